//! The `prefill` role: serves the gRPC `Transfer` service (DESIGN §3) and sends each opened room's KV,
//! computed by the simulated engine, over the data transport (RDMA when built and present, else TCP —
//! the choice is logged). SIGTERM/SIGINT stops admission, drains in-flight writes with a deadline and
//! exits (DESIGN contract 9: rooms drain through contract 3 before the transport goes away).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_worker::config::LoadConfig;
use tandem_worker::control::KvLayout;
use tandem_worker::control::prefill::{PrefillConfig, PrefillNode, PrefillService};
use tandem_worker::transfer::Transport;
use tandem_worker::transfer::TransportKind;
use tandem_worker::transfer::select::{Preference, select};
use tandem_worker::transfer::tcp::{TcpConfig, TcpTransport};

use crate::RoleError;

/// `tandem-worker prefill` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Serve as a pod of the pool: the resolved worker config (`/etc/tandem/worker.json`, read
    /// through `$TANDEM_ROOT`). Ports, revision and cache tier come from it; the flags below
    /// are for the stand-alone demo mode only.
    #[arg(long, env = "TANDEM_WORKER_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// gRPC control address; port 0 picks one (printed on stdout as `listening on ADDR`).
    #[arg(long, env = "TANDEM_PREFILL_LISTEN", default_value = "0.0.0.0:7430")]
    pub listen: SocketAddr,
    /// Worker id.
    #[arg(long, env = "TANDEM_WORKER_ID", default_value = "prefill-0")]
    pub worker_id: String,
    /// Prefill rank.
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// KV layers per page.
    #[arg(long, default_value_t = 32)]
    pub layers: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_tokens: u32,
    /// Bytes per token per layer.
    #[arg(long, default_value_t = 4096)]
    pub token_bytes: u32,
    /// Simulated compute time per page (µs).
    #[arg(long, default_value_t = 1000)]
    pub compute_per_page_us: u64,
    /// Seconds to drain in-flight writes at shutdown.
    #[arg(long, default_value_t = 30)]
    pub drain_s: u64,
}

fn failed(what: &'static str) -> impl FnOnce(String) -> RoleError {
    move |e| RoleError::Failed(format!("{what}: {e}"))
}

/// Runs the prefill worker until SIGTERM/SIGINT.
///
/// # Errors
/// [`RoleError::Failed`] when the runtime cannot start or the address cannot be bound.
pub fn run(args: Args) -> Result<(), RoleError> {
    if let Some(path) = &args.config {
        return serve_config(path);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .map_err(failed("starting the runtime"))?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> Result<(), RoleError> {
    let selection = select(Preference::Auto);
    if selection.kind == TransportKind::Tcp {
        tracing::info!(reason = %selection.reason, "KV data transport: TCP");
    } else {
        // The RDMA WRITE transport exists (`transfer::rdma`), but the hello does not yet carry
        // the endpoint and prefill chunks are not yet registered sources: say so, send over TCP.
        tracing::warn!(
            selected = selection.kind.as_str(),
            reason = %selection.reason,
            "KV data transport: TCP (the RDMA write path is not wired into the roles yet)"
        );
    }
    let transport = Arc::new(TcpTransport::new(TcpConfig::default()));
    let cfg = PrefillConfig {
        worker_id: args.worker_id.clone(),
        rank: args.rank,
        layout: KvLayout {
            layers: args.layers,
            page_tokens: args.page_tokens,
            token_bytes: args.token_bytes,
        },
        compute_per_page: Duration::from_micros(args.compute_per_page_us),
    };
    let node = PrefillNode::new(cfg, transport.clone());
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| e.to_string())
        .map_err(failed("binding the control address"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| e.to_string())
        .map_err(failed("reading the bound address"))?;
    println!("listening on {addr}");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = shutdown => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
        }
    };
    tonic::transport::Server::builder()
        .add_service(PrefillService::new(node.clone()).into_server())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
        .map_err(|e| e.to_string())
        .map_err(failed("serving"))?;
    // Admission stopped; let posted writes finish (their acks go out) before closing the transport.
    let deadline = Instant::now() + Duration::from_secs(args.drain_s);
    let t = transport.clone();
    let report = tokio::task::spawn_blocking(move || t.drain(deadline))
        .await
        .map_err(|e| e.to_string())
        .map_err(failed("draining"))?;
    if !report.quiescent() {
        tracing::error!(
            in_flight = report.in_flight.len(),
            "writes still in flight at the drain deadline"
        );
    }
    transport.shutdown();
    tracing::info!(rooms_held = node.rooms_held(), "prefill stopped");
    Ok(())
}

/// `--config` mode: the pool's prefill server until SIGTERM, then drain and exit 0.
fn serve_config(path: &std::path::Path) -> Result<(), RoleError> {
    use tandem_worker::serve::{prefill, signals, sim::SimKnobs};
    let cfg = tandem_worker::config::WorkerConfig::load(&tandem_worker::config::resolve_path(path))
        .map_err(|e| RoleError::Failed(e.to_string()))?;
    let knobs = SimKnobs::from_env().map_err(|e| RoleError::Failed(e.to_string()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| RoleError::Failed(format!("starting the runtime: {e}")))?;
    runtime.block_on(async move {
        let stop = signals::terminated()
            .map_err(|e| RoleError::Failed(format!("signal handlers: {e}")))?;
        let server =
            prefill::PrefillServer::start(&cfg, knobs, prefill::PrefillOptions::from_env())
                .await
                .map_err(|e| RoleError::Failed(e.to_string()))?;
        println!("listening on {}", server.control_addr);
        let signal = stop.await;
        tracing::info!(signal, "stopping prefill");
        let clean = server.shutdown().await;
        tracing::info!(clean, "prefill exited");
        Ok(())
    })
}
