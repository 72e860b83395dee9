//! Reading and writing children and the parent's own metadata and status: the only place that
//! sends writes, so the skip-when-unchanged rules live in one module.

use std::collections::BTreeMap;
use std::fmt::Debug;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use super::{Context, DESIRED_HASH, Error, FINALIZER, Result};
use crate::labels::{self, FIELD_MANAGER, Role};
use crate::status::ConditionStatus;

/// Hash of a desired object (its JSON), written as [`DESIRED_HASH`].
pub fn desired_hash<K: Serialize>(obj: &K) -> Result<String> {
    let text = serde_json::to_string(obj)?;
    let digest = Sha256::digest(text.as_bytes());
    Ok(digest.iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// Stamps `obj` with the hash of its current content.
pub fn stamp<K: Serialize + Resource>(obj: &mut K) -> Result<String> {
    let h = desired_hash(obj)?;
    obj.annotations_mut().insert(DESIRED_HASH.into(), h.clone());
    Ok(h)
}

/// Label selector of a pool's (or tier's) objects.
pub fn selector(pool: &str, role: Role) -> String {
    labels::selector_string(pool, role)
}

/// Lists objects of `api` carrying the selector labels of `pool`.
pub async fn list<K>(api: &Api<K>, pool: &str, role: Role) -> Result<Vec<K>>
where
    K: Clone + DeserializeOwned + Debug,
{
    Ok(api
        .list(&ListParams::default().labels(&selector(pool, role)))
        .await?
        .items)
}

/// Why a child was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyReason {
    /// It did not exist.
    Missing,
    /// Its desired hash changed (spec or template change).
    Changed,
    /// Its replicas were edited by someone else.
    ReplicaDrift,
}

/// Applies `desired` (server-side apply, field manager `tandem-operator`, force) when `existing`
/// is missing, carries another desired hash, or — with `replicas` — has drifted replicas; but
/// not while reads come from the caches and this very object (same hash) was applied and its
/// watch event has not arrived ([`super::cache::PendingApplies`]: `existing` is then older than
/// the operator's own write). Returns why it applied, or `None` when nothing was written.
pub async fn apply_if_changed<K>(
    ctx: &Context,
    kind: &str,
    api: &Api<K>,
    mut desired: K,
    existing: Option<&K>,
    replicas: Option<(i32, Option<i32>)>,
) -> Result<Option<ApplyReason>>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
{
    let hash = stamp(&mut desired)?;
    let cached = ctx.caches().is_some();
    if cached && ctx.pending_applies.pending(&desired, &hash) {
        return Ok(None);
    }
    let reason = match existing {
        None => Some(ApplyReason::Missing),
        Some(e) if e.annotations().get(DESIRED_HASH) != Some(&hash) => Some(ApplyReason::Changed),
        Some(_) => match replicas {
            Some((want, have)) if have != Some(want) => Some(ApplyReason::ReplicaDrift),
            _ => None,
        },
    };
    let reason = match (reason, ctx.always_apply()) {
        (None, true) => Some(ApplyReason::Changed),
        (r, _) => r,
    };
    if reason.is_some() {
        let name = desired.name_any();
        // Recorded before the write: its watch event may be routed before the patch returns
        // (and must then clear the record, not precede it).
        if cached {
            ctx.pending_applies.applied(&desired, &hash);
        }
        let applied = api
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&desired),
            )
            .await;
        if let Err(e) = applied {
            ctx.pending_applies.seen(&desired);
            return Err(e.into());
        }
        ctx.metrics.write(kind, "apply");
    }
    Ok(reason)
}

/// Adds [`FINALIZER`] to `obj` if missing (merge patch guarded by `resourceVersion`).
pub async fn ensure_finalizer<K>(ctx: &Context, kind: &str, api: &Api<K>, obj: &K) -> Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    if obj.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(());
    }
    let mut list = obj.finalizers().to_vec();
    list.push(FINALIZER.into());
    let patch = serde_json::json!({"metadata": {
        "finalizers": list, "resourceVersion": obj.resource_version()}});
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    ctx.metrics.write(kind, "finalizer");
    Ok(())
}

/// Removes [`FINALIZER`] from `obj` (merge patch guarded by `resourceVersion`).
pub async fn remove_finalizer<K>(ctx: &Context, kind: &str, api: &Api<K>, obj: &K) -> Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    if !obj.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(());
    }
    let list: Vec<&String> = obj
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .collect();
    let patch = serde_json::json!({"metadata": {
        "finalizers": list, "resourceVersion": obj.resource_version()}});
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    ctx.metrics.write(kind, "finalizer");
    Ok(())
}

/// Applies `status` (server-side apply on the status subresource, so a field this operator set
/// before and now omits is removed) when it differs from `previous`.
pub async fn patch_status_if_changed<K, S>(
    ctx: &Context,
    kind: &str,
    api: &Api<K>,
    name: &str,
    previous: Option<&S>,
    status: &S,
) -> Result<bool>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    S: Serialize + PartialEq,
{
    if previous == Some(status) {
        return Ok(false);
    }
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    ctx.metrics.write(kind, "status");
    Ok(true)
}

/// Scales a StatefulSet to 0 through its `/scale` subresource (a patch that cannot create).
pub async fn scale_to_zero(
    ctx: &Context,
    kind: &str,
    api: &Api<StatefulSet>,
    name: &str,
) -> Result<()> {
    let patch = serde_json::json!({"spec": {"replicas": 0}});
    match api
        .patch_scale(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    ctx.metrics.write(kind, "scale");
    Ok(())
}

/// Deletes a named object; a 404 counts as done.
pub async fn delete<K>(ctx: &Context, kind: &str, api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    ctx.metrics.write(kind, "delete");
    Ok(())
}

/// Children by name.
pub fn by_name<K: Resource>(items: Vec<K>) -> BTreeMap<String, K> {
    items.into_iter().map(|k| (k.name_any(), k)).collect()
}

/// The group index of a labelled object.
pub fn group_of<K: Resource>(obj: &K) -> Option<u32> {
    obj.labels().get(labels::GROUP)?.parse().ok()
}

/// Pod facts the controllers use.
pub fn pod_ready(p: &Pod) -> bool {
    condition(p, "Ready").is_some_and(ConditionStatus::is_true)
}

/// The pod's `ContainersReady` condition is true (its containers' readiness alone, without
/// readiness gates: what [`crate::gang`] judges a group by).
pub fn pod_containers_ready(p: &Pod) -> bool {
    condition(p, "ContainersReady").is_some_and(ConditionStatus::is_true)
}

/// The largest `restartCount` among the pod's containers and init containers (native sidecars
/// restart in place like main containers); 0 without status.
pub fn pod_restarts(p: &Pod) -> u32 {
    let Some(st) = p.status.as_ref() else {
        return 0;
    };
    st.container_statuses
        .iter()
        .chain(st.init_container_statuses.iter())
        .flatten()
        .map(|c| u32::try_from(c.restart_count).unwrap_or(0))
        .max()
        .unwrap_or(0)
}

/// `PodScheduled=False` with reason `Unschedulable`.
pub fn pod_unschedulable(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && ConditionStatus::parse(&c.status) == ConditionStatus::False
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
}

/// The pod is bound to a node.
pub fn pod_scheduled(p: &Pod) -> bool {
    p.spec.as_ref().is_some_and(|s| s.node_name.is_some())
        || condition(p, "PodScheduled").is_some_and(ConditionStatus::is_true)
}

/// The status of the pod condition `type_` (a core/v1 pod condition type such as `Ready`).
fn condition(p: &Pod, type_: &str) -> Option<ConditionStatus> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| ConditionStatus::parse(&c.status))
}

/// The object has a deletion timestamp.
pub fn terminating<K: Resource>(obj: &K) -> bool {
    obj.meta().deletion_timestamp.is_some()
}

/// Event type shorthand.
pub fn warning() -> EventType {
    EventType::Warning
}

/// Event type shorthand.
pub fn normal() -> EventType {
    EventType::Normal
}

/// `Error::MissingField` helper.
pub fn need<T>(v: Option<T>, what: &'static str) -> Result<T> {
    v.ok_or(Error::MissingField(what))
}
