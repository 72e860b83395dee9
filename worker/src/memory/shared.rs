//! The `SharedMemory` domain: buffers carved out of store-client segments.
//!
//! The store client (embedded or standalone) owns the segments; this backend hands out page-aligned
//! ranges of them with a first-fit free list and coalescing. Every buffer therefore lies inside a
//! segment the store client knows, which is the precondition for registering it in standalone mode
//! (seed 000; reference/dataplane.md §1.3: "standalone mode can only register buffers that the Mooncake
//! allocator produced"). A host pool that must be registrable asks the tier for this allocator instead
//! of building its own (DESIGN §2: the draft pool uses the same allocator domain as the target).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::allocator::{AllocatorBackend, MemoryError, RawRegion, SegmentPlacement};
use super::domain::AllocatorDomain;
use super::segment::Segment;
use super::{align_up, host_page_size};

#[derive(Debug)]
struct Arena {
    segment: Arc<Segment>,
    /// Free ranges: offset → length, non-overlapping, coalesced.
    free: BTreeMap<usize, usize>,
}

/// The set of segments a store client has mapped into this process, shared between the client (which
/// adds segments and checks placement) and the allocator backend (which carves buffers).
#[derive(Debug, Default)]
pub struct SegmentSet {
    arenas: Mutex<Vec<Arena>>,
}

impl SegmentSet {
    /// An empty set.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arena>> {
        // A panic while holding this lock leaves the free lists consistent (every mutation is a
        // single insert/remove), so a poisoned lock is safe to keep using.
        self.arenas.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a mapped segment; its whole range becomes free.
    pub fn add(&self, segment: Arc<Segment>) {
        let mut free = BTreeMap::new();
        free.insert(0, segment.len());
        self.lock().push(Arena { segment, free });
    }

    /// The segment containing `[addr, addr+len)` and the offset in it, if any.
    pub fn locate(&self, addr: usize, len: usize) -> Option<(u64, usize)> {
        self.lock().iter().find_map(|a| {
            a.segment
                .offset_of(addr, len)
                .map(|off| (a.segment.info().id, off))
        })
    }

    /// Total bytes of all segments.
    pub fn capacity(&self) -> usize {
        self.lock().iter().map(|a| a.segment.len()).sum()
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.lock().len()
    }

    /// A duplicate of the fd of segment `id`, to pass to another process (the engine API passes pool
    /// fds by SCM_RIGHTS); `None` when no segment of this set has that id.
    pub fn dup_fd(&self, id: u64) -> Option<std::io::Result<std::os::fd::OwnedFd>> {
        self.lock()
            .iter()
            .find(|a| a.segment.info().id == id)
            .map(|a| a.segment.fd().try_clone_to_owned())
    }

    /// Teardown: drops (unmaps, and unlinks if POSIX shm) every segment with no live buffer in it.
    /// A segment that still holds live or quarantined buffers only loses its name — so nothing of ours
    /// stays in /dev/shm — and remains mapped until those buffers go or the process exits.
    /// Idempotent. Returns the number of segments kept mapped.
    pub fn release_idle(&self) -> usize {
        let mut arenas = self.lock();
        let mut kept = Vec::new();
        for arena in arenas.drain(..) {
            let idle = arena.free.get(&0) == Some(&arena.segment.len());
            if idle {
                drop(arena);
            } else {
                if let Err(e) = arena.segment.unlink() {
                    tracing::error!(segment = %arena.segment.info().name, error = %e, "unlink failed");
                }
                kept.push(arena);
            }
        }
        let n = kept.len();
        *arenas = kept;
        n
    }

    /// Test-only negative control: make every segment forget to unlink its name. Feature
    /// `negative-controls`.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn leak_names_for_test(&self) {
        for a in self.lock().iter() {
            a.segment.leak_name_for_test();
        }
    }

    fn carve(&self, len: usize) -> Result<RawRegion, MemoryError> {
        let mut arenas = self.lock();
        let mut largest = 0;
        for arena in arenas.iter_mut() {
            let hit = arena
                .free
                .iter()
                .find(|&(_, &l)| l >= len)
                .map(|(&o, &l)| (o, l));
            if let Some((off, free_len)) = hit {
                arena.free.remove(&off);
                if free_len > len {
                    arena.free.insert(off + len, free_len - len);
                }
                return Ok(RawRegion {
                    addr: arena.segment.base() + off,
                    len,
                });
            }
            largest = largest.max(arena.free.values().copied().max().unwrap_or(0));
        }
        Err(MemoryError::SegmentFull {
            requested: len,
            largest_free: largest,
        })
    }

    fn give_back(&self, region: RawRegion) -> Result<(), MemoryError> {
        let mut arenas = self.lock();
        let Some(arena) = arenas
            .iter_mut()
            .find(|a| a.segment.offset_of(region.addr, region.len).is_some())
        else {
            return Err(MemoryError::Os {
                call: "segment free",
                bytes: region.len,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "range lies in no segment of this set",
                ),
            });
        };
        let mut off = region.addr - arena.segment.base();
        let mut len = region.len;
        if let Some((&prev_off, &prev_len)) = arena.free.range(..off).next_back()
            && prev_off + prev_len == off
        {
            arena.free.remove(&prev_off);
            off = prev_off;
            len += prev_len;
        }
        if let Some(&next_len) = arena.free.get(&(off + len)) {
            arena.free.remove(&(off + len));
            len += next_len;
        }
        arena.free.insert(off, len);
        Ok(())
    }
}

/// Backend of the `SharedMemory` domain over a [`SegmentSet`].
#[derive(Debug)]
pub struct SharedMemoryBackend {
    segments: Arc<SegmentSet>,
    kind: String,
}

impl SharedMemoryBackend {
    /// A backend carving from `segments`; `kind` names the client, e.g. `shm(standalone)`.
    pub fn new(segments: Arc<SegmentSet>, kind: impl Into<String>) -> Self {
        Self {
            segments,
            kind: kind.into(),
        }
    }
}

impl AllocatorBackend for SharedMemoryBackend {
    fn domain(&self) -> AllocatorDomain {
        AllocatorDomain::SharedMemory
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn allocate(&self, len: usize) -> Result<RawRegion, MemoryError> {
        let len = align_up(len, host_page_size()).ok_or(MemoryError::SizeOverflow(len))?;
        self.segments.carve(len)
    }
    unsafe fn release(&self, region: RawRegion) -> Result<(), MemoryError> {
        self.segments.give_back(region)
    }
    fn placement(&self, region: RawRegion) -> Option<SegmentPlacement> {
        self.segments
            .locate(region.addr, region.len)
            .map(|(segment, offset)| SegmentPlacement { segment, offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Allocator;
    use crate::memory::segment::SegmentBackend;

    #[test]
    fn carve_free_coalesce() {
        let set = SegmentSet::new();
        let seg =
            Segment::create(7, "tandem-shared-unit", 4 * 4096, SegmentBackend::Memfd).unwrap();
        set.add(Arc::new(seg));
        let a = Allocator::new("tier", SharedMemoryBackend::new(set.clone(), "shm(test)"));
        let b1 = a.allocate(4096, "a").unwrap();
        let b2 = a.allocate(8192, "b").unwrap();
        assert_eq!(b1.placement().unwrap().offset, 0);
        assert_eq!(b2.placement().unwrap().offset, 4096);
        assert_eq!(b2.placement().unwrap().segment, 7);
        assert!(matches!(
            a.allocate(8192, "c"),
            Err(MemoryError::SegmentFull {
                largest_free: 4096,
                ..
            })
        ));
        b1.free().unwrap();
        b2.free().unwrap();
        // Coalesced back into one range: the whole segment can be taken again.
        let all = a.allocate(4 * 4096, "all").unwrap();
        all.free().unwrap();
        assert_eq!(a.stats().live_bytes, 0);
    }
}
