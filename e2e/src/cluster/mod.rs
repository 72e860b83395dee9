//! A real Kubernetes control plane on 127.0.0.1 for the end-to-end tests (DESIGN §6, issue 4).
//!
//! * [`build`]: the binaries (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
//!   etcd, kwok, helm), built from the Go module proxy by `e2e/tools/build-controlplane.sh` and
//!   cached under `~/.cache/k8s-e2e-tools` by version stamp.
//! * [`up`]: certificates and kubeconfigs, then etcd → kube-apiserver → kube-controller-manager +
//!   kube-scheduler → kwok, each started by `e2e/tools/run-controlplane.sh start` and awaited here;
//!   then the kwok nodes.
//! * [`down`]: stops the recorded pids only (SIGTERM, grace, SIGKILL) and removes the state dir.
//! * [`status`]: what runs, whether the API server is ready, the nodes, the tool paths.
//!
//! Layout of the state dir ([`ClusterConfig::state_dir`]): `pki/`, `admin.kubeconfig` (the
//! kubeconfig users and tests take), `logs/<component>.log`, `pids/<component>.pid`, `etcd/`,
//! `bin-dir` (the binaries this cluster runs), `runner/` (process-runner pods, see [`crate::runner`]).

pub mod build;
pub mod down;
pub mod nodes;
pub mod status;
pub mod up;
pub mod wait;

use std::path::{Path, PathBuf};

pub use build::{BinDir, BuildMode};

/// Errors of the cluster lifecycle.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A helper script could not be run or failed.
    #[error("{script}: {message}")]
    Script {
        /// The script path.
        script: PathBuf,
        /// What failed (exit status, missing file, ...).
        message: String,
    },
    /// The binaries are not built and the mode forbids building them.
    #[error(
        "control-plane binaries are not built (run `tandem-e2e cluster up`, which builds them)"
    )]
    NotBuilt,
    /// A component did not become ready in time.
    #[error("{what} not ready after {seconds} s; logs in {logs}")]
    NotReady {
        /// The component or condition.
        what: String,
        /// The timeout.
        seconds: u64,
        /// Where its log is.
        logs: PathBuf,
    },
    /// A state-dir file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The cluster is (partly) running already.
    #[error("a cluster already runs in {0} (run `tandem-e2e cluster down` first)")]
    AlreadyRunning(PathBuf),
    /// Talking to the API server failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The kubeconfig could not be loaded.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}

/// The components in start order; [`down`] stops them in reverse.
pub const COMPONENTS: [&str; 5] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
];

/// TCP ports of the components (all on 127.0.0.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// etcd client port.
    pub etcd: u16,
    /// etcd peer port.
    pub etcd_peer: u16,
    /// kube-apiserver secure port.
    pub api: u16,
    /// kube-controller-manager secure port (`/healthz`).
    pub kcm: u16,
    /// kube-scheduler secure port (`/healthz`).
    pub scheduler: u16,
    /// kwok's HTTP server (metrics, healthz).
    pub kwok: u16,
}

impl Ports {
    /// The defaults of `run-controlplane.sh`, each shifted by `offset` (two clusters on one
    /// machine need different offsets and state dirs).
    pub fn with_offset(offset: u16) -> Self {
        Self {
            etcd: 23790 + offset,
            etcd_peer: 23800 + offset,
            api: 26443 + offset,
            kcm: 20257 + offset,
            scheduler: 20259 + offset,
            kwok: 20247 + offset,
        }
    }
}

impl Default for Ports {
    fn default() -> Self {
        Self::with_offset(0)
    }
}

/// What to start and where.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// State dir (certificates, kubeconfigs, logs, pids, etcd data).
    pub state_dir: PathBuf,
    /// Component ports.
    pub ports: Ports,
    /// Start kube-controller-manager (GC, Deployments → Pods, ServiceAccounts, node lifecycle).
    pub controller_manager: bool,
    /// Start kube-scheduler.
    pub scheduler: bool,
    /// Fake kwok nodes to create (0: kwok is not started).
    pub kwok_nodes: u32,
    /// `nvidia.com/gpu` capacity of each kwok node.
    pub kwok_gpus_per_node: u32,
    /// How to obtain the binaries.
    pub build: BuildMode,
}

impl ClusterConfig {
    /// The default cluster of the `tandem-e2e cluster` command:
    /// `~/.cache/tandem-e2e/cluster`, default ports, KCM + scheduler, 2 kwok nodes × 8 GPUs.
    pub fn default_cli() -> Self {
        Self {
            state_dir: default_state_dir(),
            ports: Ports::default(),
            controller_manager: true,
            scheduler: true,
            kwok_nodes: 2,
            kwok_gpus_per_node: 8,
            build: BuildMode::BuildIfMissing,
        }
    }

    /// The admin kubeconfig (`system:masters`) this cluster writes.
    pub fn kubeconfig(&self) -> PathBuf {
        self.state_dir.join("admin.kubeconfig")
    }

    /// `https://127.0.0.1:<api port>`.
    pub fn api_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.api)
    }

    /// The pid file of `component`.
    pub fn pid_file(&self, component: &str) -> PathBuf {
        self.state_dir.join("pids").join(format!("{component}.pid"))
    }

    /// The log file of `component`.
    pub fn log_file(&self, component: &str) -> PathBuf {
        self.state_dir.join("logs").join(format!("{component}.log"))
    }

    pub(crate) fn bin_dir_record(&self) -> PathBuf {
        self.state_dir.join("bin-dir")
    }

    /// Where process-runner pods of this cluster keep their files and pid files.
    pub fn runner_dir(&self) -> PathBuf {
        self.state_dir.join("runner")
    }
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/tandem-e2e`.
pub fn cache_root() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tandem-e2e")
}

/// `~/.cache/tandem-e2e/cluster`: the state dir of the CLI's cluster.
pub fn default_state_dir() -> PathBuf {
    cache_root().join("cluster")
}

/// The directory of the helper scripts: `$TANDEM_E2E_TOOLS_DIR`, else `e2e/tools` of this source tree.
pub fn tools_dir() -> PathBuf {
    std::env::var_os("TANDEM_E2E_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tools"))
}

/// A kube client for a kubeconfig file (no context override).
pub async fn client_for(kubeconfig: &Path) -> Result<kube::Client, ClusterError> {
    let err = |message: String| ClusterError::Kubeconfig {
        path: kubeconfig.to_owned(),
        message,
    };
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).map_err(|e| err(e.to_string()))?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| err(e.to_string()))?;
    kube::Client::try_from(config).map_err(ClusterError::Kube)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ClusterError + '_ {
    move |source| ClusterError::Io {
        path: path.to_owned(),
        source,
    }
}
