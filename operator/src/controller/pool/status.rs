//! The status stage of a pool, pure: from what was desired, applied and observed to the new
//! `PoolStatus` — and the status of a blocked or terminating pool.
//!
//! `Ready` and `Progressing` look at the pair, not only at the pool's own groups: a DecodePool is
//! Ready only when its decode groups *and* the prefill groups its scaling transaction applied are
//! Ready, and it is Progressing (`ScaleUpPending`, `Scaling`) until both pools converge. Once a
//! target is refused for capacity, the pool settles on the admitted counts with
//! `Progressing=False, CapacityLimited` saying what was admitted and why, and
//! `status.admittedReplicas` (the `Admitted` column) says how many decode groups.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use tandem_crds::{GroupRestartStatus, PoolStatus, RolloutStatus, ScalingStatus};

use super::super::blocked::{Block, blocked_conditions};
use super::PoolKind;
use super::observe::PoolChildren;
use crate::labels::{self, Role};
use crate::rollout::{self, RolloutPlan};
use crate::scaling::Counts;
use crate::status::{self, ConditionType, Decided, Reason};

/// The other pool of a pair as a DecodePool sees it: the PrefillPool's groups against the count
/// the scaling transaction applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairProgress {
    /// The PrefillPool.
    pub name: String,
    /// Groups applied (`status.scaling.applied.prefill`).
    pub desired: u32,
    /// Groups that exist (in range, not terminating).
    pub existing: u32,
    /// Groups all of whose pods are Ready.
    pub ready: u32,
}

impl PairProgress {
    fn converged(&self) -> bool {
        self.existing == self.desired && self.ready >= self.desired
    }
}

/// Where a DecodePool's scaling transaction stands, for `Progressing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CapacityState {
    /// Nothing pending or refused (or the pool has no transaction: a PrefillPool).
    #[default]
    Steady,
    /// A scale-up to `applied` is applied and its pods are not all scheduled yet.
    Pending {
        /// The applied counts.
        applied: Counts,
    },
    /// The pools hold `admitted`; `target` was refused for capacity.
    Limited {
        /// The counts the transaction admitted.
        admitted: Counts,
        /// The refused target.
        target: Counts,
    },
}

/// Facts the status of a pool that rolled out is built from.
#[derive(Debug, Clone)]
pub struct StatusFacts<'a> {
    /// Previous status.
    pub previous: Option<&'a PoolStatus>,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// Role (for the selector).
    pub role: Role,
    /// Pool name.
    pub name: &'a str,
    /// Groups converged to.
    pub desired: u32,
    /// Existing groups (StatefulSets in range).
    pub existing: u32,
    /// Groups all of whose pods are Ready.
    pub ready: u32,
    /// The rollout plan acted on.
    pub rollout: &'a RolloutPlan,
    /// The target revision.
    pub revision: &'a str,
    /// Who owns the count.
    pub replicas_owner: String,
    /// Scaling transaction (DecodePool).
    pub scaling: Option<ScalingStatus>,
    /// Decode groups admitted (DecodePool).
    pub admitted: Option<u32>,
    /// The PrefillPool's progress (DecodePool).
    pub pair: Option<&'a PairProgress>,
    /// The scaling transaction's state (DecodePool).
    pub capacity: CapacityState,
    /// The kind's other conditions (`Degraded`, `PolicyConflict`, `InsufficientCapacity`,
    /// `ReplicasIgnored`), as decided by the desired stage.
    pub extra: &'a [Decided],
    /// `status.groupRestarts` ([`crate::recovery`]).
    pub group_restarts: &'a [GroupRestartStatus],
}

/// `Ready` and `Progressing` from the facts (see the module docs).
pub fn readiness(f: &StatusFacts<'_>) -> [Decided; 2] {
    let mut counts = format!("{}/{} groups ready", f.ready, f.desired);
    if let Some(p) = f.pair {
        counts.push_str(&format!(
            "; PrefillPool {}: {}/{} groups ready",
            p.name, p.ready, p.desired
        ));
    }
    if let CapacityState::Limited { admitted, target } = f.capacity {
        counts.push_str(&format!(
            "; {} of {} decode groups admitted (see InsufficientCapacity)",
            admitted.decode, target.decode
        ));
    }
    let all_ready = f.ready >= f.desired && f.pair.is_none_or(|p| p.ready >= p.desired);
    let ready = if all_ready {
        Decided::yes(ConditionType::Ready, Reason::AllGroupsReady, counts)
    } else {
        Decided::no(ConditionType::Ready, Reason::GroupsNotReady, counts)
    };
    let pr = ConditionType::Progressing;
    let p = f.rollout;
    let progressing = if p.phase != rollout::phase::IDLE {
        let mut message = format!(
            "{} group {}; {} groups at the new revision",
            p.phase,
            p.group.map_or("-".into(), |g| g.to_string()),
            p.updated_groups
        );
        if let Some(w) = p.prefill_wait {
            message.push_str(&format!(
                "; needs {} Updated prefill groups at the revision, {} present",
                w.needed, w.updated
            ));
        }
        Decided::yes(pr, Reason::RollingRestart, message)
    } else if let CapacityState::Pending { applied } = f.capacity {
        Decided::yes(
            pr,
            Reason::ScaleUpPending,
            format!(
                "scale-up to decode {} / prefill {} groups applied; waiting for its pods to be \
                 scheduled (rolled back to the last scheduled counts after \
                 unschedulableDeadlineSeconds)",
                applied.decode, applied.prefill
            ),
        )
    } else if f.existing != f.desired || f.ready < f.desired {
        Decided::yes(
            pr,
            Reason::Scaling,
            format!(
                "{} groups exist, {} ready, {} desired",
                f.existing, f.ready, f.desired
            ),
        )
    } else if let Some(p) = f.pair.filter(|p| !p.converged()) {
        Decided::yes(
            pr,
            Reason::Scaling,
            format!(
                "PrefillPool {}: {} groups exist, {} ready, {} desired",
                p.name, p.existing, p.ready, p.desired
            ),
        )
    } else if let CapacityState::Limited { admitted, target } = f.capacity {
        Decided::no(
            pr,
            Reason::CapacityLimited,
            format!(
                "holding the admitted counts decode {} / prefill {}: the target decode {} / \
                 prefill {} was refused for capacity (see InsufficientCapacity); change \
                 spec.replicas or the ratio to retry",
                admitted.decode, admitted.prefill, target.decode, target.prefill
            ),
        )
    } else {
        Decided::no(pr, Reason::Settled, "nothing to roll out")
    };
    [ready, progressing]
}

fn int(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

fn previous_conditions(prev: Option<&PoolStatus>) -> &[Condition] {
    prev.map(|p| p.conditions.as_slice()).unwrap_or_default()
}

/// The new status of a pool that rolled out.
pub fn pool_status(f: &StatusFacts<'_>) -> PoolStatus {
    let prev = f.previous.cloned().unwrap_or_default();
    let mut decided = readiness(f).to_vec();
    decided.extend(f.extra.iter().cloned());
    let now = jiff::Timestamp::now();
    let conditions = status::conditions(&prev.conditions, &decided, f.generation, now);
    let settled = f.rollout.phase == rollout::phase::IDLE && f.ready >= f.desired;
    PoolStatus {
        observed_generation: f.generation,
        conditions,
        replicas: int(f.existing),
        ready_replicas: int(f.ready),
        updated_replicas: int(f.rollout.updated_groups),
        desired_replicas: int(f.desired),
        admitted_replicas: f.admitted.map(int),
        replicas_owner: Some(f.replicas_owner.clone()),
        selector: labels::selector_string(f.name, f.role),
        current_revision: if settled {
            Some(f.revision.to_owned())
        } else {
            prev.current_revision.clone()
        },
        update_revision: Some(f.revision.to_owned()),
        rollout: Some(RolloutStatus {
            phase: f.rollout.phase.into(),
            updated_groups: int(f.rollout.updated_groups),
            group: f.rollout.group.and_then(|g| i32::try_from(g).ok()),
            target_revision: Some(f.revision.to_owned()),
        }),
        scaling: f.scaling.clone().or(prev.scaling),
        group_restarts: f.group_restarts.to_vec(),
    }
}

/// The status of a pool of kind `K` that does not roll out now (refused, or being torn down):
/// the [`blocked_conditions`] of the kind's condition types, the groups that exist, none counted
/// ready, and everything else as it was.
pub fn blocked_status<K: PoolKind>(
    pool: &K,
    observed: &PoolChildren,
    block: &Block,
    replicas_owner: String,
) -> PoolStatus {
    let prev = pool.status();
    let base = prev.cloned().unwrap_or_default();
    let generation = pool.meta().generation;
    let decided = blocked_conditions(block, previous_conditions(prev), K::CONDITIONS);
    let now = jiff::Timestamp::now();
    PoolStatus {
        observed_generation: generation,
        conditions: status::conditions(&base.conditions, &decided, generation, now),
        replicas: int(observed.groups_existing()),
        ready_replicas: 0,
        replicas_owner: Some(replicas_owner),
        selector: labels::selector_string(&pool.name_any(), K::ROLE),
        ..base
    }
}

/// `Degraded=False` and `PolicyConflict=False` (with what was resolved) of a pool that rolls out.
pub fn resolved_conditions(p: &crate::policy::MemoryPolicy) -> [Decided; 2] {
    [
        Decided::no(
            ConditionType::Degraded,
            Reason::AsExpected,
            "no degradation observed",
        ),
        Decided::no(
            ConditionType::PolicyConflict,
            Reason::PolicyResolved,
            policy_message(p),
        ),
    ]
}

/// `Degraded=True, ReplicaRestartBudgetExceeded` in `conditions` when `recovery` halted a group
/// (a `Degraded=True` the kind decided for another reason is kept: it came first).
pub fn degrade_for_recovery(
    conditions: &mut [Decided],
    recovery: &crate::recovery::RecoveryPlan,
    budget: i32,
) {
    let halted = recovery.halted_groups();
    if halted.is_empty() {
        return;
    }
    let Some(slot) = conditions
        .iter_mut()
        .find(|c| c.type_ == ConditionType::Degraded && !c.is_true())
    else {
        return;
    };
    let list: Vec<String> = halted.iter().map(u32::to_string).collect();
    *slot = Decided::yes(
        ConditionType::Degraded,
        Reason::ReplicaRestartBudgetExceeded,
        format!(
            "group(s) {} kept failing past maxGroupRestarts {budget} at this revision and are \
             held at 0 pods (GPUs released); see the pods' logs and events, fix the cause, then \
             change the spec or bump restart.id to try again",
            list.join(", ")
        ),
    );
}

/// `Degraded=True, WorkerDegraded` from what the pool's unready workers report (the first fault
/// names the cause; the count says how many more), replacing the `Degraded` condition in
/// `conditions` when that one is False. `None` (nothing changed) without faults or when `Degraded`
/// is already True for another reason (that reason wins).
pub fn worker_degraded(
    conditions: &mut [Decided],
    faults: &[crate::controller::probe::WorkerFault],
) -> Option<Decided> {
    let first = faults.first()?;
    let more = match faults.len() - 1 {
        0 => String::new(),
        n => format!(" (and {n} more)"),
    };
    degrade(
        conditions,
        Reason::WorkerDegraded,
        format!(
            "worker {} is not Ready: {} {}: {}{more}",
            first.pod, first.component, first.code, first.message
        ),
    )
}

/// Sets the first `Degraded` condition that is not True to True with `reason` and `message`, and
/// returns it; `None` when none is left (Degraded is already True: its reason stands).
fn degrade(conditions: &mut [Decided], reason: Reason, message: String) -> Option<Decided> {
    let slot = conditions
        .iter_mut()
        .find(|d| d.type_ == ConditionType::Degraded && !d.is_true())?;
    *slot = Decided::yes(ConditionType::Degraded, reason, message);
    Some(slot.clone())
}

/// Turns the first `Degraded` condition that is not True into `Degraded=True`,
/// `NodeWithoutTopologyLabel` when a pod of the pool runs on a node without the placement's
/// topology label (`misplaced`, from [`super::observe::pods_on_unlabeled_nodes`]); returns it
/// (for the event) or `None` when nothing is misplaced or `Degraded` is already True (a worker's
/// own degradation or a halted group says more).
pub fn placement_degraded(
    conditions: &mut [Decided],
    key: &str,
    misplaced: &[super::observe::Misplaced],
) -> Option<Decided> {
    let first = misplaced.first()?;
    let more = match misplaced.len() - 1 {
        0 => String::new(),
        n => format!(" (and {n} more pods)"),
    };
    degrade(
        conditions,
        Reason::NodeWithoutTopologyLabel,
        format!(
            "pod {} runs on node {}, which has no label {key}: spec.placement cannot hold for \
             it{more}; label the node, or use placement.mode Required (the scheduler then \
             never picks such a node)",
            first.pod, first.node
        ),
    )
}

/// The message of `PolicyConflict=False`: what was resolved.
fn policy_message(p: &crate::policy::MemoryPolicy) -> String {
    match &p.l3 {
        Some(l3) => format!(
            "CacheTier {:?}: allocator {:?}, client mode {:?}, {} tokens per page",
            l3.tier, p.allocator, l3.client_mode, l3.page_tokens
        ),
        None => format!("no CacheTier: allocator {:?}, no L3", p.allocator),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_idle(updated: u32) -> RolloutPlan {
        RolloutPlan {
            phase: rollout::phase::IDLE,
            group: None,
            updated_groups: updated,
            action: rollout::RolloutAction::Wait,
            prefill_wait: None,
        }
    }

    fn facts<'a>(
        plan: &'a RolloutPlan,
        pair: Option<&'a PairProgress>,
        capacity: CapacityState,
    ) -> StatusFacts<'a> {
        StatusFacts {
            previous: None,
            generation: Some(1),
            role: Role::Decode,
            name: "d",
            desired: 2,
            existing: 2,
            ready: 2,
            rollout: plan,
            revision: "r",
            replicas_owner: "spec.replicas".into(),
            scaling: None,
            admitted: Some(2),
            pair,
            capacity,
            extra: &[],
            group_restarts: &[],
        }
    }

    fn prefill(desired: u32, ready: u32) -> PairProgress {
        PairProgress {
            name: "p".into(),
            desired,
            existing: desired,
            ready,
        }
    }

    fn summary(d: &[Decided; 2]) -> [(bool, Reason); 2] {
        [(d[0].is_true(), d[0].reason), (d[1].is_true(), d[1].reason)]
    }

    /// Issue 19 item 3: decode groups all Ready is not enough while the prefill groups of the
    /// scale-up are pending.
    #[test]
    fn a_pending_scale_up_of_either_pool_is_not_ready_nor_settled() {
        let plan = plan_idle(2);
        let pair = prefill(8, 4);
        let applied = Counts {
            decode: 2,
            prefill: 8,
        };
        let pending = readiness(&facts(
            &plan,
            Some(&pair),
            CapacityState::Pending { applied },
        ));
        assert_eq!(
            summary(&pending),
            [
                (false, Reason::GroupsNotReady),
                (true, Reason::ScaleUpPending)
            ]
        );
        assert!(
            pending[0].message.contains("PrefillPool p: 4/8"),
            "{pending:?}"
        );
        // Scheduled, prefill still starting: still progressing.
        let starting = readiness(&facts(&plan, Some(&pair), CapacityState::Steady));
        assert_eq!(
            summary(&starting),
            [(false, Reason::GroupsNotReady), (true, Reason::Scaling)]
        );
        let done = prefill(8, 8);
        let settled = readiness(&facts(&plan, Some(&done), CapacityState::Steady));
        assert_eq!(
            summary(&settled),
            [(true, Reason::AllGroupsReady), (false, Reason::Settled)]
        );
    }

    /// Issue 17: a decode pool waiting at the prefill gate says how many Updated prefill groups
    /// it needs and how many there are.
    #[test]
    fn waiting_for_prefill_says_needed_vs_present() {
        let plan = RolloutPlan {
            phase: rollout::phase::WAITING_FOR_PREFILL,
            group: Some(1),
            updated_groups: 1,
            action: rollout::RolloutAction::Wait,
            prefill_wait: Some(rollout::PrefillWait {
                needed: 3,
                updated: 2,
            }),
        };
        let pair = prefill(4, 3);
        let d = readiness(&facts(&plan, Some(&pair), CapacityState::Steady));
        assert_eq!(d[1].reason, Reason::RollingRestart);
        assert_eq!(
            d[1].message,
            "WaitingForPrefill group 1; 1 groups at the new revision; needs 3 Updated prefill \
             groups at the revision, 2 present"
        );
        // Other phases keep the message they had.
        let draining = RolloutPlan {
            phase: rollout::phase::DRAINING,
            prefill_wait: None,
            ..plan
        };
        let d = readiness(&facts(&draining, Some(&pair), CapacityState::Steady));
        assert_eq!(
            d[1].message,
            "Draining group 1; 1 groups at the new revision"
        );
    }

    #[test]
    fn after_a_refusal_status_says_what_was_admitted_and_why() {
        let plan = plan_idle(2);
        let pair = prefill(4, 4);
        let limited = CapacityState::Limited {
            admitted: Counts {
                decode: 2,
                prefill: 4,
            },
            target: Counts {
                decode: 4,
                prefill: 8,
            },
        };
        let f = facts(&plan, Some(&pair), limited);
        let d = readiness(&f);
        assert_eq!(
            summary(&d),
            [
                (true, Reason::AllGroupsReady),
                (false, Reason::CapacityLimited)
            ]
        );
        assert!(
            d[0].message.contains("2 of 4 decode groups admitted"),
            "{d:?}"
        );
        assert!(
            d[1].message.contains("decode 2 / prefill 4")
                && d[1].message.contains("decode 4 / prefill 8"),
            "{d:?}"
        );
        assert_eq!(pool_status(&f).admitted_replicas, Some(2));
    }

    #[test]
    fn an_unready_workers_degradation_turns_degraded_true_unless_already_true() {
        use crate::controller::probe::WorkerFault;
        let fault = |pod: &str| WorkerFault {
            pod: pod.into(),
            component: "pools".into(),
            code: "PoolDomainMismatch".into(),
            message: "the draft pool would be carved from mmap".into(),
        };
        let policy = Decided::no(ConditionType::PolicyConflict, Reason::PolicyResolved, "ok");
        let healthy = || {
            vec![
                Decided::no(ConditionType::Degraded, Reason::AsExpected, "none"),
                policy.clone(),
            ]
        };
        let mut c = healthy();
        assert_eq!(worker_degraded(&mut c, &[]), None, "no fault: unchanged");
        assert_eq!(c, healthy());
        let d = worker_degraded(&mut c, &[fault("d-g0-0"), fault("d-g1-0")]).unwrap();
        assert_eq!(
            (d.status, d.reason),
            (crate::status::ConditionStatus::True, Reason::WorkerDegraded)
        );
        assert!(
            d.message.contains("d-g0-0")
                && d.message.contains("pools PoolDomainMismatch")
                && d.message.ends_with("(and 1 more)"),
            "{}",
            d.message
        );
        assert_eq!(c[0], d);
        assert_eq!(c[1], policy, "other conditions untouched");
        // Degraded already True for another reason: that reason wins.
        let render = Decided::yes(ConditionType::Degraded, Reason::RenderFailed, "x");
        let mut c = vec![render.clone()];
        assert_eq!(worker_degraded(&mut c, &[fault("p")]), None);
        assert_eq!(c, [render]);
    }

    #[test]
    fn a_pod_on_a_node_without_the_topology_label_turns_degraded_true() {
        use crate::controller::pool::observe::Misplaced;
        let healthy = || vec![Decided::no(ConditionType::Degraded, Reason::AsExpected, "")];
        let mut c = healthy();
        let zone = "topology.kubernetes.io/zone";
        assert_eq!(placement_degraded(&mut c, zone, &[]), None);
        assert_eq!(c, healthy(), "every pod on a labelled node: unchanged");
        let m = |pod: &str| Misplaced {
            pod: pod.into(),
            node: "kwok-node-0".into(),
        };
        let d = placement_degraded(&mut c, zone, &[m("d-g0-0"), m("d-g1-0")]).unwrap();
        assert_eq!(d.reason, Reason::NodeWithoutTopologyLabel);
        assert!(d.is_true());
        assert!(
            d.message.contains("pod d-g0-0 runs on node kwok-node-0")
                && d.message.contains(zone)
                && d.message.contains("(and 1 more pods)"),
            "{}",
            d.message
        );
        // A worker's own degradation, decided first, keeps the slot.
        let worker = Decided::yes(ConditionType::Degraded, Reason::WorkerDegraded, "x");
        let mut c = vec![worker.clone()];
        assert_eq!(placement_degraded(&mut c, zone, &[m("p")]), None);
        assert_eq!(c, [worker]);
    }
}
