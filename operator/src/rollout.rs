//! The rolling-restart state machine of one pool (DESIGN §5), pure: from the observed pods of each
//! group to the next step.
//!
//! Group StatefulSets use `updateStrategy: OnDelete`, so applying a new pod template restarts
//! nothing; the controller restarts groups itself, one at a time, lowest index first:
//!
//! 1. **Draining** — the old-revision pods of the chosen group are deleted. Deleting a pod is how
//!    routing stops: a terminating pod's endpoint is published `ready=false` at once, and the
//!    worker's `/readyz` turns 503 on SIGTERM, then it drains or aborts its rooms and flushes L2 to
//!    L3 within the grace period (DESIGN contract 9). Pod labels are never edited: a pod that lost
//!    its selector label would be orphaned and replaced behind our back.
//! 2. **Restarting** — the StatefulSet recreates the missing pods from the new template.
//! 3. **LoadingBack** — the new pods exist but are not Ready; workers report ready only after
//!    their L3 loadback (or when policy lets them serve while warming).
//! 4. Next group, until every group is at the target revision and Ready (**Idle**).
//!
//! A decode pool starts a group only when its PrefillPool already has a Ready group of the same
//! revision (`gate_open`): every new decode pod then finds a same-revision prefill peer, and the
//! workers refuse to pair across revisions. While the gate is closed the phase is
//! **WaitingForPrefill**.

/// One pod as the rollout sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodObservation {
    /// Pod name.
    pub name: String,
    /// Its `serving.tandem.dev/revision` label.
    pub revision: String,
    /// The `Ready` condition is true.
    pub ready: bool,
    /// It has a deletion timestamp.
    pub terminating: bool,
    /// The largest `restartCount` of its containers (native sidecars included): restarts in
    /// place since the pod was created ([`crate::recovery`]).
    pub restarts: u32,
}

/// One group: its index, how many pods it should have (`tensor × context`) and the pods found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupObservation {
    /// Group index.
    pub index: u32,
    /// Desired pods.
    pub desired_pods: u32,
    /// Pods found with this group's labels.
    pub pods: Vec<PodObservation>,
}

/// Where a group stands relative to the target revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupState {
    /// Every desired pod exists at the target revision, Ready, not terminating.
    Updated,
    /// Complete and settled (no pod terminating, every target-revision pod Ready) but some pods
    /// are at an old revision: the group is due for a restart.
    Stale,
    /// Pods terminating: routing has stopped and the workers drain.
    Draining,
    /// Fewer pods than desired: the StatefulSet is (re)creating them.
    Restarting,
    /// Target-revision pods exist but are not Ready (loading back from L3, or warming up).
    LoadingBack,
}

impl GroupObservation {
    /// Classifies the group against `target`.
    pub fn state(&self, target: &str) -> GroupState {
        if self.pods.iter().any(|p| p.terminating) {
            return GroupState::Draining;
        }
        if self.pods.len() < self.desired_pods as usize {
            return GroupState::Restarting;
        }
        if self.pods.iter().any(|p| p.revision == target && !p.ready) {
            return GroupState::LoadingBack;
        }
        if self.pods.iter().any(|p| p.revision != target) {
            return GroupState::Stale;
        }
        if self.pods.iter().all(|p| p.ready) {
            GroupState::Updated
        } else {
            GroupState::LoadingBack
        }
    }

    /// Every desired pod exists, is Ready and is not terminating (any revision).
    pub fn ready(&self) -> bool {
        self.pods.len() >= self.desired_pods as usize
            && self.pods.iter().all(|p| p.ready && !p.terminating)
    }
}

/// Rollout phase names, as written to `status.rollout.phase`.
pub mod phase {
    /// No group is at an old revision.
    pub const IDLE: &str = "Idle";
    /// A decode pool waits for a Ready prefill group of the target revision.
    pub const WAITING_FOR_PREFILL: &str = "WaitingForPrefill";
    /// Old pods of the current group are terminating (routing stopped, draining, flushing).
    pub const DRAINING: &str = "Draining";
    /// The current group's pods are being recreated.
    pub const RESTARTING: &str = "Restarting";
    /// The current group's new pods are not Ready yet (L3 loadback).
    pub const LOADING_BACK: &str = "LoadingBack";
}

/// What the controller does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutAction {
    /// Nothing: idle, or waiting for the current step to finish.
    Wait,
    /// Delete these old-revision pods of `group` (they restart from the new template).
    RestartGroup {
        /// Group index.
        group: u32,
        /// Pods to delete.
        pods: Vec<String>,
    },
}

/// The outcome of one look at the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutPlan {
    /// One of [`phase`].
    pub phase: &'static str,
    /// The group being rolled (or about to be), if any.
    pub group: Option<u32>,
    /// Groups at the target revision and Ready.
    pub updated_groups: u32,
    /// Next step.
    pub action: RolloutAction,
}

/// Decides the next rollout step of a pool whose groups are `groups` (ascending index) towards
/// `target`. `gate_open` is false for a decode pool whose PrefillPool has no Ready group at
/// `target` yet (always true for prefill).
///
/// At most one group is in flight at a time: while any group drains, restarts or loads back, no
/// other group is touched. A group created by a scale-up that is still coming up counts as in
/// flight only if the pool has a stale group (otherwise there is no rollout, just `Progressing`).
pub fn plan(groups: &[GroupObservation], target: &str, gate_open: bool) -> RolloutPlan {
    let states: Vec<(u32, GroupState)> =
        groups.iter().map(|g| (g.index, g.state(target))).collect();
    let updated_groups = states
        .iter()
        .filter(|(_, s)| *s == GroupState::Updated)
        .count() as u32;
    let has_old = groups
        .iter()
        .any(|g| g.pods.iter().any(|p| p.revision != target));
    if !has_old {
        // Groups still coming up at the target revision are reported by `Progressing`.
        return RolloutPlan {
            phase: phase::IDLE,
            group: None,
            updated_groups,
            action: RolloutAction::Wait,
        };
    }
    if let Some((i, s)) = states.iter().find(|(_, s)| {
        matches!(
            s,
            GroupState::Draining | GroupState::Restarting | GroupState::LoadingBack
        )
    }) {
        let phase = match s {
            GroupState::Draining => phase::DRAINING,
            GroupState::Restarting => phase::RESTARTING,
            _ => phase::LOADING_BACK,
        };
        return RolloutPlan {
            phase,
            group: Some(*i),
            updated_groups,
            action: RolloutAction::Wait,
        };
    }
    let Some(stale) = groups.iter().find(|g| g.state(target) == GroupState::Stale) else {
        return RolloutPlan {
            phase: phase::IDLE,
            group: None,
            updated_groups,
            action: RolloutAction::Wait,
        };
    };
    if !gate_open {
        return RolloutPlan {
            phase: phase::WAITING_FOR_PREFILL,
            group: Some(stale.index),
            updated_groups,
            action: RolloutAction::Wait,
        };
    }
    RolloutPlan {
        phase: phase::DRAINING,
        group: Some(stale.index),
        updated_groups,
        action: RolloutAction::RestartGroup {
            group: stale.index,
            pods: stale
                .pods
                .iter()
                .filter(|p| p.revision != target)
                .map(|p| p.name.clone())
                .collect(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(g: u32, i: u32, rev: &str, ready: bool) -> PodObservation {
        PodObservation {
            name: format!("p-g{g}-{i}"),
            revision: rev.into(),
            ready,
            terminating: false,
            restarts: 0,
        }
    }

    fn group(index: u32, pods: Vec<PodObservation>) -> GroupObservation {
        GroupObservation {
            index,
            desired_pods: 2,
            pods,
        }
    }

    fn settled(index: u32, rev: &str) -> GroupObservation {
        group(
            index,
            vec![pod(index, 0, rev, true), pod(index, 1, rev, true)],
        )
    }

    #[test]
    fn all_at_target_is_idle() {
        let p = plan(&[settled(0, "b"), settled(1, "b")], "b", true);
        assert_eq!((p.phase, p.updated_groups), (phase::IDLE, 2));
        assert_eq!(p.action, RolloutAction::Wait);
    }

    #[test]
    fn restarts_the_lowest_stale_group_whole() {
        let p = plan(&[settled(0, "a"), settled(1, "a")], "b", true);
        assert_eq!(
            p.action,
            RolloutAction::RestartGroup {
                group: 0,
                pods: vec!["p-g0-0".into(), "p-g0-1".into()]
            }
        );
        assert_eq!(p.phase, phase::DRAINING);
    }

    #[test]
    fn one_group_at_a_time_through_every_phase() {
        // g0 terminating: wait, even though g1 is stale.
        let mut g0 = settled(0, "a");
        g0.pods[0].terminating = true;
        let p = plan(&[g0, settled(1, "a")], "b", true);
        assert_eq!((p.phase, p.group), (phase::DRAINING, Some(0)));
        assert_eq!(p.action, RolloutAction::Wait);
        // g0 recreated partially.
        let g0 = group(0, vec![pod(0, 0, "b", false)]);
        let p = plan(&[g0, settled(1, "a")], "b", true);
        assert_eq!(
            (p.phase, p.action.clone()),
            (phase::RESTARTING, RolloutAction::Wait)
        );
        // g0 complete, loading back.
        let g0 = group(0, vec![pod(0, 0, "b", true), pod(0, 1, "b", false)]);
        let p = plan(&[g0, settled(1, "a")], "b", true);
        assert_eq!((p.phase, p.group), (phase::LOADING_BACK, Some(0)));
        assert_eq!(p.action, RolloutAction::Wait);
        // g0 ready at b: now g1.
        let p = plan(&[settled(0, "b"), settled(1, "a")], "b", true);
        assert_eq!(p.updated_groups, 1);
        assert!(matches!(
            p.action,
            RolloutAction::RestartGroup { group: 1, .. }
        ));
    }

    #[test]
    fn decode_waits_for_a_same_revision_prefill_group() {
        let p = plan(&[settled(0, "a")], "b", false);
        assert_eq!(p.phase, phase::WAITING_FOR_PREFILL);
        assert_eq!(p.action, RolloutAction::Wait);
    }

    #[test]
    fn only_old_pods_of_a_mixed_group_are_deleted() {
        // A pod the StatefulSet recreated from the new template is already at b.
        let g = group(0, vec![pod(0, 0, "b", true), pod(0, 1, "a", true)]);
        let p = plan(&[g], "b", true);
        assert_eq!(
            p.action,
            RolloutAction::RestartGroup {
                group: 0,
                pods: vec!["p-g0-1".into()]
            }
        );
    }

    /// Drives a simulated pool through a whole rollout: at every step at most one group is away
    /// from Ready, and groups restart in index order.
    #[test]
    fn simulated_rollout_keeps_all_but_one_group_serving() {
        let mut groups: Vec<GroupObservation> = (0..4).map(|i| settled(i, "a")).collect();
        let mut order = Vec::new();
        for _ in 0..100 {
            let p = plan(&groups, "b", true);
            let not_ready = groups.iter().filter(|g| !g.ready()).count();
            assert!(not_ready <= 1, "two groups down at once: {groups:?}");
            match p.action {
                RolloutAction::RestartGroup { group, .. } => {
                    order.push(group);
                    // Deleted, then recreated at b, then ready: three observations.
                    let g = &mut groups[group as usize];
                    for pd in &mut g.pods {
                        pd.terminating = true;
                    }
                    assert_eq!(plan(&groups, "b", true).phase, phase::DRAINING);
                    let g = &mut groups[group as usize];
                    g.pods = vec![pod(group, 0, "b", false), pod(group, 1, "b", false)];
                    // The last group's loadback is reported by `Progressing`, not the rollout.
                    let ph = plan(&groups, "b", true).phase;
                    assert!(
                        ph == phase::LOADING_BACK || (group == 3 && ph == phase::IDLE),
                        "{ph}"
                    );
                    let g = &mut groups[group as usize];
                    for pd in &mut g.pods {
                        pd.ready = true;
                    }
                }
                RolloutAction::Wait if p.phase == phase::IDLE => break,
                RolloutAction::Wait => panic!("stuck in {}", p.phase),
            }
        }
        assert_eq!(order, vec![0, 1, 2, 3]);
    }
}
