//! `tandem-worker decode --config`: the decode serving process (worker/interfaces/README.md §2, §3).
//!
//! Owns the KV receive region (data port), the same-revision prefill [`PeerSet`], and the front
//! door; the per-request path (peers, rooms, the KV deadline, retries, simulated decoding and the
//! speculative-decoding guard of contract 8) is [`engine`].
//!
//! `/report` adds `routing` (the policy in use, [`DecodeOptions::routing`]), `peers`, `refused_peers`, `kv_pages` `{free, held, quarantined}` (pages of the
//! receive region) and `spec_guard` `{enabled, anomalies_by_reason}` to worker/interfaces/README.md §4.
//!
//! Readiness: ready only while at least one same-revision prefill peer is connected; `/report`
//! says why not otherwise. Drain (SIGTERM): readiness 503 at once, new requests 503, in-flight
//! requests finish until the grace deadline.
//!
//! - [`node`]: the KV region, its TCP receiver, rooms on prefill peers and the release gate
//!   (contract 3);
//! - [`peers`]: the same-revision prefill peer set;
//! - [`engine`]: what the front door calls per request;
//! - [`front_door`]: the OpenAI-compatible HTTP API;
//! - [`engine_seat`], [`via_engine`], [`node::engine_rooms`]: with `config.engine`, the engine beside
//!   the worker decodes (DESIGN §3.1): the pools are allocated and registered at start, the worker
//!   is not ready until an engine attached, and every admitted request is handed to that engine;
//!   without it, the built-in simulated engine of [`engine`] decodes, as before (`/report` says
//!   `"engine": {"kind": "builtin"}`);
//! - here: the CLI ([`Args`], [`run`]) and the server that wires them ([`DecodeServer`]).

pub mod engine;
pub mod engine_seat;
pub mod front_door;
pub mod node;
pub mod own_api;
pub mod peers;
pub mod routing;
pub mod snapshot_push;
pub mod via_engine;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::resolve::Resolver;
use super::sim::{SimKnobs, region_pages};
use super::{RoleError, ServeError, load_worker_config, pod_ip, signals};
use crate::config::EngineKind;
use crate::config::WorkerConfig;
use crate::control::KvLayout;
use crate::health::counters::mirror;
use crate::health::http::{ServeState, router, spawn_http};
use crate::l3::replicas::BookConfig;
use crate::release::receiver::GateMode;
use crate::roles::prefill::seat::TierSeat;
use crate::spec_guard::AnomalyReason;
use crate::teardown::{Teardown, TeardownReport};
use engine::DecodeEngine;
use node::{DecodeConfig, DecodeNode};
use peers::{PeerSet, PeerTarget};

/// `tandem-worker decode` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The resolved worker config (`/etc/tandem/worker.json` in a pod; read through
    /// `$TANDEM_ROOT`): the front door, the peer set and the health port. The simulation knobs
    /// come from `TANDEM_SIM_*` (see `roles::sim`), the options of [`DecodeOptions::from_env`]
    /// from the environment.
    #[arg(long, env = "TANDEM_WORKER_CONFIG")]
    pub config: std::path::PathBuf,
}

/// Runs the pool's decode server until SIGTERM/SIGINT, then drains and exits 0. Prints
/// `listening on ADDR` (the front door) once serving. When the engine seat's pools are refused
/// ([`ServeError::Pools`]) it serves nothing and holds the refusal on the health port
/// ([`super::refusal::hold`]) until SIGTERM.
///
/// # Errors
/// [`RoleError::Failed`] when the config or a knob is invalid, the runtime or the signal handlers
/// cannot start, or a port cannot be bound.
pub fn run(args: Args) -> Result<(), RoleError> {
    let cfg = load_worker_config(&args.config)?;
    super::check_role(&cfg, crate::config::WorkerRole::Decode)?;
    let knobs = SimKnobs::from_env().map_err(|e| RoleError::Failed(e.to_string()))?;
    super::runtime()?.block_on(async move {
        let stop = signals::terminated()
            .map_err(|e| RoleError::Failed(format!("signal handlers: {e}")))?;
        let mut opts = DecodeOptions::from_env();
        (opts.kv_deadline, opts.kv_deadline_per_token) =
            kv_deadline_of(&cfg, |k| std::env::var(k).ok());
        if let Ok(v) = std::env::var("TANDEM_DECODE_GATE_PROOF") {
            opts.gate_proof = GateProof::parse(&v).map_err(RoleError::Failed)?;
        }
        if let Ok(v) = std::env::var(routing::ROUTING_ENV) {
            opts.routing = routing::Routing::parse(&v).map_err(RoleError::Failed)?;
        }
        let server = match DecodeServer::start(&cfg, knobs, opts).await {
            Ok(s) => s,
            // Fail closed, visibly: not Ready, the typed refusal in /readyz, /report, /metrics.
            Err(ServeError::Pools(e)) => {
                return super::refusal::hold(&cfg, "decode", &e, stop).await;
            }
            Err(e) => return Err(RoleError::Failed(e.to_string())),
        };
        println!("listening on {}", server.front_addr);
        let signal = stop.await;
        tracing::info!(signal, "stopping decode");
        super::print_teardown(&server.shutdown().await);
        Ok(())
    })
}

/// Process-level options (the config decides the rest).
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    /// Address to bind (default `$POD_IP`, else 0.0.0.0).
    pub bind_ip: IpAddr,
    /// Worker id (default `$POD_NAME`).
    pub worker_id: String,
    /// Deadline for a request's KV; past it the room aborts through the release protocol.
    pub kv_deadline: Duration,
    /// Added to `kv_deadline` per prompt token (default zero; see `DecodeEngine`).
    pub kv_deadline_per_token: Duration,
    /// Retries on another prefill peer after a peer failure.
    pub retry_budget: u32,
    /// Requests admitted at once; beyond, 429.
    pub max_inflight: usize,
    /// Peer set refresh interval.
    pub refresh_every: Duration,
    /// Heartbeat interval on each prefill link (3 missed = peer dead).
    pub heartbeat: Duration,
    /// Grace for in-flight requests at drain.
    pub drain_grace: Duration,
    /// Control port of the prefill peers (default: this config's `ports.control`, the pools'
    /// common port).
    pub peer_port: Option<u16>,
    /// What the release gate accepts as proof that no write of an aborted room can still land
    /// (DESIGN contract 3, seed 004).
    pub gate_proof: GateProof,
    /// Deadline of every request from admission to its last token (issue 18 item 2): past it the
    /// request ends with 504 `request_deadline_exceeded` (a stream: that error as its last event)
    /// and its pages go to the release gate. `TANDEM_DECODE_REQUEST_DEADLINE_MS`, default 300000
    /// (5 min: above the KV deadline plus the longest simulated decode of `MAX_TOKENS_LIMIT` at
    /// 1 ms per token).
    pub request_deadline: Duration,
    /// Snapshot sync of finished turns (DESIGN contract 4, issue 15): `TANDEM_DECODE_SNAPSHOT_SYNC`
    /// `on` (default) or `off`. On, a turn that names `session_kv_hashes` is pushed to the prefill
    /// of its next turn ([`snapshot_push`]).
    pub snapshot_sync: bool,
    /// Most bytes of engine session pages (SyncSession) held at once:
    /// `TANDEM_DECODE_SNAPSHOT_SYNC_BUDGET_BYTES`, default
    /// [`snapshot_push::SYNC_BUDGET_BYTES`].
    pub snapshot_sync_budget: u64,
    /// How rooms are spread over the prefill peers (issue 16 item 2): `TANDEM_DECODE_ROUTING`
    /// `least-work` (default: the peer with the fewest blocks to compute before the request's KV
    /// is ready, its prefix counted), `affinity` (prefix affinity within
    /// [`routing::DEFAULT_MAX_SKEW`] rooms of the least-loaded peer), `affinity:SKEW` or
    /// `round-robin`; read by [`run`], which refuses a bad
    /// value. `/report` shows it as `routing`.
    pub routing: routing::Routing,
}

/// The release gate's proof rule for an aborted room's pages (DESIGN contract 3, seed 004).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GateProof {
    /// The TCP receiver's fence (writes of a fenced room are refused on arrival) or the prefill's
    /// ack, whichever comes first — the default over TCP.
    #[default]
    Fence,
    /// The prefill's ack (or the peer's transport torn down) only: the rule RDMA needs, because a
    /// posted one-sided write lands whatever the receiver's state. Selectable over TCP so that the
    /// ack path runs in the demo and the live tests (`TANDEM_DECODE_GATE_PROOF=ack-only`).
    AckOnly,
}

impl GateProof {
    /// Parses `fence` or `ack-only`.
    ///
    /// # Errors
    /// The unknown value, named.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "fence" => Ok(Self::Fence),
            "ack-only" => Ok(Self::AckOnly),
            other => Err(format!(
                "TANDEM_DECODE_GATE_PROOF={other:?}: expected \"fence\" or \"ack-only\""
            )),
        }
    }

    /// Lower-case name for `/report` and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fence => "fence",
            Self::AckOnly => "ack-only",
        }
    }
}

/// Default fixed part of a room's KV deadline when neither the config (`kvDeadline`) nor the
/// environment sets one.
pub const DEFAULT_KV_DEADLINE: Duration = Duration::from_secs(30);

/// A room's KV deadline `(fixed part, per prompt token)`: `TANDEM_DECODE_KV_DEADLINE_MS` and
/// `TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN` when set (each overrides its half; the process tests'
/// and the demo's knob), else the config's `kvDeadline` (the DecodePool's
/// `spec.prefill.kvDeadline`, seed 004's prefill queueing deadline), else
/// [`DEFAULT_KV_DEADLINE`] and zero. `env` looks a variable up (a closure so it is testable).
pub fn kv_deadline_of(
    cfg: &WorkerConfig,
    env: impl Fn(&str) -> Option<String>,
) -> (Duration, Duration) {
    let num = |k: &str| env(k).and_then(|v| v.trim().parse::<u64>().ok());
    let from_cfg = cfg
        .kv_deadline
        .map_or((DEFAULT_KV_DEADLINE, Duration::ZERO), |d| {
            (
                Duration::from_millis(d.milliseconds),
                Duration::from_micros(d.per_token_microseconds),
            )
        });
    (
        num("TANDEM_DECODE_KV_DEADLINE_MS").map_or(from_cfg.0, Duration::from_millis),
        num("TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN").map_or(from_cfg.1, Duration::from_micros),
    )
}

impl DecodeOptions {
    /// Options from the pod environment: `$POD_IP`, `$POD_NAME`, and the optional overrides
    /// `TANDEM_DECODE_RETRY_BUDGET` (default 2), `TANDEM_DECODE_KV_DEADLINE_MS` (default
    /// 30000) and `TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN` (default 0); the rest as documented on
    /// the fields. [`run`] then takes the KV deadline from the config where the environment does
    /// not set it ([`kv_deadline_of`]). `TANDEM_DECODE_GATE_PROOF` (`fence` | `ack-only`) and
    /// `TANDEM_DECODE_ROUTING` are read by [`run`], which refuses a bad value.
    pub fn from_env() -> Self {
        let num = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Self {
            bind_ip: pod_ip(),
            worker_id: std::env::var("POD_NAME").unwrap_or_else(|_| "decode-0".into()),
            kv_deadline: Duration::from_millis(
                num("TANDEM_DECODE_KV_DEADLINE_MS").unwrap_or(30_000),
            ),
            kv_deadline_per_token: Duration::from_micros(
                num("TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN").unwrap_or(0),
            ),
            retry_budget: num("TANDEM_DECODE_RETRY_BUDGET")
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(2),
            max_inflight: 256,
            refresh_every: Duration::from_secs(2),
            heartbeat: Duration::from_millis(500),
            drain_grace: super::drain_grace_from_env(),
            peer_port: None,
            gate_proof: GateProof::default(),
            request_deadline: Duration::from_millis(
                num("TANDEM_DECODE_REQUEST_DEADLINE_MS").unwrap_or(300_000),
            ),
            snapshot_sync: std::env::var("TANDEM_DECODE_SNAPSHOT_SYNC")
                .map_or(true, |v| v.trim() != "off"),
            snapshot_sync_budget: num("TANDEM_DECODE_SNAPSHOT_SYNC_BUDGET_BYTES")
                .unwrap_or(snapshot_push::SYNC_BUDGET_BYTES),
            routing: routing::Routing::default(),
        }
    }
}

/// A running decode server.
pub struct DecodeServer {
    /// Serving state.
    pub state: Arc<ServeState>,
    /// The engine behind the front door.
    pub engine: Arc<DecodeEngine>,
    /// Front door address.
    pub front_addr: SocketAddr,
    /// Health address.
    pub health_addr: SocketAddr,
    /// KV data address.
    pub data_addr: String,
    /// The health port's server (stopped last: readiness says "draining" until the end).
    http: tokio::task::JoinHandle<()>,
    /// The front door and the peer refresh.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    grace: Duration,
    seat: Option<engine_seat::DecodeSeat>,
}

impl DecodeServer {
    /// Starts the receiver, the peer refresh, the front door and the health port.
    ///
    /// # Errors
    /// [`ServeError`] on a missing `peers.prefillService` or `ports.frontDoor`, or a bind failure.
    pub async fn start(
        cfg: &WorkerConfig,
        knobs: SimKnobs,
        opts: DecodeOptions,
    ) -> Result<Self, ServeError> {
        let service = cfg
            .peers
            .prefill_service
            .clone()
            .ok_or_else(|| ServeError::Config("decode needs peers.prefillService".into()))?;
        let front_port = cfg
            .ports
            .front_door
            .ok_or_else(|| ServeError::Config("decode needs ports.frontDoor".into()))?;
        let engine_metrics = crate::roles::prefill::seat::EngineMetrics::default();
        let decode_metrics = engine_seat::DecodeEngineMetrics::default();
        let l3_metrics = crate::roles::prefill::l3_report::L3Metrics::default();
        let state = ServeState::with_metrics(
            "decode",
            &cfg.pool,
            &cfg.revision,
            "connecting to prefill peers",
            |r| {
                if cfg.engine.is_some() {
                    engine_metrics.register_common(r);
                    decode_metrics.register(r);
                }
                if serves_tiers(cfg) {
                    l3_metrics.register(r);
                }
            },
        );
        let transport = super::apply_transport(cfg.transport, &state);
        super::config_use::apply(cfg, &state);
        state.set_section(
            "release_gate",
            serde_json::json!({"proof": opts.gate_proof.as_str()}),
        );
        // The room deadline in use (seed 004's prefill queueing deadline when the pool sets one).
        state.set_section(
            "kv_deadline",
            serde_json::json!({
                "milliseconds": u64::try_from(opts.kv_deadline.as_millis()).unwrap_or(u64::MAX),
                "per_token_microseconds":
                    u64::try_from(opts.kv_deadline_per_token.as_micros()).unwrap_or(u64::MAX),
            }),
        );
        tracing::info!(
            proof = opts.gate_proof.as_str(),
            "release gate: an aborted room's pages return after this proof"
        );
        // With an engine the KV lands in the engine's pool, whose rows follow the same knobs.
        let (layout, target_token_bytes) = match &cfg.engine {
            None => (knobs.layout(cfg), None),
            Some(_) => crate::roles::prefill::seat::engine_layout(cfg, &knobs)?,
        };
        if opts.bind_ip.is_unspecified() {
            tracing::warn!(
                "POD_IP is not set: the KV receiver advertises an unspecified address, which only \
                 a prefill on this host can reach"
            );
        }
        // Issue 18: this process's incarnation (0 only under the negative control).
        let incarnation = if crate::control::incarnation_ignored() {
            tracing::warn!("negative control: no incarnation, peers' incarnations ignored");
            0
        } else {
            crate::control::new_incarnation()
        };
        let node = DecodeNode::start_incarnation(
            DecodeConfig {
                worker_id: opts.worker_id.clone(),
                rank: crate::roles::ordinal_from_env(),
                // With an engine the built-in region holds nothing: the engine's pool receives
                // the KV.
                pages: if cfg.engine.is_some() {
                    0
                } else {
                    region_pages(cfg.memory.target_pool_bytes, layout)
                },
                layout,
                data_bind: SocketAddr::new(opts.bind_ip, cfg.ports.data).to_string(),
                ack_timeout: Duration::from_secs(30),
                heartbeat: opts.heartbeat,
                // The gate's proof rule follows the transport in use (the fence proves nothing
                // under RDMA) and the configured proof (ack-only runs the path RDMA needs, over
                // TCP too).
                fence_is_proof: opts.gate_proof == GateProof::Fence
                    && transport
                        .in_use
                        .is_some_and(crate::transfer::select::receiver_fence_is_proof),
                gate: GateMode::Safe,
            },
            incarnation,
        )?;
        // Negative control of the abandoned-request tests only (feature `negative-controls`):
        // `TANDEM_NEGATIVE_LEAK_ON_DROP=1` brings back the leak of issue 19.
        #[cfg(feature = "negative-controls")]
        if std::env::var("TANDEM_NEGATIVE_LEAK_ON_DROP").as_deref() == Ok("1") {
            tracing::warn!("negative control: abandoned rooms are not released");
            node.leak_abandoned_rooms(true);
        }
        let peers = PeerSet::new(
            node.clone(),
            PeerTarget {
                service: service.clone(),
                port: opts.peer_port.unwrap_or(cfg.ports.control),
                revision: cfg.revision.clone(),
                connect_timeout: Duration::from_secs(2),
            },
            Resolver::from_env(),
            state.counters.clone(),
            opts.routing,
        );
        state.set_section("routing", opts.routing.report());
        tracing::info!(routing = %opts.routing, "prefill peers chosen by this routing policy");
        let spec_guard = match (&cfg.speculative, &cfg.spec_guard) {
            (Some(_), Some(g)) => Some(g.clone()),
            (None, Some(_)) => {
                tracing::warn!("specGuard is set without speculative decoding: nothing to guard");
                None
            }
            (_, None) => None,
        };
        if cfg.speculative.is_some() && spec_guard.is_none() {
            tracing::warn!(
                "speculative decoding without specGuard: corrupt KV state goes undetected \
                 (DESIGN contract 8)"
            );
        }
        // Readiness while an engine (if any) is attached: a live same-revision peer, no stranded page.
        let kv_deadline = opts.kv_deadline;
        let (p, n) = (peers.clone(), node.clone());
        let own_api_engine = cfg.engine.as_ref().and_then(|e| {
            let (kind, style) = match e.kind {
                EngineKind::Simulated => return None,
                EngineKind::SgLang => ("SGLang", own_api::HandOffStyle::SgLang),
                EngineKind::Vllm => ("vLLM", own_api::HandOffStyle::Vllm),
            };
            Some(own_api::OwnApiEngine {
                kind,
                style,
                addr: std::net::SocketAddr::from(([127, 0, 0, 1], e.http_port())),
                hands_off: !serves_tiers(cfg),
            })
        });
        let ready_now: Arc<dyn Fn() -> Result<(), String> + Send + Sync> =
            if own_api_engine.is_some_and(|o| !o.hands_off) {
                // An SGLang or vLLM decode serving the tier calls serves whole requests on its own
                // API (the Service targets it) and takes no KV from the prefills: its readiness is
                // the attach alone, so that a PrefillPool rollout or outage does not empty the
                // DecodePool's endpoints. A decode the front door hands requests to needs a live
                // prefill, as the Simulated engine's.
                Arc::new(|| Ok(()))
            } else {
                Arc::new(move || {
                    engine::readiness(p.live(), n.stranded(kv_deadline), kv_deadline, || {
                        p.not_ready_reason()
                    })
                })
            };
        let rank = crate::roles::ordinal_from_env();
        let seat = match &cfg.engine {
            Some(e) => Some(engine_seat::DecodeSeat::start(
                cfg,
                e,
                &node,
                &state,
                rank,
                (&engine_metrics, &decode_metrics),
                layout,
                target_token_bytes,
                ready_now.clone(),
                engine_tiers(cfg, rank, layout, &state, l3_metrics),
            )?),
            None => None,
        };
        let engine = Arc::new(DecodeEngine {
            state: state.clone(),
            model: cfg.model.name.clone(),
            revision: cfg.revision.clone(),
            worker_id: opts.worker_id.clone(),
            knobs,
            node: node.clone(),
            peers: peers.clone(),
            inflight: Arc::new(Semaphore::new(opts.max_inflight.max(1))),
            max_inflight: opts.max_inflight.max(1),
            draft_tokens: cfg.speculative.as_ref().map(|s| s.draft_tokens.max(1)),
            spec_guard,
            kv_deadline: opts.kv_deadline,
            kv_deadline_per_token: opts.kv_deadline_per_token,
            retry_budget: opts.retry_budget,
            next_request: AtomicU64::new(1),
            request_deadline: opts.request_deadline,
            deadline_tally: Arc::default(),
            engine_rooms: seat.as_ref().map(|s| s.rooms.clone()),
            own_api_engine,
            snapshots: opts.snapshot_sync.then(|| {
                snapshot_push::SnapshotPush::new(
                    peers.clone(),
                    layout,
                    opts.snapshot_sync_budget,
                    &opts.worker_id,
                    node.incarnation(),
                    state.counters.clone(),
                )
            }),
        });
        // Snapshot sync through the engine API (contract 4): an engine decoding DecodeWork hands
        // its finished turns' session KV over with SyncSession.
        if let (Some(push), Some(rooms)) = (&engine.snapshots, &engine.engine_rooms) {
            rooms.set_snapshots(push.clone());
        }
        let n = node.clone();
        state.on_refresh(move |s| {
            let c = &s.counters;
            mirror(&c.abort_acks, n.acks_received());
            mirror(&c.pages_quarantined, n.pages().quarantined as u64);
        });
        let p = peers.clone();
        let (st, guarded, n) = (state.clone(), engine.spec_guard_enabled(), node.clone());
        let kv_deadline = opts.kv_deadline;
        let tally = engine.deadline_tally.clone();
        let seat_report: Arc<dyn Fn() -> serde_json::Value + Send + Sync> = match &seat {
            Some(s) => {
                let (api, rooms, kind) = (s.seat.api.clone(), s.rooms.clone(), s.seat.kind);
                let (reg, dir) = (s.seat.registration.clone(), s.seat.socket_dir.clone());
                let tiers = s.seat.tiers.clone();
                Arc::new(move || {
                    engine_seat::report_of(kind, &api, &rooms, &reg, &dir, tiers.as_deref())
                })
            }
            None => Arc::new(|| crate::roles::prefill::seat::report(None, None)),
        };
        state.set_extra(move || {
            let mut m = serde_json::Map::new();
            m.insert("engine".into(), seat_report());
            let pages = n.pages();
            let stranded = n.stranded(kv_deadline);
            m.insert(
                "kv_pages".into(),
                serde_json::json!({"free": pages.free, "held": pages.held,
                    "quarantined": pages.quarantined, "total": n.total_pages(),
                    "stranded": stranded.pages}),
            );
            let t = n.tally();
            m.insert(
                "rooms".into(),
                serde_json::json!({"opened": t.opened, "released": t.released,
                    "quarantined": t.quarantined, "abandoned": t.abandoned,
                    "freed_on_ack": t.freed_on_ack,
                    "freed_on_transport": t.freed_on_transport}),
            );
            let cancelled: serde_json::Map<String, serde_json::Value> = engine::Stage::ALL
                .iter()
                .map(|s| {
                    let n = st.by_reason.requests_cancelled_of(s.code());
                    (s.code().to_owned(), serde_json::json!(n))
                })
                .collect();
            m.insert("requests_cancelled_by_reason".into(), cancelled.into());
            let expired: serde_json::Map<String, serde_json::Value> = engine::Stage::ALL
                .iter()
                .map(|s| (s.code().to_owned(), serde_json::json!(tally.of(*s))))
                .collect();
            m.insert("requests_deadline_exceeded".into(), expired.into());
            m.insert("peers".into(), serde_json::json!(p.addrs()));
            m.insert("incarnation".into(), serde_json::json!(n.incarnation()));
            m.insert(
                "peer_incarnations".into(),
                serde_json::json!(p.incarnations()),
            );
            m.insert("peer_restarts".into(), serde_json::json!(n.peer_restarts()));
            m.insert("refused_peers".into(), serde_json::json!(p.refused()));
            m.insert(
                "group_member_peers".into(),
                serde_json::json!(p.group_members()),
            );
            let by_reason: serde_json::Map<String, serde_json::Value> = AnomalyReason::ALL
                .iter()
                .map(|r| {
                    let n = st.by_reason.spec_guard_anomalies_of(r.code());
                    (r.code().to_owned(), serde_json::json!(n))
                })
                .collect();
            m.insert(
                "spec_guard".into(),
                serde_json::json!({"enabled": guarded, "anomalies_by_reason": by_reason}),
            );
            m
        });
        let (health_addr, http) = spawn_http(
            SocketAddr::new(opts.bind_ip, cfg.ports.health),
            router(state.clone()),
        )
        .await
        .map_err(|e| ServeError::Bind("health", e))?;
        let (front_addr, front) = spawn_http(
            SocketAddr::new(opts.bind_ip, front_port),
            front_door::router(engine.clone()),
        )
        .await
        .map_err(|e| ServeError::Bind("front door", e))?;
        let (st, n) = (state.clone(), node.clone());
        let attached = seat.as_ref().map(|s| s.seat.api.clone());
        let refresh = peers.spawn_refresh(opts.refresh_every, move |_live| {
            let stranded = n.stranded(kv_deadline);
            if stranded.pages > 0 {
                st.health.degrade(
                    "kv_pages",
                    "KvPagesStranded",
                    engine::stranded_reason(stranded, kv_deadline),
                );
            } else {
                st.health.recover("kv_pages");
            }
            if attached
                .as_ref()
                .is_some_and(|a| a.current_attach().is_none())
            {
                st.set_ready(Err(crate::roles::prefill::seat::NOT_ATTACHED.into()));
            } else {
                st.set_ready(ready_now());
            }
        });
        tracing::info!(%front_addr, %health_addr, data = %node.data_addr(), %service, revision = %cfg.revision, ?layout, "decode serving");
        Ok(Self {
            state,
            engine,
            front_addr,
            health_addr,
            data_addr: node.data_addr(),
            http,
            tasks: vec![front, refresh],
            grace: opts.drain_grace,
            seat,
        })
    }

    /// Drains and stops through the ordered teardown of DESIGN contract 9
    /// ([`crate::teardown::Teardown`]): readiness 503 and new requests refused at once
    /// (StopAdmission); in-flight requests finish until the grace deadline, then the engine
    /// detaches and the requests still in flight end as its rooms fail (DrainRooms); the engine's
    /// target pool leaves the KV receiver (Deregister); the front door and the prefill links stop
    /// (DestroyTransports); the pools are deregistered from the store client and freed with the
    /// allocator that made them (FreeMemory). A failing step is recorded and the later ones still
    /// run. The health port stops last.
    ///
    /// Returns the report: every step, in order, with its result ([`TeardownReport::ok`] when
    /// every request finished in time and every resource was released).
    pub async fn shutdown(self) -> TeardownReport {
        use crate::teardown::TeardownPhase as Phase;
        let rt = tokio::runtime::Handle::current();
        let plan = Teardown::new();
        let state = self.state.clone();
        plan.register(
            Phase::StopAdmission,
            "readiness 503, new requests refused",
            move || {
                state.begin_drain();
                Ok(())
            },
        );
        let (e, deadline) = (self.engine.clone(), Instant::now() + self.grace);
        plan.register(
            Phase::DrainRooms,
            "in-flight requests finish until the grace deadline",
            move || {
                let in_flight = || e.max_inflight - e.inflight.available_permits();
                tracing::info!(in_flight = in_flight(), "draining decode");
                while in_flight() > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                match in_flight() {
                    0 => Ok(()),
                    n => Err(format!("{n} requests in flight at the grace deadline")),
                }
            },
        );
        let tasks = self.tasks;
        plan.register(
            Phase::DestroyTransports,
            "the front door and the prefill links stop",
            move || {
                for t in &tasks {
                    t.abort();
                }
                Ok(())
            },
        );
        if let Some(seat) = self.seat {
            let tiers = seat.seat.tiers.clone();
            let seat: crate::roles::prefill::seat::HeldSeat<_> =
                Arc::new(std::sync::Mutex::new(Some(seat)));
            let (held, e) = (seat.clone(), self.engine.clone());
            plan.register(
                Phase::DrainRooms,
                "the engine detaches; requests still in flight end",
                move || {
                    let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(s) = held.as_mut() {
                        rt.block_on(s.stop_engine());
                    }
                    // The attach's end fails the rooms those requests wait on: they answer and
                    // drop what they hold of the pools (bounded).
                    let until = Instant::now() + Duration::from_secs(5);
                    let in_flight = || e.max_inflight - e.inflight.available_permits();
                    while in_flight() > 0 && Instant::now() < until {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    match in_flight() {
                        0 => Ok(()),
                        n => Err(format!(
                            "{n} requests still in flight 5 s after the engine left"
                        )),
                    }
                },
            );
            // Once the engine left, the tier calls' L2 (beside SGLang or vLLM) is flushed to L3
            // under write-back, as a prefill's (the background writer stops first;
            // write-through: nothing to do).
            if let Some(tiers) = tiers {
                plan.register(
                    Phase::DrainRooms,
                    "L2 flushed to L3 (write-back)",
                    move || {
                        let flushed = tiers.flush(Instant::now() + Duration::from_secs(10));
                        if flushed > 0 {
                            tracing::info!(flushed, "L2 flushed to L3 (write-back)");
                        }
                        Ok(())
                    },
                );
            }
            let held = seat.clone();
            plan.register(
                Phase::Deregister,
                "the engine's target pool leaves the KV receiver",
                move || {
                    let held = held.lock().unwrap_or_else(|p| p.into_inner());
                    match held.as_ref().map(|s| s.rooms.unbind()) {
                        Some(false) => {
                            Err("the target pool was not registered on the receiver".into())
                        }
                        _ => Ok(()),
                    }
                },
            );
            crate::roles::prefill::seat::register_release(
                &plan,
                seat,
                engine_seat::DecodeSeat::release,
            );
        }
        let report = plan.run_blocking().await;
        self.http.abort();
        tracing::info!(clean = report.ok(), "decode stopped");
        report
    }
}

/// Whether a decode worker with this config serves the engine API's tier calls: beside an SGLang
/// or vLLM engine with a CacheTier. Those engines take no rooms through the engine API on the
/// decode (their requests come to their own HTTP port), so their pool is theirs alone and the
/// tier calls may use any of its pages; the Simulated engine Reserves pages for rooms from the
/// same pool, and does not use the tier calls on the decode (they answer `TIER_UNAVAILABLE`).
pub fn serves_tiers(cfg: &WorkerConfig) -> bool {
    cfg.cache.is_some()
        && cfg
            .engine
            .as_ref()
            .is_some_and(|e| matches!(e.kind, EngineKind::SgLang | EngineKind::Vllm))
}

/// The tier calls' L2/L3 of a decode worker that [`serves_tiers`]: the same tier cache as a
/// prefill's (`roles::prefill::tier_cache`: L2 of `memory.targetPoolBytes` of pages, the L3
/// replicas of this rank's shard), without the prefill's restart loadback into L2.
fn engine_tiers(
    cfg: &WorkerConfig,
    rank: u32,
    layout: KvLayout,
    state: &Arc<ServeState>,
    l3_metrics: crate::roles::prefill::l3_report::L3Metrics,
) -> Option<Box<TierSeat>> {
    if !serves_tiers(cfg) {
        return None;
    }
    let pages = usize::try_from(cfg.memory.target_pool_bytes / layout.page_bytes().max(1))
        .unwrap_or(usize::MAX);
    let cache = crate::roles::prefill::tier_cache(
        cfg,
        rank,
        pages,
        Duration::ZERO,
        state,
        BookConfig::default(),
        l3_metrics,
    );
    Some(Box::new(TierSeat {
        cache,
        l2_pages: pages,
        layout,
        counters: state.counters.clone(),
        admitting: Arc::new(std::sync::atomic::AtomicBool::new(true)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KvDeadline;

    /// The config's `kvDeadline` is the room deadline unless the environment overrides a half.
    #[test]
    fn the_kv_deadline_comes_from_the_config_unless_the_environment_overrides_it() {
        let text = include_str!("../../../interfaces/samples/decode-worker.json");
        let mut c: WorkerConfig = serde_json::from_str(text).unwrap();
        assert_eq!(
            kv_deadline_of(&c, |_| None),
            (DEFAULT_KV_DEADLINE, Duration::ZERO)
        );
        c.kv_deadline = Some(KvDeadline {
            milliseconds: 3_000,
            per_token_microseconds: 50,
        });
        assert_eq!(
            kv_deadline_of(&c, |_| None),
            (Duration::from_millis(3_000), Duration::from_micros(50))
        );
        let env = |k: &str| (k == "TANDEM_DECODE_KV_DEADLINE_MS").then(|| "250".to_owned());
        assert_eq!(
            kv_deadline_of(&c, env),
            (Duration::from_millis(250), Duration::from_micros(50)),
            "the environment overrides its half only"
        );
    }
}
