//! Replay and report against a fake DecodePool front door (worker/interfaces/README.md §3) and fake
//! worker `/report` (§4), plus the trace loader on the real Mooncake trace when it is present.
//!
//! The fake decides what to do with a request from its first block hash (the "behaviour code")
//! and identifies it by its second; both fake front doors share one state, so attempts of one
//! request are counted across targets.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use tandem_e2e::replay::front_door::CompletionRequest;
use tandem_e2e::replay::workload::{self, BLOCK_TOKENS, TraceRequest};
use tandem_e2e::replay::{Outcome, ReplayConfig, TargetSet};
use tandem_e2e::report::sampler::ReportSource;
use tandem_e2e::report::session::{Session, replay_and_report};

/// Behaviour codes (first hash id).
const NORMAL: u64 = 0;
const UNAVAILABLE_ONCE: u64 = 1;
const ALWAYS_UNAVAILABLE: u64 = 2;
const DROP_ONCE: u64 = 3;
const BUSY_ONCE: u64 = 4;
const MALFORMED: u64 = 5;
const ERROR_EVENT_ONCE: u64 = 6;

const TTFT: Duration = Duration::from_millis(30);
const TPOT: Duration = Duration::from_millis(4);

#[derive(Default)]
struct Fake {
    /// request id → (port, arrival) of every attempt.
    attempts: HashMap<u64, Vec<(u16, Instant)>>,
    served: u64,
    kv_bytes: u64,
}

type Shared = Arc<Mutex<Fake>>;

async fn completions(
    State((fake, port)): State<(Shared, u16)>,
    Json(req): Json<CompletionRequest>,
) -> Response {
    let code = req.kv_block_hashes.first().copied().unwrap_or(NORMAL);
    let id = req.kv_block_hashes.get(1).copied().unwrap_or(u64::MAX);
    let attempt = {
        let mut f = fake.lock().unwrap();
        let a = f.attempts.entry(id).or_default();
        a.push((port, Instant::now()));
        a.len()
    };
    let refuse = |status: StatusCode, message: &str| {
        let body = serde_json::json!({"error": {"message": message, "type": "x", "code": status.as_u16()}});
        (status, Json(body)).into_response()
    };
    match (code, attempt) {
        (UNAVAILABLE_ONCE, 1) | (ALWAYS_UNAVAILABLE, _) => {
            return refuse(StatusCode::SERVICE_UNAVAILABLE, "draining");
        }
        (BUSY_ONCE, 1) => return refuse(StatusCode::TOO_MANY_REQUESTS, "at capacity"),
        // The decode front door's answer to a prompt its KV pool can never hold: final, not retried.
        (MALFORMED, _) => {
            let body = serde_json::json!({"error": {"message": "the prompt can never fit",
                "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}});
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
        _ => {}
    }
    let cut = match (code, attempt) {
        (DROP_ONCE, 1) => Some(Cut::Drop),
        (ERROR_EVENT_ONCE, 1) => Some(Cut::ErrorEvent),
        _ => None,
    };
    let stream = async_stream(fake, req.max_tokens, req.input_tokens, cut);
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn event(v: serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// How a first attempt is cut short after its first event.
#[derive(Clone, Copy, PartialEq)]
enum Cut {
    /// The body stream fails: hyper aborts the connection.
    Drop,
    /// An `{"error": ...}` event and the end of the stream, no `[DONE]`.
    ErrorEvent,
}

/// The SSE body: one event per token (TTFT then TPOT apart), the last with usage and the
/// `tandem` block (half the prompt hit in L2), then `[DONE]`; or cut after the first event.
fn async_stream(
    fake: Shared,
    tokens: u32,
    input: u32,
    cut: Option<Cut>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    let chunk = |text: &str, finish: Option<&str>| {
        serde_json::json!({"id": "c", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]})
    };
    let mut plan: Vec<(Duration, Result<Bytes, std::io::Error>)> = Vec::new();
    for i in 0..tokens {
        let delay = if i == 0 { TTFT } else { TPOT };
        if i == 1 && cut == Some(Cut::Drop) {
            plan.push((delay, Err(std::io::Error::other("connection dropped"))));
            break;
        }
        if i == 1 && cut == Some(Cut::ErrorEvent) {
            let e = serde_json::json!({"error": {"message": "spec_guard_anomaly", "type": "x", "code": 503}});
            plan.push((delay, Ok(event(e))));
            break;
        }
        if i + 1 < tokens {
            plan.push((delay, Ok(event(chunk("x", None)))));
        } else {
            let mut last = chunk("x", Some("length"));
            last["usage"] = serde_json::json!({"prompt_tokens": input, "completion_tokens": tokens,
                "total_tokens": input + tokens});
            last["tandem"] = serde_json::json!({"prefix_hit_tokens": {"l1": 0, "l2": input / 2, "l3": 0},
                "kv_bytes": u64::from(input) * 100, "prefill_worker": "p-0", "revision": "r1",
                "corrupt_chunks": 0, "spec_accept_length": 1.5});
            plan.push((delay, Ok(event(last))));
            plan.push((Duration::ZERO, Ok(Bytes::from_static(b"data: [DONE]\n\n"))));
            let mut f = fake.lock().unwrap();
            f.served += 1;
            f.kv_bytes += u64::from(input) * 100;
        }
    }
    futures::stream::iter(plan).then(|(delay, item)| async move {
        tokio::time::sleep(delay).await;
        item
    })
}

async fn report(State((fake, _)): State<(Shared, u16)>) -> Json<serde_json::Value> {
    let f = fake.lock().unwrap();
    Json(
        serde_json::json!({"ready": true, "role": "decode", "pool": "d", "revision": "r1",
        "degraded": [], "counters": {"requests_ok": f.served, "kv_bytes_received": f.kv_bytes}}),
    )
}

/// Starts one fake front door on 127.0.0.1 sharing `fake`; returns its address.
async fn start_fake(fake: Shared) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/report", get(report))
        .with_state((fake, addr.port()));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// A request with behaviour `code`, unique id `id`, at `ts` ms.
fn request(code: u64, id: u64, ts: u64, input: u32, output: u32) -> TraceRequest {
    let blocks = input.div_ceil(BLOCK_TOKENS) as usize;
    let mut hash_ids = vec![code, 1_000_000 + id];
    hash_ids.resize(blocks.max(2), 0);
    hash_ids.truncate(blocks.max(2));
    TraceRequest {
        timestamp: ts,
        input_length: input.max(BLOCK_TOKENS + 1),
        output_length: output,
        hash_ids,
    }
}

fn config(scale: f64) -> ReplayConfig {
    ReplayConfig {
        time_scale: scale,
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(40),
        attempt_timeout: Duration::from_secs(10),
        ..ReplayConfig::default()
    }
}

fn png_dims(path: &Path) -> (u32, u32) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    (info.width, info.height)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_times_retries_classifies_and_reports() {
    let fake: Shared = Arc::default();
    let a = start_fake(fake.clone()).await;
    let b = start_fake(fake.clone()).await;
    let targets = TargetSet::fixed(vec![format!("http://{a}"), format!("http://{b}")]);
    // Timestamps 0..=1600 ms, scale 0.5 → due 0..=800 ms.
    let codes = [
        NORMAL,
        UNAVAILABLE_ONCE,
        NORMAL,
        ALWAYS_UNAVAILABLE,
        DROP_ONCE,
        NORMAL,
        BUSY_ONCE,
        MALFORMED,
        ERROR_EVENT_ONCE,
    ];
    let workload: Vec<TraceRequest> = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| request(c, i as u64, i as u64 * 200, 1024 + i as u32 * 100, 6))
        .collect();
    let out = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let session = Session {
        reports: ReportSource::Fixed(vec![format!("http://{a}/report")]),
        sample_every: Duration::from_millis(100),
        out: out.path(),
        bar: None,
    };
    let summary = replay_and_report(&workload, "test".into(), &targets, &config(0.5), session)
        .await
        .unwrap();

    // Timing, seen from the server: first attempts arrive no earlier than their scaled times
    // (`started` precedes the replay clock's origin, so this bound is conservative for the client
    // but would still fail for a driver that sent everything at once: the last is due at 800 ms).
    let f = fake.lock().unwrap();
    let first: Vec<Instant> = (0..codes.len() as u64)
        .map(|i| f.attempts[&(1_000_000 + i)][0].1)
        .collect();
    for (i, t) in first.iter().enumerate() {
        let due = Duration::from_millis(i as u64 * 100);
        assert!(
            t.duration_since(started) + Duration::from_millis(1) >= due,
            "request {i} early"
        );
    }
    // Retries went to the other front door.
    let ports: Vec<u16> = f.attempts[&1_000_001].iter().map(|a| a.0).collect();
    assert_eq!(ports.len(), 2);
    assert_ne!(ports[0], ports[1]);
    drop(f);

    let results: Vec<tandem_e2e::replay::RequestResult> =
        std::fs::read_to_string(out.path().join("requests.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let outcome: Vec<(Outcome, u32)> = results.iter().map(|r| (r.outcome, r.attempts)).collect();
    assert_eq!(
        outcome,
        vec![
            (Outcome::Ok, 1),
            (Outcome::Retried, 2),
            (Outcome::Ok, 1),
            (Outcome::Failed, 4),
            (Outcome::Retried, 2),
            (Outcome::Ok, 1),
            (Outcome::Retried, 2),
            (Outcome::Failed, 1),
            (Outcome::Retried, 2),
        ]
    );
    for r in &results {
        assert!(
            r.sent_ms + 1e-6 >= r.scheduled_ms,
            "request {} sent early",
            r.index
        );
        assert!((r.scheduled_ms - r.index as f64 * 100.0).abs() < 1e-6);
        if r.outcome != Outcome::Failed {
            assert!(r.ttft_ms.unwrap() >= TTFT.as_millis() as f64 - 1.0);
            // TPOT is measured (not a timing bound: under load the first token can arrive late and
            // the next ones bunched behind it, so inter-token gaps shrink below the server's sleep).
            assert!(
                r.tpot_ms.is_some_and(|t| t > 0.0),
                "request {} has no TPOT",
                r.index
            );
            assert_eq!(r.completion_tokens, 6);
        }
    }
    assert!(results[3].errors.iter().all(|e| e.contains("503")));
    assert_eq!(results[7].errors.len(), 1, "{:?}", results[7].errors);
    assert!(
        results[7].errors[0]
            .ends_with("HTTP 400: context_length_exceeded: the prompt can never fit"),
        "{:?}",
        results[7].errors
    );
    assert!(
        results[4].errors[0].contains("stream"),
        "{:?}",
        results[4].errors
    );
    assert!(
        results[8].errors[0].contains("spec_guard_anomaly"),
        "{:?}",
        results[8].errors
    );

    // Summary and results.json.
    assert_eq!(
        (
            summary.requests.ok,
            summary.requests.retried,
            summary.requests.failed
        ),
        (3, 4, 2)
    );
    assert!(!summary.passed(), "lost requests must fail the run");
    assert!(
        (summary.hit_ratio.l2 - 0.5).abs() < 0.01,
        "{:?}",
        summary.hit_ratio
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    for key in ["ok", "retried", "failed", "retries"] {
        assert!(json["requests"][key].is_u64(), "requests.{key}");
    }
    for key in ["p50", "p90", "p99"] {
        assert!(json["ttft_ms"][key].as_f64().unwrap() >= 29.0);
        assert!(json["tpot_ms"][key].as_f64().unwrap() > 0.0);
    }
    for key in ["l1", "l2", "l3", "total"] {
        assert!(json["hit_ratio"][key].is_f64());
    }
    assert!(!json["over_time"].as_array().unwrap().is_empty());
    assert_eq!(json["worker_counters"]["corrupt_pages_read"], 0);
    assert!(
        json["worker_counters"]["kv_bytes_received"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(json["kv"]["bytes_in_responses"].as_u64().unwrap() > 0);
    assert_eq!(json["worker_counters"]["requests_ok"], 7);
    let checks = json["checks"].as_array().unwrap();
    let lost = checks
        .iter()
        .find(|c| c["name"].as_str().unwrap().contains("lost"))
        .unwrap();
    assert_eq!(lost["passed"], false);

    // `TANDEM_E2E_KEEP_REPLAY_OUT=DIR` keeps the report of this run for a look at the plots.
    if let Some(keep) = std::env::var_os("TANDEM_E2E_KEEP_REPLAY_OUT") {
        std::fs::create_dir_all(&keep).unwrap();
        for e in std::fs::read_dir(out.path()).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), Path::new(&keep).join(e.file_name())).unwrap();
        }
    }
    // Plots exist and decode as PNG.
    assert_eq!(json["plots"].as_array().unwrap().len(), 3);
    for p in ["latency.png", "hit_ratio.png", "throughput.png"] {
        let (w, h) = png_dims(&out.path().join(p));
        assert!(w >= 1000 && h >= 400, "{p}: {w}x{h}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_run_passes_and_concurrency_limit_holds() {
    let fake: Shared = Arc::default();
    let a = start_fake(fake.clone()).await;
    let targets = TargetSet::fixed(vec![format!("http://{a}")]);
    let workload: Vec<TraceRequest> = (0..12).map(|i| request(NORMAL, i, 0, 2048, 4)).collect();
    let out = tempfile::tempdir().unwrap();
    let cfg = ReplayConfig {
        concurrency_limit: Some(2),
        ..config(1.0)
    };
    let session = Session {
        reports: ReportSource::Fixed(vec![]),
        sample_every: Duration::from_millis(100),
        out: out.path(),
        bar: None,
    };
    let summary = replay_and_report(&workload, "test".into(), &targets, &cfg, session)
        .await
        .unwrap();
    assert!(summary.passed(), "{summary}");
    assert_eq!(summary.requests.ok, 12);
    // 12 requests, 2 at a time, each ≥ TTFT + 3 × TPOT: at least 6 rounds.
    let min = 6.0 * (TTFT + 3 * TPOT).as_secs_f64() * 1000.0;
    assert!(
        summary.duration_ms >= min,
        "{} < {min}",
        summary.duration_ms
    );
}

#[tokio::test]
async fn no_target_means_failed_not_hung() {
    let workload = vec![request(NORMAL, 0, 0, 1024, 2)];
    let results = tandem_e2e::replay::replay(
        &workload,
        &TargetSet::default(),
        &config(1.0),
        tandem_e2e::replay::Clock::start(),
        None,
        None,
    )
    .await;
    assert_eq!(results[0].outcome, Outcome::Failed);
    assert_eq!(results[0].attempts, 4);
}

#[test]
fn plots_without_a_font_still_decode() {
    let results: Vec<tandem_e2e::replay::RequestResult> = Vec::new();
    let summary = tandem_e2e::report::summarize_run(tandem_e2e::report::ReportInput {
        source: "empty".into(),
        time_scale: 1.0,
        unbounded_hit_ratio: 0.0,
        ceiling_hit_tokens: &[],
        results: &results,
        samples: &[],
        events: &[tandem_e2e::report::Event::new(10.0, "restart", "x")],
        teardown: None,
    });
    let out = tempfile::tempdir().unwrap();
    let files =
        tandem_e2e::report::plots::write_plots(out.path(), &results, &summary, false).unwrap();
    for f in files {
        png_dims(&out.path().join(f));
    }
}

fn real_trace() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/mooncake/conversation_trace.jsonl");
    let alt = PathBuf::from("/work/shared/data/mooncake/conversation_trace.jsonl");
    [p, alt].into_iter().find(|p| p.is_file())
}

#[test]
fn trace_loader_on_the_real_trace() {
    let Some(path) = real_trace() else {
        assert!(
            std::env::var_os("TANDEM_REQUIRE_DATA").is_none_or(|v| v != "1"),
            "TANDEM_REQUIRE_DATA=1 and the Mooncake trace is not in shared/data"
        );
        eprintln!("skipped: the Mooncake trace is not in shared/data");
        return;
    };
    let head = workload::load_trace(&path, Some(200)).unwrap();
    assert_eq!(head.len(), 200);
    assert_eq!(head[0].input_length, 6758);
    assert_eq!(head[0].output_length, 500);
    assert_eq!(head[0].hash_ids, (0..14).collect::<Vec<u64>>());
    assert_eq!(head[1].hash_ids[0], 0, "requests share the first block");

    // The README's figures, on the whole file.
    let all = workload::load_trace(&path, None).unwrap();
    assert_eq!(all.len(), 12_031);
    let n = all.len() as f64;
    let avg_in = all.iter().map(|r| f64::from(r.input_length)).sum::<f64>() / n;
    let avg_out = all.iter().map(|r| f64::from(r.output_length)).sum::<f64>() / n;
    assert!((avg_in - 12_035.06).abs() < 0.01, "{avg_in}");
    assert!((avg_out - 342.62).abs() < 0.01, "{avg_out}");
    assert_eq!(all.iter().map(|r| r.input_length).max(), Some(126_195));
    assert_eq!(all.iter().map(|r| r.output_length).max(), Some(2_000));
    assert_eq!(all.last().unwrap().timestamp, 3_536_999);
    let refs: usize = all.iter().map(|r| r.hash_ids.len()).sum();
    assert_eq!(refs, 288_500);
    let distinct: std::collections::HashSet<u64> = all
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    assert_eq!(distinct.len(), 182_790);
    let ratio = workload::unbounded_hit_ratio(&all);
    assert!((ratio - 0.374).abs() <= 0.001, "{ratio}");
}

#[test]
fn trace_loader_rejects_malformed_lines() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.jsonl");
    std::fs::write(&p, "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\n{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n").unwrap();
    let err = workload::load_trace(&p, None).unwrap_err().to_string();
    assert!(err.contains(":3:") && err.contains("goes back"), "{err}");
    std::fs::write(
        &p,
        "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    assert!(
        workload::load_trace(&p, None)
            .unwrap_err()
            .to_string()
            .contains("want 2")
    );
    assert_eq!(workload::load_trace(&p, Some(0)).unwrap().len(), 0);
}
