//! The replay report (issue 8): stdout summary, `results.json`, per-request and per-sample JSONL,
//! and PNG plots.
//!
//! * [`percentile`]: nearest-rank percentiles.
//! * [`workers`]: worker `/report` bodies (worker/interfaces/README.md §4) and their aggregation
//!   across restarts.
//! * [`sampler`]: polls every worker's `/report` once a second while the replay runs.
//! * [`events`]: scale/restart/pod events on the replay clock.
//! * [`summary`]: the pure aggregation into [`summary::Summary`] (`results.json`).
//! * [`plots`]: the PNGs.
//! * [`routing`]: rooms per prefill pod, the decodes' routing policy, and the round-robin /
//!   least-work A/B table (`tandem-e2e demo --routing-ab`).
//! * [`session`]: one replay with sampling and the report (`tandem-e2e replay`).

pub mod events;
pub mod percentile;
pub mod plots;
pub mod routing;
pub mod sampler;
pub mod session;
pub mod snapshot_ab;
pub mod summary;
pub mod workers;

use std::io::Write;
use std::path::{Path, PathBuf};

pub use events::Event;
pub use summary::{ReportInput, Summary, summarize_run};

use crate::replay::RequestResult;
use workers::Sample;

/// Why the report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A plot failed.
    #[error(transparent)]
    Plot(#[from] plots::PlotError),
}

fn write_jsonl<T: serde::Serialize>(path: &Path, items: &[T]) -> Result<(), ReportError> {
    let io = |source| ReportError::Io {
        path: path.to_owned(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for i in items {
        serde_json::to_writer(&mut f, i).map_err(|e| io(e.into()))?;
        f.write_all(b"\n").map_err(io)?;
    }
    f.flush().map_err(io)
}

/// Writes into `dir` (created if missing): the plots (their names recorded in
/// `summary.plots`), `results.json` (the summary), `requests.jsonl` (one [`RequestResult`] a
/// line) and `samples.jsonl` (one worker sample a line).
pub fn write_report(
    dir: &Path,
    summary: &mut Summary,
    results: &[RequestResult],
    samples: &[Sample],
) -> Result<(), ReportError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ReportError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    summary.plots = plots::write_plots(dir, results, summary, plots::font_available())?;
    let path = dir.join("results.json");
    let json = serde_json::to_vec_pretty(&*summary).map_err(|e| io(&path)(e.into()))?;
    std::fs::write(&path, json).map_err(io(&path))?;
    write_jsonl(&dir.join("requests.jsonl"), results)?;
    write_jsonl(&dir.join("samples.jsonl"), samples)?;
    Ok(())
}
