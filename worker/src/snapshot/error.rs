//! Typed errors of the snapshot buffer (DESIGN contract 4). Outcomes that are part of the protocol —
//! the buffer is full, the KV pool has no room at finalize — are *not* errors: they are variants of
//! [`super::PrepareOutcome`] and [`super::FinalizeOutcome`] so that a caller cannot mistake them for
//! bugs. Errors are for malformed calls and for faults of the memory underneath.

use crate::memory::pool::PoolError;
use crate::memory::{DomainMismatch, MemoryError};
use crate::transfer::RegionError;

use super::id::{SnapshotId, SnapshotState};

/// Errors of snapshot operations. None of them changes the snapshot it names.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The buffer size or the page geometry leaves no whole slot (e.g. `snapshot_buffer_bytes` of 0,
    /// or smaller than one KV page over all layers).
    #[error(
        "snapshot buffer of {buffer_bytes} B holds no slot of {slot_bytes} B (one KV page, all layers)"
    )]
    NoSlots {
        /// Configured buffer size in bytes.
        buffer_bytes: u64,
        /// Bytes of one slot (0 for an empty geometry).
        slot_bytes: u64,
    },
    /// A snapshot of zero pages, or more pages than the whole buffer has slots: it can never fit.
    #[error("snapshot of {pages} pages cannot fit a buffer of {slots} slots")]
    InvalidSize {
        /// Pages asked for.
        pages: usize,
        /// Slots in the buffer.
        slots: u32,
    },
    /// No snapshot with this id (never prepared, already finalized, aborted or evicted).
    #[error("unknown snapshot {0}")]
    Unknown(SnapshotId),
    /// The call is not valid in the snapshot's current state (e.g. finalize before seal).
    #[error("snapshot {id} is {state:?}; {op} needs {expected}")]
    WrongState {
        /// The snapshot.
        id: SnapshotId,
        /// Its state.
        state: SnapshotState,
        /// The refused operation.
        op: &'static str,
        /// The state(s) the operation needs.
        expected: &'static str,
    },
    /// The session already has a live (reserved or sealed) snapshot; abort or finalize it first.
    #[error("session {session} already has live snapshot {id}")]
    SessionBusy {
        /// Session id.
        session: u64,
        /// Its live snapshot.
        id: SnapshotId,
    },
    /// The KV pool's page geometry differs from the buffer's slot geometry: copying would mix
    /// layers or tokens.
    #[error("KV pool geometry ({pool}) differs from the snapshot slot geometry ({slots})")]
    GeometryMismatch {
        /// The pool's chunk bytes × layers.
        pool: String,
        /// The slots' chunk bytes × layers.
        slots: String,
    },
    /// A slot a record holds has no chunk in the buffer (a bookkeeping bug; the snapshot is
    /// aborted, not left behind).
    #[error("slot {slot} is outside the buffer's {slots} slots")]
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// Slots in the buffer.
        slots: u32,
    },
    /// The buffer's allocator domain is not one this receive path can write (DESIGN contract 1).
    #[error(transparent)]
    Domain(#[from] DomainMismatch),
    /// Allocating or addressing the buffer failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A KV pool operation failed at finalize (other than running out of pages).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Reading a slot failed (a bug: slots are in bounds by construction).
    #[error(transparent)]
    Region(#[from] RegionError),
}
