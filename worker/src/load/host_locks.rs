//! Host-page locks for loads and backups (reference/dataplane.md R-HIC-4, sglang PR #31427).
//!
//! An L2 (host) page that is the source of an in-flight load into L1, or of a backup into L3, is
//! locked from submission until the copy is acknowledged. L2 eviction skips locked pages, so the
//! bytes a copy is reading are never reclaimed under it. Locks count: two loads of one page need two
//! unlocks.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use crate::tier::page_key::PageKey;

/// An unlock of a page that is not locked: a bookkeeping bug of the caller, reported, never ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("host page {0} unlocked more times than it was locked")]
pub struct UnlockUnderflow(pub PageKey);

/// Lock counts of host pages. Thread-safe.
#[derive(Debug, Default)]
pub struct HostPageLocks {
    counts: Mutex<HashMap<PageKey, u32>>,
}

impl HostPageLocks {
    /// An empty lock table.
    pub fn new() -> Self {
        Self::default()
    }

    fn counts(&self) -> MutexGuard<'_, HashMap<PageKey, u32>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Locks each of `keys` once.
    pub fn lock(&self, keys: &[PageKey]) {
        let mut counts = self.counts();
        for k in keys {
            *counts.entry(*k).or_insert(0) += 1;
        }
    }

    /// Unlocks each of `keys` once.
    ///
    /// # Errors
    /// [`UnlockUnderflow`] for the first key that was not locked (the others are still unlocked).
    pub fn unlock(&self, keys: &[PageKey]) -> Result<(), UnlockUnderflow> {
        let mut counts = self.counts();
        let mut first_err = None;
        for k in keys {
            match counts.get_mut(k) {
                Some(c) if *c > 1 => *c -= 1,
                Some(_) => {
                    counts.remove(k);
                }
                None => {
                    first_err.get_or_insert(UnlockUnderflow(*k));
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Whether `key` is locked.
    pub fn is_locked(&self, key: &PageKey) -> bool {
        self.counts().contains_key(key)
    }

    /// Pages currently locked.
    pub fn locked_pages(&self) -> usize {
        self.counts().len()
    }

    /// Chooses up to `n` eviction victims from `candidates` (least recently used first), skipping
    /// locked pages. Eviction with `EvictionPolicy::UnsafeIgnoreLocks` (feature `negative-controls`)
    /// is the negative control of the lock rule and takes the first `n` whatever their locks.
    pub fn pick_victims(
        &self,
        candidates: impl IntoIterator<Item = PageKey>,
        n: usize,
        policy: EvictionPolicy,
    ) -> Vec<PageKey> {
        let counts = self.counts();
        candidates
            .into_iter()
            .filter(|k| policy.ignores_locks() || !counts.contains_key(k))
            .take(n)
            .collect()
    }
}

/// How L2 eviction treats locked pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Skip locked pages (the rule).
    SkipLocked,
    /// Negative control: evict locked pages too (the sglang #30321 bug).
    #[cfg(feature = "negative-controls")]
    UnsafeIgnoreLocks,
}

impl EvictionPolicy {
    /// Whether locked pages may be evicted (only under the negative control).
    fn ignores_locks(self) -> bool {
        match self {
            EvictionPolicy::SkipLocked => false,
            #[cfg(feature = "negative-controls")]
            EvictionPolicy::UnsafeIgnoreLocks => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_skips_locked_pages_until_unlocked() {
        let locks = HostPageLocks::new();
        let keys: Vec<PageKey> = (1..=4).map(PageKey::from_trace_id).collect();
        locks.lock(&keys[..2]);
        locks.lock(&keys[..1]);
        assert_eq!(
            locks.pick_victims(keys.clone(), 2, EvictionPolicy::SkipLocked),
            keys[2..].to_vec()
        );
        assert_eq!(
            locks.pick_victims(keys.clone(), 2, EvictionPolicy::UnsafeIgnoreLocks),
            keys[..2].to_vec()
        );
        locks.unlock(&keys[..2]).expect("locked");
        assert!(locks.is_locked(&keys[0]), "locked twice, unlocked once");
        assert!(!locks.is_locked(&keys[1]));
        assert_eq!(locks.unlock(&keys[1..2]), Err(UnlockUnderflow(keys[1])));
    }
}
