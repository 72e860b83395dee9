//! PrefillPool controller: the prefill groups. When a DecodePool pairs with the pool, the group
//! count is that DecodePool's `status.scaling.applied.prefill` (the ratio transaction) and the
//! revision is the pair's; `spec.replicas` is then ignored and `status.replicasOwner` says so.

use std::sync::Arc;

use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use tandem_crds::conditions as cond;
use tandem_crds::{DecodePool, PrefillPool};

use super::children::{self, need};
use super::pool::{self, Block, PoolChildren, StatusFacts, policy_message, state_of};
use super::pool_teardown::{run_teardown_step, scaled_up, teardown_message};
use super::revision::{self, Blocked};
use super::{BUSY, Context, RESYNC, Result};
use crate::capacity;
use crate::labels::Role;
use crate::render::PoolView;
use crate::rollout::phase;
use crate::status::Decided;
use crate::teardown::{self, TeardownObservation, TeardownStep};

/// Kind name for metrics and logs.
pub const KIND: &str = "PrefillPool";

/// The DecodePools in `ns` that pair with PrefillPool `name`, by name.
pub async fn pairing_decode_pools(ctx: &Context, ns: &str, name: &str) -> Result<Vec<DecodePool>> {
    let api: Api<DecodePool> = Api::namespaced(ctx.client.clone(), ns);
    let mut v: Vec<DecodePool> = api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|d| d.spec.prefill.pool_ref.name == name)
        .collect();
    v.sort_by_key(|d| d.name_any());
    Ok(v)
}

/// Reconciles one PrefillPool.
///
/// # Errors
/// API failures; they are retried with backoff.
pub async fn reconcile(pp: Arc<PrefillPool>, ctx: Arc<Context>) -> Result<Action> {
    let ns = need(pp.namespace(), "metadata.namespace")?;
    let name = pp.name_any();
    let api: Api<PrefillPool> = Api::namespaced(ctx.client.clone(), &ns);
    let parent = pp.object_ref(&());
    let observed = pool::observe(&ctx, &ns, &name, Role::Prefill).await?;
    let pairs = pairing_decode_pools(&ctx, &ns, &name).await?;
    let key = format!("{ns}/{name}");

    if children::terminating(pp.as_ref()) && !ctx.unsafe_modes.reconcile_while_deleting {
        ctx.metrics.set_state(KIND, &key, Some("Terminating"));
        return teardown(&ctx, &api, &pp, &observed, &pairs).await;
    }
    children::ensure_finalizer(&ctx, KIND, &api, pp.as_ref()).await?;
    let prev = pp.status.as_ref();
    let owner = need(pp.controller_owner_ref(&()), "metadata.uid")?;
    let view = PoolView::prefill(&pp);
    // The pair's restart.id restarts prefill too: it is part of the pair revision below.
    let pair = pairs
        .iter()
        .find(|d| !children::terminating(*d))
        .or(pairs.first());
    let replicas_owner = match pair {
        Some(d) => format!("DecodePool/{} ratio {}", d.name_any(), d.spec.prefill.ratio),
        None => "spec.replicas".to_owned(),
    };
    // Two live DecodePools pairing with one PrefillPool would each run a ratio transaction on the
    // same prefill groups. Admission cannot see across objects, so refuse here: nothing of this
    // pool changes until one of them points elsewhere.
    let live: Vec<String> = pairs
        .iter()
        .filter(|d| !children::terminating(*d))
        .map(|d| d.name_any())
        .collect();
    if live.len() > 1 {
        let msg = format!(
            "DecodePools {} all pair with this PrefillPool; one prefill pool serves one DecodePool \
             (its group count follows that pool's ratio)",
            live.join(", ")
        );
        return blocked(
            &ctx,
            &api,
            &pp,
            &observed,
            Block::new(cond::POLICY_CONFLICT, "MultipleDecodePools", msg),
            replicas_owner,
        )
        .await;
    }
    let resolved = match revision::resolve(&ctx, &view).await? {
        Ok(r) => r,
        Err(Blocked::Conflict(c)) => {
            return blocked(
                &ctx,
                &api,
                &pp,
                &observed,
                Block::new(cond::POLICY_CONFLICT, c.reason(), c.to_string()),
                replicas_owner,
            )
            .await;
        }
        Err(Blocked::Render(e)) => {
            return blocked(
                &ctx,
                &api,
                &pp,
                &observed,
                Block::new(cond::DEGRADED, "RenderFailed", e.to_string()),
                replicas_owner,
            )
            .await;
        }
    };
    let (rev, groups, capacity_condition) = match pair {
        Some(d) => {
            let dview = PoolView::decode(d);
            let dresolved = match revision::resolve(&ctx, &dview).await? {
                Ok(r) => r,
                Err(b) => {
                    let msg = format!("paired DecodePool {:?} cannot roll out: {b}", d.name_any());
                    return blocked(
                        &ctx,
                        &api,
                        &pp,
                        &observed,
                        Block::new(cond::DEGRADED, "DecodePoolBlocked", msg),
                        replicas_owner,
                    )
                    .await;
                }
            };
            let rev = revision::pair_revision(&resolved.own_revision, &dresolved.own_revision);
            let dstatus = d.status.as_ref();
            // Until the DecodePool admitted a count, keep what exists.
            let groups = dstatus
                .and_then(|s| s.scaling.as_ref())
                .map_or(observed.groups_existing(), |s| {
                    capacity::counts(s.applied).prefill
                });
            let ic = dstatus
                .and_then(|s| crate::status::find(&s.conditions, cond::INSUFFICIENT_CAPACITY))
                .map_or_else(
                    || {
                        Decided::new(
                            cond::INSUFFICIENT_CAPACITY,
                            false,
                            "WithinCapacity",
                            "no scale-up pending",
                        )
                    },
                    |c| {
                        Decided::new(
                            cond::INSUFFICIENT_CAPACITY,
                            c.status == "True",
                            c.reason.clone(),
                            format!("from DecodePool {}: {}", d.name_any(), c.message),
                        )
                    },
                );
            (rev, groups, ic)
        }
        None => (
            resolved.own_revision.clone(),
            u32::try_from(pp.spec.replicas).unwrap_or(0),
            Decided::new(
                cond::INSUFFICIENT_CAPACITY,
                false,
                "WithinCapacity",
                "no budget applies to an unpaired pool",
            ),
        ),
    };
    let mut cfg = resolved.config.clone();
    cfg.revision = rev.clone();

    let plan = pool::converge(
        &ctx, KIND, &parent, &view, &cfg, groups, &owner, &observed, true,
    )
    .await?;
    let ready = observed
        .observations(groups, view.group_size())
        .iter()
        .filter(|g| g.ready())
        .count() as u32;
    let status = pool::pool_status(&StatusFacts {
        previous: prev,
        generation: pp.metadata.generation,
        role: Role::Prefill,
        name: &name,
        desired: groups,
        existing: observed.groups_in_range(groups),
        ready,
        rollout: Some(&plan),
        revision: Some(&rev),
        replicas_owner,
        scaling: None,
        extra: vec![
            Decided::new(
                cond::DEGRADED,
                false,
                "AsExpected",
                "no degradation observed",
            ),
            Decided::new(
                cond::POLICY_CONFLICT,
                false,
                "PolicyResolved",
                policy_message(&resolved.policy),
            ),
            capacity_condition,
        ],
        blocked: None,
    });
    if prev
        .and_then(|p| p.rollout.as_ref())
        .is_some_and(|r| r.phase != phase::IDLE)
        && plan.phase == phase::IDLE
    {
        ctx.event(
            &parent,
            children::normal(),
            "RolloutComplete",
            "Rollout",
            format!("every group runs revision {rev}"),
        )
        .await;
    }
    ctx.metrics.set_state(KIND, &key, Some(state_of(&status)));
    children::patch_status_if_changed(&ctx, KIND, &api, &name, prev, &status).await?;
    let busy = plan.phase != phase::IDLE || ready < groups;
    Ok(Action::requeue(if busy { BUSY } else { RESYNC }))
}

/// Reports `block` on this PrefillPool; `replicas_owner` as in its status.
async fn blocked(
    ctx: &Context,
    api: &Api<PrefillPool>,
    pp: &PrefillPool,
    observed: &PoolChildren,
    block: Block,
    replicas_owner: String,
) -> Result<Action> {
    let prev = pp.status.as_ref();
    pool::report_blocked(
        ctx,
        KIND,
        api,
        pp,
        prev,
        Role::Prefill,
        observed,
        block,
        replicas_owner,
    )
    .await
}

/// Teardown (DESIGN §5): wait while a pairing DecodePool still has pods → scale to 0 → wait for
/// pods → release.
async fn teardown(
    ctx: &Context,
    api: &Api<PrefillPool>,
    pp: &PrefillPool,
    observed: &PoolChildren,
    pairs: &[DecodePool],
) -> Result<Action> {
    if !pp.finalizers().iter().any(|f| f == super::FINALIZER) {
        return Ok(Action::await_change());
    }
    let name = pp.name_any();
    let ns = pp.namespace().unwrap_or_default();
    let mut blocking = Vec::new();
    for d in pairs {
        let dpods = pool::observe_pods(ctx, &ns, &d.name_any(), Role::Decode).await?;
        if dpods > 0 {
            blocking.push(format!("DecodePool/{} ({dpods} pods left)", d.name_any()));
        }
    }
    let obs = TeardownObservation {
        blocking,
        front_door_present: false,
        scaled_up: scaled_up(observed),
        pods_left: observed.pods.len() as u32,
    };
    let step = teardown::next_step(&obs);
    run_teardown_step(ctx, KIND, &pp.object_ref(&()), &ns, &name, &step).await?;
    if step == TeardownStep::RemoveFinalizer {
        children::remove_finalizer(ctx, KIND, api, pp).await?;
        return Ok(Action::await_change());
    }
    let prev = pp.status.as_ref();
    let owner = prev
        .and_then(|p| p.replicas_owner.clone())
        .unwrap_or_else(|| "spec.replicas".into());
    let status = pool::blocked_status(
        prev,
        pp.metadata.generation,
        &name,
        Role::Prefill,
        observed,
        &Block::new(cond::DEGRADED, "Terminating", teardown_message(&step)),
        owner,
    );
    children::patch_status_if_changed(ctx, KIND, api, &name, prev, &status).await?;
    Ok(Action::requeue(BUSY))
}
