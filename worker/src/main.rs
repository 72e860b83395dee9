//! `tandem-worker`: the data-plane binary (DESIGN §3). One subcommand per role; each role lives in
//! `src/roles/<role>.rs` and exposes `Args` (clap) and `run(Args) -> Result<(), RoleError>`.
//!
//! In a pod every role runs as a long-running server from the operator's rendered config:
//! `tandem-worker prefill|decode|store-client --config /etc/tandem/worker.json` and
//! `tandem-worker cache --config /etc/tandem/tier.json` (paths resolved through `$TANDEM_ROOT`;
//! `tandem_worker::serve` has the servers). Without `--config` the flag-driven demo modes run.
//!
//! Adding a role: declare its module in `mod roles` and point its variant at `roles::<role>::Args`
//! and `roles::<role>::run` in [`Role`] and [`main`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod roles {
    //! One module per role.
    pub mod cache;
    pub mod decode;
    pub mod prefill;
    pub mod store_client;
}

/// Errors a role returns to `main`; printed, and the process exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The role failed.
    #[error("{0}")]
    Failed(String),
}

#[derive(Debug, Parser)]
#[command(
    name = "tandem-worker",
    version,
    about = "Tandem PD-disaggregated serving data plane"
)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Prefill instance.
    Prefill(roles::prefill::Args),
    /// Decode instance.
    Decode(roles::decode::Args),
    /// Standalone store client: owns the shared-memory segments workers register (DESIGN §2).
    StoreClient(roles::store_client::Args),
    /// CacheTier store replica.
    Cache(roles::cache::Args),
    /// The simulated engine: a client of a worker's engine API (DESIGN §3.1).
    SimEngine(tandem_worker::sim_engine::Args),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.role {
        Role::Prefill(args) => roles::prefill::run(args),
        Role::Decode(args) => roles::decode::run(args),
        Role::StoreClient(args) => roles::store_client::run(args),
        Role::Cache(args) => roles::cache::run(args),
        Role::SimEngine(args) => tandem_worker::sim_engine::run_blocking(args)
            .map(|_| ())
            .map_err(|e| RoleError::Failed(e.to_string())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem-worker: {e}");
            ExitCode::FAILURE
        }
    }
}
