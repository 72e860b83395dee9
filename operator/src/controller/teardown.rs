//! Teardown writes shared by the PrefillPool and DecodePool controllers (DESIGN §5): which groups
//! still run, the `Degraded=True, reason Terminating` message of each step, and the step's writes.
//! The step itself is planned by the pure [`crate::teardown`].

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Service;
use kube::Api;

use super::children::{self, normal};
use super::pool::PoolChildren;
use super::{Context, Result};
use crate::teardown::TeardownStep;

/// Group StatefulSets still scaled above zero and not terminating.
pub fn scaled_up(observed: &PoolChildren) -> Vec<String> {
    observed
        .statefulsets
        .iter()
        .filter(|(_, s)| !children::terminating(*s) && s.spec.replicas.unwrap_or(1) > 0)
        .map(|(n, _)| n.clone())
        .collect()
}

/// The `Degraded=True, reason Terminating` message for a step.
pub fn teardown_message(step: &TeardownStep) -> String {
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
pub async fn run_teardown_step(
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
