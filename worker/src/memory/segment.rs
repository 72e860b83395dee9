//! Shared-memory segments: the memory behind the `SharedMemory` domain.
//!
//! A segment is created by the store client that owns it (in-process for `Embedded`, the `store-client`
//! process for `Standalone`), backed by a memfd (anonymous, freed by the kernel when the last fd and
//! mapping go) or a POSIX shm object (`/dev/shm/<name>`, which must be unlinked explicitly — DESIGN
//! contract 9: no segment of ours is left in /dev/shm). The worker maps the same pages from the fd it
//! receives over the store client's Unix socket (SCM_RIGHTS), so both processes see one physical range
//! (reference/dataplane.md §1.3: Mooncake's ShmHelper does the same with memfd).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{MemfdFlags, Mode};
use rustix::mm::{MapFlags, ProtFlags};
use serde::{Deserialize, Serialize};

use super::allocator::{MemoryError, RawRegion};
use super::mmap::unmap;
use super::{align_up, host_page_size};

/// Prefix of every segment name we create; teardown checks and tests scan `/dev/shm` for it.
pub const SEGMENT_NAME_PREFIX: &str = "tandem-";

/// How a segment's memory is provided by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SegmentBackend {
    /// `memfd_create`: no name in any filesystem; cannot leak past the last process holding it.
    #[default]
    Memfd,
    /// `shm_open` under `/dev/shm`: visible by name, must be unlinked by its owner.
    PosixShm,
}

/// Description of a segment, as sent from the store client to a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentInfo {
    /// Id unique within the owning store client.
    pub id: u64,
    /// Kernel name (memfd name, or POSIX shm name with its leading `/`).
    pub name: String,
    /// Length in bytes (a multiple of the host page size).
    pub len: usize,
    /// Kernel backing.
    pub backend: SegmentBackend,
}

/// A mapped segment. The creator also owns the name (POSIX shm) and unlinks it when destroyed.
#[derive(Debug)]
pub struct Segment {
    info: SegmentInfo,
    fd: OwnedFd,
    base: usize,
    owns_name: bool,
    unlinked: AtomicBool,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the page refcounts of
// the pools carved from it, and `Segment` itself exposes only addresses.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates and maps a new segment of at least `len` bytes (rounded up to the page size).
    ///
    /// `name` should start with [`SEGMENT_NAME_PREFIX`]; for `PosixShm` it must be unique on the host
    /// (created with `O_EXCL`, so a stale object of the same name is an error, not silently reused).
    ///
    /// # Errors
    /// [`MemoryError::ZeroSize`], [`MemoryError::SizeOverflow`], or [`MemoryError::Os`] for
    /// `memfd_create`/`shm_open`/`ftruncate`/`mmap` (a failed step undoes the previous ones).
    pub fn create(
        id: u64,
        name: &str,
        len: usize,
        backend: SegmentBackend,
    ) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroSize);
        }
        let len = align_up(len, host_page_size()).ok_or(MemoryError::SizeOverflow(len))?;
        let os = |call: &'static str| {
            move |e: rustix::io::Errno| MemoryError::Os {
                call,
                bytes: len,
                source: e.into(),
            }
        };
        let (fd, kernel_name) = match backend {
            SegmentBackend::Memfd => (
                rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC).map_err(os("memfd_create"))?,
                name.to_owned(),
            ),
            SegmentBackend::PosixShm => {
                let shm_name = format!("/{}", name.trim_start_matches('/'));
                let fd = rustix::shm::open(
                    shm_name.as_str(),
                    rustix::shm::OFlags::CREATE
                        | rustix::shm::OFlags::EXCL
                        | rustix::shm::OFlags::RDWR,
                    Mode::RUSR | Mode::WUSR,
                )
                .map_err(os("shm_open"))?;
                (fd, shm_name)
            }
        };
        let info = SegmentInfo {
            id,
            name: kernel_name,
            len,
            backend,
        };
        let unlink_on_error = |info: &SegmentInfo| {
            if info.backend == SegmentBackend::PosixShm {
                let _ = rustix::shm::unlink(info.name.as_str());
            }
        };
        if let Err(e) = rustix::fs::ftruncate(&fd, len as u64) {
            unlink_on_error(&info);
            return Err(os("ftruncate")(e));
        }
        match map_shared(fd.as_fd(), len) {
            Ok(base) => Ok(Self {
                info,
                fd,
                base,
                owns_name: true,
                unlinked: AtomicBool::new(false),
            }),
            Err(e) => {
                unlink_on_error(&info);
                Err(e)
            }
        }
    }

    /// Maps a segment received from its owner (the fd came over SCM_RIGHTS). The fd's size must be at
    /// least `info.len`. The mapping does not own the name: dropping it never unlinks.
    ///
    /// # Errors
    /// [`MemoryError::Os`] for `fstat`/`mmap`, or a size mismatch reported as `fstat` EINVAL.
    pub fn map_received(info: SegmentInfo, fd: OwnedFd) -> Result<Self, MemoryError> {
        let st = rustix::fs::fstat(&fd).map_err(|e| MemoryError::Os {
            call: "fstat",
            bytes: info.len,
            source: e.into(),
        })?;
        if (st.st_size as u64) < info.len as u64 || info.len == 0 {
            return Err(MemoryError::Os {
                call: "fstat",
                bytes: info.len,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "segment {} is {} bytes, announced {}",
                        info.name, st.st_size, info.len
                    ),
                ),
            });
        }
        let base = map_shared(fd.as_fd(), info.len)?;
        Ok(Self {
            info,
            fd,
            base,
            owns_name: false,
            unlinked: AtomicBool::new(false),
        })
    }

    /// Description (id, name, length, backend).
    pub fn info(&self) -> &SegmentInfo {
        &self.info
    }
    /// Base address in this process.
    pub fn base(&self) -> usize {
        self.base
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.info.len
    }
    /// Always false (segments are never empty).
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }
    /// The fd, to pass to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
    /// Whether `[addr, addr+len)` lies inside this segment's mapping; returns the offset if so.
    pub fn offset_of(&self, addr: usize, len: usize) -> Option<usize> {
        let end = addr.checked_add(len)?;
        (addr >= self.base && end <= self.base + self.info.len).then(|| addr - self.base)
    }

    /// Removes the name (POSIX shm, creator only) now, ahead of the unmap on drop. Idempotent.
    ///
    /// # Errors
    /// [`MemoryError::Os`] for `shm_unlink` other than "already gone".
    pub fn unlink(&self) -> Result<(), MemoryError> {
        let already = self.unlinked.swap(true, Ordering::AcqRel);
        if already || !self.owns_name || self.info.backend != SegmentBackend::PosixShm {
            return Ok(());
        }
        match rustix::shm::unlink(self.info.name.as_str()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(MemoryError::Os {
                call: "shm_unlink",
                bytes: self.info.len,
                source: e.into(),
            }),
        }
    }

    /// Test-only negative control: forget the name so dropping the segment leaves it in /dev/shm.
    /// Feature `negative-controls`.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn leak_name_for_test(&self) {
        self.unlinked.store(true, Ordering::Release);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Err(e) = self.unlink() {
            tracing::error!(segment = %self.info.name, error = %e, "segment unlink failed");
        }
        // SAFETY: the mapping is ours and whole; every buffer carved from it holds an `Arc` to the
        // segment, so no buffer outlives this drop.
        if let Err(e) = unsafe {
            unmap(RawRegion {
                addr: self.base,
                len: self.info.len,
            })
        } {
            tracing::error!(segment = %self.info.name, error = %e, "segment unmap failed");
        }
    }
}

fn map_shared(fd: BorrowedFd<'_>, len: usize) -> Result<usize, MemoryError> {
    // SAFETY: mapping a shared file at a kernel-chosen address aliases nothing in this process.
    let p = unsafe {
        rustix::mm::mmap(
            ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(|e| MemoryError::Os {
        call: "mmap",
        bytes: len,
        source: e.into(),
    })?;
    Ok(p as usize)
}

/// Names of POSIX shm objects in `/dev/shm` that start with `prefix` (for teardown checks and tests).
pub fn dev_shm_entries(prefix: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_share_bytes_and_posix_name_is_removed() {
        let name = format!("{SEGMENT_NAME_PREFIX}unit-{}", std::process::id());
        let seg = Segment::create(1, &name, 5000, SegmentBackend::PosixShm).unwrap();
        assert_eq!(seg.len(), 8192);
        assert_eq!(dev_shm_entries(&name).len(), 1);
        let fd = seg.fd().try_clone_to_owned().unwrap();
        let other = Segment::map_received(seg.info().clone(), fd).unwrap();
        // SAFETY: both mappings are live and 8 KiB long; single-threaded test.
        unsafe {
            *(seg.base() as *mut u8).add(100) = 42;
            assert_eq!(*(other.base() as *const u8).add(100), 42);
        }
        assert_eq!(seg.offset_of(seg.base() + 10, 10), Some(10));
        assert_eq!(seg.offset_of(seg.base() + 8190, 10), None);
        drop(other);
        drop(seg);
        assert!(dev_shm_entries(&name).is_empty());
    }

    #[test]
    fn memfd_segment_never_appears_in_dev_shm() {
        let name = format!("{SEGMENT_NAME_PREFIX}memfd-unit-{}", std::process::id());
        let seg = Segment::create(2, &name, 4096, SegmentBackend::Memfd).unwrap();
        assert!(dev_shm_entries(&name).is_empty());
        assert!(Segment::create(3, &name, 0, SegmentBackend::Memfd).is_err());
        drop(seg);
    }
}
