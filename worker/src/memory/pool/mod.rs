//! Page-granular KV pools (reference/dataplane.md R-MEM-4, R-MEM-5; DESIGN §2 target and draft pools).
//!
//! - [`geometry`]: pure arithmetic: bytes of a page on a layer, layouts layer-first and page-first,
//!   byte offsets;
//! - [`pages`]: the page table: free list and per-page reference counts (owner, in-flight writers,
//!   readers), with quarantine for pages that may still be written;
//! - [`kv_pool`]: a pool = one buffer from an allocator + geometry + page table.

pub mod geometry;
pub mod kv_pool;
pub mod pages;

pub use geometry::{KvGeometry, PoolLayout};
pub use kv_pool::{KvPool, PageRegion, PoolError, PoolSpec};
pub use pages::{PageError, PageId, PageRefs, PageStats, PageTable};

use serde::{Deserialize, Serialize};

/// What a pool holds KV for. One worker has at most one committed pool per role and tier
/// (DESIGN §2: the draft model's pools are sized and allocated in the same domain as the target's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PoolRole {
    /// The served model's KV.
    Target,
    /// The speculative-decoding draft model's KV (seed 000: the pool that broke).
    Draft,
    /// A sidecar pool such as a sparse-attention indexer cache (seed 004).
    Indexer,
}

impl PoolRole {
    /// Stable lowercase name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolRole::Target => "target",
            PoolRole::Draft => "draft",
            PoolRole::Indexer => "indexer",
        }
    }
}

impl std::fmt::Display for PoolRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
