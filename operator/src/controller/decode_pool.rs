//! DecodePool: the decode groups and the front door, through the pool stages of
//! [`super::pool`]; and the owner of the P:D scaling transaction (its
//! `status.scaling.applied.prefill` is the PrefillPool's group count), decided in the pure
//! desired stage by [`crate::capacity::decide`].

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use tandem_crds::{DecodePool, PrefillPool};

use super::cache::{Caches, FIRST_LIST_WAIT};
use super::children::{self, normal, warning};
use super::pool::observe::{self, PoolChildren, Read};
use super::pool::status::{CapacityState, PairProgress, resolved_conditions};
use super::pool::{self, Desired, Note, PoolKind, SPEC_REPLICAS};
use super::prefill_pool::pairing_decode_pools;
use super::refusal::Refusal;
use super::revision::{self, Resolved, TierRead};
use super::{Context, Result};
use crate::capacity::{self, CapacityInput, CapacityObservation, CapacityOutcome};
use crate::labels::Role;
use crate::policy::model_difference;
use crate::render::PoolView;
use crate::rollout::{GroupState, PrefillGate};
use crate::scaling::{self, Counts, GroupSizes};
use crate::status::{self, ConditionType, Decided, Reason};

/// Kind name for metrics and logs.
pub const KIND: &str = "DecodePool";

/// Reconciles one DecodePool.
///
/// # Errors
/// API failures; they are retried with backoff.
pub async fn reconcile(dp: Arc<DecodePool>, ctx: Arc<Context>) -> Result<Action> {
    pool::reconcile(dp, ctx).await
}

/// What a DecodePool's reconcile reads besides the pool.
#[derive(Debug, Clone, Default)]
pub struct DecodeWorld {
    /// The PrefillPool named by `spec.prefill.poolRef`, if it exists.
    pub prefill: Option<PrefillPool>,
    /// Other live DecodePools pairing with that PrefillPool.
    pub rivals: Vec<String>,
    /// The pool's tier.
    pub tier: TierRead,
    /// The PrefillPool's tier.
    pub prefill_tier: TierRead,
    /// The PrefillPool's children.
    pub prefill_children: PoolChildren,
}

/// A DecodePool that may roll out.
#[derive(Debug, Clone)]
pub struct DecodeValidated {
    /// The pool resolved against its tier.
    pub own: Resolved,
    /// The PrefillPool's own revision.
    pub prefill_revision: String,
    /// Pods per prefill group.
    pub prefill_group_size: u32,
}

impl PoolKind for DecodePool {
    const ROLE: Role = Role::Decode;
    type World = DecodeWorld;
    type Validated = DecodeValidated;

    fn view(&self) -> PoolView<'_> {
        PoolView::decode(self)
    }

    async fn read(ctx: &Context, ns: &str, dp: &Self, read: Read) -> Result<DecodeWorld> {
        let name = dp.name_any();
        let prefill_name = &dp.spec.prefill.pool_ref.name;
        let prefill = match ctx.caches().filter(|_| read == Read::Cached) {
            Some(c) => {
                c.ready(FIRST_LIST_WAIT).await?;
                Caches::get(&c.prefills, ns, prefill_name)
            }
            None => {
                let api: Api<PrefillPool> = Api::namespaced(ctx.client.clone(), ns);
                api.get_opt(prefill_name).await?
            }
        };
        let mut world = DecodeWorld {
            prefill,
            tier: revision::read_tier(ctx, &dp.view(), read).await?,
            ..DecodeWorld::default()
        };
        if let Some(p) = &world.prefill {
            world.rivals = pairing_decode_pools(ctx, ns, prefill_name, read)
                .await?
                .iter()
                .filter(|d| !children::terminating(*d) && d.name_any() != name)
                .map(|d| d.name_any())
                .collect();
            world.prefill_tier = revision::read_tier(ctx, &PoolView::prefill(p), read).await?;
            world.prefill_children =
                observe::observe(ctx, ns, prefill_name, Role::Prefill, read).await?;
        }
        Ok(world)
    }

    fn validate(dp: &Self, world: &DecodeWorld) -> Result<DecodeValidated, Refusal> {
        let prefill_name = &dp.spec.prefill.pool_ref.name;
        let Some(prefill) = &world.prefill else {
            return Err(Refusal::PrefillPoolNotFound {
                name: prefill_name.clone(),
                namespace: dp.namespace().unwrap_or_default(),
            });
        };
        // Another live DecodePool pairing with the same PrefillPool: the PrefillPool refuses
        // both, so a scale-up here would wait forever for prefill groups. Say so.
        if !world.rivals.is_empty() {
            return Err(Refusal::SharedPrefillPool {
                prefill: prefill_name.clone(),
                others: world.rivals.clone(),
            });
        }
        let own = revision::resolve(&dp.view(), &world.tier)?;
        if let Some(detail) = model_difference(&dp.spec.model, &prefill.spec.model) {
            return Err(Refusal::PrefillModelMismatch {
                prefill: prefill_name.clone(),
                detail,
            });
        }
        let pview = PoolView::prefill(prefill);
        let (ours, theirs) = (
            crate::render::engine::kv_path(&dp.view()),
            crate::render::engine::kv_path(&pview),
        );
        if ours != theirs {
            return Err(Refusal::PrefillEngineMismatch {
                prefill: prefill_name.clone(),
                ours,
                theirs,
            });
        }
        let theirs = revision::resolve(&pview, &world.prefill_tier).map_err(|cause| {
            Refusal::PrefillPoolBlocked {
                name: prefill_name.clone(),
                cause,
            }
        })?;
        Ok(DecodeValidated {
            own,
            prefill_revision: theirs.own_revision,
            prefill_group_size: pview.group_size(),
        })
    }

    fn desire(
        dp: &Self,
        world: &DecodeWorld,
        v: DecodeValidated,
        observed: &PoolChildren,
        now: jiff::Timestamp,
    ) -> Desired {
        let prev = dp.status.as_ref();
        let previous = prev.map(|s| s.conditions.as_slice()).unwrap_or_default();
        let pchildren = &world.prefill_children;
        let sizes = GroupSizes {
            decode: dp.view().group_size(),
            prefill: v.prefill_group_size,
        };
        let prev_applied = prev
            .and_then(|s| s.scaling.as_ref())
            .map(|s| capacity::counts(s.applied));
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
            observed: capacity_observation(observed, pchildren, prev_applied, sizes),
            now,
        });
        let ic = capacity_condition(previous, &outcome, sizes, budget);
        let notes = capacity_notes(previous, &outcome, &ic);
        let applied = capacity::counts(scaling.applied);
        let rev = revision::pair_revision(&v.prefill_revision, &v.own.own_revision);

        // Gate: a decode group restarts only once enough prefill groups of the same revision are
        // Updated (the P:D share of the new revision, see `PrefillGate`).
        let prefill_groups = pchildren.observations(applied.prefill, sizes.prefill);
        let gate = PrefillGate {
            updated_prefill: prefill_groups
                .iter()
                .filter(|g| g.state(&rev) == GroupState::Updated)
                .count() as u32,
            prefill_groups: applied.prefill,
            decode_groups: applied.decode,
        };
        let pair = PairProgress {
            name: dp.spec.prefill.pool_ref.name.clone(),
            desired: applied.prefill,
            existing: pchildren.groups_in_range(applied.prefill),
            ready: prefill_groups.iter().filter(|g| g.ready()).count() as u32,
        };
        let capacity = match scaling.refused.map(capacity::counts) {
            Some(target) if target != applied => CapacityState::Limited {
                admitted: applied,
                target,
            },
            _ if outcome == CapacityOutcome::Pending => CapacityState::Pending { applied },
            _ => CapacityState::Steady,
        };
        let busy = matches!(
            outcome,
            CapacityOutcome::Step { .. }
                | CapacityOutcome::Pending
                | CapacityOutcome::WaitingForShrink
        ) || pair.ready < pair.desired
            || pair.existing != pair.desired;
        let [degraded, policy] = resolved_conditions(&v.own.policy);
        Desired {
            groups: applied.decode,
            resolved: v.own.with_revision(rev),
            gate: Some(gate),
            replicas_owner: SPEC_REPLICAS.into(),
            scaling: Some(scaling),
            admitted: Some(applied.decode),
            pair: Some(pair),
            capacity,
            conditions: vec![degraded, policy, ic],
            notes,
            busy,
            rolling: pool::rolling(dp.status.as_ref()),
        }
    }

    fn replicas_owner(_dp: &Self, _world: &DecodeWorld) -> String {
        SPEC_REPLICAS.into()
    }

    async fn teardown_blockers(_ctx: &Context, _dp: &Self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
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

/// `InsufficientCapacity` for what the transaction did.
pub fn capacity_condition(
    previous: &[Condition],
    outcome: &CapacityOutcome,
    sizes: GroupSizes,
    budget: Option<u64>,
) -> Decided {
    let ic = ConditionType::InsufficientCapacity;
    if let Some(b) = budget
        && b < scaling::minimum_budget(sizes)
    {
        return Decided::yes(
            ic,
            Reason::BudgetTooSmall,
            format!(
                "budget.gpus {b} cannot hold one decode group ({} GPUs) and one prefill group ({} GPUs)",
                sizes.decode, sizes.prefill
            ),
        );
    }
    match outcome {
        CapacityOutcome::OverBudget { needed, budget } => Decided::yes(
            ic,
            Reason::OverBudget,
            format!(
                "the target needs {needed} GPUs but budget.gpus is {budget}; the current counts are kept"
            ),
        ),
        CapacityOutcome::RolledBack { from, to } => Decided::yes(
            ic,
            Reason::Unschedulable,
            format!(
                "pods of the scale-up to decode {} / prefill {} stayed unschedulable past unschedulableDeadlineSeconds; rolled back to decode {} / prefill {}",
                from.decode, from.prefill, to.decode, to.prefill
            ),
        ),
        CapacityOutcome::Unschedulable { counts } => Decided::yes(
            ic,
            Reason::Unschedulable,
            format!(
                "pods of decode {} / prefill {} groups stayed unschedulable past unschedulableDeadlineSeconds; nothing was fully scheduled before, so the counts are kept",
                counts.decode, counts.prefill
            ),
        ),
        CapacityOutcome::Refused => status::read(previous, ic)
            .filter(Decided::is_true)
            .unwrap_or_else(|| {
                Decided::yes(
                    ic,
                    Reason::Refused,
                    "the target was refused for capacity; change spec.replicas or the ratio to retry",
                )
            }),
        CapacityOutcome::Pending => Decided::no(
            ic,
            Reason::ScaleUpPending,
            "scale-up applied; waiting for its pods to be scheduled",
        ),
        _ => Decided::no(
            ic,
            Reason::WithinCapacity,
            "the applied counts fit the budget",
        ),
    }
}

/// The events of a transaction step: `Scaled` for each step, `InsufficientCapacity` (Warning)
/// once per refusal.
fn capacity_notes(previous: &[Condition], outcome: &CapacityOutcome, ic: &Decided) -> Vec<Note> {
    match outcome {
        CapacityOutcome::Step { from, to } => vec![Note {
            type_: normal(),
            reason: "Scaled",
            action: "Scale",
            message: format!(
                "decode {} → {}, prefill {} → {} (one budget-safe step, shrink before grow)",
                from.decode, to.decode, from.prefill, to.prefill
            ),
        }],
        CapacityOutcome::RolledBack { .. }
        | CapacityOutcome::OverBudget { .. }
        | CapacityOutcome::Unschedulable { .. }
            if status::newly_true(previous, ic) =>
        {
            vec![Note {
                type_: warning(),
                reason: "InsufficientCapacity",
                action: "Scale",
                message: ic.message.clone(),
            }]
        }
        _ => Vec::new(),
    }
}
