//! `tandem-bench routing`: prefix-aware prefill selection against round-robin on the Mooncake
//! conversation trace, in the same run (issue 16 item 2).
//!
//! A trace-driven model of the demo's serving path, with the worker's own pieces where they
//! decide the figures: the decode's chooser ([`tandem_worker::roles::decode::routing::choose`]
//! and its [`AffinityTable`]), each prefill's L2 as a bounded [`PrefixIndex`] of page keys, and
//! the CacheTier's L3 as one shared index (write-through: every computed page is put). Time is a
//! model: each prefill is one FIFO server that spends `--us-per-token` per prompt token it
//! computes, `--l3-us-per-token` per token it loads from L3, nothing for L2 hits; requests arrive
//! at their trace timestamps × `--time-scale`; the front door spreads them over `--decodes`
//! decode workers in turn, each with its own affinity table and its own count of rooms in flight
//! per prefill (what a decode worker knows).
//!
//! Three settings, each with round-robin, `affinity` and `least-work` (the decode's default): L2
//! only (no CacheTier), the demo's L3 capacity, and an L3 that holds the whole working set; plus
//! the ceiling — one unbounded cache that sees every request. Each decode counts, per prefill, its
//! rooms in flight and the blocks they compute (their blocks the prefill did not hold by its
//! table), as the worker's `PeerSet` does. Printed per row: token hit ratio by tier, the ratio to the ceiling, TTFT p50/p99
//! (model), and the prefill queue imbalance (busiest prefill's compute time / the mean).
//!
//! Defaults are the demo's: 4 prefills, 1 decode; L2 1 GiB per prefill at the demo's 1,024 KV bytes
//! per token (pages of 512 tokens × 80 layers × 16 B = 640 KiB: 1,638 pages); L3 2 replicas of
//! 4 GiB (13,107 pages); 20 µs per computed token (the simulated engine's default).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use tandem_worker::roles::decode::routing::{self, AffinityTable, Candidate, Routing};
use tandem_worker::tier::hit_accounting::page_token_len;
use tandem_worker::tier::trace::{TRACE_BLOCK_TOKENS, TracePageKeys, TraceRequest, read_trace};
use tandem_worker::tier::{PrefixIndex, Residency, Tier};

/// Arguments of `tandem-bench routing`.
#[derive(Debug, Clone, clap::Args)]
pub struct RoutingArgs {
    /// The Mooncake conversation trace (JSON lines).
    #[arg(
        long,
        default_value = "../shared/data/mooncake/conversation_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// Requests replayed from the start of the trace (0: all).
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// Trace time × this = arrival time.
    #[arg(long, default_value_t = 0.5)]
    pub time_scale: f64,
    /// Prefill instances.
    #[arg(long, default_value_t = 4)]
    pub prefills: usize,
    /// Decode workers (each routes with its own table).
    #[arg(long, default_value_t = 1)]
    pub decodes: usize,
    /// L2 pages per prefill.
    #[arg(long, default_value_t = 1638)]
    pub l2_pages: usize,
    /// L3 pages (the demo's CacheTier).
    #[arg(long, default_value_t = 13_107)]
    pub l3_pages: usize,
    /// Compute time per prompt token not served from a cache, µs.
    #[arg(long, default_value_t = 20.0)]
    pub us_per_token: f64,
    /// Load time per prompt token served from L3, µs.
    #[arg(long, default_value_t = 2.0)]
    pub l3_us_per_token: f64,
    /// Rooms in flight above the least-loaded prefill that affinity may accept.
    #[arg(long, default_value_t = routing::DEFAULT_MAX_SKEW)]
    pub max_skew: u32,
}

/// One (setting, policy) row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `L2 only`, `demo L3`, `L3 holds all`.
    pub setting: &'static str,
    /// `round-robin`, `affinity` or `least-work`.
    pub policy: &'static str,
    /// Hit tokens / prompt tokens, L2.
    pub l2: f64,
    /// Hit tokens / prompt tokens, L3.
    pub l3: f64,
    /// TTFT p50, ms (model).
    pub ttft_p50_ms: f64,
    /// TTFT p99, ms (model).
    pub ttft_p99_ms: f64,
    /// Busiest prefill's compute time / the mean.
    pub imbalance: f64,
}

/// What the bench measured.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingReport {
    /// Requests replayed.
    pub requests: usize,
    /// The unbounded single cache's token hit ratio.
    pub ceiling: f64,
    /// Rows, round-robin, affinity, then least-work per setting.
    pub rows: Vec<Row>,
}

impl RoutingReport {
    /// Printable lines, with the goals of issue 16 item 2 as ratios.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "routing: {} requests; ceiling (one unbounded cache) hit ratio {:.3}",
            self.requests, self.ceiling
        )];
        out.push(format!(
            "{:<13} {:<11} {:>6} {:>6} {:>6} {:>8} {:>9} {:>9} {:>9}",
            "setting",
            "policy",
            "L2",
            "L3",
            "total",
            "/ceiling",
            "TTFT p50",
            "TTFT p99",
            "imbalance"
        ));
        for r in &self.rows {
            let total = r.l2 + r.l3;
            out.push(format!(
                "{:<13} {:<11} {:>6.3} {:>6.3} {:>6.3} {:>8.2} {:>7.0}ms {:>7.0}ms {:>9.2}",
                r.setting,
                r.policy,
                r.l2,
                r.l3,
                total,
                total / self.ceiling.max(f64::MIN_POSITIVE),
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.imbalance
            ));
        }
        for rr in self.rows.iter().filter(|r| r.policy == "round-robin") {
            for other in self
                .rows
                .iter()
                .filter(|r| r.setting == rr.setting && r.policy != rr.policy)
            {
                out.push(format!(
                    "{}: {} / round-robin hit ratio {:.2}, TTFT p99 {:.2} × round-robin's",
                    rr.setting,
                    other.policy,
                    (other.l2 + other.l3) / (rr.l2 + rr.l3).max(f64::MIN_POSITIVE),
                    other.ttft_p99_ms / rr.ttft_p99_ms.max(f64::MIN_POSITIVE)
                ));
            }
        }
        out
    }
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum RoutingBenchError {
    /// The trace could not be opened or parsed.
    #[error("trace {path}: {message}")]
    Trace {
        /// Path given.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Arguments that describe no system.
    #[error("{0}")]
    BadArgs(String),
}

/// Runs the bench.
///
/// # Errors
/// [`RoutingBenchError::Trace`] when the trace cannot be read, [`RoutingBenchError::BadArgs`]
/// when there are no prefills or decodes or the time scale is not positive.
pub fn run(args: &RoutingArgs) -> Result<RoutingReport, RoutingBenchError> {
    if args.prefills == 0 || args.decodes == 0 || args.time_scale.is_nan() || args.time_scale <= 0.0
    {
        return Err(RoutingBenchError::BadArgs(
            "--prefills and --decodes must be at least 1 and --time-scale positive".into(),
        ));
    }
    let trace_err = |message: String| RoutingBenchError::Trace {
        path: args.trace.clone(),
        message,
    };
    let file = std::fs::File::open(&args.trace).map_err(|e| trace_err(e.to_string()))?;
    let mut requests =
        read_trace(std::io::BufReader::new(file)).map_err(|e| trace_err(e.to_string()))?;
    if args.requests > 0 {
        requests.truncate(args.requests);
    }
    let ceiling = {
        let mut idx = PrefixIndex::unbounded();
        tandem_worker::tier::trace::replay(&mut idx, Tier::L3Store, &requests).token_hit_ratio()
    };
    let mut rows = Vec::new();
    for (setting, l3) in [
        ("L2 only", Some(0)),
        ("demo L3", Some(args.l3_pages)),
        ("L3 holds all", None),
    ] {
        for (policy, routing) in [
            ("round-robin", Routing::RoundRobin),
            (
                "affinity",
                Routing::PrefixAffinity {
                    max_skew: args.max_skew,
                },
            ),
            ("least-work", Routing::LeastWork),
        ] {
            rows.push(simulate(args, &requests, setting, policy, routing, l3));
        }
    }
    Ok(RoutingReport {
        requests: requests.len(),
        ceiling,
        rows,
    })
}

/// A decode's rooms open on one prefill: (finish time µs, blocks to compute), soonest first.
type OpenRooms = BinaryHeap<Reverse<(u64, u64)>>;

/// One replay: `l3` is the L3 capacity in pages (`Some(0)`: no CacheTier, `None`: unbounded).
fn simulate(
    args: &RoutingArgs,
    requests: &[TraceRequest],
    setting: &'static str,
    policy: &'static str,
    routing: Routing,
    l3: Option<usize>,
) -> Row {
    let p = args.prefills;
    let l2_cap = NonZeroUsize::new(args.l2_pages.max(1));
    let mut l2: Vec<PrefixIndex> = (0..p)
        .map(|_| PrefixIndex::new([None, l2_cap, None]))
        .collect();
    let mut store = match l3 {
        Some(0) => None,
        Some(n) => Some(PrefixIndex::new([None, None, NonZeroUsize::new(n)])),
        None => Some(PrefixIndex::unbounded()),
    };
    let addrs: Vec<String> = (0..p).map(|i| format!("prefill-{i}")).collect();
    let mut tables: Vec<AffinityTable> = (0..args.decodes)
        .map(|_| AffinityTable::new(args.l2_pages.max(1)))
        .collect();
    // Finish times (µs) and blocks to compute of the rooms each decode has open on each prefill.
    let mut open: Vec<Vec<OpenRooms>> = vec![vec![BinaryHeap::new(); p]; args.decodes];
    let mut free_at = vec![0f64; p];
    let mut busy = vec![0f64; p];
    let (mut lookup, mut hit_l2, mut hit_l3) = (0u64, 0u64, 0u64);
    let mut ttft_ms = Vec::with_capacity(requests.len());
    for (n, req) in requests.iter().enumerate() {
        let arrival = req.timestamp as f64 * args.time_scale * 1000.0; // µs
        let d = n % args.decodes;
        let now = arrival as u64;
        for heap in &mut open[d] {
            while heap.peek().is_some_and(|Reverse((t, _))| *t <= now) {
                heap.pop();
            }
        }
        let candidates: Vec<Candidate<'_>> = (0..p)
            .map(|i| Candidate {
                addr: &addrs[i],
                in_flight: u32::try_from(open[d][i].len()).unwrap_or(u32::MAX),
                pending_blocks: open[d][i].iter().map(|Reverse((_, b))| b).sum(),
            })
            .collect();
        let hashes = &req.hash_ids;
        let i = routing::choose(routing, &candidates, hashes, &tables[d], n).unwrap_or(0);
        let own = (hashes.len() - tables[d].leading_match(&addrs[i], hashes)) as u64;
        let keys = req.page_keys();
        let tokens = u64::from(req.input_length);
        let in_l2 = l2[i].leading_present(Tier::L2Host, &keys);
        let in_l3 = store
            .as_ref()
            .map_or(0, |s| s.leading_present(Tier::L3Store, &keys))
            .max(in_l2);
        let sum = |from: usize, to: usize| -> u64 {
            (from..to)
                .map(|k| page_token_len(tokens, TRACE_BLOCK_TOKENS, k))
                .sum()
        };
        let (t_l2, t_l3) = (sum(0, in_l2), sum(in_l2, in_l3));
        let computed = tokens.saturating_sub(t_l2 + t_l3);
        lookup += tokens;
        hit_l2 += t_l2;
        hit_l3 += t_l3;
        let service = computed as f64 * args.us_per_token + t_l3 as f64 * args.l3_us_per_token;
        let start = free_at[i].max(arrival);
        let finish = start + service;
        free_at[i] = finish;
        busy[i] += service;
        ttft_ms.push((finish - arrival) / 1000.0);
        open[d][i].push(Reverse((finish as u64, own)));
        l2[i].insert(Tier::L2Host, &keys, Residency::Present);
        if let Some(s) = store.as_mut() {
            s.insert(Tier::L3Store, &keys, Residency::Present);
        }
        tables[d].record(&addrs[i], hashes);
    }
    ttft_ms.sort_by(f64::total_cmp);
    let pct = |q: f64| -> f64 {
        if ttft_ms.is_empty() {
            return 0.0;
        }
        let k = ((ttft_ms.len() as f64 - 1.0) * q).round() as usize;
        ttft_ms[k.min(ttft_ms.len() - 1)]
    };
    let mean_busy = busy.iter().sum::<f64>() / p as f64;
    let max_busy = busy.iter().copied().fold(0.0, f64::max);
    let ratio = |h: u64| {
        if lookup == 0 {
            0.0
        } else {
            h as f64 / lookup as f64
        }
    };
    Row {
        setting,
        policy,
        l2: ratio(hit_l2),
        l3: ratio(hit_l3),
        ttft_p50_ms: pct(0.5),
        ttft_p99_ms: pct(0.99),
        imbalance: if mean_busy > 0.0 {
            max_busy / mean_busy
        } else {
            1.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(trace: PathBuf) -> RoutingArgs {
        RoutingArgs {
            trace,
            requests: 0,
            time_scale: 1.0,
            prefills: 2,
            decodes: 1,
            l2_pages: 4,
            l3_pages: 0,
            us_per_token: 1.0,
            l3_us_per_token: 0.1,
            max_skew: 4,
        }
    }

    /// Three sessions taking turns on two prefills: round-robin moves each session's next turn
    /// to the other prefill, affinity and least-work keep each session on one, so only they hit
    /// in L2.
    #[test]
    fn affinity_keeps_alternating_sessions_where_their_prefix_is() {
        let dir = std::env::temp_dir().join(format!("tandem-routing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.jsonl");
        let mut rows = String::new();
        let mut sessions = [vec![0u64], vec![0u64], vec![0u64]];
        let mut t = 0u64;
        for turn in 0..6u64 {
            for (s, h) in sessions.iter_mut().enumerate() {
                h.push(100 * (s as u64 + 1) + turn);
                t += 1000;
                rows.push_str(&format!(
                    "{{\"timestamp\":{t},\"input_length\":{},\"output_length\":1,\"hash_ids\":{h:?}}}\n",
                    h.len() * 512
                ));
            }
        }
        std::fs::write(&path, rows).unwrap();
        let mut a = args(path);
        a.l2_pages = 64;
        let report = run(&a).unwrap();
        let l2_only: Vec<&Row> = report
            .rows
            .iter()
            .filter(|r| r.setting == "L2 only")
            .collect();
        let (rr, aff, lw) = (l2_only[0], l2_only[1], l2_only[2]);
        assert_eq!(
            [rr.policy, aff.policy, lw.policy],
            ["round-robin", "affinity", "least-work"]
        );
        assert!(
            (lw.l2 - report.ceiling).abs() < 1e-9,
            "least-work {} vs ceiling {}",
            lw.l2,
            report.ceiling
        );
        // Each session on one prefill sees all its earlier turns: the ceiling, from L2 alone.
        assert!(
            (aff.l2 - report.ceiling).abs() < 1e-9,
            "affinity {} vs ceiling {}",
            aff.l2,
            report.ceiling
        );
        assert!(
            rr.l2 < report.ceiling - 0.1,
            "round-robin {} vs ceiling {}",
            rr.l2,
            report.ceiling
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_missing_trace_is_a_typed_error() {
        let e = run(&args(PathBuf::from("/nonexistent/trace.jsonl"))).unwrap_err();
        assert!(matches!(e, RoutingBenchError::Trace { .. }), "{e}");
    }
}
