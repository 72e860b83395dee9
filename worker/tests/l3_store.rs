//! The L3 store on disk: visibility, atomic manifests, eviction, restart loadback and its failure
//! cases (DESIGN contract 7; reference TC-L3-01..04).

mod l3_support;

use std::fs;
use std::sync::Arc;

use l3_support::{config, identity, load_trace, object_bytes};
use tandem_worker::l3::manifest::{ObjectKey, ShardCoords, StoreIdentity};
use tandem_worker::l3::replay::{ReplayMode, replay_l3};
use tandem_worker::l3::store::{L3Error, L3Store, PutOutcome, WarmState};
use tandem_worker::memory::pool::PoolRole;
use tandem_worker::tier::PageKey;

fn key(id: u64, identity: &StoreIdentity) -> ObjectKey {
    ObjectKey {
        page: PageKey::from_trace_id(id),
        pool: PoolRole::Target,
        shard: ShardCoords::whole(identity),
    }
}

fn open_warm(cfg: tandem_worker::l3::store::L3Config) -> Arc<L3Store> {
    let (store, loadback) = L3Store::open(cfg).expect("open");
    loadback.join();
    assert_eq!(store.health().state, WarmState::CacheWarm);
    store
}

#[test]
fn put_then_get_and_a_second_put_is_a_no_op() {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = identity("m");
    let store = open_warm(config(dir.path(), id.clone()));
    let k = key(1, &id);
    assert!(store.get(&k).is_none());
    assert_eq!(
        store.put(k, &object_bytes(&k)).expect("put"),
        PutOutcome::Stored
    );
    assert_eq!(
        store.put(k, &object_bytes(&k)).expect("put"),
        PutOutcome::AlreadyPresent
    );
    assert_eq!(store.get(&k).as_deref(), Some(object_bytes(&k).as_slice()));
    let bad = ObjectKey {
        shard: ShardCoords {
            tp_rank: 1,
            ..k.shard
        },
        ..k
    };
    assert!(matches!(
        store.put(bad, b"x"),
        Err(L3Error::KeyOutOfIdentity(_))
    ));
}

#[test]
fn crash_between_data_write_and_manifest_commit_leaves_the_object_invisible() {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = identity("m");
    let (good, cut) = (key(1, &id), key(2, &id));
    {
        let store = open_warm(config(dir.path(), id.clone()));
        store.put(good, &object_bytes(&good)).expect("put");
        store
            .put_crashing_before_manifest(cut, &object_bytes(&cut))
            .expect("data written");
        assert!(store.get(&cut).is_none(), "no manifest, no object");
        assert!(
            dir.path()
                .join(format!("objects/{}.kv", cut.file_stem()))
                .exists()
        );
    }
    let store = open_warm(config(dir.path(), id));
    assert!(store.get(&cut).is_none());
    assert!(store.get(&good).is_some(), "the complete object is served");
    let h = store.health();
    assert_eq!(h.loadback.orphans_removed, 1);
    assert_eq!((h.objects, h.loadback.published), (1, 1));
    assert!(
        !dir.path()
            .join(format!("objects/{}.kv", cut.file_stem()))
            .exists()
    );
}

#[test]
fn corrupted_objects_are_counted_misses_not_crashes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = identity("m");
    let keys: Vec<ObjectKey> = (1..=6).map(|i| key(i, &id)).collect();
    {
        let store = open_warm(config(dir.path(), id.clone()));
        for k in &keys {
            store.put(*k, &object_bytes(k)).expect("put");
        }
    }
    let obj = |k: &ObjectKey| dir.path().join(format!("objects/{}.kv", k.file_stem()));
    let man = |k: &ObjectKey| dir.path().join(format!("manifests/{}.json", k.file_stem()));
    let mut flipped = fs::read(obj(&keys[0])).expect("read");
    flipped[10] ^= 0xff;
    fs::write(obj(&keys[0]), flipped).expect("flip a byte");
    fs::write(obj(&keys[1]), b"short").expect("truncate");
    fs::remove_file(obj(&keys[2])).expect("lose data");
    fs::write(man(&keys[3]), b"{not json").expect("garble manifest");

    let store = open_warm(config(dir.path(), id));
    let h = store.health();
    assert_eq!(h.loadback.corrupt, 4);
    assert_eq!(h.loadback.published, 2);
    for k in &keys[..4] {
        assert!(store.get(k).is_none());
    }
    for k in &keys[4..] {
        assert_eq!(store.get(k).as_deref(), Some(object_bytes(k).as_slice()));
    }
    assert!(
        dir.path()
            .join("quarantine")
            .read_dir()
            .expect("dir")
            .count()
            >= 4
    );
    assert_eq!(store.health().counters.misses, 4);
}

#[test]
fn a_changed_model_identity_turns_every_object_into_a_miss() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = identity("model-a");
    let keys: Vec<ObjectKey> = (1..=5).map(|i| key(i, &old)).collect();
    {
        let store = open_warm(config(dir.path(), old.clone()));
        for k in &keys {
            store.put(*k, &object_bytes(k)).expect("put");
        }
    }
    for changed in [
        identity("model-b"),
        StoreIdentity {
            tp_size: 2,
            ..old.clone()
        },
        StoreIdentity {
            page_tokens: 256,
            ..old.clone()
        },
    ] {
        // Each reopen starts from the objects moved aside by the previous one: put them back.
        let stale = dir.path().join("stale");
        for e in fs::read_dir(&stale).expect("dir") {
            let p = e.expect("entry").path();
            let sub = if p.extension().is_some_and(|x| x == "json") {
                "manifests"
            } else {
                "objects"
            };
            fs::rename(&p, dir.path().join(sub).join(p.file_name().expect("name")))
                .expect("restore");
        }
        let store = open_warm(config(dir.path(), changed));
        let h = store.health();
        assert_eq!(h.loadback.identity_mismatch, 5);
        assert_eq!(
            (h.objects, h.memory_bytes),
            (0, 0),
            "nothing is read into the store"
        );
        for k in &keys {
            assert!(store.get(k).is_none());
        }
    }
}

#[test]
fn lru_eviction_respects_disk_and_memory_budgets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = identity("m");
    let mut cfg = config(dir.path(), id.clone());
    cfg.disk_budget_bytes = 10 * 256;
    cfg.memory_budget_bytes = 4 * 256;
    let store = open_warm(cfg.clone());
    let keys: Vec<ObjectKey> = (1..=15).map(|i| key(i, &id)).collect();
    for k in &keys[..10] {
        store.put(*k, &object_bytes(k)).expect("put");
    }
    assert!(store.get(&keys[0]).is_some(), "touch the oldest");
    for k in &keys[10..] {
        store.put(*k, &object_bytes(k)).expect("put");
    }
    let h = store.health();
    assert_eq!((h.objects, h.disk_bytes), (10, 10 * 256));
    assert!(h.memory_bytes <= 4 * 256);
    assert_eq!(h.counters.evicted_disk, 5);
    assert!(store.contains(&keys[0]), "recently used survives");
    for k in &keys[1..6] {
        assert!(!store.contains(k));
        assert!(
            !dir.path()
                .join(format!("manifests/{}.json", k.file_stem()))
                .exists()
        );
        assert!(
            !dir.path()
                .join(format!("objects/{}.kv", k.file_stem()))
                .exists()
        );
    }
    drop(store);
    let store = open_warm(cfg);
    assert_eq!(store.health().objects, 10, "what was kept is loaded back");
}

#[test]
fn restart_restores_the_prefix_hit_ratio_of_a_second_replay() {
    let Some(requests) = load_trace() else { return };
    let (fill, probe) = (&requests[..600], &requests[600..900]);
    let dir = tempfile::tempdir().expect("tempdir");
    let id = identity("m");
    let shard = ShardCoords::whole(&id);
    let before = {
        let store = open_warm(config(dir.path(), id.clone()));
        replay_l3(&*store, fill, shard, ReplayMode::Fill, object_bytes).expect("fill");
        replay_l3(&*store, probe, shard, ReplayMode::LookupOnly, object_bytes)
            .expect("probe")
            .token_hit_ratio()
    };
    assert!(before > 0.1, "the probe must hit something: {before}");
    let (store, loadback) = L3Store::open(config(dir.path(), id)).expect("reopen");
    // Serving starts before loadback ends: lookups answer at once (misses while warming).
    let early = replay_l3(
        &*store,
        &probe[..20],
        shard,
        ReplayMode::LookupOnly,
        object_bytes,
    )
    .expect("early probe")
    .token_hit_ratio();
    loadback.join();
    let after = replay_l3(&*store, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    println!(
        "probe hit ratio: before restart {before:.4}, while warming {early:.4}, after {after:.4}"
    );
    assert_eq!(after, before);
    let h = store.health();
    assert_eq!(h.loadback.corrupt + h.loadback.identity_mismatch, 0);
    assert_eq!(h.loadback.published, h.loadback.total);
}
