//! L2 → L3 write-through against the real store: while puts run, the prefix index never claims an L3
//! hit that the store cannot serve; the optimistic marking (negative control) does.

mod l3_support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use l3_support::{config, identity, object_bytes};
use tandem_worker::l3::backup::{BackupMarking, backup_sequence};
use tandem_worker::l3::manifest::{ObjectKey, ShardCoords};
use tandem_worker::l3::replay::L3Backend;
use tandem_worker::l3::store::{L3Error, L3Store};
use tandem_worker::memory::pool::PoolRole;
use tandem_worker::tier::{PageKey, PrefixIndex, Tier};

/// The store, with every put slowed so that lookups run while puts are in flight.
struct SlowPuts(Arc<L3Store>);

impl L3Backend for SlowPuts {
    type Error = L3Error;
    fn leading_present(&self, keys: &[ObjectKey]) -> Result<usize, L3Error> {
        Ok(self.0.leading_present(keys))
    }
    fn put(&self, key: ObjectKey, data: &[u8]) -> Result<(), L3Error> {
        std::thread::sleep(Duration::from_millis(5));
        self.0.put(key, data).map(|_| ())
    }
}

/// Backs up 40 pages while a reader looks the sequence up and fetches every page the index calls an
/// L3 hit; returns the hits the store could not serve.
fn unserved_hits(marking: BackupMarking) -> usize {
    let dir = tempfile::tempdir().expect("tempdir");
    let id = identity("m");
    let (store, loadback) = L3Store::open(config(dir.path(), id.clone())).expect("open");
    loadback.join();
    let objects: Vec<ObjectKey> = (0..40)
        .map(|i| ObjectKey {
            page: PageKey::from_trace_id(100 + i),
            pool: PoolRole::Target,
            shard: ShardCoords::whole(&id),
        })
        .collect();
    let index = Arc::new(Mutex::new(PrefixIndex::unbounded()));
    let bad = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(2));
    let reader = {
        let (index, store, bad, start, objects) = (
            Arc::clone(&index),
            Arc::clone(&store),
            Arc::clone(&bad),
            Arc::clone(&start),
            objects.clone(),
        );
        std::thread::spawn(move || {
            start.wait();
            let pages: Vec<PageKey> = objects.iter().map(|o| o.page).collect();
            for _ in 0..100 {
                let hit = index.lock().expect("index").lookup(&pages);
                for (o, tier) in objects.iter().zip(&hit.tiers) {
                    assert_eq!(*tier, Tier::L3Store);
                    if store.get(o).is_none() {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    start.wait();
    let acked = backup_sequence(
        &index,
        &SlowPuts(Arc::clone(&store)),
        &objects,
        object_bytes,
        marking,
    );
    reader.join().expect("reader");
    assert_eq!(acked, objects.len());
    let pages: Vec<PageKey> = objects.iter().map(|o| o.page).collect();
    assert_eq!(
        index.lock().expect("index").lookup(&pages).pages(),
        40,
        "all present after acks"
    );
    bad.load(Ordering::Relaxed)
}

#[test]
fn pending_backups_are_never_reported_as_l3_hits() {
    assert_eq!(unserved_hits(BackupMarking::Honest), 0);
}

#[test]
fn negative_control_optimistic_marking_claims_hits_the_store_cannot_serve() {
    assert!(unserved_hits(BackupMarking::UnsafeOptimistic) > 0);
}
