//! The serving path on the engine API (DESIGN §3.1, issue 13), through real processes: a prefill
//! worker whose config names an engine (`engine: Simulated`), `tandem-worker sim-engine --serve` as
//! its engine container (sharing the socket directory under the pod's `$TANDEM_ROOT`), and a decode
//! worker with its front door. The prefill computes nothing itself: each room the decode opens
//! becomes a PrefillWork, the engine writes the KV into the shared memfd pool and says PagesReady,
//! and the worker moves exactly those pages over TCP; the decode verifies every byte it receives.
//!
//! - requests through the front door succeed with 0 corrupt pages, and the prefill's `/report` and
//!   `/metrics` show the pools and the rooms served by the engine; the prefill is not ready before an
//!   engine attached, nor after it left;
//! - the engine started before its worker attaches once the worker is up; SIGKILLed with rooms in
//!   flight, every request ends with a reason well within its deadline, no decode page leaks, and a
//!   new engine serves again from the same pools;
//! - negative control (feature `negative-controls`): an engine that writes one wrong byte makes the
//!   decode count exactly one corrupt chunk — the check can fail.
//!
//! Each test has its own `127.0.<net>.x` addresses (nets 91–93).

mod serve_support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::{EngineKind, EngineSeat, WorkerConfig, WorkerRole};
use tandem_worker::memory::AllocatorDomain;
use tandem_worker::model::{Attention, ModelIdentity};

/// The engine socket directory as the pod mounts it (resolved under each process's `$TANDEM_ROOT`).
const SOCKET_DIR: &str = "/run/tandem/engine";
/// 1200 prompt tokens: 3 pages of 512 tokens.
const PROMPT: u32 = 1200;
/// One page: 512 tokens × 8 layers × 64 B per token and layer.
const PAGE_BYTES: u64 = 512 * 8 * 64;

/// 8 layers of 64 B per token and layer (2 × 1 head × 16 × 2 B): the geometry the shared
/// `TANDEM_SIM_KV_BYTES_PER_TOKEN=512` of the serving tests implies, so the engine's pool and the
/// decode's receive layout agree.
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

fn prefill_config(w: &World) -> WorkerConfig {
    let mut c = config(WorkerRole::Prefill, "r1", w.ports);
    c.model = model();
    with_engine(c)
}

/// `c` with a simulated engine beside the worker (pools need the shareable domain).
fn with_engine(mut c: WorkerConfig) -> WorkerConfig {
    c.memory.allocator = AllocatorDomain::SharedMemory;
    c.engine = Some(EngineSeat {
        kind: EngineKind::Simulated,
        socket_dir: SOCKET_DIR.into(),
        http_port: None,
    });
    c
}

fn decode_config(w: &World) -> WorkerConfig {
    let mut c = config(WorkerRole::Decode, "r1", w.ports);
    c.model = model();
    c
}

/// The prefill's config as written into its `$TANDEM_ROOT` (the engine container reads the same
/// file, as the operator mounts it in both containers).
fn write_prefill_config(w: &World, host: u8, cfg: &WorkerConfig) {
    let etc = w.root(host).join("etc/tandem");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::write(
        etc.join(tandem_worker::config::CONFIG_FILE),
        serde_json::to_vec(cfg).unwrap(),
    )
    .unwrap();
}

/// `tandem-worker sim-engine --serve` as the engine container of the prefill pod on `host` (killed
/// when dropped, so a failing test leaves no engine retrying its attach).
fn spawn_engine(w: &World, host: u8, extra: &[&str]) -> Proc {
    let child = Command::new(BIN)
        .args(["sim-engine", "--serve", "--socket-dir", SOCKET_DIR])
        .args([
            "--config",
            &format!("/etc/tandem/{}", tandem_worker::config::CONFIG_FILE),
        ])
        .args(["--ordinal", "0", "--attach-backoff-max-ms", "200"])
        .args(extra)
        .env("TANDEM_ROOT", w.root(host))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Proc(child)
}

/// Waits (bounded) for the engine to exit; returns its status and the summary line it printed.
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

/// One non-streaming completion; status and body.
async fn complete(front: std::net::SocketAddr, tokens: u32) -> (u16, Value) {
    let body = completion(tokens, 3, false);
    let (code, frames) = http(front, "POST", "/v1/completions", Some(body)).await;
    (
        code,
        serde_json::from_str(&text(&frames)).unwrap_or(Value::Null),
    )
}

/// Sends `SIGTERM` to an engine.
fn term(engine: &Proc) {
    engine.signal(libc::SIGTERM);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_served_by_the_engine_through_the_engine_api() {
    let w = World::new(91);
    w.publish(&[2]);
    // llama-3-8b (4 KiB per token and layer), scaled by the serving tests' shared
    // `TANDEM_SIM_KV_BYTES_PER_TOKEN=512` to 64 B rows in the engine's pool, as in the decode.
    let pcfg = with_engine(config(WorkerRole::Prefill, "r1", w.ports));
    let p = w.spawn(2, &pcfg, &[]);
    let ph = w.addr(2, w.ports.health);

    // Pools allocated and visible at start; not ready before an engine attached.
    let (code, body) = readyz(ph).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("engine not attached"), "{body}");
    let m = metrics(ph).await;
    assert!(
        m.contains(r#"tandem_engine_pool_bytes{pool="target",domain="SharedMemory"} 67108864"#),
        "{m}"
    );
    assert!(
        m.contains(r#"tandem_engine_pool_registered{pool="target",state="none"} 1"#),
        "{m}"
    );
    assert!(m.contains("tandem_engine_attached 0"), "{m}");
    let r = report(ph).await;
    assert_eq!(r["ready"], false);
    assert_eq!(r["reason"], "engine not attached");
    assert_eq!(r["engine"]["kind"], "Simulated");
    assert_eq!(r["engine"]["attached"], false);
    assert_eq!(r["engine"]["pools"][0]["pool"], "target");
    assert_eq!(r["engine"]["pools"][0]["domain"], "SharedMemory");
    assert_eq!(r["engine"]["pools"][0]["bytes"], 64 << 20);

    // The engine attaches: ready.
    let engine = spawn_engine(&w, 2, &[]);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    assert!(metrics(ph).await.contains("tandem_engine_attached 1"));

    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(dh, "/readyz").await == Some(200)
    })
    .await;

    // Requests through the front door: served, every byte verified.
    const N: u64 = 5;
    let mut tasks = Vec::new();
    for _ in 0..N {
        tasks.push(tokio::spawn(complete(front, PROMPT)));
    }
    for t in tasks {
        let (code, v) = t.await.unwrap();
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
        assert_eq!(v["tandem"]["kv_bytes"], 3 * PAGE_BYTES);
    }
    let dr = report(dh).await;
    assert_eq!(dr["counters"]["requests_ok"], N);
    assert_eq!(dr["counters"]["corrupt_pages_read"], 0);
    assert_eq!(dr["counters"]["kv_bytes_received"], N * 3 * PAGE_BYTES);
    // The prefill's rooms were computed by the engine: sent, none failed, no page held.
    until(Duration::from_secs(10), || async {
        report(ph).await["engine"]["rooms_open"] == 0
    })
    .await;
    let pr = report(ph).await;
    let e = &pr["engine"];
    assert_eq!(e["attached"], true, "{pr}");
    assert_eq!(e["attaches"], 1);
    assert_eq!(e["rooms_submitted"], N, "{pr}");
    assert_eq!(e["rooms_sent"], N, "{pr}");
    assert_eq!(e["rooms_failed"], 0, "{pr}");
    assert_eq!(e["writes"], 2 * N, "two layer halves per room");
    assert_eq!(e["source_pages_held"], 0);
    assert_eq!(
        e["pages_freed"],
        3 * N,
        "every source page came back to the engine"
    );
    assert_eq!(pr["counters"]["kv_bytes_sent"], N * 3 * PAGE_BYTES);
    assert_eq!(pr["counters"]["requests_ok"], N);
    let m = metrics(ph).await;
    assert!(
        m.contains(&format!("tandem_engine_rooms_sent_total {N}")),
        "{m}"
    );

    // SIGTERM: the engine detaches and exits 0; the worker is not ready again, with the reason.
    term(&engine);
    let (st, summary) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {summary}");
    assert_eq!(summary["role"], "prefill");
    assert_eq!(summary["rooms"], N);
    assert_eq!(summary["attaches"], 1);
    assert_eq!(summary["pages_ready_calls"], 2 * N);
    until(Duration::from_secs(10), || async {
        let (code, body) = readyz(ph).await;
        code == 503 && body.contains("engine not attached")
    })
    .await;
    // Without an engine the room is refused at once, with the reason: the request fails fast.
    let sent = Instant::now();
    let (code, v) = complete(front, PROMPT).await;
    assert_ne!(code, 200, "{v}");
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "{:?}",
        sent.elapsed()
    );
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_fails_its_rooms_within_the_deadline_and_a_new_one_serves() {
    let w = World::new(92);
    w.publish(&[2]);
    // The engine container starts first: it retries until its worker is up.
    write_prefill_config(&w, 2, &prefill_config(&w));
    let mut slow = spawn_engine(&w, 2, &["--prefill-us-per-token", "20000"]);
    let _p = w.spawn(2, &prefill_config(&w), &[]);
    let ph = w.addr(2, w.ports.health);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    let _d = w.spawn(
        9,
        &decode_config(&w),
        &[("TANDEM_DECODE_KV_DEADLINE_MS", "60000")],
    );
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(dh, "/readyz").await == Some(200)
    })
    .await;

    // Two requests whose rooms the (slow: 30 s per room) engine is computing. They share their
    // prefix: neither may load the other's pages before they are computed (CI stop 32: the second
    // room did, and answered 200 before the kill).
    let mut tasks = Vec::new();
    for _ in 0..2 {
        tasks.push(tokio::spawn(complete(front, PROMPT)));
    }
    until(Duration::from_secs(20), || async {
        report(ph).await["engine"]["rooms_submitted"]
            .as_u64()
            .unwrap_or(0)
            >= 2
    })
    .await;

    // SIGKILL: no Detach; the worker sees the pools connection close.
    slow.0.kill().unwrap();
    let killed = Instant::now();
    let _ = slow.0.wait();
    for t in tasks {
        let (code, v) = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("a request hung after its engine died")
            .unwrap();
        assert_ne!(code, 200, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
    }
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "the rooms failed {:?} after the kill (KV deadline 60 s)",
        killed.elapsed()
    );
    until(Duration::from_secs(10), || async {
        let (code, body) = readyz(ph).await;
        code == 503 && body.contains("engine not attached")
    })
    .await;
    // Both rooms failed on the prefill (none sent), and nothing of them is held any more.
    until(Duration::from_secs(10), || async {
        let e = report(ph).await["engine"].clone();
        e["rooms_failed"].as_u64().unwrap_or(0) >= 2
            && e["rooms_open"] == 0
            && e["source_pages_held"] == 0
    })
    .await;
    assert_eq!(report(ph).await["engine"]["rooms_sent"], 0);
    // No decode page leaks: every page of the failed rooms came back through the gate.
    until(Duration::from_secs(15), || async {
        let k = &report(dh).await["kv_pages"];
        k["free"] == k["total"] && k["quarantined"] == 0
    })
    .await;

    // A new engine attaches to the same pools and serves.
    let fresh = spawn_engine(&w, 2, &["--prefill-us-per-token", "0"]);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    let (code, v) = complete(front, PROMPT).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0);
    assert_eq!(report(ph).await["engine"]["attaches"], 2);
    term(&fresh);
    let (st, summary) = engine_exit(fresh, Duration::from_secs(20));
    assert!(st.success(), "{st:?} {summary}");
    assert_eq!(summary["rooms"], 1);
}

#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_an_engine_writing_one_wrong_byte_is_caught_by_the_decode() {
    let w = World::new(93);
    w.publish(&[2]);
    let _p = w.spawn(2, &prefill_config(&w), &[]);
    let ph = w.addr(2, w.ports.health);
    write_prefill_config(&w, 2, &prefill_config(&w));
    let engine = spawn_engine(&w, 2, &["--corrupt-one-byte"]);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    let _d = w.spawn(9, &decode_config(&w), &[]);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(dh, "/readyz").await == Some(200)
    })
    .await;
    let (code, v) = complete(front, PROMPT).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 1, "{v}");
    let (code, v) = complete(front, PROMPT).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        v["tandem"]["corrupt_chunks"], 0,
        "only the first chunk was wrong: {v}"
    );
    assert_eq!(report(dh).await["counters"]["corrupt_pages_read"], 1);
    term(&engine);
    let (st, _) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_engine_the_prefill_computes_with_its_built_in_engine_and_says_so() {
    let w = World::new(94);
    w.publish(&[2]);
    let mut cfg = config(WorkerRole::Prefill, "r1", w.ports);
    cfg.model = model();
    let _p = w.spawn(2, &cfg, &[]);
    let ph = w.addr(2, w.ports.health);
    until(Duration::from_secs(15), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    let r = report(ph).await;
    assert_eq!(r["engine"], serde_json::json!({"kind": "builtin"}), "{r}");
    assert!(
        !metrics(ph).await.contains("tandem_engine_"),
        "no engine metrics without an engine"
    );
}

/// Seed 000 through the serving path: with a Standalone CacheTier client, the engine's pool is carved
/// from the store-client sidecar's memfd segment and registered with it (COMMITTED, visible in
/// `/metrics` and `/report`); the engine maps that same segment and the requests are served from
/// it; SIGTERM tears the worker down (deregistration inside the sidecar is covered by
/// `engine_api_standalone`, which counts the sidecar's registrations of its own connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_pools_live_in_the_sidecar_segment_and_are_registered() {
    use tandem_worker::config::{CONFIG_FILE, CacheConfig, WritePolicy};
    use tandem_worker::store_client::ClientMode;
    let w = World::new(95);
    w.publish(&[2]);
    let mut cfg = prefill_config(&w);
    cfg.memory.client_mode = Some(ClientMode::Standalone);
    cfg.cache = Some(CacheConfig {
        tier: "l3".into(),
        service: "l3-store.serving.svc".into(),
        replicas: 1,
        page_tokens: 512,
        write_policy: WritePolicy::WriteThrough,
    });
    // The sidecar of the pod (same $TANDEM_ROOT, so the same /dev/shm socket).
    let (_sidecar, _socket) = w.start_role(
        2,
        "store-client",
        CONFIG_FILE,
        &serde_json::to_vec(&cfg).unwrap(),
        &[],
        &["--backend", "memfd"],
    );
    // No scaling knob on either side: the pool's rows are the model's own 64 B.
    let unscaled = [("TANDEM_SIM_KV_BYTES_PER_TOKEN", "")];
    let mut p = w.spawn(2, &cfg, &unscaled);
    let ph = w.addr(2, w.ports.health);
    let m = metrics(ph).await;
    assert!(
        m.contains(r#"tandem_engine_pool_registered{pool="target",state="committed"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"tandem_registration_commits_total{role="target"} 1"#),
        "{m}"
    );
    let r = report(ph).await;
    assert_eq!(r["engine"]["pools"][0]["registration"], "committed", "{r}");

    let engine = spawn_engine(&w, 2, &[]);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    let _d = w.spawn(9, &decode_config(&w), &unscaled);
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(dh, "/readyz").await == Some(200)
    })
    .await;
    for _ in 0..2 {
        let (code, v) = complete(front, PROMPT).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    }
    assert_eq!(report(ph).await["engine"]["rooms_sent"], 2);

    // Teardown: the engine leaves, the worker drains, deregisters and exits 0.
    term(&engine);
    let (st, _) = engine_exit(engine, Duration::from_secs(20));
    assert!(st.success());
    p.signal(libc::SIGTERM);
    let st = p.wait_exit(Duration::from_secs(30)).expect("prefill exits");
    assert!(st.success(), "{st:?}");
    // The teardown ran in contract 9's order, every step done; the pools deregistered last.
    w.assert_clean_teardown(
        2,
        &[
            "StopAdmission",
            "DrainRooms",
            "DrainRooms",
            "FreeTransferHandles",
            "DestroyTransports",
            "DestroyTransports",
            "FreeMemory",
        ],
    );
}

/// An engine that never answers: the room fails with a reason at its deadline (the decode's KV
/// deadline, which the open carries), the request ends with an error instead of hanging, and no
/// page stays held on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_the_engine_never_produces_fails_at_its_deadline() {
    let w = World::new(96);
    w.publish(&[2]);
    let _p = w.spawn(2, &prefill_config(&w), &[]);
    let ph = w.addr(2, w.ports.health);
    // 20 ms per token: a 3-page room takes 30 s, far past the 1.5 s KV deadline.
    let engine = spawn_engine(&w, 2, &["--prefill-us-per-token", "20000"]);
    until(Duration::from_secs(30), || async {
        readyz(ph).await.0 == 200
    })
    .await;
    let _d = w.spawn(
        9,
        &decode_config(&w),
        &[
            ("TANDEM_DECODE_KV_DEADLINE_MS", "1500"),
            ("TANDEM_DECODE_RETRY_BUDGET", "0"),
        ],
    );
    let (dh, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(dh, "/readyz").await == Some(200)
    })
    .await;
    let sent = Instant::now();
    let (code, v) = tokio::time::timeout(Duration::from_secs(15), complete(front, PROMPT))
        .await
        .expect("the request hung past its deadline");
    assert_ne!(code, 200, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "{:?}",
        sent.elapsed()
    );
    until(Duration::from_secs(10), || async {
        let e = report(ph).await["engine"].clone();
        e["rooms_failed"] == 1 && e["rooms_open"] == 0 && e["source_pages_held"] == 0
    })
    .await;
    until(Duration::from_secs(15), || async {
        let k = &report(dh).await["kv_pages"];
        k["free"] == k["total"] && k["quarantined"] == 0
    })
    .await;
    // The engine is still attached (it is only slow): the worker stays ready.
    assert_eq!(readyz(ph).await.0, 200);
    drop(engine);
}
