//! Pure builders: from a pool (or tier) and its resolved policy to the worker config and the
//! Kubernetes objects. No I/O; unit-tested against YAML fixtures.

pub mod config;
pub mod engine;
pub mod placement;
pub mod tier;
pub mod workload;

use k8s_openapi::api::core::v1::ResourceRequirements;
use tandem_crds::{
    DecodePool, EngineSpec, HostPoolSpec, KvDeadlineSpec, LocalRef, ModelSpec, Parallelism,
    PlacementSpec, PodTemplateOverrides, PrefillPool, SpecGuardSpec, SpeculativeSpec, Transport,
};

use crate::labels::Role;

/// The fields prefill and decode pools share, borrowed from either kind, plus the role-specific
/// ones as options. Builders take this so each rule is written once.
#[derive(Debug, Clone)]
pub struct PoolView<'a> {
    /// Prefill or decode.
    pub role: Role,
    /// Pool name.
    pub name: &'a str,
    /// Namespace.
    pub namespace: &'a str,
    /// Model identity.
    pub model: &'a ModelSpec,
    /// Group layout.
    pub parallelism: &'a Parallelism,
    /// LayerSplit (prefill only).
    pub layer_split: bool,
    /// The tier reference.
    pub cache_tier_ref: Option<&'a LocalRef>,
    /// Host pool.
    pub host_pool: &'a HostPoolSpec,
    /// Speculative decoding.
    pub speculative: Option<&'a SpeculativeSpec>,
    /// Snapshot buffer quantity (prefill only).
    pub snapshot_buffer: Option<&'a k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    /// Spec guard (decode only).
    pub spec_guard: Option<&'a SpecGuardSpec>,
    /// The KV deadline of a room (decode only; `spec.prefill.kvDeadline`).
    pub kv_deadline: Option<&'a KvDeadlineSpec>,
    /// Front-door port (decode only).
    pub front_door_port: Option<i32>,
    /// The PrefillPool a DecodePool pairs with (decode only).
    pub paired_prefill: Option<&'a str>,
    /// Transport.
    pub transport: Transport,
    /// Image.
    pub image: &'a str,
    /// The serving engine beside the worker (`spec.engine`); `None`: the worker alone.
    pub engine: Option<&'a EngineSpec>,
    /// Container resources.
    pub resources: &'a ResourceRequirements,
    /// Pod overrides.
    pub pod_template: &'a PodTemplateOverrides,
    /// Topology-aware placement (`spec.placement`; [`placement`]).
    pub placement: Option<&'a PlacementSpec>,
    /// `restart.id` (decode; prefill follows its DecodePool's).
    pub restart_id: Option<&'a str>,
    /// `spec.maxGroupRestarts` ([`crate::recovery`]); not rendered into any child.
    pub max_group_restarts: i32,
}

impl<'a> PoolView<'a> {
    /// View of a PrefillPool.
    pub fn prefill(p: &'a PrefillPool) -> Self {
        let s = &p.spec;
        Self {
            role: Role::Prefill,
            name: p.metadata.name.as_deref().unwrap_or_default(),
            namespace: p.metadata.namespace.as_deref().unwrap_or("default"),
            model: &s.model,
            parallelism: &s.parallelism,
            layer_split: s.layer_split,
            cache_tier_ref: s.cache_tier_ref.as_ref(),
            host_pool: &s.host_pool,
            speculative: s.speculative.as_ref(),
            snapshot_buffer: Some(&s.snapshot_buffer.size),
            spec_guard: None,
            kv_deadline: None,
            front_door_port: None,
            paired_prefill: None,
            transport: s.transport,
            image: &s.image,
            engine: s.engine.as_ref(),
            resources: &s.resources,
            pod_template: &s.pod_template,
            placement: s.placement.as_ref(),
            restart_id: None,
            max_group_restarts: s.max_group_restarts,
        }
    }

    /// View of a DecodePool.
    pub fn decode(d: &'a DecodePool) -> Self {
        let s = &d.spec;
        Self {
            role: Role::Decode,
            name: d.metadata.name.as_deref().unwrap_or_default(),
            namespace: d.metadata.namespace.as_deref().unwrap_or("default"),
            model: &s.model,
            parallelism: &s.parallelism,
            layer_split: false,
            cache_tier_ref: s.cache_tier_ref.as_ref(),
            host_pool: &s.host_pool,
            speculative: s.speculative.as_ref(),
            snapshot_buffer: None,
            spec_guard: Some(&s.spec_guard),
            kv_deadline: s.prefill.kv_deadline.as_ref(),
            front_door_port: Some(s.front_door.port),
            paired_prefill: Some(&s.prefill.pool_ref.name),
            transport: s.transport,
            image: &s.image,
            engine: s.engine.as_ref(),
            resources: &s.resources,
            pod_template: &s.pod_template,
            placement: s.placement.as_ref(),
            restart_id: s.restart.as_ref().map(|r| r.id.as_str()),
            max_group_restarts: s.max_group_restarts,
        }
    }

    /// Pods per group.
    pub fn group_size(&self) -> u32 {
        u32::try_from(self.parallelism.group_size()).unwrap_or(u32::MAX)
    }
}
