//! The `tandem-worker cache` role as a real process: fill it over TCP from a trace replay, kill it
//! with SIGKILL, start it again on the same data directory, and check that the prefix hit ratio of a
//! probe replay returns to its value before the kill (DESIGN §7 "L3 loadback after restart"); a start
//! under a changed model identity serves misses without crashing; SIGTERM exits cleanly.

mod l3_support;
mod serve_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use l3_support::{identity, load_trace, object_bytes};
use serve_support::{Proc, World};
use tandem_worker::config::{
    CACHE_TIER_CONFIG_API_VERSION, CACHE_TIER_CONFIG_FILE, CacheEviction, CachePorts,
    CacheTierConfig, DEFAULT_CACHE_DATA_DIR, WritePolicy,
};
use tandem_worker::l3::client::L3Client;
use tandem_worker::l3::manifest::{ShardCoords, StoreIdentity};
use tandem_worker::l3::replay::{ReplayMode, replay_l3};
use tandem_worker::l3::store::{L3Health, WarmState};

struct Replica {
    proc: Proc,
    addr: SocketAddr,
}

/// The tier config of a replica storing objects of `identity` (its data directory is the
/// default one under the host's `$TANDEM_ROOT`, so every start on one host sees the same data).
fn tier(identity: &StoreIdentity) -> CacheTierConfig {
    CacheTierConfig {
        api_version: CACHE_TIER_CONFIG_API_VERSION.into(),
        namespace: "serving".into(),
        tier: "l3".into(),
        revision: "t1".into(),
        model: identity.model.clone(),
        indexer: None,
        page_tokens: identity.page_tokens,
        layout: identity.layout,
        max_tensor: identity.tp_size,
        max_context: identity.cp_size,
        memory_bytes: 1 << 30,
        disk_bytes: 16 << 30,
        persistent: true,
        data_dir: DEFAULT_CACHE_DATA_DIR.into(),
        // Free ports, printed on stdout (`listening on ADDR`).
        ports: CachePorts { l3: 0, health: 0 },
        eviction: CacheEviction::default(),
        write_policy: WritePolicy::WriteThrough,
        registration_failure: None,
    }
}

/// Starts `tandem-worker cache --config` on host 1 of `w` (fsync off: a test-only flag).
fn start(w: &World, identity: &StoreIdentity) -> Replica {
    let cfg = tier(identity);
    assert_eq!(&cfg.identity(), identity);
    let (proc, addr) = w.start_role(
        1,
        "cache",
        CACHE_TIER_CONFIG_FILE,
        &serde_json::to_vec(&cfg).expect("json"),
        &[],
        &["--progress-interval-s", "1", "--unsafe-no-fsync"],
    );
    Replica {
        proc,
        addr: addr.parse().expect("address"),
    }
}

fn client(r: &Replica) -> L3Client {
    L3Client::connect(r.addr, Duration::from_secs(30)).expect("connect")
}

fn wait_warm(c: &L3Client) -> L3Health {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let h = c.health().expect("health");
        if h.state == WarmState::CacheWarm {
            return h;
        }
        assert!(Instant::now() < deadline, "no CacheWarm: {h:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn killed_replica_restarts_with_its_hit_ratio_and_survives_an_identity_change() {
    let Some(requests) = load_trace() else { return };
    let (fill, probe) = (&requests[..400], &requests[400..600]);
    let w = World::new(53);
    let id = identity("m");
    let shard = ShardCoords::whole(&id);

    let first = start(&w, &id);
    let c = client(&first);
    wait_warm(&c);
    replay_l3(&c, fill, shard, ReplayMode::Fill, object_bytes).expect("fill");
    let before = replay_l3(&c, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    let objects = c.health().expect("health").objects;
    assert!(
        before > 0.1 && objects > 1_000,
        "ratio {before}, objects {objects}"
    );
    drop(c);
    drop(first); // SIGKILL: no shutdown path runs

    let second = start(&w, &id);
    let c = client(&second);
    let h = wait_warm(&c);
    assert_eq!((h.objects, h.loadback.published), (objects, objects));
    assert_eq!(h.loadback.corrupt + h.loadback.identity_mismatch, 0);
    let after = replay_l3(&c, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    println!(
        "probe hit ratio before kill {before:.4}, after restart {after:.4} ({objects} objects)"
    );
    assert_eq!(after, before);
    drop(c);
    // SIGTERM: a clean stop with exit status 0.
    let mut second = second;
    second.proc.signal(libc::SIGTERM);
    let status = second.proc.0.wait().expect("wait");
    assert!(status.success(), "SIGTERM exit: {status:?}");

    let changed = StoreIdentity {
        model: tandem_worker::model::ModelIdentity {
            name: "another-model".into(),
            ..id.model.clone()
        },
        ..id
    };
    let third = start(&w, &changed);
    let c = client(&third);
    let h = wait_warm(&c);
    assert_eq!(h.loadback.identity_mismatch, objects);
    assert_eq!(h.objects, 0);
    let shard = ShardCoords::whole(&changed);
    let ratio = replay_l3(&c, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    assert_eq!(ratio, 0.0, "another model's KV is never served");
}
