//! A watch on the stack's pods for the whole demo: pod churn during the scale-up and the rolling
//! restart becomes report events, and the teardown check gets each pod's end time.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::watcher;

use super::teardown::PodEnd;
use crate::replay::schedule::Clock;
use crate::replay::targets::{REVISION_LABEL, ROLE_LABEL, pod_serving};
use crate::report::Event;

/// What the watch knows about one pod (keyed by uid).
#[derive(Debug, Clone, PartialEq)]
pub struct PodTrack {
    /// Pod name.
    pub name: String,
    /// Role label.
    pub role: String,
    /// Revision label.
    pub revision: String,
    /// Serving at the last observation.
    pub serving: bool,
    /// First observation with `deletionTimestamp` (ms).
    pub deletion_seen_ms: Option<f64>,
    /// Deleted event (ms).
    pub gone_ms: Option<f64>,
}

#[derive(Default)]
struct State {
    pods: BTreeMap<String, PodTrack>,
    events: Vec<Event>,
}

/// A running pod watch; drop or [`PodWatch::stop`] ends it.
pub struct PodWatch {
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodWatch {
    /// Watches pods with a role label in `namespace`, timing everything on `clock`.
    pub fn start(client: kube::Client, namespace: &str, clock: Clock) -> Self {
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let task = tokio::spawn(async move {
            let cfg = watcher::Config::default().labels(ROLE_LABEL);
            let mut stream = watcher(api, cfg).boxed();
            while let Some(ev) = stream.next().await {
                let now = clock.ms();
                let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
                match ev {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                        observe(&mut s, &p, now)
                    }
                    Ok(watcher::Event::Delete(p)) => gone(&mut s, &p, now),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "pod watch error (the watcher retries)"),
                }
            }
        });
        Self { state, task }
    }

    /// Events so far (pod ready / deleting / gone).
    pub fn events(&self) -> Vec<Event> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .clone()
    }

    /// Every pod seen so far.
    pub fn pods(&self) -> Vec<PodTrack> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pods
            .values()
            .cloned()
            .collect()
    }

    /// The ends of the pods still present at `since_ms` (not gone before it), for the teardown
    /// check.
    pub fn ends_since(&self, since_ms: f64) -> Vec<PodEnd> {
        self.pods()
            .into_iter()
            .filter(|p| p.gone_ms.is_none_or(|g| g >= since_ms))
            .map(|p| PodEnd {
                pod: p.name,
                role: p.role,
                deletion_seen_ms: p.deletion_seen_ms,
                gone_ms: p.gone_ms,
            })
            .collect()
    }

    /// Marks every tracked pod that is not in `present` (uids) and has no end yet as gone at
    /// `now_ms`: a watch that re-lists after an error sees no Deleted event for a pod that went
    /// meanwhile. Returns how many were marked (0 in a clean run; the report says so).
    pub fn mark_missing_gone(&self, present: &[String], now_ms: f64) -> usize {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        for (uid, t) in s.pods.iter_mut() {
            if t.gone_ms.is_none() && !present.contains(uid) {
                t.gone_ms = Some(now_ms);
                n += 1;
            }
        }
        n
    }

    /// Stops the watch.
    pub fn stop(self) {
        self.task.abort();
    }
}

fn key(p: &Pod) -> String {
    p.metadata
        .uid
        .clone()
        .or_else(|| p.metadata.name.clone())
        .unwrap_or_default()
}

fn observe(s: &mut State, p: &Pod, now: f64) {
    let label = |k: &str| {
        p.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(k))
            .cloned()
            .unwrap_or_default()
    };
    let serving = pod_serving(p);
    let name = p.metadata.name.clone().unwrap_or_default();
    let k = key(p);
    let new = !s.pods.contains_key(&k);
    let t = s.pods.entry(k).or_insert_with(|| PodTrack {
        name: name.clone(),
        role: label(ROLE_LABEL),
        revision: label(REVISION_LABEL),
        serving: false,
        deletion_seen_ms: None,
        gone_ms: None,
    });
    let became_serving = serving && !t.serving;
    t.serving = serving;
    let deleting = p.metadata.deletion_timestamp.is_some() && t.deletion_seen_ms.is_none();
    if deleting {
        t.deletion_seen_ms = Some(now);
    }
    let detail = format!("{name} ({} {})", t.role, t.revision);
    if new && !became_serving {
        s.events
            .push(Event::new(now, "pod-created", detail.clone()));
    }
    if became_serving {
        s.events.push(Event::new(now, "pod-ready", detail.clone()));
    }
    if deleting {
        s.events.push(Event::new(now, "pod-deleting", detail));
    }
}

fn gone(s: &mut State, p: &Pod, now: f64) {
    observe(s, p, now);
    if let Some(t) = s.pods.get_mut(&key(p))
        && t.gone_ms.is_none()
    {
        t.gone_ms = Some(now);
        let detail = format!("{} ({} {})", t.name, t.role, t.revision);
        s.events.push(Event::new(now, "pod-gone", detail));
    }
}
