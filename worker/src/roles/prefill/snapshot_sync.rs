//! The prefill side of snapshot sync (DESIGN contract 4; seed 002; issue 15): the snapshot buffer
//! on the serving path.
//!
//! A decode worker pushes a finished turn's KV (prompt and generated tokens, one page per key) into
//! this prefill so that the session's next turn hits instead of recomputing. The pieces:
//!
//! - the **snapshot buffer**: one [`SnapshotRegion`] of `memory.snapshotBufferBytes`, from its own
//!   allocator (never the KV pool's), registered once with this prefill's own TCP data receiver
//!   (bound on `ports.data`, which a prefill used for nothing else) under [`SNAPSHOT_REGION`];
//!   the receiver enforces the generation fence (room = session, generation = snapshot id);
//! - the **prefill KV pool** ([`PrefillPages`]): the pages this prefill's prefill work holds. With
//!   the built-in engine every room holds one page per prompt page while it computes and sends
//!   (so concurrent prefill work keeps the pool full, seed 002's steady state); with an engine the
//!   pool is the engine's, reached through the engine API;
//! - the **protocol** ([`SnapshotStore`]): `SnapshotPrepare` reserves slots (or answers
//!   `snapshot-buf-full`, counted), the decode writes, `SnapshotSeal` seals and finalizes: pool
//!   pages are allocated *then*, the slots copied into them (every chunk verified against the page
//!   it must hold), and the keys inserted into the prefix index (the planner's L2). A full pool is
//!   `alloc-failed-on-finalize` (counted): the snapshot waits, sealed, in FIFO order, and is
//!   finalized as soon as prefill work frees pages — before that work may take them again
//!   ([`PrefillPages::acquire`] yields to waiting snapshots). Stale snapshots are evicted least
//!   recently used first when a prepare does not fit; `SnapshotAbort` frees (or drains) the slots.
//!
//! The built-in engine's L2 holds page keys, not bytes (its KV is regenerated): a finalized
//! snapshot's pages are verified and returned to the pool, its keys stay in the index. The keys a
//! snapshot *added* (not already in L2) are remembered, so `snapshot_hit_tokens` counts only the
//! hits sync made possible.
//!
//! NEGATIVE CONTROL (feature `negative-controls`, `TANDEM_SNAPSHOT_RECEIVE=kv-pool`): seed 002's old
//! design, the receive space taken from the prefill KV pool at prepare (`alloc-failed` when prefill
//! work holds it: the seed's 0 of 167).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::control::KvLayout;
use crate::control::pb;
use crate::health::counters::Counters;
use crate::memory::Allocator;
use crate::memory::mmap::MmapBackend;
use crate::memory::pool::{KvPool, PageId, PoolLayout, PoolRole, PoolSpec};
#[cfg(feature = "negative-controls")]
use crate::release::RoomKey;
use crate::snapshot::{
    FinalizeOutcome, Finalized, FinalizedBytes, PrepareOutcome, ReceiverGate, SlotGeometry,
    SnapshotError, SnapshotGrant, SnapshotId, SnapshotRegion, SnapshotRequest, SnapshotStore,
    StoreConfig,
};
use crate::tier::{PageKey, Tier};
use crate::transfer::RegionId;
use crate::transfer::tcp::{GenerationCheck, TcpReceiver};

use super::prefix_cache::PrefixCache;
use super::tiers::HostTiers;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Region id of the snapshot buffer at this prefill's snapshot receiver.
pub const SNAPSHOT_REGION: RegionId = RegionId(1);
/// Region id of the KV pool at the receiver (the negative control only).
#[cfg(feature = "negative-controls")]
pub const KV_POOL_REGION: RegionId = RegionId(2);

/// A reserved or sealed snapshot untouched this long may be evicted to make room (LRU).
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(30);

/// Most failed finalizes remembered for their seal's answer (a seal answers right after its
/// finalize; older entries belong to snapshots finalized late, whose seal already answered).
const LOST_KEPT: usize = 1024;

/// Longest a fence waits for writes being applied when a snapshot is aborted or sealed.
const FENCE_WAIT: Duration = Duration::from_secs(2);

/// The prefill KV pool: pages held by prefill work, and the pages finalized snapshots are copied
/// into. Prefill work waits for pages while a sealed snapshot waits for finalize, so a snapshot is
/// finalized at the first moment pages free (seed 002: "finalize at a moment the prefill scheduler
/// chooses").
pub struct PrefillPages {
    pool: Arc<KvPool>,
    freed: tokio::sync::Notify,
    /// Set by the snapshot side: whether a sealed snapshot waits for pages.
    waiting: Mutex<Option<Arc<SnapshotSync>>>,
}

impl PrefillPages {
    /// A pool of `pages` pages of `layout` in host memory (lazily touched).
    ///
    /// # Errors
    /// Pool allocation errors, as text.
    pub fn new(layout: KvLayout, pages: u32) -> Result<Arc<PrefillPages>, String> {
        let spec = PoolSpec {
            role: PoolRole::Target,
            model: crate::roles::sim::layout_model(layout),
            page_tokens: layout.page_tokens.max(1),
            pages: pages.max(1),
            layout: PoolLayout::PageFirst,
        };
        let pool = KvPool::new(spec, &Allocator::new("prefill KV pool", MmapBackend::new()))
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(PrefillPages {
            pool: Arc::new(pool),
            freed: tokio::sync::Notify::new(),
            waiting: Mutex::new(None),
        }))
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Pages free now.
    pub fn free_pages(&self) -> usize {
        self.pool.stats().free as usize
    }

    fn sync(&self) -> Option<Arc<SnapshotSync>> {
        lock(&self.waiting).clone()
    }

    /// Takes `n` pages for prefill work (at most the pool's size), waiting while the pool is full
    /// or a sealed snapshot waits for finalize; `None` at `deadline` (the work then runs without
    /// pool pages, logged by the caller).
    pub async fn acquire(&self, n: usize, deadline: tokio::time::Instant) -> Option<Vec<PageId>> {
        let n = n.clamp(1, self.pool.geometry().pages as usize);
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let snapshots_wait = self.sync().is_some_and(|s| s.pending() > 0);
            if !snapshots_wait && let Ok(p) = self.pool.allocate(n) {
                return Some(p);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return None;
            }
            // Bounded: a wake-up lost to a race costs one tick, never the deadline.
            let tick = (deadline - now).min(Duration::from_millis(50));
            let _ = tokio::time::timeout(tick, notified).await;
        }
    }

    /// Returns prefill work's pages; waiting snapshots are finalized first, then waiting work wakes.
    pub fn release(&self, pages: &[PageId]) {
        if let Err(e) = self.pool.free(pages) {
            tracing::error!(error = %e, "freeing prefill pool pages");
        }
        if let Some(s) = self.sync() {
            s.finalize_pending();
        }
        self.freed.notify_waiters();
    }
}

/// Whether `store` holds snapshot `id` of `session` (a decode names both; a mismatch is refused).
fn owns(store: &SnapshotStore, id: SnapshotId, session: u64) -> bool {
    store.session(id) == Some(session)
}

/// The keys of `keys` not present in L2 now (what a snapshot adds).
fn absent(index: &crate::tier::PrefixIndex, keys: &[PageKey]) -> Vec<PageKey> {
    keys.iter()
        .filter(|k| index.residency(Tier::L2Host, k) != Some(crate::tier::Residency::Present))
        .copied()
        .collect()
}

/// The keys of `keys` not in `before`.
#[cfg(feature = "negative-controls")]
fn absent_from(before: &std::collections::HashSet<PageKey>, keys: &[PageKey]) -> Vec<PageKey> {
    keys.iter()
        .filter(|k| !before.contains(k))
        .copied()
        .collect()
}

fn reply(outcome: pb::SnapshotOutcome, message: String) -> pb::SnapshotReply {
    pb::SnapshotReply {
        outcome: outcome as i32,
        message,
    }
}

fn grant_reply(g: &SnapshotGrant, data_addr: &str) -> pb::SnapshotPrepareReply {
    pb::SnapshotPrepareReply {
        outcome: pb::SnapshotOutcome::Granted as i32,
        snapshot: Some(pb::SnapshotRef {
            session: g.key.room.0,
            generation: g.key.generation.0,
        }),
        data_addr: data_addr.to_owned(),
        region_id: g.region.0,
        chunk_bytes: g.chunk_bytes,
        layers: g.layers,
        chunk_offsets: g.chunk_offsets.clone(),
        message: String::new(),
    }
}

/// What one finalize produced.
enum Finalize {
    /// Pages of the KV pool (the built-in engine), or the pool had no room; with the keys the
    /// snapshot adds to the prefix index.
    Pool(FinalizeOutcome, Vec<PageKey>),
    /// Page bytes for the host tier (an engine beside the worker).
    Bytes(FinalizedBytes),
}

/// Which receive space snapshots use.
enum Backing {
    /// The dedicated snapshot buffer (the design).
    Dedicated(SnapshotStore),
    /// NEGATIVE CONTROL: pages of the prefill KV pool taken at prepare (seed 002's old design).
    #[cfg(feature = "negative-controls")]
    SharedPool(crate::snapshot::SharedPoolSnapshots),
}

/// The prefill's snapshot service: buffer, receiver, protocol state and finalize queue.
pub struct SnapshotSync {
    backing: Mutex<Backing>,
    /// Sealed snapshots waiting for pool pages, FIFO.
    pending: Mutex<VecDeque<SnapshotId>>,
    /// Sealed snapshots whose finalize failed (dropped), with why, until their seal answers: a
    /// seal must not report `FINALIZED` for pages nobody will find. Bounded by [`LOST_KEPT`].
    lost: Mutex<std::collections::HashMap<SnapshotId, String>>,
    /// Held for a whole [`SnapshotSync::finalize_pending`] pass: a seal and a page release may
    /// both start one, and two passes reading the same front would finalize it once and then
    /// drop the *next* waiting snapshot from the queue unfinalized (CI stop 26: one sync of 100
    /// never finalized).
    finalizing: Mutex<()>,
    /// Held so the receiver serves while the service lives (the gate holds it too); the negative
    /// control fences its rooms through it directly.
    #[cfg_attr(not(feature = "negative-controls"), allow(dead_code))]
    receiver: Arc<TcpReceiver>,
    data_addr: String,
    pages: Arc<PrefillPages>,
    layout: KvLayout,
    counters: Counters,
    into: ReceiveInto,
    publish: Publish,
    /// Prepares answered, and how many found the prefill KV pool with no free page (the
    /// occupancy seed 002 measured under).
    prepares: AtomicU64,
    prepares_pool_full: AtomicU64,
    /// Seals, and how many found the KV pool without room for the snapshot (it waited).
    seals: AtomicU64,
    seals_pool_full: AtomicU64,
}

/// Where a finalized snapshot is published for the session's next turn.
#[derive(Clone)]
pub enum Publish {
    /// The built-in engine: its KV pool and the prefix cache's index (L2 holds keys; its KV is
    /// regenerated). Every finalized chunk is verified against the page it must hold.
    PrefixCache(Arc<PrefixCache>),
    /// An engine beside the worker: the host tier whose L2 the engine's Lookup and Load read
    /// ([`HostTiers::insert_snapshot`]). The bytes are the decode engine's; the prefill engine
    /// verifies what it loads.
    HostTiers(Arc<HostTiers>),
}

/// How the prefill received snapshots: `TANDEM_SNAPSHOT_RECEIVE` (`buffer`, the default, or
/// `kv-pool`, the negative control, only with the `negative-controls` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiveInto {
    /// The dedicated snapshot buffer.
    Buffer,
    /// NEGATIVE CONTROL: the prefill KV pool (seed 002's old design).
    #[cfg(feature = "negative-controls")]
    KvPool,
}

impl ReceiveInto {
    /// Parses `TANDEM_SNAPSHOT_RECEIVE`.
    ///
    /// # Errors
    /// An unknown value, or `kv-pool` in a build without `negative-controls`.
    pub fn parse(v: Option<&str>) -> Result<ReceiveInto, String> {
        match v.map(str::trim) {
            None | Some("") | Some("buffer") => Ok(ReceiveInto::Buffer),
            #[cfg(feature = "negative-controls")]
            Some("kv-pool") => Ok(ReceiveInto::KvPool),
            Some(other) => Err(format!(
                "TANDEM_SNAPSHOT_RECEIVE={other}: expected `buffer` (`kv-pool` is a negative \
                 control, only in builds with the negative-controls feature)"
            )),
        }
    }
}

impl SnapshotSync {
    /// Binds the snapshot receiver on `bind` (host:port), allocates `buffer_bytes` of snapshot
    /// buffer over `pages`' geometry and registers it; `into` picks the receive space.
    ///
    /// # Errors
    /// A text reason when the port cannot be bound or the buffer holds no slot.
    pub fn start(
        bind: &str,
        buffer_bytes: u64,
        pages: Arc<PrefillPages>,
        layout: KvLayout,
        counters: Counters,
        into: ReceiveInto,
        publish: Publish,
    ) -> Result<Arc<SnapshotSync>, String> {
        if into != ReceiveInto::Buffer && matches!(publish, Publish::HostTiers(_)) {
            return Err(
                "TANDEM_SNAPSHOT_RECEIVE=kv-pool is a built-in-engine negative control: with an \
                 engine the KV pool is the engine's, not a receive space of the worker"
                    .into(),
            );
        }
        let receiver = Arc::new(
            TcpReceiver::bind(bind, GenerationCheck::Enforced)
                .map_err(|e| format!("binding the snapshot receiver on {bind}: {e}"))?,
        );
        let gate = Arc::new(ReceiverGate::new(receiver.clone(), FENCE_WAIT));
        let geometry = SlotGeometry::for_pool(pages.pool().geometry(), buffer_bytes)
            .map_err(|e| e.to_string())?;
        let region = Arc::new(
            SnapshotRegion::new(
                &Allocator::new("snapshot buffer", MmapBackend::new()),
                geometry,
            )
            .map_err(|e| e.to_string())?,
        );
        receiver.register_region(SNAPSHOT_REGION, region.clone());
        let backing = match into {
            ReceiveInto::Buffer => Backing::Dedicated(SnapshotStore::new(
                region,
                SNAPSHOT_REGION,
                gate,
                StoreConfig {
                    stale_after: DEFAULT_STALE_AFTER,
                    tier: Tier::L2Host,
                },
            )),
            #[cfg(feature = "negative-controls")]
            ReceiveInto::KvPool => {
                let pool_region =
                    crate::transfer::pool_region::PoolRegion::for_tcp(pages.pool().clone())
                        .map_err(|e| e.to_string())?;
                receiver.register_region(KV_POOL_REGION, Arc::new(pool_region));
                tracing::warn!(
                    "NEGATIVE CONTROL: snapshots are received into the prefill KV pool (seed 002's old design)"
                );
                Backing::SharedPool(crate::snapshot::SharedPoolSnapshots::new(
                    pages.pool().clone(),
                    KV_POOL_REGION,
                    gate,
                    Tier::L2Host,
                ))
            }
        };
        let sync = Arc::new(SnapshotSync {
            backing: Mutex::new(backing),
            pending: Mutex::new(VecDeque::new()),
            lost: Mutex::new(std::collections::HashMap::new()),
            finalizing: Mutex::new(()),
            data_addr: receiver.addr().to_string(),
            receiver,
            pages: pages.clone(),
            layout,
            counters,
            into,
            publish,
            prepares: AtomicU64::new(0),
            prepares_pool_full: AtomicU64::new(0),
            seals: AtomicU64::new(0),
            seals_pool_full: AtomicU64::new(0),
        });
        *lock(&pages.waiting) = Some(sync.clone());
        Ok(sync)
    }

    /// Stale snapshots evicted so far (LRU, to make room).
    pub fn evicted(&self) -> u64 {
        match &*lock(&self.backing) {
            Backing::Dedicated(s) => s.counters().evicted,
            #[cfg(feature = "negative-controls")]
            Backing::SharedPool(_) => 0,
        }
    }

    /// The `snapshot` object of `/report`: `receive` (`buffer`, or `kv-pool` in the negative
    /// control), `data_addr`, `pool_pages`, `pool_free`, `pending` (sealed, waiting for pool
    /// pages), `live`, `prepares`, `prepares_pool_full` (prepares that found the prefill KV pool
    /// without a free page), `seals`, `seals_pool_full` (seals whose finalize found the pool
    /// without room: `alloc-failed-on-finalize`, the snapshot waited for pages).
    pub fn report(&self) -> serde_json::Value {
        let (pool_pages, pool_free) = match &self.publish {
            Publish::PrefixCache(_) => (
                self.pages.pool().geometry().pages as usize,
                self.pages.free_pages(),
            ),
            Publish::HostTiers(t) => (t.l2_capacity(), t.l2_capacity().saturating_sub(t.l2_len())),
        };
        serde_json::json!({
            "publish": match self.publish {
                Publish::PrefixCache(_) => "prefix-cache",
                Publish::HostTiers(_) => "host-tiers",
            },
            "receive": match self.into {
                ReceiveInto::Buffer => "buffer",
                #[cfg(feature = "negative-controls")]
                ReceiveInto::KvPool => "kv-pool",
            },
            "data_addr": self.data_addr,
            "pool_pages": pool_pages,
            "pool_free": pool_free,
            "pending": self.pending(),
            "live": self.live(),
            "prepares": self.prepares.load(Ordering::Relaxed),
            "prepares_pool_full": self.prepares_pool_full.load(Ordering::Relaxed),
            "seals": self.seals.load(Ordering::Relaxed),
            "seals_pool_full": self.seals_pool_full.load(Ordering::Relaxed),
        })
    }

    /// The snapshot receiver's address (what a grant names).
    pub fn data_addr(&self) -> &str {
        &self.data_addr
    }

    /// Sealed snapshots waiting for pool pages.
    pub fn pending(&self) -> usize {
        lock(&self.pending).len()
    }

    /// Live snapshots (any state).
    pub fn live(&self) -> usize {
        match &*lock(&self.backing) {
            Backing::Dedicated(s) => s.live(),
            #[cfg(feature = "negative-controls")]
            Backing::SharedPool(_) => 0,
        }
    }

    /// Stops finalizing (drain): the pool no longer waits for snapshots, and the receiver stops
    /// when the last handle of this service drops.
    pub fn shutdown(&self) {
        lock(&self.pending).clear();
        *lock(&self.pages.waiting) = None;
    }

    /// `SnapshotPrepare`: reserves one slot per page key (or answers `snapshot-buf-full`).
    pub fn prepare(&self, req: &pb::SnapshotPrepareRequest) -> pb::SnapshotPrepareReply {
        let refuse = |outcome: pb::SnapshotOutcome, message: String| pb::SnapshotPrepareReply {
            outcome: outcome as i32,
            message,
            ..Default::default()
        };
        if req.layout.map(KvLayout::from) != Some(self.layout) {
            return refuse(
                pb::SnapshotOutcome::Unspecified,
                "KV layout mismatch".into(),
            );
        }
        self.prepares.fetch_add(1, Ordering::Relaxed);
        if self.pages.free_pages() == 0 {
            self.prepares_pool_full.fetch_add(1, Ordering::Relaxed);
        }
        let request = SnapshotRequest {
            session: req.session,
            keys: req
                .page_keys
                .iter()
                .copied()
                .map(PageKey::from_trace_id)
                .collect(),
        };
        let grant = match &mut *lock(&self.backing) {
            Backing::Dedicated(store) => match store.prepare(request, Instant::now()) {
                Ok(PrepareOutcome::Granted(g)) => {
                    self.counters.snapshot_reserved.inc();
                    g
                }
                Ok(PrepareOutcome::BufFull(full)) => {
                    return refuse(
                        pb::SnapshotOutcome::BufFull,
                        format!(
                            "snapshot-buf-full: {} slots needed, {} free, {} draining",
                            full.needed, full.free, full.draining
                        ),
                    );
                }
                Err(e) => return refuse(pb::SnapshotOutcome::Unspecified, e.to_string()),
            },
            #[cfg(feature = "negative-controls")]
            Backing::SharedPool(shared) => match shared.prepare(request) {
                Ok(crate::snapshot::SharedPrepareOutcome::Granted(g)) => {
                    self.counters.snapshot_reserved.inc();
                    g
                }
                Ok(crate::snapshot::SharedPrepareOutcome::AllocFailed { needed, pool_free }) => {
                    return refuse(
                        pb::SnapshotOutcome::AllocFailed,
                        format!("alloc-failed: {needed} KV pool pages needed, {pool_free} free"),
                    );
                }
                Err(e) => return refuse(pb::SnapshotOutcome::Unspecified, e.to_string()),
            },
        };
        grant_reply(&grant, &self.data_addr)
    }

    /// `SnapshotSeal`: the decode's writes all completed. Finalizes now, or queues the snapshot
    /// until pool pages free (`alloc-failed-on-finalize`).
    pub fn seal(&self, r: pb::SnapshotRef) -> pb::SnapshotReply {
        let id = SnapshotId(r.generation);
        let sealed = match &mut *lock(&self.backing) {
            Backing::Dedicated(store) => {
                if !owns(store, id, r.session) {
                    return reply(
                        pb::SnapshotOutcome::Unspecified,
                        format!("unknown snapshot {id} of session {}", r.session),
                    );
                }
                store.seal(id, Instant::now())
            }
            #[cfg(feature = "negative-controls")]
            Backing::SharedPool(_) => {
                let key = RoomKey::new(r.session, r.generation);
                self.receiver
                    .fence(key, Instant::now() + FENCE_WAIT)
                    .map(|_| ())
                    .map_err(|e| SnapshotError::Unknown(SnapshotId(e.key.generation.0)))
            }
        };
        if let Err(e) = sealed {
            return reply(pb::SnapshotOutcome::Unspecified, e.to_string());
        }
        lock(&self.pending).push_back(id);
        self.finalize_pending();
        self.seals.fetch_add(1, Ordering::Relaxed);
        // Queued first, lost second: a finalize pass on another thread can only move it from the
        // queue to `lost`, never back.
        let queued = lock(&self.pending).contains(&id);
        if !queued && let Some(why) = lock(&self.lost).remove(&id) {
            return reply(
                pb::SnapshotOutcome::Unspecified,
                format!("finalize failed, the snapshot was dropped: {why}"),
            );
        }
        if queued {
            self.seals_pool_full.fetch_add(1, Ordering::Relaxed);
            reply(
                pb::SnapshotOutcome::PendingFinalize,
                "alloc-failed-on-finalize: the KV pool is full; finalized when pages free".into(),
            )
        } else {
            reply(pb::SnapshotOutcome::Finalized, String::new())
        }
    }

    /// `SnapshotAbort`: the decode gave up (a write failed, or its deadline passed).
    pub fn abort(&self, r: pb::SnapshotRef) -> pb::SnapshotReply {
        let id = SnapshotId(r.generation);
        lock(&self.pending).retain(|p| *p != id);
        let done = match &mut *lock(&self.backing) {
            Backing::Dedicated(store) => {
                if !owns(store, id, r.session) {
                    return reply(pb::SnapshotOutcome::Aborted, "not live".into());
                }
                store.abort(id).map(|_| ())
            }
            #[cfg(feature = "negative-controls")]
            Backing::SharedPool(shared) => {
                let key = RoomKey::new(r.session, r.generation);
                let _ = self.receiver.fence(key, Instant::now() + FENCE_WAIT);
                shared.abort(id)
            }
        };
        match done {
            Ok(()) => {
                self.counters.snapshot_aborted.inc();
                reply(pb::SnapshotOutcome::Aborted, String::new())
            }
            Err(e) => reply(pb::SnapshotOutcome::Aborted, e.to_string()),
        }
    }

    /// Finalizes waiting snapshots in FIFO order until one finds the pool full. One pass at a
    /// time; a snapshot leaves the queue by its id, never by position.
    pub fn finalize_pending(&self) {
        let _pass = lock(&self.finalizing);
        loop {
            let Some(id) = lock(&self.pending).front().copied() else {
                return;
            };
            let outcome = {
                let mut backing = lock(&self.backing);
                match &mut *backing {
                    Backing::Dedicated(store) => match &self.publish {
                        Publish::PrefixCache(cache) => cache.with_index(|index| {
                            let fresh = absent(index, store.keys(id).unwrap_or_default());
                            store
                                .finalize(id, self.pages.pool(), index)
                                .map(|o| Finalize::Pool(o, fresh))
                        }),
                        Publish::HostTiers(_) => store.finalize_to_bytes(id).map(Finalize::Bytes),
                    },
                    #[cfg(feature = "negative-controls")]
                    Backing::SharedPool(shared) => match &self.publish {
                        Publish::PrefixCache(cache) => cache.with_index(|index| {
                            let before: std::collections::HashSet<PageKey> =
                                index.present_keys(Tier::L2Host).into_iter().collect();
                            shared.finalize(id, index).map(|f| {
                                let fresh = absent_from(&before, &f.keys);
                                Finalize::Pool(FinalizeOutcome::Finalized(f), fresh)
                            })
                        }),
                        // `start` refuses the KV-pool receive space with an engine.
                        Publish::HostTiers(_) => Err(SnapshotError::Unknown(id)),
                    },
                }
            };
            match outcome {
                Ok(Finalize::Pool(FinalizeOutcome::Finalized(f), fresh)) => {
                    self.unqueue(id);
                    self.finalized(f, &fresh);
                }
                Ok(Finalize::Bytes(f)) => {
                    self.unqueue(id);
                    self.published(f);
                }
                Ok(Finalize::Pool(FinalizeOutcome::AllocFailedOnFinalize { .. }, _)) => {
                    self.counters.snapshot_alloc_failed_on_finalize.inc();
                    return;
                }
                Err(SnapshotError::Unknown(_)) => {
                    // Evicted as stale (or aborted) while it waited.
                    self.unqueue(id);
                }
                Err(e) => {
                    tracing::error!(snapshot = %id, error = %e, "snapshot finalize failed; dropped");
                    self.lost(id, e.to_string());
                    self.unqueue(id);
                    #[allow(irrefutable_let_patterns)]
                    if let Backing::Dedicated(store) = &mut *lock(&self.backing) {
                        let _ = store.abort(id);
                    }
                }
            }
        }
    }

    /// Records that sealed snapshot `id` was dropped at finalize (`why`), for its seal's answer.
    fn lost(&self, id: SnapshotId, why: String) {
        let mut lost = lock(&self.lost);
        if lost.len() >= LOST_KEPT {
            lost.clear();
        }
        lost.insert(id, why);
    }

    /// Takes `id` out of the finalize queue (wherever it stands; absent is fine).
    fn unqueue(&self, id: SnapshotId) {
        let mut q = lock(&self.pending);
        if let Some(i) = q.iter().position(|p| *p == id) {
            q.remove(i);
        }
    }

    /// A snapshot taken out of the buffer as bytes (the engine path): into the host tier's L2.
    fn published(&self, f: FinalizedBytes) {
        let Publish::HostTiers(tiers) = &self.publish else {
            return;
        };
        let pages = f.keys.iter().copied().zip(f.pages).collect();
        if let Err(e) = tiers.insert_snapshot(pages) {
            tracing::error!(snapshot = %f.id, error = %e, "snapshot not published in L2");
            self.lost(f.id, e);
            return;
        }
        self.counters.snapshot_finalized.inc();
        tracing::debug!(snapshot = %f.id, session = f.session, pages = f.keys.len(), "snapshot finalized into L2");
    }

    /// A snapshot is in the pool and the index: verify every chunk against the page it must hold,
    /// remember the keys it added, and return the pages (the built-in engine's L2 holds keys).
    fn finalized(&self, f: Finalized, fresh: &[PageKey]) {
        let chunk = self.layout.chunk_bytes() as usize;
        let mut buf = vec![0u8; chunk];
        let mut corrupt = 0u64;
        for (page, key) in f.pages.iter().zip(&f.keys) {
            let expected = PrefixCache::object_bytes(*key, self.layout);
            for layer in 0..self.layout.layers {
                let ok = self
                    .pages
                    .pool()
                    .read_chunk(*page, layer, 0, &mut buf)
                    .is_ok()
                    && expected
                        .get(layer as usize * chunk..(layer as usize + 1) * chunk)
                        .is_some_and(|e| e == buf.as_slice());
                if !ok {
                    corrupt += 1;
                }
            }
        }
        let mut published = true;
        if let Publish::PrefixCache(cache) = &self.publish {
            if corrupt > 0 {
                tracing::error!(snapshot = %f.id, corrupt, "snapshot chunks do not hold their pages");
                self.counters.corrupt_pages_read.inc_by(corrupt);
                cache.with_index(|index| {
                    for key in &f.keys {
                        index.remove(Tier::L2Host, key);
                    }
                });
                self.lost(f.id, format!("{corrupt} chunks do not hold their pages"));
                published = false;
            } else {
                cache.mark_from_snapshot(fresh);
            }
        }
        if let Err(e) = self.pages.pool().free(&f.pages) {
            tracing::error!(error = %e, "returning finalized snapshot pages");
        }
        if !published {
            return;
        }
        self.counters.snapshot_finalized.inc();
        tracing::debug!(snapshot = %f.id, session = f.session, pages = f.pages.len(), "snapshot finalized");
    }
}

/// Pages of the built-in engine's prefill KV pool that rooms hold while they compute:
/// `TANDEM_SIM_PREFILL_POOL_PAGES` (a simulation knob, `roles::sim`). Unset: rooms hold none and
/// the pool (the target pool's pages, capped like a decode's region) only receives finalized
/// snapshots.
pub const POOL_PAGES_ENV: &str = "TANDEM_SIM_PREFILL_POOL_PAGES";

/// The built-in engine's snapshot sync: its KV pool (held by rooms only with
/// [`POOL_PAGES_ENV`]) and the snapshot service, its receiver bound on `ports.data`.
///
/// # Errors
/// A text reason: a bad knob, an unbindable port, a buffer that holds no page.
pub fn start_builtin(
    cfg: &crate::config::WorkerConfig,
    opts: &super::PrefillOptions,
    layout: KvLayout,
    cache: Arc<PrefixCache>,
    counters: Counters,
) -> Result<(Option<Arc<PrefillPages>>, Arc<SnapshotSync>), String> {
    let held: Option<u32> = match std::env::var(POOL_PAGES_ENV) {
        Ok(v) => Some(
            v.trim()
                .parse()
                .ok()
                .filter(|n: &u32| *n > 0)
                .ok_or_else(|| format!("{POOL_PAGES_ENV}={v}: expected a page count > 0"))?,
        ),
        Err(_) => None,
    };
    let pages = held
        .unwrap_or_else(|| crate::roles::sim::region_pages(cfg.memory.target_pool_bytes, layout));
    let pool = PrefillPages::new(layout, pages)?;
    let into = ReceiveInto::parse(std::env::var("TANDEM_SNAPSHOT_RECEIVE").ok().as_deref())?;
    let bind = std::net::SocketAddr::new(opts.bind_ip, cfg.ports.data).to_string();
    let sync = SnapshotSync::start(
        &bind,
        cfg.memory.snapshot_buffer_bytes,
        pool.clone(),
        layout,
        counters,
        into,
        Publish::PrefixCache(cache),
    )?;
    tracing::info!(
        data_addr = %sync.data_addr(),
        buffer_bytes = cfg.memory.snapshot_buffer_bytes,
        pool_pages = pages,
        rooms_hold_pages = held.is_some(),
        receive = ?into,
        "snapshot sync: receiving session snapshots"
    );
    Ok((held.map(|_| pool), sync))
}

/// The snapshot sync of a prefill with an engine beside it (DESIGN §3.1 "Snapshot and
/// LayerSplit"): the dedicated buffer and its receiver on `ports.data`, as with the built-in
/// engine; a sealed snapshot is finalized at once into `tiers`' L2 ([`Publish::HostTiers`]), where
/// the next turn's Lookup finds it and its Load copies it into the engine's pages (contract 5).
/// L2 makes room by evicting its least recently used page, so no finalize waits for pages here.
///
/// # Errors
/// A text reason: an unbindable port, a buffer that holds no page, or the negative control
/// `TANDEM_SNAPSHOT_RECEIVE=kv-pool` (the engine's KV pool is the engine's to fill, not a receive
/// space the worker may allocate from).
pub fn start_engine(
    cfg: &crate::config::WorkerConfig,
    opts: &super::PrefillOptions,
    layout: KvLayout,
    tiers: Arc<HostTiers>,
    counters: Counters,
) -> Result<Arc<SnapshotSync>, String> {
    let into = ReceiveInto::parse(std::env::var("TANDEM_SNAPSHOT_RECEIVE").ok().as_deref())?;
    // One page: the slot geometry's template. Nothing is finalized into it (Publish::HostTiers).
    let geometry = PrefillPages::new(layout, 1)?;
    let bind = std::net::SocketAddr::new(opts.bind_ip, cfg.ports.data).to_string();
    let sync = SnapshotSync::start(
        &bind,
        cfg.memory.snapshot_buffer_bytes,
        geometry,
        layout,
        counters,
        into,
        Publish::HostTiers(tiers),
    )?;
    tracing::info!(
        data_addr = %sync.data_addr(),
        buffer_bytes = cfg.memory.snapshot_buffer_bytes,
        "snapshot sync: receiving session snapshots into L2 for the engine"
    );
    Ok(sync)
}
