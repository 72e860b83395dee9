//! Tandem API types: `serving.tandem.dev/v1alpha1`.
//!
//! Three namespaced kinds (DESIGN §2):
//!
//! * [`CacheTier`] — the L3 KV store and the memory policy (allocator domain, client mode) of
//!   every client that uses it;
//! * [`PrefillPool`] — prefill instances, one replica = one group of `tensor × context` pods;
//! * [`DecodePool`] — decode instances and the front door; it owns the P:D ratio and, through it,
//!   the replica count of the PrefillPool it pairs with.
//!
//! Everything here is pure data: serde + schemars types, defaults, and the CEL rules that the
//! API server enforces at admission. The `crdgen` binary writes the CRD YAML into
//! `charts/tandem/crds/`; tests evaluate every CEL rule offline with kube's `cel` feature.

pub mod cache_tier;
pub mod common;
pub mod conditions;
pub mod crdgen;
pub mod decode_pool;
pub mod labels;
pub mod placement;
pub mod ports;
pub mod prefill_pool;
pub mod ratio;

pub use cache_tier::{
    AllocatorDomain, CacheTier, CacheTierSpec, CacheTierStatus, ClientMode, EvictionPolicy,
    EvictionSpec, LoadbackProgress, PersistenceSpec, RegistrationFailurePolicy, WritePolicy,
};
pub use common::{
    AttentionKind, DEFAULT_MAX_GROUP_RESTARTS, EngineKind, EngineSpec, HostPoolSpec, IndexerSpec,
    KvDtype, LocalRef, ModelSpec, Parallelism, PodTemplateOverrides, SGLANG_OWNED_FLAGS,
    SpeculativeSpec, Transport, VLLM_OWNED_FLAGS,
};
pub use decode_pool::{
    BudgetSpec, DecodePool, DecodePoolSpec, FrontDoorSpec, KvDeadlineSpec, PrefillPairing,
    RestartSpec, SpecGuardSpec,
};
pub use placement::{PlacementMode, PlacementSpec, TopologyKey};
pub use prefill_pool::{
    GroupCounts, GroupRestartStatus, PoolStatus, PrefillPool, PrefillPoolSpec, RolloutStatus,
    ScalingStatus, SnapshotBufferSpec,
};
pub use ratio::{PdRatio, RatioError};

/// The API group of every Tandem kind.
pub const GROUP: &str = "serving.tandem.dev";
/// The one served (and stored) API version.
pub const VERSION: &str = "v1alpha1";
/// The `kubectl get tandem` category shared by all three kinds.
pub const CATEGORY: &str = "tandem";
