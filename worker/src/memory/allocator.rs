//! The allocator handle, the backend trait and the buffer handle.
//!
//! Ownership rule (DESIGN contract 9 step "free memory with the allocator that made it"; LMCache PR #2643
//! class of bug): a [`Buffer`] keeps a handle to the [`Allocator`] that made it and is released only
//! through it. [`Allocator::free`] refuses a buffer made by another allocator with
//! [`MemoryError::WrongAllocator`]. A buffer whose registration could not be undone is
//! [`Buffer::quarantine`]d: its memory is never freed or reused until the process exits
//! (reference/dataplane.md R-REG-3).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::domain::AllocatorDomain;

/// Process-unique id of an allocator instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocatorId(pub u64);

/// Process-unique id of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buffer#{}", self.0)
    }
}

static NEXT_ALLOCATOR: AtomicU64 = AtomicU64::new(1);
static NEXT_BUFFER: AtomicU64 = AtomicU64::new(1);

/// A raw range handed out by a backend: `addr` is a CPU virtual address for host domains and a device
/// pointer for `Device`. `len` is the usable length in bytes (≥ the requested length, rounded up by the
/// backend to its granularity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawRegion {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Where a shared-memory buffer lies inside a store-client segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentPlacement {
    /// Segment id as assigned by the store client that owns the segment.
    pub segment: u64,
    /// Byte offset of the buffer from the segment base.
    pub offset: usize,
}

/// What an allocator backend does: hand out and take back raw ranges of one domain.
///
/// Backends are internal building blocks; code outside `memory` uses [`Allocator`]. A backend may be
/// wrapped (for fault injection in tests) as long as the domain it reports is the domain of the memory.
pub trait AllocatorBackend: Send + Sync + fmt::Debug {
    /// The domain of every range this backend returns.
    fn domain(&self) -> AllocatorDomain;
    /// Short kind for logs and errors, e.g. `mmap`, `pinned`, `shm(standalone)`.
    fn kind(&self) -> String;
    /// Allocates at least `len` bytes (`len` > 0, checked by the caller).
    ///
    /// # Errors
    /// A [`MemoryError`] naming the cause (OS error, memlock limit, segment space, device absent).
    fn allocate(&self, len: usize) -> Result<RawRegion, MemoryError>;
    /// Releases a range this backend returned.
    ///
    /// # Safety
    /// `region` must come from `allocate` on this backend, be released at most once, and no reference
    /// into it may outlive the call.
    ///
    /// # Errors
    /// The OS error of the unmap or free.
    unsafe fn release(&self, region: RawRegion) -> Result<(), MemoryError>;
    /// For shared-memory backends, where `region` lies in its segment; `None` otherwise.
    fn placement(&self, _region: RawRegion) -> Option<SegmentPlacement> {
        None
    }
}

/// Live counters of one allocator; all zero after a clean teardown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Buffers allocated and not yet freed or quarantined.
    pub live_buffers: u64,
    /// Bytes of those buffers.
    pub live_bytes: u64,
    /// Buffers quarantined (never freed until exit).
    pub quarantined_buffers: u64,
    /// Bytes quarantined.
    pub quarantined_bytes: u64,
    /// Successful frees since creation.
    pub frees: u64,
}

/// A hook called before every allocation and release of an allocator: the seam where tests inject
/// faults at the external calls and record their order (DESIGN §6 "fault injection").
pub trait AllocatorHook: Send + Sync + fmt::Debug {
    /// Called before the backend allocates `len` bytes for `owner`; an error aborts the allocation.
    ///
    /// # Errors
    /// Whatever the hook decides (tests return [`MemoryError::Injected`]).
    fn before_allocate(&self, len: usize, owner: &str) -> Result<(), MemoryError>;
    /// Called before the backend releases a buffer; an error aborts the release.
    ///
    /// # Errors
    /// As above.
    fn before_release(&self, buffer: BufferId, owner: &str) -> Result<(), MemoryError>;
}

#[derive(Debug)]
struct AllocatorInner {
    id: AllocatorId,
    name: String,
    backend: Arc<dyn AllocatorBackend>,
    hook: Option<Arc<dyn AllocatorHook>>,
    live_buffers: AtomicU64,
    live_bytes: AtomicU64,
    quarantined_buffers: AtomicU64,
    quarantined_bytes: AtomicU64,
    frees: AtomicU64,
}

/// A handle to one allocator instance (cheap to clone; clones are the same allocator).
#[derive(Debug, Clone)]
pub struct Allocator {
    inner: Arc<AllocatorInner>,
}

impl Allocator {
    /// Wraps a backend. `name` appears in errors and logs (e.g. `"tier shared memory"`).
    pub fn new(name: impl Into<String>, backend: impl AllocatorBackend + 'static) -> Self {
        Self::from_boxed(name, Box::new(backend))
    }

    /// As [`Allocator::new`] for an already boxed backend.
    pub fn from_boxed(name: impl Into<String>, backend: Box<dyn AllocatorBackend>) -> Self {
        Self::build(name.into(), Arc::from(backend), None)
    }

    /// A new allocator over the same backend (same domain and memory source) with `hook` called
    /// before each allocation and release. It is a distinct allocator: buffers it makes must be freed
    /// by it, and it has its own counters.
    pub fn with_hook(&self, hook: Arc<dyn AllocatorHook>) -> Self {
        Self::build(
            format!("{} (hooked)", self.inner.name),
            self.inner.backend.clone(),
            Some(hook),
        )
    }

    fn build(
        name: String,
        backend: Arc<dyn AllocatorBackend>,
        hook: Option<Arc<dyn AllocatorHook>>,
    ) -> Self {
        Self {
            inner: Arc::new(AllocatorInner {
                id: AllocatorId(NEXT_ALLOCATOR.fetch_add(1, Ordering::Relaxed)),
                name,
                backend,
                hook,
                live_buffers: AtomicU64::new(0),
                live_bytes: AtomicU64::new(0),
                quarantined_buffers: AtomicU64::new(0),
                quarantined_bytes: AtomicU64::new(0),
                frees: AtomicU64::new(0),
            }),
        }
    }

    /// This allocator's id.
    pub fn id(&self) -> AllocatorId {
        self.inner.id
    }

    /// The domain of every buffer it makes.
    pub fn domain(&self) -> AllocatorDomain {
        self.inner.backend.domain()
    }

    /// Human-readable description: `name (kind, Domain)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}, {})",
            self.inner.name,
            self.inner.backend.kind(),
            self.domain()
        )
    }

    /// Allocates a buffer of at least `len` bytes for `owner` (e.g. `"draft host KV pool"`).
    ///
    /// # Errors
    /// [`MemoryError::ZeroSize`] for `len == 0`; otherwise the backend's error.
    pub fn allocate(&self, len: usize, owner: impl Into<String>) -> Result<Buffer, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroSize);
        }
        let owner = owner.into();
        if let Some(hook) = &self.inner.hook {
            hook.before_allocate(len, &owner)?;
        }
        let region = self.inner.backend.allocate(len)?;
        self.inner.live_buffers.fetch_add(1, Ordering::Relaxed);
        self.inner
            .live_bytes
            .fetch_add(region.len as u64, Ordering::Relaxed);
        let placement = self.inner.backend.placement(region);
        Ok(Buffer {
            id: BufferId(NEXT_BUFFER.fetch_add(1, Ordering::Relaxed)),
            region,
            requested: len,
            owner,
            allocator: self.clone(),
            placement,
            released: false,
        })
    }

    /// Frees `buffer`, which must have been made by this allocator.
    ///
    /// # Errors
    /// [`MemoryError::WrongAllocator`] (the buffer is handed back untouched inside the error) or the
    /// backend's release error.
    pub fn free(&self, buffer: Buffer) -> Result<(), MemoryError> {
        if buffer.allocator.id() != self.id() {
            return Err(MemoryError::WrongAllocator {
                buffer: buffer.id,
                made_by: buffer.allocator.describe(),
                freed_by: self.describe(),
                rejected: Box::new(buffer),
            });
        }
        buffer.free()
    }

    /// Current counters.
    pub fn stats(&self) -> AllocatorStats {
        let i = &self.inner;
        AllocatorStats {
            live_buffers: i.live_buffers.load(Ordering::Relaxed),
            live_bytes: i.live_bytes.load(Ordering::Relaxed),
            quarantined_buffers: i.quarantined_buffers.load(Ordering::Relaxed),
            quarantined_bytes: i.quarantined_bytes.load(Ordering::Relaxed),
            frees: i.frees.load(Ordering::Relaxed),
        }
    }

    fn release_region(
        &self,
        buffer: BufferId,
        owner: &str,
        region: RawRegion,
    ) -> Result<(), MemoryError> {
        if let Some(hook) = &self.inner.hook {
            hook.before_release(buffer, owner)?;
        }
        // SAFETY: `Buffer` is the only holder of `region`, it calls this exactly once (guarded by its
        // `released` flag), and byte views borrow the buffer, so none outlive it.
        unsafe { self.inner.backend.release(region) }?;
        self.inner.live_buffers.fetch_sub(1, Ordering::Relaxed);
        self.inner
            .live_bytes
            .fetch_sub(region.len as u64, Ordering::Relaxed);
        self.inner.frees.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// A buffer handle: an address range plus its domain, owner, allocator and (for shared memory) its
/// place in a store-client segment.
///
/// Not `Clone`: exactly one handle owns the memory. Dropping a handle that was neither freed nor
/// quarantined frees it through its allocator and logs a warning (so a leak cannot outlive the handle,
/// but an explicit [`Buffer::free`] is expected and reports errors).
#[derive(Debug)]
pub struct Buffer {
    id: BufferId,
    region: RawRegion,
    requested: usize,
    owner: String,
    allocator: Allocator,
    placement: Option<SegmentPlacement>,
    released: bool,
}

// SAFETY: a `Buffer` is a unique owner of its range (like a `Box<[u8]>`); shared access goes through
// `&Buffer`, and the byte-view methods are `unsafe` with documented aliasing contracts.
unsafe impl Send for Buffer {}
// SAFETY: as above; `&Buffer` exposes only addresses and metadata safely.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Process-unique id.
    pub fn id(&self) -> BufferId {
        self.id
    }
    /// Start address (CPU virtual address, or device pointer for `Device`).
    pub fn addr(&self) -> usize {
        self.region.addr
    }
    /// Usable length in bytes (the request rounded up to the backend's granularity).
    pub fn len(&self) -> usize {
        self.region.len
    }
    /// Always false: zero-size buffers cannot be made.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
    /// Length asked for at allocation.
    pub fn requested_len(&self) -> usize {
        self.requested
    }
    /// The domain, taken from the allocator at allocation (cannot be changed).
    pub fn domain(&self) -> AllocatorDomain {
        self.allocator.domain()
    }
    /// Who asked for it.
    pub fn owner(&self) -> &str {
        &self.owner
    }
    /// The allocator that must free it.
    pub fn allocator(&self) -> &Allocator {
        &self.allocator
    }
    /// Place in a store-client segment, for `SharedMemory` buffers.
    pub fn placement(&self) -> Option<&SegmentPlacement> {
        self.placement.as_ref()
    }

    /// Raw pointer to the first byte (host domains only).
    ///
    /// # Errors
    /// [`MemoryError::NotHostMemory`] for device buffers.
    pub fn host_ptr(&self) -> Result<*mut u8, MemoryError> {
        if self.domain().is_host() {
            Ok(self.region.addr as *mut u8)
        } else {
            Err(MemoryError::NotHostMemory(self.id))
        }
    }

    /// Frees the buffer through the allocator that made it.
    ///
    /// # Errors
    /// The backend's release error; the memory is then treated as quarantined (it may still be mapped).
    pub fn free(mut self) -> Result<(), MemoryError> {
        self.released = true;
        match self
            .allocator
            .release_region(self.id, &self.owner, self.region)
        {
            Ok(()) => Ok(()),
            Err(e) => {
                self.count_quarantine();
                Err(e)
            }
        }
    }

    /// Gives up the memory without freeing it: it stays mapped and unused until the process exits.
    /// Used when a registration could not be undone, so freeing could let a NIC or a peer write into
    /// memory that is reused (reference/dataplane.md R-REG-3).
    pub fn quarantine(mut self) {
        self.released = true;
        self.count_quarantine();
        tracing::error!(
            buffer = %self.id,
            owner = %self.owner,
            bytes = self.region.len,
            allocator = %self.allocator.describe(),
            "buffer quarantined: memory kept until exit"
        );
    }

    fn count_quarantine(&self) {
        let i = &self.allocator.inner;
        i.live_buffers.fetch_sub(1, Ordering::Relaxed);
        i.live_bytes
            .fetch_sub(self.region.len as u64, Ordering::Relaxed);
        i.quarantined_buffers.fetch_add(1, Ordering::Relaxed);
        i.quarantined_bytes
            .fetch_add(self.region.len as u64, Ordering::Relaxed);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        tracing::warn!(buffer = %self.id, owner = %self.owner, "buffer dropped without free; freeing");
        if let Err(e) = self
            .allocator
            .release_region(self.id, &self.owner, self.region)
        {
            tracing::error!(buffer = %self.id, error = %e, "implicit free failed; memory quarantined");
            self.count_quarantine();
        }
    }
}

/// Errors of allocation and freeing.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// A zero-byte allocation or registration (Mooncake PR #701: size 0 is rejected, not a no-op).
    #[error("zero-size buffer requested")]
    ZeroSize,
    /// The size overflowed when rounded up to the backend's granularity.
    #[error("size {0} overflows when aligned")]
    SizeOverflow(usize),
    /// An OS call failed.
    #[error("{call} failed for {bytes} bytes: {source}")]
    Os {
        /// The call, e.g. `mmap`, `munmap`, `memfd_create`.
        call: &'static str,
        /// Size involved.
        bytes: usize,
        /// Errno.
        source: std::io::Error,
    },
    /// mlock refused: the memlock limit (`ulimit -l`) is too low for pinned memory.
    #[error(
        "cannot pin {bytes} bytes: memlock limit reached ({source}); raise `ulimit -l` or use the Mmap domain"
    )]
    MemlockLimit {
        /// Size asked for.
        bytes: usize,
        /// Errno (EPERM or ENOMEM).
        source: std::io::Error,
    },
    /// No segment has a free range large enough.
    #[error(
        "shared-memory segments have no free range of {requested} bytes (largest free range {largest_free})"
    )]
    SegmentFull {
        /// Size asked for.
        requested: usize,
        /// Largest free range across segments.
        largest_free: usize,
    },
    /// GPU memory is not available: built without `cuda`, no driver library, or no device.
    #[error("device memory unavailable: {reason}")]
    DeviceUnavailable {
        /// Why, in words.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {message}")]
    Device {
        /// The call.
        call: &'static str,
        /// The driver's message.
        message: String,
    },
    /// The buffer was made by another allocator (TC-OPS-03: free with the allocator that made it).
    #[error("{buffer} was made by {made_by} and cannot be freed by {freed_by}")]
    WrongAllocator {
        /// The buffer.
        buffer: BufferId,
        /// The allocator that made it.
        made_by: String,
        /// The allocator asked to free it.
        freed_by: String,
        /// The buffer itself, returned untouched.
        rejected: Box<Buffer>,
    },
    /// A CPU view was asked of device memory.
    #[error("{0} is device memory and has no host view")]
    NotHostMemory(BufferId),
    /// A fault injected by a test harness at an external call.
    #[error("injected fault at {0}")]
    Injected(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::mmap::MmapBackend;

    #[test]
    fn buffer_records_domain_owner_allocator_and_frees_through_it() {
        let a = Allocator::new("test mmap", MmapBackend::new());
        let b = a.allocate(10, "target host KV pool").unwrap();
        assert_eq!(b.domain(), AllocatorDomain::Mmap);
        assert_eq!(b.owner(), "target host KV pool");
        assert_eq!(b.allocator().id(), a.id());
        assert!(b.len() >= 10);
        assert_eq!(a.stats().live_buffers, 1);
        a.free(b).unwrap();
        assert_eq!(a.stats().live_buffers, 0);
        assert_eq!(a.stats().frees, 1);
    }

    #[test]
    fn another_allocator_cannot_free_it() {
        let a = Allocator::new("a", MmapBackend::new());
        let other = Allocator::new("b", MmapBackend::new());
        let b = a.allocate(4096, "x").unwrap();
        let err = other.free(b).unwrap_err();
        let MemoryError::WrongAllocator { rejected, .. } = err else {
            panic!("expected WrongAllocator")
        };
        assert_eq!(a.stats().live_buffers, 1, "nothing was freed");
        a.free(*rejected).unwrap();
        assert_eq!(a.stats().live_buffers, 0);
    }

    #[test]
    fn zero_size_and_quarantine() {
        let a = Allocator::new("a", MmapBackend::new());
        assert!(matches!(a.allocate(0, "x"), Err(MemoryError::ZeroSize)));
        let b = a.allocate(4096, "x").unwrap();
        b.quarantine();
        let s = a.stats();
        assert_eq!((s.live_buffers, s.quarantined_buffers, s.frees), (0, 1, 0));
    }
}
