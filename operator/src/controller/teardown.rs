//! Teardown writes shared by the three controllers (DESIGN §5): which workloads still run, the
//! `Degraded=True, reason Terminating` message of each step, and the step's writes. The step
//! itself is planned by the pure [`crate::teardown`].

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};

use super::blocked::{Block, Reported};
use super::children::{self, normal};
use super::pool::observe::PoolChildren;
use super::{BUSY, Context, Result};
use crate::teardown::{TeardownObservation, TeardownStep, next_step};

/// Whether a StatefulSet still counts as running for teardown: scaled above zero, not terminating.
pub fn still_scaled(s: &StatefulSet) -> bool {
    !children::terminating(s) && s.spec.replicas.unwrap_or(1) > 0
}

/// Group StatefulSets still scaled above zero and not terminating.
pub fn scaled_up(observed: &PoolChildren) -> Vec<String> {
    observed
        .statefulsets
        .iter()
        .filter(|(_, s)| still_scaled(s))
        .map(|(n, _)| n.clone())
        .collect()
}

/// The `Degraded=True, reason Terminating` message for a step.
pub fn message(step: &TeardownStep) -> String {
    match step {
        TeardownStep::WaitForDependents(d) => format!("teardown: waiting for {}", d.join(", ")),
        TeardownStep::StopRouting => "teardown: front door removed, routing stopped".into(),
        TeardownStep::ScaleToZero(s) => {
            format!("teardown: scaling {} to 0 (workers drain)", s.join(", "))
        }
        TeardownStep::WaitForPods(n) => format!("teardown: waiting for {n} pod(s) to exit"),
        TeardownStep::RemoveFinalizer => "teardown: done".into(),
    }
}

/// Executes one teardown step's writes (none of which creates or applies a child).
pub async fn run_step(
    ctx: &Context,
    kind: &str,
    parent: &k8s_openapi::api::core::v1::ObjectReference,
    ns: &str,
    name: &str,
    step: &TeardownStep,
) -> Result<()> {
    match step {
        TeardownStep::StopRouting => {
            let svcs: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
            children::delete(ctx, kind, &svcs, name).await?;
            ctx.event(
                parent,
                normal(),
                "StopRouting",
                "Teardown",
                format!("deleted the front-door Service {name}"),
            )
            .await;
        }
        TeardownStep::ScaleToZero(sets) => {
            let stss: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), ns);
            for s in sets {
                children::scale_to_zero(ctx, kind, &stss, s).await?;
            }
            ctx.event(
                parent,
                normal(),
                "Draining",
                "Teardown",
                format!("scaled {} to 0; pods drain on SIGTERM", sets.join(", ")),
            )
            .await;
        }
        TeardownStep::RemoveFinalizer => {
            ctx.event(
                parent,
                normal(),
                "TeardownComplete",
                "Teardown",
                format!(
                    "every pod of {name} exited; finalizer {} removed",
                    super::FINALIZER
                ),
            )
            .await;
        }
        TeardownStep::WaitForDependents(_) | TeardownStep::WaitForPods(_) => {}
    }
    Ok(())
}

/// Whether `obj` still carries the operator's finalizer (its teardown is not finished).
pub fn holds_finalizer<K: Resource>(obj: &K) -> bool {
    obj.finalizers().iter().any(|f| f == super::FINALIZER)
}

/// Takes the next teardown step of `obj` for what was observed: runs its writes, then removes the
/// finalizer when the step says so, else patches the status `status_of` builds for the step's
/// `Degraded=True, Terminating` block and requeues soon.
///
/// # Errors
/// API failures of the step, the finalizer patch or the status patch.
pub async fn advance<K: Reported>(
    ctx: &Context,
    api: &Api<K>,
    obj: &K,
    observation: &TeardownObservation,
    status_of: impl FnOnce(&Block) -> K::Status,
) -> Result<Action> {
    let name = obj.name_any();
    let ns = obj.namespace().unwrap_or_default();
    let step = next_step(observation);
    run_step(ctx, K::KIND, &obj.object_ref(&()), &ns, &name, &step).await?;
    if step == TeardownStep::RemoveFinalizer {
        children::remove_finalizer(ctx, K::KIND, api, obj).await?;
        return Ok(Action::await_change());
    }
    let status = status_of(&Block::terminating(&step));
    children::patch_status_if_changed(ctx, K::KIND, api, &name, obj.status(), &status).await?;
    Ok(Action::requeue(BUSY))
}
