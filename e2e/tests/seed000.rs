//! Seed 000 end to end on the real cluster (issue 13): a speculative DecodePool over a Standalone
//! CacheTier, through the real chain — CRD admission, the operator installed by `helm install` and
//! running in the cluster, the StatefulSet controller, the scheduler and the process runner —
//! with every container a real process: the `store-client` native sidecar owning the
//! shared-memory segments, the `tandem-worker` decode sidecar, and the simulated engine.
//!
//! 1. **The fix.** CacheTier (`Standalone`, `SharedMemory`, `FailClosed`) + PrefillPool +
//!    DecodePool with `speculative` (a draft model, so a draft KV pool) and `engine: {kind:
//!    Simulated}`, paired 1:1. The DecodePool becomes `Ready` with `Degraded=False`; the decode
//!    worker's `/report` lists the target and draft pools in `SharedMemory`, registration
//!    `committed`, its `/metrics` the same (`tandem_engine_pool_registered{pool="draft",
//!    state="committed"} 1`); the pod's store-client sidecar's `/report` holds exactly one
//!    segment and two registrations (it refuses any range outside its own segments), and the
//!    worker process maps that sidecar's memfd (`/proc/<pid>/maps`: `/memfd:tandem-sc-<sidecar
//!    pid>-…`) — the draft pool lives inside the sidecar's segment.
//! 2. **The negative control** (the bug of seed 000: the draft pool carved from plain mmap). The
//!    DecodePool is deleted and a second one paired with the same PrefillPool is created; the
//!    runner gives every pod `TANDEM_NC_DRAFT_POOL_ON_MMAP=<that pool>`, which a worker built with
//!    the `negative-controls` feature honours for that pool only. Its worker fails closed before
//!    any registration: the pod stays Running and not Ready without a restart, `/readyz` and
//!    `/report` carry the typed refusal (`PoolDomainMismatch` on `pools.draft`), `/metrics`
//!    `tandem_engine_pool_refusals_total{pool="draft",reason="PoolDomainMismatch"} 1`; the
//!    DecodePool says `Degraded=True, WorkerDegraded` with that reason and a `WorkerDegraded`
//!    Warning event, and never `Ready`; the sidecar received no `Register` request at all, holds
//!    no registration and no segment (the reservation went with the worker's connection). After
//!    the pool is deleted, none of its pod's processes is left.
//!
//! Builds the worker with `-p tandem-worker --features negative-controls` (and the operator) into
//! this target dir first. Skips with a printed reason when the control-plane binaries are not
//! built, unless `TANDEM_E2E_REQUIRE_CLUSTER` is set.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;
use support::{Harness, HarnessConfig, install, poll, ready, run_suite, wait_condition};
use tandem_crds::labels::{POOL, ROLE, ROLE_DECODE};
use tandem_e2e::pidfile::{Liveness, ProcessId};
use tandem_e2e::report::sampler::HEALTH_PORT;

const TIER: &str = "s0-l3";
const PREFILL: &str = "s0-prefill";
const DECODE: &str = "s0-decode";
/// The DecodePool of the negative control: the one pool whose workers get the draft on mmap.
const DECODE_NC: &str = "s0-decode-mmap";
/// The worker's negative-control switch (`worker/src/engine_api/pools.rs`, feature
/// `negative-controls`): its value names the pool whose draft pool goes onto plain mmap.
const NC_ENV: &str = "TANDEM_NC_DRAFT_POOL_ON_MMAP";

const MODEL: &str = r#"
    name: llama-3-70b
    layers: 80
    attention: GQA
    kvHeads: 8
    headDim: 128
    dtype: BF16"#;

fn tier_yaml() -> String {
    format!(
        r#"apiVersion: serving.tandem.dev/v1alpha1
kind: CacheTier
metadata: {{name: {TIER}, namespace: default}}
spec:
  clientMode: Standalone
  allocator: SharedMemory
  pageTokens: 512
  model:{MODEL}
  replicas: 1
  memory: 256Mi
  registrationFailurePolicy: FailClosed
  writePolicy: WriteThrough
---
apiVersion: serving.tandem.dev/v1alpha1
kind: PrefillPool
metadata: {{name: {PREFILL}, namespace: default}}
spec:
  model:{MODEL}
  parallelism: {{tensor: 1, context: 1}}
  cacheTierRef: {{name: {TIER}}}
  hostPool: {{size: 1Gi}}
  engine: {{kind: Simulated}}
"#
    )
}

fn decode_yaml(name: &str) -> String {
    format!(
        r#"apiVersion: serving.tandem.dev/v1alpha1
kind: DecodePool
metadata: {{name: {name}, namespace: default}}
spec:
  model:{MODEL}
  replicas: 1
  parallelism: {{tensor: 1, context: 1}}
  cacheTierRef: {{name: {TIER}}}
  hostPool: {{size: 1Gi}}
  speculative:
    draftModel:
      name: llama-3-8b
      layers: 32
      attention: GQA
      kvHeads: 8
      headDim: 128
      dtype: BF16
    draftTokens: 4
  engine: {{kind: Simulated}}
  prefill:
    poolRef: {{name: {PREFILL}}}
    ratio: "1:1"
  budget: {{gpus: 4}}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_pool_in_the_sidecar_segment_and_on_mmap_fails_closed() {
    // The worker honours the control's switch only when built with the feature.
    let worker = tandem_e2e::demo::stack::negative_controls_worker()
        .await
        .unwrap_or_else(|e| panic!("a tandem-worker with negative controls: {e}"));
    run_suite(
        HarnessConfig {
            name: "seed000",
            port_offset: 6600,
            runner_gpus: 4,
            first_node_index: 60,
            worker_bin: Some(worker),
            pod_env: &[(NC_ENV, DECODE_NC)],
        },
        scenario,
    )
    .await;
}

async fn scenario(h: &Harness) -> Result<(), String> {
    let t0 = Instant::now();
    let say = |what: &str| println!("[{:>5.1}s] {what}", t0.elapsed().as_secs_f64());
    install(h).await?;
    say("operator installed and Ready");
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let apply = |name: &str, yaml: String| -> Result<(), String> {
        let path = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, yaml).map_err(|e| e.to_string())?;
        h.kubectl(&["apply", "-f", &path.to_string_lossy()])
            .map(drop)
    };

    // 1. The fix: the draft pool inside the sidecar's segment, registered, the pool Ready.
    apply("stack", tier_yaml())?;
    apply("decode", decode_yaml(DECODE))?;
    wait_condition(h, "cachetier", TIER, "Ready", "True", 240).await?;
    wait_condition(h, "decodepool", DECODE, "Ready", "True", 300).await?;
    condition_is(h, DECODE, "Degraded", "False", "AsExpected")?;
    let pod = decode_pod(h, DECODE).await?;
    let ip = pod_ip(&pod)?;
    let report = get_json(&format!("http://{ip}:{HEALTH_PORT}/report")).await?;
    let pools = report["engine"]["pools"]
        .as_array()
        .ok_or_else(|| format!("no engine.pools in the decode /report: {report}"))?;
    for want in ["target", "draft"] {
        let p = pools
            .iter()
            .find(|p| p["pool"] == want)
            .ok_or_else(|| format!("no {want} pool in the decode /report: {pools:?}"))?;
        if p["domain"] != "SharedMemory"
            || p["registration"] != "committed"
            || p["bytes"].as_u64().unwrap_or(0) == 0
        {
            return Err(format!("{want} pool not committed in SharedMemory: {p}"));
        }
    }
    if report["engine"]["attached"] != true || !degraded(&report).is_empty() {
        return Err(format!("decode engine not attached or degraded: {report}"));
    }
    let metrics = get_text(&format!("http://{ip}:{HEALTH_PORT}/metrics")).await?;
    for line in [
        r#"tandem_engine_pool_registered{pool="draft",state="committed"} 1"#,
        r#"tandem_engine_pool_registered{pool="target",state="committed"} 1"#,
    ] {
        if !metrics.lines().any(|l| l == line) {
            return Err(format!("the decode /metrics lacks `{line}`"));
        }
    }
    if !metrics
        .lines()
        .any(|l| l.starts_with(r#"tandem_engine_pool_bytes{pool="draft",domain="SharedMemory"}"#))
    {
        return Err("the decode /metrics has no draft pool bytes in SharedMemory".into());
    }
    let sidecar = sidecar_stats(&ip).await?;
    let counts = (
        sidecar["segments"].as_u64(),
        sidecar["registrations"].as_u64(),
        sidecar["connections_open"].as_u64(),
    );
    if counts != (Some(1), Some(2), Some(1)) {
        return Err(format!(
            "the sidecar must hold 1 segment and 2 registrations (target, draft) for 1 worker: \
             {sidecar}"
        ));
    }
    let procs = pod_processes(h, &pod)?;
    let worker = procs
        .iter()
        .find(|(c, _)| c == "worker")
        .map(|(_, p)| *p)
        .ok_or_else(|| format!("no worker process recorded: {procs:?}"))?;
    let sc = procs
        .iter()
        .find(|(c, _)| c == "store-client")
        .map(|(_, p)| *p)
        .ok_or_else(|| format!("no store-client process recorded: {procs:?}"))?;
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", worker.pid))
        .map_err(|e| format!("/proc/{}/maps: {e}", worker.pid))?;
    let memfd = format!("/memfd:tandem-sc-{}-", sc.pid);
    if !maps.lines().any(|l| l.contains(&memfd)) {
        return Err(format!(
            "the decode worker (pid {}) maps no segment of its sidecar (pid {}, {memfd}…)",
            worker.pid, sc.pid
        ));
    }
    say(&format!(
        "fix: {DECODE} Ready; target + draft committed in SharedMemory; sidecar {sidecar}; the \
         worker maps {memfd}…"
    ));

    // 2. The negative control: the same pool with the draft forced onto plain mmap.
    h.kubectl(&[
        "delete",
        "decodepool",
        DECODE,
        "--wait=true",
        "--timeout=120s",
    ])?;
    poll(Duration::from_secs(120), || async {
        let pods = h.pods(&format!("{POOL}={DECODE}")).await.ok()?;
        pods.is_empty().then_some(())
    })
    .await
    .ok_or("the first DecodePool's pods did not go")?;
    apply("decode-nc", decode_yaml(DECODE_NC))?;
    wait_condition(h, "decodepool", DECODE_NC, "Degraded", "True", 240)
        .await
        .map_err(|e| {
            format!(
                "{e} (is the worker built with `negative-controls`? Without it the switch \
                 {NC_ENV} is ignored)"
            )
        })?;
    condition_is(h, DECODE_NC, "Degraded", "True", "WorkerDegraded")?;
    let message = condition_field(h, DECODE_NC, "Degraded", "message")?;
    if !message.contains("PoolDomainMismatch") || !message.contains("draft") {
        return Err(format!(
            "Degraded must name the typed refusal and the pool: {message:?}"
        ));
    }
    condition_is(h, DECODE_NC, "Ready", "False", "GroupsNotReady")?;
    let selector = format!("involvedObject.name={DECODE_NC},reason=WorkerDegraded");
    let events = poll(Duration::from_secs(30), || async {
        let out = h
            .kubectl(&[
                "get",
                "events",
                "--field-selector",
                &selector,
                "-o",
                "jsonpath={range .items[*]}{.type} {.message}{\"\\n\"}{end}",
            ])
            .ok()?;
        out.lines()
            .any(|l| l.starts_with("Warning ") && l.contains("PoolDomainMismatch"))
            .then_some(out)
    })
    .await;
    if events.is_none() {
        return Err("no WorkerDegraded Warning event naming PoolDomainMismatch".into());
    }
    let pod = decode_pod(h, DECODE_NC).await?;
    let ip = pod_ip(&pod)?;
    if ready(&pod) {
        return Err("the negative control's decode pod is Ready".into());
    }
    let restarts: i32 = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.name == "worker" || c.name == "store-client")
        .map(|c| c.restart_count)
        .sum();
    if restarts != 0 {
        return Err(format!(
            "the refused worker must stay up (fail closed, not crash-loop): {restarts} restarts"
        ));
    }
    let readyz = get_text(&format!("http://{ip}:{HEALTH_PORT}/readyz")).await;
    let readyz = readyz.unwrap_or_else(|e| e);
    if !readyz.contains("PoolDomainMismatch") {
        return Err(format!("/readyz must say why: {readyz:?}"));
    }
    let report = get_json(&format!("http://{ip}:{HEALTH_PORT}/report")).await?;
    let refused = &report["engine"]["refused"];
    let degraded = degraded(&report);
    if report["ready"] != false
        || refused["pool"] != "draft"
        || refused["reason"] != "PoolDomainMismatch"
        || refused["field"] != "pools.draft"
        || report["engine"]["pools"] != serde_json::json!([])
        || degraded != [("pools".to_owned(), "PoolDomainMismatch".to_owned())]
    {
        return Err(format!("the refused worker's /report: {report}"));
    }
    let metrics = get_text(&format!("http://{ip}:{HEALTH_PORT}/metrics")).await?;
    let line = r#"tandem_engine_pool_refusals_total{pool="draft",reason="PoolDomainMismatch"} 1"#;
    if !metrics.lines().any(|l| l == line) {
        return Err(format!("the refused worker's /metrics lacks `{line}`"));
    }
    // Nothing registered, nothing kept: no Register request ever reached the sidecar.
    let sidecar = sidecar_stats(&ip).await?;
    let counts = (
        sidecar["register_requests"].as_u64(),
        sidecar["registrations"].as_u64(),
        sidecar["segments"].as_u64(),
        sidecar["connections_open"].as_u64(),
    );
    if counts != (Some(0), Some(0), Some(0), Some(0)) {
        return Err(format!(
            "the sidecar must have seen no Register request and hold nothing: {sidecar}"
        ));
    }
    let procs = pod_processes(h, &pod)?;
    let alive: Vec<&str> = procs
        .iter()
        .filter(|(_, p)| p.state() == Liveness::Running)
        .map(|(c, _)| c.as_str())
        .collect();
    if alive.len() != 3 {
        return Err(format!(
            "the pod runs store-client, worker and engine, one process each: {alive:?}"
        ));
    }
    say(&format!(
        "control: {DECODE_NC} Degraded=True WorkerDegraded ({message}); worker not Ready, 0 \
         restarts; sidecar {sidecar}; processes {alive:?}"
    ));

    // Teardown: nothing of the pod is left running.
    h.kubectl(&[
        "delete",
        "decodepool",
        DECODE_NC,
        "--wait=true",
        "--timeout=120s",
    ])?;
    let left = poll(Duration::from_secs(60), || async {
        let running: Vec<&str> = procs
            .iter()
            .filter(|(_, p)| p.state() == Liveness::Running)
            .map(|(c, _)| c.as_str())
            .collect();
        running.is_empty().then_some(())
    })
    .await;
    if left.is_none() {
        return Err("processes of the refused pod outlived its deletion".into());
    }
    say("control: deleted; none of its 3 processes is left");
    Ok(())
}

/// The pool's one decode pod (not terminating).
async fn decode_pod(h: &Harness, pool: &str) -> Result<Pod, String> {
    poll(Duration::from_secs(120), || async {
        let pods = h
            .pods(&format!("{POOL}={pool},{ROLE}={ROLE_DECODE}"))
            .await
            .ok()?;
        let live: Vec<Pod> = pods
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some())
            .collect();
        (live.len() == 1).then(|| live.into_iter().next()).flatten()
    })
    .await
    .ok_or_else(|| format!("no single running decode pod of {pool}"))
}

fn pod_ip(p: &Pod) -> Result<String, String> {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .ok_or_else(|| "decode pod without an IP".into())
}

/// The container processes the runner recorded for `pod` (`<runner>/pids/<uid>-<container>.pid`).
fn pod_processes(h: &Harness, pod: &Pod) -> Result<Vec<(String, ProcessId)>, String> {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let dir: PathBuf = h.cluster.config.runner_dir().join("pids");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let e = e.map_err(|e| e.to_string())?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(container) = name
            .strip_prefix(&format!("{uid}-"))
            .and_then(|r| r.strip_suffix(".pid"))
        else {
            continue;
        };
        let id = ProcessId::read(&e.path()).map_err(|e| e.to_string())?;
        out.push((container.to_owned(), id));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The `store_client` section of the pod's sidecar `/report` (health port + 1).
async fn sidecar_stats(ip: &str) -> Result<Value, String> {
    let r = get_json(&format!("http://{ip}:{}/report", HEALTH_PORT + 1)).await?;
    let s = r["store_client"].clone();
    if s.is_null() {
        return Err(format!("the sidecar /report has no store_client: {r}"));
    }
    Ok(s)
}

/// `(component, code)` of every `degraded` entry of a worker report.
fn degraded(report: &Value) -> Vec<(String, String)> {
    report["degraded"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            (
                d["component"].as_str().unwrap_or("").to_owned(),
                d["code"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn condition_field(h: &Harness, pool: &str, ty: &str, field: &str) -> Result<String, String> {
    h.kubectl(&[
        "get",
        "decodepool",
        pool,
        "-o",
        &format!("jsonpath={{.status.conditions[?(@.type==\"{ty}\")].{field}}}"),
    ])
}

fn condition_is(
    h: &Harness,
    pool: &str,
    ty: &str,
    status: &str,
    reason: &str,
) -> Result<(), String> {
    let got = (
        condition_field(h, pool, ty, "status")?,
        condition_field(h, pool, ty, "reason")?,
    );
    if got.0 != status || got.1 != reason {
        return Err(format!(
            "decodepool/{pool}: {ty} is {got:?}, expected ({status}, {reason}); message: {:?}",
            condition_field(h, pool, ty, "message").unwrap_or_default()
        ));
    }
    Ok(())
}

async fn get_text(url: &str) -> Result<String, String> {
    let r = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let ok = r.status().is_success();
    let text = r.text().await.map_err(|e| format!("{url}: {e}"))?;
    if ok { Ok(text) } else { Err(text) }
}

async fn get_json(url: &str) -> Result<Value, String> {
    let text = get_text(url).await?;
    serde_json::from_str(&text).map_err(|e| format!("{url}: {e}: {text}"))
}
