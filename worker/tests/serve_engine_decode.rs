//! The decode role on the engine API (DESIGN §3.1, issue 13), through real processes: a prefill
//! worker and a decode worker whose configs both name an engine (`engine: Simulated`), each with
//! `tandem-worker sim-engine --serve` as its engine container (sharing the socket directory under
//! the pod's `$TANDEM_ROOT`). The decode worker's front door admits each request and picks the
//! prefill peer; its engine Reserves pages, the room opens on the peer into the engine's pool, the
//! engine verifies every page it reads, generates the tokens the front door streams, and Finishes.
//!
//! - requests served with 0 corrupt pages, the engine's tokens in the response, pages back only
//!   through SafeToReuse (the engine's own ownership check: 0 early reuses), `/metrics` and
//!   `/report.engine` of the decode seat; not ready before an engine attached, nor after it left;
//! - the decode engine SIGKILLed with requests decoding: they end with a reason at once, no page
//!   leaks, a new engine re-attaches and serves;
//! - negative control (feature `negative-controls`): a prefill engine writing one wrong byte makes
//!   the decode ENGINE count exactly one corrupt chunk;
//! - speculative decoding: the draft pool is allocated and registered beside the target's, the
//!   engine reports every step through `Spec.ReportSteps`, and an injected fault trips the guard
//!   there (the room aborts through the gate, the request is retried);
//! - a decode engine killed while its KV is in flight: both sides release through the gate;
//! - Standalone client mode: target and draft pools committed in the sidecar's segment (seed 000);
//!   its negative control, the draft pool on plain mmap, fails closed before any registration;
//! - clients that hang up in prefill or while the engine decodes: every page comes back;
//! - prefix hits: the prefill's OpenRoom answer reaches the decode engine's response
//!   (`tandem.prefix_hit_tokens`, `usage.prompt_tokens_details.cached_tokens`), and the decode's
//!   `/report.engine` carries the engine's own summary;
//! - a request's own `kv_deadline_ms` (seed 004's probe) ends its engine room at that deadline.
//!
//! - snapshot sync through the engine API: the decode engine hands its finished turn's session KV
//!   over (SyncSession), the prefill finalizes it into the L2 its engine reads, and the next turn
//!   loads the pages no prefill computed.
//!
//! Each test has its own `127.0.<net>.x` addresses (nets 101–110, 116, 131).

mod serve_support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::{
    EngineKind, EngineSeat, SpecGuard, Speculative, WorkerConfig, WorkerRole,
};
use tandem_worker::memory::AllocatorDomain;
use tandem_worker::model::{Attention, ModelIdentity};

const SOCKET_DIR: &str = "/run/tandem/engine";
/// 1200 prompt tokens: 3 pages of 512 tokens.
const PROMPT: u32 = 1200;
/// One page: 512 tokens × 8 layers × 64 B per token and layer.
const PAGE_BYTES: u64 = 512 * 8 * 64;

/// 8 layers of 64 B per token and layer: the rows the serving tests' shared
/// `TANDEM_SIM_KV_BYTES_PER_TOKEN=512` implies, so both engines' pools and the transfer agree.
fn model() -> ModelIdentity {
    ModelIdentity {
        name: "tiny-8l".into(),
        layers: 8,
        attention: Attention::Gqa {
            kv_heads: 1,
            head_dim: 16,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    }
}

fn with_engine(mut c: WorkerConfig) -> WorkerConfig {
    c.model = model();
    c.memory.allocator = AllocatorDomain::SharedMemory;
    c.engine = Some(EngineSeat {
        kind: EngineKind::Simulated,
        socket_dir: SOCKET_DIR.into(),
        http_port: None,
    });
    c
}

fn prefill_config(w: &World) -> WorkerConfig {
    with_engine(config(WorkerRole::Prefill, "r1", w.ports))
}

fn decode_config(w: &World) -> WorkerConfig {
    with_engine(config(WorkerRole::Decode, "r1", w.ports))
}

/// `tandem-worker sim-engine --serve` as the engine container of the pod on `host` (killed when
/// dropped).
fn spawn_engine(w: &World, host: u8, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(["sim-engine", "--serve", "--socket-dir", SOCKET_DIR])
        .args([
            "--config",
            &format!("/etc/tandem/{}", tandem_worker::config::CONFIG_FILE),
        ])
        .args(["--ordinal", "0", "--attach-backoff-max-ms", "200"])
        .args(extra)
        .env("TANDEM_ROOT", w.root(host))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().unwrap())
}

/// Waits (bounded) for the engine to exit; its status and summary line.
fn engine_exit(mut engine: Proc, within: Duration) -> (std::process::ExitStatus, Value) {
    let child = &mut engine.0;
    let end = Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "the engine did not exit within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    use std::io::Read;
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let summary = out
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or(Value::Null);
    (status, summary)
}

async fn readyz(addr: std::net::SocketAddr) -> (u16, String) {
    let (code, frames) = http(addr, "GET", "/readyz", None).await;
    (code, text(&frames))
}

async fn metrics(addr: std::net::SocketAddr) -> String {
    text(&http(addr, "GET", "/metrics", None).await.1)
}

async fn report(addr: std::net::SocketAddr) -> Value {
    get_json(addr, "/report").await.1
}

async fn complete(front: std::net::SocketAddr, max_tokens: u32) -> (u16, Value) {
    complete_body(front, completion(PROMPT, max_tokens, false)).await
}

async fn complete_body(front: std::net::SocketAddr, body: Value) -> (u16, Value) {
    let (code, frames) = http(front, "POST", "/v1/completions", Some(body)).await;
    (
        code,
        serde_json::from_str(&text(&frames)).unwrap_or(Value::Null),
    )
}

/// A prefill with its engine on host 2, ready.
async fn prefill_with_engine(w: &World, extra: &[&str]) -> (Proc, Proc) {
    let p = w.spawn(2, &prefill_config(w), &[]);
    let e = spawn_engine(w, 2, extra, &[]);
    let ph = w.addr(2, w.ports.health);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    (p, e)
}

/// The words the front door writes for token ids `request_id + position`.
fn words_of(text: &str) -> usize {
    text.split_whitespace().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_engine_serves_the_front_doors_requests_through_the_engine_api() {
    let w = World::new(101);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &[]).await;
    let _d = w.spawn(9, &decode_config(&w), &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));

    // Pools allocated at start, not ready before an engine attached (a prefill peer is there).
    until(Duration::from_secs(15), || async {
        report(dh).await["peers"]
            .as_array()
            .is_some_and(|p| p.len() == 1)
    })
    .await;
    let (code, body) = readyz(dh).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("engine not attached"), "{body}");
    let m = metrics(dh).await;
    assert!(
        m.contains(r#"tandem_engine_pool_bytes{pool="target",domain="SharedMemory"} 67108864"#),
        "{m}"
    );
    assert!(m.contains("tandem_engine_attached 0"), "{m}");
    let r = report(dh).await;
    assert_eq!(r["engine"]["kind"], "Simulated", "{r}");
    assert_eq!(r["engine"]["pools"][0]["pool"], "target");
    assert_eq!(r["engine"]["pages"]["total"], 256, "{r}");
    // Not ready: the front door refuses at once.
    let (code, v) = complete(front, 3).await;
    assert_eq!(code, 503, "{v}");

    let engine = spawn_engine(&w, 9, &[], &[]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    assert!(metrics(dh).await.contains("tandem_engine_attached 1"));

    const N: u64 = 6;
    let mut tasks = Vec::new();
    for _ in 0..N {
        tasks.push(tokio::spawn(complete(front, 5)));
    }
    for t in tasks {
        let (code, v) = t.await.unwrap();
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
        assert_eq!(v["tandem"]["kv_bytes"], 3 * PAGE_BYTES);
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(words_of(text), 5, "the engine's 5 tokens: {v}");
    }
    // A streamed request: one event per token, the last with usage, then [DONE].
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(PROMPT, 4, true)),
    )
    .await;
    assert_eq!(code, 200);
    let events = sse_events(&text(&frames));
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let tokens: Vec<Value> = events[..events.len() - 2]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(tokens.len(), 4, "{events:?}");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["tandem"]["corrupt_chunks"], 0, "{last}");
    let served = N + 1;

    // Every page came back through SafeToReuse (the gate's proof: concluded), none is held.
    until(Duration::from_secs(10), || async {
        let e = report(dh).await["engine"].clone();
        e["pages"]["free"] == e["pages"]["total"] && e["rooms_open"] == 0
    })
    .await;
    let r = report(dh).await;
    let e = &r["engine"];
    assert_eq!(e["attached"], true, "{r}");
    assert_eq!(e["work"], served, "{r}");
    assert_eq!(e["rooms_reserved"], served, "{r}");
    assert_eq!(e["rooms_completed"], served, "{r}");
    assert_eq!(e["rooms_failed"], 0, "{r}");
    assert_eq!(e["releases"]["concluded"], served, "{r}");
    assert_eq!(e["chunks_verified"], served * 3 * 8, "{r}");
    assert_eq!(e["corrupt_chunks"], 0, "{r}");
    assert_eq!(e["tokens"], N * 5 + 4, "{r}");
    assert_eq!(e["requests_waiting"], 0, "{r}");
    assert_eq!(r["counters"]["requests_ok"], served, "{r}");
    assert_eq!(r["counters"]["corrupt_pages_read"], 0);
    assert_eq!(r["counters"]["kv_bytes_received"], served * 3 * PAGE_BYTES);
    // The built-in region received nothing: every byte landed in the engine's pool.
    assert_eq!(r["kv_pages"]["total"], 0, "{r}");
    let m = metrics(dh).await;
    assert!(
        m.contains(&format!("tandem_engine_rooms_completed_total {served}")),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            r#"tandem_engine_releases_total{{proof="concluded"}} {served}"#
        )),
        "{m}"
    );
    assert!(m.contains(r#"tandem_engine_pages{state="held"} 0"#), "{m}");

    // SIGTERM: the engine detaches with its summary; the decode is not ready again.
    engine.signal(libc::SIGTERM);
    let (st, s) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["role"], "decode", "{s}");
    assert_eq!(s["decode"]["work"], served, "{s}");
    assert_eq!(s["completed"], served, "{s}");
    assert_eq!(s["corrupt_chunks"], 0, "{s}");
    assert_eq!(s["decode"]["early_reuse"], 0, "{s}");
    assert_eq!(
        s["decode"]["release_gaps"], 0,
        "numbered 1, 2, ... without gaps: {s}"
    );
    assert_eq!(s["releases"], served, "one SafeToReuse per room: {s}");
    until(Duration::from_secs(10), || async {
        let (code, body) = readyz(dh).await;
        code == 503 && body.contains("engine not attached")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_engine_ends_its_requests_at_once_and_a_new_one_serves() {
    let w = World::new(102);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &[]).await;
    let _d = w.spawn(
        9,
        &decode_config(&w),
        &[("TANDEM_DECODE_KV_DEADLINE_MS", "60000")],
    );
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    // A slow engine: 3 s per token, so the requests are decoding when it dies.
    let slow = spawn_engine(&w, 9, &[], &[("TANDEM_SIM_TPOT_MS", "3000")]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    let mut tasks = Vec::new();
    for _ in 0..2 {
        tasks.push(tokio::spawn(complete(front, 8)));
    }
    until(Duration::from_secs(20), || async {
        report(dh).await["engine"]["rooms_completed"]
            .as_u64()
            .unwrap_or(0)
            >= 2
    })
    .await;
    let mut slow = slow;
    slow.0.kill().unwrap();
    let killed = Instant::now();
    let _ = slow.0.wait();
    for t in tasks {
        let (code, v) = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("a request hung after its engine died")
            .unwrap();
        assert_eq!(code, 503, "{v}");
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains("engine went away"), "{v}");
    }
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "the requests ended {:?} after the kill",
        killed.elapsed()
    );
    until(Duration::from_secs(10), || async {
        let (code, body) = readyz(dh).await;
        code == 503 && body.contains("engine not attached")
    })
    .await;
    // No page leaks: both rooms went through the gate.
    until(Duration::from_secs(15), || async {
        let e = report(dh).await["engine"].clone();
        e["pages"]["free"] == e["pages"]["total"]
            && e["pages"]["quarantined"] == 0
            && e["rooms_open"] == 0
            && e["requests_waiting"] == 0
    })
    .await;
    assert_eq!(report(dh).await["engine"]["rooms_failed"], 2);

    // A new engine attaches to the same pools and serves.
    let fresh = spawn_engine(&w, 9, &[], &[]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    let (code, v) = complete(front, 3).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    assert_eq!(report(dh).await["engine"]["attaches"], 2);
    fresh.signal(libc::SIGTERM);
    let (st, s) = engine_exit(fresh, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["completed"], 1, "{s}");
    assert_eq!(s["decode"]["early_reuse"], 0, "{s}");
}

/// The decode engine dies while its rooms wait for KV the (slow) prefill engine is still
/// computing: the rooms fail through the release gate (ABORT to the prefill, the receiver fence as
/// proof), the requests end at once, and neither side keeps a page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_killed_while_its_kv_is_in_flight_leaks_no_page_on_either_side() {
    let w = World::new(105);
    w.publish(&[2]);
    // 20 ms per prompt token: a 3-page room takes 24 s to compute.
    let (_p, _pe) = prefill_with_engine(&w, &["--prefill-us-per-token", "20000"]).await;
    let ph = w.addr(2, w.ports.health);
    let _d = w.spawn(
        9,
        &decode_config(&w),
        &[("TANDEM_DECODE_KV_DEADLINE_MS", "60000")],
    );
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let mut engine = spawn_engine(&w, 9, &[], &[]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    // Two prompts with one prefix: neither room may load the other's pages before they are
    // computed (when the engine stored them at once, the second completed: `rooms_completed` 1
    // below, seen in a CI rehearsal).
    let mut tasks = Vec::new();
    for _ in 0..2 {
        tasks.push(tokio::spawn(complete(front, 3)));
    }
    // Both rooms are open on the prefill, whose engine is computing them.
    until(Duration::from_secs(20), || async {
        report(ph).await["engine"]["rooms_submitted"]
            .as_u64()
            .unwrap_or(0)
            >= 2
    })
    .await;
    assert_eq!(report(dh).await["engine"]["rooms_completed"], 0);
    engine.0.kill().unwrap();
    let killed = Instant::now();
    let _ = engine.0.wait();
    for t in tasks {
        let (code, v) = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("a request hung after its engine died")
            .unwrap();
        assert_eq!(code, 503, "{v}");
    }
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "{:?}",
        killed.elapsed()
    );
    // Decode: both rooms released through the gate with a proof, nothing quarantined.
    until(Duration::from_secs(15), || async {
        let e = report(dh).await["engine"].clone();
        e["pages"]["free"] == e["pages"]["total"] && e["rooms_open"] == 0
    })
    .await;
    let e = report(dh).await["engine"].clone();
    assert_eq!(e["rooms_failed"], 2, "{e}");
    assert_eq!(e["quarantined"], 0, "{e}");
    let proofs =
        e["releases"]["transport"].as_u64().unwrap() + e["releases"]["acks"].as_u64().unwrap();
    assert_eq!(proofs, 2, "released with a proof, not by a timer: {e}");
    // Prefill: the aborted rooms failed, none was sent, no source page is held.
    until(Duration::from_secs(40), || async {
        let e = report(ph).await["engine"].clone();
        e["rooms_failed"] == 2 && e["rooms_open"] == 0 && e["source_pages_held"] == 0
    })
    .await;
    assert_eq!(report(ph).await["engine"]["rooms_sent"], 0);
}

#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_one_wrong_byte_is_caught_by_the_decode_engine() {
    let w = World::new(103);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &["--corrupt-one-byte"]).await;
    let _d = w.spawn(9, &decode_config(&w), &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let engine = spawn_engine(&w, 9, &[], &[]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    let (code, v) = complete(front, 3).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 1, "{v}");
    let (code, v) = complete(front, 3).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        v["tandem"]["corrupt_chunks"], 0,
        "only one chunk was wrong: {v}"
    );
    let r = report(dh).await;
    assert_eq!(r["counters"]["corrupt_pages_read"], 1, "{r}");
    assert_eq!(r["engine"]["corrupt_chunks"], 1, "{r}");
    engine.signal(libc::SIGTERM);
    let (st, s) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success());
    assert_eq!(s["corrupt_chunks"], 1, "{s}");
}

#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decode_reports_steps_and_a_fault_trips_the_guard_through_the_engine_api() {
    let w = World::new(104);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &[]).await;
    let mut cfg = decode_config(&w);
    cfg.speculative = Some(Speculative {
        draft_model: model(),
        draft_tokens: 4,
    });
    cfg.memory.draft_pool_bytes = 16 << 20;
    cfg.memory.segment_bytes = cfg.memory.target_pool_bytes + cfg.memory.draft_pool_bytes;
    cfg.spec_guard = Some(SpecGuard {
        min_accept_length: 1.4,
        max_accept_rate: 0.96,
        after_tokens: 128,
        retry_budget: 1,
    });
    let _d = w.spawn(9, &cfg, &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    // The draft pool is allocated beside the target's, in the same domain.
    until(Duration::from_secs(15), || async {
        metrics(dh)
            .await
            .contains(r#"tandem_engine_pool_bytes{pool="draft",domain="SharedMemory"}"#)
    })
    .await;
    // The first attempt of every request rejects almost every draft token.
    let engine = spawn_engine(&w, 9, &[], &[("TANDEM_SIM_SPEC_FAULT", "low_accept:1")]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    let r = report(dh).await;
    let pools: Vec<&str> = r["engine"]["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pool"].as_str().unwrap())
        .collect();
    assert_eq!(pools, ["target", "draft"], "{r}");

    // Tripped after 128 tokens through ReportSteps, aborted through the gate, retried, served.
    let (code, v) = complete(front, 300).await;
    assert_eq!(code, 200, "{v}");
    let sg = &v["tandem"]["spec_guard"];
    assert_eq!(sg["enabled"], true, "{v}");
    assert_eq!(sg["aborts"], 1, "{v}");
    assert_eq!(sg["anomalies"][0]["reason"], "low_accept_length", "{v}");
    assert!(
        v["tandem"]["spec_accept_length"].as_f64().unwrap() > 1.4,
        "{v}"
    );
    assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    assert_eq!(words_of(v["choices"][0]["text"].as_str().unwrap()), 300);
    until(Duration::from_secs(10), || async {
        let e = report(dh).await["engine"].clone();
        e["pages"]["free"] == e["pages"]["total"] && e["rooms_open"] == 0
    })
    .await;
    let r = report(dh).await;
    assert_eq!(r["engine"]["spec_trips"], 1, "{r}");
    assert_eq!(r["engine"]["rooms_reserved"], 2, "{r}");
    assert_eq!(r["counters"]["spec_guard_aborts"], 1, "{r}");
    assert_eq!(
        r["spec_guard"]["anomalies_by_reason"]["low_accept_length"],
        1
    );
    engine.signal(libc::SIGTERM);
    let (st, s) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["spec_trips"], 1, "{s}");
    assert!(s["spec_steps"].as_u64().unwrap() > 30, "{s}");
    assert_eq!(
        s["corrupt_chunks"], 0,
        "target and draft pages verified: {s}"
    );
    assert_eq!(s["decode"]["early_reuse"], 0, "{s}");
}

/// Seed 000 on the decode side: with a Standalone CacheTier client and speculative decoding, the
/// decode engine's target AND draft pools are carved from the store-client sidecar's memfd segment
/// and registered with it (COMMITTED, visible in `/metrics` and `/report`); the engine maps that
/// segment and serves from it; SIGTERM tears the worker down cleanly.
/// A speculative decode config with a Standalone CacheTier client: target and draft pools of 16 MiB
/// each in the sidecar's segments.
fn standalone_speculative_decode(w: &World) -> WorkerConfig {
    use tandem_worker::config::{CacheConfig, WritePolicy};
    use tandem_worker::store_client::ClientMode;
    let mut cfg = decode_config(w);
    cfg.speculative = Some(Speculative {
        draft_model: model(),
        draft_tokens: 4,
    });
    cfg.memory.draft_pool_bytes = 16 << 20;
    cfg.memory.segment_bytes = cfg.memory.target_pool_bytes + cfg.memory.draft_pool_bytes;
    cfg.memory.client_mode = Some(ClientMode::Standalone);
    cfg.cache = Some(CacheConfig {
        tier: "l3".into(),
        service: "l3-store.serving.svc".into(),
        replicas: 1,
        page_tokens: 512,
        write_policy: WritePolicy::WriteThrough,
    });
    cfg
}

/// The store-client sidecar of the pod on `host` (same `$TANDEM_ROOT`, so the same `/dev/shm`
/// socket), memfd segments; health on `ports.health + 1`.
fn spawn_sidecar(w: &World, host: u8, cfg: &WorkerConfig) -> Proc {
    w.start_role(
        host,
        "store-client",
        tandem_worker::config::CONFIG_FILE,
        &serde_json::to_vec(cfg).unwrap(),
        &[],
        &["--backend", "memfd"],
    )
    .0
}

/// Seed 000's negative control through real processes: the decode worker of that pool carves its
/// draft pool from plain mmap (`TANDEM_NC_DRAFT_POOL_ON_MMAP`, feature `negative-controls`). It
/// fails closed before any registration and says why, staying up: `/readyz` 503 with the typed
/// reason, `/report` `degraded` and `engine.refused`, `/metrics` the refusal; the sidecar never
/// received a `Register` request and holds nothing (the reserved segment went with the worker's
/// connection). SIGTERM then stops it with exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_decode_with_its_draft_on_mmap_fails_closed_before_any_registration() {
    use tandem_worker::engine_api::pools::NC_DRAFT_ON_MMAP_ENV;
    let w = World::new(110);
    let cfg = standalone_speculative_decode(&w);
    let _sidecar = spawn_sidecar(&w, 9, &cfg);
    let mut d = w.spawn(9, &cfg, &[(NC_DRAFT_ON_MMAP_ENV, cfg.pool.as_str())]);
    let dh = w.addr(9, w.ports.health);
    let (code, why) = readyz(dh).await;
    assert_eq!(code, 503, "{why}");
    assert!(
        why.contains("engine pools refused: PoolDomainMismatch (pools.draft)"),
        "{why}"
    );
    let r = report(dh).await;
    assert_eq!(r["ready"], false, "{r}");
    assert_eq!(r["degraded"][0]["component"], "pools", "{r}");
    assert_eq!(r["degraded"][0]["code"], "PoolDomainMismatch", "{r}");
    let refused = &r["engine"]["refused"];
    assert_eq!(refused["pool"], "draft", "{r}");
    assert_eq!(refused["code"], "FailedPrecondition", "{r}");
    assert!(
        refused["theirs"].as_str().unwrap_or("").contains("Mmap"),
        "{r}"
    );
    assert_eq!(r["engine"]["pools"], serde_json::json!([]), "{r}");
    let m = metrics(dh).await;
    assert!(
        m.contains(
            r#"tandem_engine_pool_refusals_total{pool="draft",reason="PoolDomainMismatch"} 1"#
        ),
        "{m}"
    );
    assert!(!m.contains("tandem_engine_pool_registered"), "{m}");
    // The sidecar notices the worker's closed connection within its 100 ms poll.
    let sc = w.addr(9, w.ports.health + 1);
    until(Duration::from_secs(5), || async {
        get_json(sc, "/report").await.1["store_client"]["connections_open"] == 0
    })
    .await;
    let sidecar = get_json(sc, "/report").await.1;
    let s = &sidecar["store_client"];
    assert_eq!(
        s["register_requests"], 0,
        "no Register request reached the sidecar: {sidecar}"
    );
    assert_eq!(
        (&s["registrations"], &s["segments"], &s["connections_open"]),
        (&Value::from(0), &Value::from(0), &Value::from(0)),
        "{sidecar}"
    );
    assert_eq!(
        s["segments_created"], 1,
        "the reservation came and went: {sidecar}"
    );
    assert!(
        d.0.try_wait().unwrap().is_none(),
        "the refused worker stays up"
    );
    d.signal(libc::SIGTERM);
    let st = d.wait_exit(Duration::from_secs(20)).expect("decode exits");
    assert!(st.success(), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_decode_pools_target_and_draft_live_in_the_sidecar_segment() {
    let w = World::new(106);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &[]).await;
    let cfg = standalone_speculative_decode(&w);
    let _sidecar = spawn_sidecar(&w, 9, &cfg);
    let mut d = w.spawn(9, &cfg, &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let sidecar = get_json(w.addr(9, w.ports.health + 1), "/report").await.1;
    let s = &sidecar["store_client"];
    assert_eq!(
        (&s["segments"], &s["registrations"], &s["connections_open"]),
        (&Value::from(1), &Value::from(2), &Value::from(1)),
        "one segment, target and draft registered in it: {sidecar}"
    );
    let m = metrics(dh).await;
    for pool in ["target", "draft"] {
        assert!(
            m.contains(&format!(
                r#"tandem_engine_pool_registered{{pool="{pool}",state="committed"}} 1"#
            )),
            "{m}"
        );
        assert!(
            m.contains(&format!(
                r#"tandem_registration_commits_total{{role="{pool}"}} 1"#
            )),
            "{m}"
        );
    }
    let r = report(dh).await;
    for (i, pool) in ["target", "draft"].iter().enumerate() {
        let p = &r["engine"]["pools"][i];
        assert_eq!(p["pool"], *pool, "{r}");
        assert_eq!(p["registration"], "committed", "{r}");
        assert_eq!(p["domain"], "SharedMemory", "{r}");
    }
    let engine = spawn_engine(&w, 9, &[], &[]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    for _ in 0..2 {
        let (code, v) = complete(front, 6).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    }
    engine.signal(libc::SIGTERM);
    let (st, s) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["pools"], serde_json::json!(["target", "draft"]), "{s}");
    assert_eq!(s["completed"], 2, "{s}");
    assert_eq!(s["corrupt_chunks"], 0, "{s}");
    d.signal(libc::SIGTERM);
    let st = d.wait_exit(Duration::from_secs(30)).expect("decode exits");
    assert!(st.success(), "{st:?}");
    // The teardown ran in contract 9's order, every step done; the pools deregistered last.
    w.assert_clean_teardown(
        9,
        &[
            "StopAdmission",
            "DrainRooms",
            "DrainRooms",
            "Deregister",
            "DestroyTransports",
            "FreeMemory",
        ],
    );
}

/// SIGTERM with a request still decoding past the drain grace: the teardown records the drain as
/// failed (the request in flight at the deadline) and still runs every later step — the engine
/// API stops and the pools are deregistered and freed — and the worker exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_grace_is_reported_and_the_teardown_goes_on() {
    let w = World::new(115);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &[]).await;
    let mut d = w.spawn(9, &decode_config(&w), &[("TANDEM_DRAIN_GRACE_MS", "300")]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    // 1 s per token: a request of 6 tokens decodes for 5 s.
    let _engine = spawn_engine(&w, 9, &[], &[("TANDEM_SIM_TPOT_MS", "1000")]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    let _held = send_and_hold(front, &completion(PROMPT, 6, false)).await;
    until(Duration::from_secs(20), || async {
        report(dh).await["engine"]["rooms_completed"] == 1
    })
    .await;
    d.signal(libc::SIGTERM);
    let st = d.wait_exit(Duration::from_secs(30)).expect("decode exits");
    assert!(st.success(), "{st:?}");
    let (ok, steps) = w.teardown_of(9);
    assert!(
        !ok,
        "a request was in flight at the grace deadline: {steps:?}"
    );
    let drain = steps
        .iter()
        .position(|s| s.0 == "DrainRooms")
        .expect("a DrainRooms step");
    assert_eq!(
        steps[drain].2.as_deref(),
        Some("1 requests in flight at the grace deadline"),
        "{steps:?}"
    );
    let dereg = steps
        .iter()
        .position(|s| s.0 == "FreeMemory")
        .expect("the pools' step ran after the failed drain");
    assert!(dereg > drain && steps[dereg].2.is_none(), "{steps:?}");
}

/// Sends a completion on its own connection and returns the socket, the response unread: dropping
/// it is the client hanging up.
async fn send_and_hold(addr: std::net::SocketAddr, body: &Value) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
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

/// Clients that hang up: while their KV is in prefill (the worker fails the engine's room through
/// the gate) and while the engine decodes (its next EmitTokens is answered `cancelled` and it
/// Aborts). Every page comes back, the requests are counted cancelled, the engine goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_hang_up_release_the_engines_pages_in_either_stage() {
    let w = World::new(107);
    w.publish(&[2]);
    // 5 ms per prompt token: a 3-page prompt is in prefill for 6 s (room for a slow machine
    // between the pages' reservation and the hang-up).
    let (_p, _pe) = prefill_with_engine(&w, &["--prefill-us-per-token", "5000"]).await;
    let _d = w.spawn(9, &decode_config(&w), &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    // 1 s per token: a request of 6 tokens decodes for 5 s.
    let engine = spawn_engine(&w, 9, &[], &[("TANDEM_SIM_TPOT_MS", "1000")]);
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;

    // In prefill: the engine's rooms wait for KV.
    let held: Vec<_> = hold_requests(front, 2).await;
    until(Duration::from_secs(10), || async {
        report(dh).await["engine"]["pages"]["held"] == 6
    })
    .await;
    drop(held);
    until(Duration::from_secs(15), || async {
        let r = report(dh).await;
        let e = &r["engine"];
        e["pages"]["free"] == e["pages"]["total"]
            && e["requests_waiting"] == 0
            && r["counters"]["requests_cancelled"] == 2
    })
    .await;
    let r = report(dh).await;
    assert_eq!(
        r["requests_cancelled_by_reason"]["prefill"], 2,
        "both hung up while their KV was in prefill: {r}"
    );
    // Not asserted: `rooms_completed == 0`. A prefill already sending when the client hangs up
    // may still land the room's KV (a CI rehearsal saw 1); the stage counter above is the proof
    // that both were cancelled in prefill, and the pages all came back. A room whose KV landed
    // reached the engine, whose next EmitTokens was answered `cancelled`: it counts among the
    // engine's completed and cancelled rooms below (a second CI rehearsal: cancelled 2, completed 3).

    // Decoding: the KV is in, the engine generates slowly.
    let completed_before = r["engine"]["rooms_completed"].as_u64().unwrap_or(0);
    assert!(completed_before <= 2, "{r}");
    let held = send_and_hold(front, &completion(PROMPT, 6, false)).await;
    until(Duration::from_secs(20), || async {
        report(dh).await["engine"]["rooms_completed"].as_u64() == Some(completed_before + 1)
    })
    .await;
    drop(held);
    until(Duration::from_secs(15), || async {
        let r = report(dh).await;
        let e = &r["engine"];
        e["pages"]["free"] == e["pages"]["total"]
            && e["rooms_open"] == 0
            && e["cancelled_reports"].as_u64().unwrap_or(0) >= 1
            && r["counters"]["requests_cancelled"] == 3
    })
    .await;

    // The engine still serves.
    let (code, v) = complete(front, 2).await;
    assert_eq!(code, 200, "{v}");
    engine.signal(libc::SIGTERM);
    let (st, s) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(
        s["decode"]["cancelled"].as_u64(),
        Some(1 + completed_before),
        "the decoding one was Aborted (and any room whose KV landed after its client hung up, \
         {completed_before}): {s}"
    );
    assert_eq!(s["decode"]["early_reuse"], 0, "{s}");
    assert_eq!(s["completed"].as_u64(), Some(2 + completed_before), "{s}");
}

/// Sends `n` completions of [`PROMPT`] tokens, each on its own held connection.
async fn hold_requests(front: std::net::SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(send_and_hold(front, &completion(PROMPT, 3, false)).await);
    }
    out
}

/// One request with a prefix identity (three 512-token blocks) through the front door.
async fn with_prefix(front: std::net::SocketAddr, hashes: &[u64]) -> Value {
    let body = serde_json::json!({"prompt": "x", "max_tokens": 2, "input_tokens": 1536,
        "kv_block_hashes": hashes});
    let (code, frames) = http(front, "POST", "/v1/completions", Some(body)).await;
    let v: Value = serde_json::from_str(&text(&frames)).unwrap_or(Value::Null);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hits_reach_the_response_when_both_pools_run_the_engine() {
    let w = World::new(108);
    w.publish(&[2]);
    let (_p, _pe) = prefill_with_engine(&w, &[]).await;
    let _d = w.spawn(9, &decode_config(&w), &[]);
    let _de = spawn_engine(&w, 9, &[], &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;

    // Cold: nothing cached. Again: the prefill's OpenRoom finds the whole prompt in L2 (its engine
    // loads it instead of computing it), and the decode engine's response says so.
    let cold = with_prefix(front, &[301, 302, 303]).await;
    assert_eq!(cold["tandem"]["prefix_hit_tokens"]["l2"], 0, "{cold}");
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let warm = with_prefix(front, &[301, 302, 303]).await;
    let h = &warm["tandem"]["prefix_hit_tokens"];
    assert_eq!(
        (h["l1"].as_u64(), h["l2"].as_u64(), h["l3"].as_u64()),
        (Some(0), Some(1536), Some(0)),
        "{warm}"
    );
    assert_eq!(warm["usage"]["prompt_tokens"], 1536, "{warm}");
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"], 1536,
        "{warm}"
    );
    let shared = with_prefix(front, &[301, 302, 999]).await;
    assert_eq!(
        shared["tandem"]["prefix_hit_tokens"]["l2"], 1024,
        "two shared pages: {shared}"
    );

    // The decode's /report.engine carries the engine's own summary and the pools' registration.
    // The engine publishes its summary after its last EmitTokens of an attempt, which is what
    // answered the client: the third attempt's figures may land just after the response.
    until(Duration::from_secs(10), || async {
        report(dh).await["engine"]["engine_summary"]["completed"] == 3
    })
    .await;
    let r = report(dh).await;
    let e = &r["engine"];
    assert_eq!(e["registration"]["quarantined"], 0, "{r}");
    let es = &e["engine_summary"];
    assert_eq!(es["role"], "decode", "{r}");
    assert_eq!(es["completed"], 3, "{r}");
    assert_eq!(es["corrupt_chunks"], 0, "{r}");
    assert_eq!(
        es["pages"], 9,
        "three pages per request, every one verified: {r}"
    );
    assert_eq!(es["decode"]["early_reuse"], 0, "{r}");
}

/// One turn of a session through the front door: `input` prompt tokens over `hashes`, `output`
/// generated, `session` the session's KV after it (empty: no sync). Returns its L2 hit tokens.
async fn session_turn(
    front: std::net::SocketAddr,
    input: u32,
    output: u32,
    hashes: &[u64],
    session: &[u64],
) -> u64 {
    let body = serde_json::json!({"prompt": "x", "max_tokens": output, "input_tokens": input,
        "kv_block_hashes": hashes, "session_kv_hashes": session});
    let (code, frames) = http(front, "POST", "/v1/completions", Some(body)).await;
    let v: Value = serde_json::from_str(&text(&frames)).unwrap_or(Value::Null);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    v["tandem"]["prefix_hit_tokens"]["l2"].as_u64().unwrap()
}

/// A prefill with a 16-page snapshot buffer and a decode (with `decode_env`), each with its
/// simulated engine (the decode's with `decode_engine` arguments), both ready: the processes, then
/// the prefill's and the decode's health addresses and the front door.
async fn sync_stack(
    w: &World,
    decode_env: &[(&str, &str)],
    decode_engine: &[&str],
) -> (
    Vec<Proc>,
    std::net::SocketAddr,
    std::net::SocketAddr,
    std::net::SocketAddr,
) {
    w.publish(&[2]);
    let mut pc = prefill_config(w);
    pc.memory.snapshot_buffer_bytes = 16 * PAGE_BYTES;
    pc.memory.segment_bytes += pc.memory.snapshot_buffer_bytes;
    let procs = vec![
        w.spawn(2, &pc, &[]),
        spawn_engine(w, 2, &[], &[]),
        w.spawn(9, &decode_config(w), decode_env),
        spawn_engine(w, 9, decode_engine, &[]),
    ];
    let (ph, dh, front) = (
        w.addr(2, w.ports.health),
        w.addr(9, w.ports.health),
        w.addr(9, w.ports.front),
    );
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200 && readyz(dh).await.0 == 200
    })
    .await;
    (procs, ph, dh, front)
}

/// Snapshot sync through the engine API (DESIGN §3.1 and contract 4; seed 002; issue 15). Turn 1
/// of a session: a 1400-token prompt (3 pages, the last partial) and 300 generated tokens, so its
/// KV after the turn is 4 pages whose last two no prefill ever computed. The decode engine lays
/// them out and hands them over with SyncSession (two calls: its room has 3 pages); the decode
/// worker pushes them into the prefill's snapshot buffer; the prefill finalizes them into the L2
/// its engine reads. Turn 2 extends the chain by one page: its first 4 pages hit L2 and the prefill
/// engine loads and verifies them byte for byte. A session without sync hits only the 2 pages
/// turn 1's prefill computed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_sync_through_the_engine_api_the_next_turn_loads_the_decode_engines_pages() {
    let w = World::new(116);
    let (_procs, ph, dh, front) = sync_stack(&w, &[], &[]).await;

    let b = 7_000_000u64;
    let (t1, kv, t2) = (
        [b, b + 1, b + 2],
        [b, b + 1, b + 3, b + 4],
        [b, b + 1, b + 3, b + 4, b + 5],
    );
    assert_eq!(session_turn(front, 1400, 300, &t1, &kv).await, 0, "cold");
    until(Duration::from_secs(15), || async {
        report(ph).await["counters"]["snapshot_finalized"] == 1
    })
    .await;
    let d = report(dh).await;
    assert_eq!(d["counters"]["snapshot_sync_attempts"], 1, "{d}");
    assert_eq!(d["counters"]["snapshot_sync_ok"], 1, "{d}");
    assert_eq!(d["engine"]["sessions_synced"], 1, "{d}");
    assert_eq!(d["engine"]["session_pages"], 4, "{d}");
    let p = report(ph).await;
    assert_eq!(p["snapshot"]["publish"], "host-tiers", "{p}");
    assert_eq!(p["snapshot"]["live"], 0, "{p}");
    assert_eq!(p["engine"]["tiers"]["snapshot_pages"], 4, "{p}");
    assert_eq!(
        p["engine"]["tiers"]["snapshot_pages_new"], 2,
        "the generated tokens' pages are new to L2: {p}"
    );

    // Turn 2: the session's 4 pages hit and are loaded; only the new page is computed.
    assert_eq!(session_turn(front, 2300, 4, &t2, &[]).await, 4 * 512);
    let p = report(ph).await;
    assert_eq!(
        p["counters"]["snapshot_hit_tokens"], 1024,
        "two of the four pages came with the snapshot: {p}"
    );
    assert_eq!(p["counters"]["snapshot_hit_requests"], 1, "{p}");
    // The prefill engine publishes its summary after each room (possibly just after the reply).
    until(Duration::from_secs(10), || async {
        report(ph).await["engine"]["engine_summary"]["rooms"] == 2
    })
    .await;
    let p = report(ph).await;
    let es = &p["engine"]["engine_summary"];
    assert_eq!(es["loaded_pages"], 4, "{p}");
    assert_eq!(
        es["loaded_chunks"], 32,
        "the prefill engine loaded and verified the 4 pages' 8 layers: {p}"
    );
    assert_eq!(es["loaded_corrupt_chunks"], 0, "{p}");
    assert_eq!(es["read_before_ready"], 0, "{p}");

    // Without sync the next turn recomputes the generated tokens' pages.
    let c = 8_000_000u64;
    session_turn(front, 1400, 300, &[c, c + 1, c + 2], &[]).await;
    assert_eq!(
        session_turn(front, 2300, 4, &[c, c + 1, c + 3, c + 4, c + 5], &[]).await,
        2 * 512
    );
    let d = report(dh).await;
    assert_eq!(d["counters"]["snapshot_sync_attempts"], 1, "{d}");
    assert_eq!(
        d["engine"]["engine_summary"]["decode"]["sessions_synced"], 1,
        "{d}"
    );
    assert_eq!(
        d["engine"]["engine_summary"]["decode"]["session_sync_errors"], 0,
        "{d}"
    );
}

/// The decode worker holds at most its budget of session pages in flight
/// (`TANDEM_DECODE_SNAPSHOT_SYNC_BUDGET_BYTES`): a session larger than the budget is refused at its
/// first SyncSession, before any page is copied, and the turn still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_beyond_the_sync_budget_is_refused_and_the_turn_still_answers() {
    let w = World::new(131);
    let budget = (2 * PAGE_BYTES).to_string();
    let (_procs, ph, dh, front) = sync_stack(
        &w,
        &[("TANDEM_DECODE_SNAPSHOT_SYNC_BUDGET_BYTES", &budget)],
        &[],
    )
    .await;
    let b = 9_000_000u64;
    session_turn(front, 1400, 300, &[b, b + 1, b + 2], &[b, b + 1, b + 3]).await;
    let d = report(dh).await;
    assert_eq!(d["engine"]["session_pages_refused"], 3, "{d}");
    assert_eq!(d["engine"]["session_pages"], 0, "{d}");
    assert_eq!(d["engine"]["sessions_synced"], 0, "{d}");
    assert_eq!(d["counters"]["snapshot_sync_attempts"], 0, "{d}");
    until(Duration::from_secs(10), || async {
        report(dh).await["engine"]["engine_summary"]["completed"] == 1
    })
    .await;
    let d = report(dh).await;
    assert_eq!(
        d["engine"]["engine_summary"]["decode"]["session_sync_errors"], 1,
        "{d}"
    );
    // A session within the budget syncs.
    let c = 9_100_000u64;
    session_turn(front, 600, 500, &[c, c + 1], &[c, c + 1]).await;
    until(Duration::from_secs(15), || async {
        report(ph).await["counters"]["snapshot_finalized"] == 1
    })
    .await;
    assert_eq!(report(dh).await["counters"]["snapshot_sync_ok"], 1);
}

/// Pages pair with the session's hashes by position, so a refused SyncSession ends the attempt's
/// hand-over — also one the decode side refuses before any hand-over (a page named twice). The
/// engine here ignores that refusal and hands the session over as if it had not happened: every
/// later call is refused, nothing is pushed, and the turn still answers. (Had the worker taken
/// them, an engine that skipped a refused batch would have had its next pages filed under the
/// skipped batch's hashes.)
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_sync_session_ends_the_hand_over_and_later_calls_are_refused() {
    let w = World::new(158);
    let (_procs, ph, dh, front) = sync_stack(&w, &[], &["--sync-page-twice-first"]).await;
    let b = 9_200_000u64;
    session_turn(
        front,
        1400,
        300,
        &[b, b + 1, b + 2],
        &[b, b + 1, b + 3, b + 4],
    )
    .await;
    until(Duration::from_secs(10), || async {
        report(dh).await["engine"]["engine_summary"]["completed"] == 1
    })
    .await;
    let d = report(dh).await;
    assert_eq!(d["engine"]["sessions_synced"], 0, "{d}");
    assert_eq!(d["engine"]["session_pages"], 0, "{d}");
    assert_eq!(d["counters"]["snapshot_sync_attempts"], 0, "{d}");
    assert_eq!(
        d["engine"]["engine_summary"]["decode"]["session_sync_errors"], 1,
        "the engine's hand-over after the refusal was refused: {d}"
    );
    let p = report(ph).await;
    assert_eq!(p["counters"]["snapshot_finalized"], 0, "{p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_own_kv_deadline_holds_on_the_engine_path() {
    let w = World::new(109);
    w.publish(&[2]);
    // The prefill engine takes ~2.4 s per 1200-token room.
    let (_p, _pe) = prefill_with_engine(&w, &["--prefill-us-per-token", "2000"]).await;
    let _d = w.spawn(9, &decode_config(&w), &[]);
    let _de = spawn_engine(&w, 9, &[], &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(30), || async {
        readyz(dh).await.0 == 200
    })
    .await;
    // Seed 004's probe: a KV deadline shorter than the prefill. The engine's room fails at it
    // (503 kv_deadline_exceeded, long before the prefill would be done) and its pages go to the
    // release gate.
    let mut body = completion(PROMPT, 2, false);
    body["kv_deadline_ms"] = 200.into();
    let sent = Instant::now();
    let (code, frames) = http(front, "POST", "/v1/completions", Some(body)).await;
    let took = sent.elapsed();
    let v: Value = serde_json::from_str(&text(&frames)).unwrap_or(Value::Null);
    assert_eq!(code, 503, "{v}");
    assert!(v.to_string().contains("kv_deadline_exceeded"), "{v}");
    assert!(took < Duration::from_millis(2000), "ended after {took:?}");
    until(Duration::from_secs(15), || async {
        let e = &report(dh).await["engine"];
        e["rooms_failed"] == 1 && e["rooms_open"] == 0
    })
    .await;
    // The worker's own deadline still lets a request without one through.
    let (code, v) = complete(front, 2).await;
    assert_eq!(code, 200, "{v}");
}
