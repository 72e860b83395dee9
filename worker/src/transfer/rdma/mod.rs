//! The RDMA transport: one-sided RDMA WRITE of KV pages into a peer's registered memory over RC
//! queue pairs (dataplane.md R-XFER-3/4; DESIGN contract 3).
//!
//! Layout — pure logic apart from I/O:
//! - [`endpoint`] (always compiled): what peers exchange in the hello to connect queue pairs and
//!   address each other's memory ([`endpoint::RdmaEndpoint`], `PeerInfo.rdma` on the wire).
//! - [`plan`] (always compiled): a [`super::WriteBatch`] → bounds-checked RDMA WRITE work requests
//!   against the peer's registrations and this worker's, grouped into selectively signaled posts.
//! - [`completions`] (always compiled): the per-queue-pair ledger — send-queue credit, work
//!   completions → per-write outcomes, flush accounting after an error, cancel. A handle is terminal
//!   only when every posted request is accounted (with its negative control,
//!   `completions::TrackerMode::EagerFailure`, feature `negative-controls`).
//! - `verbs` (feature `rdma`): the only `unsafe` code — device, protection domain, memory
//!   registration over existing memory, completion queue, RC queue pair RESET → INIT → RTR → RTS,
//!   `post_send` / `poll_cq` through the provider's ops table (they are `static inline` in
//!   `verbs.h`), raw types from `ibverbs-sys` (ibverbs 0.9's safe API only posts `IBV_WR_SEND`).
//! - [`sender`] (always compiled): [`sender::RdmaSender`], the [`super::Transport`] machinery —
//!   submit → plan → ledger → post, the completion-poller thread, cancel, deadline waits, peer
//!   removal as transport proof — against the [`sender::QueuePairOps`] seam (one connected QP).
//! - [`source`] (always compiled): zero-copy write sources — a KV pool chunk as `Bytes`,
//!   reader-pinned until the last work request reading it is retired (the one `unsafe` block
//!   outside `verbs`).
//! - `transport` (feature `rdma`): `RdmaTransport` — device, registration of existing memory
//!   (`RdmaMemory`, implemented for a KV pool), the QP handshake (`local_endpoint` / `connect`),
//!   `disconnect` — with `RdmaSender` over verbs queue pairs.
//!
//! What is verified where: `endpoint`, `plan`, `completions`, `source` and `sender` (with a
//! scripted fake queue pair) are unit- and property-tested in the default build. `verbs` and
//! `transport` are compile-checked (`--features rdma`, clippy included) and their no-device path is
//! tested (the constructor returns a typed [`RdmaError`], and [`super::select`] falls back to TCP
//! with a log line). This project's machines have no RDMA device, so the device path (register →
//! connect → write → completion on a NIC, dataplane.md TC-XFER-06) has never run; the loopback test
//! `transport::tests::device_loopback_write_lands_when_a_device_is_present` runs it where a NIC
//! exists (`cargo test -p tandem-worker --features rdma --lib transfer::rdma`).
//!
//! Not wired yet: the worker roles still build the TCP transport, and the control plane does not
//! fill `PeerInfo.rdma`. Plugging in: decode registers its KV pool with
//! `RdmaTransport::register(pool, Some(region))`, sends `local_endpoint(prefill)` in its hello
//! (`roles/decode/node.rs`, `DecodeNode::connect`); prefill's `peer_hello` (`roles/prefill/node.rs`)
//! connects to it and answers with its own endpoint, which decode connects to; prefill's
//! `submit_pages` sources writes with [`source::pinned_chunk`] from a registered pool instead of
//! heap copies; decode's release gate runs with `fence_is_proof = false`.
//!
//! What RDMA cannot do: there is no receiver-side check of a write — a posted write lands whatever
//! the room's state on the receiver. So decode's release gate may not use a receiver fence as
//! transport proof under RDMA ([`super::select::receiver_fence_is_proof`]); its proofs are the
//! prefill acks, or the queue pair destroyed with every posted request accounted
//! (`RdmaTransport::disconnect`).
//!
//! Build: `ibverbs-sys` compiles a vendored rdma-core with cmake and runs bindgen, so the feature
//! needs `cmake libclang-dev libibverbs-dev libnl-3-dev libnl-route-3-dev`
//! (`e2e/tools/install-build-deps.sh`).

pub mod completions;
pub mod endpoint;
pub mod plan;
pub mod sender;
pub mod source;

#[cfg(feature = "rdma")]
pub mod transport;
#[cfg(feature = "rdma")]
mod verbs;

use std::io;

/// Why the RDMA transport cannot start or connect.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// Listing devices failed (no uverbs support in the kernel: ENOSYS).
    #[error("cannot list RDMA devices: {0}")]
    List(io::Error),
    /// No device (or not the one asked for).
    #[error("no RDMA device present{}", .0.as_deref().map(|n| format!(" named {n}")).unwrap_or_default())]
    NoDevice(Option<String>),
    /// A verbs call failed.
    #[error("RDMA device {device}: {step} failed: {source}")]
    Verbs {
        /// Device name.
        device: String,
        /// The failing verb.
        step: &'static str,
        /// The OS error (ENOMEM/EPERM on `reg_mr` usually mean the memlock limit).
        source: io::Error,
    },
    /// The port is not ACTIVE (link down, or no subnet manager on InfiniBand).
    #[error("RDMA device {device} port {port} is not active (state {state})")]
    PortDown {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// `ibv_port_state` value.
        state: u32,
    },
    /// A peer's endpoint or a registration table is malformed.
    #[error("invalid RDMA endpoint: {0}")]
    Endpoint(String),
    /// Memory that cannot be registered (a domain the device cannot reach, or empty).
    #[error("cannot register memory: {0}")]
    Memory(String),
}
