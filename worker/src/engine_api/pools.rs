//! The pools of an attach (DESIGN §3.1 "Attach", contracts 1 and 2).
//!
//! Every pool an engine maps is a range of a memfd segment, so it is in the `SharedMemory` domain: it
//! is carved by the store client's allocator ([`StoreClient::host_allocator`]) — the standalone store
//! client's segments in `Standalone` mode (seed 000: only those register), the worker's own in
//! `Embedded` mode or without a CacheTier — and, with a CacheTier, registered through
//! [`Registrar::attach`] (ALLOCATED → REGISTERING → COMMITTED, or rolled back under the configured
//! failure policy). A worker configured for a process-private domain (`Mmap`, `Pinned`) cannot share
//! pools with an engine process and refuses to start the engine API ([`PoolSetError::DomainNotShareable`]).
//!
//! All pools of an attach have the same page count (page index `i` names page `i` of every pool): the
//! smallest `configured bytes / page bytes` over the configured pools. An attach allocates the pools it
//! asks for once, as one transaction: a failure of a later pool rolls back the earlier ones. A later
//! attach (the engine restarted) gets the same pools.
//!
//! Before any pool is allocated or registered, the attach checks that every pool it asks for comes
//! from the store client's own allocator (seed 000's preflight, across pools): a pool that would be
//! carved elsewhere is refused with `POOL_DOMAIN_MISMATCH` while nothing has reached the store
//! client. The negative control of that check (feature `negative-controls`, environment variable
//! [`NC_DRAFT_ON_MMAP_ENV`]) puts the draft pool on a plain mmap allocator, the bug of seed 000.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tonic::Code;

use crate::config::WorkerConfig;
use crate::memory::pool::{KvGeometry, KvPool, PoolRole, PoolSpec};
use crate::memory::{Allocator, AllocatorDomain, host_page_size};
use crate::registration::{AttachOutcome, Phase, Registrar};
use crate::store_client::StoreClient;
use crate::store_client::embedded::EmbeddedClient;

use super::error::ApiError;
use super::identity::{
    configured_bytes, domain_to_proto, kind_to_proto, layout_to_proto, pool_model,
};
use super::{EngineApiConfig, pb};

/// Why the engine API cannot serve pools with this configuration (a startup refusal).
#[derive(Debug, thiserror::Error)]
pub enum PoolSetError {
    /// The configured domain is process-private: an engine process cannot map it.
    #[error(
        "memory.allocator is {0}: engine-API pools are memfd shared memory, which only the SharedMemory domain describes; configure SharedMemory"
    )]
    DomainNotShareable(AllocatorDomain),
    /// The store client's allocator is in another domain than the configured one.
    #[error("the store client allocates in {theirs}, the config asks for {ours}")]
    DomainMismatch {
        /// Configured.
        ours: AllocatorDomain,
        /// The store client's.
        theirs: AllocatorDomain,
    },
    /// The store client has no segments whose fds could be passed.
    #[error("the {0} store client exposes no segments to pass to the engine")]
    NoSegments(crate::store_client::ClientMode),
    /// A configured pool cannot hold one page.
    #[error("the {role} pool of {bytes} B cannot hold one page of {page_bytes} B")]
    TooSmall {
        /// Pool.
        role: PoolRole,
        /// Configured bytes.
        bytes: u64,
        /// Bytes of one page.
        page_bytes: u64,
    },
    /// A configured pool's model is missing (e.g. draft bytes without `speculative`).
    #[error("the {0} pool is sized but its model is not configured")]
    NoModel(PoolRole),
    /// Creating the worker's own segment failed.
    #[error("creating the pools' shared-memory segment failed: {0}")]
    Segment(String),
}

/// Negative control of seed 000 (feature `negative-controls` only; a release build does not read
/// it): `TANDEM_NC_DRAFT_POOL_ON_MMAP=<pool>` makes the worker of pool `<pool>` (its config's
/// `pool`) carve the draft pool from a plain mmap allocator instead of the store client's, as
/// SGLang's draft host pool did before the fix. The attach's preflight must refuse it before
/// anything is registered. Naming the pool lets one process runner's global pod environment hit a
/// single pool of a stack.
pub const NC_DRAFT_ON_MMAP_ENV: &str = "TANDEM_NC_DRAFT_POOL_ON_MMAP";

/// How long a Standalone worker waits for its store-client sidecar's socket at start (the native
/// sidecar starts first, but the kubelet moves on once its process runs, before it listens).
pub const SIDECAR_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Registration state of one pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// No CacheTier: not registered.
    None,
    /// Committed.
    Committed,
    /// Rolled back under `fallbackToL2`; the reason.
    FallbackL2(String),
}

/// One allocated pool.
#[derive(Debug, Clone)]
pub struct AttachedPool {
    /// Target, draft or indexer.
    pub role: PoolRole,
    /// The pool (buffer in a memfd segment, geometry, page table).
    pub pool: Arc<KvPool>,
    /// Its registration.
    pub registration: Registration,
    /// Segment id and byte offset of the pool's buffer inside it.
    pub segment: u64,
    /// Byte offset inside the segment.
    pub offset: usize,
}

impl AttachedPool {
    /// The descriptor the engine maps the pool with; `fd_index` is its place in the delivery.
    pub fn descriptor(&self, fd_index: u32) -> pb::PoolDescriptor {
        let g = self.pool.geometry();
        let (registration, reason) = match &self.registration {
            Registration::None => (pb::RegistrationState::None, String::new()),
            Registration::Committed => (pb::RegistrationState::Committed, String::new()),
            Registration::FallbackL2(r) => (pb::RegistrationState::FallbackL2, r.clone()),
        };
        pb::PoolDescriptor {
            kind: kind_to_proto(self.role) as i32,
            fd_index,
            map_offset: self.offset as u64,
            map_length: self.pool.buffer().len() as u64,
            page_count: g.pages,
            page_tokens: g.page_tokens,
            layers: g.layers,
            bytes_per_token_layer: g.bytes_per_token_layer,
            chunk_bytes: g.chunk_bytes(),
            page_bytes: g.page_bytes(),
            layout: layout_to_proto(g.layout) as i32,
            domain: domain_to_proto(self.pool.domain()) as i32,
            registration: registration as i32,
            registration_reason: reason,
        }
    }
}

/// The pools of this worker's engine API.
#[derive(Debug)]
pub struct PoolSet {
    cfg: WorkerConfig,
    target_token_bytes: Option<u64>,
    layer_split: Option<super::LayerSplitSeat>,
    page_tokens: u32,
    layout: crate::memory::pool::PoolLayout,
    pages: u32,
    store: Arc<dyn StoreClient>,
    registrar: Option<Arc<Registrar>>,
    attached: Mutex<Option<Vec<AttachedPool>>>,
    /// Negative control ([`NC_DRAFT_ON_MMAP_ENV`]): the draft pool's allocator instead of the
    /// store client's.
    #[cfg(feature = "negative-controls")]
    draft_override: Option<Allocator>,
}

/// The pools `cfg` sizes, in delivery order (target, then draft and indexer when their
/// `memory.*PoolBytes` are non-zero): what a worker allocates at start and what the simulated engine
/// asks for at Attach.
pub fn roles_configured(cfg: &WorkerConfig) -> Vec<PoolRole> {
    [PoolRole::Target, PoolRole::Draft, PoolRole::Indexer]
        .into_iter()
        .filter(|r| configured_bytes(cfg, *r) > 0)
        .collect()
}

/// The model whose geometry sizes `role`'s pool: [`pool_model`], with the target's rows scaled to
/// [`EngineApiConfig::target_token_bytes`] when set (a one-byte-element MLA row of that many bytes,
/// same name and layers) and the draft's rows scaled by the same ratio (at least
/// [`crate::engine::content::TAG_BYTES`], a multiple of 8): the draft pool's configured bytes are
/// sized for the target's real token capacity, so unscaled draft rows would cap the shared page
/// count at that capacity (6 pages for the demo's llama-3-70b + llama-3-8b decode pool) while the
/// scaled target holds hundreds. A LayerSplit rank's target model has its owned layers and the
/// receive slot ([`super::LayerSplitSeat::pool_layers`]): the same bytes hold more pages.
fn sized_model(
    cfg: &WorkerConfig,
    role: PoolRole,
    target_token_bytes: Option<u64>,
    layer_split: Option<&super::LayerSplitSeat>,
) -> Option<crate::model::ModelIdentity> {
    let model = pool_model(cfg, role)?;
    let mla = |bytes: u64, model: crate::model::ModelIdentity| crate::model::ModelIdentity {
        attention: crate::model::Attention::Mla {
            kv_lora_rank: u32::try_from(bytes).unwrap_or(u32::MAX),
            rope_dim: 0,
        },
        dtype_bytes: 1,
        row_extra_bytes: 0,
        ..model
    };
    let model = match (role, layer_split) {
        // A LayerSplit rank's target pool: its owned layers and the receive slot (seed 004).
        (PoolRole::Target, Some(seat)) => crate::model::ModelIdentity {
            layers: seat.pool_layers(),
            ..model
        },
        _ => model,
    };
    match (role, target_token_bytes) {
        (PoolRole::Target, Some(bytes)) => Some(mla(bytes, model)),
        (PoolRole::Draft, Some(bytes)) => {
            let real = cfg.model.bytes_per_token_layer().max(1);
            let scaled = (model.bytes_per_token_layer().saturating_mul(bytes))
                .div_ceil(real)
                .next_multiple_of(8)
                .max(crate::engine::content::TAG_BYTES as u64);
            Some(mla(scaled, model))
        }
        _ => Some(model),
    }
}

fn page_bytes(
    cfg: &WorkerConfig,
    api: &EngineApiConfig,
    role: PoolRole,
) -> Result<u64, PoolSetError> {
    let model = sized_model(cfg, role, api.target_token_bytes, api.layer_split.as_ref())
        .ok_or(PoolSetError::NoModel(role))?;
    Ok(KvGeometry::new(&model, api.page_tokens, 1, api.layout).page_bytes())
}

impl PoolSet {
    /// The shared page count of the configured pools: `min(configured bytes / page bytes)`.
    ///
    /// # Errors
    /// [`PoolSetError::TooSmall`], [`PoolSetError::NoModel`].
    pub fn page_count(cfg: &WorkerConfig, api: &EngineApiConfig) -> Result<u32, PoolSetError> {
        let mut pages = u64::from(u32::MAX);
        for role in roles_configured(cfg) {
            let per_page = page_bytes(cfg, api, role)?;
            let bytes = configured_bytes(cfg, role);
            let n = bytes / per_page.max(1);
            if n == 0 {
                return Err(PoolSetError::TooSmall {
                    role,
                    bytes,
                    page_bytes: per_page,
                });
            }
            pages = pages.min(n);
        }
        Ok(u32::try_from(pages).unwrap_or(u32::MAX))
    }

    /// Segment bytes the configured pools need (each rounded up to the host page size): what a store
    /// client must `reserve` before [`PoolSet::new`].
    ///
    /// # Errors
    /// As [`PoolSet::page_count`].
    pub fn bytes_needed(cfg: &WorkerConfig, api: &EngineApiConfig) -> Result<u64, PoolSetError> {
        let pages = u64::from(Self::page_count(cfg, api)?);
        let align = host_page_size() as u64;
        let mut total = 0u64;
        for role in roles_configured(cfg) {
            let b = page_bytes(cfg, api, role)? * pages;
            total += b.div_ceil(align) * align;
        }
        Ok(total)
    }

    /// Pools over `store`'s segments, registered through `registrar` when one is given (a CacheTier is
    /// configured). The store client must already hold [`PoolSet::bytes_needed`] bytes of segments.
    ///
    /// # Errors
    /// [`PoolSetError`] when the domain is not shareable or disagrees with the store client, the store
    /// client has no segments, or a pool is too small.
    pub fn new(
        cfg: &WorkerConfig,
        api: &EngineApiConfig,
        store: Arc<dyn StoreClient>,
        registrar: Option<Arc<Registrar>>,
    ) -> Result<Self, PoolSetError> {
        let ours = cfg.memory.allocator;
        if ours != AllocatorDomain::SharedMemory {
            return Err(PoolSetError::DomainNotShareable(ours));
        }
        let theirs = store.host_allocator().domain();
        if theirs != ours {
            return Err(PoolSetError::DomainMismatch { ours, theirs });
        }
        if store.segment_set().is_none() {
            return Err(PoolSetError::NoSegments(store.mode()));
        }
        let pages = Self::page_count(cfg, api)?;
        Ok(Self {
            cfg: cfg.clone(),
            target_token_bytes: api.target_token_bytes,
            layer_split: api.layer_split.clone(),
            page_tokens: api.page_tokens,
            layout: api.layout,
            pages,
            store,
            registrar,
            attached: Mutex::new(None),
            #[cfg(feature = "negative-controls")]
            draft_override: None,
        })
    }

    /// Negative control of seed 000 (feature `negative-controls`): the draft pool is carved from
    /// `allocator` (a plain mmap allocator in the tests) instead of the store client's.
    #[cfg(feature = "negative-controls")]
    pub fn with_draft_allocator(mut self, allocator: Allocator) -> Self {
        self.draft_override = Some(allocator);
        self
    }

    /// Applies [`NC_DRAFT_ON_MMAP_ENV`] when it names this worker's pool (feature
    /// `negative-controls`; without it, `self` unchanged).
    fn with_negative_controls_from_env(self) -> Self {
        #[cfg(feature = "negative-controls")]
        if std::env::var(NC_DRAFT_ON_MMAP_ENV).is_ok_and(|v| v.trim() == self.cfg.pool) {
            tracing::warn!(
                pool = %self.cfg.pool,
                "negative control: the draft pool is carved from plain mmap (seed 000's bug)"
            );
            return self.with_draft_allocator(Allocator::new(
                "default host allocator (negative control)",
                crate::memory::mmap::MmapBackend::new(),
            ));
        }
        self
    }

    /// The allocator `role`'s pool is carved from: the store client's.
    fn allocator_for(&self, role: PoolRole) -> &Allocator {
        #[cfg(feature = "negative-controls")]
        if role == PoolRole::Draft
            && let Some(a) = &self.draft_override
        {
            return a;
        }
        let _ = role;
        self.store.host_allocator()
    }

    /// Seed 000's preflight across the pools of one attach, before any of them is allocated or
    /// registered: each must come from the store client's own allocator (its segments are the only
    /// memory it can register, and the only memory an engine process can map).
    ///
    /// # Errors
    /// FAILED_PRECONDITION / `POOL_DOMAIN_MISMATCH` naming the first pool (`pools.<role>`) whose
    /// allocator is another one, with both allocators' descriptions as the two sides.
    fn preflight(&self, roles: &[PoolRole]) -> Result<(), ApiError> {
        let store = self.store.host_allocator();
        for &role in roles {
            let a = self.allocator_for(role);
            if a.id() != store.id() {
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::PoolDomainMismatch,
                    format!(
                        "the {role} pool would be carved from {}, outside the {} store client's \
                         segments ({}): it could not be registered nor mapped by the engine; \
                         nothing was allocated or registered (seed 000)",
                        a.describe(),
                        self.store.mode(),
                        store.describe()
                    ),
                )
                .field(format!("pools.{role}"))
                .sides(store.describe(), a.describe()));
            }
        }
        Ok(())
    }

    /// Pools for a worker without a CacheTier: one worker-owned memfd segment of
    /// [`PoolSet::bytes_needed`], nothing registered.
    ///
    /// # Errors
    /// As [`PoolSet::new`], and [`PoolSetError::Segment`] when the segment cannot be created.
    pub fn unregistered(cfg: &WorkerConfig, api: &EngineApiConfig) -> Result<Self, PoolSetError> {
        let client = EmbeddedClient::new(crate::memory::segment::SegmentBackend::Memfd);
        if cfg.memory.allocator != AllocatorDomain::SharedMemory {
            return Err(PoolSetError::DomainNotShareable(cfg.memory.allocator));
        }
        let bytes = Self::bytes_needed(cfg, api)?;
        client
            .reserve(usize::try_from(bytes).unwrap_or(usize::MAX))
            .map_err(|e| PoolSetError::Segment(e.to_string()))?;
        Self::new(cfg, api, Arc::new(client), None)
    }

    /// The pools of a worker as its config says (DESIGN §3.1 "Attach", contracts 1–2): without a
    /// CacheTier, [`PoolSet::unregistered`]; with `clientMode: Embedded`, an in-process store client
    /// over memfd segments of [`PoolSet::bytes_needed`] bytes; with `Standalone`, the sidecar's
    /// segments, reached over its socket `sidecar_socket` (seed 000: only buffers inside them
    /// register). With a CacheTier, pools register through a [`Registrar`] under
    /// `memory.registrationFailure`, reporting into `health` and `metrics`.
    ///
    /// # Errors
    /// As [`PoolSet::new`]; [`PoolSetError::Segment`] when the store client cannot be reached or
    /// cannot reserve the segments.
    pub fn from_config(
        cfg: &WorkerConfig,
        api: &EngineApiConfig,
        health: Arc<crate::health::Health>,
        metrics: crate::registration::metrics::RegistrationMetrics,
        sidecar_socket: &std::path::Path,
    ) -> Result<Self, PoolSetError> {
        use crate::store_client::ClientMode;
        let bytes = usize::try_from(Self::bytes_needed(cfg, api)?).unwrap_or(usize::MAX);
        let store: Arc<dyn StoreClient> = match cfg.memory.client_mode {
            None => return Self::unregistered(cfg, api),
            Some(ClientMode::Embedded) => {
                let client = EmbeddedClient::new(crate::memory::segment::SegmentBackend::Memfd);
                client
                    .reserve(bytes)
                    .map_err(|e| PoolSetError::Segment(e.to_string()))?;
                Arc::new(client)
            }
            Some(ClientMode::Standalone) => {
                let worker = std::env::var("POD_NAME").unwrap_or_else(|_| cfg.pool.clone());
                // The sidecar starts first but may not listen yet: wait for it, bounded.
                let deadline = std::time::Instant::now() + SIDECAR_WAIT;
                let client = loop {
                    match crate::store_client::standalone::StandaloneClient::connect(
                        sidecar_socket,
                        &worker,
                    ) {
                        Ok(c) => break c,
                        Err(_) if std::time::Instant::now() < deadline => {
                            std::thread::sleep(std::time::Duration::from_millis(50));
                        }
                        Err(e) => {
                            return Err(PoolSetError::Segment(format!(
                                "store-client sidecar at {} (waited {} s): {e}",
                                sidecar_socket.display(),
                                SIDECAR_WAIT.as_secs()
                            )));
                        }
                    }
                };
                client
                    .reserve(bytes)
                    .map_err(|e| PoolSetError::Segment(e.to_string()))?;
                Arc::new(client)
            }
        };
        let registrar = Arc::new(Registrar::new(
            store.clone(),
            health,
            metrics,
            crate::registration::RegistrarConfig {
                policy: cfg.memory.registration_failure,
                ..crate::registration::RegistrarConfig::default()
            },
        ));
        Ok(Self::new(cfg, api, store, Some(registrar))?.with_negative_controls_from_env())
    }

    fn lock(&self) -> MutexGuard<'_, Option<Vec<AttachedPool>>> {
        self.attached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Pages of every pool.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// The store client.
    pub fn store(&self) -> &Arc<dyn StoreClient> {
        &self.store
    }

    /// The registrar, when a CacheTier is configured.
    pub fn registrar(&self) -> Option<&Arc<Registrar>> {
        self.registrar.as_ref()
    }

    /// The allocated pools (empty before the first attach).
    pub fn attached(&self) -> Vec<AttachedPool> {
        self.lock().clone().unwrap_or_default()
    }

    /// The allocated pool of `role`.
    pub fn pool(&self, role: PoolRole) -> Option<Arc<KvPool>> {
        self.lock()
            .as_ref()?
            .iter()
            .find(|p| p.role == role)
            .map(|p| p.pool.clone())
    }

    /// Allocates and registers `roles` as one transaction, or returns the pools a previous attach
    /// allocated (the roles must then be the same).
    ///
    /// # Errors
    /// `IDENTITY_MISMATCH` (field `pools`) when a previous attach had other pools;
    /// `POOL_ALLOCATION_FAILED` or `POOL_REGISTRATION_FAILED` after a rollback of every pool of the
    /// transaction.
    pub fn attach(&self, roles: &[PoolRole]) -> Result<Vec<AttachedPool>, ApiError> {
        let mut slot = self.lock();
        if let Some(existing) = slot.as_ref() {
            let have: Vec<PoolRole> = existing.iter().map(|p| p.role).collect();
            if have != roles {
                let names =
                    |r: &[PoolRole]| r.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(",");
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::IdentityMismatch,
                    "a previous attach of this worker allocated other pools; attach with the same pools",
                )
                .field("pools")
                .sides(names(&have), names(roles)));
            }
            return Ok(existing.clone());
        }
        self.preflight(roles)?;
        let mut done: Vec<AttachedPool> = Vec::new();
        for &role in roles {
            match self.allocate(role) {
                Ok(p) => done.push(p),
                Err(e) => {
                    self.roll_back(done);
                    return Err(e);
                }
            }
        }
        *slot = Some(done.clone());
        Ok(done)
    }

    fn spec(&self, role: PoolRole) -> Result<PoolSpec, ApiError> {
        let model = sized_model(
            &self.cfg,
            role,
            self.target_token_bytes,
            self.layer_split.as_ref(),
        )
        .ok_or_else(|| ApiError::internal(format!("no model for the {role} pool")))?;
        Ok(PoolSpec {
            role,
            model,
            page_tokens: self.page_tokens,
            pages: self.pages,
            layout: self.layout,
        })
    }

    fn allocate(&self, role: PoolRole) -> Result<AttachedPool, ApiError> {
        let spec = self.spec(role)?;
        let allocator = self.allocator_for(role);
        let (pool, registration) = match &self.registrar {
            None => {
                let pool = KvPool::new(spec, allocator).map_err(|e| alloc_failed(role, &e))?;
                (Arc::new(pool), Registration::None)
            }
            Some(registrar) => match registrar.attach(spec.clone(), allocator) {
                Ok(AttachOutcome::Committed(c)) => (c.pool.clone(), Registration::Committed),
                Ok(AttachOutcome::FallbackL2 { failure }) => {
                    // The transaction destroyed its pool; the pool serves without L3.
                    let pool = KvPool::new(spec, allocator).map_err(|e| alloc_failed(role, &e))?;
                    (
                        Arc::new(pool),
                        Registration::FallbackL2(failure.to_string()),
                    )
                }
                Err(failure) => {
                    let (code, reason) = if failure.phase == Phase::Allocate {
                        (
                            Code::ResourceExhausted,
                            pb::ErrorReason::PoolAllocationFailed,
                        )
                    } else {
                        (
                            Code::FailedPrecondition,
                            pb::ErrorReason::PoolRegistrationFailed,
                        )
                    };
                    return Err(ApiError::new(code, reason, failure.to_string())
                        .field(format!("pools.{role}")));
                }
            },
        };
        let placement = pool.buffer().placement().cloned();
        let Some(placement) = placement else {
            let e = ApiError::internal(format!(
                "the {role} pool's buffer lies in no segment (allocator {})",
                allocator.describe()
            ));
            self.roll_back(vec![AttachedPool {
                role,
                pool,
                registration,
                segment: 0,
                offset: 0,
            }]);
            return Err(e);
        };
        Ok(AttachedPool {
            role,
            pool,
            registration,
            segment: placement.segment,
            offset: placement.offset,
        })
    }

    fn roll_back(&self, pools: Vec<AttachedPool>) {
        for p in pools.into_iter().rev() {
            let role = p.role;
            match p.registration {
                Registration::Committed => {
                    drop(p.pool);
                    if let Some(r) = &self.registrar
                        && let Err(e) = r.detach(role)
                    {
                        tracing::error!(%role, error = %e, "rolling back the pool's registration failed");
                    }
                }
                Registration::None | Registration::FallbackL2(_) => match Arc::try_unwrap(p.pool) {
                    Ok(pool) => {
                        if let Err(e) = pool.destroy() {
                            tracing::error!(%role, error = %e, "destroying a rolled-back pool failed");
                        }
                    }
                    Err(_) => tracing::error!(%role, "rolled-back pool still referenced"),
                },
            }
        }
    }

    /// Duplicates of the segment fds of the allocated pools, in `fd_index` order.
    ///
    /// # Errors
    /// `INTERNAL` when a segment is gone or its fd cannot be duplicated.
    pub fn export_fds(&self) -> Result<Vec<OwnedFd>, ApiError> {
        let set = self
            .store
            .segment_set()
            .ok_or_else(|| ApiError::internal("the store client has no segments"))?;
        self.attached()
            .iter()
            .map(|p| {
                set.dup_fd(p.segment)
                    .ok_or_else(|| ApiError::internal(format!("segment {} is gone", p.segment)))?
                    .map_err(|e| ApiError::internal(format!("dup of segment {}: {e}", p.segment)))
            })
            .collect()
    }

    /// Teardown (DESIGN contract 9): deregisters and frees every pool with the allocator that made it.
    /// Callers drop every other reference to the pools first; a pool still referenced is reported.
    /// Returns the errors, one line each.
    pub fn release(&self) -> Vec<String> {
        let Some(pools) = self.lock().take() else {
            return Vec::new();
        };
        let mut errors = Vec::new();
        let mut registered = false;
        for p in pools.into_iter().rev() {
            let role = p.role;
            match p.registration {
                Registration::Committed => {
                    registered = true;
                    drop(p.pool);
                }
                _ => match Arc::try_unwrap(p.pool) {
                    Ok(pool) => {
                        if let Err(e) = pool.destroy() {
                            errors.push(format!("{role}: {e}"));
                        }
                    }
                    Err(_) => errors.push(format!("{role}: pool still referenced at release")),
                },
            }
        }
        if registered && let Some(r) = &self.registrar {
            errors.extend(
                r.detach_all()
                    .into_iter()
                    .map(|(role, e)| format!("{role}: {e}")),
            );
        }
        errors
    }
}

fn alloc_failed(role: PoolRole, e: &crate::memory::pool::PoolError) -> ApiError {
    ApiError::new(
        Code::ResourceExhausted,
        pb::ErrorReason::PoolAllocationFailed,
        format!("allocating the {role} pool failed: {e}"),
    )
    .field(format!("pools.{role}"))
}
