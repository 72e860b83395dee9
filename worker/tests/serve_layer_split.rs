//! LayerSplit on the serving path (DESIGN contract 6, seed 004, issue 15), with real worker
//! processes: two prefill pods of one CP-2 group (`p-g0-0`, `p-g0-1`) find each other by pod DNS
//! under `peers.groupService`, connect the rank link and agree on the owner map; each stores only
//! its four of the model's eight layers. A decode serves requests through the group: the leader
//! takes the rooms, every rank runs the layer loop (the owner broadcasts a layer's pages in use,
//! the other waits on the layer's event), and each rank writes its own layers into the decode's
//! pages — the decode verifies every chunk it received.
//!
//! - the group serves: every response clean, per-rank KV bytes half the replicated layout's,
//!   broadcast bytes a small fraction of a whole-layer broadcast, 0 corrupt chunks read, the
//!   member's written KV bytes equal to the leader's (each wrote its half of every page), the
//!   member kept out of the decode's room peers;
//! - the baseline, a replicated CP group (every rank stores every layer): nothing broadcast, the
//!   leader writes whole pages, as clean;
//! - ranks on different owner maps refuse each other at connect: neither starts;
//! - NEGATIVE CONTROL (feature `negative-controls`, `TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1`):
//!   ranks that attend without waiting on the layer's event read bytes that are not the layer's
//!   KV, and the engine reports corrupt chunks.

mod serve_support;

use std::time::Duration;

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::*;

const LEADER: u8 = 2;
const MEMBER: u8 = 3;
const DECODE: u8 = 9;
const GROUP_SERVICE: &str = "p-peers.serving.svc";

/// The owner map of a rank: the contiguous split, another map, or none (replicated).
enum Map {
    Contiguous,
    Owners(Vec<u32>),
    Replicated,
}

fn rank_cfg(w: &World, rank_link: u16, map: Map) -> WorkerConfig {
    let mut c = config(WorkerRole::Prefill, "r1", w.ports);
    c.parallelism.context = 2;
    c.layer_split = match map {
        Map::Owners(owners) => Some(LayerSplit { owners }),
        Map::Contiguous => LayerSplit::contiguous(c.model.layers, 2),
        Map::Replicated => None,
    };
    c.ports.rank_link = Some(rank_link);
    c.peers.group_service = Some(GROUP_SERVICE.into());
    c.check().expect("a valid LayerSplit prefill config");
    c
}

/// Starts both ranks at once (each start returns once its group has connected).
fn start_group(
    w: &World,
    cfgs: [&WorkerConfig; 2],
    env: &[(&str, &str)],
    within: Duration,
) -> [Result<Proc, String>; 2] {
    let start = |host: u8, pod: &'static str, cfg: &WorkerConfig| {
        let mut env = env.to_vec();
        env.push(("POD_NAME", pod));
        let json = serde_json::to_vec(cfg).unwrap();
        w.try_start_role(host, "prefill", CONFIG_FILE, &json, &env, &[], within)
            .map(|(p, _)| p)
    };
    let start = &start;
    std::thread::scope(|s| {
        let a = s.spawn(move || start(LEADER, "p-g0-0", cfgs[0]));
        let b = s.spawn(move || start(MEMBER, "p-g0-1", cfgs[1]));
        [a.join().unwrap(), b.join().unwrap()]
    })
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

/// Sends one request of `input` prompt tokens; returns the decode's `tandem` section.
async fn send(w: &World, n: u64, input: u32) -> Value {
    let body = serde_json::json!({"model": "llama-3-8b", "prompt": "x", "max_tokens": 2,
        "input_tokens": input, "kv_block_hashes": [n * 100 + 1, n * 100 + 2, n * 100 + 3]});
    let (code, frames) = http(
        w.addr(DECODE, w.ports.front),
        "POST",
        "/v1/completions",
        Some(body),
    )
    .await;
    let v: Value = serde_json::from_str(&text(&frames)).unwrap_or(Value::Null);
    assert_eq!(code, 200, "{v}");
    v["tandem"].clone()
}

/// A group of two and a decode; `requests` served; the two ranks' `layer_split` reports.
struct Served {
    leader: Value,
    member: Value,
    corrupt_at_decode: u64,
}

async fn serve(net: u8, map: Map, env: &[(&str, &str)], requests: u64) -> Served {
    let w = World::new(net);
    w.publish_group(GROUP_SERVICE, LEADER, MEMBER);
    let cfg = rank_cfg(&w, w.free_port(), map);
    let [leader, member] = start_group(&w, [&cfg, &cfg], env, Duration::from_secs(90));
    let (_leader, _member) = (leader.unwrap(), member.unwrap());
    let _decode = w.spawn(DECODE, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, LEADER).await;
    wait_ready(&w, MEMBER).await;
    wait_ready(&w, DECODE).await;
    let mut corrupt = 0;
    for n in 0..requests {
        // 1 to 6 pages of 512 tokens.
        let t = send(&w, n, 400 + (n as u32 % 6) * 512).await;
        corrupt += t["corrupt_chunks"].as_u64().unwrap();
    }
    let (l, m) = (report(&w, LEADER).await, report(&w, MEMBER).await);
    assert!(
        !l["config"]["unused"].to_string().contains("layerSplit"),
        "the built-in engine acts on layerSplit: {}",
        l["config"]
    );
    // The member is a group member at the decode, not a room peer.
    let d = report(&w, DECODE).await;
    assert!(
        d["group_member_peers"]
            .to_string()
            .contains(&format!("127.0.{net}.{MEMBER}")),
        "{d}"
    );
    Served {
        leader: l,
        member: m,
        corrupt_at_decode: corrupt,
    }
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_split_group_serves_each_layer_range_from_its_owner() {
    let requests = 24;
    let s = serve(174, Map::Contiguous, &[], requests).await;
    let (l, m) = (&s.leader["cp_group"], &s.member["cp_group"]);
    println!("leader: {l}\nmember: {m}");
    assert_eq!(s.corrupt_at_decode, 0, "the decode verified every chunk");
    for (r, rank) in [(l, 0), (m, 1)] {
        assert_eq!(n(r, "cp_rank"), rank);
        assert_eq!(n(r, "steps"), requests, "{r}");
        assert_eq!(n(r, "step_failures"), 0, "{r}");
        assert_eq!(n(r, "corrupt_chunks_read"), 0, "{r}");
        // Four of eight layers stored: half the replicated bytes.
        assert_eq!(
            2 * n(r, "stored_kv_bytes"),
            n(r, "replicated_kv_bytes"),
            "{r}"
        );
        // One wait per non-owned layer per request.
        assert_eq!(n(r, "waits"), 4 * requests, "{r}");
        // Each rank broadcast its four layers once per request to its one peer...
        assert_eq!(n(r, "frames_sent"), 4 * requests, "{r}");
        // ...carrying only the pages in use: a sliver of what whole-layer frames would move.
        assert!(
            n(r, "broadcast_payload_bytes") * 20 < n(r, "whole_layer_broadcast_bytes"),
            "{r}"
        );
    }
    assert_eq!(l["owned_layers"], serde_json::json!([[0, 4]]));
    assert_eq!(m["owned_layers"], serde_json::json!([[4, 8]]));
    assert_eq!(l["owner_map_digest"], m["owner_map_digest"]);
    // Each rank wrote its own half of every page into the decode.
    let leader_bytes = n(&s.leader["counters"], "kv_bytes_sent");
    assert!(leader_bytes > 0);
    assert_eq!(n(m, "kv_bytes_written"), leader_bytes, "{m}");
    assert_eq!(n(&s.member["counters"], "kv_bytes_sent"), 0);
    // Half of each page per rank: the same memory caches twice the pages.
    assert_eq!(
        n(l, "prefix_cache_pages"),
        2 * n(l, "replicated_prefix_cache_pages"),
        "{l}"
    );
}

/// The baseline LayerSplit replaces, in the same harness: a CP group whose ranks store every
/// layer. Nothing is broadcast, nobody waits, the leader writes whole pages, and the decode's
/// KV is as clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_group_computes_together_and_its_leader_writes_whole_pages() {
    let requests = 12;
    let s = serve(177, Map::Replicated, &[], requests).await;
    let (l, m) = (&s.leader["cp_group"], &s.member["cp_group"]);
    println!("replicated leader: {l}\nreplicated member: {m}");
    assert_eq!(s.corrupt_at_decode, 0);
    for r in [l, m] {
        assert_eq!(r["layout"], "replicated");
        assert_eq!(n(r, "steps"), requests, "{r}");
        assert_eq!(n(r, "stored_kv_bytes"), n(r, "replicated_kv_bytes"), "{r}");
        assert_eq!(n(r, "frames_sent") + n(r, "waits"), 0, "{r}");
        assert_eq!(n(r, "corrupt_chunks_read"), 0, "{r}");
    }
    assert_eq!(n(m, "kv_bytes_written"), 0, "{m}");
    assert!(n(&s.leader["counters"], "kv_bytes_sent") > 0);
    assert_eq!(
        n(l, "prefix_cache_pages"),
        n(l, "replicated_prefix_cache_pages")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_on_different_owner_maps_refuse_each_other_before_any_store() {
    let w = World::new(175);
    w.publish_group(GROUP_SERVICE, LEADER, MEMBER);
    let port = w.free_port();
    let contiguous = rank_cfg(&w, port, Map::Contiguous);
    let shifted = rank_cfg(&w, port, Map::Owners(vec![0, 0, 0, 1, 1, 1, 1, 1]));
    let started = std::time::Instant::now();
    let [a, b] = start_group(&w, [&contiguous, &shifted], &[], Duration::from_secs(60));
    assert!(
        a.is_err() && b.is_err(),
        "a group on two owner maps started"
    );
    for e in [a.err().unwrap(), b.err().unwrap()] {
        assert!(e.contains("did not start"), "{e}");
    }
    // Refused at the link's preamble, well before the 120 s connect deadline.
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A group runs no step without every rank, and a restarted rank can only join a group whose
/// ranks all connect anew: when one rank goes away, the others stop (non-zero exit, after their
/// teardown) so that their pods restart and the group re-forms — not a leader that keeps taking
/// rooms it cannot run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_goes_away_breaks_the_group_and_the_leader_stops() {
    let w = World::new(178);
    w.publish_group(GROUP_SERVICE, LEADER, MEMBER);
    let cfg = rank_cfg(&w, w.free_port(), Map::Contiguous);
    let [leader, member] = start_group(&w, [&cfg, &cfg], &[], Duration::from_secs(90));
    let (mut leader, member) = (leader.unwrap(), member.unwrap());
    let _decode = w.spawn(DECODE, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, LEADER).await;
    wait_ready(&w, DECODE).await;
    assert_eq!(send(&w, 1, 900).await["corrupt_chunks"], 0);
    drop(member); // killed: its rank link closes
    let status = tokio::task::spawn_blocking(move || {
        let s = leader.wait_exit(Duration::from_secs(30));
        (s, leader)
    })
    .await
    .unwrap()
    .0
    .expect("the leader stops once its group broke");
    assert!(!status.success(), "a broken group is a failure: {status:?}");
    // Stopped through its teardown (not a crash): the report names the group's drain step.
    let (_, steps) = w.teardown_of(LEADER);
    assert!(
        steps.iter().any(|(_, step, _)| step.contains("CP rank")),
        "{steps:?}"
    );
}

/// NEGATIVE CONTROL: without the wait, attention reads the receive scratch before the owner's
/// layer is there — bytes that are not the layer's KV — and the engine counts them.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_skipping_the_layer_wait_reads_stale_kv() {
    let s = serve(
        176,
        Map::Contiguous,
        &[("TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT", "1")],
        6,
    )
    .await;
    let (l, m) = (&s.leader["cp_group"], &s.member["cp_group"]);
    println!("NEGATIVE CONTROL leader: {l}\nmember: {m}");
    assert_eq!(l["negative_control_skip_wait"], true);
    for r in [l, m] {
        assert_eq!(n(r, "waits"), 0, "{r}");
        assert!(n(r, "corrupt_chunks_read") > 0, "stale KV went unseen: {r}");
    }
}
