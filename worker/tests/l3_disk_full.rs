//! Issue 18, item 5: the L3 store's volume fills. The process's file size limit (`RLIMIT_FSIZE`,
//! with `SIGXFSZ` ignored, so a write past it fails with `EFBIG` as a full volume fails with
//! `ENOSPC`) stands in for a persistence volume too small for the working set: puts are refused
//! and counted, reads keep serving, no half-written file stays (in `tmp/` or `objects/`), every
//! manifest matches its data, and after a restart exactly the stored objects are back.
//!
//! One test in this binary: the limit is process-wide.

mod l3_support;

use std::fs;

use l3_support::{config, identity, object_bytes_len};
use tandem_worker::l3::manifest::{ObjectKey, ShardCoords, StoreIdentity};
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

/// Sets the soft file size limit to `bytes` (keeping the hard limit); returns the previous one.
fn limit_file_size(bytes: libc::rlim_t) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain libc calls on this process's own limits and signal disposition.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut old), 0);
        let new = libc::rlimit {
            rlim_cur: bytes.min(old.rlim_max),
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &new), 0);
    }
    old
}

fn restore_file_size(old: libc::rlimit) {
    // SAFETY: as above.
    unsafe {
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &old), 0);
    }
}

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_full_volume_refuses_puts_keeps_serving_reads_and_leaves_nothing_half_written() {
    let dir = tempfile::tempdir().unwrap();
    let id = identity("m");
    let small = |i: u64| object_bytes_len(&key(i, &id), 1024);
    let big = |i: u64| object_bytes_len(&key(i, &id), 8192);
    let (store, loadback) = L3Store::open(config(dir.path(), id.clone())).unwrap();
    loadback.join();
    for i in 1..=3 {
        assert_eq!(
            store.put(key(i, &id), &small(i)).unwrap(),
            PutOutcome::Stored
        );
    }

    // The volume "fills": no file may grow past 4 KiB.
    let old = limit_file_size(4096);
    let mut refused = 0;
    for i in 10..15 {
        match store.put(key(i, &id), &big(i)) {
            Err(L3Error::DiskFull { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::FileTooLarge, "{source}");
                refused += 1;
            }
            other => panic!("a put past the volume was not refused: {other:?}"),
        }
    }
    // The store says its volume is full (what the cache role reports as `VolumeFull`)...
    let full = store.health().volume_full;
    assert!(
        full.as_deref()
            .is_some_and(|m| m.contains("File too large")),
        "{full:?}"
    );
    // What still fits is stored; what was stored is read.
    assert_eq!(
        store.put(key(4, &id), &small(4)).unwrap(),
        PutOutcome::Stored
    );
    restore_file_size(old);

    let h = store.health();
    // ...until a put is stored again.
    assert_eq!(h.volume_full, None);
    assert_eq!(h.counters.puts_refused_disk_full, refused);
    assert_eq!(h.counters.puts, 4);
    assert_eq!(h.objects, 4);
    for i in 1..=4 {
        assert_eq!(
            store.get(&key(i, &id)).as_deref(),
            Some(small(i).as_slice())
        );
    }
    for i in 10..15 {
        assert!(store.get(&key(i, &id)).is_none());
    }
    // Nothing half-written: no temporary, no data file without its manifest, every manifest's
    // object of its length.
    assert!(
        files(&dir.path().join("tmp")).is_empty(),
        "{:?}",
        files(&dir.path().join("tmp"))
    );
    let objects = files(&dir.path().join("objects"));
    let manifests = files(&dir.path().join("manifests"));
    assert_eq!(objects.len(), 4, "{objects:?}");
    assert_eq!(manifests.len(), 4, "{manifests:?}");
    for m in &manifests {
        let stem = m.strip_suffix(".json").unwrap();
        let data = dir.path().join(format!("objects/{stem}.kv"));
        assert_eq!(fs::metadata(&data).unwrap().len(), 1024, "{stem}");
    }
    drop(store);

    // After a restart exactly the stored objects are back, none corrupt, no orphan removed.
    let (store, loadback) = L3Store::open(config(dir.path(), id.clone())).unwrap();
    loadback.join();
    let h = store.health();
    assert_eq!(h.state, WarmState::CacheWarm);
    assert_eq!(h.objects, 4);
    assert_eq!(h.loadback.corrupt, 0);
    assert_eq!(h.loadback.orphans_removed, 0);
    for i in 1..=4 {
        assert_eq!(
            store.get(&key(i, &id)).as_deref(),
            Some(small(i).as_slice())
        );
    }
    for i in 10..15 {
        assert!(store.get(&key(i, &id)).is_none());
    }
}
