//! Watch-fed caches of what a reconcile reads besides its own object (issue 17: reconcile latency
//! flat in the number of pools).
//!
//! One watch per kind for the whole operator reflects full objects (without `managedFields`,
//! which nothing reads) into a [`Store`]: the children — StatefulSets, Services, ConfigMaps and
//! pods carrying the role label `serving.tandem.dev/role` (a pool's children are then selected by
//! its selector labels: the same set a LIST by them returns) — and the three kinds it reconciles. A reconcile reads a
//! pool's children ([`Caches::children`]), its tier, its pair and the pools naming a tier
//! ([`Caches::get`], [`Caches::in_namespace`]) from these stores instead of the API server:
//! before, a reconcile made about ten sequential requests (four label-selected LISTs of its
//! children, the DecodePool four more of its PrefillPool's, GETs of the tiers and the pair, a
//! LIST of DecodePools), and its latency grew with the API server's (N = 10 → 100 stacks:
//! reconcile p99 4.1 s → > 8.2 s, `e2e/README.md`). Its own object it still reads fresh (a quorum
//! GET: its status holds the scaling transaction, `pool::reconcile`).
//!
//! The same watches trigger the controllers (`run.rs` routes each event to the resources it
//! concerns), and a watch passes an event on only once its store holds it (a list's objects at
//! the list's end, when the store swaps them in): a reconcile triggered by a change sees at least
//! that change. While a watch fails or re-lists its store may be frozen or behind: reconciles
//! then read from the API server (`Context::caches`). A reconcile triggered by
//! something else may see children a moment old, as in any informer-fed operator; writes from it
//! are idempotent (server-side apply of the desired object, status recomputed on the next event).
//! Deletes are not: `pool::reconcile` acts on a pod or StatefulSet delete only after confirming
//! the decision on children it has just LISTed ("decide from the cache, act on a fresh read"), so
//! a stale pod can never get its freshly recreated namesake deleted or a group restart counted
//! twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use tandem_crds::{CacheTier, DecodePool, PrefillPool};

use crate::labels::{self, Role};

/// How long a reconcile waits for the watches' first lists before it fails (and is retried
/// along the error back-off). Bounded: a watch that cannot list (its kind forbidden) shows in
/// `/readyz` and the reconcile says why instead of hanging.
pub const FIRST_LIST_WAIT: Duration = Duration::from_secs(30);

/// How a reconcile reads what is not its own object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// From the caches when they run (else listed).
    Cached,
    /// From the API server now: the reads a delete is decided on.
    Listed,
}

/// The stores, shared by the three controllers; cheap to clone.
#[derive(Clone)]
pub struct Caches {
    /// Managed StatefulSets (groups, cache replicas).
    pub statefulsets: Store<StatefulSet>,
    /// Managed Services (peers, front doors, tier services).
    pub services: Store<Service>,
    /// Managed ConfigMaps (worker and tier configs).
    pub config_maps: Store<ConfigMap>,
    /// Pods of every role.
    pub pods: Store<Pod>,
    /// CacheTiers.
    pub tiers: Store<CacheTier>,
    /// PrefillPools.
    pub prefills: Store<PrefillPool>,
    /// DecodePools.
    pub decodes: Store<DecodePool>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("statefulsets", &self.statefulsets.len())
            .field("services", &self.services.len())
            .field("config_maps", &self.config_maps.len())
            .field("pods", &self.pods.len())
            .field("tiers", &self.tiers.len())
            .field("prefills", &self.prefills.len())
            .field("decodes", &self.decodes.len())
            .finish()
    }
}

/// The watches have not completed their first list within [`FIRST_LIST_WAIT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the operator's watches have not listed within {}s (see /readyz for the failing watch)",
    FIRST_LIST_WAIT.as_secs()
)]
pub struct NotListed;

impl Caches {
    /// Waits until every store has completed its first list, at most `within`.
    ///
    /// # Errors
    /// [`NotListed`] when one has not by then (or its watch is gone).
    pub async fn ready(&self, within: Duration) -> Result<(), NotListed> {
        let all = async {
            self.statefulsets.wait_until_ready().await?;
            self.services.wait_until_ready().await?;
            self.config_maps.wait_until_ready().await?;
            self.pods.wait_until_ready().await?;
            self.tiers.wait_until_ready().await?;
            self.prefills.wait_until_ready().await?;
            self.decodes.wait_until_ready().await
        };
        match tokio::time::timeout(within, all).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(NotListed),
        }
    }

    /// The objects of `store` in namespace `ns` carrying the selector labels of `pool` with
    /// `role` (the same set the label-selected LIST returns), sorted by name.
    pub fn children<K>(store: &Store<K>, ns: &str, pool: &str, role: Role) -> Vec<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let want = labels::selector(pool, role);
        let mut out: Vec<K> = store
            .state()
            .into_iter()
            .filter(|o| o.namespace().as_deref() == Some(ns))
            .filter(|o| {
                let have = o.labels();
                want.iter().all(|(k, v)| have.get(k) == Some(v))
            })
            .map(|o| o.as_ref().clone())
            .collect();
        out.sort_by_key(|o| o.name_any());
        out
    }

    /// The object `name` in namespace `ns` of `store`, if cached.
    pub fn get<K>(store: &Store<K>, ns: &str, name: &str) -> Option<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        store
            .get(&ObjectRef::new(name).within(ns))
            .map(|o| o.as_ref().clone())
    }

    /// The objects of `store` in namespace `ns`, sorted by name.
    pub fn in_namespace<K>(store: &Store<K>, ns: &str) -> Vec<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let mut out: Vec<K> = store
            .state()
            .into_iter()
            .filter(|o| o.namespace().as_deref() == Some(ns))
            .map(|o| o.as_ref().clone())
            .collect();
        out.sort_by_key(|o| o.name_any());
        out
    }
}

/// How long an apply waits for its watch event before [`PendingApplies`] forgets it (an apply
/// that changed nothing produces no event).
pub const PENDING_APPLY_TTL: Duration = Duration::from_secs(60);

/// The applies this operator made whose watch events have not arrived yet, by child (kind,
/// namespace, name) → the desired hash applied. While one is pending, a cached read of that child
/// is older than the operator's own write: a reconcile would apply the same object again and
/// publish its `Created`/`Updated` event twice (found in review: the pool's status patch
/// re-triggers it through the pool watch before the StatefulSet watch delivers the StatefulSet
/// it just created). `children::apply_if_changed` skips an apply of the hash pending for that
/// child; the child's next watch event (any: apply or delete) clears it, and
/// [`PENDING_APPLY_TTL`] bounds it. Cheap to clone (clones share the map).
#[derive(Debug, Clone, Default)]
pub struct PendingApplies {
    map: Arc<Mutex<HashMap<ChildKey, (String, Instant)>>>,
}

/// A child by kind, namespace and name.
type ChildKey = (String, String, String);

impl PendingApplies {
    fn key<K: kube::Resource<DynamicType = ()>>(obj: &K) -> ChildKey {
        (
            K::kind(&()).into_owned(),
            obj.namespace().unwrap_or_default(),
            obj.name_any(),
        )
    }

    /// Records that `obj`, stamped with `hash`, was applied.
    pub fn applied<K: kube::Resource<DynamicType = ()>>(&self, obj: &K, hash: &str) {
        if let Ok(mut m) = self.map.lock() {
            m.insert(Self::key(obj), (hash.to_owned(), Instant::now()));
        }
    }

    /// Whether an apply of `obj` with `hash` is still on its way to the caches.
    pub fn pending<K: kube::Resource<DynamicType = ()>>(&self, obj: &K, hash: &str) -> bool {
        let Ok(mut m) = self.map.lock() else {
            return false;
        };
        let key = Self::key(obj);
        match m.get(&key) {
            Some((h, at)) if at.elapsed() < PENDING_APPLY_TTL => h == hash,
            Some(_) => {
                m.remove(&key);
                false
            }
            None => false,
        }
    }

    /// A watch of `K` started a (re)list: an object deleted while it was down comes with no
    /// event, so no record of `K` can wait for one.
    pub fn relisting<K: kube::Resource<DynamicType = ()>>(&self) {
        let kind = K::kind(&());
        if let Ok(mut m) = self.map.lock() {
            m.retain(|(k, _, _), _| *k != kind);
        }
    }

    /// The watch delivered an event of `obj`: the caches hold the operator's write (or a later
    /// change).
    pub fn seen<K: kube::Resource<DynamicType = ()>>(&self, obj: &K) {
        if let Ok(mut m) = self.map.lock() {
            m.remove(&Self::key(obj));
        }
    }
}

/// What a cached copy of a kind keeps: what reconciles read of it, nothing more (at N = 1,000
/// stacks the caches hold about 20,000 objects; the operator's memory goal is 256 MiB). Every
/// kind drops `metadata.managedFields` (server-side apply bookkeeping, often a third of an
/// object). A reconcile reading a field dropped here would decide differently from cached and
/// listed reads: `tests/controller.rs` trims its caches the same way.
pub trait Trim {
    /// Drops what no reconcile reads.
    fn trim(&mut self);
}

fn trim_meta<K: kube::Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

/// StatefulSets: metadata (labels, annotations with the desired hash, owner references,
/// deletion), `spec.replicas`, status; not the pod template (the bulk).
impl Trim for StatefulSet {
    fn trim(&mut self) {
        trim_meta(self);
        self.spec.template = Default::default();
        self.spec.volume_claim_templates = None;
    }
}

/// ConfigMaps: metadata only (the desired hash says whether the config changed).
impl Trim for ConfigMap {
    fn trim(&mut self) {
        trim_meta(self);
        self.data = None;
        self.binary_data = None;
    }
}

/// Pods: metadata, status (conditions, container restarts, phase, IP), and of the spec only the
/// node and the readiness gates.
impl Trim for Pod {
    fn trim(&mut self) {
        trim_meta(self);
        if let Some(spec) = self.spec.take() {
            self.spec = Some(k8s_openapi::api::core::v1::PodSpec {
                node_name: spec.node_name,
                readiness_gates: spec.readiness_gates,
                ..Default::default()
            });
        }
    }
}

/// Kinds whose cached copy keeps everything a reconcile may read: all but the managed fields.
macro_rules! trim_meta_only {
    ($($kind:ty),*) => {$(
        impl Trim for $kind {
            fn trim(&mut self) {
                trim_meta(self);
            }
        }
    )*};
}

trim_meta_only!(Service, CacheTier, PrefillPool, DecodePool);

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector::store;
    use kube::runtime::watcher::Event;

    fn pod(ns: &str, name: &str, labels: &[(String, String)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                labels: Some(labels.iter().cloned().collect()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    /// A pool's children are exactly the objects of its namespace with all of its selector
    /// labels: another pool, another role, another namespace, or a partial label set is not.
    #[test]
    fn children_select_like_the_label_selected_list() {
        let (reader, mut writer) = store::<Pod>();
        let sel = |pool: &str, role| -> Vec<(String, String)> {
            labels::selector(pool, role).into_iter().collect()
        };
        let mut partial = sel("p", Role::Prefill);
        partial.pop();
        writer.apply_watcher_event(&Event::Init);
        for p in [
            pod("a", "p-g0-0", &sel("p", Role::Prefill)),
            pod("a", "p-g1-0", &sel("p", Role::Prefill)),
            pod("a", "q-g0-0", &sel("q", Role::Prefill)),
            pod("a", "p-d-0", &sel("p", Role::Decode)),
            pod("b", "p-g0-0", &sel("p", Role::Prefill)),
            pod("a", "partial", &partial),
        ] {
            writer.apply_watcher_event(&Event::InitApply(p));
        }
        writer.apply_watcher_event(&Event::InitDone);
        let names: Vec<String> = Caches::children(&reader, "a", "p", Role::Prefill)
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, ["p-g0-0", "p-g1-0"]);
        assert!(Caches::children(&reader, "c", "p", Role::Prefill).is_empty());
    }

    /// A pending apply hides only its own hash, until the child's watch event (or the TTL).
    #[test]
    fn a_pending_apply_is_cleared_by_its_watch_event() {
        let p = PendingApplies::default();
        let obj = pod("a", "x", &[]);
        assert!(!p.pending(&obj, "h1"));
        p.applied(&obj, "h1");
        assert!(p.pending(&obj, "h1"));
        assert!(!p.pending(&obj, "h2"), "another desired object is applied");
        assert!(!p.pending(&pod("b", "x", &[]), "h1"), "another namespace");
        p.seen(&obj);
        assert!(!p.pending(&obj, "h1"));
    }

    /// A cached pod keeps what reconciles read (labels, node, readiness gates, status) and drops
    /// the managed fields and the rest of its spec.
    #[test]
    fn a_trimmed_pod_keeps_what_reconciles_read() {
        use k8s_openapi::api::core::v1::{Container, PodReadinessGate, PodSpec, PodStatus};
        let mut p = pod("a", "x", &[("k".into(), "v".into())]);
        p.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        p.spec = Some(PodSpec {
            node_name: Some("n".into()),
            readiness_gates: Some(vec![PodReadinessGate {
                condition_type: "g".into(),
            }]),
            containers: vec![Container {
                name: "worker".into(),
                ..Container::default()
            }],
            ..PodSpec::default()
        });
        p.status = Some(PodStatus {
            pod_ip: Some("10.0.0.1".into()),
            ..PodStatus::default()
        });
        let before = p.clone();
        p.trim();
        assert_eq!(p.metadata.managed_fields, None);
        assert_eq!(p.metadata.labels, before.metadata.labels);
        assert_eq!(p.status, before.status);
        let spec = p.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n"));
        assert_eq!(spec.readiness_gates, before.spec.unwrap().readiness_gates);
        assert!(spec.containers.is_empty());
    }
}
