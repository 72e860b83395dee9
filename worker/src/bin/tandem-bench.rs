//! `tandem-bench`: the data plane's benchmarks (DESIGN §7). Each subcommand measures against a baseline
//! in the same run and prints ratios; none is a timed unit test.
//!
//! Adding a benchmark: put `Args`, `run` and a report with `lines()` in `src/bench/<name>.rs`, then add
//! a variant to [`Bench`] and its arm in [`main`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tandem_worker::bench;

#[derive(Debug, Parser)]
#[command(name = "tandem-bench", about = "Tandem data-plane benchmarks")]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Register/deregister N buffers and roll back an N-range transaction, vs the raw store client.
    Registration(bench::registration::RegistrationArgs),
    /// KV pool page alloc/free rate vs a bare free list.
    Pool(bench::pool::PoolArgs),
    /// TCP transport throughput vs a plain socket copy.
    Transfer(bench::transfer::TransferArgs),
    /// Abort stress: corrupt pages read with the release gate (and with it bypassed, `--unsafe`).
    AbortStress(bench::abort_stress::AbortStressArgs),
    /// LayerSplit per-rank KV bytes and broadcast bytes vs replicated / whole-buffer; identical outputs.
    LayerSplit(bench::layer_split::LayerSplitArgs),
    /// L3 restart-to-warm time and loadback bytes/s vs the disk's sequential read rate.
    Loadback(bench::loadback::LoadbackArgs),
    /// Snapshot sync with the prefill KV pool full: dedicated buffer vs the pool itself (seed 002).
    Snapshot(bench::snapshot::SnapshotArgs),
}

fn main() -> ExitCode {
    let lines: Result<Vec<String>, String> = match Cli::parse().bench {
        Bench::Registration(a) => bench::registration::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Pool(a) => bench::pool::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Transfer(a) => bench::transfer::run(&a)
            .map(|rs| rs.iter().map(|r| r.line()).collect())
            .map_err(|e| e.to_string()),
        Bench::AbortStress(a) => bench::abort_stress::run(&a)
            .map(|r| r.lines(a.unsafe_gate))
            .map_err(|e| e.to_string()),
        Bench::LayerSplit(a) => bench::layer_split::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Loadback(a) => bench::loadback::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Snapshot(a) => bench::snapshot::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
    };
    match lines {
        Ok(lines) => {
            for l in lines {
                println!("{l}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tandem-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
