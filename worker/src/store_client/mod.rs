//! Store clients: the worker's connection to the L3 KV store (DESIGN §2 `CacheTier.clientMode`;
//! reference/dataplane.md §1.3 "Client modes").
//!
//! - `Embedded`: the client lives in the worker process, creates its shared-memory segments itself and
//!   can register any host memory of this process ([`embedded::EmbeddedClient`]).
//! - `Standalone`: a separate `tandem-worker store-client` process creates and owns the segments; the
//!   worker maps them through fds received over a Unix socket and can register only buffers that lie
//!   inside them ([`standalone::StandaloneClient`], server side in [`server`], wire format in
//!   [`protocol`]). A pointer from anywhere else is [`StoreError::NotInSegment`], found before any IPC —
//!   never a bare −1 (seed 000).
//!
//! Every client hands out the tier's allocator ([`StoreClient::host_allocator`]); host pools that will be
//! registered are allocated from it, so target and draft pools share one domain by construction.

pub mod embedded;
pub mod protocol;
pub mod server;
pub mod socket_path;
pub mod standalone;

use std::fmt;

use crate::memory::{Allocator, AllocatorDomain, Buffer, BufferId, MemoryError};
use protocol::RemoteError;

/// Where the store client runs (DESIGN §2 `CacheTier.clientMode`); named in the worker config, so
/// it lives in `tandem-interfaces` (worker/interfaces/README.md §2).
pub use tandem_interfaces::memory::ClientMode;

/// A range to register: a whole buffer or a sub-range of one, with the buffer's provenance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferRef {
    /// The buffer the range belongs to.
    pub buffer: BufferId,
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// The buffer's domain.
    pub domain: AllocatorDomain,
    /// The buffer's owner.
    pub owner: String,
    /// The allocator that made it (for error messages).
    pub allocator: String,
}

impl BufferRef {
    /// The whole of `buffer`.
    pub fn whole(buffer: &Buffer) -> Self {
        Self {
            buffer: buffer.id(),
            addr: buffer.addr(),
            len: buffer.len(),
            domain: buffer.domain(),
            owner: buffer.owner().to_owned(),
            allocator: buffer.allocator().describe(),
        }
    }

    /// `len` bytes at `offset` inside `buffer`, or `None` if the range leaves the buffer.
    pub fn sub_range(buffer: &Buffer, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        (end <= buffer.len()).then(|| Self {
            addr: buffer.addr() + offset,
            len,
            ..Self::whole(buffer)
        })
    }

    /// `[addr, addr+len)` overlaps `other`.
    pub fn overlaps(&self, addr: usize, len: usize) -> bool {
        self.addr < addr.saturating_add(len) && addr < self.addr.saturating_add(self.len)
    }
}

/// The client's receipt for one registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreHandle(pub u64);

/// A store client, embedded or standalone.
pub trait StoreClient: Send + Sync + fmt::Debug {
    /// Embedded or standalone.
    fn mode(&self) -> ClientMode;

    /// The allocator of the tier's shared memory: every host pool that will be registered is
    /// allocated from it (DESIGN §2: target and draft pools share the allocator domain).
    fn host_allocator(&self) -> &Allocator;

    /// Domains this client can register. Standalone: only `SharedMemory`.
    fn accepted_domains(&self) -> &'static [AllocatorDomain];

    /// Checks, without side effects, that `range` could be registered: its domain is accepted and
    /// (standalone) it lies inside one of the client's segments. This is the preflight of DESIGN
    /// contract 2.
    ///
    /// # Errors
    /// [`StoreError::ZeroSize`], [`StoreError::DomainMismatch`], [`StoreError::NotInSegment`].
    fn check_registrable(&self, range: &BufferRef) -> Result<(), StoreError> {
        if range.len == 0 {
            return Err(StoreError::ZeroSize(range.buffer));
        }
        if !self.accepted_domains().contains(&range.domain) {
            return Err(StoreError::DomainMismatch {
                buffer: range.buffer,
                owner: range.owner.clone(),
                domain: range.domain,
                allocator: range.allocator.clone(),
                mode: self.mode(),
                accepted: self.accepted_domains().to_vec(),
            });
        }
        Ok(())
    }

    /// Registers `range` with the store (the external call that can fail; fault-injected in tests).
    ///
    /// # Errors
    /// The preflight errors, [`StoreError::Remote`] from the store-client process, or
    /// [`StoreError::PeerIpc`].
    fn register_buffer(&self, range: &BufferRef) -> Result<StoreHandle, StoreError>;

    /// Undoes one registration.
    ///
    /// # Errors
    /// [`StoreError::UnknownHandle`], [`StoreError::Remote`], [`StoreError::PeerIpc`].
    fn unregister_buffer(&self, handle: StoreHandle) -> Result<(), StoreError>;

    /// Registrations this client currently holds (0 after a clean teardown).
    fn registered_count(&self) -> usize;

    /// The segments behind [`StoreClient::host_allocator`], whose fds the engine API passes to the
    /// engine (DESIGN §3.1); `None` for a client without segments.
    fn segment_set(&self) -> Option<&std::sync::Arc<crate::memory::shared::SegmentSet>> {
        None
    }

    /// Releases the client's segments and connection (teardown, DESIGN contract 9). Idempotent.
    ///
    /// # Errors
    /// [`StoreError::PeerIpc`] when the store-client process cannot be told.
    fn shutdown(&self) -> Result<(), StoreError>;
}

/// Errors of store clients: typed reasons instead of Mooncake's overloaded −1
/// (reference/dataplane.md §1.3 and R-REG-5).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Zero-length registration (Mooncake PR #701).
    #[error("{0}: zero-size registration")]
    ZeroSize(BufferId),
    /// The buffer's domain is not one this client can register (seed 000: a `Mmap` draft pool handed
    /// to a standalone client).
    #[error(
        "{buffer} ({owner}) is in the {domain} domain (allocator {allocator}) but the {mode} store client accepts only {accepted:?}"
    )]
    DomainMismatch {
        /// The buffer.
        buffer: BufferId,
        /// Its owner.
        owner: String,
        /// Its domain.
        domain: AllocatorDomain,
        /// The allocator that made it.
        allocator: String,
        /// The client's mode.
        mode: ClientMode,
        /// What the client accepts.
        accepted: Vec<AllocatorDomain>,
    },
    /// The range is not inside any segment of the standalone store client.
    #[error("{buffer}: range {addr:#x}+{len} lies in no segment of the standalone store client")]
    NotInSegment {
        /// The buffer.
        buffer: BufferId,
        /// Start address.
        addr: usize,
        /// Length.
        len: usize,
    },
    /// The handle is not one of this client's registrations.
    #[error("unknown store registration {0:?}")]
    UnknownHandle(StoreHandle),
    /// The store-client process refused, with its typed reason.
    #[error("store client refused: {0}")]
    Remote(RemoteError),
    /// Talking to the store-client process failed (PEER_IPC_FAILED).
    #[error("store-client IPC failed during {op}: {source}")]
    PeerIpc {
        /// The request.
        op: &'static str,
        /// The socket error.
        source: std::io::Error,
    },
    /// The store-client process answered something unexpected.
    #[error("store-client protocol error: {0}")]
    Protocol(String),
    /// Mapping or creating a segment failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A fault injected by a test harness.
    #[error("injected fault: {0}")]
    Injected(String),
}
