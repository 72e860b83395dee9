//! Receive regions: the byte ranges a transport may write into on the receiving side.
//!
//! A region is what decode registers for KV to land in (a KV pool's pages). Transports see it only
//! through [`ReceiveRegion`]: a length, and bounded writes. Every write is bounds-checked; a write
//! that does not fit is refused whole, never truncated (dataplane.md §5 item 2, Mooncake#2017).
//!
//! [`HostRegion`] is the host-memory implementation used by the TCP receiver, the simulated engine
//! and the benchmarks: fixed-size pages, each behind its own lock, so that concurrent writers and
//! readers of the *same* page are serialised (a late write still lands — that is the hazard the
//! release gate exists for — but it lands as a whole, defined write, never as a data race).

use std::io::Read;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Identifies a registered region within one worker (wire: `u32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId(pub u32);

/// Errors of region access.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// `offset + len` exceeds the region.
    #[error("write of {len} B at offset {offset} exceeds region of {region_len} B")]
    OutOfBounds {
        /// Requested offset (bytes).
        offset: u64,
        /// Requested length (bytes).
        len: u64,
        /// Region length (bytes).
        region_len: u64,
    },
    /// The region refused the write (e.g. a pool page that is not allocated); nothing was written.
    #[error("write refused: {0}")]
    Refused(String),
    /// Reading the payload from its source failed; bytes before the failure may have landed.
    #[error("payload source failed after {landed} B: {source}")]
    Source {
        /// Bytes written before the failure.
        landed: u64,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A byte range a transport may write into.
pub trait ReceiveRegion: Send + Sync {
    /// Length in bytes.
    fn len(&self) -> u64;

    /// True when the region has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` to `offset`. Refused whole if it does not fit.
    fn write(&self, offset: u64, src: &[u8]) -> Result<(), RegionError>;

    /// Reads exactly `len` bytes from `src` into `offset` (zero-copy receive from a socket).
    /// Bounds are checked before the first byte is read.
    fn write_from(&self, offset: u64, len: u64, src: &mut dyn Read) -> Result<(), RegionError>;

    /// Copies bytes at `offset` into `dst`.
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), RegionError>;
}

/// Checks `offset + len <= region_len` without overflow.
pub fn check_bounds(offset: u64, len: u64, region_len: u64) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionError::OutOfBounds {
            offset,
            len,
            region_len,
        }),
    }
}

/// Host memory split into equal pages, one lock per page.
#[derive(Debug)]
pub struct HostRegion {
    page_bytes: u64,
    pages: Vec<Mutex<Box<[u8]>>>,
}

impl HostRegion {
    /// `pages` zeroed pages of `page_bytes` each.
    ///
    /// # Panics
    /// Never; a zero page size yields an empty region.
    pub fn new(pages: u32, page_bytes: u64) -> HostRegion {
        let n = if page_bytes == 0 { 0 } else { pages as usize };
        let pages = (0..n)
            .map(|_| Mutex::new(vec![0u8; page_bytes as usize].into_boxed_slice()))
            .collect();
        HostRegion { page_bytes, pages }
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Number of pages.
    pub fn pages(&self) -> u32 {
        self.pages.len() as u32
    }

    /// Locks one page for reading or verifying in place. `None` if out of range.
    pub fn page(&self, index: u32) -> Option<MutexGuard<'_, Box<[u8]>>> {
        self.pages
            .get(index as usize)
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Splits `[offset, offset+len)` into (page, start, count) pieces.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let pb = self.page_bytes;
        let mut pos = offset;
        let end = offset + len;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let page = (pos / pb) as usize;
            let start = (pos % pb) as usize;
            let count = ((pb - start as u64).min(end - pos)) as usize;
            pos += count as u64;
            Some((page, start, count))
        })
    }
}

impl ReceiveRegion for HostRegion {
    fn len(&self) -> u64 {
        self.page_bytes * self.pages.len() as u64
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), RegionError> {
        check_bounds(offset, src.len() as u64, self.len())?;
        let mut done = 0usize;
        for (page, start, count) in self.pieces(offset, src.len() as u64) {
            let mut guard = self.pages[page]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            guard[start..start + count].copy_from_slice(&src[done..done + count]);
            done += count;
        }
        Ok(())
    }

    fn write_from(&self, offset: u64, len: u64, src: &mut dyn Read) -> Result<(), RegionError> {
        check_bounds(offset, len, self.len())?;
        let mut landed = 0u64;
        for (page, start, count) in self.pieces(offset, len) {
            let mut guard = self.pages[page]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            src.read_exact(&mut guard[start..start + count])
                .map_err(|source| RegionError::Source { landed, source })?;
            landed += count as u64;
        }
        Ok(())
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), RegionError> {
        check_bounds(offset, dst.len() as u64, self.len())?;
        let mut done = 0usize;
        for (page, start, count) in self.pieces(offset, dst.len() as u64) {
            let guard = self.pages[page]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            dst[done..done + count].copy_from_slice(&guard[start..start + count]);
            done += count;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_span_pages_and_bounds_are_whole() {
        let r = HostRegion::new(3, 4);
        r.write(2, &[1, 2, 3, 4, 5, 6]).unwrap();
        let mut out = [0u8; 12];
        r.read(0, &mut out).unwrap();
        assert_eq!(out, [0, 0, 1, 2, 3, 4, 5, 6, 0, 0, 0, 0]);
        assert!(matches!(
            r.write(10, &[9, 9, 9]),
            Err(RegionError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.write(u64::MAX, &[9]),
            Err(RegionError::OutOfBounds { .. })
        ));
        r.read(6, &mut out[..6]).unwrap();
        assert_eq!(
            &out[..6],
            &[5, 6, 0, 0, 0, 0],
            "a refused write changes nothing"
        );
    }

    #[test]
    fn write_from_reads_exactly() {
        let r = HostRegion::new(2, 4);
        let mut src: &[u8] = &[7, 8, 9, 10, 11];
        r.write_from(3, 4, &mut src).unwrap();
        assert_eq!(src, &[11]);
        let mut short: &[u8] = &[1];
        assert!(matches!(
            r.write_from(0, 2, &mut short),
            Err(RegionError::Source { landed: 0, .. })
        ));
    }
}
