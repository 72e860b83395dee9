//! Errors of the LayerSplit mechanism (DESIGN contract 6).

use crate::memory::pool::PoolError;

use super::wire::WireError;

/// Everything that can go wrong while setting up or running a LayerSplit CP group.
#[derive(Debug, thiserror::Error)]
pub enum LayerSplitError {
    /// The owner map is malformed: wrong length, or a layer owned by a rank outside `0..cp_size`
    /// (reference/dataplane.md TC-LS-01).
    #[error("invalid owner map: {0}")]
    InvalidOwnerMap(String),
    /// A peer's owner map differs from ours (R-LS-1: the map must be identical on all ranks). Raised
    /// by the group handshake, before any KV is allocated or written.
    #[error(
        "owner map mismatch: rank {local_rank} has digest {local:016x}, rank {peer_rank} has {peer:016x}"
    )]
    OwnerMapMismatch {
        /// This rank.
        local_rank: u32,
        /// This rank's owner-map digest.
        local: u64,
        /// The peer whose map differs.
        peer_rank: u32,
        /// The peer's digest.
        peer: u64,
    },
    /// A rank index outside `0..cp_size`.
    #[error("CP rank {rank} outside 0..{cp_size}")]
    RankOutOfRange {
        /// The rank named.
        rank: u32,
        /// CP size.
        cp_size: u32,
    },
    /// This rank was asked to store or read locally a layer it does not own.
    #[error("rank {rank} does not own layer {layer} (owner is rank {owner})")]
    NotOwned {
        /// This rank.
        rank: u32,
        /// The layer.
        layer: u32,
        /// Its owner.
        owner: u32,
    },
    /// A layer index outside the model.
    #[error("layer {layer} outside 0..{layers}")]
    LayerOutOfRange {
        /// The layer named.
        layer: u32,
        /// Layers of the model.
        layers: u32,
    },
    /// The consumer waited for a layer of a step that its owner never broadcast: every peer link
    /// closed first (contract 6; R-LS-2 "finished before attention").
    #[error("layer {layer} of step {step} was never broadcast (owner rank {owner} is gone)")]
    NeverBroadcast {
        /// Step (request sequence number in the group).
        step: u64,
        /// The layer waited for.
        layer: u32,
        /// Its owner.
        owner: u32,
    },
    /// The broadcast of a layer did not arrive within the wait deadline.
    #[error("layer {layer} of step {step} not received within {timeout_ms} ms")]
    BroadcastTimeout {
        /// Step.
        step: u64,
        /// Layer.
        layer: u32,
        /// The deadline, ms.
        timeout_ms: u64,
    },
    /// A layer frame came from a rank that does not own that layer (R-LS-1: transfers address only
    /// owned layers).
    #[error("rank {from} sent layer {layer}, which rank {owner} owns")]
    WrongSender {
        /// Sender.
        from: u32,
        /// Layer in the frame.
        layer: u32,
        /// The layer's owner.
        owner: u32,
    },
    /// A layer frame for `(step, layer)` arrived twice.
    #[error("layer {layer} of step {step} received twice")]
    DuplicateLayer {
        /// Step.
        step: u64,
        /// Layer.
        layer: u32,
    },
    /// The broadcast does not carry a page the request reads, or its request id differs.
    #[error("layer {layer} of step {step}: broadcast lacks page {page} of request {request}")]
    MissingPage {
        /// Step.
        step: u64,
        /// Layer.
        layer: u32,
        /// Request.
        request: u64,
        /// The page id missing from the frame.
        page: u32,
    },
    /// The frame's request id is not the one this step runs.
    #[error("step {step}: broadcast is for request {found}, expected {expected}")]
    RequestMismatch {
        /// Step.
        step: u64,
        /// Expected request.
        expected: u64,
        /// Request in the frame.
        found: u64,
    },
    /// A layer frame that does not fit this rank's pool (chunk size, page id).
    #[error("bad layer frame: {0}")]
    BadFrame(String),
    /// The transport to a peer failed.
    #[error("transport to rank {peer}: {reason}")]
    Transport {
        /// The peer rank.
        peer: u32,
        /// What failed.
        reason: String,
    },
    /// A malformed frame.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The rank's KV pool refused an operation.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A rank thread panicked or could not be spawned.
    #[error("rank {rank} thread: {reason}")]
    Thread {
        /// The rank.
        rank: u32,
        /// What happened.
        reason: String,
    },
}
