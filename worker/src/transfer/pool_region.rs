//! A [`KvPool`] as a transfer receive region: region offsets are the pool buffer's byte offsets, so a
//! peer addresses a `(page, layer)` chunk exactly where [`KvPool::chunk_region`] says it lives (either
//! layout). Every piece is written through [`KvPool::write_chunk`], which refuses pages that are not
//! allocated (or pinned): a write can never land in a free page.
//!
//! Writes are copies. The receive path reads a payload into a scratch buffer first, then copies it
//! chunk by chunk; two writers never target the same chunk because the TCP receiver only admits
//! writes of the room that currently owns the pages (the generation fence, DESIGN contract 3).

use std::io::Read;
use std::sync::Arc;

use crate::memory::pool::{KvPool, PageId, PoolLayout};
use crate::memory::{AllocatorDomain, DomainMismatch, require_domain};

use super::region::{ReceiveRegion, RegionError, check_bounds};

/// A KV pool seen as a receive region.
pub struct PoolRegion {
    pool: Arc<KvPool>,
}

/// Domains the TCP receiver can write: CPU-addressable host memory (DESIGN contract 1).
pub const TCP_ACCEPTED_DOMAINS: [AllocatorDomain; 3] = [
    AllocatorDomain::SharedMemory,
    AllocatorDomain::Mmap,
    AllocatorDomain::Pinned,
];

impl PoolRegion {
    /// Wraps `pool` for the TCP receiver, refusing (before any side effect) a pool outside the host
    /// domains the receiver can write into.
    ///
    /// # Errors
    /// [`DomainMismatch`] for a device pool.
    pub fn for_tcp(pool: Arc<KvPool>) -> Result<PoolRegion, DomainMismatch> {
        require_domain(
            pool.buffer(),
            "TCP transport receiver",
            &TCP_ACCEPTED_DOMAINS,
        )?;
        Ok(PoolRegion { pool })
    }

    /// Splits `[offset, offset + len)` into `(page, layer, offset in chunk, bytes)` pieces.
    fn pieces(&self, offset: u64, len: u64) -> Vec<(PageId, u32, usize, usize)> {
        let g = self.pool.geometry();
        let chunk = g.chunk_bytes();
        let mut out = Vec::new();
        let (mut pos, end) = (offset, offset + len);
        while pos < end && chunk > 0 {
            let index = pos / chunk;
            let within = pos % chunk;
            let n = (chunk - within).min(end - pos);
            let (page, layer) = match g.layout {
                PoolLayout::PageFirst => (index / u64::from(g.layers), index % u64::from(g.layers)),
                PoolLayout::LayerFirst => (index % u64::from(g.pages), index / u64::from(g.pages)),
            };
            out.push((
                PageId(page as u32),
                layer as u32,
                within as usize,
                n as usize,
            ));
            pos += n;
        }
        out
    }
}

impl ReceiveRegion for PoolRegion {
    fn len(&self) -> u64 {
        self.pool.geometry().total_bytes().unwrap_or(0)
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), RegionError> {
        check_bounds(offset, src.len() as u64, self.len())?;
        let pieces = self.pieces(offset, src.len() as u64);
        // Check every page first so that a refused write changes nothing.
        for (page, ..) in &pieces {
            let refs = self
                .pool
                .page_refs(*page)
                .map_err(|e| RegionError::Refused(e.to_string()))?;
            if !(refs.owned || refs.writers > 0) {
                return Err(RegionError::Refused(format!(
                    "page {} is not allocated",
                    page.0
                )));
            }
        }
        let mut done = 0usize;
        for (page, layer, within, n) in pieces {
            self.pool
                .write_chunk(page, layer, within, &src[done..done + n])
                .map_err(|e| RegionError::Refused(e.to_string()))?;
            done += n;
        }
        Ok(())
    }

    fn write_from(&self, offset: u64, len: u64, src: &mut dyn Read) -> Result<(), RegionError> {
        check_bounds(offset, len, self.len())?;
        let mut scratch = vec![0u8; len as usize];
        src.read_exact(&mut scratch)
            .map_err(|source| RegionError::Source { landed: 0, source })?;
        self.write(offset, &scratch)
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), RegionError> {
        check_bounds(offset, dst.len() as u64, self.len())?;
        let mut done = 0usize;
        for (page, layer, within, n) in self.pieces(offset, dst.len() as u64) {
            self.pool
                .read_chunk(page, layer, within, &mut dst[done..done + n])
                .map_err(|e| RegionError::Refused(e.to_string()))?;
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Allocator;
    use crate::memory::mmap::MmapBackend;
    use crate::memory::pool::{PoolRole, PoolSpec};
    use crate::model::{Attention, ModelIdentity};

    fn pool(layout: PoolLayout) -> Arc<KvPool> {
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
            pages: 4,
            layout,
        };
        let a = Allocator::new("t", MmapBackend::new());
        Arc::new(KvPool::new(spec, &a).unwrap())
    }

    #[test]
    fn offsets_map_to_the_pools_chunks_and_free_pages_are_refused() {
        for layout in [PoolLayout::PageFirst, PoolLayout::LayerFirst] {
            let p = pool(layout);
            let region = PoolRegion::for_tcp(p.clone()).unwrap();
            let pages = p.allocate(1).unwrap();
            let page = pages[0];
            let at = p.chunk_region(page, 1).unwrap();
            let data = vec![9u8; at.len];
            region.write(at.offset as u64, &data).unwrap();
            let mut back = vec![0u8; at.len];
            p.read_chunk(page, 1, 0, &mut back).unwrap();
            assert_eq!(back, data, "{layout:?}");
            // Any other page is free: refused whole, nothing written.
            let other = PageId((page.0 + 1) % 4);
            let free_at = p.chunk_region(other, 0).unwrap();
            assert!(
                matches!(
                    region.write(free_at.offset as u64, &data),
                    Err(RegionError::Refused(_))
                ),
                "{layout:?}"
            );
            assert!(matches!(
                region.write(region.len(), &[1]),
                Err(RegionError::OutOfBounds { .. })
            ));
        }
    }
}
