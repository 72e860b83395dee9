//! Issue 19, through real processes: clients that hang up while their prompt is in prefill (or
//! mid-stream) leave no KV page behind. The abandoned requests are counted
//! (`requests_cancelled`, by stage), every page returns through the release gate, the decode stays
//! ready, and a request of the pool's full size is admitted and reads intact KV.
//!
//! With `--features negative-controls`, `TANDEM_NEGATIVE_LEAK_ON_DROP=1` brings the leak back and
//! the decode's readiness must say so.

mod serve_support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::WorkerRole;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Pages of the decode pools here: 512 tokens × 512 B per page (256 KiB), 8 pages.
const POOL_PAGES: u64 = 8;
const PAGE_BYTES: u64 = 512 * 512;

/// Sends a completion on its own connection and returns the socket, the response unread: dropping
/// it is the client hanging up (like `curl --max-time`).
async fn send_and_hold(addr: SocketAddr, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let b = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(b.as_bytes()).await.unwrap();
    s
}

async fn report(health: SocketAddr) -> Value {
    get_json(health, "/report").await.1
}

/// A prefill at 1.5 ms per prompt token (a 1024-token prompt is in prefill for 1.5 s) and a
/// decode of [`POOL_PAGES`] pages.
fn pair(net: u8, decode_env: &[(&str, &str)]) -> (World, Proc, Proc) {
    let w = World::new(net);
    w.publish(&[2]);
    let p = w.spawn(
        2,
        &config(WorkerRole::Prefill, "r1", w.ports),
        &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", "1500")],
    );
    let mut dcfg = config(WorkerRole::Decode, "r1", w.ports);
    dcfg.memory.target_pool_bytes = POOL_PAGES * PAGE_BYTES;
    dcfg.memory.segment_bytes = POOL_PAGES * PAGE_BYTES;
    let d = w.spawn(9, &dcfg, decode_env);
    (w, p, d)
}

/// Sends `n` requests of 2 pages each and hangs up on all of them once the decode holds their
/// pages (rooms open, prompts in prefill).
async fn abandon_in_prefill(front: SocketAddr, health: SocketAddr, n: u64) {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(send_and_hold(front, &completion(1024, 4, false)).await);
    }
    until(Duration::from_secs(10), || async {
        report(health).await["kv_pages"]["held"] == 2 * n
    })
    .await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_requests_release_their_kv_pages_and_are_counted() {
    let (w, _p, _d) = pair(71, &[]);
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    assert_eq!(report(health).await["kv_pages"]["total"], POOL_PAGES);

    // Three clients hang up while their prompts are in prefill.
    abandon_in_prefill(front, health, 3).await;
    until(Duration::from_secs(30), || async {
        let r = report(health).await;
        r["counters"]["requests_cancelled"] == 3 && r["kv_pages"]["held"] == 0
    })
    .await;
    let r = report(health).await;
    assert_eq!(r["requests_cancelled_by_reason"]["prefill"], 3, "{r}");
    assert_eq!(r["rooms"]["abandoned"], 3, "{r}");
    assert_eq!(r["rooms"]["released"], 3, "{r}");
    assert_eq!(r["kv_pages"]["free"], POOL_PAGES, "{r}");
    assert_eq!(r["kv_pages"]["quarantined"], 0, "{r}");
    assert_eq!(r["kv_pages"]["stranded"], 0, "{r}");
    assert_eq!(
        (
            &r["counters"]["requests_ok"],
            &r["counters"]["requests_failed"]
        ),
        (&Value::from(0), &Value::from(0)),
        "{r}"
    );
    let (_, metrics) = http(health, "GET", "/metrics", None).await;
    let metrics = text(&metrics);
    assert!(
        metrics.contains("tandem_requests_cancelled_total 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"tandem_requests_cancelled_by_reason_total{reason="prefill"} 3"#),
        "{metrics}"
    );
    assert_eq!(status(health, "/readyz").await, Some(200));

    // The whole pool is one request again, and its KV reads intact.
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion((POOL_PAGES * 512) as u32, 2, false)),
    )
    .await;
    assert_eq!(code, 200, "{}", text(&frames));
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");

    // A client that hangs up mid-stream: counted under `stream`, its pages back.
    let mut s = send_and_hold(front, &completion(1024, 60_000, true)).await;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
            .await
            .expect("no first event")
            .unwrap();
        assert!(n > 0, "stream closed before its first event");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(report(health).await["kv_pages"]["held"], 2);
    drop(s);
    until(Duration::from_secs(10), || async {
        let r = report(health).await;
        r["requests_cancelled_by_reason"]["stream"] == 1 && r["kv_pages"]["held"] == 0
    })
    .await;
    let r = report(health).await;
    assert_eq!(r["counters"]["requests_cancelled"], 4, "{r}");
    assert_eq!(r["counters"]["requests_ok"], 1, "{r}");
    assert_eq!(r["kv_pages"]["free"], POOL_PAGES, "{r}");
}

/// Negative control: with the room guard's hand-over switched off, the abandoned pages stay
/// held, the decode turns not ready with the reason, and a full-size request is refused.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_leaked_pages_turn_readiness_off_with_the_reason() {
    let (w, _p, _d) = pair(
        72,
        &[
            ("TANDEM_NEGATIVE_LEAK_ON_DROP", "1"),
            ("TANDEM_DECODE_KV_DEADLINE_MS", "500"),
        ],
    );
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    abandon_in_prefill(front, health, 1).await;
    until(Duration::from_secs(30), || async {
        status(health, "/readyz").await == Some(503)
    })
    .await;
    let r = report(health).await;
    assert_eq!(r["kv_pages"]["held"], 2, "{r}");
    assert_eq!(r["kv_pages"]["stranded"], 2, "{r}");
    assert_eq!(r["rooms"]["abandoned"], 0, "{r}");
    let reason = r["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("held by no live request"), "{r}");
    assert!(
        r["degraded"]
            .as_array()
            .is_some_and(|d| d.iter().any(|d| d["code"] == "KvPagesStranded")),
        "{r}"
    );
    // The request is still counted: its admission ended with the dropped future.
    assert_eq!(r["requests_cancelled_by_reason"]["prefill"], 1, "{r}");
}
