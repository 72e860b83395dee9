//! Where requests go: a fixed list of front-door URLs, or the Ready decode pods of a DecodePool
//! found through the API server and refreshed while the replay runs (pods come and go during a
//! scale-up or a rolling restart).
//!
//! There is no kube-proxy in the e2e cluster (the process runner gives each pod its own 127.x
//! address), so the client balances over pod IPs itself, as a headless-Service client would.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

/// Label keys the operator puts on every pod it renders (`tandem_crds::labels`).
pub use tandem_crds::labels::{
    GROUP as GROUP_LABEL, POOL as POOL_LABEL, REVISION as REVISION_LABEL, ROLE as ROLE_LABEL,
};
/// The decode front door's container port (`tandem_crds::ports`).
pub use tandem_crds::ports::FRONT_DOOR_PORT;

/// A shared, replaceable list of base URLs (`http://ip:port`).
#[derive(Debug, Clone, Default)]
pub struct TargetSet {
    urls: Arc<RwLock<Vec<String>>>,
}

impl TargetSet {
    /// A set holding `urls` (trailing `/` removed).
    pub fn fixed(urls: Vec<String>) -> Self {
        let s = Self::default();
        s.replace(urls);
        s
    }

    /// Replaces the list (a poisoned lock is recovered: the list is plain data).
    pub fn replace(&self, urls: Vec<String>) {
        let urls = urls
            .into_iter()
            .map(|u| u.trim_end_matches('/').to_owned())
            .collect();
        *self.urls.write().unwrap_or_else(|e| e.into_inner()) = urls;
    }

    /// The current list.
    pub fn snapshot(&self) -> Vec<String> {
        self.urls.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Target number `n` modulo the current size (`None` when the set is empty): request `i`'s
    /// attempt `k` takes `pick(i + k)`, so a retry lands on another target when there is one.
    pub fn pick(&self, n: usize) -> Option<String> {
        let urls = self.urls.read().unwrap_or_else(|e| e.into_inner());
        (!urls.is_empty()).then(|| urls[n % urls.len()].clone())
    }
}

/// A pod that serves: phase Running, `Ready` condition `True`, an IP, not being deleted.
pub fn pod_serving(pod: &Pod) -> bool {
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let status = pod.status.as_ref();
    let running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let ip = status.and_then(|s| s.pod_ip.as_deref()).is_some();
    !deleting && running && ready && ip
}

/// `http://<podIP>:<port>` of every serving pod, sorted (a stable order for [`TargetSet::pick`]).
pub fn serving_urls(pods: &[Pod], port: u16) -> Vec<String> {
    let mut urls: Vec<String> = pods
        .iter()
        .filter(|p| pod_serving(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .map(|ip| format!("http://{ip}:{port}"))
        .collect();
    urls.sort();
    urls
}

/// Label selector of a DecodePool's decode pods.
pub fn decode_selector(pool: &str) -> String {
    format!(
        "{POOL_LABEL}={pool},{ROLE_LABEL}={}",
        tandem_crds::labels::ROLE_DECODE
    )
}

/// The front doors of DecodePool `pool` in `namespace`, right now.
pub async fn discover_front_doors(
    client: &kube::Client,
    namespace: &str,
    pool: &str,
) -> Result<Vec<String>, kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = api
        .list(&ListParams::default().labels(&decode_selector(pool)))
        .await?;
    Ok(serving_urls(&pods.items, FRONT_DOOR_PORT))
}

/// Refreshes `set` from the API server every `interval` until the task is aborted. A failed list
/// keeps the previous targets (a restarting API server must not empty the set).
pub fn spawn_discovery(
    client: kube::Client,
    namespace: String,
    pool: String,
    set: TargetSet,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match discover_front_doors(&client, &namespace, &pool).await {
                Ok(urls) => set.replace(urls),
                Err(e) => {
                    tracing::warn!(error = %e, "front-door discovery failed; keeping targets")
                }
            }
            tokio::time::sleep(interval).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ip: &str, phase: &str, ready: &str, deleting: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": format!("p-{ip}"),
                "deletionTimestamp": if deleting { Some("2026-01-01T00:00:00Z") } else { None },
            },
            "status": {
                "phase": phase,
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": ready}],
            }
        }))
        .unwrap()
    }

    #[test]
    fn only_ready_running_undeleted_pods_serve() {
        let pods = [
            pod("127.100.0.3", "Running", "True", false),
            pod("127.100.0.2", "Running", "True", false),
            pod("127.100.0.4", "Running", "False", false),
            pod("127.100.0.5", "Pending", "True", false),
            pod("127.100.0.6", "Running", "True", true),
        ];
        assert_eq!(
            serving_urls(&pods, 8000),
            vec!["http://127.100.0.2:8000", "http://127.100.0.3:8000"]
        );
    }

    #[test]
    fn pick_rotates_and_handles_empty() {
        let s = TargetSet::fixed(vec!["http://a/".into(), "http://b".into()]);
        assert_eq!(s.pick(0).as_deref(), Some("http://a"));
        assert_eq!(s.pick(3).as_deref(), Some("http://b"));
        s.replace(vec![]);
        assert_eq!(s.pick(0), None);
        assert_eq!(
            decode_selector("d"),
            "serving.tandem.dev/pool=d,serving.tandem.dev/role=decode"
        );
    }
}
