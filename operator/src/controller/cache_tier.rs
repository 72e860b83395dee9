//! CacheTier controller: the store StatefulSet, its headless Service and the `tier.json`
//! ConfigMap; status `Ready`, `Progressing`, `Degraded`, `CacheWarm`.
//!
//! `CacheWarm` is True when every replica's `GET /report` says `warm` (loadback finished). A
//! replica whose report cannot be fetched (no pod IP, not reachable from the operator) counts as
//! warm when it is Ready, and the condition's reason is then `ReadyApproximation` instead of
//! `AllReplicasWarm`, so the source of the claim is visible.
//!
//! `Degraded` is True with `StoreVolumeFull` while some replica's report says its volume is full
//! (issue 18 item 5: puts refused and counted, reads still served); the message names the replicas
//! and what they report. While reports are probed, a settled tier is re-read every
//! [`REPORT_POLL`] (a volume fills without any API event).

use std::sync::Arc;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use tandem_crds::conditions::TIER_CONDITIONS;
use tandem_crds::{CacheTier, CacheTierStatus, DecodePool, PrefillPool};

use super::blocked::{self, Block, Reported, blocked_conditions, previous_conditions};
use super::children::{self, need, normal, warning};
use super::pool::apply::apply_child;
use super::pool::observe::{Read, observe};
use super::probe;
use super::refusal::Refusal;
use super::{BUSY, Context, Result, teardown};
use crate::labels::{self, Role};
use crate::render::tier::{self, L3_PORT};
use crate::status::{self, ConditionType, Decided, Reason};
use crate::teardown::TeardownObservation;

/// Kind name for metrics and logs.
pub const KIND: &str = "CacheTier";

/// Requeue interval of a settled tier while replicas' reports are probed: how late a full volume
/// (or its recovery) may show in `Degraded`. A re-read that changes nothing writes nothing.
pub const REPORT_POLL: std::time::Duration = std::time::Duration::from_secs(10);

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
    let parent = ct.object_ref(&());
    let store = labels::store_name(&name);
    let deleting = children::terminating(ct.as_ref()) && !ctx.reconcile_while_deleting();
    // Teardown decides on children listed now; otherwise the caches serve.
    let read = if deleting { Read::Listed } else { Read::Cached };
    let mut observed = observe(&ctx, &ns, &name, Role::Cache, read).await?;
    let sts = observed.statefulsets.remove(&store);
    let pods = std::mem::take(&mut observed.pods);
    let prev = ct.status.as_ref();

    if deleting {
        ctx.metrics.set_state(KIND, &key, Some("Terminating"));
        if !teardown::holds_finalizer(ct.as_ref()) {
            return Ok(Action::await_change());
        }
        let obs = TeardownObservation {
            blocking: referencing_pools(&ctx, &ns, &name).await?,
            front_door_present: false,
            scaled_up: sts
                .iter()
                .filter(|s| teardown::still_scaled(s))
                .map(|_| store.clone())
                .collect(),
            pods_left: pods.len() as u32,
        };
        return teardown::advance(&ctx, &api, ct.as_ref(), &obs, |b| blocked_status(&ct, b)).await;
    }
    children::ensure_finalizer(&ctx, KIND, &api, ct.as_ref()).await?;
    let owner = need(ct.controller_owner_ref(&()), "metadata.uid")?;

    let cfg = match tier::tier_config(&ct) {
        Ok(c) => c,
        Err(e) => {
            let block = Block::from(&Refusal::Render(e));
            let status = blocked_status(&ct, &block);
            return blocked::report(&ctx, &api, ct.as_ref(), &block, status).await;
        }
    };
    let replicas = ct.spec.replicas.max(0);
    let cm = tier::tier_config_map(&ct, &cfg, &owner)?;
    let cm_existing = observed.config_maps.remove(&labels::config_map(&name));
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
    let svc_existing = observed.services.remove(&store);
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
    let mut names = Vec::new();
    for p in &ready {
        names.push(p.name_any());
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
            Decided::yes(
                ConditionType::Ready,
                Reason::AllReplicasReady,
                format!("{ready_n}/{replicas} store replicas ready"),
            )
        } else {
            Decided::no(
                ConditionType::Ready,
                Reason::ReplicasNotReady,
                format!("{ready_n}/{replicas} store replicas ready"),
            )
        },
        if ready_n < replicas || updated < replicas || live.len() as i32 != replicas {
            Decided::yes(
                ConditionType::Progressing,
                Reason::RollingOut,
                format!(
                    "{} replicas, {ready_n} ready, {updated} at revision {}",
                    live.len(),
                    cfg.revision
                ),
            )
        } else {
            Decided::no(
                ConditionType::Progressing,
                Reason::Settled,
                "every replica is ready at the current revision",
            )
        },
        store_degraded(&names, &reports),
        warm.clone(),
    ];
    if warm.is_true()
        && !status::is_true(previous_conditions(ct.as_ref()), ConditionType::CacheWarm)
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
    if decided[2].is_true()
        && !status::is_true(previous_conditions(ct.as_ref()), ConditionType::Degraded)
    {
        ctx.event(
            &parent,
            warning(),
            Reason::StoreVolumeFull.as_str(),
            "StoreWrite",
            decided[2].message.clone(),
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
    let known: Vec<probe::CacheReport> = reports.iter().flatten().cloned().collect();
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
    ctx.metrics
        .set_state(KIND, &key, Some(CacheTier::state(&status)));
    children::patch_status_if_changed(&ctx, KIND, &api, &name, prev, &status).await?;
    let busy = ready_n < replicas || !warm.is_true();
    Ok(Action::requeue(if busy {
        BUSY
    } else if ctx.probe_reports {
        ctx.resync.min(REPORT_POLL)
    } else {
        ctx.resync
    }))
}

/// `Degraded` from the replicas' reports (`names[i]` is the pod of `reports[i]`; `None` =
/// unreachable, which says nothing about its volume): True, `StoreVolumeFull`, when some replica
/// reports a full volume (issue 18 item 5); False, `AsExpected`, otherwise.
pub fn store_degraded(names: &[String], reports: &[Option<probe::CacheReport>]) -> Decided {
    let full: Vec<String> = names
        .iter()
        .zip(reports)
        .filter_map(|(n, r)| Some(format!("{n}: {}", r.as_ref()?.volume_full.as_ref()?)))
        .collect();
    if full.is_empty() {
        Decided::no(
            ConditionType::Degraded,
            Reason::AsExpected,
            "no degradation observed",
        )
    } else {
        Decided::yes(
            ConditionType::Degraded,
            Reason::StoreVolumeFull,
            format!(
                "store volume full on {} replica(s), writes refused: {}",
                full.len(),
                full.join("; ")
            ),
        )
    }
}

/// `CacheWarm` from the replicas' reports (`None` = unreachable, judged by readiness).
pub fn cache_warm(replicas: i32, ready: i32, reports: &[Option<probe::CacheReport>]) -> Decided {
    let cw = ConditionType::CacheWarm;
    if ready < replicas {
        return Decided::no(
            cw,
            Reason::ReplicasNotReady,
            format!("{ready}/{replicas} store replicas ready"),
        );
    }
    let cold = reports
        .iter()
        .filter(|r| r.as_ref().is_some_and(|r| !r.warm))
        .count();
    if cold > 0 {
        return Decided::no(
            cw,
            Reason::LoadingBack,
            format!("{cold} replica(s) still loading objects back"),
        );
    }
    if reports.iter().any(Option::is_none) {
        Decided::yes(
            cw,
            Reason::ReadyApproximation,
            "every replica is Ready; at least one /report was unreachable, so warmth is judged by readiness",
        )
    } else {
        Decided::yes(
            cw,
            Reason::AllReplicasWarm,
            "every replica reports loadback finished",
        )
    }
}

/// The status of a tier that does not roll out now (render failure, teardown).
fn blocked_status(ct: &CacheTier, block: &Block) -> CacheTierStatus {
    let prev = ct.status.as_ref();
    let decided = blocked_conditions(block, previous_conditions(ct), &TIER_CONDITIONS);
    tier_status(
        prev,
        ct.metadata.generation,
        &decided,
        prev.cloned().unwrap_or_default(),
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report(volume_full: Option<&str>) -> Option<probe::CacheReport> {
        Some(probe::CacheReport {
            warm: true,
            volume_full: volume_full.map(str::to_owned),
            ..Default::default()
        })
    }

    #[test]
    fn a_full_volume_on_any_replica_degrades_the_tier_and_names_it() {
        let names = ["t-store-0".to_owned(), "t-store-1".to_owned()];
        let ok = store_degraded(&names, &[report(None), None]);
        assert!(!ok.is_true());
        assert_eq!(ok.reason, Reason::AsExpected);
        let full = store_degraded(&names, &[None, report(Some("2 put(s) refused"))]);
        assert!(full.is_true());
        assert_eq!(full.reason, Reason::StoreVolumeFull);
        assert!(
            full.message.contains("t-store-1: 2 put(s) refused")
                && !full.message.contains("t-store-0"),
            "{}",
            full.message
        );
    }
}
