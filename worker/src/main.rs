//! `tandem-worker`: the data-plane binary (DESIGN §3). One subcommand per role; each role is a module
//! of the library, `tandem_worker::roles::<role>`, with `Args` (clap) and
//! `run(Args) -> Result<(), RoleError>`.
//!
//! Every role starts from the config file the operator renders — the only start path:
//! `tandem-worker prefill|decode|store-client --config /etc/tandem/worker.json` and
//! `tandem-worker cache --config /etc/tandem/tier.json` (paths resolved through `$TANDEM_ROOT`).
//! `tandem-worker <role> --help` lists each role's few process-level options.
//!
//! Adding a role: a module in `roles` (src/roles/mod.rs), then a variant of [`Role`] and its arm in
//! [`main`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tandem_worker::roles;

#[derive(Debug, Parser)]
#[command(
    name = "tandem-worker",
    version,
    about = "Tandem PD-disaggregated serving data plane",
    long_about = "Tandem PD-disaggregated serving data plane. Every role starts from its config \
                  file (`--config`), as the operator renders it for a pod; paths are read \
                  through $TANDEM_ROOT when it is set."
)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Prefill instance: the gRPC `Transfer` service, computing with the built-in simulated engine,
    /// or serving the engine API to the engine beside it when the config names one (`engine`).
    Prefill(roles::prefill::Args),
    /// Decode instance: the KV receiver, the prefill peer set and the front door.
    Decode(roles::decode::Args),
    /// Standalone store client: owns the shared-memory segments workers register (DESIGN §2).
    StoreClient(roles::store_client::Args),
    /// CacheTier store replica.
    Cache(roles::cache::Args),
    /// The simulated engine: a client of a worker's engine API (DESIGN §3.1); a bounded run, or
    /// `--serve` as the engine container of a prefill pod (until SIGTERM).
    SimEngine(tandem_worker::sim_engine::Args),
}

fn main() -> ExitCode {
    // Before other threads start: page-sized buffers freed across threads must not fragment the heap.
    let heap = tandem_worker::memory::heap::tune();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    tracing::info!(?heap, "process heap policy (memory::heap)");
    let cli = Cli::parse();
    let result = match cli.role {
        Role::Prefill(args) => roles::prefill::run(args),
        Role::Decode(args) => roles::decode::run(args),
        Role::StoreClient(args) => roles::store_client::run(args),
        Role::Cache(args) => roles::cache::run(args),
        Role::SimEngine(args) => tandem_worker::sim_engine::run_blocking(args)
            .map(|_| ())
            .map_err(|e| roles::RoleError::Failed(e.to_string())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem-worker: {e}");
            ExitCode::FAILURE
        }
    }
}
