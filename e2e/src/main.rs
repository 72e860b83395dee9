//! `tandem-e2e`: the local control plane, the process runner, trace replay and the demo (see
//! `e2e/README.md`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tandem_e2e::cluster::{self, BuildMode, ClusterConfig, Ports, client_for};
use tandem_e2e::demo::DemoOptions;
use tandem_e2e::replay::ReplayConfig;
use tandem_e2e::replay::driver::AbortProbe;
use tandem_e2e::replay::targets::{
    TargetSet, decode_selector, discover_front_doors, spawn_discovery,
};
use tandem_e2e::replay::workload::select_workload;
use tandem_e2e::report::routing::{AB_POLICIES, ROUTING_ENV, RoutingAb};
use tandem_e2e::report::sampler::ReportSource;
use tandem_e2e::report::session::{Session, replay_and_report, request_bar};
use tandem_e2e::report::snapshot_ab::{AB_SYNC, SnapshotAb};
use tandem_e2e::runner::image::ImageTable;
use tandem_e2e::runner::node::NodeSpecification;
use tandem_e2e::runner::{PodDefaults, ProcessRunner, RunnerConfig};

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
    /// Replay a Mooncake trace (or the generated workload) into a DecodePool's front door and
    /// write the report (exit 1 on a corrupt page or a request lost beyond the retry budget).
    Replay(ReplayArgs),
    /// Cluster up, helm install, sample stack, replay with scale-up and rolling restart, teardown
    /// order check, report, cluster down (exit 1 if any check fails).
    Demo(DemoArgs),
    /// Prints (and rewrites) the routing A/B table of a `demo --routing-ab` output directory.
    RoutingTable(RoutingTableArgs),
    /// The operator at scale on kwok nodes: N stacks per cluster, measured; then one pool scaled
    /// 1 → 64 groups and rolled (report: scale.json, scale.md, SVG plots; exit 1 if a check fails).
    Scale(ScaleArgs),
}

#[derive(Args)]
struct ScaleArgs {
    /// Stack counts, one fresh cluster each (e.g. `10,100,1000`).
    #[arg(long, value_delimiter = ',', default_value = "10")]
    stacks: Vec<usize>,
    /// Report directory.
    #[arg(long, default_value = "tandem-scale-out")]
    out: PathBuf,
    /// Decode groups the scaled pool goes to (0 skips the scale and restart experiment).
    #[arg(long, default_value_t = 64)]
    scale_groups: u32,
    /// nvidia.com/gpu per kwok node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// The operator's --resync-seconds (default N / 5, clamped to 20..300).
    #[arg(long)]
    resync_seconds: Option<u64>,
    /// The operator's --child-cache: `false` runs the baseline that LISTs children on every
    /// reconcile.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    read_cache: bool,
    /// Added to every cluster port.
    #[arg(long, default_value_t = 0)]
    port_offset: u16,
    /// Cluster state dir (default ~/.cache/tandem-e2e/scale-<offset>).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Directory with cachetier.yaml, prefillpool.yaml, decodepool.yaml (default manifests/samples).
    #[arg(long)]
    samples: Option<PathBuf>,
    /// The operator binary (default $TANDEM_OPERATOR_BIN, else next to this executable).
    #[arg(long)]
    operator_bin: Option<PathBuf>,
    /// Fail instead of building the control plane when it is not cached.
    #[arg(long)]
    cached_only: bool,
    /// Deadline of each wait, seconds.
    #[arg(long, default_value_t = 900)]
    wait_timeout_s: u64,
    /// Report where the pods went by this node label (e.g. topology.kubernetes.io/zone), whatever
    /// the samples' pools place by: the baseline of a placement run.
    #[arg(long)]
    placement_key: Option<String>,
    /// Stacks applied per second, open loop (default: a burst, as fast as the API server takes
    /// them). A rate the control plane sustains measures each stack's own apply→Ready.
    #[arg(long, value_parser = parse_apply_rate)]
    apply_rate: Option<f64>,
}

/// `--apply-rate`: a finite rate of at least one stack per hour.
fn parse_apply_rate(s: &str) -> Result<f64, String> {
    let r: f64 = s.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    if r.is_finite() && r >= 1.0 / 3600.0 {
        Ok(r)
    } else {
        Err(format!(
            "{s:?}: stacks per second, at least 1/3600 (omit the flag for a burst)"
        ))
    }
}

/// Workload flags shared by `replay` and `demo`.
#[derive(Args)]
struct WorkloadArgs {
    /// Mooncake trace (JSONL: timestamp, input_length, output_length, hash_ids); default: a
    /// generated workload in the same schema (seed 42).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// First N requests of the trace, or N generated (default 300).
    #[arg(long)]
    requests: Option<usize>,
    /// Multiplies the trace timestamps (0.1 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    concurrency_limit: Option<usize>,
    /// Retries per request (on 503, 429, connection errors) on another front door.
    #[arg(long, default_value_t = 3)]
    retry_budget: u32,
    /// Model name sent in each request.
    #[arg(long, default_value = "llama-3-70b")]
    model: String,
    /// Seed 004's abort probe: the first attempt of every N-th request carries a KV deadline
    /// shorter than its prefill (`--abort-deadline-ms`), so the decode aborts the room while its KV
    /// is being written; the client retries it without. 0 turns the probe off.
    #[arg(long, default_value_t = 10)]
    abort_every: usize,
    /// The abort probe's KV deadline, in ms (≥ 1).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    abort_deadline_ms: u64,
    /// Snapshot sync (issue 15): `on` names each request's session KV (its next turn in the
    /// trace: the first later request that starts with its full prompt blocks and holds its
    /// answer), so the decode pushes it to the next turn's prefill; `off` never does.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    snapshot_sync: String,
}

impl WorkloadArgs {
    fn replay_config(&self) -> ReplayConfig {
        ReplayConfig {
            model: self.model.clone(),
            time_scale: self.time_scale,
            concurrency_limit: self.concurrency_limit,
            retry_budget: self.retry_budget,
            abort_probe: (self.abort_every > 0).then_some(AbortProbe {
                every: self.abort_every,
                kv_deadline_ms: self.abort_deadline_ms,
            }),
            snapshot_sync: self.snapshot_sync == "on",
            ..ReplayConfig::default()
        }
    }
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Report directory.
    #[arg(long, default_value = "tandem-replay-out")]
    out: PathBuf,
    /// Front-door base URLs (`http://ip:8000`); default: the Ready decode pods of --pool.
    #[arg(long = "target", num_args = 1..)]
    targets: Vec<String>,
    /// Worker `/report` URLs to sample; default (with discovery): every Tandem pod of --namespace.
    #[arg(long = "report-url", num_args = 1..)]
    report_urls: Vec<String>,
    /// DecodePool whose decode pods are the front doors.
    #[arg(long, default_value = tandem_e2e::demo::DECODE_POOL)]
    pool: String,
    /// Namespace of the pool.
    #[arg(long, default_value = tandem_e2e::demo::NAMESPACE)]
    namespace: String,
    /// Kubeconfig for discovery (default: $KUBECONFIG, else the CLI cluster's admin kubeconfig).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

#[derive(Args)]
struct DemoArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Report directory.
    #[arg(long, default_value = "tandem-demo-out")]
    out: PathBuf,
    /// Directory with the stack's cachetier.yaml, prefillpool.yaml and decodepool.yaml
    /// (default: the repo's manifests/samples); e.g. a copy with a smaller L3 persistence.size.
    #[arg(long)]
    samples: Option<PathBuf>,
    /// Leave the cluster and the stack's operator running at the end.
    #[arg(long)]
    keep_cluster: bool,
    /// Added to every cluster port (a second cluster; state dir `cluster-<offset>`).
    #[arg(long, default_value_t = 0)]
    port_offset: u16,
    /// Cluster state dir.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Process-runner nodes.
    #[arg(long, default_value_t = 1)]
    runner_nodes: u32,
    /// nvidia.com/gpu per runner node.
    #[arg(long, default_value_t = 16)]
    runner_gpus: u32,
    /// Extra env `K=V` for every pod (the workers' `TANDEM_SIM_*` knobs).
    #[arg(long = "pod-env")]
    pod_env: Vec<String>,
    /// Fail instead of building the control plane when it is not cached.
    #[arg(long)]
    cached_only: bool,
    /// Deadline of each wait (operator, Ready, scale, restart, teardown), seconds.
    #[arg(long, default_value_t = 300)]
    wait_timeout_s: u64,
    /// Run the PrefillPool and the DecodePool on the worker's built-in engine instead of the
    /// Simulated engine container on the engine API.
    #[arg(long)]
    builtin_engine: bool,
    /// Percent of the requests dispatched at which the DecodePool scales up by one.
    #[arg(long, default_value_t = tandem_e2e::demo::DEFAULT_SCALE_AT_PCT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=99))]
    scale_at: usize,
    /// Percent of the requests dispatched at which the ordered rolling restart starts (a short
    /// replay needs it early: decode groups restart only once enough prefill groups are back).
    #[arg(long, default_value_t = tandem_e2e::demo::DEFAULT_RESTART_AT_PCT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=99))]
    restart_at: usize,
    /// Prefill routing A/B (issue 16 item 2): the whole demo twice, each on a fresh cluster and
    /// stack, first with `TANDEM_DECODE_ROUTING=round-robin`, then `least-work` (the default); reports
    /// in `--out`/round-robin and `--out`/least-work, the side-by-side table on stdout and in
    /// `--out`/routing-ab.md (and .json).
    #[arg(long, conflicts_with = "snapshot_ab")]
    routing_ab: bool,
    /// Snapshot sync A/B (issue 15): the whole demo twice on the same slice, each on a fresh
    /// cluster and stack, first with `--snapshot-sync off`, then `on`; reports in `--out`/off and
    /// `--out`/on, the side-by-side table (next turns' hit ratio and TTFT, syncs by outcome) on
    /// stdout and in `--out`/snapshot-ab.md (and .json).
    #[arg(long)]
    snapshot_ab: bool,
}

#[derive(Args)]
struct RoutingTableArgs {
    /// The `--out` of a `demo --routing-ab` run (holding round-robin/ and least-work/).
    #[arg(long, default_value = "tandem-demo-out")]
    out: PathBuf,
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
    /// Extra env `K=V` for every pod of the runner daemon (e.g. `TANDEM_SIM_TPOT_MS=1`).
    #[arg(long = "pod-env")]
    pod_env: Vec<String>,
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
    /// Extra env `K=V` for every pod (the workers' `TANDEM_SIM_*` knobs), overridden by the
    /// pod's own env.
    #[arg(long = "pod-env")]
    pod_env: Vec<String>,
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
        Command::Replay(args) => replay(args).await,
        Command::Demo(args) => demo(args).await,
        Command::RoutingTable(args) => {
            let ab = RoutingAb::load(&args.out, &format!("{}", args.out.display()));
            ab.write(&args.out)
                .with_context(|| format!("writing into {}", args.out.display()))?;
            print!("{ab}");
            Ok(if ab.missing.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Scale(args) => scale(args).await,
    }
}

async fn scale(args: ScaleArgs) -> anyhow::Result<ExitCode> {
    let opts = tandem_e2e::scale::ScaleOptions {
        stacks: args.stacks,
        out: args.out.clone(),
        port_offset: args.port_offset,
        state_dir: args.state_dir,
        gpus_per_node: args.gpus_per_node,
        scale_groups: args.scale_groups,
        resync_seconds: args.resync_seconds,
        read_cache: args.read_cache,
        samples: args.samples,
        operator_bin: args.operator_bin,
        build: if args.cached_only {
            BuildMode::CachedOnly
        } else {
            BuildMode::BuildIfMissing
        },
        phase_timeout: Duration::from_secs(args.wait_timeout_s),
        placement_key: args.placement_key,
        apply_rate: args.apply_rate,
    };
    let report = tandem_e2e::scale::run_scale(&opts).await?;
    println!("{}", report.markdown());
    eprintln!("[scale] report in {}", args.out.display());
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        eprintln!("[scale] FAILED: see the checks");
        ExitCode::FAILURE
    })
}

async fn replay(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let w = &args.workload;
    let (workload, source) = select_workload(w.trace.as_deref(), w.requests)?;
    eprintln!(
        "[replay] {source}: {} requests, time scale {}",
        workload.len(),
        w.time_scale
    );
    let targets = TargetSet::fixed(args.targets.clone());
    let mut discovery = None;
    let mut reports = ReportSource::Fixed(args.report_urls.clone());
    if args.targets.is_empty() || args.report_urls.is_empty() {
        let kubeconfig = args
            .kubeconfig
            .clone()
            .or_else(|| std::env::var_os("KUBECONFIG").map(PathBuf::from))
            .unwrap_or_else(|| ClusterConfig::default_cli().kubeconfig());
        let client = client_for(&kubeconfig).await?;
        if args.targets.is_empty() {
            targets.replace(discover_front_doors(&client, &args.namespace, &args.pool).await?);
            anyhow::ensure!(
                !targets.snapshot().is_empty(),
                "no Ready decode pod of DecodePool {}/{} (selector {})",
                args.namespace,
                args.pool,
                decode_selector(&args.pool)
            );
            discovery = Some(spawn_discovery(
                client.clone(),
                args.namespace.clone(),
                args.pool.clone(),
                targets.clone(),
                Duration::from_secs(1),
            ));
        }
        if args.report_urls.is_empty() {
            reports = ReportSource::Kube {
                client,
                namespace: args.namespace.clone(),
            };
        }
    }
    eprintln!("[replay] front doors: {:?}", targets.snapshot());
    let session = Session {
        reports,
        sample_every: Duration::from_secs(1),
        out: &args.out,
        bar: Some(request_bar(workload.len())),
    };
    let summary =
        replay_and_report(&workload, source, &targets, &w.replay_config(), session).await?;
    if let Some(d) = discovery {
        d.abort();
    }
    println!("{summary}");
    eprintln!("[replay] report in {}", args.out.display());
    Ok(if summary.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let opts = DemoOptions {
        trace: args.workload.trace.clone(),
        time_scale: args.workload.time_scale,
        requests: args.workload.requests,
        out: args.out,
        samples: args.samples,
        keep_cluster: args.keep_cluster,
        port_offset: args.port_offset,
        state_dir: args.state_dir,
        runner_nodes: args.runner_nodes,
        runner_gpus: args.runner_gpus,
        pod_env: args.pod_env,
        replay: args.workload.replay_config(),
        cached_only: args.cached_only,
        wait_timeout: Duration::from_secs(args.wait_timeout_s),
        builtin_engine: args.builtin_engine,
        scale_at_pct: args.scale_at,
        restart_at_pct: args.restart_at,
    };
    if args.routing_ab {
        return routing_ab(opts).await;
    }
    if args.snapshot_ab {
        return snapshot_ab(opts).await;
    }
    let summary = tandem_e2e::demo::run(&opts).await?;
    Ok(if summary.passed() {
        ExitCode::SUCCESS
    } else {
        eprintln!("[demo] FAILED: see the checks above");
        ExitCode::FAILURE
    })
}

/// Runs the demo once per `(label, options)` (each with its own cluster state dir beside the
/// base's, named `<base>-<label>`, and its own report dir `--out`/`<label>`). A run that fails (a
/// phase or a check) does not stop the next; returns whether every run passed.
async fn demo_variants(tag: &str, base: &DemoOptions, variants: Vec<(&str, DemoOptions)>) -> bool {
    let state_base = tandem_e2e::demo::cluster_config(base).state_dir;
    let mut all_ok = true;
    for (label, mut opts) in variants {
        opts.out = base.out.join(label);
        opts.state_dir = Some(state_base.with_file_name(format!(
            "{}-{label}",
            state_base
                .file_name()
                .map_or_else(|| "cluster".into(), |n| n.to_string_lossy())
        )));
        // A run that fails before its report must not leave an earlier run's files to the table.
        for f in ["results.json", "requests.jsonl"] {
            let _ = std::fs::remove_file(opts.out.join(f));
        }
        eprintln!("[{tag}] {label}: demo, report in {}", opts.out.display());
        match tandem_e2e::demo::run(&opts).await {
            Ok(s) => all_ok &= s.passed(),
            Err(e) => {
                eprintln!("[{tag}] {label}: {:#}", anyhow::Error::from(e));
                all_ok = false;
            }
        }
    }
    all_ok
}

/// What an A/B ran, one line (workload, requests, time scale, samples, pod env).
fn ab_setting(base: &DemoOptions) -> String {
    format!(
        "{}, {} requests, time scale {}, samples {}, pod env {:?}",
        base.trace.as_ref().map_or_else(
            || "generated workload".to_owned(),
            |t| t.display().to_string()
        ),
        base.requests
            .map_or_else(|| "default".to_owned(), |n| n.to_string()),
        base.time_scale,
        base.samples.as_ref().map_or_else(
            || "manifests/samples".to_owned(),
            |d| d.display().to_string()
        ),
        tandem_e2e::demo::effective_pod_env(&base.pod_env),
    )
}

/// `demo --routing-ab`: the demo once per policy of [`AB_POLICIES`], then the table. The exit
/// code is success only when both ran and passed.
async fn routing_ab(base: DemoOptions) -> anyhow::Result<ExitCode> {
    if let Some(kv) = base
        .pod_env
        .iter()
        .find(|kv| kv.starts_with(&format!("{ROUTING_ENV}=")))
    {
        anyhow::bail!("--routing-ab sets {ROUTING_ENV} itself; drop --pod-env {kv}");
    }
    let variants = AB_POLICIES
        .iter()
        .map(|(label, value)| {
            let mut opts = base.clone();
            opts.pod_env.push(format!("{ROUTING_ENV}={value}"));
            (*label, opts)
        })
        .collect();
    let all_ok = demo_variants("routing-ab", &base, variants).await;
    let ab = RoutingAb::load(&base.out, &ab_setting(&base));
    ab.write(&base.out)
        .with_context(|| format!("writing into {}", base.out.display()))?;
    println!("{ab}");
    eprintln!(
        "[routing-ab] table in {}",
        base.out.join("routing-ab.md").display()
    );
    Ok(if all_ok && ab.missing.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("[routing-ab] a run failed or is missing: see its report");
        ExitCode::FAILURE
    })
}

/// `demo --snapshot-ab`: the demo with snapshot sync off, then on, on the same slice; then the
/// table ([`SnapshotAb`]). The exit code is success only when both ran and passed.
async fn snapshot_ab(base: DemoOptions) -> anyhow::Result<ExitCode> {
    let (workload, _) = tandem_e2e::demo::load_workload(&base)
        .map_err(|e| anyhow::anyhow!("loading the workload: {e}"))?;
    let variants = AB_SYNC
        .iter()
        .map(|(label, on)| {
            let mut opts = base.clone();
            opts.replay.snapshot_sync = *on;
            (*label, opts)
        })
        .collect();
    let all_ok = demo_variants("snapshot-ab", &base, variants).await;
    let ab = SnapshotAb::load(&base.out, &workload, &ab_setting(&base));
    ab.write(&base.out)
        .with_context(|| format!("writing into {}", base.out.display()))?;
    println!("{ab}");
    eprintln!(
        "[snapshot-ab] table in {}",
        base.out.join("snapshot-ab.md").display()
    );
    Ok(if all_ok && ab.missing.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("[snapshot-ab] a run failed or is missing: see its report");
        ExitCode::FAILURE
    })
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
        tandem_e2e::demo::daemon::start_runner_daemon(
            &config,
            args.runner_nodes,
            args.runner_gpus,
            &args.pod_env,
        )
        .await?;
    }
    eprintln!(
        "[tandem-e2e] kubectl: {}",
        running.bin_dir.kubectl().display()
    );
    eprintln!("[tandem-e2e] helm:    {}", running.bin_dir.helm().display());
    println!("{}", running.kubeconfig.display());
    Ok(ExitCode::SUCCESS)
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
    let mut defaults = PodDefaults::default();
    for spec in &args.pod_env {
        defaults.env.push(
            PodDefaults::parse_env(spec)
                .with_context(|| format!("bad --pod-env {spec:?} (want K=V)"))?,
        );
    }
    let runner = ProcessRunner::start_with(
        client,
        RunnerConfig {
            nodes,
            first_node_index: args.first_node_index,
            dir: config.runner_dir(),
            images,
            api_port,
        },
        defaults,
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
