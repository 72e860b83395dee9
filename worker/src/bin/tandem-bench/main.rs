//! `tandem-bench`: the data plane's benchmarks (DESIGN §7). Each subcommand measures against a baseline
//! in the same run and prints ratios; none is a timed unit test.
//!
//! The benchmarks are modules of this binary, not of the library: `tandem_worker` has no `bench` in
//! its API. Two integration tests compile a module of it (`tests/release_abort_stress.rs`,
//! `tests/layer_split_contract.rs`, through `#[path]`).
//!
//! Adding a benchmark: put `Args`, `run` and a report with `lines()` in
//! `src/bin/tandem-bench/<name>.rs`, declare it below, then add a variant to [`Bench`] and its arm
//! in [`main`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod abort_stress;
mod gpu;
mod layer_split;
mod loadback;
mod pool;
mod registration;
mod restart_loadback;
mod routing;
mod snapshot;
mod transfer;

#[derive(Debug, Parser)]
#[command(name = "tandem-bench", about = "Tandem data-plane benchmarks")]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Register/deregister N buffers and roll back an N-range transaction, vs the raw store client.
    Registration(registration::RegistrationArgs),
    /// KV pool page alloc/free rate vs a bare free list.
    Pool(pool::PoolArgs),
    /// TCP transport throughput vs a plain socket copy (and Mooncake's engine, `--against mooncake`).
    Transfer(transfer::TransferArgs),
    /// Abort stress: corrupt pages read with the release gate (and with it bypassed, `--unsafe`, in
    /// builds with the `negative-controls` feature).
    AbortStress(abort_stress::AbortStressArgs),
    /// LayerSplit per-rank KV bytes and broadcast bytes vs replicated / whole-buffer; identical outputs.
    LayerSplit(layer_split::LayerSplitArgs),
    /// L3 restart-to-warm time and loadback bytes/s vs the disk's sequential read rate.
    Loadback(loadback::LoadbackArgs),
    /// A restarted prefill's loadback from L3 into L2: several read streams vs one at a time.
    RestartLoadback(restart_loadback::RestartLoadbackArgs),
    /// Snapshot sync with the prefill KV pool full: dedicated buffer vs the pool itself (seed 002).
    Snapshot(snapshot::SnapshotArgs),
    /// Prefix-affine prefill selection vs round-robin on the Mooncake conversation trace (model).
    Routing(routing::RoutingArgs),
    /// KV page copies H2D, D2H and D2D as ratios of the device's own one-copy peaks (feature `cuda`;
    /// `worker/tools/gpu-check.sh` runs it on a GPU machine).
    Gpu(gpu::GpuArgs),
}

fn main() -> ExitCode {
    let lines: Result<Vec<String>, String> = match Cli::parse().bench {
        Bench::Registration(a) => registration::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Pool(a) => pool::run(&a).map(|r| r.lines()).map_err(|e| e.to_string()),
        Bench::Transfer(a) => transfer::run(&a)
            .map(|rs| rs.iter().flat_map(|r| r.lines()).collect())
            .map_err(|e| e.to_string()),
        Bench::AbortStress(a) => abort_stress::run(&a)
            .map(|r| r.lines(a.unsafe_gate))
            .map_err(|e| e.to_string()),
        Bench::LayerSplit(a) => layer_split::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Loadback(a) => loadback::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::RestartLoadback(a) => restart_loadback::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Snapshot(a) => snapshot::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Routing(a) => routing::run(&a)
            .map(|r| r.lines())
            .map_err(|e| e.to_string()),
        Bench::Gpu(a) => gpu::run(&a).map(|r| r.lines()).map_err(|e| e.to_string()),
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
