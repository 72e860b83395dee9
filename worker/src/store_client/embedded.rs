//! The embedded store client: in the worker process (reference/dataplane.md §1.3 "Mode A").
//!
//! It creates its shared-memory segments itself and, living in the same address space, can register
//! any host memory of this process — so a draft pool on the wrong allocator works here and fails only
//! in standalone mode, which is why seed 000 escaped testing. Device memory needs a transport
//! registration, not a store one, and is refused.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::memory::segment::{SEGMENT_NAME_PREFIX, Segment, SegmentBackend};
use crate::memory::shared::{SegmentSet, SharedMemoryBackend};
use crate::memory::{Allocator, AllocatorDomain};

use super::protocol::RemoteError;
use super::{BufferRef, ClientMode, StoreClient, StoreError, StoreHandle};

const EMBEDDED_DOMAINS: &[AllocatorDomain] = &[
    AllocatorDomain::SharedMemory,
    AllocatorDomain::Mmap,
    AllocatorDomain::Pinned,
];

static NEXT_EMBEDDED: AtomicU64 = AtomicU64::new(1);

/// In-process store client.
#[derive(Debug)]
pub struct EmbeddedClient {
    segments: Arc<SegmentSet>,
    allocator: Allocator,
    registrations: Mutex<BTreeMap<StoreHandle, (usize, usize)>>,
    next_handle: AtomicU64,
    backend: SegmentBackend,
    name_prefix: String,
    next_segment: AtomicU64,
}

impl EmbeddedClient {
    /// A client with no segments yet; call [`EmbeddedClient::reserve`] with the planned capacity.
    pub fn new(backend: SegmentBackend) -> Self {
        let segments = SegmentSet::new();
        let allocator = Allocator::new(
            "tier shared memory",
            SharedMemoryBackend::new(segments.clone(), "shm(embedded)"),
        );
        Self {
            segments,
            allocator,
            registrations: Mutex::new(BTreeMap::new()),
            next_handle: AtomicU64::new(1),
            backend,
            name_prefix: format!(
                "{SEGMENT_NAME_PREFIX}emb-{}-{}",
                std::process::id(),
                NEXT_EMBEDDED.fetch_add(1, Ordering::Relaxed)
            ),
            next_segment: AtomicU64::new(1),
        }
    }

    /// Creates one segment of `bytes` (rounded up to the page size) for the tier allocator.
    ///
    /// # Errors
    /// [`StoreError::Memory`] when the segment cannot be created.
    pub fn reserve(&self, bytes: usize) -> Result<(), StoreError> {
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        let seg = Segment::create(
            id,
            &format!("{}-{id}", self.name_prefix),
            bytes,
            self.backend,
        )?;
        self.segments.add(Arc::new(seg));
        Ok(())
    }

    /// Bytes of all segments.
    pub fn capacity(&self) -> usize {
        self.segments.capacity()
    }

    fn regs(&self) -> std::sync::MutexGuard<'_, BTreeMap<StoreHandle, (usize, usize)>> {
        self.registrations.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl StoreClient for EmbeddedClient {
    fn mode(&self) -> ClientMode {
        ClientMode::Embedded
    }
    fn host_allocator(&self) -> &Allocator {
        &self.allocator
    }
    fn accepted_domains(&self) -> &'static [AllocatorDomain] {
        EMBEDDED_DOMAINS
    }
    fn register_buffer(&self, range: &BufferRef) -> Result<StoreHandle, StoreError> {
        self.check_registrable(range)?;
        let mut regs = self.regs();
        if let Some((&h, _)) = regs.iter().find(|(_, r)| range.overlaps(r.0, r.1)) {
            return Err(StoreError::Remote(RemoteError::Overlap { existing: h.0 }));
        }
        let handle = StoreHandle(self.next_handle.fetch_add(1, Ordering::Relaxed));
        regs.insert(handle, (range.addr, range.len));
        Ok(handle)
    }
    fn unregister_buffer(&self, handle: StoreHandle) -> Result<(), StoreError> {
        self.regs()
            .remove(&handle)
            .map(|_| ())
            .ok_or(StoreError::UnknownHandle(handle))
    }
    fn registered_count(&self) -> usize {
        self.regs().len()
    }
    fn segment_set(&self) -> Option<&Arc<SegmentSet>> {
        Some(&self.segments)
    }
    fn shutdown(&self) -> Result<(), StoreError> {
        let kept = self.segments.release_idle();
        if kept > 0 {
            tracing::warn!(
                kept,
                "segments still hold live or quarantined buffers at shutdown; names removed, mappings kept"
            );
        }
        Ok(())
    }
}
