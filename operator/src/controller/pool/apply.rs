//! What prefill and decode pools share: observing the children, converging them (config, peers
//! Service, group StatefulSets, rollout steps) and building the status.

use std::collections::BTreeMap;
use std::fmt::Debug;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tandem_crds::conditions as cond;
use tandem_crds::{PoolStatus, RolloutStatus, ScalingStatus};
use tandem_interfaces::config::WorkerConfig;

use super::children::{self, ApplyReason, normal, warning};
use super::{Context, RESYNC, Result};
use crate::labels::{self, Role};
use crate::render::{PoolView, workload};
use crate::rollout::{self, GroupObservation, PodObservation, RolloutAction, RolloutPlan};
use crate::status::{self, Decided};

/// The children of a pool as listed now.
#[derive(Debug, Default, Clone)]
pub struct PoolChildren {
    /// Group StatefulSets by name.
    pub statefulsets: BTreeMap<String, StatefulSet>,
    /// Services by name (peers, front door).
    pub services: BTreeMap<String, Service>,
    /// ConfigMaps by name.
    pub config_maps: BTreeMap<String, ConfigMap>,
    /// Pods of every group.
    pub pods: Vec<Pod>,
}

impl PoolChildren {
    /// Group StatefulSets that exist, not terminating, with index below `groups`.
    pub fn groups_in_range(&self, groups: u32) -> u32 {
        self.statefulsets
            .values()
            .filter(|s| !children::terminating(*s))
            .filter(|s| children::group_of(*s).is_some_and(|g| g < groups))
            .count() as u32
    }

    /// Group StatefulSets that exist and are not terminating (any index).
    pub fn groups_existing(&self) -> u32 {
        self.statefulsets
            .values()
            .filter(|s| !children::terminating(*s))
            .count() as u32
    }

    /// The group observations of groups `0..groups` of `group_size` pods.
    pub fn observations(&self, groups: u32, group_size: u32) -> Vec<GroupObservation> {
        (0..groups)
            .map(|g| GroupObservation {
                index: g,
                desired_pods: group_size,
                pods: self
                    .pods
                    .iter()
                    .filter(|p| children::group_of(*p) == Some(g))
                    .map(|p| PodObservation {
                        name: p.name_any(),
                        revision: p
                            .labels()
                            .get(labels::REVISION)
                            .cloned()
                            .unwrap_or_default(),
                        ready: children::pod_ready(p),
                        terminating: children::terminating(p),
                    })
                    .collect(),
            })
            .collect()
    }
}

/// Lists the children of pool `name` with role `role`.
pub async fn observe(ctx: &Context, ns: &str, name: &str, role: Role) -> Result<PoolChildren> {
    let c = &ctx.client;
    Ok(PoolChildren {
        statefulsets: children::by_name(
            children::list(&Api::<StatefulSet>::namespaced(c.clone(), ns), name, role).await?,
        ),
        services: children::by_name(
            children::list(&Api::<Service>::namespaced(c.clone(), ns), name, role).await?,
        ),
        config_maps: children::by_name(
            children::list(&Api::<ConfigMap>::namespaced(c.clone(), ns), name, role).await?,
        ),
        pods: children::list(&Api::<Pod>::namespaced(c.clone(), ns), name, role).await?,
    })
}

/// Counts the pods of pool `name` with role `role`.
pub async fn observe_pods(ctx: &Context, ns: &str, name: &str, role: Role) -> Result<u32> {
    let pods = children::list(&Api::<Pod>::namespaced(ctx.client.clone(), ns), name, role).await?;
    Ok(pods.len() as u32)
}

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
    match reason {
        Some(ApplyReason::Missing) => {
            ctx.event_related(
                parent,
                related.clone(),
                normal(),
                "Created",
                "Apply",
                format!("created {what} {name}"),
            )
            .await;
        }
        Some(ApplyReason::Changed) => {
            ctx.event_related(
                parent,
                related.clone(),
                normal(),
                "Updated",
                "Apply",
                format!("updated {what} {name}"),
            )
            .await;
        }
        Some(ApplyReason::ReplicaDrift) => {
            let (want, have) = replicas.unwrap_or_default();
            ctx.event_related(
                parent,
                related.clone(),
                warning(),
                "ReplicaDrift",
                "RestoreReplicas",
                format!(
                    "{what} {name} had replicas {} set outside the operator; restored to {want}",
                    have.map_or("unset".into(), |h| h.to_string())
                ),
            )
            .await;
        }
        None => {}
    }
    Ok(reason)
}

/// Converges a pool's children to `groups` groups rendered from `cfg` (revision filled in).
/// Returns the rollout plan that was acted on.
#[allow(clippy::too_many_arguments)]
pub async fn converge(
    ctx: &Context,
    kind: &str,
    parent: &ObjectReference,
    view: &PoolView<'_>,
    cfg: &WorkerConfig,
    groups: u32,
    owner: &OwnerReference,
    observed: &PoolChildren,
    gate_open: bool,
) -> Result<RolloutPlan> {
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
        let sts = workload::group_statefulset(view, cfg, g, owner);
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

    let obs = observed.observations(groups, view.group_size());
    let plan = rollout::plan(&obs, &cfg.revision, gate_open);
    if let RolloutAction::RestartGroup { group, pods } = &plan.action {
        let pod_api: Api<Pod> = Api::namespaced(c.clone(), ns);
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

/// Facts the pool status is built from.
#[derive(Debug, Clone)]
pub struct StatusFacts<'a> {
    /// Previous status.
    pub previous: Option<&'a PoolStatus>,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// Role (for the selector).
    pub role: Role,
    /// Pool name.
    pub name: &'a str,
    /// Groups converged to.
    pub desired: u32,
    /// Existing groups (StatefulSets in range).
    pub existing: u32,
    /// Groups all of whose pods are Ready.
    pub ready: u32,
    /// The rollout plan, when the pool rolled out this time.
    pub rollout: Option<&'a RolloutPlan>,
    /// The target revision, when rendered.
    pub revision: Option<&'a str>,
    /// Who owns the count.
    pub replicas_owner: String,
    /// Scaling transaction (DecodePool).
    pub scaling: Option<ScalingStatus>,
    /// `PolicyConflict`, `Degraded` and `InsufficientCapacity` as decided by the controller;
    /// `Ready` and `Progressing` are derived here unless `blocked` is set.
    pub extra: Vec<Decided>,
    /// A blocking reason (conflict, render failure, missing pair): Ready and Progressing False.
    pub blocked: Option<(String, String)>,
}

/// The new status of a pool.
pub fn pool_status(f: &StatusFacts<'_>) -> PoolStatus {
    let prev = f.previous.cloned().unwrap_or_default();
    let (ready_c, progressing_c) = match &f.blocked {
        Some((reason, msg)) => (
            Decided::new(cond::READY, false, reason.clone(), msg.clone()),
            Decided::new(cond::PROGRESSING, false, reason.clone(), msg.clone()),
        ),
        None => {
            let ready = if f.ready >= f.desired {
                Decided::new(
                    cond::READY,
                    true,
                    "AllGroupsReady",
                    format!("{}/{} groups ready", f.ready, f.desired),
                )
            } else {
                Decided::new(
                    cond::READY,
                    false,
                    "GroupsNotReady",
                    format!("{}/{} groups ready", f.ready, f.desired),
                )
            };
            let progressing = match f.rollout {
                Some(p) if p.phase != rollout::phase::IDLE => Decided::new(
                    cond::PROGRESSING,
                    true,
                    "RollingRestart",
                    format!(
                        "{} group {}; {} groups at the new revision",
                        p.phase,
                        p.group.map_or("-".into(), |g| g.to_string()),
                        p.updated_groups
                    ),
                ),
                _ if f.existing != f.desired || f.ready < f.desired => Decided::new(
                    cond::PROGRESSING,
                    true,
                    "Scaling",
                    format!(
                        "{} groups exist, {} ready, {} desired",
                        f.existing, f.ready, f.desired
                    ),
                ),
                _ => Decided::new(cond::PROGRESSING, false, "Settled", "nothing to roll out"),
            };
            (ready, progressing)
        }
    };
    let mut decided = vec![ready_c, progressing_c];
    decided.extend(f.extra.iter().cloned());
    let now = jiff::Timestamp::now();
    let conditions: Vec<Condition> =
        status::conditions(&prev.conditions, &decided, f.generation, now);
    let settled = f
        .rollout
        .is_some_and(|p| p.phase == rollout::phase::IDLE && f.ready >= f.desired);
    PoolStatus {
        observed_generation: f.generation,
        conditions,
        replicas: i32::try_from(f.existing).unwrap_or(i32::MAX),
        ready_replicas: i32::try_from(f.ready).unwrap_or(i32::MAX),
        updated_replicas: f.rollout.map_or(prev.updated_replicas, |p| {
            i32::try_from(p.updated_groups).unwrap_or(i32::MAX)
        }),
        desired_replicas: i32::try_from(f.desired).unwrap_or(i32::MAX),
        replicas_owner: Some(f.replicas_owner.clone()),
        selector: labels::selector_string(f.name, f.role),
        current_revision: if settled {
            f.revision.map(str::to_owned)
        } else {
            prev.current_revision.clone()
        },
        update_revision: f.revision.map(str::to_owned).or(prev.update_revision),
        rollout: match f.rollout {
            Some(p) => Some(RolloutStatus {
                phase: p.phase.into(),
                updated_groups: i32::try_from(p.updated_groups).unwrap_or(i32::MAX),
                group: p.group.and_then(|g| i32::try_from(g).ok()),
                target_revision: f.revision.map(str::to_owned),
            }),
            None => prev.rollout,
        },
        scaling: f.scaling.clone().or(prev.scaling),
    }
}

/// The condition list of `previous` without a flip: the decided `type_` unless it is missing.
pub fn previous_condition<'a>(
    previous: Option<&'a PoolStatus>,
    type_: &str,
) -> Option<&'a Condition> {
    previous.and_then(|s| status::find(&s.conditions, type_))
}

/// True when the condition `type_` moves to True with `reason` now (for a one-time event).
pub fn newly_true(previous: Option<&PoolStatus>, type_: &str, reason: &str) -> bool {
    !previous_condition(previous, type_).is_some_and(|c| c.status == "True" && c.reason == reason)
}

/// The `resources` gauge state of a pool status.
pub fn state_of(s: &PoolStatus) -> &'static str {
    use crate::status::is_true;
    if is_true(&s.conditions, cond::POLICY_CONFLICT) {
        "PolicyConflict"
    } else if is_true(&s.conditions, cond::INSUFFICIENT_CAPACITY) {
        "InsufficientCapacity"
    } else if is_true(&s.conditions, cond::READY) {
        "Ready"
    } else if is_true(&s.conditions, cond::PROGRESSING) {
        "Progressing"
    } else {
        "NotReady"
    }
}

/// The message of `PolicyConflict=False`: what was resolved.
pub fn policy_message(p: &crate::policy::MemoryPolicy) -> String {
    match &p.l3 {
        Some(l3) => format!(
            "CacheTier {:?}: allocator {:?}, client mode {:?}, {} tokens per page",
            l3.tier, p.allocator, l3.client_mode, l3.page_tokens
        ),
        None => format!("no CacheTier: allocator {:?}, no L3", p.allocator),
    }
}

/// Why a pool cannot roll out: the condition set True, with its reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Condition type (`Degraded` or `PolicyConflict`).
    pub type_: &'static str,
    /// Condition reason (CamelCase), also the event reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

impl Block {
    /// A block setting `type_` True with `reason` and `message`.
    pub fn new(type_: &'static str, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            type_,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// Reports `block` on pool `obj` of `kind` and `role` (a Warning event the first time the
/// condition turns True), touching no child; requeues at the resync period.
///
/// # Errors
/// The status patch's API error.
#[allow(clippy::too_many_arguments)]
pub async fn report_blocked<K>(
    ctx: &Context,
    kind: &str,
    api: &Api<K>,
    obj: &K,
    prev: Option<&PoolStatus>,
    role: Role,
    observed: &PoolChildren,
    block: Block,
    replicas_owner: String,
) -> Result<Action>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    if newly_true(prev, block.type_, &block.reason) {
        ctx.event(
            &obj.object_ref(&()),
            warning(),
            &block.reason,
            "Block",
            format!("{}; no child is created or updated", block.message),
        )
        .await;
    }
    let status = blocked_status(
        prev,
        obj.meta().generation,
        &obj.name_any(),
        role,
        observed,
        &block,
        replicas_owner,
    );
    ctx.metrics.set_state(
        kind,
        &format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any()),
        Some(state_of(&status)),
    );
    children::patch_status_if_changed(ctx, kind, api, &obj.name_any(), prev, &status).await?;
    Ok(Action::requeue(RESYNC))
}

/// The status of a pool that cannot roll out: Ready and Progressing False with the reason, the
/// blocking condition True, the other conditions False.
pub fn blocked_status(
    prev: Option<&PoolStatus>,
    generation: Option<i64>,
    name: &str,
    role: Role,
    observed: &PoolChildren,
    block: &Block,
    replicas_owner: String,
) -> PoolStatus {
    let Block {
        type_,
        reason,
        message,
    } = block;
    let extra = [
        cond::DEGRADED,
        cond::POLICY_CONFLICT,
        cond::INSUFFICIENT_CAPACITY,
    ]
    .into_iter()
    .map(|t| {
        if t == *type_ {
            Decided::new(t, true, reason.as_str(), message.as_str())
        } else if t == cond::INSUFFICIENT_CAPACITY {
            match previous_condition(prev, t) {
                Some(c) => Decided::new(t, c.status == "True", c.reason.clone(), c.message.clone()),
                None => Decided::new(t, false, "WithinCapacity", "no scale-up pending"),
            }
        } else {
            Decided::new(t, false, "AsExpected", "")
        }
    })
    .collect();
    let existing = observed.groups_existing();
    pool_status(&StatusFacts {
        previous: prev,
        generation,
        role,
        name,
        desired: prev.map_or(0, |p| u32::try_from(p.desired_replicas).unwrap_or(0)),
        existing,
        ready: 0,
        rollout: None,
        revision: None,
        replicas_owner,
        scaling: None,
        extra,
        blocked: Some((reason.clone(), message.clone())),
    })
}
