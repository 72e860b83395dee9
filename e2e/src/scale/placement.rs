//! Where the scheduler put the pods of pools with `spec.placement` (issue 17): read from the pods'
//! labels and their nodes' topology labels once every stack is Ready, pure so it is unit-tested.
//!
//! - a **split group**: a group (namespace, pool, group label) whose pods sit in more than one
//!   domain of the key;
//! - an **unpaired decode pod**: a decode pod whose domain holds no prefill pod of its namespace
//!   (the scale stacks pair one DecodePool with one PrefillPool per namespace);
//! - pods on nodes **without the key**, and the pools that say so (`Degraded`,
//!   `NodeWithoutTopologyLabel`: the operator's own report of them).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use tandem_crds::PoolStatus;
use tandem_crds::conditions::{ConditionType, Reason};
use tandem_crds::labels::{GROUP, POOL, ROLE, ROLE_DECODE, ROLE_PREFILL};

/// What the placement check found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PlacementFigures {
    /// The node label the pools place by.
    pub topology_key: String,
    /// Scheduled pool pods looked at.
    pub pods: usize,
    /// Groups looked at, and those with at least two pods.
    pub groups: usize,
    /// Groups of two or more pods.
    pub multi_pod_groups: usize,
    /// Groups whose pods are in more than one domain (must be 0 under `Required`).
    pub split_groups: usize,
    /// Decode pods in a domain without a prefill pod of their stack (must be 0 under `Required`).
    pub unpaired_decode_pods: usize,
    /// Pods on nodes without the key.
    pub pods_on_unlabeled_nodes: usize,
    /// Pool pods per domain.
    pub pods_per_domain: BTreeMap<String, usize>,
    /// Pools (PrefillPool and DecodePool objects) listed, and those whose status says `Degraded`,
    /// `NodeWithoutTopologyLabel`.
    pub pools: usize,
    /// Pools reporting a pod on a node without their key.
    pub pools_reporting_unlabeled_nodes: usize,
}

/// Whether a pool's status reports `Degraded=True`, `NodeWithoutTopologyLabel`.
pub fn reports_unlabeled_node(status: Option<&PoolStatus>) -> bool {
    status.is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == ConditionType::Degraded.as_str()
                && c.status == "True"
                && c.reason == Reason::NodeWithoutTopologyLabel.as_str()
        })
    })
}

/// The figures for `pods` (pool pods; others are ignored) on `nodes`, by `key`.
pub fn figures(pods: &[Pod], nodes: &[Node], key: &str) -> PlacementFigures {
    let domain_of: BTreeMap<&str, Option<&str>> = nodes
        .iter()
        .filter_map(|n| {
            let name = n.metadata.name.as_deref()?;
            let d = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(key))
                .map(String::as_str);
            Some((name, d))
        })
        .collect();
    let mut f = PlacementFigures {
        topology_key: key.to_owned(),
        ..PlacementFigures::default()
    };
    let mut groups: BTreeMap<(String, String, String), Vec<Option<String>>> = BTreeMap::new();
    let mut prefill_domains: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut decodes: Vec<(String, Option<String>)> = Vec::new();
    for p in pods {
        let (Some(labels), Some(ns)) = (p.metadata.labels.as_ref(), p.metadata.namespace.as_ref())
        else {
            continue;
        };
        let (Some(pool), Some(role), Some(group)) =
            (labels.get(POOL), labels.get(ROLE), labels.get(GROUP))
        else {
            continue;
        };
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            continue;
        };
        let Some(domain) = domain_of.get(node) else {
            continue;
        };
        f.pods += 1;
        let domain = domain.map(str::to_owned);
        match &domain {
            Some(d) => *f.pods_per_domain.entry(d.clone()).or_default() += 1,
            None => f.pods_on_unlabeled_nodes += 1,
        }
        groups
            .entry((ns.clone(), pool.clone(), group.clone()))
            .or_default()
            .push(domain.clone());
        if role == ROLE_PREFILL {
            if let Some(d) = &domain {
                prefill_domains
                    .entry(ns.clone())
                    .or_default()
                    .insert(d.clone());
            }
        } else if role == ROLE_DECODE {
            decodes.push((ns.clone(), domain));
        }
    }
    f.groups = groups.len();
    for domains in groups.values() {
        if domains.len() > 1 {
            f.multi_pod_groups += 1;
        }
        let distinct: BTreeSet<&Option<String>> = domains.iter().collect();
        if distinct.len() > 1 || distinct.contains(&None) && domains.len() > 1 {
            f.split_groups += 1;
        }
    }
    f.unpaired_decode_pods = decodes
        .iter()
        .filter(|(ns, d)| {
            d.as_ref()
                .is_none_or(|d| !prefill_domains.get(ns).is_some_and(|s| s.contains(d)))
        })
        .count();
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, zone: Option<&str>) -> Node {
        let mut v = serde_json::json!({"metadata": {"name": name, "labels": {}}});
        if let Some(z) = zone {
            v["metadata"]["labels"]["zone"] = z.into();
        }
        serde_json::from_value(v).unwrap()
    }

    fn pod(ns: &str, role: &str, group: &str, node: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{role}-{group}-{node}"), "namespace": ns, "labels": {
                POOL: format!("{ns}-{role}"), ROLE: role, GROUP: group}},
            "spec": {"containers": [], "nodeName": node},
        }))
        .unwrap()
    }

    #[test]
    fn split_groups_and_unpaired_decodes_are_counted() {
        let nodes = [
            node("a1", Some("a")),
            node("a2", Some("a")),
            node("b1", Some("b")),
            node("x", None),
        ];
        let pods = [
            // ns1: prefill group 0 packed in a, group 1 split a/b; decode in b (prefill in b: paired).
            pod("ns1", ROLE_PREFILL, "0", "a1"),
            pod("ns1", ROLE_PREFILL, "0", "a2"),
            pod("ns1", ROLE_PREFILL, "1", "a1"),
            pod("ns1", ROLE_PREFILL, "1", "b1"),
            pod("ns1", ROLE_DECODE, "0", "b1"),
            // ns2: decode in b, its prefill only in a: unpaired; one decode on an unlabeled node.
            pod("ns2", ROLE_PREFILL, "0", "a1"),
            pod("ns2", ROLE_DECODE, "0", "b1"),
            pod("ns2", ROLE_DECODE, "1", "x"),
        ];
        let f = figures(&pods, &nodes, "zone");
        assert_eq!(f.pods, 8);
        assert_eq!(f.groups, 6);
        assert_eq!(f.multi_pod_groups, 2);
        assert_eq!(f.split_groups, 1);
        assert_eq!(f.unpaired_decode_pods, 2);
        assert_eq!(f.pods_on_unlabeled_nodes, 1);
        assert_eq!(
            f.pods_per_domain,
            BTreeMap::from([("a".into(), 4), ("b".into(), 3)])
        );
    }
}
