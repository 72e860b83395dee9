//! NEGATIVE CONTROL — not for serving: snapshot space taken from the prefill KV pool itself, the
//! design seed 002 replaced (SGLang `d2p_replication.py`, dataplane.md §2.4: "allocates the
//! destination slots from the prefill KV pool").
//!
//! `prepare` allocates one KV pool page per snapshot page. While prefill work holds the pool — its
//! normal state — that allocation fails, and the sync fails with it: the seed measured 0 of 167
//! syncs succeeding (148 `alloc-failed`). The benchmark and `tests/snapshot_occupied_pool.rs` run
//! this next to [`super::SnapshotStore`] on the same workload to show the difference, and also with
//! a pool that has room, to show the control is a working receive path and not a stub.
//!
//! Kept deliberately simple: abort frees the pages at once, with no drain (the old code's second
//! hazard); do not reuse it.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::memory::pool::{KvPool, PageError, PageId, PoolError};
use crate::release::RoomKey;
use crate::tier::page_key::PageKey;
use crate::tier::prefix_index::{PrefixIndex, Residency, Tier};
use crate::transfer::RegionId;

use super::error::SnapshotError;
use super::gate::SnapshotGate;
use super::id::SnapshotId;
use super::store::{Finalized, SnapshotGrant, SnapshotRequest};

/// Answer of [`SharedPoolSnapshots::prepare`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedPrepareOutcome {
    /// Pool pages allocated; write the snapshot there.
    Granted(SnapshotGrant),
    /// The seed's `alloc-failed`: the KV pool has too few free pages.
    AllocFailed {
        /// Pages needed.
        needed: usize,
        /// Pages free.
        pool_free: usize,
    },
}

/// Counters of the control.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedPoolCounters {
    /// Prepares that got pool pages.
    pub reserved: u64,
    /// Prepares refused because the pool was full.
    pub alloc_failed: u64,
    /// Snapshots inserted into the prefix index.
    pub finalized: u64,
}

struct Record {
    session: u64,
    keys: Vec<PageKey>,
    pages: Vec<PageId>,
}

/// Snapshots received straight into KV pool pages (negative control).
pub struct SharedPoolSnapshots {
    pool: Arc<KvPool>,
    region_id: RegionId,
    gate: Arc<dyn SnapshotGate>,
    tier: Tier,
    records: BTreeMap<SnapshotId, Record>,
    next_id: u64,
    counters: SharedPoolCounters,
}

impl SharedPoolSnapshots {
    /// Receives into `pool`, registered at the receiver as `region_id` (a
    /// [`crate::transfer::pool_region::PoolRegion`]).
    pub fn new(
        pool: Arc<KvPool>,
        region_id: RegionId,
        gate: Arc<dyn SnapshotGate>,
        tier: Tier,
    ) -> SharedPoolSnapshots {
        SharedPoolSnapshots {
            pool,
            region_id,
            gate,
            tier,
            records: BTreeMap::new(),
            next_id: 1,
            counters: SharedPoolCounters::default(),
        }
    }

    /// Counters so far.
    pub fn counters(&self) -> SharedPoolCounters {
        self.counters
    }

    /// Allocates one pool page per key.
    ///
    /// # Errors
    /// [`SnapshotError::InvalidSize`] for zero keys; pool faults other than exhaustion.
    pub fn prepare(&mut self, req: SnapshotRequest) -> Result<SharedPrepareOutcome, SnapshotError> {
        let needed = req.keys.len();
        if needed == 0 {
            return Err(SnapshotError::InvalidSize {
                pages: 0,
                slots: self.pool.geometry().pages,
            });
        }
        let pages = match self.pool.allocate(needed) {
            Ok(p) => p,
            Err(PoolError::Page(PageError::Exhausted { free, .. })) => {
                self.counters.alloc_failed += 1;
                return Ok(SharedPrepareOutcome::AllocFailed {
                    needed,
                    pool_free: free,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let g = self.pool.geometry();
        let mut chunk_offsets = Vec::with_capacity(needed * g.layers as usize);
        for page in &pages {
            for layer in 0..g.layers {
                chunk_offsets.push(self.pool.chunk_region(*page, layer)?.offset as u64);
            }
        }
        let id = SnapshotId(self.next_id);
        self.next_id += 1;
        let key = RoomKey::new(req.session, id.0);
        self.gate.open(key);
        self.records.insert(
            id,
            Record {
                session: req.session,
                keys: req.keys,
                pages,
            },
        );
        self.counters.reserved += 1;
        Ok(SharedPrepareOutcome::Granted(SnapshotGrant {
            id,
            key,
            region: self.region_id,
            chunk_bytes: g.chunk_bytes(),
            layers: g.layers,
            chunk_offsets,
        }))
    }

    /// Publishes `id`'s pages (already in the pool) in the prefix index.
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`].
    pub fn finalize(
        &mut self,
        id: SnapshotId,
        index: &mut PrefixIndex,
    ) -> Result<Finalized, SnapshotError> {
        let r = self.records.remove(&id).ok_or(SnapshotError::Unknown(id))?;
        let index_evicted = index.insert(self.tier, &r.keys, Residency::Present);
        self.counters.finalized += 1;
        Ok(Finalized {
            id,
            session: r.session,
            pages: r.pages,
            keys: r.keys,
            index_evicted,
        })
    }

    /// Frees `id`'s pages at once (unsafe against late writes; see the module docs).
    ///
    /// # Errors
    /// [`SnapshotError::Unknown`], pool faults.
    pub fn abort(&mut self, id: SnapshotId) -> Result<(), SnapshotError> {
        let r = self.records.remove(&id).ok_or(SnapshotError::Unknown(id))?;
        self.pool.free(&r.pages)?;
        Ok(())
    }
}
