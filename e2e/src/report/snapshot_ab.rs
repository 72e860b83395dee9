//! Snapshot sync on against off (issue 15; seed 002): the side-by-side table of two demo runs of
//! the same trace slice, each on a fresh cluster ([`SnapshotAb`], `tandem-e2e demo --snapshot-ab`).
//!
//! What sync is for is the session's **next turn**: a request that is the next turn of an earlier
//! request of the slice ([`crate::replay::workload::session_kv_hashes`]'s pairing). Its prompt
//! starts with the earlier turn's prompt and answer; with sync on, the decode pushed that KV into
//! the prefill the next turn is routed to, so its pages hit instead of being recomputed. The table
//! gives, per run, the next turns' hit ratio and TTFT, the whole slice's, and the sync outcomes by
//! reason (decode counters: attempts, ok, `snapshot-buf-full`, transfer, other; prefill:
//! finalized, `alloc-failed-on-finalize`, pages hit because of a snapshot).

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::percentile::summarize;
use super::summary::Summary;
use crate::replay::workload::TraceRequest;
use crate::replay::{Outcome, RequestResult};

/// The two runs, in order: label and whether the replay names the session KV.
pub const AB_SYNC: [(&str, bool); 2] = [("off", false), ("on", true)];

/// The requests of `workload` that are a session's next turn (their index), by the replay's own
/// pairing ([`crate::replay::workload::next_turns`]).
pub fn next_turns(workload: &[TraceRequest]) -> BTreeSet<usize> {
    crate::replay::workload::next_turns(workload)
        .into_iter()
        .flatten()
        .collect()
}

/// One run's row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncRow {
    /// `on` or `off`.
    pub sync: String,
    /// Requests completed / lost.
    pub completed: usize,
    /// Requests lost beyond the retry budget.
    pub failed: usize,
    /// Next turns completed (the rows below are over them).
    pub next_turns: usize,
    /// Next turns' prefix hit tokens (L1 + L2 + L3) / prompt tokens, over every completed next turn
    /// (retried ones too, unlike the slice's `total_hit`, which counts first attempts).
    pub next_turn_hit: f64,
    /// Next turns' TTFT p50 (ms).
    pub next_turn_ttft_p50_ms: f64,
    /// Next turns' TTFT p99 (ms).
    pub next_turn_ttft_p99_ms: f64,
    /// Whole slice: total hit ratio.
    pub total_hit: f64,
    /// Whole slice: TTFT p50 (ms).
    pub ttft_p50_ms: f64,
    /// Whole slice: TTFT p99 (ms).
    pub ttft_p99_ms: f64,
    /// Decode: syncs started.
    pub attempts: u64,
    /// Decode: syncs the prefill took.
    pub ok: u64,
    /// Decode: `snapshot-buf-full`.
    pub failed_buf_full: u64,
    /// Decode: `alloc-failed` (the negative control only).
    pub failed_alloc: u64,
    /// Decode: writes that did not complete.
    pub failed_transfer: u64,
    /// Decode: no peer, a refused or lost call.
    pub failed_other: u64,
    /// Prefill: snapshots finalized.
    pub finalized: u64,
    /// Prefill: `alloc-failed-on-finalize` answers.
    pub alloc_failed_on_finalize: u64,
    /// Prefill: prompt tokens served from pages a snapshot added.
    pub snapshot_hit_tokens: u64,
    /// Every check of the run passed.
    pub passed: bool,
}

impl SyncRow {
    /// The row of one run: its summary and its requests.
    pub fn of(sync: &str, s: &Summary, results: &[RequestResult], next: &BTreeSet<usize>) -> Self {
        let turns: Vec<&RequestResult> = results
            .iter()
            .filter(|r| next.contains(&r.index) && r.outcome != Outcome::Failed)
            .collect();
        let (hit, prompt) = turns.iter().fold((0u64, 0u64), |(h, p), r| {
            let t = r.tandem.as_ref().map_or(0, |t| {
                let k = &t.prefix_hit_tokens;
                k.l1 + k.l2 + k.l3
            });
            (h + t, p + u64::from(r.input_tokens))
        });
        let ttft = summarize(turns.iter().filter_map(|r| r.ttft_ms));
        let all = s.ttft_ms.as_ref();
        let c = &s.worker_counters;
        Self {
            sync: sync.to_owned(),
            completed: s.requests.ok + s.requests.retried,
            failed: s.requests.failed,
            next_turns: turns.len(),
            next_turn_hit: if prompt == 0 {
                f64::NAN
            } else {
                hit as f64 / prompt as f64
            },
            next_turn_ttft_p50_ms: ttft.map_or(f64::NAN, |p| p.p50),
            next_turn_ttft_p99_ms: ttft.map_or(f64::NAN, |p| p.p99),
            total_hit: s.hit_ratio.total,
            ttft_p50_ms: all.map_or(f64::NAN, |p| p.p50),
            ttft_p99_ms: all.map_or(f64::NAN, |p| p.p99),
            attempts: c.snapshot_sync_attempts,
            ok: c.snapshot_sync_ok,
            failed_buf_full: c.snapshot_sync_failed_buf_full,
            failed_alloc: c.snapshot_sync_failed_alloc,
            failed_transfer: c.snapshot_sync_failed_transfer,
            failed_other: c.snapshot_sync_failed_other,
            finalized: c.snapshot_finalized,
            alloc_failed_on_finalize: c.snapshot_alloc_failed_on_finalize,
            snapshot_hit_tokens: c.snapshot_hit_tokens,
            passed: s.passed(),
        }
    }
}

/// Sync off and on side by side (`snapshot-ab.json`; its `Display` is `snapshot-ab.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotAb {
    /// What was run, one line.
    pub setting: String,
    /// Next turns in the slice (requests that are an earlier request's next turn).
    pub next_turns_in_slice: usize,
    /// The runs, in [`AB_SYNC`] order; a run without a report is absent (see `missing`).
    pub rows: Vec<SyncRow>,
    /// Runs without a report, with why.
    pub missing: Vec<String>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { f64::NAN } else { a / b }
}

impl SnapshotAb {
    /// The row of `sync` (`on`, `off`).
    pub fn row(&self, sync: &str) -> Option<&SyncRow> {
        self.rows.iter().find(|r| r.sync == sync)
    }

    /// The A/B of the runs under `dir` (`dir/off/`, `dir/on/`: `results.json` and
    /// `requests.jsonl`) over `workload` (the slice both replayed); a run whose files are missing
    /// or unreadable is listed in `missing`.
    pub fn load(dir: &Path, workload: &[TraceRequest], setting: &str) -> Self {
        let next = next_turns(workload);
        let mut ab = SnapshotAb {
            setting: setting.to_owned(),
            next_turns_in_slice: next.len(),
            rows: Vec::new(),
            missing: Vec::new(),
        };
        for (label, _) in AB_SYNC {
            let run = dir.join(label);
            let read = || -> Result<(Summary, Vec<RequestResult>), String> {
                let s: Summary = std::fs::read(run.join("results.json"))
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))?;
                let text = std::fs::read_to_string(run.join("requests.jsonl"))
                    .map_err(|e| e.to_string())?;
                let results = text
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| serde_json::from_str(l).map_err(|e| e.to_string()))
                    .collect::<Result<Vec<RequestResult>, String>>()?;
                Ok((s, results))
            };
            match read() {
                Ok((s, results)) => ab.rows.push(SyncRow::of(label, &s, &results, &next)),
                Err(e) => ab.missing.push(format!("{label}: {}: {e}", run.display())),
            }
        }
        ab
    }

    /// Writes `snapshot-ab.json` and `snapshot-ab.md` into `dir`.
    ///
    /// # Errors
    /// The file that could not be written.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("snapshot-ab.json"), json)?;
        std::fs::write(dir.join("snapshot-ab.md"), self.to_string())
    }
}

impl fmt::Display for SnapshotAb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "snapshot sync A/B: {}", self.setting)?;
        writeln!(
            f,
            "next turns in the slice: {} (requests that continue an earlier request's session)",
            self.next_turns_in_slice
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "| sync | completed | lost | next turns | next-turn hit | next-turn TTFT p50 ms | \
             next-turn TTFT p99 ms | total hit | TTFT p50 ms | TTFT p99 ms | syncs ok / started | \
             buf full | transfer | other | finalized | alloc-failed-on-finalize | snapshot hit \
             tokens | checks |"
        )?;
        writeln!(
            f,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {} | {} | {} | {:.3} | {:.0} | {:.0} | {:.3} | {:.0} | {:.0} | {} / {} | {} \
                 | {} | {} | {} | {} | {} | {} |",
                r.sync,
                r.completed,
                r.failed,
                r.next_turns,
                r.next_turn_hit,
                r.next_turn_ttft_p50_ms,
                r.next_turn_ttft_p99_ms,
                r.total_hit,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.ok,
                r.attempts,
                r.failed_buf_full,
                r.failed_transfer,
                r.failed_other,
                r.finalized,
                r.alloc_failed_on_finalize,
                r.snapshot_hit_tokens,
                if r.passed { "pass" } else { "FAIL" }
            )?;
        }
        if let (Some(off), Some(on)) = (self.row("off"), self.row("on")) {
            writeln!(
                f,
                "| on / off | | | | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | | | | | | | | |",
                ratio(on.next_turn_hit, off.next_turn_hit),
                ratio(on.next_turn_ttft_p50_ms, off.next_turn_ttft_p50_ms),
                ratio(on.next_turn_ttft_p99_ms, off.next_turn_ttft_p99_ms),
                ratio(on.total_hit, off.total_hit),
                ratio(on.ttft_p50_ms, off.ttft_p50_ms),
                ratio(on.ttft_p99_ms, off.ttft_p99_ms),
            )?;
            writeln!(f)?;
            let ok = ratio(on.ok as f64, on.attempts as f64);
            writeln!(
                f,
                "syncs ok with sync on: {} of {} ({:.1} %; goal ≥ 99 %: {})",
                on.ok,
                on.attempts,
                100.0 * ok,
                if ok >= 0.99 { "met" } else { "NOT met" }
            )?;
        }
        for m in &self.missing {
            writeln!(f, "missing: {m}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(timestamp: u64, input_length: u32, output_length: u32, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length,
            output_length,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn next_turns_are_the_requests_the_sessions_continue_into() {
        let w = [
            req(0, 1400, 300, &[1, 2, 3]),
            req(0, 600, 5, &[7, 8]),
            req(5, 2300, 5, &[1, 2, 4, 5, 6]),
            req(9, 2300, 5, &[1, 2, 4, 5, 6]),
        ];
        assert_eq!(next_turns(&w), BTreeSet::from([2]));
    }
}
