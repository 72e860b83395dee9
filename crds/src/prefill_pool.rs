//! `PrefillPool`: prefill instances, and the status type both pool kinds share.

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::common::{
    EngineSpec, HostPoolSpec, LocalRef, ModelSpec, Parallelism, PodTemplateOverrides,
    SpeculativeSpec, Transport, default_max_group_restarts, default_worker_image,
};

/// The dedicated receive buffer for decode→prefill session snapshots (seed 002, DESIGN
/// contract 4). It never competes with the prefill KV pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotBufferSpec {
    /// Bytes of registered host memory per prefill pod; `0` disables snapshot sync.
    #[serde(default = "default_snapshot_size")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0'))").message("snapshotBuffer.size must be a non-negative quantity such as 8Gi"))]
    pub size: Quantity,
}

fn default_snapshot_size() -> Quantity {
    Quantity("8Gi".into())
}

impl Default for SnapshotBufferSpec {
    fn default() -> Self {
        Self {
            size: default_snapshot_size(),
        }
    }
}

/// The CEL rule shared by both pools: the operator gives each pod exactly one GPU.
pub(crate) const NO_GPU_IN_RESOURCES: &str = "(!has(self.limits) || !('nvidia.com/gpu' in self.limits)) && (!has(self.requests) || !('nvidia.com/gpu' in self.requests))";
/// Message of [`NO_GPU_IN_RESOURCES`].
pub(crate) const NO_GPU_IN_RESOURCES_MESSAGE: &str = "resources must not set nvidia.com/gpu: each pod gets exactly one GPU and a group has tensor × context pods; change parallelism instead";

/// Prefill instances. One replica is one group of `tensor × context` pods; groups roll as units.
///
/// When a DecodePool pairs with this pool through `spec.prefill.poolRef`, the DecodePool's ratio
/// derives the replica count and `spec.replicas` here is ignored, as is an autoscaler writing
/// `/scale`: `status.replicasOwner` says who owns the count, the condition `ReplicasIgnored` says
/// that `spec.replicas` is ignored (the `Spec-Ignored` column of `kubectl get`), and `/scale`
/// reports the groups that exist (`status.replicas`). When that DecodePool is deleted the pool
/// keeps the count and revision the ratio last set until its own spec changes (no scale or
/// restart caused by the release itself).
#[allow(clippy::duplicated_attributes)] // typed printcolumn(..) entries trip this lint
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "serving.tandem.dev",
    version = "v1alpha1",
    kind = "PrefillPool",
    namespaced,
    status = "PoolStatus",
    shortname = "pfp",
    category = "tandem",
    derive = "PartialEq",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    cel,
    validation = Rule::new("self.metadata.name.size() <= 40").message("a PrefillPool name must be at most 40 characters (it prefixes its StatefulSet and pod names)")
)]
#[kube(printcolumn(
    name = "Desired",
    type_ = "integer",
    json_path = ".status.desiredReplicas"
))]
#[kube(printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"))]
#[kube(printcolumn(name = "Spec", type_ = "integer", json_path = ".spec.replicas"))]
#[kube(printcolumn(
    name = "Spec-Ignored",
    type_ = "string",
    json_path = ".status.conditions[?(@.type==\"ReplicasIgnored\")].status"
))]
#[kube(printcolumn(name = "Owner", type_ = "string", json_path = ".status.replicasOwner"))]
#[kube(printcolumn(
    name = "TP",
    type_ = "integer",
    json_path = ".spec.parallelism.tensor",
    priority = 1
))]
#[kube(printcolumn(
    name = "CP",
    type_ = "integer",
    json_path = ".spec.parallelism.context",
    priority = 1
))]
#[kube(printcolumn(name = "Engine", type_ = "string", json_path = ".spec.engine.kind"))]
#[kube(printcolumn(
    name = "Age",
    type_ = "date",
    json_path = ".metadata.creationTimestamp"
))]
#[x_kube(validation = Rule::new(crate::common::REAL_ENGINE_PARALLELISM_RULE).message(crate::common::REAL_ENGINE_PARALLELISM_MESSAGE))]
#[x_kube(validation = Rule::new(crate::common::REAL_ENGINE_PREFILL_RULE).message(crate::common::REAL_ENGINE_PREFILL_MESSAGE))]
#[x_kube(validation = Rule::new("!self.layerSplit || self.parallelism.context > 1")
    .message("layerSplit requires parallelism.context > 1: it splits layers across context-parallel ranks (set parallelism.context to 2 or more, or layerSplit: false)"))]
#[serde(rename_all = "camelCase")]
pub struct PrefillPoolSpec {
    /// Model identity and KV geometry; must equal the CacheTier's when `cacheTierRef` is set.
    pub model: ModelSpec,
    /// Groups, when no DecodePool owns the count through its ratio.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: i32,
    /// Parallel layout of one group.
    #[serde(default)]
    pub parallelism: Parallelism,
    /// Store each layer's KV only on its owner CP rank and broadcast it before attention
    /// (seed 004, DESIGN contract 6).
    #[serde(default)]
    pub layer_split: bool,
    /// The CacheTier (L3) this pool reads and writes; no L3 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_tier_ref: Option<LocalRef>,
    /// Host (L2) KV pool of each pod.
    pub host_pool: HostPoolSpec,
    /// Speculative decoding: a draft model whose pools share the target's allocator domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeSpec>,
    /// The snapshot receive buffer.
    #[serde(default)]
    pub snapshot_buffer: SnapshotBufferSpec,
    /// Bulk KV transport.
    #[serde(default)]
    pub transport: Transport,
    /// The serving engine beside the worker (DESIGN §3.1): an `engine` container with the worker
    /// as its native sidecar. Unset: the worker alone, with its built-in simulated engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineSpec>,
    /// Topology-aware placement (issue 17): the pods of a group are packed into one domain of
    /// `topologyKey`;
    /// `Required` or `Preferred`. Unset: the scheduler spreads pods as it likes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<crate::placement::PlacementSpec>,
    /// Times a group that keeps failing (a container of one of its pods restarted) is restarted
    /// at the current revision before the operator gives up on it: the
    /// group's StatefulSet is scaled to 0 (its GPUs released) and the pool reports
    /// `Degraded=True, ReplicaRestartBudgetExceeded` (kubernetes-sigs/lws KEP-820). A group of
    /// several pods is restarted whole (one rank's restart breaks the group's collectives); a
    /// one-pod group is restarted in place by the kubelet and each container restart counts. A
    /// new revision (a changed spec, `restart.id`) starts every group's count at 0.
    #[serde(default = "default_max_group_restarts")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 1000").message("maxGroupRestarts must be between 0 and 1000"))]
    pub max_group_restarts: i32,
    /// Worker image.
    #[serde(default = "default_worker_image")]
    #[x_kube(validation = Rule::new("self.size() > 0").message("image must not be empty"))]
    pub image: String,
    /// CPU and memory of each worker container (not GPUs: one per pod, set by the operator).
    #[serde(default)]
    #[x_kube(validation = Rule::new(NO_GPU_IN_RESOURCES).message(NO_GPU_IN_RESOURCES_MESSAGE))]
    pub resources: ResourceRequirements,
    /// Pod-template fields a user may override.
    #[serde(default)]
    pub pod_template: PodTemplateOverrides,
}

fn one() -> i32 {
    1
}

/// A rolling restart in progress (DESIGN §5).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// `Idle`; `WaitingForPrefill` (a DecodePool: too few prefill groups at the new revision
    /// yet); `WaitingForStatefulSet` (the group's StatefulSet controller has not yet seen the new
    /// pod template); `Draining` (the group's pods are terminating: routing stopped, rooms
    /// drain, L2 flushes to L3); `Restarting` (its pods are being recreated); `LoadingBack` (its
    /// new pods are not Ready yet: L3 loadback).
    pub phase: String,
    /// Groups already at the target revision and ready.
    #[serde(default)]
    pub updated_groups: i32,
    /// Index of the group being rolled, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<i32>,
    /// Revision the rollout moves to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_revision: Option<String>,
}

/// One group's restarts at the current revision (`spec.maxGroupRestarts`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupRestartStatus {
    /// Group index.
    pub group: i32,
    /// The revision the count belongs to; a group at another revision starts again at 0.
    pub revision: String,
    /// Whole-group restarts the operator made (groups of several pods).
    #[serde(default)]
    pub restarts: i32,
    /// The budget was spent: the group's StatefulSet is held at 0 pods until the revision
    /// changes.
    #[serde(default)]
    pub halted: bool,
}

/// Observed state of a PrefillPool or DecodePool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded`, `PolicyConflict`, `InsufficientCapacity`; a PrefillPool
    /// also `ReplicasIgnored` (see `tandem_crds::conditions`).
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// Groups that exist.
    #[serde(default)]
    pub replicas: i32,
    /// Groups whose pods are all ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Groups at the current revision.
    #[serde(default)]
    pub updated_replicas: i32,
    /// Groups the operator is converging to (from the ratio for a paired PrefillPool).
    #[serde(default)]
    pub desired_replicas: i32,
    /// DecodePool only: the decode groups the scaling transaction admitted
    /// (`scaling.applied.decode`). Below `spec.replicas` while a target is refused for capacity
    /// (the `InsufficientCapacity` condition says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted_replicas: Option<i32>,
    /// Who owns the replica count: `spec.replicas`, or `DecodePool/<name> ratio P:D`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas_owner: Option<String>,
    /// Label selector of the pool's pods, for the scale subresource and HPAs.
    #[serde(default)]
    pub selector: String,
    /// Revision of the running groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_revision: Option<String>,
    /// Revision the pool is moving to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_revision: Option<String>,
    /// Groups that failed at the current revision: whole-group restarts made and groups halted
    /// (`spec.maxGroupRestarts`). Empty while every group runs clean.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_restarts: Vec<GroupRestartStatus>,
    /// Rolling-restart progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
    /// The P:D scaling transaction (DecodePool only): the group counts admitted for both pools,
    /// the last counts whose pods were all scheduled, and a scale-up refused for capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<ScalingStatus>,
}

/// Group counts of a paired decode and prefill pool.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct GroupCounts {
    /// Decode groups.
    pub decode: i32,
    /// Prefill groups.
    pub prefill: i32,
}

/// The scaling transaction of a DecodePool and its PrefillPool (DESIGN §2 `budget`): the
/// operator moves `applied` towards the target one budget-safe step at a time (shrink before
/// grow) and rolls back to `scheduled` when a scale-up stays unschedulable past the deadline.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingStatus {
    /// The counts both pools are rendered with now (the PrefillPool reads `applied.prefill`).
    pub applied: GroupCounts,
    /// The last counts whose pods were all scheduled (the rollback point).
    pub scheduled: GroupCounts,
    /// When `applied` last changed (RFC 3339); the unschedulable deadline counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_at: Option<String>,
    /// A target refused for capacity; not retried until the target changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<GroupCounts>,
}
