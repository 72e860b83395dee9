//! The three controllers (I/O). Module map:
//!
//! - [`pool`]: the one staged reconcile of both pool kinds — read ([`pool::observe`], the kind's
//!   reads) → validate (pure, a typed [`refusal::Refusal`]) → the desired set as a value (pure,
//!   [`pool::Desired`]) → apply ([`pool::apply`]) → status (pure, [`pool::status`]);
//!   [`prefill_pool`] and [`decode_pool`] supply what differs ([`pool::PoolKind`]);
//! - [`cache_tier`]: the CacheTier;
//! - shared by all three: [`blocked`] (the report of a refused or terminating resource),
//!   [`teardown`] (the writes of each teardown step), [`children`] (every read and write of
//!   children, with the skip-when-unchanged rules), [`revision`] (tier read, policy resolution,
//!   pair revision), [`probe`] (a cache replica's `/report`);
//! - [`run`]: wiring of the controllers and their watches ([`watches`]: failures are warnings
//!   with their back-off and show in `/readyz`), and the error policy ([`backoff`]: per object,
//!   exponential with a cap, reset on success).
//!
//! Every reconcile:
//! - applies a child only when it is missing, its `serving.tandem.dev/desired-hash` annotation
//!   differs from the hash of the desired object, or (StatefulSets) its `spec.replicas` drifted;
//!   patches status only when the recomputed status differs; publishes events only for decisions
//!   (a transition, an action taken). A steady-state resync therefore makes zero writes;
//! - once `deletionTimestamp` is set, runs only the teardown steps of [`crate::teardown`]: it
//!   never creates or applies a child (scale-to-zero goes through the `/scale` subresource, which
//!   cannot create).
//!
//! A reconcile reads its own object fresh (a quorum GET) and the rest — children, tiers, the
//! pair — from watch-fed caches ([`cache`]; one watch per kind for the whole operator, which also
//! triggers the controllers); it lists children only to confirm a decision that deletes (a pod or
//! a group's StatefulSet) and in teardown. Without the caches (a [`Context`] that [`run`] did not
//! start, as in the controller tests) every read goes to the API server.

pub mod backoff;
pub mod blocked;
pub mod cache;
pub mod cache_tier;
pub mod children;
pub mod decode_pool;
pub mod pool;
pub mod prefill_pool;
pub mod probe;
pub mod refusal;
pub mod revision;
pub mod run;
pub mod teardown;
pub mod watches;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use self::backoff::ErrorBackoff;
use self::watches::WatchHealth;
use crate::metrics::Metrics;

/// The finalizer that holds a resource until its teardown steps are done (DESIGN §5).
pub const FINALIZER: &str = "serving.tandem.dev/teardown";
/// Annotation with the hash of the desired object last applied.
pub const DESIRED_HASH: &str = "serving.tandem.dev/desired-hash";

/// Default requeue interval of a settled resource (a safety resync; watches do the real work).
/// [`Context::resync`] holds the interval in use (`tandem-operator --resync-seconds`).
pub const RESYNC: Duration = Duration::from_secs(300);
/// Requeue interval while something is moving (rollout, teardown, pending scale-up, warming).
pub const BUSY: Duration = Duration::from_secs(5);

/// Behaviours that remove a safety mechanism, for negative controls: tests assert that each one
/// makes the corresponding test fail. Compiled only with the cargo feature `negative-controls`,
/// which the crate's tests enable (a dev-dependency of the crate on itself) and a release build
/// of the binary does not.
#[cfg(feature = "negative-controls")]
#[derive(Debug, Clone, Copy, Default)]
pub struct UnsafeModes {
    /// Apply every child on every reconcile, skipping the desired-hash comparison.
    pub always_apply: bool,
    /// Ignore `deletionTimestamp` and run the normal reconcile.
    pub reconcile_while_deleting: bool,
    /// Decide from the object the reconcile was handed (the reflector's copy, possibly older
    /// than the operator's last status write) instead of a fresh read.
    pub trust_cached_status: bool,
    /// Act on a delete decided from the child caches without listing the children again.
    pub act_on_cached_children: bool,
}

/// Default of `tandem-operator --max-concurrent-reconciles` (per kind).
pub const DEFAULT_MAX_CONCURRENT_RECONCILES: u16 = 32;

/// Per-kind limits on reconciles doing their reads and writes at once (controller-runtime's
/// `MaxConcurrentReconciles`; kube-runtime's own `concurrency` would also hide the waiting ones
/// from the queue-depth gauge). Cheap to clone (clones share the slots).
#[derive(Debug, Clone)]
pub struct ReconcileSlots {
    per_kind: u16,
    kinds: Arc<std::sync::Mutex<std::collections::BTreeMap<&'static str, Arc<Semaphore>>>>,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl ReconcileSlots {
    /// `per_kind` slots for each kind (at least 1).
    pub fn new(per_kind: u16) -> Self {
        Self {
            per_kind: per_kind.max(1),
            kinds: Arc::default(),
            closed: Arc::default(),
        }
    }

    /// Waits for a slot of `kind`; the slot is held until the permit drops. `None` once
    /// [`ReconcileSlots::close`]d (at shutdown): the reconcile must not run.
    pub async fn acquire(&self, kind: &'static str) -> Option<OwnedSemaphorePermit> {
        use std::sync::atomic::Ordering;
        let sem = self.kinds.lock().ok().map(|mut m| {
            let sem = m
                .entry(kind)
                .or_insert_with(|| Arc::new(Semaphore::new(usize::from(self.per_kind))))
                .clone();
            if self.closed.load(Ordering::SeqCst) {
                sem.close();
            }
            sem
        })?;
        sem.acquire_owned().await.ok()
    }

    /// Shutdown: every waiting and later [`ReconcileSlots::acquire`] answers `None` (the
    /// reconciles already running finish; the queue behind them is not worked off — the watches
    /// have stopped, and a deposed leader must stop writing).
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Ok(m) = self.kinds.lock() {
            for sem in m.values() {
                sem.close();
            }
        }
    }
}

/// Shared state of the controllers.
#[derive(Clone)]
pub struct Context {
    /// API client.
    pub client: Client,
    /// Event recorder (events.k8s.io/v1).
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Metrics,
    /// Probe cache replicas' `/report` for `CacheWarm` (off in tests without a network, and on
    /// simulated nodes, whose pods serve nothing: `CacheWarm` then says `ReadyApproximation`).
    pub probe_reports: bool,
    /// Requeue interval of a settled resource (default [`RESYNC`]; shorter in the scale harness,
    /// which measures the writes of steady resyncs).
    pub resync: Duration,
    /// Per-object failure counts for the error policy.
    pub error_backoff: Arc<ErrorBackoff>,
    /// Which watches are failing (read by `/readyz`).
    pub watches: WatchHealth,
    /// Whether [`run::run`] hands its caches to the reconciles (default); `false`, every
    /// reconcile reads from the API server (`tandem-operator --read-cache false`, a baseline).
    pub read_cache: bool,
    /// How many reconciles of each kind do their reads and writes at once.
    pub reconcile_slots: ReconcileSlots,
    /// Applies on their way to the caches (`children::apply_if_changed`; cleared by the watches).
    pub pending_applies: cache::PendingApplies,
    /// The caches while [`run::run`] runs them; `None`, reads go to the API server.
    pub caches: Arc<std::sync::RwLock<Option<cache::Caches>>>,
    /// Negative-control switches (tests only).
    #[cfg(feature = "negative-controls")]
    pub unsafe_modes: UnsafeModes,
}

impl Context {
    /// A context with the reporter `tandem-operator` (instance: `$POD_NAME` when set).
    pub fn new(client: Client, metrics: Metrics) -> Self {
        let reporter = Reporter {
            controller: crate::labels::FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            watches: WatchHealth::with_gauge(metrics.watches_failing.clone()),
            metrics,
            probe_reports: true,
            resync: RESYNC,
            error_backoff: Arc::default(),
            read_cache: true,
            pending_applies: cache::PendingApplies::default(),
            reconcile_slots: ReconcileSlots::new(DEFAULT_MAX_CONCURRENT_RECONCILES),
            caches: Arc::default(),
            #[cfg(feature = "negative-controls")]
            unsafe_modes: UnsafeModes::default(),
        }
    }

    /// The caches, when [`run::run`] runs them and reads may use them: not while a watch is
    /// failing or (re)listing (its store may be frozen or behind; reads then go to the API server,
    /// [`watches::WatchHealth::settled`]).
    pub fn caches(&self) -> Option<cache::Caches> {
        if !self.watches.settled() {
            return None;
        }
        self.caches.read().ok().and_then(|c| c.clone())
    }

    /// Negative control: apply children even when unchanged (always false in a release build).
    pub fn always_apply(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        return self.unsafe_modes.always_apply;
        #[cfg(not(feature = "negative-controls"))]
        false
    }

    /// Negative control: reconcile as usual while deleting (always false in a release build).
    pub fn reconcile_while_deleting(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        return self.unsafe_modes.reconcile_while_deleting;
        #[cfg(not(feature = "negative-controls"))]
        false
    }

    /// Negative control: decide from the handed copy (always false in a release build).
    pub fn trust_cached_status(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        return self.unsafe_modes.trust_cached_status;
        #[cfg(not(feature = "negative-controls"))]
        false
    }

    /// Negative control: delete on the cached children's word (always false in a release build).
    pub fn act_on_cached_children(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        return self.unsafe_modes.act_on_cached_children;
        #[cfg(not(feature = "negative-controls"))]
        false
    }

    /// Publishes an event about `object`; a failure to publish is logged, never fatal.
    pub async fn event(
        &self,
        object: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        self.event_related(object, None, type_, reason, action, note)
            .await;
    }

    /// Publishes an event about `object` that concerns the child `related` (a StatefulSet, a
    /// Service). Events are grouped into series by (object, related, reason, action), so naming
    /// the child keeps one line per child in `kubectl events`.
    pub async fn event_related(
        &self,
        object: &ObjectReference,
        related: Option<ObjectReference>,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let kind = object.kind.as_deref().unwrap_or_default();
        // An event is an API write too (events.k8s.io create or patch of a series): counted, so
        // a steady state's zero-write claim covers it.
        self.metrics.write(kind, "event");
        tracing::info!(
            object = object.name.as_deref().unwrap_or_default(),
            kind,
            reason,
            action,
            %note,
            "event"
        );
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: related,
        };
        if let Err(e) = self.recorder.publish(&ev, object).await {
            tracing::warn!(error = %e, reason, "publishing an event failed");
        }
    }
}

/// Why a reconcile failed (it is retried per object along [`backoff::RECONCILE`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A desired object could not be serialized.
    #[error("serializing a desired object: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The object lacks a field the API server always sets (name, namespace, uid).
    #[error("object has no {0}")]
    MissingField(&'static str),
    /// The child caches have not listed yet.
    #[error(transparent)]
    NotListed(#[from] cache::NotListed),
}

impl Error {
    /// Stable reason for the `reconcile_errors` metric.
    pub fn reason(&self) -> String {
        match self {
            Error::Kube(kube::Error::Api(s)) => format!("Api{}", s.code),
            Error::Kube(_) => "Client".into(),
            Error::Serialize(_) => "Serialize".into(),
            Error::MissingField(_) => "MissingField".into(),
            Error::NotListed(_) => "NotListed".into(),
        }
    }
}

/// Result of a reconcile.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod slot_tests {
    use futures::FutureExt;

    use super::ReconcileSlots;

    /// A kind's slots bound the reconciles that run at once; another kind has its own; a slot
    /// freed lets a waiting reconcile in.
    #[tokio::test]
    async fn a_kinds_slots_bound_its_running_reconciles() {
        let slots = ReconcileSlots::new(2);
        let a = slots.acquire("PrefillPool").await.expect("slot");
        let _b = slots.acquire("PrefillPool").await.expect("slot");
        let mut third = Box::pin(slots.acquire("PrefillPool"));
        assert!(
            (&mut third).now_or_never().is_none(),
            "two of two slots held"
        );
        assert!(
            slots.acquire("DecodePool").now_or_never().is_some(),
            "another kind has its own slots"
        );
        drop(a);
        let c = third.now_or_never().flatten();
        assert!(c.is_some(), "a freed slot lets it in");
        let mut waiting = Box::pin(slots.acquire("PrefillPool"));
        assert!((&mut waiting).now_or_never().is_none());
        slots.close();
        assert!(
            matches!(waiting.now_or_never(), Some(None)),
            "closed: the waiter is turned away"
        );
        assert!(
            matches!(slots.acquire("CacheTier").now_or_never(), Some(None)),
            "and every later one"
        );
    }
}
