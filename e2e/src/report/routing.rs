//! Prefill routing in the report (issue 16 item 2): how evenly the decodes spread rooms over the
//! prefill pods ([`PrefillBalance`], in `results.json`), which policy the decodes reported
//! ([`decode_routing`]), and the side-by-side table of two demo runs, round-robin against the
//! prefix-aware default, least-work ([`RoutingAb`], `tandem-e2e demo --routing-ab`).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::summary::Summary;
use super::workers::Sample;
use crate::replay::{Outcome, RequestResult};

/// Window of [`PrefillBalance`], by the requests' send time.
pub const BALANCE_WINDOW_MS: f64 = 30_000.0;

/// Rooms per prefill pod (`tandem.prefill_worker` of the completed requests: the prefill that
/// computed the KV the decode used) and their imbalance.
///
/// The pods change during a demo (the scale-up adds prefill pods at 30 %, the rolling restart
/// replaces them), so the imbalance is taken per window of [`BALANCE_WINDOW_MS`]: in each window,
/// max / mean of the rooms per pod over the pods serving then (a pod is serving from its first to
/// its last room; one that got no room in the window counts 0), weighted by the window's rooms.
/// 1.0 is perfectly even; round-robin's is not 1.0 either (retries, pods joining and leaving).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillBalance {
    /// Completed requests per prefill pod, whole replay.
    pub rooms_per_pod: BTreeMap<String, u64>,
    /// Room-weighted mean over the windows of max / mean rooms per serving pod.
    pub imbalance: f64,
    /// The largest window's max / mean.
    pub imbalance_max: f64,
    /// Windows counted.
    pub windows: usize,
}

/// [`PrefillBalance`] of `results`.
pub fn prefill_balance(results: &[RequestResult]) -> PrefillBalance {
    let rooms: Vec<(&str, f64)> = results
        .iter()
        .filter(|r| r.outcome != Outcome::Failed)
        .filter_map(|r| {
            let pod = r.tandem.as_ref()?.prefill_worker.as_str();
            (!pod.is_empty()).then_some((pod, r.sent_ms))
        })
        .collect();
    let mut b = PrefillBalance::default();
    let mut span: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for &(pod, t) in &rooms {
        *b.rooms_per_pod.entry(pod.to_owned()).or_insert(0) += 1;
        let s = span.entry(pod).or_insert((t, t));
        s.0 = s.0.min(t);
        s.1 = s.1.max(t);
    }
    let Some(start) = rooms.iter().map(|r| r.1).reduce(f64::min) else {
        return b;
    };
    let end = rooms.iter().map(|r| r.1).fold(start, f64::max);
    let n = (((end - start) / BALANCE_WINDOW_MS).floor() as usize) + 1;
    let (mut weighted, mut weight) = (0.0, 0.0);
    for w in 0..n {
        let (t0, t1) = (
            start + w as f64 * BALANCE_WINDOW_MS,
            start + (w + 1) as f64 * BALANCE_WINDOW_MS,
        );
        let serving: Vec<&str> = span
            .iter()
            .filter(|(_, (first, last))| *first < t1 && *last >= t0)
            .map(|(p, _)| *p)
            .collect();
        let counts: Vec<f64> = serving
            .iter()
            .map(|p| {
                rooms
                    .iter()
                    .filter(|(q, t)| q == p && *t >= t0 && *t < t1)
                    .count() as f64
            })
            .collect();
        let total: f64 = counts.iter().sum();
        if total == 0.0 {
            continue;
        }
        let ratio = counts.iter().copied().fold(0.0, f64::max) / (total / counts.len() as f64);
        weighted += ratio * total;
        weight += total;
        b.imbalance_max = b.imbalance_max.max(ratio);
        b.windows += 1;
    }
    b.imbalance = if weight > 0.0 { weighted / weight } else { 0.0 };
    b
}

/// The routing policies the decode workers reported in `/report.routing` (`least-work`,
/// `round-robin`, `affinity:SKEW`), each once, sorted; empty when no decode reported one.
pub fn decode_routing(samples: &[Sample]) -> Vec<String> {
    let mut out: Vec<String> = samples
        .iter()
        .filter_map(|s| s.report.as_ref())
        .filter(|r| r.role == "decode")
        .filter_map(|r| {
            let v = r.routing.as_ref()?;
            let policy = v["policy"].as_str()?;
            Some(match v["max_skew"].as_u64() {
                Some(k) => format!("{policy}:{k}"),
                None => policy.to_owned(),
            })
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The decode worker's routing knob (`worker/src/roles/decode/routing.rs`, `ROUTING_ENV`).
pub const ROUTING_ENV: &str = "TANDEM_DECODE_ROUTING";

/// The two policies of the A/B, in run order: (label, `TANDEM_DECODE_ROUTING` value): the
/// baseline, then the decode's default.
pub const AB_POLICIES: [(&str, &str); 2] =
    [("round-robin", "round-robin"), ("least-work", "least-work")];

/// The baseline's label in [`AB_POLICIES`].
const BASELINE: &str = AB_POLICIES[0].0;
/// The prefix-aware policy's label in [`AB_POLICIES`].
const AWARE: &str = AB_POLICIES[1].0;

/// One run's figures in the A/B table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbRow {
    /// The policy asked for (`TANDEM_DECODE_ROUTING`).
    pub policy: String,
    /// What the decodes reported (`/report.routing`).
    pub reported: Vec<String>,
    /// Requests completed / lost.
    pub completed: usize,
    /// Lost beyond the retry budget.
    pub failed: usize,
    /// First-prefill hit ratio per tier and in all.
    pub l2: f64,
    /// From L3.
    pub l3: f64,
    /// All tiers.
    pub total: f64,
    /// The unbounded-cache ceiling of the requests the hit ratios count
    /// ([`Summary::unbounded_hit_ratio_counted`]; the whole workload's when a report lacks it).
    pub ceiling: f64,
    /// TTFT p50 (ms).
    pub ttft_p50_ms: f64,
    /// TTFT p99 (ms).
    pub ttft_p99_ms: f64,
    /// [`PrefillBalance::imbalance`].
    pub imbalance: f64,
    /// [`PrefillBalance::imbalance_max`].
    pub imbalance_max: f64,
    /// Every check of the run passed.
    pub passed: bool,
}

impl AbRow {
    /// The row of one run.
    pub fn of(policy: &str, s: &Summary) -> Self {
        let t = s.ttft_ms.as_ref();
        Self {
            policy: policy.to_owned(),
            reported: s.decode_routing.clone(),
            completed: s.requests.ok + s.requests.retried,
            failed: s.requests.failed,
            l2: s.hit_ratio.l2,
            l3: s.hit_ratio.l3,
            total: s.hit_ratio.total,
            ceiling: s
                .unbounded_hit_ratio_counted
                .unwrap_or(s.unbounded_hit_ratio),
            ttft_p50_ms: t.map_or(f64::NAN, |p| p.p50),
            ttft_p99_ms: t.map_or(f64::NAN, |p| p.p99),
            imbalance: s.prefill_balance.imbalance,
            imbalance_max: s.prefill_balance.imbalance_max,
            passed: s.passed(),
        }
    }
}

/// Round-robin and the prefix-aware policy side by side (`routing-ab.json`; its `Display` is `routing-ab.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingAb {
    /// What was run (workload, samples), one line.
    pub setting: String,
    /// The runs, in [`AB_POLICIES`] order; a run that did not finish is absent (see `missing`).
    pub rows: Vec<AbRow>,
    /// Runs without a report, with why.
    pub missing: Vec<String>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { f64::NAN } else { a / b }
}

impl RoutingAb {
    /// The row of `policy`.
    pub fn row(&self, policy: &str) -> Option<&AbRow> {
        self.rows.iter().find(|r| r.policy == policy)
    }

    /// prefix-aware / round-robin of `f`, when both ran.
    pub fn ratio_of(&self, f: fn(&AbRow) -> f64) -> Option<f64> {
        let (rr, af) = (self.row(BASELINE)?, self.row(AWARE)?);
        Some(ratio(f(af), f(rr)))
    }
}

impl fmt::Display for RoutingAb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "routing A/B: {}", self.setting)?;
        writeln!(f)?;
        writeln!(
            f,
            "| policy | decode /report | completed | lost | L2 hit | L3 hit | total hit | ceiling \
             (same requests) | total / ceiling | TTFT p50 ms | TTFT p99 ms | prefill imbalance (max/mean) | checks |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.0} | {:.0} | {:.2} \
                 (worst window {:.2}) | {} |",
                r.policy,
                if r.reported.is_empty() {
                    "none".to_owned()
                } else {
                    r.reported.join(", ")
                },
                r.completed,
                r.failed,
                r.l2,
                r.l3,
                r.total,
                r.ceiling,
                ratio(r.total, r.ceiling),
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.imbalance,
                r.imbalance_max,
                if r.passed { "pass" } else { "FAIL" }
            )?;
        }
        if let (Some(rr), Some(af)) = (self.row(BASELINE), self.row(AWARE)) {
            writeln!(
                f,
                "| {AWARE} / {BASELINE} | | | | {:.2} | {:.2} | {:.2} | | | {:.2} | {:.2} | {:.2} | |",
                ratio(af.l2, rr.l2),
                ratio(af.l3, rr.l3),
                ratio(af.total, rr.total),
                ratio(af.ttft_p50_ms, rr.ttft_p50_ms),
                ratio(af.ttft_p99_ms, rr.ttft_p99_ms),
                ratio(af.imbalance, rr.imbalance),
            )?;
            writeln!(f)?;
            writeln!(
                f,
                "goal when L3 holds the working set: {AWARE}'s total hit ratio within 10 % of the \
                 ceiling: {:.3} / {:.3} = {:.2} (≥ 0.90 {})",
                af.total,
                af.ceiling,
                ratio(af.total, af.ceiling),
                if ratio(af.total, af.ceiling) >= 0.9 {
                    "met"
                } else {
                    "NOT met"
                }
            )?;
            writeln!(
                f,
                "goal when it does not: {AWARE}'s total hit ratio ≥ 1.3 × {BASELINE}'s: {:.2} × \
                 ({})",
                ratio(af.total, rr.total),
                if ratio(af.total, rr.total) >= 1.3 {
                    "met"
                } else {
                    "NOT met"
                }
            )?;
            writeln!(
                f,
                "with p99 TTFT no worse: {:.0} ms against {:.0} ms ({})",
                af.ttft_p99_ms,
                rr.ttft_p99_ms,
                if af.ttft_p99_ms <= rr.ttft_p99_ms {
                    "met"
                } else {
                    "NOT met"
                }
            )?;
        }
        for m in &self.missing {
            writeln!(f, "missing: {m}")?;
        }
        Ok(())
    }
}

impl RoutingAb {
    /// The A/B of the runs under `dir` (`dir/round-robin/results.json`, `dir/least-work/results.json`);
    /// a run whose file is missing or unreadable is listed in `missing`.
    pub fn load(dir: &std::path::Path, setting: &str) -> Self {
        let mut ab = RoutingAb {
            setting: setting.to_owned(),
            rows: Vec::new(),
            missing: Vec::new(),
        };
        for (label, _) in AB_POLICIES {
            let path = dir.join(label).join("results.json");
            let read = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Summary>(&b).map_err(|e| e.to_string()));
            match read {
                Ok(s) => ab.rows.push(AbRow::of(label, &s)),
                Err(e) => ab.missing.push(format!("{label}: {}: {e}", path.display())),
            }
        }
        ab
    }

    /// Writes `routing-ab.json` and `routing-ab.md` into `dir`.
    ///
    /// # Errors
    /// The file that could not be written.
    pub fn write(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("routing-ab.json"), json)?;
        std::fs::write(dir.join("routing-ab.md"), self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::front_door::{TandemBlock, TierTokens};
    use crate::report::workers::WorkerReport;

    fn room(i: usize, sent: f64, pod: &str) -> RequestResult {
        RequestResult {
            index: i,
            input_tokens: 1000,
            max_tokens: 10,
            scheduled_ms: sent,
            sent_ms: sent,
            finished_ms: sent + 100.0,
            outcome: Outcome::Ok,
            attempts: 1,
            errors: Vec::new(),
            target: None,
            ttft_ms: Some(10.0),
            tpot_ms: None,
            completion_tokens: 10,
            tandem: Some(TandemBlock {
                prefix_hit_tokens: TierTokens::default(),
                prefill_worker: pod.into(),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn balance_counts_rooms_per_pod_per_window_over_the_pods_serving_then() {
        // Window 1 (0–30 s): a 3, b 1 → max/mean 3 / 2 = 1.5 over 4 rooms. Window 2 (30–60 s):
        // a 1, b 1, c 2 (c joined at 31 s) → 2 / (4/3) = 1.5 over 4 rooms. Window 3 (60–90 s):
        // b and c served last in window 2, so a alone: 1 / 1 = 1.0 over 1 room.
        let mut results = vec![
            room(0, 0.0, "a"),
            room(1, 1000.0, "a"),
            room(2, 2000.0, "a"),
            room(3, 3000.0, "b"),
            room(4, 30_500.0, "a"),
            room(5, 31_000.0, "c"),
            room(6, 32_000.0, "c"),
            room(7, 33_000.0, "b"),
            room(8, 61_000.0, "a"),
        ];
        // A lost request and one without a prefill pod count nowhere.
        let mut lost = room(9, 5000.0, "b");
        lost.outcome = Outcome::Failed;
        results.push(lost);
        results.push(room(10, 5000.0, ""));
        let b = prefill_balance(&results);
        assert_eq!(
            b.rooms_per_pod,
            BTreeMap::from([("a".into(), 5), ("b".into(), 2), ("c".into(), 2)])
        );
        assert_eq!(b.windows, 3);
        assert!((b.imbalance_max - 1.5).abs() < 1e-12, "{b:?}");
        assert!(
            (b.imbalance - (1.5 * 4.0 + 1.5 * 4.0 + 1.0) / 9.0).abs() < 1e-12,
            "{b:?}"
        );
        assert_eq!(prefill_balance(&[]), PrefillBalance::default());
    }

    #[test]
    fn the_decodes_reported_policies_once_each() {
        let s = |role: &str, routing: Option<serde_json::Value>| Sample {
            round: 0,
            t_ms: 0.0,
            pod: "p".into(),
            uid: "u".into(),
            report: Some(WorkerReport {
                role: role.into(),
                routing,
                ..Default::default()
            }),
            error: None,
        };
        let af = serde_json::json!({"policy": "affinity", "max_skew": 0});
        let samples = [
            s("decode", Some(af.clone())),
            s("decode", Some(af)),
            s("decode", Some(serde_json::json!({"policy": "round-robin"}))),
            s("prefill", Some(serde_json::json!({"policy": "other"}))),
            s("decode", None),
        ];
        assert_eq!(decode_routing(&samples), ["affinity:0", "round-robin"]);
    }

    fn row(policy: &str, l2: f64, l3: f64, p99: f64) -> AbRow {
        AbRow {
            policy: policy.into(),
            reported: vec![policy.into()],
            completed: 100,
            failed: 0,
            l2,
            l3,
            total: l2 + l3,
            ceiling: 0.2,
            ttft_p50_ms: 100.0,
            ttft_p99_ms: p99,
            imbalance: 1.2,
            imbalance_max: 1.5,
            passed: true,
        }
    }

    #[test]
    fn the_table_shows_both_runs_their_ratio_and_the_goals() {
        let ab = RoutingAb {
            setting: "trace x, 600 requests".into(),
            rows: vec![
                row("round-robin", 0.05, 0.05, 1000.0),
                row("least-work", 0.12, 0.03, 900.0),
            ],
            missing: Vec::new(),
        };
        let text = ab.to_string();
        assert!(
            text.contains(
                "| round-robin | round-robin | 100 | 0 | 0.050 | 0.050 | 0.100 | 0.200 | 0.50 | 100 \
                 | 1000 | 1.20 (worst window 1.50) | pass |"
            ),
            "{text}"
        );
        assert!(text.contains("| least-work | least-work | 100 | 0 | 0.120 | 0.030 | 0.150 |"));
        assert!(
            text.contains(
                "| least-work / round-robin | | | | 2.40 | 0.60 | 1.50 | | | 1.00 | 0.90 | 1.00 | |"
            ),
            "{text}"
        );
        assert!(
            text.contains("0.150 / 0.200 = 0.75 (≥ 0.90 NOT met)"),
            "{text}"
        );
        assert!(text.contains("1.50 × (met)"), "{text}");
        assert!(text.contains("900 ms against 1000 ms (met)"), "{text}");
        assert!((ab.ratio_of(|r| r.total).unwrap() - 1.5).abs() < 1e-12);

        // One run missing: no ratio row, the reason named.
        let half = RoutingAb {
            rows: vec![row("round-robin", 0.05, 0.05, 1000.0)],
            missing: vec!["least-work: demo phase `replay` failed".into()],
            ..ab
        };
        let text = half.to_string();
        assert!(!text.contains("least-work / round-robin") && text.contains("missing: least-work"));
        assert!(half.ratio_of(|r| r.total).is_none());
    }

    #[test]
    fn load_names_a_missing_run() {
        let dir = tempfile::tempdir().unwrap();
        let ab = RoutingAb::load(dir.path(), "s");
        assert!(ab.rows.is_empty());
        assert_eq!(ab.missing.len(), 2);
        assert!(
            ab.missing[0].starts_with("round-robin: "),
            "{:?}",
            ab.missing
        );
        ab.write(dir.path()).unwrap();
        let md = std::fs::read_to_string(dir.path().join("routing-ab.md")).unwrap();
        assert!(md.starts_with("routing A/B: s\n"), "{md}");
    }

    #[test]
    fn a_row_reads_the_summary() {
        let json = serde_json::json!({
            "source": "t", "time_scale": 1.0, "duration_ms": 1.0,
            "requests": {"total": 3, "ok": 2, "retried": 1, "failed": 0, "retries": 1},
            "ttft_ms": {"count": 3, "mean": 2.0, "p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0},
            "tpot_ms": null, "requests_per_s": 1.0, "output_tokens_per_s": 1.0,
            "unbounded_hit_ratio": 0.2,
            "hit_ratio": {"l1": 0.0, "l2": 0.1, "l3": 0.05, "total": 0.15, "prompt_tokens": 9},
            "hit_ratio_before_restart": null, "hit_ratio_after_restart": null,
            "over_time": [], "kv": {"bytes_in_responses": 0, "bytes_sent": 0, "bytes_received": 0,
                "mean_bytes_per_s": 0.0, "peak_bytes_per_s": 0.0, "over_time": []},
            "worker_counters": {}, "worker_incarnations": 1, "sample_errors": 0,
            "corrupt_chunks_in_responses": 0, "l3_pages_loaded_back_after_restart": null,
            "events": [], "teardown": null, "checks": [], "plots": []
        });
        // A results.json written before this field still reads (no balance, no policy).
        let s: Summary = serde_json::from_value(json).unwrap();
        let r = AbRow::of("least-work", &s);
        assert_eq!((r.completed, r.failed), (3, 0));
        assert_eq!((r.l2, r.l3, r.total, r.ceiling), (0.1, 0.05, 0.15, 0.2));
        assert_eq!((r.ttft_p50_ms, r.ttft_p99_ms), (2.0, 3.0));
        assert_eq!(r.imbalance, 0.0);
        assert!(r.reported.is_empty() && r.passed);
    }
}
