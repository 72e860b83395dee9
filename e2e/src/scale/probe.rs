//! What the scale run observes while it runs: the operator process (`/proc`), its `/metrics`, the
//! API server's `/metrics`, the readiness of every stack (watches), and which groups of a pool
//! serve (a pod watch).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde::Serialize;
use tandem_crds::labels::{GROUP, POOL};

use super::prom::{self, Sample};
use crate::demo::stack::{TandemKind, is_ready};
use crate::http_get;

/// CPU time and memory of a process, from `/proc/<pid>/stat` and `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ProcSample {
    /// Seconds since the run's origin.
    pub t_s: f64,
    /// User + system CPU seconds so far.
    pub cpu_s: f64,
    /// Resident set size (MiB).
    pub rss_mib: f64,
    /// Peak resident set size so far (`VmHWM`, MiB).
    pub peak_rss_mib: f64,
    /// `tandem_operator_reconciles_in_flight`, summed over kinds (the queue depth).
    pub in_flight: f64,
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 when it cannot be run).
pub fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU seconds, RSS and peak RSS (MiB) of `pid`; `None` when it is gone.
pub fn read_proc(pid: u32, ticks: f64) -> Option<(f64, f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at the last ')'.
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): utime is field 14, stime 15.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((
        (utime + stime) / ticks,
        kib("VmRSS:")? / 1024.0,
        kib("VmHWM:")? / 1024.0,
    ))
}

/// GET `http://addr/metrics`, parsed.
pub async fn scrape_operator(addr: SocketAddr) -> Option<Vec<Sample>> {
    let r = http_get::get(addr, "/metrics", &[], Duration::from_secs(5))
        .await
        .ok()?;
    (r.status == 200).then(|| prom::parse(&r.body))
}

/// The API server's `/metrics` (admin client), parsed.
pub async fn scrape_apiserver(client: &kube::Client) -> Option<Vec<Sample>> {
    let req = http::Request::get("/metrics").body(Vec::new()).ok()?;
    let text = client.request_text(req).await.ok()?;
    Some(prom::parse(&text))
}

/// Samples the operator process and its queue depth every `every` until dropped.
pub struct ProcSampler {
    samples: Arc<Mutex<Vec<ProcSample>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ProcSampler {
    /// Starts sampling `pid` (and `metrics` for the in-flight gauge); `origin` is time zero.
    pub fn start(pid: u32, metrics: SocketAddr, origin: Instant, every: Duration) -> Self {
        let samples: Arc<Mutex<Vec<ProcSample>>> = Arc::default();
        let out = samples.clone();
        let ticks = clock_ticks();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some((cpu_s, rss_mib, peak_rss_mib)) = read_proc(pid, ticks) else {
                    return;
                };
                let in_flight = scrape_operator(metrics).await.map_or(f64::NAN, |s| {
                    prom::sum(&s, "tandem_operator_reconciles_in_flight", &[])
                });
                if let Ok(mut v) = out.lock() {
                    v.push(ProcSample {
                        t_s: origin.elapsed().as_secs_f64(),
                        cpu_s,
                        rss_mib,
                        peak_rss_mib,
                        in_flight,
                    });
                }
            }
        });
        Self { samples, task }
    }

    /// The samples so far.
    pub fn snapshot(&self) -> Vec<ProcSample> {
        self.samples.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl Drop for ProcSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The first time each object of the three kinds was seen `Ready=True`, by
/// `Kind/namespace/name`.
#[derive(Clone, Default)]
pub struct ReadyTimes {
    seen: Arc<Mutex<HashMap<String, Instant>>>,
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl ReadyTimes {
    /// Watches kind `K` in every namespace.
    pub fn watch<K>(&self, client: &kube::Client)
    where
        K: TandemKind + Send + Sync + 'static,
    {
        let api: Api<K> = Api::all(client.clone());
        let seen = self.seen.clone();
        let kind = K::kind(&()).to_string();
        let task = tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(ev) = events.next().await {
                let Ok(obj) = ev else { continue };
                if is_ready(obj.conditions()) {
                    let key = format!(
                        "{kind}/{}/{}",
                        obj.namespace().unwrap_or_default(),
                        obj.name_any()
                    );
                    if let Ok(mut m) = seen.lock() {
                        m.entry(key).or_insert_with(Instant::now);
                    }
                }
            }
        });
        if let Ok(mut t) = self.tasks.lock() {
            t.push(task);
        }
    }

    /// When `Kind/namespace/name` was first seen Ready.
    pub fn get(&self, key: &str) -> Option<Instant> {
        self.seen.lock().ok()?.get(key).copied()
    }

    /// Objects seen Ready so far.
    pub fn count(&self) -> usize {
        self.seen.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Stops the watches.
    pub fn stop(&self) {
        if let Ok(mut t) = self.tasks.lock() {
            for task in t.drain(..) {
                task.abort();
            }
        }
    }
}

/// When each stack's children appeared and when its pods became Ready, by namespace (one stack
/// per namespace): what splits apply→Ready into the operator's part and the control plane's
/// (issue 17). Instants are when this process saw the event on its watches.
#[derive(Clone, Default)]
pub struct StackPhases {
    first_child: Arc<Mutex<HashMap<String, Instant>>>,
    pods: Arc<Mutex<HashMap<String, HashMap<String, PodSeen>>>>,
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

/// One pod name of a stack as the watch last saw it: a pod replaced under the same name (a new
/// UID) starts over, so its replacement's Ready time is the one that counts.
#[derive(Debug, Clone, Default)]
struct PodSeen {
    uid: String,
    ready_at: Option<Instant>,
    /// Incarnations seen before this one.
    replaced: usize,
}

impl PodSeen {
    /// Folds in one observation of the pod.
    fn observe(&mut self, uid: &str, serving: bool) {
        if self.uid != uid {
            if !self.uid.is_empty() {
                self.replaced += 1;
            }
            self.uid = uid.to_owned();
            self.ready_at = None;
        }
        if !serving {
            self.ready_at = None;
        } else if self.ready_at.is_none() {
            self.ready_at = Some(Instant::now());
        }
    }
}

impl StackPhases {
    /// Watches StatefulSets (the operator's first child of every stack) and pods in every
    /// namespace.
    pub fn start(client: &kube::Client) -> Self {
        let this = Self::default();
        let first = this.first_child.clone();
        let sts: Api<StatefulSet> = Api::all(client.clone());
        let a = tokio::spawn(async move {
            let mut events = watcher(sts, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(ev) = events.next().await {
                let Ok(obj) = ev else { continue };
                if let (Some(ns), Ok(mut m)) = (obj.namespace(), first.lock()) {
                    m.entry(ns).or_insert_with(Instant::now);
                }
            }
        });
        let seen = this.pods.clone();
        let pods: Api<Pod> = Api::all(client.clone());
        let b = tokio::spawn(async move {
            let mut events = watcher(pods, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(ev) = events.next().await {
                let Ok(p) = ev else { continue };
                let uid = p.uid().unwrap_or_default();
                if let (Some(ns), Ok(mut m)) = (p.namespace(), seen.lock()) {
                    m.entry(ns)
                        .or_default()
                        .entry(p.name_any())
                        .or_default()
                        .observe(&uid, pod_serving(&p));
                }
            }
        });
        if let Ok(mut t) = this.tasks.lock() {
            t.extend([a, b]);
        }
        this
    }

    /// When the first StatefulSet of `namespace` was seen.
    pub fn first_child(&self, namespace: &str) -> Option<Instant> {
        self.first_child.lock().ok()?.get(namespace).copied()
    }

    /// When the last of `pods` pods of `namespace` became Ready (each pod name's current
    /// incarnation, Ready now); `None` while fewer than `pods` are.
    pub fn pods_ready(&self, namespace: &str, pods: usize) -> Option<Instant> {
        let m = self.pods.lock().ok()?;
        let ready: Vec<Instant> = m
            .get(namespace)?
            .values()
            .filter_map(|p| p.ready_at)
            .collect();
        (ready.len() >= pods).then(|| ready.iter().max().copied())?
    }

    /// Pods of `namespace` replaced under the same name (a new UID) so far.
    pub fn replaced(&self, namespace: &str) -> usize {
        self.pods
            .lock()
            .ok()
            .and_then(|m| {
                m.get(namespace)
                    .map(|p| p.values().map(|s| s.replaced).sum())
            })
            .unwrap_or(0)
    }

    /// Stops the watches.
    pub fn stop(&self) {
        if let Ok(mut t) = self.tasks.lock() {
            for task in t.drain(..) {
                task.abort();
            }
        }
    }
}

/// One observation of a pair's groups: how many of the first `desired` groups of each pool serve
/// (every pod of the group exists, Ready, not terminating).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ServingPoint {
    /// Seconds since the tracker started.
    pub t_s: f64,
    /// Desired groups (per pool).
    pub desired: u32,
    /// Decode groups serving.
    pub decode: u32,
    /// Prefill groups serving.
    pub prefill: u32,
}

#[derive(Debug, Clone)]
struct PodState {
    pool: String,
    group: u32,
    uid: String,
    serving: bool,
}

#[derive(Default)]
struct ServingState {
    pods: BTreeMap<String, PodState>,
    uids: std::collections::BTreeSet<String>,
    points: Vec<ServingPoint>,
}

/// Watches the pods of one namespace and records, at every pod event, how many groups of the
/// decode and the prefill pool serve.
pub struct ServingTracker {
    state: Arc<Mutex<ServingState>>,
    desired: Arc<std::sync::atomic::AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

/// Whether a pod serves: Ready, not terminating.
pub fn pod_serving(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Groups among `0..desired` of `pool` with at least `size` serving pods.
fn serving_groups(pods: &BTreeMap<String, PodState>, pool: &str, desired: u32, size: u32) -> u32 {
    let mut per: BTreeMap<u32, u32> = BTreeMap::new();
    for p in pods.values().filter(|p| p.pool == pool && p.serving) {
        *per.entry(p.group).or_default() += 1;
    }
    per.iter()
        .filter(|(g, n)| **g < desired && **n >= size)
        .count() as u32
}

impl ServingTracker {
    /// Starts watching `namespace`; `decode` and `prefill` name the pools, `size` is the pods
    /// per group (tensor × context), `desired` the groups counted.
    pub fn start(
        client: &kube::Client,
        namespace: &str,
        decode: String,
        prefill: String,
        size: u32,
        desired: u32,
    ) -> Self {
        let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let state: Arc<Mutex<ServingState>> = Arc::default();
        let desired = Arc::new(std::sync::atomic::AtomicU32::new(desired));
        let (st, want) = (state.clone(), desired.clone());
        let origin = Instant::now();
        let task = tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(ev) = events.next().await {
                let Ok(ev) = ev else { continue };
                let Ok(mut s) = st.lock() else { return };
                let upsert = |s: &mut ServingState, p: &Pod| {
                    let labels = p.labels();
                    let (Some(pool), Some(group)) = (
                        labels.get(POOL),
                        labels.get(GROUP).and_then(|g| g.parse::<u32>().ok()),
                    ) else {
                        return;
                    };
                    let uid = p.uid().unwrap_or_default();
                    s.uids.insert(uid.clone());
                    s.pods.insert(
                        p.name_any(),
                        PodState {
                            pool: pool.clone(),
                            group,
                            uid,
                            serving: pod_serving(p),
                        },
                    );
                };
                match ev {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => upsert(&mut s, &p),
                    watcher::Event::Delete(p) => {
                        s.pods.remove(&p.name_any());
                    }
                    watcher::Event::Init => s.pods.clear(),
                    watcher::Event::InitDone => {}
                }
                let d = want.load(std::sync::atomic::Ordering::Relaxed);
                let point = ServingPoint {
                    t_s: origin.elapsed().as_secs_f64(),
                    desired: d,
                    decode: serving_groups(&s.pods, &decode, d, size),
                    prefill: serving_groups(&s.pods, &prefill, d, size),
                };
                s.points.push(point);
            }
        });
        Self {
            state,
            desired,
            task,
        }
    }

    /// Sets the groups counted from now on.
    pub fn set_desired(&self, desired: u32) {
        self.desired
            .store(desired, std::sync::atomic::Ordering::Relaxed);
    }

    /// The points so far.
    pub fn points(&self) -> Vec<ServingPoint> {
        self.state
            .lock()
            .map(|s| s.points.clone())
            .unwrap_or_default()
    }

    /// Distinct pod UIDs seen so far (a restart replaces every pod: +1 per pod).
    pub fn uids_seen(&self) -> usize {
        self.state.lock().map(|s| s.uids.len()).unwrap_or(0)
    }

    /// UIDs of the pods that exist now.
    pub fn current_uids(&self) -> Vec<String> {
        self.state
            .lock()
            .map(|s| s.pods.values().map(|p| p.uid.clone()).collect())
            .unwrap_or_default()
    }
}

impl Drop for ServingTracker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_replaced_under_its_name_counts_its_replacements_ready_time() {
        let mut p = PodSeen::default();
        p.observe("u1", false);
        assert_eq!((p.ready_at, p.replaced), (None, 0));
        p.observe("u1", true);
        let first = p.ready_at.expect("ready");
        p.observe("u1", true);
        assert_eq!(
            p.ready_at,
            Some(first),
            "a later event keeps the first Ready time"
        );
        // Deleted (terminating: not serving), then recreated under the same name.
        p.observe("u1", false);
        assert_eq!(p.ready_at, None);
        p.observe("u2", false);
        assert_eq!((p.ready_at, p.replaced), (None, 1));
        p.observe("u2", true);
        assert!(p.ready_at.is_some_and(|t| t >= first));
        // A new UID that is already Ready when first seen.
        p.observe("u3", true);
        assert_eq!(p.replaced, 2);
        assert!(p.ready_at.is_some());
    }

    #[test]
    fn reads_this_process() {
        let (cpu, rss, peak) = read_proc(std::process::id(), clock_ticks()).expect("own /proc");
        assert!(cpu >= 0.0);
        assert!(rss > 0.0 && peak >= rss, "{rss} {peak}");
    }

    #[test]
    fn a_group_serves_only_with_all_its_pods() {
        let mut pods = BTreeMap::new();
        let mut add = |name: &str, group: u32, serving: bool| {
            pods.insert(
                name.to_owned(),
                PodState {
                    pool: "d".into(),
                    group,
                    uid: name.into(),
                    serving,
                },
            );
        };
        add("d-0-0", 0, true);
        add("d-0-1", 0, true);
        add("d-1-0", 1, true);
        add("d-1-1", 1, false);
        add("d-2-0", 2, true);
        add("d-2-1", 2, true);
        assert_eq!(serving_groups(&pods, "d", 3, 2), 1 + 1);
        assert_eq!(
            serving_groups(&pods, "d", 2, 2),
            1,
            "group 2 is out of range"
        );
        assert_eq!(serving_groups(&pods, "p", 3, 2), 0);
    }
}
