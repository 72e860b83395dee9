//! Topology-aware placement of a pool's pods (issue 17): the pods of a group are packed into one
//! topology domain, and a decode group is placed with prefill pods of its paired pool
//! (ai-dynamo/dynamo `kvTransferPolicy`: KV moves fastest inside a zone, rack or NVLink domain).
//!
//! The operator renders it as pod affinity on the group StatefulSets (a scheduling rule, so the
//! scheduler enforces it): `Required` is `requiredDuringSchedulingIgnoredDuringExecution` (a pod
//! stays Pending rather than leave the domain), `Preferred` the weighted form (weight 100).

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// Longest label key Kubernetes accepts: a 253-character DNS-subdomain prefix, `/`, and a
/// 63-character name.
pub const MAX_TOPOLOGY_KEY: usize = 317;

/// The CEL rule of `placement.topologyKey`: a label key (optional DNS-subdomain prefix and `/`,
/// then a name of 1 to 63 alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric).
pub const TOPOLOGY_KEY_RULE: &str = "self.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$')";
/// Message of [`TOPOLOGY_KEY_RULE`].
pub const TOPOLOGY_KEY_MESSAGE: &str = "placement.topologyKey must be a node label key, for example \
     topology.kubernetes.io/zone";

/// A node label key naming a topology domain (`topology.kubernetes.io/zone`, a rack label, an
/// NVLink-domain label); the CRD checks its grammar at admission ([`TOPOLOGY_KEY_RULE`]).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(transparent)]
pub struct TopologyKey(pub String);

impl TopologyKey {
    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl schemars::JsonSchema for TopologyKey {
    fn schema_name() -> Cow<'static, str> {
        "TopologyKey".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_TOPOLOGY_KEY,
            "description": "Node label key naming a topology domain, e.g. topology.kubernetes.io/zone.",
            "x-kubernetes-validations": [{"rule": TOPOLOGY_KEY_RULE, "message": TOPOLOGY_KEY_MESSAGE}],
        })
    }
}

/// Whether placement is a hard rule.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
pub enum PlacementMode {
    /// The scheduler must honour it: a pod that cannot be placed in its group's domain (a
    /// DecodePool's pod: next to its paired prefill pods) stays Pending; nodes without the label
    /// are never chosen. A paired DecodePool's group packing stays weighted, since the scheduler
    /// requires every required term to be met by one existing pod.
    Required,
    /// The scheduler prefers it (weight 100) and places the pod elsewhere when it must, also on
    /// a node without the label (the pool then reports `Degraded`, `NodeWithoutTopologyLabel`).
    #[default]
    Preferred,
}

impl PlacementMode {
    /// The spec's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Required => "Required",
            Self::Preferred => "Preferred",
        }
    }
}

/// `spec.placement` of a PrefillPool or DecodePool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSpec {
    /// The node label whose value names a domain: the pods of one group share its value, and a
    /// DecodePool's pods go where pods of its paired PrefillPool run.
    pub topology_key: TopologyKey,
    /// `Required` or `Preferred` (the default).
    #[serde(default)]
    pub mode: PlacementMode,
}
