//! Issue 19, item 2, through real processes: the front door's status codes and its one error shape.
//! A prompt that can never fit the decode's KV pool is a 400 `context_length_exceeded` (not a
//! retryable 429); 429 stays for "full now"; an oversized body is a JSON 413; and every error —
//! bad JSON, wrong content type, unknown route, wrong method — is OpenAI's
//! `{"error":{"message","type","param","code"}}`.

mod serve_support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::WorkerRole;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const POOL_PAGES: u64 = 8;
const PAGE_BYTES: u64 = 512 * 512;
const POOL_TOKENS: u32 = (POOL_PAGES * 512) as u32;

/// One request on its own connection, written by a task of its own (a server may answer before
/// reading the whole body); returns the status and the body parsed as JSON (`Null` if it is not).
async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (u16, Value) {
    let s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    if let Some(ct) = content_type {
        head.push_str(&format!("content-type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(head.as_bytes()).await;
        let _ = wr.write_all(&body).await;
        wr
    });
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let (status, body) = loop {
        let n = tokio::time::timeout(Duration::from_secs(20), rd.read(&mut buf))
            .await
            .expect("no response")
            .unwrap_or(0);
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
            let len = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            });
            match len {
                Some(len) if rest.len() >= len => break (status, rest[..len].to_owned()),
                None if n == 0 => break (status, rest.to_owned()),
                _ => {}
            }
        }
        assert!(n > 0, "connection closed before a full response: {text:?}");
    };
    writer.abort();
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The body is exactly OpenAI's error object with `code` and `param`.
fn assert_error(status: u16, body: &Value, want: u16, code: &str, param: Option<&str>) {
    assert_eq!(status, want, "{body}");
    let e = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("{body}"));
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "message", "param", "type"], "{body}");
    assert_eq!(e["code"], code, "{body}");
    assert_eq!(e["param"], param.map_or(Value::Null, Value::from), "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
}

async fn post_json(addr: SocketAddr, body: &Value) -> (u16, Value) {
    raw(
        addr,
        "POST",
        "/v1/completions",
        Some("application/json"),
        body.to_string().into_bytes(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn front_door_errors_are_openai_json_with_the_right_status() {
    let w = World::new(73);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let mut dcfg = config(WorkerRole::Decode, "r1", w.ports);
    dcfg.memory.target_pool_bytes = POOL_PAGES * PAGE_BYTES;
    dcfg.memory.segment_bytes = POOL_PAGES * PAGE_BYTES;
    let _d = w.spawn(9, &dcfg, &[]);
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;

    // A prompt one token longer than the whole pool: never fits, so 400, not 429.
    let (s, b) = post_json(front, &completion(POOL_TOKENS + 1, 2, false)).await;
    assert_error(s, &b, 400, "context_length_exceeded", Some("prompt"));
    assert_eq!(b["error"]["type"], "invalid_request_error");
    let m = b["error"]["message"].as_str().unwrap();
    assert!(m.contains(&POOL_TOKENS.to_string()), "{m}");
    let (s, b) = post_json(front, &completion(600_000, 2, true)).await;
    assert_error(s, &b, 400, "context_length_exceeded", Some("prompt"));
    // Exactly the pool: served.
    let (s, b) = post_json(front, &completion(POOL_TOKENS, 2, false)).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["tandem"]["corrupt_chunks"], 0);

    // Full now: the whole pool is held by a long stream, so a small request gets 429.
    let mut stream = TcpStream::connect(front).await.unwrap();
    let body = completion(POOL_TOKENS, 60_000, true).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {front}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    until(Duration::from_secs(10), || async {
        get_json(health, "/report").await.1["kv_pages"]["free"] == 0
    })
    .await;
    let (s, b) = post_json(front, &completion(100, 2, false)).await;
    assert_error(s, &b, 429, "at_capacity", None);
    assert_eq!(b["error"]["type"], "rate_limit_exceeded");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("need 1 KV pages, 0 free"),
        "{b}"
    );
    drop(stream);
    until(Duration::from_secs(10), || async {
        get_json(health, "/report").await.1["kv_pages"]["free"] == POOL_PAGES
    })
    .await;
    let (s, b) = post_json(front, &completion(100, 2, false)).await;
    assert_eq!(s, 200, "{b}");

    // Malformed JSON, a malformed field.
    let (s, b) = raw(
        front,
        "POST",
        "/v1/completions",
        Some("application/json"),
        b"{".to_vec(),
    )
    .await;
    assert_error(s, &b, 400, "malformed", None);
    let (s, b) = post_json(front, &serde_json::json!({"max_tokens": 1_000_000})).await;
    assert_error(s, &b, 400, "malformed", Some("max_tokens"));
    // No content type is taken as JSON; another one is refused.
    let (s, b) = raw(
        front,
        "POST",
        "/v1/completions",
        None,
        completion(10, 1, false).to_string().into_bytes(),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let (s, b) = raw(
        front,
        "POST",
        "/v1/completions",
        Some("text/plain"),
        completion(10, 1, false).to_string().into_bytes(),
    )
    .await;
    assert_error(s, &b, 415, "unsupported_media_type", None);
    // A body over the limit.
    let big = vec![b' '; tandem_worker::roles::decode::front_door::MAX_BODY_BYTES + 1];
    let (s, b) = raw(
        front,
        "POST",
        "/v1/completions",
        Some("application/json"),
        big,
    )
    .await;
    assert_error(s, &b, 413, "request_too_large", None);
    // Unknown route, wrong methods.
    let (s, b) = raw(front, "GET", "/v1/nope", None, Vec::new()).await;
    assert_error(s, &b, 404, "not_found", None);
    let (s, b) = raw(front, "GET", "/v1/completions", None, Vec::new()).await;
    assert_error(s, &b, 405, "method_not_allowed", None);
    let (s, b) = raw(front, "POST", "/v1/models", None, Vec::new()).await;
    assert_error(s, &b, 405, "method_not_allowed", None);

    // The 429 is a refusal, the stream a cancellation; no request failed.
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["counters"]["requests_ok"], 3, "{r}");
    assert_eq!(r["counters"]["requests_refused"], 1, "{r}");
    assert_eq!(r["counters"]["requests_cancelled"], 1, "{r}");
    assert_eq!(r["counters"]["requests_failed"], 0, "{r}");
    assert_eq!(r["kv_pages"]["held"], 0, "{r}");
}
