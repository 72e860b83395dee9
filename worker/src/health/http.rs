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

    /// Ready, or not ready for `reason`. Ignored once draining (draining is final).
    pub fn set_ready(&self, ready: Result<(), String>) {
        let mut p = lock(&self.phase);
        if *p == Phase::Draining {
            return;
        }
        *p = match ready {
            Ok(()) => Phase::Ready,
            Err(reason) => Phase::Starting(reason),
        };
        self.health.set_ready(*p == Phase::Ready);
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
