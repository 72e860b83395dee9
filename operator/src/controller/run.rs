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

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tandem_crds::{CacheTier, DecodePool, PrefillPool};

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

fn pool_of<K: Resource<DynamicType = ()>>(obj: &impl Resource) -> Option<ObjectRef<K>> {
    let pool = obj.labels().get(labels::POOL)?;
    Some(ObjectRef::new(pool).within(obj.meta().namespace.as_deref()?))
}

/// Times one reconcile and counts its error, by kind.
fn instrumented<K, F>(
    kind: &'static str,
    f: F,
) -> impl FnMut(Arc<K>, Arc<Context>) -> BoxFuture<'static, Result<Action, Error>>
where
    K: Send + Sync + 'static,
    F: Fn(Arc<K>, Arc<Context>) -> BoxFuture<'static, Result<Action, Error>>
        + Copy
        + Send
        + 'static,
{
    move |obj, ctx| {
        Box::pin(async move {
            let started = Instant::now();
            let out = f(obj, ctx.clone()).await;
            ctx.metrics
                .reconcile_duration
                .get_or_create(&KindLabels { kind: kind.into() })
                .observe(started.elapsed().as_secs_f64());
            if let Err(e) = &out {
                ctx.metrics
                    .reconcile_errors
                    .get_or_create(&ErrorLabels {
                        kind: kind.into(),
                        reason: e.reason(),
                    })
                    .inc();
            }
            out
        })
    }
}

fn error_policy<K: Resource<DynamicType = ()>>(
    obj: Arc<K>,
    err: &Error,
    _ctx: Arc<Context>,
) -> Action {
    tracing::warn!(
        kind = %K::kind(&()),
        name = %obj.name_any(),
        namespace = obj.namespace().unwrap_or_default(),
        error = %err,
        "reconcile failed; retrying"
    );
    Action::requeue(Duration::from_secs(10))
}

async fn log_results<K: Resource, E: std::fmt::Display>(
    stream: impl futures::Stream<Item = Result<(ObjectRef<K>, Action), E>>,
) {
    stream
        .for_each(|r| async move {
            match r {
                Ok((o, _)) => tracing::debug!(object = %o, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "controller"),
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

    // CacheTier.
    let tier_ctrl = Controller::new(tiers.clone(), wc.clone())
        .owns(scope.api::<StatefulSet>(c), managed())
        .owns(scope.api::<Service>(c), managed())
        .owns(scope.api::<ConfigMap>(c), managed())
        .watches(scope.api::<Pod>(c), role_pods(Role::Cache), |p| {
            pool_of::<CacheTier>(&p)
        })
        .watches(prefills.clone(), wc.clone(), |p: PrefillPool| {
            let ns = p.namespace();
            p.spec
                .cache_tier_ref
                .map(|r| ObjectRef::new(&r.name).within(ns.as_deref().unwrap_or_default()))
        })
        .watches(decodes.clone(), wc.clone(), |d: DecodePool| {
            let ns = d.namespace();
            d.spec
                .cache_tier_ref
                .map(|r| ObjectRef::new(&r.name).within(ns.as_deref().unwrap_or_default()))
        })
        .graceful_shutdown_on(shutdown.clone());
    let tier_fut = tier_ctrl.run(
        instrumented::<CacheTier, _>(cache_tier::KIND, |o, c| {
            Box::pin(cache_tier::reconcile(o, c))
        }),
        error_policy,
        ctx.clone(),
    );

    // PrefillPool.
    let pctrl = Controller::new(prefills.clone(), wc.clone());
    let pstore = pctrl.store();
    let prefill_ctrl = pctrl
        .owns(scope.api::<StatefulSet>(c), managed())
        .owns(scope.api::<Service>(c), managed())
        .owns(scope.api::<ConfigMap>(c), managed())
        .watches(scope.api::<Pod>(c), role_pods(Role::Prefill), |p| {
            pool_of::<PrefillPool>(&p)
        })
        .watches(decodes.clone(), wc.clone(), |d: DecodePool| {
            let ns = d.namespace().unwrap_or_default();
            Some(ObjectRef::new(&d.spec.prefill.pool_ref.name).within(&ns))
        })
        .watches(tiers.clone(), wc.clone(), move |t: CacheTier| {
            let (name, ns) = (t.name_any(), t.namespace());
            pstore
                .state()
                .into_iter()
                .filter(|p| {
                    p.namespace() == ns
                        && p.spec
                            .cache_tier_ref
                            .as_ref()
                            .is_some_and(|r| r.name == name)
                })
                .map(|p| ObjectRef::from_obj(p.as_ref()))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(shutdown.clone());
    let prefill_fut = prefill_ctrl.run(
        instrumented::<PrefillPool, _>(prefill_pool::KIND, |o, c| {
            Box::pin(prefill_pool::reconcile(o, c))
        }),
        error_policy,
        ctx.clone(),
    );

    // DecodePool.
    let dctrl = Controller::new(decodes.clone(), wc.clone());
    let dstore_a = dctrl.store();
    let dstore_b = dctrl.store();
    let dstore_c = dctrl.store();
    let pairing = move |store: &kube::runtime::reflector::Store<DecodePool>,
                        ns: Option<String>,
                        prefill: &str| {
        store
            .state()
            .into_iter()
            .filter(|d| d.namespace() == ns && d.spec.prefill.pool_ref.name == prefill)
            .map(|d| ObjectRef::from_obj(d.as_ref()))
            .collect::<Vec<_>>()
    };
    let decode_ctrl = dctrl
        .owns(scope.api::<StatefulSet>(c), managed())
        .owns(scope.api::<Service>(c), managed())
        .owns(scope.api::<ConfigMap>(c), managed())
        .watches(scope.api::<Pod>(c), role_pods(Role::Decode), |p| {
            pool_of::<DecodePool>(&p)
        })
        .watches(
            scope.api::<Pod>(c),
            role_pods(Role::Prefill),
            move |p: Pod| {
                let pool = p.labels().get(labels::POOL).cloned().unwrap_or_default();
                pairing(&dstore_a, p.namespace(), &pool)
            },
        )
        .watches(prefills.clone(), wc.clone(), move |p: PrefillPool| {
            pairing(&dstore_b, p.namespace(), &p.name_any())
        })
        .watches(tiers.clone(), wc.clone(), move |t: CacheTier| {
            let (name, ns) = (t.name_any(), t.namespace());
            dstore_c
                .state()
                .into_iter()
                .filter(|d| {
                    d.namespace() == ns
                        && d.spec
                            .cache_tier_ref
                            .as_ref()
                            .is_some_and(|r| r.name == name)
                })
                .map(|d| ObjectRef::from_obj(d.as_ref()))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(shutdown);
    let decode_fut = decode_ctrl.run(
        instrumented::<DecodePool, _>(decode_pool::KIND, |o, c| {
            Box::pin(decode_pool::reconcile(o, c))
        }),
        error_policy,
        ctx.clone(),
    );

    tokio::join!(
        log_results(tier_fut),
        log_results(prefill_fut),
        log_results(decode_fut)
    );
}
