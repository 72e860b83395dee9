//! The teardown step planner (DESIGN §5), pure: once a resource has a deletion timestamp, its
//! finalizer `serving.tandem.dev/teardown` holds it until these steps are done, in this order:
//!
//! 1. **WaitForDependents** — a PrefillPool waits while a DecodePool that pairs with it still has
//!    pods (decode drains first); a CacheTier waits while any pool still references it (clients
//!    flush to L3 and stop before the store).
//! 2. **StopRouting** — a DecodePool deletes its front-door Service, so no new request arrives.
//! 3. **ScaleToZero** — every workload is scaled to 0 through its `/scale` subresource (never an
//!    apply: a scale patch cannot create an object that foreground deletion already removed).
//!    Pods get SIGTERM and run the worker's drain path (decode/prefill) or sync their manifest
//!    (store).
//! 4. **WaitForPods** — until no pod of the resource is left.
//! 5. **RemoveFinalizer** — the API server then deletes the resource and the garbage collector
//!    its (now empty) children.
//!
//! No step creates or applies a child. Steps are idempotent: the planner is re-run on every
//! reconcile from what it observes, so an operator restart resumes where it stopped.

/// What the controller observed about a resource being deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TeardownObservation {
    /// Resources that must go (or drain) first, e.g. `DecodePool/d` (empty when none).
    pub blocking: Vec<String>,
    /// The front-door Service still exists (DecodePool only) and is not already terminating.
    pub front_door_present: bool,
    /// Workloads (StatefulSet names) whose `spec.replicas` is still above 0 and that are not
    /// already terminating.
    pub scaled_up: Vec<String>,
    /// Pods of the resource still present (terminating or not).
    pub pods_left: u32,
}

/// The next teardown step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TeardownStep {
    /// Wait for these resources.
    WaitForDependents(Vec<String>),
    /// Delete the front-door Service.
    StopRouting,
    /// Scale these StatefulSets to 0.
    ScaleToZero(Vec<String>),
    /// Wait until this many pods are gone.
    WaitForPods(u32),
    /// Done: remove the finalizer.
    RemoveFinalizer,
}

impl TeardownStep {
    /// Short name for events and logs.
    pub fn name(&self) -> &'static str {
        match self {
            TeardownStep::WaitForDependents(_) => "WaitForDependents",
            TeardownStep::StopRouting => "StopRouting",
            TeardownStep::ScaleToZero(_) => "ScaleToZero",
            TeardownStep::WaitForPods(_) => "WaitForPods",
            TeardownStep::RemoveFinalizer => "RemoveFinalizer",
        }
    }
}

/// The next step for what was observed.
pub fn next_step(o: &TeardownObservation) -> TeardownStep {
    if !o.blocking.is_empty() {
        return TeardownStep::WaitForDependents(o.blocking.clone());
    }
    if o.front_door_present {
        return TeardownStep::StopRouting;
    }
    if !o.scaled_up.is_empty() {
        return TeardownStep::ScaleToZero(o.scaled_up.clone());
    }
    if o.pods_left > 0 {
        return TeardownStep::WaitForPods(o.pods_left);
    }
    TeardownStep::RemoveFinalizer
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DecodePool teardown, step by step, as the world responds to each step.
    #[test]
    fn decode_pool_stops_routing_then_drains_then_releases() {
        let mut o = TeardownObservation {
            blocking: vec![],
            front_door_present: true,
            scaled_up: vec!["d-g0".into(), "d-g1".into()],
            pods_left: 2,
        };
        let mut steps = Vec::new();
        loop {
            let s = next_step(&o);
            steps.push(s.name());
            match s {
                TeardownStep::StopRouting => o.front_door_present = false,
                TeardownStep::ScaleToZero(_) => o.scaled_up.clear(),
                TeardownStep::WaitForPods(_) => o.pods_left -= 1,
                TeardownStep::RemoveFinalizer => break,
                TeardownStep::WaitForDependents(_) => unreachable!(),
            }
        }
        assert_eq!(
            steps,
            [
                "StopRouting",
                "ScaleToZero",
                "WaitForPods",
                "WaitForPods",
                "RemoveFinalizer"
            ]
        );
    }

    #[test]
    fn dependents_block_every_other_step() {
        let o = TeardownObservation {
            blocking: vec!["DecodePool/d".into()],
            front_door_present: false,
            scaled_up: vec!["p-g0".into()],
            pods_left: 1,
        };
        assert_eq!(
            next_step(&o),
            TeardownStep::WaitForDependents(vec!["DecodePool/d".into()])
        );
    }

    #[test]
    fn nothing_left_releases_at_once() {
        assert_eq!(
            next_step(&TeardownObservation::default()),
            TeardownStep::RemoveFinalizer
        );
    }
}
