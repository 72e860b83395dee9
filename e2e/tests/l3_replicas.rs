//! Issue 18 item 4 on the live stack: L3 store replicas that restart empty or move, under write
//! load, against the operator installed by `helm install` and the sample stack on the process
//! runner (one cluster, ports + 9000, runner node index 90), traffic from the replay driver through
//! the decode Service (resolved in the runner's hosts file). Every wait is on an observed event (a
//! `/report` field, the hosts file, a pod's status), bounded.
//!
//! The stack is the samples with a 1:1 ratio (one prefill group: its `/report` is the one writer's
//! view), a three-replica CacheTier whose persistence is the default local volume (a directory
//! under the runner's dir, kept across container restarts and pod re-creation, like a PVC), and the
//! prefill's host pool cut to the least the operator accepts (one page of llama-3-70b tokens: 256
//! simulated pages of L2). The prefill's write ramp and rate window are shortened to [`RAMP_S`]
//! through the pods' environment (`TANDEM_L3_WRITE_RAMP_S`, `TANDEM_L3_RATE_WINDOW_S`; the prefill
//! reports them back and the suite checks it).
//!
//! The load ([`Load`]) cycles a hot set of 384 pages, larger than that L2, so every hot prompt is
//! looked up in L3 on every cycle, with a fresh two-page prompt every fourth request (writes that
//! exist without a restart). A replica that loses its objects therefore has its pages looked up
//! again and refilled within a cycle: the refill that, placed by hash alone, would all go to it
//! (the flood of Mooncake#3688; `worker/tests/serve_l3_replicas.rs` has the negative control).
//!
//! 1. A replica restarted empty (kvcache-ai/Mooncake#3688): store replica 0 is frozen (SIGSTOP), its
//!    volume's contents are deleted (a replaced disk: with persistence, a plain restart would load
//!    its objects back and not be empty), then it is SIGKILLed; the runner restarts it in the same
//!    pod, on the same address, with nothing to load back. Freezing first makes sure no put lands
//!    between the wipe and the kill. The load runs throughout. Once the prefill has attached it
//!    again for a whole rate window, the prefill's `/report` gives each replica's stored-write rate
//!    over that window: the restarted replica's must be at most 2× the mean of the others', and it
//!    must have been seen ramping (weight below 1) and taking some writes (a ramp, not a shut-out).
//! 2. A replica on a new address (Mooncake#2185, #3740): store replica 1's pod is deleted; the
//!    StatefulSet recreates it and the runner gives the new pod a new IP (the runner never hands out
//!    a freed address while fresh ones remain). From the moment the hosts file (the `<tier>-store`
//!    Service) lists the new address, the prefill must report the reattachment to it within 10 s,
//!    the prefill and decode pods being the same pods with the same container restart counts and
//!    the prefill the same process (incarnation).
//!
//! Skips with a printed reason when the control-plane binaries are not built, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolume, Pod};
use kube::Api;
use rustix::process::Signal;
use serde_json::Value;
use support::{
    Harness, HarnessConfig, install, pod_ip, pod_name, pod_uid, poll, report_client, run_suite,
    wait_condition,
};
use tandem_crds::labels::{POOL, ROLE, ROLE_CACHE, ROLE_DECODE, ROLE_PREFILL};
use tandem_crds::ports::{FRONT_DOOR_PORT, HEALTH_PORT, L3_PORT};
use tandem_e2e::replay::driver::{ReplayConfig, RequestResult, replay};
use tandem_e2e::replay::schedule::{Clock, Outcome};
use tandem_e2e::replay::targets::TargetSet;
use tandem_e2e::replay::workload::TraceRequest;
use tandem_e2e::runner::crash::{container_process, kill_container};
use tandem_e2e::runner::hosts::resolve;

const NS: &str = "default";
const DECODE: &str = "llama70b-decode";
const PREFILL: &str = "llama70b-prefill";
const TIER: &str = "llama70b-l3";
/// Store replicas of the tier.
const REPLICAS: usize = 3;
/// The prefill's write ramp and rate window, seconds (60 by default; the pods get this value
/// through [`POD_ENV`], which must spell the same number).
const RAMP_S: u64 = 20;
const POD_ENV: &[(&str, &str)] = &[
    ("TANDEM_L3_WRITE_RAMP_S", "20"),
    ("TANDEM_L3_RATE_WINDOW_S", "20"),
];
/// The bound of item 4: the restarted replica's write rate over the window after its restart, at
/// most this many times the mean of the others'.
const MAX_RATIO: f64 = 2.0;
/// The bound of item 4: reattached to a replica's new address within this long of its publication.
const MAX_REATTACH: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_replicas_restarted_empty_or_moved_on_the_live_stack() {
    run_suite(
        HarnessConfig {
            name: "l3_replicas",
            port_offset: 9000,
            runner_gpus: 4,
            first_node_index: 90,
            worker_bin: None,
            pod_env: POD_ENV,
        },
        scenario,
    )
    .await;
}

/// Seconds since `t0`, for the printed timeline.
fn at(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

async fn scenario(h: &Harness) -> Result<(), String> {
    let t0 = Instant::now();
    install(h).await?;
    let manifests = tempfile::tempdir().map_err(|e| e.to_string())?;
    write_stack(manifests.path())?;
    h.kubectl(&["apply", "-f", &manifests.path().display().to_string()])?;
    wait_condition(h, "cachetier", TIER, "Ready", "True", 240).await?;
    wait_condition(h, "decodepool", DECODE, "Ready", "True", 240).await?;
    let s = Stack::new(h);
    let stores = s.stores().await?;
    if stores.len() != REPLICAS {
        return Err(format!(
            "{} store replicas, expected {REPLICAS}",
            stores.len()
        ));
    }
    println!(
        "[{:>5.1}s] stack Ready: 1 prefill, 1 decode, {REPLICAS} store replicas ({})",
        at(t0),
        stores
            .iter()
            .map(|p| format!("{} {}", pod_name(p), pod_ip(p).unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let load = Load::start(s.front_doors().await?);
    let outcome = async {
        ramped_write_share(h, &s, t0).await?;
        new_address(h, &s, t0).await
    }
    .await;
    let results = load.stop().await;
    let t = tally(&results);
    println!(
        "[{:>5.1}s] load: {} requests through the decode Service, {} ok, {} retried, {} failed \
         (attempt errors {:?}); prompt tokens the prefill found in L2 {}, in L3 {}",
        at(t0),
        results.len(),
        t.ok,
        t.retried,
        t.failed.len(),
        t.reasons,
        t.l2_tokens,
        t.l3_tokens,
    );
    outcome?;
    if !t.failed.is_empty() {
        return Err(format!(
            "{} requests failed while store replicas restarted or moved (L3 is a cache: a \
             replica away must not fail a request): {:?}",
            t.failed.len(),
            t.failed.iter().take(5).collect::<Vec<_>>()
        ));
    }
    // The premise of phase 1: the hot set missed the prefill's L2 and was read from L3 (so the
    // pages the restarted replica lost were looked up again).
    if t.l3_tokens == 0 {
        return Err("no prompt token was served from L3: the hot set never missed L2".into());
    }
    Ok(())
}

/// The sample stack, changed for this suite: ratio 1:1 (one prefill) and [`REPLICAS`] store
/// replicas. Each change must apply (the samples may not drift from it).
fn write_stack(dir: &std::path::Path) -> Result<(), String> {
    let samples = support::repo().join("manifests/samples");
    let edit = |file: &str, edits: &[(&str, String)]| -> Result<(), String> {
        let mut text =
            std::fs::read_to_string(samples.join(file)).map_err(|e| format!("{file}: {e}"))?;
        for (from, to) in edits {
            if !text.contains(from) {
                return Err(format!("{file} no longer contains {from:?}"));
            }
            text = text.replacen(from, to, 1);
        }
        std::fs::write(dir.join(file), text).map_err(|e| e.to_string())
    };
    edit(
        "cachetier.yaml",
        &[
            // The persistence stays the samples' (the default class: a directory that outlives
            // the pod; item 2's replica comes back on a new address with its objects, item 1
            // wipes it on purpose).
            ("replicas: 2", format!("replicas: {REPLICAS}")),
        ],
    )?;
    // The prefill's L2 smaller than the load's hot set ([`HOT`]): one page of the model's tokens
    // (512 × 320 KiB per token of llama-3-70b), the least the operator accepts.
    edit(
        "prefillpool.yaml",
        &[(
            "hostPool:\n    size: 1Gi",
            "hostPool:\n    size: 160Mi".into(),
        )],
    )?;
    edit(
        "decodepool.yaml",
        &[("ratio: \"4:1\"", "ratio: \"1:1\"".to_owned())],
    )
}

/// Hot prompts the load cycles through, of [`HOT_PAGES`] pages each: 384 pages, more than the
/// prefill's L2 holds (its host pool is cut to one page of the model's tokens, [`write_stack`]),
/// so every hot prompt misses L2 and is looked up in L3 on every cycle: the pages a replica loses
/// are looked up again, and refilled, within a cycle (~11 s at the load's rate).
const HOT: u64 = 48;
/// Pages (512-token blocks) of a hot prompt.
const HOT_PAGES: u64 = 8;
/// Every `FRESH_EVERY`-th request is a fresh two-page prompt: writes that exist without any
/// restart, so every replica has a write rate to compare with.
const FRESH_EVERY: u64 = 4;
/// Requests per second of the load.
const RATE: u64 = 8;

/// The load's request number `i`: a hot prompt, or every [`FRESH_EVERY`]-th a fresh one.
fn request(i: u64, at_ms: u64) -> TraceRequest {
    let hash_ids: Vec<u64> = if i % FRESH_EVERY == FRESH_EVERY - 1 {
        (0..2).map(|k| (1 << 40) + 2 * i + k).collect()
    } else {
        let p = (i - i / FRESH_EVERY) % HOT;
        (0..HOT_PAGES)
            .map(|k| (2 << 40) + HOT_PAGES * p + k)
            .collect()
    };
    TraceRequest {
        timestamp: at_ms,
        input_length: 512 * hash_ids.len() as u32,
        output_length: 8,
        hash_ids,
    }
}

/// Requests `from .. from + n` of the load, [`RATE`] per second.
fn chunk(from: u64, n: u64) -> Vec<TraceRequest> {
    (0..n).map(|k| request(from + k, k * 1000 / RATE)).collect()
}

fn replay_config() -> ReplayConfig {
    ReplayConfig {
        concurrency_limit: Some(8),
        retry_budget: 3,
        backoff_base: Duration::from_millis(200),
        backoff_max: Duration::from_secs(2),
        attempt_timeout: Duration::from_secs(30),
        ..ReplayConfig::default()
    }
}

/// What a load's results add up to.
#[derive(Debug, Default)]
struct Tally {
    /// Completed on the first attempt.
    ok: usize,
    /// Completed after retries.
    retried: usize,
    /// The failed requests with their errors.
    failed: Vec<String>,
    /// Errors of the attempts that were retried or failed, by reason (the URL left out), counted.
    reasons: BTreeMap<String, usize>,
    /// Prompt tokens the prefill found in L2 and in L3, over the completed requests.
    l2_tokens: u64,
    l3_tokens: u64,
}

fn tally(results: &[RequestResult]) -> Tally {
    let mut t = Tally::default();
    for r in results {
        match r.outcome {
            Outcome::Ok => t.ok += 1,
            Outcome::Retried => t.retried += 1,
            Outcome::Failed => t.failed.push(format!("#{}: {:?}", r.index, r.errors)),
        }
        for e in &r.errors {
            let text = e.split_once(": ").map_or(e.as_str(), |(_, rest)| rest);
            *t.reasons
                .entry(text.chars().take(70).collect())
                .or_default() += 1;
        }
        if let Some(b) = &r.tandem {
            t.l2_tokens += b.prefix_hit_tokens.l2;
            t.l3_tokens += b.prefix_hit_tokens.l3;
        }
    }
    t
}

/// The write load: successive workload chunks (fresh pages each) replayed through the decode
/// Service until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<RequestResult>>,
}

impl Load {
    fn start(front_doors: Vec<String>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let targets = TargetSet::fixed(front_doors);
            let mut out = Vec::new();
            let mut next = 0;
            while !flag.load(Ordering::Acquire) {
                out.extend(
                    replay(
                        &chunk(next, 2 * RATE),
                        &targets,
                        &replay_config(),
                        Clock::start(),
                        None,
                        None,
                    )
                    .await,
                );
                next += 2 * RATE;
            }
            out
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<RequestResult> {
        self.stop.store(true, Ordering::Release);
        self.task.await.unwrap_or_default()
    }
}

/// The stack's pods and `/report`s.
struct Stack<'a> {
    h: &'a Harness,
    http: reqwest::Client,
}

impl<'a> Stack<'a> {
    fn new(h: &'a Harness) -> Self {
        Self {
            h,
            http: report_client(),
        }
    }

    async fn live(&self, pool: &str, role: &str) -> Result<Vec<Pod>, String> {
        let mut pods: Vec<Pod> = self
            .h
            .pods(&format!("{POOL}={pool},{ROLE}={role}"))
            .await?
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        pods.sort_by_key(pod_name);
        Ok(pods)
    }

    /// The one live pod of the prefill or decode pool.
    async fn worker(&self, role: &str) -> Result<Pod, String> {
        let pool = if role == ROLE_PREFILL {
            PREFILL
        } else {
            DECODE
        };
        match self.live(pool, role).await?.as_slice() {
            [p] => Ok(p.clone()),
            other => Err(format!("{role}: {} live pods, expected 1", other.len())),
        }
    }

    /// The live store replicas, by name.
    async fn stores(&self) -> Result<Vec<Pod>, String> {
        self.live(TIER, ROLE_CACHE).await
    }

    /// The live store replica `name`.
    async fn store(&self, pod: &str) -> Result<Pod, String> {
        self.stores()
            .await?
            .into_iter()
            .find(|p| pod_name(p) == pod)
            .ok_or_else(|| format!("no live pod {pod}"))
    }

    async fn report_of(&self, pod: &Pod) -> Result<Value, String> {
        let url = format!("http://{}:{HEALTH_PORT}/report", pod_ip(pod)?);
        let r = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        r.json().await.map_err(|e| format!("{url}: {e}"))
    }

    async fn prefill_report(&self) -> Result<Value, String> {
        self.report_of(&self.worker(ROLE_PREFILL).await?).await
    }

    fn hosts(&self) -> String {
        std::fs::read_to_string(self.h.cluster.config.runner_dir().join("hosts"))
            .unwrap_or_default()
    }

    /// The decode Service's addresses in the runner's hosts file, as front-door URLs. The pool
    /// turns Ready from its pods' readiness; the Service's endpoints, and the hosts file the
    /// runner writes from them, follow a moment later: waited for, at most 30 s.
    async fn front_doors(&self) -> Result<Vec<String>, String> {
        let service = format!("{DECODE}.{NS}.svc.cluster.local");
        let ips = poll(Duration::from_secs(30), || async {
            let ips = resolve(&self.hosts(), &service);
            (!ips.is_empty()).then_some(ips)
        })
        .await
        .unwrap_or_default();
        if ips.is_empty() {
            return Err(format!("{service} resolves to no address within 30 s"));
        }
        Ok(ips
            .iter()
            .map(|ip| format!("http://{ip}:{FRONT_DOOR_PORT}"))
            .collect())
    }

    /// What the store Service (the name the writers resolve) lists.
    fn store_addresses(&self) -> BTreeSet<String> {
        resolve(&self.hosts(), &store_service())
            .into_iter()
            .collect()
    }
}

/// The name writers resolve the tier's replicas by (the `<tier>-store` headless Service, which
/// publishes ready replicas only), as the operator writes it into the workers' config.
fn store_service() -> String {
    format!("{TIER}-store.{NS}.svc")
}

/// Restarts of every container of `p` (init and native sidecars included).
fn restarts(p: &Pod) -> i32 {
    let s = p.status.as_ref();
    let count = |cs: Option<&Vec<k8s_openapi::api::core::v1::ContainerStatus>>| -> i32 {
        cs.map_or(0, |cs| cs.iter().map(|c| c.restart_count).sum())
    };
    count(s.and_then(|s| s.container_statuses.as_ref()))
        + count(s.and_then(|s| s.init_container_statuses.as_ref()))
}

/// Restarts of container `c` of `p`.
fn restarts_of(p: &Pod, c: &str) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|s| s.name == c))
        .map_or(0, |s| s.restart_count)
}

/// The prefill's `l3.replicas` line of the replica at `ip`.
fn line<'a>(report: &'a Value, ip: &str) -> Option<&'a Value> {
    let addr = format!("{ip}:{L3_PORT}");
    report["l3"]["replicas"]
        .as_array()?
        .iter()
        .find(|l| l["addr"] == addr.as_str())
}

/// The directory of the persistent volume bound to store replica `pod`'s claim.
async fn volume_of(h: &Harness, pod: &str) -> Result<PathBuf, String> {
    let api: Api<PersistentVolume> = Api::all(h.client.clone());
    let pvs = api
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?;
    let suffix = format!("-{pod}");
    let dirs: Vec<PathBuf> = pvs
        .items
        .iter()
        .filter_map(|pv| {
            let spec = pv.spec.as_ref()?;
            let claim = spec.claim_ref.as_ref()?;
            let path = &spec.host_path.as_ref()?.path;
            (claim.namespace.as_deref() == Some(NS)
                && claim.name.as_deref().is_some_and(|n| n.ends_with(&suffix)))
            .then(|| PathBuf::from(path))
        })
        .collect();
    match dirs.as_slice() {
        [d] => Ok(d.clone()),
        other => Err(format!("{pod}: {} volumes, expected 1", other.len())),
    }
}

/// Phase 1: a replica restarted empty under write load takes a ramped share of writes.
async fn ramped_write_share(h: &Harness, s: &Stack<'_>, t0: Instant) -> Result<(), String> {
    // Every replica attached, past its own cold-start ramp (the whole tier started empty) and
    // taking writes, and the whole hot set written (so the replica restarted below loses pages
    // that are looked up again); the prefill runs with the suite's ramp.
    let stores = s.stores().await?;
    let ips: Vec<String> = stores.iter().map(pod_ip).collect::<Result<_, _>>()?;
    let settled = poll(Duration::from_secs(3 * RAMP_S + 30), || async {
        let r = s.prefill_report().await.ok()?;
        let all = ips.iter().all(|i| {
            line(&r, i).is_some_and(|l| {
                l["ramping"] == false
                    && !l["attached_for_s"].is_null()
                    && l["writes"].as_u64() > Some(0)
            })
        });
        let written: u64 = ips
            .iter()
            .filter_map(|i| line(&r, i)?["writes"].as_u64())
            .sum();
        (all && written >= HOT * HOT_PAGES).then_some(r)
    })
    .await
    .ok_or_else(|| {
        "the prefill did not attach every store replica past its ramp, taking writes, with the \
         hot set written"
            .to_owned()
    })?;
    let ramp_s = settled["l3"]["write_ramp"]["ramp_s"].as_f64();
    let window_s = settled["l3"]["rate_window_s"].as_f64();
    if ramp_s != Some(RAMP_S as f64) || window_s != Some(RAMP_S as f64) {
        return Err(format!(
            "the prefill runs with ramp {ramp_s:?} s and rate window {window_s:?} s, not the \
             suite's {RAMP_S} s (pod env TANDEM_L3_WRITE_RAMP_S / TANDEM_L3_RATE_WINDOW_S)"
        ));
    }
    println!(
        "[{:>5.1}s] load running; every replica attached and past its cold-start ramp \
         (ramp {RAMP_S} s, rate window {RAMP_S} s); writes/s {}",
        at(t0),
        rates(&settled, &ips)
    );

    // Restart replica 0 empty: frozen, its volume emptied, killed; the runner restarts it.
    let victim = stores[0].clone();
    let (vname, vip) = (pod_name(&victim), pod_ip(&victim)?);
    let dir = volume_of(h, &vname).await?;
    let before = s.report_of(&victim).await?;
    let runner = h.cluster.config.runner_dir();
    let frozen = container_process(&runner, &pod_uid(&victim), "store")
        .ok_or_else(|| format!("{vname}: no running store process"))?;
    frozen.signal(Signal::STOP, true);
    let mut wiped = 0;
    for e in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        }
        .map_err(|e| format!("{}: {e}", p.display()))?;
        wiped += 1;
    }
    let killed = kill_container(&runner, &pod_uid(&victim), "store").map_err(|e| e.to_string())?;
    let t_kill = Instant::now();
    let back = poll(Duration::from_secs(60), || async {
        let pod = s.store(&vname).await.ok()?;
        let r = s.report_of(&pod).await.ok()?;
        let restarted = restarts_of(&pod, "store") > restarts_of(&victim, "store");
        (restarted && r["warm"] == true && r["loadback"]["total"] == 0).then_some(r)
    })
    .await
    .ok_or_else(|| format!("{vname} did not come back warm and empty within 60 s"))?;
    let t_back = Instant::now();
    if pod_uid(&s.store(&vname).await?) != pod_uid(&victim)
        || pod_ip(&s.store(&vname).await?)? != vip
    {
        return Err(format!(
            "{vname} was restarted in a new pod or on a new address"
        ));
    }
    println!(
        "[{:>5.1}s] item 4 (empty restart): {vname} ({vip}) held {} objects; frozen, its volume \
         emptied ({wiped} entries of {}), SIGKILLed (pid {}); back serving after {} ms with {} \
         objects and nothing to load back, same pod and address",
        at(t0),
        before["objects"],
        dir.display(),
        killed.pid,
        (t_back - t_kill).as_millis(),
        back["objects"],
    );

    // The prefill attaches it again (empty: its write share ramps); once attached for a whole
    // window, every replica's rate over that window is after the restart.
    let (mut seen_ramping, mut weights) = (false, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(RAMP_S + 60);
    let last = loop {
        if Instant::now() > deadline {
            return Err(format!(
                "the prefill did not keep {vname} attached for {RAMP_S} s within {} s of its \
                 restart",
                RAMP_S + 60
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Ok(r) = s.prefill_report().await else {
            continue;
        };
        let Some(l) = line(&r, &vip) else { continue };
        // Before its first call to the restarted replica the prefill may still show the
        // attachment from before the restart.
        let Some(attached) = l["attached_for_s"]
            .as_f64()
            .filter(|a| *a <= t_kill.elapsed().as_secs_f64())
        else {
            continue;
        };
        seen_ramping |= l["ramping"] == true;
        weights.push((attached, l["weight"].as_f64().unwrap_or(f64::NAN)));
        if attached >= RAMP_S as f64 {
            break r;
        }
    };
    let rate = |i: &str| {
        line(&last, i)
            .and_then(|l| l["writes_per_s"].as_f64())
            .unwrap_or(0.0)
    };
    let restarted = rate(&vip);
    let others: Vec<f64> = ips.iter().filter(|i| **i != vip).map(|i| rate(i)).collect();
    let mean = others.iter().sum::<f64>() / others.len() as f64;
    let ratio = restarted / mean;
    let in_window = (restarted + others.iter().sum::<f64>()) * RAMP_S as f64;
    let sampled: Vec<String> = weights
        .iter()
        .step_by((weights.len() / 6).max(1))
        .map(|(t, w)| format!("{t:.0}s:{w:.2}"))
        .collect();
    println!(
        "[{:>5.1}s] item 4 (empty restart): writes/s over the {RAMP_S} s window after {vname} \
         attached again: {vname} {restarted:.2}, others {} (mean {mean:.2}); ratio {ratio:.2} \
         (bound {MAX_RATIO}); {in_window:.0} writes in the window; its weight (attached s:weight) \
         {}; l3 {}",
        at(t0),
        others
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        sampled.join(" "),
        last["l3"]
    );
    if in_window < 30.0 || mean <= 0.0 {
        return Err(format!(
            "only {in_window:.0} writes in the window: too few for a rate ratio to mean anything"
        ));
    }
    if !seen_ramping {
        return Err(format!(
            "{vname} attached empty but was never seen ramping (weight below 1): {weights:?}"
        ));
    }
    if restarted <= 0.0 {
        return Err(format!(
            "{vname} took no write in the window after its restart: a ramp must let writes in"
        ));
    }
    if ratio > MAX_RATIO {
        return Err(format!(
            "{vname}, restarted empty, stored {ratio:.2}× the others' mean write rate (bound \
             {MAX_RATIO}×): {}",
            last["l3"]
        ));
    }
    Ok(())
}

/// `writes/s` of each replica at `ips` in a prefill report.
fn rates(r: &Value, ips: &[String]) -> String {
    ips.iter()
        .map(|i| {
            format!(
                "{i} {:.2}",
                line(r, i)
                    .and_then(|l| l["writes_per_s"].as_f64())
                    .unwrap_or(f64::NAN)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Phase 2: a replica that comes back on a new address is followed without restarting the
/// prefill.
async fn new_address(h: &Harness, s: &Stack<'_>, t0: Instant) -> Result<(), String> {
    let prefill = s.worker(ROLE_PREFILL).await?;
    let decode = s.worker(ROLE_DECODE).await?;
    let p_report = s.report_of(&prefill).await?;
    let incarnation = p_report["incarnation"].clone();
    let reattaches = p_report["l3"]["reattach"]["count"].as_u64().unwrap_or(0);
    let stores = s.stores().await?;
    let mover = stores[1].clone();
    let (mname, old_ip) = (pod_name(&mover), pod_ip(&mover)?);
    let listed_before = s.store_addresses();
    h.kubectl(&["delete", "pod", &mname, "--wait=false"])?;
    let t_delete = Instant::now();
    // The new address as soon as the hosts file lists it (what the writers read on every call).
    let deadline = t_delete + Duration::from_secs(90);
    let (new_ip, t_published) = loop {
        let now = s.store_addresses();
        if let Some(n) = now.iter().find(|a| !listed_before.contains(*a)) {
            break (n.clone(), Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no new address for {} in the hosts file within 90 s of deleting {mname}: {now:?}",
                store_service()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let moved = s.store(&mname).await?;
    if pod_ip(&moved)? != new_ip || pod_uid(&moved) == pod_uid(&mover) || new_ip == old_ip {
        return Err(format!(
            "the new address {new_ip} is not {mname}'s new pod ({} {})",
            pod_uid(&moved),
            pod_ip(&moved).unwrap_or_default()
        ));
    }
    // The prefill's reattachment to it.
    let addr = format!("{new_ip}:{L3_PORT}");
    let deadline = t_published + Duration::from_secs(30);
    let (report, t_reattached) = loop {
        let r = s.report_of(&prefill).await.unwrap_or(Value::Null);
        let re = &r["l3"]["reattach"];
        if re["last"]["addr"] == addr.as_str() && re["count"].as_u64() > Some(reattaches) {
            break (r, Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the prefill did not reattach to {addr} within 30 s of its publication: l3 {}",
                r["l3"]
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let observed = t_reattached - t_published;
    let re = &report["l3"]["reattach"]["last"];
    // Same prefill and decode pods, no container restarted, the same prefill process.
    let prefill_now = s.worker(ROLE_PREFILL).await?;
    let decode_now = s.worker(ROLE_DECODE).await?;
    let same = pod_uid(&prefill_now) == pod_uid(&prefill)
        && pod_uid(&decode_now) == pod_uid(&decode)
        && restarts(&prefill_now) == restarts(&prefill)
        && restarts(&decode_now) == restarts(&decode)
        && report["incarnation"] == incarnation;
    // Writes follow it: its line takes writes.
    let took = poll(Duration::from_secs(20), || async {
        let r = s.report_of(&prefill).await.ok()?;
        line(&r, &new_ip)?["writes"].as_u64().filter(|n| *n > 0)
    })
    .await;
    println!(
        "[{:>5.1}s] item 4 (new address): {mname} deleted; recreated on {new_ip} (was {old_ip}), \
         listed by {} {} ms after the delete; the prefill reattached {} ms after the listing \
         (observed; writer-reported: outage {} s, since listed {} s; reattaches {reattaches} → \
         {}); {} writes to it since; prefill and decode pods, container restart counts ({} / {}) \
         and prefill incarnation {incarnation} unchanged: {same}",
        at(t0),
        store_service(),
        (t_published - t_delete).as_millis(),
        observed.as_millis(),
        re["outage_s"],
        re["since_listed_s"],
        report["l3"]["reattach"]["count"],
        took.map_or("no".into(), |n| n.to_string()),
        restarts(&prefill_now),
        restarts(&decode_now),
    );
    if observed >= MAX_REATTACH {
        return Err(format!(
            "the prefill reattached to {addr} {} ms after its publication (bound {} s)",
            observed.as_millis(),
            MAX_REATTACH.as_secs()
        ));
    }
    if !same {
        return Err(format!(
            "following the moved replica restarted something: prefill {} → {} (restarts {} → \
             {}, incarnation {incarnation} → {}), decode {} → {} (restarts {} → {})",
            pod_uid(&prefill),
            pod_uid(&prefill_now),
            restarts(&prefill),
            restarts(&prefill_now),
            report["incarnation"],
            pod_uid(&decode),
            pod_uid(&decode_now),
            restarts(&decode),
            restarts(&decode_now)
        ));
    }
    if took.is_none() {
        return Err(format!(
            "no write reached {mname} on its new address within 20 s of the reattachment"
        ));
    }
    Ok(())
}
