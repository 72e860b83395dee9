//! Pinned host memory: the `Pinned` domain.
//!
//! Anonymous mmap locked into RAM with `mlock`, so pages are never swapped and DMA engines (RDMA NICs,
//! GPU copy engines) can rely on them. A low `ulimit -l` is reported as [`MemoryError::MemlockLimit`]
//! (reference/dataplane.md R-REG-5: MEMLOCK is an actionable code, not a bare failure).

use std::ffi::c_void;

use super::allocator::{AllocatorBackend, MemoryError, RawRegion};
use super::domain::AllocatorDomain;
use super::mmap::{map_anonymous, unmap};
use super::{align_up, host_page_size};

/// Backend of the `Pinned` domain: mmap + mlock per buffer; munlock + munmap on release.
#[derive(Debug, Default)]
pub struct PinnedBackend {
    _private: (),
}

impl PinnedBackend {
    /// A new backend (stateless).
    pub fn new() -> Self {
        Self { _private: () }
    }
}

impl AllocatorBackend for PinnedBackend {
    fn domain(&self) -> AllocatorDomain {
        AllocatorDomain::Pinned
    }
    fn kind(&self) -> String {
        "pinned".into()
    }
    fn allocate(&self, len: usize) -> Result<RawRegion, MemoryError> {
        let len = align_up(len, host_page_size()).ok_or(MemoryError::SizeOverflow(len))?;
        let region = map_anonymous(len)?;
        // SAFETY: `region` is a live mapping we just created.
        if let Err(e) = unsafe { rustix::mm::mlock(region.addr as *mut c_void, len) } {
            // SAFETY: nothing references the fresh mapping yet.
            if let Err(unmap_err) = unsafe { unmap(region) } {
                tracing::error!(error = %unmap_err, "unmap after failed mlock failed");
            }
            return Err(MemoryError::MemlockLimit {
                bytes: len,
                source: e.into(),
            });
        }
        Ok(region)
    }
    unsafe fn release(&self, region: RawRegion) -> Result<(), MemoryError> {
        // SAFETY: region is a live locked mapping from `allocate`. munlock failing is harmless
        // (munmap unlocks too), so only munmap's result matters.
        let _ = unsafe { rustix::mm::munlock(region.addr as *mut c_void, region.len) };
        // SAFETY: forwarded contract.
        unsafe { unmap(region) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Allocator;

    #[test]
    fn pinned_allocates_or_reports_memlock() {
        let a = Allocator::new("pinned", PinnedBackend::new());
        match a.allocate(4096, "t") {
            Ok(b) => {
                assert_eq!(b.domain(), AllocatorDomain::Pinned);
                b.free().unwrap();
            }
            Err(MemoryError::MemlockLimit { bytes, .. }) => assert_eq!(bytes, 4096),
            Err(e) => panic!("unexpected {e}"),
        }
        assert_eq!(a.stats().live_buffers, 0);
    }
}
