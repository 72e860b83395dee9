//! A serving role whose engine pools were refused (DESIGN contracts 1–2, seed 000): the worker
//! fails closed — it serves no request and never becomes Ready — but it stays up and says why, so
//! that the pod's readiness, `/report` and the operator's pool status carry the typed reason (a
//! crash loop would hide it behind restarts), as `roles::apply_transport` does for a refused
//! transport.
//!
//! What it serves on the health port until SIGTERM/SIGINT:
//! - `/readyz` 503 `not ready: engine pools refused: <REASON> (<field>): <message>`;
//! - `/report`: `ready: false`, `degraded: [{component: "pools", code: <Reason>, message}]` (the
//!   reason's CamelCase name, e.g. `PoolDomainMismatch`), and
//!   `engine: {kind, attached: false, pools: [], refused: {reason, code, field, ours, theirs,
//!   message}}`;
//! - `/metrics`: `tandem_engine_pool_refusals_total{pool,reason} 1` besides the common counters.

use std::net::SocketAddr;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::json;

use super::RoleError;
use crate::config::WorkerConfig;
use crate::engine_api::error::ApiError;
use crate::health::http::{ServeState, router, spawn_http};

/// The `/report` component of the refusal.
pub const COMPONENT: &str = "pools";

/// The readiness reason of a worker holding a refusal (its prefix; the typed reason follows).
pub const NOT_READY_PREFIX: &str = "engine pools refused";

/// Serves the refusal `err` of a `role` worker with config `cfg` on its health port until `stop`
/// resolves (SIGTERM/SIGINT), then returns. Nothing else runs: no pool, no engine API socket, no
/// front door. Prints `listening on <health address>` once the health port serves.
///
/// # Errors
/// [`RoleError::Failed`] when the health port cannot be bound (the refusal is then only in the log).
pub async fn hold(
    cfg: &WorkerConfig,
    role: &'static str,
    err: &ApiError,
    stop: impl std::future::Future<Output = &'static str>,
) -> Result<(), RoleError> {
    let reason = format!("{:?}", err.reason);
    let pool = err
        .field
        .strip_prefix("pools.")
        .unwrap_or(&err.field)
        .to_owned();
    let refusals = Family::<Vec<(String, String)>, Counter>::default();
    let state = ServeState::with_metrics(role, &cfg.pool, &cfg.revision, NOT_READY_PREFIX, |r| {
        r.register(
            "tandem_engine_pool_refusals",
            "Engine pools refused before anything was registered or kept, by pool and reason",
            refusals.clone(),
        );
    });
    refusals
        .get_or_create(&vec![
            ("pool".to_owned(), pool.clone()),
            ("reason".to_owned(), reason.clone()),
        ])
        .inc();
    let why = format!(
        "{NOT_READY_PREFIX}: {reason} ({}): {}",
        err.field, err.message
    );
    state
        .health
        .degrade(COMPONENT, &reason, err.message.clone());
    state.block_ready(why.clone());
    let kind = cfg
        .engine
        .as_ref()
        .map_or_else(|| "builtin".to_owned(), |e| format!("{:?}", e.kind));
    state.set_section(
        "engine",
        json!({
            "kind": kind,
            "attached": false,
            "pools": [],
            "refused": {
                "pool": pool,
                "reason": reason,
                "code": format!("{:?}", err.code),
                "field": err.field,
                "ours": err.ours,
                "theirs": err.theirs,
                "message": err.message,
            },
        }),
    );
    let addr = SocketAddr::new(super::pod_ip(), cfg.ports.health);
    let (local, http) = spawn_http(addr, router(state.clone()))
        .await
        .map_err(|e| RoleError::Failed(format!("{why}; and binding the health port: {e}")))?;
    tracing::error!(health = %local, %why, "fail-closed: serving nothing, not ready, until SIGTERM");
    // What a serving role prints once up: here the only address that serves.
    println!("listening on {local}");
    let signal = stop.await;
    tracing::info!(signal, "stopping the refused {role} worker");
    state.begin_drain();
    http.abort();
    Ok(())
}
