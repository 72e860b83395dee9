//! KV pool geometry: pure arithmetic over a model identity (reference/dataplane.md R-MEM-4, TC-MEM-03).
//!
//! The unit of storage is a *page-layer chunk*: `page_tokens` consecutive tokens of one page on one
//! layer, `page_tokens × bytes_per_token_layer` bytes, contiguous in every layout. Layouts differ only
//! in how chunks are ordered:
//!
//! - `LayerFirst`: `[layer][page]` — offset `(layer × pages + page) × chunk`; one layer of all pages is
//!   contiguous (what a layer-by-layer load or LayerSplit broadcast wants);
//! - `PageFirst`: `[page][layer]` — offset `(page × layers + layer) × chunk`; one page of all layers is
//!   contiguous (what a page transfer or an L3 object wants).

use crate::model::ModelIdentity;

/// Order of page-layer chunks in a pool buffer; named in the cache-tier config, so it lives in
/// `tandem-interfaces` (worker/interfaces/README.md §2).
pub use tandem_interfaces::memory::PoolLayout;

/// The shape of one pool: how many pages, of how many tokens, over how many layers, in which layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    /// Bytes of one token on one layer (from [`ModelIdentity::bytes_per_token_layer`]).
    pub bytes_per_token_layer: u64,
    /// Layers with KV.
    pub layers: u32,
    /// Tokens per page (DESIGN §2 `pageTokens`, default 512).
    pub page_tokens: u32,
    /// Pages in the pool.
    pub pages: u32,
    /// Chunk order.
    pub layout: PoolLayout,
}

impl KvGeometry {
    /// Geometry for `pages` pages of `page_tokens` tokens of `model`.
    pub fn new(model: &ModelIdentity, page_tokens: u32, pages: u32, layout: PoolLayout) -> Self {
        Self {
            bytes_per_token_layer: model.bytes_per_token_layer(),
            layers: model.layers,
            page_tokens,
            pages,
            layout,
        }
    }

    /// Bytes of one page on one layer: `page_tokens × bytes_per_token_layer`.
    pub fn chunk_bytes(&self) -> u64 {
        u64::from(self.page_tokens) * self.bytes_per_token_layer
    }

    /// Bytes of one page over all layers.
    pub fn page_bytes(&self) -> u64 {
        self.chunk_bytes() * u64::from(self.layers)
    }

    /// Bytes of the whole pool: `pages × layers × chunk_bytes`. `None` on overflow.
    pub fn total_bytes(&self) -> Option<u64> {
        self.chunk_bytes()
            .checked_mul(u64::from(self.layers))?
            .checked_mul(u64::from(self.pages))
    }

    /// Byte offset of the chunk of `page` on `layer` from the pool's base, or `None` if either index is
    /// out of range.
    pub fn chunk_offset(&self, page: u32, layer: u32) -> Option<u64> {
        if page >= self.pages || layer >= self.layers {
            return None;
        }
        let index = match self.layout {
            PoolLayout::LayerFirst => u64::from(layer) * u64::from(self.pages) + u64::from(page),
            PoolLayout::PageFirst => u64::from(page) * u64::from(self.layers) + u64::from(layer),
        };
        Some(index * self.chunk_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Attention;

    fn model() -> ModelIdentity {
        ModelIdentity {
            name: "t".into(),
            layers: 3,
            attention: Attention::Gqa {
                kv_heads: 2,
                head_dim: 4,
            },
            dtype_bytes: 2,
            row_extra_bytes: 4,
        }
    }

    #[test]
    fn offsets_follow_the_reference_formula_in_both_layouts() {
        // TC-MEM-03: row = 2·2·4·2 + 4 scale bytes = 36 B; chunk = 8 tokens × 36 = 288 B.
        for layout in [PoolLayout::LayerFirst, PoolLayout::PageFirst] {
            let g = KvGeometry::new(&model(), 8, 5, layout);
            assert_eq!(g.chunk_bytes(), 288);
            assert_eq!(g.total_bytes(), Some(288 * 3 * 5));
            let mut seen = std::collections::BTreeSet::new();
            for page in 0..5 {
                for layer in 0..3 {
                    let off = g.chunk_offset(page, layer).unwrap();
                    let expect = match layout {
                        PoolLayout::LayerFirst => (layer * 5 + page) as u64 * 288,
                        PoolLayout::PageFirst => (page * 3 + layer) as u64 * 288,
                    };
                    assert_eq!(off, expect);
                    assert!(seen.insert(off), "chunks never overlap");
                }
            }
            assert_eq!(g.chunk_offset(5, 0), None);
            assert_eq!(g.chunk_offset(0, 3), None);
        }
    }
}
