//! `tandem-e2e demo` (issue 8, issue 4's main job): a local cluster, Tandem installed with Helm,
//! the sample stack (CacheTier, PrefillPool, DecodePool paired 4:1) running as real processes,
//! a trace replay through the front door with a scale-up at ~30% and a rolling restart at ~60%
//! (`--scale-at`, `--restart-at`),
//! then the stack deleted with its teardown order checked, and the report.
//!
//! Phases print `[demo] ...` progress lines; a failing phase is named in the error. After the
//! cluster is up, any failure still stops the cluster (unless `keep_cluster`) but keeps its
//! state dir (logs of every component and pod) and says where it is.
//!
//! * [`stack`]: binaries, helm, CRDs, samples, readiness, pod table, patches.
//! * [`pod_watch`]: pod churn events and pod end times.
//! * [`teardown`]: the teardown order check.
//! * [`daemon`]: the process-runner daemon of a cluster.

pub mod daemon;
pub mod pod_watch;
pub mod stack;
pub mod teardown;

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::cluster::{self, BuildMode, ClusterConfig, Ports};
use crate::replay::driver::{ReplayConfig, ReplayProgress, replay};
use crate::replay::schedule::Clock;
use crate::replay::targets::{TargetSet, decode_selector, spawn_discovery};
use crate::replay::workload::{self, TraceRequest};
use crate::report::events::{RESTART, SCALE};
use crate::report::sampler::{ReportSource, Sampler};
use crate::report::{Event, ReportInput, Summary, summarize_run, write_report};
use pod_watch::PodWatch;
use stack::StackError;

/// Namespace of the sample stack (`manifests/samples/*.yaml`).
pub const NAMESPACE: &str = "default";
/// The sample CacheTier.
pub const TIER: &str = "llama70b-l3";
/// The sample PrefillPool.
pub const PREFILL_POOL: &str = "llama70b-prefill";
/// The sample DecodePool.
pub const DECODE_POOL: &str = "llama70b-decode";
/// Namespace and release name of the Helm install.
pub const RELEASE_NAMESPACE: &str = "tandem-system";
/// Helm release name.
pub const RELEASE: &str = "tandem";
/// The sample files, in apply order (delete goes in reverse).
pub const SAMPLES: [&str; 3] = ["cachetier.yaml", "prefillpool.yaml", "decodepool.yaml"];

/// Options of the demo (the CLI's flags).
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// A Mooncake trace (JSONL); None: the built-in generated workload.
    pub trace: Option<PathBuf>,
    /// Timestamp multiplier.
    pub time_scale: f64,
    /// First N requests of the trace, or N generated (default 300).
    pub requests: Option<usize>,
    /// Report directory.
    pub out: PathBuf,
    /// Directory holding the stack's manifests (`cachetier.yaml`, `prefillpool.yaml`,
    /// `decodepool.yaml`, with the names of [`SAMPLES`]' resources); None: `manifests/samples`.
    /// A long replay on a small disk points it at a copy with a smaller `persistence.size`.
    pub samples: Option<PathBuf>,
    /// Leave the cluster (and the operator) running at the end.
    pub keep_cluster: bool,
    /// Port offset of the cluster (a second cluster on the machine).
    pub port_offset: u16,
    /// Cluster state dir (default: `~/.cache/tandem-e2e/cluster`, or `cluster-<offset>`).
    pub state_dir: Option<PathBuf>,
    /// Runner nodes and GPUs per node.
    pub runner_nodes: u32,
    /// `nvidia.com/gpu` per runner node.
    pub runner_gpus: u32,
    /// Extra pod env (`K=V`) for the workers' simulation knobs.
    pub pod_env: Vec<String>,
    /// Replay knobs (time scale is taken from `time_scale`).
    pub replay: ReplayConfig,
    /// Fail instead of building the control plane.
    pub cached_only: bool,
    /// Deadline of each wait (operator, Ready, restart, teardown).
    pub wait_timeout: Duration,
    /// Run the PrefillPool and the DecodePool with the worker's built-in engine instead of the
    /// Simulated engine container on the engine API ([`with_simulated_engine`]).
    pub builtin_engine: bool,
    /// Percent of the requests dispatched at which the DecodePool scales up by one (1–99).
    pub scale_at_pct: usize,
    /// Percent of the requests dispatched at which the rolling restart starts (1–99). A short
    /// replay needs it early: the decode groups restart only after `ceil((k+1)·P/D)` prefill
    /// groups are back at the new revision (the operator's rollout gate), which at the demo's 8:2
    /// takes most of a two-minute slice.
    pub restart_at_pct: usize,
}

/// Default of [`DemoOptions::scale_at_pct`].
pub const DEFAULT_SCALE_AT_PCT: usize = 30;
/// Default of [`DemoOptions::restart_at_pct`].
pub const DEFAULT_RESTART_AT_PCT: usize = 60;

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            trace: None,
            time_scale: 1.0,
            requests: None,
            out: PathBuf::from("tandem-demo-out"),
            samples: None,
            keep_cluster: false,
            port_offset: 0,
            state_dir: None,
            runner_nodes: 1,
            runner_gpus: 16,
            pod_env: Vec::new(),
            replay: ReplayConfig::default(),
            cached_only: false,
            wait_timeout: Duration::from_secs(300),
            builtin_engine: false,
            scale_at_pct: DEFAULT_SCALE_AT_PCT,
            restart_at_pct: DEFAULT_RESTART_AT_PCT,
        }
    }
}

/// The demo's phases, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Loading or generating the workload.
    Workload,
    /// Building tandem-worker and tandem-operator.
    Binaries,
    /// Control plane and process runner.
    Cluster,
    /// `helm install` and the operator Deployment.
    Install,
    /// Applying the samples and waiting for Ready.
    Stack,
    /// The replay with scale-up and rolling restart.
    Replay,
    /// Deleting the stack.
    Teardown,
    /// Writing the report.
    Report,
    /// Stopped by Ctrl-C or SIGTERM (whatever phase was running).
    Interrupted,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Workload => "workload",
            Self::Binaries => "binaries",
            Self::Cluster => "cluster up",
            Self::Install => "helm install",
            Self::Stack => "sample stack",
            Self::Replay => "replay",
            Self::Teardown => "teardown",
            Self::Report => "report",
            Self::Interrupted => "interrupted",
        })
    }
}

/// A failed phase.
#[derive(Debug, thiserror::Error)]
#[error("demo phase `{phase}` failed")]
pub struct DemoError {
    /// Which phase.
    pub phase: Phase,
    /// Why.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

fn at<E: std::error::Error + Send + Sync + 'static>(phase: Phase) -> impl FnOnce(E) -> DemoError {
    move |e| DemoError {
        phase,
        source: Box::new(e),
    }
}

fn say(msg: impl fmt::Display) {
    eprintln!("[demo] {msg}");
}

/// The signal that interrupted the demo.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by {0}")]
pub struct Interrupted(&'static str);

/// Resolves on Ctrl-C or SIGTERM (on Ctrl-C alone when the SIGTERM handler cannot be installed;
/// never when neither can). After it resolved, the demo cleans up; a second signal during the
/// cleanup ends the process at once (see [`exit_on_second_signal`]).
async fn interrupted() -> Interrupted {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return match tokio::signal::ctrl_c().await {
            Ok(()) => Interrupted("SIGINT"),
            Err(_) => std::future::pending().await,
        };
    };
    tokio::select! {
        Ok(()) = tokio::signal::ctrl_c() => Interrupted("SIGINT"),
        _ = term.recv() => Interrupted("SIGTERM"),
    }
}

/// While the cleanup after a signal runs, a second Ctrl-C or SIGTERM exits with status 130
/// (tokio keeps its handlers installed, so without this a hanging cleanup could not be stopped).
fn exit_on_second_signal() {
    tokio::spawn(async {
        let second = interrupted().await;
        eprintln!("[demo] {second} during cleanup: exiting now; processes may be left running");
        std::process::exit(130);
    });
}

/// `yaml` (a PrefillPool or DecodePool manifest) with `spec.engine: {kind: Simulated}` — the
/// pool's KV computed (prefill) or received, verified and decoded (decode) by the simulated engine
/// as its own container, through the engine API (DESIGN §3.1) — unless it names an engine already.
///
/// # Errors
/// A message when the manifest has no top-level `spec:` line.
pub fn with_simulated_engine(yaml: &str) -> Result<String, String> {
    if yaml.lines().any(|l| l.trim_start().starts_with("engine:")) {
        return Ok(yaml.to_owned());
    }
    let mut out = String::with_capacity(yaml.len() + 40);
    let mut done = false;
    for line in yaml.split_inclusive('\n') {
        out.push_str(line);
        if !done && line.trim_end() == "spec:" {
            if !line.ends_with('\n') {
                out.push('\n');
            }
            out.push_str("  engine:\n    kind: Simulated\n");
            done = true;
        }
    }
    if done {
        Ok(out)
    } else {
        Err("the pool manifest has no top-level `spec:` line".to_owned())
    }
}

/// The workload of `opts`: the trace's first N requests, or N generated ones (default 300).
pub fn load_workload(
    opts: &DemoOptions,
) -> Result<(Vec<TraceRequest>, String), workload::WorkloadError> {
    workload::select_workload(opts.trace.as_deref(), opts.requests)
}

/// Simulation knobs the demo gives every pod unless `--pod-env` sets the same key: the sample
/// model's real KV geometry (llama-3-70b, 320 KiB per token) would make a 12k-token prompt move
/// 4 GB through a 1 GiB host pool on a 2-core machine; 1 KiB per token keeps every mechanism
/// (pages, transfer, tiers, loadback) exercised at a size the machine can replay in real time.
///
/// The replay's abort probe (`--abort-every`, on by default) makes seed 004's deadline aborts happen
/// on a known fraction of requests whatever the machine's speed; the report's `aborts` line counts
/// them and its checks require acks and 0 corrupt pages. The release gate keeps its default proof
/// (the TCP fence or the ack): `--pod-env TANDEM_DECODE_GATE_PROOF=ack-only` runs the ack-only rule
/// RDMA needs, which over TCP has no proof for the rooms of a prefill that died — the demo's rolling
/// restart then quarantines their pages for good (seen: 1,914 pages), so it is not the default.
pub const DEFAULT_POD_ENV: [&str; 1] = ["TANDEM_SIM_KV_BYTES_PER_TOKEN=1024"];

/// `DEFAULT_POD_ENV` overridden by the user's `K=V` entries (same key: the user's wins), then the
/// user's other entries, in order.
pub fn effective_pod_env(user: &[String]) -> Vec<String> {
    let key = |kv: &str| kv.split_once('=').map_or(kv, |(k, _)| k).to_owned();
    let user_keys: Vec<String> = user.iter().map(|kv| key(kv)).collect();
    DEFAULT_POD_ENV
        .iter()
        .filter(|kv| !user_keys.contains(&key(kv)))
        .map(|kv| kv.to_string())
        .chain(user.iter().cloned())
        .collect()
}

/// The cluster config of `opts`.
pub fn cluster_config(opts: &DemoOptions) -> ClusterConfig {
    let mut c = ClusterConfig::default_cli();
    c.ports = Ports::with_offset(opts.port_offset);
    c.state_dir = match (&opts.state_dir, opts.port_offset) {
        (Some(d), _) => d.clone(),
        (None, 0) => cluster::default_state_dir(),
        (None, k) => cluster::cache_root().join(format!("cluster-{k}")),
    };
    c.kwok_nodes = 0;
    c.build = if opts.cached_only {
        BuildMode::CachedOnly
    } else {
        BuildMode::BuildIfMissing
    };
    c
}

/// Runs the demo; returns the summary (its [`Summary::passed`] decides the exit code).
pub async fn run(opts: &DemoOptions) -> Result<Summary, DemoError> {
    let (workload, source) = load_workload(opts).map_err(at(Phase::Workload))?;
    say(format!(
        "workload: {source}, {} requests, time scale {}",
        workload.len(),
        opts.time_scale
    ));
    say("phase binaries: tandem-worker, tandem-operator");
    stack::ensure_binaries()
        .await
        .map_err(at(Phase::Binaries))?;
    let config = cluster_config(opts);
    say(format!(
        "phase cluster up: state dir {}",
        config.state_dir.display()
    ));
    let running = cluster::up::up(&config).await.map_err(at(Phase::Cluster))?;
    let on_cluster = async {
        let pod_env = effective_pod_env(&opts.pod_env);
        say(format!("pod env: {pod_env:?}"));
        daemon::start_runner_daemon(&config, opts.runner_nodes, opts.runner_gpus, &pod_env)
            .await
            .map_err(at(Phase::Cluster))?;
        on_cluster(opts, &running, workload, source).await
    };
    // A signal abandons the phase but not the cleanup below: the cluster, the runner daemon and
    // its worker processes are stopped (state kept for the logs), never left behind.
    let outcome = tokio::select! {
        r = on_cluster => r,
        signal = interrupted() => {
            say(format!("{signal}: stopping"));
            exit_on_second_signal();
            Err(at(Phase::Interrupted)(signal))
        }
    };
    if opts.keep_cluster {
        say(format!(
            "cluster kept: KUBECONFIG={} ; stop it with `tandem-e2e cluster down --state-dir {}`",
            running.kubeconfig.display(),
            config.state_dir.display()
        ));
    } else {
        let keep_state = outcome.is_err();
        say(if keep_state {
            format!(
                "stopping the cluster; logs kept in {}",
                config.state_dir.display()
            )
        } else {
            "stopping the cluster".to_owned()
        });
        if let Err(e) = cluster::down::down(&config, keep_state).await {
            say(format!("cluster down: {e}"));
        }
    }
    outcome
}

async fn on_cluster(
    opts: &DemoOptions,
    running: &cluster::up::RunningCluster,
    workload: Vec<TraceRequest>,
    source: String,
) -> Result<Summary, DemoError> {
    let client = cluster::client_for(&running.kubeconfig)
        .await
        .map_err(at(Phase::Cluster))?;
    let kubeconfig = running.kubeconfig.to_string_lossy().into_owned();
    let root = stack::repo_root();

    say("phase helm install: charts/tandem");
    let chart = root.join("charts/tandem").to_string_lossy().into_owned();
    stack::run_command(
        &running.bin_dir.helm(),
        &[
            "install",
            RELEASE,
            &chart,
            "--namespace",
            RELEASE_NAMESPACE,
            "--create-namespace",
            "--kubeconfig",
            &kubeconfig,
        ],
    )
    .await
    .map_err(at(Phase::Install))?;
    stack::wait_crds_established(&client, opts.wait_timeout)
        .await
        .map_err(at(Phase::Install))?;
    stack::wait_deployments_available(&client, RELEASE_NAMESPACE, opts.wait_timeout)
        .await
        .map_err(at(Phase::Install))?;

    say("phase sample stack: CacheTier, PrefillPool, DecodePool (4:1)");
    let samples_dir = opts
        .samples
        .clone()
        .unwrap_or_else(|| root.join("manifests/samples"));
    say(format!("samples from {}", samples_dir.display()));
    let mut manifests: Vec<String> = SAMPLES
        .iter()
        .map(|f| samples_dir.join(f).to_string_lossy().into_owned())
        .collect();
    if !opts.builtin_engine {
        // Both pools run through the engine API: the Simulated engine as its own container.
        let stack_dir = opts.out.join("stack");
        std::fs::create_dir_all(&stack_dir)
            .map_err(|e| StackError::Missing(format!("{}: {e}", stack_dir.display())))
            .map_err(at(Phase::Stack))?;
        for i in [1, 2] {
            let src = samples_dir.join(SAMPLES[i]);
            let text = std::fs::read_to_string(&src)
                .map_err(|e| StackError::Missing(format!("{}: {e}", src.display())))
                .map_err(at(Phase::Stack))?;
            let with = with_simulated_engine(&text)
                .map_err(|e| StackError::Missing(format!("{}: {e}", src.display())))
                .map_err(at(Phase::Stack))?;
            let path = stack_dir.join(SAMPLES[i]);
            std::fs::write(&path, with)
                .map_err(|e| StackError::Missing(format!("{}: {e}", path.display())))
                .map_err(at(Phase::Stack))?;
            manifests[i] = path.to_string_lossy().into_owned();
        }
        say(format!(
            "PrefillPool and DecodePool on the Simulated engine (engine API): {}",
            stack_dir.display()
        ));
    }
    let mut apply = vec!["apply", "--kubeconfig", &kubeconfig];
    for s in &manifests {
        apply.extend(["-f", s]);
    }
    let out = stack::run_command(&running.bin_dir.kubectl(), &apply)
        .await
        .map_err(at(Phase::Stack))?;
    say(out.trim());
    let names = stack::StackNames {
        tier: TIER,
        prefill: PREFILL_POOL,
        decode: DECODE_POOL,
    };
    stack::wait_resources_ready(&client, NAMESPACE, names, opts.wait_timeout)
        .await
        .map_err(at(Phase::Stack))?;
    let pods = stack::list_tandem_pods(&client, NAMESPACE)
        .await
        .map_err(at(Phase::Stack))?;
    say(format!(
        "running:\n{}",
        stack::render_table(&stack::pod_rows(&pods))
    ));

    say(format!(
        "phase replay: {} requests into {}",
        workload.len(),
        decode_selector(DECODE_POOL)
    ));
    let clock = Clock::start();
    let pod_watch = PodWatch::start(client.clone(), NAMESPACE, clock);
    let targets = TargetSet::default();
    let discovery = spawn_discovery(
        client.clone(),
        NAMESPACE.to_owned(),
        DECODE_POOL.to_owned(),
        targets.clone(),
        Duration::from_secs(1),
    );
    stack::poll(
        "a front door in the target set",
        Duration::from_secs(30),
        || {
            let t = targets.snapshot();
            async move { ((!t.is_empty()).then_some(()), format!("{t:?}")) }
        },
    )
    .await
    .map_err(at(Phase::Replay))?;
    let sampler = Sampler::start(
        ReportSource::Kube {
            client: client.clone(),
            namespace: NAMESPACE.to_owned(),
        },
        Duration::from_secs(1),
        clock,
    );
    let (tx, rx) = watch::channel(ReplayProgress::default());
    let actions_log = Arc::new(Mutex::new(Vec::new()));
    let actions = tokio::spawn(mid_replay_actions(
        client.clone(),
        rx,
        clock,
        actions_log.clone(),
        opts.wait_timeout,
        (opts.scale_at_pct, opts.restart_at_pct),
    ));
    let bar = crate::report::session::request_bar(workload.len());
    let cfg = ReplayConfig {
        time_scale: opts.time_scale,
        ..opts.replay.clone()
    };
    let results = replay(&workload, &targets, &cfg, clock, Some(tx), Some(bar)).await;
    say("replay done; waiting for the scale-up and the rolling restart to finish");
    let action_result = match tokio::time::timeout(opts.wait_timeout * 2, actions).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(StackError::Missing(format!("mid-replay actions task: {e}"))),
        Err(_) => Err(StackError::Missing(
            "mid-replay actions did not finish".to_owned(),
        )),
    };
    if let Err(e) = &action_result {
        say(format!("scale/restart: {e}"));
    }
    // One more sampling round after the restart so the new workers' loadback counters are in.
    let samples = sampler.finish().await;
    discovery.abort();

    say("phase teardown: deleting DecodePool, PrefillPool, CacheTier");
    let t_delete = clock.ms();
    let mut delete = vec!["delete", "--wait=false", "--kubeconfig", &kubeconfig];
    for s in manifests.iter().rev() {
        delete.extend(["-f", s.as_str()]);
    }
    let teardown = async {
        stack::run_command(&running.bin_dir.kubectl(), &delete).await?;
        stack::poll("every stack pod gone", opts.wait_timeout, || {
            let client = client.clone();
            async move {
                match stack::list_tandem_pods(&client, NAMESPACE).await {
                    Ok(p) if p.is_empty() => (Some(()), String::new()),
                    Ok(p) => (None, format!("{} pods left", p.len())),
                    Err(e) => (None, e.to_string()),
                }
            }
        })
        .await?;
        Ok::<(), StackError>(())
    }
    .await;
    let marked = pod_watch.mark_missing_gone(&[], clock.ms());
    if marked > 0 {
        say(format!(
            "{marked} pods vanished without a Deleted watch event (timed at detection)"
        ));
    }
    let mut events: Vec<Event> = actions_log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    events.extend(pod_watch.events());
    events.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    let ends = pod_watch.ends_since(t_delete);
    pod_watch.stop();
    let teardown_report = teardown::teardown_report(ends);

    say("phase report");
    let ceiling = workload::ceiling_hit_tokens(&workload);
    let mut summary = summarize_run(ReportInput {
        source,
        time_scale: opts.time_scale,
        unbounded_hit_ratio: workload::unbounded_hit_ratio(&workload),
        ceiling_hit_tokens: &ceiling,
        results: &results,
        samples: &samples,
        events: &events,
        teardown: Some(teardown_report.clone()),
    });
    summary.check(
        "teardown order decode → prefill → cache",
        teardown.is_ok() && teardown_report.order_held,
        match (&teardown, &teardown_report.violation) {
            (Err(e), _) => format!("teardown did not finish: {e}"),
            (Ok(()), Some(v)) => v.to_string(),
            (Ok(()), None) => format!("{} pods, order held", teardown_report.pods.len()),
        },
    );
    // Zero corrupt pages means something only if the workers' counters were actually read.
    summary.check(
        "worker /report sampled",
        summary.worker_incarnations > 0,
        format!(
            "{} worker incarnations, {} failed GETs",
            summary.worker_incarnations, summary.sample_errors
        ),
    );
    let restarted = events.iter().any(|e| e.kind == "restart-done");
    let last_finished = results.iter().map(|r| r.finished_ms).fold(0.0, f64::max);
    summary.decode_restart_under_traffic =
        events.iter().find(|e| e.kind == RESTART).map(|restart| {
            events.iter().any(|e| {
                e.kind == "pod-deleting"
                    && e.detail.contains("(decode ")
                    && (restart.t_ms..=last_finished).contains(&e.t_ms)
            })
        });
    let loaded = summary.l3_pages_loaded_back_after_restart.unwrap_or(0);
    summary.check(
        "rolling restart with L3 loadback",
        restarted && loaded > 0,
        format!(
            "restart {}; l3_pages_loaded_back by restarted workers: {loaded}",
            if restarted {
                "completed"
            } else {
                "did NOT complete"
            }
        ),
    );
    // Seed 004's race happened and was survived: rooms aborted while their KV was on the way, the
    // prefills acked, and (the corruption check above) no reused page was read corrupt.
    if let Some(p) = opts.replay.abort_probe.filter(|p| p.every > 0) {
        let c = &summary.worker_counters;
        let probed = results.iter().filter(|r| p.probes(r.index)).count();
        summary.check(
            "aborted rooms released through the gate",
            probed == 0 || (c.rooms_aborted > 0 && c.abort_acks > 0),
            format!(
                "abort probe on {probed} requests (every {}th, KV deadline {} ms): {} rooms \
                 aborted, {} acks, {} pages quarantined",
                p.every, p.kv_deadline_ms, c.rooms_aborted, c.abort_acks, c.pages_quarantined
            ),
        );
    }
    // Snapshot sync on the live stack (issue 15, seed 002): the slice's sessions were pushed to
    // their next turn's prefill and taken. Not 99 % here: the rolling restart may take a
    // prefill away in the middle of a sync (a counted failure, not a loss).
    if opts.replay.snapshot_sync {
        let sessions = workload::session_kv_hashes(&workload)
            .iter()
            .filter(|s| !s.is_empty())
            .count();
        let c = &summary.worker_counters;
        let ok_share = if c.snapshot_sync_attempts == 0 {
            0.0
        } else {
            c.snapshot_sync_ok as f64 / c.snapshot_sync_attempts as f64
        };
        summary.check(
            "snapshot sync: sessions pushed to their next turn's prefill",
            sessions == 0 || (c.snapshot_sync_attempts > 0 && ok_share >= 0.9),
            format!(
                "{sessions} sessions in the slice: {} syncs started, {} ok ({:.0} %), failed {}                  buffer full / {} transfer / {} other; {} finalized, {} next-turn tokens hit                  pages only a snapshot brought",
                c.snapshot_sync_attempts,
                c.snapshot_sync_ok,
                100.0 * ok_share,
                c.snapshot_sync_failed_buf_full,
                c.snapshot_sync_failed_transfer,
                c.snapshot_sync_failed_other,
                c.snapshot_finalized,
                c.snapshot_hit_tokens
            ),
        );
    }
    write_report(&opts.out, &mut summary, &results, &samples).map_err(at(Phase::Report))?;
    println!("{summary}");
    say(format!("report in {}", opts.out.display()));
    Ok(summary)
}

/// At ≥ `at.0` % of requests dispatched (default 30): DecodePool `replicas` + 1 (the PrefillPool
/// follows the ratio); at ≥ `at.1` % (default 60): a new `spec.restart.id` (ordered rolling
/// restart). Records `scale`,
/// `scale-ready`, `restart`, `restart-done` events into `log` as they happen; returns once the
/// restart is done (every decode pod serving on a new revision) or fails.
async fn mid_replay_actions(
    client: kube::Client,
    mut progress: watch::Receiver<ReplayProgress>,
    clock: Clock,
    log: Arc<Mutex<Vec<Event>>>,
    timeout: Duration,
    (scale_at, restart_at): (usize, usize),
) -> Result<(), StackError> {
    let record = |e: Event| {
        say(format!("event {}: {}", e.kind, e.detail));
        log.lock().unwrap_or_else(|e| e.into_inner()).push(e);
    };
    let reached =
        |p: &ReplayProgress, pct: usize| p.total > 0 && p.dispatched * 100 >= p.total * pct;
    let _ = progress.wait_for(|p| reached(p, scale_at)).await;
    let before = stack::decode_replicas(&client, NAMESPACE, DECODE_POOL).await?;
    stack::patch_decode_pool(
        &client,
        NAMESPACE,
        DECODE_POOL,
        serde_json::json!({ "replicas": before + 1 }),
    )
    .await?;
    record(Event::new(
        clock.ms(),
        SCALE,
        format!(
            "DecodePool replicas {before} → {} (PrefillPool follows the ratio)",
            before + 1
        ),
    ));
    let scale_ready = {
        let client = client.clone();
        let want = (before + 1) as usize;
        async move {
            let r = stack::poll("scaled DecodePool serving", timeout, || {
                let client = client.clone();
                async move {
                    serving_decode(&client, None)
                        .await
                        .map_or((None, String::new()), |(n, s)| {
                            ((n >= want).then_some(()), s)
                        })
                }
            })
            .await;
            (r, clock.ms())
        }
    };
    let restart = async {
        let _ = progress.wait_for(|p| reached(p, restart_at)).await;
        let old = revisions(&client).await?;
        let id = format!("demo-{}", jiff::Timestamp::now().as_millisecond());
        stack::patch_decode_pool(
            &client,
            NAMESPACE,
            DECODE_POOL,
            serde_json::json!({ "restart": { "id": id } }),
        )
        .await?;
        let t = clock.ms();
        Ok::<_, StackError>((t, id, old))
    };
    let ((scaled, t_scaled), started) = tokio::join!(scale_ready, restart);
    match scaled {
        Ok(()) => record(Event::new(
            t_scaled,
            "scale-ready",
            format!("{} decode pods serving", before + 1),
        )),
        Err(e) => say(format!("scale-up: {e}")),
    }
    let (t, id, old) = started?;
    record(Event::new(
        t,
        RESTART,
        format!("restart.id → {id} (old revisions {old:?})"),
    ));
    let want = (before + 1) as usize;
    stack::poll("rolling restart done", timeout, || {
        let client = client.clone();
        let old = old.clone();
        async move {
            match serving_decode(&client, Some(&old)).await {
                Some((n, s)) => ((n >= want).then_some(()), s),
                None => (None, String::new()),
            }
        }
    })
    .await?;
    record(Event::new(
        clock.ms(),
        "restart-done",
        format!("{want} decode pods serving on a new revision"),
    ));
    Ok(())
}

/// Decode pods of the sample pool serving now (with `exclude_revisions`: only those on another
/// revision, and `None` while any pod of an excluded revision remains).
async fn serving_decode(
    client: &kube::Client,
    exclude_revisions: Option<&[String]>,
) -> Option<(usize, String)> {
    let api: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(client.clone(), NAMESPACE);
    let pods = api
        .list(&kube::api::ListParams::default().labels(&decode_selector(DECODE_POOL)))
        .await
        .ok()?
        .items;
    let rows = stack::pod_rows(&pods);
    let desc = format!(
        "{:?}",
        rows.iter()
            .map(|r| format!("{} {} ready={}", r.name, r.revision, r.ready))
            .collect::<Vec<_>>()
    );
    if let Some(ex) = exclude_revisions
        && rows.iter().any(|r| ex.contains(&r.revision))
    {
        return Some((0, desc));
    }
    Some((rows.iter().filter(|r| r.ready).count(), desc))
}

async fn revisions(client: &kube::Client) -> Result<Vec<String>, StackError> {
    let pods = stack::list_tandem_pods(client, NAMESPACE).await?;
    let mut revs: Vec<String> = stack::pod_rows(&pods)
        .into_iter()
        .filter(|r| r.role == tandem_crds::labels::ROLE_DECODE && r.pool == DECODE_POOL)
        .map(|r| r.revision)
        .collect();
    revs.sort();
    revs.dedup();
    Ok(revs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_names_match_the_manifests() {
        let dir = stack::repo_root().join("manifests/samples");
        for (file, name) in SAMPLES.iter().zip([TIER, PREFILL_POOL, DECODE_POOL]) {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            assert!(
                text.contains(&format!("name: {name}\n")),
                "{file} does not name {name}"
            );
            assert!(text.contains(&format!("namespace: {NAMESPACE}\n")));
        }
    }

    #[test]
    fn the_sample_pools_get_the_simulated_engine_once() {
        let dir = stack::repo_root().join("manifests/samples");
        for file in [SAMPLES[1], SAMPLES[2]] {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            let with = with_simulated_engine(&text).unwrap();
            assert!(
                with.contains("spec:\n  engine:\n    kind: Simulated\n"),
                "{file}: {with}"
            );
            assert_eq!(
                with.len(),
                text.len() + "  engine:\n    kind: Simulated\n".len()
            );
            assert_eq!(with_simulated_engine(&with).unwrap(), with, "idempotent");
        }
        assert!(with_simulated_engine("kind: PrefillPool\n").is_err());
    }

    #[test]
    fn pod_env_defaults_yield_to_the_user() {
        assert_eq!(effective_pod_env(&[]), DEFAULT_POD_ENV.map(str::to_owned));
        let user = vec![
            "TANDEM_SIM_KV_BYTES_PER_TOKEN=8".to_owned(),
            "TANDEM_SIM_TPOT_MS=1".to_owned(),
        ];
        let env = effective_pod_env(&user);
        assert!(!env.contains(&"TANDEM_SIM_KV_BYTES_PER_TOKEN=1024".to_owned()));
        assert_eq!(env[env.len() - 2..], user[..], "{env:?}");
    }

    #[test]
    fn default_workload_and_cluster_config() {
        let opts = DemoOptions::default();
        let (w, src) = load_workload(&opts).unwrap();
        assert_eq!(w.len(), 300);
        assert!(src.starts_with("generated"));
        let c = cluster_config(&DemoOptions {
            port_offset: 7,
            ..DemoOptions::default()
        });
        assert_eq!(c.ports.api, 26450);
        assert!(c.state_dir.ends_with("cluster-7"));
    }
}
