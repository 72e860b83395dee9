//! The `store-client` role: a standalone store client that creates and owns the shared-memory
//! segments of its workers (DESIGN §2 `clientMode: Standalone`; server in
//! `tandem_worker::store_client::server`). SIGTERM or SIGINT stops it and destroys every segment, so
//! nothing of ours is left in /dev/shm (DESIGN contract 9).

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use tandem_worker::memory::segment::SegmentBackend;
use tandem_worker::store_client::server::{ServerConfig, StoreClientServer};

use std::net::SocketAddr;

use tandem_worker::config::{LoadConfig, WorkerConfig, resolve_path};
use tandem_worker::serve::health::{ServeState, router, spawn_http};

use crate::RoleError;

/// Segment backing, as a CLI value.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum BackendArg {
    /// memfd_create (default): nothing in /dev/shm, freed with the last holder.
    Memfd,
    /// POSIX shm under /dev/shm, unlinked at shutdown.
    PosixShm,
}

/// `tandem-worker store-client` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run as the pool's sidecar: the resolved worker config (`/etc/tandem/worker.json`, read
    /// through `$TANDEM_ROOT`). The budget is `memory.segmentBytes`, the socket is
    /// [`SIDECAR_SOCKET`] on the pod's shared `/dev/shm` volume, and health is served on
    /// `ports.health + 1` (the worker container holds `ports.health`).
    #[arg(long, env = "TANDEM_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Unix socket to listen on.
    #[arg(
        long,
        env = "TANDEM_STORE_CLIENT_SOCKET",
        required_unless_present = "config"
    )]
    pub socket: Option<PathBuf>,
    /// Total bytes of segments this process may create.
    #[arg(long, default_value_t = 64 << 30)]
    pub budget_bytes: usize,
    /// Segment backing.
    #[arg(long, value_enum, default_value_t = BackendArg::Memfd)]
    pub backend: BackendArg,
    /// Segment name prefix (must start with `tandem-`, so leak checks find it); defaults to
    /// `tandem-sc-<pid>`.
    #[arg(long)]
    pub name_prefix: Option<String>,
    /// Test-only negative control: leave POSIX shm names behind at shutdown.
    #[arg(long, hide = true)]
    pub leak_segments_for_test: bool,
}

/// Socket of the sidecar in `--config` mode: on the `kv-shm` emptyDir the operator mounts at
/// `/dev/shm` in both containers (resolved through `$TANDEM_ROOT`).
pub const SIDECAR_SOCKET: &str = "/dev/shm/tandem-store-client.sock";

/// Runs the store client until SIGTERM/SIGINT, then tears down.
///
/// # Errors
/// [`RoleError::Failed`] when the socket cannot be bound or the signal handlers cannot be installed.
pub fn run(args: Args) -> Result<(), RoleError> {
    let (socket, budget, health) = match &args.config {
        Some(path) => {
            let cfg = WorkerConfig::load(&resolve_path(path))
                .map_err(|e| RoleError::Failed(e.to_string()))?;
            let budget = usize::try_from(cfg.memory.segment_bytes).unwrap_or(usize::MAX);
            let health = SocketAddr::new(
                tandem_worker::serve::pod_ip(),
                cfg.ports.health.saturating_add(1),
            );
            (
                resolve_path(std::path::Path::new(SIDECAR_SOCKET)),
                budget,
                Some((health, cfg.pool, cfg.revision)),
            )
        }
        None => (
            args.socket.clone().unwrap_or_default(),
            args.budget_bytes,
            None,
        ),
    };
    let mut config = ServerConfig::new(
        socket,
        match args.backend {
            BackendArg::Memfd => SegmentBackend::Memfd,
            BackendArg::PosixShm => SegmentBackend::PosixShm,
        },
        budget,
    );
    if let Some(prefix) = args.name_prefix {
        config.name_prefix = prefix;
    }
    config.leak_segments_for_test = args.leak_segments_for_test;
    let server = StoreClientServer::bind(config).map_err(|e| RoleError::Failed(e.to_string()))?;
    let stop = server.stop_flag();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RoleError::Failed(format!("tokio runtime: {e}")))?;
    // Install the handlers before announcing readiness, so a SIGTERM right after start is not lost.
    let signals = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    });
    let (mut term, mut int) =
        signals.map_err(|e| RoleError::Failed(format!("signal handlers: {e}")))?;
    let state = health.map(|(addr, pool, revision)| {
        let state = ServeState::new("store-client", &pool, &revision, "starting");
        (addr, state)
    });
    let http = match &state {
        Some((addr, st)) => {
            let (local, task) = runtime
                .block_on(spawn_http(*addr, router(st.clone())))
                .map_err(|e| RoleError::Failed(format!("binding the health port: {e}")))?;
            tracing::info!(%local, "store client health serving");
            st.set_ready(Ok(()));
            Some(task)
        }
        None => None,
    };
    let drain_state = state.map(|(_, st)| st);
    let waiter = std::thread::spawn(move || {
        runtime.block_on(async {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: stopping store client"),
                _ = int.recv() => tracing::info!("SIGINT: stopping store client"),
            }
        });
        if let Some(st) = &drain_state {
            st.begin_drain();
        }
        if let Some(task) = http {
            task.abort();
        }
        stop.store(true, Ordering::Release);
    });
    tracing::info!(socket = %server.socket_path().display(), "store client ready");
    if args.config.is_some() {
        println!("listening on {}", server.socket_path().display());
    }
    // `serve` returns Ok only after the waiter set the stop flag, so joining it cannot block.
    let report = server
        .serve()
        .map_err(|e| RoleError::Failed(e.to_string()))?;
    let _ = waiter.join();
    tracing::info!(?report, "store client stopped; segments destroyed");
    Ok(())
}
