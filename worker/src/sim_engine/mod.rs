//! The simulated engine as its own process (`tandem-worker sim-engine`): a client of the engine API
//! and nothing else (DESIGN §3.1). It stands in for SGLang or vLLM exactly where they plug in.
//!
//! It attaches with the identity of the worker config it is given, maps the pools, and then, by the
//! role the worker reports:
//! - **prefill**: takes each PrefillWork, allocates source pages itself (as an engine's allocator
//!   does), writes the room's KV — bytes that are a deterministic function of (request, layer, token),
//!   [`crate::engine::content`] — in two layer halves with a PagesReady each, and reuses a page only
//!   after its SourceFree ([`source_pages`]). Up to `--max-running-rooms` rooms are computed at once,
//!   each on its own task at the same cost per token, as an engine batches the requests it runs;
//!   work beyond that, or beyond the free pages, waits in arrival order;
//! - **decode**: reserves pages per request, waits for the KV, verifies every row of every page of
//!   every pool it reads (a page holding another request's, layer's or token's bytes is counted
//!   corrupt, never guessed), reports accept counts per verification step, finishes, and reuses pages
//!   only after their SafeToReuse.
//!
//! It prints one JSON [`Summary`] line on stdout and exits non-zero when a page was corrupt, a room
//! failed, or the run did not finish within its bound.
//!
//! With `--serve` it is the engine container of a pod (DESIGN §3.1): it attaches to its prefill
//! worker, serves every PrefillWork until SIGTERM or SIGINT — then Detach, the summary line, exit
//! 0 — and, when the worker is not up yet or goes away, attaches again with a bounded backoff
//! (50 ms doubling to `--attach-backoff-max-ms`): the pod's containers may start in either order.
//! A room the worker refuses (it failed meanwhile) is dropped and its pages reused once free; the
//! session goes on. Against a decode worker, serve mode decodes the requests its front door hands
//! out ([`decode`]).
//!
//! A PrefillWork with prefix hashes goes through the tier calls first ([`tiers`]): Lookup, Load of
//! the hit pages into the room's source pages (each layer read only after its `LayerLoaded`, every
//! loaded chunk verified against its page's content), and — once the room's compute time has
//! passed, before its last PagesReady — Store of the computed pages through staging pages; loaded
//! pages cost no compute time.

pub mod decode;
mod layer_split;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio_stream::StreamExt;

use crate::config::WorkerConfig;
use crate::engine::content::{ChunkSpec, TAG_BYTES, fill_chunk, verify_chunk};
use crate::engine_api::client::{Attached, ClientError, EngineClient, MappedPool};
use crate::engine_api::identity::{
    configured_bytes, fingerprint, kind_to_proto, layout_to_proto, model_to_proto,
};
use crate::engine_api::pb;
use crate::memory::pool::{PoolLayout, PoolRole};
use crate::release::RoomKey;

pub mod source_pages;
pub mod tiers;

use source_pages::SourcePages;

/// Rooms the simulated prefill engine computes at once by default (`--max-running-rooms`): the
/// demo's router holds at most 8 requests in flight per decode pool, so 8 rooms keep a prefill from
/// queueing them one behind the other as a batching engine would not.
pub const DEFAULT_MAX_RUNNING_ROOMS: u32 = 8;

/// Command-line arguments of `tandem-worker sim-engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Directory of the worker's `engine.sock` and `pools.sock`.
    #[arg(long)]
    pub socket_dir: PathBuf,
    /// The worker config (the engine presents its model, parallelism and pools).
    #[arg(long)]
    pub config: PathBuf,
    /// Pod ordinal in the group (gives the TP/CP ranks); default: the numeric suffix of
    /// `$POD_NAME`, as the worker derives its own (else 0).
    #[arg(long)]
    pub ordinal: Option<u32>,
    /// Tokens per page (default: the CacheTier's, else 512).
    #[arg(long)]
    pub page_tokens: Option<u32>,
    /// Pool layout: `page-first` or `layer-first`.
    #[arg(long, default_value = "page-first")]
    pub layout: String,
    /// Rooms to serve (prefill) or requests to run (decode).
    #[arg(long, default_value_t = 8)]
    pub requests: u32,
    /// Prompt tokens per request (decode; default two pages and three tokens).
    #[arg(long)]
    pub tokens: Option<u32>,
    /// Verification steps reported per request (decode; 0 = none).
    #[arg(long, default_value_t = 4)]
    pub spec_steps: u32,
    /// First request id (decode).
    #[arg(long, default_value_t = 1)]
    pub request_base: u64,
    /// KV deadline per request, milliseconds (decode).
    #[arg(long, default_value_t = 10_000)]
    pub kv_deadline_ms: u64,
    /// Deadline of each unary call, milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub call_timeout_ms: u64,
    /// Bound of the whole run, seconds (bounded mode only).
    #[arg(long, default_value_t = 120)]
    pub run_timeout_s: u64,
    /// Serve until SIGTERM/SIGINT instead of a bounded run (the engine container of a prefill pod).
    #[arg(long)]
    pub serve: bool,
    /// Prefill compute time per prompt token, microseconds (the cost model: spent before each
    /// layer half's PagesReady). Default: `$TANDEM_SIM_PREFILL_US_PER_TOKEN`, else 0 in bounded
    /// mode and 20 in serve mode (the built-in engine's default).
    #[arg(long)]
    pub prefill_us_per_token: Option<u64>,
    /// Longest wait between two attach attempts in serve mode, milliseconds.
    #[arg(long, default_value_t = 2_000)]
    pub attach_backoff_max_ms: u64,
    /// Prefill: rooms computed at once (as an engine batches the requests it runs; each room still
    /// costs `--prefill-us-per-token` per computed token). Rooms beyond it, or beyond the free
    /// source pages, wait in arrival order. 1 = one room at a time.
    #[arg(long, default_value_t = DEFAULT_MAX_RUNNING_ROOMS)]
    pub max_running_rooms: u32,
    /// Negative control: flip one byte of the first target chunk written, after its PagesReady
    /// content was computed (the decode side must count it corrupt). Only in builds with the
    /// `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true)]
    pub corrupt_one_byte: bool,
    /// Negative control: read every loaded layer right after the Load call instead of after its
    /// `LayerLoaded` (counted as read-before-ready). Only with the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true, conflicts_with = "regenerate_hits")]
    pub skip_load_wait: bool,
    /// Negative control: serve a Lookup's hits by computing their pages again instead of loading
    /// the stored bytes (the KV is the same; no byte comes from L2 or L3, so the loaded-bytes
    /// checks must fail). Only with the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true)]
    pub regenerate_hits: bool,
    /// Fault injection: when a Lookup hits some pages but not all, ask the Load for one page past
    /// the hits, so the load fails partway (`LoadFailed` after the leading pages). Only with the
    /// `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true, conflicts_with_all = ["regenerate_hits", "skip_load_wait"])]
    pub load_beyond_hit: bool,
    /// Negative control, with `--load-beyond-hit`: verify every page a Load asked for on each
    /// `LayerLoaded`, ignoring the pages the event says it covers. Only with the
    /// `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true, requires = "load_beyond_hit")]
    pub ignore_load_coverage: bool,
    /// Fault injection (decode): the first SyncSession call of each session names its first page
    /// twice (refused), and the engine then hands the session over as if that call had not
    /// happened — which the worker must refuse, since pages pair with hashes by position. Only
    /// with the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true)]
    pub sync_page_twice_first: bool,
    /// Negative control (a LayerSplit rank): attention reads each non-owned layer's receive slot
    /// without AwaitLayer (counted as layer reads before ready; the chunks fail verification).
    /// Only with the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true)]
    pub skip_layer_wait: bool,
}

impl Args {
    /// The pod ordinal: `--ordinal`, else `$POD_NAME`'s suffix, else 0.
    fn ordinal(&self) -> u32 {
        self.ordinal.unwrap_or_else(|| {
            std::env::var("POD_NAME")
                .ok()
                .and_then(|n| n.rsplit_once('-').and_then(|(_, d)| d.parse().ok()))
                .unwrap_or(0)
        })
    }

    /// Compute time per prompt token.
    fn per_token(&self) -> Duration {
        let env = std::env::var("TANDEM_SIM_PREFILL_US_PER_TOKEN")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        let default = if self.serve { 20 } else { 0 };
        Duration::from_micros(self.prefill_us_per_token.or(env).unwrap_or(default))
    }

    /// How the prefill uses a Lookup's hits: [`tiers::HitUse::LoadAndWait`] unless a negative
    /// control says otherwise.
    fn hit_use(&self) -> tiers::HitUse {
        #[cfg(feature = "negative-controls")]
        {
            if self.regenerate_hits {
                return tiers::HitUse::Regenerate;
            }
            if self.skip_load_wait {
                return tiers::HitUse::LoadSkipWait;
            }
            if self.load_beyond_hit {
                return tiers::HitUse::LoadBeyondHit {
                    trust_coverage: !self.ignore_load_coverage,
                };
            }
        }
        tiers::HitUse::LoadAndWait
    }

    /// Whether LayerSplit attention skips AwaitLayer (always false without the feature).
    fn skip_layer_wait(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        {
            self.skip_layer_wait
        }
        #[cfg(not(feature = "negative-controls"))]
        {
            false
        }
    }

    /// Whether the first SyncSession call of each session is malformed (always false without
    /// the feature).
    fn sync_fault(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        {
            self.sync_page_twice_first
        }
        #[cfg(not(feature = "negative-controls"))]
        {
            false
        }
    }

    fn corrupt_once(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        {
            self.corrupt_one_byte
        }
        #[cfg(not(feature = "negative-controls"))]
        {
            false
        }
    }
}

/// What a run did (printed as one JSON line).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// `prefill` or `decode`.
    pub role: String,
    /// The attach id.
    pub attach_id: u64,
    /// Pools mapped.
    pub pools: Vec<String>,
    /// Rooms served (prefill) or requests run (decode).
    pub rooms: u32,
    /// Decode: rooms whose KV completed.
    pub completed: u32,
    /// Decode: rooms that failed.
    pub failed: u32,
    /// Pages written (prefill) or read and verified (decode), over all pools.
    pub pages: u64,
    /// Chunks (page × layer × pool) written or verified.
    pub chunks: u64,
    /// Decode: chunks that failed verification (must be 0).
    pub corrupt_chunks: u64,
    /// PagesReady calls (prefill).
    pub pages_ready_calls: u32,
    /// SafeToReuse (decode) or SourceFree (prefill) events received.
    pub releases: u32,
    /// Verification steps reported (decode).
    pub spec_steps: u32,
    /// Rooms the spec guard tripped (decode).
    pub spec_trips: u32,
    /// Serve mode: attaches made (re-attaches after the worker went away included).
    #[serde(default)]
    pub attaches: u32,
    /// Serve mode / prefill: rooms the worker refused or failed while the engine computed them.
    #[serde(default)]
    pub rooms_dropped: u32,
    /// Serve mode / decode: what the decode serve loop did ([`decode::DecodeStats`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<decode::DecodeStats>,
    /// Prefill: Lookup calls (rooms with prefix hashes; [`tiers`]).
    #[serde(default)]
    pub lookups: u32,
    /// Prefill: pages loaded from the tiers into source pages (their compute was saved).
    #[serde(default)]
    pub loaded_pages: u64,
    /// Prefill: loaded chunks verified byte for byte against their page's content.
    #[serde(default)]
    pub loaded_chunks: u64,
    /// Prefill: loaded chunks that did not hold their page's bytes (must be 0).
    #[serde(default)]
    pub loaded_corrupt_chunks: u64,
    /// Prefill: `LayerLoaded` events awaited before reading a loaded layer.
    #[serde(default)]
    pub load_waits: u64,
    /// Prefill: loaded layers read before their `LayerLoaded` (must be 0; only the negative
    /// control `--skip-load-wait` reads early).
    #[serde(default)]
    pub read_before_ready: u64,
    /// Prefill: loads that ended in LoadFailed (or broke the event order).
    #[serde(default)]
    pub load_failures: u32,
    /// Prefill: computed pages stored into the tiers.
    #[serde(default)]
    pub stored_pages: u64,
    /// Prefill: Store calls the worker refused (the room's KV is sent all the same).
    #[serde(default)]
    pub store_failures: u32,
    /// LayerSplit rank: AwaitLayer calls (one per non-owned layer of each room).
    #[serde(default)]
    pub layer_waits: u64,
    /// LayerSplit rank: AwaitLayer calls whose broadcast had landed before the call.
    #[serde(default)]
    pub layer_waits_hidden: u64,
    /// LayerSplit rank: receive-slot chunks attention read (every page of every awaited layer).
    #[serde(default)]
    pub layer_chunks_read: u64,
    /// LayerSplit rank: receive-slot chunks that did not hold their layer's KV of the request
    /// (must be 0; only the negative control `--skip-layer-wait` reads them early).
    #[serde(default)]
    pub layer_corrupt_chunks: u64,
    /// LayerSplit rank: receive-slot chunks read without AwaitLayer (the negative control).
    #[serde(default)]
    pub layer_reads_before_ready: u64,
    /// Prefill: most rooms computed at once (bounded by `--max-running-rooms`).
    #[serde(default)]
    pub peak_running_rooms: u32,
}

impl Summary {
    /// Adds the counts of `d` (one room's, or one loop's) to these; `role`, `attach_id`, `pools`
    /// and `attaches` stay, and `peak_running_rooms` is the larger of the two.
    pub fn absorb(&mut self, d: &Summary) {
        self.rooms += d.rooms;
        self.completed += d.completed;
        self.failed += d.failed;
        self.pages += d.pages;
        self.chunks += d.chunks;
        self.corrupt_chunks += d.corrupt_chunks;
        self.pages_ready_calls += d.pages_ready_calls;
        self.releases += d.releases;
        self.spec_steps += d.spec_steps;
        self.spec_trips += d.spec_trips;
        self.rooms_dropped += d.rooms_dropped;
        self.lookups += d.lookups;
        self.loaded_pages += d.loaded_pages;
        self.loaded_chunks += d.loaded_chunks;
        self.loaded_corrupt_chunks += d.loaded_corrupt_chunks;
        self.load_waits += d.load_waits;
        self.read_before_ready += d.read_before_ready;
        self.load_failures += d.load_failures;
        self.stored_pages += d.stored_pages;
        self.store_failures += d.store_failures;
        self.layer_waits += d.layer_waits;
        self.layer_waits_hidden += d.layer_waits_hidden;
        self.layer_chunks_read += d.layer_chunks_read;
        self.layer_corrupt_chunks += d.layer_corrupt_chunks;
        self.layer_reads_before_ready += d.layer_reads_before_ready;
        self.peak_running_rooms = self.peak_running_rooms.max(d.peak_running_rooms);
        if let Some(theirs) = &d.decode {
            let mine = self.decode.get_or_insert_with(decode::DecodeStats::default);
            mine.work += theirs.work;
            mine.tokens += theirs.tokens;
            mine.early_reuse += theirs.early_reuse;
            mine.release_waits += theirs.release_waits;
            mine.release_gaps += theirs.release_gaps;
            mine.cancelled += theirs.cancelled;
            mine.engine_errors += theirs.engine_errors;
            mine.sessions_synced += theirs.sessions_synced;
            mine.session_pages_synced += theirs.session_pages_synced;
            mine.session_sync_errors += theirs.session_sync_errors;
        }
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Setup failed (config, identity, geometry).
    #[error("{0}")]
    Setup(String),
    /// An API call failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The run did not finish in time.
    #[error("the run did not finish within {0:?}")]
    Timeout(Duration),
    /// Pages were corrupt or rooms failed; the summary says how many.
    #[error("verification failed: {corrupt} corrupt chunks, {failed} failed rooms")]
    Verification {
        /// Corrupt chunks.
        corrupt: u64,
        /// Failed rooms.
        failed: u32,
        /// The summary.
        summary: Box<Summary>,
    },
}

/// The request key of a pool's content: target KV is keyed by the request id itself, draft and
/// indexer by distinct derivations, so a page of one pool copied into another is detected.
pub fn content_key(role: PoolRole, request: u64) -> u64 {
    match role {
        PoolRole::Target => request,
        PoolRole::Draft => request ^ (1 << 63),
        PoolRole::Indexer => request ^ (1 << 62),
    }
}

/// The chunk of page `k` (of the room) on `layer` of `pool`: rows of the tokens the page holds.
pub fn chunk_spec(pool: &MappedPool, request: u64, tokens: u32, k: u32, layer: u32) -> ChunkSpec {
    let pt = pool.geometry().page_tokens;
    let first = k * pt;
    ChunkSpec {
        request: content_key(pool.role, request),
        layer,
        first_token: first,
        tokens: tokens.saturating_sub(first).min(pt),
        token_bytes: pool.geometry().bytes_per_token_layer as usize,
    }
}

/// The identity a simulated engine of `cfg` presents (ordinal `ordinal`, the given page size and
/// layout), asking for every configured pool.
pub fn identity_from_config(
    cfg: &WorkerConfig,
    page_tokens: u32,
    layout: PoolLayout,
    ordinal: u32,
) -> pb::EngineIdentity {
    let (tp, cp) = cfg.parallelism.ranks_of(ordinal).unwrap_or((0, 0));
    let mut pools = vec![pb::PoolRequest {
        kind: kind_to_proto(PoolRole::Target) as i32,
        ..pb::PoolRequest::default()
    }];
    if let Some(s) = &cfg.speculative
        && configured_bytes(cfg, PoolRole::Draft) > 0
    {
        pools.push(pb::PoolRequest {
            kind: kind_to_proto(PoolRole::Draft) as i32,
            draft_model: Some(model_to_proto(&s.draft_model)),
            ..pb::PoolRequest::default()
        });
    }
    if let Some(g) = &cfg.indexer
        && configured_bytes(cfg, PoolRole::Indexer) > 0
    {
        pools.push(pb::PoolRequest {
            kind: kind_to_proto(PoolRole::Indexer) as i32,
            indexer: Some(pb::IndexerGeometry {
                head_dim: g.head_dim,
                dtype_bytes: g.dtype_bytes,
            }),
            ..pb::PoolRequest::default()
        });
    }
    pb::EngineIdentity {
        engine: format!("simulated/{}", env!("CARGO_PKG_VERSION")),
        model: Some(model_to_proto(&cfg.model)),
        model_fingerprint: fingerprint(&cfg.model),
        page_tokens,
        layout: layout_to_proto(layout) as i32,
        tp_rank: tp,
        tp_size: cfg.parallelism.tensor,
        cp_rank: cp,
        cp_size: cfg.parallelism.context,
        pools,
    }
}

/// Runs the simulated engine to completion on its own runtime (the subcommand's entry point).
///
/// # Errors
/// [`SimError`].
pub fn run_blocking(args: Args) -> Result<Summary, SimError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| SimError::Setup(format!("runtime: {e}")))?;
    let summary = rt.block_on(async move {
        if args.serve {
            serve(args).await
        } else {
            run(args).await
        }
    });
    match &summary {
        Ok(s) => println!("{}", serde_json::to_string(s).unwrap_or_default()),
        Err(SimError::Verification { summary, .. }) => {
            println!("{}", serde_json::to_string(summary).unwrap_or_default());
        }
        Err(_) => {}
    }
    summary
}

/// Runs the simulated engine (attach, then the role's loop) within `args.run_timeout_s`.
///
/// # Errors
/// [`SimError`].
pub async fn run(args: Args) -> Result<Summary, SimError> {
    let bound = Duration::from_secs(args.run_timeout_s);
    match tokio::time::timeout(bound, run_inner(args)).await {
        Ok(r) => r,
        Err(_) => Err(SimError::Timeout(bound)),
    }
}

async fn run_inner(args: Args) -> Result<Summary, SimError> {
    let cfg = <WorkerConfig as crate::config::LoadConfig>::load(&args.config)
        .map_err(|e| SimError::Setup(e.to_string()))?;
    let layout = match args.layout.as_str() {
        "page-first" => PoolLayout::PageFirst,
        "layer-first" => PoolLayout::LayerFirst,
        other => return Err(SimError::Setup(format!("unknown layout {other:?}"))),
    };
    let page_tokens = args.page_tokens.unwrap_or_else(|| {
        cfg.cache
            .as_ref()
            .map_or(crate::engine_api::DEFAULT_PAGE_TOKENS, |c| c.page_tokens)
    });
    let call = Duration::from_millis(args.call_timeout_ms);
    let mut client = EngineClient::connect(&args.socket_dir, call).await?;
    let identity = identity_from_config(&cfg, page_tokens, layout, args.ordinal());
    let attached = client.attach(identity).await?;
    for p in &attached.pools {
        if (p.geometry().bytes_per_token_layer as usize) < TAG_BYTES {
            return Err(SimError::Setup(format!(
                "the {} pool has {} B per token and layer; the simulated engine's content needs at least {TAG_BYTES}",
                p.role,
                p.geometry().bytes_per_token_layer
            )));
        }
    }
    let mut summary = Summary {
        role: attached.reply.role.clone(),
        attach_id: attached.id(),
        pools: attached.pools.iter().map(|p| p.role.to_string()).collect(),
        ..Summary::default()
    };
    match attached.reply.role.as_str() {
        "decode" => decode_loop(&args, &mut client, &attached, &mut summary).await?,
        "prefill" => {
            let attached = Arc::new(attached);
            prefill_loop(&args, &mut client, &attached, &mut summary).await?;
        }
        other => return Err(SimError::Setup(format!("unknown worker role {other:?}"))),
    }
    if summary.corrupt_chunks > 0
        || summary.failed > 0
        || summary.loaded_corrupt_chunks > 0
        || summary.read_before_ready > 0
    {
        return Err(SimError::Verification {
            corrupt: summary.corrupt_chunks + summary.loaded_corrupt_chunks,
            failed: summary.failed,
            summary: Box::new(summary),
        });
    }
    Ok(summary)
}

/// First wait between two attach attempts in serve mode.
pub const ATTACH_BACKOFF_MIN: Duration = Duration::from_millis(50);

enum Session {
    /// SIGTERM or SIGINT.
    Stop,
    /// The session ended on its own (the worker went away, a stream failed).
    Ended(Result<(), SimError>),
}

/// Serve mode (`--serve`): attach, serve prefill work (or, against a decode worker, its DecodeWork:
/// [`decode::serve_loop`]) until SIGTERM/SIGINT, then Detach and return the summary; re-attach with
/// a bounded backoff whenever the worker is not up or goes away.
///
/// # Errors
/// [`SimError::Setup`] when the config is unreadable or the signal handlers cannot be installed.
pub async fn serve(args: Args) -> Result<Summary, SimError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).map_err(|e| SimError::Setup(format!("SIGTERM: {e}")))?;
    let mut int =
        signal(SignalKind::interrupt()).map_err(|e| SimError::Setup(format!("SIGINT: {e}")))?;
    let config = crate::config::resolve_path(&args.config);
    let cfg = <WorkerConfig as crate::config::LoadConfig>::load(&config)
        .map_err(|e| SimError::Setup(e.to_string()))?;
    let socket_dir = crate::config::resolve_path(&args.socket_dir);
    let layout = parse_layout(&args.layout)?;
    let page_tokens = page_tokens_of(&args, &cfg);
    let call = Duration::from_millis(args.call_timeout_ms);
    let max_backoff = Duration::from_millis(args.attach_backoff_max_ms.max(1));
    let mut total = Summary {
        role: "prefill".into(),
        ..Summary::default()
    };
    let mut backoff = ATTACH_BACKOFF_MIN;
    loop {
        let attempt = async {
            let mut client = EngineClient::connect(&socket_dir, call).await?;
            let identity = identity_from_config(&cfg, page_tokens, layout, args.ordinal());
            let attached = client.attach(identity).await?;
            Ok::<_, ClientError>((client, attached))
        };
        let attached = tokio::select! {
            _ = term.recv() => None,
            _ = int.recv() => None,
            r = attempt => Some(r),
        };
        let (mut client, attached) = match attached {
            None => return Ok(total),
            Some(Ok(a)) => a,
            Some(Err(e)) => {
                tracing::info!(error = %e, retry_in_ms = backoff.as_millis() as u64,
                    "worker not reachable or refused the attach; retrying");
                let stop = tokio::select! {
                    _ = term.recv() => true,
                    _ = int.recv() => true,
                    () = tokio::time::sleep(backoff) => false,
                };
                if stop {
                    return Ok(total);
                }
                backoff = (backoff * 2).min(max_backoff);
                continue;
            }
        };
        backoff = ATTACH_BACKOFF_MIN;
        let attached = std::sync::Arc::new(attached);
        let decode = attached.reply.role == "decode";
        total.role.clone_from(&attached.reply.role);
        check_row_bytes(&attached)?;
        total.attaches += 1;
        total.attach_id = attached.id();
        total.pools = attached.pools.iter().map(|p| p.role.to_string()).collect();
        tracing::info!(attach_id = attached.id(), pools = ?total.pools, role = %total.role, "attached; serving the worker's work");
        let session = tokio::select! {
            _ = term.recv() => Session::Stop,
            _ = int.recv() => Session::Stop,
            r = async {
                if decode {
                    decode::serve_loop(&args, &client, attached.clone(), &mut total).await
                } else {
                    prefill_loop(&args, &mut client, &attached, &mut total).await
                }
            } => Session::Ended(r),
        };
        match session {
            Session::Stop => {
                match client.detach(attached.id()).await {
                    Ok(()) => tracing::info!(attach_id = attached.id(), "detached; exiting"),
                    Err(e) => tracing::warn!(error = %e, "detach failed; exiting"),
                }
                return Ok(total);
            }
            Session::Ended(r) => {
                tracing::warn!(result = ?r.err(), "the attach ended; attaching again");
                drop(attached);
            }
        }
    }
}

fn parse_layout(v: &str) -> Result<PoolLayout, SimError> {
    match v {
        "page-first" => Ok(PoolLayout::PageFirst),
        "layer-first" => Ok(PoolLayout::LayerFirst),
        other => Err(SimError::Setup(format!("unknown layout {other:?}"))),
    }
}

fn page_tokens_of(args: &Args, cfg: &WorkerConfig) -> u32 {
    args.page_tokens.unwrap_or_else(|| {
        cfg.cache
            .as_ref()
            .map_or(crate::engine_api::DEFAULT_PAGE_TOKENS, |c| c.page_tokens)
    })
}

fn check_row_bytes(attached: &Attached) -> Result<(), SimError> {
    for p in &attached.pools {
        if (p.geometry().bytes_per_token_layer as usize) < TAG_BYTES {
            return Err(SimError::Setup(format!(
                "the {} pool has {} B per token and layer; the simulated engine's content needs at least {TAG_BYTES}",
                p.role,
                p.geometry().bytes_per_token_layer
            )));
        }
    }
    Ok(())
}

fn key_of(r: Option<pb::RoomRef>) -> Option<RoomKey> {
    r.map(RoomKey::from)
}

async fn decode_loop(
    args: &Args,
    client: &mut EngineClient,
    att: &Attached,
    s: &mut Summary,
) -> Result<(), SimError> {
    let id = att.id();
    let target = att
        .pool(PoolRole::Target)
        .ok_or_else(|| SimError::Setup("no target pool".into()))?;
    let pt = target.geometry().page_tokens;
    let tokens = args.tokens.unwrap_or(2 * pt + 3);
    let req = client.req_within(
        pb::WatchReleasesRequest { attach_id: id },
        Duration::from_secs(args.run_timeout_s),
    );
    let mut releases = client
        .decode
        .watch_releases(req)
        .await
        .map_err(ClientError::from)?
        .into_inner();
    let mut released: HashMap<RoomKey, pb::SafeToReuse> = HashMap::new();
    for i in 0..args.requests {
        let request = args.request_base + u64::from(i);
        // Reserve, waiting for a release when the pools are full.
        let reply = loop {
            let r = client.req(pb::ReserveRequest {
                attach_id: id,
                request_id: request,
                tokens,
                kv_deadline_ms: args.kv_deadline_ms,
                hand_off_token: 0,
            });
            match client.decode.reserve(r).await {
                Ok(r) => break r.into_inner(),
                Err(st) => {
                    let e = ClientError::from(st);
                    if e.api()
                        .is_some_and(|a| a.reason == pb::ErrorReason::NoFreePages)
                    {
                        let ev = releases
                            .next()
                            .await
                            .ok_or_else(|| SimError::Setup("release stream ended".into()))?
                            .map_err(ClientError::from)?;
                        s.releases += 1;
                        if let Some(k) = key_of(ev.room) {
                            released.insert(k, ev);
                        }
                        continue;
                    }
                    return Err(e.into());
                }
            }
        };
        let key =
            key_of(reply.room).ok_or_else(|| SimError::Setup("Reserve named no room".into()))?;
        s.rooms += 1;
        let wait = client.req_within(
            pb::AwaitKvRequest {
                attach_id: id,
                room: reply.room,
            },
            Duration::from_millis(args.kv_deadline_ms + args.call_timeout_ms),
        );
        let outcome = client
            .decode
            .await_kv(wait)
            .await
            .map_err(ClientError::from)?
            .into_inner();
        match outcome.outcome {
            Some(pb::await_kv_reply::Outcome::Complete(c)) => {
                s.completed += 1;
                verify_room(att, request, tokens, &c.pages, s);
                let mut tripped = false;
                if args.spec_steps > 0 {
                    let steps: Vec<pb::SpecStep> = (0..args.spec_steps)
                        .map(|k| pb::SpecStep {
                            proposed: 4,
                            accepted: 1 + (k + i) % 3,
                        })
                        .collect();
                    s.spec_steps += args.spec_steps;
                    let r = client.req(pb::SpecStepsRequest {
                        attach_id: id,
                        room: reply.room,
                        steps,
                    });
                    let rep = client
                        .spec
                        .report_steps(r)
                        .await
                        .map_err(ClientError::from)?
                        .into_inner();
                    tripped = rep.tripped;
                    s.spec_trips += u32::from(tripped);
                }
                // A tripped guard already aborted the room through the gate.
                if !tripped {
                    let r = client.req(pb::FinishRequest {
                        attach_id: id,
                        room: reply.room,
                    });
                    client.decode.finish(r).await.map_err(ClientError::from)?;
                }
            }
            Some(pb::await_kv_reply::Outcome::Failed(f)) => {
                s.failed += 1;
                tracing::warn!(%key, reason = f.reason, message = %f.message, "room failed");
            }
            None => return Err(SimError::Setup("AwaitKv answered no outcome".into())),
        }
        // The room's pages are reused only after its SafeToReuse.
        while !released.contains_key(&key) {
            let ev = releases
                .next()
                .await
                .ok_or_else(|| SimError::Setup("release stream ended".into()))?
                .map_err(ClientError::from)?;
            s.releases += 1;
            if let Some(k) = key_of(ev.room) {
                released.insert(k, ev);
            }
        }
        let ev = &released[&key];
        let mut got = ev.pages.clone();
        got.sort_unstable();
        let mut want = reply.pages.clone();
        want.sort_unstable();
        if got != want {
            return Err(SimError::Setup(format!(
                "SafeToReuse of {key} names pages {got:?}, reserved {want:?}"
            )));
        }
    }
    Ok(())
}

fn verify_room(att: &Attached, request: u64, tokens: u32, pages: &[u32], s: &mut Summary) {
    for pool in &att.pools {
        let g = *pool.geometry();
        for (k, &page) in pages.iter().enumerate() {
            s.pages += 1;
            for layer in 0..g.layers {
                let spec = chunk_spec(pool, request, tokens, k as u32, layer);
                let mut buf = vec![0u8; spec.bytes()];
                s.chunks += 1;
                let bad = match pool.read(page, layer, 0, &mut buf) {
                    Ok(()) => verify_chunk(&buf, &spec).err().map(|c| c.to_string()),
                    Err(e) => Some(e.to_string()),
                };
                if let Some(why) = bad {
                    s.corrupt_chunks += 1;
                    tracing::error!(pool = %pool.role, request, page, layer, error = %why, "corrupt KV chunk read");
                }
            }
        }
    }
}

async fn prefill_loop(
    args: &Args,
    client: &mut EngineClient,
    att: &Arc<Attached>,
    s: &mut Summary,
) -> Result<(), SimError> {
    let id = att.id();
    let target = att
        .pool(PoolRole::Target)
        .ok_or_else(|| SimError::Setup("no target pool".into()))?;
    let g = *target.geometry();
    let stream_deadline = Duration::from_secs(args.run_timeout_s);
    // Serve mode: the streams live as long as the attach.
    let stream_req = |m| {
        if args.serve {
            tonic::Request::new(m)
        } else {
            client.req_within(m, stream_deadline)
        }
    };
    let work_req = stream_req(pb::WatchWorkRequest { attach_id: id });
    let mut work = client
        .prefill
        .watch_work(work_req)
        .await
        .map_err(ClientError::from)?
        .into_inner();
    let free_req = if args.serve {
        tonic::Request::new(pb::WatchSourceFreeRequest { attach_id: id })
    } else {
        client.req_within(
            pb::WatchSourceFreeRequest { attach_id: id },
            stream_deadline,
        )
    };
    let mut freed = client
        .prefill
        .watch_source_free(free_req)
        .await
        .map_err(ClientError::from)?
        .into_inner();
    // Only this loop touches the book: pages are taken, returned and handed out here, never in a
    // room's task ([`source_pages`]).
    let mut book = SourcePages::new(g.pages);
    let mut queue: VecDeque<pb::PrefillWork> = VecDeque::new();
    let mut running: JoinSet<RoomDone> = JoinSet::new();
    let max_running = args.max_running_rooms.max(1) as usize;
    let started = Instant::now();
    let corrupt = Arc::new(AtomicBool::new(args.corrupt_once()));
    let per_token = args.per_token();
    while args.serve || s.rooms < args.requests || !running.is_empty() || !book.all_free() {
        // Start queued work, in arrival order, while a room may run and its pages are free.
        while running.len() < max_running
            && let Some(w) = queue.front()
        {
            let need = w.tokens.div_ceil(g.page_tokens).max(1) as usize;
            if need > g.pages as usize {
                return Err(SimError::Setup(format!(
                    "work of {} tokens exceeds the pool",
                    w.tokens
                )));
            }
            // Staging pages for the Store after the compute ([`tiers::store`]), taken with the
            // room's own when the pool can ever hold both (else the room stores nothing).
            let stage = w.prefix_hashes.len().min(need);
            // A LayerSplit rank is served no tier calls: nothing to stage.
            let split = att.reply.layer_split.is_some();
            let stage = if need + stage <= g.pages as usize && !split {
                stage
            } else {
                0
            };
            if book.free() < need + stage {
                break;
            }
            let (Some(pages), Some(staging)) = (book.take(need), book.take(stage)) else {
                break;
            };
            let w = queue.pop_front().unwrap_or_default();
            let room = Room {
                client: client.clone(),
                att: att.clone(),
                work: w,
                pages,
                staging,
                corrupt: corrupt.clone(),
                per_token,
                hit_use: args.hit_use(),
                skip_layer_wait: args.skip_layer_wait(),
            };
            running.spawn(room.run());
            s.peak_running_rooms = s.peak_running_rooms.max(running.len() as u32);
        }
        let in_flight = s.rooms + (running.len() + queue.len()) as u32;
        tokio::select! {
            w = work.next(), if args.serve || in_flight < args.requests => {
                let w = w.ok_or_else(|| SimError::Setup("work stream ended".into()))?.map_err(ClientError::from)?;
                queue.push_back(w);
            }
            f = freed.next() => {
                let f = f.ok_or_else(|| SimError::Setup("SourceFree stream ended".into()))?.map_err(ClientError::from)?;
                s.releases += 1;
                book.source_free(&f.pages);
            }
            Some(done) = running.join_next(), if !running.is_empty() => {
                let done = done.map_err(|e| SimError::Setup(format!("a room's task failed: {e}")))?;
                s.absorb(&done.counts);
                // Staging pages are never the worker's: the Store copied them before its reply.
                book.room_ended(&done.staging, true);
                match done.result {
                    Ok(()) => book.room_ended(&done.pages, false),
                    Err(Refused {
                        any_accepted,
                        error,
                    }) if args.serve => {
                        // The room failed meanwhile (deadline, abort): drop it and go on. Pages
                        // the worker took come back in a SourceFree; the others are free now.
                        tracing::warn!(room = ?done.room, %error, "the worker refused a PagesReady");
                        s.rooms_dropped += 1;
                        book.room_ended(&done.pages, !any_accepted);
                    }
                    Err(Refused { error, .. }) => return Err(error.into()),
                }
                s.rooms += 1;
                if args.serve {
                    tiers::publish_summary(&args.socket_dir, s);
                }
            }
        }
        if !args.serve && started.elapsed() > stream_deadline {
            return Err(SimError::Timeout(stream_deadline));
        }
    }
    Ok(())
}

/// One room to compute on its own task: its work, the source pages the loop took for it, and what
/// computing it needs.
struct Room {
    client: EngineClient,
    att: Arc<Attached>,
    work: pb::PrefillWork,
    pages: Vec<u32>,
    /// Pages to write the computed prefix pages into for their Store ([`tiers::store`]).
    staging: Vec<u32>,
    corrupt: Arc<AtomicBool>,
    per_token: Duration,
    hit_use: tiers::HitUse,
    /// The LayerSplit negative control `--skip-layer-wait`.
    skip_layer_wait: bool,
}

/// What a room's task did: its counts, and whether the worker refused it.
struct RoomDone {
    room: Option<pb::RoomRef>,
    pages: Vec<u32>,
    staging: Vec<u32>,
    counts: Summary,
    result: Result<(), Refused>,
}

impl Room {
    async fn run(mut self) -> RoomDone {
        let mut counts = Summary::default();
        let result = match self.att.reply.layer_split {
            // A rank of a LayerSplit group: layer by layer with the group.
            Some(seat) => layer_split::compute_and_send(&mut self, &seat, &mut counts).await,
            None => {
                compute_and_send(
                    &mut self.client,
                    &self.att,
                    &self.work,
                    &self.pages,
                    &self.staging,
                    &mut counts,
                    &self.corrupt,
                    self.per_token,
                    self.hit_use,
                )
                .await
            }
        };
        RoomDone {
            room: self.work.room,
            pages: self.pages,
            staging: self.staging,
            counts,
            result,
        }
    }
}

/// A PagesReady the worker refused; `any_accepted` when an earlier PagesReady of the room was
/// accepted (the worker then returns the pages in a SourceFree).
struct Refused {
    any_accepted: bool,
    error: ClientError,
}

#[allow(clippy::too_many_arguments)]
async fn compute_and_send(
    client: &mut EngineClient,
    att: &Attached,
    w: &pb::PrefillWork,
    pages: &[u32],
    staging: &[u32],
    s: &mut Summary,
    corrupt: &AtomicBool,
    per_token: Duration,
    hit_use: tiers::HitUse,
) -> Result<(), Refused> {
    let id = att.id();
    let mut any_accepted = false;
    let refused = |any_accepted: bool, error: ClientError| Refused {
        any_accepted,
        error,
    };
    // The tier calls: loaded pages cost no compute ([`tiers`]).
    let bound = Duration::from_millis(w.deadline_ms.max(1_000));
    let loaded = tiers::load(client, att, &w.prefix_hashes, pages, bound, hit_use, s)
        .await
        .unwrap_or_else(|e| {
            // The tiers failed this room: compute every page (the KV is the same, only slower).
            s.load_failures += 1;
            tracing::warn!(room = ?w.room, error = %e, "tier calls failed; computing every page");
            0
        });
    let page_tokens = att
        .pool(PoolRole::Target)
        .map_or(1, |p| p.geometry().page_tokens);
    let computed_tokens = w
        .tokens
        .saturating_sub((loaded as u32).saturating_mul(page_tokens));
    let layers = att
        .pool(PoolRole::Target)
        .map_or(1, |p| p.geometry().layers);
    let halves = if layers >= 2 {
        vec![(0, layers / 2, false), (layers / 2, layers, true)]
    } else {
        vec![(0, layers, true)]
    };
    let cost = per_token.saturating_mul(computed_tokens) / halves.len().max(1) as u32;
    // The computed pages with a prefix hash: stored once the compute time has passed.
    let m = w.prefix_hashes.len().min(pages.len());
    let to_store = &w.prefix_hashes[loaded.min(m)..m];
    for (start, end, last) in halves {
        if !cost.is_zero() {
            tokio::time::sleep(cost).await;
        }
        if last
            && !to_store.is_empty()
            && let Err(e) = tiers::store(client, att, to_store, staging, s).await
        {
            // The KV still goes to the decode; only the tiers miss these pages.
            s.store_failures += 1;
            tracing::warn!(room = ?w.room, error = %e, "Store refused; the pages are not cached");
        }
        for pool in &att.pools {
            let top = pool.geometry().layers;
            for (k, &page) in pages.iter().enumerate() {
                for layer in start.min(top)..end.min(top) {
                    let spec = chunk_spec(pool, w.request_id, w.tokens, k as u32, layer);
                    let mut buf = vec![0u8; spec.bytes()];
                    fill_chunk(&mut buf, &spec);
                    if pool.role == PoolRole::Target
                        && buf.len() > 20
                        && corrupt.swap(false, Ordering::SeqCst)
                    {
                        // Negative control (--corrupt-one-byte): one wrong byte in one chunk.
                        buf[20] ^= 0x40;
                        tracing::warn!(
                            request = w.request_id,
                            page,
                            layer,
                            "negative control: one byte of this chunk is wrong"
                        );
                    }
                    pool.write(page, layer, 0, &buf)
                        .map_err(|e| refused(any_accepted, e))?;
                    s.chunks += 1;
                }
            }
        }
        let r = client.req(pb::PagesReadyRequest {
            attach_id: id,
            room: w.room,
            pages: pages.to_vec(),
            first_page: 0,
            layers: Some(pb::LayerRange { start, end }),
            last,
        });
        s.pages_ready_calls += 1;
        let accepted = client
            .prefill
            .pages_ready(r)
            .await
            .map_err(|e| refused(any_accepted, ClientError::from(e)))?
            .into_inner()
            .accepted;
        if !accepted {
            // The room failed: the worker returns this call's pages in a SourceFree.
            s.rooms_dropped += 1;
            break;
        }
        any_accepted = true;
    }
    s.pages += (pages.len() * att.pools.len()) as u64;
    Ok(())
}
