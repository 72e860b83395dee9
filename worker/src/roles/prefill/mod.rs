//! `tandem-worker prefill --config`: the prefill serving process (worker/interfaces/README.md §2).
//!
//! Serves the gRPC `Transfer` service on `$POD_IP:ports.control` with this pool's revision (a decode
//! of another revision is refused in the hello), runs the simulated engine per room with the
//! prefix cache when the config names a tier, and the health port. Drain (SIGTERM): readiness 503 at
//! once, new rooms refused with `UNAVAILABLE` (decode retries elsewhere), running rooms finish or
//! are aborted through the release protocol until the grace deadline, then the transport drains
//! and closes (DESIGN contract 9).
//!
//! With a tier, the worker starts not ready and admits no room until it loaded its hot prefixes
//! back from L3 into L2 (bounded by a deadline; DESIGN §5 "load back from L3, admit when
//! CacheWarm"); with write-back, drain flushes L2 to L3. With an engine, the loadback reads the
//! pages' bytes into [`tiers::HostTiers`]' L2 and readiness follows the engine's attach (rooms are
//! not admitted before the loadback ends).
//!
//! The data port (`ports.data`) is where a decode worker's KV receiver listens; the prefill side
//! only dials it, so a prefill binds no data port.
//!
//! Which engine computes the rooms follows `config.engine` (DESIGN §3.1): `None` — the built-in
//! in-process simulated engine, as before (logged, and `/report` says `"engine": {"kind":
//! "builtin"}`); `Some` — the engine beside the worker, through the engine API ([`seat`],
//! [`node::engine`]): the pools are allocated and registered at start, the worker is not ready
//! until an engine attached, and every room is computed by that engine and moved from its shared
//! pool.
//!
//! - [`node`]: the `Transfer` service and the sender side of every room (contract 3), with the
//!   engine path in [`node::engine`];
//! - [`seat`]: the engine seat (pools, engine-API server, readiness, metrics) of a worker with an
//!   engine;
//! - [`prefix_cache`]: the L2 index and the L3 store around the built-in engine (contract 7);
//! - [`tiers`]: with an engine, the tier calls (L2 of page bytes, L3 loads into the engine's pages
//!   with per-layer events, stores; contracts 5 and 7);
//! - here: the CLI ([`Args`], [`run`]) and the server that wires them ([`PrefillServer`]).

pub mod cp_engine;
pub mod cp_group;
pub mod l3_report;
pub mod loadback;
pub mod node;
pub mod prefix_cache;
pub mod seat;
pub mod snapshot_sync;
pub mod tiers;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::resolve::Resolver;
use super::sim::SimKnobs;
use super::{RoleError, ServeError, load_worker_config, ordinal_from_env, pod_ip, signals};
use crate::config::WorkerConfig;
use crate::health::counters::mirror;
use crate::health::http::{ServeState, router, spawn_http};
use crate::l3::manifest::ShardCoords;
use crate::l3::replicas::BookConfig;
use crate::teardown::{Teardown, TeardownReport};
use crate::transfer::Transport;
use crate::transfer::tcp::{TcpConfig, TcpTransport};
use node::{PrefillConfig, PrefillNode, PrefillService};
use prefix_cache::{L3_PORT, L3Target, PrefixCache};

/// `tandem-worker prefill` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The resolved worker config (`/etc/tandem/worker.json` in a pod; read through
    /// `$TANDEM_ROOT`). Ports, revision, model, memory and cache tier come from it; the simulation
    /// knobs from `TANDEM_SIM_*` (see `roles::sim`); bind address and worker id from `$POD_IP` and
    /// `$POD_NAME`.
    #[arg(long, env = "TANDEM_WORKER_CONFIG")]
    pub config: std::path::PathBuf,
}

/// Runs the pool's prefill server until SIGTERM/SIGINT, then drains and exits 0. Prints
/// `listening on ADDR` (the gRPC control address) once serving. When the engine seat's pools are
/// refused it serves nothing and holds the refusal on the health port
/// ([`super::refusal::hold`]) until SIGTERM.
///
/// # Errors
/// [`RoleError::Failed`] when the config or a knob is invalid, the runtime or the signal handlers
/// cannot start, or a port cannot be bound.
pub fn run(args: Args) -> Result<(), RoleError> {
    let cfg = load_worker_config(&args.config)?;
    super::check_role(&cfg, crate::config::WorkerRole::Prefill)?;
    let knobs = SimKnobs::from_env().map_err(|e| RoleError::Failed(e.to_string()))?;
    super::runtime()?.block_on(async move {
        let stop = signals::terminated()
            .map_err(|e| RoleError::Failed(format!("signal handlers: {e}")))?;
        let opts = PrefillOptions::from_env().map_err(RoleError::Failed)?;
        let server = match PrefillServer::start(&cfg, knobs, opts).await {
            Ok(s) => s,
            // Fail closed, visibly: not Ready, the typed refusal in /readyz, /report, /metrics.
            Err(super::ServeError::Pools(e)) => {
                return super::refusal::hold(&cfg, "prefill", &e, stop).await;
            }
            Err(e) => return Err(RoleError::Failed(e.to_string())),
        };
        println!("listening on {}", server.control_addr);
        let broken = tokio::select! {
            signal = stop => {
                tracing::info!(signal, "stopping prefill");
                None
            }
            why = server.group_broken() => Some(why),
        };
        if let Some(why) = &broken {
            // A CP group runs no step without every rank, and re-forms only when all its ranks
            // connect anew: drain, then exit non-zero so the pod restarts into the new group.
            tracing::error!(error = %why, "CP group broken: stopping so that the group re-forms");
            server
                .state
                .set_ready(Err(format!("CP group broken: {why}")));
        }
        super::print_teardown(&server.shutdown().await);
        match broken {
            Some(why) => Err(RoleError::Failed(format!("CP group broken: {why}"))),
            None => Ok(()),
        }
    })
}

/// Process-level options (the config decides the rest).
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// Address to bind (default `$POD_IP`, else 0.0.0.0).
    pub bind_ip: IpAddr,
    /// Worker id (default `$POD_NAME`).
    pub worker_id: String,
    /// Grace for in-flight rooms at drain.
    pub drain_grace: Duration,
    /// Longest restart loadback from L3 before admitting anyway.
    pub loadback_deadline: Duration,
    /// Most pages loaded back at start (`TANDEM_L3_LOADBACK_PAGES`; default: the L2 capacity;
    /// 0 disables loadback).
    pub loadback_pages: Option<usize>,
    /// Reads in flight during the restart loadback (`TANDEM_L3_LOADBACK_STREAMS`, 1 to
    /// [`loadback::MAX_STREAMS`]; default [`loadback::DEFAULT_STREAMS`]): see [`loadback`].
    pub loadback_streams: usize,
    /// The L3 replica book's knobs: `TANDEM_L3_WRITE_RAMP_S` (write ramp of a replica that
    /// attached empty, seconds, at least 1; default 60) and `TANDEM_L3_RATE_WINDOW_S` (window of
    /// the per-replica write rates, seconds, at least 1; default 60). Builds with the
    /// `negative-controls` feature also read `TANDEM_L3_WRITE_RAMP_OFF_FOR_TEST=1` (no ramp).
    pub l3_book: BookConfig,
}

/// The tier cache of a worker serving tier calls (the prefill role, and a decode beside an SGLang
/// or vLLM engine): an L2 prefix index of `l2_pages` pages and, when the config has a `cache`,
/// the L3 CacheTier's replicas for this rank's shard (layers owned under LayerSplit). With a tier,
/// an unreachable L3 degrades the worker's health (component `l3`, cleared when it answers: it is
/// probed every [`L3_PROBE_EVERY`] while no request reaches it) and `/report` gets an `l3` section.
pub(crate) fn tier_cache(
    cfg: &WorkerConfig,
    rank: u32,
    l2_pages: usize,
    prefill_per_token: Duration,
    state: &Arc<ServeState>,
    book: BookConfig,
    l3_metrics: l3_report::L3Metrics,
) -> Arc<PrefixCache> {
    let l3 = cfg.cache.as_ref().map(|c| {
        let (tp, cp) = cfg.parallelism.ranks_of(rank).unwrap_or((0, 0));
        let (start, end) = cfg
            .layer_split
            .as_ref()
            .map(|ls| {
                let owned: Vec<u32> = ls.owned_by(cp).collect();
                (
                    owned.first().copied().unwrap_or(0),
                    owned.last().map_or(cfg.model.layers, |l| l + 1),
                )
            })
            .unwrap_or((0, cfg.model.layers));
        L3Target {
            service: c.service.clone(),
            port: L3_PORT,
            shard: ShardCoords {
                tp_rank: tp,
                cp_rank: cp,
                layer_start: start,
                layer_end: end,
            },
            write_policy: c.write_policy,
        }
    });
    let st = state.clone();
    let sink: Arc<dyn Fn(Option<String>) + Send + Sync> = Arc::new(move |r| match r {
        Some(r) => st.health.degrade("l3", "L3Unreachable", r),
        None => st.health.recover("l3"),
    });
    let with_tier = l3.is_some();
    let cache = Arc::new(
        PrefixCache::new(
            l2_pages,
            l3,
            Resolver::from_env(),
            prefill_per_token,
            state.counters.clone(),
            sink,
        )
        .with_replica_book(book, l3_metrics),
    );
    if with_tier {
        // Weak: the cache's health sink already holds the state.
        let c = Arc::downgrade(&cache);
        state.on_refresh(move |st| {
            if let Some(c) = c.upgrade() {
                st.set_section("l3", c.l3_report());
            }
        });
        // The tier is re-checked between calls, so an L3 degraded reason clears when the
        // tier is back even while no request reaches it; ends with the cache.
        let c = Arc::downgrade(&cache);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(L3_PROBE_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(cache) = c.upgrade() else { break };
                if tokio::task::spawn_blocking(move || cache.probe_tier())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
    }
    cache
}

/// Seconds from `var`, at least 1; `default` when unset or unparsable.
fn env_secs(var: &str, default: Duration) -> Duration {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite())
        .map_or(default, |s| Duration::from_secs_f64(s.max(1.0)))
}

fn l3_book_from_env() -> BookConfig {
    let d = BookConfig::default();
    #[cfg(feature = "negative-controls")]
    let ramp_enabled = !matches!(
        std::env::var("TANDEM_L3_WRITE_RAMP_OFF_FOR_TEST")
            .as_deref()
            .map(str::trim),
        Ok("1")
    );
    #[cfg(not(feature = "negative-controls"))]
    let ramp_enabled = true;
    BookConfig {
        ramp: env_secs("TANDEM_L3_WRITE_RAMP_S", d.ramp),
        rate_window: env_secs("TANDEM_L3_RATE_WINDOW_S", d.rate_window),
        ramp_enabled,
        ..d
    }
}

impl PrefillOptions {
    /// Options from the pod environment.
    ///
    /// # Errors
    /// A setting the worker does not understand (today `TANDEM_L3_LOADBACK_STREAMS`), named.
    pub fn from_env() -> Result<Self, String> {
        Ok(Self {
            bind_ip: pod_ip(),
            worker_id: std::env::var("POD_NAME").unwrap_or_else(|_| "prefill-0".into()),
            drain_grace: super::drain_grace_from_env(),
            loadback_deadline: Duration::from_secs(30),
            loadback_pages: std::env::var("TANDEM_L3_LOADBACK_PAGES")
                .ok()
                .and_then(|v| v.trim().parse().ok()),
            loadback_streams: loadback::streams_from_env()?,
            l3_book: l3_book_from_env(),
        })
    }
}

/// How often a prefill with a tier re-checks it between L3 calls
/// ([`prefix_cache::PrefixCache::probe_tier`]): a degraded L3 reason clears within this of the
/// tier coming back.
pub const L3_PROBE_EVERY: Duration = Duration::from_secs(2);

/// A running prefill server.
pub struct PrefillServer {
    /// Serving state (phase, counters).
    pub state: Arc<ServeState>,
    /// gRPC control address.
    pub control_addr: SocketAddr,
    /// Health address.
    pub health_addr: SocketAddr,
    node: Arc<PrefillNode>,
    service: PrefillService,
    transport: Arc<TcpTransport>,
    grpc: tokio::task::JoinHandle<()>,
    http: tokio::task::JoinHandle<()>,
    grace: Duration,
    cache: Arc<PrefixCache>,
    layout: crate::control::KvLayout,
    seat: Option<seat::Seat>,
    group: Option<Arc<cp_group::GroupRank>>,
    engine_group: Option<Arc<cp_engine::EngineGroup>>,
}

impl PrefillServer {
    /// Starts serving; ready as soon as the control port listens.
    ///
    /// # Errors
    /// [`ServeError`] when a port cannot be bound.
    pub async fn start(
        cfg: &WorkerConfig,
        knobs: SimKnobs,
        opts: PrefillOptions,
    ) -> Result<Self, ServeError> {
        let engine_metrics = seat::EngineMetrics::default();
        let l3_metrics = l3_report::L3Metrics::default();
        let state =
            ServeState::with_metrics("prefill", &cfg.pool, &cfg.revision, "starting", |r| {
                if cfg.engine.is_some() {
                    engine_metrics.register(r);
                }
                if cfg.cache.is_some() {
                    l3_metrics.register(r);
                }
            });
        let (layout, target_token_bytes) = match &cfg.engine {
            None => (knobs.layout(cfg), None),
            Some(_) => seat::engine_layout(cfg, &knobs)?,
        };
        let serving_transport = super::apply_transport(cfg.transport, &state);
        super::config_use::apply(cfg, &state);
        let refused = serving_transport.refusal().is_some();
        let transport = Arc::new(TcpTransport::new(TcpConfig::default()));
        let rank = ordinal_from_env();
        let node = PrefillNode::new(
            PrefillConfig {
                worker_id: opts.worker_id.clone(),
                rank,
                layout,
                compute_per_page: knobs.prefill_per_token * layout.page_tokens,
            },
            transport.clone(),
        );
        // Issue 18: this process's incarnation (what its hello and heartbeats carry), so a reader
        // can match it with the decode's `peer_incarnations` after a restart on the same address.
        state.set_section("incarnation", serde_json::json!(node.incarnation()));
        let mut service = PrefillService::new(node.clone());
        service.revision = cfg.revision.clone();
        // A CP group (issue 15): pure, from the config and the pod name. The built-in engine's
        // groups (replicated or LayerSplit) connect below. With an engine beside the worker only a
        // LayerSplit group runs as a group (`cp_engine`): its ranks connect and agree on the owner
        // map here, before any pool is allocated (R-LS-1); the pods of a replicated group each
        // stay their own prefill (`config.unused` says so).
        let group_plan = match &cfg.engine {
            None => cp_group::plan(cfg, &opts.worker_id).map_err(ServeError::CpGroup)?,
            Some(_) => None,
        };
        let engine_link = match &cfg.engine {
            Some(engine)
                if cfg.layer_split.is_some()
                    && engine.kind == crate::config::EngineKind::Simulated =>
            {
                match cp_group::plan(cfg, &opts.worker_id).map_err(ServeError::CpGroup)? {
                    Some(plan) => {
                        state.set_ready(Err("connecting the CP group".into()));
                        let mut api = crate::engine_api::EngineApiConfig::for_worker(
                            cfg,
                            &crate::config::resolve_path(&engine.socket_dir),
                        );
                        api.target_token_bytes = target_token_bytes;
                        let (c, rt) = (cfg.clone(), tokio::runtime::Handle::current());
                        let resolver = super::resolve::Resolver::from_env();
                        let connected = tokio::task::spawn_blocking(move || {
                            cp_engine::connect(plan, api, &c, layout, &resolver, &rt)
                        })
                        .await
                        .map_err(|e| ServeError::CpGroup(e.to_string()))?
                        .map_err(ServeError::CpGroup)?;
                        Some(connected)
                    }
                    None => None,
                }
            }
            _ => None,
        };
        let page_bytes = layout.page_bytes().max(1);
        let whole_pages =
            usize::try_from(cfg.memory.target_pool_bytes / page_bytes).unwrap_or(usize::MAX);
        // Under LayerSplit the same host memory per rank holds more pages (seed 004).
        let l2_pages = group_plan
            .as_ref()
            .map_or(whole_pages, |p| p.prefix_cache_pages(whole_pages));
        let with_tier = cfg.cache.is_some();
        let cache = tier_cache(
            cfg,
            rank,
            l2_pages,
            knobs.prefill_per_token,
            &state,
            opts.l3_book.clone(),
            l3_metrics,
        );
        // With a tier, no room is admitted before the hot prefixes are back in L2; with a refused
        // transport, none at all.
        service
            .admitting
            .store(!with_tier && !refused, Ordering::SeqCst);
        // The engine seat: pools allocated and registered now, the engine-API server, readiness that
        // follows the engine's attach (DESIGN §3.1). Without one, the built-in engine computes.
        let seat = match &cfg.engine {
            Some(engine) => Some(seat::Seat::start(
                cfg,
                engine,
                &node,
                &state,
                rank,
                &engine_metrics,
                target_token_bytes,
                seat::TierSeat {
                    cache: cache.clone(),
                    l2_pages,
                    layout,
                    counters: state.counters.clone(),
                    admitting: service.admitting.clone(),
                },
                engine_link.as_ref().map(|l| l.seat.clone()),
            )?),
            None => {
                state.set_extra(|| {
                    let mut m = serde_json::Map::new();
                    m.insert("engine".into(), seat::report(None, None));
                    m
                });
                None
            }
        };
        // A LayerSplit rank with its engine: the group's control thread, AwaitLayer, broadcasts.
        let engine_group = match (engine_link, &seat) {
            (Some(connected), Some(seat)) => {
                let group = cp_engine::EngineGroup::start(
                    connected,
                    &node,
                    layout.chunk_bytes() as usize,
                    cp_group::GroupOptions::default().wait_timeout,
                    tokio::runtime::Handle::current(),
                )
                .map_err(ServeError::CpGroup)?;
                node.set_engine_group(group.clone());
                seat.api.set_layer_group(group.clone());
                service.cp_engine = Some(group.clone());
                let g = group.clone();
                state.on_refresh(move |st| {
                    st.set_section("cp_group", g.report());
                    match g.broken() {
                        Some(why) => st.health.degrade("cp_group", "CpGroupBroken", why),
                        None => st.health.recover("cp_group"),
                    }
                });
                Some(group)
            }
            _ => None,
        };
        // The prefix cache and L3 loadback plan the built-in engine's compute; an engine reaches
        // the tiers through the engine API's tier calls instead (the seat's `HostTiers`, whose
        // L2 holds page bytes and which loads back from L3 itself).
        if seat.is_none() {
            service.planner = Some(cache.clone());
        }
        // Snapshot sync (DESIGN contract 4, issue 15): the snapshot buffer with its receiver on
        // the data port. The built-in engine finalizes into its KV pool and prefix cache; with an
        // engine beside the worker a snapshot is finalized into the seat's host tier, whose L2
        // the engine's next Lookup and Load read.
        // Only decodes that hand their sessions over push (SyncSession: the Simulated engine's);
        // SGLang and vLLM decodes hand over none yet, so their prefills keep no buffer
        // (`config.unused` says so).
        let engine_tiers = seat
            .as_ref()
            .filter(|_| {
                cfg.engine
                    .as_ref()
                    .is_some_and(|e| e.kind == crate::config::EngineKind::Simulated)
            })
            .and_then(|s| s.tiers.clone());
        let snapshots = if cfg.memory.snapshot_buffer_bytes == 0 {
            None
        } else if seat.is_none() {
            let sync = snapshot_sync::start_builtin(
                cfg,
                &opts,
                layout,
                cache.clone(),
                state.counters.clone(),
            )
            .map_err(ServeError::Snapshot)?;
            service.pages = sync.0;
            Some(sync.1)
        } else if let Some(tiers) = engine_tiers {
            let sync =
                snapshot_sync::start_engine(cfg, &opts, layout, tiers, state.counters.clone())
                    .map_err(ServeError::Snapshot)?;
            Some(sync)
        } else {
            None
        };
        if let Some(s) = &snapshots {
            service.snapshots = Some(s.clone());
            let s = s.clone();
            // `/report.snapshot` (SnapshotSync::report), with or without an engine.
            state.on_refresh(move |st| {
                mirror(&st.counters.snapshot_evicted, s.evicted());
                st.set_section("snapshot", s.report());
            });
        }
        let group_slot: Arc<std::sync::OnceLock<Arc<cp_group::GroupRank>>> = Arc::default();
        if seat.is_none() {
            let group = group_slot.clone();
            state.set_extra(move || {
                let mut m = serde_json::Map::new();
                m.insert("engine".into(), seat::report(None, None));
                if let Some(g) = group.get() {
                    m.insert("cp_group".into(), g.report());
                }
                m
            });
        }
        let n = node.clone();
        state.on_refresh(move |s| {
            let st = n.stats();
            let c = &s.counters;
            mirror(&c.kv_bytes_sent, st.kv_bytes_sent.load(Ordering::Relaxed));
            mirror(&c.rooms_aborted, st.aborts_received.load(Ordering::Relaxed));
            mirror(&c.abort_acks, st.acks_sent.load(Ordering::Relaxed));
            mirror(&c.requests_ok, st.rooms_completed.load(Ordering::Relaxed));
        });

        let listener =
            tokio::net::TcpListener::bind(SocketAddr::new(opts.bind_ip, cfg.ports.control))
                .await
                .map_err(|e| ServeError::Bind("control", e))?;
        let control_addr = listener
            .local_addr()
            .map_err(|e| ServeError::Bind("control", e))?;
        let (health_addr, http) = spawn_http(
            SocketAddr::new(opts.bind_ip, cfg.ports.health),
            router(state.clone()),
        )
        .await
        .map_err(|e| ServeError::Bind("health", e))?;
        // A CP group (issue 15): its ranks connect and agree on the owner map (LayerSplit) or on
        // replication before any KV store is allocated and before this worker answers a decode
        // (health is up meanwhile).
        if let Some(plan) = group_plan {
            state.set_ready(Err("connecting the CP group".into()));
            let group_opts = cp_group::GroupOptions {
                pool_pages: crate::roles::sim::region_pages(cfg.memory.target_pool_bytes, layout),
                prefix_cache_pages: (l2_pages, whole_pages),
                ..cp_group::GroupOptions::default()
            };
            let (n, rt) = (node.clone(), tokio::runtime::Handle::current());
            let resolver = super::resolve::Resolver::from_env();
            let group = tokio::task::spawn_blocking(move || {
                cp_group::GroupRank::start(plan, layout, n, group_opts, &resolver, &rt)
            })
            .await
            .map_err(|e| ServeError::CpGroup(e.to_string()))?
            .map_err(ServeError::CpGroup)?;
            let group = Arc::new(group);
            service.cp_group = Some(group.clone());
            let _ = group_slot.set(group.clone());
            state.on_refresh(move |st| match group.broken() {
                Some(why) => st.health.degrade("cp_group", "CpGroupBroken", why),
                None => st.health.recover("cp_group"),
            });
        }
        let svc = service.clone();
        let grpc = tokio::spawn(async move {
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(svc.into_server())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
            {
                tracing::error!(error = %e, "gRPC server stopped");
            }
        });
        if with_tier {
            if seat.is_none() {
                state.set_ready(Err(seat::LOADING_BACK.into()));
            }
            let api = seat.as_ref().map(|s| s.api.clone());
            let (st, c, admitting) = (state.clone(), cache.clone(), service.admitting.clone());
            let tiers = seat.as_ref().and_then(|s| s.tiers.clone());
            let deadline = Instant::now() + opts.loadback_deadline;
            let limit = opts.loadback_pages.unwrap_or(l2_pages).min(l2_pages);
            let streams = opts.loadback_streams;
            let with_engine = api.is_some();
            tokio::spawn(async move {
                let started = Instant::now();
                let loaded = tokio::task::spawn_blocking(move || match tiers {
                    // With an engine, L2 holds the bytes: the loadback reads them into it.
                    Some(t) => t.load_back(limit, streams, deadline),
                    // A LayerSplit rank with an engine serves no tier (`config.unused`).
                    None if with_engine => 0,
                    None => c.load_back(layout, limit, streams, deadline),
                })
                .await
                .unwrap_or(0);
                tracing::info!(
                    loaded,
                    streams,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "L3 loadback into L2 done; admitting"
                );
                admitting.store(!refused, Ordering::SeqCst);
                // With an engine, ready once it is attached too (the seat's watcher covers an
                // attach from now on).
                if !with_engine || api.is_some_and(|a| a.current_attach().is_some()) {
                    st.set_ready(Ok(()));
                }
            });
        } else if seat.is_none() {
            state.set_ready(Ok(()));
        }
        match &seat {
            Some(s) => {
                tracing::info!(%control_addr, %health_addr, revision = %cfg.revision, ?layout,
                engine = ?s.kind, socket_dir = %s.socket_dir.display(), "prefill serving through the engine API")
            }
            None => tracing::info!(%control_addr, %health_addr, revision = %cfg.revision, ?layout,
                engine = "builtin", "prefill serving with the built-in simulated engine"),
        }
        let group = service.cp_group.clone();
        Ok(Self {
            engine_group,
            state,
            control_addr,
            health_addr,
            node,
            service,
            transport,
            grpc,
            http,
            grace: opts.drain_grace,
            cache,
            layout,
            seat,
            group,
        })
    }

    /// Resolves with the reason once this worker's CP group breaks; never without a group.
    pub async fn group_broken(&self) -> String {
        match (&self.group, &self.engine_group) {
            (Some(g), _) => g.broken_signal().await,
            (None, Some(g)) => g.broken_signal().await,
            (None, None) => std::future::pending().await,
        }
    }

    /// Drains and stops through the ordered teardown of DESIGN contract 9
    /// ([`crate::teardown::Teardown`]): readiness 503 and no new rooms (StopAdmission); running
    /// rooms finish until the grace deadline, then L2 is flushed to L3 under write-back
    /// (DrainRooms); the transport's writes conclude (FreeTransferHandles); the KV transport and
    /// the snapshot receiver close, then the engine detaches and the engine API stops
    /// (DestroyTransports); the pools are deregistered and freed with the allocator that made them
    /// (FreeMemory). A failing
    /// step is recorded and the later ones still run. The servers stop last.
    ///
    /// Returns the report: every step, in order, with its result ([`TeardownReport::ok`] when
    /// every room finished in time and every resource was released).
    pub async fn shutdown(self) -> TeardownReport {
        use crate::teardown::TeardownPhase as Phase;
        let rt = tokio::runtime::Handle::current();
        let plan = Teardown::new();
        let (state, admitting) = (self.state.clone(), self.service.admitting.clone());
        plan.register(
            Phase::StopAdmission,
            "readiness 503, no new rooms",
            move || {
                state.begin_drain();
                admitting.store(false, Ordering::SeqCst);
                Ok(())
            },
        );
        let deadline = Instant::now() + self.grace;
        let node = self.node.clone();
        plan.register(
            Phase::DrainRooms,
            "running rooms finish until the grace deadline",
            move || {
                tracing::info!(rooms = node.rooms_held(), "draining prefill");
                while node.rooms_held() > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                match node.rooms_held() {
                    0 => Ok(()),
                    n => Err(format!("{n} rooms still held at the grace deadline")),
                }
            },
        );
        if let Some(group) = self.group.clone() {
            plan.register(
                Phase::DrainRooms,
                "a CP rank other than the leader serves its leader's steps until the leader leaves",
                move || {
                    if group.drain_member(deadline) {
                        Ok(())
                    } else {
                        Err("the group's leader was still there at the grace deadline".into())
                    }
                },
            );
        }
        let (cache, layout) = (self.cache.clone(), self.layout);
        let tiers = self.seat.as_ref().and_then(|s| s.tiers.clone());
        plan.register(
            Phase::DrainRooms,
            "L2 flushed to L3 (write-back)",
            move || {
                let flush_deadline = Instant::now() + Duration::from_secs(10);
                let flushed = match tiers {
                    Some(t) => t.flush(flush_deadline),
                    None => cache.flush(layout),
                };
                if flushed > 0 {
                    tracing::info!(flushed, "L2 flushed to L3 (write-back)");
                }
                Ok(())
            },
        );
        let t = self.transport.clone();
        plan.register(
            Phase::FreeTransferHandles,
            "the transport's writes conclude",
            move || {
                let report = t.drain(deadline.max(Instant::now() + Duration::from_secs(1)));
                if report.quiescent() {
                    Ok(())
                } else {
                    Err("writes still in flight at the drain deadline".into())
                }
            },
        );
        let (t, snapshots) = (self.transport.clone(), self.service.snapshots.clone());
        plan.register(
            Phase::DestroyTransports,
            "the KV transport and the snapshot receiver close",
            move || {
                t.shutdown();
                if let Some(s) = snapshots {
                    s.shutdown();
                }
                Ok(())
            },
        );
        if let Some(seat) = self.seat {
            let seat: seat::HeldSeat<_> = Arc::new(std::sync::Mutex::new(Some(seat)));
            let held = seat.clone();
            plan.register(
                Phase::DestroyTransports,
                "the engine detaches; the engine API stops",
                move || {
                    let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(s) = held.as_mut() {
                        rt.block_on(s.stop_engine());
                    }
                    Ok(())
                },
            );
            seat::register_release(&plan, seat, seat::Seat::release);
        }
        let report = plan.run_blocking().await;
        self.grpc.abort();
        self.http.abort();
        tracing::info!(clean = report.ok(), "prefill stopped");
        report
    }
}
