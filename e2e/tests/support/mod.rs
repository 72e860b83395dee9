//! Shared scaffolding of the end-to-end suites that run the Tandem stack: a private control plane
//! (temp state dir, ports offset), one process-runner node in the test process, and `kubectl` /
//! `helm` from the cached tool dir, run from the repository root.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use tandem_e2e::cluster::down::down;
use tandem_e2e::cluster::up::{RunningCluster, up};
use tandem_e2e::cluster::{BuildMode, ClusterConfig, ClusterError, Ports, client_for};
use tandem_e2e::runner::image::ImageTable;
use tandem_e2e::runner::node::NodeSpecification;
use tandem_e2e::runner::{PodDefaults, ProcessRunner, RunnerConfig};

/// The control-plane components and fake nodes a suite's private cluster runs.
pub struct ClusterShape {
    /// Port offset (each suite its own, so suites and a user's cluster run side by side).
    pub port_offset: u16,
    /// Run kube-controller-manager.
    pub controller_manager: bool,
    /// Run kube-scheduler.
    pub scheduler: bool,
    /// kwok nodes, and `nvidia.com/gpu` on each.
    pub kwok_nodes: u32,
    /// `nvidia.com/gpu` per kwok node.
    pub kwok_gpus_per_node: u32,
}

impl ClusterShape {
    /// etcd and the API server only (no controllers, no nodes), ports + `port_offset`.
    pub fn api_only(port_offset: u16) -> Self {
        Self {
            port_offset,
            controller_manager: false,
            scheduler: false,
            kwok_nodes: 0,
            kwok_gpus_per_node: 0,
        }
    }
}

/// Runs `program` (the cached kubectl or helm) with `kubeconfig` from the repository root; stdout,
/// or an error with stdout and stderr.
pub fn run_tool(program: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .current_dir(repo())
        .output()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{} {args:?} failed: {}{}",
            program.file_name().unwrap_or_default().to_string_lossy(),
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A suite's private control plane: state in a temp dir that lives as long as this value.
pub struct PrivateCluster {
    /// The running cluster (its `config` has the state dir and ports).
    pub cluster: RunningCluster,
    /// The temp dir holding the state dir (suites may put their own files in it).
    pub tmp: tempfile::TempDir,
}

/// Starts a private control plane for suite `name`. Without cached control-plane binaries it
/// prints why the suite is skipped and returns `None`, unless `TANDEM_E2E_REQUIRE_CLUSTER` is set:
/// then it builds them (tens of minutes cold) and a failure panics.
pub async fn start_cluster(name: &str, shape: ClusterShape) -> Option<PrivateCluster> {
    let required = std::env::var_os("TANDEM_E2E_REQUIRE_CLUSTER").is_some();
    let tmp = tempfile::Builder::new()
        .prefix(&format!("tandem-e2e-{name}"))
        .tempdir()
        .expect("temp dir");
    let config = ClusterConfig {
        state_dir: tmp.path().join("cluster"),
        ports: Ports::with_offset(shape.port_offset),
        controller_manager: shape.controller_manager,
        scheduler: shape.scheduler,
        kwok_nodes: shape.kwok_nodes,
        kwok_gpus_per_node: shape.kwok_gpus_per_node,
        build: if required {
            BuildMode::BuildIfMissing
        } else {
            BuildMode::CachedOnly
        },
    };
    match up(&config).await {
        Ok(cluster) => Some(PrivateCluster { cluster, tmp }),
        Err(ClusterError::NotBuilt) if !required => {
            println!(
                "SKIPPED {name}: control-plane binaries are not built (run `tandem-e2e cluster up` \
                 once, or set TANDEM_E2E_REQUIRE_CLUSTER=1 to build them here)"
            );
            None
        }
        Err(e) => panic!("cluster up: {e}"),
    }
}

/// What a suite asks of its harness.
pub struct HarnessConfig {
    /// Test name, for the skip message and the temp dir.
    pub name: &'static str,
    /// Port offset of this suite's control plane (each suite its own).
    pub port_offset: u16,
    /// `nvidia.com/gpu` capacity of the one runner node.
    pub runner_gpus: u32,
    /// Index of the runner node's address block (`127.<100+i>.0.0/16`): each suite its own.
    pub first_node_index: u32,
    /// The program the `tandem-worker` image runs (default: the binary next to the test
    /// executable, [`ImageTable::tandem`]).
    pub worker_bin: Option<PathBuf>,
    /// Environment every pod gets after [`SIM_ENV`] (a later entry wins over an earlier one).
    pub pod_env: &'static [(&'static str, &'static str)],
}

/// A running control plane with a process-runner node.
pub struct Harness {
    /// Client with the admin kubeconfig.
    pub client: Client,
    /// The cluster.
    pub cluster: RunningCluster,
    runner: Option<ProcessRunner>,
    _tmp: tempfile::TempDir,
}

/// Simulation knobs every worker pod gets (`worker/README.md`): small KV per token so a laptop
/// moves it quickly, a short TPOT.
pub const SIM_ENV: &[(&str, &str)] = &[
    ("TANDEM_SIM_KV_BYTES_PER_TOKEN", "256"),
    ("TANDEM_SIM_TPOT_MS", "1"),
    ("TANDEM_SIM_PREFILL_US_PER_TOKEN", "5"),
];

/// The repository root (suites run kubectl and helm from there).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

impl Harness {
    /// Starts the control plane and the runner; `None` (after printing why) when the control plane
    /// is not built and `TANDEM_E2E_REQUIRE_CLUSTER` is unset.
    pub async fn start(cfg: HarnessConfig) -> Option<Self> {
        let PrivateCluster { cluster, tmp } = start_cluster(
            cfg.name,
            ClusterShape {
                port_offset: cfg.port_offset,
                controller_manager: true,
                scheduler: true,
                kwok_nodes: 0,
                kwok_gpus_per_node: 0,
            },
        )
        .await?;
        let client = client_for(&cluster.kubeconfig).await.expect("client");
        let runner = ProcessRunner::start_with(
            client.clone(),
            RunnerConfig {
                nodes: vec![NodeSpecification {
                    name: "runner-0".into(),
                    gpus: cfg.runner_gpus,
                }],
                first_node_index: cfg.first_node_index,
                dir: cluster.config.runner_dir(),
                images: match &cfg.worker_bin {
                    Some(bin) => {
                        ImageTable::tandem().with("tandem-worker", vec![bin.display().to_string()])
                    }
                    None => ImageTable::tandem(),
                },
                api_port: cluster.config.ports.api,
            },
            PodDefaults {
                env: SIM_ENV
                    .iter()
                    .chain(cfg.pod_env)
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            },
        )
        .await
        .expect("runner starts");
        Some(Self {
            client,
            cluster,
            runner: Some(runner),
            _tmp: tmp,
        })
    }

    /// Runs the cached kubectl with the admin kubeconfig from the repository root; stdout, or an
    /// error with stderr.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        self.tool(&self.cluster.bin_dir.kubectl(), args)
    }

    /// Runs the cached helm likewise.
    pub fn helm(&self, args: &[&str]) -> Result<String, String> {
        self.tool(&self.cluster.bin_dir.helm(), args)
    }

    fn tool(&self, program: &Path, args: &[&str]) -> Result<String, String> {
        run_tool(program, &self.cluster.kubeconfig, args)
    }

    /// Pods in `default` matching a label selector.
    pub async fn pods(&self, selector: &str) -> Result<Vec<Pod>, String> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), "default");
        api.list(&ListParams::default().labels(selector))
            .await
            .map(|l| l.items)
            .map_err(|e| e.to_string())
    }

    /// Prints what helps a failure: Tandem objects, pods, events, and the tail of every pod log.
    pub fn dump_diagnostics(&self) {
        for args in [
            &[
                "get",
                "tandem,statefulsets,pods,svc,pvc",
                "-A",
                "-o",
                "wide",
            ][..],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
            &["get", "decodepools,prefillpools,cachetiers", "-o", "yaml"][..],
        ] {
            println!("--- kubectl {}", args.join(" "));
            println!("{}", self.kubectl(args).unwrap_or_else(|e| e));
        }
        let pods = self.cluster.config.runner_dir().join("pods");
        for pod in std::fs::read_dir(&pods).into_iter().flatten().flatten() {
            for log in std::fs::read_dir(pod.path().join("logs"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                println!("--- {}", log.path().display());
                for l in tail.iter().rev() {
                    println!("{l}");
                }
            }
        }
    }

    /// Stops the runner (its pods) and the control plane, removing the state.
    pub async fn stop(mut self) {
        if let Some(r) = self.runner.take() {
            r.shutdown(true).await;
        }
        let _ = down(&self.cluster.config, false).await;
    }
}

/// Runs one live-stack suite: starts the harness (or returns, the skip printed, when the control
/// plane is not built and not required), runs `scenario`, prints the diagnostics if it failed,
/// stops the harness, then fails the test with the scenario's error (printed before and after the
/// diagnostics, without a backtrace).
pub async fn run_suite(
    cfg: HarnessConfig,
    scenario: impl AsyncFnOnce(&Harness) -> Result<(), String>,
) {
    let Some(h) = Harness::start(cfg).await else {
        return;
    };
    let outcome = scenario(&h).await;
    if let Err(e) = &outcome {
        // The error first, then the diagnostics: a CI log cut to its head and tail keeps it.
        println!("--- scenario failed: {e}");
        h.dump_diagnostics();
    }
    h.stop().await;
    if let Err(e) = outcome {
        println!("--- scenario failed: {e}");
        // The error is the report; a backtrace through the runtime would bury it.
        std::panic::resume_unwind(Box::new(e));
    }
}

/// Polls `f` every 500 ms until it returns `Some`, or `None` after `timeout`.
pub async fn poll<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `helm install` of charts/tandem into `tandem-system` (waited), then a Ready operator pod.
pub async fn install(h: &Harness) -> Result<(), String> {
    h.helm(&[
        "install",
        "tandem",
        "charts/tandem",
        "-n",
        "tandem-system",
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
    ])?;
    poll(Duration::from_secs(60), || async {
        let pods = operator_pods(h).await.ok()?;
        (!pods.is_empty()).then_some(())
    })
    .await
    .ok_or_else(|| "no operator pod Ready after helm install".to_owned())
}

/// The Ready, not deleting operator pods.
pub async fn operator_pods(h: &Harness) -> Result<BTreeSet<String>, String> {
    let api: Api<Pod> = Api::namespaced(h.client.clone(), "tandem-system");
    let list = api
        .list(&kube::api::ListParams::default().labels("app.kubernetes.io/name=tandem-operator"))
        .await
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .iter()
        .filter(|p| ready(p) && p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.metadata.name.clone())
        .collect())
}

/// Waits until condition `ty` of `kind/name` has status `want` (at most `secs`).
pub async fn wait_condition(
    h: &Harness,
    kind: &str,
    name: &str,
    ty: &str,
    want: &str,
    secs: u64,
) -> Result<(), String> {
    let path = format!("jsonpath={{.status.conditions[?(@.type==\"{ty}\")].status}}");
    let mut last = String::new();
    let got = poll(Duration::from_secs(secs), || {
        let out = h.kubectl(&["get", kind, name, "-o", &path]);
        if let Ok(s) = &out {
            last = s.clone();
        }
        async move { out.ok().filter(|s| s.trim() == want) }
    })
    .await;
    if got.is_some() {
        return Ok(());
    }
    let conditions = h
        .kubectl(&["get", kind, name, "-o", "jsonpath={.status.conditions}"])
        .unwrap_or_default();
    Err(format!(
        "{kind}/{name}: condition {ty} is {last:?}, not {want}, after {secs}s; conditions: {conditions}"
    ))
}

/// Whether the pod's `Ready` condition is `True`.
pub fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod's name ("" when unset).
pub fn pod_name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

/// The pod's UID ("" when unset): tells a recreated pod of the same name apart.
pub fn pod_uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

/// The pod's IP, or an error naming the pod when it has none yet.
pub fn pod_ip(p: &Pod) -> Result<String, String> {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .ok_or_else(|| format!("{}: no pod IP", pod_name(p)))
}

/// An HTTP client for the workers' health ports (`/report`, `/readyz`): every call bounded by 3 s.
pub fn report_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap_or_default()
}
