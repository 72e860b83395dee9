//! Issue 15: LayerSplit on the live stack. A v1.37 control plane, the operator installed by
//! `helm install` and running in the cluster, and `manifests/samples/layersplit/` applied as a
//! user would: a PrefillPool of deepseek-v3 (61 layers, MLA) in CP-4 groups with `layerSplit:
//! true`, and its DecodePool (ratio 1:1). Every worker is a real `tandem-worker` process of the
//! process runner, on the built-in engine.
//!
//! Phases:
//! 1. the stack reaches Ready: the four CP ranks of the group found each other by pod DNS under
//!    the pool's headless Service and agreed on the owner map before allocating their stores;
//! 2. requests through the decode's front door are served clean — the decode verifies every chunk
//!    it receives, each layer range written by the rank that owns it — and every rank's
//!    `/report.layer_split` shows: its owned layers (the four ranges cover 0..61), its KV bytes
//!    against the replicated layout's (owned/61 of it), the broadcast bytes against a whole-layer
//!    broadcast, one wait per non-owned layer per step, 0 corrupt chunks read;
//! 3. NEGATIVE CONTROL: the same pool with `TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1` in its pods'
//!    environment (the process runner's pod-env annotation; the worker is built with the
//!    `negative-controls` feature): the ranks attend without waiting on the layer's event and
//!    the engine counts the chunks it read that were not the layer's KV.
//!
//! Skips with a printed reason when the control-plane binaries are not built, unless
//! `TANDEM_E2E_REQUIRE_CLUSTER` is set.

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use support::{Harness, HarnessConfig, install, poll, ready, run_suite, wait_condition};
use tandem_crds::labels::{POOL, ROLE, ROLE_DECODE};
use tandem_e2e::replay::targets::{FRONT_DOOR_PORT, pod_serving};
use tandem_e2e::report::sampler::HEALTH_PORT;
use tandem_e2e::runner::env::POD_ENV_ANNOTATION;

const DECODE: &str = "deepseek-decode";
const PREFILL: &str = "deepseek-prefill";
/// deepseek-v3's layers.
const LAYERS: u64 = 61;
/// CP ranks per group in the sample.
const CP: usize = 4;
/// One decode and one prefill group of four pods, one GPU each.
const NODE_GPUS: u32 = 6;
/// Requests of the served phase.
const REQUESTS: u64 = 16;
/// How long a pool has to roll onto a new spec.
const ROLLOUT: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_split_groups_serve_under_the_operator() {
    let worker = tandem_e2e::demo::stack::negative_controls_worker()
        .await
        .unwrap_or_else(|e| panic!("a tandem-worker with negative controls: {e}"));
    run_suite(
        HarnessConfig {
            name: "layer_split_stack",
            port_offset: 9700,
            runner_gpus: NODE_GPUS,
            first_node_index: 97,
            worker_bin: Some(worker),
            pod_env: &[],
        },
        scenario,
    )
    .await;
}

async fn scenario(h: &Harness) -> Result<(), String> {
    let t0 = Instant::now();
    let at = || format!("[{:>5.1}s]", t0.elapsed().as_secs_f64());
    install(h).await?;
    h.kubectl(&["apply", "-f", "manifests/samples/layersplit/"])?;
    wait_condition(h, "prefillpool", PREFILL, "Ready", "True", 300).await?;
    wait_condition(h, "decodepool", DECODE, "Ready", "True", 300).await?;
    let ranks = prefill_pods(h).await?;
    if ranks.len() != CP {
        return Err(format!(
            "{} prefill pods, want one group of {CP}",
            ranks.len()
        ));
    }
    println!("{} stack Ready: one CP-{CP} LayerSplit group", at());

    // Served: every response clean; every rank's figures.
    for n in 0..REQUESTS {
        let v = complete_ok(h, &request(n)).await?;
        if v["tandem"]["corrupt_chunks"] != 0 {
            return Err(format!("request {n}: the decode read corrupt chunks: {v}"));
        }
    }
    let reports = rank_reports(h).await?;
    let mut owned_total = 0;
    for r in &reports {
        let ls = &r["layer_split"];
        let owned: u64 = ls["owned_layers"]
            .as_array()
            .ok_or_else(|| format!("no layer_split in a prefill report: {r}"))?
            .iter()
            .map(|x| x[1].as_u64().unwrap_or(0) - x[0].as_u64().unwrap_or(0))
            .sum();
        owned_total += owned;
        let stored = num(ls, "stored_kv_bytes")?;
        let replicated = num(ls, "replicated_kv_bytes")?;
        let (payload, whole) = (
            num(ls, "broadcast_payload_bytes")?,
            num(ls, "whole_layer_broadcast_bytes")?,
        );
        println!(
            "{} cp rank {}: layers {} ({owned}), KV {stored} B = {:.3} of replicated {replicated} B; \
             broadcast {payload} B = {:.4} of whole-layer {whole} B; steps {} waits {} (hidden {}) \
             corrupt {}",
            at(),
            ls["cp_rank"],
            ls["owned_layers"],
            stored as f64 / replicated as f64,
            payload as f64 / whole.max(1) as f64,
            ls["steps"],
            ls["waits"],
            ls["waits_hidden"],
            ls["corrupt_chunks_read"],
        );
        let steps = num(ls, "steps")?;
        if steps < REQUESTS
            || num(ls, "step_failures")? != 0
            || num(ls, "corrupt_chunks_read")? != 0
            || stored * LAYERS != replicated * owned
            || num(ls, "waits")? != steps * (LAYERS - owned)
            || payload * 10 > whole
        {
            return Err(format!("a rank's figures are off: {ls}"));
        }
    }
    if owned_total != LAYERS {
        return Err(format!(
            "the ranks own {owned_total} layers, the model has {LAYERS}"
        ));
    }

    // NEGATIVE CONTROL: the ranks skip the layer wait.
    h.kubectl(&[
        "patch",
        "prefillpool",
        PREFILL,
        "--type=merge",
        "-p",
        &json!({"spec": {"podTemplate": {"annotations": {
            POD_ENV_ANNOTATION: "TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1"}}}})
        .to_string(),
    ])?;
    rolled_out(h).await?;
    println!(
        "{} prefill group restarted with the layer wait skipped",
        at()
    );
    for n in 0..4 {
        complete_ok(h, &request(1000 + n)).await?;
    }
    let reports = rank_reports(h).await?;
    let corrupt: u64 = reports
        .iter()
        .map(|r| {
            r["layer_split"]["corrupt_chunks_read"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    let skipping = reports
        .iter()
        .all(|r| r["layer_split"]["negative_control_skip_wait"] == true);
    println!(
        "{} NEGATIVE CONTROL skip-wait: {corrupt} chunks read that were not their layer's KV",
        at()
    );
    if !skipping || corrupt == 0 {
        return Err(format!(
            "skip-wait: the ranks must report corrupt chunks read (skipping: {skipping}, corrupt {corrupt})"
        ));
    }
    Ok(())
}

/// A request of 1 to 6 pages of 512 tokens, fresh prefix.
fn request(n: u64) -> Value {
    json!({"model": "deepseek-v3", "prompt": "x", "max_tokens": 2,
        "input_tokens": 300 + (n % 6) * 512, "kv_block_hashes": [n * 10 + 1, n * 10 + 2]})
}

fn num(v: &Value, k: &str) -> Result<u64, String> {
    v[k].as_u64().ok_or_else(|| format!("{k} missing in {v}"))
}

async fn prefill_pods(h: &Harness) -> Result<Vec<Pod>, String> {
    Ok(h.pods(&format!("{POOL}={PREFILL}"))
        .await?
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

fn ip(p: &Pod) -> Option<String> {
    p.status.as_ref()?.pod_ip.clone()
}

/// Every prefill rank's `/report`.
async fn rank_reports(h: &Harness) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for p in prefill_pods(h).await? {
        let ip = ip(&p).ok_or("a prefill pod without an IP")?;
        out.push(get_json(format!("http://{ip}:{HEALTH_PORT}/report")).await?);
    }
    Ok(out)
}

async fn get_json(url: String) -> Result<Value, String> {
    let r = reqwest::Client::new()
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    r.json().await.map_err(|e| format!("GET {url}: {e}"))
}

/// A completion that must succeed (the decode may still be connecting to a new group): the
/// first 200 within 60 s.
async fn complete_ok(h: &Harness, body: &Value) -> Result<Value, String> {
    let mut last = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let decode = h
            .pods(&format!("{POOL}={DECODE},{ROLE}={ROLE_DECODE}"))
            .await?
            .iter()
            .filter(|p| pod_serving(p))
            .find_map(ip);
        if let Some(d) = decode {
            let r = reqwest::Client::new()
                .post(format!("http://{d}:{FRONT_DOOR_PORT}/v1/completions"))
                .timeout(Duration::from_secs(60))
                .json(body)
                .send()
                .await;
            match r {
                Ok(r) if r.status().as_u16() == 200 => {
                    return r.json().await.map_err(|e| e.to_string());
                }
                Ok(r) => last = format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                Err(e) => last = e.to_string(),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("no 200 for {body} within 60 s; last: {last}"))
}

/// Waits until the PrefillPool's group runs the patched spec: every live pod Ready and carrying
/// the pod-env annotation, and the pool's status settled; at most [`ROLLOUT`].
async fn rolled_out(h: &Harness) -> Result<(), String> {
    poll(ROLLOUT, || async {
        let seen = h
            .kubectl(&[
                "get",
                "prefillpool",
                PREFILL,
                "-o",
                "jsonpath={.status.updatedReplicas} {.status.readyReplicas} {.status.replicas}",
            ])
            .ok()?;
        let v: Vec<&str> = seen.split_whitespace().collect();
        let settled = v.len() == 3 && v[0] == v[2] && v[1] == v[2] && v[0] != "0";
        let pods = prefill_pods(h).await.ok()?;
        let patched = pods.len() == CP
            && pods.iter().all(|p| {
                ready(p)
                    && p.metadata
                        .annotations
                        .as_ref()
                        .is_some_and(|a| a.contains_key(POD_ENV_ANNOTATION))
            });
        (settled && patched).then_some(())
    })
    .await
    .ok_or_else(|| format!("{PREFILL} did not roll onto the patched spec in {ROLLOUT:?}"))
}
