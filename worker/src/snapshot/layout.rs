//! Slot geometry of the snapshot buffer: pure arithmetic (DESIGN contract 4; dataplane.md R-MEM-6
//! "size classes matched to KV chunk sizes").
//!
//! One **slot** holds one KV page over all layers: `layers` chunks of `chunk_bytes`
//! (= `page_tokens × bytes_per_token_layer`, the pool's own chunk size), layer-major inside the slot.
//! A snapshot of `n` pages reserves `n` slots, which need not be adjacent. The buffer is
//! `slots × slot_bytes` bytes; the remainder of the configured size (less than one slot) is unused.

use crate::memory::pool::KvGeometry;

use super::error::SnapshotError;

/// Index of a slot in the snapshot buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotIndex(pub u32);

/// Shape of the snapshot buffer, derived from the prefill KV pool's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotGeometry {
    /// Bytes of one page on one layer (the pool's `chunk_bytes`).
    pub chunk_bytes: u64,
    /// Layers with KV.
    pub layers: u32,
    /// Number of slots.
    pub slots: u32,
}

impl SlotGeometry {
    /// As many slots of one `pool` page as fit in `buffer_bytes` (the config's
    /// `memory.snapshot_buffer_bytes`).
    ///
    /// # Errors
    /// [`SnapshotError::NoSlots`] when not even one slot fits (or the geometry is empty).
    pub fn for_pool(pool: &KvGeometry, buffer_bytes: u64) -> Result<SlotGeometry, SnapshotError> {
        let slot_bytes = pool.page_bytes();
        let slots = buffer_bytes.checked_div(slot_bytes).unwrap_or(0);
        let slots = u32::try_from(slots).unwrap_or(u32::MAX);
        if slots == 0 {
            return Err(SnapshotError::NoSlots {
                buffer_bytes,
                slot_bytes,
            });
        }
        Ok(SlotGeometry {
            chunk_bytes: pool.chunk_bytes(),
            layers: pool.layers,
            slots,
        })
    }

    /// Bytes of one slot: `layers × chunk_bytes`.
    pub fn slot_bytes(&self) -> u64 {
        self.chunk_bytes * u64::from(self.layers)
    }

    /// Bytes of the buffer: `slots × slot_bytes`.
    pub fn total_bytes(&self) -> u64 {
        self.slot_bytes() * u64::from(self.slots)
    }

    /// Byte offset of `layer`'s chunk in `slot`, or `None` if either is out of range.
    pub fn chunk_offset(&self, slot: SlotIndex, layer: u32) -> Option<u64> {
        if slot.0 >= self.slots || layer >= self.layers {
            return None;
        }
        Some(u64::from(slot.0) * self.slot_bytes() + u64::from(layer) * self.chunk_bytes)
    }

    /// The slot containing byte `offset`, or `None` past the end.
    pub fn slot_of(&self, offset: u64) -> Option<SlotIndex> {
        if offset >= self.total_bytes() {
            return None;
        }
        Some(SlotIndex((offset / self.slot_bytes()) as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::pool::PoolLayout;

    fn pool_geometry() -> KvGeometry {
        KvGeometry {
            bytes_per_token_layer: 64,
            layers: 3,
            page_tokens: 4,
            pages: 10,
            layout: PoolLayout::LayerFirst,
        }
    }

    #[test]
    fn slots_are_whole_pages_and_offsets_are_layer_major() {
        let g = SlotGeometry::for_pool(&pool_geometry(), 3 * 768 + 700).unwrap();
        assert_eq!((g.chunk_bytes, g.slot_bytes(), g.slots), (256, 768, 3));
        assert_eq!(g.chunk_offset(SlotIndex(1), 2), Some(768 + 512));
        assert_eq!(g.chunk_offset(SlotIndex(3), 0), None);
        assert_eq!(g.chunk_offset(SlotIndex(0), 3), None);
        assert_eq!(g.slot_of(767), Some(SlotIndex(0)));
        assert_eq!(g.slot_of(768), Some(SlotIndex(1)));
        assert_eq!(g.slot_of(g.total_bytes()), None);
    }

    #[test]
    fn a_buffer_smaller_than_one_page_is_refused() {
        assert!(matches!(
            SlotGeometry::for_pool(&pool_geometry(), 767),
            Err(SnapshotError::NoSlots {
                slot_bytes: 768,
                ..
            })
        ));
        assert!(SlotGeometry::for_pool(&pool_geometry(), 0).is_err());
    }
}
