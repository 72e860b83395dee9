//! `tandem-e2e scale`: the operator against a real API server with N stacks on simulated (kwok)
//! nodes, measured (issue 17).
//!
//! For each N: a fresh control plane (etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler) and kwok nodes with `nvidia.com/gpu` capacity, zone and rack labels
//! ([`stacks::topology_node`]); the CRDs; the operator binary as a local process (admin kubeconfig,
//! no leader election, `--probe-reports=false`, a short `--resync-seconds`); then N stacks
//! ([`stacks::stack`]) applied one after another, and:
//!
//! - **apply-to-Ready** per stack: from the stack's last apply to the first time all three of its
//!   objects were seen `Ready=True` (watches);
//! - the operator's **reconcile latency** (its histogram's bucket deltas over the run: the
//!   p50/p99 figures are "at most" bucket bounds) and **queue depth** (its
//!   `reconciles_in_flight` gauge, sampled every 250 ms);
//! - its **RSS** (peak `VmHWM`) and **CPU** seconds (`/proc`);
//! - **API requests by verb** and resource: the API server's `apiserver_request_total` scraped
//!   before the first apply and once settled (every client: the operator, KCM, the scheduler,
//!   kwok, this harness);
//! - **writes per steady resync**: after everything settled, the operator's `writes_total` (every
//!   write, events included) across a window in which it reconciled every object at least once
//!   more (its `reconcile_duration_seconds` count grew by at least 3N). Must be 0.
//!
//! Then, in the first N's cluster when `scale_groups > 0`: one more stack ([`stacks::scaled_stack`])
//! scaled 1 → `scale_groups` decode groups (prefill following the ratio) and a rolling restart
//! (`spec.restart.id`) of all of them: time to converge, and from a pod watch, how many groups of
//! each pool served at every pod event (never none).
//!
//! **Readiness on simulated nodes.** kwok's `pod-ready` stage marks a scheduled pod Ready; no
//! process runs. The operator decides a pool's `Ready` from its pods' `Ready` conditions only
//! (group readiness: every `tensor × context` pod Ready), so pool readiness here is the real
//! decision on simulated pods. The one HTTP read it makes — a cache replica's `GET /report` for
//! `CacheWarm` — is switched off (`--probe-reports=false`): `CacheWarm` then says
//! `ReadyApproximation`, and the report says so. Nothing serves traffic: these figures are the
//! control plane's, not the data plane's.

pub mod placement;
pub mod probe;
pub mod prom;
pub mod report;
pub mod stacks;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, CustomResourceExt, Resource, ResourceExt};
use serde::Serialize;
use tandem_crds::{CacheTier, DecodePool, PrefillPool};

use self::probe::{ProcSampler, ReadyTimes, ServingPoint, ServingTracker, StackPhases};
use self::report::{RunFigures, ScaleFigures, ScaleReport};
use self::stacks::{Samples, Stack};
use crate::cluster::down::down;
use crate::cluster::up::{RunningCluster, node_ready, up};
use crate::cluster::{BuildMode, ClusterConfig, Ports, cache_root, client_for};
use crate::demo::stack::{poll, repo_root, wait_crds_established};
use crate::report::percentile;

/// Field manager of what the scale run applies.
pub const FIELD_MANAGER: &str = "tandem-e2e-scale";
/// Namespace of the scaled stack.
pub const SCALED_NAMESPACE: &str = "scale-pool";

/// What to run.
#[derive(Debug, Clone)]
pub struct ScaleOptions {
    /// Stack counts, one cluster each.
    pub stacks: Vec<usize>,
    /// Report directory.
    pub out: PathBuf,
    /// Added to every cluster port.
    pub port_offset: u16,
    /// Cluster state dir (default `~/.cache/tandem-e2e/scale-<offset>`).
    pub state_dir: Option<PathBuf>,
    /// `nvidia.com/gpu` per kwok node.
    pub gpus_per_node: u32,
    /// Decode groups the scaled pool goes to (0: no scale/restart experiment).
    pub scale_groups: u32,
    /// The operator's `--resync-seconds` (default: N / 5 clamped to 20..300).
    pub resync_seconds: Option<u64>,
    /// The operator's `--child-cache` (default true; false: the baseline that LISTs children on
    /// every reconcile).
    pub read_cache: bool,
    /// Directory of the three sample manifests (default `manifests/samples`).
    pub samples: Option<PathBuf>,
    /// The operator binary (default `$TANDEM_OPERATOR_BIN`, else next to this executable or one
    /// directory up, as a test binary in `target/<profile>/deps` finds it).
    pub operator_bin: Option<PathBuf>,
    /// How to obtain the control-plane binaries.
    pub build: BuildMode,
    /// Longest wait for any one phase.
    pub phase_timeout: Duration,
    /// Report where the pods went by this node label, whatever the pools' own
    /// `placement.topologyKey` (a baseline); `None`: by the pools' key, if any.
    pub placement_key: Option<String>,
    /// Stacks applied per second, open loop (stack i at i / rate s after the first); `None`: as
    /// fast as the API server takes them (4 in flight). A burst measures how long N stacks queue
    /// behind each other; a rate the control plane sustains measures each stack's own latency,
    /// which is what "apply→Ready flat in N" asks of the operator (issue 17).
    pub apply_rate: Option<f64>,
}

impl Default for ScaleOptions {
    fn default() -> Self {
        Self {
            stacks: vec![10],
            out: PathBuf::from("tandem-scale-out"),
            port_offset: 0,
            state_dir: None,
            gpus_per_node: 8,
            scale_groups: 64,
            resync_seconds: None,
            read_cache: true,
            samples: None,
            operator_bin: None,
            build: BuildMode::BuildIfMissing,
            phase_timeout: Duration::from_secs(900),
            placement_key: None,
            apply_rate: None,
        }
    }
}

/// Why a scale run failed.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// The cluster could not be brought up or talked to.
    #[error("cluster: {0}")]
    Cluster(#[from] crate::cluster::ClusterError),
    /// An API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A wait timed out or a step failed.
    #[error("{0}")]
    Stack(#[from] crate::demo::stack::StackError),
    /// The samples could not be read.
    #[error("samples: {0}")]
    Samples(#[from] stacks::StackError),
    /// The operator could not be started or died.
    #[error("operator: {0}")]
    Operator(String),
    /// The report could not be written.
    #[error("report: {0}")]
    Report(String),
}

/// The operator's `--resync-seconds` for `n` stacks: N / 5, clamped to 20..=300 (3N reconciles
/// per interval stay near 30 per second at N = 1,000 on two cores).
pub fn default_resync(n: usize) -> u64 {
    (n as u64 / 5).clamp(20, 300)
}

/// Runs every N of `opts` and writes the report; returns it.
///
/// # Errors
/// A phase failed (the cluster of that N is stopped first).
pub async fn run_scale(opts: &ScaleOptions) -> Result<ScaleReport, ScaleError> {
    let samples_dir = opts
        .samples
        .clone()
        .unwrap_or_else(|| repo_root().join("manifests/samples"));
    let samples = Samples::read(&samples_dir)?;
    let mut runs = Vec::new();
    let mut scaled = None;
    for (i, &n) in opts.stacks.iter().enumerate() {
        let with_scale = (i == 0 && opts.scale_groups > 0).then_some(opts.scale_groups);
        let (figures, s) = run_one(opts, &samples, n, with_scale).await?;
        eprintln!("[scale] {}", report::row_line(&figures));
        runs.push(figures);
        if s.is_some() {
            scaled = s;
        }
        // The report so far: a later N that fails or is stopped keeps the earlier figures.
        ScaleReport::new(runs.clone(), scaled.clone())
            .write(&opts.out)
            .map_err(|e| ScaleError::Report(e.to_string()))?;
    }
    Ok(ScaleReport::new(runs, scaled))
}

fn cluster_config(opts: &ScaleOptions) -> ClusterConfig {
    ClusterConfig {
        state_dir: opts
            .state_dir
            .clone()
            .unwrap_or_else(|| cache_root().join(format!("scale-{}", opts.port_offset))),
        ports: Ports::with_offset(opts.port_offset),
        controller_manager: true,
        scheduler: true,
        // `up` starts kwok and its first node; the run then applies all of its nodes.
        kwok_nodes: 1,
        kwok_gpus_per_node: opts.gpus_per_node,
        build: opts.build,
    }
}

/// Where the scheduler put the pool pods, by `key` when given (a baseline run, or one whose pools
/// place by a key the nodes lack), else by a sample pool's `placement.topologyKey` (the decode's,
/// else the prefill's); `None` when neither names one.
async fn placement_figures(
    client: &kube::Client,
    samples: &Samples,
    key: Option<&str>,
) -> Result<Option<placement::PlacementFigures>, ScaleError> {
    let key = key.map(str::to_owned).or_else(|| {
        [
            &samples.decode.spec.placement,
            &samples.prefill.spec.placement,
        ]
        .into_iter()
        .flatten()
        .map(|p| p.topology_key.as_str().to_owned())
        .next()
    });
    let Some(key) = key else {
        return Ok(None);
    };
    let lp = ListParams::default().labels(tandem_crds::labels::POOL);
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone())
        .list(&lp)
        .await?;
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let mut f = placement::figures(&pods.items, &nodes.items, &key);
    let lp = ListParams::default();
    let prefill = Api::<PrefillPool>::all(client.clone()).list(&lp).await?;
    let decode = Api::<DecodePool>::all(client.clone()).list(&lp).await?;
    let statuses: Vec<_> = (prefill.items.iter().map(|p| p.status.as_ref()))
        .chain(decode.items.iter().map(|d| d.status.as_ref()))
        .collect();
    f.pools = statuses.len();
    f.pools_reporting_unlabeled_nodes = statuses
        .into_iter()
        .filter(|s| placement::reports_unlabeled_node(*s))
        .count();
    eprintln!(
        "[scale] placement by {key}: {} pods in {} groups ({} of several pods), {} split, {} decode \
         pods without a prefill pod in their domain, {} on unlabeled nodes ({} of {} pools report \
         it), per domain {:?}",
        f.pods,
        f.groups,
        f.multi_pod_groups,
        f.split_groups,
        f.unpaired_decode_pods,
        f.pods_on_unlabeled_nodes,
        f.pools_reporting_unlabeled_nodes,
        f.pools,
        f.pods_per_domain
    );
    Ok(Some(f))
}

/// One N: cluster up, measure, cluster down (also on failure).
async fn run_one(
    opts: &ScaleOptions,
    samples: &Samples,
    n: usize,
    scale_groups: Option<u32>,
) -> Result<(RunFigures, Option<ScaleFigures>), ScaleError> {
    let config = cluster_config(opts);
    eprintln!(
        "[scale] N = {n}: starting a control plane in {}",
        config.state_dir.display()
    );
    let cluster = up(&config).await?;
    let out = measure(opts, samples, &cluster, n, scale_groups).await;
    let _ = down(&config, false).await;
    out
}

/// The operator as a local process.
struct Operator {
    child: tokio::process::Child,
    pid: u32,
    metrics: SocketAddr,
    log: PathBuf,
}

impl Operator {
    async fn start(
        opts: &ScaleOptions,
        cluster: &RunningCluster,
        resync: u64,
    ) -> Result<Self, ScaleError> {
        let bin = opts.operator_bin.clone().unwrap_or_else(|| {
            crate::runner::image::locate_binary("tandem-operator", "TANDEM_OPERATOR_BIN")
        });
        if !bin.exists() {
            return Err(ScaleError::Operator(format!(
                "{} not found (cargo build -p tandem-operator, or set TANDEM_OPERATOR_BIN)",
                bin.display()
            )));
        }
        // A fixed port here sits in the kernel's ephemeral range (32768–60999), where any client
        // socket of the control plane may hold it (a CI rehearsal's operator never came up on
        // 34480): ask the kernel for a free port, the fixed one only if that fails.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_or(29080 + opts.port_offset, |a| a.port());
        let metrics = SocketAddr::from(([127, 0, 0, 1], port));
        let log = cluster.config.log_file("tandem-operator");
        let file = std::fs::File::create(&log)
            .map_err(|e| ScaleError::Operator(format!("{}: {e}", log.display())))?;
        let err_file = file
            .try_clone()
            .map_err(|e| ScaleError::Operator(e.to_string()))?;
        let child = tokio::process::Command::new(&bin)
            .args([
                "--no-leader-election",
                "--metrics-addr",
                &metrics.to_string(),
                "--resync-seconds",
                &resync.to_string(),
                "--probe-reports",
                "false",
                "--read-cache",
                if opts.read_cache { "true" } else { "false" },
            ])
            .env("KUBECONFIG", &cluster.kubeconfig)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err_file))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| ScaleError::Operator(format!("{}: {e}", bin.display())))?;
        let pid = child
            .id()
            .ok_or_else(|| ScaleError::Operator("exited at once".into()))?;
        let mut op = Self {
            child,
            pid,
            metrics,
            log,
        };
        op.wait_ready(Duration::from_secs(60)).await?;
        Ok(op)
    }

    /// Waits (bounded) for `/readyz` 200; an operator that exits first fails at once, with the
    /// tail of its log (the state dir, and the log with it, is removed when the run ends).
    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), ScaleError> {
        let started = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(ScaleError::Operator(format!(
                    "exited ({st}) before /readyz; its log ends:\n{}",
                    self.log_tail(20)
                )));
            }
            let reply =
                crate::http_get::get(self.metrics, "/readyz", &[], Duration::from_secs(2)).await;
            let last = match reply {
                Ok(r) if r.status == 200 => {
                    eprintln!(
                        "[scale] operator /readyz: done after {:.1} s",
                        started.elapsed().as_secs_f64()
                    );
                    return Ok(());
                }
                Ok(r) => format!("{} {}", r.status, r.body),
                Err(e) => e.to_string(),
            };
            if started.elapsed() >= timeout {
                return Err(ScaleError::Operator(format!(
                    "/readyz not 200 within {timeout:?} (last: {last}); its log ends:\n{}",
                    self.log_tail(20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The last `n` lines of the operator's log.
    fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// SIGTERM, then SIGKILL after 10 s.
    async fn stop(mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }

    fn alive(&mut self) -> Result<(), ScaleError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(ScaleError::Operator(format!(
                "exited ({st}); log {}",
                self.log.display()
            ))),
            Err(e) => Err(ScaleError::Operator(e.to_string())),
        }
    }
}

async fn apply<K>(client: &kube::Client, obj: &K) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let ns = obj.meta().namespace.clone().unwrap_or_default();
    let api: Api<K> = Api::namespaced(client.clone(), &ns);
    let mut v = serde_json::to_value(obj).map_err(kube::Error::SerdeError)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("apiVersion".into(), K::api_version(&()).into());
        o.insert("kind".into(), K::kind(&()).into());
        o.remove("status");
    }
    api.patch(
        &obj.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&v),
    )
    .await?;
    Ok(())
}

async fn apply_stack(client: &kube::Client, s: &Stack) -> Result<(), kube::Error> {
    let nss: Api<Namespace> = Api::all(client.clone());
    let mut ns =
        serde_json::to_value(stacks::namespace(&s.namespace)).map_err(kube::Error::SerdeError)?;
    if let Some(o) = ns.as_object_mut() {
        o.insert("apiVersion".into(), "v1".into());
        o.insert("kind".into(), "Namespace".into());
    }
    nss.patch(
        &s.namespace,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&ns),
    )
    .await?;
    apply(client, &s.tier).await?;
    apply(client, &s.prefill).await?;
    apply(client, &s.decode).await
}

fn ready_key<K: Resource<DynamicType = ()>>(ns: &str, name: &str) -> String {
    format!("{}/{ns}/{name}", K::kind(&()))
}

fn stack_ready_at(ready: &ReadyTimes, s: &Stack) -> Option<Instant> {
    let ns = &s.namespace;
    let a = ready.get(&ready_key::<CacheTier>(ns, &s.tier.name_any()))?;
    let b = ready.get(&ready_key::<PrefillPool>(ns, &s.prefill.name_any()))?;
    let c = ready.get(&ready_key::<DecodePool>(ns, &s.decode.name_any()))?;
    Some(a.max(b).max(c))
}

/// apply→Ready of every stack split at its first StatefulSet and its last pod Ready, over the
/// stacks whose three instants were all seen. The parts add up to first apply sent → stack Ready.
fn phase_split(
    phases: &StackPhases,
    ready: &ReadyTimes,
    all: &[Stack],
    apply_began: &[Instant],
    pods: u32,
) -> report::PhaseSplit {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let mut parts: [Vec<f64>; 3] = Default::default();
    let mut replaced = 0;
    for (s, t0) in all.iter().zip(apply_began) {
        replaced += phases.replaced(&s.namespace);
        let (Some(child), Some(pods_ready), Some(done)) = (
            phases.first_child(&s.namespace),
            phases.pods_ready(&s.namespace, pods as usize),
            stack_ready_at(ready, s),
        ) else {
            continue;
        };
        parts[0].push(ms(*t0, child));
        parts[1].push(ms(child, pods_ready));
        parts[2].push(ms(pods_ready, done));
    }
    let [a, b, c] = parts;
    report::PhaseSplit {
        operator_pickup_ms: percentile::summarize(a),
        control_plane_ms: percentile::summarize(b),
        operator_ready_ms: percentile::summarize(c),
        pods_replaced: replaced,
    }
}

/// The operator's component name in its events (`reportingController`; the operator's field
/// manager, `operator/src/labels.rs`).
pub const OPERATOR_COMPONENT: &str = "tandem-operator";

/// The operator's events so far by reason, every occurrence of a series counted
/// (events.k8s.io/v1, listed 500 at a time).
async fn operator_events_by_reason(
    client: &kube::Client,
) -> Result<std::collections::BTreeMap<String, f64>, kube::Error> {
    use k8s_openapi::api::events::v1::Event;
    let api: Api<Event> = Api::all(client.clone());
    let mut out = std::collections::BTreeMap::new();
    let mut lp = ListParams::default().limit(500);
    loop {
        let page = api.list(&lp).await?;
        for e in &page.items {
            if e.reporting_controller.as_deref() != Some(OPERATOR_COMPONENT) {
                continue;
            }
            let n = e.series.as_ref().map_or(1, |s| s.count.max(1));
            *out.entry(e.reason.clone().unwrap_or_default())
                .or_insert(0.0) += f64::from(n);
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp.continue_token = Some(c),
            None => return Ok(out),
        }
    }
}

/// Operator counters read from one scrape.
#[derive(Debug, Clone, Copy, Default)]
struct OpCounters {
    writes: f64,
    reconciles: f64,
}

fn op_counters(s: &[prom::Sample]) -> OpCounters {
    OpCounters {
        writes: prom::sum(s, "tandem_operator_writes_total", &[]),
        reconciles: prom::sum(s, "tandem_operator_reconcile_duration_seconds_count", &[]),
    }
}

async fn scrape_op(op: &Operator) -> Result<Vec<prom::Sample>, ScaleError> {
    probe::scrape_operator(op.metrics)
        .await
        .ok_or_else(|| ScaleError::Operator("GET /metrics failed".into()))
}

async fn create_nodes(client: &kube::Client, nodes: u32, gpus: u32) -> Result<(), ScaleError> {
    let api: Api<Node> = Api::all(client.clone());
    let results: Vec<Result<Node, kube::Error>> = futures::stream::iter(0..nodes)
        .map(|i| {
            let api = api.clone();
            async move {
                api.patch(
                    &stacks::node_name(i),
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&stacks::topology_node(i, gpus)),
                )
                .await
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for r in results {
        r?;
    }
    // The taint `up` gave node 0 belongs to the manager `tandem-e2e`: drop it explicitly.
    let untaint = serde_json::json!({"spec": {"taints": null}});
    api.patch(
        &stacks::node_name(0),
        &PatchParams::default(),
        &Patch::Merge(&untaint),
    )
    .await?;
    let want = nodes as usize;
    poll(
        &format!("{want} kwok nodes Ready"),
        Duration::from_secs(300),
        || {
            let api = api.clone();
            async move {
                let list = api.list(&ListParams::default().labels("type=kwok")).await;
                match list {
                    Ok(l) => {
                        let ready = l.items.iter().filter(|n| node_ready(n)).count();
                        (
                            (ready >= want).then_some(()),
                            format!("{ready}/{want} Ready"),
                        )
                    }
                    Err(e) => (None, e.to_string()),
                }
            }
        },
    )
    .await?;
    Ok(())
}

async fn install_crds(client: &kube::Client) -> Result<(), ScaleError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [CacheTier::crd(), PrefillPool::crd(), DecodePool::crd()] {
        api.patch(
            &crd.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await?;
    }
    wait_crds_established(client, Duration::from_secs(60)).await?;
    Ok(())
}

async fn measure(
    opts: &ScaleOptions,
    samples: &Samples,
    cluster: &RunningCluster,
    n: usize,
    scale_groups: Option<u32>,
) -> Result<(RunFigures, Option<ScaleFigures>), ScaleError> {
    let client = client_for(&cluster.kubeconfig).await?;
    let scaled_gpus = scale_groups.map_or(0, |g| g * 2);
    let gpus = n as u32 * samples.gpus_per_stack() + scaled_gpus;
    let pods = n as u32 * samples.pods_per_stack() + scaled_gpus + 2;
    let nodes = stacks::nodes_for(gpus, pods, opts.gpus_per_node);
    eprintln!(
        "[scale] N = {n}: {nodes} kwok nodes × {} GPUs",
        opts.gpus_per_node
    );
    create_nodes(&client, nodes, opts.gpus_per_node).await?;
    install_crds(&client).await?;
    let resync = opts.resync_seconds.unwrap_or_else(|| default_resync(n));
    let mut op = Operator::start(opts, cluster, resync).await?;
    let result = measure_with(
        opts,
        samples,
        &client,
        &mut op,
        n,
        nodes,
        resync,
        scale_groups,
    )
    .await;
    let log = op.log.clone();
    op.stop().await;
    result.map_err(|e| match e {
        ScaleError::Operator(m) => ScaleError::Operator(m),
        other => ScaleError::Operator(format!("{other} (operator log: {})", log.display())),
    })
}

#[allow(clippy::too_many_arguments)]
async fn measure_with(
    opts: &ScaleOptions,
    samples: &Samples,
    client: &kube::Client,
    op: &mut Operator,
    n: usize,
    nodes: u32,
    resync: u64,
    scale_groups: Option<u32>,
) -> Result<(RunFigures, Option<ScaleFigures>), ScaleError> {
    let origin = Instant::now();
    let sampler = ProcSampler::start(op.pid, op.metrics, origin, Duration::from_millis(250));
    let ready = ReadyTimes::default();
    ready.watch::<CacheTier>(client);
    ready.watch::<PrefillPool>(client);
    ready.watch::<DecodePool>(client);
    let api_before = probe::scrape_apiserver(client)
        .await
        .ok_or_else(|| ScaleError::Operator("GET apiserver /metrics failed".into()))?;
    let op_before = scrape_op(op).await?;

    // Apply N stacks (in a burst, or at the asked rate), recording when each one's first apply
    // was sent and when its last apply returned.
    let all: Vec<Stack> = (0..n)
        .map(|i| stacks::stack(samples, &stacks::stack_namespace(i)))
        .collect();
    let phases = StackPhases::start(client);
    let load_at_apply = report::load_avg();
    let apply_started = Instant::now();
    let rate = opts.apply_rate.filter(|r| r.is_finite() && *r > 0.0);
    // Paced: enough in flight that a slow apply does not hold the schedule back.
    let in_flight = if rate.is_some() { 32 } else { 4 };
    let applied: Vec<Result<(usize, Instant, Instant), kube::Error>> = futures::stream::iter(0..n)
        .map(|i| {
            let s = &all[i];
            let at = rate.map(|r| apply_started + Duration::from_secs_f64(i as f64 / r));
            async move {
                if let Some(at) = at {
                    tokio::time::sleep_until(at.into()).await;
                }
                let began = Instant::now();
                apply_stack(client, s).await?;
                Ok((i, began, Instant::now()))
            }
        })
        .buffer_unordered(in_flight)
        .collect()
        .await;
    let mut applied_at = vec![apply_started; n];
    let mut apply_began = vec![apply_started; n];
    for r in applied {
        let (i, began, t) = r?;
        apply_began[i] = began;
        applied_at[i] = t;
    }
    let apply_s = apply_started.elapsed().as_secs_f64();
    eprintln!("[scale] N = {n}: applied {n} stacks in {apply_s:.1} s");

    // Every stack Ready.
    let want = 3 * n;
    poll(&format!("{n} stacks Ready"), opts.phase_timeout, || {
        let ready = ready.clone();
        let alive = op.child.try_wait().ok().flatten().is_none();
        async move {
            let c = ready.count();
            if !alive {
                return (None, "operator exited".into());
            }
            (
                (c >= want).then_some(()),
                format!("{c}/{want} objects Ready"),
            )
        }
    })
    .await?;
    op.alive()?;
    let all_ready_s = apply_started.elapsed().as_secs_f64();
    let placement = placement_figures(client, samples, opts.placement_key.as_deref()).await?;
    let apply_to_ready_ms: Vec<f64> = all
        .iter()
        .zip(&applied_at)
        .map(|(s, t0)| {
            stack_ready_at(&ready, s).map_or(f64::NAN, |t| {
                t.saturating_duration_since(*t0).as_secs_f64() * 1e3
            })
        })
        .collect();

    let split = phase_split(
        &phases,
        &ready,
        &all,
        &apply_began,
        samples.pods_per_stack(),
    );
    phases.stop();

    // Settled: no operator write for 5 s. (Reconciles keep running — resyncs, and the 5 s
    // requeue of anything still moving — so the in-flight gauge is no settle signal at large N.)
    let settle_started = Instant::now();
    let mut last = op_counters(&scrape_op(op).await?).writes;
    let mut quiet_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let s = scrape_op(op).await?;
        let w = op_counters(&s).writes;
        if w != last {
            last = w;
            quiet_since = Instant::now();
        }
        if quiet_since.elapsed() >= Duration::from_secs(5) {
            break;
        }
        if settle_started.elapsed() > opts.phase_timeout {
            return Err(ScaleError::Operator(format!(
                "never settled: writes still growing after {} s",
                opts.phase_timeout.as_secs()
            )));
        }
    }
    let settled_s = apply_started.elapsed().as_secs_f64();
    // Informational: a failed listing is reported empty, not a failed run.
    let operator_events = operator_events_by_reason(client).await.unwrap_or_else(|e| {
        eprintln!("[scale] N = {n}: listing the operator's events failed: {e}");
        Default::default()
    });
    let api_after = probe::scrape_apiserver(client)
        .await
        .ok_or_else(|| ScaleError::Operator("GET apiserver /metrics failed".into()))?;
    let op_settled = scrape_op(op).await?;
    let load_settled = report::load_avg();
    let proc_settled = sampler.snapshot();

    // Steady resync window: every object reconciled at least once more.
    let c0 = op_counters(&op_settled);
    let window_started = Instant::now();
    let cpu0 = probe::read_proc(op.pid, probe::clock_ticks()).map_or(0.0, |p| p.0);
    let window_timeout = Duration::from_secs(3 * resync + 120);
    let c1 = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let c = op_counters(&scrape_op(op).await?);
        if c.reconciles - c0.reconciles >= want as f64 {
            break c;
        }
        if window_started.elapsed() > window_timeout {
            return Err(ScaleError::Operator(format!(
                "only {} reconciles in {} s after settling (want {want}: one resync of every \
                 object at --resync-seconds {resync})",
                c.reconciles - c0.reconciles,
                window_timeout.as_secs()
            )));
        }
    };
    let window_s = window_started.elapsed().as_secs_f64();
    let cpu1 = probe::read_proc(op.pid, probe::clock_ticks()).map_or(0.0, |p| p.0);
    let op_after_window = scrape_op(op).await?;
    op.alive()?;
    let resync_reconciles = c1.reconciles - c0.reconciles;
    let steady_writes = c1.writes - c0.writes;
    let resyncs = resync_reconciles / want as f64;

    // Reconcile latency over apply → settled, and over the resync window.
    let h = "tandem_operator_reconcile_duration_seconds";
    let busy = prom::bucket_delta(
        &prom::buckets(&op_before, h),
        &prom::buckets(&op_settled, h),
    );
    let steady = prom::bucket_delta(
        &prom::buckets(&op_settled, h),
        &prom::buckets(&op_after_window, h),
    );
    let last_busy = proc_settled.last().copied().unwrap_or_default();
    let in_flight: Vec<f64> = proc_settled
        .iter()
        .map(|p| p.in_flight)
        .filter(|v| v.is_finite())
        .collect();
    let by_verb = delta_map(
        &prom::sum_by(&api_before, "apiserver_request_total", &["verb"]),
        &prom::sum_by(&api_after, "apiserver_request_total", &["verb"]),
    );
    let by_verb_resource = delta_map(
        &prom::sum_by(
            &api_before,
            "apiserver_request_total",
            &["verb", "resource"],
        ),
        &prom::sum_by(&api_after, "apiserver_request_total", &["verb", "resource"]),
    );
    let dur = "apiserver_request_duration_seconds";
    let sums = delta_map(
        &prom::sum_by(&api_before, &format!("{dur}_sum"), &["verb"]),
        &prom::sum_by(&api_after, &format!("{dur}_sum"), &["verb"]),
    );
    let counts = delta_map(
        &prom::sum_by(&api_before, &format!("{dur}_count"), &["verb"]),
        &prom::sum_by(&api_after, &format!("{dur}_count"), &["verb"]),
    );
    let api_latency: std::collections::BTreeMap<String, f64> = sums
        .iter()
        // A WATCH lasts as long as the watch: not a latency.
        .filter(|(k, _)| k.as_str() != "WATCH" && k.as_str() != "CONNECT")
        .filter_map(|(k, s)| {
            let n = counts.get(k).copied().unwrap_or(0.0);
            (n > 0.0).then(|| (k.clone(), 1e3 * s / n))
        })
        .collect();
    let op_writes = delta_map(
        &prom::sum_by(&op_before, "tandem_operator_writes_total", &["verb"]),
        &prom::sum_by(&op_settled, "tandem_operator_writes_total", &["verb"]),
    );
    let figures = RunFigures {
        n,
        nodes,
        gpus_per_node: opts.gpus_per_node,
        resync_seconds: resync,
        read_cache: opts.read_cache,
        apply_s,
        all_ready_s,
        settled_s,
        apply_to_ready_ms: percentile::summarize(apply_to_ready_ms.iter().copied()),
        stacks_ready: apply_to_ready_ms.iter().filter(|v| v.is_finite()).count(),
        apply_rate: rate,
        phases: split,
        reconciles_busy: busy.last().map_or(0.0, |b| b.1),
        reconcile_p50_le_s: prom::quantile_bound(&busy, 0.5),
        reconcile_p99_le_s: prom::quantile_bound(&busy, 0.99),
        reconcile_steady_p50_le_s: prom::quantile_bound(&steady, 0.5),
        reconcile_steady_p99_le_s: prom::quantile_bound(&steady, 0.99),
        queue_depth_max: in_flight.iter().copied().fold(0.0, f64::max),
        queue_depth_mean: if in_flight.is_empty() {
            0.0
        } else {
            in_flight.iter().sum::<f64>() / in_flight.len() as f64
        },
        peak_rss_mib: last_busy.peak_rss_mib,
        rss_settled_mib: last_busy.rss_mib,
        cpu_s_to_settled: last_busy.cpu_s,
        steady_cpu_percent: if window_s > 0.0 {
            100.0 * (cpu1 - cpu0) / window_s
        } else {
            0.0
        },
        api_requests_by_verb: by_verb,
        api_requests_by_verb_resource: by_verb_resource,
        api_request_mean_ms_by_verb: api_latency,
        operator_writes_by_verb: op_writes,
        operator_events_by_reason: operator_events,
        steady_window_s: window_s,
        steady_reconciles: resync_reconciles,
        steady_writes,
        writes_per_steady_resync: if resyncs > 0.0 {
            steady_writes / resyncs
        } else {
            f64::NAN
        },
        load_avg: [load_at_apply, load_settled],
        process: proc_settled,
        placement,
    };
    ready.stop();

    let scaled = match scale_groups {
        Some(target) => Some(scale_and_restart(opts, samples, client, op, target).await?),
        None => None,
    };
    drop(sampler);
    Ok((figures, scaled))
}

fn delta_map(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> std::collections::BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// Where a pool of the scaled pair stands.
#[derive(Debug, Clone, Default, PartialEq)]
struct PoolSeen {
    ready: bool,
    ready_replicas: i32,
    phase: String,
    current: Option<String>,
    update: Option<String>,
    observed: bool,
}

fn seen_of(
    generation: Option<i64>,
    status: Option<&tandem_crds::PoolStatus>,
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
) -> PoolSeen {
    let s = status.cloned().unwrap_or_default();
    PoolSeen {
        ready: crate::demo::stack::is_ready(conditions),
        ready_replicas: s.ready_replicas,
        phase: s.rollout.map(|r| r.phase).unwrap_or_default(),
        current: s.current_revision,
        update: s.update_revision,
        observed: s.observed_generation == generation,
    }
}

async fn pair_seen(
    client: &kube::Client,
    ns: &str,
    decode: &str,
    prefill: &str,
) -> Result<(PoolSeen, PoolSeen), kube::Error> {
    use crate::demo::stack::TandemKind;
    let d = Api::<DecodePool>::namespaced(client.clone(), ns)
        .get(decode)
        .await?;
    let p = Api::<PrefillPool>::namespaced(client.clone(), ns)
        .get(prefill)
        .await?;
    Ok((
        seen_of(d.metadata.generation, d.status.as_ref(), d.conditions()),
        // The PrefillPool's generation does not move when the DecodePool rescales it.
        seen_of(p.metadata.generation, p.status.as_ref(), p.conditions()),
    ))
}

/// Waits until both pools are Ready with `groups` ready groups, idle, at one revision that is not
/// `old_revision`'s (when given); returns the decode pool's revision.
async fn wait_pair(
    client: &kube::Client,
    s: &Stack,
    groups: i32,
    old_revision: Option<&str>,
    timeout: Duration,
    what: &str,
) -> Result<String, ScaleError> {
    let (ns, d, p) = (
        s.namespace.clone(),
        s.decode.name_any(),
        s.prefill.name_any(),
    );
    let rev = poll(what, timeout, || {
        let (ns, d, p) = (ns.clone(), d.clone(), p.clone());
        async move {
            match pair_seen(client, &ns, &d, &p).await {
                Ok((ds, ps)) => {
                    let ok = |x: &PoolSeen| {
                        x.ready
                            && x.observed
                            && x.ready_replicas == groups
                            && x.phase == crate::scale::report::IDLE
                            && x.current.is_some()
                            && x.current == x.update
                            && old_revision.is_none_or(|o| x.current.as_deref() != Some(o))
                    };
                    let done = ok(&ds) && ok(&ps);
                    (
                        done.then(|| ds.current.clone().unwrap_or_default()),
                        format!("decode {ds:?}; prefill {ps:?}"),
                    )
                }
                Err(e) => (None, e.to_string()),
            }
        }
    })
    .await?;
    Ok(rev)
}

async fn scale_and_restart(
    opts: &ScaleOptions,
    samples: &Samples,
    client: &kube::Client,
    op: &mut Operator,
    target: u32,
) -> Result<ScaleFigures, ScaleError> {
    let s = stacks::scaled_stack(samples, SCALED_NAMESPACE, target);
    let size =
        |p: &tandem_crds::Parallelism| u32::try_from((p.tensor * p.context).max(1)).unwrap_or(1);
    let group_size = size(&s.decode.spec.parallelism);
    let tracker = ServingTracker::start(
        client,
        SCALED_NAMESPACE,
        s.decode.name_any(),
        s.prefill.name_any(),
        group_size,
        1,
    );
    let t = Instant::now();
    apply_stack(client, &s).await?;
    let rev0 = wait_pair(
        client,
        &s,
        1,
        None,
        opts.phase_timeout,
        "scaled stack Ready at 1 group",
    )
    .await?;
    let initial_s = t.elapsed().as_secs_f64();

    // 1 → target decode groups; prefill follows the ratio (1:1).
    let api: Api<DecodePool> = Api::namespaced(client.clone(), SCALED_NAMESPACE);
    let scale_started_at = tracker.points().last().map_or(0.0, |p| p.t_s);
    tracker.set_desired(target);
    let t = Instant::now();
    let _ = api
        .patch(
            &s.decode.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"spec": {"replicas": target}})),
        )
        .await?;
    let t_target = i32::try_from(target).unwrap_or(i32::MAX);
    wait_pair(
        client,
        &s,
        t_target,
        None,
        opts.phase_timeout,
        &format!("scaled to {target} groups"),
    )
    .await?;
    let scale_up_s = t.elapsed().as_secs_f64();
    op.alive()?;

    // Rolling restart of every group of both pools.
    let restart_started_at = tracker.points().last().map_or(0.0, |p| p.t_s);
    let uids_before = tracker.current_uids();
    let seen_before = tracker.uids_seen();
    let t = Instant::now();
    let _ = api
        .patch(
            &s.decode.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"spec": {"restart": {"id": "scale-restart-1"}}})),
        )
        .await?;
    let rev1 = wait_pair(
        client,
        &s,
        t_target,
        Some(&rev0),
        opts.phase_timeout,
        &format!("rolling restart of {target} + {target} groups"),
    )
    .await?;
    let restart_s = t.elapsed().as_secs_f64();
    op.alive()?;
    let restart_ended_at = tracker.points().last().map_or(0.0, |p| p.t_s);
    let uids_after = tracker.current_uids();
    let replaced = uids_before
        .iter()
        .filter(|u| !uids_after.contains(u))
        .count();
    let points: Vec<ServingPoint> = tracker.points();
    let during: Vec<&ServingPoint> = points
        .iter()
        .filter(|p| p.t_s >= restart_started_at && p.t_s <= restart_ended_at)
        .collect();
    let min_decode = during.iter().map(|p| p.decode).min().unwrap_or(0);
    let min_prefill = during.iter().map(|p| p.prefill).min().unwrap_or(0);
    Ok(ScaleFigures {
        target,
        group_size,
        initial_ready_s: initial_s,
        scale_up_s,
        restart_s,
        revision_before: rev0,
        revision_after: rev1,
        pods_before_restart: uids_before.len(),
        pods_replaced: replaced,
        pods_created_during_restart: tracker.uids_seen().saturating_sub(seen_before),
        min_serving_decode_during_restart: min_decode,
        min_serving_prefill_during_restart: min_prefill,
        max_not_serving_decode_during_restart: target.saturating_sub(min_decode),
        max_not_serving_prefill_during_restart: target.saturating_sub(min_prefill),
        scale_started_at_s: scale_started_at,
        restart_started_at_s: restart_started_at,
        restart_ended_at_s: restart_ended_at,
        points,
    })
}
