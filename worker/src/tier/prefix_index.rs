//! The prefix index shared by the three cache tiers (L1 device pool, L2 host pool, L3 CacheTier store).
//!
//! Each tier keeps a set of [`PageKey`]s with a [`Residency`]: a page is `Pending` from the moment a
//! write into that tier starts until the write is acknowledged, and `Present` only afterwards. A lookup
//! returns the leading run of pages that are `Present` in some tier and names, for each page, the
//! fastest tier that holds it. A `Pending` page is never a hit: reading it could return bytes that are
//! not yet written (reference/dataplane.md R-HIC-5, R-L3-4, R-L3-5: "a span whose L3 backup is still
//! pending is not in L3", sglang #39444).
//!
//! Capacity is counted in pages per tier; an insert beyond it evicts the least recently used pages of
//! that tier. Inserts touch the pages of a sequence from the last to the first, so a parent page is
//! always more recently used than its children and LRU eviction removes leaves before the prefixes
//! they hang from (the radix-tree rule of SGLang and vLLM, obtained without a tree). Because the touch
//! order depends only on the request stream, the per-tier LRU keeps the inclusion property: a smaller
//! capacity holds a subset of what a larger one holds, so the hit ratio never rises as capacity shrinks
//! (tested on the Mooncake trace in `tests/tier_trace_replay.rs`).

use std::num::NonZeroUsize;

use lru::LruCache;

use super::page_key::PageKey;

/// A cache tier, fastest first. The order is the preference order of a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Tier {
    /// L1: the device (GPU) KV pool of the instance.
    L1Device,
    /// L2: the host KV pool of the instance.
    L2Host,
    /// L3: the CacheTier store, shared across instances and persisted across restarts.
    L3Store,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::L1Device, Tier::L2Host, Tier::L3Store];

    /// Position in [`Tier::ALL`] (0, 1, 2).
    pub const fn index(self) -> usize {
        match self {
            Tier::L1Device => 0,
            Tier::L2Host => 1,
            Tier::L3Store => 2,
        }
    }
}

/// Whether a page's bytes are complete in a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// A write into the tier has started and is not acknowledged: the page must not be read from
    /// there and is not a hit.
    Pending,
    /// The write is acknowledged: the page can be read from the tier.
    Present,
}

/// Capacity of one tier, in pages. `None` is unbounded.
pub type TierCapacity = Option<NonZeroUsize>;

/// The result of a prefix lookup: one entry per matched leading page, naming the fastest tier in which
/// it is [`Residency::Present`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// `tiers[i]` serves page `i` of the looked-up sequence; the length is the matched prefix in pages.
    pub tiers: Vec<Tier>,
}

impl PrefixMatch {
    /// Matched prefix length in pages.
    pub fn pages(&self) -> usize {
        self.tiers.len()
    }

    /// Number of matched pages served by `tier`.
    pub fn pages_in(&self, tier: Tier) -> usize {
        self.tiers.iter().filter(|t| **t == tier).count()
    }
}

/// Per-tier counters of the index since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Pages currently in the tier (pending or present).
    pub resident: usize,
    /// Pages evicted to respect the capacity.
    pub evicted: u64,
    /// Of those, pages evicted while their write was still pending (they were never a hit).
    pub evicted_pending: u64,
    /// `complete` calls for pages that were no longer in the tier (evicted or removed while pending);
    /// such pages stay absent.
    pub completed_absent: u64,
}

struct TierSet {
    pages: LruCache<PageKey, Residency>,
    capacity: TierCapacity,
    counters: TierCounters,
}

impl TierSet {
    fn new(capacity: TierCapacity) -> Self {
        TierSet {
            pages: LruCache::unbounded(),
            capacity,
            counters: TierCounters::default(),
        }
    }

    fn is_present(&self, key: &PageKey) -> bool {
        self.pages.peek(key) == Some(&Residency::Present)
    }

    /// Inserts or refreshes `key`; a present page stays present even if `residency` is pending (a
    /// rewrite of identical bytes does not hide the complete copy).
    fn touch(&mut self, key: PageKey, residency: Residency, evicted: &mut Vec<PageKey>) {
        match self.pages.get_mut(&key) {
            Some(r) => {
                if residency == Residency::Present {
                    *r = Residency::Present;
                }
            }
            None => {
                self.pages.put(key, residency);
                self.evict_over_capacity(evicted);
            }
        }
    }

    fn evict_over_capacity(&mut self, evicted: &mut Vec<PageKey>) {
        let Some(cap) = self.capacity else { return };
        while self.pages.len() > cap.get() {
            let Some((key, residency)) = self.pages.pop_lru() else {
                break;
            };
            self.counters.evicted += 1;
            if residency == Residency::Pending {
                self.counters.evicted_pending += 1;
            }
            evicted.push(key);
        }
    }
}

/// The prefix index over all tiers (see the module docs).
pub struct PrefixIndex {
    tiers: [TierSet; 3],
}

impl PrefixIndex {
    /// An index whose tiers hold at most `capacities[tier.index()]` pages each.
    pub fn new(capacities: [TierCapacity; 3]) -> Self {
        PrefixIndex {
            tiers: capacities.map(TierSet::new),
        }
    }

    /// An index with every tier unbounded.
    pub fn unbounded() -> Self {
        Self::new([None, None, None])
    }

    fn tier(&self, tier: Tier) -> &TierSet {
        &self.tiers[tier.index()]
    }

    fn tier_mut(&mut self, tier: Tier) -> &mut TierSet {
        &mut self.tiers[tier.index()]
    }

    /// The leading run of `keys` that is present in some tier, fastest tier per page. Does not change
    /// recency (callers touch what they use with [`PrefixIndex::insert`]).
    pub fn lookup(&self, keys: &[PageKey]) -> PrefixMatch {
        let mut tiers = Vec::new();
        for key in keys {
            match Tier::ALL
                .into_iter()
                .find(|t| self.tier(*t).is_present(key))
            {
                Some(t) => tiers.push(t),
                None => break,
            }
        }
        PrefixMatch { tiers }
    }

    /// The leading run of `keys` present in `tier` alone, in pages.
    pub fn leading_present(&self, tier: Tier, keys: &[PageKey]) -> usize {
        let set = self.tier(tier);
        keys.iter().take_while(|k| set.is_present(k)).count()
    }

    /// Residency of `key` in `tier`, if it is there.
    pub fn residency(&self, tier: Tier, key: &PageKey) -> Option<Residency> {
        self.tier(tier).pages.peek(key).copied()
    }

    /// Inserts (or refreshes) the pages of one sequence into `tier` with `residency`, touching them
    /// from last to first (see the module docs), and returns the pages evicted to respect the tier's
    /// capacity, which callers release in the tier's storage.
    pub fn insert(&mut self, tier: Tier, keys: &[PageKey], residency: Residency) -> Vec<PageKey> {
        let mut evicted = Vec::new();
        let set = self.tier_mut(tier);
        for key in keys.iter().rev() {
            set.touch(*key, residency, &mut evicted);
        }
        // A page touched early in this call can be evicted by a later insert of the same call only
        // when the sequence is longer than the capacity; it is then reported evicted, as it is.
        evicted
    }

    /// Marks pending pages of `tier` present once their write is acknowledged. Pages that are no
    /// longer in the tier (evicted or removed while pending) stay absent and are counted in
    /// [`TierCounters::completed_absent`]; the return value is the number of pages made present.
    pub fn complete(&mut self, tier: Tier, keys: &[PageKey]) -> usize {
        let set = self.tier_mut(tier);
        let mut done = 0;
        for key in keys {
            match set.pages.peek_mut(key) {
                Some(r) => {
                    *r = Residency::Present;
                    done += 1;
                }
                None => set.counters.completed_absent += 1,
            }
        }
        done
    }

    /// Removes `key` from `tier` (its storage dropped it, or its write failed). Returns whether it
    /// was there.
    pub fn remove(&mut self, tier: Tier, key: &PageKey) -> bool {
        self.tier_mut(tier).pages.pop(key).is_some()
    }

    /// Keys present (complete) in `tier`, most recently used first.
    pub fn present_keys(&self, tier: Tier) -> Vec<PageKey> {
        self.tiers[tier.index()]
            .pages
            .iter()
            .filter(|(_, r)| **r == Residency::Present)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Counters of `tier`.
    pub fn counters(&self, tier: Tier) -> TierCounters {
        let set = self.tier(tier);
        TierCounters {
            resident: set.pages.len(),
            ..set.counters
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ids: &[u64]) -> Vec<PageKey> {
        ids.iter().copied().map(PageKey::from_trace_id).collect()
    }

    #[test]
    fn pending_pages_are_never_hits() {
        let mut idx = PrefixIndex::unbounded();
        let k = keys(&[1, 2, 3]);
        idx.insert(Tier::L3Store, &k, Residency::Pending);
        assert_eq!(
            idx.lookup(&k).pages(),
            0,
            "a pending L3 write is not an L3 hit"
        );
        idx.complete(Tier::L3Store, &k[..2]);
        let m = idx.lookup(&k);
        assert_eq!(m.tiers, vec![Tier::L3Store, Tier::L3Store]);
    }

    #[test]
    fn lookup_prefers_the_fastest_tier_and_stops_at_the_first_gap() {
        let mut idx = PrefixIndex::unbounded();
        idx.insert(Tier::L3Store, &keys(&[1, 2, 3, 4]), Residency::Present);
        idx.insert(Tier::L1Device, &keys(&[1]), Residency::Present);
        idx.insert(Tier::L2Host, &keys(&[2]), Residency::Present);
        idx.remove(Tier::L3Store, &PageKey::from_trace_id(3));
        let m = idx.lookup(&keys(&[1, 2, 3, 4]));
        assert_eq!(m.tiers, vec![Tier::L1Device, Tier::L2Host]);
        assert_eq!(idx.leading_present(Tier::L3Store, &keys(&[1, 2, 3, 4])), 2);
    }

    #[test]
    fn lru_evicts_leaves_before_their_prefix() {
        let cap = NonZeroUsize::new(3);
        let mut idx = PrefixIndex::new([None, None, cap]);
        idx.insert(Tier::L3Store, &keys(&[1, 2, 3]), Residency::Present);
        let evicted = idx.insert(Tier::L3Store, &keys(&[1, 4]), Residency::Present);
        assert_eq!(
            evicted,
            keys(&[3]),
            "the leaf of the older sequence goes first"
        );
        assert_eq!(idx.lookup(&keys(&[1, 2, 3])).pages(), 2);
    }

    #[test]
    fn a_page_evicted_while_pending_stays_absent_after_completion() {
        let cap = NonZeroUsize::new(1);
        let mut idx = PrefixIndex::new([None, None, cap]);
        idx.insert(Tier::L3Store, &keys(&[1]), Residency::Pending);
        idx.insert(Tier::L3Store, &keys(&[9]), Residency::Present);
        assert_eq!(idx.complete(Tier::L3Store, &keys(&[1])), 0);
        assert_eq!(idx.lookup(&keys(&[1])).pages(), 0);
        let c = idx.counters(Tier::L3Store);
        assert_eq!(
            (c.evicted, c.evicted_pending, c.completed_absent),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_pending_rewrite_does_not_hide_a_present_page() {
        let mut idx = PrefixIndex::unbounded();
        idx.insert(Tier::L2Host, &keys(&[5]), Residency::Present);
        idx.insert(Tier::L2Host, &keys(&[5]), Residency::Pending);
        assert_eq!(
            idx.residency(Tier::L2Host, &PageKey::from_trace_id(5)),
            Some(Residency::Present)
        );
    }
}
