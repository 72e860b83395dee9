//! The report of one replay (`results.json` and the stdout summary): pure aggregation of the
//! per-request results, the worker samples and the events.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::events::{Event, RESTART};
use super::percentile::{Percentiles, summarize};
use super::routing::{PrefillBalance, decode_routing, prefill_balance};
use super::workers::{Counters, Sample, incarnations, per_round_increase, totals};
use crate::demo::teardown::TeardownReport;
use crate::replay::{Outcome, RequestResult};

/// Everything the report is made from.
#[derive(Debug, Clone)]
pub struct ReportInput<'a> {
    /// Where the workload came from (`generated (seed 42)` or the trace path).
    pub source: String,
    /// The `--time-scale` used.
    pub time_scale: f64,
    /// The workload's hit ratio with an unbounded cache (the ceiling for the measured one).
    pub unbounded_hit_ratio: f64,
    /// Per request (by index), the hit tokens of that ceiling
    /// ([`crate::replay::workload::ceiling_hit_tokens`]); empty when unknown.
    pub ceiling_hit_tokens: &'a [u64],
    /// Per-request results.
    pub results: &'a [RequestResult],
    /// Worker `/report` samples.
    pub samples: &'a [Sample],
    /// Scale/restart/pod events.
    pub events: &'a [Event],
    /// Teardown observations (demo only).
    pub teardown: Option<TeardownReport>,
}

/// Request counts by outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestCounts {
    /// All requests.
    pub total: usize,
    /// First attempt completed.
    pub ok: usize,
    /// Completed after retries.
    pub retried: usize,
    /// Lost (retry budget exhausted or refused for good).
    pub failed: usize,
    /// Retries made in all.
    pub retries: u64,
    /// The lost requests (at most [`FAILURES_SHOWN`]), each as `#index after N attempts:
    /// last error`, so that a report says why without its per-request file.
    #[serde(default)]
    pub failures: Vec<String>,
}

/// How many lost requests [`RequestCounts::failures`] names.
pub const FAILURES_SHOWN: usize = 10;

/// Token-weighted prefix hit ratios (hit tokens / prompt tokens).
///
/// Unless a field says otherwise, only requests served by their **first prefill** count: completed
/// on the client's first attempt, with no prefill retried inside the decode worker
/// (`tandem.prefill_retries` 0). A retry — by the client, or by the decode worker on another
/// prefill peer — can hit the prefix its own failed attempt stored, a hit the unbounded-cache
/// ceiling (one pass over the trace) never counts, so mixing them in lets a short slice read above
/// its ceiling. Retried requests are reported apart ([`Summary::hit_ratio_retried`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HitRatio {
    /// From L1.
    pub l1: f64,
    /// From L2.
    pub l2: f64,
    /// From L3.
    pub l3: f64,
    /// All tiers.
    pub total: f64,
    /// Prompt tokens counted.
    pub prompt_tokens: u64,
}

/// One time window of the over-time series.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Window start (ms on the replay clock).
    pub t_ms: f64,
    /// Completed requests that finished in the window.
    pub requests: usize,
    /// Their hit ratio.
    pub hit: HitRatio,
    /// Completions per second in the window.
    pub requests_per_s: f64,
    /// Output tokens per second in the window.
    pub output_tokens_per_s: f64,
}

/// KV transfer figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransfer {
    /// Sum of the responses' `tandem.kv_bytes`.
    pub bytes_in_responses: u64,
    /// Workers' `kv_bytes_sent`, all incarnations.
    pub bytes_sent: u64,
    /// Workers' `kv_bytes_received`, all incarnations.
    pub bytes_received: u64,
    /// `bytes_received` (or the responses' bytes when no worker reported) over the replay time.
    pub mean_bytes_per_s: f64,
    /// Highest per-sampling-round receive rate.
    pub peak_bytes_per_s: f64,
    /// `(t_ms, bytes/s)` per sampling round.
    pub over_time: Vec<(f64, f64)>,
}

/// One pass/fail check of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// What is checked.
    pub name: String,
    /// Whether it held.
    pub passed: bool,
    /// The figures behind it.
    pub detail: String,
}

/// One worker incarnation (prefill or decode) that served through the engine API (its
/// `/report.engine`; worker/interfaces/README.md §4), as last sampled. Every figure is read from
/// that report or from the engine's own summary in it (`engine_summary`); a figure the report
/// lacks reads 0.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineWorker {
    /// Pod name.
    pub pod: String,
    /// The worker's role (`prefill` or `decode`, from `/report.role`).
    #[serde(default)]
    pub role: String,
    /// The incarnation started after the first restart event.
    pub after_restart: bool,
    /// Engine kind (`Simulated`, …).
    pub kind: String,
    /// Pools: `(pool, domain, bytes, registration state)`.
    pub pools: Vec<(String, String, u64, String)>,
    /// Registration transactions committed.
    pub registration_commits: u64,
    /// Registrations quarantined (undo failed: leaked).
    pub registration_leaks: u64,
    /// Rooms the engine produced and the transport delivered.
    pub rooms_sent: u64,
    /// Rooms failed on the engine path.
    pub rooms_failed: u64,
    /// `LayerLoaded` events delivered by the worker.
    pub load_waits: u64,
    /// Reads before ready: the worker's refused Stores plus the engine's early reads.
    pub read_before_ready: u64,
    /// Pages loaded into engine pages from L2 and from L3.
    pub pages_loaded_l2: u64,
    /// Pages loaded into engine pages straight from L3.
    pub pages_loaded_l3: u64,
    /// Pages loaded whose bytes came from L3 (fetched, or loaded back at restart).
    pub pages_loaded_from_l3: u64,
    /// The engine's own count of loaded pages it verified.
    pub engine_pages_verified: u64,
    /// Loaded chunks that failed the engine's check.
    pub engine_corrupt_chunks: u64,
    /// A decode worker's figures (`None` for a prefill).
    #[serde(default)]
    pub decode: Option<DecodeEngineFigures>,
}

/// What a decode worker's engine did, from its `/report.engine` (the worker's tallies) and the
/// engine's own summary in it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeEngineFigures {
    /// Rooms the engine reserved.
    pub rooms_reserved: u64,
    /// Rooms whose KV completed in the engine's pages.
    pub rooms_completed: u64,
    /// Rooms failed (aborts included).
    pub rooms_failed: u64,
    /// SafeToReuse releases by the gate's proof: concluded, acks, transport (fence), bypassed.
    pub released: [u64; 4],
    /// Abort acks the gate counted.
    pub acks: u64,
    /// Rooms quarantined.
    pub quarantined: u64,
    /// Chunks the engine verified (as its EmitTokens reported them to the worker).
    pub chunks_verified: u64,
    /// Chunks the engine found corrupt (as reported to the worker).
    pub corrupt_chunks: u64,
    /// Whether the engine published its own summary (`engine_summary` not null).
    pub summary_published: bool,
    /// The engine's own count of pages it read and verified.
    pub engine_pages: u64,
    /// The engine's own count of corrupt chunks.
    pub engine_corrupt_chunks: u64,
    /// Pages the engine got from Reserve while their previous room's SafeToReuse had not come.
    pub early_reuse: u64,
    /// Reserve replies that named a SafeToReuse the engine had not received yet (it waited).
    #[serde(default)]
    pub release_waits: u64,
    /// Gaps in the SafeToReuse numbering (events the worker dropped).
    #[serde(default)]
    pub release_gaps: u64,
}

impl EngineWorker {
    /// The figures of one incarnation's `/report.engine` (`role` from `/report.role`), or `None`
    /// for the built-in engine.
    pub fn of(pod: &str, role: &str, after_restart: bool, e: &serde_json::Value) -> Option<Self> {
        let kind = e["kind"].as_str()?.to_owned();
        if kind == "builtin" {
            return None;
        }
        let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
        let (t, es) = (&e["tiers"], &e["engine_summary"]);
        let decode = (role == "decode").then(|| DecodeEngineFigures {
            rooms_reserved: n(&e["rooms_reserved"]),
            rooms_completed: n(&e["rooms_completed"]),
            rooms_failed: n(&e["rooms_failed"]),
            released: ["concluded", "acks", "transport", "bypassed"].map(|p| n(&e["releases"][p])),
            acks: n(&e["acks"]),
            quarantined: n(&e["quarantined"]),
            chunks_verified: n(&e["chunks_verified"]),
            corrupt_chunks: n(&e["corrupt_chunks"]),
            summary_published: es.is_object(),
            engine_pages: n(&es["pages"]),
            engine_corrupt_chunks: n(&es["corrupt_chunks"]),
            early_reuse: n(&es["decode"]["early_reuse"]),
            release_waits: n(&es["decode"]["release_waits"]),
            release_gaps: n(&es["decode"]["release_gaps"]),
        });
        Some(Self {
            pod: pod.to_owned(),
            role: role.to_owned(),
            after_restart,
            kind,
            pools: e["pools"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .map(|p| {
                            (
                                p["pool"].as_str().unwrap_or("").to_owned(),
                                p["domain"].as_str().unwrap_or("").to_owned(),
                                n(&p["bytes"]),
                                p["registration"].as_str().unwrap_or("").to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
            registration_commits: n(&e["registration"]["commits"]),
            registration_leaks: n(&e["registration"]["quarantined"]),
            rooms_sent: n(&e["rooms_sent"]),
            rooms_failed: n(&e["rooms_failed"]),
            load_waits: n(&t["load_waits"]),
            read_before_ready: n(&t["read_before_ready"]) + n(&es["read_before_ready"]),
            pages_loaded_l2: n(&t["pages_loaded"]["l2"]),
            pages_loaded_l3: n(&t["pages_loaded"]["l3"]),
            pages_loaded_from_l3: n(&t["pages_loaded_from_l3_bytes"]),
            engine_pages_verified: n(&es["loaded_pages"]),
            engine_corrupt_chunks: n(&es["loaded_corrupt_chunks"]),
            decode,
        })
    }
}

/// Name of the check of [`engine_load_check`].
pub const ENGINE_LOAD_CHECK: &str =
    "engine API: loads waited per layer, none read before ready, every loaded page verified";
/// Name of the check of [`l3_loaded_check`].
pub const L3_LOADED_CHECK: &str = "engine API: L3 pages loaded into engine pages after the restart";

/// The report's load-before-read check over engine workers (DESIGN contract 5, seed 001): some
/// load waited for its per-layer events, no layer was read before its event (the engine's and the
/// workers' counts), no loaded chunk failed the engine's verification, no registration leaked.
/// Returns whether it passed and the line that says why.
pub fn engine_load_check(workers: &[EngineWorker]) -> (bool, String) {
    let sum = |f: fn(&EngineWorker) -> u64| workers.iter().map(f).sum::<u64>();
    let (waits, early, corrupt, leaks) = (
        sum(|w| w.load_waits),
        sum(|w| w.read_before_ready),
        sum(|w| w.engine_corrupt_chunks),
        sum(|w| w.registration_leaks),
    );
    (
        waits > 0 && early == 0 && corrupt == 0 && leaks == 0,
        format!(
            "{} engine workers: {waits} load waits, {early} reads before ready, {} pages \
             loaded and verified by the engine, {corrupt} corrupt loaded chunks, {leaks} \
             registration leaks",
            workers.len(),
            sum(|w| w.engine_pages_verified)
        ),
    )
}

/// The report's loaded-bytes check (DESIGN contract 7): workers started after the restart copied
/// pages whose bytes came from L3 into their engines' pages — an L3 hit served by computing the KV
/// again copies none and fails it. Returns whether it passed and the line that says why.
pub fn l3_loaded_check(workers: &[EngineWorker]) -> (bool, String) {
    let l3 = workers
        .iter()
        .filter(|w| w.after_restart)
        .map(|w| w.pages_loaded_from_l3)
        .sum::<u64>();
    (
        l3 > 0,
        format!("{l3} pages whose bytes came from L3, loaded by restarted workers"),
    )
}

/// `results.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Workload source.
    pub source: String,
    /// Time scale.
    pub time_scale: f64,
    /// Replay wall time (first send to last finish, ms).
    pub duration_ms: f64,
    /// Outcomes.
    pub requests: RequestCounts,
    /// TTFT percentiles (ms), completed requests.
    pub ttft_ms: Option<Percentiles>,
    /// TPOT percentiles (ms), completed requests with ≥ 2 tokens.
    pub tpot_ms: Option<Percentiles>,
    /// Completions per second over the replay.
    pub requests_per_s: f64,
    /// Output tokens per second over the replay.
    pub output_tokens_per_s: f64,
    /// The workload's ceiling with an unbounded cache.
    pub unbounded_hit_ratio: f64,
    /// The unbounded-cache ceiling of the requests [`Summary::hit_ratio`] counts (first-prefill
    /// completions; their per-request ceilings over their prompt tokens); `None` when the per-request
    /// ceilings are unknown. Which requests were retried differs between runs, so two runs'
    /// `hit_ratio`s are each measured against this, not against the whole workload's.
    #[serde(default)]
    pub unbounded_hit_ratio_counted: Option<f64>,
    /// Measured prefix hit ratio, whole replay, first-attempt completions (see [`HitRatio`]).
    pub hit_ratio: HitRatio,
    /// Prefix hit ratio of the completed requests that were retried (by the client or by the decode
    /// worker on another prefill peer): their own earlier attempt may have stored what they hit.
    #[serde(default)]
    pub hit_ratio_retried: HitRatio,
    /// First-prefill requests that hit more tokens than their own trace-order ceiling: possible
    /// only when a later request sharing their blocks ran first (concurrency reorders), so a
    /// handful is expected and many mean hits are over-counted.
    #[serde(default)]
    pub first_prefill_above_ceiling: usize,
    /// Hit ratio before the first restart event (None without one).
    pub hit_ratio_before_restart: Option<HitRatio>,
    /// Hit ratio after the first restart event.
    pub hit_ratio_after_restart: Option<HitRatio>,
    /// Per-window series.
    pub over_time: Vec<Window>,
    /// KV transfer.
    pub kv: KvTransfer,
    /// Worker counters summed over all incarnations.
    pub worker_counters: Counters,
    /// Worker process incarnations seen.
    pub worker_incarnations: usize,
    /// `/report` GETs that failed.
    pub sample_errors: usize,
    /// Sum of the responses' `tandem.corrupt_chunks`.
    pub corrupt_chunks_in_responses: u64,
    /// `l3_pages_loaded_back` of the incarnations that started after the first restart event.
    pub l3_pages_loaded_back_after_restart: Option<u64>,
    /// Whether the rolling restart deleted a decode pod before the last request finished, i.e.
    /// the decode side of the rollout (held back by the operator's prefill gate) ran under
    /// traffic (demo; `None` elsewhere or without a restart).
    #[serde(default)]
    pub decode_restart_under_traffic: Option<bool>,
    /// Rooms per prefill pod and their imbalance ([`PrefillBalance`]).
    #[serde(default)]
    pub prefill_balance: PrefillBalance,
    /// Routing policies the decodes reported (`/report.routing`: `least-work`, `round-robin`, `affinity:SKEW`).
    #[serde(default)]
    pub decode_routing: Vec<String>,
    /// Prefill incarnations that served through the engine API.
    #[serde(default)]
    pub engine_workers: Vec<EngineWorker>,
    /// Events.
    pub events: Vec<Event>,
    /// Teardown (demo).
    pub teardown: Option<TeardownReport>,
    /// Pass/fail checks.
    pub checks: Vec<Check>,
    /// PNG files written (relative to the output dir).
    pub plots: Vec<String>,
}

impl Summary {
    /// Every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    /// Appends a check.
    pub fn check(&mut self, name: &str, passed: bool, detail: impl Into<String>) {
        self.checks.push(Check {
            name: name.to_owned(),
            passed,
            detail: detail.into(),
        });
    }
}

/// True for a completed request served by its first prefill: no client retry, no prefill retried
/// inside the decode worker.
fn first_prefill(r: &RequestResult) -> bool {
    r.outcome == Outcome::Ok && r.tandem.as_ref().is_none_or(|t| t.prefill_retries == 0)
}

/// Hit ratio over the completed requests of `results` for which `first_prefill` is `first`.
fn hit_ratio_of<'a>(first: bool, results: impl IntoIterator<Item = &'a RequestResult>) -> HitRatio {
    let (mut l1, mut l2, mut l3, mut prompt) = (0u64, 0u64, 0u64, 0u64);
    for r in results {
        if r.outcome == Outcome::Failed || first_prefill(r) != first {
            continue;
        }
        prompt += u64::from(r.input_tokens);
        if let Some(t) = &r.tandem {
            l1 += t.prefix_hit_tokens.l1;
            l2 += t.prefix_hit_tokens.l2;
            l3 += t.prefix_hit_tokens.l3;
        }
    }
    let f = |x: u64| {
        if prompt == 0 {
            0.0
        } else {
            x as f64 / prompt as f64
        }
    };
    HitRatio {
        l1: f(l1),
        l2: f(l2),
        l3: f(l3),
        total: f(l1 + l2 + l3),
        prompt_tokens: prompt,
    }
}

/// Hit ratio of the requests among `results` served by their first prefill (see [`HitRatio`]).
fn hit_ratio<'a>(results: impl IntoIterator<Item = &'a RequestResult>) -> HitRatio {
    hit_ratio_of(true, results)
}

/// The unbounded-cache ceiling of the first-prefill completions among `done` (see
/// [`Summary::unbounded_hit_ratio_counted`]); `None` without per-request ceilings or requests.
fn counted_ceiling(ceiling: &[u64], done: &[&RequestResult]) -> Option<f64> {
    if ceiling.is_empty() {
        return None;
    }
    let (mut hit, mut prompt) = (0u64, 0u64);
    for r in done.iter().filter(|r| first_prefill(r)) {
        hit += ceiling.get(r.index).copied().unwrap_or(0);
        prompt += u64::from(r.input_tokens);
    }
    (prompt > 0).then(|| hit as f64 / prompt as f64)
}

/// Window length for the over-time series: about 40 windows, at least 1 s.
pub fn window_ms(duration_ms: f64) -> f64 {
    (duration_ms / 40.0).max(1000.0)
}

/// Builds the summary with the two checks every replay has (no corrupt page, no lost request);
/// the demo adds its own with [`Summary::check`].
pub fn summarize_run(input: ReportInput<'_>) -> Summary {
    let res = input.results;
    let mut counts = RequestCounts {
        total: res.len(),
        ..Default::default()
    };
    for r in res {
        match r.outcome {
            Outcome::Ok => counts.ok += 1,
            Outcome::Retried => counts.retried += 1,
            Outcome::Failed => {
                counts.failed += 1;
                if counts.failures.len() < FAILURES_SHOWN {
                    counts.failures.push(format!(
                        "#{} after {} attempts: {}",
                        r.index,
                        r.attempts,
                        r.errors.last().map_or("no error recorded", String::as_str)
                    ));
                }
            }
        }
        counts.retries += u64::from(r.attempts.saturating_sub(1));
    }
    let start = res.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let end = res.iter().map(|r| r.finished_ms).fold(0.0, f64::max);
    let duration_ms = if start.is_finite() {
        (end - start).max(0.0)
    } else {
        0.0
    };
    let secs = (duration_ms / 1000.0).max(1e-9);
    let done: Vec<&RequestResult> = res
        .iter()
        .filter(|r| r.outcome != Outcome::Failed)
        .collect();
    let out_tokens: u64 = done.iter().map(|r| r.completion_tokens).sum();

    let w = window_ms(duration_ms);
    let mut over_time = Vec::new();
    if start.is_finite() {
        let n = (duration_ms / w).ceil().max(1.0) as usize;
        for i in 0..n {
            let t0 = start + i as f64 * w;
            let in_w: Vec<&RequestResult> = done
                .iter()
                .copied()
                .filter(|r| r.finished_ms >= t0 && (r.finished_ms < t0 + w || i + 1 == n))
                .collect();
            over_time.push(Window {
                t_ms: t0,
                requests: in_w.len(),
                hit: hit_ratio(in_w.iter().copied()),
                requests_per_s: in_w.len() as f64 / (w / 1000.0),
                output_tokens_per_s: in_w.iter().map(|r| r.completion_tokens).sum::<u64>() as f64
                    / (w / 1000.0),
            });
        }
    }

    let restart_ms = input
        .events
        .iter()
        .filter(|e| e.kind == RESTART)
        .map(|e| e.t_ms)
        .reduce(f64::min);
    let (before, after) = match restart_ms {
        Some(t) => (
            Some(hit_ratio(done.iter().copied().filter(|r| r.sent_ms < t))),
            Some(hit_ratio(done.iter().copied().filter(|r| r.sent_ms >= t))),
        ),
        None => (None, None),
    };

    let incs = incarnations(input.samples);
    let counters = totals(&incs);
    let loaded_after = restart_ms.map(|t| {
        incs.iter()
            .filter(|i| i.first_ms >= t)
            .map(|i| i.last.l3_pages_loaded_back)
            .sum()
    });
    let engine_workers: Vec<EngineWorker> = incs
        .iter()
        .filter_map(|i| {
            let after = restart_ms.is_some_and(|t| i.first_ms >= t);
            EngineWorker::of(&i.pod, &i.role, after, i.engine.as_ref()?)
        })
        .collect();
    let rounds = per_round_increase(input.samples, |c| c.kv_bytes_received);
    let mut rates = Vec::new();
    for pair in rounds.windows(2) {
        let dt = (pair[1].0 - pair[0].0) / 1000.0;
        if dt > 0.0 {
            rates.push((pair[1].0, pair[1].1 as f64 / dt));
        }
    }
    let bytes_in_responses: u64 = done
        .iter()
        .filter_map(|r| r.tandem.as_ref())
        .map(|t| t.kv_bytes)
        .sum();
    let moved = if counters.kv_bytes_received > 0 {
        counters.kv_bytes_received
    } else {
        bytes_in_responses
    };
    let kv = KvTransfer {
        bytes_in_responses,
        bytes_sent: counters.kv_bytes_sent,
        bytes_received: counters.kv_bytes_received,
        mean_bytes_per_s: moved as f64 / secs,
        peak_bytes_per_s: rates.iter().map(|r| r.1).fold(0.0, f64::max),
        over_time: rates,
    };
    let corrupt_chunks: u64 = done
        .iter()
        .filter_map(|r| r.tandem.as_ref())
        .map(|t| t.corrupt_chunks)
        .sum();
    let mut s = Summary {
        source: input.source,
        time_scale: input.time_scale,
        duration_ms,
        requests: counts,
        ttft_ms: summarize(done.iter().filter_map(|r| r.ttft_ms)),
        tpot_ms: summarize(done.iter().filter_map(|r| r.tpot_ms)),
        requests_per_s: done.len() as f64 / secs,
        output_tokens_per_s: out_tokens as f64 / secs,
        unbounded_hit_ratio: input.unbounded_hit_ratio,
        unbounded_hit_ratio_counted: counted_ceiling(input.ceiling_hit_tokens, &done),
        hit_ratio: hit_ratio(done.iter().copied()),
        hit_ratio_retried: hit_ratio_of(false, done.iter().copied()),
        first_prefill_above_ceiling: done
            .iter()
            .filter(|r| first_prefill(r))
            .filter(|r| {
                let hit = r.tandem.as_ref().map_or(0, |t| {
                    t.prefix_hit_tokens.l1 + t.prefix_hit_tokens.l2 + t.prefix_hit_tokens.l3
                });
                input
                    .ceiling_hit_tokens
                    .get(r.index)
                    .is_some_and(|ceiling| hit > *ceiling)
            })
            .count(),
        hit_ratio_before_restart: before,
        hit_ratio_after_restart: after,
        over_time,
        kv,
        worker_counters: counters,
        worker_incarnations: incs.len(),
        sample_errors: input.samples.iter().filter(|s| s.error.is_some()).count(),
        corrupt_chunks_in_responses: corrupt_chunks,
        l3_pages_loaded_back_after_restart: loaded_after,
        decode_restart_under_traffic: None,
        engine_workers,
        prefill_balance: prefill_balance(res),
        decode_routing: decode_routing(input.samples),
        events: input.events.to_vec(),
        teardown: input.teardown,
        checks: Vec::new(),
        plots: Vec::new(),
    };
    let corrupt = s.worker_counters.corrupt_pages_read + s.corrupt_chunks_in_responses;
    s.check(
        "no corrupt pages",
        corrupt == 0,
        format!(
            "corrupt_pages_read {} (workers), corrupt_chunks {} (responses)",
            s.worker_counters.corrupt_pages_read, s.corrupt_chunks_in_responses
        ),
    );
    let prefills: Vec<EngineWorker> = s
        .engine_workers
        .iter()
        .filter(|w| w.decode.is_none())
        .cloned()
        .collect();
    if !s.engine_workers.is_empty() {
        let bare: Vec<&str> = s
            .engine_workers
            .iter()
            .filter(|w| w.pools.is_empty())
            .map(|w| w.pod.as_str())
            .collect();
        s.check(
            "engine API: every engine worker reports its pools",
            bare.is_empty(),
            if bare.is_empty() {
                format!("{} engine workers", s.engine_workers.len())
            } else {
                format!("no pools in /report.engine of {bare:?}")
            },
        );
    }
    if !prefills.is_empty() {
        let (passed, detail) = engine_load_check(&prefills);
        s.check(ENGINE_LOAD_CHECK, passed, detail);
        if restart_ms.is_some() {
            let (passed, detail) = l3_loaded_check(&prefills);
            s.check(L3_LOADED_CHECK, passed, detail);
        }
    }
    let decodes: Vec<(&EngineWorker, &DecodeEngineFigures)> = s
        .engine_workers
        .iter()
        .filter_map(|w| Some((w, w.decode.as_ref()?)))
        .collect();
    if !decodes.is_empty() {
        let sum =
            |f: fn(&DecodeEngineFigures) -> u64| decodes.iter().map(|(_, d)| f(d)).sum::<u64>();
        let leaks: u64 = decodes.iter().map(|(w, _)| w.registration_leaks).sum();
        let silent: Vec<&str> = decodes
            .iter()
            .filter(|(_, d)| !d.summary_published && d.rooms_reserved > 0)
            .map(|(w, _)| w.pod.as_str())
            .collect();
        let (verified, corrupt, early, gaps) = (
            sum(|d| d.chunks_verified),
            sum(|d| d.corrupt_chunks + d.engine_corrupt_chunks),
            sum(|d| d.early_reuse),
            sum(|d| d.release_gaps),
        );
        let detail = format!(
            "{} decode engine workers: {} rooms reserved, {} completed, {verified} chunks and {} \
             pages verified by the engines, {corrupt} corrupt, {early} pages reused before their \
             SafeToReuse ({} Reserve replies waited for the release they named, {gaps} gaps in \
             the release numbers), {leaks} registration leaks{}",
            decodes.len(),
            sum(|d| d.rooms_reserved),
            sum(|d| d.rooms_completed),
            sum(|d| d.engine_pages),
            sum(|d| d.release_waits),
            if silent.is_empty() {
                String::new()
            } else {
                format!("; no engine summary from {silent:?}")
            }
        );
        let passed = verified > 0
            && corrupt == 0
            && early == 0
            && gaps == 0
            && leaks == 0
            && silent.is_empty();
        s.check(
            "engine API (decode): every received page verified by the engine, none corrupt, \
             none reused early",
            passed,
            detail,
        );
    }
    let c = s.requests.clone();
    s.check(
        "no request lost beyond the retry budget",
        c.failed == 0,
        format!(
            "{} failed of {} ({} retried, {} retries)",
            c.failed, c.total, c.retried, c.retries
        ),
    );
    s
}

fn pct(p: &Option<Percentiles>) -> String {
    match p {
        Some(p) => format!(
            "p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1} ms  (n={})",
            p.p50, p.p90, p.p99, p.max, p.count
        ),
        None => "no data".to_owned(),
    }
}

fn ratio(h: &HitRatio) -> String {
    format!(
        "{:.3} (L1 {:.3}, L2 {:.3}, L3 {:.3})",
        h.total, h.l1, h.l2, h.l3
    )
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.requests;
        let c = &self.worker_counters;
        writeln!(
            f,
            "workload      {} (time scale {})",
            self.source, self.time_scale
        )?;
        writeln!(
            f,
            "requests      {} total: {} ok, {} retried ({} retries), {} failed, in {:.1} s",
            r.total,
            r.ok,
            r.retried,
            r.retries,
            r.failed,
            self.duration_ms / 1000.0
        )?;
        for lost in &r.failures {
            writeln!(f, "  lost        {lost}")?;
        }
        writeln!(f, "TTFT          {}", pct(&self.ttft_ms))?;
        writeln!(f, "TPOT          {}", pct(&self.tpot_ms))?;
        writeln!(
            f,
            "throughput    {:.2} req/s, {:.0} output tokens/s",
            self.requests_per_s, self.output_tokens_per_s
        )?;
        writeln!(
            f,
            "prefix hits   {} (first prefills); unbounded-cache ceiling {:.3}{}",
            ratio(&self.hit_ratio),
            self.unbounded_hit_ratio,
            self.unbounded_hit_ratio_counted
                .map(|c| format!(" ({c:.3} for the requests counted)"))
                .unwrap_or_default()
        )?;
        if self.first_prefill_above_ceiling > 0 {
            writeln!(
                f,
                "  {} first-prefill requests hit more than their trace-order ceiling",
                self.first_prefill_above_ceiling
            )?;
        }
        if self.hit_ratio_retried.prompt_tokens > 0 {
            writeln!(
                f,
                "  retried (client or prefill) {}",
                ratio(&self.hit_ratio_retried)
            )?;
        }
        if let (Some(b), Some(a)) = (
            &self.hit_ratio_before_restart,
            &self.hit_ratio_after_restart,
        ) {
            writeln!(
                f,
                "  before restart {}\n  after restart  {}",
                ratio(b),
                ratio(a)
            )?;
        }
        let b = &self.prefill_balance;
        if !b.rooms_per_pod.is_empty() || !self.decode_routing.is_empty() {
            writeln!(
                f,
                "routing       decodes report {}; rooms per prefill pod {:?}; imbalance max/mean \
                 {:.2} per 30 s window (worst {:.2})",
                if self.decode_routing.is_empty() {
                    "no policy".to_owned()
                } else {
                    self.decode_routing.join(", ")
                },
                b.rooms_per_pod,
                b.imbalance,
                b.imbalance_max
            )?;
        }
        writeln!(
            f,
            "KV transfer   {:.1} MiB received ({:.1} MiB in responses), mean {:.1} MiB/s, peak {:.1} MiB/s",
            mib(self.kv.bytes_received),
            mib(self.kv.bytes_in_responses),
            self.kv.mean_bytes_per_s / 1048576.0,
            self.kv.peak_bytes_per_s / 1048576.0
        )?;
        writeln!(
            f,
            "aborts        {} rooms aborted, {} acks; {} pages quarantined",
            c.rooms_aborted, c.abort_acks, c.pages_quarantined
        )?;
        writeln!(
            f,
            "corruption    {} corrupt pages read, {} corrupt chunks in responses",
            c.corrupt_pages_read, self.corrupt_chunks_in_responses
        )?;
        writeln!(
            f,
            "L3            {} pages written, {} loaded back{}",
            c.l3_pages_written,
            c.l3_pages_loaded_back,
            self.l3_pages_loaded_back_after_restart
                .map(|n| format!(" ({n} by workers started after the restart)"))
                .unwrap_or_default()
        )?;
        if let Some(under) = self.decode_restart_under_traffic {
            writeln!(
                f,
                "restart       {}",
                if under {
                    "decode pods restarted while requests were still running"
                } else {
                    "no decode pod restarted before the last request (the decode restarts saw no traffic)"
                }
            )?;
        }
        writeln!(
            f,
            "workers       {} process incarnations sampled, {} failed /report GETs",
            self.worker_incarnations, self.sample_errors
        )?;
        for w in &self.engine_workers {
            let pools: Vec<String> = w
                .pools
                .iter()
                .map(|(p, d, b, r)| format!("{p} {:.0} MiB {d} {r}", mib(*b)))
                .collect();
            if let Some(d) = &w.decode {
                let [concluded, acks, fence, bypassed] = d.released;
                writeln!(
                    f,
                    "engine        {}{} {} decode: pools [{}], {} commits, {} leaks; rooms {} \
                     reserved {} completed {} failed; gate: released {concluded} concluded, \
                     {acks} on acks, {fence} on the fence, {bypassed} bypassed; {} acks, {} \
                     quarantined; engine verified {} chunks ({} pages), {} corrupt, {} reused early",
                    w.pod,
                    if w.after_restart { " (restarted)" } else { "" },
                    w.kind,
                    pools.join(", "),
                    w.registration_commits,
                    w.registration_leaks,
                    d.rooms_reserved,
                    d.rooms_completed,
                    d.rooms_failed,
                    d.acks,
                    d.quarantined,
                    d.chunks_verified,
                    d.engine_pages,
                    d.corrupt_chunks + d.engine_corrupt_chunks,
                    d.early_reuse
                )?;
                continue;
            }
            writeln!(
                f,
                "engine        {}{} {} prefill: pools [{}], {} commits, {} leaks; rooms {} sent {} failed; \
                 loads {} L2 + {} L3 pages ({} with L3 bytes), {} waits, {} read before ready; \
                 engine verified {} loaded pages, {} corrupt chunks",
                w.pod,
                if w.after_restart { " (restarted)" } else { "" },
                w.kind,
                pools.join(", "),
                w.registration_commits,
                w.registration_leaks,
                w.rooms_sent,
                w.rooms_failed,
                w.pages_loaded_l2,
                w.pages_loaded_l3,
                w.pages_loaded_from_l3,
                w.load_waits,
                w.read_before_ready,
                w.engine_pages_verified,
                w.engine_corrupt_chunks
            )?;
        }
        for e in &self.events {
            writeln!(
                f,
                "event         {:>9.1} s  {:<14} {}",
                e.t_ms / 1000.0,
                e.kind,
                e.detail
            )?;
        }
        if let Some(t) = &self.teardown {
            writeln!(
                f,
                "teardown      {} pods, order {}",
                t.pods.len(),
                match &t.violation {
                    None => "held (decode → prefill → cache)".to_owned(),
                    Some(v) => format!("VIOLATED: {v}"),
                }
            )?;
        }
        for c in &self.checks {
            writeln!(
                f,
                "check         [{}] {}: {}",
                if c.passed { "pass" } else { "FAIL" },
                c.name,
                c.detail
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::front_door::{TandemBlock, TierTokens};
    use crate::report::workers::{Counters, WorkerReport};

    fn result(i: usize, sent: f64, outcome: Outcome, l3: u64, ttft: f64) -> RequestResult {
        RequestResult {
            index: i,
            input_tokens: 1000,
            max_tokens: 10,
            scheduled_ms: sent,
            sent_ms: sent,
            finished_ms: sent + 100.0,
            outcome,
            attempts: if outcome == Outcome::Retried { 3 } else { 1 },
            errors: Vec::new(),
            target: None,
            ttft_ms: (outcome != Outcome::Failed).then_some(ttft),
            tpot_ms: None,
            completion_tokens: 10,
            tandem: (outcome != Outcome::Failed).then(|| TandemBlock {
                prefix_hit_tokens: TierTokens { l1: 0, l2: 0, l3 },
                kv_bytes: 7,
                ..Default::default()
            }),
        }
    }

    fn sample(t: f64, uid: &str, loaded: u64, corrupt: u64) -> Sample {
        Sample {
            round: t as u64,
            t_ms: t,
            pod: uid.into(),
            uid: uid.into(),
            report: Some(WorkerReport {
                counters: Counters {
                    l3_pages_loaded_back: loaded,
                    corrupt_pages_read: corrupt,
                    ..Default::default()
                },
                ..Default::default()
            }),
            error: None,
        }
    }

    #[test]
    fn restart_split_loadback_and_checks() {
        let results = [
            result(0, 0.0, Outcome::Ok, 500, 10.0),
            result(1, 1000.0, Outcome::Retried, 300, 20.0),
            result(2, 3000.0, Outcome::Ok, 400, 30.0),
            {
                let mut r = result(3, 4000.0, Outcome::Failed, 0, 0.0);
                r.errors = vec![
                    "d0: HTTP 503: draining".into(),
                    "d1: HTTP 503: no peer".into(),
                ];
                r
            },
            // Completed on the first client attempt, but on a second prefill peer.
            {
                let mut r = result(4, 3500.0, Outcome::Ok, 1000, 40.0);
                if let Some(t) = r.tandem.as_mut() {
                    t.prefill_retries = 1;
                }
                r
            },
        ];
        // "old" existed before the restart at 2000 ms; "new" started after it and loaded back.
        let samples = [sample(500.0, "old", 5, 0), sample(2500.0, "new", 9, 0)];
        let events = [Event::new(2000.0, RESTART, "r2")];
        let s = summarize_run(ReportInput {
            source: "t".into(),
            time_scale: 1.0,
            unbounded_hit_ratio: 0.5,
            // Request 2 (first prefill, 400 hit tokens) is above its 300-token ceiling.
            ceiling_hit_tokens: &[500, 0, 300, 0, 1000],
            results: &results,
            samples: &samples,
            events: &events,
            teardown: None,
        });
        assert_eq!(
            (s.requests.ok, s.requests.retried, s.requests.failed),
            (3, 1, 1)
        );
        assert_eq!(s.requests.retries, 2);
        // The lost request is named with its last error, in the printed report too.
        assert_eq!(
            s.requests.failures,
            ["#3 after 1 attempts: d1: HTTP 503: no peer"]
        );
        assert!(s.to_string().contains("lost        #3 after 1 attempts"));
        // Hit ratios count first-prefill completions only; the client-retried request and the
        // one a second prefill peer served are apart.
        assert!((s.hit_ratio.l3 - 900.0 / 2000.0).abs() < 1e-12);
        assert_eq!(s.hit_ratio.prompt_tokens, 2000);
        assert!((s.hit_ratio_retried.l3 - 1300.0 / 2000.0).abs() < 1e-12);
        assert!((s.hit_ratio_before_restart.unwrap().l3 - 0.5).abs() < 1e-12);
        assert!((s.hit_ratio_after_restart.unwrap().l3 - 0.4).abs() < 1e-12);
        assert_eq!(s.l3_pages_loaded_back_after_restart, Some(9));
        assert_eq!(s.worker_counters.l3_pages_loaded_back, 14);
        assert_eq!(s.ttft_ms.unwrap().p50, 20.0);
        assert_eq!(s.kv.bytes_in_responses, 28);
        // One lost request fails the run; no corruption passes its check.
        assert!(!s.passed());
        assert!(s.checks[0].passed && !s.checks[1].passed);
        let text = s.to_string();
        assert!(text.contains("1 failed") && text.contains("before restart"));
        assert!(text.contains("retried (client or prefill)"), "{text}");
        assert_eq!(s.first_prefill_above_ceiling, 1);
        // The ceiling of the requests counted: #0 and #2, (500 + 300) / 2000.
        assert_eq!(s.unbounded_hit_ratio_counted, Some(0.4));
        assert!(text.contains("(0.400 for the requests counted)"), "{text}");
        assert!(text.contains("1 first-prefill requests hit more"), "{text}");
    }

    #[test]
    fn corruption_fails_the_run() {
        let results = [result(0, 0.0, Outcome::Ok, 0, 1.0)];
        let clean = summarize_run(ReportInput {
            source: "t".into(),
            time_scale: 1.0,
            unbounded_hit_ratio: 0.0,
            ceiling_hit_tokens: &[],
            results: &results,
            samples: &[sample(1.0, "w", 0, 0)],
            events: &[],
            teardown: None,
        });
        assert!(clean.passed());
        let corrupt = summarize_run(ReportInput {
            source: "t".into(),
            time_scale: 1.0,
            unbounded_hit_ratio: 0.0,
            ceiling_hit_tokens: &[],
            results: &results,
            samples: &[sample(1.0, "w", 0, 2)],
            events: &[],
            teardown: None,
        });
        assert!(!corrupt.passed());
        assert_eq!(corrupt.l3_pages_loaded_back_after_restart, None);
    }
}

#[cfg(test)]
mod engine_tests {
    use super::EngineWorker;

    #[test]
    fn engine_figures_come_from_the_report_and_builtin_is_skipped() {
        let e = serde_json::json!({
            "kind": "Simulated", "rooms_sent": 9, "rooms_failed": 1,
            "pools": [{"pool": "target", "domain": "SharedMemory", "bytes": 1048576,
                       "registration": "committed"}],
            "registration": {"commits": 1, "quarantined": 0},
            "tiers": {"load_waits": 80, "read_before_ready": 0,
                      "pages_loaded": {"l2": 7, "l3": 3}, "pages_loaded_from_l3_bytes": 4},
            "engine_summary": {"loaded_pages": 10, "loaded_corrupt_chunks": 0,
                               "read_before_ready": 2}
        });
        let w = EngineWorker::of("p-0", "prefill", true, &e).unwrap();
        assert_eq!(w.decode, None);
        assert_eq!(
            w.pools,
            vec![(
                "target".into(),
                "SharedMemory".into(),
                1048576,
                "committed".into()
            )]
        );
        assert_eq!((w.rooms_sent, w.rooms_failed), (9, 1));
        assert_eq!((w.pages_loaded_l2, w.pages_loaded_l3), (7, 3));
        assert_eq!(w.pages_loaded_from_l3, 4);
        assert_eq!(w.load_waits, 80);
        assert_eq!(
            w.read_before_ready, 2,
            "the engine's early reads count as well"
        );
        assert_eq!(w.engine_pages_verified, 10);
        assert!(
            EngineWorker::of(
                "p-1",
                "prefill",
                false,
                &serde_json::json!({"kind": "builtin"})
            )
            .is_none()
        );
    }

    #[test]
    fn decode_engine_figures_come_from_the_report_and_the_engine_summary() {
        let e = serde_json::json!({
            "kind": "Simulated", "rooms_reserved": 12, "rooms_completed": 10, "rooms_failed": 2,
            "pools": [{"pool": "target", "domain": "SharedMemory", "bytes": 1048576,
                       "registration": "committed"}],
            "registration": {"commits": 2, "quarantined": 0},
            "releases": {"concluded": 10, "acks": 2, "transport": 0, "bypassed": 0},
            "acks": 2, "quarantined": 0, "chunks_verified": 800, "corrupt_chunks": 0,
            "engine_summary": {"pages": 100, "corrupt_chunks": 0, "decode": {"early_reuse": 1}}
        });
        let w = EngineWorker::of("d-0", "decode", false, &e).unwrap();
        let d = w.decode.clone().unwrap();
        assert_eq!(
            (d.rooms_reserved, d.rooms_completed, d.rooms_failed),
            (12, 10, 2)
        );
        assert_eq!(d.released, [10, 2, 0, 0]);
        assert_eq!((d.acks, d.chunks_verified, d.engine_pages), (2, 800, 100));
        assert_eq!(d.early_reuse, 1);
        assert!(d.summary_published);
        assert_eq!(w.registration_commits, 2);
        // Through the summary: the figures come from a decode worker's sampled /report.
        let sample = |early: u64| crate::report::workers::Sample {
            round: 1,
            t_ms: 1.0,
            pod: "d-0".into(),
            uid: "d-0".into(),
            report: Some(crate::report::workers::WorkerReport {
                role: "decode".into(),
                engine: Some({
                    let mut e = e.clone();
                    e["engine_summary"]["decode"]["early_reuse"] = early.into();
                    e
                }),
                ..Default::default()
            }),
            error: None,
        };
        let name = "engine API (decode): every received page verified by the engine, none \
                    corrupt, none reused early";
        for (early, pass) in [(0, true), (1, false)] {
            let s = super::summarize_run(super::ReportInput {
                source: "t".into(),
                time_scale: 1.0,
                unbounded_hit_ratio: 0.0,
                ceiling_hit_tokens: &[],
                results: &[],
                samples: &[sample(early)],
                events: &[],
                teardown: None,
            });
            let c = s
                .checks
                .iter()
                .find(|c| c.name == name)
                .expect("the decode check");
            assert_eq!(c.passed, pass, "{c:?}");
            assert!(s.to_string().contains("d-0 Simulated decode"), "{s}");
        }
    }
}
