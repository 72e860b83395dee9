//! The one trace request type: a row of the Mooncake FAST'25 trace schema
//! (worker/interfaces/README.md §7).
//!
//! Schema (kvcache-ai/Mooncake, `FAST25-release/traces/`, e.g. `conversation_trace.jsonl`; the
//! copy in `shared/data/mooncake/README.md`): one JSON object a line with four integer fields:
//!
//! | field | unit | width here | why |
//! | --- | --- | --- | --- |
//! | `timestamp` | ms since the trace start, non-decreasing | `u64` | a `u32` of ms wraps after 49.7 days of trace |
//! | `input_length` | prompt tokens | `u32` | context lengths are far below 2³² tokens (the trace's max is 126,195) |
//! | `output_length` | generated tokens | `u32` | as above (max 2,000) |
//! | `hash_ids` | one id per 512-token block | `u64` | ids are opaque block hashes; the trace numbers them, other producers hash |
//!
//! `hash_ids[i]` identifies the prefix of `(i+1) × 512` tokens, so `len(hash_ids) ==
//! ceil(input_length / 512)` and equal ids mean equal prefixes. The replay tools (e2e), the trace
//! generator and the worker's cache benchmarks all read and write this type.
//!
//! [`TraceReader`] parses and validates a stream of lines from any `BufRead` (a file the caller
//! opened, a string); it does no other I/O.

use std::io::BufRead;

use serde::{Deserialize, Serialize};

/// Tokens per `hash_ids` block in the Mooncake traces.
pub const BLOCK_TOKENS: u32 = 512;

/// One request of a trace, exactly the Mooncake FAST'25 schema (module docs; unknown fields are
/// refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival time in ms, relative to the trace start (non-decreasing over a file).
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Completion length in tokens.
    pub output_length: u32,
    /// Prefix identity, one id per 512-token block ([`BLOCK_TOKENS`]).
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// Blocks a prompt of this length spans: `ceil(input_length / 512)`.
    pub fn blocks(&self) -> usize {
        self.input_length.div_ceil(BLOCK_TOKENS) as usize
    }

    /// Tokens in block `i` of the prompt (512 except a partial last block; 0 past the end).
    pub fn block_len(&self, i: usize) -> u32 {
        block_len(self.input_length, i)
    }

    /// Checks the row on its own: `len(hash_ids) == ceil(input_length / 512)`.
    ///
    /// # Errors
    /// [`LineError::BlockCount`].
    pub fn check(&self) -> Result<(), LineError> {
        if self.hash_ids.len() == self.blocks() {
            Ok(())
        } else {
            Err(LineError::BlockCount {
                ids: self.hash_ids.len(),
                input_length: self.input_length,
                want: self.blocks(),
            })
        }
    }
}

/// Tokens in block `i` of a prompt of `input_length` tokens (512 except a partial last block; 0
/// past the end).
pub fn block_len(input_length: u32, i: usize) -> u32 {
    let start = u32::try_from(i).map_or(u32::MAX, |i| i.saturating_mul(BLOCK_TOKENS));
    input_length.saturating_sub(start).min(BLOCK_TOKENS)
}

/// What is wrong with one line.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Not a JSON object of the schema (missing or unknown field, wrong type).
    #[error("not a trace request: {0}")]
    Parse(#[from] serde_json::Error),
    /// `len(hash_ids) != ceil(input_length / 512)`.
    #[error("{ids} hash_ids for input_length {input_length} (want {want})")]
    BlockCount {
        /// Ids on the line.
        ids: usize,
        /// Input length on the line.
        input_length: u32,
        /// `ceil(input_length / 512)`.
        want: usize,
    },
    /// A timestamp is smaller than the one before it.
    #[error("timestamp {timestamp} goes back (previous {previous})")]
    TimeGoesBack {
        /// The offending timestamp.
        timestamp: u64,
        /// The timestamp of the request before.
        previous: u64,
    },
}

/// A trace that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading from the underlying reader failed.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a valid trace row.
    #[error("trace line {line}: {problem}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        problem: LineError,
    },
}

/// The requests of a JSONL trace, one at a time, validated (block counts, non-decreasing
/// timestamps). Blank lines are skipped. After the first error the iterator ends.
#[derive(Debug)]
pub struct TraceReader<R> {
    lines: std::io::Lines<R>,
    line: usize,
    last_ts: u64,
    failed: bool,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads from `reader`.
    pub fn new(reader: R) -> Self {
        Self {
            lines: reader.lines(),
            line: 0,
            last_ts: 0,
            failed: false,
        }
    }

    fn row(&mut self, text: &str) -> Result<TraceRequest, LineError> {
        let req: TraceRequest = serde_json::from_str(text)?;
        req.check()?;
        if req.timestamp < self.last_ts {
            return Err(LineError::TimeGoesBack {
                timestamp: req.timestamp,
                previous: self.last_ts,
            });
        }
        self.last_ts = req.timestamp;
        Ok(req)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        loop {
            self.line += 1;
            let text = match self.lines.next()? {
                Ok(t) => t,
                Err(e) => {
                    self.failed = true;
                    return Some(Err(TraceError::Io(e)));
                }
            };
            if text.trim().is_empty() {
                continue;
            }
            let line = self.line;
            let out = self
                .row(&text)
                .map_err(|problem| TraceError::Line { line, problem });
            self.failed = out.is_err();
            return Some(out);
        }
    }
}

/// Parses and validates a whole trace ([`TraceReader`]).
///
/// # Errors
/// The first [`TraceError`] met.
pub fn read_trace(reader: impl BufRead) -> Result<Vec<TraceRequest>, TraceError> {
    TraceReader::new(reader).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_wrong_block_count_and_time_going_back() {
        let bad = r#"{"timestamp":0,"input_length":513,"output_length":1,"hash_ids":[1]}"#;
        assert!(matches!(
            read_trace(bad.as_bytes()),
            Err(TraceError::Line {
                line: 1,
                problem: LineError::BlockCount { want: 2, .. }
            })
        ));
        let back = "{\"timestamp\":5,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n\
                    {\"timestamp\":4,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}";
        assert!(matches!(
            read_trace(back.as_bytes()),
            Err(TraceError::Line {
                line: 2,
                problem: LineError::TimeGoesBack {
                    timestamp: 4,
                    previous: 5
                }
            })
        ));
        assert!(matches!(
            read_trace("{\"timestamp\":0}".as_bytes()),
            Err(TraceError::Line {
                problem: LineError::Parse(_),
                ..
            })
        ));
        // An unknown field is refused, not dropped.
        let extra = r#"{"timestamp":0,"input_length":1,"output_length":1,"hash_ids":[1],"x":1}"#;
        assert!(read_trace(extra.as_bytes()).is_err());
    }

    #[test]
    fn widths_are_the_schema_s() {
        // A timestamp past u32::MAX ms and a 64-bit hash id parse; a negative or fractional length
        // does not.
        let big = format!(
            r#"{{"timestamp":{},"input_length":1,"output_length":4000000000,"hash_ids":[{}]}}"#,
            u64::from(u32::MAX) + 1,
            u64::MAX
        );
        let r = read_trace(big.as_bytes()).unwrap();
        assert_eq!(r[0].timestamp, u64::from(u32::MAX) + 1);
        assert_eq!(r[0].hash_ids, [u64::MAX]);
        assert_eq!(r[0].output_length, 4_000_000_000);
        for bad in [
            r#"{"timestamp":0,"input_length":-1,"output_length":1,"hash_ids":[]}"#,
            r#"{"timestamp":0,"input_length":1.5,"output_length":1,"hash_ids":[1]}"#,
            r#"{"timestamp":0,"input_length":4294967296,"output_length":1,"hash_ids":[]}"#,
        ] {
            assert!(read_trace(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn blank_lines_skip_line_numbers_count_and_the_reader_stops_after_an_error() {
        let rows = "\n{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1,2]}\n\n\
                    {\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1]}\n\
                    {\"timestamp\":1,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n";
        let mut it = TraceReader::new(rows.as_bytes());
        assert_eq!(it.next().unwrap().unwrap().hash_ids, [1, 2]);
        match it.next() {
            Some(Err(TraceError::Line { line: 4, .. })) => {}
            other => panic!("want an error on line 4, got {other:?}"),
        }
        assert!(it.next().is_none());
    }

    #[test]
    fn block_lengths_count_the_partial_last_block() {
        assert_eq!(block_len(1100, 0), 512);
        assert_eq!(block_len(1100, 1), 512);
        assert_eq!(block_len(1100, 2), 76);
        assert_eq!(block_len(1100, 3), 0);
        assert_eq!(block_len(1100, usize::MAX), 0);
    }
}
