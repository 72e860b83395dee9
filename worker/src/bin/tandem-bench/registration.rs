//! `tandem-bench registration`: register and deregister N buffers (default 1,000) and roll back a
//! transaction of N ranges, against the raw store client measured in the same run (DESIGN §7).
//!
//! Rows (each an average over `--rounds`):
//! - `raw client`: `StoreClient::register_buffer` + `unregister_buffer` per range — the baseline;
//! - `registry`: the same ranges through [`Registry`] (duplicate/overlap checks, refcounts);
//! - `txn commit+detach`: one pool cut into N ranges, attached transactionally and detached;
//! - `txn rollback@N`: the same with the Nth registration failing — N−1 undone in reverse, destroy once.
//!
//! Modes: `embedded` (in process) and `standalone` (a store-client server on a Unix socket, in a thread
//! of this process: the socket round trips are real).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tandem_worker::health::Health;
use tandem_worker::memory::pool::{PoolLayout, PoolRole, PoolSpec};
use tandem_worker::memory::segment::SegmentBackend;
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::registration::fault::{FaultInjector, FaultPlan, FaultyClient};
use tandem_worker::registration::metrics::RegistrationMetrics;
use tandem_worker::registration::{Registrar, RegistrarConfig, Registry};
use tandem_worker::store_client::embedded::EmbeddedClient;
use tandem_worker::store_client::server::{ServerConfig, StoreClientServer};
use tandem_worker::store_client::standalone::StandaloneClient;
use tandem_worker::store_client::{BufferRef, StoreClient};

/// Arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct RegistrationArgs {
    /// Buffers (ranges) per round.
    #[arg(long, default_value_t = 1000)]
    pub buffers: usize,
    /// Rounds per row.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

/// One measured row.
#[derive(Debug, Clone)]
pub struct Row {
    /// Mode (`embedded` / `standalone`).
    pub mode: &'static str,
    /// What was measured.
    pub what: &'static str,
    /// Mean time per round.
    pub per_round: Duration,
    /// Ratio to the raw-client baseline of the same mode.
    pub vs_baseline: f64,
}

/// The report.
#[derive(Debug, Clone)]
pub struct RegistrationReport {
    /// Buffers per round.
    pub buffers: usize,
    /// Rows.
    pub rows: Vec<Row>,
}

impl RegistrationReport {
    /// Printable lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "registration benchmark: {} buffers of 4 KiB per round",
            self.buffers
        )];
        for r in &self.rows {
            let per_buffer = r.per_round.as_secs_f64() * 1e6 / self.buffers as f64;
            out.push(format!(
                "{:<10} {:<20} {:>10.3} ms/round {:>8.2} us/buffer {:>6.2}x raw client",
                r.mode,
                r.what,
                r.per_round.as_secs_f64() * 1e3,
                per_buffer,
                r.vs_baseline
            ));
        }
        out
    }
}

/// Errors that stop the run.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationBenchError {
    /// Setup or a measured step failed.
    #[error("{0}")]
    Failed(String),
}

fn fail(e: impl std::fmt::Display) -> RegistrationBenchError {
    RegistrationBenchError::Failed(e.to_string())
}

fn spec(ranges: usize) -> PoolSpec {
    // 256 B/token/layer × 16 tokens = 4 KiB per page per layer; one layer: N pages = N ranges of 4 KiB.
    PoolSpec {
        role: PoolRole::Draft,
        model: ModelIdentity {
            name: "bench".into(),
            layers: 1,
            attention: Attention::Gqa {
                kv_heads: 1,
                head_dim: 64,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        },
        page_tokens: 16,
        pages: ranges as u32,
        layout: PoolLayout::LayerFirst,
    }
}

fn time<F: FnMut() -> Result<(), RegistrationBenchError>>(
    rounds: usize,
    mut f: F,
) -> Result<Duration, RegistrationBenchError> {
    f()?; // warm-up
    let start = Instant::now();
    for _ in 0..rounds {
        f()?;
    }
    Ok(start.elapsed() / rounds.max(1) as u32)
}

fn measure_mode(
    mode: &'static str,
    client: Arc<dyn StoreClient>,
    args: &RegistrationArgs,
) -> Result<Vec<Row>, RegistrationBenchError> {
    let n = args.buffers;
    let tier = client.host_allocator().clone();
    let buffer = tier.allocate(n * 4096, "bench buffers").map_err(fail)?;
    let ranges: Vec<BufferRef> = (0..n)
        .filter_map(|i| BufferRef::sub_range(&buffer, i * 4096, 4096))
        .collect();

    let baseline = time(args.rounds, || {
        let mut handles = Vec::with_capacity(n);
        for r in &ranges {
            handles.push(client.register_buffer(r).map_err(fail)?);
        }
        for h in handles.into_iter().rev() {
            client.unregister_buffer(h).map_err(fail)?;
        }
        Ok(())
    })?;

    let registry = Registry::new(client.clone());
    let via_registry = time(args.rounds, || {
        let mut ids = Vec::with_capacity(n);
        for r in &ranges {
            ids.push(registry.register(r).map_err(fail)?);
        }
        ids.reverse();
        registry.deregister(&ids).map_err(fail)
    })?;
    drop(registry);
    buffer.free().map_err(fail)?;

    let config = RegistrarConfig {
        max_registration_bytes: 4096,
        ..RegistrarConfig::default()
    };
    let registrar = Registrar::new(
        client.clone(),
        Arc::new(Health::new()),
        RegistrationMetrics::default(),
        config,
    );
    let commit = time(args.rounds, || {
        registrar.attach(spec(n), &tier).map_err(fail)?;
        registrar.detach(PoolRole::Draft).map_err(fail)
    })?;

    let faults = FaultInjector::new(FaultPlan::default());
    let faulty: Arc<dyn StoreClient> = Arc::new(FaultyClient::new(client.clone(), faults.clone()));
    let rollback_registrar = Registrar::new(
        faulty,
        Arc::new(Health::new()),
        RegistrationMetrics::default(),
        config,
    );
    let rollback = time(args.rounds, || {
        faults.set_plan(FaultPlan {
            register: Some(n),
            ..FaultPlan::default()
        });
        match rollback_registrar.attach(spec(n), &tier) {
            Err(f) if f.undo.undone.len() == n - 1 && f.undo.pool_freed => Ok(()),
            Err(f) => Err(fail(format!("unexpected rollback: {f}"))),
            Ok(_) => Err(fail("the injected fault did not fire")),
        }
    })?;
    if client.registered_count() != 0 || tier.stats().live_buffers != 0 {
        return Err(fail("benchmark leaked registrations or buffers"));
    }
    let ratio = |d: Duration| d.as_secs_f64() / baseline.as_secs_f64().max(1e-12);
    Ok(vec![
        Row {
            mode,
            what: "raw client",
            per_round: baseline,
            vs_baseline: 1.0,
        },
        Row {
            mode,
            what: "registry",
            per_round: via_registry,
            vs_baseline: ratio(via_registry),
        },
        Row {
            mode,
            what: "txn commit+detach",
            per_round: commit,
            vs_baseline: ratio(commit),
        },
        Row {
            mode,
            what: "txn rollback@N",
            per_round: rollback,
            vs_baseline: ratio(rollback),
        },
    ])
}

/// Runs both modes.
///
/// # Errors
/// [`RegistrationBenchError::Failed`] when a step fails or something leaks.
pub fn run(args: &RegistrationArgs) -> Result<RegistrationReport, RegistrationBenchError> {
    if args.buffers < 2 {
        return Err(fail("--buffers must be at least 2"));
    }
    let bytes = args.buffers * 4096;
    let embedded = Arc::new(EmbeddedClient::new(SegmentBackend::Memfd));
    embedded.reserve(bytes).map_err(fail)?;
    let mut rows = measure_mode("embedded", embedded.clone(), args)?;
    embedded.shutdown().map_err(fail)?;

    let dir = std::env::temp_dir().join(format!("tandem-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(fail)?;
    let socket: PathBuf = dir.join("store-client.sock");
    let server = StoreClientServer::bind(ServerConfig::new(
        socket.clone(),
        SegmentBackend::Memfd,
        bytes * 2,
    ))
    .map_err(fail)?;
    let stop: Arc<AtomicBool> = server.stop_flag();
    let thread = std::thread::spawn(move || server.serve());
    let result = (|| {
        let client = Arc::new(StandaloneClient::connect(&socket, "bench").map_err(fail)?);
        client.reserve(bytes).map_err(fail)?;
        let rows = measure_mode("standalone", client.clone(), args)?;
        client.shutdown().map_err(fail)?;
        Ok::<_, RegistrationBenchError>(rows)
    })();
    stop.store(true, Ordering::Release);
    let served = thread.join();
    let _ = std::fs::remove_dir_all(&dir);
    rows.extend(result?);
    served
        .map_err(|_| fail("store-client server thread panicked"))?
        .map_err(fail)?;
    Ok(RegistrationReport {
        buffers: args.buffers,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_completes_without_leaks() {
        let report = run(&RegistrationArgs {
            buffers: 8,
            rounds: 1,
        })
        .unwrap();
        assert_eq!(report.rows.len(), 8);
        assert_eq!(report.lines().len(), 9);
    }
}
