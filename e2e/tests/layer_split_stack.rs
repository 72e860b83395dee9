//! Issue 15: LayerSplit on the live stack. A v1.37 control plane, the operator installed by
//! `helm install` and running in the cluster, and `manifests/samples/layersplit/` applied as a
//! user would: a PrefillPool of deepseek-v3 (61 layers, MLA) in CP-4 groups with `layerSplit:
//! true`, and its DecodePool (ratio 1:1). Every worker is a real `tandem-worker` process of the
//! process runner, on the built-in engine.
//!
//! Phases:
//! 1. the stack reaches Ready: the four CP ranks of the group found each other by pod DNS under
//!    the pool's headless Service and agreed on the owner map before allocating their stores;
//! 2. a slice of the Mooncake conversation trace ([`SLICE`] requests, when the trace is present;
//!    required with `TANDEM_REQUIRE_DATA=1`) is replayed through the decode's front door, and
//!    requests are served clean — the decode verifies every chunk it receives, each layer range
//!    written by the rank that owns it — and every rank's `/report.cp_group` shows: its owned
//!    layers (the four ranges cover 0..61), its KV bytes against the replicated layout's (owned/61
//!    of it), the broadcast bytes against a whole-layer broadcast, one wait per non-owned layer
//!    per step, 0 corrupt chunks read;
//! 3. the baseline: the same pool with `layerSplit: false` — the same CP-4 group, every rank
//!    storing all 61 layers — replays the same slice; the test prints the prefix hit ratio and
//!    TTFT of both (LayerSplit caches 61/16 times the pages in the same host memory, seed 004's
//!    token-capacity gain; LRU's inclusion property makes its hits a superset);
//! 4. NEGATIVE CONTROL: the same pool with `TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1` in its pods'
//!    environment (the process runner's pod-env annotation; the worker is built with the
//!    `negative-controls` feature): the ranks attend without waiting on the layer's event and
//!    the engine counts the chunks it read that were not the layer's KV;
//! 5. through the engine API: the same pool with `engine: {kind: Simulated}` — each pod's worker
//!    gives its engine container a pool of its owned layers and a receive slot, the engines
//!    compute layer by layer (PagesReady per owned layer, AwaitLayer for the others) — serves
//!    clean, each rank's pages `owned + 1` of 61 layers, one wait per non-owned layer per step,
//!    0 corrupt receive-slot reads;
//! 6. NEGATIVE CONTROL through the engine API: the engines run with `--skip-layer-wait` and count
//!    the receive-slot chunks they read that were not the layer's KV.
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
/// Requests of the trace slice. The conversation trace reuses prefixes at long distances (its
/// first reuses are more than 2,000 pages back), so a slice shows the capacity only once it is
/// that long: an LRU model of the first 250 requests gives 0.036 of the prompt tokens hit with
/// the replicated layout's 2,148 pages and about 0.07 with LayerSplit's 8,189. One group serves
/// about 1.3 rooms/s in a debug build on 2 cores, so each replay takes about 3 minutes.
const SLICE: usize = 250;
/// Trace timestamps × this (the slice spans 85 s of the trace); the group is the bottleneck.
const TIME_SCALE: f64 = 0.1;
/// Requests in flight: one group computes one room at a time, so more would only queue rooms
/// past the decode's KV deadline (aborted, retried: work done twice).
const IN_FLIGHT: usize = 4;

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

    let workload = trace_slice()?;
    let with_split = match &workload {
        Some(w) => Some(replay_slice(h, w, "LayerSplit").await?),
        None => None,
    };

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
        let ls = &r["cp_group"];
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
             corrupt {}, failed steps {}",
            at(),
            ls["cp_rank"],
            ls["owned_layers"],
            stored as f64 / replicated as f64,
            payload as f64 / whole.max(1) as f64,
            ls["steps"],
            ls["waits"],
            ls["waits_hidden"],
            ls["corrupt_chunks_read"],
            ls["step_failures"],
        );
        let steps = num(ls, "steps")?;
        // A room the decode aborted mid-step (its KV deadline) fails its step: counted, not
        // required to be 0 here; every request still completed clean above.
        if steps < REQUESTS + workload.as_ref().map_or(0, |w| w.len() as u64)
            || num(ls, "corrupt_chunks_read")? != 0
            || stored * LAYERS != replicated * owned
            || num(ls, "waits")? > steps * (LAYERS - owned)
            || num(ls, "waits")? == 0
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

    // The baseline on the same slice: the same group, every rank storing every layer.
    if let (Some(w), Some(a)) = (&workload, &with_split) {
        patch_prefill(h, json!({"layerSplit": false}))?;
        rolled_out(h, "replicated").await?;
        complete_within(h, &request(3000), ROLLOUT).await?;
        println!(
            "{} prefill group restarted replicated (layerSplit: false)",
            at()
        );
        let b = replay_slice(h, w, "replicated").await?;
        println!(
            "{} same {}-request slice: prefix hit ratio {:.3} with LayerSplit against {:.3} \
             replicated ({:.2}x); TTFT p50 {:.0} ms against {:.0} ms, p90 {:.0} ms against {:.0} ms",
            at(),
            w.len(),
            a.hit_ratio,
            b.hit_ratio,
            a.hit_ratio / b.hit_ratio.max(1e-9),
            a.ttft_p50,
            b.ttft_p50,
            a.ttft_p90,
            b.ttft_p90,
        );
        if a.hit_ratio + 0.01 < b.hit_ratio {
            return Err(format!(
                "LayerSplit's larger cache hit less than the replicated one: {:.3} < {:.3}",
                a.hit_ratio, b.hit_ratio
            ));
        }
    }

    // NEGATIVE CONTROL: the ranks skip the layer wait.
    patch_prefill(
        h,
        json!({"layerSplit": true, "podTemplate": {"annotations": {
            POD_ENV_ANNOTATION: "TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1"}}}),
    )?;
    rolled_out(h, "layer_split").await?;
    complete_within(h, &request(4000), ROLLOUT).await?;
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
        .map(|r| r["cp_group"]["corrupt_chunks_read"].as_u64().unwrap_or(0))
        .sum();
    let skipping = reports
        .iter()
        .all(|r| r["cp_group"]["negative_control_skip_wait"] == true);
    println!(
        "{} NEGATIVE CONTROL skip-wait: {corrupt} chunks read that were not their layer's KV",
        at()
    );
    let annotated = prefill_pods(h).await?.iter().all(|p| {
        p.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(POD_ENV_ANNOTATION))
    });
    if !annotated || !skipping || corrupt == 0 {
        return Err(format!(
            "skip-wait: the ranks must report corrupt chunks read (skipping: {skipping}, corrupt {corrupt})"
        ));
    }

    // 5. Through the engine API: the same group with the Simulated engine beside each worker.
    patch_prefill(
        h,
        json!({"engine": {"kind": "Simulated"},
            "podTemplate": {"annotations": {POD_ENV_ANNOTATION: null}}}),
    )?;
    rolled_out_where(h, "LayerSplit with engines", |pods, reports| {
        pods.iter()
            .all(|p| engine_args(p).is_some_and(|a| !a.iter().any(|x| x == "--skip-layer-wait")))
            && reports.iter().all(|r| r["cp_group"]["engine"] == true)
    })
    .await?;
    complete_within(h, &request(5000), ROLLOUT).await?;
    println!("{} prefill group restarted with its engines", at());
    for n in 0..REQUESTS {
        let v = complete_ok(h, &request(2000 + n)).await?;
        if v["tandem"]["corrupt_chunks"] != 0 {
            return Err(format!(
                "engine request {n}: the decode read corrupt chunks: {v}"
            ));
        }
    }
    let reports = rank_reports(h).await?;
    let owned_of = |r: &Value| {
        r["cp_group"]["owned_layers"][0][1].as_u64().unwrap_or(0)
            - r["cp_group"]["owned_layers"][0][0].as_u64().unwrap_or(0)
    };
    // Every rank's pool has the largest share's layers and the receive slot.
    let pool_layers = reports.iter().map(owned_of).max().unwrap_or(0) + 1;
    let mut owned_total = 0;
    for r in &reports {
        let (ls, e) = (&r["cp_group"], &r["engine"]["engine_summary"]);
        let owned = owned_of(r);
        owned_total += owned;
        let (steps, waits) = (num(ls, "steps")?, num(ls, "waits")?);
        println!(
            "{} engine cp rank {}: layers {} ({owned}), page {} B against replicated {} B; \
             steps {steps} waits {waits} (hidden {}); engine: {} receive-slot chunks read, {} \
             corrupt, {} failed steps",
            at(),
            ls["cp_rank"],
            ls["owned_layers"],
            ls["page_bytes"],
            ls["replicated_page_bytes"],
            ls["waits_hidden"],
            e["layer_chunks_read"],
            e["layer_corrupt_chunks"],
            ls["step_failures"],
        );
        if ls["engine"] != true
            || steps < REQUESTS
            || waits == 0
            || waits > steps * (LAYERS - owned)
            || num(e, "layer_corrupt_chunks")? != 0
            || num(e, "layer_waits")? != waits
            || num(ls, "page_bytes")? * LAYERS != num(ls, "replicated_page_bytes")? * pool_layers
        {
            return Err(format!("an engine rank's figures are off: {r}"));
        }
    }
    if owned_total != LAYERS {
        return Err(format!(
            "the engine ranks own {owned_total} layers, the model has {LAYERS}"
        ));
    }

    // 6. NEGATIVE CONTROL through the engine API: the engines read the receive slot without
    //    AwaitLayer, and count the chunks that were not their layer's KV.
    patch_prefill(
        h,
        json!({"engine": {"kind": "Simulated", "args": ["--skip-layer-wait"]}}),
    )?;
    rolled_out_where(h, "engines skipping the layer wait", |pods, reports| {
        pods.iter()
            .all(|p| engine_args(p).is_some_and(|a| a.iter().any(|x| x == "--skip-layer-wait")))
            && reports.iter().all(|r| r["cp_group"]["engine"] == true)
    })
    .await?;
    complete_within(h, &request(6000), ROLLOUT).await?;
    for n in 0..4 {
        complete_ok(h, &request(3000 + n)).await?;
    }
    let reports = rank_reports(h).await?;
    let corrupt: u64 = reports
        .iter()
        .map(|r| {
            r["engine"]["engine_summary"]["layer_corrupt_chunks"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    println!(
        "{} NEGATIVE CONTROL engines skipping the wait: {corrupt} receive-slot chunks read that \
         were not their layer's KV",
        at()
    );
    if corrupt == 0 {
        return Err("engines skipping the layer wait must count corrupt receive-slot reads".into());
    }
    Ok(())
}

/// The `args` of a pod's engine container; `None` without one.
fn engine_args(p: &Pod) -> Option<Vec<String>> {
    p.spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == "engine")
        .map(|c| c.args.clone().unwrap_or_default())
}

/// A request of 1 to 6 pages of 512 tokens, fresh prefix.
fn request(n: u64) -> Value {
    json!({"model": "deepseek-v3", "prompt": "x", "max_tokens": 2,
        "input_tokens": 300 + (n % 6) * 512,
        "kv_block_hashes": [(1 << 40) + n * 10 + 1, (1 << 40) + n * 10 + 2]})
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
    complete_within(h, body, Duration::from_secs(60)).await
}

/// [`complete_ok`] within `within`: after a change of the PrefillPool's spec the paired
/// DecodePool rolls onto the new revision too, and no decode serves for a while.
async fn complete_within(h: &Harness, body: &Value, within: Duration) -> Result<Value, String> {
    let mut last = String::new();
    let deadline = Instant::now() + within;
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
    Err(format!("no 200 for {body} within {within:?}; last: {last}"))
}

/// `kubectl patch prefillpool` with a merge of `spec`.
fn patch_prefill(h: &Harness, spec: Value) -> Result<String, String> {
    h.kubectl(&[
        "patch",
        "prefillpool",
        PREFILL,
        "--type=merge",
        "-p",
        &json!({ "spec": spec }).to_string(),
    ])
}

/// Waits until the PrefillPool's group runs the patched spec: the pool's status settled and
/// every live pod Ready, reporting `layout` (`layer_split` or `replicated`); at most [`ROLLOUT`].
async fn rolled_out(h: &Harness, layout: &str) -> Result<(), String> {
    rolled_out_where(h, layout, |_, reports| {
        reports.iter().all(|r| r["cp_group"]["layout"] == layout)
    })
    .await
}

/// [`rolled_out`] with `done(pods, reports)` saying whether the pods and their `/report`s show
/// the patched spec (`what` names it in the error).
async fn rolled_out_where(
    h: &Harness,
    what: &str,
    done: impl Fn(&[Pod], &[Value]) -> bool,
) -> Result<(), String> {
    let done = &done;
    poll(ROLLOUT, || async move {
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
        if !settled || pods.len() != CP || !pods.iter().all(ready) {
            return None;
        }
        let reports = rank_reports(h).await.ok()?;
        done(&pods, &reports).then_some(())
    })
    .await
    .ok_or_else(|| {
        format!(
            "{PREFILL} did not roll onto {what} in {ROLLOUT:?}; {}",
            rollout_state(h)
        )
    })
}

/// What a stuck rollout looks like: each prefill pod's revision, readiness, gang gate and
/// restarts, and the pool's rollout status, group restarts and Degraded condition.
fn rollout_state(h: &Harness) -> String {
    let pods = h
        .kubectl(&[
            "get",
            "pods",
            "-l",
            &format!("{POOL}={PREFILL}"),
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} rev={.metadata.labels.serving\\.tandem\\.dev/revision} \
             deleting={.metadata.deletionTimestamp} ready={.status.conditions[?(@.type==\"Ready\")].status} \
             gate={.status.conditions[?(@.type==\"serving.tandem.dev/group-ready\")].reason} \
             restarts={.status.containerStatuses[*].restartCount}; {end}",
        ])
        .unwrap_or_else(|e| e);
    let pool = h
        .kubectl(&[
            "get",
            "prefillpool",
            PREFILL,
            "-o",
            "jsonpath=rollout={.status.rollout} groupRestarts={.status.groupRestarts} \
             degraded={.status.conditions[?(@.type==\"Degraded\")].message}",
        ])
        .unwrap_or_else(|e| e);
    format!("pods: {pods} pool: {pool}")
}

/// What a replay of the slice saw.
struct SliceRun {
    hit_ratio: f64,
    ttft_p50: f64,
    ttft_p90: f64,
}

/// The Mooncake trace's first [`SLICE`] requests; `None` (printed) without the trace, an error
/// when `TANDEM_REQUIRE_DATA=1`.
fn trace_slice() -> Result<Option<Vec<tandem_e2e::replay::TraceRequest>>, String> {
    let path = std::env::var_os("TANDEM_TRACE")
        .map(std::path::PathBuf::from)
        .into_iter()
        .chain([
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../shared/data/mooncake/conversation_trace.jsonl"),
            std::path::PathBuf::from("/work/shared/data/mooncake/conversation_trace.jsonl"),
        ])
        .find(|p| p.exists());
    match path {
        Some(p) => tandem_e2e::replay::workload::load_trace(&p, Some(SLICE))
            .map(Some)
            .map_err(|e| e.to_string()),
        None if std::env::var_os("TANDEM_REQUIRE_DATA").is_some_and(|v| v == "1") => Err(
            "TANDEM_REQUIRE_DATA=1 and no Mooncake trace at $TANDEM_TRACE or \
             ../shared/data/mooncake/conversation_trace.jsonl"
                .into(),
        ),
        None => {
            println!("no Mooncake trace: the trace-slice comparison is skipped");
            Ok(None)
        }
    }
}

/// Replays `workload` through the decode's front door; every request must complete clean.
async fn replay_slice(
    h: &Harness,
    workload: &[tandem_e2e::replay::TraceRequest],
    what: &str,
) -> Result<SliceRun, String> {
    let urls: Vec<String> = h
        .pods(&format!("{POOL}={DECODE},{ROLE}={ROLE_DECODE}"))
        .await?
        .iter()
        .filter(|p| pod_serving(p))
        .filter_map(ip)
        .map(|ip| format!("http://{ip}:{FRONT_DOOR_PORT}"))
        .collect();
    if urls.is_empty() {
        return Err("no serving decode pod".into());
    }
    let config = tandem_e2e::replay::ReplayConfig {
        model: "deepseek-v3".into(),
        time_scale: TIME_SCALE,
        concurrency_limit: Some(IN_FLIGHT),
        ..Default::default()
    };
    let results = tandem_e2e::replay::replay(
        workload,
        &tandem_e2e::replay::TargetSet::fixed(urls),
        &config,
        tandem_e2e::replay::Clock::start(),
        None,
        None,
    )
    .await;
    let failed: Vec<_> = results
        .iter()
        .filter(|r| r.outcome == tandem_e2e::replay::Outcome::Failed)
        .collect();
    let corrupt: u64 = results
        .iter()
        .filter_map(|r| r.tandem.as_ref())
        .map(|t| t.corrupt_chunks)
        .sum();
    if !failed.is_empty() || corrupt > 0 {
        return Err(format!(
            "{what} slice: {} of {} failed (first: {:?}), {corrupt} corrupt chunks",
            failed.len(),
            results.len(),
            failed.first().map(|r| &r.errors)
        ));
    }
    let hits: u64 = results
        .iter()
        .filter_map(|r| r.tandem.as_ref())
        .map(|t| t.prefix_hit_tokens.total())
        .sum();
    let tokens: u64 = results.iter().map(|r| u64::from(r.input_tokens)).sum();
    let mut ttft: Vec<f64> = results.iter().filter_map(|r| r.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let q = |p: f64| {
        ttft.get(((ttft.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    println!(
        "{what} slice: {} requests, {tokens} prompt tokens, {hits} hit",
        results.len()
    );
    Ok(SliceRun {
        hit_ratio: hits as f64 / tokens.max(1) as f64,
        ttft_p50: q(0.5),
        ttft_p90: q(0.9),
    })
}
