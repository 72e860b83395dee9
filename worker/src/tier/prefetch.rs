//! Prefetch from L3 with a bounded wait, and what may be published afterwards (reference/
//! dataplane.md R-HIC-5, R-HIC-6; TC-HIC-06, TC-HIC-07).
//!
//! - A prefetch runs in batches of at most [`PREFETCH_BATCH_PAGES`] pages; under the `Timeout`
//!   policy it stops at its deadline (`base + per_ki_token × tokens / 1024`, capped), and the
//!   batches that finished are kept (SGLang HiCache `STORAGE_BATCH_SIZE`, `PrefetchTimeoutConfig`).
//! - What becomes usable is the **leading contiguous** run of pages that every required pool covers
//!   (KV and sidecar pools such as the indexer, all "all pages" pools): the MIN over pools
//!   (sglang #30057 / PR #30738: KV restored without its indexer pages must not be published). TP and
//!   CP ranks then agree on the MIN of their counts (PR #20460: CP groups must take part).

use std::time::{Duration, Instant};

/// Pages per prefetch I/O batch.
pub const PREFETCH_BATCH_PAGES: usize = 128;

/// When a prefetch stops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefetchPolicy {
    /// Use whatever finished by the time the request is scheduled (no wait of its own).
    BestEffort,
    /// Wait until every page is fetched.
    WaitComplete,
    /// Wait at most `base + per_ki_token × tokens / 1024`, capped at `max`.
    Timeout {
        /// Fixed part.
        base: Duration,
        /// Part per 1024 prompt tokens.
        per_ki_token: Duration,
        /// Cap.
        max: Duration,
    },
}

impl PrefetchPolicy {
    /// The SGLang defaults: 2 s + 0.1 s per Ki tokens, capped at 30 s.
    pub const DEFAULT_TIMEOUT: PrefetchPolicy = PrefetchPolicy::Timeout {
        base: Duration::from_secs(2),
        per_ki_token: Duration::from_millis(100),
        max: Duration::from_secs(30),
    };

    /// The wait allowed for a prompt of `tokens` tokens: `None` for no bound (`WaitComplete`),
    /// zero for `BestEffort`.
    pub fn budget(&self, tokens: u64) -> Option<Duration> {
        match *self {
            PrefetchPolicy::BestEffort => Some(Duration::ZERO),
            PrefetchPolicy::WaitComplete => None,
            PrefetchPolicy::Timeout {
                base,
                per_ki_token,
                max,
            } => {
                let extra = per_ki_token.as_secs_f64() * tokens as f64 / 1024.0;
                Some((base + Duration::from_secs_f64(extra)).min(max))
            }
        }
    }
}

/// The outcome of a prefetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchOutcome {
    /// Leading pages fetched (whole batches, in order).
    pub pages: usize,
    /// Whether the deadline stopped it before the end.
    pub timed_out: bool,
}

/// Fetches `pages` pages in batches with `fetch_batch(start, len)`, which returns how many of the
/// batch's leading pages it fetched (a short count ends the prefetch there). Stops at the policy's
/// deadline between batches; finished batches are kept. `BestEffort` fetches the first batch only
/// if its budget allows, i.e. not at all: the caller schedules with what is already resident.
pub fn prefetch(
    pages: usize,
    tokens: u64,
    policy: PrefetchPolicy,
    mut fetch_batch: impl FnMut(usize, usize) -> usize,
) -> PrefetchOutcome {
    let deadline = policy.budget(tokens).map(|b| Instant::now() + b);
    let mut done = 0;
    while done < pages {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return PrefetchOutcome {
                pages: done,
                timed_out: true,
            };
        }
        let len = PREFETCH_BATCH_PAGES.min(pages - done);
        let got = fetch_batch(done, len).min(len);
        done += got;
        if got < len {
            break;
        }
    }
    PrefetchOutcome {
        pages: done,
        timed_out: false,
    }
}

/// The pages that may be published: the MIN over the required pools' leading contiguous coverage
/// (R-HIC-5). No pools → 0.
pub fn publishable_pages(leading_coverage_per_pool: &[usize]) -> usize {
    leading_coverage_per_pool.iter().copied().min().unwrap_or(0)
}

/// The count every TP and CP rank agrees on: the MIN of the ranks' counts (TC-HIC-06). No ranks → 0.
pub fn agree_across_ranks(per_rank: &[usize]) -> usize {
    per_rank.iter().copied().min().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_budget_follows_the_formula_and_the_cap() {
        let p = PrefetchPolicy::DEFAULT_TIMEOUT;
        assert_eq!(p.budget(0), Some(Duration::from_secs(2)));
        assert_eq!(p.budget(10 * 1024), Some(Duration::from_secs(3)));
        assert_eq!(p.budget(1 << 30), Some(Duration::from_secs(30)));
        assert_eq!(PrefetchPolicy::WaitComplete.budget(5), None);
        assert_eq!(PrefetchPolicy::BestEffort.budget(5), Some(Duration::ZERO));
    }

    #[test]
    fn a_timed_out_prefetch_keeps_the_batches_that_finished() {
        let policy = PrefetchPolicy::Timeout {
            base: Duration::from_millis(30),
            per_ki_token: Duration::ZERO,
            max: Duration::from_secs(1),
        };
        let out = prefetch(1_000, 0, policy, |_, len| {
            std::thread::sleep(Duration::from_millis(20));
            len
        });
        assert!(out.timed_out);
        assert_eq!(out.pages % PREFETCH_BATCH_PAGES, 0);
        assert!(out.pages >= PREFETCH_BATCH_PAGES && out.pages < 1_000);
        let full = prefetch(300, 0, PrefetchPolicy::WaitComplete, |_, len| len);
        assert_eq!(
            full,
            PrefetchOutcome {
                pages: 300,
                timed_out: false
            }
        );
        let short = prefetch(300, 0, PrefetchPolicy::WaitComplete, |start, len| {
            if start == 128 { 5 } else { len }
        });
        assert_eq!(short.pages, 133, "a short batch ends the contiguous prefix");
    }

    #[test]
    fn publication_is_the_min_over_pools_and_ranks() {
        // KV restored 40 pages, the indexer only 32: publish 32 (sglang #30057).
        assert_eq!(publishable_pages(&[40, 32]), 32);
        assert_eq!(publishable_pages(&[]), 0);
        assert_eq!(agree_across_ranks(&[10, 8, 9]), 8);
    }
}
