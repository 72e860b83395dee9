//! `DecodePool`: decode instances, the front door, and the owner of the P:D ratio.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::common::{
    EngineSpec, HostPoolSpec, LocalRef, ModelSpec, Parallelism, PodTemplateOverrides,
    SpeculativeSpec, Transport, default_max_group_restarts, default_worker_image,
};
use crate::prefill_pool::{NO_GPU_IN_RESOURCES, NO_GPU_IN_RESOURCES_MESSAGE, PoolStatus};
use crate::ratio::PdRatio;

/// The PrefillPool this pool pairs with and the P:D ratio that sizes it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrefillPairing {
    /// The PrefillPool in this namespace.
    pub pool_ref: LocalRef,
    /// Prefill instances per decode instance, `"P:D"`; the PrefillPool gets
    /// `ceil(decode replicas × P / D)` groups.
    pub ratio: PdRatio,
    /// How long a decode waits for a request's KV from its prefill (queueing, compute and
    /// transfer) before it aborts the room through the release gate and retries the request on
    /// another prefill (a vLLM decode recomputes the prompt instead). Unset: 30 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_deadline: Option<KvDeadlineSpec>,
}

/// A prefill queueing deadline as in seed 004: the decode aborts a request whose KV has not
/// arrived `milliseconds + perTokenMicroseconds × prompt tokens` after it opened the room, which
/// bounds TTFT when prefills queue; the release gate keeps the aborted room's pages from reuse
/// until the prefill's writes to them are fenced.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KvDeadlineSpec {
    /// Fixed part, milliseconds.
    #[x_kube(validation = Rule::new("self >= 100 && self <= 600000").message("prefill.kvDeadline.milliseconds must be between 100 and 600000"))]
    pub milliseconds: i64,
    /// Added per prompt token, microseconds: set it to about twice the prefill's compute time per
    /// token so that only queueing, not a long prompt, trips the deadline.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 100000").message("prefill.kvDeadline.perTokenMicroseconds must be between 0 and 100000"))]
    pub per_token_microseconds: i64,
}

/// A GPU budget for this DecodePool and its PrefillPool together. A scale or ratio change is
/// admitted only as one transaction that never exceeds it (shrink before grow).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetSpec {
    /// GPUs for both pools (each pod has one). At least one decode group (CEL on the spec) and
    /// one prefill group (checked by the operator, which sees the PrefillPool).
    pub gpus: i32,
}

/// The speculative-decoding anomaly guard (seed 004): a request whose draft stops helping
/// (accept length too low) or looks degenerate (accept rate too high, e.g. a repetition loop) is
/// aborted through the release protocol and retried on another instance.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpecGuardSpec {
    /// Abort when the mean accept length (tokens per verification step, bonus token included)
    /// falls below this after `afterTokens`.
    #[serde(default = "default_min_accept_length")]
    #[x_kube(validation = Rule::new("self >= 1.0").message("specGuard.minAcceptLength must be at least 1.0 (one token per step is plain decoding)"))]
    pub min_accept_length: f64,
    /// Abort when the fraction of accepted draft tokens rises above this after `afterTokens`.
    #[serde(default = "default_max_accept_rate")]
    #[x_kube(validation = Rule::new("self > 0.0 && self <= 1.0").message("specGuard.maxAcceptRate must be in (0, 1]"))]
    pub max_accept_rate: f64,
    /// Generated tokens before the guard judges a request.
    #[serde(default = "default_after_tokens")]
    #[x_kube(validation = Rule::new("self >= 1").message("specGuard.afterTokens must be at least 1"))]
    pub after_tokens: i32,
    /// Retries on another instance before the request fails.
    #[serde(default = "default_retry_budget")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 10").message("specGuard.retryBudget must be between 0 and 10"))]
    pub retry_budget: i32,
}

fn default_min_accept_length() -> f64 {
    1.4
}
fn default_max_accept_rate() -> f64 {
    0.96
}
fn default_after_tokens() -> i32 {
    128
}
fn default_retry_budget() -> i32 {
    1
}

impl Default for SpecGuardSpec {
    fn default() -> Self {
        Self {
            min_accept_length: default_min_accept_length(),
            max_accept_rate: default_max_accept_rate(),
            after_tokens: default_after_tokens(),
            retry_budget: default_retry_budget(),
        }
    }
}

/// Changing `id` starts an ordered rolling restart, one group at a time (DESIGN §5).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestartSpec {
    /// Any string; a new value restarts every group of both pools in order.
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 63").message("restart.id must be 1 to 63 characters"))]
    pub id: String,
}

/// The Service clients call.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct FrontDoorSpec {
    /// Service port of the OpenAI-compatible completions endpoint.
    #[serde(default = "default_port")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("frontDoor.port must be between 1 and 65535"))]
    pub port: i32,
}

fn default_port() -> i32 {
    8000
}

impl Default for FrontDoorSpec {
    fn default() -> Self {
        Self {
            port: default_port(),
        }
    }
}

/// Decode instances and the front door. Owns the P:D ratio: scaling this pool (also through
/// `kubectl scale` or an HPA on the scale subresource) moves the paired PrefillPool too.
#[allow(clippy::duplicated_attributes)] // typed printcolumn(..) entries trip this lint
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "serving.tandem.dev",
    version = "v1alpha1",
    kind = "DecodePool",
    namespaced,
    status = "PoolStatus",
    shortname = "dcp",
    category = "tandem",
    derive = "PartialEq",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    cel,
    validation = Rule::new("self.metadata.name.size() <= 40").message("a DecodePool name must be at most 40 characters (it prefixes its StatefulSet and pod names)")
)]
#[kube(printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"))]
#[kube(printcolumn(
    name = "Admitted",
    type_ = "integer",
    json_path = ".status.admittedReplicas"
))]
#[kube(printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"))]
#[kube(printcolumn(name = "Ratio", type_ = "string", json_path = ".spec.prefill.ratio"))]
#[kube(printcolumn(
    name = "Prefill",
    type_ = "string",
    json_path = ".spec.prefill.poolRef.name"
))]
#[kube(printcolumn(
    name = "Rollout",
    type_ = "string",
    json_path = ".status.rollout.phase"
))]
#[kube(printcolumn(name = "Engine", type_ = "string", json_path = ".spec.engine.kind"))]
#[kube(printcolumn(
    name = "Age",
    type_ = "date",
    json_path = ".metadata.creationTimestamp"
))]
#[x_kube(validation = Rule::new(crate::common::REAL_ENGINE_PARALLELISM_RULE).message(crate::common::REAL_ENGINE_PARALLELISM_MESSAGE))]
#[x_kube(validation = Rule::new(crate::common::REAL_ENGINE_DECODE_RULE).message(crate::common::REAL_ENGINE_DECODE_MESSAGE))]
#[x_kube(validation = Rule::new("!has(self.budget) || self.budget.gpus >= self.parallelism.tensor * self.parallelism.context")
    .message("budget.gpus must hold at least one decode group (parallelism.tensor × parallelism.context GPUs); raise budget.gpus or shrink the group"))]
#[x_kube(validation = Rule::new("!has(self.speculative) || self.specGuard.minAcceptLength <= double(self.speculative.draftTokens + 1)")
    .message("specGuard.minAcceptLength cannot exceed speculative.draftTokens + 1 (the most tokens one step can accept); every request would be aborted"))]
#[serde(rename_all = "camelCase")]
pub struct DecodePoolSpec {
    /// Model identity and KV geometry; must equal the PrefillPool's and the CacheTier's.
    pub model: ModelSpec,
    /// Decode groups.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: i32,
    /// Parallel layout of one group.
    #[serde(default)]
    pub parallelism: Parallelism,
    /// The CacheTier (L3) this pool reads and writes; no L3 when unset. With a vLLM engine it
    /// also picks the mode: with a tier the engine serves whole requests with Tandem's offloading
    /// tier, without one it runs prefill/decode through Tandem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_tier_ref: Option<LocalRef>,
    /// Host (L2) KV pool of each pod.
    pub host_pool: HostPoolSpec,
    /// Speculative decoding: a draft model whose pools share the target's allocator domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeSpec>,
    /// The PrefillPool this pool pairs with, and the ratio.
    pub prefill: PrefillPairing,
    /// GPU budget for both pools; unlimited when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetSpec>,
    /// Seconds a scale-up may stay unschedulable before it is rolled back with
    /// `InsufficientCapacity`.
    #[serde(default = "default_unschedulable_deadline")]
    #[x_kube(validation = Rule::new("self >= 10 && self <= 86400").message("unschedulableDeadlineSeconds must be between 10 and 86400"))]
    pub unschedulable_deadline_seconds: i32,
    /// The speculative-decoding anomaly guard.
    #[serde(default)]
    pub spec_guard: SpecGuardSpec,
    /// Rolling restart trigger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<RestartSpec>,
    /// The client-facing Service.
    #[serde(default)]
    pub front_door: FrontDoorSpec,
    /// Bulk KV transport.
    #[serde(default)]
    pub transport: Transport,
    /// The serving engine beside the worker (DESIGN §3.1): an `engine` container with the worker
    /// as its native sidecar. Unset: the worker alone, with its built-in simulated engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineSpec>,
    /// Topology-aware placement (issue 17): the pods of a group are packed into one domain of
    /// `topologyKey`, and the pool's pods go where pods of its paired PrefillPool run;
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

fn default_unschedulable_deadline() -> i32 {
    300
}
