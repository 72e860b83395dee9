//! The engine seat of a worker whose config names an engine (`config.engine`, DESIGN §3.1): the
//! pools, the engine-API server, readiness that follows the engine's attach, and what `/metrics`
//! and `/report` say about them. The seat is role-agnostic ([`Seat::start_role`]): the decode role
//! uses it too (`roles::decode::engine_seat`), adding its own readiness, metrics and report fields;
//! what follows describes the prefill's.
//!
//! At start the worker allocates every configured pool (target, plus draft and indexer when sized) in
//! the configured allocator domain through [`PoolSet::from_config`] and registers them
//! transactionally with the configured client mode and failure policy (DESIGN contracts 1–2); a
//! failure refuses the start. Then it serves the engine API on `engine.socketDir`. `/readyz` answers
//! 503 `engine not attached` until an engine attached, and again from the moment that attach ends
//! (Detach, or the engine's pools connection closing because it exited or was killed); the attach's
//! open rooms then fail through the sender's release path.
//!
//! `/metrics`: `tandem_engine_pool_bytes{pool,domain}`, `tandem_engine_pool_registered{pool,state}`
//! (1 for the pool's registration state: `none`, `committed` or `fallback_l2`), the registration
//! counters of [`RegistrationMetrics`], `tandem_engine_attached` (0/1), `tandem_engine_attaches`,
//! `tandem_engine_rooms_{submitted,sent,failed}`, `tandem_engine_writes`,
//! `tandem_engine_source_pages_held`, and for the tier calls ([`HostTiers`])
//! `tandem_engine_load_{waits,failed,read_before_ready,pages_from_l3}`,
//! `tandem_engine_load_{pages,bytes}{tier}`, `tandem_engine_store_pages`. `/report` carries the same
//! under `engine` (the tier figures under `engine.tiers`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use super::node::PrefillNode;
use super::prefix_cache::PrefixCache;
use super::tiers::{HostTiers, TierStats};
use crate::config::{EngineKind, EngineSeat, WorkerConfig, WorkerRole, resolve_path};
use crate::control::KvLayout;
use crate::engine_api::decode::KvSource;
use crate::engine_api::pools::{PoolSet, Registration, roles_configured};
use crate::engine_api::server::{self, RunningServer};
use crate::engine_api::service::{Backend, EngineApi};
use crate::engine_api::{DEFAULT_PAGE_TOKENS, EngineApiConfig};
use crate::health::Health;
use crate::health::counters::{Counters, mirror};
use crate::health::http::ServeState;
use crate::memory::pool::PoolRole;
use crate::registration::metrics::{RegistrationMetrics, RoleLabel};
use crate::roles::ServeError;
use crate::roles::store_client::SIDECAR_SOCKET;

type Labels = Vec<(String, String)>;

/// The readiness reason while no engine is attached.
pub const NOT_ATTACHED: &str = "engine not attached";

/// The readiness reason while the restart loadback runs.
pub const LOADING_BACK: &str = "loading back hot prefixes from L3";

/// The engine seat's metrics; cheap to clone (clones share their values).
#[derive(Debug, Clone, Default)]
pub struct EngineMetrics {
    /// Bytes of each pool's mapping, by pool and allocator domain.
    pub pool_bytes: Family<Labels, Gauge>,
    /// 1 for each pool's registration state (`none`, `committed`, `fallback_l2`).
    pub pool_registered: Family<Labels, Gauge>,
    /// The registration transactions (commits, rollbacks, fallbacks, quarantines) by pool.
    pub registration: RegistrationMetrics,
    /// 1 while an engine is attached.
    pub attached: Gauge,
    /// Attaches so far.
    pub attaches: Counter,
    /// Rooms handed to the engine.
    pub rooms_submitted: Counter,
    /// Rooms the engine produced and the transport delivered.
    pub rooms_sent: Counter,
    /// Rooms that failed on the engine path (aborted, engine gone, deadline, transfer).
    pub rooms_failed: Counter,
    /// PagesReady writes accepted.
    pub writes: Counter,
    /// Source pages the worker holds for in-flight sends.
    pub source_pages_held: Gauge,
    /// Tier calls: `LayerLoaded` events delivered (the waits of the engine's compute).
    pub load_waits: Counter,
    /// Tier calls: pages copied into engine pages, by source tier (`l2`, `l3`).
    pub load_pages: Family<Labels, Counter>,
    /// Tier calls: bytes copied into engine pages, by source tier.
    pub load_bytes: Family<Labels, Counter>,
    /// Tier calls: pages loaded whose bytes came from L3 (fetched, or loaded back at restart).
    pub load_pages_from_l3: Counter,
    /// Tier calls: loads that ended in LoadFailed.
    pub load_failed: Counter,
    /// Tier calls: Stores refused for reading a page a load still writes.
    pub load_read_before_ready: Counter,
    /// Tier calls: pages stored into L2.
    pub store_pages: Counter,
}

impl EngineMetrics {
    /// Registers every metric in `r` (`tandem_engine_*` and the registration counters).
    pub fn register(&self, r: &mut Registry) {
        self.register_common(r);
        self.register_prefill(r);
    }

    /// Registers the metrics of any role's seat: pool bytes and registration, the registration
    /// counters, `tandem_engine_attached` and `tandem_engine_attaches` (a decode seat adds its own).
    pub fn register_common(&self, r: &mut Registry) {
        r.register(
            "tandem_engine_pool_bytes",
            "Bytes of each engine-API pool, by pool and allocator domain",
            self.pool_bytes.clone(),
        );
        r.register(
            "tandem_engine_pool_registered",
            "Registration state of each engine-API pool (1 for the state it is in)",
            self.pool_registered.clone(),
        );
        self.registration.register(r);
        r.register(
            "tandem_engine_attached",
            "1 while an engine is attached",
            self.attached.clone(),
        );
        r.register(
            "tandem_engine_attaches",
            "Engine attaches",
            self.attaches.clone(),
        );
    }

    fn register_prefill(&self, r: &mut Registry) {
        r.register(
            "tandem_engine_rooms_submitted",
            "Rooms handed to the engine",
            self.rooms_submitted.clone(),
        );
        r.register(
            "tandem_engine_rooms_sent",
            "Rooms the engine produced and the transport delivered",
            self.rooms_sent.clone(),
        );
        r.register(
            "tandem_engine_rooms_failed",
            "Rooms failed on the engine path",
            self.rooms_failed.clone(),
        );
        r.register(
            "tandem_engine_writes",
            "PagesReady writes accepted",
            self.writes.clone(),
        );
        r.register(
            "tandem_engine_source_pages_held",
            "Source pages held for in-flight sends",
            self.source_pages_held.clone(),
        );
        r.register(
            "tandem_engine_load_waits",
            "LayerLoaded events delivered to the engine (each gates its read of a loaded layer)",
            self.load_waits.clone(),
        );
        r.register(
            "tandem_engine_load_pages",
            "Pages loaded into engine pages, by source tier",
            self.load_pages.clone(),
        );
        r.register(
            "tandem_engine_load_bytes",
            "Bytes loaded into engine pages, by source tier",
            self.load_bytes.clone(),
        );
        r.register(
            "tandem_engine_load_pages_from_l3",
            "Pages loaded into engine pages whose bytes came from L3",
            self.load_pages_from_l3.clone(),
        );
        r.register(
            "tandem_engine_load_failed",
            "Loads that ended in LoadFailed",
            self.load_failed.clone(),
        );
        r.register(
            "tandem_engine_load_read_before_ready",
            "Stores refused because they read a page a load still writes",
            self.load_read_before_ready.clone(),
        );
        r.register(
            "tandem_engine_store_pages",
            "Pages stored into L2 by the engine",
            self.store_pages.clone(),
        );
    }

    fn mirror_tiers(&self, t: &TierStats) {
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        mirror(&self.load_waits, g(&t.layer_events));
        for (tier, pages, bytes) in [
            ("l2", &t.pages_loaded_l2, &t.bytes_loaded_l2),
            ("l3", &t.pages_loaded_l3, &t.bytes_loaded_l3),
        ] {
            let l = vec![("tier".to_owned(), tier.to_owned())];
            mirror(&self.load_pages.get_or_create(&l), g(pages));
            mirror(&self.load_bytes.get_or_create(&l), g(bytes));
        }
        mirror(&self.load_pages_from_l3, g(&t.pages_loaded_from_l3_bytes));
        mirror(&self.load_failed, g(&t.loads_failed));
        mirror(&self.load_read_before_ready, g(&t.read_before_ready));
        mirror(&self.store_pages, g(&t.pages_stored));
    }
}

/// The KV layout of the engine path: the target pool's geometry — the model's layers and the
/// CacheTier's page size, with rows of the model's bytes per token and layer, or, when the
/// simulation knob `TANDEM_SIM_KV_BYTES_PER_TOKEN` scales KV (`knobs`), the rows the knob implies
/// (the pool is then sized to them: [`EngineApiConfig::target_token_bytes`]). Returns the layout
/// and the pool's row override. The decode side derives its layout from the same knobs, so both
/// agree.
///
/// # Errors
/// [`ServeError::Config`] when the knobs are unset and the model's rows differ from what they
/// imply (tensor parallelism splits a rank's rows; the engine API has no per-rank scaling yet).
pub fn engine_layout(
    cfg: &WorkerConfig,
    knobs: &crate::roles::sim::SimKnobs,
) -> Result<(KvLayout, Option<u64>), ServeError> {
    let builtin = knobs.layout(cfg);
    if knobs.kv_bytes_per_token.is_some() {
        return Ok((builtin, Some(u64::from(builtin.token_bytes))));
    }
    let layout = KvLayout {
        layers: cfg.model.layers,
        page_tokens: cfg
            .cache
            .as_ref()
            .map_or(DEFAULT_PAGE_TOKENS, |c| c.page_tokens),
        token_bytes: u32::try_from(cfg.model.bytes_per_token_layer()).unwrap_or(u32::MAX),
    };
    if layout != builtin {
        return Err(ServeError::Config(format!(
            "with an engine the KV rows are the model's ({layout:?}); the decode side expects \
             {builtin:?}; set TANDEM_SIM_KV_BYTES_PER_TOKEN on both pools to scale them"
        )));
    }
    Ok((layout, None))
}

/// What the seat needs to serve the tier calls: the prefix cache (its L3 access), the L2
/// capacity in pages, the KV layout and the worker's counters.
pub struct TierSeat {
    /// The prefix cache whose replica access reaches L3.
    pub cache: Arc<PrefixCache>,
    /// L2 capacity in pages.
    pub l2_pages: usize,
    /// The KV layout (the target pool's geometry).
    pub layout: KvLayout,
    /// The worker's counters (hit accounting).
    pub counters: Counters,
    /// Cleared while the restart loadback runs (and at drain): an attached engine makes the
    /// worker ready only while it is set.
    pub admitting: Arc<std::sync::atomic::AtomicBool>,
}

/// A running engine seat.
pub struct Seat {
    /// The engine kind the config names.
    pub kind: EngineKind,
    /// The socket directory (resolved through `$TANDEM_ROOT`).
    pub socket_dir: PathBuf,
    /// The engine API.
    pub api: Arc<EngineApi>,
    /// The tier backend (L2 bytes, L3) the engine's Lookup/Load/Store reach (a prefill's; a
    /// decode serves no tier calls).
    pub tiers: Option<Arc<HostTiers>>,
    /// The registration transactions of the seat's pools ([`registration_report`]).
    pub registration: RegistrationMetrics,
    server: RunningServer,
}

/// A seat shared by the teardown steps of its role ([`register_release`]): the engine-detach
/// step uses it, the release step takes it.
pub type HeldSeat<S> = Arc<std::sync::Mutex<Option<S>>>;

/// Registers the FreeMemory step of DESIGN contract 9 for the seat in `held`: `release` (the
/// seat's [`Seat::release`], or its role's wrapper) deregisters and frees the pools; its errors,
/// joined, are the step's error.
pub fn register_release<S: Send + 'static>(
    plan: &crate::teardown::Teardown,
    held: HeldSeat<S>,
    release: fn(S) -> Vec<String>,
) {
    plan.register(
        crate::teardown::TeardownPhase::FreeMemory,
        "the pools deregistered and freed with their allocator",
        move || {
            let taken = held.lock().unwrap_or_else(|p| p.into_inner()).take();
            match taken.map(release).unwrap_or_default().as_slice() {
                [] => Ok(()),
                errors => Err(errors.join("; ")),
            }
        },
    );
}

/// The `/report` value of a worker's engine: `{"kind": "builtin"}` without a seat; with one, its
/// `tiers` are [`HostTiers::report`]'s figures.
pub fn report(seat: Option<(&EngineKind, &Arc<EngineApi>)>, tiers: Option<&HostTiers>) -> Value {
    let Some((kind, api)) = seat else {
        return json!({ "kind": "builtin" });
    };
    let pools: Vec<Value> = api
        .pools()
        .attached()
        .iter()
        .map(|p| {
            let (state, reason) = registration_state(&p.registration);
            json!({
                "pool": p.role.as_str(),
                "domain": p.pool.domain().to_string(),
                "bytes": p.pool.buffer().len(),
                "registration": state,
                "reason": reason,
            })
        })
        .collect();
    let common = json!({
        "kind": format!("{kind:?}"),
        "attached": api.current_attach().is_some(),
        "attach_id": api.current_attach().unwrap_or(0),
        "attaches": api.attaches(),
        "pools": pools,
    });
    if api.config().role != WorkerRole::Prefill {
        // The decode role adds its own fields (`roles::decode::engine_seat`).
        return common;
    }
    let side = api.prefill_side();
    let stat = |f: fn(&crate::engine_api::prefill::PrefillStats) -> u64| {
        side.as_ref().map_or(0, |s| f(s.stats()))
    };
    let mut out = common;
    let prefill = json!({
        "rooms_submitted": stat(|s| s.rooms_submitted.load(Ordering::Relaxed)),
        "rooms_sent": stat(|s| s.rooms_sent.load(Ordering::Relaxed)),
        "rooms_failed": stat(|s| s.rooms_failed.load(Ordering::Relaxed)),
        "writes": stat(|s| s.writes.load(Ordering::Relaxed)),
        "pages_freed": stat(|s| s.pages_freed.load(Ordering::Relaxed)),
        "source_pages_held": side.as_ref().map_or(0, |s| s.held_pages()),
        "rooms_open": side.as_ref().map_or(0, |s| s.rooms()),
        "tiers": tiers.map_or(Value::Null, HostTiers::report),
    });
    if let (Some(o), Value::Object(p)) = (out.as_object_mut(), prefill) {
        o.extend(p);
    }
    out
}

/// The role behind a seat: what the engine API's calls reach.
pub enum SeatRole<'a> {
    /// A prefill worker: PrefillWork from the node's rooms, PagesReady moved by its transport, the
    /// tier calls served by a [`HostTiers`] over the [`TierSeat`]. With a LayerSplit seat (a rank
    /// of a LayerSplit group, `super::cp_engine`) the target pool holds the owned layers and the
    /// receive slot, and the tier calls answer `TIER_UNAVAILABLE` (its L2 and L3 would need keys
    /// per owned layer range, not wired on the engine path yet).
    Prefill(
        &'a Arc<PrefillNode>,
        Box<TierSeat>,
        Option<crate::engine_api::LayerSplitSeat>,
    ),
    /// A decode worker: Reserve opens rooms through this transport (and it receives EmitTokens).
    /// The role follows the attach in its own readiness and `/report`. With a [`TierSeat`] (an
    /// SGLang or vLLM engine, whose decode takes no rooms through the engine API, so its pool is
    /// its own) the tier calls are served by a [`HostTiers`] too; without, they answer
    /// `TIER_UNAVAILABLE`.
    Decode(Arc<dyn KvSource>, Option<Box<TierSeat>>),
}

/// The registration transactions of the seat's pools, summed over pool roles: `commits`,
/// `rollbacks`, `fallbacks` and `quarantined` (a registration whose undo failed: a leak).
pub fn registration_report(m: &RegistrationMetrics) -> Value {
    let sum = |f: &Family<RoleLabel, Counter>| -> u64 {
        ["target", "draft", "indexer"]
            .iter()
            .map(|r| {
                f.get_or_create(&RoleLabel {
                    role: (*r).to_owned(),
                })
                .get()
            })
            .sum()
    };
    json!({
        "commits": sum(&m.commits),
        "rollbacks": sum(&m.rollbacks),
        "fallbacks": sum(&m.fallback),
        "quarantined": sum(&m.quarantined),
    })
}

/// The simulated engine's own running summary ([`crate::engine_api::SIM_SUMMARY_FILE`] in the
/// socket directory: rooms, loaded pages verified, loaded chunks corrupt, load waits, reads before
/// ready), or null (a real engine, or none published yet).
pub fn engine_summary(dir: &std::path::Path) -> Value {
    std::fs::read(dir.join(crate::engine_api::SIM_SUMMARY_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

fn registration_state(r: &Registration) -> (&'static str, String) {
    match r {
        Registration::None => ("none", String::new()),
        Registration::Committed => ("committed", String::new()),
        Registration::FallbackL2(why) => ("fallback_l2", why.clone()),
    }
}

impl Seat {
    /// Allocates and registers the pools, starts the engine-API server on `seat.socket_dir` and
    /// makes readiness follow the engine's attach. `rank` is this worker's ordinal;
    /// `target_token_bytes` scales the target pool's rows ([`engine_layout`]); the tier calls are
    /// served by a [`HostTiers`] over `tier`.
    ///
    /// # Errors
    /// [`ServeError::Config`] when the pools cannot be made or registered (fail-closed), the tier
    /// backend cannot be built, or the server cannot bind its sockets.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        cfg: &WorkerConfig,
        seat: &EngineSeat,
        node: &Arc<PrefillNode>,
        state: &Arc<ServeState>,
        rank: u32,
        metrics: &EngineMetrics,
        target_token_bytes: Option<u64>,
        tier: TierSeat,
        layer_split: Option<crate::engine_api::LayerSplitSeat>,
    ) -> Result<Self, ServeError> {
        Self::start_role(
            cfg,
            seat,
            SeatRole::Prefill(node, Box::new(tier), layer_split),
            state,
            rank,
            metrics,
            target_token_bytes,
        )
    }

    /// [`Seat::start`] for either role (the seat is role-agnostic: pools, registration, server,
    /// metrics). A prefill seat also makes readiness follow the attach and sets `/report`'s
    /// `engine`; a decode seat leaves both to its role, which combines the attach with its peers.
    ///
    /// # Errors
    /// As [`Seat::start`].
    pub fn start_role(
        cfg: &WorkerConfig,
        seat: &EngineSeat,
        role: SeatRole<'_>,
        state: &Arc<ServeState>,
        rank: u32,
        metrics: &EngineMetrics,
        target_token_bytes: Option<u64>,
    ) -> Result<Self, ServeError> {
        let socket_dir = resolve_path(&seat.socket_dir);
        let mut api_cfg = EngineApiConfig::for_worker(cfg, &socket_dir);
        api_cfg.target_token_bytes = target_token_bytes;
        api_cfg.ranks = cfg.parallelism.ranks_of(rank);
        match &role {
            SeatRole::Prefill(_, _, layer_split) => {
                api_cfg.prefill_rank = rank;
                api_cfg.layer_split = layer_split.clone();
            }
            SeatRole::Decode(..) => {
                api_cfg.decode_rank = rank;
                // Negative control only (feature `negative-controls`, `$TANDEM_NEGATIVE_GATE_BYPASS`).
                #[cfg(feature = "negative-controls")]
                {
                    api_cfg.unsafe_release_on_abort = crate::roles::gate_bypass_from_env();
                }
            }
        }
        let health = Arc::new(Health::new());
        let sidecar = resolve_path(std::path::Path::new(SIDECAR_SOCKET));
        let pools = PoolSet::from_config(
            cfg,
            &api_cfg,
            health.clone(),
            metrics.registration.clone(),
            &sidecar,
        )
        .map_err(|e| ServeError::Config(format!("engine pools: {e}")))?;
        let attached = pools
            .attach(&roles_configured(cfg))
            .map_err(ServeError::Pools)?;
        for p in &attached {
            let (reg, reason) = registration_state(&p.registration);
            metrics
                .pool_bytes
                .get_or_create(&vec![
                    ("pool".into(), p.role.as_str().into()),
                    ("domain".into(), p.pool.domain().to_string()),
                ])
                .set(p.pool.buffer().len() as i64);
            metrics
                .pool_registered
                .get_or_create(&vec![
                    ("pool".into(), p.role.as_str().into()),
                    ("state".into(), reg.into()),
                ])
                .set(1);
            if !reason.is_empty() {
                state
                    .health
                    .degrade(&format!("pool/{}", p.role), "FallbackL2", reason.clone());
            }
            tracing::info!(pool = %p.role, domain = %p.pool.domain(), bytes = p.pool.buffer().len(),
                registration = reg, reason, "engine pool allocated");
        }
        let target = attached
            .iter()
            .find(|p| p.role == PoolRole::Target)
            .map(|p| p.pool.clone())
            .ok_or_else(|| ServeError::Config("engine pools: no target pool".into()))?;
        drop(attached);
        // The tier calls' L2/L3 over the target pool (the engine's pages they load into).
        let host_tiers = |target, tier: &TierSeat| {
            HostTiers::new(
                target,
                tier.layout,
                tier.l2_pages,
                tier.cache.clone(),
                tier.counters.clone(),
            )
            .map_err(|e| ServeError::Config(format!("engine tiers: {e}")))
        };
        let (backend, node, tiers, admitting) = match role {
            SeatRole::Prefill(node, tier, Some(_)) => {
                drop(target);
                (
                    Backend::Prefill(node.clone()),
                    Some(node),
                    None,
                    Some(tier.admitting),
                )
            }
            SeatRole::Prefill(node, tier, None) => {
                let tiers = host_tiers(target, &tier)?;
                node.set_tiers(tiers.clone());
                (
                    Backend::Prefill(node.clone()),
                    Some(node),
                    Some(tiers),
                    Some(tier.admitting),
                )
            }
            SeatRole::Decode(source, None) => {
                drop(target);
                (Backend::Decode(source), None, None, None)
            }
            SeatRole::Decode(source, Some(tier)) => {
                let tiers = host_tiers(target, &tier)?;
                (Backend::Decode(source), None, Some(tiers), None)
            }
        };
        let tier_backend: Arc<dyn crate::engine_api::tiers::TierBackend> = match &tiers {
            Some(t) => t.clone(),
            None => Arc::new(crate::engine_api::tiers::NoTiers),
        };
        let api = EngineApi::new(cfg, api_cfg, pools, backend, tier_backend, health.clone())
            .map_err(|e| ServeError::Config(e.to_string()))?;
        if let Some(node) = node {
            node.set_engine(&api);
        }
        let server = server::start(api.clone()).map_err(|e| ServeError::Config(e.to_string()))?;
        // Not ready from now on until an engine attached.
        state.set_ready(Err(NOT_ATTACHED.into()));
        let prefill = node.is_some();
        let mut rx = api.watch_attach();
        let st = state.clone();
        let dir = socket_dir.clone();
        // A prefill's readiness follows the attach (a decode's combines it with its peers).
        tokio::spawn(async move {
            if !prefill {
                return;
            }
            loop {
                let now = *rx.borrow_and_update();
                match now {
                    Some(id) if admitting.as_ref().is_none_or(|a| a.load(Ordering::SeqCst)) => {
                        tracing::info!(attach_id = id, "engine attached: ready");
                        st.set_ready(Ok(()));
                    }
                    Some(id) => {
                        tracing::info!(
                            attach_id = id,
                            "engine attached; loading back from L3 first"
                        );
                        st.set_ready(Err(LOADING_BACK.into()));
                    }
                    None => {
                        tracing::warn!(socket_dir = %dir.display(), "{NOT_ATTACHED}: not ready");
                        st.set_ready(Err(NOT_ATTACHED.into()));
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        // Metrics and the registrar's degradations follow the API on every scrape.
        let (a, m, t) = (api.clone(), metrics.clone(), tiers.clone());
        state.on_refresh(move |s| {
            if let Some(t) = &t {
                m.mirror_tiers(t.stats());
            }
            m.attached.set(i64::from(a.current_attach().is_some()));
            mirror(&m.attaches, a.attaches());
            for d in health.report().degraded {
                s.health.degrade(&d.component, &d.code, d.message);
            }
            if let Some(side) = a.prefill_side() {
                let st = side.stats();
                mirror(
                    &m.rooms_submitted,
                    st.rooms_submitted.load(Ordering::Relaxed),
                );
                mirror(&m.rooms_sent, st.rooms_sent.load(Ordering::Relaxed));
                mirror(&m.rooms_failed, st.rooms_failed.load(Ordering::Relaxed));
                mirror(&m.writes, st.writes.load(Ordering::Relaxed));
                m.source_pages_held.set(i64::from(side.held_pages()));
            }
        });
        if prefill {
            // A LayerSplit rank's seat serves no tiers (`tiers` is `None`): its report says so.
            let t = tiers.clone();
            let (kind, a) = (seat.kind, api.clone());
            let (reg, dir) = (metrics.registration.clone(), socket_dir.clone());
            state.set_extra(move || {
                let mut engine = report(Some((&kind, &a)), t.as_deref());
                if let Some(obj) = engine.as_object_mut() {
                    obj.insert("registration".into(), registration_report(&reg));
                    obj.insert("engine_summary".into(), engine_summary(&dir));
                }
                let mut m = serde_json::Map::new();
                m.insert("engine".into(), engine);
                m
            });
        }
        tracing::info!(kind = ?seat.kind, socket_dir = %socket_dir.display(), role = ?cfg.role,
            "the worker serves through the engine API; {NOT_ATTACHED} yet");
        Ok(Self {
            kind: seat.kind,
            socket_dir,
            api,
            tiers,
            registration: metrics.registration.clone(),
            server,
        })
    }

    /// Teardown (DESIGN contract 9), after the rooms drained and the transport closed: the live
    /// attach ends, the server stops and removes its sockets, and the pools are deregistered and
    /// freed with the allocator that made them. Returns the release errors, one line each.
    pub async fn stop(mut self) -> Vec<String> {
        self.stop_engine().await;
        self.release()
    }

    /// The first half of [`Seat::stop`] (DESIGN contract 9, "destroy transports and the engine"):
    /// the live attach ends (its rooms fail through the gate; requests waiting on them end), the
    /// server stops and removes its sockets, the tier backend closes. The pools stay.
    pub async fn stop_engine(&mut self) {
        self.server.stop().await;
        if let Some(t) = &self.tiers {
            t.close();
        }
    }

    /// The second half of [`Seat::stop`] ("free memory"): the pools are deregistered and freed
    /// with the allocator that made them. Returns the release errors, one line each (a pool still
    /// referenced elsewhere is named, and freed when its last reference goes).
    pub fn release(self) -> Vec<String> {
        let api = self.api.clone();
        drop(self);
        api.release_pools()
    }
}
