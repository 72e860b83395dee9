//! Per-rank KV storage under LayerSplit (DESIGN contract 6; seed 004 "每张 GPU ... 仅持有部分层的
//! KV Cache").
//!
//! A [`RankKvStore`] is a [`KvPool`] whose geometry has only the layers this rank stores: its buffer
//! is `pool_pages × stored_layers × chunk_bytes`, so a rank of a LayerSplit group allocates
//! `owned / layers` of what a replicated rank allocates. Global layer ids are mapped to the pool's
//! local layer index; touching a layer the rank does not store is a typed error. The page table is the
//! pool's: every rank of the group runs the same allocation sequence, so a request gets the same page
//! ids on every rank (checked by the consumers against the broadcast's page list).

use crate::memory::Allocator;
use crate::memory::pool::{KvPool, PageId, PoolLayout, PoolRole, PoolSpec};
use crate::model::ModelIdentity;

use super::error::LayerSplitError;

/// The KV one CP rank stores.
pub struct RankKvStore {
    rank: u32,
    /// `local[layer] = Some(index in the pool)` for stored layers.
    local: Vec<Option<u32>>,
    owners_hint: Vec<u32>,
    pool: KvPool,
}

impl RankKvStore {
    /// A pool of `pool_pages` pages of `page_tokens` tokens holding `stored` layers of `model` (global
    /// layer ids, any order, no duplicates), layer-first so one layer's pages are contiguous.
    /// `owners[layer]` names the owner of each layer, for error messages.
    ///
    /// # Errors
    /// [`LayerSplitError::LayerOutOfRange`] for a stored layer outside the model,
    /// [`LayerSplitError::InvalidOwnerMap`] for an empty or duplicated set, pool errors.
    pub fn new(
        rank: u32,
        model: &ModelIdentity,
        stored: &[u32],
        owners: &[u32],
        page_tokens: u32,
        pool_pages: u32,
        allocator: &Allocator,
    ) -> Result<Self, LayerSplitError> {
        let mut local = vec![None; model.layers as usize];
        for (i, layer) in stored.iter().enumerate() {
            let slot = local
                .get_mut(*layer as usize)
                .ok_or(LayerSplitError::LayerOutOfRange {
                    layer: *layer,
                    layers: model.layers,
                })?;
            if slot.replace(i as u32).is_some() {
                return Err(LayerSplitError::InvalidOwnerMap(format!(
                    "layer {layer} stored twice"
                )));
            }
        }
        if stored.is_empty() {
            return Err(LayerSplitError::InvalidOwnerMap(format!(
                "rank {rank} stores no layer"
            )));
        }
        let local_model = ModelIdentity {
            layers: stored.len() as u32,
            ..model.clone()
        };
        let spec = PoolSpec {
            role: PoolRole::Target,
            model: local_model,
            page_tokens,
            pages: pool_pages,
            layout: PoolLayout::LayerFirst,
        };
        Ok(Self {
            rank,
            local,
            owners_hint: owners.to_vec(),
            pool: KvPool::new(spec, allocator)?,
        })
    }

    /// Bytes of the pool buffer: `pool_pages × stored_layers × chunk_bytes` (before allocator
    /// rounding).
    pub fn stored_bytes(&self) -> u64 {
        self.pool.geometry().total_bytes().unwrap_or(u64::MAX)
    }

    /// Layers stored.
    pub fn stored_layers(&self) -> u32 {
        self.pool.geometry().layers
    }

    /// Bytes of one page-layer chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.pool.geometry().chunk_bytes() as usize
    }

    /// Pages in the pool.
    pub fn pool_pages(&self) -> u32 {
        self.pool.geometry().pages
    }

    /// Whether this rank stores `layer`.
    pub fn stores(&self, layer: u32) -> bool {
        self.local.get(layer as usize).is_some_and(Option::is_some)
    }

    /// Allocates `n` pages for a request.
    ///
    /// # Errors
    /// Pool exhaustion.
    pub fn allocate(&self, n: usize) -> Result<Vec<PageId>, LayerSplitError> {
        Ok(self.pool.allocate(n)?)
    }

    /// Frees a request's pages.
    ///
    /// # Errors
    /// Pool state errors.
    pub fn free(&self, pages: &[PageId]) -> Result<(), LayerSplitError> {
        Ok(self.pool.free(pages)?)
    }

    /// Writes the whole chunk of `page` on global `layer`.
    ///
    /// # Errors
    /// [`LayerSplitError::NotOwned`], pool range/state errors.
    pub fn write_chunk(&self, page: PageId, layer: u32, src: &[u8]) -> Result<(), LayerSplitError> {
        let local = self.local_layer(layer)?;
        Ok(self.pool.write_chunk(page, local, 0, src)?)
    }

    /// Reads the whole chunk of `page` on global `layer` into `dst`.
    ///
    /// # Errors
    /// As [`RankKvStore::write_chunk`].
    pub fn read_chunk(
        &self,
        page: PageId,
        layer: u32,
        dst: &mut [u8],
    ) -> Result<(), LayerSplitError> {
        let local = self.local_layer(layer)?;
        Ok(self.pool.read_chunk(page, local, 0, dst)?)
    }

    fn local_layer(&self, layer: u32) -> Result<u32, LayerSplitError> {
        match self.local.get(layer as usize) {
            Some(Some(l)) => Ok(*l),
            Some(None) => Err(LayerSplitError::NotOwned {
                rank: self.rank,
                layer,
                owner: self
                    .owners_hint
                    .get(layer as usize)
                    .copied()
                    .unwrap_or(u32::MAX),
            }),
            None => Err(LayerSplitError::LayerOutOfRange {
                layer,
                layers: self.local.len() as u32,
            }),
        }
    }

    /// Frees the pool's buffer with the allocator that made it.
    ///
    /// # Errors
    /// Pool destroy errors (pages still pinned).
    pub fn destroy(self) -> Result<(), LayerSplitError> {
        Ok(self.pool.destroy()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::mmap::MmapBackend;
    use crate::model::Attention;

    #[test]
    fn stores_only_owned_layers_and_refuses_the_others() {
        let model = ModelIdentity {
            name: "t".into(),
            layers: 5,
            attention: Attention::Gqa {
                kv_heads: 1,
                head_dim: 8,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        };
        let a = Allocator::new("ls", MmapBackend::new());
        let owners = [0, 0, 0, 1, 1];
        let s = RankKvStore::new(1, &model, &[3, 4], &owners, 4, 8, &a).unwrap();
        // 8 pages × 2 layers × (4 tokens × 32 B).
        assert_eq!(s.stored_bytes(), 8 * 2 * 128);
        let pages = s.allocate(2).unwrap();
        let chunk = vec![9u8; s.chunk_bytes()];
        s.write_chunk(pages[1], 4, &chunk).unwrap();
        let mut back = vec![0u8; s.chunk_bytes()];
        s.read_chunk(pages[1], 4, &mut back).unwrap();
        assert_eq!(back, chunk);
        assert!(matches!(
            s.write_chunk(pages[0], 2, &chunk),
            Err(LayerSplitError::NotOwned {
                rank: 1,
                layer: 2,
                owner: 0
            })
        ));
        assert!(matches!(
            s.read_chunk(pages[0], 5, &mut back),
            Err(LayerSplitError::LayerOutOfRange { layer: 5, .. })
        ));
        assert!(RankKvStore::new(1, &model, &[3, 3], &owners, 4, 8, &a).is_err());
        assert!(RankKvStore::new(1, &model, &[], &owners, 4, 8, &a).is_err());
        s.free(&pages).unwrap();
        s.destroy().unwrap();
    }
}
