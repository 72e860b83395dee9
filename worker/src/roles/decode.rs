//! The `decode` role: owns the KV region and its TCP receiver, connects to prefill peers over gRPC,
//! and runs requests in the trace-request form `{input_length, output_length, hash_ids}` (one JSON
//! object per line) — each allocates pages, opens a room, receives and verifies the KV, and releases
//! pages only through the release gate (DESIGN contract 3). Prints one summary line and exits.
//!
//! With `--config`, it is instead the pool's long-running decode server
//! (`tandem_worker::serve::decode`): the OpenAI-compatible front door, the same-revision prefill
//! peer set, and the health port; SIGTERM drains and exits 0.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tandem_worker::config::LoadConfig;
use tandem_worker::control::KvLayout;
use tandem_worker::control::decode::{DecodeConfig, DecodeNode, TransferOutcome};
use tandem_worker::control::pb::RequestSpec;
use tandem_worker::room::receiver::GateMode;

use crate::RoleError;

/// `tandem-worker decode` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Serve as a pod of the pool: the resolved worker config (`/etc/tandem/worker.json`, read
    /// through `$TANDEM_ROOT`): the front door, the peer set and the health port. Without it, the
    /// batch demo below runs and exits.
    #[arg(long, env = "TANDEM_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Prefill peer control address (host:port), batch demo mode.
    #[arg(long, env = "TANDEM_PREFILL_PEER", required_unless_present = "config")]
    pub prefill: Option<String>,
    /// Trace requests (JSON lines with input_length, output_length, hash_ids); without it,
    /// `--requests` synthetic requests of `--input-tokens`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Synthetic requests when no trace is given.
    #[arg(long, default_value_t = 10)]
    pub requests: u64,
    /// Input tokens of a synthetic request.
    #[arg(long, default_value_t = 1024)]
    pub input_tokens: u32,
    /// Worker id.
    #[arg(long, env = "TANDEM_WORKER_ID", default_value = "decode-0")]
    pub worker_id: String,
    /// Address of the KV data receiver.
    #[arg(long, default_value = "0.0.0.0:0")]
    pub data_bind: String,
    /// Pages in the KV region.
    #[arg(long, default_value_t = 1024)]
    pub pages: u32,
    /// KV layers per page.
    #[arg(long, default_value_t = 32)]
    pub layers: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_tokens: u32,
    /// Bytes per token per layer.
    #[arg(long, default_value_t = 4096)]
    pub token_bytes: u32,
    /// Deadline for a request's KV (ms); past it the room is aborted (seed 004).
    #[arg(long, default_value_t = 10_000)]
    pub deadline_ms: u64,
    /// Ack deadline before a failed room's pages are quarantined (ms).
    #[arg(long, default_value_t = 30_000)]
    pub ack_timeout_ms: u64,
}

#[derive(serde::Deserialize)]
struct TraceRow {
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

fn failed(what: &'static str) -> impl FnOnce(String) -> RoleError {
    move |e| RoleError::Failed(format!("{what}: {e}"))
}

fn load(args: &Args) -> Result<Vec<RequestSpec>, RoleError> {
    let Some(path) = &args.trace else {
        return Ok((1..=args.requests)
            .map(|id| RequestSpec {
                request_id: id,
                input_tokens: args.input_tokens,
                output_tokens: 1,
                hash_ids: vec![],
            })
            .collect());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .map_err(failed("reading the trace"))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let row: TraceRow = serde_json::from_str(l)
                .map_err(|e| RoleError::Failed(format!("trace line {}: {e}", i + 1)))?;
            Ok(RequestSpec {
                request_id: i as u64 + 1,
                input_tokens: row.input_length,
                output_tokens: row.output_length,
                hash_ids: row.hash_ids,
            })
        })
        .collect()
}

/// Runs the requests and prints `completed=.. failed=.. corrupt_chunks=.. quarantined_pages=..`.
///
/// # Errors
/// [`RoleError::Failed`] when the trace is unreadable, the receiver cannot bind or the peer cannot
/// be reached, or when any chunk read was corrupt.
pub fn run(args: Args) -> Result<(), RoleError> {
    if let Some(path) = &args.config {
        return serve_config(path);
    }
    let prefill = args.prefill.clone().unwrap_or_default();
    let requests = load(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .map_err(failed("starting the runtime"))?;
    runtime.block_on(async move {
        let node: Arc<DecodeNode> = DecodeNode::start(DecodeConfig {
            worker_id: args.worker_id.clone(),
            rank: 0,
            pages: args.pages,
            layout: KvLayout { layers: args.layers, page_tokens: args.page_tokens, token_bytes: args.token_bytes },
            data_bind: args.data_bind.clone(),
            ack_timeout: Duration::from_millis(args.ack_timeout_ms),
            heartbeat: Duration::from_millis(500),
            // The node receives KV through its TCP receiver: derive the gate's proof rule from that.
            fence_is_proof: tandem_worker::transfer::select::receiver_fence_is_proof(
                tandem_worker::transfer::TransportKind::Tcp,
            ),
            gate: GateMode::Safe,
        })
        .map_err(|e| e.to_string())
        .map_err(failed("starting the decode node"))?;
        let link = node.connect(&prefill, Duration::from_secs(5)).await.map_err(|e| e.to_string()).map_err(failed("connecting to prefill"))?;
        let (mut completed, mut failed_rooms, mut corrupt) = (0u64, 0u64, 0u64);
        for request in requests {
            match node.transfer(&link, request, Duration::from_millis(args.deadline_ms)).await {
                Ok(TransferOutcome::Completed { corrupt_chunks, .. }) => {
                    completed += 1;
                    corrupt += corrupt_chunks;
                }
                Ok(TransferOutcome::Failed { key, cause }) => {
                    tracing::warn!(%key, ?cause, "request failed");
                    failed_rooms += 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "request not admitted");
                    failed_rooms += 1;
                }
            }
        }
        let pages = node.pages();
        println!("completed={completed} failed={failed_rooms} corrupt_chunks={corrupt} quarantined_pages={} alarms={}", pages.quarantined, pages.alarms);
        if corrupt > 0 { Err(RoleError::Failed(format!("{corrupt} corrupt KV chunks read"))) } else { Ok(()) }
    })
}

/// `--config` mode: the pool's decode server until SIGTERM, then drain and exit 0.
fn serve_config(path: &std::path::Path) -> Result<(), RoleError> {
    use tandem_worker::serve::{decode, signals, sim::SimKnobs};
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
        let server = decode::DecodeServer::start(&cfg, knobs, decode::DecodeOptions::from_env())
            .await
            .map_err(|e| RoleError::Failed(e.to_string()))?;
        println!("listening on {}", server.front_addr);
        let signal = stop.await;
        tracing::info!(signal, "stopping decode");
        let clean = server.shutdown().await;
        tracing::info!(clean, "decode exited");
        Ok(())
    })
}
