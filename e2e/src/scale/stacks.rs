//! The stacks and nodes of a scale run, pure: N copies of the sample stack
//! (`manifests/samples/{cachetier,prefillpool,decodepool}.yaml`), each in its own namespace, and
//! kwok nodes with GPUs and topology labels.
//!
//! Changes to the samples, each forced by the simulation and reported with the figures:
//! - the CacheTier has no `persistence` (kwok nodes have no volume provisioner, so a claim would
//!   stay Pending and its pod unschedulable);
//! - the pool that is scaled 1 → 64 pairs `1:1` (prefill follows the ratio: 64 prefill groups)
//!   with a GPU budget of exactly the target (`64 × (1 + 1)` GPUs), so the rolling restart of
//!   both pools stays within minutes on two cores.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::ObjectMeta;
use tandem_crds::{BudgetSpec, CacheTier, DecodePool, PdRatio, PrefillPool};

use crate::cluster::nodes::{kwok_node, kwok_node_name};

/// Zone label of the kwok nodes (`topology.kubernetes.io/zone`).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Rack label of the kwok nodes (no upstream key exists; this one is Tandem's).
pub const RACK_LABEL: &str = "topology.tandem.dev/rack";
/// The two zones the nodes alternate between.
pub const ZONES: [&str; 2] = ["zone-a", "zone-b"];
/// Nodes per rack.
pub const NODES_PER_RACK: u32 = 4;

/// Why the samples could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// A sample file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A sample file is not a valid object of its kind.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
}

/// The three sample objects, as parsed.
#[derive(Debug, Clone)]
pub struct Samples {
    /// `cachetier.yaml`.
    pub tier: CacheTier,
    /// `prefillpool.yaml`.
    pub prefill: PrefillPool,
    /// `decodepool.yaml`.
    pub decode: DecodePool,
}

fn parse<T: serde::de::DeserializeOwned>(dir: &Path, file: &str) -> Result<T, StackError> {
    let path = dir.join(file);
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|source| StackError::Read {
        path: shown.clone(),
        source,
    })?;
    serde_saphyr::from_str(&text).map_err(|e| StackError::Parse {
        path: shown,
        message: e.to_string(),
    })
}

impl Samples {
    /// Reads `cachetier.yaml`, `prefillpool.yaml` and `decodepool.yaml` from `dir`.
    ///
    /// # Errors
    /// A file is missing or does not parse as its kind.
    pub fn read(dir: &Path) -> Result<Self, StackError> {
        Ok(Self {
            tier: parse(dir, "cachetier.yaml")?,
            prefill: parse(dir, "prefillpool.yaml")?,
            decode: parse(dir, "decodepool.yaml")?,
        })
    }

    /// GPUs one stack of the samples asks for: decode groups plus the prefill groups the ratio
    /// gives, each of `tensor × context` pods with one GPU.
    pub fn gpus_per_stack(&self) -> u32 {
        let d = &self.decode.spec;
        let groups = u32::try_from(d.replicas.max(0)).unwrap_or(0);
        let prefill = d.prefill.ratio.prefill_replicas_for(groups);
        let size = |p: &tandem_crds::Parallelism| {
            u32::try_from((p.tensor * p.context).max(1)).unwrap_or(1)
        };
        groups * size(&d.parallelism) + prefill * size(&self.prefill.spec.parallelism)
    }

    /// Pods one stack asks for (GPU pods plus the CacheTier's replicas).
    pub fn pods_per_stack(&self) -> u32 {
        self.gpus_per_stack() + u32::try_from(self.tier.spec.replicas.max(0)).unwrap_or(0)
    }
}

/// One stack: its namespace and the three objects, named as in the samples.
#[derive(Debug, Clone)]
pub struct Stack {
    /// The namespace (one per stack).
    pub namespace: String,
    /// The CacheTier.
    pub tier: CacheTier,
    /// The PrefillPool.
    pub prefill: PrefillPool,
    /// The DecodePool.
    pub decode: DecodePool,
}

fn place(meta: &mut ObjectMeta, namespace: &str) {
    meta.namespace = Some(namespace.to_owned());
    meta.resource_version = None;
    meta.uid = None;
}

/// The namespace of stack `index` (`scale-0007`).
pub fn stack_namespace(index: usize) -> String {
    format!("scale-{index:04}")
}

/// Stack `index` in namespace [`stack_namespace`], from the samples, without persistence (see
/// the module docs).
pub fn stack(samples: &Samples, namespace: &str) -> Stack {
    let mut tier = samples.tier.clone();
    place(&mut tier.metadata, namespace);
    tier.spec.persistence = None;
    tier.status = None;
    let mut prefill = samples.prefill.clone();
    place(&mut prefill.metadata, namespace);
    prefill.status = None;
    let mut decode = samples.decode.clone();
    place(&mut decode.metadata, namespace);
    decode.status = None;
    Stack {
        namespace: namespace.to_owned(),
        tier,
        prefill,
        decode,
    }
}

/// The stack that is scaled: [`stack`] paired `1:1`, one decode group, and a GPU budget of
/// `target × (1 + 1)` groups' GPUs (see the module docs).
pub fn scaled_stack(samples: &Samples, namespace: &str, target: u32) -> Stack {
    let mut s = stack(samples, namespace);
    let d = &mut s.decode.spec;
    d.replicas = 1;
    // 1:1 is within the ratio's bounds, so `new` cannot fail; keep the sample's ratio if it did.
    if let Ok(r) = PdRatio::new(1, 1) {
        d.prefill.ratio = r;
    }
    let per_group = |p: &tandem_crds::Parallelism| (p.tensor * p.context).max(1);
    let gpus = i64::from(target)
        * i64::from(per_group(&d.parallelism) + per_group(&s.prefill.spec.parallelism));
    d.budget = Some(BudgetSpec {
        gpus: i32::try_from(gpus).unwrap_or(i32::MAX),
    });
    s
}

/// A namespace object.
pub fn namespace(name: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// Kwok node `index` with `gpus` × `nvidia.com/gpu`, untainted (every pod of the scale run lands
/// on kwok nodes: the run has no process-runner node), in zone `ZONES[index % 2]` and rack
/// `rack-<index / NODES_PER_RACK>`.
pub fn topology_node(index: u32, gpus: u32) -> Node {
    let mut node = kwok_node(index, gpus);
    if let Some(spec) = node.spec.as_mut() {
        spec.taints = None;
    }
    let labels = node.metadata.labels.get_or_insert_with(BTreeMap::new);
    labels.insert(ZONE_LABEL.into(), ZONES[(index % 2) as usize].into());
    labels.insert(
        RACK_LABEL.into(),
        format!("rack-{}", index / NODES_PER_RACK),
    );
    node
}

/// The name of node `index` (the cluster's kwok node names).
pub fn node_name(index: u32) -> String {
    kwok_node_name(index)
}

/// Nodes for `gpus` GPUs and `pods` pods at `gpus_per_node` GPUs and 110 pods per node, plus
/// one node (10 %, at least one) of headroom so a scheduling delay is never a full cluster.
pub fn nodes_for(gpus: u32, pods: u32, gpus_per_node: u32) -> u32 {
    let by_gpu = gpus.div_ceil(gpus_per_node.max(1));
    let by_pods = pods.div_ceil(100);
    let need = by_gpu.max(by_pods).max(1);
    need + need.div_ceil(10)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Samples {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples");
        Samples::read(&dir).expect("samples parse")
    }

    #[test]
    fn stacks_are_the_samples_in_their_namespace_without_persistence() {
        let s = samples();
        assert!(
            s.tier.spec.persistence.is_some(),
            "the sample has persistence"
        );
        let st = stack(&s, &stack_namespace(7));
        assert_eq!(st.namespace, "scale-0007");
        assert_eq!(st.tier.metadata.namespace.as_deref(), Some("scale-0007"));
        assert_eq!(st.decode.metadata.namespace.as_deref(), Some("scale-0007"));
        assert!(st.tier.spec.persistence.is_none());
        assert_eq!(
            st.decode.spec.prefill.pool_ref.name,
            st.prefill.metadata.name.clone().unwrap()
        );
        // 1 decode + 4 prefill (4:1) GPUs, plus 2 cache replicas.
        assert_eq!(s.gpus_per_stack(), 5);
        assert_eq!(s.pods_per_stack(), 7);
    }

    #[test]
    fn the_scaled_stack_pairs_one_to_one_within_a_budget_of_the_target() {
        let st = scaled_stack(&samples(), "scale-pool", 64);
        assert_eq!(st.decode.spec.replicas, 1);
        assert_eq!(st.decode.spec.prefill.ratio.prefill_replicas_for(64), 64);
        assert_eq!(st.decode.spec.budget.as_ref().map(|b| b.gpus), Some(128));
    }

    #[test]
    fn nodes_alternate_zones_and_carry_gpus_without_taint() {
        let n = topology_node(5, 8);
        let l = n.metadata.labels.as_ref().unwrap();
        assert_eq!(l[ZONE_LABEL], "zone-b");
        assert_eq!(l[RACK_LABEL], "rack-1");
        assert!(n.spec.as_ref().unwrap().taints.is_none());
        assert_eq!(n.status.unwrap().capacity.unwrap()["nvidia.com/gpu"].0, "8");
        assert_eq!(
            topology_node(4, 8).metadata.labels.unwrap()[ZONE_LABEL],
            "zone-a"
        );
        // 5000 GPUs / 8 = 625 nodes, + 63 headroom.
        assert_eq!(nodes_for(5000, 7000, 8), 688);
        assert_eq!(nodes_for(50, 70, 8), 8);
    }
}
