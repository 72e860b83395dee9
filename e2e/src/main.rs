//! `tandem-e2e`: the local control plane and the process runner (see `e2e/README.md`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use std::os::unix::process::CommandExt;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;
use tandem_e2e::cluster::down::RUNNER_PID_NAME;
use tandem_e2e::cluster::up::node_ready;
use tandem_e2e::cluster::wait::wait_for;
use tandem_e2e::cluster::{self, BuildMode, ClusterConfig, Ports, client_for};
use tandem_e2e::pidfile::ProcessId;
use tandem_e2e::runner::image::ImageTable;
use tandem_e2e::runner::node::NodeSpecification;
use tandem_e2e::runner::{ProcessRunner, RunnerConfig};

#[derive(Parser)]
#[command(
    name = "tandem-e2e",
    about = "Tandem end-to-end harness: local control plane and process runner"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The local Kubernetes control plane.
    Cluster {
        #[command(subcommand)]
        action: ClusterAction,
    },
    /// Run the process runner in the foreground (Ctrl-C stops it and its pods).
    Runner(RunnerArgs),
}

#[derive(Subcommand)]
enum ClusterAction {
    /// Build (once, cached) and start the control plane; prints the kubeconfig path on stdout.
    Up(UpArgs),
    /// Stop the processes this cluster started and remove its state dir.
    Down {
        #[command(flatten)]
        dir: StateDir,
        /// Keep the state dir (logs, certificates, etcd data).
        #[arg(long)]
        keep_state: bool,
    },
    /// Show components, API readiness, nodes and tool paths (kubectl, helm); exit 1 if not healthy.
    Status {
        #[command(flatten)]
        dir: StateDir,
    },
}

#[derive(Args)]
struct StateDir {
    /// Cluster state dir (default ~/.cache/tandem-e2e/cluster).
    #[arg(long, env = "TANDEM_E2E_STATE_DIR")]
    state_dir: Option<PathBuf>,
}

impl StateDir {
    fn config(&self) -> ClusterConfig {
        let mut c = ClusterConfig::default_cli();
        if let Some(d) = &self.state_dir {
            c.state_dir = d.clone();
        }
        c
    }
}

#[derive(Args)]
struct UpArgs {
    #[command(flatten)]
    dir: StateDir,
    /// Added to every default port (23790 etcd, 26443 apiserver, ...): for a second cluster.
    #[arg(long, default_value_t = 0)]
    port_offset: u16,
    /// Number of kwok (simulated) nodes; 0 skips kwok.
    #[arg(long, default_value_t = 2)]
    kwok_nodes: u32,
    /// nvidia.com/gpu per kwok node.
    #[arg(long, default_value_t = 8)]
    kwok_gpus: u32,
    /// Also start a process-runner daemon with this many nodes (0: none).
    #[arg(long, default_value_t = 0)]
    runner_nodes: u32,
    /// nvidia.com/gpu per runner node.
    #[arg(long, default_value_t = 8)]
    runner_gpus: u32,
    /// Fail instead of building when the binaries are not cached.
    #[arg(long)]
    cached_only: bool,
    /// Skip kube-controller-manager (and with it Deployments, GC, ServiceAccounts).
    #[arg(long)]
    no_controller_manager: bool,
    /// Skip kube-scheduler.
    #[arg(long)]
    no_scheduler: bool,
}

#[derive(Args)]
struct RunnerArgs {
    #[command(flatten)]
    dir: StateDir,
    /// Number of nodes to register.
    #[arg(long, default_value_t = 1)]
    nodes: u32,
    /// nvidia.com/gpu per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Node name prefix (nodes are <prefix>-0, <prefix>-1, ...).
    #[arg(long, default_value = "runner")]
    name_prefix: String,
    /// First index in the 127.<100+i> address scheme.
    #[arg(long, default_value_t = 0)]
    first_node_index: u32,
    /// Extra image mappings, `NAME=PROGRAM [ARGS]` (e.g. `web=python3 -m http.server`).
    #[arg(long = "image")]
    images: Vec<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(
                |_| // kube-client logs every refused connection of a readiness poll at ERROR.
                tracing_subscriber::EnvFilter::new("info,kube_client::client::builder=off"),
            ),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tandem-e2e: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Cluster {
            action: ClusterAction::Up(args),
        } => up(args).await,
        Command::Cluster {
            action: ClusterAction::Down { dir, keep_state },
        } => {
            cluster::down::down(&dir.config(), keep_state).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster {
            action: ClusterAction::Status { dir },
        } => {
            let s = cluster::status::status(&dir.config()).await;
            print!("{s}");
            Ok(if s.healthy() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Runner(args) => runner(args).await,
    }
}

async fn up(args: UpArgs) -> anyhow::Result<ExitCode> {
    let mut config = args.dir.config();
    config.ports = Ports::with_offset(args.port_offset);
    config.kwok_nodes = args.kwok_nodes;
    config.kwok_gpus_per_node = args.kwok_gpus;
    config.controller_manager = !args.no_controller_manager;
    config.scheduler = !args.no_scheduler;
    config.build = if args.cached_only {
        BuildMode::CachedOnly
    } else {
        BuildMode::BuildIfMissing
    };
    let running = cluster::up::up(&config).await?;
    if args.runner_nodes > 0 {
        start_runner_daemon(&config, args.runner_nodes, args.runner_gpus).await?;
    }
    eprintln!(
        "[tandem-e2e] kubectl: {}",
        running.bin_dir.kubectl().display()
    );
    eprintln!("[tandem-e2e] helm:    {}", running.bin_dir.helm().display());
    println!("{}", running.kubeconfig.display());
    Ok(ExitCode::SUCCESS)
}

/// Starts `tandem-e2e runner` in the background (own process group, pid recorded for `down`) and
/// waits until its nodes are Ready.
async fn start_runner_daemon(config: &ClusterConfig, nodes: u32, gpus: u32) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating tandem-e2e")?;
    let log_path = config
        .state_dir
        .join("logs")
        .join(format!("{RUNNER_PID_NAME}.log"));
    let log = std::fs::File::create(&log_path).with_context(|| log_path.display().to_string())?;
    let child = std::process::Command::new(exe)
        .args([
            "runner",
            "--nodes",
            &nodes.to_string(),
            "--gpus",
            &gpus.to_string(),
            "--state-dir",
        ])
        .arg(&config.state_dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting the process runner")?;
    let id = ProcessId::of_pid(child.id() as i32).context("runner exited at once")?;
    id.write(&config.pid_file(RUNNER_PID_NAME))?;
    eprintln!(
        "[tandem-e2e] started process runner (pid {}, log {})",
        id.pid,
        log_path.display()
    );
    let client = client_for(&config.kubeconfig()).await?;
    let api: Api<Node> = Api::all(client);
    let want = nodes as usize;
    wait_for(
        &format!("{want} runner node(s) Ready"),
        Duration::from_secs(60),
        Duration::from_millis(500),
        &log_path,
        || {
            let api = api.clone();
            async move {
                let list = api
                    .list(&ListParams::default().labels("tandem.dev/node-kind=process"))
                    .await
                    .ok()?;
                (list.items.iter().filter(|n| node_ready(n)).count() >= want).then_some(())
            }
        },
    )
    .await?;
    Ok(())
}

async fn runner(args: RunnerArgs) -> anyhow::Result<ExitCode> {
    let config = args.dir.config();
    let kubeconfig = config.kubeconfig();
    let client = client_for(&kubeconfig).await?;
    let kc = kube::config::Kubeconfig::read_from(&kubeconfig)?;
    let kconf = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    let api_port = kconf
        .cluster_url
        .port_u16()
        .context("kubeconfig server has no port")?;
    let mut images = ImageTable::tandem();
    for spec in &args.images {
        images = images
            .with_spec(spec)
            .with_context(|| format!("bad --image {spec:?} (want NAME=PROGRAM [ARGS])"))?;
    }
    let nodes = (0..args.nodes)
        .map(|i| NodeSpecification {
            name: format!("{}-{i}", args.name_prefix),
            gpus: args.gpus,
        })
        .collect();
    let runner = ProcessRunner::start(
        client,
        RunnerConfig {
            nodes,
            first_node_index: args.first_node_index,
            dir: config.runner_dir(),
            images,
            api_port,
        },
    )
    .await?;
    eprintln!(
        "[tandem-e2e] process runner serving {:?}; Ctrl-C or SIGTERM stops it",
        runner.nodes()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("[tandem-e2e] stopping pods");
    runner.shutdown(false).await;
    Ok(ExitCode::SUCCESS)
}
