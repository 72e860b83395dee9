//! The rolling-restart state machine of one pool (DESIGN §5), pure: from the observed pods of each
//! group to the next step.
//!
//! Group StatefulSets use `updateStrategy: OnDelete`, so applying a new pod template restarts
//! nothing; the controller restarts groups itself, one at a time, lowest index first:
//!
//! 0. **WaitingForStatefulSet** — until the group's StatefulSet controller has observed the new
//!    template ([`GroupObservation::template_revision`]): it recreates a deleted pod from the
//!    spec it has seen.
//! 1. **Draining** — the pods of the chosen group are deleted (all of them: a group found at two
//!    revisions cannot form, so its new pods restart with the old). Deleting a pod is how
//!    routing stops: a terminating pod's endpoint is published `ready=false` at once, and the
//!    worker's `/readyz` turns 503 on SIGTERM, then it drains or aborts its rooms and flushes L2 to
//!    L3 within the grace period (DESIGN contract 9). Pod labels are never edited: a pod that lost
//!    its selector label would be orphaned and replaced behind our back.
//! 2. **Restarting** — the StatefulSet recreates the missing pods from the new template.
//! 3. **LoadingBack** — the new pods exist but are not Ready; workers report ready only after
//!    their L3 loadback (or when policy lets them serve while warming).
//! 4. Next group, until every group is at the target revision and Ready (**Idle**).
//!
//! A decode pool restarts a group only when enough groups of its PrefillPool are already
//! Updated at the same (pair) revision ([`PrefillGate`]): the workers refuse to pair across
//! revisions, so the new-revision decode groups share the new-revision prefill groups, and one
//! Ready prefill group is not enough for all of them (a CI demo lost requests with every new
//! decode group paired to the single new prefill group). The k-th decode group to restart
//! (0-based, k = decode groups already Updated) needs
//! `required(k) = max(1, min(⌈(k+1)·P/D⌉, P−1))` Updated prefill groups, P and D the applied
//! prefill and decode group counts: the new revision keeps the pool's P:D ratio as it grows,
//! capped at P−1 so the decode rollout can go on while the last prefill group restarts, and never
//! below 1 so every new decode pod has a peer. While the gate is closed the phase is
//! **WaitingForPrefill**. Prefill groups restart one at a time without a gate, so the prefill
//! rollout always ends with all P groups Updated ≥ `required(k)` for every k: the decode rollout
//! cannot deadlock, whatever P, D, or a scaling during the rollout.

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
    /// The revision of the pod template the group's StatefulSet controller recreates pods from:
    /// the StatefulSet's `serving.tandem.dev/revision` label once its `status.observedGeneration`
    /// has reached its `metadata.generation`; `None` while the controller has not yet seen the
    /// StatefulSet's latest spec (or there is no StatefulSet). A pod deleted before the controller
    /// has seen a new template comes back from the old one.
    pub template_revision: Option<String>,
}

/// Where a group stands relative to the target revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupState {
    /// Every desired pod exists at the target revision, Ready, not terminating.
    Updated,
    /// Complete (every desired pod present, none terminating) but some pods are at an old
    /// revision: the group is due for a restart (of its old pods; new pods of a mixed group
    /// cannot become Ready beside them).
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
        // Old pods first: a group of several pods at more than one revision never becomes Ready
        // (its gang gate says `GroupMixedRevision`, and ranks of two revisions refuse each
        // other), so waiting for its new pods would wait forever. The StatefulSet controller
        // recreates a pod from the template it has seen: one deleted right after the template
        // changed can come back at the old revision.
        if self.pods.iter().any(|p| p.revision != target) {
            return GroupState::Stale;
        }
        if self.pods.iter().any(|p| !p.ready) {
            return GroupState::LoadingBack;
        }
        GroupState::Updated
    }

    /// Every desired pod exists, is Ready and is not terminating (any revision).
    pub fn ready(&self) -> bool {
        self.pods.len() >= self.desired_pods as usize
            && self.pods.iter().all(|p| p.ready && !p.terminating)
    }
}

/// Rollout phase names, as written to `status.rollout.phase`.
pub mod phase {
    /// No group is at an old revision, and (for a rollout under way, [`super::plan_rollout`])
    /// every group is Updated.
    pub const IDLE: &str = "Idle";
    /// A decode pool waits for enough Updated prefill groups of the target revision
    /// ([`PrefillGate`]).
    pub const WAITING_FOR_PREFILL: &str = "WaitingForPrefill";
    /// Old pods of the current group are terminating (routing stopped, draining, flushing).
    pub const DRAINING: &str = "Draining";
    /// The current group's pods are being recreated.
    pub const RESTARTING: &str = "Restarting";
    /// The current group's new pods are not Ready yet (L3 loadback).
    pub const LOADING_BACK: &str = "LoadingBack";
    /// The next group's StatefulSet controller has not yet observed the new pod template
    /// ([`super::GroupObservation::template_revision`]): its pods are deleted once it has, so they
    /// come back at the target revision.
    pub const WAITING_FOR_STATEFUL_SET: &str = "WaitingForStatefulSet";
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
    /// In [`phase::WAITING_FOR_PREFILL`] only: the prefill groups the gate wants and has.
    pub prefill_wait: Option<PrefillWait>,
}

/// Why a decode pool waits ([`phase::WAITING_FOR_PREFILL`]): prefill groups Updated at the pair
/// revision, needed and present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillWait {
    /// [`PrefillGate::required_for`] the next decode group.
    pub needed: u32,
    /// [`PrefillGate::updated_prefill`].
    pub updated: u32,
}

/// The gate of a decode pool's rolling restart: how many of its PrefillPool's groups must be
/// Updated (every pod at the pair revision, Ready) before the next decode group restarts.
///
/// The k-th decode group to restart (0-based; k = decode groups already Updated at the target)
/// needs `required(k) = max(1, min(⌈(k+1)·P/D⌉, P−1))` Updated prefill groups, P =
/// `prefill_groups`, D = `decode_groups` (the applied counts of the P:D scaling transaction):
/// - `⌈(k+1)·P/D⌉`: after the restart the new revision has k+1 decode groups and at least its
///   P:D share of prefill groups, so no new prefill group serves more decode groups than the
///   pool's ratio (workers pair only within one revision);
/// - `P−1`: the last prefill group's restart does not hold up the decode rollout;
/// - `1`: a new decode group always has a same-revision peer (also when P = 1).
///
/// The prefill rollout is not gated, so it ends with `updated_prefill = P ≥ required(k)` for any
/// k: the gate never deadlocks (P > D, P < D, or counts changing mid-rollout alike). With P = 0
/// the gate stays closed (there is no peer to pair with); D = 0 is read as D = 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillGate {
    /// Prefill groups `0..prefill_groups` that are Updated at the pair revision.
    pub updated_prefill: u32,
    /// P: the applied prefill group count.
    pub prefill_groups: u32,
    /// D: the applied decode group count.
    pub decode_groups: u32,
}

impl PrefillGate {
    /// Updated prefill groups the k-th decode group to restart (0-based) needs:
    /// `max(1, min(⌈(k+1)·P/D⌉, P−1))`.
    pub fn required_for(&self, k: u32) -> u32 {
        let p = u64::from(self.prefill_groups);
        let d = u64::from(self.decode_groups.max(1));
        let share = (u64::from(k) + 1).saturating_mul(p).div_ceil(d);
        let required = share.min(p.saturating_sub(1)).max(1);
        u32::try_from(required).unwrap_or(u32::MAX)
    }

    /// The k-th decode group to restart may start now.
    pub fn allows(&self, k: u32) -> bool {
        self.updated_prefill >= self.required_for(k)
    }
}

/// Decides the next rollout step of a pool whose groups are `groups` (ascending index) towards
/// `target`. `gate` is a decode pool's [`PrefillGate`]: the next stale group restarts only when
/// it [allows](PrefillGate::allows) k = the groups already Updated; `None` (a PrefillPool) never
/// waits.
///
/// At most one group is in flight at a time: while any group drains, restarts or loads back, no
/// other group is touched. A group created by a scale-up that is still coming up counts as in
/// flight only if the pool has a stale group (otherwise there is no rollout, just `Progressing`).
pub fn plan(groups: &[GroupObservation], target: &str, gate: Option<PrefillGate>) -> RolloutPlan {
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
        // Groups still coming up at the target revision: `plan_rollout` keeps a rollout's phase
        // until they are Updated; a scale-up's are reported by `Progressing`.
        return RolloutPlan {
            phase: phase::IDLE,
            group: None,
            updated_groups,
            action: RolloutAction::Wait,
            prefill_wait: None,
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
            prefill_wait: None,
        };
    }
    let Some(stale) = groups.iter().find(|g| g.state(target) == GroupState::Stale) else {
        return RolloutPlan {
            phase: phase::IDLE,
            group: None,
            updated_groups,
            action: RolloutAction::Wait,
            prefill_wait: None,
        };
    };
    if let Some(g) = gate.filter(|g| !g.allows(updated_groups)) {
        return RolloutPlan {
            phase: phase::WAITING_FOR_PREFILL,
            group: Some(stale.index),
            updated_groups,
            action: RolloutAction::Wait,
            prefill_wait: Some(PrefillWait {
                needed: g.required_for(updated_groups),
                updated: g.updated_prefill,
            }),
        };
    }
    // Only once the StatefulSet controller works from the target template: it recreates a
    // deleted pod from the spec it has observed, so a delete that races the template update
    // brings the pod back at the old revision — a wasted restart (a second drain and loadback),
    // and for a group of several pods a group at two revisions. The StatefulSet's status update
    // is a watch event, so the next reconcile comes with it.
    if stale.template_revision.as_deref() != Some(target) {
        return RolloutPlan {
            phase: phase::WAITING_FOR_STATEFUL_SET,
            group: Some(stale.index),
            updated_groups,
            action: RolloutAction::Wait,
            prefill_wait: None,
        };
    }
    // The whole group: a pod already at the target beside old ones is a rank that could not
    // form its group (and may have crashed trying); it restarts with the others, so the group
    // comes back whole and with no restart counted against it.
    RolloutPlan {
        phase: phase::DRAINING,
        group: Some(stale.index),
        updated_groups,
        action: RolloutAction::RestartGroup {
            group: stale.index,
            pods: stale.pods.iter().map(|p| p.name.clone()).collect(),
        },
        prefill_wait: None,
    }
}

/// [`plan`] for a pool whose status says a rollout is under way (`rolling`: its last phase was
/// not Idle). Once no pod is left at an old revision the rollout is not over until every group
/// is Updated: a group still draining, restarting or loading back keeps its phase. Without this a
/// pool whose last old pods were deleted and already gone (a group of 0 pods has no old pod)
/// would report `Idle` and `RolloutComplete` while its group is down.
pub fn plan_rollout(
    groups: &[GroupObservation],
    target: &str,
    gate: Option<PrefillGate>,
    rolling: bool,
) -> RolloutPlan {
    let p = plan(groups, target, gate);
    if !rolling || p.phase != phase::IDLE {
        return p;
    }
    let coming_up = groups.iter().find_map(|g| match g.state(target) {
        GroupState::Draining => Some((g.index, phase::DRAINING)),
        GroupState::Restarting => Some((g.index, phase::RESTARTING)),
        GroupState::LoadingBack => Some((g.index, phase::LOADING_BACK)),
        GroupState::Updated | GroupState::Stale => None,
    });
    match coming_up {
        Some((group, phase)) => RolloutPlan {
            phase,
            group: Some(group),
            ..p
        },
        None => p,
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

    /// A group of two pods whose StatefulSet controller already works from the target
    /// template "b" (the tests' target).
    fn group(index: u32, pods: Vec<PodObservation>) -> GroupObservation {
        GroupObservation {
            index,
            desired_pods: 2,
            pods,
            template_revision: Some("b".into()),
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
        let p = plan(&[settled(0, "b"), settled(1, "b")], "b", None);
        assert_eq!((p.phase, p.updated_groups), (phase::IDLE, 2));
        assert_eq!(p.action, RolloutAction::Wait);
    }

    #[test]
    fn restarts_the_lowest_stale_group_whole() {
        let p = plan(&[settled(0, "a"), settled(1, "a")], "b", None);
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
        let p = plan(&[g0, settled(1, "a")], "b", None);
        assert_eq!((p.phase, p.group), (phase::DRAINING, Some(0)));
        assert_eq!(p.action, RolloutAction::Wait);
        // g0 recreated partially.
        let g0 = group(0, vec![pod(0, 0, "b", false)]);
        let p = plan(&[g0, settled(1, "a")], "b", None);
        assert_eq!(
            (p.phase, p.action.clone()),
            (phase::RESTARTING, RolloutAction::Wait)
        );
        // g0 complete, loading back.
        let g0 = group(0, vec![pod(0, 0, "b", true), pod(0, 1, "b", false)]);
        let p = plan(&[g0, settled(1, "a")], "b", None);
        assert_eq!((p.phase, p.group), (phase::LOADING_BACK, Some(0)));
        assert_eq!(p.action, RolloutAction::Wait);
        // g0 ready at b: now g1.
        let p = plan(&[settled(0, "b"), settled(1, "a")], "b", None);
        assert_eq!(p.updated_groups, 1);
        assert!(matches!(
            p.action,
            RolloutAction::RestartGroup { group: 1, .. }
        ));
    }

    /// The last old pods deleted and already gone: the group has no pod at all, so none is
    /// old; a rollout under way stays `Restarting` (then `LoadingBack`) until the group is
    /// Updated, where a pool that was not rolling (a scale-up) stays `Idle`.
    #[test]
    fn a_rollout_ends_only_when_its_groups_are_updated() {
        let gone = group(0, vec![]);
        let p = plan_rollout(&[gone.clone(), settled(1, "b")], "b", None, true);
        assert_eq!((p.phase, p.group), (phase::RESTARTING, Some(0)));
        assert_eq!(p.action, RolloutAction::Wait);
        assert_eq!(p.updated_groups, 1);
        let warming = group(0, vec![pod(0, 0, "b", true), pod(0, 1, "b", false)]);
        let p = plan_rollout(&[warming], "b", None, true);
        assert_eq!((p.phase, p.group), (phase::LOADING_BACK, Some(0)));
        let p = plan_rollout(&[settled(0, "b")], "b", None, true);
        assert_eq!((p.phase, p.group), (phase::IDLE, None));
        let p = plan_rollout(&[gone], "b", None, false);
        assert_eq!(p.phase, phase::IDLE, "a scale-up is no rollout");
    }

    #[test]
    fn decode_waits_for_a_same_revision_prefill_group() {
        let closed = PrefillGate {
            updated_prefill: 0,
            prefill_groups: 1,
            decode_groups: 1,
        };
        let p = plan(&[settled(0, "a")], "b", Some(closed));
        assert_eq!(p.phase, phase::WAITING_FOR_PREFILL);
        assert_eq!(p.action, RolloutAction::Wait);
        assert_eq!(
            p.prefill_wait,
            Some(PrefillWait {
                needed: 1,
                updated: 0
            })
        );
        let open = PrefillGate {
            updated_prefill: 1,
            ..closed
        };
        let p = plan(&[settled(0, "a")], "b", Some(open));
        assert!(matches!(
            p.action,
            RolloutAction::RestartGroup { group: 0, .. }
        ));
        assert_eq!(p.prefill_wait, None);
    }

    /// A delete that races the template update is recreated from the old template (the
    /// StatefulSet controller recreates from the spec it has observed): the rollout deletes a
    /// group's pods only once its StatefulSet's controller has observed the target template.
    #[test]
    fn a_group_restarts_only_once_its_statefulset_works_from_the_target_template() {
        for seen in [None, Some("a")] {
            let mut g = settled(0, "a");
            g.template_revision = seen.map(str::to_owned);
            let p = plan(&[g, settled(1, "a")], "b", None);
            assert_eq!(p.phase, phase::WAITING_FOR_STATEFUL_SET, "{seen:?}");
            assert_eq!(p.group, Some(0));
            assert_eq!(p.action, RolloutAction::Wait, "{seen:?}");
        }
        let p = plan(&[settled(0, "a"), settled(1, "a")], "b", None);
        assert!(matches!(
            p.action,
            RolloutAction::RestartGroup { group: 0, .. }
        ));
        // A decode pool behind its prefill gate says so first: that is the longer wait.
        let mut g = settled(0, "a");
        g.template_revision = None;
        let closed = PrefillGate {
            updated_prefill: 0,
            prefill_groups: 1,
            decode_groups: 1,
        };
        assert_eq!(
            plan(&[g], "b", Some(closed)).phase,
            phase::WAITING_FOR_PREFILL
        );
    }

    /// A pod the StatefulSet recreated from the new template sits beside an old one: its gang
    /// gate keeps it not Ready (`GroupMixedRevision`), so the group is restarted whole at once,
    /// never left waiting in LoadingBack for a readiness that cannot come.
    #[test]
    fn a_group_at_two_revisions_restarts_whole() {
        for new_ready in [false, true] {
            let g = group(0, vec![pod(0, 0, "b", new_ready), pod(0, 1, "a", false)]);
            let p = plan(&[g], "b", None);
            assert_eq!(p.phase, phase::DRAINING);
            assert_eq!(
                p.action,
                RolloutAction::RestartGroup {
                    group: 0,
                    pods: vec!["p-g0-0".into(), "p-g0-1".into()]
                }
            );
        }
    }

    /// Drives a simulated pool through a whole rollout: at every step at most one group is away
    /// from Ready, and groups restart in index order.
    #[test]
    fn simulated_rollout_keeps_all_but_one_group_serving() {
        let mut groups: Vec<GroupObservation> = (0..4).map(|i| settled(i, "a")).collect();
        let mut order = Vec::new();
        for _ in 0..100 {
            let p = plan(&groups, "b", None);
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
                    assert_eq!(plan(&groups, "b", None).phase, phase::DRAINING);
                    let g = &mut groups[group as usize];
                    g.pods = vec![pod(group, 0, "b", false), pod(group, 1, "b", false)];
                    // The last group's loadback: no old pod is left, but the rollout is under
                    // way until that group is Updated.
                    assert_eq!(
                        plan_rollout(&groups, "b", None, true).phase,
                        phase::LOADING_BACK
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

    fn gate(updated_prefill: u32, prefill_groups: u32, decode_groups: u32) -> PrefillGate {
        PrefillGate {
            updated_prefill,
            prefill_groups,
            decode_groups,
        }
    }

    /// `required(k)` for k = 0..D, per P:D.
    fn required(p: u32, d: u32) -> Vec<u32> {
        (0..d).map(|k| gate(0, p, d).required_for(k)).collect()
    }

    #[test]
    fn required_prefill_groups_follow_the_ratio_capped_at_p_minus_one() {
        // P = 1: one peer is all there is.
        assert_eq!(required(1, 1), vec![1]);
        assert_eq!(required(1, 2), vec![1, 1]);
        assert_eq!(required(1, 4), vec![1, 1, 1, 1]);
        // 2:1: ⌈2/1⌉ = 2, capped at P−1 = 1.
        assert_eq!(required(2, 1), vec![1]);
        // 3:2: ⌈3/2⌉ = 2, ⌈6/2⌉ = 3 capped at 2.
        assert_eq!(required(3, 2), vec![2, 2]);
        // 4:1 (the sample stack): 3 of 4 prefill groups before the one decode group.
        assert_eq!(required(4, 1), vec![3]);
        // 4:2: 2 for the first, 4 capped at 3 for the second.
        assert_eq!(required(4, 2), vec![2, 3]);
        // 2:4: ⌈(k+1)/2⌉ capped at 1.
        assert_eq!(required(2, 4), vec![1, 1, 1, 1]);
        // 6:3: 2, 4, then 6 capped at 5.
        assert_eq!(required(6, 3), vec![2, 4, 5]);
        // Degenerate counts: D = 0 reads as 1; P = 0 keeps the gate closed (nothing to pair with).
        assert_eq!(gate(0, 2, 0).required_for(0), 1);
        assert_eq!(gate(0, 0, 2).required_for(0), 1);
        assert!(!gate(0, 0, 2).allows(0));
        // k past D (groups Updated beyond a shrunk D) stays at the cap.
        assert_eq!(gate(0, 3, 2).required_for(7), 2);
    }

    #[test]
    fn the_gate_allows_exactly_from_the_required_count() {
        for (p, d) in [(1, 1), (1, 2), (2, 1), (1, 4), (3, 2), (4, 1), (6, 3)] {
            for k in 0..d {
                let need = gate(0, p, d).required_for(k);
                assert!(!gate(need - 1, p, d).allows(k), "{p}:{d} k={k}");
                assert!(gate(need, p, d).allows(k), "{p}:{d} k={k}");
                assert!(
                    gate(p, p, d).allows(k),
                    "all P Updated always opens: {p}:{d}"
                );
            }
        }
    }

    #[test]
    fn plan_reports_how_many_prefill_groups_it_waits_for() {
        // 3:2, one decode group already Updated: the second needs 2 Updated prefill groups.
        let groups = [settled(0, "b"), settled(1, "a")];
        let p = plan(&groups, "b", Some(gate(1, 3, 2)));
        assert_eq!((p.phase, p.group), (phase::WAITING_FOR_PREFILL, Some(1)));
        assert_eq!(
            p.prefill_wait,
            Some(PrefillWait {
                needed: 2,
                updated: 1
            })
        );
        let p = plan(&groups, "b", Some(gate(2, 3, 2)));
        assert!(matches!(
            p.action,
            RolloutAction::RestartGroup { group: 1, .. }
        ));
    }

    /// A pool of `n` settled groups at revision "a".
    fn pool(n: u32) -> Vec<GroupObservation> {
        (0..n).map(|i| settled(i, "a")).collect()
    }

    /// One step of the cluster for a group in flight: terminating → recreated at "b" not Ready →
    /// Ready.
    fn advance(groups: &mut [GroupObservation]) {
        for g in groups {
            if g.pods.iter().any(|p| p.terminating) {
                let i = g.index;
                g.pods = vec![pod(i, 0, "b", false), pod(i, 1, "b", false)];
            } else if g.pods.iter().any(|p| !p.ready) {
                for p in &mut g.pods {
                    p.ready = true;
                }
            }
        }
    }

    fn act(groups: &mut [GroupObservation], p: &RolloutPlan) {
        if let RolloutAction::RestartGroup { group, .. } = &p.action {
            for pd in &mut groups[*group as usize].pods {
                pd.terminating = true;
            }
        }
    }

    fn updated(groups: &[GroupObservation]) -> u32 {
        groups
            .iter()
            .filter(|g| g.state("b") == GroupState::Updated)
            .count() as u32
    }

    /// Drives a PrefillPool (ungated) and its DecodePool (gated) through a restart together,
    /// `prefill_every` ticks per prefill step (prefill loads back slower than decode).
    /// `scale_at`: at that tick both pools grow to `(P', D')` (new groups come up at "b").
    /// Checks at every decode restart that the new revision already holds `required(k)` Updated
    /// prefill groups, and that both rollouts end (no deadlock). Returns the order of decode
    /// restarts with the Updated prefill count each saw.
    fn joint_rollout(
        p: u32,
        d: u32,
        prefill_every: u32,
        scale_at: Option<(u32, u32, u32)>,
    ) -> Vec<(u32, u32)> {
        let (mut prefill, mut decode) = (pool(p), pool(d));
        let mut seen = Vec::new();
        for tick in 0..1000 {
            if let Some((at, p2, d2)) = scale_at
                && tick == at
            {
                for (groups, n) in [(&mut prefill, p2), (&mut decode, d2)] {
                    let have = groups.len() as u32;
                    groups.extend(
                        (have..n)
                            .map(|i| group(i, vec![pod(i, 0, "b", false), pod(i, 1, "b", false)])),
                    );
                }
            }
            if tick % prefill_every == 0 {
                advance(&mut prefill);
                let pp = plan(&prefill, "b", None);
                act(&mut prefill, &pp);
            }
            advance(&mut decode);
            let g = gate(updated(&prefill), prefill.len() as u32, decode.len() as u32);
            let dp = plan(&decode, "b", Some(g));
            if let RolloutAction::RestartGroup { group, .. } = dp.action {
                // After this restart the new revision has k+1 decode groups (nothing else is in
                // flight); its prefill groups must cover them at the ratio, or be all but one.
                let (u, pn, dn) = (g.updated_prefill, g.prefill_groups, g.decode_groups);
                let new_decode = dp.updated_groups + 1;
                assert!(
                    u >= 1 && (u * dn >= new_decode * pn || u + 1 >= pn),
                    "{p}:{d} decode group {group} restarted with {g:?}, {new_decode} new"
                );
                seen.push((group, u));
            } else if dp.phase == phase::WAITING_FOR_PREFILL {
                assert_eq!(dp.prefill_wait.map(|w| w.updated), Some(g.updated_prefill));
            }
            act(&mut decode, &dp);
            let done =
                |gs: &[GroupObservation]| gs.iter().all(|g| g.state("b") == GroupState::Updated);
            if done(&prefill) && done(&decode) {
                return seen;
            }
        }
        panic!("{p}:{d}: the rollout did not end: {prefill:?} {decode:?}");
    }

    #[test]
    fn joint_rollouts_keep_the_ratio_and_always_finish() {
        // (P, D) → the Updated prefill count each decode restart saw, prefill 3x slower.
        assert_eq!(joint_rollout(1, 1, 3, None), vec![(0, 1)]);
        assert_eq!(joint_rollout(1, 2, 3, None), vec![(0, 1), (1, 1)]);
        assert_eq!(joint_rollout(2, 1, 3, None), vec![(0, 1)]);
        assert_eq!(
            joint_rollout(1, 4, 3, None),
            vec![(0, 1), (1, 1), (2, 1), (3, 1)]
        );
        assert_eq!(joint_rollout(3, 2, 3, None), vec![(0, 2), (1, 2)]);
        assert_eq!(joint_rollout(4, 1, 3, None), vec![(0, 3)]);
        // Prefill faster than decode: decode then restarts as soon as its group is done, the
        // gate already open.
        let fast = joint_rollout(3, 2, 1, None);
        assert_eq!(fast.len(), 2);
        assert!(fast.iter().all(|(_, u)| *u >= 2), "{fast:?}");
    }

    #[test]
    fn joint_rollouts_finish_when_the_pools_scale_mid_rollout() {
        // Grow 2:2 → 4:4 and 3:2 → 6:4 mid-rollout, shrink-free; every tick is a possible
        // moment. The new groups start at the target revision and count as Updated.
        for at in 0..12 {
            let order = joint_rollout(2, 2, 2, Some((at, 4, 4)));
            assert_eq!(
                order.iter().map(|(g, _)| *g).collect::<Vec<_>>(),
                vec![0, 1]
            );
            let order = joint_rollout(3, 2, 3, Some((at, 6, 4)));
            assert_eq!(order.len(), 2, "at {at}: {order:?}");
        }
    }
}
