//! Zero-copy write sources for RDMA: a KV pool chunk as [`Bytes`], reader-pinned while any view of
//! it lives (pure memory logic; always compiled).
//!
//! RDMA reads a write's source straight from registered memory, so a [`WriteOp`]'s bytes must be a
//! view into a registered pool (the planner refuses anything else: `NotRegistered`), not a copy on
//! the heap. [`pinned_chunk`] pins the page as a reader and returns a view whose owner unpins it
//! when the last clone or slice is dropped. The RDMA ledger holds a slice of it per work request
//! until the request is retired, so the page stays allocated until the send is terminal even if
//! its owner frees it earlier (DESIGN contract 3: prefill source pages are held until the send is
//! terminal; the page table recycles a freed page only when its last pin goes).
//!
//! This module holds the transport's one `unsafe` block outside `verbs`: the byte view itself.
//!
//! [`WriteOp`]: crate::transfer::WriteOp

use std::sync::Arc;

use bytes::Bytes;

use crate::memory::pool::{KvPool, PageId, PoolError};

/// Owner of a pinned chunk view: unpins the page on drop.
struct PinnedChunk {
    pool: Arc<KvPool>,
    page: PageId,
    /// Address of the chunk's first byte (kept as an integer: the view is `Send`).
    addr: usize,
    len: usize,
}

impl AsRef<[u8]> for PinnedChunk {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `[addr, addr + len)` is a chunk of `pool`'s buffer (bounds checked by
        // `chunk_slice` when the view was made); the `Arc` keeps the buffer alive and the reader pin
        // keeps the page from being recycled while this owner lives. The caller of `pinned_chunk`
        // promises no writer mutates the chunk meanwhile (a computed prefill page is read-only).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl Drop for PinnedChunk {
    fn drop(&mut self) {
        if let Err(e) = self.pool.unpin_reader(self.page) {
            tracing::error!(page = self.page.0, error = %e, "cannot unpin an RDMA source page");
        }
    }
}

/// The chunk of `page` on `layer` as `Bytes`, the page reader-pinned until every view is dropped.
///
/// # Safety
/// The page must be allocated (owned or pinned) and its KV computed: nothing may write the chunk
/// while any view of it lives. The pool's reader pin keeps the page from being freed and reused,
/// but it does not stop its owner writing — a write during the view's life is a data race.
///
/// # Errors
/// [`PoolError`] when the page is free, quarantined or out of range, the layer out of range, or
/// the pool not host-addressable; nothing stays pinned.
pub unsafe fn pinned_chunk(
    pool: &Arc<KvPool>,
    page: PageId,
    layer: u32,
) -> Result<Bytes, PoolError> {
    pool.pin_reader(page)?;
    // SAFETY: the page is reader-pinned (above) and, per this function's safety contract, no
    // longer written; the slice is only used to read its address and length.
    let view = unsafe { pool.chunk_slice(page, layer) }.map(|s| (s.as_ptr() as usize, s.len()));
    let (addr, len) = match view {
        Ok(v) => v,
        Err(e) => {
            let _ = pool.unpin_reader(page);
            return Err(e);
        }
    };
    Ok(Bytes::from_owner(PinnedChunk {
        pool: pool.clone(),
        page,
        addr,
        len,
    }))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::memory::Allocator;
    use crate::memory::mmap::MmapBackend;
    use crate::memory::pool::{PoolLayout, PoolRole, PoolSpec};
    use crate::model::{Attention, ModelIdentity};

    /// A host pool of `pages` pages, 2 layers, 64 B chunks.
    pub(in crate::transfer::rdma) fn pool(pages: u32) -> Arc<KvPool> {
        let spec = PoolSpec {
            role: PoolRole::Target,
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
            page_tokens: 4,
            pages,
            layout: PoolLayout::PageFirst,
        };
        let a = Allocator::new("t", MmapBackend::new());
        Arc::new(KvPool::new(spec, &a).unwrap())
    }

    #[test]
    fn the_view_is_the_chunk_in_place_and_holds_the_page_until_dropped() {
        let p = pool(1);
        let page = p.allocate(1).unwrap()[0];
        let at = p.chunk_region(page, 1).unwrap();
        let data: Vec<u8> = (0..at.len).map(|i| i as u8).collect();
        p.write_chunk(page, 1, 0, &data).unwrap();
        // SAFETY: the test wrote the page before and never writes it again.
        let view = unsafe { pinned_chunk(&p, page, 1) }.unwrap();
        assert_eq!(&view[..], &data[..]);
        // Zero copy: the bytes are the pool's (so a registration of the pool covers them).
        let base = p.buffer().addr() as u64;
        assert_eq!(view.as_ptr() as u64, base + at.offset as u64);
        assert_eq!(p.page_refs(page).unwrap().readers, 1);
        // The owner frees the page while the send holds a slice of it: it is not recycled.
        let piece = view.slice(4..8);
        drop(view);
        p.free(&[page]).unwrap();
        assert!(
            p.allocate(1).is_err(),
            "a pinned page is not handed out again"
        );
        drop(piece);
        assert_eq!(
            p.allocate(1).unwrap(),
            vec![page],
            "the last view unpinned it"
        );
    }

    #[test]
    fn a_free_page_or_bad_layer_pins_nothing() {
        let p = pool(2);
        // SAFETY: refused before any view exists.
        assert!(
            unsafe { pinned_chunk(&p, PageId(0), 0) }.is_err(),
            "free page"
        );
        let page = p.allocate(1).unwrap()[0];
        // SAFETY: refused before any view exists.
        assert!(
            unsafe { pinned_chunk(&p, page, 9) }.is_err(),
            "layer out of range"
        );
        assert_eq!(p.page_refs(page).unwrap().readers, 0);
    }
}
