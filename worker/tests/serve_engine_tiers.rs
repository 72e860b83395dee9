//! The tier calls on the engine's serving path (DESIGN §3.1 "Tiers", contracts 5 and 7; issue 13),
//! through real processes: a prefill worker with an engine (`engine: Simulated`) and a CacheTier,
//! `tandem-worker sim-engine --serve` as its engine container, a `tandem-worker cache` replica and a
//! decode worker with its front door.
//!
//! - a repeated prefix is loaded from L2 (real bytes, copied into the engine's pages with one
//!   `LayerLoaded` per layer that the engine waits on, every loaded chunk verified); after the
//!   prefill and its engine restart (L2 empty, no loadback), from L3 — the replica's objects,
//!   loaded into pages and verified — then from L2 again; 0 corrupt, 0 read before ready; metrics
//!   `tandem_engine_load_*` and `/report.engine.tiers` say the same;
//! - negative controls (feature `negative-controls`): a worker whose loads send their events without
//!   copying makes the engine's loaded-bytes check fail; an engine that reads before the events
//!   counts reads before ready; an engine that computes its hits again instead of loading them
//!   (`--regenerate-hits`) loads no page;
//! - a load that fails partway (the engine asks for a page past its hits) is read only where it
//!   wrote; the negative control reads past its coverage and counts the unwritten page corrupt.
//!
//! Each test has its own `127.0.<net>.x` addresses (nets 111–114, 118, 119).

mod serve_support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::*;
use tandem_worker::memory::AllocatorDomain;
use tandem_worker::store_client::ClientMode;

/// The engine socket directory as the pod mounts it (resolved under each process's `$TANDEM_ROOT`).
const SOCKET_DIR: &str = "/run/tandem/engine";
/// Layers of the KV layout the serving tests' `TANDEM_SIM_KV_BYTES_PER_TOKEN=512` implies.
const LAYERS: u64 = 8;

/// A prefill with an engine beside it and, when `l3`, a write-through CacheTier.
fn prefill(w: &World, l3: bool) -> WorkerConfig {
    let mut c = config(WorkerRole::Prefill, "r1", w.ports);
    c.memory.allocator = AllocatorDomain::SharedMemory;
    c.memory.client_mode = l3.then_some(ClientMode::Embedded);
    c.engine = Some(EngineSeat {
        kind: EngineKind::Simulated,
        socket_dir: SOCKET_DIR.into(),
        http_port: None,
    });
    // Without a tier: L2 only, pages of the default 512 tokens (the trace blocks).
    c.cache = l3.then(|| CacheConfig {
        tier: "l3".into(),
        service: L3_SERVICE.into(),
        replicas: 1,
        page_tokens: 512,
        write_policy: WritePolicy::WriteThrough,
    });
    c
}

/// `tandem-worker sim-engine --serve` as the engine container of the prefill pod on `host`.
fn spawn_engine(w: &World, host: u8, extra: &[&str]) -> Proc {
    let child = Command::new(BIN)
        .args(["sim-engine", "--serve", "--socket-dir", SOCKET_DIR])
        .args(["--config", &format!("/etc/tandem/{CONFIG_FILE}")])
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

/// SIGTERM, then (bounded) the engine's exit status and the summary line it printed.
fn stop_engine(mut engine: Proc) -> (std::process::ExitStatus, Value) {
    engine.signal(libc::SIGTERM);
    let status = engine
        .wait_exit(Duration::from_secs(20))
        .expect("the engine exits within 20 s of SIGTERM");
    let mut out = String::new();
    use std::io::Read;
    engine
        .0
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

fn request(hashes: &[u64]) -> Value {
    serde_json::json!({"prompt": "x", "max_tokens": 1, "input_tokens": 1536,
        "kv_block_hashes": hashes})
}

/// One request through the front door: its (L2, L3) prefix hit tokens; 200 and 0 corrupt asserted.
async fn hits(w: &World, hashes: &[u64]) -> (u64, u64) {
    let (code, frames) = http(
        w.addr(9, w.ports.front),
        "POST",
        "/v1/completions",
        Some(request(hashes)),
    )
    .await;
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    let h = &v["tandem"]["prefix_hit_tokens"];
    (h["l2"].as_u64().unwrap(), h["l3"].as_u64().unwrap())
}

async fn wait_ready(w: &World, host: u8) {
    let h = w.addr(host, w.ports.health);
    until(Duration::from_secs(30), || async {
        status(h, "/readyz").await == Some(200)
    })
    .await;
}

async fn report(w: &World, host: u8) -> Value {
    get_json(w.addr(host, w.ports.health), "/report").await.1
}

async fn metrics(w: &World, host: u8) -> String {
    text(
        &http(w.addr(host, w.ports.health), "GET", "/metrics", None)
            .await
            .1,
    )
}

/// Waits (bounded) until the prefill's `/report` satisfies `ok`; returns that report.
async fn report_until(w: &World, host: u8, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let r = report(w, host).await;
        if ok(&r) {
            return r;
        }
        assert!(Instant::now() < end, "{what}: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_loads_prefixes_from_l2_then_from_l3_after_a_restart() {
    let w = World::new(111);
    w.publish_names(&[(SERVICE, &[2]), (L3_SERVICE, &[5])]);
    let pcfg = prefill(&w, true);
    let _cache = w.spawn_cache(5, &tier(&w, &pcfg));
    wait_ready(&w, 5).await;
    let mut p = w.spawn(2, &pcfg, &[]);
    let engine = spawn_engine(&w, 2, &[]);
    wait_ready(&w, 2).await;
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 9).await;

    assert_eq!(hits(&w, &[101, 102, 103]).await, (0, 0), "cold");
    assert_eq!(
        hits(&w, &[101, 102, 103]).await,
        (1536, 0),
        "whole prompt from L2"
    );
    assert_eq!(
        hits(&w, &[101, 102, 999]).await,
        (1024, 0),
        "shared prefix of two pages"
    );
    let pr = report_until(
        &w,
        2,
        "4 pages written through to L3, the engine's 3 rooms published",
        |r| r["counters"]["l3_pages_written"] == 4 && r["engine"]["engine_summary"]["rooms"] == 3,
    )
    .await;
    let t = &pr["engine"]["tiers"];
    assert_eq!(t["pages_stored"], 4, "{pr}");
    assert_eq!(t["pages_loaded"]["l2"], 5, "{pr}");
    assert_eq!(t["pages_loaded"]["l3"], 0, "{pr}");
    assert_eq!(t["bytes_loaded"]["l2"], 5 * 512 * 512, "{pr}");
    assert_eq!(t["load_waits"], 2 * LAYERS, "one event per layer per load");
    assert_eq!(t["read_before_ready"], 0);
    assert_eq!(t["corrupt_objects"], 0);
    assert_eq!(t["loads_failed"], 0);
    assert_eq!(pr["counters"]["prefix_hit_tokens_l2"], 2560, "{pr}");
    // The engine's own figures, as it publishes them beside its socket.
    let es = &pr["engine"]["engine_summary"];
    assert_eq!(es["loaded_pages"], 5, "{pr}");
    assert_eq!(es["loaded_corrupt_chunks"], 0, "{pr}");
    assert_eq!(es["read_before_ready"], 0, "{pr}");
    assert_eq!(pr["engine"]["registration"]["quarantined"], 0, "{pr}");
    let m = metrics(&w, 2).await;
    assert!(
        m.contains(r#"tandem_engine_load_pages_total{tier="l2"} 5"#),
        "{m}"
    );
    assert!(
        m.contains(&format!("tandem_engine_load_waits_total {}", 2 * LAYERS)),
        "{m}"
    );
    assert!(
        m.contains("tandem_engine_load_read_before_ready_total 0"),
        "{m}"
    );
    let (st, s) = stop_engine(engine);
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["loaded_pages"], 5, "{s}");
    assert_eq!(s["loaded_chunks"], 5 * LAYERS, "{s}");
    assert_eq!(s["loaded_corrupt_chunks"], 0, "{s}");
    assert_eq!(s["load_waits"], 2 * LAYERS, "{s}");
    assert_eq!(s["read_before_ready"], 0, "{s}");
    assert_eq!(s["stored_pages"], 4, "{s}");

    // The prefill restarts without loadback: L2 is empty; the pages come from the replica.
    p.signal(libc::SIGTERM);
    assert!(
        p.wait_exit(Duration::from_secs(15))
            .expect("prefill exits")
            .success()
    );
    // Its teardown released every resource (the L2 flush, the transport, the engine's pool).
    let (ok, steps) = w.teardown_of(2);
    assert!(ok, "{steps:?}");
    let _p = w.spawn(2, &pcfg, &[("TANDEM_L3_LOADBACK_PAGES", "0")]);
    let engine = spawn_engine(&w, 2, &[]);
    wait_ready(&w, 2).await;
    let front = w.addr(9, w.ports.front);
    until(Duration::from_secs(15), || async {
        http(front, "POST", "/v1/completions", Some(request(&[7])))
            .await
            .0
            == 200
    })
    .await;
    assert_eq!(
        hits(&w, &[101, 102, 103]).await,
        (0, 1536),
        "whole prompt from L3"
    );
    assert_eq!(
        hits(&w, &[101, 102, 103]).await,
        (1536, 0),
        "and now from L2"
    );
    let pr = report(&w, 2).await;
    let t = &pr["engine"]["tiers"];
    assert_eq!(t["pages_loaded"]["l3"], 3, "{pr}");
    assert_eq!(t["bytes_loaded"]["l3"], 3 * 512 * 512, "{pr}");
    assert_eq!(t["pages_loaded"]["l2"], 3, "{pr}");
    assert_eq!(t["pages_loaded_from_l3_bytes"], 6, "{pr}");
    assert_eq!(t["read_before_ready"], 0);
    let m = metrics(&w, 2).await;
    assert!(
        m.contains(r#"tandem_engine_load_pages_total{tier="l3"} 3"#),
        "{m}"
    );
    let (st, s) = stop_engine(engine);
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["loaded_pages"], 6, "{s}");
    assert_eq!(s["loaded_corrupt_chunks"], 0, "{s}");
    assert_eq!(s["read_before_ready"], 0, "{s}");
}

/// Two rooms with one prefix computed at the same time: neither loads the other's pages, which
/// are not computed yet — the engine stores a room's pages only once its compute time has passed
/// (before, the second room loaded the first's pages and finished at once: CI stop 32). The next
/// turn after them loads the whole prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_room_computed_at_the_same_time_loads_nothing_not_yet_computed() {
    let w = World::new(157);
    w.publish(&[2]);
    let pcfg = prefill(&w, false);
    let _p = w.spawn(2, &pcfg, &[]);
    // 5 ms per token: 7.7 s per 1,536-token room.
    let engine = spawn_engine(&w, 2, &["--prefill-us-per-token", "5000"]);
    wait_ready(&w, 2).await;
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 9).await;
    let (a, b) = tokio::join!(
        hits(&w, &[501, 502, 503]),
        // Sent once the first room's Lookup was answered (the engine computes both at once).
        async {
            report_until(&w, 2, "the first room looked up", |r| {
                r["engine"]["tiers"]["lookups"].as_u64().unwrap_or(0) >= 1
            })
            .await;
            hits(&w, &[501, 502, 503]).await
        }
    );
    assert_eq!((a, b), ((0, 0), (0, 0)), "neither room loads a page");
    let pr = report(&w, 2).await;
    assert_eq!(pr["engine"]["tiers"]["pages_loaded"]["l2"], 0, "{pr}");
    assert_eq!(hits(&w, &[501, 502, 503]).await, (1536, 0), "the next turn");
    let (st, s) = stop_engine(engine);
    assert!(st.success(), "{st:?} {s}");
    assert_eq!(s["loaded_pages"], 3, "{s}");
    assert_eq!(s["loaded_corrupt_chunks"], 0, "{s}");
    assert_eq!(s["store_failures"], 0, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_load_that_does_not_copy_fails_the_loaded_bytes_check() {
    let w = World::new(112);
    w.publish(&[2]);
    let pcfg = prefill(&w, false);
    let _p = w.spawn(2, &pcfg, &[("TANDEM_NC_TIERS_SKIP_COPY", "1")]);
    let engine = spawn_engine(&w, 2, &[]);
    wait_ready(&w, 2).await;
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 9).await;
    assert_eq!(hits(&w, &[201, 202, 203]).await, (0, 0));
    assert_eq!(hits(&w, &[201, 202, 203]).await, (1536, 0));
    let (_, s) = stop_engine(engine);
    assert_eq!(s["loaded_pages"], 3, "{s}");
    assert_eq!(
        s["loaded_corrupt_chunks"],
        3 * LAYERS,
        "every chunk of a load that copied nothing fails: {s}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_an_engine_that_skips_the_layer_wait_reads_before_ready() {
    let w = World::new(113);
    w.publish(&[2]);
    let pcfg = prefill(&w, false);
    let _p = w.spawn(2, &pcfg, &[]);
    let engine = spawn_engine(&w, 2, &["--skip-load-wait"]);
    wait_ready(&w, 2).await;
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 9).await;
    assert_eq!(hits(&w, &[301, 302, 303]).await, (0, 0));
    assert_eq!(hits(&w, &[301, 302, 303]).await, (1536, 0));
    let (_, s) = stop_engine(engine);
    assert_eq!(s["read_before_ready"], LAYERS, "{s}");
}

/// Negative control of the loaded-bytes check (the stack-level one is e2e/tests/stack_negative.rs):
/// an engine that serves its hits by computing them again gets the same hits and correct KV, but
/// loads nothing — the engine's `loaded_pages` and the worker's `pages_loaded` stay 0, so a check
/// that loaded bytes were verified fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_an_engine_that_regenerates_hits_loads_no_byte() {
    let w = World::new(114);
    w.publish(&[2]);
    let pcfg = prefill(&w, false);
    let _p = w.spawn(2, &pcfg, &[]);
    let engine = spawn_engine(&w, 2, &["--regenerate-hits"]);
    wait_ready(&w, 2).await;
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 9).await;
    assert_eq!(hits(&w, &[401, 402, 403]).await, (0, 0));
    assert_eq!(hits(&w, &[401, 402, 403]).await, (1536, 0), "the hits");
    let pr = report(&w, 2).await;
    let t = &pr["engine"]["tiers"];
    assert_eq!(t["pages_loaded"]["l2"], 0, "{t}");
    assert_eq!(t["loads"], 0, "{t}");
    let (_, s) = stop_engine(engine);
    assert_eq!(s["loaded_pages"], 0, "{s}");
    assert!(s["lookups"].as_u64().unwrap_or(0) >= 2, "{s}");
    assert_eq!(
        s["stored_pages"], 6,
        "the hit pages were computed and stored again: {s}"
    );
}

/// A load that fails partway (issue 13: the full-trace run's "corrupt loaded chunks"): the engine
/// asks for one page past its Lookup's hits (`--load-beyond-hit`, a page evicted between Lookup
/// and Load), the worker's fetch of that page fails, so it copies the two leading pages, sends
/// every `LayerLoaded` saying it covers 2 pages, then `LoadFailed{pages_loaded: 2}`. The engine
/// reads only the covered pages (0 corrupt), keeps the 2 loaded pages, computes and stores the
/// third, and the request completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_fails_partway_is_read_only_where_it_wrote() {
    let (s, t) = partial_load(118, &[]).await;
    assert_eq!(s["load_failures"], 1, "{s}");
    assert_eq!(s["loaded_pages"], 2, "{s}");
    assert_eq!(s["loaded_chunks"], 2 * LAYERS, "{s}");
    assert_eq!(s["loaded_corrupt_chunks"], 0, "{s}");
    assert_eq!(s["read_before_ready"], 0, "{s}");
    assert_eq!(
        s["stored_pages"], 4,
        "3 cold pages and the one the load missed: {s}"
    );
    assert_eq!(t["loads_failed"], 1, "{t}");
    assert_eq!(t["pages_loaded"]["l2"], 2, "{t}");
    assert_eq!(t["load_waits"], LAYERS, "{t}");
}

/// Negative control of the coverage rule: the same partial load, read by an engine that ignores
/// what each `LayerLoaded` covers (`--ignore-load-coverage`), verifies the page the failed fetch
/// never wrote — one corrupt chunk per layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_reading_past_a_partial_loads_coverage_reads_unwritten_pages() {
    let (s, _) = partial_load(119, &["--ignore-load-coverage"]).await;
    assert_eq!(s["load_failures"], 1, "{s}");
    assert_eq!(s["loaded_chunks"], 3 * LAYERS, "{s}");
    assert_eq!(s["loaded_corrupt_chunks"], LAYERS, "{s}");
}

/// A prefill (L2 only) with an engine run with `--load-beyond-hit` and `extra`: a cold request,
/// then one sharing its first two pages. Returns the engine's summary and the worker's
/// `/report.engine.tiers`.
async fn partial_load(net: u8, extra: &[&str]) -> (Value, Value) {
    let w = World::new(net);
    w.publish(&[2]);
    let pcfg = prefill(&w, false);
    let _p = w.spawn(2, &pcfg, &[]);
    let mut args = vec!["--load-beyond-hit"];
    args.extend_from_slice(extra);
    let engine = spawn_engine(&w, 2, &args);
    wait_ready(&w, 2).await;
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 9).await;
    let (code, frames) = http(
        w.addr(9, w.ports.front),
        "POST",
        "/v1/completions",
        Some(request(&[501, 502, 503])),
    )
    .await;
    assert_eq!(code, 200, "{}", text(&frames));
    let (code, frames) = http(
        w.addr(9, w.ports.front),
        "POST",
        "/v1/completions",
        Some(request(&[501, 502, 599])),
    )
    .await;
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(code, 200, "the request survives the failed load: {v}");
    let pr = report_until(&w, 2, "the engine's 2 rooms published", |r| {
        r["engine"]["engine_summary"]["rooms"] == 2
    })
    .await;
    let (st, s) = stop_engine(engine);
    assert!(st.success(), "{st:?} {s}");
    (s, pr["engine"]["tiers"].clone())
}
