//! Page-aligned private anonymous mmap: the `Mmap` domain.
//!
//! Memory from here is meaningful only inside this process; a standalone store client cannot register
//! it (seed 000: the draft host pool that fell back to plain mmap).

use std::ffi::c_void;
use std::ptr;

use rustix::mm::{MapFlags, ProtFlags};

use super::allocator::{AllocatorBackend, MemoryError, RawRegion};
use super::domain::AllocatorDomain;
use super::{align_up, host_page_size};

/// Backend of the `Mmap` domain: one `mmap(MAP_PRIVATE|MAP_ANONYMOUS)` per buffer, length rounded up to
/// the host page size, released with `munmap`.
#[derive(Debug, Default)]
pub struct MmapBackend {
    _private: (),
}

impl MmapBackend {
    /// A new backend (stateless).
    pub fn new() -> Self {
        Self { _private: () }
    }
}

/// Maps `len` bytes (already page-aligned) of private anonymous read-write memory.
pub(crate) fn map_anonymous(len: usize) -> Result<RawRegion, MemoryError> {
    // SAFETY: a fresh anonymous mapping at a kernel-chosen address aliases nothing.
    let addr = unsafe {
        rustix::mm::mmap_anonymous(
            ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .map_err(|e| MemoryError::Os {
        call: "mmap",
        bytes: len,
        source: e.into(),
    })?;
    Ok(RawRegion {
        addr: addr as usize,
        len,
    })
}

/// Unmaps a region returned by [`map_anonymous`] or a segment mapping.
///
/// # Safety
/// The region must be a whole live mapping with no outstanding references.
pub(crate) unsafe fn unmap(region: RawRegion) -> Result<(), MemoryError> {
    // SAFETY: forwarded contract.
    unsafe { rustix::mm::munmap(region.addr as *mut c_void, region.len) }.map_err(|e| {
        MemoryError::Os {
            call: "munmap",
            bytes: region.len,
            source: e.into(),
        }
    })
}

impl AllocatorBackend for MmapBackend {
    fn domain(&self) -> AllocatorDomain {
        AllocatorDomain::Mmap
    }
    fn kind(&self) -> String {
        "mmap".into()
    }
    fn allocate(&self, len: usize) -> Result<RawRegion, MemoryError> {
        let len = align_up(len, host_page_size()).ok_or(MemoryError::SizeOverflow(len))?;
        map_anonymous(len)
    }
    unsafe fn release(&self, region: RawRegion) -> Result<(), MemoryError> {
        // SAFETY: the caller guarantees `region` came from `allocate` and is released once.
        unsafe { unmap(region) }
    }
}
