//! The front door's requests decoded by the engine beside the worker (DESIGN §3.1 "Decode side";
//! used when the config names an `engine`).
//!
//! The front door still admits each request and its router picks the prefill peer ([`super::peers`],
//! [`super::routing`]); the request then goes to the engine as a `DecodeWork`
//! ([`EngineRooms::submit`]). The engine Reserves its pages (the room opens on the chosen peer, into
//! the engine's pool), awaits and verifies the KV, generates the tokens at its own pace, reports
//! them with EmitTokens and Finishes; the front door streams exactly the engine's tokens. The same
//! rules as the built-in path apply:
//! - a prefill peer that fails the room (lost, failed, transfer error) is retried on another peer
//!   within `TANDEM_DECODE_RETRY_BUDGET`; a KV deadline is a 503 `kv_deadline_exceeded`;
//! - a spec-guard trip (ReportSteps, contract 8) aborts the room through the gate and the request is
//!   retried on another peer within `specGuard.retryBudget`, else 503 `spec_guard_anomaly` (a stream
//!   ends with that error event and no `[DONE]`);
//! - an engine that detaches or dies ends every waiting request at once with a 503 `not_ready` and
//!   the reason (its rooms already failed through the gate); an engine that stops answering ends it
//!   after the KV deadline plus [`ENGINE_SLACK`] (before the first token) or
//!   [`TOKEN_IDLE`] between two reports;
//! - a client that goes away: the attempt is forgotten ([`EngineRooms::forget`]); a room still
//!   waiting for its KV fails through the gate, an engine still decoding gets `cancelled` on its next
//!   EmitTokens and Aborts.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::engine::{Admission, DecodeEngine, GuardReport, Prefilled, RequestError, Stage};
use super::front_door::{Reply, now_secs, request_error_after, spec_guard_body, token_word};
use super::node::engine_rooms::{EngineEvent, EngineRooms};
use crate::control::pb as cpb;
use crate::engine_api::pb as api;
use crate::spec_guard::{Anomaly, AnomalyReason};

/// How long past the KV deadline a request waits for the engine's first report.
pub const ENGINE_SLACK: Duration = Duration::from_secs(5);

/// Longest silence of the engine between two reports of a decoding request.
pub const TOKEN_IDLE: Duration = Duration::from_secs(15);

/// What the front door asks of the engine for one request.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The worker's request id.
    pub request_id: u64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Server-sent events.
    pub stream: bool,
    /// Prefix identity (`kv_block_hashes`).
    pub hashes: Vec<u64>,
    /// The request's own KV deadline (`kv_deadline_ms`), capped at the worker's as on the built-in
    /// path.
    pub kv_deadline: Option<Duration>,
    /// The session's KV after this turn (`session_kv_hashes`, snapshot sync); empty: no sync.
    pub session_kv_hashes: Vec<u64>,
}

/// The session hashes a DecodeWork carries: none with sync off; else at most the pages the turn's
/// KV can fill (`ceil((prompt + max_tokens) / page_tokens)`), so a client naming more cannot make
/// the engine hand over more than its turn holds.
fn session_hashes(ask: &Ask, rooms: &EngineRooms) -> Vec<u64> {
    if !rooms.syncs_sessions() {
        return Vec::new();
    }
    let tokens = u64::from(ask.prompt_tokens.max(1)) + u64::from(ask.max_tokens);
    let pages = tokens.div_ceil(u64::from(rooms.page_tokens().max(1)));
    let n = usize::try_from(pages).unwrap_or(usize::MAX);
    ask.session_kv_hashes.iter().take(n).copied().collect()
}

/// Forgets an attempt when dropped (the request ended, or its future was dropped).
struct Forget {
    rooms: Arc<EngineRooms>,
    request: u64,
    attempt: u32,
}

impl Drop for Forget {
    fn drop(&mut self) {
        self.rooms.forget(self.request, self.attempt);
    }
}

/// One attempt in flight.
struct Attempt {
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    _forget: Forget,
    peer: String,
    corrupt: u64,
    tokens_seen: bool,
    /// The prefix hits the prefill peer's OpenRoom answered (known before the KV completes).
    hits: cpb::PrefixHits,
}

/// What one wait on the engine brought.
enum Step {
    /// Token ids (possibly none) and, when the attempt ended, its end.
    Report(Vec<u32>, Option<api::decode_end::Outcome>),
    /// The request cannot go on.
    Fail(RequestError),
}

impl Attempt {
    async fn next(&mut self, kv_deadline: Duration) -> Step {
        let idle = if self.tokens_seen {
            TOKEN_IDLE
        } else {
            kv_deadline + ENGINE_SLACK
        };
        loop {
            let ev = match tokio::time::timeout(idle, self.rx.recv()).await {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    return Step::Fail(RequestError::Failed(
                        "the engine path dropped the request".into(),
                    ));
                }
                Err(_) if self.tokens_seen => {
                    return Step::Fail(RequestError::Failed(format!(
                        "the decode engine reported nothing for {idle:?}"
                    )));
                }
                Err(_) => return Step::Fail(RequestError::Timeout(idle)),
            };
            match ev {
                EngineEvent::Reserved(key) => {
                    tracing::debug!(%key, peer = %self.peer, "the engine reserved the request's pages");
                }
                EngineEvent::Opened(hits) => self.hits = hits,
                EngineEvent::EngineLost(why) => {
                    return Step::Fail(RequestError::NotReady(format!(
                        "the decode engine went away: {why}"
                    )));
                }
                EngineEvent::Report(r) => {
                    self.corrupt += r.corrupt_chunks;
                    if !r.tokens.is_empty() {
                        self.tokens_seen = true;
                    }
                    let end = r.end.and_then(|e| e.outcome);
                    if end.is_some() || !r.tokens.is_empty() {
                        return Step::Report(r.tokens, end);
                    }
                }
            }
        }
    }
}

fn anomaly_of(t: &api::SpecTrip) -> Anomaly {
    let reason = AnomalyReason::ALL
        .into_iter()
        .find(|r| r.code() == t.anomaly)
        .unwrap_or(AnomalyReason::LowAcceptLength);
    Anomaly {
        reason,
        accept_length: t.accept_length,
        accept_rate: t.accept_rate,
        tokens: t.tokens,
    }
}

/// Counts a spec-guard abort the engine's ReportSteps tripped (the worker already aborted the room).
fn count_spec_abort(engine: &DecodeEngine, request_id: u64, anomaly: &Anomaly, peer: &str) {
    tracing::warn!(
        request_id,
        reason = anomaly.reason.code(),
        accept_length = anomaly.accept_length,
        accept_rate = anomaly.accept_rate,
        tokens = anomaly.tokens,
        prefill_worker = peer,
        "spec guard: the engine's decode was aborted"
    );
    engine.state.counters.spec_guard_aborts.inc();
    engine
        .state
        .by_reason
        .spec_guard_anomaly(anomaly.reason.code());
}

/// Serves one admitted request through the engine.
pub(super) async fn completion(
    engine: Arc<DecodeEngine>,
    rooms: Arc<EngineRooms>,
    ask: Ask,
    mut admission: Admission,
) -> Response {
    let c = &engine.state.counters;
    let mut guard = GuardReport {
        enabled: engine.spec_guard_enabled(),
        ..GuardReport::default()
    };
    let mut tried: Vec<String> = Vec::new();
    let mut avoid: Vec<String> = Vec::new();
    let mut last_error: Option<String> = None;
    let mut peer_failures = 0u32;
    let mut spec_attempt = 0u32;
    let pages = u64::from(
        ask.prompt_tokens
            .max(1)
            .div_ceil(rooms.page_tokens().max(1)),
    );
    let mut peer_retry = false;
    let kv_bytes = pages * rooms.page_bytes();
    // The KV deadline of every attempt: the worker's (with its per-token part), or the request's
    // when shorter — the rule of the built-in path (`DecodeEngine::prefill`).
    let ours = engine.kv_deadline
        + engine
            .kv_deadline_per_token
            .saturating_mul(ask.prompt_tokens.max(1));
    let kv_deadline = ask.kv_deadline.map_or(ours, |d| d.min(ours));
    for attempt in 0u32.. {
        admission.enter(Stage::Prefill);
        let shunned: Vec<String> = tried.iter().chain(&avoid).cloned().collect();
        let Some(link) = engine
            .peers
            .pick(&shunned, &ask.hashes)
            .or_else(|| engine.peers.pick(&tried, &ask.hashes))
        else {
            let e = match last_error {
                Some(e) => RequestError::PrefillLost(format!("{} peer(s) tried: {e}", tried.len())),
                None => RequestError::NoPeer(engine.peers.not_ready_reason()),
            };
            admission.ended_with(&e);
            return request_error_after(&e, &guard);
        };
        if std::mem::take(&mut peer_retry) {
            c.requests_retried.inc();
        }
        let peer = link.addr().to_owned();
        tried.push(peer.clone());
        let spec = cpb::RequestSpec {
            request_id: ask.request_id,
            input_tokens: ask.prompt_tokens.max(1),
            output_tokens: ask.max_tokens,
            hash_ids: ask.hashes.clone(),
        };
        let work = api::DecodeWork {
            request_id: ask.request_id,
            attempt,
            prompt_tokens: ask.prompt_tokens.max(1),
            max_tokens: ask.max_tokens,
            kv_deadline_ms: kv_deadline.as_millis().max(1) as u64,
            prefix_hashes: ask.hashes.clone(),
            draft_tokens: engine.draft_tokens.unwrap_or(0),
            session_kv_hashes: session_hashes(&ask, &rooms),
        };
        let rx = match rooms.submit(work, link, spec) {
            Ok(rx) => rx,
            Err(why) => {
                let e = RequestError::NotReady(why);
                admission.ended_with(&e);
                return request_error_after(&e, &guard);
            }
        };
        let mut at = Attempt {
            rx,
            _forget: Forget {
                rooms: rooms.clone(),
                request: ask.request_id,
                attempt,
            },
            peer: peer.clone(),
            corrupt: 0,
            tokens_seen: false,
            hits: cpb::PrefixHits::default(),
        };
        // Until the first tokens: the KV (reserve, transfer, verification).
        let (first, end) = match at.next(kv_deadline).await {
            Step::Report(tokens, end) => (tokens, end),
            Step::Fail(e) => {
                admission.ended_with(&e);
                return request_error_after(&e, &guard);
            }
        };
        let prefilled = Prefilled {
            hits: at.hits,
            kv_bytes,
            corrupt_chunks: at.corrupt,
            peer: peer.clone(),
            retries: peer_failures,
        };
        match end {
            Some(api::decode_end::Outcome::KvFailed(f)) => {
                c.rooms_aborted.inc();
                let reason = api::FailureReason::try_from(f.reason)
                    .unwrap_or(api::FailureReason::Unspecified);
                tracing::warn!(request_id = ask.request_id, %peer, ?reason, message = %f.message, "the engine's room failed");
                match reason {
                    api::FailureReason::KvTimeout => {
                        let e = RequestError::Timeout(kv_deadline);
                        admission.ended_with(&e);
                        return request_error_after(&e, &guard);
                    }
                    api::FailureReason::PeerLost
                    | api::FailureReason::PrefillFailed
                    | api::FailureReason::TransferFailed => {
                        engine.peers.forget_if_dead(&peer);
                        last_error = Some(format!("prefill peer {peer} failed: {reason:?}"));
                        if peer_failures >= engine.retry_budget {
                            let e = RequestError::PrefillLost(format!(
                                "{} peer(s) tried: {}",
                                tried.len(),
                                last_error.unwrap_or_default()
                            ));
                            admission.ended_with(&e);
                            return request_error_after(&e, &guard);
                        }
                        peer_failures += 1;
                        peer_retry = true;
                        tracing::info!(
                            request_id = ask.request_id,
                            attempt,
                            "retrying on another prefill peer"
                        );
                        continue;
                    }
                    _ => {
                        let e = RequestError::NotReady(format!(
                            "the decode engine's room failed: {reason:?}: {}",
                            f.message
                        ));
                        admission.ended_with(&e);
                        return request_error_after(&e, &guard);
                    }
                }
            }
            Some(api::decode_end::Outcome::EngineError(msg)) => {
                let e = RequestError::Failed(format!("the decode engine: {msg}"));
                admission.ended_with(&e);
                return request_error_after(&e, &guard);
            }
            _ => {}
        }
        // The KV is in and verified.
        c.kv_bytes_received.inc_by(kv_bytes);
        c.corrupt_pages_read.inc_by(at.corrupt);
        let first_corrupt = at.corrupt;
        engine.peers.routed(&peer, &ask.hashes);
        let reply = Reply {
            id: format!("cmpl-{}-{}", engine.worker_id, ask.request_id),
            created: now_secs(),
            model: engine.model.clone(),
            revision: engine.revision.clone(),
            prompt_tokens: ask.prompt_tokens,
            completion_tokens: ask.max_tokens,
            prefilled,
            guard: guard.clone(),
        };
        if ask.stream {
            admission.enter(Stage::Stream);
            return stream(engine, reply, at, first, end, admission).into_response();
        }
        admission.enter(Stage::Decode);
        let mut text: String = first.iter().map(|t| token_word(*t)).collect();
        let mut end = end;
        while end.is_none() {
            match at.next(kv_deadline).await {
                Step::Report(tokens, e) => {
                    text.extend(tokens.iter().map(|t| token_word(*t)));
                    end = e;
                }
                Step::Fail(e) => {
                    admission.ended_with(&e);
                    return request_error_after(&e, &guard);
                }
            }
        }
        match end {
            Some(api::decode_end::Outcome::Done(d)) => {
                c.corrupt_pages_read.inc_by(at.corrupt - first_corrupt);
                admission.succeeded();
                let mut reply = reply;
                reply.prefilled.corrupt_chunks = at.corrupt;
                return axum::Json(reply.last_with(&text, d.accept_length, d.accept_rate))
                    .into_response();
            }
            Some(api::decode_end::Outcome::SpecGuard(t)) => {
                let anomaly = anomaly_of(&t);
                count_spec_abort(&engine, ask.request_id, &anomaly, &peer);
                guard.anomalies.push((anomaly, peer.clone()));
                avoid.push(peer);
                if spec_attempt >= engine.spec_retry_budget() {
                    admission.failed();
                    let body = spec_guard_body(&anomaly, &guard);
                    return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
                }
                spec_attempt += 1;
                guard.retries += 1;
                // A fresh attempt: the peer-failure budget starts again (the aborted peer is
                // avoided, and taken again when it is the only one).
                tried.clear();
                peer_failures = 0;
                c.spec_guard_retries.inc();
                tracing::info!(
                    request_id = ask.request_id,
                    attempt,
                    "spec guard: retrying the request"
                );
            }
            Some(other) => {
                let e =
                    RequestError::Failed(format!("the decode engine ended the request: {other:?}"));
                admission.ended_with(&e);
                return request_error_after(&e, &guard);
            }
            // The loop above ran until the attempt ended.
            None => {}
        }
    }
    let e = RequestError::Failed("no attempt left".into());
    admission.ended_with(&e);
    request_error_after(&e, &guard)
}

fn stream(
    engine: Arc<DecodeEngine>,
    reply: Reply,
    mut at: Attempt,
    first: Vec<u32>,
    end: Option<api::decode_end::Outcome>,
    admission: Admission,
) -> Sse<ReceiverStream<Result<Event, Infallible>>> {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(16);
    tokio::spawn(async move {
        let send = |v: Value| Ok(Event::default().data(v.to_string()));
        let mut ok = true;
        let mut tokens = first;
        let mut end = end;
        loop {
            for t in &tokens {
                ok &= tx
                    .send(send(reply.chunk(&token_word(*t), None)))
                    .await
                    .is_ok();
            }
            if !ok || end.is_some() {
                break;
            }
            match at.next(engine.kv_deadline).await {
                Step::Report(t, e) => {
                    tokens = t;
                    end = e;
                }
                Step::Fail(e) => {
                    let _ = tx.send(send(request_error_body(&e, &reply.guard))).await;
                    admission.failed();
                    return;
                }
            }
        }
        if !ok {
            tracing::info!(
                request_id = at._forget.request,
                "client went away mid-stream"
            );
            admission.cancelled();
            return;
        }
        match end {
            Some(api::decode_end::Outcome::Done(d)) => {
                engine
                    .state
                    .counters
                    .corrupt_pages_read
                    .inc_by(at.corrupt - reply.prefilled.corrupt_chunks);
                let mut reply = reply;
                reply.prefilled.corrupt_chunks = at.corrupt;
                ok = tx
                    .send(send(reply.last_with("", d.accept_length, d.accept_rate)))
                    .await
                    .is_ok()
                    && tx.send(Ok(Event::default().data("[DONE]"))).await.is_ok();
                if ok {
                    admission.succeeded();
                } else {
                    admission.cancelled();
                }
            }
            Some(api::decode_end::Outcome::SpecGuard(t)) => {
                let anomaly = anomaly_of(&t);
                count_spec_abort(&engine, at._forget.request, &anomaly, &at.peer);
                let mut guard = reply.guard.clone();
                guard.anomalies.push((anomaly, at.peer.clone()));
                let _ = tx.send(send(spec_guard_body(&anomaly, &guard))).await;
                admission.failed();
            }
            other => {
                let e =
                    RequestError::Failed(format!("the decode engine ended the stream: {other:?}"));
                let _ = tx.send(send(request_error_body(&e, &reply.guard))).await;
                admission.failed();
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
}

fn request_error_body(e: &RequestError, guard: &GuardReport) -> Value {
    let mut body =
        super::front_door::error_body("service_unavailable", "engine_failed", None, e.to_string());
    if !guard.anomalies.is_empty() {
        body["tandem"] = serde_json::json!({"spec_guard": guard.json()});
    }
    body
}
