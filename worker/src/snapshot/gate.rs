//! The seam between the snapshot protocol and the receiver that admits writes (DESIGN contracts 3
//! and 4): which room a snapshot's writes belong to, and proof that none can land any more.
//!
//! Each snapshot's writes carry a [`RoomKey`]: room = the decode session id, generation = the
//! snapshot id (strictly increasing within a store, so every re-sync of a session has a higher
//! generation). The TCP receiver admits a write only while its room is open at its generation
//! (R-XFER-6); fencing the room is the proof the store needs to reuse an aborted snapshot's slots at
//! once. A one-sided transport (RDMA WRITE, the simulated transport) gives no such proof: the slots
//! of an aborted snapshot stay *draining* until the caller reports its writer terminal.
//!
//! Snapshot rooms use session ids as room ids: a receiver that also receives request KV must keep the
//! two id spaces apart (today prefill receives nothing else, so one receiver per prefill worker is
//! the intended wiring).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::release::RoomKey;
use crate::release::receiver::TransportProof;
use crate::transfer::tcp::TcpReceiver;

/// Opens and fences snapshot rooms at the receiver.
pub trait SnapshotGate: Send + Sync {
    /// Admits writes of `key` from now on (called before the grant is handed to the decode side).
    fn open(&self, key: RoomKey);

    /// Closes `key`; returns proof that no write of it can land any more, or `None` when this
    /// transport cannot prove it now (the slots must then drain).
    fn fence(&self, key: RoomKey) -> Option<TransportProof>;
}

/// The TCP receiver's generation fence.
pub struct ReceiverGate {
    receiver: Arc<TcpReceiver>,
    wait: Duration,
}

impl ReceiverGate {
    /// Fences rooms of `receiver`, waiting at most `wait` for writes being applied to finish.
    pub fn new(receiver: Arc<TcpReceiver>, wait: Duration) -> ReceiverGate {
        ReceiverGate { receiver, wait }
    }
}

impl SnapshotGate for ReceiverGate {
    fn open(&self, key: RoomKey) {
        self.receiver.open_room(key);
    }

    fn fence(&self, key: RoomKey) -> Option<TransportProof> {
        let proof = self.receiver.fence(key, Instant::now() + self.wait).ok()?;
        // Unknown rooms drop every write, so forgetting a fenced room keeps the proof.
        self.receiver.forget_room(key.room);
        Some(proof)
    }
}

/// One-sided transports: writes need no opening and nothing can be fenced.
#[derive(Debug, Clone, Copy, Default)]
pub struct OneSidedGate;

impl SnapshotGate for OneSidedGate {
    fn open(&self, _key: RoomKey) {}

    fn fence(&self, _key: RoomKey) -> Option<TransportProof> {
        None
    }
}
