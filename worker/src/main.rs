//! `tandem-worker`: the data-plane binary (DESIGN §3). One subcommand per role; each role lives in
//! `src/roles/<role>.rs` and exposes `Args` (clap) and `run(Args) -> Result<(), RoleError>`.
//!
//! Adding a role: declare its module in `mod roles` and point its variant at `roles::<role>::Args`
//! and `roles::<role>::run` in [`Role`] and [`main`]. Roles not built yet parse any arguments and
//! exit with [`RoleError::NotBuilt`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod roles {
    //! One module per role.
    pub mod cache;
    pub mod store_client;
}

/// Errors a role returns to `main`; printed, and the process exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The role exists in the design but is not built in this binary yet.
    #[error("role `{0}` is not built yet in this binary")]
    NotBuilt(&'static str),
    /// The role failed.
    #[error("{0}")]
    Failed(String),
}

/// Arguments of a role that is not built yet (accepted and ignored).
#[derive(Debug, clap::Args)]
struct NotBuiltArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    rest: Vec<String>,
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
    Prefill(NotBuiltArgs),
    /// Decode instance.
    Decode(NotBuiltArgs),
    /// Standalone store client: owns the shared-memory segments workers register (DESIGN §2).
    StoreClient(roles::store_client::Args),
    /// CacheTier store replica.
    Cache(roles::cache::Args),
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
        Role::Prefill(_) => Err(RoleError::NotBuilt("prefill")),
        Role::Decode(_) => Err(RoleError::NotBuilt("decode")),
        Role::StoreClient(args) => roles::store_client::run(args),
        Role::Cache(args) => roles::cache::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem-worker: {e}");
            ExitCode::FAILURE
        }
    }
}
