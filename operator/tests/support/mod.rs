//! A small in-memory API server behind tower-test's mock service: enough of GET, LIST (label
//! equality selectors), server-side apply, merge patch (with `resourceVersion` preconditions),
//! `/status` and `/scale` subresources, POST and DELETE for the operator's reconcilers. Every call
//! is logged so tests can assert exact request sequences and count writes.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};

/// One request the reconcilers made.
#[derive(Debug, Clone)]
pub struct Call {
    /// HTTP method.
    pub method: String,
    /// Path without the query.
    pub path: String,
    /// Content type of the body.
    pub content_type: Option<String>,
    /// Body, when JSON.
    pub body: Option<Value>,
}

impl Call {
    /// Server-side apply.
    pub fn is_apply(&self) -> bool {
        self.content_type.as_deref() == Some("application/apply-patch+yaml")
    }
    /// Any write.
    pub fn is_write(&self) -> bool {
        self.method != "GET"
    }
}

#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    log: Vec<Call>,
    rv: u64,
}

/// The fake API server.
#[derive(Clone, Default)]
pub struct FakeApi {
    state: Arc<Mutex<State>>,
}

/// Collection paths.
pub mod paths {
    /// `CacheTier`s.
    pub const TIERS: &str = "/apis/serving.tandem.dev/v1alpha1/namespaces/default/cachetiers";
    /// `PrefillPool`s.
    pub const PREFILLS: &str = "/apis/serving.tandem.dev/v1alpha1/namespaces/default/prefillpools";
    /// `DecodePool`s.
    pub const DECODES: &str = "/apis/serving.tandem.dev/v1alpha1/namespaces/default/decodepools";
    /// StatefulSets.
    pub const STS: &str = "/apis/apps/v1/namespaces/default/statefulsets";
    /// Services.
    pub const SVC: &str = "/api/v1/namespaces/default/services";
    /// ConfigMaps.
    pub const CM: &str = "/api/v1/namespaces/default/configmaps";
    /// Pods.
    pub const PODS: &str = "/api/v1/namespaces/default/pods";
    /// Events.
    pub const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// A strategic-merge patch of a pod's status as the API server and kubelet treat it:
/// `conditions` merge by `type` (other fields merge as JSON), then `Ready` is recomputed the
/// kubelet's way — `ContainersReady` and every readiness gate's condition `True`.
fn strategic_status(pod: &mut Value, patch: &Value) {
    let mut rest = patch.clone();
    let conds = rest
        .as_object_mut()
        .and_then(|o| o.remove("conditions"))
        .and_then(|c| c.as_array().cloned())
        .unwrap_or_default();
    merge(&mut pod["status"], &rest);
    for c in conds {
        set_condition(pod, c);
    }
    kubelet_ready(pod);
}

/// Sets (replaces by `type`) one condition in a pod's status.
pub fn set_condition(pod: &mut Value, c: Value) {
    if !pod["status"]["conditions"].is_array() {
        pod["status"]["conditions"] = json!([]);
    }
    let list = pod["status"]["conditions"].as_array_mut().unwrap();
    match list.iter_mut().find(|x| x["type"] == c["type"]) {
        Some(x) => *x = c,
        None => list.push(c),
    }
}

/// The kubelet's `Ready`: `ContainersReady` True and every `spec.readinessGates` condition True.
pub fn kubelet_ready(pod: &mut Value) {
    let is_true = |pod: &Value, t: &str| {
        pod["status"]["conditions"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == t && c["status"] == "True"))
    };
    let gates: Vec<String> = pod["spec"]["readinessGates"]
        .as_array()
        .map(|g| {
            g.iter()
                .filter_map(|g| g["conditionType"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let ready = is_true(pod, "ContainersReady") && gates.iter().all(|g| is_true(pod, g));
    set_condition(
        pod,
        json!({"type": "Ready", "status": if ready { "True" } else { "False" }}),
    );
}

fn status(code: u16, reason: &str) -> (u16, Value) {
    (
        code,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
               "message": reason, "reason": reason, "code": code}),
    )
}

fn labels_match(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

impl FakeApi {
    /// Starts the server; returns it and a client talking to it.
    pub fn start() -> (Self, Client) {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let fake = FakeApi::default();
        let f = fake.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let (parts, body) = req.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let (code, v) = f.handle(&parts, &bytes);
                let resp = Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&v).unwrap()))
                    .unwrap();
                send.send_response(resp);
            }
        });
        (fake, Client::new(svc, "default"))
    }

    fn handle(&self, parts: &http::request::Parts, bytes: &[u8]) -> (u16, Value) {
        let path = parts.uri.path().to_owned();
        let query = parts.uri.query().unwrap_or("").to_owned();
        let content_type = parts
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body: Option<Value> = serde_json::from_slice(bytes).ok();
        let mut st = self.state.lock().unwrap();
        st.log.push(Call {
            method: parts.method.to_string(),
            path: path.clone(),
            content_type: content_type.clone(),
            body: body.clone(),
        });
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let Some(ns_i) = segs.iter().position(|s| *s == "namespaces") else {
            return status(404, "NotFound");
        };
        let rest = &segs[ns_i + 1..];
        let collection = format!("/{}", segs[..(ns_i + 3).min(segs.len())].join("/"));
        let name = rest.get(2).map(|s| s.to_string());
        let sub = rest.get(3).map(|s| s.to_string());
        st.rv += 1;
        let rv = st.rv.to_string();
        match (parts.method.as_str(), name) {
            ("GET", None) => {
                let selector = query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("labelSelector="))
                    .map(percent_decode)
                    .unwrap_or_default();
                let prefix = format!("{collection}/");
                let items: Vec<Value> = st
                    .objects
                    .iter()
                    .filter(|(k, _)| k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
                    .map(|(_, v)| v.clone())
                    .filter(|v| labels_match(v, &selector))
                    .collect();
                (
                    200,
                    json!({"apiVersion":"v1","kind":"List","metadata":{"resourceVersion": rv},"items": items}),
                )
            }
            ("GET", Some(n)) => match st.objects.get(&format!("{collection}/{n}")) {
                Some(v) => (200, v.clone()),
                None => status(404, "NotFound"),
            },
            ("POST", None) => {
                let mut v = body.unwrap_or(Value::Null);
                let n = v["metadata"]["name"]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("gen-{rv}"));
                v["metadata"]["name"] = json!(n);
                v["metadata"]["resourceVersion"] = json!(rv);
                st.objects.insert(format!("{collection}/{n}"), v.clone());
                (201, v)
            }
            ("DELETE", Some(n)) => match st.objects.remove(&format!("{collection}/{n}")) {
                Some(v) => (200, v),
                None => status(404, "NotFound"),
            },
            ("PATCH", Some(n)) => {
                let key = format!("{collection}/{n}");
                let patch = body.unwrap_or(Value::Null);
                if content_type.as_deref() == Some("application/apply-patch+yaml") {
                    if sub.as_deref() == Some("status") {
                        let Some(mut o) = st.objects.get(&key).cloned() else {
                            return status(404, "NotFound");
                        };
                        // The operator owns every status field: apply replaces the status.
                        o["status"] = patch["status"].clone();
                        o["metadata"]["resourceVersion"] = json!(rv);
                        st.objects.insert(key, o.clone());
                        return (200, o);
                    }
                    let obj = match st.objects.get(&key) {
                        Some(existing) => {
                            let mut o = existing.clone();
                            // Apply owns spec/data/metadata it sends: replace those wholesale.
                            for f in ["spec", "data"] {
                                if let Some(v) = patch.get(f) {
                                    o[f] = v.clone();
                                }
                            }
                            merge(&mut o["metadata"], &patch["metadata"]);
                            // As the API server does: a spec change moves the generation.
                            if o["spec"] != existing["spec"] {
                                let g = existing["metadata"]["generation"].as_i64().unwrap_or(1);
                                o["metadata"]["generation"] = json!(g + 1);
                            }
                            o
                        }
                        None => {
                            let mut o = patch.clone();
                            o["metadata"]["uid"] = json!(format!("uid-{n}"));
                            o["metadata"]["generation"] = json!(1);
                            o["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
                            o
                        }
                    };
                    let mut obj = obj;
                    obj["metadata"]["resourceVersion"] = json!(rv);
                    st.objects.insert(key, obj.clone());
                    return (200, obj);
                }
                let Some(existing) = st.objects.get(&key).cloned() else {
                    return status(404, "NotFound");
                };
                let mut o = existing.clone();
                match sub.as_deref() {
                    Some("scale") => {
                        o["spec"]["replicas"] = patch["spec"]["replicas"].clone();
                        o["metadata"]["resourceVersion"] = json!(rv);
                        st.objects.insert(key, o.clone());
                        return (
                            200,
                            json!({"apiVersion":"autoscaling/v1","kind":"Scale",
                            "metadata": {"name": n, "namespace": "default"},
                            "spec": {"replicas": o["spec"]["replicas"]}, "status": {"replicas": 0}}),
                        );
                    }
                    Some("status")
                        if content_type.as_deref()
                            == Some("application/strategic-merge-patch+json") =>
                    {
                        strategic_status(&mut o, &patch["status"]);
                    }
                    Some("status") => merge(&mut o["status"], &patch["status"]),
                    _ => {
                        if let Some(want) = patch["metadata"]["resourceVersion"].as_str()
                            && existing["metadata"]["resourceVersion"].as_str() != Some(want)
                        {
                            return status(409, "Conflict");
                        }
                        merge(&mut o, &patch);
                    }
                }
                o["metadata"]["resourceVersion"] = json!(rv);
                let gone = o["metadata"]["deletionTimestamp"].is_string()
                    && o["metadata"]["finalizers"]
                        .as_array()
                        .is_none_or(|f| f.is_empty());
                if gone {
                    st.objects.remove(&key);
                } else {
                    st.objects.insert(key, o.clone());
                }
                (200, o)
            }
            _ => status(405, "MethodNotAllowed"),
        }
    }

    /// Stores `obj` under `collection` (its `metadata.name`).
    pub fn insert(&self, collection: &str, mut obj: Value) {
        let mut st = self.state.lock().unwrap();
        st.rv += 1;
        let n = obj["metadata"]["name"].as_str().unwrap().to_owned();
        obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        if obj["metadata"]["uid"].is_null() {
            obj["metadata"]["uid"] = json!(format!("uid-{n}"));
        }
        if obj["metadata"]["generation"].is_null() {
            obj["metadata"]["generation"] = json!(1);
        }
        obj["metadata"]["namespace"] = json!("default");
        st.objects.insert(format!("{collection}/{n}"), obj);
    }

    /// The stored object.
    pub fn get(&self, collection: &str, name: &str) -> Option<Value> {
        self.state
            .lock()
            .unwrap()
            .objects
            .get(&format!("{collection}/{name}"))
            .cloned()
    }

    /// Edits a stored object in place.
    pub fn edit(&self, collection: &str, name: &str, f: impl FnOnce(&mut Value)) {
        let mut st = self.state.lock().unwrap();
        st.rv += 1;
        let rv = st.rv.to_string();
        let o = st
            .objects
            .get_mut(&format!("{collection}/{name}"))
            .expect("object to edit");
        f(o);
        o["metadata"]["resourceVersion"] = json!(rv);
    }

    /// Removes a stored object.
    pub fn remove(&self, collection: &str, name: &str) {
        self.state
            .lock()
            .unwrap()
            .objects
            .remove(&format!("{collection}/{name}"));
    }

    /// Names of the stored objects of a collection.
    pub fn names(&self, collection: &str) -> Vec<String> {
        let prefix = format!("{collection}/");
        self.state
            .lock()
            .unwrap()
            .objects
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix))
            .filter(|k| !k.contains('/'))
            .map(str::to_owned)
            .collect()
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().unwrap().log.clone()
    }

    /// Forgets the call log.
    pub fn clear_calls(&self) {
        self.state.lock().unwrap().log.clear();
    }

    /// The writes so far.
    pub fn writes(&self) -> Vec<Call> {
        self.calls().into_iter().filter(Call::is_write).collect()
    }

    /// The StatefulSet controller's sync of every StatefulSet, as far as the operator reads it:
    /// `status.observedGeneration` set to `metadata.generation` (a pod it recreates from now on
    /// comes from the latest template).
    pub fn observe_statefulsets(&self) {
        for n in self.names(paths::STS) {
            let Some(s) = self.get(paths::STS, &n) else {
                continue;
            };
            if s["status"]["observedGeneration"] != s["metadata"]["generation"] {
                self.edit(paths::STS, &n, |o| {
                    o["status"]["observedGeneration"] = o["metadata"]["generation"].clone();
                });
            }
        }
    }

    /// Creates the pods of every StatefulSet (as the StatefulSet controller and the scheduler
    /// and kubelet would), `ContainersReady` and scheduled, from the current template (its
    /// readiness gates included: `Ready` waits for their conditions); drops pods beyond
    /// `spec.replicas`. Existing pods keep their labels (OnDelete). Every StatefulSet's
    /// `status.observedGeneration` reaches its generation ([`Self::observe_statefulsets`]).
    pub fn materialize_pods(&self) {
        self.observe_statefulsets();
        let sets: Vec<Value> = self
            .names(paths::STS)
            .iter()
            .filter_map(|n| self.get(paths::STS, n))
            .collect();
        for s in sets {
            let name = s["metadata"]["name"].as_str().unwrap().to_owned();
            let replicas = s["spec"]["replicas"].as_i64().unwrap_or(1);
            for i in 0..replicas {
                let pod = format!("{name}-{i}");
                if self.get(paths::PODS, &pod).is_some() {
                    continue;
                }
                let labels = s["spec"]["template"]["metadata"]["labels"].clone();
                let mut obj = json!({"apiVersion":"v1","kind":"Pod",
                    "metadata":{"name": pod, "labels": labels},
                    "spec":{"nodeName":"node-1","containers":[{"name":"worker"}]},
                    "status":{"conditions":[
                        {"type":"PodScheduled","status":"True"},
                        {"type":"ContainersReady","status":"True"}]}});
                let gates = &s["spec"]["template"]["spec"]["readinessGates"];
                if gates.is_array() {
                    obj["spec"]["readinessGates"] = gates.clone();
                }
                kubelet_ready(&mut obj);
                self.insert(paths::PODS, obj);
            }
            for p in self.names(paths::PODS) {
                if let Some(i) = p
                    .strip_prefix(&format!("{name}-"))
                    .and_then(|i| i.parse::<i64>().ok())
                    && i >= replicas
                {
                    self.remove(paths::PODS, &p);
                }
            }
        }
    }
}
