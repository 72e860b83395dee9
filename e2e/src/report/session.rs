//! One replay with its report: sample the workers while the workload runs, then aggregate and
//! write everything (what `tandem-e2e replay` does; the demo adds its cluster steps around it).

use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::sampler::{ReportSource, Sampler};
use super::{ReportError, ReportInput, Summary, summarize_run, write_report};
use crate::replay::driver::{ReplayConfig, replay};
use crate::replay::schedule::Clock;
use crate::replay::targets::TargetSet;
use crate::replay::workload::{TraceRequest, unbounded_hit_ratio};

/// A progress bar over `n` requests (hidden when stderr is not a terminal, as indicatif does).
pub fn request_bar(n: usize) -> ProgressBar {
    let bar = ProgressBar::new(n as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
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
    tokio::time::sleep(sample_every).await;
    let samples = sampler.stop().await;
    let mut summary = summarize_run(ReportInput {
        source,
        time_scale: config.time_scale,
        unbounded_hit_ratio: unbounded_hit_ratio(workload),
        results: &results,
        samples: &samples,
        events: &[],
        teardown: None,
    });
    write_report(out, &mut summary, &results, &samples)?;
    Ok(summary)
}
