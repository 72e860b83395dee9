//! The host-memory policy names the configs carry (worker/interfaces/README.md §2; DESIGN §2
//! `CacheTier`, contracts 1 and 2): the allocator domain of every host pool, where the store client
//! runs, what a failed L3 registration does, and the chunk order of a pool. The worker implements
//! them (`memory`, `store_client`, `registration`, `pool`); this crate only names them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a buffer's memory comes from, and therefore who can map or register it.
///
/// The names of the host domains are those of the `CacheTier.allocator` field (`SharedMemory`, `Mmap`,
/// `Pinned`); `Device` is GPU memory (feature `cuda`). Standalone store clients accept only
/// `SharedMemory`: a pointer from any other domain has no meaning in the store-client process (seed 000).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AllocatorDomain {
    /// Ranges of shared-memory segments (memfd or POSIX shm) created and owned by a store client.
    SharedMemory,
    /// Private anonymous page-aligned mmap: usable only inside this process.
    Mmap,
    /// Private anonymous mmap locked into RAM (mlock): DMA-friendly, still process-private.
    Pinned,
    /// GPU device memory (CUDA); not CPU-addressable.
    Device,
}

impl AllocatorDomain {
    /// Whether the CPU can read and write this memory through a pointer.
    pub fn is_host(self) -> bool {
        !matches!(self, AllocatorDomain::Device)
    }

    /// The stable name used in configs, logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatorDomain::SharedMemory => "SharedMemory",
            AllocatorDomain::Mmap => "Mmap",
            AllocatorDomain::Pinned => "Pinned",
            AllocatorDomain::Device => "Device",
        }
    }
}

impl fmt::Display for AllocatorDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the store client runs (DESIGN §2 `CacheTier.clientMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ClientMode {
    /// In the worker process.
    Embedded,
    /// In a separate `store-client` process that owns the segments.
    Standalone,
}

impl fmt::Display for ClientMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClientMode::Embedded => "Embedded",
            ClientMode::Standalone => "Standalone",
        })
    }
}

/// What to do when registering a pool fails (DESIGN §2/§3 contract 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailurePolicy {
    /// Fail startup with an error naming allocator, client mode, buffer size and phase. The default
    /// when L3 was asked for: serving silently with other semantics is worse than not serving.
    #[default]
    FailClosed,
    /// Continue without L3 for this pool: a warning log, `tandem_l3_fallback_total{role}` and a reason
    /// in the health report.
    FallbackToL2,
}

/// Order of page-layer chunks in a pool buffer (a chunk is `page_tokens` tokens of one page on
/// one layer, contiguous in every layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub enum PoolLayout {
    /// `[layer][page]`: one layer of all pages is contiguous (what a layer-by-layer load or a
    /// LayerSplit broadcast wants).
    #[default]
    LayerFirst,
    /// `[page][layer]`: one page of all layers is contiguous (what a page transfer or an L3
    /// object wants).
    PageFirst,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_on_the_wire_are_the_crd_names() {
        for (d, s) in [
            (AllocatorDomain::SharedMemory, "\"SharedMemory\""),
            (AllocatorDomain::Mmap, "\"Mmap\""),
            (AllocatorDomain::Pinned, "\"Pinned\""),
        ] {
            assert_eq!(serde_json::to_string(&d).unwrap(), s);
            assert_eq!(format!("\"{d}\""), s);
        }
        assert!(!AllocatorDomain::Device.is_host());
        assert_eq!(
            serde_json::to_string(&ClientMode::Standalone).unwrap(),
            "\"Standalone\""
        );
        assert_eq!(
            serde_json::to_string(&FailurePolicy::FallbackToL2).unwrap(),
            "\"fallbackToL2\""
        );
        assert_eq!(
            serde_json::to_string(&PoolLayout::default()).unwrap(),
            "\"layerFirst\""
        );
    }
}
