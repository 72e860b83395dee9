//! Health of a worker: one module for what a role reports about itself.
//!
//! - [`Health`] (here): readiness plus the reasons the worker runs degraded (seed 000: a fallback to
//!   L2 must be visible in "the cache report", not only in a log line; DESIGN contract 2);
//! - [`counters`]: the serving counters, exported in `/report` and as Prometheus counters;
//! - [`http`]: the health port of every role (`/healthz`, `/readyz`, `/metrics`, `/report`).

pub mod counters;
pub mod http;

use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// Why a component runs degraded: an element of `/report`'s `degraded` list, so it lives in
/// `tandem-interfaces` (worker/interfaces/README.md §4).
pub use tandem_interfaces::report::DegradedReason;

/// A point-in-time health report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthReport {
    /// Whether the worker admits requests.
    pub ready: bool,
    /// Components running degraded, in the order they degraded.
    pub degraded: Vec<DegradedReason>,
    /// Active store registrations.
    pub registrations: usize,
    /// Quarantined registrations (undo failed; memory kept until exit).
    pub quarantined_registrations: usize,
    /// Quarantined bytes of host memory.
    pub quarantined_bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    ready: bool,
    degraded: Vec<DegradedReason>,
}

/// Shared health state; components write, the health endpoint reads.
#[derive(Debug, Default)]
pub struct Health {
    state: Mutex<State>,
}

impl Health {
    /// Not ready, nothing degraded.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets readiness.
    pub fn set_ready(&self, ready: bool) {
        self.state().ready = ready;
    }

    /// Records (or replaces, per component) a degradation reason.
    pub fn degrade(&self, component: &str, code: &str, message: impl Into<String>) {
        let mut s = self.state();
        s.degraded.retain(|d| d.component != component);
        s.degraded.push(DegradedReason {
            component: component.to_owned(),
            code: code.to_owned(),
            message: message.into(),
        });
    }

    /// Clears a component's degradation.
    pub fn recover(&self, component: &str) {
        self.state().degraded.retain(|d| d.component != component);
    }

    /// Readiness and reasons; callers fill in the counters they own.
    pub fn report(&self) -> HealthReport {
        let s = self.state();
        HealthReport {
            ready: s.ready,
            degraded: s.degraded.clone(),
            ..HealthReport::default()
        }
    }
}
