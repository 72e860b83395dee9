//! The `store-client` role: a standalone store client that creates and owns the shared-memory
//! segments of its workers (DESIGN §2 `clientMode: Standalone`; server in
//! [`crate::store_client::server`]). SIGTERM or SIGINT runs its ordered teardown (DESIGN
//! contract 9; `teardown` below): connections joined, registrations dropped, socket removed, every
//! segment destroyed, so nothing of ours is left in /dev/shm; the report is printed as the last
//! stdout line `teardown {…}` like the serving roles'.
//!
//! Its health port (`ports.health + 1`) says what it holds: `/report` adds `store_client`
//! ([`ServerStats`]: `connections_open`, `segments`, `segment_bytes`, `registrations`,
//! `register_requests`, `segments_created`) and `/metrics` the same as
//! `tandem_store_client_{connections_open,segments,segment_bytes,registrations}` (gauges) and
//! `tandem_store_client_{register_requests,segments_created}` (totals).

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use crate::memory::segment::SegmentBackend;
use crate::store_client::server::{ServerConfig, ServerStats, StoreClientServer};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use std::net::SocketAddr;

use crate::config::resolve_path;
use crate::health::http::{ServeState, router, spawn_http};

use super::RoleError;

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
    /// The pool's resolved worker config (`/etc/tandem/worker.json`, read through
    /// `$TANDEM_ROOT`). The budget is `memory.segmentBytes`, the socket is
    /// `/dev/shm/tandem-store-client.sock` on the pod's shared `/dev/shm` volume, and health is
    /// served on `ports.health + 1` (the worker container holds `ports.health`). Segment names
    /// start with `tandem-sc-<pid>`.
    #[arg(long, env = "TANDEM_WORKER_CONFIG")]
    pub config: PathBuf,
    /// Segment backing (the config does not choose it).
    #[arg(long, value_enum, default_value_t = BackendArg::Memfd)]
    pub backend: BackendArg,
    /// Test-only negative control: leave POSIX shm names behind at shutdown. Only in builds with
    /// the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
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
    let cfg = super::load_worker_config(&args.config)?;
    let budget = usize::try_from(cfg.memory.segment_bytes).unwrap_or(usize::MAX);
    let health = SocketAddr::new(crate::roles::pod_ip(), cfg.ports.health.saturating_add(1));
    let socket = resolve_path(std::path::Path::new(SIDECAR_SOCKET));
    let backend = match args.backend {
        BackendArg::Memfd => SegmentBackend::Memfd,
        BackendArg::PosixShm => SegmentBackend::PosixShm,
    };
    let config = ServerConfig {
        #[cfg(feature = "negative-controls")]
        leak_segments_for_test: args.leak_segments_for_test,
        ..ServerConfig::new(socket, backend, budget)
    };
    let server = StoreClientServer::bind(config).map_err(|e| RoleError::Failed(e.to_string()))?;
    let stop = server.stop_flag();
    // One runtime thread keeps the health port served while the teardown runs on this thread.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
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
    let stats = server.stats();
    let gauges = StoreClientGauges::default();
    let state =
        ServeState::with_metrics("store-client", &cfg.pool, &cfg.revision, "starting", |r| {
            gauges.register(r)
        });
    let (st, g) = (stats.clone(), gauges.clone());
    state.on_refresh(move |_| g.mirror(&st.snapshot()));
    state.set_extra(move || {
        let mut m = serde_json::Map::new();
        m.insert(
            "store_client".into(),
            serde_json::to_value(stats.snapshot()).unwrap_or_default(),
        );
        m
    });
    let (local, http) = runtime
        .block_on(spawn_http(health, router(state.clone())))
        .map_err(|e| RoleError::Failed(format!("binding the health port: {e}")))?;
    tracing::info!(%local, "store client health serving");
    state.set_ready(Ok(()));
    let handle = runtime.handle().clone();
    let waiter = std::thread::spawn(move || {
        handle.block_on(async {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: stopping store client"),
                _ = int.recv() => tracing::info!("SIGINT: stopping store client"),
            }
        });
        stop.store(true, Ordering::Release);
    });
    tracing::info!(socket = %server.socket_path().display(), "store client ready");
    println!("listening on {}", server.socket_path().display());
    // Returns only after the waiter set the stop flag, so joining it cannot block.
    let stopped = server.accept_until_stopped();
    let _ = waiter.join();
    let report = teardown(state, http, stopped).run();
    super::print_teardown(&report);
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(())
}

/// The sidecar's shutdown as a contract-9 plan (DESIGN §5; printed like the serving roles' by
/// [`super::print_teardown`]): StopAdmission (readiness 503; the socket already accepts no one) →
/// JoinThreads (every worker connection closed; a worker's segments go with it) → Deregister
/// (registrations still held dropped) → DestroyTransports (socket file removed, health port
/// closed) → FreeMemory (every segment destroyed, so nothing of ours is left in /dev/shm). In a
/// pod the sidecar is stopped after the worker (native sidecars stop in reverse order), so the
/// connections are normally closed already.
fn teardown(
    state: std::sync::Arc<ServeState>,
    http: tokio::task::JoinHandle<()>,
    stopped: crate::store_client::server::StoppedServer,
) -> std::sync::Arc<crate::teardown::Teardown> {
    use crate::teardown::{Teardown, TeardownPhase as Phase};
    let plan = Teardown::new();
    let stopped = std::sync::Arc::new(std::sync::Mutex::new(Some(stopped)));
    let with = |f: fn(&mut crate::store_client::server::StoppedServer) -> Result<(), String>| {
        let s = std::sync::Arc::clone(&stopped);
        move || {
            let mut g = s.lock().unwrap_or_else(|p| p.into_inner());
            g.as_mut().map_or(Ok(()), f)
        }
    };
    plan.register(
        Phase::StopAdmission,
        "readiness 503; no new worker connection",
        move || {
            state.begin_drain();
            Ok(())
        },
    );
    plan.register(
        Phase::JoinThreads,
        "worker connections closed",
        with(|s| s.join_connections()),
    );
    plan.register(
        Phase::Deregister,
        "registrations dropped",
        with(|s| {
            let n = s.drop_registrations();
            tracing::info!(registrations = n, "store client: registrations dropped");
            Ok(())
        }),
    );
    let socket = with(|s| s.remove_socket());
    plan.register(
        Phase::DestroyTransports,
        "socket removed; health port closed",
        move || {
            let r = socket();
            http.abort();
            r
        },
    );
    let s = std::sync::Arc::clone(&stopped);
    plan.register(Phase::FreeMemory, "segments destroyed", move || {
        let Some(mut server) = s.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(());
        };
        let n = server.destroy_segments();
        match server.finish() {
            Ok(report) => {
                tracing::info!(
                    ?report,
                    destroyed = n,
                    "store client stopped; segments destroyed"
                );
                Ok(())
            }
            Err(e) => Err(format!("the accept loop had failed: {e}")),
        }
    });
    plan
}

/// The store client's `/metrics` (mirrors of [`ServerStats`] at every scrape).
#[derive(Debug, Clone, Default)]
struct StoreClientGauges {
    connections_open: Gauge,
    segments: Gauge,
    segment_bytes: Gauge,
    registrations: Gauge,
    register_requests: Counter,
    segments_created: Counter,
}

impl StoreClientGauges {
    fn register(&self, r: &mut Registry) {
        for (name, help, g) in [
            (
                "tandem_store_client_connections_open",
                "Worker connections open",
                &self.connections_open,
            ),
            (
                "tandem_store_client_segments",
                "Shared-memory segments alive",
                &self.segments,
            ),
            (
                "tandem_store_client_segment_bytes",
                "Bytes of the segments alive",
                &self.segment_bytes,
            ),
            (
                "tandem_store_client_registrations",
                "Buffer registrations alive",
                &self.registrations,
            ),
        ] {
            r.register(name, help, g.clone());
        }
        r.register(
            "tandem_store_client_register_requests",
            "Register requests received (accepted or refused)",
            self.register_requests.clone(),
        );
        r.register(
            "tandem_store_client_segments_created",
            "Segments created",
            self.segments_created.clone(),
        );
    }

    fn mirror(&self, s: &ServerStats) {
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.connections_open.set(i(s.connections_open));
        self.segments.set(i(s.segments));
        self.segment_bytes.set(i(s.segment_bytes));
        self.registrations.set(i(s.registrations));
        crate::health::counters::mirror(&self.register_requests, s.register_requests);
        crate::health::counters::mirror(&self.segments_created, s.segments_created);
    }
}
