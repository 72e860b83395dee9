//! One replay with its report: sample the workers while the workload runs, then aggregate and
//! write everything (what `tandem-e2e replay` does; the demo adds its cluster steps around it).

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::sampler::{ReportSource, Sampler};
use super::{ReportError, ReportInput, Summary, summarize_run, write_report};
use crate::replay::driver::{ReplayConfig, replay};
use crate::replay::schedule::Clock;
use crate::replay::targets::TargetSet;
use crate::replay::workload::{TraceRequest, ceiling_hit_tokens, unbounded_hit_ratio};

/// How often a progress line is logged when stderr is not a terminal.
const PROGRESS_LINE_EVERY: Duration = Duration::from_secs(30);

/// A progress bar over `n` requests. indicatif hides it when stderr is not a terminal (a log
/// file, CI); then a line `[replay] <finished>/<n> requests finished after <s> s (<rate>/s)` is
/// logged every 30 s instead, so a long replay shows progress in its log too. Call it inside a
/// tokio runtime for the log lines (outside one there are none).
pub fn request_bar(n: usize) -> ProgressBar {
    let bar = ProgressBar::new(n as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    if !std::io::stderr().is_terminal() {
        log_progress_lines(&bar, PROGRESS_LINE_EVERY);
    }
    bar
}

/// Logs the bar's position every `every` until it is finished, full, or dropped by everyone else
/// (the task holds only a weak reference, so a replay that ends early stops the lines too).
fn log_progress_lines(bar: &ProgressBar, every: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let weak = bar.downgrade();
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(bar) = weak.upgrade() else {
                break;
            };
            let (pos, len) = (bar.position(), bar.length().unwrap_or(0));
            let secs = bar.elapsed().as_secs_f64();
            eprintln!(
                "[replay] {pos}/{len} requests finished after {secs:.0} s ({:.1}/s)",
                pos as f64 / secs.max(1e-9)
            );
            if bar.is_finished() || pos >= len {
                break;
            }
        }
    });
}

/// Where the report of a replay comes from and goes.
pub struct Session<'a> {
    /// Workers whose `/report` is sampled.
    pub reports: ReportSource,
    /// Sampling period.
    pub sample_every: Duration,
    /// Report directory.
    pub out: &'a Path,
    /// Progress bar over the requests.
    pub bar: Option<ProgressBar>,
}

/// Replays `workload` (described by `source`) against `targets` while sampling the workers, then
/// writes the report and returns the summary (with the checks every replay has).
///
/// Errors: only writing the report; failed requests are results.
pub async fn replay_and_report(
    workload: &[TraceRequest],
    source: String,
    targets: &TargetSet,
    config: &ReplayConfig,
    session: Session<'_>,
) -> Result<Summary, ReportError> {
    let Session {
        reports,
        sample_every,
        out,
        bar,
    } = session;
    let clock = Clock::start();
    let sampler = Sampler::start(reports, sample_every, clock);
    let results = replay(workload, targets, config, clock, None, bar).await;
    // A last round after the replay so every worker's final counters are in.
    let samples = sampler.finish().await;
    let ceiling = ceiling_hit_tokens(workload);
    let mut summary = summarize_run(ReportInput {
        source,
        time_scale: config.time_scale,
        unbounded_hit_ratio: unbounded_hit_ratio(workload),
        ceiling_hit_tokens: &ceiling,
        results: &results,
        samples: &samples,
        events: &[],
        teardown: None,
    });
    write_report(out, &mut summary, &results, &samples)?;
    Ok(summary)
}
