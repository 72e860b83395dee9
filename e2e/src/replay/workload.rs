//! Workloads in the Mooncake trace schema: the real trace loader and a seeded generator.
//!
//! One request a line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [u64]}` (Mooncake FAST'25 `conversation_trace.jsonl`, see
//! `shared/data/mooncake/README.md`). `hash_ids[i]` identifies the prefix of `(i+1) × 512` tokens,
//! so `len(hash_ids) == ceil(input_length / 512)` and equal ids mean equal prefixes. The request
//! type and its parser are the worker's (`tandem_interfaces::trace`, worker/interfaces/README.md
//! §7).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tandem_interfaces::trace::{TraceError, TraceReader};

/// One request of a workload, exactly the trace's schema; tokens per `hash_ids` block; tokens in
/// block `i` of a prompt.
pub use tandem_interfaces::trace::{BLOCK_TOKENS, TraceRequest, block_len};

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is not a trace request.
    #[error("{path}:{line}: {message}")]
    Malformed {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
}

/// Reads the first `limit` requests (all when `None`) of a JSONL trace ([`TraceReader`]). Blank
/// lines are skipped.
///
/// Errors: [`WorkloadError::Io`] when the file cannot be read, [`WorkloadError::Malformed`] for a
/// line that does not parse, a timestamp that goes backwards, or a block count that contradicts
/// `input_length` (`len(hash_ids) != ceil(input_length / 512)`).
pub fn load_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRequest>, WorkloadError> {
    let file = std::fs::File::open(path).map_err(|source| WorkloadError::Io {
        path: path.to_owned(),
        source,
    })?;
    TraceReader::new(std::io::BufReader::new(file))
        .take(limit.unwrap_or(usize::MAX))
        .collect::<Result<_, _>>()
        .map_err(|e| match e {
            TraceError::Io(source) => WorkloadError::Io {
                path: path.to_owned(),
                source,
            },
            TraceError::Line { line, problem } => WorkloadError::Malformed {
                path: path.to_owned(),
                line,
                message: problem.to_string(),
            },
        })
}

/// The workload of the `--trace` / `--requests` flags: the trace's first `requests` lines, or
/// `requests` generated ones (default [`GeneratorConfig::default`]'s 300). Also returns a
/// description of the source for the report.
pub fn select_workload(
    trace: Option<&Path>,
    requests: Option<usize>,
) -> Result<(Vec<TraceRequest>, String), WorkloadError> {
    match trace {
        Some(path) => Ok((
            load_trace(path, requests)?,
            format!("trace {}", path.display()),
        )),
        None => {
            let cfg = GeneratorConfig {
                requests: requests.unwrap_or(GeneratorConfig::default().requests),
                ..GeneratorConfig::default()
            };
            Ok((generate(&cfg), format!("generated (seed {})", cfg.seed)))
        }
    }
}

/// Token-weighted prefix hit ratio with an unbounded cache (the trace README's definition): per
/// request, count the tokens of the leading run of blocks whose ids were seen before (a partial
/// last block counts its real length), then remember all its ids. 0 for an empty workload.
pub fn unbounded_hit_ratio(requests: &[TraceRequest]) -> f64 {
    let hit: u64 = ceiling_hit_tokens(requests).iter().sum();
    let total: u64 = requests.iter().map(|r| u64::from(r.input_length)).sum();
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

/// Per request, in workload order, the prefix tokens an unbounded cache serves when the requests
/// run one after another in that order (the terms of [`unbounded_hit_ratio`]).
pub fn ceiling_hit_tokens(requests: &[TraceRequest]) -> Vec<u64> {
    let mut seen = HashSet::new();
    requests
        .iter()
        .map(|r| {
            let mut hit = 0u64;
            for (i, id) in r.hash_ids.iter().enumerate() {
                if !seen.contains(id) {
                    break;
                }
                hit += u64::from(block_len(r.input_length, i));
            }
            seen.extend(r.hash_ids.iter().copied());
            hit
        })
        .collect()
}

/// Knobs of [`generate`]. The defaults make a few-minute demo workload whose unbounded hit ratio
/// is around 0.5 (shared system prompts plus multi-turn conversations).
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratorConfig {
    /// Number of requests.
    pub requests: usize,
    /// RNG seed: the same seed gives the same workload.
    pub seed: u64,
    /// Mean arrival rate (requests/s, Poisson arrivals).
    pub rate_per_s: f64,
    /// Distinct shared system prompts.
    pub system_prompts: usize,
    /// Blocks in a system prompt (each one 512 tokens).
    pub system_prompt_blocks: std::ops::RangeInclusive<u32>,
    /// Probability that a request continues an earlier conversation (its whole prompt is the
    /// prefix of the new one).
    pub follow_up: f64,
    /// New blocks a turn adds (the last one may be partial).
    pub turn_blocks: std::ops::RangeInclusive<u32>,
    /// Prompts stop growing at this many blocks (a longer conversation starts over).
    pub max_blocks: u32,
    /// Completion length range (tokens).
    pub output_tokens: std::ops::RangeInclusive<u32>,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        Self {
            requests: 300,
            seed: 42,
            rate_per_s: 5.0,
            system_prompts: 6,
            system_prompt_blocks: 1..=4,
            follow_up: 0.5,
            turn_blocks: 1..=3,
            max_blocks: 24,
            output_tokens: 16..=192,
        }
    }
}

/// Generates a workload in the trace schema. Deterministic in `config` (seeded RNG); ids form a
/// tree like the real trace's (an id always has the same parent), timestamps are non-decreasing.
pub fn generate(config: &GeneratorConfig) -> Vec<TraceRequest> {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut next_id = 0u64;
    let mut fresh = |n: u32| -> Vec<u64> {
        let ids = (next_id..next_id + u64::from(n)).collect();
        next_id += u64::from(n);
        ids
    };
    let prompts: Vec<Vec<u64>> = (0..config.system_prompts.max(1))
        .map(|_| fresh(rng.random_range(config.system_prompt_blocks.clone())))
        .collect();
    // Full-block prompts of earlier turns that a follow-up may extend.
    let mut conversations: Vec<Vec<u64>> = Vec::new();
    let mut t_ms = 0.0f64;
    let mut out = Vec::with_capacity(config.requests);
    for _ in 0..config.requests {
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        t_ms += -u.ln() / config.rate_per_s.max(1e-9) * 1000.0;
        let follow = !conversations.is_empty() && rng.random_bool(config.follow_up.clamp(0.0, 1.0));
        let mut prefix = if follow {
            let i = rng.random_range(0..conversations.len());
            conversations[i].clone()
        } else {
            // Zipf-like skew: low-numbered system prompts are shared more.
            let k = prompts.len();
            let i = ((rng.random_range(0.0..1.0f64)).powi(2) * k as f64) as usize;
            prompts[i.min(k - 1)].clone()
        };
        let turn = rng.random_range(config.turn_blocks.clone()).max(1);
        if prefix.len() as u32 + turn > config.max_blocks {
            prefix.truncate(prompts[0].len().min(prefix.len()));
        }
        let mut ids = prefix;
        ids.extend(fresh(turn));
        let partial = rng.random_range(1..=BLOCK_TOKENS);
        let input_length = (ids.len() as u32 - 1) * BLOCK_TOKENS + partial;
        // Only whole blocks may be shared by a later turn: the partial last id is this request's.
        conversations.push(ids[..ids.len() - 1].to_vec());
        out.push(TraceRequest {
            timestamp: t_ms as u64,
            input_length,
            output_length: rng.random_range(config.output_tokens.clone()),
            hash_ids: ids,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbounded_hit_ratio_counts_the_leading_run_only() {
        let r = |ids: &[u64], len| TraceRequest {
            timestamp: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        // Second request: block 0 seen (512), block 1 new, block 2 seen but after a miss (0).
        let reqs = [r(&[1, 2, 3], 1536), r(&[1, 9, 3], 1536)];
        let want = 512.0 / 3072.0;
        assert!((unbounded_hit_ratio(&reqs) - want).abs() < 1e-12);
        assert_eq!(unbounded_hit_ratio(&[]), 0.0);
    }

    #[test]
    fn generator_obeys_the_trace_schema_and_shares_prefixes() {
        let reqs = generate(&GeneratorConfig::default());
        assert_eq!(reqs.len(), 300);
        let mut parent = std::collections::HashMap::new();
        for (i, r) in reqs.iter().enumerate() {
            assert_eq!(
                r.hash_ids.len(),
                r.input_length.div_ceil(BLOCK_TOKENS) as usize
            );
            assert!(r.output_length >= 16 && r.output_length <= 192);
            if i > 0 {
                assert!(r.timestamp >= reqs[i - 1].timestamp);
            }
            for w in 0..r.hash_ids.len() {
                let p = if w == 0 {
                    None
                } else {
                    Some(r.hash_ids[w - 1])
                };
                let prev = parent.insert(r.hash_ids[w], p);
                assert!(prev.is_none() || prev == Some(p), "id with two parents");
            }
        }
        let ratio = unbounded_hit_ratio(&reqs);
        assert!((0.2..0.9).contains(&ratio), "hit ratio {ratio}");
        // The lines serialise to the trace schema and parse back.
        let line = serde_json::to_string(&reqs[0]).unwrap();
        assert!(line.contains("\"timestamp\"") && line.contains("\"hash_ids\""));
        assert_eq!(
            serde_json::from_str::<TraceRequest>(&line).unwrap(),
            reqs[0]
        );
    }

    #[test]
    fn generator_is_deterministic_in_its_seed() {
        let a = generate(&GeneratorConfig::default());
        assert_eq!(a, generate(&GeneratorConfig::default()));
        let b = generate(&GeneratorConfig {
            seed: 7,
            ..GeneratorConfig::default()
        });
        assert_ne!(a, b);
    }
}

/// Fewest full prompt blocks a turn must have to be matched with a next turn: one full block is
/// typically a system prompt many unrelated requests share, so it names no session.
pub const SESSION_MIN_FULL_BLOCKS: usize = 2;

/// Each request's **next turn** in its session (issue 15): the index of the first later request
/// (strictly later timestamp: the answer must exist before the next prompt) whose `hash_ids` start
/// with this request's *full* prompt blocks (`floor(input / 512)`, at least
/// [`SESSION_MIN_FULL_BLOCKS`]) and whose prompt holds this turn's prompt and answer (its input is
/// at least this turn's input plus output). Full blocks only: the last block of a prompt is usually partial, and its
/// hash changes once the conversation appends to it (matching the whole chain, the rule before
/// this one, found 8 sessions in the 12,031-request conversation trace). One to one: a request
/// continues at most one earlier turn — the one with the longest matching prefix, the most recent
/// of equals (the trace has sibling requests with identical prompts; only one of them is the turn
/// the conversation went on from). `None` for a request with no next turn. Pure; O(total blocks +
/// candidates tried); the requests must be in timestamp order, as trace files are.
pub fn next_turns(requests: &[TraceRequest]) -> Vec<Option<usize>> {
    let block = 512u64;
    let mut out = vec![None; requests.len()];
    // Requests still waiting for a next turn, by (full blocks, last full block's id).
    let mut waiting: std::collections::HashMap<(usize, u64), Vec<usize>> = Default::default();
    for (j, r) in requests.iter().enumerate() {
        // Longest prefix first: the first key with a turn this request continues wins.
        for (k, id) in r.hash_ids.iter().enumerate().rev() {
            let Some(prev) = waiting.get_mut(&(k + 1, *id)) else {
                continue;
            };
            let continues = |i: usize| {
                let p = &requests[i];
                u64::from(r.input_length) >= u64::from(p.input_length) + u64::from(p.output_length)
                    && r.timestamp > p.timestamp
            };
            let Some(pos) = prev.iter().rposition(|&i| continues(i)) else {
                continue;
            };
            out[prev.remove(pos)] = Some(j);
            if prev.is_empty() {
                waiting.remove(&(k + 1, *id));
            }
            break;
        }
        let full = (u64::from(r.input_length) / block) as usize;
        if full >= SESSION_MIN_FULL_BLOCKS
            && let Some(last) = r.hash_ids.get(full - 1)
        {
            waiting.entry((full, *last)).or_default().push(j);
        }
    }
    out
}

/// Each request's session KV after its turn, for snapshot sync (issue 15): the first
/// `floor((input + output) / 512)` hashes of its next turn ([`next_turns`]) — the full pages of
/// this turn's prompt and answer, the ones whose keys the next turn shares — at most the next
/// turn's length. Empty for a request with no next turn. Pure.
pub fn session_kv_hashes(requests: &[TraceRequest]) -> Vec<Vec<u64>> {
    // One hash id per 512-token block (worker/interfaces/README.md §7).
    let block = 512u64;
    next_turns(requests)
        .into_iter()
        .zip(requests)
        .map(|(next, p)| {
            next.map_or_else(Vec::new, |j| {
                let ids = &requests[j].hash_ids;
                let pages = (u64::from(p.input_length) + u64::from(p.output_length)) / block;
                ids[..(pages as usize).min(ids.len())].to_vec()
            })
        })
        .collect()
}

#[cfg(test)]
mod session_tests {
    use super::*;

    fn req(
        timestamp: u64,
        input_length: u32,
        output_length: u32,
        hash_ids: &[u64],
    ) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length,
            output_length,
            hash_ids: hash_ids.to_vec(),
        }
    }

    #[test]
    fn a_next_turn_extends_the_full_blocks_and_holds_the_answer() {
        let w = [
            // Turn 1: 1400 tokens (2 full blocks, the third partial), 300 generated.
            req(0, 1400, 300, &[1, 2, 3]),
            // Same second: not a next turn (its answer does not exist yet).
            req(0, 2300, 5, &[1, 2, 8, 9, 10]),
            // Shares the full blocks but is shorter than turn 1's prompt and answer.
            req(1, 1600, 5, &[1, 2, 7, 11]),
            // Turn 2: the partial block's hash changed (3 -> 4), the answer is in the prompt.
            req(2, 2300, 5, &[1, 2, 4, 5, 6]),
            // One full block only: a shared system prompt, no session.
            req(3, 700, 800, &[1, 12]),
            req(4, 3000, 5, &[1, 12, 13, 14, 15, 16]),
        ];
        let s = session_kv_hashes(&w);
        assert_eq!(next_turns(&w)[0], Some(3));
        // 1700 tokens after turn 1: 3 full pages of turn 2's chain.
        assert_eq!(s[0], vec![1, 2, 4]);
        assert!(s[2].is_empty(), "no later request extends [1, 2, 7]");
        assert!(s[4].is_empty(), "one full block names no session");
        assert!(s[5].is_empty(), "the last turn has none");
    }

    #[test]
    fn the_session_kv_is_capped_at_the_next_turns_length() {
        let w = [
            req(0, 1100, 2000, &[1, 2, 3]),
            req(1, 3100, 5, &[1, 2, 5, 6, 7, 8, 9]),
        ];
        // 3100 tokens = 6 full pages, and the next turn has 7 blocks.
        assert_eq!(session_kv_hashes(&w)[0], vec![1, 2, 5, 6, 7, 8]);
        let w = [req(0, 1100, 2000, &[1, 2, 3]), req(1, 3100, 5, &[1, 2, 5])];
        assert_eq!(session_kv_hashes(&w)[0], vec![1, 2, 5]);
    }

    /// Siblings with the same prompt: the later request continues only the most recent of them.
    #[test]
    fn a_request_continues_one_turn_the_most_recent_of_siblings() {
        let w = [
            req(0, 1100, 100, &[1, 2, 3]),
            req(1, 1100, 100, &[1, 2, 3]),
            req(2, 2000, 5, &[1, 2, 4, 5]),
            req(3, 2000, 5, &[1, 2, 4, 6]),
        ];
        let n = next_turns(&w);
        assert_eq!(n[1], Some(2), "the most recent sibling");
        assert_eq!(
            n[0],
            Some(3),
            "the other sibling waits for its own next turn"
        );
    }

    /// On the conversation trace: the rule finds sessions (the old whole-chain rule found 8).
    #[test]
    fn the_conversation_trace_has_sessions() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/data/mooncake/conversation_trace.jsonl");
        let Ok(text) = std::fs::read_to_string(&path) else {
            assert!(
                std::env::var_os("TANDEM_REQUIRE_DATA").is_none_or(|v| v != "1"),
                "TANDEM_REQUIRE_DATA=1 and no trace at {}",
                path.display()
            );
            return;
        };
        let w: Vec<TraceRequest> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let next = next_turns(&w);
        let with_next = next.iter().flatten().count();
        let targets: std::collections::BTreeSet<usize> = next.iter().flatten().copied().collect();
        assert_eq!(targets.len(), with_next, "one to one");
        assert!(with_next > 3000, "{with_next} sessions with a next turn");
        println!("{with_next} of {} requests have a next turn", w.len());
    }
}
