//! The simulated prefill engine's source-page book: which pages its allocator may hand out while
//! several rooms are computed at once (DESIGN §3.1: the prefill engine owns its allocator and
//! reuses a page only after its `SourceFree`).
//!
//! A page is in exactly one of three places:
//! - **free**: the allocator may hand it to the next room;
//! - **running**: a room being computed holds it (its task may still write it);
//! - **returned early**: the worker said `SourceFree` while the room holding it was still being
//!   computed (the room failed — an abort, a deadline — after an accepted `PagesReady`, and its
//!   task is still writing the next layer half). Such a page becomes free only when that room's
//!   task ends: handed out earlier, two rooms would write the same page at once.
//!
//! Pure bookkeeping, no I/O: the serve loop ([`super::prefill_loop`]) owns one book and alone
//! mutates it, so no lock is needed and no two rooms ever hold the same page.

use std::collections::BTreeSet;

/// The source pages of one attach (pages `0..pages` of the target pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcePages {
    free: BTreeSet<u32>,
    running: BTreeSet<u32>,
    returned_early: BTreeSet<u32>,
    total: usize,
}

impl SourcePages {
    /// Every page of a pool of `pages` pages free.
    pub fn new(pages: u32) -> Self {
        Self {
            free: (0..pages).collect(),
            running: BTreeSet::new(),
            returned_early: BTreeSet::new(),
            total: pages as usize,
        }
    }

    /// Free pages now.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Whether every page is free (no room runs, no `SourceFree` outstanding).
    pub fn all_free(&self) -> bool {
        self.free.len() == self.total
    }

    /// Takes `need` free pages (lowest first) for a room about to be computed; `None` (nothing
    /// taken) when fewer are free.
    pub fn take(&mut self, need: usize) -> Option<Vec<u32>> {
        if self.free.len() < need {
            return None;
        }
        let pages: Vec<u32> = self.free.iter().copied().take(need).collect();
        for p in &pages {
            self.free.remove(p);
            self.running.insert(*p);
        }
        Some(pages)
    }

    /// A `SourceFree` named `pages`: those no running room holds are free again; those a running
    /// room holds wait for its end ([`SourcePages::room_ended`]). Pages already free or unknown
    /// are ignored (a duplicate event frees nothing twice).
    pub fn source_free(&mut self, pages: &[u32]) {
        for &p in pages {
            if self.running.contains(&p) {
                self.returned_early.insert(p);
            } else if (p as usize) < self.total {
                self.free.insert(p);
            }
        }
    }

    /// The room holding `pages` ended. `worker_holds_none`: no `PagesReady` of it was accepted, so
    /// the worker will not return them — they are free now. Otherwise each page is free if its
    /// `SourceFree` came while the room ran, and waits for it otherwise.
    pub fn room_ended(&mut self, pages: &[u32], worker_holds_none: bool) {
        for &p in pages {
            if !self.running.remove(&p) {
                continue;
            }
            if self.returned_early.remove(&p) || worker_holds_none {
                self.free.insert(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_get_disjoint_pages_and_wait_when_too_few_are_free() {
        let mut b = SourcePages::new(5);
        let a = b.take(2).unwrap();
        let c = b.take(2).unwrap();
        assert!(a.iter().all(|p| !c.contains(p)), "{a:?} {c:?}");
        assert_eq!(b.take(2), None, "one page left");
        assert_eq!(b.free(), 1);
    }

    #[test]
    fn a_page_returned_while_its_room_runs_is_reused_only_after_the_room_ended() {
        let mut b = SourcePages::new(2);
        let a = b.take(2).unwrap();
        // The room failed after its first PagesReady: the worker returns the pages while the
        // room's task still writes the second half.
        b.source_free(&a);
        assert_eq!(b.take(1), None, "a running room's pages are not handed out");
        b.room_ended(&a, false);
        assert!(b.all_free());
        assert_eq!(b.take(2), Some(a));
    }

    #[test]
    fn a_finished_room_waits_for_its_source_free_unless_the_worker_took_nothing() {
        let mut b = SourcePages::new(3);
        let a = b.take(2).unwrap();
        b.room_ended(&a, false);
        assert_eq!(b.free(), 1, "sent pages come back with SourceFree only");
        b.source_free(&a);
        assert!(b.all_free());
        let c = b.take(3).unwrap();
        b.room_ended(&c, true);
        assert!(
            b.all_free(),
            "refused before any accepted write: free at once"
        );
        b.source_free(&[0, 1, 7]);
        assert_eq!(b.free(), 3, "duplicates and unknown pages change nothing");
    }
}
