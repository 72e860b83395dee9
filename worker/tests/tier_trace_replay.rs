//! Replays the Mooncake conversation trace through the prefix index (reference TC-TR-03).
//!
//! The trace is read from `../shared/data/mooncake/conversation_trace.jsonl` (never copied into the
//! repository); `TANDEM_MOONCAKE_TRACE` overrides the path. Without the file the test prints why and
//! passes without checking anything, unless `TANDEM_REQUIRE_DATA=1` (CI): then it fails.

mod l3_support;

use std::num::NonZeroUsize;

use l3_support::load_trace;
use tandem_worker::tier::trace::{TracePageKeys, replay};
use tandem_worker::tier::{PrefixIndex, Tier};

fn l3_only(capacity_pages: Option<usize>) -> PrefixIndex {
    PrefixIndex::new([None, None, capacity_pages.and_then(NonZeroUsize::new)])
}

#[test]
fn unbounded_replay_gives_the_readme_hit_ratio_and_bounded_lru_is_monotone() {
    let Some(requests) = load_trace() else { return };
    assert_eq!(requests.len(), 12_031, "row count of the README");
    let refs: usize = requests.iter().map(|r| r.hash_ids.len()).sum();
    assert_eq!(refs, 288_500, "block references of the README");

    let mut unbounded = l3_only(None);
    let acc = replay(&mut unbounded, Tier::L3Store, &requests);
    let ratio = acc.token_hit_ratio();
    println!("unbounded: token hit ratio {ratio:.4}");
    assert!(
        (ratio - 0.374).abs() <= 0.001,
        "README says 0.374, got {ratio}"
    );
    assert_eq!(
        unbounded.counters(Tier::L3Store).resident,
        182_790,
        "distinct ids"
    );
    assert_eq!(
        acc.tier_hit_ratio(Tier::L3Store),
        ratio,
        "one tier serves everything"
    );

    // Shrinking capacity never raises the hit ratio (LRU inclusion property).
    let mut previous = ratio;
    for cap in [150_000, 100_000, 50_000, 20_000, 5_000, 1_000] {
        let mut idx = l3_only(Some(cap));
        let r = replay(&mut idx, Tier::L3Store, &requests).token_hit_ratio();
        println!("capacity {cap:>7} pages: token hit ratio {r:.4}");
        assert!(
            r <= previous + 1e-12,
            "capacity {cap}: {r} rose above {previous} of the larger capacity"
        );
        assert!(idx.counters(Tier::L3Store).resident <= cap);
        previous = r;
    }
    assert!(previous < ratio, "the smallest capacity must lose hits");
}

#[test]
fn pending_l3_writes_are_not_counted_as_hits_during_a_replay() {
    let Some(requests) = load_trace() else { return };
    let head = &requests[..2_000];
    // Same replay, but every write stays pending: no lookup may hit.
    let mut idx = l3_only(None);
    let mut acc = tandem_worker::tier::HitAccounting::default();
    for r in head {
        let keys = r.page_keys();
        acc.record(u64::from(r.input_length), 512, &idx.lookup(&keys));
        idx.insert(
            Tier::L3Store,
            &keys,
            tandem_worker::tier::Residency::Pending,
        );
    }
    assert_eq!(acc.total_hit_tokens(), 0);
    let mut done = l3_only(None);
    assert!(replay(&mut done, Tier::L3Store, head).total_hit_tokens() > 0);
}
