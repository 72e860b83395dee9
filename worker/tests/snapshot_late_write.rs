//! A late write of an aborted snapshot never lands in a reused slot (DESIGN contracts 3 and 4).
//!
//! Over loopback TCP: snapshot A is prepared and aborted (the receiver fences its room, so its slots
//! are freed at once), snapshot B reuses exactly A's slots (the slab is LIFO), B is written, and then
//! A's writes arrive late. With the receiver's generation check they are dropped as stale and B
//! verifies; the NEGATIVE CONTROL (`GenerationCheck::Unchecked`, i.e. one-sided semantics with the
//! slots reused anyway) lets them land and B's pages fail verification. A late write that arrives
//! while the slots are still free is refused by the snapshot region itself, whatever the receiver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tandem_worker::engine::content::{ChunkSpec, fill_chunk, verify_chunk};
use tandem_worker::memory::Allocator;
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{KvPool, PoolLayout, PoolRole, PoolSpec};
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::release::receiver::TransportProof;
use tandem_worker::snapshot::{
    AbortOutcome, FinalizeOutcome, PrepareOutcome, ReceiverGate, SlotGeometry, SnapshotGrant,
    SnapshotRegion, SnapshotRequest, SnapshotStore, StoreConfig,
};
use tandem_worker::tier::page_key::PageKey;
use tandem_worker::tier::prefix_index::{PrefixIndex, Tier};
use tandem_worker::transfer::tcp::{GenerationCheck, TcpConfig, TcpReceiver, TcpTransport};
use tandem_worker::transfer::{
    BatchLimits, FailureKind, RegionId, TransferStatus, Transport, WriteBatch, WriteOp,
};

const PAGE_TOKENS: u32 = 8;
const LAYERS: u32 = 3;
const REGION: RegionId = RegionId(1);

struct Rig {
    pool: Arc<KvPool>,
    store: SnapshotStore,
    rx: Arc<TcpReceiver>,
    tx: TcpTransport,
    t0: Instant,
}

fn rig(check: GenerationCheck) -> Rig {
    let spec = PoolSpec {
        role: PoolRole::Target,
        model: ModelIdentity {
            name: "tiny".into(),
            layers: LAYERS,
            attention: Attention::Gqa {
                kv_heads: 1,
                head_dim: 8,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        },
        page_tokens: PAGE_TOKENS,
        pages: 8,
        layout: PoolLayout::LayerFirst,
    };
    let pool = Arc::new(KvPool::new(spec, &Allocator::new("kv", MmapBackend::new())).unwrap());
    let g = SlotGeometry::for_pool(pool.geometry(), 4 * pool.geometry().page_bytes()).unwrap();
    let region =
        Arc::new(SnapshotRegion::new(&Allocator::new("snapshot", MmapBackend::new()), g).unwrap());
    let rx = Arc::new(TcpReceiver::bind("127.0.0.1:0", check).unwrap());
    rx.register_region(REGION, region.clone());
    let gate = Arc::new(ReceiverGate::new(rx.clone(), Duration::from_secs(5)));
    let store = SnapshotStore::new(
        region,
        REGION,
        gate,
        StoreConfig {
            stale_after: Duration::from_secs(60),
            tier: Tier::L2Host,
        },
    );
    Rig {
        pool,
        store,
        rx,
        tx: TcpTransport::new(TcpConfig::default()),
        t0: Instant::now(),
    }
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
    fn grant(&mut self, session: u64, pages: u32) -> SnapshotGrant {
        let tokens: Vec<u32> = (0..pages * PAGE_TOKENS)
            .map(|t| session as u32 * 1000 + t)
            .collect();
        let req = SnapshotRequest {
            session,
            keys: PageKey::chain_sequence(&tokens, PAGE_TOKENS as usize),
        };
        match self.store.prepare(req, self.t0).unwrap() {
            PrepareOutcome::Granted(g) => g,
            other => panic!("{other:?}"),
        }
    }

    /// Decode side: writes `session`'s chunks at `grant`'s offsets, tagged with `grant.key`.
    fn push(&self, grant: &SnapshotGrant, session: u64) -> TransferStatus {
        let mut ops = Vec::new();
        for page in 0..grant.pages() as u32 {
            for layer in 0..LAYERS {
                let s = spec(session, page, layer, &self.pool);
                let mut data = vec![0u8; s.bytes()];
                fill_chunk(&mut data, &s);
                ops.push(WriteOp {
                    key: grant.key,
                    region: grant.region,
                    offset: grant.chunk_offset(page as usize, layer).unwrap(),
                    data: Bytes::from(data),
                });
            }
        }
        let batch = WriteBatch::new(ops, BatchLimits::default()).unwrap();
        let h = self
            .tx
            .submit(&self.rx.addr().to_string(), batch, None)
            .unwrap();
        let status = self
            .tx
            .wait(h, Instant::now() + Duration::from_secs(10))
            .unwrap();
        self.tx.release(h).unwrap();
        status
    }
}

struct Outcome {
    late_before_reuse: TransferStatus,
    late_after_reuse: TransferStatus,
    corrupt_chunks: usize,
}

fn run(check: GenerationCheck) -> Outcome {
    let mut r = rig(check);
    let a = r.grant(1, 2);
    assert_eq!(
        r.store.abort(a.id).unwrap(),
        AbortOutcome::Freed(Some(TransportProof::ReceiverFenced)),
        "the TCP fence proves no write of A can land: slots free at once"
    );
    // Late write while the slots are free: the region refuses it whatever the receiver does.
    let late_before_reuse = r.push(&a, 1);
    let b = r.grant(2, 2);
    let (mut sa, mut sb) = (a.chunk_offsets.clone(), b.chunk_offsets.clone());
    sa.sort_unstable();
    sb.sort_unstable();
    assert_eq!(sa, sb, "B reuses exactly A's slots");
    assert_eq!(r.push(&b, 2), TransferStatus::Completed);
    // A's writes arrive late, after B owns the slots.
    let late_after_reuse = r.push(&a, 1);
    r.store.seal(b.id, r.t0).unwrap();
    let mut index = PrefixIndex::unbounded();
    let FinalizeOutcome::Finalized(done) = r.store.finalize(b.id, &r.pool, &mut index).unwrap()
    else {
        panic!("pool has room");
    };
    let mut corrupt_chunks = 0;
    let mut buf = vec![0u8; r.pool.geometry().chunk_bytes() as usize];
    for (i, page) in done.pages.iter().enumerate() {
        for layer in 0..LAYERS {
            r.pool.read_chunk(*page, layer, 0, &mut buf).unwrap();
            if let Err(c) = verify_chunk(&buf, &spec(2, i as u32, layer, &r.pool)) {
                assert_eq!(c.found_request, 1, "the foreign bytes are A's");
                corrupt_chunks += 1;
            }
        }
    }
    Outcome {
        late_before_reuse,
        late_after_reuse,
        corrupt_chunks,
    }
}

#[test]
fn generation_fence_drops_a_late_write_into_a_reused_slot() {
    let o = run(GenerationCheck::Enforced);
    assert!(matches!(
        o.late_before_reuse,
        TransferStatus::Failed(FailureKind::Rejected { .. })
    ));
    assert_eq!(
        o.late_after_reuse,
        TransferStatus::Failed(FailureKind::Rejected {
            stale: 2 * LAYERS,
            invalid: 0
        }),
        "every late write dropped as stale"
    );
    assert_eq!(o.corrupt_chunks, 0);
}

#[test]
fn negative_control_without_the_generation_check_the_late_write_corrupts_the_new_snapshot() {
    let o = run(GenerationCheck::Unchecked);
    assert_eq!(
        o.late_before_reuse,
        TransferStatus::Failed(FailureKind::Rejected {
            stale: 0,
            invalid: 2 * LAYERS
        }),
        "free slots refuse writes even without the generation check"
    );
    assert_eq!(o.late_after_reuse, TransferStatus::Completed);
    assert_eq!(
        o.corrupt_chunks,
        2 * LAYERS as usize,
        "the unsafe mode must fail"
    );
}
