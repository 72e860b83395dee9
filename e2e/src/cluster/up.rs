//! `cluster up`: start the components in order and wait for each (controlplane.md §4–5).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};

use super::build::{BinDir, ensure_binaries};
use super::down::{running_components, stop_components};
use super::nodes::{kwok_node, kwok_node_name};
use super::wait::wait_for;
use super::{ClusterConfig, ClusterError, client_for, io_err, tools_dir};
use crate::http_get;
use crate::runner::storage::{
    SIZED_STORAGE_CLASS, STORAGE_CLASS, sized_storage_class, storage_class,
};

/// Field manager of everything `cluster up` writes.
const FIELD_MANAGER: &str = "tandem-e2e";

/// A cluster that `up` brought to ready.
#[derive(Debug, Clone)]
pub struct RunningCluster {
    /// What was started.
    pub config: ClusterConfig,
    /// The binaries it runs.
    pub bin_dir: BinDir,
    /// The admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// From the first process start to ready (binaries already built), wall clock.
    pub startup: Duration,
}

/// Builds (per `config.build`) and starts the cluster, waiting until the API server is ready, the
/// controllers answer, kwok nodes are Ready and the `default` ServiceAccount exists. Also creates
/// the default StorageClass `tandem-e2e-local` (provisioned by the process runner, see
/// [`crate::runner::storage`]).
///
/// On a failed start every component started so far is stopped again; the state dir (with the
/// logs) is kept for diagnosis. Errors: [`ClusterError::AlreadyRunning`] when pid files of live
/// components exist, build/script/readiness errors otherwise.
pub async fn up(config: &ClusterConfig) -> Result<RunningCluster, ClusterError> {
    if !running_components(config).is_empty() {
        return Err(ClusterError::AlreadyRunning(config.state_dir.clone()));
    }
    let bin_dir = ensure_binaries(config.build).await?;
    // Fresh state every time: leftovers of a crashed run (stale pids, etcd data) must not leak in.
    if config.state_dir.exists() {
        std::fs::remove_dir_all(&config.state_dir).map_err(io_err(&config.state_dir))?;
    }
    std::fs::create_dir_all(&config.state_dir).map_err(io_err(&config.state_dir))?;
    let record = config.bin_dir_record();
    std::fs::write(&record, bin_dir.0.to_string_lossy().as_bytes()).map_err(io_err(&record))?;

    let started = Instant::now();
    match start_all(config, &bin_dir).await {
        Ok(()) => {
            let startup = started.elapsed();
            eprintln!(
                "[tandem-e2e] cluster ready in {:.1}s; KUBECONFIG={}",
                startup.as_secs_f64(),
                config.kubeconfig().display()
            );
            Ok(RunningCluster {
                config: config.clone(),
                bin_dir,
                kubeconfig: config.kubeconfig(),
                startup,
            })
        }
        Err(e) => {
            eprintln!("[tandem-e2e] start failed: {e}; stopping what was started");
            stop_components(config);
            Err(e)
        }
    }
}

async fn start_all(config: &ClusterConfig, bin_dir: &BinDir) -> Result<(), ClusterError> {
    run_script(config, bin_dir, &["pki"]).await?;

    run_script(config, bin_dir, &["start", "etcd"]).await?;
    let etcd = std::net::SocketAddr::from(([127, 0, 0, 1], config.ports.etcd));
    wait_for(
        "etcd",
        Duration::from_secs(30),
        Duration::from_millis(200),
        &config.log_file("etcd"),
        || async move {
            let r = http_get::get(etcd, "/health", &[], Duration::from_secs(2)).await;
            matches!(r, Ok(r) if r.status == 200 && r.body.contains("true")).then_some(())
        },
    )
    .await?;

    run_script(config, bin_dir, &["start", "kube-apiserver"]).await?;
    let client = client_for(&config.kubeconfig()).await?;
    wait_for(
        "kube-apiserver /readyz",
        Duration::from_secs(120),
        Duration::from_millis(500),
        &config.log_file("kube-apiserver"),
        || readyz(&client),
    )
    .await?;

    // The default StorageClass whose claims the process runner provisions
    // (worker/interfaces/README.md §5).
    let classes: Api<StorageClass> = Api::all(client.clone());
    classes
        .patch(
            STORAGE_CLASS,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&storage_class()),
        )
        .await?;
    // Its sized sibling: volumes with an enforced capacity (a tmpfs of the claim's size).
    classes
        .patch(
            SIZED_STORAGE_CLASS,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&sized_storage_class()),
        )
        .await?;

    if config.controller_manager {
        run_script(config, bin_dir, &["start", "kube-controller-manager"]).await?;
        let kcm = component_client(config, config.ports.kcm).await?;
        wait_for(
            "kube-controller-manager /healthz",
            Duration::from_secs(90),
            Duration::from_millis(500),
            &config.log_file("kube-controller-manager"),
            || healthz(&kcm),
        )
        .await?;
    }
    if config.scheduler {
        run_script(config, bin_dir, &["start", "kube-scheduler"]).await?;
        let sched = component_client(config, config.ports.scheduler).await?;
        wait_for(
            "kube-scheduler /healthz",
            Duration::from_secs(90),
            Duration::from_millis(500),
            &config.log_file("kube-scheduler"),
            || healthz(&sched),
        )
        .await?;
    }
    if config.kwok_nodes > 0 {
        run_script(config, bin_dir, &["start", "kwok"]).await?;
        let nodes: Api<Node> = Api::all(client.clone());
        for i in 0..config.kwok_nodes {
            let node = kwok_node(i, config.kwok_gpus_per_node);
            nodes
                .patch(
                    &kwok_node_name(i),
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&node),
                )
                .await?;
        }
        let want = config.kwok_nodes as usize;
        wait_for(
            &format!("{want} kwok node(s) Ready"),
            Duration::from_secs(90),
            Duration::from_millis(500),
            &config.log_file("kwok"),
            || {
                let nodes = nodes.clone();
                async move {
                    let list = nodes.list(&ListParams::default().labels("type=kwok")).await;
                    let ready = list.ok()?.items.iter().filter(|n| node_ready(n)).count();
                    (ready >= want).then_some(())
                }
            },
        )
        .await?;
    }
    if config.controller_manager {
        // ServiceAccount admission rejects pods until KCM created `default` (controlplane.md §9.13).
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
        wait_for(
            "default ServiceAccount",
            Duration::from_secs(60),
            Duration::from_millis(500),
            &config.log_file("kube-controller-manager"),
            || {
                let sas = sas.clone();
                async move { sas.get_opt("default").await.ok().flatten().map(|_| ()) }
            },
        )
        .await?;
    }
    Ok(())
}

/// `Some(())` when `GET /readyz` answers `ok`.
pub(crate) async fn readyz(client: &kube::Client) -> Option<()> {
    let req = http::Request::get("/readyz").body(Vec::new()).ok()?;
    let text = client.request_text(req).await.ok()?;
    (text.trim() == "ok").then_some(())
}

async fn healthz(client: &kube::Client) -> Option<()> {
    let req = http::Request::get("/healthz").body(Vec::new()).ok()?;
    let text = client.request_text(req).await.ok()?;
    (text.trim() == "ok").then_some(())
}

/// A client for a component's own HTTPS port: its serving certificate is signed by the cluster CA,
/// so the admin kubeconfig's CA verifies it; only the URL changes.
pub(crate) async fn component_client(
    config: &ClusterConfig,
    port: u16,
) -> Result<kube::Client, ClusterError> {
    let path = config.kubeconfig();
    let kc = kube::config::Kubeconfig::read_from(&path).map_err(|e| ClusterError::Kubeconfig {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let mut kconf =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| ClusterError::Kubeconfig {
                path: path.clone(),
                message: e.to_string(),
            })?;
    kconf.cluster_url =
        format!("https://127.0.0.1:{port}")
            .parse()
            .map_err(|e: http::uri::InvalidUri| ClusterError::Kubeconfig {
                path,
                message: e.to_string(),
            })?;
    kube::Client::try_from(kconf).map_err(ClusterError::Kube)
}

/// Whether a node's `Ready` condition is `True`.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

async fn run_script(
    config: &ClusterConfig,
    bin_dir: &BinDir,
    args: &[&str],
) -> Result<(), ClusterError> {
    let script = tools_dir().join("run-controlplane.sh");
    let p = config.ports;
    let out = tokio::process::Command::new("bash")
        .arg(&script)
        .args(args)
        .env("E2E_DIR", &config.state_dir)
        .env("E2E_BIN_DIR", &bin_dir.0)
        .env("ETCD_PORT", p.etcd.to_string())
        .env("ETCD_PEER_PORT", p.etcd_peer.to_string())
        .env("API_PORT", p.api.to_string())
        .env("KCM_PORT", p.kcm.to_string())
        .env("SCHED_PORT", p.scheduler.to_string())
        .env("KWOK_PORT", p.kwok.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .await
        .map_err(|e| ClusterError::Script {
            script: script.clone(),
            message: format!("cannot run: {e}"),
        })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    for line in stderr.lines() {
        eprintln!("[tandem-e2e] {line}");
    }
    if out.status.success() {
        Ok(())
    } else {
        Err(ClusterError::Script {
            script,
            message: format!("`{}` failed ({})", args.join(" "), out.status),
        })
    }
}
