//! Gang readiness of multi-pod groups (issue 17), pure: a group of `tensor × context` pods is
//! routable only when all of them serve, so a partial group never receives traffic.
//!
//! The Kubernetes way is a pod readiness gate: every pod of a group with more than one pod
//! carries `readinessGates: [{conditionType: serving.tandem.dev/group-ready}]`
//! ([`crate::render::workload::group_statefulset`]), so its `Ready` condition — what Service
//! endpoints follow — is `ContainersReady` **and** that condition `True` (kubelet rule, KEP-580).
//! The operator sets the condition on each pod of a group from the group's pods' own
//! `ContainersReady` (never `Ready`, which includes the gate: that would be circular):
//!
//! - `True`, reason [`REASON_READY`]: every desired pod of the group exists, none is
//!   terminating, all are `ContainersReady`, all at one revision (any revision: a whole group of
//!   the old revision keeps serving during a rollout);
//! - `False` otherwise, reason [`REASON_INCOMPLETE`] (pods missing or terminating),
//!   [`REASON_NOT_READY`] (a pod not `ContainersReady`) or [`REASON_MIXED`] (pods of different
//!   revisions), so the whole group leaves the endpoints together.
//!
//! Only pods whose spec carries the gate are written (pods created before the gate existed, and
//! single-pod groups, have none: for them `Ready` is already the group's readiness). A write is
//! decided only when the pod's condition is missing or differs in status or reason, so a steady
//! resync writes nothing; terminating pods are left alone (they leave the endpoints anyway).

/// The pod condition type of the readiness gate.
pub const GROUP_READY: &str = "serving.tandem.dev/group-ready";
/// Reason of `True`: the whole group is `ContainersReady`.
pub const REASON_READY: &str = "GroupReady";
/// Reason of `False`: fewer live pods than `tensor × context` (missing or terminating).
pub const REASON_INCOMPLETE: &str = "GroupIncomplete";
/// Reason of `False`: a pod of the group is not `ContainersReady`.
pub const REASON_NOT_READY: &str = "GroupMemberNotReady";
/// Reason of `False`: the group's pods run different revisions.
pub const REASON_MIXED: &str = "GroupMixedRevision";

/// The gate condition as a pod carries it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateCondition {
    /// `True` / `False` (anything else counts as neither).
    pub status: String,
    /// Its reason (empty when absent).
    pub reason: String,
}

/// One pod of a pool as the gang decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangPod {
    /// Pod name.
    pub name: String,
    /// Its `serving.tandem.dev/group` label, when it parses.
    pub group: Option<u32>,
    /// Its `serving.tandem.dev/revision` label.
    pub revision: String,
    /// The `ContainersReady` condition is `True`.
    pub containers_ready: bool,
    /// It has a deletion timestamp.
    pub terminating: bool,
    /// Its spec lists the [`GROUP_READY`] readiness gate.
    pub gated: bool,
    /// The [`GROUP_READY`] condition in its status, if any.
    pub current: Option<GateCondition>,
}

/// A condition to write on one pod (`pods/status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateWrite {
    /// Pod name.
    pub pod: String,
    /// The status to set.
    pub ready: bool,
    /// CamelCase reason (one of the `REASON_*` constants).
    pub reason: &'static str,
    /// Human-readable detail (group, counts, the pod at fault).
    pub message: String,
}

impl GateWrite {
    /// `"True"` or `"False"`.
    pub fn status(&self) -> &'static str {
        if self.ready { "True" } else { "False" }
    }
}

/// The verdict on one group: ready or not, with reason and message.
fn verdict(group: u32, group_size: u32, members: &[&GangPod]) -> (bool, &'static str, String) {
    let live: Vec<&&GangPod> = members.iter().filter(|p| !p.terminating).collect();
    if live.len() as u32 != group_size {
        let terminating = members.len() - live.len();
        return (
            false,
            REASON_INCOMPLETE,
            format!(
                "group {group}: {} of {group_size} pods present ({terminating} terminating)",
                live.len()
            ),
        );
    }
    let mut revisions: Vec<&str> = live.iter().map(|p| p.revision.as_str()).collect();
    revisions.sort_unstable();
    revisions.dedup();
    if revisions.len() > 1 {
        return (
            false,
            REASON_MIXED,
            format!("group {group}: pods at revisions {}", revisions.join(", ")),
        );
    }
    let unready: Vec<&str> = live
        .iter()
        .filter(|p| !p.containers_ready)
        .map(|p| p.name.as_str())
        .collect();
    if !unready.is_empty() {
        return (
            false,
            REASON_NOT_READY,
            format!(
                "group {group}: {} of {group_size} pods ContainersReady; not ready: {}",
                group_size as usize - unready.len(),
                unready.join(", ")
            ),
        );
    }
    (
        true,
        REASON_READY,
        format!(
            "group {group}: all {group_size} pods ContainersReady at revision {}",
            revisions.first().copied().unwrap_or_default()
        ),
    )
}

/// The gate writes for a pool of `group_size` pods per group (module docs): one per live gated
/// pod whose condition is missing or differs in status or reason. Empty when `group_size <= 1`
/// (single-pod groups carry no gate). Pods without a group label are ignored. Ordered by pod
/// name.
pub fn decide(group_size: u32, pods: &[GangPod]) -> Vec<GateWrite> {
    if group_size <= 1 {
        return Vec::new();
    }
    let mut groups: Vec<u32> = pods.iter().filter_map(|p| p.group).collect();
    groups.sort_unstable();
    groups.dedup();
    let mut writes = Vec::new();
    for g in groups {
        let members: Vec<&GangPod> = pods.iter().filter(|p| p.group == Some(g)).collect();
        let (ready, reason, message) = verdict(g, group_size, &members);
        let status = if ready { "True" } else { "False" };
        for p in members.iter().filter(|p| p.gated && !p.terminating) {
            let same = p
                .current
                .as_ref()
                .is_some_and(|c| c.status == status && c.reason == reason);
            if !same {
                writes.push(GateWrite {
                    pod: p.name.clone(),
                    ready,
                    reason,
                    message: message.clone(),
                });
            }
        }
    }
    writes.sort_by(|a, b| a.pod.cmp(&b.pod));
    writes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, group: u32, ready: bool) -> GangPod {
        GangPod {
            name: name.into(),
            group: Some(group),
            revision: "r1".into(),
            containers_ready: ready,
            terminating: false,
            gated: true,
            current: None,
        }
    }

    fn with(mut p: GangPod, status: &str, reason: &str) -> GangPod {
        p.current = Some(GateCondition {
            status: status.into(),
            reason: reason.into(),
        });
        p
    }

    fn summary(w: &[GateWrite]) -> Vec<(String, bool, &'static str)> {
        w.iter()
            .map(|w| (w.pod.clone(), w.ready, w.reason))
            .collect()
    }

    #[test]
    fn a_whole_containers_ready_group_opens_the_gate_on_every_pod() {
        let w = decide(2, &[pod("g0-0", 0, true), pod("g0-1", 0, true)]);
        assert_eq!(
            summary(&w),
            vec![
                ("g0-0".into(), true, REASON_READY),
                ("g0-1".into(), true, REASON_READY)
            ]
        );
        assert_eq!(w[0].status(), "True");
        assert!(w[0].message.contains("all 2 pods"), "{}", w[0].message);
    }

    #[test]
    fn one_rank_not_containers_ready_closes_the_gate_on_all_of_them() {
        let pods = [
            with(pod("g0-0", 0, true), "True", REASON_READY),
            with(pod("g0-1", 0, false), "True", REASON_READY),
        ];
        let w = decide(2, &pods);
        assert_eq!(
            summary(&w),
            vec![
                ("g0-0".into(), false, REASON_NOT_READY),
                ("g0-1".into(), false, REASON_NOT_READY)
            ]
        );
        assert!(w[0].message.contains("not ready: g0-1"), "{}", w[0].message);
    }

    #[test]
    fn a_missing_or_terminating_rank_makes_the_group_incomplete() {
        let w = decide(2, &[pod("g0-0", 0, true)]);
        assert_eq!(summary(&w), vec![("g0-0".into(), false, REASON_INCOMPLETE)]);
        let mut gone = pod("g0-1", 0, true);
        gone.terminating = true;
        let w = decide(2, &[pod("g0-0", 0, true), gone]);
        // The terminating pod itself is not written.
        assert_eq!(summary(&w), vec![("g0-0".into(), false, REASON_INCOMPLETE)]);
        assert!(w[0].message.contains("1 terminating"), "{}", w[0].message);
    }

    #[test]
    fn mixed_revisions_keep_the_gate_closed_but_a_whole_old_group_stays_open() {
        let mut b = pod("g0-1", 0, true);
        b.revision = "r2".into();
        let w = decide(2, &[pod("g0-0", 0, true), b]);
        assert_eq!(
            summary(&w),
            vec![
                ("g0-0".into(), false, REASON_MIXED),
                ("g0-1".into(), false, REASON_MIXED)
            ]
        );
        // Any single revision is fine: the gate says "whole", the rollout says "current".
        let mut a = pod("g0-0", 0, true);
        let mut b = pod("g0-1", 0, true);
        a.revision = "old".into();
        b.revision = "old".into();
        assert_eq!(decide(2, &[a, b]).len(), 2);
    }

    #[test]
    fn steady_state_writes_nothing_and_only_a_changed_reason_rewrites() {
        let open = [
            with(pod("g0-0", 0, true), "True", REASON_READY),
            with(pod("g0-1", 0, true), "True", REASON_READY),
        ];
        assert_eq!(decide(2, &open), Vec::new());
        let closed = [
            with(pod("g0-0", 0, true), "False", REASON_NOT_READY),
            with(pod("g0-1", 0, false), "False", REASON_NOT_READY),
        ];
        assert_eq!(decide(2, &closed), Vec::new());
        // Same status, other reason: rewritten so the reason says why now.
        let stale = [with(pod("g0-0", 0, true), "False", REASON_NOT_READY)];
        assert_eq!(
            summary(&decide(2, &stale)),
            vec![("g0-0".into(), false, REASON_INCOMPLETE)]
        );
    }

    #[test]
    fn groups_are_judged_apart_and_ungated_or_single_pod_pools_are_left_alone() {
        let pods = [
            pod("g0-0", 0, true),
            pod("g0-1", 0, true),
            pod("g1-0", 1, true),
            pod("g1-1", 1, false),
        ];
        let w = decide(2, &pods);
        assert_eq!(
            summary(&w),
            vec![
                ("g0-0".into(), true, REASON_READY),
                ("g0-1".into(), true, REASON_READY),
                ("g1-0".into(), false, REASON_NOT_READY),
                ("g1-1".into(), false, REASON_NOT_READY)
            ]
        );
        assert_eq!(decide(1, &[pod("g0-0", 0, true)]), Vec::new());
        let mut legacy = pods.clone();
        for p in &mut legacy {
            p.gated = false;
        }
        assert_eq!(decide(2, &legacy), Vec::new());
        let mut unlabelled = pod("x", 0, true);
        unlabelled.group = None;
        assert_eq!(decide(2, &[unlabelled]), Vec::new());
    }
}
