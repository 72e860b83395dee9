//! The control plane and the process runner against real binaries (issue 4).
//!
//! Brings up its own cluster (state in a temp dir, ports offset by 1000 so a `tandem-e2e cluster`
//! of the user keeps running), then checks in order: API readiness through kubectl, a Deployment
//! scheduled onto kwok nodes, a process-runner pod served by a real `python3 -m http.server` on its
//! own 127.x address with ConfigMap/Secret/downward env and volumes, the projected service-account
//! token authenticating under RBAC, readiness from the probe (with an unready negative control), and
//! deletion by SIGTERM or — for a process that ignores it — SIGKILL after the grace period.
//! Finally `down` must leave none of the recorded processes alive.
//!
//! Without cached control-plane binaries the test prints why it is skipped and returns, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set: then it builds them (tens of minutes cold) and must pass.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tandem_e2e::cluster::client_for;
use tandem_e2e::cluster::down::down;
use tandem_e2e::cluster::up::RunningCluster;
use tandem_e2e::pidfile::{Liveness, ProcessId};
use tandem_e2e::runner::image::ImageTable;
use tandem_e2e::runner::node::NodeSpecification;
use tandem_e2e::runner::{ProcessRunner, RunnerConfig};

const NS: &str = "e2e";
const HTTP_IMAGE: &str = "example.org/e2e/py-http:1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_and_process_runner() {
    let Some(support::PrivateCluster { cluster, tmp: _tmp }) = support::start_cluster(
        "control_plane_and_process_runner",
        support::ClusterShape {
            port_offset: 1000,
            controller_manager: true,
            scheduler: true,
            kwok_nodes: 2,
            kwok_gpus_per_node: 8,
        },
    )
    .await
    else {
        return;
    };
    println!("cluster ready in {:.1}s", cluster.startup.as_secs_f64());
    let recorded = recorded_pids(&cluster.config.state_dir.join("pids"));
    assert_eq!(
        recorded.len(),
        5,
        "etcd, apiserver, KCM, scheduler, kwok: {recorded:?}"
    );

    let outcome = scenario(&cluster).await;
    let stopped = down(&cluster.config, false).await.expect("down");
    assert!(stopped.len() >= 5);
    for (name, id) in &recorded {
        assert_eq!(
            id.state(),
            Liveness::Gone,
            "{name} (pid {}) still runs after down",
            id.pid
        );
    }
    assert!(
        !cluster.config.state_dir.exists(),
        "down removes the state dir"
    );
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

async fn scenario(cluster: &RunningCluster) -> Result<(), String> {
    kubectl_works(cluster)?;
    let client = client_for(&cluster.kubeconfig)
        .await
        .map_err(|e| e.to_string())?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .map_err(|e| format!("create namespace: {e}"))?;
    // ServiceAccount admission rejects pods until KCM created the namespace's `default` SA.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    poll(Duration::from_secs(30), || async {
        sas.get_opt("default").await.ok().flatten()
    })
    .await
    .ok_or("no default ServiceAccount in the test namespace")?;
    deployment_on_kwok(&client).await?;

    let runner_dir = cluster.config.runner_dir();
    let images = ImageTable::new().with(
        "py-http",
        vec!["python3".into(), "-m".into(), "http.server".into()],
    );
    let runner = ProcessRunner::start(
        client.clone(),
        RunnerConfig {
            nodes: vec![NodeSpecification {
                name: "runner-0".into(),
                gpus: 4,
            }],
            // Own 127.140.x addresses: `tandem-e2e demo` / `runner` on this machine use 127.100.x.
            first_node_index: 40,
            dir: runner_dir.clone(),
            images,
            api_port: cluster.config.ports.api,
        },
    )
    .await
    .map_err(|e| e.to_string())?;
    let result = runner_pods(&client, &runner_dir).await;
    runner.shutdown(true).await;
    result
}

fn kubectl_works(cluster: &RunningCluster) -> Result<(), String> {
    let kubectl = cluster.bin_dir.kubectl();
    let run = |args: &[&str]| -> Result<String, String> {
        let out = std::process::Command::new(&kubectl)
            .args(args)
            .env("KUBECONFIG", &cluster.kubeconfig)
            .output()
            .map_err(|e| format!("{}: {e}", kubectl.display()))?;
        if !out.status.success() {
            return Err(format!(
                "kubectl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let readyz = run(&["get", "--raw", "/readyz"])?;
    if readyz.trim() != "ok" {
        return Err(format!("/readyz said {readyz:?}"));
    }
    let ns = run(&["get", "ns", "-o", "name"])?;
    if !ns.contains("namespace/default") || !ns.contains("namespace/kube-system") {
        return Err(format!("kubectl get ns: {ns}"));
    }
    let version = run(&["version", "-o", "json"])?;
    if !version.contains("\"gitVersion\": \"v1.37") {
        return Err(format!("unexpected versions: {version}"));
    }
    Ok(())
}

/// A GPU Deployment tolerating the kwok taint: KCM makes pods, the scheduler binds them to kwok
/// nodes, kwok marks them Running.
async fn deployment_on_kwok(client: &Client) -> Result<(), String> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "sim"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "sim"}},
            "template": {
                "metadata": {"labels": {"app": "sim"}},
                "spec": {
                    "nodeSelector": {"tandem.dev/node-kind": "kwok"},
                    "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{"name": "c", "image": "tandem-worker",
                                    "resources": {"limits": {"nvidia.com/gpu": "2"}}}]
                }
            }
        }
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &d)
        .await
        .map_err(|e| format!("create deployment: {e}"))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let running = poll(Duration::from_secs(90), || async {
        let list = pods
            .list(&ListParams::default().labels("app=sim"))
            .await
            .ok()?;
        let running: Vec<Pod> = list
            .items
            .into_iter()
            .filter(|p| phase(p) == "Running")
            .collect();
        (running.len() == 3).then_some(running)
    })
    .await
    .ok_or("3 kwok pods Running")?;
    for p in &running {
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        if !node.starts_with("kwok-node-") {
            return Err(format!("pod on {node}, want a kwok node"));
        }
    }
    Ok(())
}

async fn runner_pods(client: &Client, runner_dir: &Path) -> Result<(), String> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    cms.create(
        &pp,
        &serde_json::from_value(json!({
            "metadata": {"name": "site"}, "data": {"index.html": "hello from a configmap"}
        }))
        .unwrap(),
    )
    .await
    .map_err(|e| format!("configmap: {e}"))?;
    secrets
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}
            }))
            .unwrap(),
        )
        .await
        .map_err(|e| format!("secret: {e}"))?;

    // 1. A served pod: configmap volume, env from every source, readiness from its probe.
    let script = r#"env > "$TANDEM_ROOT/../env.txt"; exec python3 -m http.server 8080 --bind "$POD_IP" --directory "$TANDEM_ROOT/srv""#;
    pods.create(&pp, &pod_json("web", json!({
        "containers": [{
            "name": "web", "image": HTTP_IMAGE,
            "command": ["sh", "-c", script],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "SECRET_TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                {"name": "GREETING", "value": "at $(POD_IP)"}
            ],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/index.html", "port": "http"}, "periodSeconds": 1},
            "volumeMounts": [{"name": "site", "mountPath": "/srv"}]
        }],
        "volumes": [{"name": "site", "configMap": {"name": "site"}}]
    }))).await.map_err(|e| format!("create web: {e}"))?;
    // 2. Negative control: the probe targets a port nothing listens on → never Ready.
    pods.create(&pp, &pod_json("unready", json!({
        "containers": [{"name": "c", "image": HTTP_IMAGE, "args": ["8081", "--bind", "$(POD_IP)"],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "readinessProbe": {"httpGet": {"path": "/", "port": 9}, "periodSeconds": 1}}]
    }))).await.map_err(|e| format!("create unready: {e}"))?;
    // 3. A process that ignores SIGTERM: deletion must wait the grace period, then SIGKILL.
    pods.create(
        &pp,
        &pod_json(
            "stubborn",
            json!({
                "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "c", "image": HTTP_IMAGE,
                    "command": ["sh", "-c", "trap '' TERM; while :; do sleep 0.2; done"]}]
            }),
        ),
    )
    .await
    .map_err(|e| format!("create stubborn: {e}"))?;

    let web = poll(Duration::from_secs(60), || async {
        let p = pods.get("web").await.ok()?;
        ready(&p).then_some(p)
    })
    .await;
    let Some(web) = web else {
        let status = pods.get("web").await.ok().and_then(|p| p.status);
        return Err(format!("web not Ready: {status:?}"));
    };
    let status = web.status.clone().unwrap_or_default();
    let ip = status.pod_ip.clone().unwrap_or_default();
    if !ip.starts_with("127.140.") || status.phase.as_deref() != Some("Running") {
        return Err(format!("web: phase {:?} ip {ip}", status.phase));
    }
    if web.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some("runner-0") {
        return Err("web was not scheduled onto the runner node".into());
    }
    let body = tandem_e2e::http_get::get(
        format!("{ip}:8080").parse().unwrap(),
        "/index.html",
        &[],
        Duration::from_secs(5),
    )
    .await
    .map_err(|e| e.to_string())?;
    if body.body != "hello from a configmap" {
        return Err(format!("served {:?}", body.body));
    }

    let uid = web.metadata.uid.clone().unwrap_or_default();
    let container_dir = runner_dir
        .join("pods")
        .join(format!("{NS}_web_{uid}"))
        .join("containers/web");
    let env = read_env(&container_dir.join("env.txt"))?;
    let expect = [
        ("POD_NAME", "web".to_string()),
        ("POD_NAMESPACE", NS.to_string()),
        ("POD_IP", ip.clone()),
        ("SECRET_TOKEN", "s3cret".to_string()),
        ("GREETING", format!("at {ip}")),
        ("KUBERNETES_SERVICE_HOST", "127.0.0.1".to_string()),
    ];
    for (k, v) in expect {
        if env.get(k) != Some(&v) {
            return Err(format!("env {k} = {:?}, want {v:?}", env.get(k)));
        }
    }
    service_account_token_under_rbac(client, &env).await?;

    // Readiness negative control: Running, but not Ready, after its probe has failed three times
    // (the runner logs each attempt in the container's probe.log; waiting on those lines, not on a
    // fixed sleep, proves the probe ran).
    let unready = pods.get("unready").await.map_err(|e| e.to_string())?;
    let probe_log = runner_dir
        .join("pods")
        .join(format!(
            "{NS}_unready_{}",
            unready.metadata.uid.clone().unwrap_or_default()
        ))
        .join("containers/c/probe.log");
    let failed = poll(Duration::from_secs(30), || async {
        let log = std::fs::read_to_string(&probe_log).ok()?;
        let fails = log.lines().filter(|l| l.starts_with("fail")).count();
        (fails >= 3).then_some(log)
    })
    .await;
    let Some(log) = failed else {
        return Err(format!(
            "unready: fewer than 3 failed probes in 30 s in {}",
            probe_log.display()
        ));
    };
    if log.lines().any(|l| l.ends_with("ready=true")) {
        return Err(format!("unready: a probe left it ready:\n{log}"));
    }
    let unready = pods.get("unready").await.map_err(|e| e.to_string())?;
    if phase(&unready) != "Running" || ready(&unready) {
        return Err(format!(
            "unready: phase {} ready {}",
            phase(&unready),
            ready(&unready)
        ));
    }

    // Graceful deletion: SIGTERM ends python at once.
    let web_pid = container_pid(&web).ok_or("web has no container pid")?;
    let t = Instant::now();
    pods.delete("web", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    wait_gone(&pods, "web").await?;
    let took = t.elapsed();
    if ProcessId::of_pid(web_pid).is_some_and(|id| id.state() == Liveness::Running) {
        return Err("web's process survived deletion".into());
    }
    println!("web deleted in {:.1}s (SIGTERM)", took.as_secs_f64());

    // Forced path: TERM ignored → KILL after the 2 s grace.
    let stubborn = pods.get("stubborn").await.map_err(|e| e.to_string())?;
    let pid = container_pid(&stubborn).ok_or("stubborn has no container pid")?;
    let t = Instant::now();
    pods.delete("stubborn", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    wait_gone(&pods, "stubborn").await?;
    let took = t.elapsed();
    if took < Duration::from_secs(2) {
        return Err(format!(
            "stubborn gone after {took:?}: the grace period was not honoured"
        ));
    }
    if ProcessId::of_pid(pid).is_some_and(|id| id.state() == Liveness::Running) {
        return Err("stubborn's process survived SIGKILL".into());
    }
    println!(
        "stubborn deleted in {:.1}s (SIGKILL after grace)",
        took.as_secs_f64()
    );
    pods.delete("unready", &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    wait_gone(&pods, "unready").await?;
    Ok(())
}

/// The projected token authenticates as the pod's ServiceAccount and RBAC applies to it: denied
/// before a RoleBinding exists, allowed after.
async fn service_account_token_under_rbac(
    admin: &Client,
    env: &BTreeMap<String, String>,
) -> Result<(), String> {
    let kubeconfig = env
        .get("KUBECONFIG")
        .ok_or("no KUBECONFIG in the pod env")?;
    let sa = PathBuf::from(
        env.get("TANDEM_SERVICEACCOUNT_DIR")
            .ok_or("no TANDEM_SERVICEACCOUNT_DIR")?,
    );
    let token = std::fs::read_to_string(sa.join("token")).map_err(|e| format!("token: {e}"))?;
    if token.split('.').count() != 3
        || std::fs::read_to_string(sa.join("namespace"))
            .ok()
            .as_deref()
            != Some(NS)
    {
        return Err("projected token/namespace files are wrong".into());
    }
    let as_pod = client_for(Path::new(kubeconfig))
        .await
        .map_err(|e| e.to_string())?;
    let pods: Api<Pod> = Api::namespaced(as_pod, NS);
    match pods.list(&ListParams::default()).await {
        Err(kube::Error::Api(s))
            if s.code == 403 && s.message.contains("system:serviceaccount:e2e:default") => {}
        other => return Err(format!("expected 403 for the default SA, got {other:?}")),
    }
    let roles: Api<Role> = Api::namespaced(admin.clone(), NS);
    let bindings: Api<RoleBinding> = Api::namespaced(admin.clone(), NS);
    let pp = PostParams::default();
    roles
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
            }))
            .unwrap(),
        )
        .await
        .map_err(|e| e.to_string())?;
    bindings.create(&pp, &serde_json::from_value(json!({
        "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": NS}]
    })).unwrap()).await.map_err(|e| e.to_string())?;
    poll(Duration::from_secs(10), || async {
        pods.list(&ListParams::default()).await.ok()
    })
    .await
    .map(|_| ())
    .ok_or_else(|| "the RoleBinding did not grant list pods".to_string())
}

fn pod_json(name: &str, spec: serde_json::Value) -> Pod {
    let mut spec = spec;
    spec["nodeSelector"] = json!({"tandem.dev/node-kind": "process"});
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn container_pid(p: &Pod) -> Option<i32> {
    let cs = p.status.as_ref()?.container_statuses.as_ref()?;
    cs.first()?
        .container_id
        .as_deref()?
        .strip_prefix("process://")?
        .parse()
        .ok()
}

fn read_env(path: &Path) -> Result<BTreeMap<String, String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
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
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn recorded_pids(dir: &Path) -> Vec<(String, ProcessId)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if let Ok(id) = ProcessId::read(&e.path()) {
            out.push((e.file_name().to_string_lossy().into_owned(), id));
        }
    }
    out
}
