//! The engine API's state: the current attach, the pools, and the role's side (decode or prefill).
//!
//! One engine process (one TP/CP rank) attaches to its worker at a time. An attach lives from a
//! successful Attach until Detach, the close of its pools connection (the engine exited), an unclaimed
//! fd delivery past the claim deadline, or shutdown; then its live rooms fail through the release
//! gate. The pools outlive attaches: an engine that restarts attaches again and maps the same pools.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tonic::Code;

use crate::config::{WorkerConfig, WorkerRole};
use crate::health::Health;
use crate::release::PrefillRank;
use crate::release::receiver::GateMode;
use crate::spec_guard::Thresholds;

use super::decode::{DecodeSettings, DecodeSide, KvSource};
use super::error::ApiError;
use super::fd_pass::{ClaimRefused, Claims};
use super::identity::{self, domain_to_proto, kind_to_proto, layout_to_proto};
use super::pools::{PoolSet, Registration};
use super::prefill::{KvSink, LayerGroup, PrefillSide};
use super::tiers::TierBackend;
use super::{EngineApiConfig, LayerSplitSeat, pb, role_name};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The transport side of the worker's role.
#[derive(Clone)]
pub enum Backend {
    /// A decode worker: its rooms' KV comes from this source.
    Decode(Arc<dyn KvSource>),
    /// A prefill worker: its PagesReady writes go to this sink.
    Prefill(Arc<dyn KvSink>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Decode(_) => "Backend::Decode",
            Backend::Prefill(_) => "Backend::Prefill",
        })
    }
}

#[derive(Debug)]
struct AttachState {
    id: u64,
    token: u64,
    fds: Option<Vec<(String, OwnedFd)>>,
    claimed: bool,
}

#[derive(Debug, Default)]
struct SessionState {
    current: Option<AttachState>,
    next_id: u64,
    attaches: u64,
}

/// The engine API of one worker.
pub struct EngineApi {
    cfg: WorkerConfig,
    api: EngineApiConfig,
    pools: PoolSet,
    backend: Backend,
    tiers: Arc<dyn TierBackend>,
    health: Arc<Health>,
    session: Mutex<SessionState>,
    decode: Mutex<Option<Arc<DecodeSide>>>,
    prefill: Mutex<Option<Arc<PrefillSide>>>,
    /// The LayerSplit group that answers AwaitLayer (a rank of a LayerSplit group only).
    layer_group: std::sync::OnceLock<Arc<dyn LayerGroup>>,
    shutting_down: AtomicBool,
    runtime: tokio::runtime::Handle,
    attached: tokio::sync::watch::Sender<Option<u64>>,
    me: Weak<EngineApi>,
}

impl std::fmt::Debug for EngineApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineApi")
            .field("role", &self.cfg.role)
            .field("backend", &self.backend)
            .finish()
    }
}

fn random_token() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    let v = u64::from_le_bytes(b);
    if from_os.is_ok() && v != 0 {
        return v;
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    xxhash_rust::xxh3::xxh3_64(
        &[t.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat(),
    ) | 1
}

impl EngineApi {
    /// The API of a worker with config `cfg`, settings `api`, pools `pools`, the role's transport
    /// `backend` (its kind must match `cfg.role`) and tier backend `tiers`. Must be called inside a
    /// tokio runtime.
    ///
    /// # Errors
    /// `WRONG_ROLE` when `backend` does not match the role.
    pub fn new(
        cfg: &WorkerConfig,
        api: EngineApiConfig,
        pools: PoolSet,
        backend: Backend,
        tiers: Arc<dyn TierBackend>,
        health: Arc<Health>,
    ) -> Result<Arc<Self>, ApiError> {
        let matches = matches!(
            (&backend, cfg.role),
            (Backend::Decode(_), WorkerRole::Decode) | (Backend::Prefill(_), WorkerRole::Prefill)
        );
        if !matches {
            return Err(ApiError::new(
                Code::FailedPrecondition,
                pb::ErrorReason::WrongRole,
                format!("a {backend:?} for a {} worker", role_name(cfg.role)),
            ));
        }
        let runtime = tokio::runtime::Handle::current();
        Ok(Arc::new_cyclic(|me| Self {
            cfg: cfg.clone(),
            api,
            pools,
            backend,
            tiers,
            health,
            session: Mutex::new(SessionState {
                next_id: 1,
                ..SessionState::default()
            }),
            decode: Mutex::new(None),
            prefill: Mutex::new(None),
            layer_group: std::sync::OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            runtime,
            attached: tokio::sync::watch::Sender::new(None),
            me: me.clone(),
        }))
    }

    /// The settings.
    pub fn settings(&self) -> &EngineApiConfig {
        &self.api
    }

    /// The worker config.
    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    /// The pools.
    pub fn pools(&self) -> &PoolSet {
        &self.pools
    }

    /// The tier backend.
    pub fn tiers(&self) -> &Arc<dyn TierBackend> {
        &self.tiers
    }

    /// The decode side, once an engine attached to a decode worker.
    pub fn decode_side(&self) -> Option<Arc<DecodeSide>> {
        lock(&self.decode).clone()
    }

    /// The prefill side, once an engine attached to a prefill worker.
    pub fn prefill_side(&self) -> Option<Arc<PrefillSide>> {
        lock(&self.prefill).clone()
    }

    /// The LayerSplit group that answers the prefill side's AwaitLayer (set once, before or after
    /// the first attach; later calls are ignored).
    pub fn set_layer_group(&self, group: Arc<dyn LayerGroup>) {
        if self.layer_group.set(group.clone()).is_ok()
            && let Some(side) = lock(&self.prefill).as_ref()
        {
            side.set_group(group);
        }
    }

    /// Attaches completed so far.
    pub fn attaches(&self) -> u64 {
        lock(&self.session).attaches
    }

    /// The live attach id as it changes: `Some(id)` from a successful Attach, `None` once that
    /// attach ended (Detach, pools connection closed — the engine exited or was killed —, unclaimed
    /// fds, shutdown). A role's readiness follows it (DESIGN §3.1).
    pub fn watch_attach(&self) -> tokio::sync::watch::Receiver<Option<u64>> {
        self.attached.subscribe()
    }

    /// The current attach id, if an engine is attached.
    pub fn current_attach(&self) -> Option<u64> {
        lock(&self.session).current.as_ref().map(|a| a.id)
    }

    fn gate(&self) -> GateMode {
        #[cfg(feature = "negative-controls")]
        if self.api.unsafe_release_on_abort {
            return GateMode::UnsafeBypass;
        }
        GateMode::Safe
    }

    /// Attach: identity check (no side effect on refusal), pools (allocated on the first attach,
    /// registered transactionally), a new attach id and claim token.
    ///
    /// # Errors
    /// `SHUTTING_DOWN`; the identity check's refusals; `ALREADY_ATTACHED`; the pools' allocation and
    /// registration failures (rolled back).
    pub fn attach(&self, req: &pb::AttachRequest) -> Result<pb::AttachReply, ApiError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(shutting_down());
        }
        let id = req
            .identity
            .as_ref()
            .ok_or_else(|| ApiError::malformed("identity", "the engine identity is missing"))?;
        let plan = identity::check(&self.cfg, &self.api, id)?;
        let mut session = lock(&self.session);
        if let Some(cur) = &session.current {
            return Err(ApiError::new(
                Code::AlreadyExists,
                pb::ErrorReason::AlreadyAttached,
                format!(
                    "attach {} is live (its pools connection is open or its claim deadline has not passed)",
                    cur.id
                ),
            ));
        }
        let pools = self.pools.attach(&plan.pools)?;
        let fds = self.pools.export_fds()?;
        let arcs: Vec<_> = pools.iter().map(|p| p.pool.clone()).collect();
        let attach_id = session.next_id;
        session.next_id += 1;
        match &self.backend {
            Backend::Decode(source) => {
                let side = lock(&self.decode)
                    .get_or_insert_with(|| {
                        DecodeSide::new(
                            arcs.clone(),
                            source.clone(),
                            DecodeSettings {
                                gate: self.gate(),
                                ack_timeout: self.api.ack_timeout,
                                max_kv_deadline: self.api.max_kv_deadline,
                                room_base: self.api.room_base,
                                thresholds: self
                                    .cfg
                                    .speculative
                                    .as_ref()
                                    .and(self.cfg.spec_guard.as_ref())
                                    .map(Thresholds::from),
                            },
                            self.runtime.clone(),
                        )
                    })
                    .clone();
                side.set_attach(attach_id);
            }
            Backend::Prefill(sink) => {
                let side = lock(&self.prefill)
                    .get_or_insert_with(|| {
                        let side = PrefillSide::with_layer_split(
                            arcs.clone(),
                            sink.clone(),
                            PrefillRank(self.api.prefill_rank),
                            self.api.layer_split.clone(),
                        );
                        if let Some(g) = self.layer_group.get() {
                            side.set_group(g.clone());
                        }
                        side
                    })
                    .clone();
                side.set_attach(attach_id);
            }
        }
        let token = random_token();
        let kinds: Vec<String> = pools.iter().map(|p| p.role.as_str().to_owned()).collect();
        session.current = Some(AttachState {
            id: attach_id,
            token,
            fds: Some(kinds.into_iter().zip(fds).collect()),
            claimed: false,
        });
        session.attaches += 1;
        self.attached.send_replace(Some(attach_id));
        drop(session);
        let me = self.me.clone();
        let deadline = self.api.claim_deadline;
        self.runtime.spawn(async move {
            tokio::time::sleep(deadline).await;
            if let Some(me) = me.upgrade() {
                let unclaimed = lock(&me.session)
                    .current
                    .as_ref()
                    .is_some_and(|a| a.id == attach_id && !a.claimed);
                if unclaimed {
                    tracing::warn!(
                        attach_id,
                        "pool fds not claimed before the deadline; the attach ends"
                    );
                    me.end_attach(attach_id);
                }
            }
        });
        tracing::info!(
            attach_id,
            engine = %id.engine,
            pools = pools.len(),
            "engine attached"
        );
        Ok(pb::AttachReply {
            attach_id,
            claim_token: token,
            pools_socket: self.api.pools_socket().display().to_string(),
            pools: pools
                .iter()
                .enumerate()
                .map(|(i, p)| p.descriptor(i as u32))
                .collect(),
            model_fingerprint: identity::fingerprint(&self.cfg.model),
            role: role_name(self.cfg.role).into(),
            claim_deadline_ms: self.api.claim_deadline.as_millis() as u64,
            layer_split: self.api.layer_split.as_ref().map(LayerSplitSeat::to_proto),
        })
    }

    /// Checks that `attach_id` is the live attach.
    ///
    /// # Errors
    /// `SHUTTING_DOWN`, `NOT_ATTACHED`.
    pub fn check_attach(&self, attach_id: u64) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(shutting_down());
        }
        match &lock(&self.session).current {
            Some(a) if a.id == attach_id && attach_id != 0 => Ok(()),
            _ => Err(ApiError::not_attached(attach_id)),
        }
    }

    /// The decode side for a call of `attach_id`.
    ///
    /// # Errors
    /// As [`EngineApi::check_attach`]; `WRONG_ROLE` on a prefill worker.
    pub fn decode(&self, attach_id: u64) -> Result<Arc<DecodeSide>, ApiError> {
        self.check_attach(attach_id)?;
        self.decode_side()
            .ok_or_else(|| wrong_role("decode", self.cfg.role))
    }

    /// The prefill side for a call of `attach_id`.
    ///
    /// # Errors
    /// As [`EngineApi::check_attach`]; `WRONG_ROLE` on a decode worker.
    pub fn prefill(&self, attach_id: u64) -> Result<Arc<PrefillSide>, ApiError> {
        self.check_attach(attach_id)?;
        self.prefill_side()
            .ok_or_else(|| wrong_role("prefill", self.cfg.role))
    }

    /// Ends attach `attach_id` (Detach, pools connection closed, claim deadline): its live rooms fail
    /// through the gate. Returns the decode rooms failed; `None` when it was not the live attach.
    pub fn end_attach(&self, attach_id: u64) -> Option<u32> {
        {
            let mut s = lock(&self.session);
            match &s.current {
                Some(a) if a.id == attach_id => s.current = None,
                _ => return None,
            }
            self.attached.send_replace(None);
        }
        let mut failed = 0;
        if let Some(d) = self.decode_side() {
            failed = d.end_attach(attach_id);
            d.releases().reset();
            d.work().reset();
        }
        if let Some(p) = self.prefill_side() {
            p.end_attach(attach_id);
            p.work().reset();
            p.source_free().reset();
        }
        tracing::info!(attach_id, rooms_failed = failed, "engine attach ended");
        Some(failed)
    }

    /// Detach.
    ///
    /// # Errors
    /// `NOT_ATTACHED`.
    pub fn detach(&self, attach_id: u64) -> Result<pb::DetachReply, ApiError> {
        self.check_attach(attach_id)?;
        let n = self
            .end_attach(attach_id)
            .ok_or_else(|| ApiError::not_attached(attach_id))?;
        Ok(pb::DetachReply { rooms_aborted: n })
    }

    /// Stops admitting calls and ends the live attach (teardown, DESIGN contract 9).
    pub fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        let cur = self.current_attach();
        if let Some(id) = cur {
            self.end_attach(id);
        }
    }

    /// Teardown of the engine API's memory (DESIGN contract 9, after [`EngineApi::shutdown`] and the
    /// server's stop): drops the role's side and releases the pools — deregistered in reverse order
    /// and freed with the allocator that made them. Returns the errors, one line each (a pool still
    /// referenced elsewhere is reported, and freed when its last reference goes).
    pub fn release_pools(&self) -> Vec<String> {
        self.shutdown();
        lock(&self.decode).take();
        lock(&self.prefill).take();
        self.pools.release()
    }

    /// Health.
    pub fn health(&self) -> pb::HealthReply {
        let report = self.health.report();
        let mut reply = pb::HealthReply {
            ready: !self.shutting_down.load(Ordering::Acquire),
            role: role_name(self.cfg.role).into(),
            attach_id: self.current_attach().unwrap_or(0),
            page_tokens: self.api.page_tokens,
            layout: layout_to_proto(self.api.layout) as i32,
            model_fingerprint: identity::fingerprint(&self.cfg.model),
            max_call_ms: self.api.max_call.as_millis() as u64,
            pools: self
                .pools
                .attached()
                .iter()
                .map(|p| {
                    let (registration, reason) = match &p.registration {
                        Registration::None => (pb::RegistrationState::None, String::new()),
                        Registration::Committed => {
                            (pb::RegistrationState::Committed, String::new())
                        }
                        Registration::FallbackL2(r) => {
                            (pb::RegistrationState::FallbackL2, r.clone())
                        }
                    };
                    pb::PoolHealth {
                        kind: kind_to_proto(p.role) as i32,
                        domain: domain_to_proto(p.pool.domain()) as i32,
                        bytes: p.pool.buffer().len() as u64,
                        registration: registration as i32,
                        registration_reason: reason,
                    }
                })
                .collect(),
            degraded: report
                .degraded
                .iter()
                .map(|d| format!("{}: {}: {}", d.component, d.code, d.message))
                .collect(),
            ..pb::HealthReply::default()
        };
        if let Some(d) = self.decode_side() {
            let p = d.pages();
            reply.pages_free = p.free;
            reply.pages_held = p.held;
            reply.pages_release_pending = p.release_pending;
            reply.pages_quarantined = p.quarantined;
        } else if let Some(p) = self.prefill_side() {
            reply.pages_held = p.held_pages();
            reply.pages_free = self.pools.pages() - reply.pages_held;
        } else {
            reply.pages_free = self.pools.pages();
        }
        reply
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(
        Code::Unavailable,
        pb::ErrorReason::ShuttingDown,
        "the worker is shutting down",
    )
}

fn wrong_role(wanted: &str, role: WorkerRole) -> ApiError {
    ApiError::new(
        Code::FailedPrecondition,
        pb::ErrorReason::WrongRole,
        format!("a {wanted} call on a {} worker", role_name(role)),
    )
}

impl Claims for EngineApi {
    fn claim(
        &self,
        attach_id: u64,
        claim_token: u64,
    ) -> Result<Vec<(String, OwnedFd)>, ClaimRefused> {
        let mut s = lock(&self.session);
        let Some(a) = s.current.as_mut().filter(|a| a.id == attach_id) else {
            return Err(ClaimRefused {
                reason: "NOT_ATTACHED",
                message: format!("attach {attach_id} is not live"),
            });
        };
        if a.token != claim_token {
            return Err(ClaimRefused {
                reason: "ALREADY_CLAIMED",
                message: "wrong claim token".into(),
            });
        }
        let fds = a.fds.take().ok_or(ClaimRefused {
            reason: "ALREADY_CLAIMED",
            message: format!("the fds of attach {attach_id} were already passed"),
        })?;
        a.claimed = true;
        Ok(fds)
    }

    fn closed(&self, attach_id: u64) {
        self.end_attach(attach_id);
    }
}

/// The [`Claims`] of an API held by the pools socket (a weak reference: the socket never keeps the
/// API alive).
#[derive(Debug)]
pub struct WeakClaims(pub Weak<EngineApi>);

impl Claims for WeakClaims {
    fn claim(
        &self,
        attach_id: u64,
        claim_token: u64,
    ) -> Result<Vec<(String, OwnedFd)>, ClaimRefused> {
        match self.0.upgrade() {
            Some(api) => api.claim(attach_id, claim_token),
            None => Err(ClaimRefused {
                reason: "NOT_ATTACHED",
                message: "the engine API is gone".into(),
            }),
        }
    }
    fn closed(&self, attach_id: u64) {
        if let Some(api) = self.0.upgrade() {
            api.end_attach(attach_id);
        }
    }
}
