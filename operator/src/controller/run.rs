//! Wiring: the three `kube::runtime::Controller`s, their watches, metrics and error policy.
//!
//! Watches (each maps a change to the resources that must look again):
//! - every kind owns its StatefulSets, Services and ConfigMaps (owner references);
//! - pods of each role map to their pool or tier by the `serving.tandem.dev/pool` label; prefill
//!   pods also requeue the DecodePools that pair with their pool (the rollout gate and the
//!   unschedulable check read them);
//! - a DecodePool change requeues its PrefillPool (the ratio and the pair revision);
//! - a PrefillPool change requeues the DecodePools pairing with it;
//! - a CacheTier change requeues the pools that reference it; a pool change requeues its tier
//!   (teardown waits for referencing pools to go).
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

use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tandem_crds::{CacheTier, DecodePool, LocalRef, PrefillPool};

use super::blocked::Reported;
use super::watches::{WatchHealth, watched};
use super::{Context, Error, cache_tier, decode_pool, prefill_pool};
use crate::labels::{self, FIELD_MANAGER, Role};
use crate::metrics::{ErrorLabels, KindLabels};

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

fn managed() -> watcher::Config {
    watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={FIELD_MANAGER}"))
}

fn role_pods(role: Role) -> watcher::Config {
    watcher::Config::default().labels(&format!("{}={}", labels::ROLE, role.as_str()))
}

/// Builds the watches of one controller, each named `<controller>: <resource>` in
/// [`WatchHealth`].
struct Watches {
    controller: &'static str,
    health: WatchHealth,
    scope: Scope,
    client: Client,
}

impl Watches {
    fn name<K: Resource<DynamicType = ()>>(&self, suffix: &str) -> String {
        format!("{}: {}{suffix}", self.controller, K::plural(&()))
    }

    /// The controller's own kind, reflected into a store (the trigger of `for_stream`).
    fn main<K>(
        &self,
        api: Api<K>,
    ) -> (
        impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
        Store<K>,
    )
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        let (store, writer) = reflector::store();
        let events = watched(
            self.name::<K>(""),
            &self.health,
            watcher(api, watcher::Config::default()),
        );
        (
            reflector::reflector(writer, events).applied_objects(),
            store,
        )
    }

    /// The controller of `K` over its own watch, owning its StatefulSets, Services and
    /// ConfigMaps; and the store its watch reflects into (for the mappers of other watches).
    fn controller<K>(&self, api: Api<K>) -> (Controller<K>, Store<K>)
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        let (trigger, store) = self.main(api);
        let c = &self.client;
        let ctrl = Controller::for_stream(trigger, store.clone())
            .owns_stream(self.owned(self.scope.api::<PartialObjectMeta<StatefulSet>>(c)))
            .owns_stream(self.owned(self.scope.api::<PartialObjectMeta<Service>>(c)))
            .owns_stream(self.owned(self.scope.api::<PartialObjectMeta<ConfigMap>>(c)));
        (ctrl, store)
    }

    /// Children the kind owns (metadata-only watches: the owner references are what maps).
    fn owned<C>(
        &self,
        api: Api<PartialObjectMeta<C>>,
    ) -> impl Stream<Item = Result<PartialObjectMeta<C>, watcher::Error>> + Send + 'static
    where
        C: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        watched(self.name::<C>(""), &self.health, watcher(api, managed())).touched_objects()
    }

    /// Other objects whose changes map to resources of the kind.
    fn others<O>(
        &self,
        api: Api<O>,
        wc: watcher::Config,
        suffix: &str,
    ) -> impl Stream<Item = Result<O, watcher::Error>> + Send + 'static
    where
        O: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        watched(self.name::<O>(suffix), &self.health, watcher(api, wc)).touched_objects()
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

/// Times one reconcile, counts its error by kind, and resets the object's error backoff on
/// success.
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
            let started = Instant::now();
            let key = object_key(obj.as_ref());
            let labels = KindLabels { kind: kind.into() };
            let in_flight = InFlight::start(ctx.metrics.in_flight.get_or_create(&labels).clone());
            let out = f(obj, ctx.clone()).await;
            drop(in_flight);
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
    let tiers: Api<CacheTier> = scope.api(c);
    let prefills: Api<PrefillPool> = scope.api(c);
    let decodes: Api<DecodePool> = scope.api(c);
    let wc = watcher::Config::default();
    let watches = |controller| Watches {
        controller,
        health: ctx.watches.clone(),
        scope: scope.clone(),
        client: c.clone(),
    };

    // CacheTier.
    let w = watches(cache_tier::KIND);
    let (tier_ctrl, _) = w.controller(tiers.clone());
    let tier_ctrl = tier_ctrl
        .watches_stream(
            w.others(scope.api::<Pod>(c), role_pods(Role::Cache), ""),
            |p| pool_of::<CacheTier>(&p),
        )
        .watches_stream(w.others(prefills.clone(), wc.clone(), ""), |p| {
            tier_of(&p, p.spec.cache_tier_ref.as_ref())
        })
        .watches_stream(w.others(decodes.clone(), wc.clone(), ""), |d| {
            tier_of(&d, d.spec.cache_tier_ref.as_ref())
        })
        .graceful_shutdown_on(shutdown.clone());

    // PrefillPool.
    let w = watches(prefill_pool::KIND);
    let (prefill_ctrl, pstore) = w.controller(prefills.clone());
    let prefill_ctrl = prefill_ctrl
        .watches_stream(
            w.others(scope.api::<Pod>(c), role_pods(Role::Prefill), ""),
            |p| pool_of::<PrefillPool>(&p),
        )
        .watches_stream(
            w.others(decodes.clone(), wc.clone(), ""),
            |d: DecodePool| {
                let ns = d.namespace().unwrap_or_default();
                Some(ObjectRef::new(&d.spec.prefill.pool_ref.name).within(&ns))
            },
        )
        .watches_stream(w.others(tiers.clone(), wc.clone(), ""), move |t| {
            naming(&pstore, &t, |p| p.spec.cache_tier_ref.as_ref())
        })
        .graceful_shutdown_on(shutdown.clone());

    // DecodePool.
    let w = watches(decode_pool::KIND);
    let (decode_ctrl, dstore) = w.controller(decodes.clone());
    let (dstore_a, dstore_b, dstore_c) = (dstore.clone(), dstore.clone(), dstore);
    let pairing = move |store: &Store<DecodePool>, ns: Option<String>, prefill: &str| {
        store
            .state()
            .into_iter()
            .filter(|d| d.namespace() == ns && d.spec.prefill.pool_ref.name == prefill)
            .map(|d| ObjectRef::from_obj(d.as_ref()))
            .collect::<Vec<_>>()
    };
    let decode_ctrl = decode_ctrl
        .watches_stream(
            w.others(scope.api::<Pod>(c), role_pods(Role::Decode), " (decode)"),
            |p| pool_of::<DecodePool>(&p),
        )
        .watches_stream(
            w.others(scope.api::<Pod>(c), role_pods(Role::Prefill), " (prefill)"),
            move |p: Pod| {
                let pool = p.labels().get(labels::POOL).cloned().unwrap_or_default();
                pairing(&dstore_a, p.namespace(), &pool)
            },
        )
        .watches_stream(
            w.others(prefills.clone(), wc.clone(), ""),
            move |p: PrefillPool| pairing(&dstore_b, p.namespace(), &p.name_any()),
        )
        .watches_stream(w.others(tiers.clone(), wc.clone(), ""), move |t| {
            naming(&dstore_c, &t, |d| d.spec.cache_tier_ref.as_ref())
        })
        .graceful_shutdown_on(shutdown);

    let tier_fut = drive(tier_ctrl, ctx.clone(), |o, c| {
        Box::pin(cache_tier::reconcile(o, c))
    });
    let prefill_fut = drive(prefill_ctrl, ctx.clone(), |o, c| {
        Box::pin(prefill_pool::reconcile(o, c))
    });
    let decode_fut = drive(decode_ctrl, ctx.clone(), |o, c| {
        Box::pin(decode_pool::reconcile(o, c))
    });
    tokio::join!(tier_fut, prefill_fut, decode_fut);
}
