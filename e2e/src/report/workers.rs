//! Worker `/report` samples (worker/interfaces/README.md §4) and their aggregation.
//!
//! Counters are cumulative per worker process and start over when the process restarts, so a
//! total is the sum, over every process *incarnation*, of its last sampled value. An incarnation
//! is one pod uid (a restarted StatefulSet pod keeps its name but gets a new uid); within one key,
//! any counter going down also starts a new incarnation (the process restarted in place).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The counters of a worker's `/report` (worker/interfaces/README.md §4; all u64, a counter a
/// worker does not report is 0), and the report body: the worker's own schema.
pub use tandem_interfaces::report::{ReportCounters as Counters, WorkerReport};

/// One GET of one worker's `/report`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Sampling round (all workers of a round share it).
    pub round: u64,
    /// When the answer came (ms on the replay clock).
    pub t_ms: f64,
    /// Pod name (or the URL for fixed targets).
    pub pod: String,
    /// Pod uid (or the URL): the incarnation key.
    pub uid: String,
    /// The report, when the GET succeeded and parsed.
    pub report: Option<WorkerReport>,
    /// Why not, otherwise.
    pub error: Option<String>,
}

/// One worker process as seen through its samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Incarnation {
    /// Pod name.
    pub pod: String,
    /// Role reported.
    pub role: String,
    /// Pool reported.
    pub pool: String,
    /// Revision reported.
    pub revision: String,
    /// First sample (ms).
    pub first_ms: f64,
    /// Last sample (ms).
    pub last_ms: f64,
    /// Counters at the last sample.
    pub last: Counters,
    /// The engine seat at the last sample that reported one (prefill and decode workers).
    #[serde(default)]
    pub engine: Option<serde_json::Value>,
}

/// Splits samples into process incarnations (see the module doc), in order of first appearance.
pub fn incarnations(samples: &[Sample]) -> Vec<Incarnation> {
    let mut out: Vec<Incarnation> = Vec::new();
    let mut current: BTreeMap<&str, usize> = BTreeMap::new();
    let mut ordered: Vec<&Sample> = samples.iter().filter(|s| s.report.is_some()).collect();
    ordered.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    for s in ordered {
        let Some(r) = &s.report else { continue };
        match current.get(s.uid.as_str()) {
            Some(&i) if !r.counters.went_back_from(&out[i].last) => {
                let inc = &mut out[i];
                inc.last_ms = s.t_ms;
                inc.last = r.counters;
                inc.revision.clone_from(&r.revision);
                if let Some(e) = &r.engine {
                    inc.engine = Some(draining_keeps_pools(r, e, inc.engine.as_ref()));
                }
            }
            _ => {
                current.insert(&s.uid, out.len());
                out.push(Incarnation {
                    pod: s.pod.clone(),
                    role: r.role.clone(),
                    pool: r.pool.clone(),
                    revision: r.revision.clone(),
                    first_ms: s.t_ms,
                    last_ms: s.t_ms,
                    last: r.counters,
                    engine: r.engine.clone(),
                });
            }
        }
    }
    out
}

/// The engine seat of report `r` (`e`), except that a draining worker's empty `pools` keeps the
/// pools of its `earlier` report: teardown frees the pools (DESIGN contract 9, FreeMemory) before
/// the health server stops, so the last samples of a deleted pod list none, though it served with
/// them (a demo run's check read "no pools" of a prefill sampled in that window).
fn draining_keeps_pools(
    r: &WorkerReport,
    e: &serde_json::Value,
    earlier: Option<&serde_json::Value>,
) -> serde_json::Value {
    let mut e = e.clone();
    let draining = r.phase == Some(tandem_interfaces::report::ReportPhase::Draining);
    let released = e["pools"].as_array().is_some_and(Vec::is_empty);
    if draining
        && released
        && let Some(pools) = earlier.and_then(|old| old.get("pools"))
    {
        e["pools"] = pools.clone();
    }
    e
}

/// Sum of every incarnation's last counters.
pub fn totals(incs: &[Incarnation]) -> Counters {
    let mut c = Counters::default();
    for i in incs {
        c.add(&i.last);
    }
    c
}

/// Per-round increase of one counter summed over all workers: `(t_ms, increase since the
/// previous round)`. A worker seen for the first time, or after a reset, contributes its whole
/// value (it was counted from 0 by a process the previous round did not see).
pub fn per_round_increase(samples: &[Sample], counter: fn(&Counters) -> u64) -> Vec<(f64, u64)> {
    let mut rounds: BTreeMap<u64, (f64, u64)> = BTreeMap::new();
    let mut prev: BTreeMap<&str, u64> = BTreeMap::new();
    let mut ordered: Vec<&Sample> = samples.iter().filter(|s| s.report.is_some()).collect();
    ordered.sort_by(|a, b| a.round.cmp(&b.round).then(a.t_ms.total_cmp(&b.t_ms)));
    for s in ordered {
        let Some(r) = &s.report else { continue };
        let v = counter(&r.counters);
        let before = prev.insert(&s.uid, v).unwrap_or(0);
        let inc = if v >= before { v - before } else { v };
        let e = rounds.entry(s.round).or_insert((s.t_ms, 0));
        e.0 = e.0.min(s.t_ms);
        e.1 += inc;
    }
    rounds.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_interfaces::report::ReportPhase;

    fn sample(round: u64, t: f64, uid: &str, kv: u64, loaded: u64) -> Sample {
        Sample {
            round,
            t_ms: t,
            pod: "d-0".into(),
            uid: uid.into(),
            report: Some(WorkerReport {
                role: "decode".into(),
                counters: Counters {
                    kv_bytes_received: kv,
                    l3_pages_loaded_back: loaded,
                    ..Default::default()
                },
                ..Default::default()
            }),
            error: None,
        }
    }

    #[test]
    fn a_draining_workers_released_pools_keep_the_pools_it_served_with() {
        let with = |phase, pools: serde_json::Value| {
            let mut s = sample(0, 0.0, "u1", 1, 0);
            if let Some(r) = s.report.as_mut() {
                r.phase = Some(phase);
                r.engine = Some(serde_json::json!({"pools": pools, "rooms": 3}));
            }
            s
        };
        let served = serde_json::json!([["target", "SharedMemory", 1024, "committed"]]);
        let mut s = [
            with(ReportPhase::Ready, served.clone()),
            with(ReportPhase::Draining, serde_json::json!([])),
        ];
        s[1].t_ms = 1000.0;
        let incs = incarnations(&s);
        assert_eq!(incs.len(), 1);
        let e = incs[0].engine.as_ref().unwrap();
        assert_eq!(e["pools"], served, "{e}");
        // A ready worker with no pools is reported as it is.
        s[1].report.as_mut().unwrap().phase = Some(ReportPhase::Ready);
        let incs = incarnations(&s);
        assert_eq!(
            incs[0].engine.as_ref().unwrap()["pools"],
            serde_json::json!([])
        );
    }

    #[test]
    fn report_parses_with_missing_counters() {
        let r: WorkerReport = serde_json::from_str(
            r#"{"ready":true,"role":"cache","pool":"t","revision":"r","degraded":[],
                "counters":{"l3_pages_written":5},"warm":true,"objects":3,"bytes":9}"#,
        )
        .unwrap();
        assert_eq!(r.counters.l3_pages_written, 5);
        assert_eq!(r.counters.corrupt_pages_read, 0);
        assert_eq!(r.warm, Some(true));
    }

    #[test]
    fn totals_add_every_incarnation_across_restarts() {
        let s = [
            sample(0, 0.0, "u1", 10, 0),
            sample(1, 1000.0, "u1", 30, 0),
            // Same pod restarted in place: counters went back.
            sample(2, 2000.0, "u1", 5, 2),
            // Pod recreated: new uid.
            sample(3, 3000.0, "u2", 7, 4),
            sample(4, 4000.0, "u2", 9, 4),
        ];
        let incs = incarnations(&s);
        assert_eq!(incs.len(), 3);
        assert_eq!(totals(&incs).kv_bytes_received, 30 + 5 + 9);
        assert_eq!(incs[2].first_ms, 3000.0);
        let rate = per_round_increase(&s, |c| c.kv_bytes_received);
        assert_eq!(
            rate,
            vec![
                (0.0, 10),
                (1000.0, 20),
                (2000.0, 5),
                (3000.0, 7),
                (4000.0, 2)
            ]
        );
    }
}
