//! L2 → L3 backup with honest residency: a page is marked `Pending` in L3 from the moment its put
//! starts and `Present` only once the store acknowledged it, so the prefix index never reports an L3
//! hit the store cannot serve (reference/dataplane.md R-L3-4, R-L3-5; sglang #39444).

use std::sync::{Mutex, MutexGuard};

use super::manifest::ObjectKey;
use super::replay::L3Backend;
use crate::tier::prefix_index::{PrefixIndex, Residency, Tier};

/// How a backup marks its pages in the index while the puts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackupMarking {
    /// `Pending` until acknowledged (the rule).
    Honest,
    /// Negative control: `Present` at submission, before the store has the bytes (feature
    /// `negative-controls`).
    #[cfg(feature = "negative-controls")]
    UnsafeOptimistic,
}

fn lock(index: &Mutex<PrefixIndex>) -> MutexGuard<'_, PrefixIndex> {
    index.lock().unwrap_or_else(|p| p.into_inner())
}

/// Backs up the pages of one sequence: marks them in L3, puts each object, then marks the
/// acknowledged ones present and removes the failed ones. The index lock is not held during puts.
/// Returns the number of pages acknowledged.
///
/// # Errors
/// None: a failed put unmarks its page and is reported in the count (the first error is logged).
pub fn backup_sequence<B: L3Backend>(
    index: &Mutex<PrefixIndex>,
    store: &B,
    objects: &[ObjectKey],
    data: impl Fn(&ObjectKey) -> Vec<u8>,
    marking: BackupMarking,
) -> usize {
    let pages: Vec<_> = objects.iter().map(|o| o.page).collect();
    let residency = match marking {
        BackupMarking::Honest => Residency::Pending,
        #[cfg(feature = "negative-controls")]
        BackupMarking::UnsafeOptimistic => Residency::Present,
    };
    lock(index).insert(Tier::L3Store, &pages, residency);
    let mut acked = Vec::new();
    let mut failed = Vec::new();
    for object in objects {
        match store.put(*object, &data(object)) {
            Ok(()) => acked.push(object.page),
            Err(e) => {
                if failed.is_empty() {
                    tracing::warn!(object = %object, error = %e, "L3 backup put failed; page not in L3");
                }
                failed.push(object.page);
            }
        }
    }
    let mut idx = lock(index);
    idx.complete(Tier::L3Store, &acked);
    for page in &failed {
        idx.remove(Tier::L3Store, page);
    }
    acked.len()
}
