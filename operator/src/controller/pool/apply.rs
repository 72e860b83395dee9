//! The apply stage of a pool: converge its children to the desired value (config, peers Service,
//! front door, group StatefulSets; extra groups deleted) and act on the rollout plan — the only
//! stage of a pool's reconcile that writes children.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};

use super::super::children::{self, ApplyReason, normal, warning};
use super::super::{Context, Result};
use super::observe::PoolChildren;
use super::{Desired, Note};
use crate::recovery::{RecoveryAction, RecoveryPlan};
use crate::render::{PoolView, workload};
use crate::rollout::{self, RolloutAction, RolloutPlan};
use crate::{gang, labels};

/// A reference to the child `name` of kind `K` in the parent's namespace.
pub fn child_ref<K: kube::Resource<DynamicType = ()>>(
    name: &str,
    parent: &ObjectReference,
) -> ObjectReference {
    ObjectReference {
        api_version: Some(K::api_version(&()).into_owned()),
        kind: Some(K::kind(&()).into_owned()),
        name: Some(name.to_owned()),
        namespace: parent.namespace.clone(),
        ..ObjectReference::default()
    }
}

/// Applies one child and publishes an event for what was done.
#[allow(clippy::too_many_arguments)]
pub async fn apply_child<K>(
    ctx: &Context,
    kind: &str,
    parent: &ObjectReference,
    api: &Api<K>,
    desired: K,
    existing: Option<&K>,
    replicas: Option<(i32, Option<i32>)>,
    what: &str,
) -> Result<Option<ApplyReason>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let name = desired.name_any();
    let related = Some(child_ref::<K>(&name, parent));
    let reason = children::apply_if_changed(ctx, kind, api, desired, existing, replicas).await?;
    let event = match reason {
        Some(ApplyReason::Missing) => Some(Note {
            type_: normal(),
            reason: "Created",
            action: "Apply",
            message: format!("created {what} {name}"),
        }),
        Some(ApplyReason::Changed) => Some(Note {
            type_: normal(),
            reason: "Updated",
            action: "Apply",
            message: format!("updated {what} {name}"),
        }),
        Some(ApplyReason::ReplicaDrift) => {
            let (want, have) = replicas.unwrap_or_default();
            Some(Note {
                type_: warning(),
                reason: "ReplicaDrift",
                action: "RestoreReplicas",
                message: format!(
                    "{what} {name} had replicas {} set outside the operator; restored to {want}",
                    have.map_or("unset".into(), |h| h.to_string())
                ),
            })
        }
        None => None,
    };
    if let Some(n) = event {
        ctx.event_related(parent, related, n.type_, n.reason, n.action, n.message)
            .await;
    }
    Ok(reason)
}

/// Writes the group-ready readiness gate ([`crate::gang`]) on the pods whose condition must
/// change: a strategic-merge patch of `pods/status` (conditions merge by `type`, so the kubelet's
/// own conditions are untouched), nothing when every pod already carries its verdict. A pod gone
/// meanwhile (404) is skipped.
///
/// # Errors
/// API failures other than 404.
pub async fn gang_gates(
    ctx: &Context,
    kind: &str,
    pods: &Api<Pod>,
    group_size: u32,
    observed: &PoolChildren,
) -> Result<()> {
    let now = jiff::Timestamp::now();
    for w in gang::decide(group_size, &observed.gang_pods()) {
        let mut patch = serde_json::json!({"status": {"conditions": [{
            "type": gang::GROUP_READY,
            "status": w.status(),
            "reason": w.reason,
            "message": w.message,
            "lastTransitionTime": Time(now),
        }]}});
        // Decided on this version of the pod: a newer one (changed since, or a recreated
        // namesake) refuses the patch (409) and its own event brings the next decision.
        let version = observed
            .pods
            .iter()
            .find(|p| p.name_any() == w.pod)
            .and_then(|p| p.resource_version());
        if let Some(v) = version {
            patch["metadata"] = serde_json::json!({ "resourceVersion": v });
        }
        match pods
            .patch_status(&w.pod, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
        {
            Ok(_) => ctx.metrics.write(kind, "pod-gate"),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                tracing::debug!(pod = %w.pod, code = s.code, "gate not patched: the pod changed or went");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The rollout plan for `observed` (halted groups take no part in it).
pub fn rollout_plan(
    view: &PoolView<'_>,
    desired: &Desired,
    observed: &PoolChildren,
    recovery: &RecoveryPlan,
) -> RolloutPlan {
    let obs: Vec<_> = observed
        .observations(desired.groups, view.group_size())
        .into_iter()
        .filter(|g| !recovery.halted(g.index))
        .collect();
    rollout::plan_rollout(
        &obs,
        &desired.resolved.config.revision,
        desired.gate,
        desired.rolling,
    )
}

/// Whether [`converge`] would delete something for `observed`: a whole-group restart or a halt of
/// `recovery`, a group StatefulSet out of range, or the rollout's next group restart. The pool's
/// reconcile confirms such a decision on children it has just listed before acting on it
/// ([`super::super::cache`]).
pub fn would_delete(
    view: &PoolView<'_>,
    desired: &Desired,
    observed: &PoolChildren,
    recovery: &RecoveryPlan,
) -> bool {
    let out_of_range = observed.statefulsets.values().any(|s| {
        children::group_of(s).is_none_or(|g| g >= desired.groups) && !children::terminating(s)
    });
    !recovery.actions.is_empty()
        || out_of_range
        || matches!(
            rollout_plan(view, desired, observed, recovery).action,
            RolloutAction::RestartGroup { .. }
        )
}

/// Converges a pool's children to `desired` (its groups rendered from its config, revision
/// filled in; a group `recovery` halted held at 0 pods) and makes `recovery`'s whole-group
/// restarts. Returns the rollout plan that was acted on (halted groups take no part in it).
#[allow(clippy::too_many_arguments)]
pub async fn converge(
    ctx: &Context,
    kind: &str,
    parent: &ObjectReference,
    view: &PoolView<'_>,
    desired: &Desired,
    owner: &OwnerReference,
    observed: &PoolChildren,
    recovery: &RecoveryPlan,
) -> Result<RolloutPlan> {
    let cfg = &desired.resolved.config;
    let groups = desired.groups;
    let ns = view.namespace;
    let c = &ctx.client;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), ns);
    let svcs: Api<Service> = Api::namespaced(c.clone(), ns);
    let stss: Api<StatefulSet> = Api::namespaced(c.clone(), ns);

    let cm = workload::config_map(view, cfg, owner)?;
    let existing = observed.config_maps.get(&labels::config_map(view.name));
    apply_child(ctx, kind, parent, &cms, cm, existing, None, "ConfigMap").await?;

    let peers = workload::peers_service(view, owner);
    let existing = observed.services.get(&labels::peers_service(view.name));
    apply_child(ctx, kind, parent, &svcs, peers, existing, None, "Service").await?;

    if let Some(port) = view.front_door_port {
        let fd = workload::front_door_service(view, port, owner);
        let existing = observed.services.get(view.name);
        apply_child(
            ctx,
            kind,
            parent,
            &svcs,
            fd,
            existing,
            None,
            "front-door Service",
        )
        .await?;
    }

    let group_size = i32::try_from(view.group_size()).unwrap_or(i32::MAX);
    for g in 0..groups {
        let mut sts = workload::group_statefulset(view, cfg, g, owner);
        let halted = recovery.halted(g);
        if halted {
            sts.spec.replicas = Some(0);
        }
        let group_size = if halted { 0 } else { group_size };
        let name = labels::group_name(view.name, g);
        let existing = observed.statefulsets.get(&name);
        let have = existing.and_then(|s| s.spec.replicas);
        apply_child(
            ctx,
            kind,
            parent,
            &stss,
            sts,
            existing,
            Some((group_size, have)),
            "group StatefulSet",
        )
        .await?;
    }
    for (name, sts) in &observed.statefulsets {
        let out_of_range = children::group_of(sts).is_none_or(|g| g >= groups);
        if out_of_range && !children::terminating(sts) {
            children::delete(ctx, kind, &stss, name).await?;
            ctx.event_related(
                parent,
                Some(child_ref::<StatefulSet>(name, parent)),
                normal(),
                "GroupRemoved",
                "ScaleDown",
                format!("deleted group StatefulSet {name}: the pool now has {groups} groups; its pods drain on SIGTERM"),
            )
            .await;
        }
    }

    let pod_api: Api<Pod> = Api::namespaced(c.clone(), ns);
    gang_gates(ctx, kind, &pod_api, view.group_size(), observed).await?;
    for action in &recovery.actions {
        let group_ref = |g: u32| {
            Some(child_ref::<StatefulSet>(
                &labels::group_name(view.name, g),
                parent,
            ))
        };
        match action {
            RecoveryAction::RestartGroup {
                group,
                pods,
                attempt,
            } => {
                for p in pods {
                    children::delete(ctx, kind, &pod_api, p).await?;
                }
                ctx.event_related(
                    parent,
                    group_ref(*group),
                    warning(),
                    "GroupRestarted",
                    "RecoverGroup",
                    format!(
                        "group {group}: a container restarted; deleted its {} pod(s) to restart the group whole (restart {attempt} of at most {} at revision {})",
                        pods.len(),
                        view.max_group_restarts,
                        cfg.revision
                    ),
                )
                .await;
            }
            RecoveryAction::Halt { group, restarts } => {
                ctx.event_related(
                    parent,
                    group_ref(*group),
                    warning(),
                    "ReplicaRestartBudgetExceeded",
                    "HaltGroup",
                    format!(
                        "group {group} failed again after {restarts} restart(s) (maxGroupRestarts {}) at revision {}: its StatefulSet is held at 0 pods and its GPUs released until the revision changes",
                        view.max_group_restarts, cfg.revision
                    ),
                )
                .await;
            }
        }
    }

    let plan = rollout_plan(view, desired, observed, recovery);
    if let RolloutAction::RestartGroup { group, pods } = &plan.action {
        for p in pods {
            children::delete(ctx, kind, &pod_api, p).await?;
        }
        ctx.event_related(
            parent,
            Some(child_ref::<StatefulSet>(
                &labels::group_name(view.name, *group),
                parent,
            )),
            normal(),
            "RollingRestart",
            "RestartGroup",
            format!(
                "group {group}: stopped routing and deleted {} pod(s) to restart at revision {} ({} of {groups} groups updated)",
                pods.len(),
                cfg.revision,
                plan.updated_groups
            ),
        )
        .await;
    }
    Ok(plan)
}
