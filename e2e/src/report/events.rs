//! Things that happened to the stack during a replay (scale, restart, pod churn), on the replay
//! clock, so the report can mark them on the plots.

use serde::{Deserialize, Serialize};

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// When (ms on the replay clock).
    pub t_ms: f64,
    /// What: `scale`, `scale-ready`, `restart`, `restart-done`, `pod-deleted`, `pod-ready`, ...
    pub kind: String,
    /// Human detail (`replicas 1 → 2`, the new restart id, the pod name).
    pub detail: String,
}

impl Event {
    /// An event at `t_ms`.
    pub fn new(t_ms: f64, kind: &str, detail: impl Into<String>) -> Self {
        Self {
            t_ms,
            kind: kind.to_owned(),
            detail: detail.into(),
        }
    }
}

/// Kind of the event that starts a rolling restart.
pub const RESTART: &str = "restart";
/// Kind of the event that scales the DecodePool.
pub const SCALE: &str = "scale";
