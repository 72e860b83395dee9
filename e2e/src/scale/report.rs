//! The scale report: `scale.json`, `scale.md` (each figure beside its N) and SVG plots
//! (plotters' SVG backend, the font handling of [`crate::report::plots`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use super::probe::{ProcSample, ServingPoint};
use crate::report::percentile::Percentiles;
use crate::report::plots::font_available;

/// `status.rollout.phase` of a pool with nothing to roll out.
pub const IDLE: &str = "Idle";
/// RSS goal at N = 1,000 (issue 17).
pub const RSS_GOAL_MIB: f64 = 256.0;

/// The figures of one N.
#[derive(Debug, Clone, Serialize)]
pub struct RunFigures {
    /// Stacks (CacheTier + PrefillPool + DecodePool).
    pub n: usize,
    /// kwok nodes.
    pub nodes: u32,
    /// `nvidia.com/gpu` per node.
    pub gpus_per_node: u32,
    /// The operator's `--resync-seconds`.
    pub resync_seconds: u64,
    /// The operator's `--child-cache` (false: children LISTed on every reconcile, the baseline).
    pub read_cache: bool,
    /// Seconds to apply every stack.
    pub apply_s: f64,
    /// Seconds from the first apply until every object was Ready.
    pub all_ready_s: f64,
    /// Seconds from the first apply until the operator was quiet (no write for 5 s).
    pub settled_s: f64,
    /// Apply-to-Ready per stack (ms).
    pub apply_to_ready_ms: Option<Percentiles>,
    /// Stacks seen Ready.
    pub stacks_ready: usize,
    /// Stacks applied per second (`None`: a burst, as fast as the API server took them).
    pub apply_rate: Option<f64>,
    /// Where each stack's apply→Ready went.
    pub phases: PhaseSplit,
    /// Reconciles from the first apply until settled.
    pub reconciles_busy: f64,
    /// Reconcile latency p50 over apply → settled: at most this (histogram bucket bound, s).
    pub reconcile_p50_le_s: Option<f64>,
    /// Reconcile latency p99 over apply → settled (bucket bound, s).
    pub reconcile_p99_le_s: Option<f64>,
    /// Reconcile latency p50 of the steady resyncs (bucket bound, s).
    pub reconcile_steady_p50_le_s: Option<f64>,
    /// Reconcile latency p99 of the steady resyncs (bucket bound, s).
    pub reconcile_steady_p99_le_s: Option<f64>,
    /// Largest `reconciles_in_flight` sampled (queue depth).
    pub queue_depth_max: f64,
    /// Mean `reconciles_in_flight` sampled.
    pub queue_depth_mean: f64,
    /// Peak RSS of the operator (`VmHWM`, MiB) when settled.
    pub peak_rss_mib: f64,
    /// RSS when settled (MiB).
    pub rss_settled_mib: f64,
    /// Operator CPU seconds from its start until settled.
    pub cpu_s_to_settled: f64,
    /// Operator CPU over the steady window (% of one core).
    pub steady_cpu_percent: f64,
    /// `apiserver_request_total` growth from before the first apply until settled, by verb (all
    /// clients).
    pub api_requests_by_verb: BTreeMap<String, f64>,
    /// The same by `verb/resource`.
    pub api_requests_by_verb_resource: BTreeMap<String, f64>,
    /// Mean API server request latency over the same span, by verb (ms; from
    /// `apiserver_request_duration_seconds` sum and count): what every reconcile's API calls wait.
    pub api_request_mean_ms_by_verb: BTreeMap<String, f64>,
    /// The operator's own writes over the same span, by verb.
    pub operator_writes_by_verb: BTreeMap<String, f64>,
    /// The operator's events from its start until settled, by reason (series counted): what its
    /// writes were for — e.g. `RollingRestart` on a fresh apply means groups replaced right after
    /// they were created.
    pub operator_events_by_reason: BTreeMap<String, f64>,
    /// Length of the steady window (s).
    pub steady_window_s: f64,
    /// Reconciles in the steady window (at least 3N: every object resynced).
    pub steady_reconciles: f64,
    /// Operator writes in the steady window.
    pub steady_writes: f64,
    /// `steady_writes` per full resync of every object (must be 0).
    pub writes_per_steady_resync: f64,
    /// `/proc/loadavg` (1, 5, 15 min) when the stacks were applied and when settled: the
    /// machine's load, which every latency here includes (two cores shared with other work).
    pub load_avg: [[f64; 3]; 2],
    /// The operator process over time (until settled).
    pub process: Vec<ProcSample>,
    /// Where the pods went, when the sample pools carry `spec.placement` (issue 17).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<super::placement::PlacementFigures>,
}

/// A stack's apply→Ready in three parts (ms, over the stacks whose three instants were seen):
/// from its first apply sent to its first StatefulSet (the operator picked it up and wrote), from
/// there to its last pod Ready (the StatefulSet controller, scheduler and kubelet — kwok here), and
/// from there to the stack Ready (the operator saw the pods and wrote the pools' status). The
/// operator's parts are the ones that must stay flat in N; the middle one is the control plane's.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PhaseSplit {
    /// First apply sent → first StatefulSet seen.
    pub operator_pickup_ms: Option<Percentiles>,
    /// First StatefulSet → last pod Ready.
    pub control_plane_ms: Option<Percentiles>,
    /// Last pod Ready → every object of the stack Ready.
    pub operator_ready_ms: Option<Percentiles>,
    /// Pods replaced under the same name (a new UID) by the time every stack was Ready, over all
    /// stacks: the operator restarting a group it had just created, which the control-plane part
    /// then holds.
    pub pods_replaced: usize,
}

/// `/proc/loadavg`'s three averages (zeros when unreadable).
pub fn load_avg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut v = text.split_whitespace().map(|x| x.parse().unwrap_or(0.0));
    [
        v.next().unwrap_or(0.0),
        v.next().unwrap_or(0.0),
        v.next().unwrap_or(0.0),
    ]
}

/// The scale 1 → target and rolling-restart experiment.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleFigures {
    /// Decode groups scaled to (prefill follows 1:1).
    pub target: u32,
    /// Pods per group.
    pub group_size: u32,
    /// Seconds from apply to Ready at one group.
    pub initial_ready_s: f64,
    /// Seconds from the scale patch until both pools were Ready at `target` groups.
    pub scale_up_s: f64,
    /// Seconds from the `restart.id` patch until both pools were idle and Ready at the new
    /// revision.
    pub restart_s: f64,
    /// Revision before the restart.
    pub revision_before: String,
    /// Revision after.
    pub revision_after: String,
    /// Pods before the restart.
    pub pods_before_restart: usize,
    /// Of those, pods gone after the restart (replaced).
    pub pods_replaced: usize,
    /// Pod UIDs first seen during the restart.
    pub pods_created_during_restart: usize,
    /// Fewest decode groups serving at any pod event of the restart.
    pub min_serving_decode_during_restart: u32,
    /// Fewest prefill groups serving at any pod event of the restart.
    pub min_serving_prefill_during_restart: u32,
    /// Most decode groups not serving at once during the restart.
    pub max_not_serving_decode_during_restart: u32,
    /// Most prefill groups not serving at once during the restart.
    pub max_not_serving_prefill_during_restart: u32,
    /// Tracker time of the scale patch (s).
    pub scale_started_at_s: f64,
    /// Tracker time of the restart patch (s).
    pub restart_started_at_s: f64,
    /// Tracker time the restart was seen converged (s).
    pub restart_ended_at_s: f64,
    /// Groups serving at every pod event.
    pub points: Vec<ServingPoint>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// What the figures are (readiness source, simulated nodes, what changed in the samples).
    pub method: Vec<String>,
    /// One entry per N.
    pub runs: Vec<RunFigures>,
    /// The scale/restart experiment, if run.
    pub scaled: Option<ScaleFigures>,
    /// Checks: `(name, passed, detail)`.
    pub checks: Vec<(String, bool, String)>,
}

/// How the run's operator read children.
fn children_read(r: &RunFigures) -> &'static str {
    if r.read_cache {
        "reads cached"
    } else {
        "reads from the API server"
    }
}

fn ms(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_infinite() => "> 8.2 s".into(),
        Some(v) => format!("≤ {:.0} ms", v * 1e3),
        None => "-".into(),
    }
}

/// One line per N for the console.
pub fn row_line(r: &RunFigures) -> String {
    let a = r.apply_to_ready_ms;
    format!(
        "N = {} ({}): apply-to-Ready p50 {:.0} ms p99 {:.0} ms; reconcile p50 {} p99 {}; queue depth \
         max {:.0}; peak RSS {:.1} MiB; CPU {:.1} s to settled, {:.1} % steady; writes per steady \
         resync {} ({} writes over {:.0} reconciles)",
        r.n,
        children_read(r),
        a.map_or(f64::NAN, |a| a.p50),
        a.map_or(f64::NAN, |a| a.p99),
        ms(r.reconcile_p50_le_s),
        ms(r.reconcile_p99_le_s),
        r.queue_depth_max,
        r.peak_rss_mib,
        r.cpu_s_to_settled,
        r.steady_cpu_percent,
        r.writes_per_steady_resync,
        r.steady_writes,
        r.steady_reconciles
    )
}

impl ScaleReport {
    /// The report of `runs` and `scaled`, with its checks.
    pub fn new(runs: Vec<RunFigures>, scaled: Option<ScaleFigures>) -> Self {
        let mut checks = Vec::new();
        for r in &runs {
            checks.push((
                format!("N={}: every stack Ready", r.n),
                r.stacks_ready == r.n,
                format!("{}/{} stacks Ready", r.stacks_ready, r.n),
            ));
            checks.push((
                format!("N={}: 0 writes per steady resync", r.n),
                r.steady_writes == 0.0 && r.steady_reconciles >= 3.0 * r.n as f64,
                format!(
                    "{} writes over {} reconciles (≥ {} = one resync of every object)",
                    r.steady_writes,
                    r.steady_reconciles,
                    3 * r.n
                ),
            ));
            if r.n >= 1000 {
                checks.push((
                    format!("N={}: peak RSS under {RSS_GOAL_MIB} MiB", r.n),
                    r.peak_rss_mib < RSS_GOAL_MIB,
                    format!("{:.1} MiB", r.peak_rss_mib),
                ));
            }
        }
        if let Some(s) = &scaled {
            checks.push((
                "restart: never all groups down".into(),
                s.min_serving_decode_during_restart > 0 && s.min_serving_prefill_during_restart > 0,
                format!(
                    "fewest serving during the restart: decode {}/{}, prefill {}/{}",
                    s.min_serving_decode_during_restart,
                    s.target,
                    s.min_serving_prefill_during_restart,
                    s.target
                ),
            ));
            checks.push((
                "restart: every pod replaced".into(),
                s.pods_replaced == s.pods_before_restart && s.revision_after != s.revision_before,
                format!(
                    "{}/{} pods replaced; revision {} → {}",
                    s.pods_replaced, s.pods_before_restart, s.revision_before, s.revision_after
                ),
            ));
        }
        Self {
            method: method(),
            runs,
            scaled,
            checks,
        }
    }

    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.1)
    }

    /// The markdown report.
    pub fn markdown(&self) -> String {
        let mut m = String::from("# Tandem operator at scale (kwok)\n\n");
        for line in &self.method {
            let _ = writeln!(m, "- {line}");
        }
        m.push_str(
            "\n| N | reads | nodes | apply (s) | all Ready (s) | apply→Ready p50 (ms) | p99 (ms) | max (ms) | \
             reconcile p50 | reconcile p99 | steady reconcile p99 | queue depth max / mean | \
             peak RSS (MiB) | CPU to settled (s) | steady CPU (%) | steady reconciles | writes \
             per steady resync | load avg (1 min) at apply / settled |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for r in &self.runs {
            let a = r.apply_to_ready_ms;
            let _ = writeln!(
                m,
                "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {:.0} / {:.2} | {:.1} | {:.1} | {:.1} | {:.0} | {} | {:.1} / {:.1} |",
                r.n,
                if r.read_cache { "cached" } else { "API" },
                r.nodes,
                r.apply_s,
                r.all_ready_s,
                a.map_or(f64::NAN, |a| a.p50),
                a.map_or(f64::NAN, |a| a.p99),
                a.map_or(f64::NAN, |a| a.max),
                ms(r.reconcile_p50_le_s),
                ms(r.reconcile_p99_le_s),
                ms(r.reconcile_steady_p99_le_s),
                r.queue_depth_max,
                r.queue_depth_mean,
                r.peak_rss_mib,
                r.cpu_s_to_settled,
                r.steady_cpu_percent,
                r.steady_reconciles,
                r.writes_per_steady_resync,
                r.load_avg[0][0],
                r.load_avg[1][0]
            );
        }
        m.push_str(
            "\n## Where apply→Ready goes (ms, p50 / p99)\n\nOperator pickup: a stack's first \
             apply sent (its namespace; the tier's apply follows) → its first StatefulSet seen. \
             Control plane: → its last pod Ready (StatefulSet controller, scheduler, kwok — and \
             the operator's later children: the prefill groups the DecodePool's ratio adds, the \
             decode's StatefulSet, pods it replaces). Operator ready: → every object of the stack \
             Ready. The parts add up to first apply sent → Ready; apply→Ready counts from the \
             last apply returned. A burst of N stacks makes the middle part grow with N on any \
             machine of fixed size.\n\n\
             | N | applied | operator pickup | control plane | operator ready | apply→Ready | pods replaced |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for r in &self.runs {
            let pq = |p: Option<Percentiles>| {
                p.map_or_else(|| "-".into(), |p| format!("{:.0} / {:.0}", p.p50, p.p99))
            };
            let _ = writeln!(
                m,
                "| {} | {} | {} | {} | {} | {} | {} |",
                r.n,
                r.apply_rate
                    .map_or_else(|| "burst".into(), |v| format!("{v} stacks/s")),
                pq(r.phases.operator_pickup_ms),
                pq(r.phases.control_plane_ms),
                pq(r.phases.operator_ready_ms),
                pq(r.apply_to_ready_ms),
                r.phases.pods_replaced,
            );
        }
        m.push_str("\n## API requests, first apply → settled (all clients), by verb\n\n");
        for r in &self.runs {
            let verbs: Vec<String> = r
                .api_requests_by_verb
                .iter()
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect();
            let ops: Vec<String> = r
                .operator_writes_by_verb
                .iter()
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect();
            let lat: Vec<String> = r
                .api_request_mean_ms_by_verb
                .iter()
                .map(|(k, v)| format!("{k} {v:.1}"))
                .collect();
            let _ = writeln!(
                m,
                "- N = {}: {}; of which the operator's writes: {}; mean API server latency (ms): {}",
                r.n,
                verbs.join(", "),
                ops.join(", "),
                lat.join(", ")
            );
        }
        m.push_str("\nThe operator's events by reason, its start → settled:\n\n");
        for r in &self.runs {
            let mut ev: Vec<(&String, &f64)> = r.operator_events_by_reason.iter().collect();
            ev.sort_by(|a, b| b.1.total_cmp(a.1).then(a.0.cmp(b.0)));
            let ev: Vec<String> = ev.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
            let _ = writeln!(m, "- N = {}: {}", r.n, ev.join(", "));
        }
        m.push_str("\nTop verb/resource pairs:\n\n");
        for r in &self.runs {
            let mut top: Vec<(&String, &f64)> = r.api_requests_by_verb_resource.iter().collect();
            top.sort_by(|a, b| b.1.total_cmp(a.1));
            let top: Vec<String> = top
                .iter()
                .take(10)
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect();
            let _ = writeln!(m, "- N = {}: {}", r.n, top.join(", "));
        }
        if let Some(s) = &self.scaled {
            let _ = write!(
                m,
                "\n## One pool scaled 1 → {t} decode groups, then a rolling restart\n\n\
                 Prefill follows the ratio (1:1, {t} prefill groups); {g} pod(s) per group.\n\n\
                 | step | seconds |\n|---|---|\n\
                 | apply → Ready at 1 group | {:.1} |\n| scale 1 → {t} (both pools Ready) | {:.1} |\n\
                 | rolling restart of {t} + {t} groups (both idle, new revision) | {:.1} |\n\n\
                 During the restart: fewest decode groups serving {}/{t} (most not serving at once: \
                 {}), fewest prefill groups serving {}/{t} (most not serving: {}); {}/{} pods \
                 replaced; revision {} → {}.\n",
                s.initial_ready_s,
                s.scale_up_s,
                s.restart_s,
                s.min_serving_decode_during_restart,
                s.max_not_serving_decode_during_restart,
                s.min_serving_prefill_during_restart,
                s.max_not_serving_prefill_during_restart,
                s.pods_replaced,
                s.pods_before_restart,
                s.revision_before,
                s.revision_after,
                t = s.target,
                g = s.group_size,
            );
        }
        m.push_str("\n## Checks\n\n");
        for (name, ok, detail) in &self.checks {
            let _ = writeln!(m, "- [{}] {name}: {detail}", if *ok { "x" } else { " " });
        }
        m.push_str(
            "\nPlots: `apply_to_ready.svg`, `apply_to_ready_split.svg`, `reconcile.svg`, `rss.svg`, `serving.svg` (when the \
             scale experiment ran).\n",
        );
        m
    }

    /// Writes `scale.json`, `scale.md` and the SVG plots into `dir`.
    ///
    /// # Errors
    /// A file could not be written or a plot drawn.
    pub fn write(&self, dir: &Path) -> Result<(), std::io::Error> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("scale.json"), json)?;
        std::fs::write(dir.join("scale.md"), self.markdown())?;
        self.plots(dir).map_err(std::io::Error::other)?;
        Ok(())
    }

    fn plots(&self, dir: &Path) -> Result<(), String> {
        let text = font_available();
        let ns: Vec<f64> = self.runs.iter().map(|r| r.n as f64).collect();
        let pick = |f: &dyn Fn(&RunFigures) -> Option<f64>| -> Vec<(f64, f64)> {
            self.runs
                .iter()
                .filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (r.n as f64, v)))
                .collect()
        };
        if !ns.is_empty() {
            xy_plot(
                &dir.join("apply_to_ready.svg"),
                text,
                ("apply-to-Ready per stack", "stacks (N)", "ms"),
                &[
                    ("p50", BLUE, pick(&|r| r.apply_to_ready_ms.map(|a| a.p50))),
                    ("p99", RED, pick(&|r| r.apply_to_ready_ms.map(|a| a.p99))),
                ],
            )?;
            xy_plot(
                &dir.join("apply_to_ready_split.svg"),
                text,
                ("apply-to-Ready split, p99 per part", "stacks (N)", "ms"),
                &[
                    (
                        "operator pickup",
                        BLUE,
                        pick(&|r| r.phases.operator_pickup_ms.map(|a| a.p99)),
                    ),
                    (
                        "control plane",
                        GREEN,
                        pick(&|r| r.phases.control_plane_ms.map(|a| a.p99)),
                    ),
                    (
                        "operator ready",
                        RED,
                        pick(&|r| r.phases.operator_ready_ms.map(|a| a.p99)),
                    ),
                ],
            )?;
            xy_plot(
                &dir.join("reconcile.svg"),
                text,
                ("reconcile latency (bucket bound)", "stacks (N)", "ms"),
                &[
                    (
                        "p50",
                        BLUE,
                        pick(&|r| r.reconcile_p50_le_s.map(|v| v * 1e3)),
                    ),
                    ("p99", RED, pick(&|r| r.reconcile_p99_le_s.map(|v| v * 1e3))),
                    (
                        "steady p99",
                        GREEN,
                        pick(&|r| r.reconcile_steady_p99_le_s.map(|v| v * 1e3)),
                    ),
                ],
            )?;
            xy_plot(
                &dir.join("rss.svg"),
                text,
                ("operator peak RSS", "stacks (N)", "MiB"),
                &[("peak RSS", BLUE, pick(&|r| Some(r.peak_rss_mib)))],
            )?;
        }
        if let Some(s) = &self.scaled {
            let d: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|p| (p.t_s, f64::from(p.decode)))
                .collect();
            let p: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|p| (p.t_s, f64::from(p.prefill)))
                .collect();
            xy_plot(
                &dir.join("serving.svg"),
                text,
                (
                    "groups serving: scale 1 → target, then rolling restart",
                    "time (s)",
                    "groups",
                ),
                &[("decode", BLUE, d), ("prefill", RED, p)],
            )?;
        }
        Ok(())
    }
}

/// One line of a chart: label, colour, points.
type Line<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

/// Lines of `(label, colour, points)` on one SVG chart.
fn xy_plot(
    path: &Path,
    text: bool,
    (title, x_desc, y_desc): (&str, &str, &str),
    series: &[Line<'_>],
) -> Result<(), String> {
    let e = |m: String| format!("{}: {m}", path.display());
    let all = series.iter().flat_map(|s| s.2.iter());
    let x_max = all.clone().map(|p| p.0).fold(0.0, f64::max).max(1e-3) * 1.05;
    let y_max = all.map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.1;
    let root = SVGBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut b = ChartBuilder::on(&root);
    b.margin(14)
        .x_label_area_size(if text { 40 } else { 4 })
        .y_label_area_size(if text { 64 } else { 4 });
    if text {
        b.caption(title, ("sans-serif", 20));
    }
    let mut chart = b
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|x| e(x.to_string()))?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc(x_desc)
            .y_desc(y_desc)
            .label_style(("sans-serif", 14));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|x| e(x.to_string()))?;
    for (label, color, points) in series {
        let c = *color;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
            .map_err(|x| e(x.to_string()))?
            .label(*label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(|x| e(x.to_string()))?;
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|x| e(x.to_string()))?;
    }
    root.present().map_err(|x| e(x.to_string()))?;
    Ok(())
}

/// What the figures are, printed at the top of the report.
fn method() -> Vec<String> {
    vec![
        "Real kube-apiserver + etcd + kube-controller-manager + kube-scheduler (local, from \
         ~/.cache/k8s-e2e-tools); kwok nodes with nvidia.com/gpu capacity, \
         topology.kubernetes.io/zone (2 zones) and topology.tandem.dev/rack labels."
            .into(),
        "Pods are simulated: kwok's pod-ready stage marks a scheduled pod Running/Ready; no \
         process runs and nothing serves traffic."
            .into(),
        "Readiness: the operator decides pool Ready from pod Ready conditions only (a group is \
         ready when all its tensor × context pods are); the CacheTier's HTTP /report probe is off \
         (--probe-reports=false), so CacheWarm reads ReadyApproximation."
            .into(),
        "Stacks are manifests/samples (CacheTier + PrefillPool 4:1 + DecodePool), one namespace \
         each, without CacheTier persistence (kwok has no volume provisioner)."
            .into(),
        "The operator runs as a local process (debug or release build, whichever tandem-e2e was \
         built as) with the admin kubeconfig, no leader election; RSS/CPU from /proc."
            .into(),
        "Reconcile latency quantiles are upper bounds of the operator's histogram buckets \
         (1 ms × 2^k); queue depth is its reconciles_in_flight gauge sampled every 250 ms."
            .into(),
        "API requests: apiserver_request_total growth from the first apply until settled, every \
         client together (operator, KCM, scheduler, kwok, this harness)."
            .into(),
        "Writes per steady resync: the operator's writes_total (events included) over a window \
         in which its reconcile count grew by ≥ 3N (every object resynced), divided by the \
         resyncs."
            .into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: usize, writes: f64) -> RunFigures {
        RunFigures {
            n,
            nodes: 8,
            gpus_per_node: 8,
            resync_seconds: 20,
            read_cache: true,
            apply_s: 1.0,
            all_ready_s: 5.0,
            settled_s: 10.0,
            apply_to_ready_ms: crate::report::percentile::summarize([100.0, 200.0]),
            stacks_ready: n,
            reconciles_busy: 100.0,
            reconcile_p50_le_s: Some(0.008),
            reconcile_p99_le_s: Some(0.064),
            reconcile_steady_p50_le_s: Some(0.004),
            reconcile_steady_p99_le_s: Some(0.016),
            queue_depth_max: 3.0,
            queue_depth_mean: 0.5,
            peak_rss_mib: 40.0,
            rss_settled_mib: 38.0,
            cpu_s_to_settled: 2.0,
            steady_cpu_percent: 1.0,
            api_requests_by_verb: BTreeMap::from([("LIST".into(), 10.0)]),
            api_requests_by_verb_resource: BTreeMap::from([("LIST/pods".into(), 10.0)]),
            api_request_mean_ms_by_verb: BTreeMap::from([("LIST".into(), 3.0)]),
            operator_writes_by_verb: BTreeMap::from([("apply".into(), 5.0)]),
            operator_events_by_reason: BTreeMap::from([("Created".into(), 3.0)]),
            steady_window_s: 20.0,
            steady_reconciles: 3.0 * n as f64,
            steady_writes: writes,
            writes_per_steady_resync: writes,
            load_avg: [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]],
            process: vec![],
            placement: None,
            apply_rate: Some(2.0),
            phases: PhaseSplit {
                operator_pickup_ms: crate::report::percentile::summarize([10.0, 20.0]),
                control_plane_ms: crate::report::percentile::summarize([50.0, 150.0]),
                operator_ready_ms: crate::report::percentile::summarize([30.0, 40.0]),
                pods_replaced: 1,
            },
        }
    }

    #[test]
    fn a_steady_write_fails_the_check_and_the_report_is_written() {
        let ok = ScaleReport::new(vec![run(5, 0.0), run(10, 0.0)], None);
        assert!(ok.passed(), "{:?}", ok.checks);
        let bad = ScaleReport::new(vec![run(5, 2.0)], None);
        assert!(!bad.passed());
        let dir = tempfile::tempdir().unwrap();
        ok.write(dir.path()).unwrap();
        let md = std::fs::read_to_string(dir.path().join("scale.md")).unwrap();
        assert!(md.contains("| 10 | cached | 8 |"), "{md}");
        assert!(md.contains("- N = 10: Created 3\n"), "{md}");
        assert!(
            md.contains("| 10 | 2 stacks/s | 10 / 20 | 50 / 150 | 30 / 40 | 100 / 200 | 1 |"),
            "{md}"
        );
        let svg = std::fs::read_to_string(dir.path().join("apply_to_ready.svg")).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(dir.path().join("scale.json").exists());
    }
}
