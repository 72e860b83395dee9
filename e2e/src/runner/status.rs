//! The `PodStatus` a runner reports, built from its view of the processes (pure).
//!
//! Conditions follow the kubelet (`PodScheduled`, `PodReadyToStartContainers`, `Initialized`,
//! `ContainersReady`, `Ready`); a condition's `lastTransitionTime` changes only when its status
//! does ([`ConditionClock`]). Like the kubelet, `Ready` is `ContainersReady` **and** every
//! `spec.readinessGates` condition `True` ([`gate_views`], KEP-580); the gate conditions
//! themselves belong to whoever sets them (the operator's `serving.tandem.dev/group-ready`): the
//! runner never decides them, and since its merge patch replaces the `conditions` list whole, it
//! sends them back as it last saw them ([`keep_foreign_conditions`]) under a `resourceVersion`
//! precondition, so a write racing the owner's fails (409) instead of erasing it. The phase rule is the API's (`PodStatus.phase` docs): `Pending` until
//! every container started once, `Running` while any runs or will be restarted, `Succeeded` /
//! `Failed` once all terminated for good.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, HostIP, Pod, PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// A container's state as the runner tracks it.
#[derive(Debug, Clone, PartialEq)]
pub enum ContainerRun {
    /// Not running: preparing, image not mapped, config error, or back-off before a restart.
    Waiting {
        /// Machine-readable reason (`ContainerCreating`, `ErrImagePull`, `CrashLoopBackOff`, ...).
        reason: String,
        /// Human-readable detail.
        message: String,
    },
    /// The process runs.
    Running {
        /// When it started.
        started_at: Timestamp,
        /// Its readiness (probe result, or `true` without a probe).
        ready: bool,
    },
    /// The process exited.
    Terminated(Exit),
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Exit {
    /// Exit code (128 + signal when killed by a signal, as container runtimes report).
    pub exit_code: i32,
    /// The signal that ended it, if any.
    pub signal: Option<i32>,
    /// When it started.
    pub started_at: Timestamp,
    /// When it ended.
    pub finished_at: Timestamp,
}

impl Exit {
    /// `Completed` for exit code 0, else `Error` (the runtime's reasons).
    pub fn reason(&self) -> &'static str {
        if self.exit_code == 0 {
            "Completed"
        } else {
            "Error"
        }
    }
}

/// What the status builder needs about one container.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerView {
    /// Container name.
    pub name: String,
    /// Image reference from the spec.
    pub image: String,
    /// Current pid (for `containerID`).
    pub pid: Option<i32>,
    /// Restarts so far.
    pub restart_count: i32,
    /// Current state.
    pub run: ContainerRun,
    /// The previous termination, if it restarted.
    pub last_exit: Option<Exit>,
}

impl ContainerView {
    /// A container that has not started yet.
    pub fn creating(name: &str, image: &str) -> Self {
        Self {
            name: name.to_owned(),
            image: image.to_owned(),
            pid: None,
            restart_count: 0,
            run: ContainerRun::Waiting {
                reason: "ContainerCreating".into(),
                message: String::new(),
            },
            last_exit: None,
        }
    }

    /// Running and ready.
    pub fn ready(&self) -> bool {
        matches!(self.run, ContainerRun::Running { ready: true, .. })
    }
}

/// Remembers when each condition last changed.
#[derive(Debug, Clone, Default)]
pub struct ConditionClock {
    seen: BTreeMap<&'static str, (bool, Timestamp)>,
}

impl ConditionClock {
    /// Records `value` for `kind` at `now`; returns the last transition time.
    pub fn observe(&mut self, kind: &'static str, value: bool, now: Timestamp) -> Timestamp {
        match self.seen.get(kind) {
            Some((v, t)) if *v == value => *t,
            _ => {
                self.seen.insert(kind, (value, now));
                now
            }
        }
    }
}

/// One `spec.readinessGates` entry and the status of its condition in the pod now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateView {
    /// The gate's `conditionType`.
    pub condition_type: String,
    /// That condition's `status` (`True`/`False`/`Unknown`), or `None` when the pod has none.
    pub status: Option<String>,
}

/// The readiness gates of `pod` with their current condition statuses (pure; empty without gates).
pub fn gate_views(pod: &Pod) -> Vec<GateView> {
    let conditions = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    pod.spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_deref())
        .unwrap_or_default()
        .iter()
        .map(|g| GateView {
            condition_type: g.condition_type.clone(),
            status: conditions
                .iter()
                .find(|c| c.type_ == g.condition_type)
                .map(|c| c.status.clone()),
        })
        .collect()
}

/// The first readiness gate that holds `Ready` back, as the kubelet words it
/// (`pkg/kubelet/status/generate.go`); `None` when every gate's condition is `True`.
pub fn gates_not_ready(gates: &[GateView]) -> Option<String> {
    gates.iter().find_map(|g| match g.status.as_deref() {
        Some("True") => None,
        None => Some(format!(
            "corresponding condition of pod readiness gate \"{}\" does not exist.",
            g.condition_type
        )),
        Some(other) => Some(format!(
            "the status of pod readiness gate \"{}\" is not \"True\", but {other}",
            g.condition_type
        )),
    })
}

/// The condition types the runner reports itself (the kubelet's); every other condition type on a
/// pod belongs to someone else.
pub const OWNED_CONDITIONS: [&str; 5] = [
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
    "PodScheduled",
];

/// Appends to `status` the conditions of `pod` the runner does not own ([`OWNED_CONDITIONS`]),
/// unchanged: a JSON merge patch replaces the list whole, so this keeps them.
pub fn keep_foreign_conditions(status: &mut PodStatus, pod: &Pod) {
    let foreign = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|c| !OWNED_CONDITIONS.contains(&c.type_.as_str()))
        .cloned();
    status
        .conditions
        .get_or_insert_with(Vec::new)
        .extend(foreign);
}

/// Everything [`pod_status`] reports.
#[derive(Debug, Clone)]
pub struct PodView<'a> {
    /// `Pending`, `Running`, `Succeeded` or `Failed`.
    pub phase: &'a str,
    /// Assigned pod IP, once there is one.
    pub pod_ip: Option<&'a str>,
    /// The node's IP.
    pub host_ip: &'a str,
    /// When the runner accepted the pod.
    pub start_time: Timestamp,
    /// Init containers completed (or none declared).
    pub initialized: bool,
    /// Sandbox ready: the pod dir, IP and volumes are in place.
    pub sandbox_ready: bool,
    /// Init containers' views.
    pub init_containers: &'a [ContainerView],
    /// App containers' views.
    pub containers: &'a [ContainerView],
    /// Every native sidecar (restartable init container) is running and ready; their readiness
    /// counts for `ContainersReady`/`Ready` (KEP-753). `true` when there are none.
    pub sidecars_ready: bool,
    /// A pod-level reason/message (e.g. a config error), if any.
    pub message: Option<(&'a str, &'a str)>,
    /// The pod's readiness gates and their conditions now ([`gate_views`]).
    pub gates: &'a [GateView],
}

/// Builds the status object to patch into `pods/status`.
pub fn pod_status(view: &PodView<'_>, clock: &mut ConditionClock, now: Timestamp) -> PodStatus {
    let all_ready = !view.containers.is_empty()
        && view.containers.iter().all(ContainerView::ready)
        && view.sidecars_ready;
    let mut cond = |kind: &'static str, value: bool| PodCondition {
        type_: kind.to_owned(),
        status: if value { "True" } else { "False" }.to_owned(),
        last_transition_time: Some(Time(clock.observe(kind, value, now))),
        ..Default::default()
    };
    let gate_block = gates_not_ready(view.gates);
    let mut ready = cond("Ready", all_ready && gate_block.is_none());
    if all_ready && let Some(message) = gate_block {
        ready.reason = Some("ReadinessGatesNotReady".into());
        ready.message = Some(message);
    }
    let conditions = vec![
        cond("PodReadyToStartContainers", view.sandbox_ready),
        cond("Initialized", view.initialized),
        cond("ContainersReady", all_ready),
        ready,
        cond("PodScheduled", true),
    ];
    PodStatus {
        phase: Some(view.phase.to_owned()),
        conditions: Some(conditions),
        host_ip: Some(view.host_ip.to_owned()),
        host_ips: Some(vec![HostIP {
            ip: view.host_ip.to_owned(),
        }]),
        pod_ip: view.pod_ip.map(str::to_owned),
        pod_ips: view.pod_ip.map(|ip| vec![PodIP { ip: ip.to_owned() }]),
        start_time: Some(Time(view.start_time)),
        init_container_statuses: (!view.init_containers.is_empty())
            .then(|| view.init_containers.iter().map(container_status).collect()),
        container_statuses: Some(view.containers.iter().map(container_status).collect()),
        reason: view.message.map(|(r, _)| r.to_owned()),
        message: view.message.map(|(_, m)| m.to_owned()),
        // Set by the API server at creation and immutable (ValidatePodStatusUpdate): left out of
        // the merge patch, so a pod with resource requests keeps its Burstable/Guaranteed class.
        qos_class: None,
        ..Default::default()
    }
}

fn container_status(c: &ContainerView) -> ContainerStatus {
    let (state, started, ready) = match &c.run {
        ContainerRun::Waiting { reason, message } => (
            ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.clone()),
                    message: (!message.is_empty()).then(|| message.clone()),
                }),
                ..Default::default()
            },
            false,
            false,
        ),
        ContainerRun::Running { started_at, ready } => (
            ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(Time(*started_at)),
                }),
                ..Default::default()
            },
            true,
            *ready,
        ),
        ContainerRun::Terminated(exit) => (
            ContainerState {
                terminated: Some(terminated(exit)),
                ..Default::default()
            },
            false,
            false,
        ),
    };
    ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone(),
        image_id: format!("tandem-e2e-runner://{}", c.image),
        container_id: c.pid.map(|p| format!("process://{p}")),
        ready,
        started: Some(started),
        restart_count: c.restart_count,
        state: Some(state),
        last_state: c.last_exit.as_ref().map(|e| ContainerState {
            terminated: Some(terminated(e)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn terminated(e: &Exit) -> ContainerStateTerminated {
    ContainerStateTerminated {
        exit_code: e.exit_code,
        signal: e.signal,
        reason: Some(e.reason().to_owned()),
        started_at: Some(Time(e.started_at)),
        finished_at: Some(Time(e.finished_at)),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn ready_only_when_every_container_is_ready_and_transitions_are_stable() {
        let mut a = ContainerView::creating("a", "img");
        let b = ContainerView {
            run: ContainerRun::Running {
                started_at: ts(10),
                ready: true,
            },
            pid: Some(42),
            ..ContainerView::creating("b", "img")
        };
        let mut clock = ConditionClock::default();
        let cs = vec![a.clone(), b.clone()];
        let s = pod_status(&view(&cs), &mut clock, ts(20));
        let ready = |s: &PodStatus| {
            let conds = s.conditions.as_ref().unwrap();
            conds.iter().find(|c| c.type_ == "Ready").cloned().unwrap()
        };
        assert_eq!(ready(&s).status, "False");
        assert_eq!(s.pod_ip.as_deref(), Some("127.100.0.2"));
        let st = s.container_statuses.unwrap();
        assert_eq!(st[1].container_id.as_deref(), Some("process://42"));
        assert!(st[1].ready && !st[0].ready);

        a.run = ContainerRun::Running {
            started_at: ts(25),
            ready: true,
        };
        let cs = vec![a, b];
        let s1 = pod_status(&view(&cs), &mut clock, ts(30));
        assert_eq!(ready(&s1).status, "True");
        assert_eq!(ready(&s1).last_transition_time, Some(Time(ts(30))));
        let s2 = pod_status(&view(&cs), &mut clock, ts(40));
        assert_eq!(
            ready(&s2).last_transition_time,
            Some(Time(ts(30))),
            "unchanged status keeps its time"
        );
    }

    fn view(containers: &[ContainerView]) -> PodView<'_> {
        PodView {
            phase: "Running",
            pod_ip: Some("127.100.0.2"),
            host_ip: "127.100.0.1",
            start_time: ts(1),
            initialized: true,
            sandbox_ready: true,
            init_containers: &[],
            containers,
            sidecars_ready: true,
            message: None,
            gates: &[],
        }
    }

    fn running(name: &str) -> ContainerView {
        ContainerView {
            run: ContainerRun::Running {
                started_at: ts(10),
                ready: true,
            },
            ..ContainerView::creating(name, "img")
        }
    }

    fn condition(s: &PodStatus, type_: &str) -> PodCondition {
        let conds = s.conditions.as_ref().unwrap();
        conds.iter().find(|c| c.type_ == type_).cloned().unwrap()
    }

    #[test]
    fn ready_waits_for_every_readiness_gate_and_never_reports_the_gate_itself() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "a"}],
                     "readinessGates": [{"conditionType": "serving.tandem.dev/group-ready"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let gates = gate_views(&pod);
        assert_eq!(
            gates,
            vec![GateView {
                condition_type: "serving.tandem.dev/group-ready".into(),
                status: None
            }]
        );
        let cs = vec![running("a")];
        let mut clock = ConditionClock::default();
        let v = PodView {
            gates: &gates,
            ..view(&cs)
        };
        let s = pod_status(&v, &mut clock, ts(20));
        assert_eq!(condition(&s, "ContainersReady").status, "True");
        let ready = condition(&s, "Ready");
        assert_eq!(
            ready.status, "False",
            "a missing gate condition holds Ready"
        );
        assert_eq!(ready.reason.as_deref(), Some("ReadinessGatesNotReady"));
        assert!(
            ready.message.as_deref().unwrap().contains("does not exist"),
            "{ready:?}"
        );
        assert!(
            s.conditions
                .as_ref()
                .unwrap()
                .iter()
                .all(|c| c.type_ != "serving.tandem.dev/group-ready"),
            "the runner does not own the gate condition"
        );

        let mut gated = gates.clone();
        gated[0].status = Some("False".into());
        let s = pod_status(
            &PodView {
                gates: &gated,
                ..view(&cs)
            },
            &mut clock,
            ts(25),
        );
        let ready = condition(&s, "Ready");
        assert_eq!(ready.status, "False");
        assert!(
            ready.message.as_deref().unwrap().contains("but False"),
            "{ready:?}"
        );

        gated[0].status = Some("True".into());
        let s = pod_status(
            &PodView {
                gates: &gated,
                ..view(&cs)
            },
            &mut clock,
            ts(30),
        );
        let ready = condition(&s, "Ready");
        assert_eq!((ready.status.as_str(), ready.reason), ("True", None));
        assert_eq!(ready.last_transition_time, Some(Time(ts(30))));

        // The gate condition as the pod carries it is sent back unchanged, owned ones are not
        // duplicated.
        let mut seen = pod.clone();
        seen.status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .push(PodCondition {
                type_: "serving.tandem.dev/group-ready".into(),
                status: "True".into(),
                reason: Some("GroupReady".into()),
                ..Default::default()
            });
        let mut out = s.clone();
        keep_foreign_conditions(&mut out, &seen);
        let types: Vec<&str> = out
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.type_.as_str())
            .collect();
        assert_eq!(
            types,
            vec![
                "PodReadyToStartContainers",
                "Initialized",
                "ContainersReady",
                "Ready",
                "PodScheduled",
                "serving.tandem.dev/group-ready"
            ]
        );
        assert_eq!(
            out.conditions.as_ref().unwrap()[5].reason.as_deref(),
            Some("GroupReady")
        );

        // A container going unready wins over the gate: ContainersReady and Ready both False.
        let down = vec![ContainerView::creating("a", "img")];
        let s = pod_status(
            &PodView {
                gates: &gated,
                ..view(&down)
            },
            &mut clock,
            ts(40),
        );
        assert_eq!(condition(&s, "ContainersReady").status, "False");
        assert_eq!(condition(&s, "Ready").status, "False");
        assert_eq!(condition(&s, "Ready").reason, None);
    }

    #[test]
    fn terminated_state_and_last_state() {
        let exit = Exit {
            exit_code: 137,
            signal: Some(9),
            started_at: ts(1),
            finished_at: ts(2),
        };
        let c = ContainerView {
            run: ContainerRun::Terminated(exit.clone()),
            last_exit: Some(Exit {
                exit_code: 0,
                ..exit
            }),
            restart_count: 1,
            ..ContainerView::creating("a", "i")
        };
        let st = container_status(&c);
        let t = st.state.unwrap().terminated.unwrap();
        assert_eq!((t.exit_code, t.reason.as_deref()), (137, Some("Error")));
        assert_eq!(
            st.last_state.unwrap().terminated.unwrap().reason.as_deref(),
            Some("Completed")
        );
        assert_eq!(st.restart_count, 1);
    }
}
