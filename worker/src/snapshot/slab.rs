//! The slab allocator of the snapshot buffer: a free list of fixed-size slots and the owner of every
//! slot (DESIGN contract 4; dataplane.md R-MEM-6). Pure bookkeeping, no memory.
//!
//! Reservation is all-or-nothing: a snapshot gets all its slots or none, so a full buffer never
//! leaves a half-reserved snapshot behind. The free list is LIFO: a slot just released is the first
//! one handed out again — the order that makes a late write into a reused slot most likely, which is
//! why the tests use it to prove such writes cannot land.

use super::id::SnapshotId;
use super::layout::SlotIndex;

/// Slot free list plus the snapshot owning each slot.
#[derive(Debug, Clone)]
pub struct SlotSlab {
    owners: Vec<Option<SnapshotId>>,
    free: Vec<SlotIndex>,
}

/// A release named a slot that the snapshot does not own (a bookkeeping bug); nothing was released.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("slot {slot} is not owned by snapshot {id} (owner {owner:?})")]
pub struct NotOwner {
    /// The slot.
    pub slot: u32,
    /// The snapshot that tried to release it.
    pub id: SnapshotId,
    /// Its actual owner.
    pub owner: Option<SnapshotId>,
}

impl SlotSlab {
    /// `slots` free slots.
    pub fn new(slots: u32) -> SlotSlab {
        SlotSlab {
            owners: vec![None; slots as usize],
            free: (0..slots).rev().map(SlotIndex).collect(),
        }
    }

    /// Slots in the buffer.
    pub fn slots(&self) -> u32 {
        self.owners.len() as u32
    }

    /// Free slots.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// The owner of `slot` (`None` when free or out of range).
    pub fn owner(&self, slot: SlotIndex) -> Option<SnapshotId> {
        self.owners.get(slot.0 as usize).copied().flatten()
    }

    /// Reserves `n` slots for `id`, or none if fewer than `n` are free.
    pub fn reserve(&mut self, n: usize, id: SnapshotId) -> Option<Vec<SlotIndex>> {
        if n > self.free.len() {
            return None;
        }
        let slots = self.free.split_off(self.free.len() - n);
        for s in &slots {
            self.owners[s.0 as usize] = Some(id);
        }
        Some(slots)
    }

    /// Returns `slots` of `id` to the free list. Every slot is checked first.
    ///
    /// # Errors
    /// [`NotOwner`] if any slot is not owned by `id`; nothing is released then.
    pub fn release(&mut self, slots: &[SlotIndex], id: SnapshotId) -> Result<(), NotOwner> {
        for s in slots {
            let owner = self.owner(*s);
            if owner != Some(id) {
                return Err(NotOwner {
                    slot: s.0,
                    id,
                    owner,
                });
            }
        }
        for s in slots {
            // A slot named twice goes back once: pushing it twice would let two later
            // reservations share it.
            if self.owners[s.0 as usize].take().is_some() {
                self.free.push(*s);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_named_twice_in_a_release_is_freed_once() {
        let mut slab = SlotSlab::new(4);
        let a = slab.reserve(2, SnapshotId(1)).unwrap();
        slab.release(&[a[0], a[0], a[1]], SnapshotId(1)).unwrap();
        // Four distinct slots to hand out, never one slot twice.
        let all = slab.reserve(4, SnapshotId(2)).unwrap();
        let mut ids: Vec<u32> = all.iter().map(|s| s.0).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 4);
        assert!(slab.reserve(1, SnapshotId(3)).is_none());
    }

    #[test]
    fn reserve_is_all_or_nothing_and_release_is_lifo() {
        let mut slab = SlotSlab::new(4);
        let a = slab.reserve(3, SnapshotId(1)).unwrap();
        assert_eq!(slab.free_count(), 1);
        assert!(slab.reserve(2, SnapshotId(2)).is_none(), "all or nothing");
        assert_eq!(slab.free_count(), 1);
        assert_eq!(slab.owner(a[0]), Some(SnapshotId(1)));
        slab.release(&a, SnapshotId(1)).unwrap();
        let b = slab.reserve(3, SnapshotId(2)).unwrap();
        let (mut a_sorted, mut b_sorted) = (a.clone(), b.clone());
        a_sorted.sort();
        b_sorted.sort();
        assert_eq!(a_sorted, b_sorted, "released slots are reused first");
    }

    #[test]
    fn release_by_a_non_owner_changes_nothing() {
        let mut slab = SlotSlab::new(2);
        let a = slab.reserve(1, SnapshotId(1)).unwrap();
        let b = slab.reserve(1, SnapshotId(2)).unwrap();
        let both = [a[0], b[0]];
        let e = slab.release(&both, SnapshotId(1)).unwrap_err();
        assert_eq!(e.owner, Some(SnapshotId(2)));
        assert_eq!(slab.owner(a[0]), Some(SnapshotId(1)), "nothing released");
        assert_eq!(slab.free_count(), 0);
        assert!(slab.release(&[SlotIndex(9)], SnapshotId(1)).is_err());
    }
}
