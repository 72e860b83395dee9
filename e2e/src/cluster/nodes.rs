//! The fake (kwok) nodes: pure builders.
//!
//! kwok manages only nodes annotated `kwok.x-k8s.io/node=fake` (flag in `run-controlplane.sh`), and
//! they carry the kwok convention taint `kwok.x-k8s.io/node=fake:NoSchedule`: only pods that
//! tolerate it land there (scale tests, where pods need not run), while ordinary pods go to
//! process-runner nodes, whose processes are real ([`crate::runner`]). Labels:
//! `type=kwok` and [`NODE_KIND_LABEL`]`=kwok`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;

/// Label telling node kinds apart: `kwok` (simulated) or `process` (the process runner).
pub const NODE_KIND_LABEL: &str = "tandem.dev/node-kind";
/// The extended resource name of NVIDIA's device plugin.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Annotation and taint key kwok uses for the nodes it manages.
pub const KWOK_NODE_KEY: &str = "kwok.x-k8s.io/node";

/// Name of the `index`-th kwok node.
pub fn kwok_node_name(index: u32) -> String {
    format!("kwok-node-{index}")
}

/// Capacity of a node: 32 CPUs, 256 GiB, 110 pods and `gpus` × `nvidia.com/gpu`.
pub fn node_capacity(gpus: u32) -> BTreeMap<String, Quantity> {
    BTreeMap::from([
        ("cpu".to_owned(), Quantity("32".into())),
        ("memory".to_owned(), Quantity("256Gi".into())),
        ("pods".to_owned(), Quantity("110".into())),
        (GPU_RESOURCE.to_owned(), Quantity(gpus.to_string())),
    ])
}

/// A kwok node with `gpus` GPUs (status is initialised by kwok's node-initialize stage, which
/// keeps the capacity given here).
pub fn kwok_node(index: u32, gpus: u32) -> Node {
    let name = kwok_node_name(index);
    Node {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            annotations: Some(BTreeMap::from([
                (KWOK_NODE_KEY.to_owned(), "fake".to_owned()),
                ("node.alpha.kubernetes.io/ttl".to_owned(), "0".to_owned()),
            ])),
            labels: Some(BTreeMap::from([
                ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
                ("kubernetes.io/os".to_owned(), "linux".to_owned()),
                ("kubernetes.io/hostname".to_owned(), name),
                ("type".to_owned(), "kwok".to_owned()),
                (NODE_KIND_LABEL.to_owned(), "kwok".to_owned()),
            ])),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            taints: Some(vec![Taint {
                key: KWOK_NODE_KEY.to_owned(),
                value: Some("fake".to_owned()),
                effect: "NoSchedule".to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            capacity: Some(node_capacity(gpus)),
            allocatable: Some(node_capacity(gpus)),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kwok_node_is_selected_by_kwok_and_tainted() {
        let n = kwok_node(3, 8);
        let meta = &n.metadata;
        assert_eq!(meta.name.as_deref(), Some("kwok-node-3"));
        assert_eq!(meta.annotations.as_ref().unwrap()[KWOK_NODE_KEY], "fake");
        assert_eq!(meta.labels.as_ref().unwrap()[NODE_KIND_LABEL], "kwok");
        let taints = n.spec.unwrap().taints.unwrap();
        assert_eq!(taints[0].key, KWOK_NODE_KEY);
        assert_eq!(taints[0].effect, "NoSchedule");
        let cap = n.status.unwrap().capacity.unwrap();
        assert_eq!(cap[GPU_RESOURCE].0, "8");
    }
}
