//! Wiring: the three `kube::runtime::Controller`s, their watches, metrics and error policy.
//!
//! One watch per kind for all three controllers — the three kinds, the StatefulSets, Services and
//! ConfigMaps the operator manages, and pods of every role — reflected into the caches the
//! reconciles read ([`super::cache`]); each change is then routed, after its store holds it, to
//! the resources that must look again:
//! - a StatefulSet, Service or ConfigMap to its owner (owner references);
//! - a pod to its pool or tier by the `serving.tandem.dev/pool` label, and a prefill pod also to
//!   the DecodePools that pair with its pool (the rollout gate and the unschedulable check read
//!   them);
//! - a CacheTier to itself and the pools that reference it;
//! - a PrefillPool to itself, its tier (teardown waits for referencing pools to go) and the
//!   DecodePools pairing with it;
//! - a DecodePool to itself, its tier and its PrefillPool (the ratio and the pair revision).
//!
//! Every watch is built here and wrapped by [`super::watches::watched`]: a failure is a warning
//! with its back-off, shows in `/readyz` and the `watches_failing` gauge, and is retried along
//! [`super::backoff::WATCH`] without pausing the other watches. A failed reconcile is retried per
//! object along [`super::backoff::RECONCILE`] (1 s doubling to 120 s), and its count resets on
//! success.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::mpsc::{self, UnboundedSender};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tandem_crds::{CacheTier, DecodePool, LocalRef, PrefillPool};

use super::blocked::Reported;
use super::cache::{self, Caches};
use super::watches::{WatchHealth, watched};
use super::{Context, Error, cache_tier, decode_pool, prefill_pool};
use crate::labels::{self, Role};
use crate::metrics::{ErrorLabels, KindLabels, ResourceLabels};

/// Where the controllers look.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// A single namespace, or all when `None`.
    pub namespace: Option<String>,
}

impl Scope {
    fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match &self.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
}

fn pool_of<K: Resource<DynamicType = ()>>(obj: &impl Resource) -> Option<ObjectRef<K>> {
    let pool = obj.labels().get(labels::POOL)?;
    Some(ObjectRef::new(pool).within(obj.meta().namespace.as_deref()?))
}

/// The CacheTier a pool names (`cacheTierRef`), in the pool's namespace.
fn tier_of(pool: &impl Resource, tier: Option<&LocalRef>) -> Option<ObjectRef<CacheTier>> {
    let ns = pool.meta().namespace.as_deref().unwrap_or_default();
    tier.map(|r| ObjectRef::new(&r.name).within(ns))
}

/// The pools in `store` whose `cacheTierRef` (read by `tier_ref`) names `tier`.
fn naming<K>(
    store: &Store<K>,
    tier: &CacheTier,
    tier_ref: impl Fn(&K) -> Option<&LocalRef>,
) -> Vec<ObjectRef<K>>
where
    K: Resource<DynamicType = ()> + Clone,
{
    let (name, ns) = (tier.name_any(), tier.namespace());
    store
        .state()
        .into_iter()
        .filter(|p| p.namespace() == ns && tier_ref(p).is_some_and(|r| r.name == name))
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// An object a watch saw change, passed on once its store holds the change.
struct Touched<K> {
    obj: K,
    /// The object was deleted (it is no longer in the store).
    deleted: bool,
}

/// One watch for the whole operator: reflects `K` (as [`cache::Trim`] keeps it) into a store
/// and yields each applied or deleted object once the store holds the change ([`touched`]); a
/// (re)list forgets `pending` applies of `K` (an object deleted while the watch was down comes
/// with no event).
/// Named `watch: <plural>` in [`WatchHealth`] (`/readyz`).
fn watch_kind<K>(
    health: &WatchHealth,
    pending: &cache::PendingApplies,
    api: Api<K>,
    wc: watcher::Config,
) -> (Store<K>, impl Stream<Item = Touched<K>> + Send + 'static)
where
    K: Resource<DynamicType = ()>
        + cache::Trim
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let pending = pending.clone();
    let name = format!("watch: {}", K::plural(&()));
    let events = watched(name, health, watcher(api, wc)).modify(K::trim);
    let reflected = reflector::reflector(writer, events).inspect(move |e| {
        if matches!(e, Ok(watcher::Event::Init)) {
            pending.relisting::<K>();
        }
    });
    (store.clone(), touched(store, reflected))
}

/// A (re)list in progress: the store's objects when it began, and the objects listed so far.
struct Relist<K: Resource<DynamicType = ()>> {
    before: Vec<Arc<K>>,
    listed: Vec<ObjectRef<K>>,
}

/// The changes of `events` (already applied to `store` by the reflector) as [`Touched`]
/// objects, each yielded only once `store` holds it:
/// - `Apply` and `Delete` at once (the reflector applied them before yielding);
/// - a list's objects (`InitApply`) are held until its `InitDone`, when the reflector swaps the
///   listed set into the store (before that the store still holds the previous state), then
///   yielded from the store; objects the store held before the list and no longer holds are
///   yielded as deleted (a re-list after a desync carries no `Delete` for them).
fn touched<K, S>(store: Store<K>, events: S) -> impl Stream<Item = Touched<K>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    events
        .scan(None::<Relist<K>>, move |relist, e| {
            let out = match e {
                Ok(watcher::Event::Apply(obj)) => vec![Touched {
                    obj,
                    deleted: false,
                }],
                Ok(watcher::Event::Delete(obj)) => vec![Touched { obj, deleted: true }],
                Ok(watcher::Event::Init) => {
                    *relist = Some(Relist {
                        before: store.state(),
                        listed: Vec::new(),
                    });
                    Vec::new()
                }
                Ok(watcher::Event::InitApply(obj)) => {
                    if let Some(r) = relist.as_mut() {
                        r.listed.push(ObjectRef::from_obj(&obj));
                    }
                    Vec::new()
                }
                Ok(watcher::Event::InitDone) => {
                    let r = relist.take().unwrap_or(Relist {
                        before: Vec::new(),
                        listed: Vec::new(),
                    });
                    let now = r
                        .listed
                        .iter()
                        .filter_map(|k| store.get(k))
                        .map(|o| Touched {
                            obj: o.as_ref().clone(),
                            deleted: false,
                        });
                    let gone = r
                        .before
                        .iter()
                        .filter(|o| store.get(&ObjectRef::from_obj(o.as_ref())).is_none())
                        .map(|o| Touched {
                            obj: o.as_ref().clone(),
                            deleted: true,
                        });
                    now.chain(gone).collect()
                }
                // Errors are consumed (logged, retried) by `watched`.
                Err(_) => Vec::new(),
            };
            futures::future::ready(Some(futures::stream::iter(out)))
        })
        .flatten()
}

/// The trigger channels of the three controllers, fed by the watches after their stores hold
/// each change; and the stores the mappings read.
#[derive(Clone)]
struct Routes {
    tiers: UnboundedSender<ObjectRef<CacheTier>>,
    prefills: UnboundedSender<ObjectRef<PrefillPool>>,
    decodes: UnboundedSender<ObjectRef<DecodePool>>,
    caches: Caches,
    pending: cache::PendingApplies,
}

/// Whether owner reference `o` names a `K` (same kind, same group/version).
fn owner_is<K: Resource<DynamicType = ()>>(o: &OwnerReference) -> bool {
    o.kind == K::kind(&()) && o.api_version == K::api_version(&())
}

// Sends are best effort: a closed receiver means its controller stopped at shutdown.
impl Routes {
    fn tier(&self, r: Option<ObjectRef<CacheTier>>) {
        if let Some(r) = r {
            let _ = self.tiers.unbounded_send(r);
        }
    }

    fn prefill(&self, r: Option<ObjectRef<PrefillPool>>) {
        if let Some(r) = r {
            let _ = self.prefills.unbounded_send(r);
        }
    }

    fn decodes(&self, rs: Vec<ObjectRef<DecodePool>>) {
        for r in rs {
            let _ = self.decodes.unbounded_send(r);
        }
    }

    /// A StatefulSet, Service or ConfigMap changed: the caches hold any apply of it the operator
    /// made; reconcile its owners among the three kinds.
    fn owned<C: Resource<DynamicType = ()>>(&self, obj: &C) {
        self.pending.seen(obj);
        let ns = obj.meta().namespace.as_deref().unwrap_or_default();
        for o in obj.owner_references() {
            if owner_is::<CacheTier>(o) {
                self.tier(Some(ObjectRef::new(&o.name).within(ns)));
            } else if owner_is::<PrefillPool>(o) {
                self.prefill(Some(ObjectRef::new(&o.name).within(ns)));
            } else if owner_is::<DecodePool>(o) {
                self.decodes(vec![ObjectRef::new(&o.name).within(ns)]);
            }
        }
    }

    /// A pod changed: reconcile its tier or pool, and for a prefill pod the DecodePools pairing
    /// with its pool (the rollout gate and the unschedulable check read its pods).
    fn pod(&self, p: &Pod) {
        match p.labels().get(labels::ROLE).map(String::as_str) {
            Some(r) if r == Role::Cache.as_str() => self.tier(pool_of(p)),
            Some(r) if r == Role::Prefill.as_str() => {
                self.prefill(pool_of(p));
                let pool = p.labels().get(labels::POOL).cloned().unwrap_or_default();
                self.decodes(pairing(&self.caches.decodes, p.namespace(), &pool));
            }
            Some(r) if r == Role::Decode.as_str() => {
                self.decodes(pool_of(p).into_iter().collect());
            }
            _ => {}
        }
    }

    /// A CacheTier changed: reconcile it (unless deleted) and the pools naming it.
    fn cache_tier(&self, t: &Touched<CacheTier>) {
        if !t.deleted {
            self.tier(Some(ObjectRef::from_obj(&t.obj)));
        }
        for p in naming(&self.caches.prefills, &t.obj, |p| {
            p.spec.cache_tier_ref.as_ref()
        }) {
            self.prefill(Some(p));
        }
        self.decodes(naming(&self.caches.decodes, &t.obj, |d| {
            d.spec.cache_tier_ref.as_ref()
        }));
    }

    /// A PrefillPool changed: reconcile it (unless deleted), its tier (teardown waits for the
    /// pools naming it) and the DecodePools pairing with it.
    fn prefill_pool(&self, p: &Touched<PrefillPool>) {
        if !p.deleted {
            self.prefill(Some(ObjectRef::from_obj(&p.obj)));
        }
        self.tier(tier_of(&p.obj, p.obj.spec.cache_tier_ref.as_ref()));
        self.decodes(pairing(
            &self.caches.decodes,
            p.obj.namespace(),
            &p.obj.name_any(),
        ));
    }

    /// A DecodePool changed: reconcile it (unless deleted), its tier, and its PrefillPool (the
    /// ratio and the pair revision).
    fn decode_pool(&self, d: &Touched<DecodePool>) {
        if !d.deleted {
            self.decodes(vec![ObjectRef::from_obj(&d.obj)]);
        }
        self.tier(tier_of(&d.obj, d.obj.spec.cache_tier_ref.as_ref()));
        let ns = d.obj.namespace().unwrap_or_default();
        self.prefill(Some(
            ObjectRef::new(&d.obj.spec.prefill.pool_ref.name).within(&ns),
        ));
    }
}

/// The controller of `K` over `store` (reflected by its kind's watch), triggered only by what
/// the watches route to it (`triggers`): its own changes and the others that concern it.
fn controller<K>(
    store: Store<K>,
    triggers: impl Stream<Item = ObjectRef<K>> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    Controller::for_stream(
        futures::stream::pending::<Result<K, watcher::Error>>(),
        store,
    )
    .reconcile_on(triggers)
    .graceful_shutdown_on(shutdown)
}

/// The DecodePools in `store` (namespace `ns`) pairing with PrefillPool `prefill`.
fn pairing(
    store: &Store<DecodePool>,
    ns: Option<String>,
    prefill: &str,
) -> Vec<ObjectRef<DecodePool>> {
    store
        .state()
        .into_iter()
        .filter(|d| d.namespace() == ns && d.spec.prefill.pool_ref.name == prefill)
        .map(|d| ObjectRef::from_obj(d.as_ref()))
        .collect()
}

/// Runs `ctrl` with `reconcile` (instrumented), the error policy and `ctx`, logging its results.
fn drive<K, F>(ctrl: Controller<K>, ctx: Arc<Context>, reconcile: F) -> impl Future<Output = ()>
where
    K: Reported,
    F: Fn(Arc<K>, Arc<Context>) -> BoxFuture<'static, Result<Action, Error>>
        + Copy
        + Send
        + 'static,
{
    log_results(ctrl.run(instrumented::<K, _>(K::KIND, reconcile), error_policy, ctx))
}

/// The error policy's key of an object: `Kind/namespace/name`.
fn object_key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

/// Holds one count of the `reconciles_in_flight` gauge; dropping it (also when the reconcile
/// future is cancelled at shutdown) releases the count.
struct InFlight(prometheus_client::metrics::gauge::Gauge);

impl InFlight {
    fn start(gauge: prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Times one reconcile (from when it holds one of its kind's slots), counts its error by kind,
/// and resets the object's error backoff on success.
fn instrumented<K, F>(
    kind: &'static str,
    f: F,
) -> impl FnMut(Arc<K>, Arc<Context>) -> BoxFuture<'static, Result<Action, Error>>
where
    K: Resource<DynamicType = ()> + Send + Sync + 'static,
    F: Fn(Arc<K>, Arc<Context>) -> BoxFuture<'static, Result<Action, Error>>
        + Copy
        + Send
        + 'static,
{
    move |obj, ctx| {
        Box::pin(async move {
            let key = object_key(obj.as_ref());
            let labels = KindLabels { kind: kind.into() };
            let in_flight = InFlight::start(ctx.metrics.in_flight.get_or_create(&labels).clone());
            // At most `--max-concurrent-reconciles` of a kind do their reads and writes at once;
            // the others wait here holding only the object (kube-runtime starts every due
            // reconcile at once: 2,329 ran together at N = 1,000, the operator at 1 GiB).
            let Some(slot) = ctx.reconcile_slots.acquire(kind).await else {
                // Shutting down: the queue behind the running reconciles is dropped.
                return Ok(Action::await_change());
            };
            let running = InFlight::start(ctx.metrics.running.get_or_create(&labels).clone());
            let started = Instant::now();
            let out = f(obj, ctx.clone()).await;
            drop((running, slot, in_flight));
            ctx.metrics
                .reconcile_duration
                .get_or_create(&labels)
                .observe(started.elapsed().as_secs_f64());
            match &out {
                Ok(_) => ctx.error_backoff.succeeded(&key),
                Err(e) => {
                    ctx.metrics
                        .reconcile_errors
                        .get_or_create(&ErrorLabels {
                            kind: kind.into(),
                            reason: e.reason(),
                        })
                        .inc();
                }
            }
            out
        })
    }
}

/// Requeues a failed object after its next [`super::backoff::RECONCILE`] delay.
fn error_policy<K: Resource<DynamicType = ()>>(
    obj: Arc<K>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    let key = object_key(obj.as_ref());
    let retry_in = ctx.error_backoff.failed(&key);
    tracing::warn!(
        kind = %K::kind(&()),
        name = %obj.name_any(),
        namespace = obj.namespace().unwrap_or_default(),
        error = %err,
        failures = ctx.error_backoff.failures(&key),
        retry_in_s = retry_in.as_secs_f64(),
        "reconcile failed; retrying"
    );
    Action::requeue(retry_in)
}

async fn log_results<K: Resource, E: std::fmt::Display>(
    stream: impl futures::Stream<Item = Result<(ObjectRef<K>, Action), E>>,
) {
    stream
        .for_each(|r| async move {
            match r {
                Ok((o, _)) => tracing::debug!(object = %o, "reconciled"),
                // Reconcile failures are logged by the error policy and watch failures by
                // `watched`; what is left (e.g. a requeue of an object no longer in the store)
                // is still worth seeing.
                Err(e) => tracing::warn!(error = %e, "controller"),
            }
        })
        .await;
}

/// Runs the three controllers until `shutdown` resolves (then each finishes its in-flight
/// reconciles and returns).
pub async fn run(
    ctx: Arc<Context>,
    scope: Scope,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let c = &ctx.client;
    let health = &ctx.watches;
    let pending = &ctx.pending_applies;
    let all = watcher::Config::default;

    // One watch per kind for all three controllers, reflected into the caches the reconciles
    // read; each change then goes to the resources it concerns.
    // Children: every object carrying the role label (the operator's children all do; a pool's
    // children are then selected by its selector labels, the same set a LIST by them returns).
    let role = || all().labels(labels::ROLE);
    let (sts_store, sts) = watch_kind(health, pending, scope.api::<StatefulSet>(c), role());
    let (svc_store, svcs) = watch_kind(health, pending, scope.api::<Service>(c), role());
    let (cm_store, cms) = watch_kind(health, pending, scope.api::<ConfigMap>(c), role());
    let (pod_store, pods) = watch_kind(health, pending, scope.api::<Pod>(c), role());
    let (tier_store, tiers) = watch_kind(health, pending, scope.api::<CacheTier>(c), all());
    let (prefill_store, prefills) = watch_kind(health, pending, scope.api::<PrefillPool>(c), all());
    let (decode_store, decodes) = watch_kind(health, pending, scope.api::<DecodePool>(c), all());
    let caches = Caches {
        statefulsets: sts_store,
        services: svc_store,
        config_maps: cm_store,
        pods: pod_store,
        tiers: tier_store,
        prefills: prefill_store,
        decodes: decode_store,
    };
    if ctx.read_cache
        && let Ok(mut slot) = ctx.caches.write()
    {
        *slot = Some(caches.clone());
    }

    let (tier_tx, tier_rx) = mpsc::unbounded();
    let (prefill_tx, prefill_rx) = mpsc::unbounded();
    let (decode_tx, decode_rx) = mpsc::unbounded();
    let routes = Routes {
        tiers: tier_tx,
        prefills: prefill_tx,
        decodes: decode_tx,
        caches: caches.clone(),
        pending: ctx.pending_applies.clone(),
    };
    let tier_ctrl = controller(caches.tiers.clone(), tier_rx, shutdown.clone());
    let prefill_ctrl = controller(caches.prefills.clone(), prefill_rx, shutdown.clone());
    let decode_ctrl = controller(caches.decodes.clone(), decode_rx, shutdown.clone());

    let gauge = |resource: &str| {
        ctx.metrics
            .cached_children
            .get_or_create(&ResourceLabels {
                resource: resource.into(),
            })
            .clone()
    };
    let count = |store_len: fn(&Caches) -> usize, resource: &str| {
        let (g, c) = (gauge(resource), caches.clone());
        move || g.set(i64::try_from(store_len(&c)).unwrap_or(i64::MAX))
    };
    let (r, sts_count) = (
        routes.clone(),
        count(|c| c.statefulsets.len(), "statefulsets"),
    );
    let sts = sts.map(move |t| {
        sts_count();
        r.owned(&t.obj)
    });
    let (r, svc_count) = (routes.clone(), count(|c| c.services.len(), "services"));
    let svcs = svcs.map(move |t| {
        svc_count();
        r.owned(&t.obj)
    });
    let (r, cm_count) = (routes.clone(), count(|c| c.config_maps.len(), "configmaps"));
    let cms = cms.map(move |t| {
        cm_count();
        r.owned(&t.obj)
    });
    let (r, pod_count) = (routes.clone(), count(|c| c.pods.len(), "pods"));
    let pods = pods.map(move |t| {
        pod_count();
        r.pod(&t.obj)
    });
    let r = routes.clone();
    let tiers = tiers.map(move |t| r.cache_tier(&t));
    let r = routes.clone();
    let prefills = prefills.map(move |p| r.prefill_pool(&p));
    let r = routes;
    let decodes = decodes.map(move |d| r.decode_pool(&d));
    let watches = futures::stream::select_all([
        sts.boxed(),
        svcs.boxed(),
        cms.boxed(),
        pods.boxed(),
        tiers.boxed(),
        prefills.boxed(),
        decodes.boxed(),
    ])
    .take_until(shutdown.clone())
    .for_each(|()| futures::future::ready(()));
    // At shutdown the watches stop: the caches freeze (reads go to the API server from then on)
    // and the reconciles still waiting for a slot are turned away.
    let stop = {
        let ctx = ctx.clone();
        async move {
            shutdown.await;
            ctx.reconcile_slots.close();
            if let Ok(mut slot) = ctx.caches.write() {
                *slot = None;
            }
        }
    };

    let tier_fut = drive(tier_ctrl, ctx.clone(), |o, c| {
        Box::pin(cache_tier::reconcile(o, c))
    });
    let prefill_fut = drive(prefill_ctrl, ctx.clone(), |o, c| {
        Box::pin(prefill_pool::reconcile(o, c))
    });
    let decode_fut = drive(decode_ctrl, ctx.clone(), |o, c| {
        Box::pin(decode_pool::reconcile(o, c))
    });
    tokio::join!(tier_fut, prefill_fut, decode_fut, watches, stop);
    if let Ok(mut slot) = ctx.caches.write() {
        *slot = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    /// What `touched` yields after `events`, each with what the store held when it was yielded.
    async fn run_events(events: Vec<watcher::Event<ConfigMap>>) -> Vec<(String, bool, bool)> {
        let (store, writer) = reflector::store::<ConfigMap>();
        let reflected =
            reflector::reflector(writer, futures::stream::iter(events.into_iter().map(Ok)));
        touched(store.clone(), reflected)
            .map(|t| {
                let held = store.get(&ObjectRef::from_obj(&t.obj)).is_some();
                (t.obj.name_any(), t.deleted, held)
            })
            .collect()
            .await
    }

    /// A list's objects are passed on at its end, when the store holds them; a re-list passes on
    /// as deleted what the store held before and the list no longer has (no `Delete` event comes
    /// for it); applies and deletes pass at once, after the store applied them.
    #[tokio::test]
    async fn touched_objects_pass_only_once_the_store_holds_the_change() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let seen = run_events(vec![
            Init,
            InitApply(cm("a")),
            InitApply(cm("b")),
            InitDone,
            Apply(cm("c")),
            Delete(cm("a")),
            // A re-list after a desync: b is gone meanwhile, d is new.
            Init,
            InitApply(cm("c")),
            InitApply(cm("d")),
            InitDone,
        ])
        .await;
        let s = |n: &str, deleted, held| (n.to_owned(), deleted, held);
        assert_eq!(
            seen,
            vec![
                s("a", false, true),
                s("b", false, true),
                s("c", false, true),
                s("a", true, false),
                s("c", false, true),
                s("d", false, true),
                s("b", true, false),
            ]
        );
    }
}
