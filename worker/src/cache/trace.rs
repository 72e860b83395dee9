//! The Mooncake conversation trace format and its replay through the [`PrefixIndex`].
//!
//! One JSON object a line: `timestamp` (ms), `input_length`, `output_length` (tokens) and `hash_ids`,
//! one chained prefix id per 512-token block with `len(hash_ids) == ceil(input_length / 512)`
//! (`shared/data/mooncake/README.md`). The file itself is test data and is never copied into the
//! repository: tests read it from `../shared/data/mooncake/` and benchmarks take a path flag.

use std::io::BufRead;

use serde::Deserialize;

use crate::tier::hit_accounting::HitAccounting;
use crate::tier::page_key::PageKey;
use crate::tier::prefix_index::{PrefixIndex, Residency, Tier};

/// Tokens per block of the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival time in ms from the trace start.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Generated length in tokens.
    pub output_length: u64,
    /// Chained prefix ids, one per 512-token block.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The request's page keys (ids taken as chained hashes, [`PageKey::from_trace_id`]).
    pub fn page_keys(&self) -> Vec<PageKey> {
        self.hash_ids
            .iter()
            .copied()
            .map(PageKey::from_trace_id)
            .collect()
    }
}

/// A trace that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading the file failed.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a trace row.
    #[error("trace line {line}: {source}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// `len(hash_ids) != ceil(input_length / 512)`.
    #[error("trace line {line}: {ids} hash ids for {input_length} input tokens (want ceil(n/512))")]
    BlockCount {
        /// 1-based line number.
        line: usize,
        /// Ids on the line.
        ids: usize,
        /// Input length on the line.
        input_length: u64,
    },
    /// A timestamp is smaller than the one before it.
    #[error("trace line {line}: timestamp {timestamp} goes back in time")]
    TimeGoesBack {
        /// 1-based line number.
        line: usize,
        /// The offending timestamp.
        timestamp: u64,
    },
}

/// Parses and validates a whole trace (block counts and non-decreasing timestamps). Blank lines are
/// skipped.
///
/// # Errors
/// The first [`TraceError`] met.
pub fn read_trace(reader: impl BufRead) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    let mut last_ts = 0;
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let req: TraceRequest =
            serde_json::from_str(&line).map_err(|source| TraceError::Parse {
                line: line_no,
                source,
            })?;
        let want = req.input_length.div_ceil(TRACE_BLOCK_TOKENS);
        if req.hash_ids.len() as u64 != want {
            return Err(TraceError::BlockCount {
                line: line_no,
                ids: req.hash_ids.len(),
                input_length: req.input_length,
            });
        }
        if req.timestamp < last_ts {
            return Err(TraceError::TimeGoesBack {
                line: line_no,
                timestamp: req.timestamp,
            });
        }
        last_ts = req.timestamp;
        out.push(req);
    }
    Ok(out)
}

/// Replays `requests` in order through `index` as one tier `tier` would see them: look the prefix
/// up, record the hit, then insert every page of the request as present (a write-through whose
/// writes complete before the next request). Returns the accounting of this replay.
pub fn replay(index: &mut PrefixIndex, tier: Tier, requests: &[TraceRequest]) -> HitAccounting {
    let mut acc = HitAccounting::default();
    for req in requests {
        let keys = req.page_keys();
        let matched = index.lookup(&keys);
        acc.record(req.input_length, TRACE_BLOCK_TOKENS, &matched);
        index.insert(tier, &keys, Residency::Present);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_wrong_block_count_and_time_going_back() {
        let bad = r#"{"timestamp":0,"input_length":513,"output_length":1,"hash_ids":[1]}"#;
        assert!(matches!(
            read_trace(bad.as_bytes()),
            Err(TraceError::BlockCount { line: 1, .. })
        ));
        let back = "{\"timestamp\":5,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n\
                    {\"timestamp\":4,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}";
        assert!(matches!(
            read_trace(back.as_bytes()),
            Err(TraceError::TimeGoesBack { line: 2, .. })
        ));
        assert!(matches!(
            read_trace("{\"timestamp\":0}".as_bytes()),
            Err(TraceError::Parse { .. })
        ));
    }

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
