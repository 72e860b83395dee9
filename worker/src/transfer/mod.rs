//! KV transfer: moving page bytes from a prefill worker into a decode worker's registered region.
//!
//! The [`Transport`] contract (dataplane.md R-XFER-1/2/5, DESIGN contract 3):
//! - `submit` takes one bounded [`WriteBatch`] and returns a [`TransferHandle`]. The handle stays valid
//!   until it is **terminal** — [`TransferStatus::Completed`], [`TransferStatus::Failed`] or
//!   [`TransferStatus::Cancelled`] — and until the caller [`Transport::release`]s it; releasing a
//!   non-terminal handle is refused.
//! - A handle becomes terminal only when every write of it is accounted for: landed, or proven never
//!   to land (refused by the receiver, never sent, flushed by a destroyed connection). So `Failed`
//!   and `Cancelled` both mean "nothing more from this handle can land".
//! - `wait` and `drain` take deadlines. A deadline that passes returns the handle's current,
//!   non-terminal status ([`TransferStatus::InFlight`] / [`TransferStatus::Cancelling`]) — a timeout
//!   is never reported as a failure while writes may still land (Mooncake#4247).
//! - `cancel` stops writes that have not been handed to the wire; writes already posted may still
//!   land, so the handle reads `Cancelling` until they are accounted for.
//!
//! Implementations: [`tcp`] (always available; the receiver checks region bounds and the room's
//! current generation, so it drops late writes of an aborted room — R-XFER-6), [`sim`] (an in-process
//! one-sided transport with RDMA-WRITE semantics: no receiver-side check, posted writes land; used by
//! the abort stress and fault-injection tests), and [`rdma`]: one-sided RDMA WRITE over RC queue
//! pairs. Its pure parts — endpoint exchange ([`rdma::endpoint`], `PeerInfo.rdma` in the hello),
//! write planning with bounds and registration checks ([`rdma::plan`]), completion accounting
//! ([`rdma::completions`]), the submit/poll/cancel/wait/drain machinery over a queue-pair seam
//! ([`rdma::sender`], tested with a fake queue pair) and pinned zero-copy sources
//! ([`rdma::source`]) — are always built and tested; the verbs wrapper and `RdmaTransport` are
//! built with feature `rdma` and only compile-checked here (no RDMA device on this project's
//! machines; their device loopback test returns early without one). [`select`] picks RDMA when
//! the feature is built and a device opens, otherwise TCP, and logs why;
//! [`select::receiver_fence_is_proof`] says which transports let decode's receiver fence prove that
//! nothing more lands (TCP only). The worker roles do not wire `RdmaTransport` in yet: prefill
//! sends and decode receives over TCP whatever the selection says.
//! [`pool_region`] exposes a KV pool as a receive region.

pub mod batch;
pub mod handles;
pub mod pool_region;
pub mod rdma;
pub mod region;
pub mod select;
pub mod sim;
pub mod tcp;
pub mod wire;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

pub use batch::{BatchLimits, WriteBatch};
pub use handles::HandleTable;
pub use region::{HostRegion, ReceiveRegion, RegionError, RegionId};

use crate::release::RoomKey;

/// Which transport moved the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP sockets (always available).
    Tcp,
    /// RDMA verbs (feature `rdma`, a device present).
    Rdma,
    /// In-process simulation of one-sided writes (tests and benchmarks).
    Simulated,
}

impl TransportKind {
    /// Lower-case name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
            TransportKind::Simulated => "simulated",
        }
    }
}

/// One write: `data` lands at `offset` of region `region` on the peer, on behalf of room `key`.
/// `data` is a reference-counted view of the source page: the transport holds it (and so the source
/// bytes stay valid) until the write is terminal.
#[derive(Clone, Debug)]
pub struct WriteOp {
    /// Room and generation the write belongs to; the TCP receiver drops it if stale.
    pub key: RoomKey,
    /// Destination region on the peer.
    pub region: RegionId,
    /// Destination offset in bytes.
    pub offset: u64,
    /// Source bytes.
    pub data: Bytes,
}

/// A submitted batch (wire-independent id, unique per transport instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferHandle(pub u64);

/// Why a handle failed. Every variant means: no write of the handle can land any more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The connection to the peer broke; writes not confirmed were not applied by the receiver.
    PeerLost,
    /// The receiver refused writes (stale generation, bounds, unknown region).
    Rejected {
        /// Writes refused because the room's generation was not current (late writes).
        stale: u32,
        /// Writes refused for bounds or an unknown region.
        invalid: u32,
    },
    /// A fault injected by a test.
    Injected,
}

/// The status of a handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferStatus {
    /// Submitted; writes may still land.
    InFlight,
    /// Cancel requested; writes already posted may still land.
    Cancelling,
    /// Terminal: every write landed.
    Completed,
    /// Terminal: at least one write failed; nothing more can land.
    Failed(FailureKind),
    /// Terminal: cancelled; writes not posted were dropped, posted ones are accounted for.
    Cancelled,
}

impl TransferStatus {
    /// True for `Completed`, `Failed` and `Cancelled`.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            TransferStatus::Completed | TransferStatus::Failed(_) | TransferStatus::Cancelled
        )
    }
}

/// Transport errors (none of them changes a handle's status).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The handle is unknown (never issued, or already released).
    #[error("unknown transfer handle {0:?}")]
    UnknownHandle(TransferHandle),
    /// `release` of a handle that is not terminal.
    #[error("transfer handle {0:?} is not terminal ({1:?})")]
    NotTerminal(TransferHandle, TransferStatus),
    /// The batch exceeds the transport's limits (split it with [`WriteBatch::split`]).
    #[error("batch of {ops} writes / {bytes} B exceeds the limit of {max_ops} / {max_bytes} B")]
    BatchTooLarge {
        /// Writes in the batch.
        ops: usize,
        /// Bytes in the batch.
        bytes: u64,
        /// Limit on writes.
        max_ops: usize,
        /// Limit on bytes.
        max_bytes: u64,
    },
    /// The peer could not be reached (retryable: the next submit re-resolves the peer).
    #[error("peer {peer} unreachable: {source}")]
    Connect {
        /// The peer address.
        peer: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The peer is not known to this transport.
    #[error("unknown peer {0}")]
    UnknownPeer(String),
    /// The transport is shut down.
    #[error("transport is shut down")]
    Shutdown,
}

/// Called once when a handle becomes terminal, outside the transport's locks.
pub type CompletionSink = Arc<dyn Fn(TransferHandle, &TransferStatus) + Send + Sync>;

/// What [`Transport::drain`] found at its deadline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Handles that are not terminal yet (their writes may still land).
    pub in_flight: Vec<TransferHandle>,
}

impl DrainReport {
    /// True when every handle is terminal.
    pub fn quiescent(&self) -> bool {
        self.in_flight.is_empty()
    }
}

/// A KV transport (see the module docs for the contract).
pub trait Transport: Send + Sync {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Posts one bounded batch to `peer` (the peer's data address). `on_terminal` is called once,
    /// when the handle becomes terminal.
    fn submit(
        &self,
        peer: &str,
        batch: WriteBatch,
        on_terminal: Option<CompletionSink>,
    ) -> Result<TransferHandle, TransferError>;

    /// The table this transport accounts its handles in. The default [`Transport::poll`],
    /// [`Transport::cancel`], [`Transport::wait`], [`Transport::release`] and [`Transport::drain`]
    /// run on it; a transport overrides one only to do more (RDMA's `cancel` also drops the
    /// handle's queued posts).
    fn handles(&self) -> &HandleTable;

    /// Current status, without blocking.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`].
    fn poll(&self, handle: TransferHandle) -> Result<TransferStatus, TransferError> {
        self.handles().poll(handle)
    }

    /// Requests cancellation; returns the status after the request.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`].
    fn cancel(&self, handle: TransferHandle) -> Result<TransferStatus, TransferError> {
        self.handles().cancel(handle)
    }

    /// Blocks until the handle is terminal or `deadline` passes; returns the status then.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`].
    fn wait(
        &self,
        handle: TransferHandle,
        deadline: Instant,
    ) -> Result<TransferStatus, TransferError> {
        self.handles().wait(handle, deadline)
    }

    /// Forgets a terminal handle. Refused (and the handle kept) while it is not terminal.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`], [`TransferError::NotTerminal`].
    fn release(&self, handle: TransferHandle) -> Result<TransferStatus, TransferError> {
        self.handles().release(handle)
    }

    /// Waits until every handle is terminal or `deadline` passes.
    fn drain(&self, deadline: Instant) -> DrainReport {
        self.handles().drain(deadline)
    }
}
