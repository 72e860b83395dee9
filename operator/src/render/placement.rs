//! `spec.placement` as pod affinity (issue 17; ai-dynamo/dynamo `kvTransferPolicy`): a pure
//! builder from a pool view and a group index to the group StatefulSet's `affinity`.
//!
//! Two terms, both on `placement.topologyKey`:
//! - **group packing**: the pods of one group (pool, role and group labels) share a domain, since
//!   a group's ranks run collectives with each other. The scheduler places a group's first pod
//!   anywhere (a pod that matches its own term is allowed when no other pod does), the rest next
//!   to it.
//! - **pairing** (DecodePool only): the pod goes to a domain where pods of its paired PrefillPool
//!   run, so KV moves inside the domain.
//!
//! `Required` renders `requiredDuringSchedulingIgnoredDuringExecution` (a pod stays Pending rather
//! than leave the domain; nodes without the label are never chosen); `Preferred` renders the
//! weighted terms at weight 100 (the scheduler may place a pod elsewhere, also on a node without
//! the label: the reconcile reports such a pod as `Degraded`, `NodeWithoutTopologyLabel`, with a
//! Warning event; `tandem-e2e scale` counts them).
//!
//! A decode pod's two terms cannot both be required: kube-scheduler's InterPodAffinity filter
//! counts a domain for a pod's required terms only where one existing pod matches *every* term
//! (`podMatchesAllAffinityTerms`), and no pod is both a decode group member and a prefill pod, so
//! the pod would stay Pending forever (the first kwok run of the placement test: 6 of 9 objects
//! Ready, every decode Pending). Under `Required` a paired DecodePool therefore requires pairing
//! and prefers packing (weight 100): every decode pod is next to its prefill pods, and a
//! multi-pod decode group shares a domain whenever one can hold it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, PodAffinity, PodAffinityTerm, WeightedPodAffinityTerm};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use tandem_crds::PlacementMode;

use super::PoolView;
use crate::labels::{self, Role};

/// Weight of each `Preferred` term (the largest the API accepts).
pub const PREFERRED_WEIGHT: i32 = 100;

fn term(labels: BTreeMap<String, String>, key: &str) -> PodAffinityTerm {
    PodAffinityTerm {
        label_selector: Some(LabelSelector {
            match_labels: Some(labels),
            ..LabelSelector::default()
        }),
        topology_key: key.to_owned(),
        ..PodAffinityTerm::default()
    }
}

/// The `affinity` of group `group`'s pods, or `None` without `spec.placement`.
///
/// Terms (module docs): a PrefillPool or an unpaired DecodePool gets the packing term; a paired
/// DecodePool gets pairing and packing. `Preferred` weights each at [`PREFERRED_WEIGHT`];
/// `Required` requires the first (pairing when paired) and weights the other, since the scheduler
/// ANDs required terms on a single existing pod.
pub fn affinity(pool: &PoolView<'_>, group: u32) -> Option<Affinity> {
    let p = pool.placement?;
    let key = p.topology_key.as_str();
    let mut own = labels::selector(pool.name, pool.role);
    own.insert(labels::GROUP.into(), group.to_string());
    let packing = term(own, key);
    // Most important first: pairing, when there is a prefill pool to pair with.
    let terms = match (pool.role, pool.paired_prefill) {
        (Role::Decode, Some(prefill)) => {
            vec![term(labels::selector(prefill, Role::Prefill), key), packing]
        }
        _ => vec![packing],
    };
    let weighted = |terms: Vec<PodAffinityTerm>| {
        Some(
            terms
                .into_iter()
                .map(|t| WeightedPodAffinityTerm {
                    weight: PREFERRED_WEIGHT,
                    pod_affinity_term: t,
                })
                .collect(),
        )
    };
    let pod_affinity = match p.mode {
        PlacementMode::Required => {
            let mut terms = terms.into_iter();
            let first: Vec<_> = terms.next().into_iter().collect();
            let rest: Vec<_> = terms.collect();
            PodAffinity {
                required_during_scheduling_ignored_during_execution: Some(first),
                preferred_during_scheduling_ignored_during_execution: if rest.is_empty() {
                    None
                } else {
                    weighted(rest)
                },
            }
        }
        PlacementMode::Preferred => PodAffinity {
            preferred_during_scheduling_ignored_during_execution: weighted(terms),
            ..PodAffinity::default()
        },
    };
    Some(Affinity {
        pod_affinity: Some(pod_affinity),
        ..Affinity::default()
    })
}
