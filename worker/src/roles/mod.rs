//! The roles of the one `tandem-worker` binary (DESIGN §3), one module each, wiring the contract
//! modules into long-running servers: what `tandem-worker <role> --config FILE` runs in a pod.
//! The config file the operator renders is the only start path; each role's `Args` (clap) has
//! `--config` and at most a few process-level knobs the config does not carry.
//!
//! - [`prefill`]: the gRPC `Transfer` service ([`prefill::node`]) with the built-in simulated engine
//!   and the prefix cache around it ([`prefill::prefix_cache`]: L2 index + L3 store), or, when the
//!   config names an engine, serving the engine API to it ([`prefill::seat`]);
//! - [`decode`]: the KV receive side and release gate ([`decode::node`]), the same-revision prefill
//!   peer set ([`decode::peers`]), the request engine with the spec guard ([`decode::engine`]) and
//!   the OpenAI-compatible front door ([`decode::front_door`]);
//! - [`cache`]: one CacheTier store replica (contract 7);
//! - [`config_use`]: the config fields a role does not act on (logged, in `/report.config`);
//! - [`store_client`]: the standalone store client that owns the shared-memory segments;
//! - [`refusal`]: a serving role whose engine pools were refused stays up, not Ready, saying why;
//! - shared by the roles: [`sim`] (the simulation knobs and the KV layout they imply), [`resolve`]
//!   (Service names through `$TANDEM_HOSTS_FILE` or DNS), [`signals`] (SIGTERM/SIGINT as a future).
//!   The health port and the `/report` counters are [`crate::health`].
//!
//! Adding a role: a module here with `Args` (clap) and `run(Args) -> Result<(), RoleError>`, and a
//! variant of the binary's `Role` (src/main.rs).

pub mod cache;
pub mod config_use;
pub mod decode;
pub mod prefill;
pub mod refusal;
pub mod resolve;
pub mod signals;
pub mod sim;
pub mod store_client;

use std::net::{IpAddr, Ipv4Addr};

/// Errors a role returns to `main`; printed, and the process exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The role failed.
    #[error("{0}")]
    Failed(String),
}

/// Reads the worker config at `path` (resolved through `$TANDEM_ROOT`).
///
/// # Errors
/// [`RoleError::Failed`] when it is unreadable or invalid.
pub fn load_worker_config(
    path: &std::path::Path,
) -> Result<crate::config::WorkerConfig, RoleError> {
    <crate::config::WorkerConfig as crate::config::LoadConfig>::load(&crate::config::resolve_path(
        path,
    ))
    .map_err(|e| RoleError::Failed(e.to_string()))
}

/// Refuses a config rendered for another role (`tandem-worker prefill` given a decode pool's
/// config, or the reverse): the config's `role` decides which mechanisms its fields size.
///
/// # Errors
/// [`RoleError::Failed`] naming both roles.
pub fn check_role(
    cfg: &crate::config::WorkerConfig,
    serving: crate::config::WorkerRole,
) -> Result<(), RoleError> {
    if cfg.role == serving {
        return Ok(());
    }
    Err(RoleError::Failed(format!(
        "the config's role is {:?} but this process serves {serving:?}: pass the config rendered for this role",
        cfg.role
    )))
}

/// A multi-threaded tokio runtime for a role.
///
/// # Errors
/// [`RoleError::Failed`] when the runtime cannot start.
pub fn runtime() -> Result<tokio::runtime::Runtime, RoleError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| RoleError::Failed(format!("starting the runtime: {e}")))
}

/// Errors starting a serving process.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A port could not be bound.
    #[error("binding the {0} port: {1}")]
    Bind(&'static str, std::io::Error),
    /// The config cannot be served by this role.
    #[error("config: {0}")]
    Config(String),
    /// The snapshot buffer or its receiver could not start (DESIGN contract 4).
    #[error("snapshot sync: {0}")]
    Snapshot(String),
    /// The CP group could not be formed (a peer never came, another owner map, the rank's KV
    /// store): refused before any room (issue 15).
    #[error("CP group: {0}")]
    CpGroup(String),
    /// The decode transfer side could not start.
    #[error(transparent)]
    Decode(#[from] decode::node::DecodeError),
    /// The engine seat's pools were refused or rolled back (DESIGN contracts 1–2, seed 000): the
    /// typed refusal, which the role reports while it holds the pod not Ready
    /// ([`refusal::hold`]) instead of exiting.
    #[error("engine pools: {0}")]
    Pools(crate::engine_api::error::ApiError),
}

/// `$POD_IP` when set and valid, else `0.0.0.0` (worker/interfaces/README.md §2).
pub fn pod_ip() -> IpAddr {
    std::env::var("POD_IP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// The pod's ordinal: the numeric suffix of `$POD_NAME` (`pool-g0-3` → 3), else 0.
pub fn ordinal_from_env() -> u32 {
    std::env::var("POD_NAME")
        .ok()
        .as_deref()
        .and_then(ordinal_of)
        .unwrap_or(0)
}

/// The environment switch of the stack-level release-gate negative control (seed 004).
pub const GATE_BYPASS_ENV: &str = "TANDEM_NEGATIVE_GATE_BYPASS";

/// Negative control (feature `negative-controls`; without it always false): whether
/// `$TANDEM_NEGATIVE_GATE_BYPASS` is `1`. A decode worker with an engine then runs its release gate
/// as before seed 004's fix ([`crate::engine_api::EngineApiConfig::unsafe_release_on_abort`]): a
/// failed room's pages go back to the engine at once, no prefill is told, and the room's writes
/// keep landing. e2e/tests/stack_negative.rs sets it on a live DecodePool.
pub fn gate_bypass_from_env() -> bool {
    #[cfg(feature = "negative-controls")]
    if std::env::var(GATE_BYPASS_ENV).as_deref() == Ok("1") {
        tracing::warn!(
            "negative control: the release gate is bypassed (failed rooms' pages are reused at once)"
        );
        return true;
    }
    false
}

/// The numeric suffix after the last `-` of a StatefulSet pod name.
pub fn ordinal_of(pod_name: &str) -> Option<u32> {
    pod_name.rsplit_once('-').and_then(|(_, n)| n.parse().ok())
}

/// Resolves the config's `transport` for a serving role ([`crate::transfer::select::for_serving`])
/// and records it on `state`: `/report.transport`, `tandem_transport_in_use`, and — when refused
/// (`RDMA` this worker cannot serve) — readiness blocked for good with the reason and the
/// degradation `TransportUnavailable`. The worker keeps running so that the pod's status and
/// events carry the reason (a crash loop would hide it behind restarts).
pub fn apply_transport(
    choice: crate::config::TransportChoice,
    state: &crate::health::http::ServeState,
) -> crate::transfer::select::ServingTransport {
    let t = crate::transfer::select::for_serving(choice);
    state.set_section("transport", t.report());
    state.set_transport(
        t.in_use
            .map_or("none", crate::transfer::TransportKind::as_str),
    );
    if let Some(reason) = t.refusal() {
        state
            .health
            .degrade("transport", "TransportUnavailable", reason.to_owned());
        state.block_ready(reason.to_owned());
    }
    t
}

/// The environment variable of the drain grace: milliseconds a stopping prefill or decode
/// worker gives its rooms and requests before the teardown goes on without them.
pub const DRAIN_GRACE_ENV: &str = "TANDEM_DRAIN_GRACE_MS";

/// The drain grace: `$TANDEM_DRAIN_GRACE_MS` when set to a number, else 25 s (inside the
/// Kubernetes default `terminationGracePeriodSeconds` of 30 s, leaving 5 s to release memory).
pub fn drain_grace_from_env() -> std::time::Duration {
    std::env::var(DRAIN_GRACE_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or(
            std::time::Duration::from_secs(25),
            std::time::Duration::from_millis,
        )
}

/// Reports a serving role's teardown when it exits: each step logged (by
/// [`crate::teardown::Teardown::run`]), then one log line and one stdout line
/// `teardown {"ok": …, "steps": […]}` ([`crate::teardown::TeardownReport::to_json`]) that a
/// process supervisor or test reads. A closed stdout is ignored (the process is exiting).
pub fn print_teardown(report: &crate::teardown::TeardownReport) {
    use std::io::Write as _;
    let json = report.to_json();
    if report.ok() {
        tracing::info!(teardown = %json, "teardown done");
    } else {
        tracing::error!(teardown = %json, "teardown done with failed steps");
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "teardown {json}");
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    #[test]
    fn ordinal_is_the_pod_name_suffix() {
        assert_eq!(super::ordinal_of("p-g0-3"), Some(3));
        assert_eq!(super::ordinal_of("p-g0"), None);
        assert_eq!(super::ordinal_of("solo"), None);
    }
}
