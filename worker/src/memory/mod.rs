//! Host and device memory with allocator domains (DESIGN contract 1; reference/dataplane.md R-MEM-1..3).
//!
//! Every byte the data plane registers or transfers lives in a [`Buffer`] made by an [`Allocator`]. The
//! buffer records its [`AllocatorDomain`], its owner and the allocator that must free it; none of those
//! can be forged from a raw pointer, which is what makes the seed-000 outage (a draft pool silently on
//! plain mmap) detectable before any side effect.
//!
//! - [`domain`]: the domain enum;
//! - [`allocator`]: the allocator handle, its backends' trait, the buffer handle and statistics;
//! - [`mmap`], [`pinned`], [`shared`], [`device`]: the backends;
//! - [`segment`]: shared-memory segments (memfd or POSIX shm) that a store client creates and maps;
//! - [`capacity`]: sizing every pool before anything is allocated;
//! - [`heap`]: the process heap's policy for page-sized buffers outside the pools;
//! - [`pool`]: page-granular KV pools carved from one buffer of an allocator.

pub mod allocator;
pub mod capacity;
pub mod device;
pub mod domain;
pub mod heap;
pub mod mmap;
pub mod pinned;
pub mod pool;
pub mod segment;
pub mod shared;

pub use allocator::{
    Allocator, AllocatorBackend, AllocatorHook, AllocatorId, AllocatorStats, Buffer, BufferId,
    MemoryError, RawRegion,
};
pub use domain::{AllocatorDomain, DomainMismatch, require_domain};

/// The host page size used for alignment (4 KiB on every platform we run on; queried once).
pub fn host_page_size() -> usize {
    rustix::param::page_size()
}

/// Rounds `len` up to a multiple of `align` (a power of two). `None` on overflow.
pub(crate) fn align_up(len: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    len.checked_add(align - 1).map(|v| v & !(align - 1))
}
