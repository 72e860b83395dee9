//! The snapshot receive buffer (DESIGN contract 4; seed 002; reference/dataplane.md R-MEM-6,
//! TC-MEM-02, §8 state machine 7).
//!
//! A decode worker syncs a session's KV back to a prefill worker so that the next turn's prefill hits
//! the prefix cache. Seed 002: the old path allocated the receive space from the prefill KV pool,
//! which prefill work keeps full, and 0 of 167 syncs succeeded. Here the bytes land in a dedicated,
//! registered buffer with its own slab allocator; KV pool pages are taken only at finalize, at a
//! moment the prefill scheduler chooses, and a full pool then is an explicit, retryable outcome.
//!
//! - [`layout`]: slot geometry (one slot = one KV page over all layers) — pure;
//! - [`id`]: snapshot ids and states, which the other parts name (no part depends on [`store`]);
//! - [`slab`]: the slot free list and owners — pure;
//! - [`region`]: the buffer's memory as a [`crate::transfer::ReceiveRegion`], refusing writes into
//!   free slots;
//! - [`gate`]: opening and fencing snapshot rooms at the receiver (TCP generation fence, or none for
//!   one-sided transports);
//! - [`store`]: the per-snapshot state machine (prepare → transfer → seal → finalize | abort), LRU
//!   eviction of stale snapshots;
//! - [`counters`]: the store's counters;
//! - `shared_pool`: NEGATIVE CONTROL, the seed's old design (snapshot space from the KV pool);
//!   only with the `negative-controls` feature;
//! - [`workload`]: the deterministic occupied-pool workload used by the test and `tandem-bench
//!   snapshot`.
//!
//! On the serving path (issue 15): `roles::prefill::snapshot_sync` (the built-in prefill's buffer,
//! receiver, finalize queue and KV pool) and `roles::decode::snapshot_push` (the decode's push of a
//! finished turn); an engine beside the prefill is not wired yet. The original plan, for reference:
//! the prefill role builds one [`SnapshotRegion`] at start-up,
//! sized by `memory.snapshotBufferBytes` ([`crate::config::MemoryPolicy::snapshot_buffer_bytes`];
//! 0 disables it) from its own allocator in the pool's domain, registers it once with its data-port
//! receiver, and serves a `SnapshotService` (Reserve → [`SnapshotStore::prepare`], Commit →
//! [`SnapshotStore::seal`], Release → [`SnapshotStore::abort`]) on the control port. Its scheduler
//! calls [`SnapshotStore::finalize`] between prefill batches for sealed snapshots, inserting into the
//! prefill pool's prefix index. The decode role pushes a session's pages with its existing transport
//! to the grant's offsets. Device memory (feature `cuda`) needs a device copy path in `region` and
//! `store::finalize`; today the buffer must be host memory.

pub mod counters;
pub mod error;
pub mod gate;
pub mod id;
pub mod layout;
pub mod region;
#[cfg(feature = "negative-controls")]
pub mod shared_pool;
pub mod slab;
pub mod store;
pub mod workload;

pub use counters::SnapshotCounters;
pub use error::SnapshotError;
pub use gate::{OneSidedGate, ReceiverGate, SnapshotGate};
pub use id::{SnapshotId, SnapshotState};
pub use layout::{SlotGeometry, SlotIndex};
pub use region::SnapshotRegion;
#[cfg(feature = "negative-controls")]
pub use shared_pool::{SharedPoolSnapshots, SharedPrepareOutcome};
pub use store::{
    AbortOutcome, BufFull, FinalizeOutcome, Finalized, FinalizedBytes, PrepareOutcome,
    SnapshotGrant, SnapshotRequest, SnapshotStore, StoreConfig,
};
