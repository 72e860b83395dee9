//! The snapshot buffer's memory, seen by transports as one [`ReceiveRegion`] (DESIGN contract 4).
//!
//! One buffer is allocated once, from the allocator the caller passes — a dedicated allocator, never
//! the prefill KV pool's — and registered once with the receiver under its own region id. Its bytes
//! are carved into fixed-size slots ([`SlotGeometry`]) handed out by the [`SlotSlab`] kept here, next
//! to the memory it describes, so that the write path can consult it:
//!
//! - a write is refused whole if any byte of it falls in a **free** slot (as the KV pool region
//!   refuses free pages): a write that arrives after its snapshot's slots were released and before
//!   they are reused changes nothing;
//! - every slot has its own lock: writes and reads of one slot are serialised, and
//!   `SnapshotRegion::release` (crate-private) takes the locks of the slots it frees, so no write
//!   is half-applied in a slot that is already free.
//!
//! A write that arrives after a slot was *reused* cannot be told apart here (the region sees offsets,
//! not rooms): the room generation check of the TCP receiver drops it, and for one-sided transports
//! the slots of an aborted snapshot are not reused until its writer is terminal (see
//! [`super::store`]).

use std::io::Read;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::memory::{Allocator, Buffer, require_domain};
use crate::transfer::pool_region::TCP_ACCEPTED_DOMAINS;
use crate::transfer::region::check_bounds;
use crate::transfer::{ReceiveRegion, RegionError};

use super::error::SnapshotError;
use super::id::SnapshotId;
use super::layout::{SlotGeometry, SlotIndex};
use super::slab::{NotOwner, SlotSlab};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Owner name of the buffer in the allocator's accounting and logs.
pub const SNAPSHOT_BUFFER_OWNER: &str = "snapshot buffer";

/// The snapshot receive buffer: memory, slot geometry, per-slot locks and the slab.
#[derive(Debug)]
pub struct SnapshotRegion {
    buffer: Option<Buffer>,
    base: usize,
    geometry: SlotGeometry,
    slot_locks: Vec<Mutex<()>>,
    slab: Mutex<SlotSlab>,
}

impl SnapshotRegion {
    /// Allocates `geometry.total_bytes()` from `allocator` (owner [`SNAPSHOT_BUFFER_OWNER`]).
    ///
    /// # Errors
    /// [`SnapshotError::Domain`] for an allocator whose memory the CPU cannot write (device memory
    /// needs the `cuda` receive path, not built yet), [`SnapshotError::Memory`] when allocation fails.
    pub fn new(
        allocator: &Allocator,
        geometry: SlotGeometry,
    ) -> Result<SnapshotRegion, SnapshotError> {
        let bytes =
            usize::try_from(geometry.total_bytes()).map_err(|_| SnapshotError::NoSlots {
                buffer_bytes: geometry.total_bytes(),
                slot_bytes: geometry.slot_bytes(),
            })?;
        let buffer = allocator.allocate(bytes, SNAPSHOT_BUFFER_OWNER)?;
        if let Err(e) = require_domain(
            &buffer,
            "snapshot buffer (host copy path)",
            &TCP_ACCEPTED_DOMAINS,
        ) {
            buffer.free()?;
            return Err(e.into());
        }
        let base = buffer.host_ptr()? as usize;
        Ok(SnapshotRegion {
            buffer: Some(buffer),
            base,
            geometry,
            slot_locks: (0..geometry.slots).map(|_| Mutex::new(())).collect(),
            slab: Mutex::new(SlotSlab::new(geometry.slots)),
        })
    }

    /// The slot geometry.
    pub fn geometry(&self) -> SlotGeometry {
        self.geometry
    }

    /// The buffer (for registration with a transport and for domain checks).
    pub fn buffer(&self) -> Option<&Buffer> {
        self.buffer.as_ref()
    }

    /// Free slots now.
    pub fn free_slots(&self) -> usize {
        lock(&self.slab).free_count()
    }

    /// The snapshot owning `slot` (`None` when free).
    pub fn owner(&self, slot: SlotIndex) -> Option<SnapshotId> {
        lock(&self.slab).owner(slot)
    }

    /// Reserves `n` slots for `id`, all or none.
    pub(crate) fn reserve(&self, n: usize, id: SnapshotId) -> Option<Vec<SlotIndex>> {
        lock(&self.slab).reserve(n, id)
    }

    /// Frees `slots` of `id`, after any write in progress on them has finished.
    ///
    /// # Errors
    /// [`NotOwner`]; nothing is freed then.
    pub(crate) fn release(&self, slots: &[SlotIndex], id: SnapshotId) -> Result<(), NotOwner> {
        let mut sorted: Vec<SlotIndex> = slots.to_vec();
        sorted.sort();
        sorted.dedup();
        // Lock order everywhere: slot locks (ascending), then the slab.
        let _guards: Vec<MutexGuard<'_, ()>> = sorted
            .iter()
            .filter_map(|s| self.slot_locks.get(s.0 as usize).map(lock))
            .collect();
        lock(&self.slab).release(&sorted, id)
    }

    /// Splits `[offset, offset + len)` into `(slot, offset in buffer, bytes)` pieces. In bounds.
    fn pieces(&self, offset: u64, len: u64) -> Vec<(SlotIndex, u64, usize)> {
        let slot_bytes = self.geometry.slot_bytes();
        let mut out = Vec::new();
        let (mut pos, end) = (offset, offset + len);
        while pos < end {
            let slot = SlotIndex((pos / slot_bytes) as u32);
            let n = (slot_bytes - pos % slot_bytes).min(end - pos);
            out.push((slot, pos, n as usize));
            pos += n;
        }
        out
    }

    fn refuse_free(&self, slot: SlotIndex) -> Result<(), RegionError> {
        if lock(&self.slab).owner(slot).is_none() {
            return Err(RegionError::Refused(format!(
                "snapshot slot {} is free",
                slot.0
            )));
        }
        Ok(())
    }
}

impl ReceiveRegion for SnapshotRegion {
    fn len(&self) -> u64 {
        self.geometry.total_bytes()
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), RegionError> {
        check_bounds(offset, src.len() as u64, self.len())?;
        let pieces = self.pieces(offset, src.len() as u64);
        // Every slot the write touches is locked (ascending: pieces follow the offset, the same
        // order `release` takes) and checked before the first byte is copied, so a write is
        // refused whole: a release cannot free a slot between two pieces of one write.
        let mut slots: Vec<SlotIndex> = pieces.iter().map(|(slot, ..)| *slot).collect();
        slots.dedup();
        let _guards: Vec<MutexGuard<'_, ()>> = slots
            .iter()
            .filter_map(|s| self.slot_locks.get(s.0 as usize).map(lock))
            .collect();
        for slot in &slots {
            self.refuse_free(*slot)?;
        }
        let mut done = 0usize;
        for (_, at, n) in pieces {
            // SAFETY: `at + n <= len()` (checked above) and the buffer is live for `self`'s lifetime;
            // the slot locks held above exclude every other writer and reader of these bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src[done..done + n].as_ptr(),
                    (self.base + at as usize) as *mut u8,
                    n,
                );
            }
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
        for (slot, at, n) in self.pieces(offset, dst.len() as u64) {
            let _guard = lock(&self.slot_locks[slot.0 as usize]);
            // SAFETY: in bounds (checked above); the slot lock excludes writers.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.base + at as usize) as *const u8,
                    dst[done..done + n].as_mut_ptr(),
                    n,
                );
            }
            done += n;
        }
        Ok(())
    }
}

impl Drop for SnapshotRegion {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take()
            && let Err(e) = b.free()
        {
            tracing::error!(error = %e, "freeing the snapshot buffer failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::mmap::MmapBackend;

    fn region(slots: u32) -> SnapshotRegion {
        let g = SlotGeometry {
            chunk_bytes: 8,
            layers: 2,
            slots,
        };
        SnapshotRegion::new(&Allocator::new("snapshot", MmapBackend::new()), g).unwrap()
    }

    #[test]
    fn writes_land_only_in_reserved_slots_and_read_back() {
        let r = region(3);
        let slots = r.reserve(1, SnapshotId(7)).unwrap();
        let at = r.geometry().chunk_offset(slots[0], 1).unwrap();
        r.write(at, &[5u8; 8]).unwrap();
        let mut back = [0u8; 8];
        r.read(at, &mut back).unwrap();
        assert_eq!(back, [5u8; 8]);
        let other = SlotIndex((slots[0].0 + 1) % 3);
        let free_at = r.geometry().chunk_offset(other, 0).unwrap();
        assert!(matches!(
            r.write(free_at, &[1u8; 8]),
            Err(RegionError::Refused(_))
        ));
        // A write spanning a reserved and a free slot is refused whole.
        let span_at = r.geometry().chunk_offset(slots[0], 1).unwrap() + 4;
        if r.geometry().slot_of(span_at + 8) != Some(slots[0]) {
            assert!(r.write(span_at, &[9u8; 8]).is_err());
            r.read(at, &mut back).unwrap();
            assert_eq!(back, [5u8; 8], "a refused write changes nothing");
        }
        assert!(matches!(
            r.write(r.len() - 4, &[0u8; 8]),
            Err(RegionError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn no_write_lands_after_release_returns_even_while_a_writer_races_it() {
        for _ in 0..20 {
            let r = std::sync::Arc::new(region(1));
            let slots = r.reserve(1, SnapshotId(1)).unwrap();
            let at = r.geometry().chunk_offset(slots[0], 0).unwrap();
            let writer = {
                let r = r.clone();
                std::thread::spawn(move || {
                    let mut landed = 0u32;
                    for i in 0..2_000u32 {
                        let byte = (i % 250) as u8 + 1;
                        if r.write(at, &[byte; 16]).is_ok() {
                            landed += 1;
                        }
                    }
                    landed
                })
            };
            std::thread::yield_now();
            r.release(&slots, SnapshotId(1)).unwrap();
            let mut after_release = [0u8; 16];
            r.read(at, &mut after_release).unwrap();
            writer.join().unwrap();
            let mut at_end = [0u8; 16];
            r.read(at, &mut at_end).unwrap();
            assert_eq!(
                after_release, at_end,
                "a write landed after release returned"
            );
            assert!(
                after_release.iter().all(|b| *b == after_release[0]),
                "no torn write"
            );
        }
    }

    #[test]
    fn after_release_a_late_write_is_refused() {
        let r = region(2);
        let slots = r.reserve(2, SnapshotId(1)).unwrap();
        let at = r.geometry().chunk_offset(slots[0], 0).unwrap();
        r.write(at, &[3u8; 8]).unwrap();
        r.release(&slots, SnapshotId(1)).unwrap();
        assert_eq!(r.free_slots(), 2);
        assert!(matches!(
            r.write(at, &[4u8; 8]),
            Err(RegionError::Refused(_))
        ));
        assert!(r.release(&slots, SnapshotId(1)).is_err(), "double release");
    }
}
