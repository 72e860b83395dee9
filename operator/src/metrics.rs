//! Prometheus metrics of the operator (prometheus-client), served as text on `/metrics`.
//!
//! - `tandem_operator_reconcile_duration_seconds{kind}` — histogram of reconcile durations;
//! - `tandem_operator_reconcile_errors_total{kind,reason}` — failed reconciles by error reason;
//! - `tandem_operator_resources{kind,state}` — resources per kind by state (`Ready`,
//!   `Progressing`, `PolicyConflict`, `InsufficientCapacity`, `Terminating`, `NotReady`), set on
//!   every reconcile;
//! - `tandem_operator_writes_total{kind,verb}` — API writes by verb (`apply`, `patch`, `delete`,
//!   `status`, `scale`, `finalizer`, `event`, `pod-gate` — the [`crate::gang`] condition on a
//!   pod: every API write a reconcile makes, events included), the figure a steady state keeps at
//!   zero growth;
//! - `tandem_operator_reconciles_in_flight{kind}` — reconciles started now. kube-runtime's
//!   scheduler starts every due object at once and holds back only an object already being
//!   reconciled, so this is the work outstanding: the queue depth;
//! - `tandem_operator_reconciles_running{kind}` — of those, the ones doing their reads and writes
//!   (at most `--max-concurrent-reconciles` per kind; the rest wait for a slot);
//! - `tandem_operator_fresh_reads_total{kind}` — reconciles that decided a delete or a refusal on
//!   cached reads and read again from the API server to confirm it (`controller::cache`);
//! - `tandem_operator_cached_children{resource}` — objects in the child caches now;
//! - `tandem_operator_watches_failing` — watches failing now (each retried with back-off; `/readyz`
//!   names them).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label set `{kind}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `CacheTier`, `PrefillPool` or `DecodePool`.
    pub kind: String,
}

/// Label set `{resource}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    /// The plural resource name (`pods`, `statefulsets`, ...).
    pub resource: String,
}

/// Label set `{kind, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Kind.
    pub kind: String,
    /// Error reason (stable CamelCase, see `controller::Error::reason`).
    pub reason: String,
}

/// Label set `{kind, state}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// Kind.
    pub kind: String,
    /// State.
    pub state: String,
}

/// Label set `{kind, verb}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// Kind of the reconciled resource.
    pub kind: String,
    /// `apply`, `patch`, `delete`, `status`, `finalizer`.
    pub verb: String,
}

/// The operator's metrics and their registry.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Reconcile duration by kind.
    pub reconcile_duration: Family<KindLabels, Histogram>,
    /// Errors by kind and reason.
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    /// Resources by kind and state.
    pub resources: Family<StateLabels, Gauge>,
    /// API writes by kind and verb.
    pub writes: Family<WriteLabels, Counter>,
    /// Reconciles started now, by kind (the queue depth, see the module docs).
    pub in_flight: Family<KindLabels, Gauge>,
    /// Reconciles doing their reads and writes now (holding a slot), by kind.
    pub running: Family<KindLabels, Gauge>,
    /// 1 while this replica holds the leader-election Lease (or runs without election), else 0.
    pub leading: Gauge,
    /// Watches failing now.
    pub watches_failing: Gauge,
    /// Reconciles that read again from the API server to confirm a delete or a refusal, by kind.
    pub fresh_reads: Family<KindLabels, Counter>,
    /// Objects in the child caches, by resource (`statefulsets`, `services`, `configmaps`, `pods`).
    pub cached_children: Family<ResourceLabels, Gauge>,
    /// State of each resource, `(kind, namespace/name) → state`, to recompute the gauge.
    states: Arc<Mutex<BTreeMap<(String, String), String>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tandem_operator");
        let reconcile_duration = Family::<KindLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 14))
        });
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let resources = Family::<StateLabels, Gauge>::default();
        let writes = Family::<WriteLabels, Counter>::default();
        let leading = Gauge::default();
        let in_flight = Family::<KindLabels, Gauge>::default();
        let running = Family::<KindLabels, Gauge>::default();
        registry.register(
            "reconciles_running",
            "Reconciles doing their reads and writes now (at most --max-concurrent-reconciles per kind)",
            running.clone(),
        );
        registry.register(
            "reconciles_in_flight",
            "Reconciles running now, by kind (the work outstanding)",
            in_flight.clone(),
        );
        let watches_failing = Gauge::default();
        let fresh_reads = Family::<KindLabels, Counter>::default();
        registry.register(
            "fresh_reads",
            "Reconciles that read again from the API server to confirm a delete or refusal decided on the caches",
            fresh_reads.clone(),
        );
        let cached_children = Family::<ResourceLabels, Gauge>::default();
        registry.register(
            "cached_children",
            "Objects in the operator's child caches, by resource",
            cached_children.clone(),
        );
        registry.register(
            "watches_failing",
            "Watches failing now (retried with back-off; /readyz names them)",
            watches_failing.clone(),
        );
        registry.register(
            "leading",
            "1 while this replica holds the leader-election Lease, else 0",
            leading.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile, by kind",
            reconcile_duration.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles, by kind and reason",
            reconcile_errors.clone(),
        );
        registry.register(
            "resources",
            "Resources by kind and state",
            resources.clone(),
        );
        registry.register(
            "writes",
            "API writes made by reconciles, by kind and verb",
            writes.clone(),
        );
        Self {
            registry: Arc::new(registry),
            reconcile_duration,
            reconcile_errors,
            resources,
            writes,
            in_flight,
            running,
            leading,
            watches_failing,
            fresh_reads,
            cached_children,
            states: Arc::default(),
        }
    }

    /// Records the state of one resource (`None` when it is gone) and recomputes the gauge.
    pub fn set_state(&self, kind: &str, key: &str, state: Option<&str>) {
        let Ok(mut states) = self.states.lock() else {
            return;
        };
        match state {
            Some(s) => {
                states.insert((kind.into(), key.into()), s.into());
            }
            None => {
                states.remove(&(kind.to_owned(), key.to_owned()));
            }
        }
        let mut counts: BTreeMap<String, i64> = BTreeMap::new();
        for ((k, _), s) in states.iter() {
            if k == kind {
                *counts.entry(s.clone()).or_default() += 1;
            }
        }
        for s in STATES {
            self.resources
                .get_or_create(&StateLabels {
                    kind: kind.into(),
                    state: (*s).into(),
                })
                .set(counts.get(*s).copied().unwrap_or(0));
        }
    }

    /// Counts one reconcile that read again from the API server to confirm a delete or refusal.
    pub fn fresh_read(&self, kind: &str) {
        self.fresh_reads
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    }

    /// Counts one write.
    pub fn write(&self, kind: &str, verb: &str) {
        self.writes
            .get_or_create(&WriteLabels {
                kind: kind.into(),
                verb: verb.into(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The states the `resources` gauge reports (zeros included, so dashboards see every series).
pub const STATES: &[&str] = &[
    "Ready",
    "Progressing",
    "NotReady",
    "PolicyConflict",
    "InsufficientCapacity",
    "Terminating",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_every_family() {
        let m = Metrics::new();
        m.reconcile_duration
            .get_or_create(&KindLabels {
                kind: "DecodePool".into(),
            })
            .observe(0.01);
        m.set_state("DecodePool", "ns/a", Some("Ready"));
        m.set_state("DecodePool", "ns/b", Some("Ready"));
        m.set_state("DecodePool", "ns/b", None);
        m.write("DecodePool", "apply");
        m.in_flight
            .get_or_create(&KindLabels {
                kind: "DecodePool".into(),
            })
            .inc();
        let text = m.encode();
        assert!(text.contains("tandem_operator_reconcile_duration_seconds_bucket"));
        assert!(
            text.contains(r#"tandem_operator_resources{kind="DecodePool",state="Ready"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"tandem_operator_writes_total{kind="DecodePool",verb="apply"} 1"#));
        assert!(
            text.contains(r#"tandem_operator_reconciles_in_flight{kind="DecodePool"} 1"#),
            "{text}"
        );
    }
}
