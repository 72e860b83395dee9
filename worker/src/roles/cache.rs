//! The `cache` role: one CacheTier store replica (DESIGN §2 `CacheTier`, contract 7). It opens the L3
//! store on its data directory (a PVC in the cluster), serves the framed TCP protocol of
//! `tandem_worker::cache::l3_wire` at once, and loads back what is on disk in the background, logging
//! progress and reporting `Warming` → `CacheWarm` in its health. SIGTERM or SIGINT stops serving,
//! stops loadback, joins every thread and exits 0 (DESIGN contract 9); every put is already durable,
//! so there is nothing to flush.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tandem_worker::cache::l3_server::L3Server;
use tandem_worker::cache::l3_store::{L3Config, L3Store};
use tandem_worker::cache::manifest::StoreIdentity;

use crate::RoleError;

/// `tandem-worker cache` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Data directory of the store (created if missing).
    #[arg(long, env = "TANDEM_CACHE_DATA_DIR")]
    pub data_dir: PathBuf,
    /// Address to serve on; port 0 picks one (printed on stdout as `listening on ADDR`).
    #[arg(long, env = "TANDEM_CACHE_LISTEN", default_value = "0.0.0.0:7420")]
    pub listen: SocketAddr,
    /// JSON file with the store identity (model identity and geometry, layout, page tokens, TP and
    /// CP sizes), as the operator renders it into the tier's config.
    #[arg(long, env = "TANDEM_CACHE_IDENTITY")]
    pub identity: PathBuf,
    /// Bytes of objects kept in memory.
    #[arg(long, default_value_t = 1 << 30)]
    pub memory_bytes: u64,
    /// Bytes of objects kept on disk.
    #[arg(long, default_value_t = 16 << 30)]
    pub disk_bytes: u64,
    /// Seconds between loadback progress lines.
    #[arg(long, default_value_t = 5)]
    pub progress_interval_s: u64,
    /// Test-only: skip fsync on put (atomic but not durable against power loss).
    #[arg(long, hide = true)]
    pub unsafe_no_fsync: bool,
}

fn failed(what: &str) -> impl FnOnce(String) -> RoleError + '_ {
    move |e| RoleError::Failed(format!("{what}: {e}"))
}

/// Runs the replica until SIGTERM/SIGINT.
///
/// # Errors
/// [`RoleError::Failed`] when the identity file is unreadable or invalid, the data directory cannot
/// be opened, the address cannot be bound, or signal handlers cannot be installed. Bad objects on
/// disk are never errors (they are counted misses).
pub fn run(args: Args) -> Result<(), RoleError> {
    let text = std::fs::read(&args.identity)
        .map_err(|e| e.to_string())
        .map_err(failed("reading the identity file"))?;
    let identity: StoreIdentity = serde_json::from_slice(&text)
        .map_err(|e| e.to_string())
        .map_err(failed("parsing the identity file"))?;
    identity
        .model
        .validate()
        .map_err(|e| e.to_string())
        .map_err(failed("store identity"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .map_err(failed("tokio runtime"))?;
    // Handlers first, so a SIGTERM right after start is not lost.
    let signals = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    });
    let (mut term, mut int) = signals
        .map_err(|e| e.to_string())
        .map_err(failed("signal handlers"))?;

    let config = L3Config {
        progress_interval: Duration::from_secs(args.progress_interval_s.max(1)),
        fsync: !args.unsafe_no_fsync,
        ..L3Config::new(args.data_dir, identity, args.memory_bytes, args.disk_bytes)
    };
    let (store, loadback) = L3Store::open(config)
        .map_err(|e| e.to_string())
        .map_err(failed("opening the L3 store"))?;
    let mut server = L3Server::start(std::sync::Arc::clone(&store), args.listen)
        .map_err(|e| e.to_string())
        .map_err(failed("binding the L3 service"))?;
    tracing::info!(addr = %server.local_addr(), "cache replica serving; loadback running");
    println!("listening on {}", server.local_addr());

    runtime.block_on(async {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping cache replica"),
            _ = int.recv() => tracing::info!("SIGINT: stopping cache replica"),
        }
    });
    server.stop();
    store.stop_loadback();
    loadback.join();
    tracing::info!(health = ?store.health(), "cache replica stopped");
    Ok(())
}
