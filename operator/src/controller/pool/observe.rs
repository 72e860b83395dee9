//! The read stage of a pool: its children, from the watch-fed caches ([`super::super::cache`])
//! or listed now (label-selected LIST calls: to confirm a delete, in teardown, and when no cache
//! runs), and what the rollout and teardown read from them.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use kube::{Api, ResourceExt};

pub use super::super::cache::Read;
use super::super::cache::{Caches, FIRST_LIST_WAIT};
use super::super::children;
use super::super::{Context, Result};
use crate::gang::{self, GangPod, GateCondition};
use crate::labels::{self, Role};
use crate::rollout::{GroupObservation, PodObservation};

/// The children of a pool, from the caches or as listed now ([`PoolChildren::cached`]).
#[derive(Debug, Default, Clone)]
pub struct PoolChildren {
    /// Whether these come from the caches (possibly a moment old) rather than a LIST just made.
    pub cached: bool,
    /// Group StatefulSets by name.
    pub statefulsets: BTreeMap<String, StatefulSet>,
    /// Services by name (peers, front door).
    pub services: BTreeMap<String, Service>,
    /// ConfigMaps by name.
    pub config_maps: BTreeMap<String, ConfigMap>,
    /// Pods of every group.
    pub pods: Vec<Pod>,
}

impl PoolChildren {
    /// Group StatefulSets that exist, not terminating, with index below `groups`.
    pub fn groups_in_range(&self, groups: u32) -> u32 {
        self.statefulsets
            .values()
            .filter(|s| !children::terminating(*s))
            .filter(|s| children::group_of(*s).is_some_and(|g| g < groups))
            .count() as u32
    }

    /// Group StatefulSets that exist and are not terminating (any index).
    pub fn groups_existing(&self) -> u32 {
        self.statefulsets
            .values()
            .filter(|s| !children::terminating(*s))
            .count() as u32
    }

    /// Groups among `0..groups` (of `group_size` pods) all of whose pods are Ready.
    pub fn ready_groups(&self, groups: u32, group_size: u32) -> u32 {
        self.observations(groups, group_size)
            .iter()
            .filter(|g| g.ready())
            .count() as u32
    }

    /// Every pod as the gang decision ([`crate::gang::decide`]) sees it.
    pub fn gang_pods(&self) -> Vec<GangPod> {
        self.pods.iter().map(gang_pod).collect()
    }

    /// The group observations of groups `0..groups` of `group_size` pods.
    pub fn observations(&self, groups: u32, group_size: u32) -> Vec<GroupObservation> {
        (0..groups)
            .map(|g| GroupObservation {
                index: g,
                desired_pods: group_size,
                pods: self
                    .pods
                    .iter()
                    .filter(|p| children::group_of(*p) == Some(g))
                    .map(|p| PodObservation {
                        name: p.name_any(),
                        revision: p
                            .labels()
                            .get(labels::REVISION)
                            .cloned()
                            .unwrap_or_default(),
                        ready: children::pod_ready(p),
                        terminating: children::terminating(p),
                        restarts: children::pod_restarts(p),
                    })
                    .collect(),
                template_revision: self.template_revision(g),
            })
            .collect()
    }

    /// [`GroupObservation::template_revision`] of group `g`: its StatefulSet's revision label,
    /// once `status.observedGeneration` has reached `metadata.generation` (the StatefulSet
    /// controller writes that only after syncing with that spec).
    fn template_revision(&self, g: u32) -> Option<String> {
        let sts = self
            .statefulsets
            .values()
            .find(|s| children::group_of(*s) == Some(g) && !children::terminating(*s))?;
        let observed = sts.status.as_ref().and_then(|s| s.observed_generation)?;
        if observed < sts.metadata.generation? {
            return None;
        }
        sts.labels().get(labels::REVISION).cloned()
    }
}

/// One pod as [`crate::gang`] sees it: its group and revision labels, `ContainersReady`, whether
/// its spec lists the [`gang::GROUP_READY`] readiness gate, and that condition now.
pub fn gang_pod(p: &Pod) -> GangPod {
    let gated = p
        .spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.condition_type == gang::GROUP_READY));
    let current = p
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == gang::GROUP_READY))
        .map(|c| GateCondition {
            status: c.status.clone(),
            reason: c.reason.clone().unwrap_or_default(),
        });
    GangPod {
        name: p.name_any(),
        group: children::group_of(p),
        revision: p
            .labels()
            .get(labels::REVISION)
            .cloned()
            .unwrap_or_default(),
        containers_ready: children::pod_containers_ready(p),
        terminating: children::terminating(p),
        gated,
        current,
    }
}

/// The children of pool `name` with role `role`: with [`Read::Cached`], from the caches when
/// [`run`](super::super::run) started them (after their first lists, waited for at most
/// [`FIRST_LIST_WAIT`](super::super::cache::FIRST_LIST_WAIT)), else listed now.
///
/// # Errors
/// API failures of the LISTs; [`NotListed`](super::super::cache::NotListed) when the caches have
/// not listed in time.
pub async fn observe(
    ctx: &Context,
    ns: &str,
    name: &str,
    role: Role,
    read: Read,
) -> Result<PoolChildren> {
    let Some(cache) = ctx.caches().filter(|_| read == Read::Cached) else {
        return observe_listed(ctx, ns, name, role).await;
    };
    cache.ready(FIRST_LIST_WAIT).await?;
    Ok(PoolChildren {
        cached: true,
        statefulsets: children::by_name(Caches::children(&cache.statefulsets, ns, name, role)),
        services: children::by_name(Caches::children(&cache.services, ns, name, role)),
        config_maps: children::by_name(Caches::children(&cache.config_maps, ns, name, role)),
        pods: Caches::children(&cache.pods, ns, name, role),
    })
}

/// The children of pool `name` with role `role` as listed now (four label-selected LISTs).
///
/// # Errors
/// API failures.
pub async fn observe_listed(
    ctx: &Context,
    ns: &str,
    name: &str,
    role: Role,
) -> Result<PoolChildren> {
    let c = &ctx.client;
    Ok(PoolChildren {
        cached: false,
        statefulsets: children::by_name(
            children::list(&Api::<StatefulSet>::namespaced(c.clone(), ns), name, role).await?,
        ),
        services: children::by_name(
            children::list(&Api::<Service>::namespaced(c.clone(), ns), name, role).await?,
        ),
        config_maps: children::by_name(
            children::list(&Api::<ConfigMap>::namespaced(c.clone(), ns), name, role).await?,
        ),
        pods: children::list(&Api::<Pod>::namespaced(c.clone(), ns), name, role).await?,
    })
}

/// Counts the pods of pool `name` with role `role` (with [`Read::Cached`], from the caches when
/// they run).
///
/// # Errors
/// As [`observe`].
pub async fn observe_pods(
    ctx: &Context,
    ns: &str,
    name: &str,
    role: Role,
    read: Read,
) -> Result<u32> {
    if let Some(cache) = ctx.caches().filter(|_| read == Read::Cached) {
        cache.ready(FIRST_LIST_WAIT).await?;
        return Ok(Caches::children(&cache.pods, ns, name, role).len() as u32);
    }
    let pods = children::list(&Api::<Pod>::namespaced(ctx.client.clone(), ns), name, role).await?;
    Ok(pods.len() as u32)
}

/// A pod on a node that lacks the pool's `placement.topologyKey` label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misplaced {
    /// The pod.
    pub pod: String,
    /// Its node.
    pub node: String,
}

/// The pods among `pods` scheduled on a node without label `key` (issue 17: under `Preferred`
/// the scheduler may use such a node). One metadata GET per distinct node: the operator keeps no
/// node cache, and only pools with `spec.placement` pay it. A node that is gone is skipped (its
/// pods are being rescheduled); unscheduled pods have no node to judge; when nodes are forbidden
/// (a namespace-scoped install binds no cluster-scoped grant) or a read fails, nothing is
/// reported this time (logged): the check never holds up the reconcile.
pub async fn pods_on_unlabeled_nodes(ctx: &Context, pods: &[Pod], key: &str) -> Vec<Misplaced> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let mut labelled: BTreeMap<String, bool> = BTreeMap::new();
    let mut out = Vec::new();
    for pod in pods {
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        let has = match labelled.get(&node) {
            Some(&has) => has,
            None => {
                // A node that is gone counts as labelled: nothing to report about it.
                let has = match nodes.get_metadata_opt(&node).await {
                    Ok(n) => n.is_none_or(|n| n.labels().contains_key(key)),
                    // A namespace-scoped install (`watchNamespace`) binds no cluster-scoped
                    // grant: the check is skipped, not the reconcile.
                    Err(kube::Error::Api(s)) if s.code == 403 => {
                        tracing::debug!(node, "nodes are forbidden: placement check skipped");
                        return Vec::new();
                    }
                    // An observation only: a failed read skips the check this time instead of
                    // failing the reconcile (no child applied, no rollout step, no status).
                    Err(e) => {
                        tracing::warn!(node, error = %e, "cannot read a node: placement check skipped");
                        return Vec::new();
                    }
                };
                labelled.insert(node.clone(), has);
                has
            }
        };
        if !has {
            out.push(Misplaced {
                pod: pod.name_any(),
                node,
            });
        }
    }
    out
}
