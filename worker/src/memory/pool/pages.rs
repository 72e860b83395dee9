//! The page table: free list and per-page reference counts (reference/dataplane.md R-MEM-5, TC-MEM-01).
//!
//! A page has one optional *owner* (the request or cache entry that allocated it), any number of
//! in-flight *writers* (a transfer or load writing into it) and *readers* (a transfer or backup reading
//! from it). It returns to the free list only when all three are zero. A page whose release is not
//! proven safe (DESIGN contract 3: writes may still land) is *quarantined*: it never returns to the free
//! list until the pool is destroyed.
//!
//! Pure logic, no memory: [`super::KvPool`] puts it behind a lock next to the buffer.

use serde::{Deserialize, Serialize};

/// Index of a page in its pool, `0..pages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PageId(pub u32);

impl std::fmt::Display for PageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "page {}", self.0)
    }
}

/// Reference counts of one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageRefs {
    /// Whether an owner holds the page (set by allocate, cleared by free).
    pub owned: bool,
    /// In-flight writers.
    pub writers: u32,
    /// In-flight readers.
    pub readers: u32,
    /// Taken out of circulation until the pool is destroyed.
    pub quarantined: bool,
}

impl PageRefs {
    fn in_use(&self) -> bool {
        self.owned || self.writers > 0 || self.readers > 0
    }
}

/// Counts of pages by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageStats {
    /// On the free list.
    pub free: u32,
    /// Held by an owner.
    pub owned: u32,
    /// Not owned but still pinned by writers or readers (waiting to drain).
    pub draining: u32,
    /// Quarantined.
    pub quarantined: u32,
}

/// Errors of page operations. Every operation validates all its pages before changing any.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// Fewer free pages than asked for; nothing was allocated.
    #[error("pool exhausted: {requested} pages requested, {free} free")]
    Exhausted {
        /// Pages asked for.
        requested: usize,
        /// Pages free.
        free: usize,
    },
    /// The page index is outside the pool.
    #[error("{page} is out of range (pool has {pages} pages)")]
    OutOfRange {
        /// The page.
        page: PageId,
        /// Pool size.
        pages: u32,
    },
    /// The operation needs an owned (or pinned) page and this one is free.
    #[error("{0} is not allocated")]
    NotAllocated(PageId),
    /// Free of a page with no owner, or the same page twice in one call.
    #[error("{0} has no owner to release (double free)")]
    DoubleFree(PageId),
    /// Unpin without a matching pin.
    #[error("{page} has no {kind} pin to release")]
    PinUnderflow {
        /// The page.
        page: PageId,
        /// `writer` or `reader`.
        kind: &'static str,
    },
    /// The page is quarantined.
    #[error("{0} is quarantined")]
    Quarantined(PageId),
}

/// Free list plus reference counts for `pages` pages.
#[derive(Debug, Clone)]
pub struct PageTable {
    refs: Vec<PageRefs>,
    /// Stack of free pages; the next allocation pops from the end (LIFO keeps hot pages hot).
    free: Vec<u32>,
    quarantined: u32,
}

impl PageTable {
    /// All `pages` pages free.
    pub fn new(pages: u32) -> Self {
        Self {
            refs: vec![PageRefs::default(); pages as usize],
            free: (0..pages).rev().collect(),
            quarantined: 0,
        }
    }

    /// Number of pages.
    pub fn pages(&self) -> u32 {
        self.refs.len() as u32
    }

    fn check(&self, page: PageId) -> Result<&PageRefs, PageError> {
        self.refs.get(page.0 as usize).ok_or(PageError::OutOfRange {
            page,
            pages: self.pages(),
        })
    }

    /// Refs of one page.
    ///
    /// # Errors
    /// [`PageError::OutOfRange`].
    pub fn refs(&self, page: PageId) -> Result<PageRefs, PageError> {
        self.check(page).copied()
    }

    /// Takes `n` free pages, each with its owner set. All or nothing.
    ///
    /// # Errors
    /// [`PageError::Exhausted`] when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<PageId>, PageError> {
        if n > self.free.len() {
            return Err(PageError::Exhausted {
                requested: n,
                free: self.free.len(),
            });
        }
        let start = self.free.len() - n;
        let taken: Vec<PageId> = self.free.drain(start..).rev().map(PageId).collect();
        for p in &taken {
            self.refs[p.0 as usize].owned = true;
        }
        Ok(taken)
    }

    /// Owner releases `pages`. A page goes back to the free list now if no writer or reader pins it,
    /// otherwise when the last pin goes. All pages are validated first; on error nothing changes.
    ///
    /// # Errors
    /// [`PageError::OutOfRange`], [`PageError::DoubleFree`] (not owned, or listed twice).
    pub fn free(&mut self, pages: &[PageId]) -> Result<(), PageError> {
        for (i, &p) in pages.iter().enumerate() {
            if !self.check(p)?.owned || pages[..i].contains(&p) {
                return Err(PageError::DoubleFree(p));
            }
        }
        for &p in pages {
            self.refs[p.0 as usize].owned = false;
            self.maybe_recycle(p);
        }
        Ok(())
    }

    /// Adds an in-flight writer to an allocated page.
    ///
    /// # Errors
    /// [`PageError::OutOfRange`], [`PageError::NotAllocated`] (free page), [`PageError::Quarantined`].
    pub fn pin_writer(&mut self, page: PageId) -> Result<(), PageError> {
        self.pin(page, |r| r.writers += 1)
    }

    /// Adds an in-flight reader to an allocated page. Errors as [`PageTable::pin_writer`].
    ///
    /// # Errors
    /// See [`PageTable::pin_writer`].
    pub fn pin_reader(&mut self, page: PageId) -> Result<(), PageError> {
        self.pin(page, |r| r.readers += 1)
    }

    fn pin(&mut self, page: PageId, f: impl FnOnce(&mut PageRefs)) -> Result<(), PageError> {
        let r = self.check(page)?;
        if r.quarantined {
            return Err(PageError::Quarantined(page));
        }
        if !r.in_use() {
            return Err(PageError::NotAllocated(page));
        }
        f(&mut self.refs[page.0 as usize]);
        Ok(())
    }

    /// Removes a writer; recycles the page if that was the last reference.
    ///
    /// # Errors
    /// [`PageError::OutOfRange`], [`PageError::PinUnderflow`].
    pub fn unpin_writer(&mut self, page: PageId) -> Result<(), PageError> {
        let r = self.check(page)?;
        if r.writers == 0 {
            return Err(PageError::PinUnderflow {
                page,
                kind: "writer",
            });
        }
        self.refs[page.0 as usize].writers -= 1;
        self.maybe_recycle(page);
        Ok(())
    }

    /// Removes a reader; recycles the page if that was the last reference.
    ///
    /// # Errors
    /// [`PageError::OutOfRange`], [`PageError::PinUnderflow`].
    pub fn unpin_reader(&mut self, page: PageId) -> Result<(), PageError> {
        let r = self.check(page)?;
        if r.readers == 0 {
            return Err(PageError::PinUnderflow {
                page,
                kind: "reader",
            });
        }
        self.refs[page.0 as usize].readers -= 1;
        self.maybe_recycle(page);
        Ok(())
    }

    /// Takes allocated pages out of circulation: they are disowned and never recycled (pins may still
    /// drain but the page stays out). Used when a release is not proven safe (DESIGN contract 3).
    ///
    /// # Errors
    /// [`PageError::OutOfRange`], [`PageError::NotAllocated`] (a free page needs no quarantine).
    pub fn quarantine(&mut self, pages: &[PageId]) -> Result<(), PageError> {
        for &p in pages {
            let r = self.check(p)?;
            if !r.in_use() && !r.quarantined {
                return Err(PageError::NotAllocated(p));
            }
        }
        for &p in pages {
            let r = &mut self.refs[p.0 as usize];
            if !r.quarantined {
                r.quarantined = true;
                r.owned = false;
                self.quarantined += 1;
            }
        }
        Ok(())
    }

    fn maybe_recycle(&mut self, page: PageId) {
        let r = self.refs[page.0 as usize];
        if !r.in_use() && !r.quarantined {
            self.free.push(page.0);
        }
    }

    /// Whether any page has an in-flight writer or reader (the pool's memory may be touched by a
    /// transfer, so it must not be freed).
    pub fn has_pins(&self) -> bool {
        self.refs.iter().any(|r| r.writers > 0 || r.readers > 0)
    }

    /// Counts by state.
    pub fn stats(&self) -> PageStats {
        let mut s = PageStats {
            free: self.free.len() as u32,
            quarantined: self.quarantined,
            ..PageStats::default()
        };
        for r in &self.refs {
            if r.quarantined {
                continue;
            }
            if r.owned {
                s.owned += 1;
            } else if r.writers > 0 || r.readers > 0 {
                s.draining += 1;
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_free_with_writer_pin_waits_for_the_writer() {
        // TC-MEM-01.
        let mut t = PageTable::new(4);
        let p = t.allocate(1).unwrap()[0];
        t.pin_writer(p).unwrap();
        t.free(&[p]).unwrap();
        assert_eq!(
            t.stats().free,
            3,
            "page is not on the free list while written"
        );
        assert_eq!(t.stats().draining, 1);
        t.unpin_writer(p).unwrap();
        assert_eq!(t.stats().free, 4);
        assert_eq!(t.stats().draining, 0);
    }

    #[test]
    fn allocate_is_all_or_nothing_and_free_validates_first() {
        let mut t = PageTable::new(3);
        let a = t.allocate(2).unwrap();
        assert_eq!(
            t.allocate(2),
            Err(PageError::Exhausted {
                requested: 2,
                free: 1
            })
        );
        assert_eq!(t.stats().free, 1);
        // Second entry is a double free: nothing changes, not even the first page.
        assert_eq!(t.free(&[a[0], a[0]]), Err(PageError::DoubleFree(a[0])));
        assert_eq!(t.stats().owned, 2);
        assert!(matches!(
            t.free(&[PageId(9)]),
            Err(PageError::OutOfRange { .. })
        ));
        t.free(&a).unwrap();
        assert_eq!(t.free(&a[..1]), Err(PageError::DoubleFree(a[0])));
        assert_eq!(t.pin_reader(a[0]), Err(PageError::NotAllocated(a[0])));
        assert!(matches!(
            t.unpin_reader(a[0]),
            Err(PageError::PinUnderflow { .. })
        ));
    }

    #[test]
    fn quarantined_pages_never_come_back() {
        let mut t = PageTable::new(2);
        let p = t.allocate(1).unwrap()[0];
        t.pin_writer(p).unwrap();
        t.quarantine(&[p]).unwrap();
        t.unpin_writer(p).unwrap();
        assert_eq!(
            t.stats(),
            PageStats {
                free: 1,
                owned: 0,
                draining: 0,
                quarantined: 1
            }
        );
        assert_eq!(t.pin_reader(p), Err(PageError::Quarantined(p)));
        assert_eq!(t.allocate(1).unwrap(), vec![PageId(1)]);
    }
}
