//! Ordered, idempotent teardown (DESIGN contract 9; reference/dataplane.md R-OPS-1, R-OPS-2, TC-OPS-01).
//!
//! Components register steps under a [`TeardownPhase`]; [`Teardown::run`] executes them phase by phase
//! in the contract's order (registration order within a phase), records every step and its result, and
//! keeps going after a failing step so later resources are still released. A second `run` does nothing
//! and returns the first report. SIGTERM and SIGINT run the same path ([`run_on_signal`]).

use std::sync::{Arc, Mutex, MutexGuard};

/// The phases of DESIGN contract 9, in execution order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TeardownPhase {
    /// Stop admitting requests.
    StopAdmission,
    /// Drain or abort transfer rooms through the abort-safe release (contract 3).
    DrainRooms,
    /// Join worker threads with a deadline.
    JoinThreads,
    /// Free transfer batches and handles.
    FreeTransferHandles,
    /// Deregister memory from the store and transports.
    Deregister,
    /// Destroy transports and the engine.
    DestroyTransports,
    /// Free memory with the allocator that made it; release segments.
    FreeMemory,
}

type Step = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// One executed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    /// Phase.
    pub phase: TeardownPhase,
    /// Step name.
    pub name: String,
    /// `Err(message)` if it failed.
    pub result: Result<(), String>,
}

/// What a teardown did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TeardownReport {
    /// Steps in execution order.
    pub steps: Vec<StepRecord>,
}

impl TeardownReport {
    /// Whether every step succeeded.
    pub fn ok(&self) -> bool {
        self.steps.iter().all(|s| s.result.is_ok())
    }

    /// A report of a teardown that could not run its plan (the task running it died): one failed
    /// step, `message` its error.
    pub fn failed(message: String) -> Self {
        Self {
            steps: vec![StepRecord {
                phase: TeardownPhase::StopAdmission,
                name: "run the teardown plan".into(),
                result: Err(message),
            }],
        }
    }

    /// The report as JSON: `{"ok": bool, "steps": [{"phase": "DrainRooms", "step": "…",
    /// "error": null | "…"}, …]}`, steps in execution order.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok": self.ok(),
            "steps": self.steps.iter().map(|s| serde_json::json!({
                "phase": format!("{:?}", s.phase),
                "step": s.name,
                "error": s.result.as_ref().err(),
            })).collect::<Vec<_>>(),
        })
    }
}

#[derive(Default)]
struct State {
    steps: Vec<(TeardownPhase, String, Step)>,
    report: Option<TeardownReport>,
}

/// The process's teardown plan.
#[derive(Default)]
pub struct Teardown {
    state: Mutex<State>,
}

impl std::fmt::Debug for Teardown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("Teardown")
            .field("pending_steps", &s.steps.len())
            .field("done", &s.report.is_some())
            .finish()
    }
}

impl Teardown {
    /// An empty plan.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a step. Steps added after the teardown ran are executed at once (the process is stopping).
    pub fn register(
        &self,
        phase: TeardownPhase,
        name: impl Into<String>,
        step: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) {
        let name = name.into();
        let mut s = self.state();
        if s.report.is_some() {
            drop(s);
            let result = step();
            tracing::warn!(step = %name, ?result, "teardown step registered after teardown; ran now");
            return;
        }
        s.steps.push((phase, name, Box::new(step)));
    }

    /// Runs every step in phase order, once. Later calls return the first report.
    pub fn run(&self) -> TeardownReport {
        let mut steps = {
            let mut s = self.state();
            if let Some(r) = &s.report {
                return r.clone();
            }
            // Mark as started: a concurrent caller gets an empty report and runs nothing.
            s.report = Some(TeardownReport::default());
            std::mem::take(&mut s.steps)
        };
        steps.sort_by_key(|(phase, _, _)| *phase);
        let mut report = TeardownReport::default();
        for (phase, name, step) in steps {
            let result = step();
            match &result {
                Ok(()) => tracing::info!(?phase, step = %name, "teardown step done"),
                Err(e) => tracing::error!(?phase, step = %name, error = %e, "teardown step failed"),
            }
            report.steps.push(StepRecord {
                phase,
                name,
                result,
            });
        }
        self.state().report = Some(report.clone());
        report
    }

    /// [`Teardown::run`] on a blocking thread (steps may block, e.g. on a drain deadline), from
    /// async code. A task that dies is reported as one failed step.
    pub async fn run_blocking(self: Arc<Self>) -> TeardownReport {
        tokio::task::spawn_blocking(move || self.run())
            .await
            .unwrap_or_else(|e| TeardownReport::failed(format!("the teardown task failed: {e}")))
    }

    /// Whether the teardown has started.
    pub fn started(&self) -> bool {
        self.state().report.is_some()
    }
}

/// Waits for SIGTERM or SIGINT, then runs `teardown` (on a blocking thread) and returns its report.
///
/// # Errors
/// The error of installing the signal handlers.
pub async fn run_on_signal(teardown: Arc<Teardown>) -> std::io::Result<TeardownReport> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: tearing down"),
        _ = int.recv() => tracing::info!("SIGINT: tearing down"),
    }
    tokio::task::spawn_blocking(move || teardown.run())
        .await
        .map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_in_contract_order_once_and_continues_after_a_failure() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let t = Teardown::new();
        for (phase, name) in [
            (TeardownPhase::FreeMemory, "free pools"),
            (TeardownPhase::Deregister, "deregister"),
            (TeardownPhase::StopAdmission, "stop admission"),
            (TeardownPhase::DrainRooms, "drain"),
        ] {
            let log = log.clone();
            t.register(phase, name, move || {
                log.lock().unwrap().push(name);
                if name == "deregister" {
                    Err("store gone".into())
                } else {
                    Ok(())
                }
            });
        }
        let r = t.run();
        assert_eq!(
            *log.lock().unwrap(),
            vec!["stop admission", "drain", "deregister", "free pools"]
        );
        assert!(!r.ok());
        assert_eq!(r.steps.len(), 4);
        let again = t.run();
        assert_eq!(again, r, "second run is a no-op with the same report");
        assert_eq!(log.lock().unwrap().len(), 4);
        let j = r.to_json();
        assert_eq!(j["ok"], false);
        assert_eq!(j["steps"][2]["phase"], "Deregister");
        assert_eq!(j["steps"][2]["error"], "store gone");
        assert_eq!(j["steps"][3]["step"], "free pools");
        assert!(j["steps"][3]["error"].is_null());
    }
}
