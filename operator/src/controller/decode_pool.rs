//! DecodePool controller: the decode groups, the front door, and the owner of the P:D scaling
//! transaction (its `status.scaling.applied.prefill` is the PrefillPool's group count).

use std::sync::Arc;

use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use tandem_crds::conditions as cond;
use tandem_crds::{DecodePool, PoolStatus, PrefillPool};

use super::children::{self, need, normal, warning};
use super::pool::{self, Block, PoolChildren, StatusFacts, policy_message, state_of};
use super::pool_teardown::{run_teardown_step, scaled_up, teardown_message};
use super::revision::{self, Blocked};
use super::{BUSY, Context, RESYNC, Result};
use crate::capacity::{self, CapacityInput, CapacityObservation, CapacityOutcome};
use crate::labels::Role;
use crate::policy::model_difference;
use crate::render::PoolView;
use crate::rollout::{GroupState, phase};
use crate::scaling::{self, Counts, GroupSizes};
use crate::status::Decided;
use crate::teardown::{self, TeardownObservation, TeardownStep};

/// Kind name for metrics and logs.
pub const KIND: &str = "DecodePool";

/// Reconciles one DecodePool.
///
/// # Errors
/// API failures; they are retried with backoff.
pub async fn reconcile(dp: Arc<DecodePool>, ctx: Arc<Context>) -> Result<Action> {
    let ns = need(dp.namespace(), "metadata.namespace")?;
    let name = dp.name_any();
    let api: Api<DecodePool> = Api::namespaced(ctx.client.clone(), &ns);
    // The scaling transaction lives in this object's status. The copy a reconcile is handed comes
    // from the reflector and can predate our own last status write (a child's event triggers the
    // reconcile before the watch delivers that write); deciding from it replays a finished step,
    // deleting the new groups and re-creating them. So decide from a fresh (quorum) read.
    let dp = if ctx.unsafe_modes.trust_cached_status {
        dp
    } else {
        match api.get_opt(&name).await? {
            Some(fresh) => Arc::new(fresh),
            None => return Ok(Action::await_change()),
        }
    };
    let parent = dp.object_ref(&());
    let observed = pool::observe(&ctx, &ns, &name, Role::Decode).await?;
    let key = format!("{ns}/{name}");

    if children::terminating(dp.as_ref()) && !ctx.unsafe_modes.reconcile_while_deleting {
        ctx.metrics.set_state(KIND, &key, Some("Terminating"));
        return teardown(&ctx, &api, &dp, &observed).await;
    }
    children::ensure_finalizer(&ctx, KIND, &api, dp.as_ref()).await?;
    let prev = dp.status.as_ref();
    let owner = need(dp.controller_owner_ref(&()), "metadata.uid")?;
    let view = PoolView::decode(&dp);

    let prefill_name = &dp.spec.prefill.pool_ref.name;
    let prefill_api: Api<PrefillPool> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(prefill) = prefill_api.get_opt(prefill_name).await? else {
        let msg = format!(
            "PrefillPool {prefill_name:?} does not exist in {ns}; nothing rolls out until it does"
        );
        return blocked(
            &ctx,
            &api,
            &dp,
            &observed,
            Block::new(cond::DEGRADED, "PrefillPoolNotFound", msg),
        )
        .await;
    };
    // Another live DecodePool pairing with the same PrefillPool: the PrefillPool refuses both
    // (`MultipleDecodePools`), so a scale-up here would wait forever for prefill groups. Say so.
    let rivals: Vec<String> = super::prefill_pool::pairing_decode_pools(&ctx, &ns, prefill_name)
        .await?
        .iter()
        .filter(|d| !children::terminating(*d) && d.name_any() != name)
        .map(|d| d.name_any())
        .collect();
    if !rivals.is_empty() {
        let msg = format!(
            "PrefillPool {prefill_name:?} is also paired with DecodePool {}; one prefill pool \
             serves one DecodePool",
            rivals.join(", ")
        );
        return blocked(
            &ctx,
            &api,
            &dp,
            &observed,
            Block::new(cond::POLICY_CONFLICT, "MultipleDecodePools", msg),
        )
        .await;
    }
    let resolved = match revision::resolve(&ctx, &view).await? {
        Ok(r) => r,
        Err(Blocked::Conflict(c)) => {
            return blocked(
                &ctx,
                &api,
                &dp,
                &observed,
                Block::new(cond::POLICY_CONFLICT, c.reason(), c.to_string()),
            )
            .await;
        }
        Err(Blocked::Render(e)) => {
            return blocked(
                &ctx,
                &api,
                &dp,
                &observed,
                Block::new(cond::DEGRADED, "RenderFailed", e.to_string()),
            )
            .await;
        }
    };
    if let Some(detail) = model_difference(&dp.spec.model, &prefill.spec.model) {
        let msg = format!(
            "model differs from PrefillPool {prefill_name:?} ({detail}); KV pages cannot move between different geometries"
        );
        return blocked(
            &ctx,
            &api,
            &dp,
            &observed,
            Block::new(cond::POLICY_CONFLICT, "PrefillModelMismatch", msg),
        )
        .await;
    }
    let pview = PoolView::prefill(&prefill);
    let presolved = match revision::resolve(&ctx, &pview).await? {
        Ok(r) => r,
        Err(b) => {
            let msg = format!("PrefillPool {prefill_name:?} cannot roll out: {b}");
            return blocked(
                &ctx,
                &api,
                &dp,
                &observed,
                Block::new(cond::DEGRADED, "PrefillPoolBlocked", msg),
            )
            .await;
        }
    };
    let rev = revision::pair_revision(&presolved.own_revision, &resolved.own_revision);
    let mut cfg = resolved.config;
    cfg.revision = rev.clone();

    // The scaling transaction.
    let pchildren = pool::observe(&ctx, &ns, prefill_name, Role::Prefill).await?;
    let sizes = GroupSizes {
        decode: view.group_size(),
        prefill: pview.group_size(),
    };
    let prev_applied = prev
        .and_then(|s| s.scaling.as_ref())
        .map(|s| capacity::counts(s.applied));
    let observation = capacity_observation(&observed, &pchildren, prev_applied, sizes);
    let budget = dp
        .spec
        .budget
        .as_ref()
        .map(|b| u64::try_from(b.gpus).unwrap_or(0));
    let (scaling, outcome) = capacity::decide(&CapacityInput {
        decode_replicas: u32::try_from(dp.spec.replicas).unwrap_or(0),
        ratio: dp.spec.prefill.ratio,
        sizes,
        budget,
        deadline_seconds: i64::from(dp.spec.unschedulable_deadline_seconds),
        status: prev.and_then(|s| s.scaling.as_ref()),
        observed: observation,
        now: jiff::Timestamp::now(),
    });
    let capacity_condition = capacity_condition(prev, &outcome, sizes, budget);
    capacity_events(&ctx, &parent, prev, &outcome, &capacity_condition).await;
    let applied = capacity::counts(scaling.applied);

    // Gate: a decode group restarts only once a prefill group of the same revision is Ready.
    let gate_open = pchildren
        .observations(applied.prefill, pview.group_size())
        .iter()
        .any(|g| g.state(&rev) == GroupState::Updated);
    let plan = pool::converge(
        &ctx,
        KIND,
        &parent,
        &view,
        &cfg,
        applied.decode,
        &owner,
        &observed,
        gate_open,
    )
    .await?;

    let ready = observed
        .observations(applied.decode, view.group_size())
        .iter()
        .filter(|g| g.ready())
        .count() as u32;
    let facts = StatusFacts {
        previous: prev,
        generation: dp.metadata.generation,
        role: Role::Decode,
        name: &name,
        desired: applied.decode,
        existing: observed.groups_in_range(applied.decode),
        ready,
        rollout: Some(&plan),
        revision: Some(&rev),
        replicas_owner: "spec.replicas".into(),
        scaling: Some(scaling),
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
    };
    let status = pool::pool_status(&facts);
    if prev
        .and_then(|p| p.rollout.as_ref())
        .is_some_and(|r| r.phase != phase::IDLE)
        && plan.phase == phase::IDLE
    {
        ctx.event(
            &parent,
            normal(),
            "RolloutComplete",
            "Rollout",
            format!("every group runs revision {rev}"),
        )
        .await;
    }
    ctx.metrics.set_state(KIND, &key, Some(state_of(&status)));
    children::patch_status_if_changed(&ctx, KIND, &api, &name, prev, &status).await?;
    let busy = plan.phase != phase::IDLE
        || ready < applied.decode
        || matches!(
            outcome,
            CapacityOutcome::Step { .. }
                | CapacityOutcome::Pending
                | CapacityOutcome::WaitingForShrink
        );
    Ok(Action::requeue(if busy { BUSY } else { RESYNC }))
}

fn capacity_observation(
    decode: &PoolChildren,
    prefill: &PoolChildren,
    applied: Option<Counts>,
    sizes: GroupSizes,
) -> CapacityObservation {
    let pods = decode.pods.iter().chain(prefill.pods.iter());
    let live: Vec<_> = pods.filter(|p| !children::terminating(*p)).collect();
    let expected = applied.map_or(0, |a| {
        u64::from(a.decode) * u64::from(sizes.decode)
            + u64::from(a.prefill) * u64::from(sizes.prefill)
    });
    CapacityObservation {
        existing: Counts {
            decode: decode.groups_existing(),
            prefill: prefill.groups_existing(),
        },
        unschedulable: live.iter().any(|p| children::pod_unschedulable(p)),
        all_scheduled: live.len() as u64 >= expected
            && live.iter().all(|p| children::pod_scheduled(p)),
    }
}

fn capacity_condition(
    prev: Option<&PoolStatus>,
    outcome: &CapacityOutcome,
    sizes: GroupSizes,
    budget: Option<u64>,
) -> Decided {
    let ic = cond::INSUFFICIENT_CAPACITY;
    if let Some(b) = budget
        && b < scaling::minimum_budget(sizes)
    {
        return Decided::new(
            ic,
            true,
            "BudgetTooSmall",
            format!(
                "budget.gpus {b} cannot hold one decode group ({} GPUs) and one prefill group ({} GPUs)",
                sizes.decode, sizes.prefill
            ),
        );
    }
    match outcome {
        CapacityOutcome::OverBudget { needed, budget } => Decided::new(
            ic,
            true,
            "OverBudget",
            format!(
                "the target needs {needed} GPUs but budget.gpus is {budget}; the current counts are kept"
            ),
        ),
        CapacityOutcome::RolledBack { from, to } => Decided::new(
            ic,
            true,
            "Unschedulable",
            format!(
                "pods of the scale-up to decode {} / prefill {} stayed unschedulable past unschedulableDeadlineSeconds; rolled back to decode {} / prefill {}",
                from.decode, from.prefill, to.decode, to.prefill
            ),
        ),
        CapacityOutcome::Unschedulable { counts } => Decided::new(
            ic,
            true,
            "Unschedulable",
            format!(
                "pods of decode {} / prefill {} groups stayed unschedulable past unschedulableDeadlineSeconds; nothing was fully scheduled before, so the counts are kept",
                counts.decode, counts.prefill
            ),
        ),
        CapacityOutcome::Refused => match pool::previous_condition(prev, ic) {
            Some(c) if c.status == "True" => {
                Decided::new(ic, true, c.reason.clone(), c.message.clone())
            }
            _ => Decided::new(
                ic,
                true,
                "Refused",
                "the target was refused for capacity; change spec.replicas or the ratio to retry",
            ),
        },
        CapacityOutcome::Pending => Decided::new(
            ic,
            false,
            "ScaleUpPending",
            "scale-up applied; waiting for its pods to be scheduled",
        ),
        _ => Decided::new(
            ic,
            false,
            "WithinCapacity",
            "the applied counts fit the budget",
        ),
    }
}

async fn capacity_events(
    ctx: &Context,
    parent: &k8s_openapi::api::core::v1::ObjectReference,
    prev: Option<&PoolStatus>,
    outcome: &CapacityOutcome,
    condition: &Decided,
) {
    match outcome {
        CapacityOutcome::Step { from, to } => {
            ctx.event(
                parent,
                normal(),
                "Scaled",
                "Scale",
                format!(
                    "decode {} → {}, prefill {} → {} (one budget-safe step, shrink before grow)",
                    from.decode, to.decode, from.prefill, to.prefill
                ),
            )
            .await;
        }
        CapacityOutcome::RolledBack { .. }
        | CapacityOutcome::OverBudget { .. }
        | CapacityOutcome::Unschedulable { .. }
            if pool::newly_true(prev, cond::INSUFFICIENT_CAPACITY, &condition.reason) =>
        {
            ctx.event(
                parent,
                warning(),
                "InsufficientCapacity",
                "Scale",
                condition.message.clone(),
            )
            .await;
        }
        _ => {}
    }
}

/// Reports `block` on this DecodePool (it owns its `spec.replicas`).
async fn blocked(
    ctx: &Context,
    api: &Api<DecodePool>,
    dp: &DecodePool,
    observed: &PoolChildren,
    block: Block,
) -> Result<Action> {
    let prev = dp.status.as_ref();
    let owner = "spec.replicas".to_owned();
    pool::report_blocked(
        ctx,
        KIND,
        api,
        dp,
        prev,
        Role::Decode,
        observed,
        block,
        owner,
    )
    .await
}

/// Teardown (DESIGN §5): stop routing → scale groups to 0 → wait for pods → release.
async fn teardown(
    ctx: &Context,
    api: &Api<DecodePool>,
    dp: &DecodePool,
    observed: &PoolChildren,
) -> Result<Action> {
    if !dp.finalizers().iter().any(|f| f == super::FINALIZER) {
        return Ok(Action::await_change());
    }
    let name = dp.name_any();
    let ns = dp.namespace().unwrap_or_default();
    let parent = dp.object_ref(&());
    let obs = TeardownObservation {
        blocking: vec![],
        front_door_present: observed
            .services
            .get(&name)
            .is_some_and(|s| !children::terminating(s)),
        scaled_up: scaled_up(observed),
        pods_left: observed.pods.len() as u32,
    };
    let step = teardown::next_step(&obs);
    run_teardown_step(ctx, KIND, &parent, &ns, &name, &step).await?;
    if step == TeardownStep::RemoveFinalizer {
        children::remove_finalizer(ctx, KIND, api, dp).await?;
        return Ok(Action::await_change());
    }
    let prev = dp.status.as_ref();
    let status = pool::blocked_status(
        prev,
        dp.metadata.generation,
        &name,
        Role::Decode,
        observed,
        &Block::new(cond::DEGRADED, "Terminating", teardown_message(&step)),
        "spec.replicas".into(),
    );
    children::patch_status_if_changed(ctx, KIND, api, &name, prev, &status).await?;
    Ok(Action::requeue(BUSY))
}
