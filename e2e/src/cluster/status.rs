//! `cluster status`: what runs, whether the API server is ready, the nodes and the tool paths.

use std::fmt;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;

use super::build::BinDir;
use super::down::RUNNER_PID_NAME;
use super::nodes::{GPU_RESOURCE, NODE_KIND_LABEL};
use super::up::{node_ready, readyz};
use super::{COMPONENTS, ClusterConfig, client_for};
use crate::pidfile::{Liveness, ProcessId};

/// One node as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSummary {
    /// Node name.
    pub name: String,
    /// Value of [`NODE_KIND_LABEL`] (`kwok`, `process`, or empty).
    pub kind: String,
    /// `Ready` condition is `True`.
    pub ready: bool,
    /// Allocatable `nvidia.com/gpu` (as written in the object).
    pub gpus: String,
}

/// A snapshot of the cluster.
#[derive(Debug, Clone)]
pub struct ClusterStatus {
    /// State dir.
    pub state_dir: PathBuf,
    /// Admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// Bin dir recorded by `up` (None when no cluster was started here).
    pub bin_dir: Option<BinDir>,
    /// (component, pid, running) for each recorded component.
    pub components: Vec<(String, Option<i32>, bool)>,
    /// API server `/readyz` answered `ok`.
    pub api_ready: bool,
    /// Nodes, when the API server answered.
    pub nodes: Vec<NodeSummary>,
}

impl ClusterStatus {
    /// Every recorded component runs and the API server is ready.
    pub fn healthy(&self) -> bool {
        self.api_ready && self.components.iter().all(|(_, _, up)| *up)
    }
}

/// Gathers the status; never fails (what cannot be read shows as down).
pub async fn status(config: &ClusterConfig) -> ClusterStatus {
    let bin_dir = std::fs::read_to_string(config.bin_dir_record())
        .ok()
        .map(|s| BinDir(PathBuf::from(s.trim())));
    let mut components = Vec::new();
    for c in COMPONENTS.iter().copied().chain([RUNNER_PID_NAME]) {
        let file = config.pid_file(c);
        if !file.is_file() {
            continue;
        }
        let id = ProcessId::read(&file).ok();
        let up = id.is_some_and(|id| id.state() == Liveness::Running);
        components.push((c.to_owned(), id.map(|i| i.pid), up));
    }
    let mut api_ready = false;
    let mut nodes = Vec::new();
    if config.kubeconfig().is_file()
        && let Ok(client) = client_for(&config.kubeconfig()).await
    {
        let probe = tokio::time::timeout(std::time::Duration::from_secs(5), readyz(&client));
        api_ready = matches!(probe.await, Ok(Some(())));
        if api_ready && let Ok(list) = Api::<Node>::all(client).list(&ListParams::default()).await {
            nodes = list.items.iter().map(summarize).collect();
        }
    }
    ClusterStatus {
        state_dir: config.state_dir.clone(),
        kubeconfig: config.kubeconfig(),
        bin_dir,
        components,
        api_ready,
        nodes,
    }
}

fn summarize(n: &Node) -> NodeSummary {
    NodeSummary {
        name: n.metadata.name.clone().unwrap_or_default(),
        kind: n
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(NODE_KIND_LABEL))
            .cloned()
            .unwrap_or_default(),
        ready: node_ready(n),
        gpus: n
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(GPU_RESOURCE))
            .map(|q| q.0.clone())
            .unwrap_or_else(|| "0".into()),
    }
}

impl fmt::Display for ClusterStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "state dir:   {}", self.state_dir.display())?;
        writeln!(f, "kubeconfig:  {}", self.kubeconfig.display())?;
        match &self.bin_dir {
            Some(b) => {
                writeln!(f, "bin dir:     {}", b.0.display())?;
                writeln!(f, "kubectl:     {}", b.kubectl().display())?;
                writeln!(f, "helm:        {}", b.helm().display())?;
                for line in b.versions().lines() {
                    writeln!(f, "versions:    {line}")?;
                }
            }
            None => writeln!(
                f,
                "bin dir:     (no cluster started from {})",
                self.state_dir.display()
            )?,
        }
        if self.components.is_empty() {
            writeln!(f, "components:  none recorded")?;
        }
        for (name, pid, up) in &self.components {
            let pid = pid.map_or("?".to_owned(), |p| p.to_string());
            let state = if *up { "running" } else { "NOT running" };
            writeln!(f, "component:   {name:<24} pid {pid:<8} {state}")?;
        }
        writeln!(
            f,
            "apiserver:   {}",
            if self.api_ready {
                "/readyz ok"
            } else {
                "not ready"
            }
        )?;
        for n in &self.nodes {
            let ready = if n.ready { "Ready" } else { "NotReady" };
            writeln!(
                f,
                "node:        {:<24} {:<8} {:<9} {} {GPU_RESOURCE}",
                n.name, n.kind, ready, n.gpus
            )?;
        }
        Ok(())
    }
}
