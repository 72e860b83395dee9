//! The process runner: a minimal kubelet for tests (DESIGN §6, issue 4).
//!
//! It registers nodes with `nvidia.com/gpu` capacity ([`node`]), keeps them Ready (Lease + status
//! heartbeats), watches the pods bound to them and runs each container as a local process chosen
//! by image name ([`image`]): `…/tandem-worker` → the workspace's `tandem-worker` binary,
//! `…/tandem-operator` → `tandem-operator`. Each pod gets its own 127.x.y.z address
//! ([`pod_ip`]), its ConfigMap/Secret/downward/projected volumes as files under a per-container
//! root announced in `TANDEM_ROOT` ([`volumes`]), the service-account token from the TokenRequest
//! API, and `KUBERNETES_SERVICE_HOST/PORT` pointing at the local API server. Status (phase, podIP,
//! container states, readiness from the readiness probe) is reported by [`pod`]'s supervisor, and
//! deletion follows the kubelet: SIGTERM, grace period, SIGKILL, delete with grace 0. Native
//! sidecars (init containers with `restartPolicy: Always`) start before the main containers and
//! stop after them.
//!
//! Cluster-level emulation, one task each per runner: Services as a hosts file written from
//! EndpointSlices ([`hosts`], path in every pod's `TANDEM_HOSTS_FILE`), and `persistentVolumeClaim`
//! volumes of the `tandem-e2e-local` class provisioned as directories under the runner dir
//! ([`storage`]).
//!
//! Crashes on demand ([`crash`]): a container's process group SIGKILLed from outside, which the
//! pod's supervisor restarts in place (same pod IP and ports) under the pod's `restartPolicy`.
//!
//! What it is not: no images, no isolation (processes share the host's filesystem, users and
//! network namespace), no kube-proxy (ClusterIPs are not routed; names resolve through the hosts
//! file), no liveness probes (startup probes gate readiness and the init sequence, but a failing
//! one restarts nothing), no `kubectl logs/exec` (logs are files under
//! `<runner dir>/pods/<ns>_<name>_<uid>/logs/`), no volume updates after start.

pub mod crash;
pub mod env;
pub mod hosts;
pub mod image;
pub mod node;
pub mod pod;
pub mod pod_ip;
pub mod probe;
pub mod status;
pub mod storage;
pub mod volumes;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use self::hosts::{HostsWriter, maintain_hosts_file};
use self::image::ImageTable;
use self::node::{
    LEASE_RENEW, NodeSpecification, STATUS_REFRESH, node_lease, node_status, runner_node,
};
use self::pod::{NodeContext, PodMsg, supervise};
use self::pod_ip::{PodIpAllocator, PodIpError};

/// Field manager of the runner's writes.
pub const FIELD_MANAGER: &str = "tandem-e2e-runner";

/// Errors starting the runner.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The API rejected a node registration.
    #[error("registering node {node}: {source}")]
    Register {
        /// Node name.
        node: String,
        /// The API error.
        source: kube::Error,
    },
    /// Bad node index for the 127.x scheme.
    #[error(transparent)]
    PodIp(#[from] PodIpError),
    /// The runner dir could not be created.
    #[error("{path}: {source}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// What a runner serves.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// The nodes to register (each gets its own 127.<100+i>.0.0/16).
    pub nodes: Vec<NodeSpecification>,
    /// Index of the first node in the 127.x scheme (two runners on one cluster need disjoint ones).
    pub first_node_index: u32,
    /// Working dir: `pods/…` (volumes, roots, logs) and `pids/` (read by `cluster down`).
    pub dir: PathBuf,
    /// Image → program table.
    pub images: ImageTable,
    /// The API server's port on 127.0.0.1 (given to pods as `KUBERNETES_SERVICE_PORT`).
    pub api_port: u16,
}

/// What the runner adds to every pod beyond its spec (worker/interfaces/README.md §5).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodDefaults {
    /// Extra environment variables (`--pod-env K=V`), set after the runner's own variables and
    /// before the container's `envFrom`/`env`, which therefore override them. Used for the
    /// worker's simulation knobs (`TANDEM_SIM_*`, worker/interfaces/README.md §2).
    pub env: Vec<(String, String)>,
}

impl PodDefaults {
    /// Parses `K=V` (the `--pod-env` syntax): the key must be a non-empty C identifier; the value
    /// may contain `=`. `None` when malformed.
    pub fn parse_env(spec: &str) -> Option<(String, String)> {
        let (k, v) = spec.split_once('=')?;
        let ident = !k.is_empty()
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        ident.then(|| (k.to_owned(), v.to_owned()))
    }
}

/// The hosts file a runner with working dir `dir` maintains (`<dir>/hosts`).
pub fn hosts_file(dir: &std::path::Path) -> PathBuf {
    dir.join("hosts")
}

/// Where a runner with working dir `dir` keeps provisioned volumes (`<dir>/volumes/pvc-<uid>`).
pub fn volumes_dir(dir: &std::path::Path) -> PathBuf {
    dir.join("volumes")
}

/// A running process runner; [`ProcessRunner::shutdown`] stops it and its pods' processes.
pub struct ProcessRunner {
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    client: Client,
    nodes: Vec<String>,
    hosts_file: PathBuf,
    volumes_dir: PathBuf,
}

impl ProcessRunner {
    /// Registers the nodes (returns once they exist with a Ready status) and starts serving them,
    /// with no [`PodDefaults`].
    pub async fn start(client: Client, config: RunnerConfig) -> Result<Self, RunnerError> {
        Self::start_with(client, config, PodDefaults::default()).await
    }

    /// [`ProcessRunner::start`] with extra per-pod settings (`--pod-env`).
    pub async fn start_with(
        client: Client,
        config: RunnerConfig,
        defaults: PodDefaults,
    ) -> Result<Self, RunnerError> {
        let io = |path: &std::path::Path| {
            let path = path.to_owned();
            move |source| RunnerError::Io { path, source }
        };
        for d in [config.dir.join("pids"), volumes_dir(&config.dir)] {
            std::fs::create_dir_all(&d).map_err(io(&d))?;
        }
        let hosts_path = hosts_file(&config.dir);
        // Exists (empty) before the first pod starts, so readers never see a missing file.
        let mut writer = HostsWriter::new(hosts_path.clone());
        writer.write("").map_err(io(&hosts_path))?;
        let (shutdown, _) = watch::channel(false);
        let mut tasks = vec![
            tokio::spawn(maintain_hosts_file(
                client.clone(),
                writer,
                shutdown.subscribe(),
            )),
            tokio::spawn(storage::provision_volumes(
                client.clone(),
                volumes_dir(&config.dir),
                shutdown.subscribe(),
            )),
        ];
        let mut names = Vec::new();
        for (i, spec) in config.nodes.iter().enumerate() {
            let ips = PodIpAllocator::new(config.first_node_index + i as u32)?;
            let node_ip = ips.node_ip();
            let uid = register(&client, spec, node_ip).await?;
            let ctx = Arc::new(NodeContext {
                client: client.clone(),
                node: spec.name.clone(),
                node_ip,
                ips: Mutex::new(ips),
                images: config.images.clone(),
                dir: config.dir.clone(),
                api_port: config.api_port,
                hosts_file: hosts_path.clone(),
                pod_env: defaults.env.clone(),
            });
            tasks.push(tokio::spawn(heartbeat(
                client.clone(),
                spec.clone(),
                node_ip,
                uid,
                shutdown.subscribe(),
            )));
            tasks.push(tokio::spawn(serve_pods(ctx, shutdown.subscribe())));
            names.push(spec.name.clone());
            tracing::info!(node = %spec.name, ip = %node_ip, gpus = spec.gpus, "runner node registered");
        }
        Ok(Self {
            shutdown,
            tasks,
            client,
            nodes: names,
            hosts_file: hosts_path,
            volumes_dir: volumes_dir(&config.dir),
        })
    }

    /// Names of the nodes this runner serves.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The hosts file given to pods in `TANDEM_HOSTS_FILE`.
    pub fn hosts_file(&self) -> &std::path::Path {
        &self.hosts_file
    }

    /// Stops every pod process (SIGTERM, 5 s, SIGKILL) and the heartbeats, leaving API objects as
    /// they are, and unmounts its sized volumes (their data is lost; [`storage`]); with
    /// `remove_nodes`, deletes the Node objects too (their pods are then evicted by the control
    /// plane).
    pub async fn shutdown(self, remove_nodes: bool) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        storage::unmount_all(&self.volumes_dir);
        if remove_nodes {
            let api: Api<Node> = Api::all(self.client.clone());
            for n in &self.nodes {
                let _ = api.delete(n, &Default::default()).await;
            }
        }
    }
}

/// Creates or updates the Node (metadata by server-side apply, then its status); returns its uid.
async fn register(
    client: &Client,
    spec: &NodeSpecification,
    ip: std::net::Ipv4Addr,
) -> Result<String, RunnerError> {
    let err = |source| RunnerError::Register {
        node: spec.name.clone(),
        source,
    };
    let api: Api<Node> = Api::all(client.clone());
    let mut node = runner_node(spec, ip, Timestamp::now());
    let status = node.status.take();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let created = api
        .patch(&spec.name, &pp, &Patch::Apply(&node))
        .await
        .map_err(err)?;
    let status_patch = status_apply(&spec.name, &status);
    api.patch_status(&spec.name, &pp, &Patch::Apply(&status_patch))
        .await
        .map_err(err)?;
    Ok(created.metadata.uid.unwrap_or_default())
}

/// The server-side-apply body of a Node's status.
fn status_apply<S: serde::Serialize>(name: &str, status: &S) -> serde_json::Value {
    serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "status": status})
}

/// Renews the node Lease every [`LEASE_RENEW`] and re-posts status every [`STATUS_REFRESH`].
async fn heartbeat(
    client: Client,
    spec: NodeSpecification,
    ip: std::net::Ipv4Addr,
    uid: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let since = Timestamp::now();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let nodes: Api<Node> = Api::all(client);
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let mut lease_tick = tokio::time::interval(LEASE_RENEW);
    let mut status_tick = tokio::time::interval(STATUS_REFRESH);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = lease_tick.tick() => {
                let lease = node_lease(&spec.name, &uid, Timestamp::now());
                if let Err(e) = leases.patch(&spec.name, &pp, &Patch::Apply(&lease)).await {
                    tracing::warn!(node = %spec.name, "lease renewal: {e}");
                }
            }
            _ = status_tick.tick() => {
                let status = node_status(&spec, ip, since, Timestamp::now());
                let patch = status_apply(&spec.name, &status);
                if let Err(e) = nodes.patch_status(&spec.name, &pp, &Patch::Apply(&patch)).await {
                    tracing::warn!(node = %spec.name, "status heartbeat: {e}");
                }
            }
        }
    }
}

/// Watches the pods bound to the node and hands each to its supervisor.
async fn serve_pods(ctx: Arc<NodeContext>, mut shutdown: watch::Receiver<bool>) {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let wc = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node));
    let stream = watcher(api, wc).default_backoff();
    futures::pin_mut!(stream);
    let mut pods: HashMap<String, (mpsc::UnboundedSender<PodMsg>, JoinHandle<()>)> = HashMap::new();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            ev = stream.next() => match ev {
                Some(Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p))) => {
                    pods.retain(|_, (_, h)| !h.is_finished());
                    on_apply(&ctx, &mut pods, p, &shutdown).await;
                }
                Some(Ok(watcher::Event::Delete(p))) => {
                    let uid = p.metadata.uid.clone().unwrap_or_default();
                    if let Some((tx, _)) = pods.get(&uid) {
                        let _ = tx.send(PodMsg::Gone);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::warn!(node = %ctx.node, "pod watch: {e}"),
                None => break,
            }
        }
    }
    // Supervisors see the same shutdown signal; wait until their processes are gone.
    for (_, (_, handle)) in pods {
        let _ = handle.await;
    }
}

async fn on_apply(
    ctx: &Arc<NodeContext>,
    pods: &mut HashMap<String, (mpsc::UnboundedSender<PodMsg>, JoinHandle<()>)>,
    pod: Pod,
    shutdown: &watch::Receiver<bool>,
) {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if let Some((tx, _)) = pods.get(&uid) {
        let _ = tx.send(PodMsg::Update(Box::new(pod)));
        return;
    }
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("");
    if pod.metadata.deletion_timestamp.is_some() {
        // Being deleted and nothing runs here (finished, or from before a runner restart).
        let api: Api<Pod> = Api::namespaced(
            ctx.client.clone(),
            pod.metadata.namespace.as_deref().unwrap_or(""),
        );
        let dp = kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..Default::default()
        };
        let _ = api
            .delete(pod.metadata.name.as_deref().unwrap_or(""), &dp)
            .await;
        return;
    }
    if phase == "Succeeded" || phase == "Failed" {
        return;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = tokio::spawn(supervise(ctx.clone(), pod, rx, shutdown.clone()));
    pods.insert(uid, (tx, handle));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_env_specs() {
        assert_eq!(
            PodDefaults::parse_env("TANDEM_SIM_TPOT_MS=5"),
            Some(("TANDEM_SIM_TPOT_MS".into(), "5".into()))
        );
        assert_eq!(
            PodDefaults::parse_env("A=b=c"),
            Some(("A".into(), "b=c".into()))
        );
        assert_eq!(
            PodDefaults::parse_env("EMPTY="),
            Some(("EMPTY".into(), String::new()))
        );
        for bad in ["", "=v", "NOEQ", "1X=v", "A-B=v", "A B=v"] {
            assert_eq!(PodDefaults::parse_env(bad), None, "{bad:?}");
        }
    }
}
