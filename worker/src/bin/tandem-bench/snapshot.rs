//! `tandem-bench snapshot`: decode→prefill snapshot sync with the prefill KV pool 100% occupied
//! (DESIGN §7: ≥ 99% succeed; seed 002: 0% before, ≥ 30% asked). Runs the same deterministic
//! workload ([`tandem_worker::snapshot::workload`]) twice in one process: into the dedicated snapshot buffer,
//! and into the KV pool itself (the seed's old design, the baseline). Prints both success ratios;
//! the last line is `snapshot_success_ratio=<x> baseline=<y>`. The baseline is a negative control
//! (`snapshot::shared_pool`): only builds with the `negative-controls` feature run it; others print
//! `baseline=unavailable`.

use std::time::Instant;

use tandem_worker::snapshot::workload::{
    self, Backing, WorkloadConfig, WorkloadError, WorkloadReport, WorkloadTransport,
};

/// Arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct SnapshotArgs {
    /// Sync attempts per backing.
    #[arg(long, default_value_t = 2000)]
    pub syncs: u32,
    /// Pages of the prefill KV pool.
    #[arg(long, default_value_t = 256)]
    pub pool_pages: u32,
    /// Slots (KV pages) of the snapshot buffer.
    #[arg(long, default_value_t = 64)]
    pub buffer_slots: u32,
    /// Most pages of one snapshot (fewest is 1).
    #[arg(long, default_value_t = 12)]
    pub pages_max: u32,
    /// Pages one prefill request holds (one request finishes per tick).
    #[arg(long, default_value_t = 16)]
    pub prefill_request_pages: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_tokens: u32,
    /// Layers.
    #[arg(long, default_value_t = 8)]
    pub layers: u32,
    /// Transport that moves the bytes.
    #[arg(long, value_enum, default_value_t = WorkloadTransport::Tcp)]
    pub transport: WorkloadTransport,
    /// Seed of arrivals and sizes.
    #[arg(long, default_value_t = 2)]
    pub seed: u64,
}

/// Both runs.
#[derive(Debug, Clone)]
pub struct SnapshotReport {
    /// The dedicated buffer.
    pub dedicated: WorkloadReport,
    /// The KV pool itself (baseline, seed 002's old design); `None` without the
    /// `negative-controls` feature.
    pub baseline: Option<WorkloadReport>,
    /// Seconds of each run.
    pub seconds: [f64; 2],
}

impl SnapshotReport {
    /// Printable lines; the last is the machine-readable summary.
    pub fn lines(&self) -> Vec<String> {
        let row = |name: &str, r: &WorkloadReport, secs: f64| {
            format!(
                "{name:<22} attempted={} succeeded={} ratio={:.4} buf_full={} prepare_alloc_failed={} \
                 alloc_failed_on_finalize={} evicted={} transfer_failed={} verified_chunks={} \
                 corrupt_chunks={} max_pool_free_at_arrival={} ({secs:.2}s)",
                r.attempted,
                r.succeeded,
                r.success_ratio(),
                r.buf_full,
                r.prepare_alloc_failed,
                r.alloc_failed_on_finalize,
                r.evicted,
                r.transfer_failed,
                r.verified_chunks,
                r.corrupt_chunks,
                r.max_pool_free_at_arrival,
            )
        };
        let mut lines = vec![
            "snapshot benchmark: decode->prefill sync, prefill KV pool 100% occupied".to_owned(),
            row("dedicated buffer", &self.dedicated, self.seconds[0]),
        ];
        let baseline = match &self.baseline {
            Some(b) => {
                lines.push(row("baseline (KV pool)", b, self.seconds[1]));
                format!("{:.4}", b.success_ratio())
            }
            None => "unavailable".to_owned(),
        };
        lines.push(format!(
            "snapshot_success_ratio={:.4} baseline={baseline}",
            self.dedicated.success_ratio()
        ));
        lines
    }
}

/// Runs both backings on the same workload.
///
/// # Errors
/// [`WorkloadError`] for an invalid shape or a fault of the memory or transport.
pub fn run(args: &SnapshotArgs) -> Result<SnapshotReport, WorkloadError> {
    let cfg = WorkloadConfig {
        syncs: args.syncs,
        pool_pages: args.pool_pages,
        buffer_slots: args.buffer_slots,
        pages_min: 1,
        pages_max: args.pages_max,
        prefill_request_pages: args.prefill_request_pages,
        page_tokens: args.page_tokens,
        layers: args.layers,
        transport: args.transport,
        seed: args.seed,
        ..WorkloadConfig::default()
    };
    let t0 = Instant::now();
    let dedicated = workload::run(Backing::Dedicated, &cfg)?;
    let t1 = Instant::now();
    #[cfg(feature = "negative-controls")]
    let baseline = Some(workload::run(Backing::SharedKvPool, &cfg)?);
    #[cfg(not(feature = "negative-controls"))]
    let baseline = None;
    let t2 = Instant::now();
    Ok(SnapshotReport {
        dedicated,
        baseline,
        seconds: [(t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64()],
    })
}
