//! The process runner's cluster emulation against a real control plane (worker/interfaces/README.md
//! §5).
//!
//! Brings up its own cluster (temp state dir, ports offset by 4100, no kwok), starts a runner with
//! one extra pod env variable from its config, then checks:
//!
//! 1. **Services**: a Service over two `python3 -m http.server` pods resolves, in the runner's hosts
//!    file, to both pod IPs once they are Ready (and each serves on its IP); a pod with
//!    `hostname`+`subdomain` resolves by its own name; after the pods are deleted the Service
//!    resolves to neither. Every pod has `TANDEM_HOSTS_FILE` and the config's extra env.
//! 2. **Volumes**: a PVC without a class gets the default `tandem-e2e-local`, is bound to a
//!    runner-provisioned volume; a pod writes a file into it, is deleted, and a second pod reads the
//!    file back; deleting the claim removes the volume and its directory.
//! 3. **Native sidecars**: an init container with `restartPolicy: Always` starts before the main
//!    container (each records its start time first thing), does not block the pod's
//!    initialization, and, on deletion, is sent SIGTERM only after the main container has exited (the main container takes 0.5 s to
//!    exit; a runner that stopped both at once fails the ordering assertion).
//!
//! Without cached control-plane binaries it prints why it is skipped and returns, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set: then it builds them and must pass.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Namespace, PersistentVolume, PersistentVolumeClaim, Pod, Service, ServiceAccount,
};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tandem_e2e::cluster::client_for;
use tandem_e2e::cluster::down::down;
use tandem_e2e::runner::hosts::resolve;
use tandem_e2e::runner::image::ImageTable;
use tandem_e2e::runner::node::NodeSpecification;
use tandem_e2e::runner::storage::STORAGE_CLASS;
use tandem_e2e::runner::{PodDefaults, ProcessRunner, RunnerConfig, volumes_dir};

const NS: &str = "e2e-svc";
const HTTP_IMAGE: &str = "example.org/e2e/py-http:1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_volumes_sidecars_and_pod_env() {
    let Some(support::PrivateCluster { cluster, tmp }) = support::start_cluster(
        "services_volumes_sidecars_and_pod_env",
        support::ClusterShape {
            port_offset: 4100,
            controller_manager: true,
            scheduler: true,
            kwok_nodes: 0,
            kwok_gpus_per_node: 0,
        },
    )
    .await
    else {
        return;
    };
    let started = Instant::now();
    let out_dir = tmp.path().join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    let outcome = async {
        let client = client_for(&cluster.kubeconfig)
            .await
            .map_err(|e| e.to_string())?;
        let runner_dir = cluster.config.runner_dir();
        let runner = ProcessRunner::start_with(
            client.clone(),
            RunnerConfig {
                nodes: vec![NodeSpecification {
                    name: "runner-0".into(),
                    gpus: 2,
                }],
                // Own 127.141.x addresses: other runners on this machine use 127.100.x.
                first_node_index: 41,
                dir: runner_dir.clone(),
                images: ImageTable::new().with(
                    "py-http",
                    vec!["python3".into(), "-m".into(), "http.server".into()],
                ),
                api_port: cluster.config.ports.api,
            },
            PodDefaults {
                env: vec![("E2E_OUT".into(), out_dir.display().to_string())],
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        let result = scenario(&client, &runner, &runner_dir, &out_dir).await;
        runner.shutdown(true).await;
        result
    }
    .await;
    println!("scenario took {:.1}s", started.elapsed().as_secs_f64());
    down(&cluster.config, false).await.expect("down");
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

async fn scenario(
    client: &Client,
    runner: &ProcessRunner,
    runner_dir: &Path,
    out_dir: &Path,
) -> Result<(), String> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .map_err(|e| format!("create namespace: {e}"))?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    poll(Duration::from_secs(30), || async {
        sas.get_opt("default").await.ok().flatten()
    })
    .await
    .ok_or("no default ServiceAccount in the test namespace")?;
    services(client, runner.hosts_file(), out_dir).await?;
    volumes(client, runner_dir).await?;
    sidecars(client, out_dir).await
}

async fn services(client: &Client, hosts: &Path, out_dir: &Path) -> Result<(), String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    services
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
            }))
            .unwrap(),
        )
        .await
        .map_err(|e| format!("create service: {e}"))?;
    let script = r#"env > "$E2E_OUT/env-$POD_NAME.txt"; exec python3 -m http.server 8080 --bind "$POD_IP" --directory "$TANDEM_ROOT""#;
    for name in ["web-0", "web-1"] {
        let mut spec = json!({
            "containers": [{
                "name": "web", "image": HTTP_IMAGE, "command": ["sh", "-c", script],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                ],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
            }]
        });
        if name == "web-0" {
            spec["hostname"] = json!("web-0");
            spec["subdomain"] = json!("web");
        }
        pods.create(&pp, &pod_json(name, json!({"app": "web"}), spec))
            .await
            .map_err(|e| format!("create {name}: {e}"))?;
    }
    let mut ips = Vec::new();
    for name in ["web-0", "web-1"] {
        let p = poll(Duration::from_secs(60), || async {
            let p = pods.get(name).await.ok()?;
            ready(&p).then_some(p)
        })
        .await
        .ok_or(format!("{name} not Ready"))?;
        ips.push(pod_ip(&p));
    }
    ips.sort();
    let fqdn = format!("web.{NS}.svc.cluster.local");
    let both = poll(Duration::from_secs(30), || async {
        let mut got = resolve(&read(hosts), &fqdn);
        got.sort();
        (got == ips).then_some(got)
    })
    .await;
    if both.is_none() {
        return Err(format!(
            "{fqdn} should resolve to {ips:?}; hosts file:\n{}",
            read(hosts)
        ));
    }
    let text = read(hosts);
    let mut short = resolve(&text, &format!("web.{NS}"));
    short.sort();
    if short != ips {
        return Err(format!("web.{NS} resolves to {short:?}"));
    }
    let web0 = pods.get("web-0").await.map_err(|e| e.to_string())?;
    let by_hostname = resolve(&text, &format!("web-0.web.{NS}.svc.cluster.local"));
    if by_hostname != [pod_ip(&web0)] {
        return Err(format!("web-0.web resolves to {by_hostname:?}:\n{text}"));
    }
    // Each address the name gives is served (client-side balancing has somewhere to go).
    for ip in &ips {
        let r = tandem_e2e::http_get::get(
            format!("{ip}:8080").parse().unwrap(),
            "/",
            &[],
            Duration::from_secs(5),
        )
        .await
        .map_err(|e| format!("GET {ip}:8080: {e}"))?;
        if r.status != 200 {
            return Err(format!("GET {ip}:8080 → {}", r.status));
        }
    }
    let env = read(&out_dir.join("env-web-1.txt"));
    let expect_hosts = format!("TANDEM_HOSTS_FILE={}", hosts.display());
    let expect_extra = format!("E2E_OUT={}", out_dir.display());
    for want in [&expect_hosts, &expect_extra] {
        if !env.lines().any(|l| l == want) {
            return Err(format!("pod env lacks {want:?}:\n{env}"));
        }
    }

    for name in ["web-0", "web-1"] {
        pods.delete(name, &DeleteParams::default())
            .await
            .map_err(|e| e.to_string())?;
    }
    poll(Duration::from_secs(30), || async {
        let text = read(hosts);
        (resolve(&text, &fqdn).is_empty()
            && resolve(&text, &format!("web-0.web.{NS}.svc.cluster.local")).is_empty())
        .then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "{fqdn} still resolves after the pods were deleted:\n{}",
            read(hosts)
        )
    })?;
    for name in ["web-0", "web-1"] {
        wait_gone(&pods, name).await?;
    }
    println!("services: {fqdn} → {ips:?}, then → nothing after deletion");
    Ok(())
}

async fn volumes(client: &Client, runner_dir: &Path) -> Result<(), String> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    claims
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": "1Mi"}}}
            }))
            .unwrap(),
        )
        .await
        .map_err(|e| format!("create claim: {e}"))?;
    let claim = poll(Duration::from_secs(60), || async {
        let c = claims.get("data").await.ok()?;
        (c.status.as_ref()?.phase.as_deref() == Some("Bound")).then_some(c)
    })
    .await
    .ok_or("claim not Bound within 60 s")?;
    let spec = claim.spec.clone().unwrap_or_default();
    if spec.storage_class_name.as_deref() != Some(STORAGE_CLASS) {
        return Err(format!(
            "claim class {:?}, want the default {STORAGE_CLASS}",
            spec.storage_class_name
        ));
    }
    let volume_name = spec.volume_name.unwrap_or_default();
    let pv = volumes.get(&volume_name).await.map_err(|e| e.to_string())?;
    let dir = PathBuf::from(
        pv.spec
            .and_then(|s| s.host_path)
            .map(|h| h.path)
            .unwrap_or_default(),
    );
    if dir.parent() != Some(volumes_dir(runner_dir).as_path()) {
        return Err(format!(
            "volume dir {} not under the runner dir",
            dir.display()
        ));
    }

    let volume = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    let mount = json!([{"name": "data", "mountPath": "/data"}]);
    pods.create(&pp, &pod_json("writer", json!({}), json!({
        "restartPolicy": "Never",
        "containers": [{"name": "c", "image": HTTP_IMAGE, "volumeMounts": mount,
            "command": ["sh", "-c", r#"echo "written by $HOSTNAME" > "$TANDEM_ROOT/data/file""#]}],
        "volumes": volume
    }))).await.map_err(|e| format!("create writer: {e}"))?;
    wait_phase(&pods, "writer", "Succeeded").await?;
    pods.delete("writer", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    wait_gone(&pods, "writer").await?;
    // The reader fails unless the file the deleted writer wrote is there.
    pods.create(&pp, &pod_json("reader", json!({}), json!({
        "restartPolicy": "Never",
        "containers": [{"name": "c", "image": HTTP_IMAGE, "volumeMounts": mount,
            "command": ["sh", "-c", r#"test "$(cat "$TANDEM_ROOT/data/file")" = "written by writer""#]}],
        "volumes": volume
    }))).await.map_err(|e| format!("create reader: {e}"))?;
    wait_phase(&pods, "reader", "Succeeded").await?;
    pods.delete("reader", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    wait_gone(&pods, "reader").await?;

    claims
        .delete("data", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    poll(Duration::from_secs(60), || async {
        matches!(volumes.get_opt(&volume_name).await, Ok(None)).then_some(())
    })
    .await
    .ok_or("the released volume was not reclaimed")?;
    if dir.exists() {
        return Err(format!("{} survives its volume", dir.display()));
    }
    println!("volumes: claim bound to {volume_name}; data survived the writer; reclaimed");
    Ok(())
}

async fn sidecars(client: &Client, out_dir: &Path) -> Result<(), String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let sidecar = r#"date +%s%N > "$E2E_OUT/sidecar.start"
trap 'date +%s%N > "$E2E_OUT/sidecar.term"; exit 0' TERM
while :; do sleep 0.05; done"#;
    let main = r#"date +%s%N > "$E2E_OUT/main.start"
trap 'sleep 0.5; date +%s%N > "$E2E_OUT/main.exit"; exit 0' TERM
while :; do sleep 0.05; done"#;
    pods.create(
        &PostParams::default(),
        &pod_json(
            "with-sidecar",
            json!({}),
            json!({
                "terminationGracePeriodSeconds": 10,
                "initContainers": [{"name": "store-client", "image": HTTP_IMAGE,
                    "restartPolicy": "Always", "command": ["sh", "-c", sidecar]}],
                "containers": [{"name": "main", "image": HTTP_IMAGE, "command": ["sh", "-c", main]}]
            }),
        ),
    )
    .await
    .map_err(|e| format!("create with-sidecar: {e}"))?;
    let p = poll(Duration::from_secs(60), || async {
        let p = pods.get("with-sidecar").await.ok()?;
        ready(&p).then_some(p)
    })
    .await
    .ok_or("with-sidecar not Ready: the sidecar must not block initialization")?;
    let status = p.status.unwrap_or_default();
    let sidecar_running = status
        .init_container_statuses
        .iter()
        .flatten()
        .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()));
    if !sidecar_running {
        return Err("the sidecar is not reported running".into());
    }
    pods.delete("with-sidecar", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    wait_gone(&pods, "with-sidecar").await?;
    let stamp = |f: &str| -> Result<u128, String> {
        read(&out_dir.join(f))
            .trim()
            .parse()
            .map_err(|e| format!("{f}: {e}"))
    };
    let (s_start, m_start) = (stamp("sidecar.start")?, stamp("main.start")?);
    let (m_exit, s_term) = (stamp("main.exit")?, stamp("sidecar.term")?);
    if s_start > m_start {
        return Err("the main container started before the sidecar".into());
    }
    if s_term < m_exit {
        return Err(format!(
            "the sidecar got SIGTERM {:.2}s before the main container exited",
            (m_exit - s_term) as f64 / 1e9
        ));
    }
    println!(
        "sidecars: started {:.2}s before main, stopped {:.2}s after it",
        (m_start - s_start) as f64 / 1e9,
        (s_term - m_exit) as f64 / 1e9
    );
    Ok(())
}

fn pod_json(name: &str, labels: serde_json::Value, spec: serde_json::Value) -> Pod {
    let mut spec = spec;
    spec["nodeSelector"] = json!({"tandem.dev/node-kind": "process"});
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec}))
        .unwrap()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn pod_ip(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

async fn wait_phase(pods: &Api<Pod>, name: &str, want: &str) -> Result<(), String> {
    let got = poll(Duration::from_secs(60), || async {
        let p = pods.get(name).await.ok()?;
        let phase = p.status.as_ref()?.phase.clone()?;
        matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
    })
    .await;
    match got {
        Some(p) if p == want => Ok(()),
        other => Err(format!("pod {name}: phase {other:?}, want {want}")),
    }
}

async fn wait_gone(pods: &Api<Pod>, name: &str) -> Result<(), String> {
    poll(Duration::from_secs(30), || async {
        matches!(pods.get_opt(name).await, Ok(None)).then_some(())
    })
    .await
    .ok_or_else(|| format!("pod {name} still exists 30 s after deletion"))
}

async fn poll<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
