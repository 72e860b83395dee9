//! The snapshot protocol's transitions and outcomes (DESIGN contract 4; dataplane.md TC-MEM-02 and
//! §8 state machine 7), on the store's pure API with host memory and no transport: bytes are written
//! into the region directly, as a transport's receiver would.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_worker::engine::content::{ChunkSpec, fill_chunk, verify_chunk};
use tandem_worker::memory::Allocator;
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{KvPool, PageId, PoolLayout, PoolRole, PoolSpec};
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::release::RoomKey;
use tandem_worker::release::receiver::TransportProof;
use tandem_worker::snapshot::{
    AbortOutcome, FinalizeOutcome, OneSidedGate, PrepareOutcome, SlotGeometry, SnapshotError,
    SnapshotGate, SnapshotGrant, SnapshotId, SnapshotRegion, SnapshotRequest, SnapshotState,
    SnapshotStore, StoreConfig,
};
use tandem_worker::tier::page_key::PageKey;
use tandem_worker::tier::prefix_index::{PrefixIndex, Residency, Tier};
use tandem_worker::transfer::{ReceiveRegion, RegionId};

const PAGE_TOKENS: u32 = 4;
const LAYERS: u32 = 2;
const STALE: Duration = Duration::from_secs(10);

fn model(layers: u32) -> ModelIdentity {
    ModelIdentity {
        name: "tiny".into(),
        layers,
        attention: Attention::Gqa {
            kv_heads: 1,
            head_dim: 8,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    }
}

fn pool(pages: u32, layers: u32) -> Arc<KvPool> {
    let spec = PoolSpec {
        role: PoolRole::Target,
        model: model(layers),
        page_tokens: PAGE_TOKENS,
        pages,
        layout: PoolLayout::PageFirst,
    };
    Arc::new(KvPool::new(spec, &Allocator::new("kv", MmapBackend::new())).unwrap())
}

/// A gate that records opens and fences, and proves (or not) on demand.
#[derive(Default)]
struct TestGate {
    proves: AtomicBool,
    opened: Mutex<Vec<RoomKey>>,
    fenced: Mutex<Vec<RoomKey>>,
}

impl SnapshotGate for TestGate {
    fn open(&self, key: RoomKey) {
        self.opened.lock().unwrap().push(key);
    }
    fn fence(&self, key: RoomKey) -> Option<TransportProof> {
        self.fenced.lock().unwrap().push(key);
        self.proves
            .load(Ordering::SeqCst)
            .then_some(TransportProof::ReceiverFenced)
    }
}

struct Rig {
    pool: Arc<KvPool>,
    region: Arc<SnapshotRegion>,
    store: SnapshotStore,
    index: PrefixIndex,
    t0: Instant,
}

fn rig(slots: u32, pool_pages: u32, gate: Arc<dyn SnapshotGate>) -> Rig {
    let pool = pool(pool_pages, LAYERS);
    let g = SlotGeometry::for_pool(
        pool.geometry(),
        u64::from(slots) * pool.geometry().page_bytes(),
    )
    .unwrap();
    let region =
        Arc::new(SnapshotRegion::new(&Allocator::new("snapshot", MmapBackend::new()), g).unwrap());
    let store = SnapshotStore::new(
        region.clone(),
        RegionId(1),
        gate,
        StoreConfig {
            stale_after: STALE,
            tier: Tier::L2Host,
        },
    );
    Rig {
        pool,
        region,
        store,
        index: PrefixIndex::unbounded(),
        t0: Instant::now(),
    }
}

fn keys(session: u64, pages: u32) -> Vec<PageKey> {
    let tokens: Vec<u32> = (0..pages * PAGE_TOKENS)
        .map(|t| session as u32 * 10_000 + t)
        .collect();
    PageKey::chain_sequence(&tokens, PAGE_TOKENS as usize)
}

fn spec(session: u64, page: u32, layer: u32, pool: &KvPool) -> ChunkSpec {
    ChunkSpec {
        request: session,
        layer,
        first_token: page * PAGE_TOKENS,
        tokens: PAGE_TOKENS,
        token_bytes: pool.geometry().bytes_per_token_layer as usize,
    }
}

impl Rig {
    fn at(&self, secs: u64) -> Instant {
        self.t0 + Duration::from_secs(secs)
    }

    fn prepare(&mut self, session: u64, pages: u32, secs: u64) -> PrepareOutcome {
        let now = self.at(secs);
        self.store
            .prepare(
                SnapshotRequest {
                    session,
                    keys: keys(session, pages),
                },
                now,
            )
            .unwrap()
    }

    fn grant(&mut self, session: u64, pages: u32, secs: u64) -> SnapshotGrant {
        match self.prepare(session, pages, secs) {
            PrepareOutcome::Granted(g) => g,
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    /// The receiver side of a transfer: every chunk of `session` at the grant's offsets.
    fn write(&self, grant: &SnapshotGrant, session: u64) {
        for page in 0..grant.pages() as u32 {
            for layer in 0..LAYERS {
                let s = spec(session, page, layer, &self.pool);
                let mut data = vec![0u8; s.bytes()];
                fill_chunk(&mut data, &s);
                let at = grant.chunk_offset(page as usize, layer).unwrap();
                self.region.write(at, &data).unwrap();
            }
        }
    }

    fn finalize(&mut self, id: SnapshotId) -> FinalizeOutcome {
        self.store
            .finalize(id, &self.pool, &mut self.index)
            .unwrap()
    }

    fn verify(&self, session: u64, pages: &[PageId]) {
        let mut buf = vec![0u8; self.pool.geometry().chunk_bytes() as usize];
        for (i, page) in pages.iter().enumerate() {
            for layer in 0..LAYERS {
                self.pool.read_chunk(*page, layer, 0, &mut buf).unwrap();
                verify_chunk(&buf, &spec(session, i as u32, layer, &self.pool)).unwrap();
            }
        }
    }
}

#[test]
fn prepare_write_seal_finalize_lands_verified_pages_in_the_pool_and_the_index() {
    let gate = Arc::new(TestGate::default());
    let mut r = rig(4, 8, gate.clone());
    let grant = r.grant(7, 3, 0);
    assert_eq!(grant.pages(), 3);
    assert_eq!(
        grant.key,
        RoomKey::new(7, grant.id.0),
        "room = session, generation = id"
    );
    assert_eq!(gate.opened.lock().unwrap().as_slice(), &[grant.key]);
    assert_eq!(r.store.state(grant.id), Some(SnapshotState::Reserved));
    assert_eq!(
        r.pool.stats().free,
        8,
        "prepare takes nothing from the KV pool"
    );
    r.write(&grant, 7);
    r.store.seal(grant.id, r.at(1)).unwrap();
    assert_eq!(r.store.state(grant.id), Some(SnapshotState::Sealed));
    assert_eq!(
        gate.fenced.lock().unwrap().as_slice(),
        &[grant.key],
        "seal closes the room"
    );
    let FinalizeOutcome::Finalized(done) = r.finalize(grant.id) else {
        panic!("the pool has room");
    };
    assert_eq!(done.pages.len(), 3);
    r.verify(7, &done.pages);
    assert_eq!(r.index.lookup(&keys(7, 3)).pages(), 3);
    assert_eq!(
        r.index.residency(Tier::L2Host, &keys(7, 3)[2]),
        Some(Residency::Present)
    );
    assert_eq!(r.store.state(grant.id), None);
    assert_eq!(r.region.free_slots(), 4, "slots freed after finalize");
    let c = r.store.counters();
    assert_eq!((c.reserved, c.finalized), (1, 1));
    // The session may sync again, at a higher generation.
    let again = r.grant(7, 1, 2);
    assert!(again.key.generation > grant.key.generation);
}

#[test]
fn a_full_buffer_is_explicit_backpressure_and_never_touches_the_kv_pool() {
    // TC-MEM-02: reserve to capacity -> next reserve is backpressure; the KV pool's free count is
    // unchanged throughout.
    let mut r = rig(4, 8, Arc::new(OneSidedGate));
    let pool_free = r.pool.stats().free;
    r.grant(1, 3, 0);
    r.grant(2, 1, 0);
    assert_eq!(r.region.free_slots(), 0);
    let PrepareOutcome::BufFull(full) = r.prepare(3, 1, 0) else {
        panic!("buffer is full");
    };
    assert_eq!((full.needed, full.free, full.draining), (1, 0, 0));
    assert_eq!(r.store.counters().buf_full, 1);
    assert_eq!(
        r.pool.stats().free,
        pool_free,
        "no fallback into the KV pool"
    );
    assert_eq!(
        r.store.live(),
        2,
        "nothing reserved, nothing evicted (all fresh)"
    );
}

#[test]
fn alloc_failed_on_finalize_keeps_the_snapshot_for_a_retry() {
    let mut r = rig(4, 4, Arc::new(OneSidedGate));
    let prefill_work = r.pool.allocate(4).unwrap();
    let grant = r.grant(5, 2, 0);
    r.write(&grant, 5);
    r.store.seal(grant.id, r.at(0)).unwrap();
    assert_eq!(
        r.finalize(grant.id),
        FinalizeOutcome::AllocFailedOnFinalize {
            needed: 2,
            pool_free: 0
        }
    );
    assert_eq!(r.store.state(grant.id), Some(SnapshotState::Sealed), "kept");
    assert_eq!(r.region.free_slots(), 2, "its slots stay held");
    assert_eq!(r.index.lookup(&keys(5, 2)).pages(), 0, "nothing published");
    r.pool.free(&prefill_work[..1]).unwrap();
    assert!(matches!(
        r.finalize(grant.id),
        FinalizeOutcome::AllocFailedOnFinalize { pool_free: 1, .. }
    ));
    assert_eq!(r.pool.stats().free, 1, "a failed finalize keeps no page");
    r.pool.free(&prefill_work[1..2]).unwrap();
    let FinalizeOutcome::Finalized(done) = r.finalize(grant.id) else {
        panic!("two pages free now");
    };
    r.verify(5, &done.pages);
    let c = r.store.counters();
    assert_eq!((c.alloc_failed_on_finalize, c.finalized), (2, 1));
}

#[test]
fn abort_without_proof_drains_and_the_slots_are_not_reused_until_the_writer_is_terminal() {
    let mut r = rig(2, 4, Arc::new(OneSidedGate));
    let a = r.grant(1, 2, 0);
    assert_eq!(r.store.abort(a.id).unwrap(), AbortOutcome::Draining);
    assert_eq!(r.store.state(a.id), Some(SnapshotState::Draining));
    assert_eq!(
        r.store.abort(a.id).unwrap(),
        AbortOutcome::Draining,
        "idempotent"
    );
    // A one-sided late write of A still lands in A's own slots, harmlessly: nobody else owns them.
    r.write(&a, 1);
    let PrepareOutcome::BufFull(full) = r.prepare(2, 1, 100) else {
        panic!("draining slots are not reusable, nor evictable");
    };
    assert_eq!(full.draining, 2);
    assert!(matches!(
        r.store.seal(a.id, r.at(0)),
        Err(SnapshotError::WrongState { .. })
    ));
    r.store.drained(a.id).unwrap();
    assert_eq!(r.store.state(a.id), None);
    assert_eq!(r.region.free_slots(), 2);
    let b = r.grant(2, 2, 100);
    let c = r.store.counters();
    assert_eq!((c.aborted, c.drained), (1, 1));
    // A write of A now would hit B's slots: that is why A had to drain (and, with TCP, why the
    // receiver's generation fence drops it; see tests/snapshot_late_write.rs).
    assert_eq!(b.chunk_offsets.len(), a.chunk_offsets.len());
}

#[test]
fn abort_with_proof_or_after_seal_frees_at_once() {
    let gate = Arc::new(TestGate::default());
    gate.proves.store(true, Ordering::SeqCst);
    let mut r = rig(2, 4, gate.clone());
    let a = r.grant(1, 2, 0);
    assert_eq!(
        r.store.abort(a.id).unwrap(),
        AbortOutcome::Freed(Some(TransportProof::ReceiverFenced))
    );
    assert_eq!(r.region.free_slots(), 2);
    assert!(gate.fenced.lock().unwrap().contains(&a.key));
    gate.proves.store(false, Ordering::SeqCst);
    let b = r.grant(2, 1, 0);
    r.write(&b, 2);
    r.store.seal(b.id, r.at(0)).unwrap();
    assert_eq!(r.store.abort(b.id).unwrap(), AbortOutcome::Freed(None));
    assert_eq!(r.region.free_slots(), 2);
    assert!(matches!(
        r.store.abort(b.id),
        Err(SnapshotError::Unknown(_))
    ));
    assert_eq!(r.store.counters().aborted, 2);
}

#[test]
fn stale_snapshots_are_evicted_lru_first_and_only_when_that_makes_room() {
    let gate = Arc::new(TestGate::default());
    gate.proves.store(true, Ordering::SeqCst);
    let mut r = rig(4, 8, gate);
    let old = r.grant(1, 1, 0); // reserved, never written: stale at 10 s
    let older_sealed = r.grant(2, 1, 0);
    r.store.seal(older_sealed.id, r.at(1)).unwrap(); // sealed, touched at 1 s
    let fresh = r.grant(3, 2, 20); // fresh at 20 s
    assert_eq!(r.region.free_slots(), 0);
    // Needs 3: stale ones hold 2, no free slot: eviction cannot help, so nothing is evicted.
    assert!(matches!(r.prepare(4, 3, 21), PrepareOutcome::BufFull(_)));
    assert_eq!(r.store.counters().evicted, 0);
    assert_eq!(r.store.live(), 3);
    // Needs 1: the least recently used stale snapshot (`old`, touched at 0 s) goes.
    let new = r.grant(5, 1, 21);
    assert_eq!(r.store.state(old.id), None);
    assert_eq!(r.store.state(older_sealed.id), Some(SnapshotState::Sealed));
    assert_eq!(r.store.state(fresh.id), Some(SnapshotState::Reserved));
    assert_eq!(r.store.counters().evicted, 1);
    // An evicted snapshot is gone for every later call.
    assert!(matches!(
        r.store.seal(old.id, r.at(22)),
        Err(SnapshotError::Unknown(_))
    ));
    // Needs 2: `older_sealed` (1 slot) is stale; `fresh` and `new` are not: not enough, nothing goes.
    assert!(matches!(r.prepare(6, 2, 22), PrepareOutcome::BufFull(_)));
    assert_eq!(r.store.counters().evicted, 1);
    let _ = new;
}

#[test]
fn evicting_a_stale_reserved_snapshot_without_proof_drains_it_instead_of_reusing_its_slots() {
    let mut r = rig(1, 4, Arc::new(OneSidedGate));
    let a = r.grant(1, 1, 0);
    assert!(matches!(r.prepare(2, 1, 60), PrepareOutcome::BufFull(_)));
    assert_eq!(r.store.state(a.id), Some(SnapshotState::Draining));
    assert_eq!(r.store.counters().evicted, 1);
    r.store.drained(a.id).unwrap();
    r.grant(2, 1, 61);
}

#[test]
fn malformed_calls_are_typed_errors() {
    let mut r = rig(2, 4, Arc::new(OneSidedGate));
    let now = r.at(0);
    let req = |session, pages| SnapshotRequest {
        session,
        keys: keys(session, pages),
    };
    assert!(matches!(
        r.store.prepare(req(1, 0), now),
        Err(SnapshotError::InvalidSize { pages: 0, slots: 2 })
    ));
    assert!(matches!(
        r.store.prepare(req(1, 3), now),
        Err(SnapshotError::InvalidSize { pages: 3, .. })
    ));
    let a = r.grant(1, 1, 0);
    assert!(matches!(
        r.store.prepare(req(1, 1), now),
        Err(SnapshotError::SessionBusy { session: 1, .. })
    ));
    assert!(matches!(
        r.store.finalize(a.id, &r.pool, &mut r.index),
        Err(SnapshotError::WrongState { op: "finalize", .. })
    ));
    r.store.seal(a.id, now).unwrap();
    assert!(matches!(
        r.store.seal(a.id, now),
        Err(SnapshotError::WrongState { op: "seal", .. })
    ));
    assert!(matches!(
        r.store.drained(a.id),
        Err(SnapshotError::WrongState { .. })
    ));
    assert!(matches!(
        r.store.finalize(SnapshotId(99), &r.pool, &mut r.index),
        Err(SnapshotError::Unknown(SnapshotId(99)))
    ));
    let other = pool(4, LAYERS + 1);
    assert!(matches!(
        r.store.finalize(a.id, &other, &mut r.index),
        Err(SnapshotError::GeometryMismatch { .. })
    ));
    assert_eq!(
        r.store.state(a.id),
        Some(SnapshotState::Sealed),
        "errors change nothing"
    );
    assert!(matches!(
        SlotGeometry::for_pool(r.pool.geometry(), 0),
        Err(SnapshotError::NoSlots { .. })
    ));
}
