//! Issue 18 on the live stack: the failure classes users report most, reproduced against the
//! operator installed by `helm install` and the sample stack on the process runner (one cluster,
//! ports + 8000, runner node index 80), under traffic from the replay driver. Every wait is on an
//! observed event (a `/report` field, a pod condition, a CacheTier condition), bounded.
//!
//! The stack is the samples with a 1:1 ratio (one prefill group, one decode group, so the decode
//! has no other prefill when its only one dies) and a one-replica CacheTier whose persistence is a
//! sized volume (`tandem-e2e-sized`: a tmpfs of the claim's size, so the volume really fills).
//! Pods get a 20 s request deadline (`TANDEM_DECODE_REQUEST_DEADLINE_MS`).
//!
//! 1. Item 5, the L3 store's volume fills (a ballast file takes its free space): prompts keep being
//!    served, puts are refused and counted in the replica's `/report`, the replica says
//!    `VolumeFull` in `degraded`, and the CacheTier says `Degraded=True, StoreVolumeFull` with the
//!    replica's name; the store is not restarted.
//! 2. Item 1, a prefill SIGKILLed under traffic (the runner restarts it on the same pod IP and
//!    ports, as a kubelet with `restartPolicy: Always`): every in-flight request completes or ends
//!    with a reason within its deadline, no page is corrupt, the decode is not ready from the
//!    moment it loses its only prefill until it has handshaken the new incarnation (its `/report`
//!    sampled every 100 ms, its pod's `Ready` watched), and its `peer_incarnations` then names the
//!    new process; new requests succeed, and prompts whose prefix is in L3 are served from the
//!    still-full store (reads keep serving).
//! 3. Item 1, the same for the decode: a new incarnation on the same IP, the in-flight streams end
//!    with a reason, new requests succeed at once after it is ready.
//! 4. Item 5, after a restart: the store replica SIGKILLed while full comes back with exactly the
//!    objects it had (loadback: none corrupt, no orphan removed, `tmp/` empty: nothing
//!    half-written), once Ready and listed by its Service again it refuses puts again, and once
//!    the ballast is removed new puts land and `Degraded` goes back to `AsExpected`.
//! 5. Item 6, the front door through the decode Service (resolved in the runner's hosts file):
//!    malformed JSON, negative and absurd `max_tokens`, a prompt beyond the KV pool, a body over
//!    the limit, a client that hangs up mid-stream: each a clear OpenAI error (or a counted
//!    cancellation with its pages back), and the same decode process keeps serving.
//!
//! 6. Issue 17, drain before delete: the pair scaled to 2 decode groups (2 prefill groups by the
//!    1:1 ratio), traffic that follows the Ready decode pods (as a Service's endpoints do), then
//!    `kubectl scale decodepool --replicas=1` while the group to be removed streams: exactly the
//!    highest group of each pool is deleted (the survivors keep their pod, IP and restart count),
//!    no stream is cut (no attempt ends after its first token), no request is lost, and each
//!    removed worker's teardown report says its in-flight work finished before it exited.
//!
//! Item 2 (a stalled peer or stream ends the request with a reason within the deadline) needs a
//! fault-injecting peer, which the stack has no place for: `worker/tests/serve_deadline.rs` covers
//! it at process level; here the deadline bounds every attempt (no attempt may run past it).
//!
//! Skips with a printed reason when the control-plane binaries are not built, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set; phases 1 and 4 are skipped (printed) when this process
//! cannot mount a tmpfs (not root).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, Pod};
use kube::Api;
use kube::runtime::watcher;
use serde_json::{Value, json};
use support::{
    Harness, HarnessConfig, install, pod_ip, pod_name, pod_uid, poll, ready, report_client,
    run_suite, wait_condition,
};
use tandem_crds::labels::{GROUP, POOL, ROLE, ROLE_CACHE, ROLE_DECODE, ROLE_PREFILL};
use tandem_crds::ports::{CONTROL_PORT, FRONT_DOOR_PORT, HEALTH_PORT};
use tandem_e2e::replay::driver::{ReplayConfig, ReplayProgress, RequestResult, replay};
use tandem_e2e::replay::schedule::{Clock, Outcome};
use tandem_e2e::replay::targets::{TargetSet, spawn_discovery};
use tandem_e2e::replay::workload::{GeneratorConfig, TraceRequest, generate};
use tandem_e2e::runner::crash::kill_container;
use tandem_e2e::runner::hosts::resolve;
use tandem_e2e::runner::storage::{SIZED_STORAGE_CLASS, can_mount_tmpfs};
use tokio::sync::watch;

const NS: &str = "default";
const DECODE: &str = "llama70b-decode";
const PREFILL: &str = "llama70b-prefill";
const TIER: &str = "llama70b-l3";
/// The per-request deadline every decode enforces, admission to last token.
const DEADLINE: Duration = Duration::from_secs(20);
/// Pods' extra environment: the deadline, and a slower simulation than the harness default so
/// requests are still in prefill or mid-stream when a process dies (10 ms per token: a 150-token
/// answer streams for 1.5 s; 100 µs per prompt token: a 4K-token prompt prefills for 0.4 s).
const POD_ENV: &[(&str, &str)] = &[
    ("TANDEM_DECODE_REQUEST_DEADLINE_MS", "20000"),
    ("TANDEM_DECODE_KV_DEADLINE_MS", "10000"),
    ("TANDEM_SIM_TPOT_MS", "10"),
    ("TANDEM_SIM_PREFILL_US_PER_TOKEN", "100"),
];
/// The store's volume (a tmpfs of this size when sized volumes can be mounted).
const VOLUME: &str = "64Mi";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_a_full_volume_and_bad_input_on_the_live_stack() {
    run_suite(
        HarnessConfig {
            name: "reliability",
            port_offset: 8000,
            runner_gpus: 4,
            first_node_index: 80,
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

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

async fn scenario(h: &Harness) -> Result<(), String> {
    let t0 = Instant::now();
    let sized = can_mount_tmpfs(&h.cluster.config.runner_dir());
    if !sized {
        println!(
            "SKIPPED phases 1 and 4 (L3 volume full): this process cannot mount a tmpfs \
             ({SIZED_STORAGE_CLASS} volumes need CAP_SYS_ADMIN)"
        );
    }
    install(h).await?;
    let manifests = tempfile::tempdir().map_err(|e| e.to_string())?;
    write_stack(manifests.path(), sized)?;
    h.kubectl(&["apply", "-f", &manifests.path().display().to_string()])?;
    wait_condition(h, "cachetier", TIER, "Ready", "True", 240).await?;
    wait_condition(h, "decodepool", DECODE, "Ready", "True", 240).await?;
    println!(
        "[{:>5.1}s] stack Ready: 1 prefill, 1 decode, 1 store replica ({})",
        at(t0),
        if sized {
            format!("{VOLUME} sized volume")
        } else {
            "unsized volume".into()
        }
    );
    let s = Stack::new(h);
    // Warm the tier: these prompts' pages are written through to L3.
    let warm = workload(1, 30);
    let r = s.traffic(&warm).await?;
    let c = check(&r, "warm-up")?;
    if c.failed > 0 {
        return Err(format!("warm-up: {c:?}"));
    }
    let cache = s.pod(ROLE_CACHE).await?;
    let cache_report = s.report_of(&cache).await?;
    println!(
        "[{:>5.1}s] warm-up: {} requests ok, store holds {} objects",
        at(t0),
        c.ok,
        cache_report["objects"]
    );

    let ballast = if sized {
        let b = volume_full(h, &s, t0).await?;
        Some(b)
    } else {
        None
    };
    prefill_restart(&s, t0, &warm, sized).await?;
    decode_restart(&s, t0).await?;
    if let Some(b) = ballast {
        store_restart_and_recovery(h, &s, t0, b).await?;
    }
    front_door(h, &s, t0).await?;
    scale_in(h, &s, t0).await?;
    Ok(())
}

/// The sample stack, changed for this suite: ratio 1:1, one store replica, and (when `sized`) a
/// sized volume of [`VOLUME`] for it. Each change must apply (the samples may not drift from it).
fn write_stack(dir: &Path, sized: bool) -> Result<(), String> {
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
    let mut tier = vec![("replicas: 2", "replicas: 1".to_owned())];
    if sized {
        tier.push((
            "persistence:\n    size: 20Gi",
            format!(
                "persistence:\n    size: {VOLUME}\n    storageClassName: {SIZED_STORAGE_CLASS}"
            ),
        ));
    }
    edit("cachetier.yaml", &tier)?;
    edit("prefillpool.yaml", &[])?;
    edit(
        "decodepool.yaml",
        &[("ratio: \"4:1\"", "ratio: \"1:1\"".to_owned())],
    )
}

/// A generated workload: `n` requests at 4/s, prompts of 1–8 blocks, 100–200 tokens out. Its
/// block ids are offset by `seed << 32` (the generator numbers blocks from 0 for every seed), so
/// workloads of different seeds share no page.
fn workload(seed: u64, n: usize) -> Vec<TraceRequest> {
    let mut w = generate(&GeneratorConfig {
        requests: n,
        seed,
        rate_per_s: 4.0,
        system_prompts: 3,
        system_prompt_blocks: 1..=2,
        follow_up: 0.5,
        turn_blocks: 1..=2,
        max_blocks: 8,
        output_tokens: 100..=200,
    });
    for r in &mut w {
        for id in &mut r.hash_ids {
            *id += seed << 32;
        }
    }
    w
}

/// What a replay's results add up to.
#[derive(Debug, Default)]
struct Tally {
    /// Completed on the first attempt.
    ok: usize,
    /// Completed after retries.
    retried: usize,
    /// Given up, each with its reasons.
    failed: usize,
    /// Prompt tokens served from L3, over the completed requests.
    l3_tokens: u64,
    /// The longest request, first send to its end.
    longest: Duration,
    /// Distinct reasons of failed attempts (the text before the first digit-free cut), counted.
    reasons: BTreeMap<String, usize>,
}

/// Every request completed with intact KV or ended with a reason, and no attempt ran past the
/// deadline (the replay's attempt timeout is the deadline plus 5 s: a timeout means a hang).
fn check(results: &[RequestResult], phase: &str) -> Result<Tally, String> {
    let mut t = Tally::default();
    for r in results {
        for e in &r.errors {
            if e.contains("no [DONE] within") {
                return Err(format!(
                    "{phase}: request {} hung past its deadline: {:?}",
                    r.index, r.errors
                ));
            }
            *t.reasons.entry(reason_of(e)).or_default() += 1;
        }
        t.longest = t.longest.max(Duration::from_secs_f64(
            (r.finished_ms - r.sent_ms).max(0.0) / 1000.0,
        ));
        match r.outcome {
            Outcome::Ok | Outcome::Retried => {
                let corrupt = r.tandem.as_ref().map_or(0, |b| b.corrupt_chunks);
                if corrupt != 0 {
                    return Err(format!(
                        "{phase}: request {} read {corrupt} corrupt chunks",
                        r.index
                    ));
                }
                t.l3_tokens += r.tandem.as_ref().map_or(0, |b| b.prefix_hit_tokens.l3);
                if r.outcome == Outcome::Ok {
                    t.ok += 1;
                } else {
                    t.retried += 1;
                }
            }
            Outcome::Failed => {
                if r.errors.iter().all(|e| e.trim().is_empty()) {
                    return Err(format!(
                        "{phase}: request {} failed without a reason",
                        r.index
                    ));
                }
                t.failed += 1;
            }
        }
    }
    Ok(t)
}

/// The reason of an attempt error without its target URL: `"HTTP 503: prefill_unavailable …"`.
fn reason_of(e: &str) -> String {
    let text = e.split_once(": ").map_or(e, |(_, rest)| rest);
    text.chars().take(70).collect()
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

    /// The one live pod of `role` (prefill and decode: the worker pods of the pair; cache: the
    /// store replica).
    async fn pod(&self, role: &str) -> Result<Pod, String> {
        let pool = match role {
            ROLE_PREFILL => PREFILL,
            ROLE_DECODE => DECODE,
            _ => TIER,
        };
        let pods = self.h.pods(&format!("{POOL}={pool},{ROLE}={role}")).await?;
        let live: Vec<Pod> = pods
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        match live.as_slice() {
            [p] => Ok(p.clone()),
            other => Err(format!("{role}: {} live pods, expected 1", other.len())),
        }
    }

    async fn get(&self, url: &str) -> Option<Value> {
        let r = self.http.get(url).send().await.ok()?;
        r.json().await.ok()
    }

    async fn report_of(&self, pod: &Pod) -> Result<Value, String> {
        let url = report_url(pod)?;
        self.get(&url)
            .await
            .ok_or_else(|| format!("{url} did not answer"))
    }

    /// The decode's front door, by pod IP (a restart keeps it).
    async fn front(&self) -> Result<String, String> {
        Ok(format!(
            "http://{}:{FRONT_DOOR_PORT}",
            pod_ip(&self.pod(ROLE_DECODE).await?)?
        ))
    }

    /// Replays `w` against the decode's front door and returns the results.
    async fn traffic(&self, w: &[TraceRequest]) -> Result<Vec<RequestResult>, String> {
        let targets = TargetSet::fixed(vec![self.front().await?]);
        Ok(replay(w, &targets, &replay_config(), Clock::start(), None, None).await)
    }

    /// Starts replaying `w`; returns its progress and the task.
    async fn traffic_in_background(
        &self,
        w: Vec<TraceRequest>,
    ) -> Result<
        (
            watch::Receiver<ReplayProgress>,
            tokio::task::JoinHandle<Vec<RequestResult>>,
        ),
        String,
    > {
        let targets = TargetSet::fixed(vec![self.front().await?]);
        let (tx, rx) = watch::channel(ReplayProgress::default());
        let task = tokio::spawn(async move {
            replay(
                &w,
                &targets,
                &replay_config(),
                Clock::start(),
                Some(tx),
                None,
            )
            .await
        });
        Ok((rx, task))
    }

    /// Waits (30 s) until at least `n` requests of a background replay are in flight.
    async fn in_flight(
        &self,
        progress: &mut watch::Receiver<ReplayProgress>,
        n: usize,
    ) -> Result<usize, String> {
        let got = tokio::time::timeout(
            Duration::from_secs(30),
            progress.wait_for(|p| p.dispatched.saturating_sub(p.finished) >= n),
        )
        .await
        .map_err(|_| format!("never {n} requests in flight within 30 s"))?
        .map_err(|e| e.to_string())?;
        Ok(got.dispatched - got.finished)
    }
}

fn replay_config() -> ReplayConfig {
    ReplayConfig {
        concurrency_limit: Some(8),
        retry_budget: 3,
        backoff_base: Duration::from_millis(200),
        backoff_max: Duration::from_secs(2),
        attempt_timeout: DEADLINE + Duration::from_secs(5),
        ..ReplayConfig::default()
    }
}

fn report_url(p: &Pod) -> Result<String, String> {
    Ok(format!("http://{}:{HEALTH_PORT}/report", pod_ip(p)?))
}

/// Restarts of container `c` of `p`.
fn restarts(p: &Pod, c: &str) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|s| s.name == c))
        .map_or(0, |s| s.restart_count)
}

/// One sample of the decode's `/report`.
#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    /// `None`: unreachable.
    ready: Option<bool>,
    incarnation: u64,
    peers: BTreeMap<String, u64>,
}

/// Samples a `/report` every 100 ms until stopped.
struct Recorder {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Recorder {
    fn start(http: reqwest::Client, url: String) -> Self {
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut out = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    _ = rx.changed() => return out,
                    _ = tick.tick() => {}
                }
                let r = async {
                    let resp = http.get(&url).send().await.ok()?;
                    resp.json::<Value>().await.ok()
                }
                .await;
                out.push(match r {
                    Some(v) => Sample {
                        at: Instant::now(),
                        ready: v["ready"].as_bool(),
                        incarnation: v["incarnation"].as_u64().unwrap_or(0),
                        peers: v["peer_incarnations"]
                            .as_object()
                            .map(|m| {
                                m.iter()
                                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                                    .collect()
                            })
                            .unwrap_or_default(),
                    },
                    None => Sample {
                        at: Instant::now(),
                        ready: None,
                        incarnation: 0,
                        peers: BTreeMap::new(),
                    },
                });
            }
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

/// Watches one pod's `Ready` condition and records each change with its time.
struct ReadyWatch {
    task: tokio::task::JoinHandle<()>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<(Instant, bool)>>>,
}

impl ReadyWatch {
    fn start(h: &Harness, pod: &str) -> Self {
        let api: Api<Pod> = Api::namespaced(h.client.clone(), NS);
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let out = seen.clone();
        let cfg = watcher::Config::default().fields(&format!("metadata.name={pod}"));
        let task = tokio::spawn(async move {
            let stream = watcher(api, cfg);
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let pods = match ev {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => vec![p],
                    _ => continue,
                };
                let mut s = out.lock().unwrap_or_else(|e| e.into_inner());
                for p in pods {
                    let r = ready(&p);
                    if s.last().is_none_or(|(_, last)| *last != r) {
                        s.push((Instant::now(), r));
                    }
                }
            }
        });
        Self { task, seen }
    }

    /// The changes seen so far.
    fn stop(self) -> Vec<(Instant, bool)> {
        self.task.abort();
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How long a kubelet may lag the worker's `/readyz`: the workers' readiness probe runs every 2 s
/// and turns a pod unready after 3 failures (the rendered probe, the kubelet's default
/// threshold), plus one period of phase.
const PROBE_LAG: Duration = Duration::from_secs(8);

/// The pod's `Ready` followed its worker, unready from `from` to `to`: when that window outlasted
/// [`PROBE_LAG`], the pod went unready within [`PROBE_LAG`] of `from`; and it is Ready again
/// (within 20 s). Returns what the watch saw, for the figures.
async fn pod_follows(w: ReadyWatch, from: Instant, to: Instant) -> Result<String, String> {
    let settled = poll(Duration::from_secs(20), || async {
        let s = w.seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        s.last().is_some_and(|(_, r)| *r).then_some(())
    })
    .await;
    let seen = w.stop();
    if settled.is_none() {
        return Err(format!(
            "the pod is not Ready again 20 s after its worker: {seen:?}"
        ));
    }
    let down = seen.iter().find(|(t, r)| *t >= from && !r).map(|(t, _)| *t);
    let up = down.and_then(|d| seen.iter().find(|(t, r)| *t > d && *r).map(|(t, _)| *t));
    match (down, up) {
        (Some(d), Some(u)) if d - from <= PROBE_LAG => Ok(format!(
            "pod Ready=False after {} ms, True after {} ms",
            ms(d - from),
            ms(u - from)
        )),
        (Some(d), _) => Err(format!(
            "the pod went unready {} ms after its worker, beyond the probe's lag",
            ms(d - from)
        )),
        (None, _) if to - from > PROBE_LAG => Err(format!(
            "the worker was unready for {} ms but its pod never left Ready",
            ms(to - from)
        )),
        (None, _) => Ok(format!(
            "pod stayed Ready (worker unready {} ms, within the probe's lag of {} ms)",
            ms(to - from),
            ms(PROBE_LAG)
        )),
    }
}

/// Phase 1 (item 5): fills the store's volume and checks the refusals, the replica's report and
/// the CacheTier's condition. Returns the ballast file (removed in phase 4).
async fn volume_full(h: &Harness, s: &Stack<'_>, t0: Instant) -> Result<PathBuf, String> {
    let cache = s.pod(ROLE_CACHE).await?;
    let before = s.report_of(&cache).await?;
    let dir = store_volume(h).await?;
    let ballast = dir.join("ballast");
    let filled = fill(&ballast)?;
    let t_fill = Instant::now();
    println!(
        "[{:>5.1}s] item 5: the store's volume is full ({filled} bytes of ballast in {})",
        at(t0),
        dir.display()
    );
    // New prompts: their pages cannot be stored, the prompts are still served.
    let r = s.traffic(&workload(2, 20)).await?;
    let c = check(&r, "volume full")?;
    if c.failed > 0 {
        return Err(format!(
            "requests failed while the store's volume was full: {c:?}"
        ));
    }
    let refused_before = before["puts_refused_disk_full"].as_u64().unwrap_or(0);
    let report = poll(Duration::from_secs(30), || async {
        let r = s.report_of(&cache).await.ok()?;
        let refused = r["puts_refused_disk_full"].as_u64()?;
        let degraded = r["degraded"]
            .as_array()?
            .iter()
            .any(|d| d["code"] == "VolumeFull");
        (refused > refused_before && degraded).then_some(r)
    })
    .await
    .ok_or("the store never reported refused puts and VolumeFull while its volume was full")?;
    let t_refused = Instant::now();
    wait_condition(h, "cachetier", TIER, "Degraded", "True", 60).await?;
    let t_condition = Instant::now();
    let reason = h.kubectl(&[
        "get",
        "cachetier",
        TIER,
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Degraded\")].reason}|{.status.conditions[?(@.type==\"Degraded\")].message}",
    ])?;
    let (reason, message) = reason.split_once('|').unwrap_or((&reason, ""));
    if reason != "StoreVolumeFull" || !message.contains(&pod_name(&cache)) {
        return Err(format!(
            "CacheTier Degraded must say StoreVolumeFull naming {}: {reason} {message}",
            pod_name(&cache)
        ));
    }
    let events = h.kubectl(&[
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={TIER},reason=StoreVolumeFull"),
        "-o",
        "name",
    ])?;
    if events.trim().is_empty() {
        return Err("no StoreVolumeFull event on the CacheTier".into());
    }
    let now = s.pod(ROLE_CACHE).await?;
    if restarts(&now, "store") != restarts(&cache, "store") || pod_uid(&now) != pod_uid(&cache) {
        return Err("the store replica restarted while its volume was full".into());
    }
    println!(
        "[{:>5.1}s] item 5: {} prompts served while full ({} retried); {} puts refused; replica \
         degraded {} ms and CacheTier Degraded=True StoreVolumeFull {} ms after the fill \
         (\"{message}\"); store not restarted",
        at(t0),
        c.ok + c.retried,
        c.retried,
        report["puts_refused_disk_full"].as_u64().unwrap_or(0) - refused_before,
        ms(t_refused - t_fill),
        ms(t_condition - t_fill),
    );
    Ok(ballast)
}

/// The directory of the store replica's sized volume.
async fn store_volume(h: &Harness) -> Result<PathBuf, String> {
    let api: Api<PersistentVolume> = Api::all(h.client.clone());
    let pvs = api
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?;
    let dirs: Vec<PathBuf> = pvs
        .items
        .iter()
        .filter_map(|pv| {
            let spec = pv.spec.as_ref()?;
            let claim = spec.claim_ref.as_ref()?;
            let path = &spec.host_path.as_ref()?.path;
            (spec.storage_class_name.as_deref() == Some(SIZED_STORAGE_CLASS)
                && claim.namespace.as_deref() == Some(NS))
            .then(|| PathBuf::from(path))
        })
        .collect();
    match dirs.as_slice() {
        [d] => Ok(d.clone()),
        other => Err(format!("{} sized volumes, expected 1", other.len())),
    }
}

/// Writes `path` until the volume refuses another byte (1 MiB, then 4 KiB, then 1-byte writes):
/// the bytes written.
fn fill(path: &Path) -> Result<u64, String> {
    use std::io::Write as _;
    let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut total = 0u64;
    for chunk in [1 << 20, 4096, 1] {
        let buf = vec![0x5au8; chunk];
        loop {
            match f.write(&buf) {
                Ok(0) => break,
                Ok(n) => total += n as u64,
                Err(e) if e.raw_os_error() == Some(libc_enospc()) => break,
                Err(e) => return Err(format!("{}: {e}", path.display())),
            }
        }
    }
    Ok(total)
}

/// `ENOSPC` (28 on Linux).
const fn libc_enospc() -> i32 {
    28
}

/// Phase 2 (item 1): the prefill SIGKILLed under traffic and restarted in place.
async fn prefill_restart(
    s: &Stack<'_>,
    t0: Instant,
    warm: &[TraceRequest],
    full: bool,
) -> Result<(), String> {
    let h = s.h;
    let prefill = s.pod(ROLE_PREFILL).await?;
    let decode = s.pod(ROLE_DECODE).await?;
    let peer = format!("{}:{CONTROL_PORT}", pod_ip(&prefill)?);
    let old = s.report_of(&prefill).await?["incarnation"]
        .as_u64()
        .filter(|n| *n != 0)
        .ok_or("the prefill's /report has no incarnation")?;
    let d = s.report_of(&decode).await?;
    if d["peer_incarnations"][&peer] != old {
        return Err(format!(
            "the decode's peer_incarnations do not name {peer} as incarnation {old}: {}",
            d["peer_incarnations"]
        ));
    }
    let recorder = Recorder::start(s.http.clone(), report_url(&decode)?);
    let pod_ready = ReadyWatch::start(h, &pod_name(&decode));
    let (mut progress, task) = s.traffic_in_background(workload(3, 40)).await?;
    let in_flight = s.in_flight(&mut progress, 3).await?;
    let killed = kill_container(&h.cluster.config.runner_dir(), &pod_uid(&prefill), "worker")
        .map_err(|e| e.to_string())?;
    let t_kill = Instant::now();
    // The runner restarts it: a new incarnation on the same IP answers.
    let new = poll(Duration::from_secs(60), || async {
        let n = s.report_of(&prefill).await.ok()?["incarnation"].as_u64()?;
        (n != old && n != 0).then_some(n)
    })
    .await
    .ok_or("the prefill did not come back as a new incarnation within 60 s")?;
    let t_back = Instant::now();
    poll(Duration::from_secs(60), || async {
        let d = s.report_of(&decode).await.ok()?;
        (d["peer_incarnations"][&peer] == new && d["ready"] == true).then_some(())
    })
    .await
    .ok_or_else(|| format!("the decode did not handshake the new prefill incarnation {new}"))?;
    let t_wired = Instant::now();
    let results = task.await.map_err(|e| e.to_string())?;
    let c = check(&results, "prefill restart")?;
    let samples = recorder.stop().await;
    let t_unready = readiness_truthful(&samples, t_kill, &peer, old, new)?;
    let pod = pod_follows(pod_ready, t_unready, t_wired).await?;
    // After the re-handshake: new requests succeed on their first attempt, and the warm-up's
    // prompts (their prefix in L3, the new prefill's memory empty) are served from the store:
    // loaded back into L2 at the prefill's start, or read from L3 by a request.
    let after = check(&s.traffic(&warm[..12]).await?, "after the prefill restart")?;
    if after.ok != 12 {
        return Err(format!(
            "requests after the prefill's re-handshake did not all succeed at once: {after:?}"
        ));
    }
    let loaded_back = s.report_of(&prefill).await?["counters"]["l3_pages_loaded_back"]
        .as_u64()
        .unwrap_or(0);
    if after.l3_tokens == 0 && loaded_back == 0 {
        return Err(format!(
            "nothing came from L3 after the prefill restart{}: {after:?}",
            if full {
                " (the store is full: reads must still serve)"
            } else {
                ""
            }
        ));
    }
    let now = s.pod(ROLE_PREFILL).await?;
    if pod_uid(&now) != pod_uid(&prefill) || pod_ip(&now)? != pod_ip(&prefill)? {
        return Err("the prefill was not restarted in place (pod or IP changed)".into());
    }
    let d = s.report_of(&decode).await?;
    if d["counters"]["corrupt_pages_read"] != 0 {
        return Err(format!("the decode read corrupt pages: {}", d["counters"]));
    }
    println!(
        "[{:>5.1}s] item 1 prefill: SIGKILL pid {} with {in_flight} requests in flight; decode \
         /report not ready after {} ms, prefill back (incarnation {old:#x} → {new:#x}) after {} ms, \
         decode re-handshaken and ready after {} ms; decode {pod}; 40 in-flight-window requests: {} ok, {} retried, {} failed with a reason \
         (longest {} ms) {:?}; restart count {} → {}; 12/12 after; read from L3{}: {loaded_back} \
         pages loaded back at start, {} prompt tokens; 0 corrupt pages",
        at(t0),
        killed.pid,
        ms(t_unready - t_kill),
        ms(t_back - t_kill),
        ms(t_wired - t_kill),
        c.ok,
        c.retried,
        c.failed,
        ms(c.longest),
        c.reasons,
        restarts(&prefill, "worker"),
        restarts(&now, "worker"),
        if full { " (store full)" } else { "" },
        after.l3_tokens,
    );
    Ok(())
}

/// The decode's readiness told the truth around a prefill restart: it went unready within 5 s of
/// the kill; from then on it was never ready until its `peer_incarnations` named the new
/// incarnation; and it was never ready with no live prefill link, nor (after going unready) with
/// the old incarnation. Returns when it went unready.
fn readiness_truthful(
    samples: &[Sample],
    t_kill: Instant,
    peer: &str,
    old: u64,
    new: u64,
) -> Result<Instant, String> {
    let mut decodes: Vec<u64> = samples
        .iter()
        .filter(|s| s.ready.is_some())
        .map(|s| s.incarnation)
        .collect();
    decodes.dedup();
    if decodes.len() != 1 {
        return Err(format!(
            "the decode itself restarted during the prefill's restart: incarnations {decodes:?}"
        ));
    }
    for s in samples {
        if s.ready == Some(true) && s.peers.is_empty() {
            return Err(format!(
                "the decode said ready with no live prefill link at {:?} after the kill",
                s.at.checked_duration_since(t_kill)
            ));
        }
    }
    let unready = samples
        .iter()
        .find(|s| s.at >= t_kill && s.ready == Some(false))
        .ok_or("the decode's /report never said not ready after its only prefill died")?
        .at;
    if unready - t_kill > Duration::from_secs(5) {
        return Err(format!(
            "the decode still said ready {} ms after its only prefill died",
            ms(unready - t_kill)
        ));
    }
    for s in samples.iter().filter(|s| s.at >= unready) {
        if s.ready == Some(true) && s.peers.get(peer) != Some(&new) {
            return Err(format!(
                "the decode said ready {} ms after the kill without the new incarnation {new:#x} \
                 (old {old:#x}): {:?}",
                ms(s.at - t_kill),
                s.peers
            ));
        }
    }
    Ok(unready)
}

/// Phase 3 (item 1): the decode SIGKILLed under traffic and restarted in place.
async fn decode_restart(s: &Stack<'_>, t0: Instant) -> Result<(), String> {
    let h = s.h;
    let decode = s.pod(ROLE_DECODE).await?;
    let old = s.report_of(&decode).await?["incarnation"]
        .as_u64()
        .filter(|n| *n != 0)
        .ok_or("the decode's /report has no incarnation")?;
    let prefill = s.pod(ROLE_PREFILL).await?;
    let aborted_before = s.report_of(&prefill).await?["counters"]["rooms_aborted"]
        .as_u64()
        .unwrap_or(0);
    let pod_ready = ReadyWatch::start(h, &pod_name(&decode));
    let (mut progress, task) = s.traffic_in_background(workload(4, 40)).await?;
    let in_flight = s.in_flight(&mut progress, 3).await?;
    let killed = kill_container(&h.cluster.config.runner_dir(), &pod_uid(&decode), "worker")
        .map_err(|e| e.to_string())?;
    let t_kill = Instant::now();
    let new = poll(Duration::from_secs(60), || async {
        let d = s.report_of(&decode).await.ok()?;
        let n = d["incarnation"].as_u64()?;
        (n != old && n != 0 && d["ready"] == true).then_some(n)
    })
    .await
    .ok_or("the decode did not come back ready as a new incarnation within 60 s")?;
    let t_ready = Instant::now();
    let results = task.await.map_err(|e| e.to_string())?;
    let c = check(&results, "decode restart")?;
    let after = check(
        &s.traffic(&workload(5, 12)).await?,
        "after the decode restart",
    )?;
    if after.ok != 12 {
        return Err(format!(
            "requests after the decode restart did not all succeed at once: {after:?}"
        ));
    }
    let pod = pod_follows(pod_ready, t_kill, t_ready).await?;
    let now = s.pod(ROLE_DECODE).await?;
    if pod_uid(&now) != pod_uid(&decode) || pod_ip(&now)? != pod_ip(&decode)? {
        return Err("the decode was not restarted in place (pod or IP changed)".into());
    }
    let d = s.report_of(&now).await?;
    if d["counters"]["corrupt_pages_read"] != 0 || d["counters"]["pages_quarantined"] != 0 {
        return Err(format!(
            "the new decode read corrupt pages or quarantined some: {}",
            d["counters"]
        ));
    }
    let aborted = s.report_of(&prefill).await?["counters"]["rooms_aborted"]
        .as_u64()
        .unwrap_or(0)
        - aborted_before;
    println!(
        "[{:>5.1}s] item 1 decode: SIGKILL pid {} with {in_flight} requests in flight; back ready \
         as a new incarnation ({old:#x} → {new:#x}) after {} ms; {pod}; 40 in-flight-window \
         requests: {} ok, {} retried, {} failed with a \
         reason (longest {} ms) {:?}; prefill rooms aborted for the old incarnation: {aborted}; \
         restart count {} → {}; 12/12 after; 0 corrupt pages",
        at(t0),
        killed.pid,
        ms(t_ready - t_kill),
        c.ok,
        c.retried,
        c.failed,
        ms(c.longest),
        c.reasons,
        restarts(&decode, "worker"),
        restarts(&now, "worker"),
    );
    Ok(())
}

/// Phase 4 (item 5): the store restarted while full keeps exactly its objects, nothing
/// half-written, and refuses puts again (the CacheTier `Degraded` again); then the ballast goes,
/// puts land, and `Degraded` clears.
async fn store_restart_and_recovery(
    h: &Harness,
    s: &Stack<'_>,
    t0: Instant,
    ballast: PathBuf,
) -> Result<(), String> {
    let cache = s.pod(ROLE_CACHE).await?;
    let before = s.report_of(&cache).await?;
    let objects = before["objects"].as_u64().unwrap_or(0);
    let killed = kill_container(&h.cluster.config.runner_dir(), &pod_uid(&cache), "store")
        .map_err(|e| e.to_string())?;
    let t_kill = Instant::now();
    let after = poll(Duration::from_secs(60), || async {
        let r = s.report_of(&cache).await.ok()?;
        let restarted = r["counters"]["l3_pages_written"] == 0
            && restarts(&s.pod(ROLE_CACHE).await.ok()?, "store") > restarts(&cache, "store");
        (restarted && r["warm"] == true).then_some(r)
    })
    .await
    .ok_or("the store replica did not come back warm within 60 s")?;
    let t_warm = Instant::now();
    let lb = &after["loadback"];
    let tmp = ballast.with_file_name("tmp");
    let leftovers: Vec<String> = std::fs::read_dir(&tmp)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    if after["objects"] != objects
        || lb["published"] != objects
        || lb["corrupt"] != 0
        || lb["orphansRemoved"] != 0
        || !leftovers.is_empty()
    {
        return Err(format!(
            "after a restart on a full volume the store must hold exactly its {objects} objects, \
             none corrupt or half-written: objects {}, loadback {lb}, tmp/ {leftovers:?}",
            after["objects"]
        ));
    }
    // Writers reach a replica through the `<tier>-store` Service, which publishes ready replicas
    // only: the restarted replica can be sent puts once its pod is Ready again and the Service (the
    // runner's hosts file, what the workers resolve) lists it, about a probe period after its own
    // `/report` says warm. Prompts sent before that find no replica to write to (the prefill
    // degrades with "resolves to no replica" and keeps their pages in L2 only), so nothing would
    // be put and nothing refused.
    let hosts = h.cluster.config.runner_dir().join("hosts");
    let store_ip = pod_ip(&cache)?;
    poll(Duration::from_secs(60), || async {
        let pod = s.pod(ROLE_CACHE).await.ok()?;
        let text = std::fs::read_to_string(&hosts).ok()?;
        (ready(&pod) && resolve(&text, &store_service()).contains(&store_ip)).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "the restarted store replica was not Ready and listed by {} within 60 s of being warm",
            store_service()
        )
    })?;
    let t_listed = Instant::now();
    // Still full: the new process refuses puts too, and says so.
    let t_sent = Instant::now();
    let r = s.traffic(&workload(7, 12)).await?;
    let t_served = Instant::now();
    let c = check(&r, "full after the store restart")?;
    if c.failed > 0 {
        return Err(format!(
            "requests failed on the restarted store's full volume: {c:?}"
        ));
    }
    let refused = poll(Duration::from_secs(30), || async {
        let r = s.report_of(&cache).await.ok()?;
        let degraded = r["degraded"]
            .as_array()?
            .iter()
            .any(|d| d["code"] == "VolumeFull");
        let n = r["puts_refused_disk_full"].as_u64()?;
        (degraded && n > 0).then_some(n)
    })
    .await;
    let Some(refused) = refused else {
        return Err(format!(
            "the restarted store did not refuse puts on its full volume (12 prompts sent {} ms \
             after it was listed, served in {} ms, {} ms ago); {}",
            ms(t_sent - t_listed),
            ms(t_served - t_sent),
            ms(t_served.elapsed()),
            writer_view(h, s).await
        ));
    };
    wait_condition(h, "cachetier", TIER, "Degraded", "True", 60).await?;
    std::fs::remove_file(&ballast).map_err(|e| e.to_string())?;
    let t_free = Instant::now();
    let r = s.traffic(&workload(6, 12)).await?;
    let c = check(&r, "volume freed")?;
    if c.failed > 0 {
        return Err(format!("requests failed after the volume was freed: {c:?}"));
    }
    poll(Duration::from_secs(30), || async {
        let r = s.report_of(&cache).await.ok()?;
        let clear = r["degraded"].as_array()?.is_empty();
        (clear && r["counters"]["l3_pages_written"].as_u64()? > 0).then_some(())
    })
    .await
    .ok_or("no put landed, or the replica stayed degraded, after the volume was freed")?;
    wait_condition(h, "cachetier", TIER, "Degraded", "False", 60).await?;
    let t_clear = Instant::now();
    println!(
        "[{:>5.1}s] item 5: store SIGKILLed (pid {}) on its full volume, warm again after {} ms \
         with its {objects} objects (loadback {lb}; tmp/ empty), Ready and listed by {} {} ms \
         after warm; 12 prompts served, {refused} puts refused again (VolumeFull, CacheTier \
         Degraded=True); ballast removed: puts land, CacheTier Degraded=False {} ms later",
        at(t0),
        killed.pid,
        ms(t_warm - t_kill),
        store_service(),
        ms(t_listed - t_warm),
        ms(t_clear - t_free),
    );
    Ok(())
}

/// What the L3 writer and the store replica say, for a failure message: the store's refusals,
/// `degraded` and stored puts, the prefill's `l3` section (replica book: backoff, attachment,
/// reattach), `degraded` and pages written, and what the store's Service resolves to.
async fn writer_view(h: &Harness, s: &Stack<'_>) -> String {
    let store = match s.pod(ROLE_CACHE).await {
        Ok(p) => s.report_of(&p).await.unwrap_or_else(|e| json!(e)),
        Err(e) => json!(e),
    };
    let prefill = match s.pod(ROLE_PREFILL).await {
        Ok(p) => s.report_of(&p).await.unwrap_or_else(|e| json!(e)),
        Err(e) => json!(e),
    };
    let hosts =
        std::fs::read_to_string(h.cluster.config.runner_dir().join("hosts")).unwrap_or_default();
    format!(
        "store: puts_refused_disk_full {}, degraded {}, l3_pages_written {}; prefill: \
         l3_pages_written {}, degraded {}, l3 {}; {} resolves to {:?}",
        store["puts_refused_disk_full"],
        store["degraded"],
        store["counters"]["l3_pages_written"],
        prefill["counters"]["l3_pages_written"],
        prefill["degraded"],
        prefill["l3"],
        store_service(),
        resolve(&hosts, &store_service()),
    )
}

/// The name writers resolve the tier's replicas by (the `<tier>-store` headless Service, which
/// publishes ready replicas only), as the operator writes it into the workers' config.
fn store_service() -> String {
    format!("{TIER}-store.{NS}.svc")
}

/// Phase 5 (item 6): bad input through the decode Service; the same process keeps serving.
async fn front_door(h: &Harness, s: &Stack<'_>, t0: Instant) -> Result<(), String> {
    // The Service's endpoints (and the runner's hosts file) follow the pods' readiness a moment
    // after the pool turns Ready: wait for the one decode, at most 30 s.
    let hosts_file = h.cluster.config.runner_dir().join("hosts");
    let service = format!("{DECODE}.{NS}.svc.cluster.local");
    let one = poll(Duration::from_secs(30), || async {
        let hosts = std::fs::read_to_string(&hosts_file).unwrap_or_default();
        let ips = resolve(&hosts, &service);
        (ips.len() == 1).then_some(ips)
    })
    .await;
    let hosts = std::fs::read_to_string(&hosts_file).map_err(|e| e.to_string())?;
    let ips = one.unwrap_or_else(|| resolve(&hosts, &service));
    let [svc_ip] = ips.as_slice() else {
        return Err(format!(
            "{service} resolves to {ips:?}, expected the one decode"
        ));
    };
    let base = format!("http://{svc_ip}:{FRONT_DOOR_PORT}/v1/completions");
    let decode = s.pod(ROLE_DECODE).await?;
    let before = s.report_of(&decode).await?;
    let http = reqwest::Client::new();
    let post = |body: Vec<u8>| {
        let (http, url) = (http.clone(), base.clone());
        async move {
            let r = http
                .post(url)
                .header("content-type", "application/json")
                .timeout(Duration::from_secs(30))
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let code = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            Ok::<_, String>((code, v))
        }
    };
    let ok_body = |extra: Value| {
        let mut b =
            json!({"model": "llama-3-70b", "prompt": "x", "max_tokens": 4, "input_tokens": 600});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        b.to_string().into_bytes()
    };
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("malformed JSON", b"{\"model\": ".to_vec(), 400, "malformed"),
        (
            "negative max_tokens",
            ok_body(json!({"max_tokens": -1})),
            400,
            "malformed",
        ),
        (
            "absurd max_tokens",
            ok_body(json!({"max_tokens": 1_000_000_000_000u64})),
            400,
            "malformed",
        ),
        (
            "prompt beyond the KV pool",
            ok_body(json!({"input_tokens": 1u64 << 31})),
            400,
            "context_length_exceeded",
        ),
        (
            "body over 16 MiB",
            vec![b' '; (16 << 20) + 1],
            413,
            "request_too_large",
        ),
    ];
    let mut seen = Vec::new();
    for (what, body, want, code) in cases {
        let (got, v) = post(body).await?;
        let e = &v["error"];
        if got != want || e["code"] != code || e["message"].as_str().is_none_or(str::is_empty) {
            return Err(format!(
                "{what}: expected {want} {code} with a message, got {got} {v}"
            ));
        }
        seen.push(format!("{what} → {got} {code}"));
    }
    // A client that hangs up mid-stream: the request is cancelled and its pages come back.
    let cancelled_before = before["counters"]["requests_cancelled"]
        .as_u64()
        .unwrap_or(0);
    let resp = http
        .post(&base)
        .json(
            &json!({"model": "llama-3-70b", "prompt": "x", "max_tokens": 1500,
            "input_tokens": 2000, "stream": true}),
        )
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if resp.status() != 200 {
        return Err(format!("a streamed request got {}", resp.status()));
    }
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(20), stream.next())
        .await
        .map_err(|_| "no streamed event within 20 s")?;
    if !matches!(first, Some(Ok(_))) {
        return Err(format!(
            "the stream ended before its first event: {first:?}"
        ));
    }
    drop(stream);
    let t_hangup = Instant::now();
    poll(Duration::from_secs(20), || async {
        let r = s.report_of(&decode).await.ok()?;
        let n = r["counters"]["requests_cancelled"].as_u64()?;
        (n > cancelled_before && r["kv_pages"]["held"] == 0).then_some(())
    })
    .await
    .ok_or("the hung-up stream was not counted as cancelled with its pages freed")?;
    let t_freed = Instant::now();
    let (got, v) = post(ok_body(json!({}))).await?;
    if got != 200 {
        return Err(format!("a good request after the bad ones: {got} {v}"));
    }
    let after = s.report_of(&decode).await?;
    let now = s.pod(ROLE_DECODE).await?;
    if after["incarnation"] != before["incarnation"]
        || restarts(&now, "worker") != restarts(&decode, "worker")
    {
        return Err("the decode restarted during the bad-input phase".into());
    }
    println!(
        "[{:>5.1}s] item 6 through Service {service} ({svc_ip}): {}; a stream hung up after its \
         first event was cancelled with its pages freed in {} ms; a good request then 200, same \
         incarnation, no restart",
        at(t0),
        seen.join(", "),
        ms(t_freed - t_hangup),
    );
    Ok(())
}

/// The live pods of `pool`/`role`, by group label.
async fn groups(h: &Harness, pool: &str, role: &str) -> Result<BTreeMap<String, Pod>, String> {
    let pods = h.pods(&format!("{POOL}={pool},{ROLE}={role}")).await?;
    Ok(pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let g = p.metadata.labels.as_ref()?.get(GROUP)?.clone();
            Some((g, p))
        })
        .collect())
}

/// Events received before an attempt error, from the driver's messages ("… after N events");
/// `None` for errors before any stream (refusals, connection errors).
fn events_before(e: &str) -> Option<u64> {
    let (_, rest) = e.split_once("after ")?;
    let (n, tail) = rest.split_once(' ')?;
    tail.starts_with("events").then(|| n.parse().ok())?
}

/// A container's log in the runner's pod directory (`pods/<ns>_<name>_<uid>/logs/<container>.log`),
/// opened now: the runner removes the directory with the pod, and the open file still reads.
fn open_log(h: &Harness, pod: &Pod, container: &str) -> Result<std::fs::File, String> {
    let log = h
        .cluster
        .config
        .runner_dir()
        .join("pods")
        .join(format!("{NS}_{}_{}", pod_name(pod), pod_uid(pod)))
        .join("logs")
        .join(format!("{container}.log"));
    std::fs::File::open(&log).map_err(|e| format!("{}: {e}", log.display()))
}

/// The last `teardown {…}` line of a log opened with [`open_log`] (the worker's teardown report,
/// DESIGN §5), read to its end.
fn teardown_line(mut log: std::fs::File, who: &str) -> Result<Value, String> {
    use std::io::Read;
    let mut text = String::new();
    log.read_to_string(&mut text)
        .map_err(|e| format!("{who}'s log: {e}"))?;
    let line = text
        .lines()
        .rev()
        .find_map(|l| l.find("teardown {").map(|i| &l[i + "teardown ".len()..]))
        .ok_or_else(|| format!("the removed {who} logged no teardown report"))?;
    // The structured log may quote the object; take the JSON between the outer braces.
    let end = line
        .rfind('}')
        .ok_or("teardown report without a closing brace")?;
    serde_json::from_str(&line[..=end]).map_err(|e| format!("teardown report {line}: {e}"))
}

/// Phase 6 (issue 17, drain before delete): scale-in under traffic removes exactly the highest
/// group of each pool, cuts no stream and loses no request.
async fn scale_in(h: &Harness, s: &Stack<'_>, t0: Instant) -> Result<(), String> {
    h.kubectl(&["scale", "decodepool", DECODE, "--replicas=2"])?;
    let two = poll(Duration::from_secs(180), || async {
        let d = groups(h, DECODE, ROLE_DECODE).await.ok()?;
        let p = groups(h, PREFILL, ROLE_PREFILL).await.ok()?;
        let all_ready = d.values().chain(p.values()).all(ready);
        (d.len() == 2 && p.len() == 2 && all_ready).then_some((d, p))
    })
    .await
    .ok_or("2 decode and 2 prefill groups never all Ready within 180 s")?;
    wait_condition(h, "decodepool", DECODE, "Ready", "True", 120).await?;
    let (decodes, prefills) = two;
    let last = |m: &BTreeMap<String, Pod>| -> Result<(String, Pod), String> {
        m.iter()
            .max_by_key(|(g, _)| g.parse::<u32>().unwrap_or(0))
            .map(|(g, p)| (g.clone(), p.clone()))
            .ok_or_else(|| "no group".to_owned())
    };
    let (dg, victim_d) = last(&decodes)?;
    let (pg, victim_p) = last(&prefills)?;
    let survivors: Vec<Pod> = decodes
        .iter()
        .chain(prefills.iter())
        .filter(|(g, _)| **g != dg && **g != pg)
        .map(|(_, p)| p.clone())
        .collect();

    // Traffic that follows the Ready decode pods (what the Service's endpoints publish).
    let targets = TargetSet::default();
    let discovery = spawn_discovery(
        h.client.clone(),
        NS.to_owned(),
        DECODE.to_owned(),
        targets.clone(),
        Duration::from_millis(200),
    );
    poll(Duration::from_secs(30), || async {
        (targets.snapshot().len() == 2).then_some(())
    })
    .await
    .ok_or("traffic discovery never saw both decode front doors")?;
    let (tx, mut progress) = watch::channel(ReplayProgress::default());
    let w = workload(9, 60);
    let replay_targets = targets.clone();
    let task = tokio::spawn(async move {
        replay(
            &w,
            &replay_targets,
            &replay_config(),
            Clock::start(),
            Some(tx),
            None,
        )
        .await
    });
    s.in_flight(&mut progress, 4).await?;
    // The group to be removed holds KV of rooms in flight when the scale-in is asked for.
    let held = poll(Duration::from_secs(30), || async {
        let r = s.report_of(&victim_d).await.ok()?;
        let held = r["kv_pages"]["held"].as_u64()?;
        (held > 0).then_some(held)
    })
    .await
    .ok_or("the decode group to be removed never held KV of a room in flight")?;
    let (log_d, log_p) = (
        open_log(h, &victim_d, "worker")?,
        open_log(h, &victim_p, "worker")?,
    );
    h.kubectl(&["scale", "decodepool", DECODE, "--replicas=1"])?;
    let t_scale = Instant::now();
    let gone = poll(Duration::from_secs(180), || async {
        let d = groups(h, DECODE, ROLE_DECODE).await.ok()?;
        let p = groups(h, PREFILL, ROLE_PREFILL).await.ok()?;
        let all = h.pods(POOL).await.ok()?;
        let victims_exist = all
            .iter()
            .any(|x| pod_uid(x) == pod_uid(&victim_d) || pod_uid(x) == pod_uid(&victim_p));
        (d.len() == 1 && p.len() == 1 && !victims_exist).then_some((d, p))
    })
    .await
    .ok_or("the scale-in did not remove one group of each pool within 180 s")?;
    let t_gone = Instant::now();
    let results = task.await.map_err(|e| e.to_string())?;
    discovery.abort();
    let c = check(&results, "scale-in")?;
    let cut: Vec<String> = results
        .iter()
        .flat_map(|r| r.errors.iter())
        .filter(|e| events_before(e).is_some_and(|n| n > 0))
        .cloned()
        .collect();

    // Exactly the highest groups went; the survivors are the same pods, not restarted.
    let (d_now, p_now) = gone;
    if d_now.keys().any(|g| *g == dg) || p_now.keys().any(|g| *g == pg) {
        return Err(format!(
            "a removed group is back: decode {:?}, prefill {:?}",
            d_now.keys().collect::<Vec<_>>(),
            p_now.keys().collect::<Vec<_>>()
        ));
    }
    for old in &survivors {
        let now = d_now
            .values()
            .chain(p_now.values())
            .find(|p| pod_name(p) == pod_name(old))
            .ok_or_else(|| format!("{} was removed instead of the highest group", pod_name(old)))?;
        if pod_uid(now) != pod_uid(old) || restarts(now, "worker") != restarts(old, "worker") {
            return Err(format!(
                "{} was replaced or restarted by the scale-in",
                pod_name(old)
            ));
        }
    }
    if c.failed > 0 || !cut.is_empty() {
        return Err(format!(
            "scale-in: {} requests lost, {} streams cut {cut:?}; {c:?}",
            c.failed,
            cut.len()
        ));
    }
    let td = teardown_line(log_d, "decode")?;
    let tp = teardown_line(log_p, "prefill")?;
    for (who, t) in [("decode", &td), ("prefill", &tp)] {
        if t["ok"] != true {
            return Err(format!("the removed {who}'s teardown failed a step: {t}"));
        }
    }
    println!(
        "[{:>5.1}s] issue 17 scale-in: decode group {dg} (holding {held} KV pages of rooms in \
         flight) and prefill group {pg} removed {} ms after `kubectl scale --replicas=1`; \
         survivors {:?} kept pod, IP and restart count; 60 requests: {} ok, {} retried (refused \
         before their first token: {:?}), 0 lost, 0 streams cut (longest {} ms); removed \
         workers' teardown ok (decode and prefill)",
        at(t0),
        ms(t_gone - t_scale),
        survivors.iter().map(pod_name).collect::<Vec<_>>(),
        c.ok,
        c.retried,
        c.reasons,
        ms(c.longest),
    );
    Ok(())
}

#[test]
fn events_before_reads_the_drivers_messages() {
    assert_eq!(
        events_before("http://x: stream broken after 3 events: reset"),
        Some(3)
    );
    assert_eq!(
        events_before("http://x: stream ended before [DONE] after 0 events"),
        Some(0)
    );
    assert_eq!(
        events_before("http://x: error event after 12 events: boom"),
        Some(12)
    );
    assert_eq!(events_before("http://x: HTTP 503: draining"), None);
}
