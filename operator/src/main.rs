//! `tandem-operator`: runs the CacheTier, PrefillPool and DecodePool controllers
//! (worker/interfaces/README.md §1).
//!
//! Serves `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`; with leader election (the
//! default) only the holder of the Lease `tandem-operator` in `$POD_NAMESPACE` reconciles, and a
//! replica that loses the lease exits (its restart rejoins as a candidate). SIGTERM/SIGINT stop the
//! controllers after their in-flight reconciles and release the lease.
//!
//! `/readyz` is 200 for a standby too, once the API server answered (the Lease was prepared):
//! readiness that waited for leadership would deadlock a Deployment rolling update — the new pod
//! cannot lead while the old one holds the Lease, and the old one is not stopped until the new one
//! is Ready (found by the e2e `helm upgrade` suite). Leadership is the `tandem_operator_leading`
//! gauge's business, not readiness.
//!
//! `/readyz` is 503 while a watch of the running controllers fails (e.g. a kind whose CRD was
//! deleted), with one line per failing watch: its error, how long and how often it failed, and
//! the delay before its next retry. An operator that cannot see its kinds is not ready, and it
//! says why; each failure is also logged as a warning with its back-off. `/healthz` stays 200 (a
//! restart would not bring a deleted CRD back; the watches retry every few seconds).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use clap::{Parser, ValueEnum};
use futures::FutureExt;
use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tandem_operator::controller::run::{Scope, run};
use tandem_operator::controller::watches::WatchHealth;
use tandem_operator::controller::{Context, ReconcileSlots};
use tandem_operator::metrics::Metrics;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

/// The Tandem operator: reconciles CacheTier, PrefillPool and DecodePool.
#[derive(Debug, Parser)]
#[command(name = "tandem-operator", version)]
struct Args {
    /// Address of the `/metrics`, `/healthz` and `/readyz` endpoints.
    #[arg(long, env = "TANDEM_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Hold the Lease `tandem-operator` in `$POD_NAMESPACE` before reconciling (default).
    #[arg(
        long,
        env = "TANDEM_LEADER_ELECTION",
        overrides_with = "no_leader_election",
        default_value_t = true
    )]
    leader_election: bool,
    /// Reconcile without a lease (a single replica, or local runs).
    #[arg(long, overrides_with = "leader_election")]
    no_leader_election: bool,
    /// Watch only this namespace; all namespaces when empty.
    #[arg(long, env = "TANDEM_WATCH_NAMESPACE", default_value = "")]
    watch_namespace: String,
    /// Log format.
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Lease duration in seconds (a new leader takes over at most this long after a crash).
    #[arg(long, env = "TANDEM_LEASE_SECONDS", default_value_t = 15)]
    lease_seconds: u64,
    /// Requeue interval of a settled resource, in seconds (the safety resync).
    #[arg(long, env = "TANDEM_RESYNC_SECONDS", default_value_t = 300)]
    resync_seconds: u64,
    /// Probe cache replicas' `GET /report` for `CacheWarm` (default). `false` on simulated nodes
    /// (kwok), whose pods serve nothing: `CacheWarm` is then judged by pod readiness and its
    /// reason says `ReadyApproximation`.
    #[arg(long, env = "TANDEM_PROBE_REPORTS", default_value_t = true, action = clap::ArgAction::Set)]
    probe_reports: bool,
    /// Read children, tiers and pairs from the watch-fed caches (default). `false` reads them
    /// from the API server on every reconcile (the behaviour before the caches: a baseline for
    /// `tandem-e2e scale`, or to rule the caches out when debugging).
    #[arg(long, env = "TANDEM_READ_CACHE", default_value_t = true, action = clap::ArgAction::Set)]
    read_cache: bool,
    /// Reconciles of each kind doing their reads and writes at once; the others wait for a slot
    /// (the queue depth stays visible in `tandem_operator_reconciles_in_flight`).
    #[arg(long, env = "TANDEM_MAX_CONCURRENT_RECONCILES", default_value_t = tandem_operator::controller::DEFAULT_MAX_CONCURRENT_RECONCILES)]
    max_concurrent_reconciles: u16,
}

#[derive(Clone)]
struct Http {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    watches: WatchHealth,
}

async fn serve_metrics(State(s): State<Http>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn readyz(State(s): State<Http>) -> impl IntoResponse {
    if !s.ready.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not leading or not started".to_owned(),
        );
    }
    let failing = s.watches.report();
    if failing.is_empty() {
        (StatusCode::OK, "ok".to_owned())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, failing)
    }
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube=warn,kube_lease_manager=warn")
    });
    let b = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}

async fn signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = i.recv() => tracing::info!("SIGINT: shutting down"),
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logs(args.log_format);
    let leader_election = args.leader_election && !args.no_leader_election;
    let client = Client::try_default()
        .await
        .context("building a Kubernetes client (in-cluster or KUBECONFIG)")?;
    let metrics = Metrics::new();
    let ready = Arc::new(AtomicBool::new(false));
    let watches = WatchHealth::with_gauge(metrics.watches_failing.clone());
    let http = Http {
        metrics: metrics.clone(),
        ready: ready.clone(),
        watches: watches.clone(),
    };
    let app = Router::new()
        .route("/metrics", get(serve_metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(http);
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("binding {}", args.metrics_addr))?;
    tracing::info!(addr = %args.metrics_addr, "serving /metrics, /healthz, /readyz");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let stop = signal().boxed().shared();
    let mut leader_rx = None;
    let mut lease_task = None;
    if leader_election {
        let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into());
        let identity = std::env::var("POD_NAME")
            .unwrap_or_else(|_| format!("tandem-operator-{}", std::process::id()));
        let manager = LeaseManagerBuilder::new(client.clone(), "tandem-operator")
            .with_namespace(&namespace)
            .with_identity(&identity)
            .with_duration(args.lease_seconds)
            .with_grace(args.lease_seconds / 3 + 1)
            .with_field_manager(tandem_operator::labels::FIELD_MANAGER)
            .build()
            .await
            .context("preparing the leader-election Lease")?;
        let (mut rx, task) = manager.watch().await;
        // A standby is ready: see the module docs.
        ready.store(true, Ordering::Relaxed);
        tracing::info!(%namespace, %identity, "waiting for the lease tandem-operator");
        tokio::select! {
            r = rx.wait_for(|leading| *leading) => { r.context("leader election stopped")?; }
            _ = stop.clone() => { return Ok(()); }
        }
        tracing::info!(%identity, "leading");
        leader_rx = Some(rx);
        lease_task = Some(task);
    }
    let lost = async move {
        match leader_rx.as_mut() {
            Some(rx) => {
                let _ = rx.wait_for(|leading| !*leading).await;
                tracing::error!("lost the lease; stopping so a restart rejoins as a candidate");
            }
            None => futures::future::pending::<()>().await,
        }
        leader_rx
    };
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = {
        let stop = stop.clone();
        async move {
            tokio::select! {
                _ = stop => {}
                _ = lost_rx => {}
            }
        }
        .boxed()
        .shared()
    };
    let lost_flag = Arc::new(AtomicBool::new(false));
    let lost_flag2 = lost_flag.clone();
    let watcher = tokio::spawn(async move {
        let rx = lost.await;
        lost_flag2.store(true, Ordering::Relaxed);
        let _ = lost_tx.send(());
        rx
    });

    // Past this point this replica leads (or runs without election).
    metrics.leading.set(1);
    let mut ctx = Context::new(client, metrics);
    ctx.probe_reports = args.probe_reports;
    ctx.read_cache = args.read_cache;
    ctx.reconcile_slots = ReconcileSlots::new(args.max_concurrent_reconciles);
    ctx.resync = std::time::Duration::from_secs(args.resync_seconds.max(1));
    ctx.watches = watches;
    let scope = Scope {
        namespace: (!args.watch_namespace.is_empty()).then(|| args.watch_namespace.clone()),
    };
    tracing::info!(namespace = ?scope.namespace, leader_election, "starting controllers");
    ready.store(true, Ordering::Relaxed);
    run(Arc::new(ctx), scope, shutdown).await;
    ready.store(false, Ordering::Relaxed);
    watcher.abort();
    // Dropping the receiver ends the lease watch, which releases the lease.
    if let Some(task) = lease_task {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(3), task).await;
    }
    server.abort();
    if lost_flag.load(Ordering::Relaxed) {
        anyhow::bail!("lost leadership");
    }
    tracing::info!("stopped");
    Ok(())
}
