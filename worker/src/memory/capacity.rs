//! Capacity planning: size the shared-memory segments for every pool before anything is allocated
//! (DESIGN contract 1; reference/dataplane.md R-MEM-3, TC-REG-08).
//!
//! Seed 000's draft pool copied the target's sizing but not its allocator; planning all pools together,
//! draft and indexer included, makes both the size and the domain of each pool explicit up front.

use crate::memory::pool::{PoolError, PoolRole, PoolSpec};

use super::{align_up, host_page_size};

/// One pool's line in a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedPool {
    /// Role.
    pub role: PoolRole,
    /// Bytes the pool needs, rounded up to the host page size (the allocator's granularity).
    pub bytes: usize,
}

/// A checked plan: every pool fits into `capacity` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityPlan {
    /// Bytes available (sum of the segments).
    pub capacity: usize,
    /// Pools in the order given.
    pub pools: Vec<PlannedPool>,
}

impl CapacityPlan {
    /// Plans `specs` into `capacity` bytes.
    ///
    /// # Errors
    /// [`CapacityError::Pool`] for an invalid spec; [`CapacityError::TooSmall`] listing every pool and
    /// its size when the sum exceeds the capacity.
    pub fn new(capacity: usize, specs: &[PoolSpec]) -> Result<Self, CapacityError> {
        let mut pools = Vec::with_capacity(specs.len());
        for spec in specs {
            let raw = spec.bytes().map_err(|source| CapacityError::Pool {
                role: spec.role,
                source,
            })?;
            let bytes = align_up(raw, host_page_size()).ok_or(CapacityError::Overflow)?;
            pools.push(PlannedPool {
                role: spec.role,
                bytes,
            });
        }
        let required = pools
            .iter()
            .try_fold(0usize, |acc, p| acc.checked_add(p.bytes))
            .ok_or(CapacityError::Overflow)?;
        if required > capacity {
            return Err(CapacityError::TooSmall {
                capacity,
                required,
                pools,
            });
        }
        Ok(Self { capacity, pools })
    }

    /// Sum of the planned pools.
    pub fn required(&self) -> usize {
        self.pools.iter().map(|p| p.bytes).sum()
    }
}

/// Errors of capacity planning.
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// The segments cannot hold every pool.
    #[error("shared-memory capacity {capacity} B is smaller than the {required} B the pools need: {}",
        pools.iter().map(|p| format!("{} {} B", p.role, p.bytes)).collect::<Vec<_>>().join(", "))]
    TooSmall {
        /// Bytes available.
        capacity: usize,
        /// Bytes needed.
        required: usize,
        /// Every pool with its size.
        pools: Vec<PlannedPool>,
    },
    /// A pool spec is invalid.
    #[error("{role} pool: {source}")]
    Pool {
        /// The pool.
        role: PoolRole,
        /// Why.
        source: PoolError,
    },
    /// Sizes overflow `usize`.
    #[error("pool sizes overflow")]
    Overflow,
}
