//! A process-runner node: its object, and the heartbeat that keeps it Ready (pure builders).
//!
//! The node carries `tandem.dev/node-kind=process` and no `kwok.x-k8s.io/node` annotation, so
//! kwok (which selects on that annotation) leaves it alone. Like the kubelet, the runner renews a
//! Lease in `kube-node-lease` every [`LEASE_RENEW`] (the node-lifecycle controller's heartbeat) and
//! re-posts the node status every [`STATUS_REFRESH`].

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeStatus, NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference, Time};
use kube::api::ObjectMeta;

use crate::cluster::nodes::{NODE_KIND_LABEL, node_capacity};

/// Annotation marking a node as served by the Tandem process runner.
pub const RUNNER_ANNOTATION: &str = "tandem.dev/process-runner";
/// Lease duration; the node-lifecycle controller's grace period is longer (40–50 s).
pub const LEASE_SECONDS: i32 = 40;
/// How often the lease is renewed (the kubelet uses 1/4 of the duration).
pub const LEASE_RENEW: Duration = Duration::from_secs(10);
/// How often the node status (Ready condition heartbeat) is re-posted.
pub const STATUS_REFRESH: Duration = Duration::from_secs(30);

/// Identity and size of one runner node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpecification {
    /// Node name.
    pub name: String,
    /// `nvidia.com/gpu` capacity.
    pub gpus: u32,
}

/// The Node object (metadata + status) of a runner node with address `ip`.
pub fn runner_node(spec: &NodeSpecification, ip: Ipv4Addr, now: Timestamp) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(spec.name.clone()),
            labels: Some(BTreeMap::from([
                ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
                ("kubernetes.io/os".to_owned(), "linux".to_owned()),
                ("kubernetes.io/hostname".to_owned(), spec.name.clone()),
                (NODE_KIND_LABEL.to_owned(), "process".to_owned()),
            ])),
            annotations: Some(BTreeMap::from([(
                RUNNER_ANNOTATION.to_owned(),
                "true".to_owned(),
            )])),
            ..Default::default()
        },
        spec: None,
        status: Some(node_status(spec, ip, now, now)),
    }
}

/// The node status: capacity, Ready and the pressure conditions (heartbeat `now`, unchanged since
/// `since`, the registration), addresses, system info.
pub fn node_status(
    spec: &NodeSpecification,
    ip: Ipv4Addr,
    since: Timestamp,
    now: Timestamp,
) -> NodeStatus {
    let cond = |kind: &str, status: &str, reason: &str, message: &str| NodeCondition {
        type_: kind.to_owned(),
        status: status.to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(Time(since)),
    };
    NodeStatus {
        capacity: Some(node_capacity(spec.gpus)),
        allocatable: Some(node_capacity(spec.gpus)),
        conditions: Some(vec![
            cond(
                "Ready",
                "True",
                "KubeletReady",
                "tandem-e2e process runner is posting ready status",
            ),
            cond(
                "MemoryPressure",
                "False",
                "KubeletHasSufficientMemory",
                "no pressure",
            ),
            cond(
                "DiskPressure",
                "False",
                "KubeletHasNoDiskPressure",
                "no pressure",
            ),
            cond(
                "PIDPressure",
                "False",
                "KubeletHasSufficientPID",
                "no pressure",
            ),
        ]),
        addresses: Some(vec![
            NodeAddress {
                type_: "InternalIP".into(),
                address: ip.to_string(),
            },
            NodeAddress {
                type_: "Hostname".into(),
                address: spec.name.clone(),
            },
        ]),
        daemon_endpoints: Some(NodeDaemonEndpoints::default()),
        node_info: Some(NodeSystemInfo {
            architecture: "amd64".into(),
            operating_system: "linux".into(),
            container_runtime_version: "tandem-e2e-runner://0.1".into(),
            kubelet_version: "v1.37.2-tandem-runner".into(),
            os_image: "tandem-e2e process runner".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The node's Lease in `kube-node-lease`, owned by the Node (so it goes with it).
pub fn node_lease(node: &str, node_uid: &str, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.to_owned()),
            namespace: Some("kube-node-lease".to_owned()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_owned(),
                uid: node_uid.to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_owned()),
            lease_duration_seconds: Some(LEASE_SECONDS),
            renew_time: Some(MicroTime(now)),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::nodes::{GPU_RESOURCE, KWOK_NODE_KEY};

    #[test]
    fn runner_node_is_not_kwok_and_is_ready_with_gpus() {
        let spec = NodeSpecification {
            name: "runner-0".into(),
            gpus: 4,
        };
        let n = runner_node(&spec, Ipv4Addr::new(127, 100, 0, 1), Timestamp::UNIX_EPOCH);
        let ann = n.metadata.annotations.unwrap();
        assert!(!ann.contains_key(KWOK_NODE_KEY), "kwok must not manage it");
        assert_eq!(n.metadata.labels.unwrap()[NODE_KIND_LABEL], "process");
        let st = n.status.unwrap();
        assert_eq!(st.allocatable.unwrap()[GPU_RESOURCE].0, "4");
        let ready = st
            .conditions
            .unwrap()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(ready.status, "True");
        assert_eq!(st.addresses.unwrap()[0].address, "127.100.0.1");
        let lease = node_lease("runner-0", "uid-1", Timestamp::UNIX_EPOCH);
        assert_eq!(
            lease.spec.unwrap().holder_identity.as_deref(),
            Some("runner-0")
        );
    }
}
