//! `CacheTier`: the L3 KV store and the memory policy of its clients.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::common::{ModelSpec, default_worker_image};

/// Where the L3 store client runs in each worker pod.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum ClientMode {
    /// The store client runs inside each worker process.
    #[default]
    Embedded,
    /// A `store-client` sidecar owns shared-memory segments; workers may only register buffers
    /// that lie inside them (seed 000). Requires the `SharedMemory` allocator.
    Standalone,
}

/// The allocator domain of every client host KV pool (target, draft and indexer alike).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum AllocatorDomain {
    /// Shared-memory segments (memfd / POSIX shm) owned by the store client.
    #[default]
    SharedMemory,
    /// Anonymous, page-aligned mmap in the worker process.
    Mmap,
    /// Page-locked (pinned) host memory in the worker process.
    Pinned,
}

/// What a worker does when registering its host pools with the L3 client fails (DESIGN
/// contract 2).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum RegistrationFailurePolicy {
    /// Refuse to start, with an error naming allocator, client mode, buffer size and phase.
    #[default]
    FailClosed,
    /// Serve from L1/L2 only, with a warning log, a metric and a `Degraded` reason.
    FallbackToL2,
}

/// How host (L2) pages reach the L3 store.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum WritePolicy {
    /// Every page written to L2 is written to L3 before it counts as stored.
    #[default]
    WriteThrough,
    /// Pages go to L3 when evicted from L2 and on drain.
    WriteBack,
}

/// Which object the store evicts first.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum EvictionPolicy {
    /// Least recently used.
    #[default]
    LRU,
}

/// Eviction within the memory and disk budgets of each store replica.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct EvictionSpec {
    /// Order of eviction.
    #[serde(default)]
    pub policy: EvictionPolicy,
    /// Eviction starts when usage passes this percentage of a budget.
    #[serde(default = "default_high_watermark")]
    #[x_kube(validation = Rule::new("self >= 50 && self <= 100").message("eviction.highWatermarkPercent must be between 50 and 100"))]
    pub high_watermark_percent: i32,
}

fn default_high_watermark() -> i32 {
    90
}

impl Default for EvictionSpec {
    fn default() -> Self {
        Self {
            policy: EvictionPolicy::LRU,
            high_watermark_percent: default_high_watermark(),
        }
    }
}

/// A persistent volume per store replica, so the cache survives restarts (DESIGN contract 7).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PersistenceSpec {
    /// Volume size per replica.
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("persistence.size must be a positive quantity such as 500Gi"))]
    pub size: Quantity,
    /// Storage class of the claim; the cluster default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

/// The L3 KV store (a Mooncake-store-like service) and the memory policy of its clients.
#[allow(clippy::duplicated_attributes)] // typed printcolumn(..) entries trip this lint
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "serving.tandem.dev",
    version = "v1alpha1",
    kind = "CacheTier",
    namespaced,
    status = "CacheTierStatus",
    shortname = "ct",
    category = "tandem",
    derive = "PartialEq",
    cel,
    validation = Rule::new("self.metadata.name.size() <= 40").message("a CacheTier name must be at most 40 characters (it prefixes its StatefulSet and pod names)")
)]
#[kube(printcolumn(name = "Mode", type_ = "string", json_path = ".spec.clientMode"))]
#[kube(printcolumn(name = "Allocator", type_ = "string", json_path = ".spec.allocator"))]
#[kube(printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"))]
#[kube(printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"))]
#[kube(printcolumn(
    name = "Warm",
    type_ = "string",
    json_path = ".status.conditions[?(@.type==\"CacheWarm\")].status"
))]
#[kube(printcolumn(
    name = "Age",
    type_ = "date",
    json_path = ".metadata.creationTimestamp"
))]
#[x_kube(validation = Rule::new("self.clientMode != 'Standalone' || self.allocator == 'SharedMemory'")
    .message("clientMode Standalone requires allocator SharedMemory: the standalone store client can only register buffers inside its own shared-memory segments (set allocator: SharedMemory or clientMode: Embedded)"))]
#[serde(rename_all = "camelCase")]
pub struct CacheTierSpec {
    /// Where the store client runs.
    #[serde(default)]
    pub client_mode: ClientMode,
    /// The allocator domain every client host pool must use (target, draft and indexer).
    #[serde(default)]
    pub allocator: AllocatorDomain,
    /// Tokens per KV page; L3 objects are whole pages. Immutable: stored objects are laid out
    /// in pages of this size.
    #[serde(default = "default_page_tokens")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65536").message("pageTokens must be between 1 and 65536"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("pageTokens is immutable: stored objects use this page size; create a new CacheTier"))]
    pub page_tokens: i32,
    /// Model identity (name and KV geometry) of every object in the store. Immutable: a
    /// different geometry cannot read these objects; create a new CacheTier.
    #[x_kube(validation = Rule::new("self == oldSelf").message("model is immutable: objects in the store belong to this model; create a new CacheTier for another model"))]
    pub model: ModelSpec,
    /// Store replicas.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: i32,
    /// Memory of each store replica for KV objects.
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("memory must be a positive quantity such as 64Gi"))]
    pub memory: Quantity,
    /// Persist objects on a volume per replica for restart loadback; memory-only when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<PersistenceSpec>,
    /// Eviction within the memory and disk budgets.
    #[serde(default)]
    pub eviction: EvictionSpec,
    /// What a client does when registering its pools with the store fails.
    #[serde(default)]
    pub registration_failure_policy: RegistrationFailurePolicy,
    /// How host pages reach the store.
    #[serde(default)]
    pub write_policy: WritePolicy,
    /// Image of the `tandem-worker` binary used for the store and its clients.
    #[serde(default = "default_worker_image")]
    #[x_kube(validation = Rule::new("self.size() > 0").message("image must not be empty"))]
    pub image: String,
}

fn default_page_tokens() -> i32 {
    512
}

fn one() -> i32 {
    1
}

/// Loadback of persisted objects after a (re)start.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadbackProgress {
    /// Objects verified and published so far.
    pub objects_loaded: i64,
    /// Objects found on disk.
    pub objects_total: i64,
    /// Objects rejected (checksum, identity or layout mismatch); each is a miss, not a crash.
    pub objects_rejected: i64,
    /// Bytes verified and published so far.
    pub bytes_loaded: i64,
}

/// Observed state of a CacheTier.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheTierStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded`, `CacheWarm`.
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// Store replicas that exist.
    #[serde(default)]
    pub replicas: i32,
    /// Store replicas that are ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Total memory capacity, bytes.
    #[serde(default)]
    pub capacity_bytes: i64,
    /// Bytes held by objects.
    #[serde(default)]
    pub used_bytes: i64,
    /// Objects held.
    #[serde(default)]
    pub objects: i64,
    /// `host:port` of each ready store replica.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Loadback progress after the last start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loadback: Option<LoadbackProgress>,
}
