//! Allocator domains (DESIGN contract 1, §2 `CacheTier.allocator`).

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

impl std::fmt::Display for AllocatorDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
