//! The Mooncake conversation trace and its replay through the [`PrefixIndex`].
//!
//! The request type and its parser cross process boundaries (the e2e replay tools write and read
//! the same rows) and live in `tandem-interfaces` (worker/interfaces/README.md §7: one JSON object
//! a line, `timestamp` (ms), `input_length`, `output_length` (tokens) and `hash_ids`, one chained
//! prefix id per 512-token block). The file itself is test data and is never copied into the
//! repository: tests read it from `../shared/data/mooncake/` and benchmarks take a path flag.

pub use tandem_interfaces::trace::{LineError, TraceError, TraceReader, TraceRequest, read_trace};

use super::hit_accounting::HitAccounting;
use super::page_key::PageKey;
use super::prefix_index::{PrefixIndex, Residency, Tier};

/// Tokens per block of the Mooncake traces, as the `u64` the hit accounting counts in
/// ([`tandem_interfaces::trace::BLOCK_TOKENS`]).
pub const TRACE_BLOCK_TOKENS: u64 = tandem_interfaces::trace::BLOCK_TOKENS as u64;

/// The page keys of a trace request.
pub trait TracePageKeys {
    /// The request's page keys (ids taken as chained hashes, [`PageKey::from_trace_id`]).
    fn page_keys(&self) -> Vec<PageKey>;
}

impl TracePageKeys for TraceRequest {
    fn page_keys(&self) -> Vec<PageKey> {
        self.hash_ids
            .iter()
            .copied()
            .map(PageKey::from_trace_id)
            .collect()
    }
}

/// Replays `requests` in order through `index` as one tier `tier` would see them: look the prefix
/// up, record the hit, then insert every page of the request as present (a write-through whose
/// writes complete before the next request). Returns the accounting of this replay.
pub fn replay(index: &mut PrefixIndex, tier: Tier, requests: &[TraceRequest]) -> HitAccounting {
    let mut acc = HitAccounting::default();
    for req in requests {
        let keys = req.page_keys();
        let matched = index.lookup(&keys);
        acc.record(u64::from(req.input_length), TRACE_BLOCK_TOKENS, &matched);
        index.insert(tier, &keys, Residency::Present);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_counts_the_leading_run_only() {
        let rows = "{\"timestamp\":0,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[1,2]}\n\
                    {\"timestamp\":1,\"input_length\":1500,\"output_length\":1,\"hash_ids\":[1,3,4]}\n\
                    {\"timestamp\":2,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1,2]}";
        let reqs = read_trace(rows.as_bytes()).expect("valid rows");
        let mut idx = PrefixIndex::unbounded();
        let acc = replay(&mut idx, Tier::L3Store, &reqs);
        // Request 2 hits block 1 (512 tokens); request 3 hits both blocks (512 + 88).
        assert_eq!(acc.total_hit_tokens(), 512 + 600);
        assert_eq!(acc.lookup_tokens, 1024 + 1500 + 600);
    }
}
