//! CacheTier controller: the store StatefulSet, its headless Service and the `tier.json`
//! ConfigMap; status `Ready`, `Progressing`, `Degraded`, `CacheWarm`.
//!
//! `CacheWarm` is True when every replica's `GET /report` says `warm` (loadback finished). A
//! replica whose report cannot be fetched (no pod IP, not reachable from the operator) counts as
//! warm when it is Ready, and the condition's reason is then `ReadyApproximation` instead of
//! `AllReplicasWarm`, so the source of the claim is visible.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use tandem_crds::conditions as cond;
use tandem_crds::{CacheTier, CacheTierStatus, DecodePool, PrefillPool};

use super::children::{self, need, normal, warning};
use super::pool::apply_child;
use super::pool_teardown::run_teardown_step;
use super::probe;
use super::{BUSY, Context, RESYNC, Result};
use crate::labels::{self, Role};
use crate::render::tier::{self, L3_PORT};
use crate::status::{self, Decided};
use crate::teardown::{self, TeardownObservation, TeardownStep};

/// Kind name for metrics and logs.
pub const KIND: &str = "CacheTier";

/// Pools in `ns` whose `cacheTierRef` names `tier`, as `Kind/name`.
pub async fn referencing_pools(ctx: &Context, ns: &str, tier: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let pps: Api<PrefillPool> = Api::namespaced(ctx.client.clone(), ns);
    for p in pps.list(&ListParams::default()).await?.items {
        if p.spec
            .cache_tier_ref
            .as_ref()
            .is_some_and(|r| r.name == tier)
        {
            out.push(format!("PrefillPool/{}", p.name_any()));
        }
    }
    let dps: Api<DecodePool> = Api::namespaced(ctx.client.clone(), ns);
    for d in dps.list(&ListParams::default()).await?.items {
        if d.spec
            .cache_tier_ref
            .as_ref()
            .is_some_and(|r| r.name == tier)
        {
            out.push(format!("DecodePool/{}", d.name_any()));
        }
    }
    Ok(out)
}

/// Reconciles one CacheTier.
///
/// # Errors
/// API failures; they are retried with backoff.
pub async fn reconcile(ct: Arc<CacheTier>, ctx: Arc<Context>) -> Result<Action> {
    let ns = need(ct.namespace(), "metadata.namespace")?;
    let name = ct.name_any();
    let key = format!("{ns}/{name}");
    let api: Api<CacheTier> = Api::namespaced(ctx.client.clone(), &ns);
    let stss: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), &ns);
    let svcs: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    let cms: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let parent = ct.object_ref(&());
    let store = labels::store_name(&name);
    let sts = stss.get_opt(&store).await?;
    let pods = children::list(&pods_api, &name, Role::Cache).await?;
    let prev = ct.status.as_ref();

    if children::terminating(ct.as_ref()) && !ctx.unsafe_modes.reconcile_while_deleting {
        ctx.metrics.set_state(KIND, &key, Some("Terminating"));
        if !ct.finalizers().iter().any(|f| f == super::FINALIZER) {
            return Ok(Action::await_change());
        }
        let obs = TeardownObservation {
            blocking: referencing_pools(&ctx, &ns, &name).await?,
            front_door_present: false,
            scaled_up: sts
                .iter()
                .filter(|s| !children::terminating(*s) && s.spec.replicas.unwrap_or(1) > 0)
                .map(|_| store.clone())
                .collect(),
            pods_left: pods.len() as u32,
        };
        let step = teardown::next_step(&obs);
        run_teardown_step(&ctx, KIND, &parent, &ns, &name, &step).await?;
        if step == TeardownStep::RemoveFinalizer {
            children::remove_finalizer(&ctx, KIND, &api, ct.as_ref()).await?;
            return Ok(Action::await_change());
        }
        let msg = super::pool_teardown::teardown_message(&step);
        let status = tier_status(
            prev,
            ct.metadata.generation,
            &[
                Decided::new(cond::READY, false, "Terminating", msg.clone()),
                Decided::new(cond::PROGRESSING, false, "Terminating", msg.clone()),
                Decided::new(cond::DEGRADED, true, "Terminating", msg),
                cache_warm_of(prev),
            ],
            prev.cloned().unwrap_or_default(),
        );
        children::patch_status_if_changed(&ctx, KIND, &api, &name, prev, &status).await?;
        return Ok(Action::requeue(BUSY));
    }
    children::ensure_finalizer(&ctx, KIND, &api, ct.as_ref()).await?;
    let owner = need(ct.controller_owner_ref(&()), "metadata.uid")?;

    let cfg = match tier::tier_config(&ct) {
        Ok(c) => c,
        Err(e) => {
            let reason = "RenderFailed";
            if !prev
                .and_then(|s| status::find(&s.conditions, cond::DEGRADED))
                .is_some_and(|c| c.status == "True" && c.reason == reason)
            {
                ctx.event(
                    &parent,
                    warning(),
                    reason,
                    "Block",
                    format!("{e}; no child is created or updated"),
                )
                .await;
            }
            let msg = e.to_string();
            let status = tier_status(
                prev,
                ct.metadata.generation,
                &[
                    Decided::new(cond::READY, false, reason, msg.clone()),
                    Decided::new(cond::PROGRESSING, false, reason, msg.clone()),
                    Decided::new(cond::DEGRADED, true, reason, msg),
                    cache_warm_of(prev),
                ],
                prev.cloned().unwrap_or_default(),
            );
            ctx.metrics.set_state(KIND, &key, Some("NotReady"));
            children::patch_status_if_changed(&ctx, KIND, &api, &name, prev, &status).await?;
            return Ok(Action::requeue(RESYNC));
        }
    };
    let replicas = ct.spec.replicas.max(0);
    let cm = tier::tier_config_map(&ct, &cfg, &owner)?;
    let cm_existing = cms.get_opt(&labels::config_map(&name)).await?;
    apply_child(
        &ctx,
        KIND,
        &parent,
        &cms,
        cm,
        cm_existing.as_ref(),
        None,
        "ConfigMap",
    )
    .await?;
    let svc = tier::store_service(&ct, &owner);
    let svc_existing = svcs.get_opt(&store).await?;
    apply_child(
        &ctx,
        KIND,
        &parent,
        &svcs,
        svc,
        svc_existing.as_ref(),
        None,
        "Service",
    )
    .await?;
    let desired = tier::store_statefulset(&ct, &cfg, replicas, &owner);
    let have = sts.as_ref().and_then(|s| s.spec.replicas);
    apply_child(
        &ctx,
        KIND,
        &parent,
        &stss,
        desired,
        sts.as_ref(),
        Some((replicas, have)),
        "store StatefulSet",
    )
    .await?;

    // Readiness and warmth of the replicas.
    let live: Vec<&Pod> = pods.iter().filter(|p| !children::terminating(*p)).collect();
    let ready: Vec<&Pod> = live
        .iter()
        .copied()
        .filter(|p| children::pod_ready(p))
        .collect();
    let updated = live
        .iter()
        .filter(|p| p.labels().get(labels::REVISION) == Some(&cfg.revision))
        .count() as i32;
    let mut reports = Vec::new();
    for p in &ready {
        let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
        let report = match (&ip, ctx.probe_reports) {
            (Some(ip), true) => probe::cache_report(ip, cfg.ports.health).await,
            _ => None,
        };
        reports.push(report);
    }
    let ready_n = ready.len() as i32;
    let warm = cache_warm(replicas, ready_n, &reports);
    let decided = [
        if ready_n >= replicas {
            Decided::new(
                cond::READY,
                true,
                "AllReplicasReady",
                format!("{ready_n}/{replicas} store replicas ready"),
            )
        } else {
            Decided::new(
                cond::READY,
                false,
                "ReplicasNotReady",
                format!("{ready_n}/{replicas} store replicas ready"),
            )
        },
        if ready_n < replicas || updated < replicas || live.len() as i32 != replicas {
            Decided::new(
                cond::PROGRESSING,
                true,
                "RollingOut",
                format!(
                    "{} replicas, {ready_n} ready, {updated} at revision {}",
                    live.len(),
                    cfg.revision
                ),
            )
        } else {
            Decided::new(
                cond::PROGRESSING,
                false,
                "Settled",
                "every replica is ready at the current revision",
            )
        },
        Decided::new(
            cond::DEGRADED,
            false,
            "AsExpected",
            "no degradation observed",
        ),
        warm.clone(),
    ];
    if warm.status
        && prev
            .and_then(|s| status::find(&s.conditions, cond::CACHE_WARM))
            .is_none_or(|c| c.status != "True")
    {
        ctx.event(
            &parent,
            normal(),
            "CacheWarm",
            "Loadback",
            warm.message.clone(),
        )
        .await;
    }
    let mut base = prev.cloned().unwrap_or_default();
    base.replicas = live.len() as i32;
    base.ready_replicas = ready_n;
    base.capacity_bytes = i64::try_from(
        cfg.memory_bytes
            .saturating_mul(u64::try_from(replicas).unwrap_or(0)),
    )
    .unwrap_or(i64::MAX);
    let known: Vec<probe::CacheReport> = reports.iter().flatten().copied().collect();
    if !known.is_empty() {
        base.objects =
            i64::try_from(known.iter().map(|r| r.objects).sum::<u64>()).unwrap_or(i64::MAX);
        base.used_bytes =
            i64::try_from(known.iter().map(|r| r.bytes).sum::<u64>()).unwrap_or(i64::MAX);
    }
    base.endpoints = ready
        .iter()
        .filter_map(|p| {
            p.status
                .as_ref()?
                .pod_ip
                .as_ref()
                .map(|ip| format!("{ip}:{L3_PORT}"))
        })
        .collect();
    let status = tier_status(prev, ct.metadata.generation, &decided, base);
    ctx.metrics.set_state(
        KIND,
        &key,
        Some(if status::is_true(&status.conditions, cond::READY) {
            "Ready"
        } else {
            "Progressing"
        }),
    );
    children::patch_status_if_changed(&ctx, KIND, &api, &name, prev, &status).await?;
    let busy = ready_n < replicas || !warm.status;
    Ok(Action::requeue(if busy { BUSY } else { RESYNC }))
}

/// `CacheWarm` from the replicas' reports (`None` = unreachable, judged by readiness).
pub fn cache_warm(replicas: i32, ready: i32, reports: &[Option<probe::CacheReport>]) -> Decided {
    if ready < replicas {
        return Decided::new(
            cond::CACHE_WARM,
            false,
            "ReplicasNotReady",
            format!("{ready}/{replicas} store replicas ready"),
        );
    }
    let cold = reports
        .iter()
        .filter(|r| r.is_some_and(|r| !r.warm))
        .count();
    if cold > 0 {
        return Decided::new(
            cond::CACHE_WARM,
            false,
            "LoadingBack",
            format!("{cold} replica(s) still loading objects back"),
        );
    }
    if reports.iter().any(Option::is_none) {
        Decided::new(
            cond::CACHE_WARM,
            true,
            "ReadyApproximation",
            "every replica is Ready; at least one /report was unreachable, so warmth is judged by readiness",
        )
    } else {
        Decided::new(
            cond::CACHE_WARM,
            true,
            "AllReplicasWarm",
            "every replica reports loadback finished",
        )
    }
}

fn cache_warm_of(prev: Option<&CacheTierStatus>) -> Decided {
    match prev.and_then(|s| status::find(&s.conditions, cond::CACHE_WARM)) {
        Some(c) => Decided::new(
            cond::CACHE_WARM,
            c.status == "True",
            c.reason.clone(),
            c.message.clone(),
        ),
        None => Decided::new(
            cond::CACHE_WARM,
            false,
            "NotStarted",
            "no replica reported yet",
        ),
    }
}

fn tier_status(
    prev: Option<&CacheTierStatus>,
    generation: Option<i64>,
    decided: &[Decided],
    mut base: CacheTierStatus,
) -> CacheTierStatus {
    let previous = prev.map(|p| p.conditions.as_slice()).unwrap_or_default();
    base.conditions = status::conditions(previous, decided, generation, jiff::Timestamp::now());
    base.observed_generation = generation;
    base
}
