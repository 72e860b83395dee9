//! Service emulation: a hosts file written from Services, pods and EndpointSlices
//! (worker/interfaces/README.md §5).
//!
//! There is no kube-proxy and no cluster DNS: a ClusterIP goes nowhere. Instead the runner keeps
//! one file in hosts(5) format, `<runner dir>/hosts`, and gives every pod its path in
//! `TANDEM_HOSTS_FILE` ([`HOSTS_FILE_ENV`]); Tandem's workers resolve peer names through it
//! (re-read on every lookup) and balance on the client side. Lines:
//!
//! * `<ip> <svc>.<ns>.svc.cluster.local <svc>.<ns>.svc <svc>.<ns>` for every **ready** endpoint of
//!   every Service.
//! * `<ip> <hostname>.<subdomain>.<ns>.svc.cluster.local …` for every pod that sets both
//!   `spec.hostname` and `spec.subdomain` (StatefulSet pods do), has an IP, is not terminating and
//!   has not finished. This is more permissive than cluster DNS, which answers such a name only
//!   while the pod is an endpoint of the headless Service `<subdomain>`: here a starting pod is
//!   already reachable by name, so group peers can find each other before they are ready.
//!
//! Endpoints of a Service with a selector are computed here from the pods, with the
//! endpoint-slice controller's rule (k8s.io/kubernetes `pkg/controller/endpointslice`, `podToEndpoint`):
//! a pod of the Service's namespace whose labels match the selector, with an IP, not `Succeeded` or
//! `Failed`, is a **ready** endpoint when `publishNotReadyAddresses` is set, or when it is Ready and
//! not terminating. The controller itself cannot publish them: the API server refuses EndpointSlice
//! addresses in the loopback range (`ValidateNonSpecialIP`), and runner pods live in 127/8.
//! EndpointSlices that do exist (selector-less Services, kwok pods) are honoured too: their ready
//! endpoints (no `ready` condition counts as ready, as the API documents) are added.
//!
//! The rendering is pure ([`render_hosts`], sorted, so an unchanged cluster gives a byte-identical
//! file); [`HostsWriter`] replaces the file atomically (write a temporary file, rename) and only
//! when its content changes. [`maintain_hosts_file`] is the runner task that feeds it from three
//! watches, coalescing bursts of events for [`COALESCE`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};
use tokio::sync::watch;

/// The environment variable naming the hosts file, set in every pod.
pub const HOSTS_FILE_ENV: &str = "TANDEM_HOSTS_FILE";
/// The cluster domain of the emulated names.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// The EndpointSlice label naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// How long events are collected before the file is rewritten.
pub const COALESCE: Duration = Duration::from_millis(100);

/// One line of the hosts file: an address and its names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    namespace: String,
    name: String,
    ip: String,
}

/// The hosts-file text for these Services, pods and EndpointSlices (see the module docs for the
/// rules).
///
/// Lines are sorted by (namespace, name, address) and duplicates (an address given by a selector and
/// a slice, or by two slices) are dropped. Output ends with a newline unless empty.
pub fn render_hosts(services: &[Service], pods: &[Pod], slices: &[EndpointSlice]) -> String {
    let mut endpoints = BTreeSet::new();
    for svc in services {
        let Some(spec) = &svc.spec else { continue };
        let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
            continue;
        };
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let namespace = svc.metadata.namespace.clone().unwrap_or_default();
        let publish_not_ready = spec.publish_not_ready_addresses == Some(true);
        for pod in pods {
            if pod.metadata.namespace.as_deref() != Some(namespace.as_str()) {
                continue;
            }
            let labels = pod.metadata.labels.as_ref();
            if !selector
                .iter()
                .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
            {
                continue;
            }
            let Some(ip) = live_ip(pod) else { continue };
            let terminating = pod.metadata.deletion_timestamp.is_some();
            if publish_not_ready || (pod_ready(pod) && !terminating) {
                endpoints.insert(Entry {
                    namespace: namespace.clone(),
                    name: svc.metadata.name.clone().unwrap_or_default(),
                    ip,
                });
            }
        }
    }
    for slice in slices {
        let Some(service) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        else {
            continue;
        };
        let namespace = slice.metadata.namespace.clone().unwrap_or_default();
        for ep in slice.endpoints.iter().flatten() {
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if !ready {
                continue;
            }
            for ip in &ep.addresses {
                endpoints.insert(Entry {
                    namespace: namespace.clone(),
                    name: service.clone(),
                    ip: ip.clone(),
                });
            }
        }
    }
    let mut hostnames = BTreeSet::new();
    for pod in pods {
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(spec) = &pod.spec else { continue };
        let (Some(hostname), Some(subdomain)) = (&spec.hostname, &spec.subdomain) else {
            continue;
        };
        if hostname.is_empty() || subdomain.is_empty() {
            continue;
        }
        let Some(ip) = live_ip(pod) else { continue };
        hostnames.insert(Entry {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: format!("{hostname}.{subdomain}"),
            ip,
        });
    }
    let mut out = String::new();
    for e in endpoints.iter().chain(hostnames.iter()) {
        let short = format!("{}.{}", e.name, e.namespace);
        out.push_str(&format!(
            "{} {short}.svc.{CLUSTER_DOMAIN} {short}.svc {short}\n",
            e.ip
        ));
    }
    out
}

/// The pod's IP while it has one and has not finished.
fn live_ip(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    status.pod_ip.clone().filter(|ip| !ip.is_empty())
}

/// The pod's `Ready` condition is `True`.
fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The addresses a hosts-file text gives `name` (exact match of any name on a line), in file
/// order — the lookup a worker does (worker/interfaces/README.md §2).
pub fn resolve(hosts: &str, name: &str) -> Vec<String> {
    hosts
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| {
            let mut fields = l.split_whitespace();
            let ip = fields.next()?;
            fields.any(|n| n == name).then(|| ip.to_owned())
        })
        .collect()
}

/// Writes the hosts file atomically, skipping writes that would not change it.
#[derive(Debug)]
pub struct HostsWriter {
    path: PathBuf,
    last: Option<String>,
}

impl HostsWriter {
    /// A writer for `path` (nothing is written yet).
    pub fn new(path: PathBuf) -> Self {
        Self { path, last: None }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file with `text` (write `<path>.tmp`, then rename over `path`: readers see the
    /// old or the new file, never a partial one). Returns whether it wrote.
    pub fn write(&mut self, text: &str) -> std::io::Result<bool> {
        if self.last.as_deref() == Some(text) {
            return Ok(false);
        }
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.path)?;
        self.last = Some(text.to_owned());
        Ok(true)
    }
}

/// The runner task: watches Services, Pods and EndpointSlices in all namespaces and keeps the
/// hosts file in step until `shutdown` turns true. Watch errors are logged and retried with
/// back-off.
pub async fn maintain_hosts_file(
    client: Client,
    mut writer: HostsWriter,
    mut shutdown: watch::Receiver<bool>,
) {
    let (services, service_writer) = reflector::store::<Service>();
    let (pods, pod_writer) = reflector::store::<Pod>();
    let (slices, slice_writer) = reflector::store::<EndpointSlice>();
    let all = watcher::Config::default;
    let service_events = reflector(
        service_writer,
        watcher(Api::<Service>::all(client.clone()), all()),
    )
    .default_backoff()
    .map(|e| e.map(|_| ()).map_err(|e| format!("service watch: {e}")));
    let pod_events = reflector(pod_writer, watcher(Api::<Pod>::all(client.clone()), all()))
        .default_backoff()
        .map(|e| e.map(|_| ()).map_err(|e| format!("pod watch: {e}")));
    let slice_events = reflector(
        slice_writer,
        watcher(Api::<EndpointSlice>::all(client), all()),
    )
    .default_backoff()
    .map(|e| {
        e.map(|_| ())
            .map_err(|e| format!("endpointslice watch: {e}"))
    });
    let events = futures::stream::select(
        futures::stream::select(service_events, pod_events),
        slice_events,
    );
    futures::pin_mut!(events);
    let mut due: Option<tokio::time::Instant> = None;
    loop {
        let deadline = due;
        tokio::select! {
            _ = shutdown.changed() => return,
            ev = events.next() => match ev {
                Some(Ok(())) => {
                    due.get_or_insert_with(|| tokio::time::Instant::now() + COALESCE);
                }
                Some(Err(e)) => tracing::warn!("hosts file: {e}"),
                None => return,
            },
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                due = None;
                let text = render_hosts(&owned(services.state()), &owned(pods.state()), &owned(slices.state()));
                if let Err(e) = writer.write(&text) {
                    tracing::warn!(path = %writer.path().display(), "hosts file: {e}");
                }
            }
        }
    }
}

fn owned<K: Clone>(v: Vec<std::sync::Arc<K>>) -> Vec<K> {
    v.into_iter().map(|a| (*a).clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(ns: &str, svc: &str, endpoints: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{svc}-abc"), "namespace": ns,
                         "labels": {SERVICE_NAME_LABEL: svc}},
            "addressType": "IPv4",
            "endpoints": endpoints,
        }))
        .unwrap()
    }

    fn pod(name: &str, hostname: Option<&str>, ip: Option<&str>, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": "web"}},
            "spec": {"containers": [], "hostname": hostname, "subdomain": "peers"},
            "status": {"phase": phase, "podIP": ip},
        }))
        .unwrap()
    }

    fn ready(mut p: Pod, ready: bool) -> Pod {
        let status = if ready { "True" } else { "False" };
        p.status.as_mut().unwrap().conditions = Some(vec![
            serde_json::from_value(json!({"type": "Ready", "status": status})).unwrap(),
        ]);
        p
    }

    fn terminating(mut p: Pod) -> Pod {
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::UNIX_EPOCH,
        ));
        p
    }

    fn service(name: &str, selector: serde_json::Value, publish_not_ready: bool) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"selector": selector, "publishNotReadyAddresses": publish_not_ready},
        }))
        .unwrap()
    }

    #[test]
    fn a_selector_service_resolves_to_its_ready_pods_only() {
        let pods = [
            ready(pod("a", None, Some("127.100.0.3"), "Running"), true),
            ready(pod("b", None, Some("127.100.0.2"), "Running"), true),
            ready(pod("unready", None, Some("127.100.0.4"), "Running"), false),
            terminating(ready(
                pod("going", None, Some("127.100.0.5"), "Running"),
                true,
            )),
            ready(pod("done", None, Some("127.100.0.6"), "Succeeded"), true),
            ready(pod("no-ip", None, None, "Pending"), true),
        ];
        let mut elsewhere = ready(pod("other-ns", None, Some("127.100.0.7"), "Running"), true);
        elsewhere.metadata.namespace = Some("other".into());
        let mut all = pods.to_vec();
        all.push(elsewhere);
        let services = [
            service("web", json!({"app": "web"}), false),
            service("nobody", json!({"app": "nothing"}), false),
            service("selectorless", json!({}), false),
        ];
        let text = render_hosts(&services, &all, &[]);
        assert_eq!(
            text,
            "127.100.0.2 web.ns.svc.cluster.local web.ns.svc web.ns\n\
             127.100.0.3 web.ns.svc.cluster.local web.ns.svc web.ns\n"
        );
        assert_eq!(
            resolve(&text, "web.ns.svc.cluster.local"),
            ["127.100.0.2", "127.100.0.3"]
        );
        assert_eq!(resolve(&text, "web.ns"), ["127.100.0.2", "127.100.0.3"]);
        assert!(
            resolve(&text, "web").is_empty(),
            "no search-domain guessing"
        );
        assert!(resolve(&text, "nobody.ns").is_empty());

        // publishNotReadyAddresses: unready and terminating pods are endpoints too (not finished ones).
        let peers = [service("web", json!({"app": "web"}), true)];
        let text = render_hosts(&peers, &pods, &[]);
        assert_eq!(
            resolve(&text, "web.ns"),
            ["127.100.0.2", "127.100.0.3", "127.100.0.4", "127.100.0.5"]
        );
    }

    #[test]
    fn ready_endpoints_of_existing_slices_count_and_duplicates_go() {
        let slices = [
            slice(
                "ns",
                "manual",
                json!([
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": true}},
                    {"addresses": ["10.0.0.2"]},
                    {"addresses": ["10.0.0.4"], "conditions": {"ready": false, "terminating": true}},
                ]),
            ),
            slice("ns", "manual", json!([{"addresses": ["10.0.0.2"]}])),
            slice("other", "manual", json!([{"addresses": ["10.0.1.2"]}])),
        ];
        let text = render_hosts(&[], &[], &slices);
        assert_eq!(
            text,
            "10.0.0.2 manual.ns.svc.cluster.local manual.ns.svc manual.ns\n\
             10.0.0.3 manual.ns.svc.cluster.local manual.ns.svc manual.ns\n\
             10.0.1.2 manual.other.svc.cluster.local manual.other.svc manual.other\n"
        );
        let mut unlabelled = slices[0].clone();
        unlabelled.metadata.labels = None;
        assert_eq!(render_hosts(&[], &[], &[unlabelled]), "");
    }

    #[test]
    fn pods_with_hostname_and_subdomain_get_a_name_until_they_end() {
        let pods = [
            pod("g0-0", Some("g0-0"), Some("127.100.0.5"), "Pending"),
            pod("g0-1", Some("g0-1"), None, "Pending"),
            pod("x", None, Some("127.100.0.6"), "Running"),
            pod("g0-3", Some("g0-3"), Some("127.100.0.7"), "Succeeded"),
            terminating(pod("g0-2", Some("g0-2"), Some("127.100.0.9"), "Running")),
        ];
        let text = render_hosts(&[], &pods, &[]);
        assert_eq!(
            text,
            "127.100.0.5 g0-0.peers.ns.svc.cluster.local g0-0.peers.ns.svc g0-0.peers.ns\n"
        );
    }

    #[test]
    fn writer_replaces_atomically_and_skips_unchanged_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        let mut w = HostsWriter::new(path.clone());
        assert!(w.write("a\n").unwrap());
        assert!(!w.write("a\n").unwrap());
        assert!(w.write("").unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
        assert!(!dir.path().join("hosts.tmp").exists());
    }
}
