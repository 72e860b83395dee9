//! Issue 13, operator side: a pool with `spec.engine` becomes, through the real chain — CRD
//! admission, the operator installed by `helm install` and running in the cluster, the
//! StatefulSet controller, the scheduler and the process runner — pods whose worker is a native
//! sidecar of the engine, sharing the engine-API socket directory.
//!
//! The pool's image is mapped (by the runner's image table) to a shell script that plays both
//! programs by their first argument, so that the check does not depend on the worker's engine API
//! (another branch): as the worker (`prefill …`) it records its spawn time, leaves a file in
//! `/run/tandem/engine`, serves `/healthz` on the health port one second later (recording when)
//! and `/readyz` only once (bounded wait) the engine's file is there; as the engine (`sim-engine …`) it records its spawn
//! time and argv, copies the config file it was pointed at, and answers the worker's file with its
//! own. Then:
//!
//! 1. A PrefillPool `{kind: Simulated}` with two pods per group becomes `Ready` (so the worker
//!    sidecar's readiness probe ran and counted); in each pod the worker was spawned before the
//!    engine, and the engine only after the worker's `/healthz` existed — its startup probe gates
//!    the engine, as the kubelet does for a native sidecar — (process start times from `/proc`,
//!    not the scripts' clocks), each side read the
//!    other's file in the shared directory, the engine's argv is the rendered one with
//!    `--ordinal` expanded to the pod's index (from the StatefulSet controller's
//!    `apps.kubernetes.io/pod-index` label), and the config it read names the engine seat.
//!
//!    Gang readiness (issue 17): a ready-only Service over that two-pod group lists both pods;
//!    when one rank's `/readyz` turns 404 (the test removes its file), neither pod is a ready
//!    endpoint while the other stays `ContainersReady` (the operator closed the
//!    `serving.tandem.dev/group-ready` gate on both), and both are back once it is ready again.
//! 2. A PrefillPool `{kind: vLLM, image: …}` whose args set `--kv-transfer-config`, or with two
//!    pods per group, is refused by the API server (the operator owns that flag; each pod would be
//!    its own engine); as written without it, it is admitted and rolled out: its StatefulSet's
//!    engine runs `vllm serve` with Tandem's PD connector (`kv_producer`: the pool has no
//!    CacheTier) in the KV transfer config and the user's args first. `kubectl get` shows both kinds in the `ENGINE`
//!    column.
//!
//! 3. Bounded group recovery (issue 17, `maxGroupRestarts`): a PrefillPool whose engine exits at
//!    once (`args: [--crash]`) with `maxGroupRestarts: 1` — the runner restarts the container in
//!    place as a kubelet does, the operator restarts the two-pod group whole once (event
//!    `GroupRestarted`, `status.groupRestarts`), and at the next failure halts it: the group's
//!    StatefulSet at 0 pods, no pod left, `Degraded=True, ReplicaRestartBudgetExceeded` and its
//!    event.
//!
//! Skips with a printed reason when the control-plane binaries are not built, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set. Needs the `tandem-operator` debug binary
//! (`cargo build -p tandem-operator`).

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::Value;
use support::{ClusterShape, PrivateCluster, poll, run_tool, start_cluster};
use tandem_e2e::cluster::client_for;
use tandem_e2e::cluster::down::down;
use tandem_e2e::runner::hosts::resolve;
use tandem_e2e::runner::image::ImageTable;
use tandem_e2e::runner::node::NodeSpecification;
use tandem_e2e::runner::{PodDefaults, ProcessRunner, RunnerConfig};

const NS: &str = "default";
const SIMULATED: &str = "engine-sim";
const VLLM: &str = "engine-vllm";
const CRASHING: &str = "engine-crash";
/// The readiness gate of multi-pod groups (operator/src/gang.rs).
const GATE: &str = "serving.tandem.dev/group-ready";
/// The image the pool names; the runner maps its last path component to [`SCRIPT`].
const SCRIPT_IMAGE: &str = "example.org/e2e/tandem-worker-sh:1";

/// Plays the worker (`$1` = `prefill`) or the engine (`$1` = `sim-engine`); see the module docs.
/// Every wait is bounded (20 s); a file the test reads is written last, by rename.
const SCRIPT: &str = r#"d="$TANDEM_ROOT/run/tandem/engine"
spawned=$(cut -d' ' -f22 /proc/$$/stat)
put() { printf '%s\n' "$2" > "$d/$1.tmp" && mv "$d/$1.tmp" "$d/$1"; }
await() { i=0; while [ ! -f "$d/$1" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 3; sleep 0.05; done; }
case "$1" in
prefill|decode)
  put worker.spawned "$spawned"
  put from-worker "$POD_NAME worker"
  www="$TANDEM_ROOT/www"; mkdir -p "$www"
  sleep 1
  put worker.healthy "$(sh -c 'cut -d" " -f22 /proc/$$/stat')"
  echo ok > "$www/healthz"
  (await from-engine; put worker-saw "$(cat "$d/from-engine")"; echo ok > "$www/readyz") &
  cd "$www" && exec python3 -m http.server 8080 --bind "$POD_IP" ;;
sim-engine)
  shift
  case " $* " in *" --crash "*) echo "crash requested" >&2; exit 1 ;; esac
  put engine.spawned "$spawned"
  put engine.argv "$(printf '%s\n' "$@")"
  cfg=""; prev=""
  for a in "$@"; do [ "$prev" = "--config" ] && cfg="$a"; prev="$a"; done
  cp "$TANDEM_ROOT$cfg" "$d/engine-config.tmp" && mv "$d/engine-config.tmp" "$d/engine-config.json"
  await from-worker
  put engine-saw "$(cat "$d/from-worker")"
  put from-engine "$POD_NAME engine"
  trap 'exit 0' TERM
  while :; do sleep 0.2; done ;;
*) echo "unexpected argv: $*" >&2; exit 2 ;;
esac"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_pool_runs_the_worker_as_the_engines_native_sidecar() {
    let Some(PrivateCluster { cluster, tmp: _tmp }) = start_cluster(
        "an_engine_pool_runs_the_worker_as_the_engines_native_sidecar",
        ClusterShape {
            port_offset: 4700,
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
    let runner_dir = cluster.config.runner_dir();
    let kubeconfig = cluster.kubeconfig.clone();
    let (kubectl, helm) = (cluster.bin_dir.kubectl(), cluster.bin_dir.helm());
    let outcome = async {
        let client = client_for(&kubeconfig).await.map_err(|e| e.to_string())?;
        let runner = ProcessRunner::start_with(
            client.clone(),
            RunnerConfig {
                nodes: vec![NodeSpecification {
                    name: "runner-0".into(),
                    gpus: 4,
                }],
                // Own 127.147.x addresses: other suites' runners use other indexes.
                first_node_index: 47,
                dir: runner_dir.clone(),
                images: ImageTable::tandem().with(
                    "tandem-worker-sh",
                    vec![
                        "sh".into(),
                        "-c".into(),
                        SCRIPT.into(),
                        "tandem-worker".into(),
                    ],
                ),
                api_port: cluster.config.ports.api,
            },
            PodDefaults::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
        let tools = Tools {
            kubectl: &kubectl,
            helm: &helm,
            kubeconfig: &kubeconfig,
        };
        let result = scenario(&client, &tools, &runner_dir).await;
        if result.is_err() {
            diagnostics(&tools, &runner_dir);
        }
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

struct Tools<'a> {
    kubectl: &'a Path,
    helm: &'a Path,
    kubeconfig: &'a Path,
}

impl Tools<'_> {
    fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        run_tool(self.kubectl, self.kubeconfig, args)
    }

    fn helm(&self, args: &[&str]) -> Result<String, String> {
        run_tool(self.helm, self.kubeconfig, args)
    }

    fn apply(&self, yaml: &str) -> Result<String, String> {
        let file = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
        std::fs::write(file.path(), yaml).map_err(|e| e.to_string())?;
        self.kubectl(&["apply", "-f", &file.path().display().to_string()])
    }
}

/// A PrefillPool of the sample model, one group of two pods (TP 2), no tier, with `engine`.
fn pool_yaml(name: &str, engine: &str) -> String {
    pool_yaml_tp(name, engine, 2)
}

/// [`pool_yaml`] with `tensor` pods per group (an SGLang or vLLM group is one pod: TP 1).
fn pool_yaml_tp(name: &str, engine: &str, tensor: u32) -> String {
    format!(
        "apiVersion: serving.tandem.dev/v1alpha1
kind: PrefillPool
metadata:
  name: {name}
  namespace: {NS}
spec:
  model: {{name: llama-3-70b, layers: 80, attention: GQA, kvHeads: 8, headDim: 128, dtype: BF16}}
  replicas: 1
  parallelism: {{tensor: {tensor}, context: 1}}
  hostPool: {{size: 1Gi}}
  snapshotBuffer: {{size: 64Mi}}
  image: {SCRIPT_IMAGE}
  resources: {{requests: {{cpu: 10m, memory: 64Mi}}}}
  engine: {engine}
"
    )
}

async fn scenario(client: &Client, t: &Tools<'_>, runner_dir: &Path) -> Result<(), String> {
    let t0 = Instant::now();
    t.helm(&[
        "install",
        "tandem",
        "charts/tandem",
        "-n",
        "tandem-system",
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
    ])?;
    println!("[{:>5.1}s] operator installed", t0.elapsed().as_secs_f64());

    // 1. Simulated: Ready, with the worker sidecar first and one shared directory.
    t.apply(&pool_yaml(SIMULATED, "{kind: Simulated}"))?;
    poll(Duration::from_secs(180), || async {
        let s = t
            .kubectl(&[
                "get",
                "prefillpool",
                SIMULATED,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ])
            .ok()?;
        (s.trim() == "True").then_some(())
    })
    .await
    .ok_or("the Simulated engine pool did not become Ready within 180 s")?;
    println!("[{:>5.1}s] {SIMULATED} Ready", t0.elapsed().as_secs_f64());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let list = pods
        .list(&ListParams::default().labels(&format!("serving.tandem.dev/pool={SIMULATED}")))
        .await
        .map_err(|e| e.to_string())?;
    if list.items.len() != 2 {
        return Err(format!("expected 2 pods, got {}", list.items.len()));
    }
    for p in &list.items {
        check_pod(p, runner_dir)?;
    }
    gang(client, t, &list.items, runner_dir).await?;
    println!(
        "[{:>5.1}s] {SIMULATED}: one rank unready took both out of the endpoints, then both back",
        t0.elapsed().as_secs_f64()
    );

    // 2. vLLM: a flag the operator owns, and a group of two pods (two independent engines), are
    //    refused by the API server (CEL); the pool as written is admitted and rolls out as `vllm
    //    serve` with Tandem's PD connector (no CacheTier; issue 14).
    for (engine, tensor, why) in [
        (
            "{kind: vLLM, image: vllm/vllm-openai:v0.33.0, args: [m, --kv-transfer-config, '{}']}",
            1,
            "engine.args of kind vLLM must not set",
        ),
        (
            "{kind: vLLM, image: vllm/vllm-openai:v0.33.0, args: [m]}",
            2,
            "engine.kind SGLang and vLLM run one engine per pod",
        ),
    ] {
        match t.apply(&pool_yaml_tp(VLLM, engine, tensor)) {
            Err(e) if e.contains(why) => {}
            other => {
                return Err(format!(
                    "a vLLM pool ({engine}, TP {tensor}) was not refused at admission with \"{why}\": {other:?}"
                ));
            }
        }
    }
    t.apply(&pool_yaml_tp(
        VLLM,
        "{kind: vLLM, image: vllm/vllm-openai:v0.33.0, args: [meta-llama/Llama-3.1-8B-Instruct]}",
        1,
    ))?;
    let sets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    let engine = poll(Duration::from_secs(60), || async {
        let list = sets
            .list(&ListParams::default().labels(&format!("serving.tandem.dev/pool={VLLM}")))
            .await
            .ok()?;
        let sts = list.items.into_iter().next()?;
        let spec = sts.spec.template.spec?;
        spec.containers.into_iter().find(|c| c.name == "engine")
    })
    .await
    .ok_or("the vLLM pool got no StatefulSet with an engine container within 60 s")?;
    let args = engine.args.unwrap_or_default();
    let transfer = args
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .and_then(|i| args.get(i + 1))
        .and_then(|j| serde_json::from_str::<Value>(j).ok())
        .ok_or_else(|| format!("no --kv-transfer-config JSON in {args:?}"))?;
    // No CacheTier: vLLM prefill/decode through Tandem, this PrefillPool's engine the producer.
    let extra = &transfer["kv_connector_extra_config"];
    if engine.command.as_deref() != Some(&["vllm".to_owned(), "serve".to_owned()][..])
        || transfer["kv_connector"] != "TandemConnector"
        || transfer["kv_connector_module_path"] != "tandem_kv.vllm_pd"
        || transfer["kv_role"] != "kv_producer"
        || extra["socket_dir"] != "/run/tandem/engine"
        || args.first().map(String::as_str) != Some("meta-llama/Llama-3.1-8B-Instruct")
    {
        return Err(format!(
            "the vLLM engine container is not the rendered one: {:?} {args:?}",
            engine.command
        ));
    }
    let table = t.kubectl(&["get", "prefillpools"])?;
    let engine_column = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(name))
            .is_some_and(|l| {
                l.contains(if name == SIMULATED {
                    "Simulated"
                } else {
                    "vLLM"
                })
            })
    };
    if !table.contains("ENGINE") || !engine_column(SIMULATED) || !engine_column(VLLM) {
        return Err(format!(
            "kubectl get shows no ENGINE column with both kinds:\n{table}"
        ));
    }
    println!(
        "[{:>5.1}s] {VLLM}: an owned flag refused at admission; rendered as vllm serve with Tandem's PD connector",
        t0.elapsed().as_secs_f64()
    );
    // Its pods cannot start here (no vLLM image on the runner): free their GPUs for step 3.
    t.kubectl(&[
        "delete",
        "prefillpool",
        VLLM,
        "--wait=true",
        "--timeout=60s",
    ])?;

    // 3. A crash-looping group: restarted whole once, then halted with its GPUs released.
    t.apply(
        &pool_yaml(CRASHING, "{kind: Simulated, args: [--crash]}")
            .replace("  replicas: 1\n", "  replicas: 1\n  maxGroupRestarts: 1\n"),
    )?;
    let jsonpath = |path: &str| {
        t.kubectl(&[
            "get",
            "prefillpool",
            CRASHING,
            "-o",
            &format!("jsonpath={path}"),
        ])
        .map(|s| s.trim().to_owned())
    };
    poll(Duration::from_secs(180), || async {
        let r = jsonpath("{.status.conditions[?(@.type==\"Degraded\")].reason}").ok()?;
        (r == "ReplicaRestartBudgetExceeded").then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "the crash-looping pool was not halted within 180 s (groupRestarts {:?})",
            jsonpath("{.status.groupRestarts}")
        )
    })?;
    let restarts = jsonpath("{.status.groupRestarts[0].restarts}")?;
    let halted = jsonpath("{.status.groupRestarts[0].halted}")?;
    if restarts != "1" || halted != "true" {
        return Err(format!(
            "status.groupRestarts[0]: restarts {restarts}, halted {halted}; want 1 whole-group restart, then halted"
        ));
    }
    for reason in ["GroupRestarted", "ReplicaRestartBudgetExceeded"] {
        let events = t.kubectl(&[
            "get",
            "events",
            "--field-selector",
            &format!("reason={reason},involvedObject.name={CRASHING}"),
            "-o",
            "name",
        ])?;
        if events.trim().is_empty() {
            return Err(format!("no {reason} event on the crash-looping pool"));
        }
    }
    let sts = format!("{CRASHING}-g0");
    poll(Duration::from_secs(60), || async {
        let set = sets.get_opt(&sts).await.ok()??;
        let left = pods
            .list(&ListParams::default().labels(&format!("serving.tandem.dev/pool={CRASHING}")))
            .await
            .ok()?
            .items
            .len();
        (set.spec.replicas == Some(0) && left == 0).then_some(())
    })
    .await
    .ok_or("the halted group's StatefulSet did not settle at 0 replicas with no pod left")?;
    println!(
        "[{:>5.1}s] {CRASHING}: one whole-group restart, then halted (ReplicaRestartBudgetExceeded, 0 pods)",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The condition `type_` of pod `name` now: `(status, reason)`, empty strings when absent.
async fn pod_condition(pods: &Api<Pod>, name: &str, type_: &str) -> Option<(String, String)> {
    let p = pods.get(name).await.ok()?;
    let c = p
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status, c.reason.unwrap_or_default()))
}

/// The ready endpoints of Service `service` as the runner publishes them: the addresses its
/// hosts file (`<runner dir>/hosts`, the runner's Service emulation, which computes endpoints from
/// pod `Ready` with the endpoint-slice controller's rule) gives the Service's name, sorted.
fn ready_endpoints(runner_dir: &Path, service: &str) -> Vec<String> {
    let text = std::fs::read_to_string(runner_dir.join("hosts")).unwrap_or_default();
    let mut ips = resolve(&text, &format!("{service}.{NS}.svc.cluster.local"));
    ips.sort();
    ips
}

/// Issue 17, gang readiness: a ready-only Service over the two-pod group lists both pods; when one
/// rank's worker turns unready (its `/readyz` file removed, so its probe fails), the operator
/// closes the `serving.tandem.dev/group-ready` gate on both and **neither** pod is a ready
/// endpoint — the other rank stays `ContainersReady` throughout, so only the gate holds it out —
/// and once the rank is ready again both are back.
async fn gang(
    client: &Client,
    t: &Tools<'_>,
    group: &[Pod],
    runner_dir: &Path,
) -> Result<(), String> {
    let service = format!("{SIMULATED}-gang");
    t.apply(&format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {service}, namespace: {NS}}}
spec:
  selector: {{serving.tandem.dev/pool: {SIMULATED}}}
  ports: [{{name: health, port: 8080}}]
"
    ))?;
    let mut group: Vec<&Pod> = group.iter().collect();
    group.sort_by_key(|p| p.metadata.name.clone());
    let names: Vec<String> = group
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    let mut ips: Vec<String> = group
        .iter()
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect();
    ips.sort();
    if ips.len() != 2 {
        return Err(format!("pod IPs {ips:?}: want two"));
    }
    let endpoints = || ready_endpoints(runner_dir, &service);
    poll(Duration::from_secs(60), || async {
        (endpoints() == ips).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "{service}: ready endpoints {:?}, want both ranks {ips:?}",
            endpoints()
        )
    })?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for n in &names {
        let gate = pod_condition(&pods, n, GATE).await;
        if gate.as_ref().map(|g| g.0.as_str()) != Some("True") {
            return Err(format!("{n}: group-ready gate {gate:?}, want True"));
        }
    }
    // Rank 1's worker turns unready: its /readyz file goes, so its readiness probe fails.
    let uid = group[1].metadata.uid.clone().unwrap_or_default();
    let readyz = runner_dir
        .join("pods")
        .join(format!("{NS}_{}_{uid}", names[1]))
        .join("containers/worker/root/www/readyz");
    std::fs::remove_file(&readyz).map_err(|e| format!("{}: {e}", readyz.display()))?;
    let held = poll(Duration::from_secs(60), || async {
        let rank0 = pod_condition(&pods, &names[0], "ContainersReady").await?;
        let gate0 = pod_condition(&pods, &names[0], GATE).await?;
        let closed = gate0 == ("False".into(), "GroupMemberNotReady".into());
        (endpoints().is_empty() && rank0.0 == "True" && closed).then_some(())
    })
    .await;
    if held.is_none() {
        return Err(format!(
            "with {} unready: {service} ready endpoints {:?}, {} ContainersReady {:?}, gate {:?}; \
             want none, True, False/GroupMemberNotReady",
            names[1],
            endpoints(),
            names[0],
            pod_condition(&pods, &names[0], "ContainersReady").await,
            pod_condition(&pods, &names[0], GATE).await,
        ));
    }
    // Rank 1 is ready again: both are back.
    std::fs::write(&readyz, "ok\n").map_err(|e| format!("{}: {e}", readyz.display()))?;
    poll(Duration::from_secs(60), || async {
        (endpoints() == ips).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "{service}: ready endpoints {:?} after rank 1 recovered, want {ips:?}",
            endpoints()
        )
    })?;
    t.kubectl(&["delete", "service", &service])?;
    Ok(())
}

/// One pod of the Simulated pool: order, shared directory, argv, config.
fn check_pod(p: &Pod, runner_dir: &Path) -> Result<(), String> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let uid = p.metadata.uid.clone().unwrap_or_default();
    let spec = p.spec.clone().unwrap_or_default();
    let inits: Vec<&str> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    let mains: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    if inits != ["worker"] || mains != ["engine"] {
        return Err(format!("{name}: init {inits:?}, containers {mains:?}"));
    }
    let dir = socket_dir(runner_dir, &name, &uid);
    let read = |f: &str| -> Result<String, String> {
        std::fs::read_to_string(dir.join(f))
            .map(|s| s.trim().to_owned())
            .map_err(|e| format!("{name}: {}: {e}", dir.join(f).display()))
    };
    let ticks = |f: &str| -> Result<u64, String> {
        read(f)?.parse().map_err(|e| format!("{name}: {f}: {e}"))
    };
    let (w, e) = (ticks("worker.spawned")?, ticks("engine.spawned")?);
    if w >= e {
        return Err(format!(
            "{name}: the engine was spawned at tick {e}, not after the worker sidecar ({w})"
        ));
    }
    // The worker's startup probe (`/healthz`) gates the engine: the worker serves it only 1 s
    // after its start, and the engine must not be spawned before.
    let healthy = ticks("worker.healthy")?;
    if e < healthy {
        return Err(format!(
            "{name}: the engine was spawned at tick {e}, before the worker's startup probe could \
             pass (its /healthz exists from tick {healthy})"
        ));
    }
    if read("engine-saw")? != format!("{name} worker")
        || read("worker-saw")? != format!("{name} engine")
    {
        return Err(format!(
            "{name}: the containers do not share /run/tandem/engine"
        ));
    }
    let ordinal = name.rsplit('-').next().unwrap_or_default().to_owned();
    let argv: Vec<String> = read("engine.argv")?.lines().map(str::to_owned).collect();
    let want: Vec<String> = [
        "--serve",
        "--socket-dir",
        "/run/tandem/engine",
        "--config",
        "/etc/tandem/worker.json",
        "--ordinal",
        &ordinal,
    ]
    .map(str::to_owned)
    .to_vec();
    if argv != want {
        return Err(format!(
            "{name}: engine argv after sim-engine: {argv:?}, want {want:?}"
        ));
    }
    let cfg: Value = serde_json::from_str(&read("engine-config.json")?)
        .map_err(|e| format!("{name}: engine-config.json: {e}"))?;
    if cfg["engine"] != serde_json::json!({"kind": "Simulated", "socketDir": "/run/tandem/engine"})
    {
        return Err(format!(
            "{name}: the config names no engine seat: {}",
            cfg["engine"]
        ));
    }
    println!(
        "{name}: worker spawned {} ticks before the engine, healthy {} ticks before; ordinal \
         {ordinal}; one directory",
        e - w,
        e - healthy
    );
    Ok(())
}

/// The runner's directory of the pod's `engine-socket` volume.
fn socket_dir(runner_dir: &Path, name: &str, uid: &str) -> PathBuf {
    runner_dir
        .join("pods")
        .join(format!("{NS}_{name}_{uid}"))
        .join("volumes")
        .join("engine-socket")
}

fn diagnostics(t: &Tools<'_>, runner_dir: &Path) {
    for args in [
        &["get", "tandem,statefulsets,pods", "-A", "-o", "wide"][..],
        &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
        &["get", "prefillpools", "-o", "yaml"][..],
    ] {
        println!("--- kubectl {}", args.join(" "));
        println!("{}", t.kubectl(args).unwrap_or_else(|e| e));
    }
    let pods = runner_dir.join("pods");
    for pod in std::fs::read_dir(&pods).into_iter().flatten().flatten() {
        for log in std::fs::read_dir(pod.path().join("logs"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            println!("--- {}", log.path().display());
            for l in tail.iter().rev() {
                println!("{l}");
            }
        }
    }
}
