//! The front door in front of an engine that serves its own OpenAI-compatible API (SGLang, vLLM;
//! issue 14, README "Engines on Kubernetes").
//!
//! The front door stays the stack's router: it admits the request (the decode's admission and
//! request deadline), its router picks the prefill peer ([`super::peers`]), and
//! [`EngineRooms::hand_over`] records the request as handed to the engine — so the engine's
//! `Reserve` under that id opens the room on that peer, into the engine's pool, and the release
//! gate owns its pages as on the Simulated path. The request itself goes to two engines with
//! `kv_transfer_params.tandem` naming the worker's request id (Tandem's vLLM connector,
//! `tandem_kv.vllm_pd`, works under it): to the chosen prefill's engine (`<peer ip>:<engine
//! port>`, one token, `do_remote_decode`: it computes the prompt and writes the KV into the
//! room), and to this pod's engine on the loopback (`do_remote_prefill`), whose response is
//! streamed back as the engine wrote it.
//!
//! - The engine's response is bounded by the request deadline (`TANDEM_DECODE_REQUEST_DEADLINE_MS`):
//!   headers and body alike; past it the client gets what arrived and the stream ends.
//! - A client that goes away drops the hand-off: a room still waiting for its KV fails through
//!   the gate (`ClientAbort`), and the engine sees its connection close (vLLM then aborts the
//!   request; its connector holds the request's blocks until the room's `SafeToReuse`).
//! - One attempt: a room that fails (peer lost, KV deadline, the prefill's engine refused the
//!   hand-off) is the engine's to handle (vLLM recomputes the blocks whose load failed,
//!   `get_block_ids_with_load_errors`). A refused hand-off fails the room at once
//!   ([`EngineRooms::prefill_refused`]), not at the KV deadline.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use super::engine::{Admission, DecodeEngine, GuardReport, RequestError, Stage};
use super::front_door::request_error_after;
use super::node::engine_rooms::{EngineEvent, EngineRooms};
use crate::control::pb as cpb;

/// How a hand-off names the request, its room and its token to the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandOffStyle {
    /// vLLM's `kv_transfer_params` (`tandem` and `do_remote_prefill` / `do_remote_decode`), read
    /// by `tandem_kv.vllm_pd.TandemConnector`.
    Vllm,
    /// SGLang's PD routing fields (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`), read by
    /// the `tandem` transfer backend (`tandem_kv.sglang_pd`): the room is the request id, the host
    /// carries the token and the KV deadline ([`sglang_bootstrap_host`]).
    SgLang,
}

/// SGLang's default `--disaggregation-bootstrap-port`: the port the hand-off names (the `tandem`
/// backend runs no bootstrap server; SGLang only needs a port to build the address).
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// The `bootstrap_host` of an SGLang hand-off: `tandem-<token, 16 hex digits>-<KV deadline ms>`, a
/// valid host name that SGLang hands, as it is, to the transfer backend's sender and receiver
/// (`tandem_kv.sglang_pd.parse_bootstrap_host` reads it back).
pub fn sglang_bootstrap_host(token: u64, kv_deadline_ms: u64) -> String {
    format!("tandem-{token:016x}-{kv_deadline_ms}")
}

/// The engine beside a decode worker that serves its own API.
#[derive(Debug, Clone, Copy)]
pub struct OwnApiEngine {
    /// `SGLang` or `vLLM` (the config's `engine.kind`).
    pub kind: &'static str,
    /// How the hand-off names the request to this kind of engine.
    pub style: HandOffStyle,
    /// The engine's HTTP API on the pod's loopback (`127.0.0.1:<engine.httpPort>`).
    pub addr: SocketAddr,
    /// Whether the front door hands requests to the engine: for vLLM and SGLang (whose adapters,
    /// `tandem_kv.vllm_pd` and `tandem_kv.sglang_pd`, Reserve under the hand-off) on a decode that
    /// does not serve the tier calls from the engine's pool (`super::serves_tiers`: the tier calls use any page of that
    /// pool, so no room may be reserved in it). Otherwise the front door answers 421
    /// `engine_serves_its_own_api` and the DecodePool Service targets the engine directly.
    pub hands_off: bool,
}

/// What the front door hands to the engine for one admitted request.
pub struct HandOff {
    /// The worker's request id (the engine Reserves under it).
    pub request_id: u64,
    /// The client's request body (a JSON object).
    pub body: Value,
    /// The request path (`/v1/completions`).
    pub path: &'static str,
    /// Prompt tokens as the front door counts them (the room's size comes from the engine's
    /// Reserve, which counts with the model's tokenizer).
    pub prompt_tokens: u32,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Prefix identity (`kv_block_hashes`), for routing.
    pub hashes: Vec<u64>,
    /// The KV deadline the engine should Reserve with.
    pub kv_deadline_ms: u64,
    /// The hand-off token (random, non-zero) the engine's Reserve must carry.
    pub token: u64,
    /// How the bodies name the request to the engines.
    pub style: HandOffStyle,
}

/// The id a request is handed over under: the front door's `request_id` in the low 32 bits and
/// this process's random `base` (high 32 bits, [`hand_off_base`]) above, so that the decode pods
/// of a pool, which number their requests from 1 each, never hand the same id to a shared
/// prefill (its connector matches rooms to requests by id).
pub fn hand_off_id(base: u64, request_id: u64) -> u64 {
    base | (request_id & 0xFFFF_FFFF)
}

/// This process's random high bits of [`hand_off_id`] (bits 32..63, never 0; bit 63 clear, so
/// that an id fits SGLang's signed 64-bit `bootstrap_room`).
pub fn hand_off_base() -> u64 {
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| (hand_off_token(0) & 0x7FFF_FFFF_0000_0000).max(1 << 32))
}

/// A hand-off token for `request_id`: SipHash under the process's random keys (std's
/// `RandomState`), non-zero; unpredictable to a client that never saw it.
pub fn hand_off_token(request_id: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(request_id);
    h.finish().max(1)
}

/// The body the engine gets: the client's, with the routing fields replaced by the front door's.
/// vLLM: `kv_transfer_params` = `tandem` (the request id, hand-off token, attempt, KV deadline and
/// prefix hashes) and `do_remote_prefill: true`, vLLM's spelling of "the KV comes from a prefill".
/// SGLang: `bootstrap_room` = the request id, `bootstrap_host` = [`sglang_bootstrap_host`],
/// `bootstrap_port` = [`SGLANG_BOOTSTRAP_PORT`]. A client's own routing fields never reach the
/// engine: they could steer its connector (e.g. `do_remote_decode` on a decode would hold the
/// request's blocks for a send that never comes; a `bootstrap_room` would name another room).
///
/// # Errors
/// The body is not a JSON object.
pub fn engine_body(h: &HandOff) -> Result<Value, String> {
    let mut body = h.body.clone();
    let obj = body
        .as_object_mut()
        .ok_or("the request body is not a JSON object")?;
    for k in [
        "kv_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "disagg_prefill_dp_rank",
    ] {
        obj.remove(k);
    }
    if h.style == HandOffStyle::SgLang {
        obj.insert("bootstrap_room".into(), json!(h.request_id));
        obj.insert(
            "bootstrap_host".into(),
            json!(sglang_bootstrap_host(h.token, h.kv_deadline_ms)),
        );
        obj.insert("bootstrap_port".into(), json!(SGLANG_BOOTSTRAP_PORT));
        return Ok(body);
    }
    obj.insert(
        "kv_transfer_params".into(),
        json!({
            "tandem": {
                "request_id": h.request_id,
                "token": h.token,
                "attempt": 0,
                "kv_deadline_ms": h.kv_deadline_ms,
                "prefix_hashes": h.hashes,
            },
            "do_remote_prefill": true,
        }),
    );
    Ok(body)
}

/// The body the chosen prefill's engine gets: the client's, generating one token and not
/// streamed, with the routing fields as for the decode; for vLLM `do_remote_decode: true` instead
/// of `do_remote_prefill` (its KV goes to a decode: vLLM's producer spelling). An SGLang prefill
/// runs in `--disaggregation-mode prefill` and needs no more.
///
/// # Errors
/// As [`engine_body`].
pub fn prefill_body(h: &HandOff) -> Result<Value, String> {
    let mut body = engine_body(h)?;
    let obj = body
        .as_object_mut()
        .ok_or("the request body is not a JSON object")?;
    obj.insert("max_tokens".into(), json!(1));
    obj.insert("stream".into(), json!(false));
    for k in ["stream_options", "min_tokens"] {
        obj.remove(k);
    }
    if let Some(p) = obj
        .get_mut("kv_transfer_params")
        .and_then(Value::as_object_mut)
    {
        p.remove("do_remote_prefill");
        p.insert("do_remote_decode".into(), json!(true));
    }
    Ok(body)
}

/// The chosen prefill's engine API: the peer's pod address with the engine port of this pod's
/// engine (the operator renders one `engine-http` port for both pools).
fn prefill_engine_addr(peer: &str, port: u16) -> Option<SocketAddr> {
    let control: SocketAddr = peer.parse().ok()?;
    Some(SocketAddr::new(control.ip(), port))
}

/// Sends the request to the prefill's engine (it computes the prompt; its connector writes the KV
/// into the room this decode's engine Reserves): bounded by the request deadline; the one-token
/// answer is drained. A refusal (an error status, no connection, a broken answer) is logged and
/// fails the hand-off at once ([`EngineRooms::prefill_refused`]: the decode engine learns now,
/// not at the KV deadline — vLLM recomputes the prompt, SGLang fails the request); passing the
/// request deadline ends the request anyway.
fn send_to_prefill(
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    rooms: Arc<EngineRooms>,
    addr: SocketAddr,
    body: Value,
    request_id: u64,
    deadline: tokio::time::Instant,
) {
    tokio::spawn(async move {
        let req = match Request::post(format!("http://{addr}/v1/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(request_id, error = %e, "building the prefill hand-off failed");
                return;
            }
        };
        let sent = tokio::time::timeout_at(deadline, async {
            let reply = client.request(req).await.map_err(|e| e.to_string())?;
            let status = reply.status();
            let mut data = Body::new(reply.into_body()).into_data_stream();
            while let Some(chunk) = data.next().await {
                chunk.map_err(|e| e.to_string())?;
            }
            if status.is_success() {
                Ok(())
            } else {
                Err(format!("status {status}"))
            }
        })
        .await;
        match sent {
            Ok(Ok(())) => {
                tracing::debug!(request_id, %addr, "the prefill's engine computed the prompt")
            }
            Ok(Err(e)) => {
                tracing::warn!(request_id, %addr, error = %e, "the prefill's engine did not take the request");
                rooms.prefill_refused(request_id, 0, &format!("{addr}: {e}"));
            }
            Err(_) => {
                tracing::warn!(request_id, %addr, "the prefill's engine passed the request deadline")
            }
        }
    });
}

/// Ends the hand-off when dropped: a room still waiting for its KV fails through the gate.
struct Forget {
    rooms: Arc<EngineRooms>,
    request: u64,
}

impl Drop for Forget {
    fn drop(&mut self) {
        self.rooms.forget(self.request, 0);
    }
}

/// Serves one admitted request through the engine's own API.
pub(super) async fn completion(
    engine: Arc<DecodeEngine>,
    rooms: Arc<EngineRooms>,
    own: OwnApiEngine,
    h: HandOff,
    mut admission: Admission,
) -> Response {
    let guard = GuardReport::default();
    let fail = |admission: Admission, e: RequestError| {
        admission.ended_with(&e);
        request_error_after(&e, &guard)
    };
    admission.enter(Stage::Prefill);
    let Some(link) = engine.peers.pick(&[], &h.hashes) else {
        let e = RequestError::NoPeer(engine.peers.not_ready_reason());
        return fail(admission, e);
    };
    let peer = link.addr().to_owned();
    let spec = cpb::RequestSpec {
        request_id: h.request_id,
        input_tokens: h.prompt_tokens.max(1),
        output_tokens: h.max_tokens,
        hash_ids: h.hashes.clone(),
    };
    let (events, _side) = match rooms.hand_over(h.request_id, 0, h.token, link, spec) {
        Ok(x) => x,
        Err(why) => return fail(admission, RequestError::NotReady(why)),
    };
    let forget = Forget {
        rooms: rooms.clone(),
        request: h.request_id,
    };
    let body = match engine_body(&h) {
        Ok(b) => b,
        Err(e) => return fail(admission, RequestError::Failed(e)),
    };
    let uri = format!("http://{}{}", own.addr, h.path);
    let req = match Request::post(&uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
    {
        Ok(r) => r,
        Err(e) => return fail(admission, RequestError::Failed(e.to_string())),
    };
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let deadline = admission.deadline();
    match (
        prefill_engine_addr(&peer, own.addr.port()),
        prefill_body(&h),
    ) {
        (Some(addr), Ok(pbody)) => {
            send_to_prefill(
                client.clone(),
                rooms.clone(),
                addr,
                pbody,
                h.request_id,
                deadline,
            );
        }
        (addr, body) => {
            tracing::warn!(
                request_id = h.request_id,
                %peer,
                ?addr,
                error = ?body.err(),
                "no prefill hand-off: the decode engine learns at once"
            );
            rooms.prefill_refused(h.request_id, 0, "no prefill hand-off could be built");
        }
    }
    let reply = match tokio::time::timeout_at(deadline, client.request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let e = RequestError::NotReady(format!(
                "the {} engine's API at {} did not answer: {e}",
                own.kind, own.addr
            ));
            return fail(admission, e);
        }
        Err(_) => {
            let e = admission.deadline_exceeded();
            return request_error_after(&e, &guard);
        }
    };
    let status = reply.status();
    if status.is_success() {
        engine.peers.routed(&peer, &h.hashes);
    }
    let content_type = reply
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/json"));
    admission.enter(Stage::Stream);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let mut data = Body::new(reply.into_body()).into_data_stream();
    tokio::spawn(async move {
        let _forget = forget;
        let mut events = events;
        let mut events_open = true;
        let end = loop {
            tokio::select! {
                // The client went away (even while the engine is silent, e.g. during the KV wait).
                () = tx.closed() => break End::ClientGone,
                chunk = tokio::time::timeout_at(deadline, data.next()) => match chunk {
                    Ok(Some(Ok(bytes))) => {
                        // A client that stops reading is bounded by the deadline too.
                        match tokio::time::timeout_at(deadline, tx.send(Ok(bytes))).await {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) => break End::ClientGone,
                            Err(_) => break End::Deadline,
                        }
                    }
                    Ok(None) => break End::Done,
                    Ok(Some(Err(e))) => {
                        tracing::warn!(request_id = h.request_id, error = %e, "the engine's response broke off");
                        let _ = tx.try_send(Err(std::io::Error::other(e.to_string())));
                        break End::Broken;
                    }
                    Err(_) => break End::Deadline,
                },
                ev = events.recv(), if events_open => match ev {
                    Some(EngineEvent::Reserved(key)) => {
                        tracing::debug!(request_id = h.request_id, %key, %peer, "the engine reserved the request's pages");
                    }
                    Some(_) => {}
                    // The hand-off was replaced or the engine left: the response still decides.
                    None => events_open = false,
                },
            }
        };
        match end {
            End::ClientGone => {
                tracing::info!(request_id = h.request_id, "client went away mid-response");
                admission.cancelled();
            }
            End::Done if status.is_success() => admission.succeeded(),
            End::Done | End::Broken => admission.failed(),
            End::Deadline => {
                let e = admission.deadline_exceeded();
                tracing::warn!(request_id = h.request_id, error = %e, "the engine's response passed the request deadline");
                // An error chunk makes the server abort the body: the client sees a cut response,
                // never one that looks complete.
                let _ = tx.try_send(Err(std::io::Error::other(e.to_string())));
            }
        }
    });
    let mut resp = Body::from_stream(ReceiverStream::new(rx)).into_response();
    *resp.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, content_type);
    resp
}

/// How a proxied response ended.
enum End {
    Done,
    ClientGone,
    Broken,
    Deadline,
}

/// Refuses what would make the engine run several sequences under one hand-off (`n` or
/// `best_of` above 1, several prompts): each would Reserve under the same request id, and only
/// the first room can open. Returns the parameter and the message of the 400.
///
/// # Errors
/// `(param, message)` for the first such field.
pub fn one_sequence(body: &Value) -> Result<(), (&'static str, String)> {
    for param in ["n", "best_of"] {
        if body
            .get(param)
            .and_then(Value::as_u64)
            .is_some_and(|n| n > 1)
        {
            return Err((
                param,
                format!(
                    "{param} above 1 is not served through the front door: one request is one prefill → decode transfer"
                ),
            ));
        }
    }
    if let Some(Value::Array(items)) = body.get("prompt")
        && items.iter().any(|i| !i.is_u64())
    {
        return Err((
            "prompt",
            "one prompt per request (a string or one array of token ids): one request is one prefill → decode transfer".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hand_off(body: Value) -> HandOff {
        HandOff {
            request_id: 7,
            body,
            path: "/v1/completions",
            prompt_tokens: 3,
            max_tokens: 2,
            hashes: vec![11, 12],
            kv_deadline_ms: 5_000,
            token: 99,
            style: HandOffStyle::Vllm,
        }
    }

    #[test]
    fn an_sglang_hand_off_names_the_room_and_carries_the_token_in_the_bootstrap_fields() {
        let mut h = hand_off(json!({
            "prompt": [1, 2, 3], "max_tokens": 50, "stream": true,
            "bootstrap_room": 5, "bootstrap_host": "10.0.0.9", "kv_transfer_params": {"x": 1}
        }));
        h.style = HandOffStyle::SgLang;
        h.token = 0xab;
        for b in [engine_body(&h).unwrap(), prefill_body(&h).unwrap()] {
            // The client's own routing fields are gone; the front door's name the room.
            assert_eq!(b["bootstrap_room"], 7);
            assert_eq!(b["bootstrap_host"], "tandem-00000000000000ab-5000");
            assert_eq!(b["bootstrap_port"], SGLANG_BOOTSTRAP_PORT);
            assert!(b.get("kv_transfer_params").is_none());
        }
        assert_eq!(engine_body(&h).unwrap()["max_tokens"], 50);
        assert_eq!(prefill_body(&h).unwrap()["max_tokens"], 1);
        assert_eq!(prefill_body(&h).unwrap()["stream"], false);
        // Ids fit SGLang's signed 64-bit room.
        assert!(hand_off_id(hand_off_base(), u64::MAX) <= i64::MAX as u64);
    }

    #[test]
    fn the_engine_body_names_the_request_and_keeps_the_clients_fields() {
        let b = engine_body(&hand_off(json!({
            "prompt": "a b c", "temperature": 0.5,
            "kv_transfer_params": {"other": 1, "do_remote_decode": true}
        })))
        .unwrap();
        assert_eq!(b["temperature"], 0.5);
        assert_eq!(b["prompt"], "a b c");
        let p = &b["kv_transfer_params"];
        // The client's own transfer parameters never reach the engine.
        assert!(p.get("other").is_none() && p.get("do_remote_decode").is_none());
        assert_eq!(p["do_remote_prefill"], true);
        assert_eq!(p["tandem"]["request_id"], 7);
        assert_eq!(p["tandem"]["kv_deadline_ms"], 5_000);
        assert_eq!(p["tandem"]["token"], 99);
        assert_eq!(p["tandem"]["prefix_hashes"], json!([11, 12]));
    }

    #[test]
    fn the_prefill_body_generates_one_token_and_sends_its_kv_to_the_decode() {
        let b = prefill_body(&hand_off(json!({
            "prompt": [1, 2, 3], "max_tokens": 50, "stream": true, "min_tokens": 5,
            "stream_options": {"include_usage": true}
        })))
        .unwrap();
        assert_eq!(b["max_tokens"], 1);
        assert_eq!(b["stream"], false);
        assert!(b.get("stream_options").is_none() && b.get("min_tokens").is_none());
        let p = &b["kv_transfer_params"];
        assert_eq!(p["do_remote_decode"], true);
        assert!(p.get("do_remote_prefill").is_none());
        assert_eq!(p["tandem"]["request_id"], 7);
        assert_eq!(
            prefill_engine_addr("10.1.2.3:7400", 8100),
            Some("10.1.2.3:8100".parse().unwrap())
        );
        assert_eq!(prefill_engine_addr("prefill.svc:7400", 8100), None);
    }

    #[test]
    fn several_sequences_under_one_hand_off_are_refused() {
        assert!(one_sequence(&json!({"prompt": "a", "n": 1, "best_of": 1})).is_ok());
        assert!(one_sequence(&json!({"prompt": [1, 2, 3]})).is_ok());
        assert_eq!(
            one_sequence(&json!({"prompt": "a", "n": 2})).unwrap_err().0,
            "n"
        );
        assert_eq!(
            one_sequence(&json!({"prompt": "a", "best_of": 3}))
                .unwrap_err()
                .0,
            "best_of"
        );
        assert_eq!(
            one_sequence(&json!({"prompt": ["a", "b"]})).unwrap_err().0,
            "prompt"
        );
        assert_eq!(
            one_sequence(&json!({"prompt": [[1], [2]]})).unwrap_err().0,
            "prompt"
        );
    }

    #[test]
    fn a_body_that_is_not_an_object_is_refused() {
        assert!(engine_body(&hand_off(json!([1, 2]))).is_err());
    }
}
