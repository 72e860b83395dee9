//! A KV pool: one buffer from an allocator, carved into pages by a [`KvGeometry`], with a page table.
//!
//! Thread-safe: the page table sits behind a mutex; byte access is by copy ([`KvPool::write_chunk`],
//! [`KvPool::read_chunk`]) or, for zero-copy I/O, by address ([`KvPool::chunk_region`]) and the `unsafe`
//! slice views whose contract is the page pins.

use std::sync::{Mutex, MutexGuard};

use crate::memory::{Allocator, BufferId};
use crate::memory::{AllocatorDomain, Buffer, MemoryError};
use crate::model::ModelIdentity;

use super::PoolRole;
use super::geometry::{KvGeometry, PoolLayout};
use super::pages::{PageError, PageId, PageRefs, PageStats, PageTable};

/// What to build: role, model, page size, page count and layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Target, draft or indexer.
    pub role: PoolRole,
    /// The model whose KV the pool holds (its geometry fixes the chunk size).
    pub model: ModelIdentity,
    /// Tokens per page (DESIGN §2 `pageTokens`).
    pub page_tokens: u32,
    /// Number of pages.
    pub pages: u32,
    /// Chunk order.
    pub layout: PoolLayout,
}

impl PoolSpec {
    /// The geometry of this spec.
    pub fn geometry(&self) -> KvGeometry {
        KvGeometry::new(&self.model, self.page_tokens, self.pages, self.layout)
    }

    /// Bytes of the pool's buffer (before the allocator's rounding).
    ///
    /// # Errors
    /// [`PoolError::Invalid`] for zero pages/page tokens, an invalid model or an overflow.
    pub fn bytes(&self) -> Result<usize, PoolError> {
        self.model
            .validate()
            .map_err(|e| PoolError::Invalid(e.to_string()))?;
        if self.pages == 0 || self.page_tokens == 0 {
            return Err(PoolError::Invalid(format!(
                "{} pool needs pages > 0 and page_tokens > 0 (got {} and {})",
                self.role, self.pages, self.page_tokens
            )));
        }
        self.geometry()
            .total_bytes()
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| PoolError::Invalid(format!("{} pool size overflows", self.role)))
    }
}

/// Address range of one page-layer chunk, for transfer descriptors and registrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRegion {
    /// Buffer the chunk lies in.
    pub buffer: BufferId,
    /// Absolute address (CPU or device).
    pub addr: usize,
    /// Offset from the buffer's start.
    pub offset: usize,
    /// Length in bytes (= `geometry.chunk_bytes()`).
    pub len: usize,
}

/// Errors of pool operations.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The spec is unusable.
    #[error("invalid pool spec: {0}")]
    Invalid(String),
    /// Allocating or freeing the buffer failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A page operation was refused.
    #[error(transparent)]
    Page(#[from] PageError),
    /// Layer index out of range.
    #[error("layer {layer} is out of range (model has {layers})")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers in the model.
        layers: u32,
    },
    /// A copy would cross the end of the chunk.
    #[error("{len} bytes at offset {offset} do not fit a {chunk}-byte chunk")]
    OutOfChunk {
        /// Offset in the chunk.
        offset: usize,
        /// Bytes.
        len: usize,
        /// Chunk size.
        chunk: usize,
    },
    /// Destroyed while transfers still pin pages: the memory was quarantined, not freed.
    #[error("{role} pool destroyed with pinned pages; its memory is quarantined")]
    DestroyedWhileBusy {
        /// The pool.
        role: PoolRole,
    },
}

/// A page-granular KV pool.
#[derive(Debug)]
pub struct KvPool {
    spec: PoolSpec,
    geometry: KvGeometry,
    buffer: Buffer,
    table: Mutex<PageTable>,
}

impl KvPool {
    /// Allocates the pool's buffer from `allocator` (owner `"<role> KV pool"`) and marks all pages free.
    ///
    /// # Errors
    /// [`PoolError::Invalid`] for a bad spec, [`PoolError::Memory`] when allocation fails.
    pub fn new(spec: PoolSpec, allocator: &Allocator) -> Result<Self, PoolError> {
        let bytes = spec.bytes()?;
        let buffer = allocator.allocate(bytes, format!("{} KV pool", spec.role))?;
        Ok(Self {
            geometry: spec.geometry(),
            table: Mutex::new(PageTable::new(spec.pages)),
            spec,
            buffer,
        })
    }

    fn table(&self) -> MutexGuard<'_, PageTable> {
        // Every page-table mutation validates before it changes anything, so a panic cannot leave it
        // half-updated; keep using it after poisoning.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The spec it was built from.
    pub fn spec(&self) -> &PoolSpec {
        &self.spec
    }
    /// Role.
    pub fn role(&self) -> PoolRole {
        self.spec.role
    }
    /// Geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
    /// The backing buffer (domain, owner, allocator, address).
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }
    /// Domain of the backing buffer.
    pub fn domain(&self) -> AllocatorDomain {
        self.buffer.domain()
    }

    /// Allocates `n` pages (owner set). All or nothing.
    ///
    /// # Errors
    /// [`PageError::Exhausted`].
    pub fn allocate(&self, n: usize) -> Result<Vec<PageId>, PoolError> {
        Ok(self.table().allocate(n)?)
    }
    /// Owner releases pages (recycled once unpinned). Validates all first.
    ///
    /// # Errors
    /// [`PageError::DoubleFree`], [`PageError::OutOfRange`].
    pub fn free(&self, pages: &[PageId]) -> Result<(), PoolError> {
        Ok(self.table().free(pages)?)
    }
    /// Adds an in-flight writer (transfer or load into the page).
    ///
    /// # Errors
    /// See [`PageTable::pin_writer`].
    pub fn pin_writer(&self, page: PageId) -> Result<(), PoolError> {
        Ok(self.table().pin_writer(page)?)
    }
    /// Removes an in-flight writer.
    ///
    /// # Errors
    /// See [`PageTable::unpin_writer`].
    pub fn unpin_writer(&self, page: PageId) -> Result<(), PoolError> {
        Ok(self.table().unpin_writer(page)?)
    }
    /// Adds an in-flight reader.
    ///
    /// # Errors
    /// See [`PageTable::pin_reader`].
    pub fn pin_reader(&self, page: PageId) -> Result<(), PoolError> {
        Ok(self.table().pin_reader(page)?)
    }
    /// Removes an in-flight reader.
    ///
    /// # Errors
    /// See [`PageTable::unpin_reader`].
    pub fn unpin_reader(&self, page: PageId) -> Result<(), PoolError> {
        Ok(self.table().unpin_reader(page)?)
    }
    /// Quarantines pages whose release is not proven safe (DESIGN contract 3).
    ///
    /// # Errors
    /// See [`PageTable::quarantine`].
    pub fn quarantine_pages(&self, pages: &[PageId]) -> Result<(), PoolError> {
        Ok(self.table().quarantine(pages)?)
    }
    /// Reference counts of a page.
    ///
    /// # Errors
    /// [`PageError::OutOfRange`].
    pub fn page_refs(&self, page: PageId) -> Result<PageRefs, PoolError> {
        Ok(self.table().refs(page)?)
    }
    /// Page counts by state.
    pub fn stats(&self) -> PageStats {
        self.table().stats()
    }

    /// Address range of the chunk of `page` on `layer` (any domain, no state check: descriptors for
    /// a transfer are built before the pages are pinned).
    ///
    /// # Errors
    /// [`PageError::OutOfRange`], [`PoolError::LayerOutOfRange`].
    pub fn chunk_region(&self, page: PageId, layer: u32) -> Result<PageRegion, PoolError> {
        if layer >= self.geometry.layers {
            return Err(PoolError::LayerOutOfRange {
                layer,
                layers: self.geometry.layers,
            });
        }
        let offset = self
            .geometry
            .chunk_offset(page.0, layer)
            .ok_or(PageError::OutOfRange {
                page,
                pages: self.geometry.pages,
            })? as usize;
        Ok(PageRegion {
            buffer: self.buffer.id(),
            addr: self.buffer.addr() + offset,
            offset,
            len: self.geometry.chunk_bytes() as usize,
        })
    }

    fn host_chunk(
        &self,
        page: PageId,
        layer: u32,
        offset: usize,
        len: usize,
    ) -> Result<*mut u8, PoolError> {
        let region = self.chunk_region(page, layer)?;
        if offset.checked_add(len).is_none_or(|end| end > region.len) {
            return Err(PoolError::OutOfChunk {
                offset,
                len,
                chunk: region.len,
            });
        }
        let refs = self.table().refs(page)?;
        if !(refs.owned || refs.writers > 0 || refs.readers > 0) {
            return Err(PageError::NotAllocated(page).into());
        }
        let base = self.buffer.host_ptr()?;
        // SAFETY: offset + region offset is within the buffer (checked above).
        Ok(unsafe { base.add(region.offset + offset) })
    }

    /// Copies `src` into the chunk of `page` on `layer` at `offset`. The page must be allocated.
    ///
    /// # Errors
    /// Range and state errors; [`MemoryError::NotHostMemory`] for device pools.
    pub fn write_chunk(
        &self,
        page: PageId,
        layer: u32,
        offset: usize,
        src: &[u8],
    ) -> Result<(), PoolError> {
        let dst = self.host_chunk(page, layer, offset, src.len())?;
        // SAFETY: `dst..dst+len` lies inside our live buffer; `src` is a separate Rust slice. Concurrent
        // writers to the same chunk are excluded by the page-pin protocol of the callers.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies the chunk bytes at `offset` into `dst`. The page must be allocated.
    ///
    /// # Errors
    /// As [`KvPool::write_chunk`].
    pub fn read_chunk(
        &self,
        page: PageId,
        layer: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), PoolError> {
        let src = self.host_chunk(page, layer, offset, dst.len())?;
        // SAFETY: as in `write_chunk`.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Borrowed byte view of the chunk of `page` on `layer` (zero copy, e.g. for `write_all`).
    ///
    /// # Safety
    /// The caller holds a reader pin or ownership of the page and no writer mutates the chunk for the
    /// lifetime of the slice.
    ///
    /// # Errors
    /// As [`KvPool::write_chunk`].
    pub unsafe fn chunk_slice(&self, page: PageId, layer: u32) -> Result<&[u8], PoolError> {
        let len = self.geometry.chunk_bytes() as usize;
        let p = self.host_chunk(page, layer, 0, len)?;
        // SAFETY: in-bounds (checked); aliasing per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// Mutable byte view of the chunk of `page` on `layer` (zero copy, e.g. for `read_exact`).
    ///
    /// # Safety
    /// The caller holds the only writer pin on the page and nothing else reads or writes the chunk for
    /// the lifetime of the slice.
    ///
    /// # Errors
    /// As [`KvPool::write_chunk`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn chunk_slice_mut(&self, page: PageId, layer: u32) -> Result<&mut [u8], PoolError> {
        let len = self.geometry.chunk_bytes() as usize;
        let p = self.host_chunk(page, layer, 0, len)?;
        // SAFETY: in-bounds (checked); exclusivity per the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    /// Frees the buffer with the allocator that made it. If any page is still pinned by a writer or
    /// reader, the memory could still be touched by a transfer, so it is quarantined instead and
    /// [`PoolError::DestroyedWhileBusy`] returned.
    ///
    /// # Errors
    /// [`PoolError::DestroyedWhileBusy`], or the allocator's free error.
    pub fn destroy(self) -> Result<(), PoolError> {
        let busy = self.table().has_pins();
        let role = self.spec.role;
        if busy {
            self.buffer.quarantine();
            return Err(PoolError::DestroyedWhileBusy { role });
        }
        Ok(self.buffer.free()?)
    }

    /// Gives the memory up without freeing it (a registration could not be undone; R-REG-3).
    pub fn quarantine(self) {
        self.buffer.quarantine();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::mmap::MmapBackend;
    use crate::model::Attention;

    pub(crate) fn small_spec(role: PoolRole, pages: u32, layout: PoolLayout) -> PoolSpec {
        PoolSpec {
            role,
            model: ModelIdentity {
                name: "tiny".into(),
                layers: 2,
                attention: Attention::Gqa {
                    kv_heads: 1,
                    head_dim: 8,
                },
                dtype_bytes: 2,
                row_extra_bytes: 0,
            },
            page_tokens: 16,
            pages,
            layout,
        }
    }

    #[test]
    fn chunks_are_distinct_and_round_trip() {
        let a = Allocator::new("m", MmapBackend::new());
        for layout in [PoolLayout::LayerFirst, PoolLayout::PageFirst] {
            let pool = KvPool::new(small_spec(PoolRole::Target, 4, layout), &a).unwrap();
            let pages = pool.allocate(4).unwrap();
            for &p in &pages {
                for layer in 0..2 {
                    let tag = [p.0 as u8 * 2 + layer as u8; 512];
                    pool.write_chunk(p, layer, 0, &tag).unwrap();
                }
            }
            for &p in &pages {
                for layer in 0..2 {
                    let mut got = [0u8; 512];
                    pool.read_chunk(p, layer, 0, &mut got).unwrap();
                    assert!(got.iter().all(|&b| b == p.0 as u8 * 2 + layer as u8));
                }
            }
            assert!(matches!(
                pool.write_chunk(pages[0], 0, 500, &[0; 13]),
                Err(PoolError::OutOfChunk { .. })
            ));
            assert!(matches!(
                pool.chunk_region(pages[0], 2),
                Err(PoolError::LayerOutOfRange { .. })
            ));
            pool.free(&pages).unwrap();
            assert!(matches!(
                pool.write_chunk(pages[0], 0, 0, &[1]),
                Err(PoolError::Page(PageError::NotAllocated(_)))
            ));
            pool.destroy().unwrap();
        }
        assert_eq!(a.stats().live_buffers, 0);
    }

    #[test]
    fn destroy_with_a_pinned_page_quarantines() {
        let a = Allocator::new("m", MmapBackend::new());
        let pool = KvPool::new(small_spec(PoolRole::Draft, 2, PoolLayout::PageFirst), &a).unwrap();
        let p = pool.allocate(1).unwrap()[0];
        pool.pin_writer(p).unwrap();
        assert!(matches!(
            pool.destroy(),
            Err(PoolError::DestroyedWhileBusy { .. })
        ));
        let s = a.stats();
        assert_eq!((s.live_buffers, s.quarantined_buffers, s.frees), (0, 1, 0));
    }
}
