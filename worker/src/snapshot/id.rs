//! Names and states of snapshots (DESIGN contract 4): what the protocol's other parts — the slab,
//! the region, the errors — refer to, kept apart from the state machine in [`super::store`] so that
//! none of them depends on it.

use std::fmt;

/// Identifies one snapshot within a store; also the generation of its room key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SnapshotId(pub u64);

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where a live snapshot is in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotState {
    /// Slots reserved and the room open: the decode side may be writing.
    Reserved,
    /// The writer reported the transfer complete; waiting for finalize.
    Sealed,
    /// Aborted or evicted without proof that writes stopped; slots held until
    /// [`SnapshotStore::drained`](super::SnapshotStore::drained).
    Draining,
}
