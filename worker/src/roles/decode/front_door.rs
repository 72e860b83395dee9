//! The OpenAI-compatible front door of a decode worker (worker/interfaces/README.md §3).
//!
//! - `POST /v1/completions`: body `model`, `prompt` (string, array of strings, or array of token
//!   ids), `max_tokens` (default 16), `stream`, and the Tandem extensions `kv_block_hashes` (prefix
//!   identity, one hash per 512-token block), `input_tokens` (prompt length to simulate) and
//!   `kv_deadline_ms` (this request's KV deadline, capped at the worker's).
//!   Unknown OpenAI fields (`temperature`, …) are accepted and ignored; `model` is echoed as the
//!   served model. Streaming: one `data:` event per generated token (the first marks TTFT; it is
//!   sent as soon as the KV is in), a last event with `finish_reason: "length"`, `usage` and the
//!   `tandem` block, then `data: [DONE]`. Not streaming: one JSON object with the same fields.
//! - `GET /v1/models`: the served model.
//! - Errors: every error of the front door — the routes', the body's, unknown routes and methods —
//!   is OpenAI's error object `{"error":{"message","type","param","code"}}` (`param` names the
//!   offending field or is null): 400 `malformed` (bad JSON or field), 400
//!   `context_length_exceeded` (`param: "prompt"`: the prompt needs more KV pages than this
//!   decode's pool has in total — it can never fit, do not retry), 413 `request_too_large` (body
//!   over [`MAX_BODY_BYTES`]), 415 `unsupported_media_type` (a `Content-Type` other than
//!   `application/json`; none is accepted as JSON), 404 `not_found`, 405 `method_not_allowed`,
//!   429 `at_capacity` (full now: retry later), 503 (not ready, draining, no prefill peer of this
//!   revision, KV deadline passed), 504 `request_deadline_exceeded` (the request's deadline from
//!   admission to last token passed: a prefill that went silent, a stalled decode; a stream ends
//!   with that error as its last event and no `[DONE]`), 500 (internal).
//! - Cancellation: a client that goes away — mid-stream, or before the response while its KV is
//!   prefilled or its tokens generated (the handler future is dropped) — is counted in
//!   `requests_cancelled` by stage; its KV pages go to the release gate (see [`super::engine`]).
//! - Spec guard (DESIGN contract 8, see [`super::engine`]): the last event / object carries
//!   `tandem.spec_guard` `{"enabled","aborts","retries","anomalies":[…]}` and
//!   `tandem.spec_accept_rate`. When every attempt within `specGuard.retryBudget` was judged
//!   anomalous: 503 with code `spec_guard_anomaly`, `error.reason` (`low_accept_length` or
//!   `high_accept_rate`) and `tandem.spec_guard`; a stream instead ends with that error as its last
//!   event and no `[DONE]` (the tokens it sent cannot be taken back).
//!
//! Generated text is a deterministic placeholder word per token.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::engine::{
    Admission, DecodeEngine, Decoding, GuardReport, Prefilled, RequestError, Stage,
};
use super::node::KvLease;
use crate::release::receiver::FailureCause;
use crate::spec_guard::Anomaly;

const WORDS: [&str; 16] = [
    "the", "cache", "page", "layer", "room", "token", "prefix", "decode", "prefill", "tier",
    "host", "store", "ack", "fence", "stream", "rank",
];

/// Largest `max_tokens` accepted.
pub const MAX_TOKENS_LIMIT: u32 = 1 << 16;

/// Largest request body accepted, bytes (16 MiB: a prompt of a million token ids fits); a larger
/// one gets 413 `request_too_large`.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// A prompt: text, a batch of texts (only the first is served), or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Texts (OpenAI batch form).
    Texts(Vec<String>),
}

/// The completion request body.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model name (echoed; one model per pool).
    #[serde(default)]
    pub model: Option<String>,
    /// Prompt.
    #[serde(default)]
    pub prompt: Option<Prompt>,
    /// Tokens to generate (default 16).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Server-sent events when true.
    #[serde(default)]
    pub stream: bool,
    /// Prefix identity: one chained hash per 512-token block.
    #[serde(default)]
    pub kv_block_hashes: Vec<u64>,
    /// Prompt length to simulate when the prompt is a placeholder.
    #[serde(default)]
    pub input_tokens: Option<u32>,
    /// This request's KV deadline in milliseconds (Tandem extension; ≥ 1), capped at the worker's
    /// own (`TANDEM_DECODE_KV_DEADLINE_*`): past it the room is aborted through the release gate
    /// (seed 004) and the request fails with 503 `kv_deadline_exceeded`. The demo sets it on a
    /// known fraction of first attempts to induce aborts while KV writes are in flight.
    #[serde(default)]
    pub kv_deadline_ms: Option<u64>,
    /// The session's KV after this turn (Tandem extension; DESIGN contract 4, issue 15): one
    /// chained hash per 512-token page of the prompt *and* the generated tokens. When present
    /// and snapshot sync is on, the decode pushes those pages to the prefill that will serve the
    /// session's next turn once this turn finished ([`super::snapshot_push`]).
    #[serde(default)]
    pub session_kv_hashes: Vec<u64>,
}

impl CompletionRequest {
    /// Prompt tokens: `input_tokens`, else the token ids, else whitespace-separated words (≥ 1).
    pub fn prompt_tokens(&self) -> u32 {
        if let Some(n) = self.input_tokens {
            return n.max(1);
        }
        let n = match &self.prompt {
            Some(Prompt::Tokens(t)) => t.len(),
            Some(Prompt::Text(s)) => s.split_whitespace().count(),
            Some(Prompt::Texts(v)) => v.first().map_or(0, |s| s.split_whitespace().count()),
            None => 0,
        };
        u32::try_from(n).unwrap_or(u32::MAX).max(1)
    }
}

/// OpenAI's error object: `{"error":{"message","type","param","code"}}`.
pub fn error_body(
    kind: &str,
    code: &str,
    param: Option<&str>,
    message: impl Into<String>,
) -> Value {
    json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}})
}

fn error(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    error_with(status, kind, code, None, message)
}

fn error_with(
    status: StatusCode,
    kind: &str,
    code: &str,
    param: Option<&str>,
    message: impl Into<String>,
) -> Response {
    (status, axum::Json(error_body(kind, code, param, message))).into_response()
}

fn invalid(code: &str, param: Option<&str>, message: impl Into<String>) -> Response {
    error_with(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        code,
        param,
        message,
    )
}

/// The 503 of a request whose every attempt the spec guard judged anomalous (`last` is the last).
pub(super) fn spec_guard_body(last: &Anomaly, guard: &GuardReport) -> Value {
    json!({
        "error": {
            "message": format!("{last}; {} attempt(s) aborted", guard.anomalies.len()),
            "type": "service_unavailable",
            "param": null,
            "code": "spec_guard_anomaly",
            "reason": last.reason.code(),
        },
        "tandem": {"spec_guard": guard.json()},
    })
}

/// An error response; after a spec-guard abort it carries `tandem.spec_guard` too.
pub(super) fn request_error_after(e: &RequestError, guard: &GuardReport) -> Response {
    let (status, kind, code, param) = error_parts(e);
    let mut body = error_body(kind, code, param, e.to_string());
    if !guard.anomalies.is_empty() {
        body["tandem"] = json!({"spec_guard": guard.json()});
    }
    (status, axum::Json(body)).into_response()
}

/// Status, error type, code and param of a [`RequestError`].
fn error_parts(e: &RequestError) -> (StatusCode, &'static str, &'static str, Option<&'static str>) {
    let unavailable = |code| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            code,
            None,
        )
    };
    match e {
        RequestError::NotReady(_) => unavailable("not_ready"),
        RequestError::NoPeer(_) => unavailable("no_prefill_peer"),
        RequestError::Timeout(_) => unavailable("kv_deadline_exceeded"),
        RequestError::PrefillLost(_) => unavailable("prefill_unavailable"),
        RequestError::AtCapacity(_) => (
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            "at_capacity",
            None,
        ),
        RequestError::ContextLength { .. } => (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "context_length_exceeded",
            Some("prompt"),
        ),
        RequestError::DeadlineExceeded { .. } => (
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            "request_deadline_exceeded",
            None,
        ),
        RequestError::Failed(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal",
            None,
        ),
    }
}

fn request_error(e: &RequestError) -> Response {
    let (status, kind, code, param) = error_parts(e);
    error_with(status, kind, code, param, e.to_string())
}

/// The JSON error of a body that could not be read (413 over [`MAX_BODY_BYTES`], 400 otherwise).
fn body_error(rejection: &BytesRejection) -> Response {
    let status = rejection.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return error(
            status,
            "invalid_request_error",
            "request_too_large",
            format!("request body exceeds {MAX_BODY_BYTES} bytes"),
        );
    }
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "internal_error"
    };
    error(
        status,
        kind,
        "malformed",
        format!("reading the request body: {}", rejection.body_text()),
    )
}

/// Whether the request's `Content-Type` (if any) is JSON: `application/json`, parameters allowed.
fn json_content_type(headers: &HeaderMap) -> Result<(), String> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let text = value.to_str().unwrap_or_default();
    let essence = text.split(';').next().unwrap_or_default().trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(format!(
            "Content-Type {text:?} is not supported: send the body as application/json"
        ))
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One token's text: a placeholder word, deterministic in (request, position).
pub fn token_text(request_id: u64, position: u32) -> String {
    let i = (request_id.wrapping_add(u64::from(position)) % WORDS.len() as u64) as usize;
    format!(" {}", WORDS[i])
}

/// The text of token id `id`: a placeholder word (the engine path's detokenizer; an engine that
/// emits `request_id + position` gets [`token_text`]'s words).
pub fn token_word(id: u32) -> String {
    format!(" {}", WORDS[id as usize % WORDS.len()])
}

pub(super) struct Reply {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) revision: String,
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
    pub(super) prefilled: Prefilled,
    pub(super) guard: GuardReport,
}

impl Reply {
    fn tandem(&self, decoding: &Decoding) -> Value {
        self.tandem_with(decoding.accept_length(), decoding.accept_rate())
    }

    /// The `tandem` block with the decode's accept length and rate.
    pub(super) fn tandem_with(&self, accept_length: f64, accept_rate: f64) -> Value {
        let h = &self.prefilled.hits;
        json!({
            "prefix_hit_tokens": {"l1": h.l1, "l2": h.l2, "l3": h.l3},
            "kv_bytes": self.prefilled.kv_bytes,
            "prefill_worker": self.prefilled.peer,
            // Prefills beyond the first (a failed peer, a spec-guard abort): a retry can hit pages
            // its own failed attempt stored, so hit-ratio reports keep these requests apart.
            "prefill_retries": self.prefilled.retries + self.guard.retries,
            "revision": self.revision,
            "corrupt_chunks": self.prefilled.corrupt_chunks,
            "spec_accept_length": accept_length,
            "spec_accept_rate": accept_rate,
            "spec_guard": self.guard.json(),
        })
    }

    /// OpenAI's `usage`, with `prompt_tokens_details.cached_tokens`: the prompt tokens the prefill
    /// did not compute (its prefix hits in L1, L2 and L3, as `tandem.prefix_hit_tokens` splits
    /// them).
    fn usage(&self) -> Value {
        let h = &self.prefilled.hits;
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": u64::from(self.prompt_tokens) + u64::from(self.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": h.l1 + h.l2 + h.l3},
        })
    }

    pub(super) fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        })
    }

    fn last(&self, text: &str, decoding: &Decoding) -> Value {
        let mut v = self.chunk(text, Some("length"));
        v["usage"] = self.usage();
        v["tandem"] = self.tandem(decoding);
        v
    }

    /// The last event / object with the decode's accept length and rate.
    pub(super) fn last_with(&self, text: &str, accept_length: f64, accept_rate: f64) -> Value {
        let mut v = self.chunk(text, Some("length"));
        v["usage"] = self.usage();
        v["tandem"] = self.tandem_with(accept_length, accept_rate);
        v
    }
}

/// Generates one attempt's text (not streamed): the first token, then the steps, one TPOT each.
///
/// # Errors
/// The spec guard's anomaly; nothing of the attempt reaches the client.
async fn generate(
    engine: &DecodeEngine,
    request_id: u64,
    max_tokens: u32,
    decoding: &mut Decoding,
) -> Result<String, Anomaly> {
    let mut text = String::new();
    let mut position = 0;
    if max_tokens > 0 {
        text.push_str(&token_text(request_id, 0));
        position = 1;
    }
    while let Some(tokens) = decoding.next_step()? {
        tokio::time::sleep(engine.knobs.tpot).await;
        for _ in 0..tokens {
            text.push_str(&token_text(request_id, position));
            position += 1;
        }
    }
    Ok(text)
}

async fn completions(
    State(engine): State<Arc<DecodeEngine>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    // An SGLang or vLLM engine whose pool serves the tier calls takes no rooms: it serves whole
    // requests on its own API (the DecodePool Service's `http` port targets it), so a request
    // sent here could only time out.
    if let Some(own) = engine.own_api_engine.filter(|o| !o.hands_off) {
        return error(
            StatusCode::MISDIRECTED_REQUEST,
            "invalid_request_error",
            "engine_serves_its_own_api",
            format!(
                "this decode's {} engine serves requests on its own OpenAI-compatible API \
                 (container port engine-http, which the DecodePool Service's http port targets); \
                 the front door hands requests only to an engine running Tandem's PD backend, \
                 whose pool does not serve the KV tier calls (a DecodePool without a CacheTier)",
                own.kind
            ),
        );
    }
    if let Err(message) = json_content_type(&headers) {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            message,
        );
    }
    let body = match body {
        Ok(b) => b,
        Err(rejection) => return body_error(&rejection),
    };
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return invalid(
                "malformed",
                None,
                format!("malformed completion request: {e}"),
            );
        }
    };
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens > MAX_TOKENS_LIMIT {
        return invalid(
            "malformed",
            Some("max_tokens"),
            format!("max_tokens {max_tokens} exceeds {MAX_TOKENS_LIMIT}"),
        );
    }
    if req.kv_deadline_ms == Some(0) {
        return invalid(
            "malformed",
            Some("kv_deadline_ms"),
            "kv_deadline_ms must be at least 1",
        );
    }
    let prompt_tokens = req.prompt_tokens();
    // A prompt the whole pool cannot hold is the client's error for good (400), not "full now".
    if let Err(e) = engine.check_context(prompt_tokens) {
        return request_error(&e);
    }
    // From here every ending is counted once by the admission; a dropped future counts as
    // cancelled, and the room guard or lease it holds hands the KV pages to the release gate.
    let mut admission = match engine.admit() {
        Ok(a) => a,
        Err(e) => return request_error(&e),
    };
    let request_id = engine.next_request_id();
    // An engine that serves its own API gets the request over HTTP (`super::own_api`).
    if let (Some(own), Some(rooms)) = (engine.own_api_engine, engine.engine_rooms.clone()) {
        let ours = engine.kv_deadline
            + engine
                .kv_deadline_per_token
                .saturating_mul(prompt_tokens.max(1));
        let kv_deadline = req
            .kv_deadline_ms
            .map_or(ours, |d| Duration::from_millis(d).min(ours));
        let body: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                admission.refused();
                return invalid(
                    "malformed",
                    None,
                    format!("malformed completion request: {e}"),
                );
            }
        };
        if let Err((param, message)) = super::own_api::one_sequence(&body) {
            admission.refused();
            return invalid("unsupported", Some(param), message);
        }
        let hand = super::own_api::HandOff {
            request_id: super::own_api::hand_off_id(super::own_api::hand_off_base(), request_id),
            body,
            path: "/v1/completions",
            prompt_tokens,
            max_tokens,
            hashes: req.kv_block_hashes.clone(),
            kv_deadline_ms: kv_deadline.as_millis().max(1) as u64,
            token: super::own_api::hand_off_token(request_id),
            style: own.style,
        };
        return super::own_api::completion(engine, rooms, own, hand, admission).await;
    }
    // With an engine beside the worker, the engine decodes (DESIGN §3.1): `super::via_engine`.
    if let Some(rooms) = engine.engine_rooms.clone() {
        let ask = super::via_engine::Ask {
            request_id,
            prompt_tokens,
            max_tokens,
            stream: req.stream,
            hashes: req.kv_block_hashes.clone(),
            kv_deadline: req.kv_deadline_ms.map(Duration::from_millis),
            session_kv_hashes: req.session_kv_hashes.clone(),
        };
        return super::via_engine::completion(engine, rooms, ask, admission).await;
    }
    let mut guard = GuardReport {
        enabled: engine.spec_guard_enabled(),
        ..GuardReport::default()
    };
    // Prefill peers whose KV an aborted attempt decoded: the retry prefers another.
    let mut avoid: Vec<String> = Vec::new();
    let mut attempt = 0u32;
    loop {
        admission.enter(Stage::Prefill);
        let prefill = engine.prefill(
            request_id,
            prompt_tokens,
            max_tokens,
            req.kv_block_hashes.clone(),
            req.kv_deadline_ms.map(Duration::from_millis),
            &avoid,
        );
        // Past the request's deadline the prefill future is dropped: its room guard hands the
        // pages to the release gate.
        let (prefilled, lease) = match tokio::time::timeout_at(admission.deadline(), prefill).await
        {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                admission.ended_with(&e);
                return request_error_after(&e, &guard);
            }
            Err(_) => {
                let e = admission.deadline_exceeded();
                return request_error_after(&e, &guard);
            }
        };
        let mut decoding = engine.decoding(request_id, attempt, max_tokens.saturating_sub(1));
        let peer = prefilled.peer.clone();
        let reply = Reply {
            id: format!("cmpl-{}-{request_id}", engine.worker_id),
            created: now_secs(),
            model: engine.model.clone(),
            revision: engine.revision.clone(),
            prompt_tokens,
            completion_tokens: max_tokens,
            prefilled,
            guard: guard.clone(),
        };
        if req.stream {
            admission.enter(Stage::Stream);
            let session = req.session_kv_hashes.clone();
            return stream(
                engine, reply, decoding, request_id, admission, lease, session,
            )
            .into_response();
        }
        admission.enter(Stage::Decode);
        let generated = tokio::time::timeout_at(
            admission.deadline(),
            generate(&engine, request_id, max_tokens, &mut decoding),
        )
        .await;
        let Ok(generated) = generated else {
            lease.abort(FailureCause::Timeout);
            let e = admission.deadline_exceeded();
            return request_error_after(&e, &guard);
        };
        match generated {
            Ok(text) => {
                lease.finish();
                engine.sync_session(&req.session_kv_hashes);
                admission.succeeded();
                return axum::Json(reply.last(&text, &decoding)).into_response();
            }
            Err(anomaly) => {
                engine.spec_abort(request_id, lease, &anomaly, &peer);
                guard.anomalies.push((anomaly, peer.clone()));
                avoid.push(peer);
                if attempt >= engine.spec_retry_budget() {
                    admission.failed();
                    let body = spec_guard_body(&anomaly, &guard);
                    return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
                }
                attempt += 1;
                guard.retries += 1;
                engine.state.counters.spec_guard_retries.inc();
                tracing::info!(request_id, attempt, "spec guard: retrying the request");
            }
        }
    }
}

fn stream(
    engine: Arc<DecodeEngine>,
    reply: Reply,
    mut decoding: Decoding,
    request_id: u64,
    admission: Admission,
    lease: KvLease,
    session_kv_hashes: Vec<u64>,
) -> Sse<ReceiverStream<Result<Event, Infallible>>> {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(16);
    tokio::spawn(async move {
        let send = |v: Value| Ok(Event::default().data(v.to_string()));
        let deadline = admission.deadline();
        // A client that stops reading stalls the sends: they end at the request's deadline too.
        let mut late = false;
        let mut ok = true;
        let mut position = 0u32;
        if reply.completion_tokens > 0 {
            match tokio::time::timeout_at(
                deadline,
                tx.send(send(reply.chunk(&token_text(request_id, 0), None))),
            )
            .await
            {
                Ok(sent) => ok &= sent.is_ok(),
                Err(_) => late = true,
            }
            position = 1;
        }
        while ok && !late {
            if tokio::time::Instant::now() >= deadline {
                late = true;
                break;
            }
            let tokens = match decoding.next_step() {
                Ok(Some(t)) => t,
                Ok(None) => break,
                Err(anomaly) => {
                    let peer = reply.prefilled.peer.clone();
                    engine.spec_abort(request_id, lease, &anomaly, &peer);
                    let mut guard = reply.guard.clone();
                    guard.anomalies.push((anomaly, peer));
                    let _ = tx.send(send(spec_guard_body(&anomaly, &guard))).await;
                    admission.failed();
                    return;
                }
            };
            tokio::time::sleep(engine.knobs.tpot).await;
            for _ in 0..tokens {
                let chunk = send(reply.chunk(&token_text(request_id, position), None));
                match tokio::time::timeout_at(deadline, tx.send(chunk)).await {
                    Ok(sent) => ok &= sent.is_ok(),
                    Err(_) => late = true,
                }
                position += 1;
            }
        }
        if late && ok {
            // The deadline passed mid-stream: the pages go through the gate, and the stream ends
            // with the error as its last event (if the client still reads) and no `[DONE]`.
            lease.abort(FailureCause::Timeout);
            let e = admission.deadline_exceeded();
            let (_, kind, code, param) = error_parts(&e);
            let _ = tx.try_send(send(error_body(kind, code, param, e.to_string())));
            return;
        }
        // The last token is generated (or the client left): the KV may go.
        lease.finish();
        if ok {
            engine.sync_session(&session_kv_hashes);
        }
        ok = ok
            && tx.send(send(reply.last("", &decoding))).await.is_ok()
            && tx.send(Ok(Event::default().data("[DONE]"))).await.is_ok();
        if ok {
            admission.succeeded();
        } else {
            tracing::info!(request_id, "client went away mid-stream");
            admission.cancelled();
        }
    });
    Sse::new(ReceiverStream::new(rx))
}

async fn models(State(engine): State<Arc<DecodeEngine>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": engine.model, "object": "model", "created": 0, "owned_by": "tandem"}],
    }))
    .into_response()
}

async fn not_found(uri: Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!("no route {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// The front-door routes over `engine`; unknown routes and methods answer the JSON error too,
/// and bodies over [`MAX_BODY_BYTES`] are refused with 413.
pub fn router(engine: Arc<DecodeEngine>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(engine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_tokens_prefer_the_extension() {
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt":"a b c","input_tokens":900}"#).unwrap();
        assert_eq!(r.prompt_tokens(), 900);
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt":[1,2,3,4]}"#).unwrap();
        assert_eq!(r.prompt_tokens(), 4);
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt":"a b c","temperature":0.5}"#).unwrap();
        assert_eq!(r.prompt_tokens(), 3);
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"max_tokens":"x"}"#).is_err());
    }

    #[test]
    fn spec_guard_errors_name_the_code_the_reason_and_the_attempts() {
        use crate::spec_guard::AnomalyReason;
        let a = Anomaly {
            reason: AnomalyReason::LowAcceptLength,
            accept_length: 1.05,
            accept_rate: 0.01,
            tokens: 128,
        };
        let guard = GuardReport {
            enabled: true,
            anomalies: vec![(a, "10.0.0.2:7000".into()), (a, "10.0.0.3:7000".into())],
            retries: 1,
        };
        let b = spec_guard_body(&a, &guard);
        assert_eq!(b["error"]["code"], "spec_guard_anomaly");
        assert_eq!(b["error"]["type"], "service_unavailable");
        assert_eq!(b["error"]["reason"], "low_accept_length");
        let sg = &b["tandem"]["spec_guard"];
        assert_eq!(
            (sg["aborts"].as_u64(), sg["retries"].as_u64()),
            (Some(2), Some(1))
        );
        assert_eq!(sg["anomalies"][1]["prefill_worker"], "10.0.0.3:7000");
        assert_eq!(sg["anomalies"][0]["tokens"], 128);
        // A retry that then finds no peer keeps its own code and status, plus the guard's record.
        let r = request_error_after(&RequestError::NoPeer("none".into()), &guard);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
