//! A deterministic decode→prefill sync workload with the prefill KV pool 100% occupied (seed 002's
//! steady state), run against either backing through a real [`Transport`]; shared by
//! `tests/snapshot_occupied_pool.rs` and `tandem-bench snapshot` (DESIGN §7 target: ≥ 99% of syncs
//! succeed; the seed measured 0% before its fix and asked for ≥ 30%).
//!
//! The model, one tick at a time:
//! 1. prefill work holds every page of the KV pool (requests of `prefill_request_pages` pages);
//! 2. about one sync arrives per tick (0, 1 or 2, seeded), `pages_min..=pages_max` pages. The decode
//!    side pushes at once or gives up (the seed: a session not synced now is evicted on decode), so a
//!    prepare that fails is a failed sync;
//! 3. if prepared, decode writes every `(page, layer)` chunk (content from [`crate::engine::content`])
//!    through the transport and the writer's completion seals the snapshot; finalize is tried at
//!    once (with the pool full: `alloc-failed-on-finalize`, the snapshot waits in its slots);
//! 4. at the end of the tick the oldest prefill request finishes and frees its pages; the scheduler
//!    finalizes waiting snapshots first (FIFO), then admits prefill work into every page left, so the
//!    pool is full again when the next sync arrives.
//!
//! A sync **succeeds** when its pages are in the KV pool and every chunk verifies. The finalized pages
//! are then dropped from the pool and the index (standing in for the prefix cache's own eviction),
//! so the run measures the sync path, not cache capacity.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use crate::engine::content::{ChunkSpec, fill_chunk, verify_chunk};
use crate::memory::Allocator;
use crate::memory::mmap::MmapBackend;
use crate::memory::pool::{KvPool, PageId, PoolError, PoolLayout, PoolRole, PoolSpec};
use crate::model::{Attention, ModelIdentity};
use crate::tier::page_key::PageKey;
use crate::tier::prefix_index::{PrefixIndex, Tier};
#[cfg(feature = "negative-controls")]
use crate::transfer::pool_region::PoolRegion;
use crate::transfer::sim::SimTransport;
use crate::transfer::tcp::{GenerationCheck, TcpConfig, TcpReceiver, TcpTransport};
use crate::transfer::{
    BatchLimits, ReceiveRegion, RegionId, TransferError, TransferStatus, Transport, WriteBatch,
    WriteOp,
};

use super::error::SnapshotError;
use super::gate::{OneSidedGate, ReceiverGate, SnapshotGate};
use super::id::SnapshotId;
use super::layout::SlotGeometry;
use super::region::SnapshotRegion;
#[cfg(feature = "negative-controls")]
use super::shared_pool::{SharedPoolSnapshots, SharedPrepareOutcome};
use super::store::{
    AbortOutcome, FinalizeOutcome, Finalized, PrepareOutcome, SnapshotRequest, SnapshotStore,
    StoreConfig,
};

/// Region id of the snapshot buffer at the receiver.
pub const SNAPSHOT_REGION: RegionId = RegionId(1);
/// Region id of the KV pool at the receiver (used only by the negative control).
#[cfg(feature = "negative-controls")]
pub const KV_POOL_REGION: RegionId = RegionId(2);

/// Where snapshot bytes land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// The dedicated snapshot buffer ([`SnapshotStore`]).
    Dedicated,
    /// Pages of the prefill KV pool (`SharedPoolSnapshots`, the negative control; feature
    /// `negative-controls`).
    #[cfg(feature = "negative-controls")]
    SharedKvPool,
}

/// Which transport moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadTransport {
    /// Loopback TCP (receiver with the generation check).
    Tcp,
    /// The in-process one-sided transport.
    Sim,
}

/// Shape of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadConfig {
    /// Sync attempts.
    pub syncs: u32,
    /// Pages of the prefill KV pool.
    pub pool_pages: u32,
    /// Slots of the snapshot buffer (its bytes are `slots × page bytes`).
    pub buffer_slots: u32,
    /// Fewest pages of one snapshot.
    pub pages_min: u32,
    /// Most pages of one snapshot.
    pub pages_max: u32,
    /// Pages held by one prefill request (one finishes per tick). With `occupy_pool`, a snapshot
    /// larger than this could never finalize in this model (no tick frees enough pages at once), so
    /// `pages_max > prefill_request_pages` is refused as invalid.
    pub prefill_request_pages: u32,
    /// Whether prefill work fills the pool (the seed's condition). Off: the pool stays empty, which
    /// shows the negative control is a working receive path when it has room.
    pub occupy_pool: bool,
    /// Ticks after which an unfinalized snapshot may be evicted.
    pub stale_after_ticks: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Layers of the model.
    pub layers: u32,
    /// Head dimension (one KV head, 2-byte elements: `4 × head_dim` bytes per token and layer).
    pub head_dim: u32,
    /// Seed of arrivals and sizes.
    pub seed: u64,
    /// Transport.
    pub transport: WorkloadTransport,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            syncs: 500,
            pool_pages: 64,
            buffer_slots: 32,
            pages_min: 1,
            pages_max: 8,
            prefill_request_pages: 8,
            occupy_pool: true,
            stale_after_ticks: 64,
            page_tokens: 16,
            layers: 4,
            head_dim: 8,
            seed: 2,
            transport: WorkloadTransport::Sim,
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkloadReport {
    /// Sync attempts.
    pub attempted: u64,
    /// Syncs finalized with every chunk verified.
    pub succeeded: u64,
    /// Prepares refused with `snapshot-buf-full`.
    pub buf_full: u64,
    /// Prepares refused because the KV pool was full (negative control only).
    pub prepare_alloc_failed: u64,
    /// `alloc-failed-on-finalize` answers (each a retry later, not a loss).
    pub alloc_failed_on_finalize: u64,
    /// Snapshots evicted as stale before they could be finalized.
    pub evicted: u64,
    /// Transfers that did not complete.
    pub transfer_failed: u64,
    /// Chunks verified after finalize.
    pub verified_chunks: u64,
    /// Chunks that failed verification.
    pub corrupt_chunks: u64,
    /// Most free KV pool pages seen when a sync arrived (0: the pool was always full).
    pub max_pool_free_at_arrival: u64,
}

impl WorkloadReport {
    /// `succeeded / attempted` (0 when nothing was attempted).
    pub fn success_ratio(&self) -> f64 {
        if self.attempted == 0 {
            0.0
        } else {
            self.succeeded as f64 / self.attempted as f64
        }
    }
}

/// Errors that stop a run (protocol outcomes are counted, not errors).
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// Invalid configuration.
    #[error("invalid workload: {0}")]
    Invalid(String),
    /// Setting up or running the snapshot path.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// KV pool fault.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Transport fault.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Socket setup.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

enum Receiver {
    Dedicated(SnapshotStore),
    #[cfg(feature = "negative-controls")]
    Shared(SharedPoolSnapshots),
}

struct Rig {
    pool: Arc<KvPool>,
    transport: Box<dyn Transport>,
    peer: String,
    limits: BatchLimits,
    _tcp: Option<Arc<TcpReceiver>>,
}

fn model(cfg: &WorkloadConfig) -> ModelIdentity {
    ModelIdentity {
        name: "snapshot-workload".into(),
        layers: cfg.layers,
        attention: Attention::Gqa {
            kv_heads: 1,
            head_dim: cfg.head_dim,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    }
}

fn rig(backing: Backing, cfg: &WorkloadConfig) -> Result<(Rig, Receiver), WorkloadError> {
    let spec = PoolSpec {
        role: PoolRole::Target,
        model: model(cfg),
        page_tokens: cfg.page_tokens,
        pages: cfg.pool_pages,
        layout: PoolLayout::LayerFirst,
    };
    let pool = Arc::new(KvPool::new(
        spec,
        &Allocator::new("prefill KV pool", MmapBackend::new()),
    )?);
    let geometry = SlotGeometry::for_pool(
        pool.geometry(),
        u64::from(cfg.buffer_slots) * pool.geometry().page_bytes(),
    )?;
    // Its own allocator: the snapshot buffer shares nothing with the KV pool.
    let region = Arc::new(SnapshotRegion::new(
        &Allocator::new("snapshot buffer", MmapBackend::new()),
        geometry,
    )?);
    let mut regions: HashMap<RegionId, Arc<dyn ReceiveRegion>> = HashMap::new();
    regions.insert(SNAPSHOT_REGION, region.clone());
    // The negative control receives into the KV pool itself.
    #[cfg(feature = "negative-controls")]
    regions.insert(
        KV_POOL_REGION,
        Arc::new(PoolRegion::for_tcp(pool.clone()).map_err(SnapshotError::from)?),
    );
    let limits = BatchLimits::default();
    let (transport, peer, gate, tcp): (Box<dyn Transport>, String, Arc<dyn SnapshotGate>, _) =
        match cfg.transport {
            WorkloadTransport::Tcp => {
                let rx = Arc::new(TcpReceiver::bind("127.0.0.1:0", GenerationCheck::Enforced)?);
                for (id, r) in regions {
                    rx.register_region(id, r);
                }
                let gate = Arc::new(ReceiverGate::new(rx.clone(), Duration::from_secs(5)));
                let tx = TcpTransport::new(TcpConfig {
                    limits,
                    ..TcpConfig::default()
                });
                (Box::new(tx), rx.addr().to_string(), gate, Some(rx))
            }
            WorkloadTransport::Sim => {
                let tx = SimTransport::new(Arc::new(|_| Duration::ZERO), limits, None)?;
                tx.connect_peer("prefill", regions);
                (
                    Box::new(tx),
                    "prefill".to_owned(),
                    Arc::new(OneSidedGate),
                    None,
                )
            }
        };
    let receiver = match backing {
        Backing::Dedicated => Receiver::Dedicated(SnapshotStore::new(
            region,
            SNAPSHOT_REGION,
            gate,
            StoreConfig {
                stale_after: tick(cfg.stale_after_ticks),
                tier: Tier::L2Host,
            },
        )),
        #[cfg(feature = "negative-controls")]
        Backing::SharedKvPool => Receiver::Shared(SharedPoolSnapshots::new(
            pool.clone(),
            KV_POOL_REGION,
            gate,
            Tier::L2Host,
        )),
    };
    let rig = Rig {
        pool,
        transport,
        peer,
        limits,
        _tcp: tcp,
    };
    Ok((rig, receiver))
}

/// The workload's clock: one tick is one millisecond of a synthetic timeline.
fn tick(n: u32) -> Duration {
    Duration::from_millis(u64::from(n))
}

fn chunk_spec(
    session: u64,
    page: u32,
    layer: u32,
    cfg: &WorkloadConfig,
    token_bytes: usize,
) -> ChunkSpec {
    ChunkSpec {
        request: session,
        layer,
        first_token: page * cfg.page_tokens,
        tokens: cfg.page_tokens,
        token_bytes,
    }
}

fn keys_of(session: u64, pages: u32, page_tokens: u32) -> Vec<PageKey> {
    let tokens: Vec<u32> = (0..pages * page_tokens)
        .map(|t| (session as u32).wrapping_mul(1_000_003).wrapping_add(t))
        .collect();
    PageKey::chain_sequence(&tokens, page_tokens as usize)
}

struct Sync {
    session: u64,
    pages: u32,
}

/// Runs the workload once with `backing`.
///
/// # Errors
/// [`WorkloadError`] for an invalid config or a fault of the memory, pool or transport underneath;
/// protocol outcomes (full buffer, full pool) are counted in the report.
#[cfg_attr(not(feature = "negative-controls"), allow(irrefutable_let_patterns))]
pub fn run(backing: Backing, cfg: &WorkloadConfig) -> Result<WorkloadReport, WorkloadError> {
    if cfg.pages_min == 0 || cfg.pages_min > cfg.pages_max || cfg.prefill_request_pages == 0 {
        return Err(WorkloadError::Invalid(
            "need 1 <= pages_min <= pages_max and prefill_request_pages >= 1".into(),
        ));
    }
    if cfg.occupy_pool && cfg.pages_max > cfg.prefill_request_pages {
        return Err(WorkloadError::Invalid(format!(
            "pages_max {} > prefill_request_pages {}: with the pool occupied, the model never frees \
             enough pages at once to finalize such a snapshot",
            cfg.pages_max, cfg.prefill_request_pages
        )));
    }
    let (rig, mut receiver) = rig(backing, cfg)?;
    let token_bytes = rig.pool.geometry().bytes_per_token_layer as usize;
    let mut index = PrefixIndex::unbounded();
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let mut report = WorkloadReport::default();
    let mut prefill: VecDeque<Vec<PageId>> = VecDeque::new();
    if cfg.occupy_pool {
        admit_prefill(&rig.pool, &mut prefill, cfg.prefill_request_pages)?;
    }
    let mut waiting: VecDeque<(SnapshotId, Sync)> = VecDeque::new();
    let start = Instant::now();
    let mut t = 0u32;
    // Arrivals, then at most as many extra ticks again to let the last snapshots finalize.
    while report.attempted < u64::from(cfg.syncs) || (!waiting.is_empty() && t < 2 * cfg.syncs + 64)
    {
        let now = start + tick(t);
        let arrivals = if report.attempted < u64::from(cfg.syncs) {
            rng.random_range(0..=2u32)
                .min(cfg.syncs - report.attempted as u32)
        } else {
            0
        };
        for _ in 0..arrivals {
            let sync = Sync {
                session: report.attempted,
                pages: rng.random_range(cfg.pages_min..=cfg.pages_max),
            };
            report.attempted += 1;
            report.max_pool_free_at_arrival = report
                .max_pool_free_at_arrival
                .max(rig.pool.stats().free as u64);
            let req = SnapshotRequest {
                session: sync.session,
                keys: keys_of(sync.session, sync.pages, cfg.page_tokens),
            };
            match &mut receiver {
                Receiver::Dedicated(store) => match store.prepare(req, now)? {
                    PrepareOutcome::BufFull(_) => report.buf_full += 1,
                    PrepareOutcome::Granted(grant) => {
                        let pushed = push(&rig, &grant.key, &grant, &sync, cfg, token_bytes)?;
                        if pushed == Pushed::Completed {
                            store.seal(grant.id, now)?;
                            // Try at once: with the pool full this is alloc-failed-on-finalize and
                            // the snapshot waits, sealed, for the end of the tick.
                            match store.finalize(grant.id, &rig.pool, &mut index)? {
                                FinalizeOutcome::Finalized(done) => settle(
                                    &rig.pool,
                                    &mut index,
                                    &done,
                                    &sync,
                                    cfg,
                                    token_bytes,
                                    &mut report,
                                )?,
                                FinalizeOutcome::AllocFailedOnFinalize { .. } => {
                                    report.alloc_failed_on_finalize += 1;
                                    waiting.push_back((grant.id, sync));
                                }
                            }
                        } else {
                            report.transfer_failed += 1;
                            // Without a receiver fence the slots drain until the writer is terminal.
                            if store.abort(grant.id)? == AbortOutcome::Draining
                                && pushed == Pushed::FailedTerminal
                            {
                                store.drained(grant.id)?;
                            }
                        }
                    }
                },
                #[cfg(feature = "negative-controls")]
                Receiver::Shared(shared) => match shared.prepare(req)? {
                    SharedPrepareOutcome::AllocFailed { .. } => report.prepare_alloc_failed += 1,
                    SharedPrepareOutcome::Granted(grant) => {
                        if push(&rig, &grant.key, &grant, &sync, cfg, token_bytes)?
                            == Pushed::Completed
                        {
                            let done = shared.finalize(grant.id, &mut index)?;
                            settle(
                                &rig.pool,
                                &mut index,
                                &done,
                                &sync,
                                cfg,
                                token_bytes,
                                &mut report,
                            )?;
                        } else {
                            report.transfer_failed += 1;
                            shared.abort(grant.id)?;
                        }
                    }
                },
            }
        }
        // End of tick: one prefill request finishes; waiting snapshots go first, then new prefill.
        if let Some(done) = prefill.pop_front() {
            rig.pool.free(&done)?;
        }
        if let Receiver::Dedicated(store) = &mut receiver {
            let mut still = VecDeque::new();
            while let Some((id, sync)) = waiting.pop_front() {
                if store.state(id).is_none() {
                    report.evicted += 1;
                    continue;
                }
                match store.finalize(id, &rig.pool, &mut index)? {
                    FinalizeOutcome::Finalized(done) => {
                        settle(
                            &rig.pool,
                            &mut index,
                            &done,
                            &sync,
                            cfg,
                            token_bytes,
                            &mut report,
                        )?;
                    }
                    FinalizeOutcome::AllocFailedOnFinalize { .. } => {
                        report.alloc_failed_on_finalize += 1;
                        still.push_back((id, sync));
                    }
                }
            }
            waiting = still;
        }
        if cfg.occupy_pool {
            admit_prefill(&rig.pool, &mut prefill, cfg.prefill_request_pages)?;
        }
        t += 1;
    }
    if let Receiver::Dedicated(store) = &receiver {
        report.evicted = report.evicted.max(store.counters().evicted);
    }
    Ok(report)
}

/// Fills every free page of `pool` with prefill requests of `request_pages` pages (the last smaller).
fn admit_prefill(
    pool: &KvPool,
    prefill: &mut VecDeque<Vec<PageId>>,
    request_pages: u32,
) -> Result<(), PoolError> {
    loop {
        let free = pool.stats().free;
        if free == 0 {
            return Ok(());
        }
        prefill.push_back(pool.allocate(free.min(request_pages) as usize)?);
    }
}

/// How a push ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pushed {
    /// Every write landed.
    Completed,
    /// A write failed and every handle is terminal: nothing more can land.
    FailedTerminal,
    /// Not confirmed by the deadline (or not submitted): writes may still land.
    NotConfirmed,
}

/// Decode side: writes every chunk of `sync` where `grant` says, waits for the transport.
fn push(
    rig: &Rig,
    key: &crate::release::RoomKey,
    grant: &super::store::SnapshotGrant,
    sync: &Sync,
    cfg: &WorkloadConfig,
    token_bytes: usize,
) -> Result<Pushed, WorkloadError> {
    let mut ops = Vec::with_capacity((sync.pages * cfg.layers) as usize);
    for page in 0..sync.pages {
        for layer in 0..cfg.layers {
            let spec = chunk_spec(sync.session, page, layer, cfg, token_bytes);
            let mut data = vec![0u8; spec.bytes()];
            fill_chunk(&mut data, &spec);
            let Some(offset) = grant.chunk_offset(page as usize, layer) else {
                return Ok(Pushed::NotConfirmed);
            };
            ops.push(WriteOp {
                key: *key,
                region: grant.region,
                offset,
                data: Bytes::from(data),
            });
        }
    }
    for batch in WriteBatch::split(ops, rig.limits)? {
        let h = rig.transport.submit(&rig.peer, batch, None)?;
        let status = rig
            .transport
            .wait(h, Instant::now() + Duration::from_secs(10))?;
        if !status.is_terminal() {
            return Ok(Pushed::NotConfirmed);
        }
        rig.transport.release(h)?;
        if status != TransferStatus::Completed {
            return Ok(Pushed::FailedTerminal);
        }
    }
    Ok(Pushed::Completed)
}

/// Verifies every chunk of a finalized snapshot in the pool, counts it, then drops it from the pool
/// and the index (the prefix cache's eviction, out of this model).
fn settle(
    pool: &KvPool,
    index: &mut PrefixIndex,
    done: &Finalized,
    sync: &Sync,
    cfg: &WorkloadConfig,
    token_bytes: usize,
    report: &mut WorkloadReport,
) -> Result<(), WorkloadError> {
    let mut ok = true;
    let mut buf = vec![0u8; pool.geometry().chunk_bytes() as usize];
    for (i, page) in done.pages.iter().enumerate() {
        for layer in 0..cfg.layers {
            pool.read_chunk(*page, layer, 0, &mut buf)?;
            let spec = chunk_spec(sync.session, i as u32, layer, cfg, token_bytes);
            if verify_chunk(&buf, &spec).is_ok() {
                report.verified_chunks += 1;
            } else {
                report.corrupt_chunks += 1;
                ok = false;
            }
        }
    }
    if ok {
        report.succeeded += 1;
    }
    for k in &done.keys {
        index.remove(Tier::L2Host, k);
    }
    pool.free(&done.pages)?;
    Ok(())
}
