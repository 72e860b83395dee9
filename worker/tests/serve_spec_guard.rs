//! The speculative-decoding anomaly guard end to end (DESIGN contract 8, seed 004): real prefill and
//! decode processes, the simulated draft made anomalous with the test-only `TANDEM_SIM_SPEC_FAULT`.
//!
//! - A guarded decode aborts the faulty attempt after `afterTokens` tokens, releases its pages
//!   through the gate, retries on the other prefill peer and serves the request; the abort is
//!   visible in the response, `/report` and `/metrics`.
//! - Beyond the retry budget the client gets 503 `spec_guard_anomaly` with the reason; a stream
//!   ends with that error and no `[DONE]`.
//! - Negative control: the same fault on a decode without `specGuard` streams the whole garbage
//!   response, and [`guard_caught`] — the check the guarded tests rely on — says so.
//! - The KV pages of a request stay held while it decodes and return to the pool after.

mod serve_support;

use std::time::Duration;

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::{SpecGuard, Speculative, WorkerConfig, WorkerRole};

const MAX_TOKENS: u32 = 300;

fn decode_config(w: &World, guard: Option<SpecGuard>) -> WorkerConfig {
    let mut c = config(WorkerRole::Decode, "r1", w.ports);
    c.speculative = Some(Speculative {
        draft_model: c.model.clone(),
        draft_tokens: 4,
    });
    c.memory.draft_pool_bytes = 16 << 20;
    c.memory.segment_bytes = c.memory.target_pool_bytes + c.memory.draft_pool_bytes;
    c.spec_guard = guard;
    c
}

fn seed_004_guard(retry_budget: u32) -> SpecGuard {
    SpecGuard {
        min_accept_length: 1.4,
        max_accept_rate: 0.96,
        after_tokens: 128,
        retry_budget,
    }
}

async fn ready(w: &World, host: u8) {
    let health = w.addr(host, w.ports.health);
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
}

async fn post(w: &World, host: u8, stream: bool) -> (u16, String) {
    let (code, frames) = http(
        w.addr(host, w.ports.front),
        "POST",
        "/v1/completions",
        Some(completion(600, MAX_TOKENS, stream)),
    )
    .await;
    (code, text(&frames))
}

/// Whether a non-streamed completion shows the guard at work: an anomaly recorded and, if the
/// request was served, an accept length that is not itself anomalous. `Err` says what let the
/// bad output through.
fn guard_caught(code: u16, body: &Value) -> Result<(), String> {
    let sg = &body["tandem"]["spec_guard"];
    if sg["enabled"] != true {
        return Err(format!("guard not enabled: {body}"));
    }
    if sg["aborts"].as_u64().unwrap_or(0) == 0 {
        return Err(format!("no attempt aborted: {body}"));
    }
    if code == 200 {
        let len = body["tandem"]["spec_accept_length"].as_f64().unwrap_or(0.0);
        if len < 1.4 {
            return Err(format!("served an anomalous decode (accept length {len})"));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_aborts_an_anomalous_decode_and_retries_or_refuses() {
    let w = World::new(61);
    w.publish(&[2, 3]);
    let _p2 = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _p3 = w.spawn(3, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    // Host 9: the first attempt of every request rejects almost every draft token; budget 2.
    let _d9 = w.spawn(
        9,
        &decode_config(&w, Some(seed_004_guard(2))),
        &[("TANDEM_SIM_SPEC_FAULT", "low_accept:1")],
    );
    // Host 10: every attempt accepts every draft token; budget 1.
    let _d10 = w.spawn(
        10,
        &decode_config(&w, Some(seed_004_guard(1))),
        &[("TANDEM_SIM_SPEC_FAULT", "high_accept")],
    );
    ready(&w, 9).await;
    ready(&w, 10).await;
    // Both peers connected, so the retry has another one to go to.
    until(Duration::from_secs(10), || async {
        let (_, r) = get_json(w.addr(9, w.ports.health), "/report").await;
        r["peers"].as_array().is_some_and(|p| p.len() == 2)
    })
    .await;

    // Aborted after 128 tokens, retried on the other peer, served whole.
    let (code, body) = post(&w, 9, false).await;
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    guard_caught(code, &v).unwrap();
    let sg = &v["tandem"]["spec_guard"];
    assert_eq!(
        (sg["aborts"].as_u64(), sg["retries"].as_u64()),
        (Some(1), Some(1)),
        "{sg}"
    );
    let a = &sg["anomalies"][0];
    assert_eq!(a["reason"], "low_accept_length");
    let tripped_at = a["tokens"].as_u64().unwrap();
    assert!((128..133).contains(&tripped_at), "{a}");
    assert!(a["accept_length"].as_f64().unwrap() < 1.4, "{a}");
    assert_ne!(
        a["prefill_worker"], v["tandem"]["prefill_worker"],
        "retried on another peer"
    );
    assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS);
    let words = v["choices"][0]["text"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .count();
    assert_eq!(words, MAX_TOKENS as usize, "the retry's text only");
    assert!(v["tandem"]["spec_accept_length"].as_f64().unwrap() > 2.0);

    let (_, r) = get_json(w.addr(9, w.ports.health), "/report").await;
    let c = &r["counters"];
    assert_eq!(
        (
            c["spec_guard_aborts"].as_u64(),
            c["spec_guard_retries"].as_u64()
        ),
        (Some(1), Some(1)),
        "{r}"
    );
    assert_eq!(c["requests_ok"], 1);
    assert_eq!(c["pages_quarantined"], 0);
    assert_eq!(r["spec_guard"]["enabled"], true);
    assert_eq!(
        r["spec_guard"]["anomalies_by_reason"]["low_accept_length"],
        1
    );
    assert_eq!(
        r["spec_guard"]["anomalies_by_reason"]["high_accept_rate"],
        0
    );
    // Both attempts' pages are back in the pool (the aborted one through the gate).
    assert_eq!(r["kv_pages"]["held"], 0, "{r}");
    assert_eq!(r["kv_pages"]["quarantined"], 0, "{r}");
    let (_, m) = http(w.addr(9, w.ports.health), "GET", "/metrics", None).await;
    let m = text(&m);
    assert!(
        m.contains(r#"tandem_spec_guard_anomalies_total{reason="low_accept_length"} 1"#),
        "{m}"
    );
    assert!(m.contains("tandem_spec_guard_aborts_total 1"), "{m}");
    assert!(m.contains("tandem_spec_guard_retries_total 1"), "{m}");

    // Every attempt anomalous: after 1 retry the client gets 503 spec_guard_anomaly.
    let (code, body) = post(&w, 10, false).await;
    assert_eq!(code, 503, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "spec_guard_anomaly");
    assert_eq!(v["error"]["reason"], "high_accept_rate");
    guard_caught(code, &v).unwrap();
    assert_eq!(v["tandem"]["spec_guard"]["aborts"], 2);
    assert_eq!(v["tandem"]["spec_guard"]["retries"], 1);

    // Streamed: the tokens before the trip went out; the stream ends with the error, no [DONE].
    let (code, body) = post(&w, 10, true).await;
    assert_eq!(code, 200);
    let events = sse_events(&body);
    assert_ne!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "spec_guard_anomaly");
    assert_eq!(last["error"]["reason"], "high_accept_rate");
    // The tripping step's tokens are withheld: 1 + 125 of the 130 judged tokens went out.
    let tokens = events.len() - 1;
    assert!((124..=200).contains(&tokens), "{tokens} tokens streamed");

    let (_, r) = get_json(w.addr(10, w.ports.health), "/report").await;
    let c = &r["counters"];
    assert_eq!(c["spec_guard_aborts"], 3, "{r}");
    assert_eq!(c["spec_guard_retries"], 1, "{r}");
    assert_eq!(c["requests_failed"], 2, "{r}");
    assert_eq!(
        r["spec_guard"]["anomalies_by_reason"]["high_accept_rate"],
        3
    );
    assert_eq!(r["kv_pages"]["held"], 0, "{r}");
}

/// Negative control: without `specGuard` the same fault goes unnoticed and the garbage is served.
/// Also: a request's pages stay held while it decodes and are freed after its last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_guard_the_anomalous_output_goes_through() {
    let w = World::new(62);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(
        9,
        &decode_config(&w, None),
        &[
            ("TANDEM_SIM_SPEC_FAULT", "low_accept"),
            ("TANDEM_SIM_TPOT_MS", "4"),
        ],
    );
    ready(&w, 9).await;
    let health = w.addr(9, w.ports.health);

    let (code, body) = post(&w, 9, false).await;
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let words = v["choices"][0]["text"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .count();
    assert_eq!(
        words, MAX_TOKENS as usize,
        "the whole anomalous response was served"
    );
    assert!(v["tandem"]["spec_accept_length"].as_f64().unwrap() < 1.4);
    let verdict = guard_caught(code, &v);
    assert!(
        verdict.is_err(),
        "the check must fail without the guard: {verdict:?}"
    );

    // While a stream decodes, its pages are held; after its last token they are free again.
    let w2 = &w;
    let streaming = tokio::spawn({
        let front = w2.addr(9, w2.ports.front);
        async move {
            http(
                front,
                "POST",
                "/v1/completions",
                Some(completion(600, MAX_TOKENS, true)),
            )
            .await
        }
    });
    until(Duration::from_secs(5), || async {
        let (_, r) = get_json(health, "/report").await;
        r["kv_pages"]["held"].as_u64().unwrap_or(0) > 0
    })
    .await;
    let (code, frames) = streaming.await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        sse_events(&text(&frames)).last().map(String::as_str),
        Some("[DONE]")
    );
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["kv_pages"]["held"], 0, "{r}");
    assert_eq!(r["spec_guard"]["enabled"], false);
    assert_eq!(r["counters"]["spec_guard_aborts"], 0);
    assert_eq!(r["counters"]["requests_ok"], 2);
}
