//! Registration of a KV pool with the L3 store as one transaction (DESIGN contract 2; seed 000 §建议的
//! 注册与回滚模型; reference/dataplane.md R-REG-1, R-REG-3).
//!
//! ```text
//! ALLOCATED ──preflight ok──▶ REGISTERING ──all ok──▶ COMMITTED
//!     │                           │
//!     └──── any failure ──────────┴──▶ undo registrations in reverse order
//!                                      (an undo that fails quarantines that registration and the memory)
//!                                      destroy the pool exactly once
//!                                      ──▶ FAILED (failClosed) or FALLBACK_L2 (fallbackToL2)
//! ```
//!
//! Invariant: nothing is visible to other components before COMMITTED. The only shared state is the
//! [`PoolMap`]: a committed entry carries the pool, its registrations and — because consumers look pools
//! up there — the callbacks' target, all inserted by one map insert. The seed's failure was the opposite
//! order (`registered_pools[DRAFT] = pool` before `register_buffer`); `TxnOrder::UnsafeLegacy` keeps that
//! order as a negative control for the tests (feature `negative-controls`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::health::Health;
use crate::memory::pool::{KvPool, PoolError, PoolRole, PoolSpec};
use crate::memory::{Allocator, MemoryError};
use crate::store_client::{BufferRef, ClientMode, StoreClient};

use super::metrics::RegistrationMetrics;
use super::registry::{DeregisterError, RegisterError, RegistrationId, Registry};

/// What to do when registering a pool fails (DESIGN §2/§3 contract 2); named in the worker config,
/// so it lives in `tandem-interfaces` (worker/interfaces/README.md §2).
pub use tandem_interfaces::memory::FailurePolicy;

/// Transaction states (DESIGN contract 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnState {
    /// The pool exists only locally.
    Allocated,
    /// Registrations exist only in the transaction's temporary list.
    Registering,
    /// Pool, registrations and lookups became visible together.
    Committed,
    /// Rolled back; the pool runs without L3.
    FallbackL2,
    /// Rolled back; startup must fail.
    Failed,
}

/// The step that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Phase {
    /// Allocating the pool's buffer.
    Allocate,
    /// Domain, segment, size and overlap checks, before any external call.
    Preflight,
    /// The external registrations.
    Register,
    /// Publishing to the pool map.
    Commit,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Allocate => "allocate",
            Phase::Preflight => "preflight",
            Phase::Register => "register",
            Phase::Commit => "commit",
        })
    }
}

/// Order of operations — the safe transaction, or the seed's order kept as a negative control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TxnOrder {
    /// Preflight, register into a temporary list, commit, roll back on failure.
    #[default]
    Transactional,
    /// Test-only negative control reproducing seed 000: publish first, no preflight, no rollback.
    #[cfg(feature = "negative-controls")]
    UnsafeLegacy,
}

/// Registrar settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistrarConfig {
    /// Failure policy.
    pub policy: FailurePolicy,
    /// Largest single registration; a pool buffer is registered as ⌈len / max⌉ consecutive ranges
    /// (reference/dataplane.md R-REG-2: split at the MR size limit).
    pub max_registration_bytes: usize,
    /// Order of operations.
    pub order: TxnOrder,
}

impl Default for RegistrarConfig {
    fn default() -> Self {
        Self {
            policy: FailurePolicy::FailClosed,
            max_registration_bytes: 1 << 30,
            order: TxnOrder::Transactional,
        }
    }
}

/// A pool that is registered and visible.
#[derive(Debug)]
pub struct CommittedPool {
    /// The pool.
    pub pool: Arc<KvPool>,
    /// Its registrations, in registration order.
    pub registrations: Vec<RegistrationId>,
}

/// The committed pools by role: the only registration state other components can see.
#[derive(Debug, Default)]
pub struct PoolMap {
    pools: Mutex<BTreeMap<PoolRole, Arc<CommittedPool>>>,
}

impl PoolMap {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<PoolRole, Arc<CommittedPool>>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// The committed pool of `role`.
    pub fn get(&self, role: PoolRole) -> Option<Arc<CommittedPool>> {
        self.lock().get(&role).cloned()
    }
    /// Roles with a committed pool.
    pub fn roles(&self) -> Vec<PoolRole> {
        self.lock().keys().copied().collect()
    }
    /// Number of committed pools.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
    /// Whether no pool is committed.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// What happened to the registrations on the failure path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UndoReport {
    /// Registrations undone, in the order they were undone (reverse of registration).
    pub undone: Vec<RegistrationId>,
    /// Registrations whose undo failed, now quarantined.
    pub quarantined: Vec<RegistrationId>,
    /// Whether the pool's memory was freed (false: quarantined, or never allocated).
    pub pool_freed: bool,
}

/// Why a transaction failed.
#[derive(Debug, thiserror::Error)]
pub enum FailureCause {
    /// Building the pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A registration or preflight check failed.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// A pool of this role is already committed.
    #[error("a {0} pool is already registered")]
    AlreadyCommitted(PoolRole),
}

/// A failed registration transaction: the fail-closed startup error (seed 000 acceptance: "fail-closed
/// 模式输出 allocator 类型、client mode、buffer 大小和失败阶段").
#[derive(Debug, thiserror::Error)]
#[error("registering the {role} KV pool failed in phase {phase} (allocator {allocator}, client mode {client_mode}, buffer {buffer_bytes} B): {cause}; rolled back: {} undone, {} quarantined, pool {}",
    undo.undone.len(), undo.quarantined.len(), if undo.pool_freed { "freed" } else { "not freed" })]
pub struct RegistrationFailure {
    /// Pool role.
    pub role: PoolRole,
    /// Failing phase.
    pub phase: Phase,
    /// The allocator the pool used (name, kind, domain).
    pub allocator: String,
    /// The store client's mode.
    pub client_mode: ClientMode,
    /// Pool buffer size in bytes.
    pub buffer_bytes: usize,
    /// What failed.
    pub cause: FailureCause,
    /// What the rollback did.
    pub undo: UndoReport,
}

/// Result of [`Registrar::attach`] when startup may continue.
#[derive(Debug)]
pub enum AttachOutcome {
    /// Committed: visible in the pool map.
    Committed(Arc<CommittedPool>),
    /// Rolled back under `fallbackToL2`.
    FallbackL2 {
        /// The failure that caused it.
        failure: Box<RegistrationFailure>,
    },
}

impl AttachOutcome {
    /// The transaction's final state.
    pub fn state(&self) -> TxnState {
        match self {
            AttachOutcome::Committed(_) => TxnState::Committed,
            AttachOutcome::FallbackL2 { .. } => TxnState::FallbackL2,
        }
    }
}

/// Errors of [`Registrar::detach`].
#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    /// No pool of that role is committed.
    #[error("no {0} pool is registered")]
    NotCommitted(PoolRole),
    /// Deregistration was refused or failed.
    #[error(transparent)]
    Deregister(#[from] DeregisterError),
    /// Destroying the pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// Registers pools with one store client, transactionally.
#[derive(Debug)]
pub struct Registrar {
    registry: Arc<Registry>,
    pools: Arc<PoolMap>,
    health: Arc<Health>,
    metrics: RegistrationMetrics,
    config: RegistrarConfig,
}

impl Registrar {
    /// A registrar over `client`.
    pub fn new(
        client: Arc<dyn StoreClient>,
        health: Arc<Health>,
        metrics: RegistrationMetrics,
        config: RegistrarConfig,
    ) -> Self {
        Self {
            registry: Arc::new(Registry::new(client)),
            pools: Arc::new(PoolMap::default()),
            health,
            metrics,
            config,
        }
    }

    /// The registration table.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }
    /// The committed pools.
    pub fn pools(&self) -> &Arc<PoolMap> {
        &self.pools
    }
    /// The store client.
    pub fn client(&self) -> &Arc<dyn StoreClient> {
        self.registry.client()
    }
    /// The metrics.
    pub fn metrics(&self) -> &RegistrationMetrics {
        &self.metrics
    }

    /// Allocates a pool from `allocator` and registers it as one transaction.
    ///
    /// # Errors
    /// Under `failClosed`, the [`RegistrationFailure`] (boxed); under `fallbackToL2` failures return
    /// `Ok(AttachOutcome::FallbackL2)` instead.
    pub fn attach(
        &self,
        spec: PoolSpec,
        allocator: &Allocator,
    ) -> Result<AttachOutcome, Box<RegistrationFailure>> {
        let role = spec.role;
        let failure = |phase, cause: FailureCause, undo, buffer_bytes| RegistrationFailure {
            role,
            phase,
            allocator: allocator.describe(),
            client_mode: self.client().mode(),
            buffer_bytes,
            cause,
            undo,
        };
        // ALLOCATED: the pool exists only here.
        let planned = spec.bytes().unwrap_or(0);
        let pool = match KvPool::new(spec, allocator) {
            Ok(p) => p,
            Err(e) => {
                let f = failure(Phase::Allocate, e.into(), UndoReport::default(), planned);
                return self.conclude(f);
            }
        };
        let bytes = pool.buffer().len();
        let ranges = self.split(&pool);

        #[cfg(feature = "negative-controls")]
        if self.config.order == TxnOrder::UnsafeLegacy {
            return self.attach_legacy(pool, ranges).map_err(|(phase, cause)| {
                Box::new(failure(phase, cause, UndoReport::default(), bytes))
            });
        }

        // Preflight: every check that can be made without a side effect.
        let preflight = if self.pools.get(role).is_some() {
            Err(FailureCause::AlreadyCommitted(role))
        } else {
            ranges
                .iter()
                .try_for_each(|r| self.registry.check(r).map(|_| ()))
                .map_err(FailureCause::from)
        };
        if let Err(cause) = preflight {
            let undo = self.undo(role, pool, Vec::new());
            return self.conclude(failure(Phase::Preflight, cause, undo, bytes));
        }

        // REGISTERING: a temporary list, invisible to everyone else.
        let mut registered = Vec::with_capacity(ranges.len());
        for range in &ranges {
            match self.registry.register(range) {
                Ok(id) => registered.push(id),
                Err(e) => {
                    let undo = self.undo(role, pool, registered);
                    return self.conclude(failure(Phase::Register, e.into(), undo, bytes));
                }
            }
        }

        // COMMITTED: one insert publishes pool, registrations and lookups together.
        let mut map = self.pools.lock();
        if map.contains_key(&role) {
            drop(map);
            let undo = self.undo(role, pool, registered);
            let cause = FailureCause::AlreadyCommitted(role);
            return self.conclude(failure(Phase::Commit, cause, undo, bytes));
        }
        let committed = Arc::new(CommittedPool {
            pool: Arc::new(pool),
            registrations: registered,
        });
        map.insert(role, committed.clone());
        drop(map);
        self.metrics
            .commits
            .get_or_create(&RegistrationMetrics::label(role))
            .inc();
        self.health.recover(&component(role));
        tracing::info!(%role, bytes, registrations = committed.registrations.len(), "KV pool registered");
        Ok(AttachOutcome::Committed(committed))
    }

    /// Seed 000's order, for the negative control only: publish, then register, never roll back.
    #[cfg(feature = "negative-controls")]
    fn attach_legacy(
        &self,
        pool: KvPool,
        ranges: Vec<BufferRef>,
    ) -> Result<AttachOutcome, (Phase, FailureCause)> {
        let role = pool.role();
        let pool = Arc::new(pool);
        let mut registered = Vec::new();
        self.pools.lock().insert(
            role,
            Arc::new(CommittedPool {
                pool: pool.clone(),
                registrations: Vec::new(),
            }),
        );
        for range in &ranges {
            registered.push(
                self.registry
                    .register(range)
                    .map_err(|e| (Phase::Register, e.into()))?,
            );
        }
        let committed = Arc::new(CommittedPool {
            pool,
            registrations: registered,
        });
        self.pools.lock().insert(role, committed.clone());
        Ok(AttachOutcome::Committed(committed))
    }

    /// The registration ranges of a pool: its buffer cut at `max_registration_bytes`.
    fn split(&self, pool: &KvPool) -> Vec<BufferRef> {
        let buffer = pool.buffer();
        let max = self.config.max_registration_bytes.max(1);
        (0..buffer.len())
            .step_by(max)
            .filter_map(|off| BufferRef::sub_range(buffer, off, max.min(buffer.len() - off)))
            .collect()
    }

    /// Undoes `registered` in reverse order and destroys the pool exactly once: freed if every undo
    /// succeeded, quarantined otherwise.
    fn undo(&self, role: PoolRole, pool: KvPool, registered: Vec<RegistrationId>) -> UndoReport {
        let label = RegistrationMetrics::label(role);
        let mut report = UndoReport::default();
        for id in registered.into_iter().rev() {
            match self.registry.deregister(&[id]) {
                Ok(()) => report.undone.push(id),
                Err(e) => {
                    tracing::error!(%role, %id, error = %e, "undo failed; registration and memory quarantined");
                    self.registry.quarantine(id);
                    self.metrics.quarantined.get_or_create(&label).inc();
                    report.quarantined.push(id);
                }
            }
        }
        if report.quarantined.is_empty() {
            match pool.destroy() {
                Ok(()) => report.pool_freed = true,
                Err(e) => {
                    tracing::error!(%role, error = %e, "destroying the rolled-back pool failed")
                }
            }
        } else {
            pool.quarantine();
        }
        self.metrics.rollbacks.get_or_create(&label).inc();
        report
    }

    /// Applies the failure policy.
    fn conclude(
        &self,
        failure: RegistrationFailure,
    ) -> Result<AttachOutcome, Box<RegistrationFailure>> {
        match self.config.policy {
            FailurePolicy::FailClosed => {
                tracing::error!(error = %failure, "KV pool registration failed (failClosed)");
                Err(Box::new(failure))
            }
            FailurePolicy::FallbackToL2 => {
                let role = failure.role;
                tracing::warn!(error = %failure, "KV pool registration failed; L3 disabled for this pool, continuing on L2 (fallbackToL2)");
                self.metrics
                    .fallback
                    .get_or_create(&RegistrationMetrics::label(role))
                    .inc();
                self.health.degrade(
                    &component(role),
                    "RegistrationFallbackToL2",
                    failure.to_string(),
                );
                Ok(AttachOutcome::FallbackL2 {
                    failure: Box::new(failure),
                })
            }
        }
    }

    /// Runtime detach (and teardown): validates that every registration of the pool can go (none in
    /// flight), removes the pool from the map, deregisters in reverse order and destroys the pool.
    ///
    /// # Errors
    /// [`DetachError::NotCommitted`]; [`DetachError::Deregister`] (`Busy` leaves everything as it was;
    /// a store failure quarantines the rest); [`DetachError::Pool`] from the destroy.
    pub fn detach(&self, role: PoolRole) -> Result<(), DetachError> {
        let mut map = self.pools.lock();
        let entry = map.get(&role).ok_or(DetachError::NotCommitted(role))?;
        let mut ids = entry.registrations.clone();
        ids.reverse();
        self.registry.check_deregister(&ids)?;
        let entry = map.remove(&role).ok_or(DetachError::NotCommitted(role))?;
        drop(map);
        let mut failed = None;
        for id in ids {
            if failed.is_some() {
                self.registry.quarantine(id);
                continue;
            }
            if let Err(e) = self.registry.deregister(&[id]) {
                self.registry.quarantine(id);
                failed = Some(e);
            }
        }
        let pool = match Arc::try_unwrap(entry) {
            Ok(committed) => Arc::try_unwrap(committed.pool).ok(),
            Err(_) => None,
        };
        match (pool, failed) {
            (Some(pool), None) => pool.destroy()?,
            (Some(pool), Some(e)) => {
                pool.quarantine();
                return Err(e.into());
            }
            (None, failed) => {
                // Someone still holds the pool; its memory is freed when the last reference goes.
                tracing::warn!(%role, "pool still referenced at detach; freed when released");
                if let Some(e) = failed {
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Detaches every committed pool (teardown, DESIGN contract 9 "deregister"), target last.
    /// Returns the errors, one per failing role.
    pub fn detach_all(&self) -> Vec<(PoolRole, DetachError)> {
        let mut roles = self.pools.roles();
        roles.sort_by_key(|r| std::cmp::Reverse(*r));
        roles
            .into_iter()
            .filter_map(|r| self.detach(r).err().map(|e| (r, e)))
            .collect()
    }

    /// Adds the memory steps to the process teardown (DESIGN contract 9): in `Deregister`, detach every
    /// pool (deregister in reverse, destroy with its allocator); in `FreeMemory`, shut the store client
    /// down (segments released, POSIX shm names unlinked).
    pub fn install_teardown(self: &Arc<Self>, teardown: &crate::teardown::Teardown) {
        use crate::teardown::TeardownPhase;
        let me = self.clone();
        teardown.register(TeardownPhase::Deregister, "detach KV pools", move || {
            let errors = me.detach_all();
            if errors.is_empty() {
                Ok(())
            } else {
                Err(errors
                    .iter()
                    .map(|(role, e)| format!("{role}: {e}"))
                    .collect::<Vec<_>>()
                    .join("; "))
            }
        });
        let me = self.clone();
        teardown.register(
            TeardownPhase::FreeMemory,
            "shut down store client",
            move || me.client().shutdown().map_err(|e| e.to_string()),
        );
    }

    /// Health with the registration counters filled in.
    pub fn health_report(&self) -> crate::health::HealthReport {
        let mut report = self.health.report();
        report.registrations = self.registry.active_count();
        report.quarantined_registrations = self.registry.quarantined_count();
        report.quarantined_bytes = self.client().host_allocator().stats().quarantined_bytes;
        report
    }
}

fn component(role: PoolRole) -> String {
    format!("l3/{role}")
}

/// Memory errors are a pool cause too.
impl From<MemoryError> for FailureCause {
    fn from(e: MemoryError) -> Self {
        FailureCause::Pool(PoolError::Memory(e))
    }
}
