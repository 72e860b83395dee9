//! gRPC control between workers (tonic; `worker/interfaces/proto/tandem/transfer/v1/transfer.proto`,
//! compiled by protox, no `protoc`: the messages in `tandem-interfaces`, the client and server by
//! this crate's `build.rs`).
//!
//! The peer protocol only: the generated messages ([`pb`]), their conversions to the data plane's
//! own types (rooms, the KV page layout, the RDMA endpoint in [`rdma`]) and the metadata keys. The
//! two sides that speak it are roles: the prefill worker's `Transfer` service is
//! `crate::roles::prefill::node`, the decode worker's side `crate::roles::decode::node`.
//!
//! Every room-scoped message carries `(room id, generation)` ([`pb::RoomRef`]).

pub mod rdma;

/// The peer protocol (worker/interfaces/README.md §6): the message types of `tandem-interfaces`
/// and the tonic client and server `build.rs` generates over them.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    pub use tandem_interfaces::peer::pb::*;
    tonic::include_proto!("tandem.transfer.v1");
}

use crate::release::RoomKey;

impl From<RoomKey> for pb::RoomRef {
    fn from(k: RoomKey) -> Self {
        pb::RoomRef {
            room_id: k.room.0,
            generation: k.generation.0,
        }
    }
}

impl From<pb::RoomRef> for RoomKey {
    fn from(r: pb::RoomRef) -> Self {
        RoomKey::new(r.room_id, r.generation)
    }
}

/// The room of an optional wire field; `None` when the sender left it out (malformed).
pub fn room_of(r: Option<pb::RoomRef>) -> Option<RoomKey> {
    r.map(RoomKey::from)
}

/// KV layout of a page: `layers` chunks of `page_tokens × token_bytes` bytes, page-first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers per page.
    pub layers: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Bytes per token per layer.
    pub token_bytes: u32,
}

impl KvLayout {
    /// Bytes of one (page, layer) chunk.
    pub fn chunk_bytes(&self) -> u64 {
        u64::from(self.page_tokens) * u64::from(self.token_bytes)
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> u64 {
        self.chunk_bytes() * u64::from(self.layers)
    }

    /// The simulated engine's chunk for `(request, page index in the request, layer)`.
    pub fn chunk(&self, request: u64, page_index: u32, layer: u32) -> crate::engine::ChunkSpec {
        crate::engine::ChunkSpec {
            request,
            layer,
            first_token: page_index * self.page_tokens,
            tokens: self.page_tokens,
            token_bytes: self.token_bytes as usize,
        }
    }
}

impl From<KvLayout> for pb::KvLayout {
    fn from(l: KvLayout) -> Self {
        pb::KvLayout {
            layers: l.layers,
            page_tokens: l.page_tokens,
            token_bytes: l.token_bytes,
        }
    }
}

impl From<pb::KvLayout> for KvLayout {
    fn from(l: pb::KvLayout) -> Self {
        KvLayout {
            layers: l.layers,
            page_tokens: l.page_tokens,
            token_bytes: l.token_bytes,
        }
    }
}

/// gRPC metadata key naming the calling worker on the signal stream.
pub const WORKER_ID_HEADER: &str = "tandem-worker-id";

/// gRPC metadata key carrying the refusing side's revision on a revision-mismatch refusal.
pub const REVISION_HEADER: &str = "tandem-revision";

/// gRPC metadata key carrying the decode's incarnation on the signal stream (issue 18).
pub const INCARNATION_HEADER: &str = "tandem-incarnation";

/// A fresh incarnation id: random, never 0 (0 on the wire means "unknown", never compared).
///
/// Each serving worker process draws one at start and sends it in its hello
/// (`PeerInfo.incarnation`), its heartbeats and its room replies, so that a peer that restarts on
/// the same address is told apart from the process it replaces (issue 18: stale transfer state
/// for a restarted peer). Library users that build nodes themselves may pass 0.
pub fn new_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // `RandomState` is keyed from the OS's randomness once per process (and advanced per call);
    // the pid and the clock are mixed in for good measure.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish().max(1)
}

/// Whether two incarnations name different processes: both known (non-zero) and unequal.
pub fn incarnation_changed(known: u64, seen: u64) -> bool {
    known != 0 && seen != 0 && known != seen
}

/// Negative control of the restart tests only (feature `negative-controls`):
/// `TANDEM_NEGATIVE_IGNORE_INCARNATION=1` makes the serving roles draw no incarnation (0) and
/// ignore the peers' — the behaviour before issue 18.
pub fn incarnation_ignored() -> bool {
    #[cfg(feature = "negative-controls")]
    if std::env::var("TANDEM_NEGATIVE_IGNORE_INCARNATION").as_deref() == Ok("1") {
        return true;
    }
    false
}
