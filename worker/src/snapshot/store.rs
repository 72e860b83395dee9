//! The snapshot protocol, one state machine per snapshot (DESIGN contract 4; seed 002;
//! dataplane.md §8 state machine 7 "Snapshot slot").
//!
//! ```text
//!   prepare ──► RESERVED ──seal──► SEALED ──finalize──► (slots free, pages in the KV pool + index)
//!     │            │                  │  └─finalize, pool full──► SEALED (alloc-failed-on-finalize)
//!     │            │abort/evict       │abort/evict
//!     │            ├─[fence proof]────┴──────────────► (slots free)
//!     │            └─[no proof]──► DRAINING ──drained──► (slots free)
//!     └─[no room even after evicting stale snapshots]──► snapshot-buf-full (nothing reserved)
//! ```
//!
//! - **prepare** reserves one slot per KV page, all or none, in the dedicated buffer. It never takes a
//!   page of the prefill KV pool: that contention is the seed-002 outage (0 of 167 syncs succeeded
//!   because `prepare_receive` allocated from the busy pool). When the buffer is full the answer is
//!   [`PrepareOutcome::BufFull`], backpressure the decode side sees and can act on (re-prefill or
//!   retry) — never a silent fallback into the KV pool.
//! - **transfer** is the decode side writing each `(page, layer)` chunk at
//!   [`SnapshotGrant::chunk_offset`] through any [`crate::transfer::Transport`], tagged with
//!   [`SnapshotGrant::key`]. **seal** records that the writer reported its transfer complete.
//! - **finalize** allocates KV pool pages *now* (the moment can be chosen: between prefill batches),
//!   copies the slots into them and inserts the page keys into the prefix index. If the pool has no
//!   room the answer is [`FinalizeOutcome::AllocFailedOnFinalize`] and the snapshot stays sealed in
//!   its slots for a retry (the seed's design freed it and lost the bytes).
//! - **abort** (and eviction) frees the slots at once when the [`SnapshotGate`] proves no write can
//!   land any more (TCP receiver fence, or nothing was ever open), otherwise the slots go DRAINING
//!   and are reused only after [`SnapshotStore::drained`]: a late write can never land in a slot
//!   that a newer snapshot owns.
//! - **eviction**: when a prepare does not fit, RESERVED and SEALED snapshots untouched for
//!   `stale_after` are retired least recently used first, but only if that makes enough room.
//!   DRAINING snapshots are never evicted (their writer may still land bytes).
//!
//! Pure logic apart from memory copies: time is passed in (`now`), receiver I/O sits behind the gate.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::memory::pool::{KvPool, PageError, PageId, PoolError};
use crate::release::RoomKey;
use crate::release::receiver::TransportProof;
use crate::tier::page_key::PageKey;
use crate::tier::prefix_index::{PrefixIndex, Residency, Tier};
use crate::transfer::{ReceiveRegion, RegionId};

use super::counters::SnapshotCounters;
use super::error::SnapshotError;
use super::gate::SnapshotGate;
use super::id::{SnapshotId, SnapshotState};
use super::layout::SlotIndex;
use super::region::SnapshotRegion;

/// A decode session's request to sync its KV into this prefill worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRequest {
    /// Decode session id (the room id of the snapshot's writes).
    pub session: u64,
    /// Prefix keys of the session's pages, in order; one slot is reserved per key.
    pub keys: Vec<PageKey>,
}

/// What the decode side needs to write a snapshot: where each chunk goes and the room key to tag
/// the writes with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotGrant {
    /// The snapshot.
    pub id: SnapshotId,
    /// Room key of every write (room = session, generation = snapshot id).
    pub key: RoomKey,
    /// Region id the buffer is registered under at the receiver.
    pub region: RegionId,
    /// Bytes of one `(page, layer)` chunk.
    pub chunk_bytes: u64,
    /// Layers per page.
    pub layers: u32,
    /// Byte offset in `region` of every chunk, page-major: `[page][layer]`.
    pub chunk_offsets: Vec<u64>,
}

impl SnapshotGrant {
    /// Pages in the snapshot.
    pub fn pages(&self) -> usize {
        self.chunk_offsets
            .len()
            .checked_div(self.layers as usize)
            .unwrap_or(0)
    }

    /// Offset of chunk `(page, layer)` in the region, or `None` out of range.
    pub fn chunk_offset(&self, page: usize, layer: u32) -> Option<u64> {
        if layer >= self.layers {
            return None;
        }
        self.chunk_offsets
            .get(page * self.layers as usize + layer as usize)
            .copied()
    }
}

/// `snapshot-buf-full`: not enough free slots even after retiring the stale snapshots that could
/// help. Nothing was reserved. Stale snapshots evicted on the way (counted in `evicted`) stay
/// evicted: freed, or — a reserved one whose writer cannot be proven stopped — draining until it
/// is (their slots are in `draining`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufFull {
    /// Slots the snapshot needs.
    pub needed: usize,
    /// Slots free.
    pub free: usize,
    /// Slots held by draining snapshots (freed when their writers are terminal).
    pub draining: usize,
}

/// Answer of [`SnapshotStore::prepare`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrepareOutcome {
    /// Slots reserved; write the snapshot there.
    Granted(SnapshotGrant),
    /// Backpressure: the buffer is full.
    BufFull(BufFull),
}

/// A snapshot now in the KV pool and the prefix index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finalized {
    /// The snapshot (gone from the store).
    pub id: SnapshotId,
    /// Its session.
    pub session: u64,
    /// KV pool pages holding it, one per key, owned by the caller (the prefix cache) from now on.
    pub pages: Vec<PageId>,
    /// Keys inserted into the prefix index.
    pub keys: Vec<PageKey>,
    /// Keys the index evicted to respect its capacity (their pages are the caller's to free).
    pub index_evicted: Vec<PageKey>,
}

/// A snapshot taken out of the buffer as page bytes ([`SnapshotStore::finalize_to_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalizedBytes {
    /// The snapshot (gone from the store).
    pub id: SnapshotId,
    /// Its session.
    pub session: u64,
    /// Its page keys, in order.
    pub keys: Vec<PageKey>,
    /// One entry per key: every layer's chunk, in layer order (`layers × chunk_bytes` bytes).
    pub pages: Vec<std::sync::Arc<[u8]>>,
}

/// Answer of [`SnapshotStore::finalize`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinalizeOutcome {
    /// Copied and inserted; the slots are free.
    Finalized(Finalized),
    /// `alloc-failed-on-finalize`: the KV pool has too few free pages now. The snapshot stays sealed
    /// in its slots; retry later (e.g. after the next prefill batch frees pages).
    AllocFailedOnFinalize {
        /// Pages needed.
        needed: usize,
        /// Pages free in the pool.
        pool_free: usize,
    },
}

/// Answer of [`SnapshotStore::abort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// Slots free now; `Some` names the transport proof, `None` means the writer had already
    /// reported its transfer terminal (sealed).
    Freed(Option<TransportProof>),
    /// Writes may still land: slots held until [`SnapshotStore::drained`].
    Draining,
}

/// Store settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// A reserved or sealed snapshot untouched this long may be evicted to make room.
    pub stale_after: Duration,
    /// Tier of the prefix index the KV pool's pages are published in (the prefill pool's tier).
    pub tier: Tier,
}

#[derive(Debug)]
struct Record {
    session: u64,
    key: RoomKey,
    keys: Vec<PageKey>,
    slots: Vec<SlotIndex>,
    state: SnapshotState,
    touched: Instant,
}

/// The snapshot buffer's protocol state: one record per live snapshot.
pub struct SnapshotStore {
    region: Arc<SnapshotRegion>,
    region_id: RegionId,
    gate: Arc<dyn SnapshotGate>,
    config: StoreConfig,
    records: BTreeMap<SnapshotId, Record>,
    live_by_session: HashMap<u64, SnapshotId>,
    next_id: u64,
    counters: SnapshotCounters,
}

impl SnapshotStore {
    /// A store over `region`, registered at the receiver as `region_id`, fencing rooms through `gate`.
    pub fn new(
        region: Arc<SnapshotRegion>,
        region_id: RegionId,
        gate: Arc<dyn SnapshotGate>,
        config: StoreConfig,
    ) -> SnapshotStore {
        SnapshotStore {
            region,
            region_id,
            gate,
            config,
            records: BTreeMap::new(),
            live_by_session: HashMap::new(),
            next_id: 1,
            counters: SnapshotCounters::default(),
        }
    }

    /// Counters so far.
    pub fn counters(&self) -> SnapshotCounters {
        self.counters
    }

    /// The state of `id`, `None` when it is not live.
    pub fn state(&self, id: SnapshotId) -> Option<SnapshotState> {
        self.records.get(&id).map(|r| r.state)
    }

    /// Live snapshots (any state).
    pub fn live(&self) -> usize {
        self.records.len()
    }

    /// The buffer.
    pub fn region(&self) -> &Arc<SnapshotRegion> {
        &self.region
    }

    /// Session of live snapshot `id` (a caller checks a `(session, id)` pair it was handed).
    pub fn session(&self, id: SnapshotId) -> Option<u64> {
        self.records.get(&id).map(|r| r.session)
    }

    /// Page keys of live snapshot `id`, in order.
    pub fn keys(&self, id: SnapshotId) -> Option<&[PageKey]> {
        self.records.get(&id).map(|r| r.keys.as_slice())
    }

    /// Slots of `id` (for tests and diagnostics).
    pub fn slots(&self, id: SnapshotId) -> Option<&[SlotIndex]> {
        self.records.get(&id).map(|r| r.slots.as_slice())
    }

    /// Reserves one slot per key of `req`, evicting stale snapshots if that makes room.
    ///
    /// # Errors
    /// [`SnapshotError::InvalidSize`] for zero keys or more keys than the buffer has slots;
    /// [`SnapshotError::SessionBusy`] when the session has a live reserved or sealed snapshot.
    pub fn prepare(
        &mut self,
        req: SnapshotRequest,
        now: Instant,
    ) -> Result<PrepareOutcome, SnapshotError> {
        let needed = req.keys.len();
        let slots_total = self.region.geometry().slots;
        if needed == 0 || needed > slots_total as usize {
            return Err(SnapshotError::InvalidSize {
                pages: needed,
                slots: slots_total,
            });
        }
        if let Some(id) = self.live_by_session.get(&req.session) {
            return Err(SnapshotError::SessionBusy {
                session: req.session,
                id: *id,
            });
        }
        let id = SnapshotId(self.next_id);
        let slots = match self.region.reserve(needed, id) {
            Some(s) => s,
            None => {
                self.evict_for(needed, now);
                match self.region.reserve(needed, id) {
                    Some(s) => s,
                    None => {
                        self.counters.buf_full += 1;
                        return Ok(PrepareOutcome::BufFull(BufFull {
                            needed,
                            free: self.region.free_slots(),
                            draining: self.draining_slots(),
                        }));
                    }
                }
            }
        };
        self.next_id += 1;
        let key = RoomKey::new(req.session, id.0);
        let g = self.region.geometry();
        let chunk_offsets = slots
            .iter()
            .flat_map(|s| (0..g.layers).filter_map(move |l| g.chunk_offset(*s, l)))
            .collect();
        self.gate.open(key);
        self.live_by_session.insert(req.session, id);
        self.records.insert(
            id,
            Record {
                session: req.session,
                key,
                keys: req.keys,
                slots,
                state: SnapshotState::Reserved,
                touched: now,
            },
        );
        self.counters.reserved += 1;
        Ok(PrepareOutcome::Granted(SnapshotGrant {
            id,
            key,
            region: self.region_id,
            chunk_bytes: g.chunk_bytes,
            layers: g.layers,
            chunk_offsets,
        }))
    }

    /// The writer reported the transfer of `id` complete (every write landed): RESERVED → SEALED.
    /// The room is closed, so a duplicate write is dropped from now on.
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`], [`SnapshotError::WrongState`] unless RESERVED.
    pub fn seal(&mut self, id: SnapshotId, now: Instant) -> Result<(), SnapshotError> {
        let r = self.record_in(id, SnapshotState::Reserved, "seal", "Reserved")?;
        r.state = SnapshotState::Sealed;
        r.touched = now;
        let key = r.key;
        // Best effort: with a one-sided transport the writer's own report is the only evidence.
        let _ = self.gate.fence(key);
        Ok(())
    }

    /// Copies sealed snapshot `id` into fresh pages of `pool` and inserts its keys into `index`
    /// (in the configured tier, `Present`). The snapshot leaves the store and its slots are free.
    /// When the pool has too few free pages the answer is
    /// [`FinalizeOutcome::AllocFailedOnFinalize`] and the snapshot stays, sealed, for a retry (its
    /// LRU age is not refreshed: a snapshot that never finds room ages out).
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`], [`SnapshotError::WrongState`] unless SEALED,
    /// [`SnapshotError::GeometryMismatch`] when `pool`'s pages are not the slots' shape, pool and
    /// region faults (the snapshot stays sealed and no pool page is kept).
    pub fn finalize(
        &mut self,
        id: SnapshotId,
        pool: &KvPool,
        index: &mut PrefixIndex,
    ) -> Result<FinalizeOutcome, SnapshotError> {
        let g = self.region.geometry();
        let pg = pool.geometry();
        if pg.chunk_bytes() != g.chunk_bytes || pg.layers != g.layers {
            return Err(SnapshotError::GeometryMismatch {
                pool: format!("{} B x {} layers", pg.chunk_bytes(), pg.layers),
                slots: format!("{} B x {} layers", g.chunk_bytes, g.layers),
            });
        }
        self.record_in(id, SnapshotState::Sealed, "finalize", "Sealed")?;
        let Some(r) = self.records.get(&id) else {
            return Err(SnapshotError::Unknown(id));
        };
        let needed = r.slots.len();
        let pages = match pool.allocate(needed) {
            Ok(p) => p,
            Err(PoolError::Page(PageError::Exhausted { free, .. })) => {
                self.counters.alloc_failed_on_finalize += 1;
                return Ok(FinalizeOutcome::AllocFailedOnFinalize {
                    needed,
                    pool_free: free,
                });
            }
            Err(e) => return Err(e.into()),
        };
        if let Err(e) = copy_slots(&self.region, &r.slots, pool, &pages) {
            if let Err(free_err) = pool.free(&pages) {
                tracing::error!(error = %free_err, "freeing pages of a failed snapshot copy");
            }
            return Err(e);
        }
        let index_evicted = index.insert(self.config.tier, &r.keys, Residency::Present);
        let Some(r) = self.records.remove(&id) else {
            return Err(SnapshotError::Unknown(id));
        };
        self.live_by_session.remove(&r.session);
        self.release_slots(&r.slots, id);
        self.counters.finalized += 1;
        Ok(FinalizeOutcome::Finalized(Finalized {
            id,
            session: r.session,
            pages,
            keys: r.keys,
            index_evicted,
        }))
    }

    /// Aborts `id` (the decode side gave up, or the session moved). Idempotent on a draining
    /// snapshot.
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`].
    pub fn abort(&mut self, id: SnapshotId) -> Result<AbortOutcome, SnapshotError> {
        let state = self.state(id).ok_or(SnapshotError::Unknown(id))?;
        if state == SnapshotState::Draining {
            return Ok(AbortOutcome::Draining);
        }
        self.counters.aborted += 1;
        Ok(self.retire(id))
    }

    /// Finalize for a caller whose pages live outside a [`KvPool`] (the engine path's prefill: its
    /// host tier holds page bytes): copies sealed snapshot `id` out of its slots as page bytes;
    /// the snapshot leaves the store and its slots are free. No pool is asked for pages, so there
    /// is no `alloc-failed-on-finalize` here; the caller's tier makes room (LRU).
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`], [`SnapshotError::WrongState`] unless SEALED, region faults (the
    /// snapshot stays sealed).
    pub fn finalize_to_bytes(&mut self, id: SnapshotId) -> Result<FinalizedBytes, SnapshotError> {
        self.record_in(id, SnapshotState::Sealed, "finalize", "Sealed")?;
        let Some(r) = self.records.get(&id) else {
            return Err(SnapshotError::Unknown(id));
        };
        let g = self.region.geometry();
        let chunk = g.chunk_bytes as usize;
        let mut pages = Vec::with_capacity(r.slots.len());
        for slot in &r.slots {
            let mut bytes = vec![0u8; chunk * g.layers as usize];
            for layer in 0..g.layers {
                let at = g
                    .chunk_offset(*slot, layer)
                    .ok_or(SnapshotError::SlotOutOfRange {
                        slot: slot.0,
                        slots: g.slots,
                    })?;
                let from = layer as usize * chunk;
                self.region.read(at, &mut bytes[from..from + chunk])?;
            }
            pages.push(std::sync::Arc::<[u8]>::from(bytes));
        }
        let Some(r) = self.records.remove(&id) else {
            return Err(SnapshotError::Unknown(id));
        };
        self.live_by_session.remove(&r.session);
        self.release_slots(&r.slots, id);
        self.counters.finalized += 1;
        Ok(FinalizedBytes {
            id,
            session: r.session,
            keys: r.keys,
            pages,
        })
    }

    /// The writer of draining snapshot `id` is terminal (its transfer handle completed, failed or
    /// was cancelled, or its connection was destroyed): nothing more can land, free the slots.
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`], [`SnapshotError::WrongState`] unless DRAINING.
    pub fn drained(&mut self, id: SnapshotId) -> Result<(), SnapshotError> {
        self.record_in(id, SnapshotState::Draining, "drained", "Draining")?;
        if let Some(r) = self.records.remove(&id) {
            self.release_slots(&r.slots, id);
            self.counters.drained += 1;
        }
        Ok(())
    }

    fn record_in(
        &mut self,
        id: SnapshotId,
        expected: SnapshotState,
        op: &'static str,
        expected_name: &'static str,
    ) -> Result<&mut Record, SnapshotError> {
        let r = self
            .records
            .get_mut(&id)
            .ok_or(SnapshotError::Unknown(id))?;
        if r.state != expected {
            return Err(SnapshotError::WrongState {
                id,
                state: r.state,
                op,
                expected: expected_name,
            });
        }
        Ok(r)
    }

    /// Ends a reserved or sealed snapshot: frees its slots when no write can land, else drains.
    fn retire(&mut self, id: SnapshotId) -> AbortOutcome {
        let Some(r) = self.records.get_mut(&id) else {
            return AbortOutcome::Freed(None);
        };
        self.live_by_session.remove(&r.session);
        let proof = match r.state {
            SnapshotState::Sealed => None,
            SnapshotState::Draining => return AbortOutcome::Draining,
            SnapshotState::Reserved => match self.gate.fence(r.key) {
                Some(p) => Some(p),
                None => {
                    r.state = SnapshotState::Draining;
                    return AbortOutcome::Draining;
                }
            },
        };
        if let Some(r) = self.records.remove(&id) {
            self.release_slots(&r.slots, id);
        }
        AbortOutcome::Freed(proof)
    }

    /// Evicts stale snapshots, least recently used first, if that can free `needed` slots.
    fn evict_for(&mut self, needed: usize, now: Instant) {
        let mut stale: Vec<(Instant, SnapshotId, usize)> = self
            .records
            .iter()
            .filter(|(_, r)| r.state != SnapshotState::Draining)
            .filter(|(_, r)| now.saturating_duration_since(r.touched) >= self.config.stale_after)
            .map(|(id, r)| (r.touched, *id, r.slots.len()))
            .collect();
        let free = self.region.free_slots();
        if free + stale.iter().map(|s| s.2).sum::<usize>() < needed {
            return;
        }
        stale.sort();
        for (_, id, _) in stale {
            if self.region.free_slots() >= needed {
                break;
            }
            self.counters.evicted += 1;
            match self.retire(id) {
                AbortOutcome::Freed(_) => {
                    tracing::info!(snapshot = %id, "evicted a stale snapshot to make room");
                }
                AbortOutcome::Draining => tracing::info!(
                    snapshot = %id,
                    "evicted a stale snapshot; draining: its slots return when its writer is terminal"
                ),
            }
        }
    }

    fn draining_slots(&self) -> usize {
        self.records
            .values()
            .filter(|r| r.state == SnapshotState::Draining)
            .map(|r| r.slots.len())
            .sum()
    }

    fn release_slots(&self, slots: &[SlotIndex], id: SnapshotId) {
        if let Err(e) = self.region.release(slots, id) {
            // Records and the slab are updated together; a mismatch is a bug. Keep the slots
            // (leaked, not reused) rather than free someone else's.
            tracing::error!(error = %e, "snapshot slot bookkeeping mismatch; slots kept");
        }
    }
}

/// Copies every `(slot, layer)` chunk into `(page, layer)` of `pool`.
fn copy_slots(
    region: &SnapshotRegion,
    slots: &[SlotIndex],
    pool: &KvPool,
    pages: &[PageId],
) -> Result<(), SnapshotError> {
    let g = region.geometry();
    let mut chunk = vec![0u8; g.chunk_bytes as usize];
    for (slot, page) in slots.iter().zip(pages) {
        for layer in 0..g.layers {
            let Some(at) = g.chunk_offset(*slot, layer) else {
                continue;
            };
            region.read(at, &mut chunk)?;
            pool.write_chunk(*page, layer, 0, &chunk)?;
        }
    }
    Ok(())
}
