//! LayerSplit through the engine API (DESIGN contract 6 and §3.1 "Snapshot and LayerSplit"; seed
//! 004; issue 15), with real worker processes and their simulated engines: two prefill pods of one
//! CP-2 group (`p-g0-0`, `p-g0-1`), each with its engine container (`tandem-worker sim-engine
//! --serve`), connect their rank link and agree on the owner map before any pool is allocated;
//! each worker then gives its engine a target pool of only its four of the model's eight layers
//! and a receive slot. A decode serves requests through the group: the leader takes the rooms, one
//! at a time; each engine goes through the layers in order — an owned layer is written, said
//! PagesReady, sent to the decode and broadcast (the pages in use only); another is awaited
//! (AwaitLayer) and read from the receive slot, every chunk verified — and the decode verifies
//! every chunk it received from both ranks.
//!
//! - the group serves: every response clean, each engine's receive-slot reads all verified, one
//!   wait per non-owned layer per request, the pool's pages 8/5 of a replicated pool's in the same
//!   bytes, broadcast bytes a sliver of a whole-layer broadcast, both ranks' layers in every page;
//! - NEGATIVE CONTROL (feature `negative-controls`, the engines' `--skip-layer-wait`): engines
//!   that read the receive slot without AwaitLayer read bytes that are not the layer's KV, and
//!   count them — while the decode, which gets each layer from its owner, still sees clean KV.

mod serve_support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::*;
use tandem_worker::memory::AllocatorDomain;

const LEADER: u8 = 2;
const MEMBER: u8 = 3;
const DECODE: u8 = 9;
const GROUP_SERVICE: &str = "p-peers.serving.svc";
const SOCKET_DIR: &str = "/run/tandem/engine";
/// One chunk: 512 tokens × 64 B (the serving tests' `TANDEM_SIM_KV_BYTES_PER_TOKEN=512` over 8
/// layers).
const CHUNK: u64 = 512 * 64;

fn rank_cfg(w: &World, rank_link: u16) -> WorkerConfig {
    let mut c = config(WorkerRole::Prefill, "r1", w.ports);
    c.parallelism.context = 2;
    c.layer_split = LayerSplit::contiguous(c.model.layers, 2);
    c.ports.rank_link = Some(rank_link);
    c.peers.group_service = Some(GROUP_SERVICE.into());
    c.memory.allocator = AllocatorDomain::SharedMemory;
    c.engine = Some(EngineSeat {
        kind: EngineKind::Simulated,
        socket_dir: SOCKET_DIR.into(),
        http_port: None,
    });
    c.check().expect("a valid LayerSplit prefill config");
    c
}

/// Starts both ranks at once (each start returns once its group connected and its pools exist).
fn start_group(w: &World, cfg: &WorkerConfig) -> [Proc; 2] {
    let start = |host: u8, pod: &'static str| {
        let json = serde_json::to_vec(cfg).unwrap();
        w.try_start_role(
            host,
            "prefill",
            CONFIG_FILE,
            &json,
            &[("POD_NAME", pod)],
            &[],
            Duration::from_secs(90),
        )
        .map(|(p, _)| p)
        .expect("a rank starts")
    };
    let start = &start;
    std::thread::scope(|s| {
        let a = s.spawn(move || start(LEADER, "p-g0-0"));
        let b = s.spawn(move || start(MEMBER, "p-g0-1"));
        [a.join().unwrap(), b.join().unwrap()]
    })
}

/// The engine container of the rank on `host` (pod ordinal `ordinal`), with `extra` arguments.
fn spawn_engine(w: &World, host: u8, ordinal: u32, extra: &[&str]) -> Proc {
    let child = Command::new(BIN)
        .args(["sim-engine", "--serve", "--socket-dir", SOCKET_DIR])
        .args(["--config", &format!("/etc/tandem/{CONFIG_FILE}")])
        .args(["--ordinal", &ordinal.to_string()])
        .args(["--attach-backoff-max-ms", "200"])
        .args(extra)
        .env("TANDEM_ROOT", w.root(host))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Proc(child)
}

async fn report(w: &World, host: u8) -> Value {
    get_json(w.addr(host, w.ports.health), "/report").await.1
}

async fn wait_ready(w: &World, host: u8) {
    let h = w.addr(host, w.ports.health);
    until(Duration::from_secs(30), || async {
        status(h, "/readyz").await == Some(200)
    })
    .await;
}

/// One request of `input` prompt tokens through the decode at `front`, with `extra` fields: its
/// status and body.
async fn complete(front: std::net::SocketAddr, n: u64, input: u32, extra: Value) -> (u16, Value) {
    let mut body = serde_json::json!({"model": "llama-3-8b", "prompt": "x", "max_tokens": 2,
        "input_tokens": input, "kv_block_hashes": [n * 100 + 1, n * 100 + 2, n * 100 + 3]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let (code, frames) = http(front, "POST", "/v1/completions", Some(body)).await;
    (
        code,
        serde_json::from_str(&text(&frames)).unwrap_or(Value::Null),
    )
}

/// [`complete`] that must answer 200: the decode's `tandem` section.
async fn send(front: std::net::SocketAddr, n: u64, input: u32) -> Value {
    let (code, v) = complete(front, n, input, Value::Null).await;
    assert_eq!(code, 200, "{v}");
    v["tandem"].clone()
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// What a served run left: both ranks' reports (after their engines published every room), the
/// decode's, the pages the requests held, and the corrupt chunks the decode saw.
struct Served {
    leader: Value,
    member: Value,
    decode: Value,
    pages: u64,
    corrupt_at_decode: u64,
}

/// A group of two with its engines (run with `engine_args`), a decode, and `requests` requests of
/// 1 to 4 pages, one after the other.
async fn serve(net: u8, engine_args: &[&str], requests: u64) -> Served {
    let w = World::new(net);
    w.publish_group(GROUP_SERVICE, LEADER, MEMBER);
    let cfg = rank_cfg(&w, w.free_port());
    let _ranks = start_group(&w, &cfg);
    let _engines = [
        spawn_engine(&w, LEADER, 0, engine_args),
        spawn_engine(&w, MEMBER, 1, engine_args),
    ];
    let _decode = w.spawn(DECODE, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    for host in [LEADER, MEMBER, DECODE] {
        wait_ready(&w, host).await;
    }
    // All at once: the leader queues them and runs one room at a time.
    let front = w.addr(DECODE, w.ports.front);
    let mut tasks = Vec::new();
    let mut pages = 0;
    for i in 0..requests {
        let input = 400 + (i as u32 % 4) * 512;
        pages += u64::from(input.div_ceil(512));
        tasks.push(tokio::spawn(send(front, i, input)));
    }
    let mut corrupt = 0;
    for t in tasks {
        corrupt += t.await.unwrap()["corrupt_chunks"].as_u64().unwrap();
    }
    // Every rank's engine published every room it computed.
    let end = Instant::now() + Duration::from_secs(15);
    let (leader, member) = loop {
        let (l, m) = (report(&w, LEADER).await, report(&w, MEMBER).await);
        let rooms = |r: &Value| r["engine"]["engine_summary"]["rooms"].as_u64().unwrap_or(0);
        if rooms(&l) == requests && rooms(&m) == requests {
            break (l, m);
        }
        assert!(Instant::now() < end, "engines' rooms: {l}\n{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    Served {
        leader,
        member,
        decode: report(&w, DECODE).await,
        pages,
        corrupt_at_decode: corrupt,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_split_group_of_engines_serves_each_layer_range_from_its_owner() {
    let requests = 8;
    let s = serve(161, &[], requests).await;
    let (l, m) = (&s.leader["cp_group"], &s.member["cp_group"]);
    println!("leader: {l}\nmember: {m}");
    assert_eq!(s.corrupt_at_decode, 0, "the decode verified every chunk");
    assert_eq!(n(&s.decode["counters"], "corrupt_pages_read"), 0);
    // Each page reached the decode whole: both ranks' four layers.
    assert_eq!(
        n(&s.decode["counters"], "kv_bytes_received"),
        s.pages * 8 * CHUNK,
        "{}",
        s.decode["counters"]
    );
    for (r, rank, owned) in [(l, 0, [0, 4]), (m, 1, [4, 8])] {
        assert_eq!(n(r, "cp_rank"), rank);
        assert_eq!(r["engine"], true, "{r}");
        assert_eq!(r["owned_layers"], serde_json::json!([owned]));
        assert_eq!(n(r, "steps"), requests, "{r}");
        assert_eq!(n(r, "step_failures"), 0, "{r}");
        // The pool holds four layers and the receive slot: 8/5 of a replicated pool's pages.
        assert_eq!(n(r, "page_bytes"), 5 * CHUNK, "{r}");
        assert_eq!(n(r, "replicated_page_bytes"), 8 * CHUNK, "{r}");
        assert_eq!(
            2 * n(r, "stored_kv_bytes"),
            n(r, "replicated_kv_bytes"),
            "{r}"
        );
        // One frame per owned layer per request to the one peer, the pages in use only.
        assert_eq!(n(r, "frames_sent"), 4 * requests, "{r}");
        assert_eq!(n(r, "broadcast_payload_bytes"), 4 * s.pages * CHUNK, "{r}");
        assert!(
            n(r, "broadcast_payload_bytes") * 20 < n(r, "whole_layer_broadcast_bytes"),
            "{r}"
        );
        // One wait per non-owned layer per request.
        assert_eq!(n(r, "waits"), 4 * requests, "{r}");
        assert!(!r["link_broken"].as_bool().unwrap(), "{r}");
    }
    assert_eq!(l["owner_map_digest"], m["owner_map_digest"]);
    for rank in [&s.leader, &s.member] {
        let e = &rank["engine"]["engine_summary"];
        assert_eq!(n(e, "layer_waits"), 4 * requests, "{e}");
        assert_eq!(n(e, "layer_chunks_read"), 4 * s.pages, "{e}");
        assert_eq!(n(e, "layer_corrupt_chunks"), 0, "{e}");
        assert_eq!(n(e, "layer_reads_before_ready"), 0, "{e}");
        assert!(
            !rank["config"]["unused"].to_string().contains("layerSplit"),
            "the Simulated engine's rank acts on layerSplit: {}",
            rank["config"]
        );
    }
    // Each rank wrote its own half of every page into the decode.
    assert_eq!(
        n(&s.leader["counters"], "kv_bytes_sent"),
        s.pages * 4 * CHUNK
    );
    assert_eq!(
        n(&s.member["counters"], "kv_bytes_sent"),
        s.pages * 4 * CHUNK
    );
    // The member is a group member at the decode, not a room peer.
    assert!(
        s.decode["group_member_peers"]
            .to_string()
            .contains(&format!("127.0.161.{MEMBER}")),
        "{}",
        s.decode
    );
}

/// NEGATIVE CONTROL: engines that read the receive slot without AwaitLayer read bytes that are
/// not the layer's KV (the worker writes a slot only when asked), and count them. The decode still
/// gets each layer from its owner.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_engines_that_skip_the_layer_wait_read_stale_kv() {
    let requests = 4;
    let s = serve(163, &["--skip-layer-wait"], requests).await;
    assert_eq!(s.corrupt_at_decode, 0);
    for rank in [&s.leader, &s.member] {
        let e = &rank["engine"]["engine_summary"];
        println!("NEGATIVE CONTROL engine: {e}");
        assert_eq!(n(e, "layer_waits"), 0, "{e}");
        assert_eq!(n(e, "layer_reads_before_ready"), 4 * s.pages, "{e}");
        assert_eq!(
            n(e, "layer_corrupt_chunks"),
            4 * s.pages,
            "stale KV went unseen: {e}"
        );
        assert_eq!(n(&rank["cp_group"], "waits"), 0);
    }
}

/// A group of two with slow engines (`us_per_token` of compute per prompt token, spread over the
/// layers) and a decode, ready: the processes (ranks, engines, decode) and the front door.
async fn slow_group(w: &World, us_per_token: &str) -> ([Proc; 2], [Proc; 2], Proc) {
    w.publish_group(GROUP_SERVICE, LEADER, MEMBER);
    let cfg = rank_cfg(w, w.free_port());
    let ranks = start_group(w, &cfg);
    let args = ["--prefill-us-per-token", us_per_token];
    let engines = [
        spawn_engine(w, LEADER, 0, &args),
        spawn_engine(w, MEMBER, 1, &args),
    ];
    let decode = w.spawn(
        DECODE,
        &config(WorkerRole::Decode, "r1", w.ports),
        &[("TANDEM_DECODE_KV_DEADLINE_MS", "60000")],
    );
    for host in [LEADER, MEMBER, DECODE] {
        wait_ready(w, host).await;
    }
    (ranks, engines, decode)
}

/// Waits until the member runs a step (its engine is computing a room).
async fn member_running(w: &World) {
    until(Duration::from_secs(20), || async {
        !report(w, MEMBER).await["cp_group"]["running_step"].is_null()
    })
    .await;
}

/// Neither rank nor the decode keeps a page: the ranks' sources all back with their engines, the
/// decode's pages free.
async fn nothing_held(w: &World) {
    until(Duration::from_secs(20), || async {
        let (l, m, d) = (
            report(w, LEADER).await,
            report(w, MEMBER).await,
            report(w, DECODE).await,
        );
        let k = &d["kv_pages"];
        [&l, &m]
            .iter()
            .all(|r| r["engine"]["rooms_open"] == 0 && r["engine"]["source_pages_held"] == 0)
            && k["free"] == k["total"]
            && k["quarantined"] == 0
    })
    .await;
}

/// A member's engine dies while the group computes a room: the member's room fails at once (its
/// engine detached), its `StepDone` fails the leader's room, and the request ends with an error
/// long before its 60 s KV deadline; no rank or decode keeps a page. A new engine attaches and the
/// group serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_engine_that_dies_mid_step_fails_the_room_and_a_new_one_serves() {
    let w = World::new(164);
    // 10 ms per token: a 1,000-token room computes for 10 s.
    let (_ranks, [_leader_engine, mut member_engine], _decode) = slow_group(&w, "10000").await;
    let front = w.addr(DECODE, w.ports.front);
    let request = tokio::spawn(complete(front, 1, 1000, Value::Null));
    member_running(&w).await;
    member_engine.0.kill().unwrap();
    let killed = Instant::now();
    let _ = member_engine.0.wait();
    let (code, v) = tokio::time::timeout(Duration::from_secs(30), request)
        .await
        .expect("the request hung after the member's engine died")
        .unwrap();
    assert_ne!(code, 200, "{v}");
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "the room failed {:?} after the kill (KV deadline 60 s)",
        killed.elapsed()
    );
    nothing_held(&w).await;
    let l = report(&w, LEADER).await;
    assert!(n(&l["cp_group"], "step_failures") >= 1, "{}", l["cp_group"]);
    assert!(!l["cp_group"]["link_broken"].as_bool().unwrap());
    // A new engine on the member's pool: the group serves again, every chunk clean.
    let _fresh = spawn_engine(&w, MEMBER, 1, &["--prefill-us-per-token", "0"]);
    wait_ready(&w, MEMBER).await;
    let t = send(front, 2, 700).await;
    assert_eq!(t["corrupt_chunks"], 0, "{t}");
}

/// The decode aborts a room mid-step (its KV deadline passes while the group computes it): the
/// leader tells the member (`StepAbort`), the member's room fails at once, the abort's ack leaves
/// once both ranks' writes are terminal, and no page is kept anywhere. The next room serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_the_decode_aborts_mid_step_stops_on_every_rank() {
    let w = World::new(166);
    let (_ranks, _engines, _decode) = slow_group(&w, "10000").await;
    let front = w.addr(DECODE, w.ports.front);
    // A 1,000-token room computes for 10 s; its KV deadline is 1.5 s.
    let sent = Instant::now();
    let (code, v) = complete(front, 1, 1000, serde_json::json!({"kv_deadline_ms": 1500})).await;
    assert_ne!(code, 200, "{v}");
    assert!(
        sent.elapsed() < Duration::from_secs(8),
        "{:?}",
        sent.elapsed()
    );
    // The member stopped its part when told, not at its own 30 s room deadline.
    until(Duration::from_secs(8), || async {
        n(&report(&w, MEMBER).await["cp_group"], "steps_aborted") >= 1
    })
    .await;
    nothing_held(&w).await;
    let l = report(&w, LEADER).await;
    assert!(n(&l["cp_group"], "steps_aborted") >= 1, "{}", l["cp_group"]);
    assert_eq!(report(&w, DECODE).await["counters"]["pages_quarantined"], 0);
    let t = send(front, 2, 300).await;
    assert_eq!(t["corrupt_chunks"], 0, "{t}");
}
