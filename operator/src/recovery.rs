//! Bounded group recovery (`spec.maxGroupRestarts`, kubernetes-sigs/lws KEP-820), pure: from the
//! observed pods of each group and the counts recorded in the pool's status to the restarts and
//! halts to make.
//!
//! A group *fails* when a container of one of its pods at the target revision restarted (the
//! kubelet's `restartCount`, native sidecars included) — for a group of several pods, only while
//! none of its live pods is at another revision (ranks of two revisions cannot form a group; the
//! rollout restarts the old pods). Then:
//! - a group of **several pods** (`tensor × context > 1`) is restarted whole — every pod deleted,
//!   the StatefulSet recreates them — because one rank coming back alone cannot rejoin the
//!   group's collectives; each such restart is counted in `status.groupRestarts`;
//! - a **one-pod** group was already restarted in place by the kubelet; its container restarts are
//!   the count (kept as the largest seen, so a pod replaced for another reason does not reset it).
//!
//! A group whose count has reached `maxGroupRestarts` and fails again is **halted**: its
//! StatefulSet is held at 0 pods (the GPUs go back to the cluster) and the pool reports
//! `Degraded=True, ReplicaRestartBudgetExceeded`. Counts belong to a revision: a new revision (a
//! fixed spec, or `restart.id` bumped to try again) starts every group at 0 and brings halted
//! groups back.
//!
//! The count is written to status after the restart it records (the apply stage runs first): if
//! that status write is lost, a group gets at most one restart more than its budget.

use tandem_crds::GroupRestartStatus;

use crate::rollout::GroupObservation;

/// What the apply stage does for one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryAction {
    /// Delete every pod of a failed multi-pod group (the `attempt`-th restart at this revision).
    RestartGroup {
        /// Group index.
        group: u32,
        /// Pods to delete.
        pods: Vec<String>,
        /// This restart's number at the revision (1-based).
        attempt: u32,
    },
    /// The group failed with its budget spent: hold its StatefulSet at 0 pods from now on.
    Halt {
        /// Group index.
        group: u32,
        /// Restarts counted at the revision.
        restarts: u32,
    },
}

/// The recovery decisions of one reconcile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryPlan {
    /// `status.groupRestarts` to write: every group in range with a restart or halted.
    pub records: Vec<GroupRestartStatus>,
    /// Restarts and halts decided now (each reported once, as an event).
    pub actions: Vec<RecoveryAction>,
}

impl RecoveryPlan {
    /// Whether group `g` is held at 0 pods.
    pub fn halted(&self, g: u32) -> bool {
        self.records
            .iter()
            .any(|r| r.halted && u32::try_from(r.group).ok() == Some(g))
    }

    /// Halted groups, in index order.
    pub fn halted_groups(&self) -> Vec<u32> {
        self.records
            .iter()
            .filter(|r| r.halted)
            .filter_map(|r| u32::try_from(r.group).ok())
            .collect()
    }
}

/// Decides recovery for `groups` (observed at `target` revision) given the `previous` records
/// and the `budget` (`spec.maxGroupRestarts`; negative values count as 0).
pub fn plan(
    groups: &[GroupObservation],
    previous: &[GroupRestartStatus],
    target: &str,
    budget: i32,
) -> RecoveryPlan {
    let budget = u32::try_from(budget).unwrap_or(0);
    let mut out = RecoveryPlan::default();
    for g in groups {
        let mut record = previous
            .iter()
            .find(|r| u32::try_from(r.group).ok() == Some(g.index) && r.revision == target)
            .cloned()
            .unwrap_or_else(|| GroupRestartStatus {
                group: i32::try_from(g.index).unwrap_or(i32::MAX),
                revision: target.to_owned(),
                restarts: 0,
                halted: false,
            });
        if !record.halted {
            let counted = u32::try_from(record.restarts).unwrap_or(0);
            let live: Vec<_> = g
                .pods
                .iter()
                .filter(|p| !p.terminating && p.revision == target)
                .collect();
            let in_place = live.iter().map(|p| p.restarts).max().unwrap_or(0);
            // Ranks beside a pod of another revision cannot form their group: that is the
            // rollout's to fix (it restarts the old pods, `rollout::GroupState::Stale`), not a
            // failure of the group to count against its budget.
            let mixed = g
                .pods
                .iter()
                .any(|p| !p.terminating && p.revision != target);
            if g.desired_pods > 1 {
                if in_place > 0 && !mixed {
                    if counted >= budget {
                        record.halted = true;
                        out.actions.push(RecoveryAction::Halt {
                            group: g.index,
                            restarts: counted,
                        });
                    } else {
                        record.restarts = to_i32(counted + 1);
                        out.actions.push(RecoveryAction::RestartGroup {
                            group: g.index,
                            pods: live.iter().map(|p| p.name.clone()).collect(),
                            attempt: counted + 1,
                        });
                    }
                }
            } else {
                let restarts = counted.max(in_place);
                record.restarts = to_i32(restarts);
                if restarts > budget {
                    record.halted = true;
                    out.actions.push(RecoveryAction::Halt {
                        group: g.index,
                        restarts,
                    });
                }
            }
        }
        if record.restarts > 0 || record.halted {
            out.records.push(record);
        }
    }
    out
}

fn to_i32(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::PodObservation;

    fn pod(g: u32, i: u32, rev: &str, restarts: u32) -> PodObservation {
        PodObservation {
            name: format!("p-{g}-{i}"),
            revision: rev.into(),
            ready: restarts == 0,
            terminating: false,
            restarts,
        }
    }

    fn group(index: u32, desired: u32, restarts: &[u32]) -> GroupObservation {
        GroupObservation {
            index,
            desired_pods: desired,
            pods: restarts
                .iter()
                .enumerate()
                .map(|(i, r)| pod(index, i as u32, "r1", *r))
                .collect(),
            template_revision: Some("r1".into()),
        }
    }

    fn record(group: i32, revision: &str, restarts: i32, halted: bool) -> GroupRestartStatus {
        GroupRestartStatus {
            group,
            revision: revision.into(),
            restarts,
            halted,
        }
    }

    /// A rank that crashed beside a pod the StatefulSet brought back at the old revision is not
    /// the group's failure: nothing is counted until the rollout has replaced the old pod.
    #[test]
    fn a_mixed_group_is_the_rollouts_to_fix_not_a_failure() {
        let mut g = group(0, 2, &[1, 0]);
        g.pods[1].revision = "r0".into();
        assert_eq!(plan(&[g.clone()], &[], "r1", 3), RecoveryPlan::default());
        // Once the old pod is gone and the group is whole at r1, the crash counts.
        g.pods[1].revision = "r1".into();
        assert_eq!(
            plan(&[g], &[], "r1", 3).records,
            vec![record(0, "r1", 1, false)]
        );
    }

    #[test]
    fn clean_groups_record_nothing() {
        let p = plan(&[group(0, 2, &[0, 0]), group(1, 1, &[0])], &[], "r1", 3);
        assert_eq!(p, RecoveryPlan::default());
    }

    #[test]
    fn a_failed_rank_restarts_its_whole_group_and_counts_it() {
        let p = plan(&[group(0, 2, &[0, 1])], &[], "r1", 3);
        assert_eq!(
            p.actions,
            vec![RecoveryAction::RestartGroup {
                group: 0,
                pods: vec!["p-0-0".into(), "p-0-1".into()],
                attempt: 1
            }]
        );
        assert_eq!(p.records, vec![record(0, "r1", 1, false)]);
        assert!(!p.halted(0));
    }

    #[test]
    fn a_multi_pod_group_is_halted_when_it_fails_past_the_budget() {
        // Three restarts made, a fourth failure: budget 3 is spent.
        let p = plan(
            &[group(0, 2, &[2, 0])],
            &[record(0, "r1", 3, false)],
            "r1",
            3,
        );
        assert_eq!(
            p.actions,
            vec![RecoveryAction::Halt {
                group: 0,
                restarts: 3
            }]
        );
        assert!(p.halted(0));
        assert_eq!(p.halted_groups(), vec![0]);
    }

    #[test]
    fn budget_zero_halts_at_the_first_failure() {
        let p = plan(&[group(0, 4, &[0, 0, 1, 0])], &[], "r1", 0);
        assert!(p.halted(0));
        let p = plan(&[group(0, 1, &[1])], &[], "r1", 0);
        assert!(p.halted(0));
    }

    #[test]
    fn a_one_pod_group_counts_the_kubelets_restarts_and_never_deletes() {
        let p = plan(&[group(0, 1, &[2])], &[], "r1", 3);
        assert!(p.actions.is_empty(), "{:?}", p.actions);
        assert_eq!(p.records, vec![record(0, "r1", 2, false)]);
        // The pod was replaced (count back to 0): the record keeps the largest seen.
        let p = plan(&[group(0, 1, &[0])], &p.records, "r1", 3);
        assert_eq!(p.records, vec![record(0, "r1", 2, false)]);
        // Past the budget: halted.
        let p = plan(&[group(0, 1, &[4])], &p.records, "r1", 3);
        assert_eq!(
            p.actions,
            vec![RecoveryAction::Halt {
                group: 0,
                restarts: 4
            }]
        );
    }

    #[test]
    fn a_halted_group_stays_halted_and_reports_once() {
        let prev = [record(1, "r1", 3, true)];
        let p = plan(&[group(0, 2, &[0, 0]), group(1, 2, &[])], &prev, "r1", 3);
        assert!(p.actions.is_empty());
        assert!(p.halted(1));
        assert!(!p.halted(0));
    }

    #[test]
    fn a_new_revision_starts_every_count_at_zero_and_brings_halted_groups_back() {
        let prev = [record(0, "r1", 3, true), record(1, "r1", 2, false)];
        let groups = [
            GroupObservation {
                index: 0,
                desired_pods: 2,
                pods: vec![],
                template_revision: Some("r2".into()),
            },
            group(1, 2, &[0, 0]),
        ];
        let p = plan(&groups, &prev, "r2", 3);
        assert_eq!(p, RecoveryPlan::default());
    }

    #[test]
    fn old_revision_and_terminating_pods_are_not_failures() {
        let mut g = group(0, 2, &[0, 0]);
        g.pods[0].revision = "r0".into();
        g.pods[0].restarts = 5;
        g.pods[1].terminating = true;
        g.pods[1].restarts = 5;
        assert_eq!(plan(&[g], &[], "r1", 1), RecoveryPlan::default());
    }

    #[test]
    fn out_of_range_records_are_dropped() {
        let prev = [record(5, "r1", 2, true)];
        assert_eq!(
            plan(&[group(0, 1, &[0])], &prev, "r1", 3),
            RecoveryPlan::default()
        );
    }
}
