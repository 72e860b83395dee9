//! Issue 8, the CI slice: `tandem-e2e demo` — the same path as README's first command — on the
//! first 200 requests of the real Mooncake trace at twice its speed (≈ 35 s of trace time; at most
//! 8 in flight, as a router in front of one small decode pool would hold them), through a live
//! stack on a private control plane. The demo itself asserts, and exits non-zero otherwise:
//! zero corrupt pages read, zero requests lost beyond the retry budget, the rolling restart
//! happened with L3 loadback (pages loaded back by workers started after the restart), and the
//! teardown order of DESIGN §5 held. This test checks the exit status and that the report the
//! demo wrote says the same.
//!
//! The trace is read from `$TANDEM_TRACE`, else `../shared/data/mooncake/conversation_trace.jsonl`
//! next to the repository, else `/work/shared/data/…` (the workplace's path); without it the
//! demo's built-in generated workload is used (printed), unless `TANDEM_REQUIRE_DATA=1`: then the
//! test fails.
//!
//! The suite runs the default demo: both pools on the Simulated engine through the engine API
//! (DESIGN §3.1), the path a user's `tandem-e2e demo` runs, and checks that every engine worker
//! reported its pools. It used to run the worker's built-in engine (`--builtin-engine`) because the
//! engine path lost 2 of 200 requests; those were the abort probe's rooms (KV deadline 30 ms), whose
//! deadline passed between Reserve's reply and the engine's AwaitKv: the room was released and
//! AwaitKv answered UNKNOWN_ROOM, which the engine could only report as an engine error (HTTP 500,
//! not retried). The worker now answers such a room's failure (`engine_api::decode`, ended rooms).
//! Skips when the control plane is not built, unless `TANDEM_E2E_REQUIRE_CLUSTER` is set.

use std::path::{Path, PathBuf};
use std::process::Command;

fn trace() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TANDEM_TRACE") {
        return Some(PathBuf::from(p));
    }
    // Next to the repository (the workplace layout), else the workplace's absolute path (a CI
    // clone may live elsewhere).
    [
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/data/mooncake/conversation_trace.jsonl"),
        PathBuf::from("/work/shared/data/mooncake/conversation_trace.jsonl"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// `TANDEM_REQUIRE_DATA=1` (CI sets it): a test whose data is missing fails instead of passing.
fn data_required() -> bool {
    std::env::var_os("TANDEM_REQUIRE_DATA").is_some_and(|v| v == "1")
}

#[test]
fn demo_replays_a_trace_slice_through_scale_and_rolling_restart() {
    let required = std::env::var_os("TANDEM_E2E_REQUIRE_CLUSTER").is_some();
    let tmp = tempfile::Builder::new()
        .prefix("tandem-e2e-demo")
        .tempdir()
        .unwrap();
    let out = tmp.path().join("out");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-e2e"));
    cmd.args([
        "demo",
        "--port-offset",
        "6000",
        "--requests",
        "300",
        "--time-scale",
        "1.0",
    ])
    // Retry budget 8 (backoff 0.1 s doubling to 2 s: ~9 s of retries): while the rolling restart
    // runs, the new revision briefly has fewer Ready prefill groups than its decodes want and the
    // old decodes briefly lack a peer of their revision; with budget 6 (~5 s) a CI run lost 2 of
    // 200 in that window (issue 17 note). Corruption and systematic loss still fail the run.
    //
    // The slice must restart decode groups while requests still run (asserted below). The
    // operator's prefill gate holds the k-th decode restart until ceil((k+1)·P/D) prefill groups
    // are back at the new revision (8:2: 4, then 7), and each prefill group is Ready only after
    // its L3 loadback. With the whole L2 to load back (~1,200 pages per pod after 300 requests at
    // the trace's pace) a loadback on this 2-core machine runs into its 30 s deadline, so the
    // first decode restart came ~123 s after `restart.id` — a CI run (stop 27) saw it at 143 s,
    // 2 s after the replay's last request (141 s). TANDEM_L3_LOADBACK_PAGES=256 bounds each
    // loadback to a few seconds, so the decode restarts fall mid-replay; the loadback still runs
    // on every restarted prefill (the restart check requires pages loaded back). The slice is
    // 300 requests at the trace's own pace (they span 102 s), scaling at 10 % and restarting at
    // 15 %.
    .args(["--concurrency-limit", "8", "--retry-budget", "8"])
    .args(["--scale-at", "10", "--restart-at", "15"])
    .args(["--pod-env", "TANDEM_L3_LOADBACK_PAGES=256"])
    .arg("--state-dir")
    .arg(tmp.path().join("cluster"))
    .arg("--out")
    .arg(&out);
    if !required {
        cmd.arg("--cached-only");
    }
    // `cargo test --workspace` built the workspace's binaries next to ours: use them, rather than
    // let the demo run its own `cargo build` with another feature set.
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_tandem-e2e"))
        .parent()
        .unwrap();
    let (worker, operator) = (
        bin_dir.join("tandem-worker"),
        bin_dir.join("tandem-operator"),
    );
    if worker.exists() && operator.exists() {
        cmd.env("TANDEM_WORKER_BIN", worker)
            .env("TANDEM_OPERATOR_BIN", operator);
    }
    match trace() {
        Some(t) => {
            println!("replaying {}", t.display());
            cmd.arg("--trace").arg(t);
        }
        None => {
            assert!(
                !data_required(),
                "TANDEM_REQUIRE_DATA=1 and no Mooncake trace at $TANDEM_TRACE or \
                 ../shared/data/mooncake/conversation_trace.jsonl"
            );
            println!("no Mooncake trace found: the demo's generated workload is used");
        }
    }
    let output = cmd.output().expect("tandem-e2e runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    if !required && stderr.contains("not built") && !output.status.success() {
        println!("SKIPPED demo slice: control-plane binaries are not built");
        return;
    }
    assert!(
        output.status.success(),
        "the demo failed its checks (see above)"
    );

    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json"))
            .expect("results.json parses");
    let text = results.to_string();
    for key in ["ttft_ms", "tpot_ms", "corrupt_pages_read"] {
        assert!(text.contains(key), "results.json lacks {key}: {text:.400}");
    }
    // The slice restarts early (`--restart-at 15`) so that decode groups restart while requests
    // still run: the rollout gate's wait is exercised under load, not after it.
    assert_eq!(
        results["decode_restart_under_traffic"],
        serde_json::Value::Bool(true),
        "no decode pod restarted before the replay ended: the decode restarts saw no traffic"
    );
    // Through the engine API: prefill and decode pods reported a Simulated engine (the demo's own
    // checks have verified the pages those engines read, for every engine worker it sampled).
    let engine_pods = |role: &str| -> std::collections::BTreeSet<String> {
        results["engine_workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|w| w["role"] == role && w["kind"] == "Simulated")
            .filter_map(|w| w["pod"].as_str().map(str::to_owned))
            .collect()
    };
    let (prefills, decodes) = (engine_pods("prefill"), engine_pods("decode"));
    assert!(
        prefills.len() >= 4 && decodes.len() >= 2,
        "the slice runs on the Simulated engine: engine pods {prefills:?} (prefill, want ≥ 4) and \
         {decodes:?} (decode, want ≥ 2 after the scale)"
    );
    let pngs = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "png"))
        .count();
    assert!(pngs >= 3, "the demo draws its plots ({pngs} PNGs)");
}
