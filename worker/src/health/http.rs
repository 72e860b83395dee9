//! The health port of every role (worker/interfaces/README.md §2): `GET /healthz` (200 while the
//! process runs), `GET /readyz` (200 only while admitting; 503 while starting or draining, with the
//! reason), `GET /metrics` (Prometheus text) and `GET /report` (the JSON of §4 there).
//!
//! [`ServeState`] is the one place a serving process records its phase, its degradations (the
//! existing [`Health`]) and its [`Counters`]; the HTTP layer only reads it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Map, Value, json};
use tandem_interfaces::report::{ReportPhase, WorkerReport};

use super::Health;
use super::counters::{Counters, ReasonCounters};

/// Where a serving process is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Not admitting yet; the reason says what it waits for (e.g. "no prefill peer of revision r1").
    Starting(String),
    /// Admitting requests.
    Ready,
    /// SIGTERM received: admission stopped for good, in-flight work finishing.
    Draining,
}

type Hook = Box<dyn Fn(&ServeState) + Send + Sync>;
type Extra = Box<dyn Fn() -> Map<String, Value> + Send + Sync>;

/// Shared state of one serving process.
pub struct ServeState {
    /// Role name (`prefill`, `decode`, `cache`, `store-client`).
    pub role: &'static str,
    /// Pool (or tier) name.
    pub pool: String,
    /// Pool revision (empty for tiers and sidecars).
    pub revision: String,
    /// Degradation reasons.
    pub health: Health,
    /// Counters.
    pub counters: Counters,
    /// Counters labelled by reason (exported on `/metrics`; roles add them to `/report` extras).
    pub by_reason: ReasonCounters,
    phase: Mutex<Phase>,
    registry: Registry,
    refresh: Mutex<Vec<Hook>>,
    extra: Mutex<Option<Extra>>,
    sections: Mutex<Map<String, Value>>,
    blocked: Mutex<Option<String>>,
    transport: Family<Vec<(String, String)>, Gauge>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ServeState {
    /// A state in [`Phase::Starting`] with `reason`.
    pub fn new(role: &'static str, pool: &str, revision: &str, reason: &str) -> Arc<Self> {
        Self::with_metrics(role, pool, revision, reason, |_| {})
    }

    /// As [`ServeState::new`], with the role's own metrics added to `/metrics` by `register` (e.g.
    /// the engine API's pool and registration metrics of a worker with an engine).
    pub fn with_metrics(
        role: &'static str,
        pool: &str,
        revision: &str,
        reason: &str,
        register: impl FnOnce(&mut Registry),
    ) -> Arc<Self> {
        let counters = Counters::default();
        let mut registry = Registry::default();
        register(&mut registry);
        counters.register(&mut registry);
        let by_reason = ReasonCounters::default();
        by_reason.register(&mut registry);
        let transport = Family::<Vec<(String, String)>, Gauge>::default();
        registry.register(
            "tandem_transport_in_use",
            "KV transport this worker sends or receives over (1 on the one in use; none: refused)",
            transport.clone(),
        );
        Arc::new(Self {
            role,
            pool: pool.to_owned(),
            revision: revision.to_owned(),
            health: Health::new(),
            counters,
            by_reason,
            phase: Mutex::new(Phase::Starting(reason.to_owned())),
            registry,
            refresh: Mutex::new(Vec::new()),
            extra: Mutex::new(None),
            sections: Mutex::new(Map::new()),
            blocked: Mutex::new(None),
            transport,
        })
    }

    /// The phase now.
    pub fn phase(&self) -> Phase {
        lock(&self.phase).clone()
    }

    /// Whether requests are admitted.
    pub fn admitting(&self) -> bool {
        *lock(&self.phase) == Phase::Ready
    }

    /// Whether SIGTERM was received.
    pub fn draining(&self) -> bool {
        *lock(&self.phase) == Phase::Draining
    }

    /// Ready, or not ready for `reason`. Ignored once draining (draining is final); while
    /// [`ServeState::block_ready`] holds a reason, that reason wins over `Ok`.
    pub fn set_ready(&self, ready: Result<(), String>) {
        let blocked = lock(&self.blocked).clone();
        let mut p = lock(&self.phase);
        if *p == Phase::Draining {
            return;
        }
        *p = match (blocked, ready) {
            (Some(reason), _) | (None, Err(reason)) => Phase::Starting(reason),
            (None, Ok(())) => Phase::Ready,
        };
        self.health.set_ready(*p == Phase::Ready);
    }

    /// Never ready again in this process's life, for `reason` (a startup refusal the worker
    /// reports instead of exiting, e.g. `transport: RDMA` with no usable device: the pod stays
    /// not Ready with the reason in `/readyz`, `/report` and its events). Draining still works.
    pub fn block_ready(&self, reason: String) {
        *lock(&self.blocked) = Some(reason.clone());
        self.set_ready(Err(reason));
    }

    /// Records the KV transport in use (`tcp`, `rdma`; `none` when refused) as
    /// `tandem_transport_in_use{transport} 1`.
    pub fn set_transport(&self, in_use: &str) {
        self.transport.clear();
        self.transport
            .get_or_create(&vec![("transport".to_owned(), in_use.to_owned())])
            .set(1);
    }

    /// Adds a fixed top-level field to `/report` (e.g. `transport`), kept beside the role's
    /// [`ServeState::set_extra`] fields (which win on a name clash).
    pub fn set_section(&self, name: &str, value: Value) {
        lock(&self.sections).insert(name.to_owned(), value);
    }

    /// Enters [`Phase::Draining`]: `/readyz` answers 503 from now on.
    pub fn begin_drain(&self) {
        *lock(&self.phase) = Phase::Draining;
        self.health.set_ready(false);
    }

    /// Adds a hook run before every `/report` and `/metrics` (mirrors a component's own counters).
    pub fn on_refresh(&self, hook: impl Fn(&ServeState) + Send + Sync + 'static) {
        lock(&self.refresh).push(Box::new(hook));
    }

    /// Sets the role-specific fields merged into `/report` (cache: `warm`, `objects`, `bytes`).
    pub fn set_extra(&self, extra: impl Fn() -> Map<String, Value> + Send + Sync + 'static) {
        *lock(&self.extra) = Some(Box::new(extra));
    }

    fn refresh(&self) {
        for hook in lock(&self.refresh).iter() {
            hook(self);
        }
    }

    /// The `/report` document ([`WorkerReport`], worker/interfaces/README.md §4: `phase` and
    /// `reason` say why not ready), plus the role's extra fields ([`ServeState::set_extra`]).
    pub fn report(&self) -> Value {
        self.refresh();
        let phase = self.phase();
        let (phase_name, reason) = match &phase {
            Phase::Starting(r) => (ReportPhase::Starting, Some(r.clone())),
            Phase::Ready => (ReportPhase::Ready, None),
            Phase::Draining => (
                ReportPhase::Draining,
                Some("draining after SIGTERM".to_owned()),
            ),
        };
        let report = WorkerReport {
            ready: phase == Phase::Ready,
            role: self.role.to_owned(),
            pool: self.pool.clone(),
            revision: self.revision.clone(),
            degraded: self.health.report().degraded,
            counters: self.counters.report(),
            phase: Some(phase_name),
            reason,
            ..WorkerReport::default()
        };
        let mut doc = serde_json::to_value(report).unwrap_or_else(|_| json!({}));
        if let Some(obj) = doc.as_object_mut() {
            obj.extend(lock(&self.sections).clone());
        }
        if let (Some(extra), Some(obj)) = (lock(&self.extra).as_ref(), doc.as_object_mut()) {
            obj.extend(extra());
        }
        doc
    }

    /// Prometheus text of every counter.
    pub fn metrics_text(&self) -> String {
        self.refresh();
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        text
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<Arc<ServeState>>) -> Response {
    match s.phase() {
        Phase::Ready => (StatusCode::OK, "ready\n".to_owned()).into_response(),
        Phase::Starting(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
        Phase::Draining => {
            (StatusCode::SERVICE_UNAVAILABLE, "draining\n".to_owned()).into_response()
        }
    }
}

async fn metrics(State(s): State<Arc<ServeState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics_text(),
    )
        .into_response()
}

async fn report(State(s): State<Arc<ServeState>>) -> Response {
    axum::Json(s.report()).into_response()
}

/// The health routes over `state`.
pub fn router(state: Arc<ServeState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/report", get(report))
        .with_state(state)
}

/// Binds `addr` and serves `router` on the current runtime until the returned task is aborted.
///
/// # Errors
/// The bind error.
pub async fn spawn_http(
    addr: SocketAddr,
    router: Router,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(%local, error = %e, "HTTP server stopped");
        }
    });
    Ok((local, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_state_never_becomes_ready_but_still_drains() {
        let s = ServeState::new("decode", "p", "r1", "starting");
        s.set_ready(Ok(()));
        assert!(s.admitting());
        s.block_ready("transport RDMA requested, but no usable RDMA device".into());
        assert!(!s.admitting());
        s.set_ready(Ok(()));
        assert_eq!(
            s.phase(),
            Phase::Starting("transport RDMA requested, but no usable RDMA device".into())
        );
        s.set_section("transport", json!({"in_use": "none"}));
        s.set_transport("none");
        let r = s.report();
        assert_eq!(r["transport"]["in_use"], "none");
        assert_eq!(r["ready"], false);
        assert!(
            s.metrics_text()
                .contains("tandem_transport_in_use{transport=\"none\"} 1")
        );
        s.begin_drain();
        assert!(s.draining());
    }
}
