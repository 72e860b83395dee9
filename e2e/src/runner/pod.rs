//! One pod on a runner node: prepare → start containers → probe → restart → terminate.
//!
//! A supervisor task per pod owns the processes. It steps every [`TICK`]: prepares the pod once
//! (fetches ConfigMaps, Secrets and service-account tokens, writes volumes, builds each container's
//! root, environment and argv), runs init containers in order, starts and restarts app containers
//! (`restartPolicy`, back-off 1 s doubling to 10 s), runs readiness probes, refreshes projected
//! tokens at 80 % of their lifetime, and patches `pods/status` when it changed.
//!
//! Native sidecars (KEP-753: init containers with `restartPolicy: Always`) start in their place in
//! the init sequence and the sequence moves on once they run and, when they have a
//! `startupProbe`, once it passed (readiness probes of any container run only after its startup
//! probe passed; one failing past its threshold is not restarted here); they are restarted whenever they exit
//! (whatever the pod's policy), their readiness counts for the pod's, and they are stopped after
//! the main containers — when all of those finished for good, or on deletion.
//!
//! Deletion (a `deletionTimestamp` appears): SIGTERM to the main containers' process groups, up to
//! the pod's `deletionGracePeriodSeconds` for them to exit, then SIGTERM to the sidecars one by one
//! in reverse order within what is left of the grace period, SIGKILL to what is left, then the pod
//! is deleted with grace 0 (uid precondition) so the API object goes — the kubelet's sequence.
//!
//! `persistentVolumeClaim` volumes are the bound volume's directory ([`super::storage`]); every
//! container gets `TANDEM_HOSTS_FILE` ([`super::hosts`]) and the runner's extra env.

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret, ServiceAccount};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client};
use rustix::process::Signal;
use tokio::process::Child;
use tokio::sync::{mpsc, watch};

use super::env::{PodAddresses, PodSources, container_env, expand_all, referenced_objects};
use super::hosts::HOSTS_FILE_ENV;
use super::image::ImageTable;
use super::pod_ip::PodIpAllocator;
use super::probe::{ProbeState, run_probe};
use super::status::{
    ConditionClock, ContainerRun, ContainerView, Exit, PodView, gate_views,
    keep_foreign_conditions, pod_status,
};
use super::storage::claim_directory;
use super::volumes::{ROOT_ENV, Tokens, link_mounts, plan_volume, token_needs, write_volume};
use crate::pidfile::ProcessId;

/// How often a supervisor steps.
pub const TICK: Duration = Duration::from_millis(250);
/// Back-off cap between restarts of a crashing container.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// Where kube-rs and client-go look for the service-account files.
pub const SERVICE_ACCOUNT_DIR: &str = "var/run/secrets/kubernetes.io/serviceaccount";

/// Messages from the node's pod watcher to a supervisor.
#[derive(Debug)]
pub(crate) enum PodMsg {
    /// The object changed (maybe a deletionTimestamp appeared).
    Update(Box<Pod>),
    /// The object is gone from the API (force-deleted): stop at once.
    Gone,
}

/// What every supervisor of one node shares.
pub(crate) struct NodeContext {
    pub client: Client,
    pub node: String,
    pub node_ip: Ipv4Addr,
    pub ips: Mutex<PodIpAllocator>,
    pub images: ImageTable,
    /// The runner dir: `pods/<ns>_<name>_<uid>/` and `pids/`.
    pub dir: PathBuf,
    /// API server port on 127.0.0.1 (`KUBERNETES_SERVICE_PORT`).
    pub api_port: u16,
    /// The runner's hosts file (`TANDEM_HOSTS_FILE`).
    pub hosts_file: PathBuf,
    /// Extra env for every container (`--pod-env`).
    pub pod_env: Vec<(String, String)>,
}

struct Slot {
    spec: Container,
    view: ContainerView,
    child: Option<Child>,
    id: Option<ProcessId>,
    probe: Option<ProbeState>,
    env: Vec<(String, String)>,
    root: PathBuf,
    retry_at: Option<Instant>,
    /// Terminated for good (no restart under the policy).
    done: bool,
    /// Started at least once.
    ever_started: bool,
    /// A native sidecar: an init container with `restartPolicy: Always`.
    sidecar: bool,
    /// The startup probe's state (`startupProbe`), if the container has one.
    startup: Option<ProbeState>,
    /// The startup probe passed in the current run (always, without one): readiness is probed
    /// only from then on.
    started: bool,
    /// `started` was true at least once: a native sidecar holds the init sequence until then
    /// (its restarts later do not).
    started_once: bool,
}

struct TokenState {
    refresh_at: Instant,
}

struct Supervisor {
    ctx: Arc<NodeContext>,
    pod: Pod,
    api: Api<Pod>,
    name: String,
    uid: String,
    ip: Ipv4Addr,
    dir: PathBuf,
    start_time: Timestamp,
    clock: ConditionClock,
    prepared: bool,
    prepare_retry_at: Option<Instant>,
    tokens: Option<TokenState>,
    init: Vec<Slot>,
    app: Vec<Slot>,
    failed: bool,
    last_status: Option<serde_json::Value>,
}

/// Runs the pod until it is deleted (or the runner shuts down, `shutdown` turning true: then the
/// processes are stopped but the API object is left alone).
pub(crate) async fn supervise(
    ctx: Arc<NodeContext>,
    pod: Pod,
    mut rx: mpsc::UnboundedReceiver<PodMsg>,
    mut shutdown: watch::Receiver<bool>,
) {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let ip = match ctx.ips.lock().map(|mut a| a.allocate()) {
        Ok(Ok(ip)) => ip,
        other => {
            tracing::error!(pod = %name, "no pod IP: {other:?}");
            return;
        }
    };
    let dir = ctx.dir.join("pods").join(format!("{ns}_{name}_{uid}"));
    let spec = pod.spec.clone().unwrap_or_default();
    let slot = |c: &Container| Slot {
        view: ContainerView::creating(&c.name, c.image.as_deref().unwrap_or("")),
        probe: c.readiness_probe.as_ref().map(ProbeState::new),
        spec: c.clone(),
        child: None,
        id: None,
        env: Vec::new(),
        root: dir.join("containers").join(&c.name).join("root"),
        retry_at: None,
        done: false,
        ever_started: false,
        sidecar: c.restart_policy.as_deref() == Some("Always"),
        startup: c.startup_probe.as_ref().map(ProbeState::new),
        started: false,
        started_once: false,
    };
    let mut sup = Supervisor {
        api: Api::namespaced(ctx.client.clone(), &ns),
        init: spec.init_containers.iter().flatten().map(slot).collect(),
        app: spec.containers.iter().map(slot).collect(),
        ctx,
        pod,
        name,
        uid,
        ip,
        dir,
        start_time: Timestamp::now(),
        clock: ConditionClock::default(),
        prepared: false,
        prepare_retry_at: None,
        tokens: None,
        failed: false,
        last_status: None,
    };
    tracing::info!(pod = %sup.name, ip = %sup.ip, node = %sup.ctx.node, "pod accepted");
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let outcome = loop {
        if sup.pod.metadata.deletion_timestamp.is_some() {
            break End::Deleted;
        }
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(PodMsg::Update(p)) => sup.pod = *p,
                Some(PodMsg::Gone) => break End::Gone,
                None => break End::Shutdown,
            },
            _ = shutdown.changed() => break End::Shutdown,
            _ = tick.tick() => sup.step().await,
        }
    };
    let grace = match outcome {
        End::Deleted => sup.deletion_grace(),
        End::Gone => Duration::from_secs(2),
        End::Shutdown => Duration::from_secs(5),
    };
    sup.stop_processes(grace).await;
    if outcome == End::Deleted {
        sup.delete_object().await;
    }
    sup.cleanup();
    tracing::info!(pod = %sup.name, "pod finished ({outcome:?})");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Deleted,
    Gone,
    Shutdown,
}

impl Supervisor {
    async fn step(&mut self) {
        let now = Instant::now();
        if !self.prepared {
            if self.prepare_retry_at.is_some_and(|t| now < t) {
                return;
            }
            match self.prepare().await {
                Ok(()) => self.prepared = true,
                Err(message) => {
                    tracing::warn!(pod = %self.name, "prepare: {message}");
                    for s in self.init.iter_mut().chain(self.app.iter_mut()) {
                        s.view.run = ContainerRun::Waiting {
                            reason: "CreateContainerConfigError".into(),
                            message: message.clone(),
                        };
                    }
                    self.prepare_retry_at = Some(now + Duration::from_secs(2));
                    self.publish().await;
                    return;
                }
            }
        }
        self.refresh_tokens_if_due().await;
        self.probe_startup(now).await;
        let initialized = self.run_init(now);
        if initialized && !self.failed {
            let policy = self.restart_policy();
            for i in 0..self.app.len() {
                self.reap(i, &policy, now);
                self.start_if_due(i, now);
            }
            self.probe(now).await;
            if !self.app.is_empty() && self.app.iter().all(|s| s.done) {
                // The main containers finished for good: the sidecars go too.
                let grace = self.deletion_grace();
                self.stop_sidecars(Instant::now() + grace).await;
            }
        }
        self.publish().await;
    }

    /// Whether the init sequence is through: regular init containers succeeded, sidecars started
    /// (and passed their startup probe once, when they have one).
    fn initialized(&self) -> bool {
        self.prepared
            && self
                .init
                .iter()
                .all(|s| s.done || (s.sidecar && s.ever_started && s.started_once))
    }

    fn restart_policy(&self) -> String {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into())
    }

    /// Init containers one at a time; true when all succeeded (sidecars: started). Sidecars that
    /// started are kept running: restarted with back-off whenever they exit.
    fn run_init(&mut self, now: Instant) -> bool {
        let policy = self.restart_policy();
        for i in 0..self.init.len() {
            if self.init[i].done {
                continue;
            }
            if self.init[i].sidecar {
                if let Some(exit) = try_reap(&mut self.init[i]) {
                    tracing::info!(pod = %self.name, container = %self.init[i].spec.name, code = exit.exit_code, "sidecar exited");
                    self.init[i].view.run = ContainerRun::Terminated(exit);
                    schedule_restart(&mut self.init[i], now);
                }
                let slot = &self.init[i];
                let first_start = !slot.ever_started;
                if slot.child.is_none() && slot.retry_at.is_none_or(|t| now >= t) {
                    self.start_slot(true, i, now);
                    if first_start {
                        // The sequence moves on at the next step, with the sidecar seen running
                        // (the kubelet waits for the container to be reported started).
                        return false;
                    }
                }
                if !self.init[i].ever_started {
                    return false;
                }
                if !self.init[i].started_once {
                    // The kubelet starts the next container only once a sidecar's startup
                    // probe passed.
                    return false;
                }
                continue;
            }
            if let Some(exit) = try_reap(&mut self.init[i]) {
                let ok = exit.exit_code == 0;
                let slot = &mut self.init[i];
                slot.view.run = ContainerRun::Terminated(exit);
                if ok {
                    slot.done = true;
                    continue;
                }
                if policy == "Never" {
                    slot.done = true;
                    self.failed = true;
                    return false;
                }
                schedule_restart(slot, now);
                return false;
            }
            if self.init[i].child.is_none() {
                self.start_slot(true, i, now);
            }
            return false;
        }
        true
    }

    fn reap(&mut self, i: usize, policy: &str, now: Instant) {
        let slot = &mut self.app[i];
        let Some(exit) = try_reap(slot) else { return };
        tracing::info!(pod = %self.name, container = %slot.spec.name, code = exit.exit_code, "container exited");
        let restart = match policy {
            "Never" => false,
            "OnFailure" => exit.exit_code != 0,
            _ => true,
        };
        slot.view.run = ContainerRun::Terminated(exit);
        if restart {
            schedule_restart(slot, now);
        } else {
            slot.done = true;
        }
    }

    fn start_if_due(&mut self, i: usize, now: Instant) {
        let slot = &self.app[i];
        if slot.child.is_some() || slot.done || slot.retry_at.is_some_and(|t| now < t) {
            return;
        }
        self.start_slot(false, i, now);
    }

    fn start_slot(&mut self, init: bool, i: usize, now: Instant) {
        let pid_dir = self.ctx.dir.join("pids");
        let images = &self.ctx.images;
        let uid = &self.uid;
        let log_dir = self.dir.join("logs");
        let slot = if init {
            &mut self.init[i]
        } else {
            &mut self.app[i]
        };
        let image = slot.spec.image.clone().unwrap_or_default();
        let command = expand_all(slot.spec.command.as_deref().unwrap_or(&[]), &slot.env);
        let args = expand_all(slot.spec.args.as_deref().unwrap_or(&[]), &slot.env);
        let argv = match images.argv(&image, &command, &args) {
            Ok(a) => a,
            Err(e) => {
                slot.view.run = ContainerRun::Waiting {
                    reason: "ErrImagePull".into(),
                    message: e.to_string(),
                };
                slot.retry_at = Some(now + Duration::from_secs(5));
                return;
            }
        };
        let cwd = match slot.spec.working_dir.as_deref() {
            Some(w) if !w.is_empty() => slot.root.join(w.trim_start_matches('/')),
            _ => slot.root.clone(),
        };
        match spawn(
            &argv,
            &slot.env,
            &cwd,
            &log_dir.join(format!("{}.log", slot.spec.name)),
        ) {
            Ok(child) => {
                let pid = child.id().map(|p| p as i32);
                let id = pid.and_then(ProcessId::of_pid);
                if let Some(id) = id {
                    let file = pid_dir.join(format!("{uid}-{}.pid", slot.spec.name));
                    if let Err(e) = id.write(&file) {
                        tracing::warn!("{e}");
                    }
                }
                if slot.ever_started {
                    slot.view.restart_count += 1;
                }
                slot.ever_started = true;
                slot.view.pid = pid;
                slot.id = id;
                slot.child = Some(child);
                slot.retry_at = None;
                let started_at = Timestamp::now();
                if let Some(p) = slot.probe.as_mut() {
                    p.restart(now);
                }
                if let Some(p) = slot.startup.as_mut() {
                    p.restart(now);
                }
                slot.started = slot.startup.is_none();
                slot.started_once |= slot.started;
                slot.view.run = ContainerRun::Running {
                    started_at,
                    ready: slot.probe.is_none(),
                };
                tracing::info!(container = %slot.spec.name, ?argv, "container started");
            }
            Err(e) => {
                slot.view.run = ContainerRun::Waiting {
                    reason: "RunContainerError".into(),
                    message: format!("{}: {e}", argv[0]),
                };
                schedule_restart(slot, now);
            }
        }
    }

    /// Runs the due startup probes of running containers whose startup has not passed in this
    /// run. One that fails past its `failureThreshold` is not restarted here (the kubelet would
    /// kill it): it just never counts as started.
    async fn probe_startup(&mut self, now: Instant) {
        let ip = IpAddr::V4(self.ip);
        for slot in self.init.iter_mut().chain(self.app.iter_mut()) {
            if slot.started || slot.child.is_none() {
                continue;
            }
            let (Some(state), Some(spec)) =
                (slot.startup.as_mut(), slot.spec.startup_probe.as_ref())
            else {
                continue;
            };
            if !state.due(now) {
                continue;
            }
            let ok = run_probe(spec, &slot.spec, ip, &slot.env, &slot.root, state.timeout()).await;
            if state.record(ok, Instant::now()) {
                slot.started = true;
                slot.started_once = true;
                tracing::info!(pod = %self.name, container = %slot.spec.name, "startup probe passed");
            }
        }
    }

    async fn probe(&mut self, now: Instant) {
        let ip = IpAddr::V4(self.ip);
        let sidecars = self.init.iter_mut().filter(|s| s.sidecar);
        for slot in sidecars.chain(self.app.iter_mut()) {
            if !slot.started {
                // Readiness is probed only once the startup probe passed.
                continue;
            }
            let ContainerRun::Running { started_at, .. } = slot.view.run else {
                continue;
            };
            let (Some(state), Some(spec)) =
                (slot.probe.as_mut(), slot.spec.readiness_probe.as_ref())
            else {
                continue;
            };
            if !state.due(now) {
                continue;
            }
            let ok = run_probe(spec, &slot.spec, ip, &slot.env, &slot.root, state.timeout()).await;
            let ready = state.record(ok, Instant::now());
            record_probe(&slot.root, ok, ready);
            slot.view.run = ContainerRun::Running { started_at, ready };
        }
    }

    fn phase(&self) -> &'static str {
        if self.failed {
            return "Failed";
        }
        if !self.initialized() {
            return "Pending";
        }
        if !self.app.is_empty() && self.app.iter().all(|s| s.done) {
            let all_ok = self
                .app
                .iter()
                .all(|s| matches!(&s.view.run, ContainerRun::Terminated(e) if e.exit_code == 0));
            return if all_ok { "Succeeded" } else { "Failed" };
        }
        if self.app.iter().all(|s| s.ever_started) {
            "Running"
        } else {
            "Pending"
        }
    }

    async fn publish(&mut self) {
        let ip = self.ip.to_string();
        let host = self.ctx.node_ip.to_string();
        let init_views: Vec<ContainerView> = self.init.iter().map(|s| s.view.clone()).collect();
        let app_views: Vec<ContainerView> = self.app.iter().map(|s| s.view.clone()).collect();
        let gates = gate_views(&self.pod);
        let view = PodView {
            phase: self.phase(),
            pod_ip: self.prepared.then_some(ip.as_str()),
            host_ip: &host,
            start_time: self.start_time,
            initialized: self.initialized(),
            sandbox_ready: self.prepared,
            init_containers: &init_views,
            containers: &app_views,
            sidecars_ready: self
                .init
                .iter()
                .filter(|s| s.sidecar)
                .all(|s| s.view.ready()),
            message: None,
            gates: &gates,
        };
        let mut status = pod_status(&view, &mut self.clock, Timestamp::now());
        keep_foreign_conditions(&mut status, &self.pod);
        let Ok(value) = serde_json::to_value(&status) else {
            return;
        };
        if self.last_status.as_ref() == Some(&value) {
            return;
        }
        // The merge patch replaces `conditions` whole: the precondition makes a write that raced
        // another condition owner (the operator's readiness gate) fail instead of erasing it.
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": self.pod.metadata.resource_version },
            "status": value,
        });
        match self
            .api
            .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(pod) => {
                self.pod = pod;
                self.last_status = Some(value);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                // Someone wrote the pod since we read it: reread, and publish again next tick.
                tracing::debug!(pod = %self.name, "status patch conflict; rereading the pod");
                if let Ok(pod) = self.api.get_status(&self.name).await {
                    self.pod = pod;
                }
            }
            Err(e) => tracing::warn!(pod = %self.name, "status patch: {e}"),
        }
    }

    /// Fetches what the pod references and writes volumes and container roots.
    async fn prepare(&mut self) -> Result<(), String> {
        let ns = self.pod.metadata.namespace.clone().unwrap_or_default();
        let (cms, secrets) = referenced_objects(&self.pod);
        let mut sources = PodSources::default();
        let cm_api: Api<ConfigMap> = Api::namespaced(self.ctx.client.clone(), &ns);
        for n in cms {
            if let Some(cm) = cm_api
                .get_opt(&n)
                .await
                .map_err(|e| format!("configmap {n}: {e}"))?
            {
                sources.config_maps.insert(n, cm);
            }
        }
        let s_api: Api<Secret> = Api::namespaced(self.ctx.client.clone(), &ns);
        for n in secrets {
            if let Some(s) = s_api
                .get_opt(&n)
                .await
                .map_err(|e| format!("secret {n}: {e}"))?
            {
                sources.secrets.insert(n, s);
            }
        }
        let tokens = self.fetch_tokens().await?;
        let addrs = self.addresses();
        let volumes = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.clone())
            .unwrap_or_default();
        for v in &volumes {
            if let Some(claim) = &v.persistent_volume_claim {
                let target = claim_directory(&self.ctx.client, &ns, &claim.claim_name)
                    .await
                    .map_err(|e| format!("volume {}: {e}", v.name))?;
                link_volume(&self.volume_dir(&v.name), &target)
                    .map_err(|e| format!("volume {}: {e}", v.name))?;
                continue;
            }
            let files =
                plan_volume(&self.pod, v, &addrs, &sources, &tokens).map_err(|e| e.to_string())?;
            write_volume(&self.volume_dir(&v.name), files.as_deref()).map_err(|e| e.to_string())?;
        }
        let vol_root = self.dir.join("volumes");
        for slot in self.init.iter().chain(self.app.iter()) {
            link_mounts(&slot.root, &slot.spec, &volumes, |n| vol_root.join(n))
                .map_err(|e| e.to_string())?;
        }
        let bases: Vec<_> = self
            .init
            .iter()
            .chain(self.app.iter())
            .map(|s| self.base_env(&s.root, &s.spec))
            .collect();
        for (slot, base) in self.init.iter_mut().chain(self.app.iter_mut()).zip(bases) {
            slot.env = container_env(&self.pod, &slot.spec, &addrs, &sources, &base)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn addresses(&self) -> PodAddresses {
        PodAddresses {
            pod_ip: self.ip.to_string(),
            host_ip: self.ctx.node_ip.to_string(),
        }
    }

    fn volume_dir(&self, name: &str) -> PathBuf {
        self.dir.join("volumes").join(name)
    }

    /// The runner's variables, before envFrom/env (documented in e2e/README.md).
    fn base_env(&self, root: &Path, c: &Container) -> Vec<(String, String)> {
        let mut env = vec![
            (
                "PATH".to_owned(),
                std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
            ),
            ("HOME".to_owned(), root.display().to_string()),
            ("HOSTNAME".to_owned(), self.name.clone()),
            ("KUBERNETES_SERVICE_HOST".to_owned(), "127.0.0.1".to_owned()),
            (
                "KUBERNETES_SERVICE_PORT".to_owned(),
                self.ctx.api_port.to_string(),
            ),
            (
                "KUBERNETES_SERVICE_PORT_HTTPS".to_owned(),
                self.ctx.api_port.to_string(),
            ),
            (ROOT_ENV.to_owned(), root.display().to_string()),
            (
                HOSTS_FILE_ENV.to_owned(),
                self.ctx.hosts_file.display().to_string(),
            ),
        ];
        for pass in ["RUST_LOG", "RUST_BACKTRACE"] {
            if let Ok(v) = std::env::var(pass) {
                env.push((pass.to_owned(), v));
            }
        }
        env.extend(self.ctx.pod_env.iter().cloned());
        let sa_mount = format!("/{SERVICE_ACCOUNT_DIR}");
        if c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path.trim_end_matches('/') == sa_mount)
        {
            let sa_dir = root.join(SERVICE_ACCOUNT_DIR);
            let ns = self.pod.metadata.namespace.clone().unwrap_or_default();
            let kubeconfig = root.join("..").join("in-cluster.kubeconfig");
            let text = in_cluster_kubeconfig(self.ctx.api_port, &sa_dir, &ns);
            if std::fs::write(&kubeconfig, text).is_ok() {
                env.push(("KUBECONFIG".to_owned(), kubeconfig.display().to_string()));
            }
            env.push((
                "TANDEM_SERVICEACCOUNT_DIR".to_owned(),
                sa_dir.display().to_string(),
            ));
        }
        env
    }

    async fn fetch_tokens(&mut self) -> Result<Tokens, String> {
        let needs = token_needs(&self.pod);
        let mut tokens = Tokens::new();
        if needs.is_empty() {
            return Ok(tokens);
        }
        let ns = self.pod.metadata.namespace.clone().unwrap_or_default();
        let sa = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let api: Api<ServiceAccount> = Api::namespaced(self.ctx.client.clone(), &ns);
        let mut shortest = i64::MAX;
        for need in needs {
            let request = TokenRequest {
                spec: Some(TokenRequestSpec {
                    audiences: need.audience.clone().map(|a| vec![a]),
                    expiration_seconds: Some(need.expiration_seconds),
                    bound_object_ref: Some(BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: Some(self.name.clone()),
                        uid: Some(self.uid.clone()),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let got = api
                .create_token_request(&sa, &PostParams::default(), &request)
                .await
                .map_err(|e| format!("token for serviceaccount {ns}/{sa}: {e}"))?;
            let token = got
                .status
                .and_then(|s| s.token)
                .ok_or("empty TokenRequest status")?;
            shortest = shortest.min(need.expiration_seconds);
            tokens.insert((need.volume, need.index), token);
        }
        let refresh = Duration::from_secs((shortest.max(600) as u64) * 8 / 10);
        self.tokens = Some(TokenState {
            refresh_at: Instant::now() + refresh,
        });
        Ok(tokens)
    }

    async fn refresh_tokens_if_due(&mut self) {
        let Some(state) = &self.tokens else { return };
        if Instant::now() < state.refresh_at {
            return;
        }
        let tokens = match self.fetch_tokens().await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(pod = %self.name, "token refresh: {e}");
                if let Some(s) = self.tokens.as_mut() {
                    s.refresh_at = Instant::now() + Duration::from_secs(10);
                }
                return;
            }
        };
        for v in self
            .pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
        {
            let Some(p) = &v.projected else { continue };
            for (index, src) in p.sources.iter().flatten().enumerate() {
                let (Some(t), Some(token)) = (
                    &src.service_account_token,
                    tokens.get(&(v.name.clone(), index)),
                ) else {
                    continue;
                };
                let path = self.volume_dir(&v.name).join(&t.path);
                let tmp = path.with_extension("tmp");
                // Atomic replace: a reader sees the old or the new token, never a partial one.
                if let Err(e) =
                    std::fs::write(&tmp, token).and_then(|()| std::fs::rename(&tmp, &path))
                {
                    tracing::warn!("{}: {e}", path.display());
                }
            }
        }
    }

    fn deletion_grace(&self) -> Duration {
        let secs = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30);
        Duration::from_secs(secs.max(0) as u64)
    }

    /// The kubelet's stop order: SIGTERM to the main (and running regular init) containers, wait
    /// for them up to `grace`; then the sidecars in reverse order, each SIGTERMed and awaited in
    /// turn within what is left of `grace`; SIGKILL whatever still runs at the deadline; reap all.
    async fn stop_processes(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let main = self
            .init
            .iter_mut()
            .filter(|s| !s.sidecar)
            .chain(self.app.iter_mut());
        terminate(main.collect(), deadline).await;
        self.stop_sidecars(deadline).await;
        for s in self.init.iter().chain(self.app.iter()) {
            let file = self
                .ctx
                .dir
                .join("pids")
                .join(format!("{}-{}.pid", self.uid, s.spec.name));
            let _ = std::fs::remove_file(file);
        }
    }

    /// Stops the sidecars for good, last declared first, each within `deadline`.
    async fn stop_sidecars(&mut self, deadline: Instant) {
        for s in self.init.iter_mut().rev().filter(|s| s.sidecar) {
            s.done = true;
            if s.child.is_some() {
                tracing::info!(pod = %self.name, container = %s.spec.name, "stopping sidecar");
                terminate(vec![s], deadline).await;
            }
        }
    }

    async fn delete_object(&self) {
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.api.delete(&self.name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => tracing::warn!(pod = %self.name, "final delete: {e}"),
        }
    }

    fn cleanup(&self) {
        if let Ok(mut ips) = self.ctx.ips.lock() {
            ips.release(self.ip);
        }
        if std::env::var_os("TANDEM_E2E_KEEP_POD_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// SIGTERM to each slot's process group, wait until they exited or `deadline`, SIGKILL the rest;
/// every process is reaped and its state recorded.
async fn terminate(mut live: Vec<&mut Slot>, deadline: Instant) {
    live.retain(|s| s.child.is_some());
    for s in &live {
        if let Some(id) = s.id {
            id.signal(Signal::TERM, true);
        }
    }
    loop {
        live.retain_mut(|s| match try_reap(s) {
            Some(exit) => {
                s.view.run = ContainerRun::Terminated(exit);
                false
            }
            None => true,
        });
        if live.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for s in live {
        if let Some(id) = s.id {
            id.signal(Signal::KILL, true);
        }
        if let Some(mut child) = s.child.take() {
            let _ = child.wait().await;
        }
        s.id = None;
    }
}

/// Makes `link` (a pod's volume dir) a symlink to `target` (a claim's directory).
fn link_volume(link: &Path, target: &Path) -> std::io::Result<()> {
    if let Some(parent) = link.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match link.symlink_metadata() {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(link)?,
        Ok(_) => std::fs::remove_file(link)?,
        Err(_) => {}
    }
    std::os::unix::fs::symlink(target, link)
}

/// Takes the exit of a slot's process, if it ended.
fn try_reap(slot: &mut Slot) -> Option<Exit> {
    let child = slot.child.as_mut()?;
    let status = child.try_wait().ok()??;
    slot.child = None;
    slot.id = None;
    let started_at = match slot.view.run {
        ContainerRun::Running { started_at, .. } => started_at,
        _ => Timestamp::now(),
    };
    let signal = status.signal();
    Some(Exit {
        exit_code: status.code().unwrap_or_else(|| 128 + signal.unwrap_or(0)),
        signal,
        started_at,
        finished_at: Timestamp::now(),
    })
}

fn schedule_restart(slot: &mut Slot, now: Instant) {
    let backoff = Duration::from_secs(1u64 << slot.view.restart_count.clamp(0, 4)).min(MAX_BACKOFF);
    if let ContainerRun::Terminated(exit) = &slot.view.run {
        slot.view.last_exit = Some(exit.clone());
    }
    slot.view.run = ContainerRun::Waiting {
        reason: "CrashLoopBackOff".into(),
        message: format!(
            "back-off {}s restarting failed container",
            backoff.as_secs()
        ),
    };
    slot.retry_at = Some(now + backoff);
}

fn spawn(
    argv: &[String],
    env: &[(String, String)],
    cwd: &Path,
    log: &Path,
) -> std::io::Result<Child> {
    std::fs::create_dir_all(cwd)?;
    if let Some(parent) = log.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let err = out.try_clone()?;
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("empty argv"))?;
    // The PATH a container sees resolves the program, as exec in the container would.
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone());
    let program = resolve_program(program, path.as_deref());
    tokio::process::Command::new(program)
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        // Own process group: termination signals reach the whole container (sh -c children too).
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
}

fn resolve_program(program: &str, path: Option<&str>) -> PathBuf {
    if program.contains('/') {
        return PathBuf::from(program);
    }
    for dir in path.unwrap_or("").split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(program);
        if candidate.is_file() {
            return candidate;
        }
    }
    PathBuf::from(program)
}

/// A kubeconfig that authenticates with the projected token (re-read by kube-rs and client-go as
/// it rotates) and trusts the projected `ca.crt`.
pub fn in_cluster_kubeconfig(api_port: u16, sa_dir: &Path, namespace: &str) -> String {
    let sa = sa_dir.display();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: in-cluster\n  cluster:\n    server: https://127.0.0.1:{api_port}\n    certificate-authority: {sa}/ca.crt\nusers:\n- name: serviceaccount\n  user:\n    tokenFile: {sa}/token\ncontexts:\n- name: in-cluster\n  context: {{cluster: in-cluster, user: serviceaccount, namespace: {namespace}}}\ncurrent-context: in-cluster\n"
    )
}

/// Appends one readiness-probe result to `<container dir>/probe.log` (`ok|fail ready=<bool>`, one
/// line per attempt), beside the container's `root`: what a kubelet reports as `Unhealthy` events,
/// and what tests wait on to know a probe ran (instead of sleeping). A write failure is logged and
/// changes nothing else.
fn record_probe(root: &Path, ok: bool, ready: bool) {
    use std::io::Write as _;
    let Some(dir) = root.parent() else { return };
    let line = format!("{} ready={ready}\n", if ok { "ok" } else { "fail" });
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("probe.log"))
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        tracing::debug!(dir = %dir.display(), error = %e, "probe.log not written");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_cluster_kubeconfig_parses_and_points_at_the_projected_files() {
        let text = in_cluster_kubeconfig(
            26443,
            Path::new("/r/var/run/secrets/kubernetes.io/serviceaccount"),
            "ns1",
        );
        let kc = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        let cluster = kc.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:26443"));
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(
            user.token_file.as_deref(),
            Some("/r/var/run/secrets/kubernetes.io/serviceaccount/token")
        );
    }

    #[test]
    fn program_resolution_uses_the_container_path() {
        assert_eq!(resolve_program("/abs/x", None), PathBuf::from("/abs/x"));
        let sh = resolve_program("sh", Some("/nonexistent:/bin:/usr/bin"));
        assert!(sh.is_absolute(), "{sh:?}");
        assert_eq!(
            resolve_program("no-such-program-xyz", Some("/bin")),
            PathBuf::from("no-such-program-xyz")
        );
    }
}
