//! The serving processes end to end: `tandem-worker prefill --config` and `decode --config` as real
//! processes on their own loopback addresses (like the e2e process runner), peers found through a
//! `$TANDEM_HOSTS_FILE`, configs read through `$TANDEM_ROOT`, and completions through the front door.
//!
//! Each test uses its own `127.0.<net>.x` addresses so tests run in parallel without port clashes.

mod serve_support;

use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::{CONFIG_FILE, TransportChoice, WorkerRole};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_plain_completions_through_prefill_and_decode() {
    let w = World::new(41);
    w.publish(&[2]);
    let p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    // A 64 GiB host pool in the config: the receive region is capped and touched lazily.
    let mut dcfg = config(WorkerRole::Decode, "r1", w.ports);
    dcfg.memory.target_pool_bytes = 64 << 30;
    dcfg.memory.segment_bytes = 64 << 30;
    let d = w.spawn(9, &dcfg, &[]);
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;

    // Streaming: token events in order, then the last event with usage and tandem, then [DONE].
    let sent = Instant::now();
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(1200, 20, true)),
    )
    .await;
    assert_eq!(code, 200, "{}", text(&frames));
    let events = sse_events(&text(&frames));
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let parsed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (last, tokens) = parsed.split_last().unwrap();
    assert_eq!(tokens.len(), 20);
    assert!(
        tokens
            .iter()
            .all(|t| t["choices"][0]["finish_reason"].is_null()
                && !t["choices"][0]["text"].as_str().unwrap().is_empty())
    );
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["prompt_tokens"], 1200);
    assert_eq!(last["usage"]["completion_tokens"], 20);
    assert_eq!(last["usage"]["total_tokens"], 1220);
    let t = &last["tandem"];
    assert_eq!(t["corrupt_chunks"], 0);
    assert_eq!(t["revision"], "r1");
    assert_eq!(t["prefill_worker"], w.addr(2, w.ports.control).to_string());
    // 1200 tokens = 3 pages of 512 tokens × 8 layers × 64 B per token-layer.
    assert_eq!(t["kv_bytes"], 3 * 512 * 8 * 64);
    // The first token arrives before the last, and TTFT precedes the remaining TPOTs.
    let first = frames.first().unwrap().0;
    assert!(first >= sent && first <= frames.last().unwrap().0);

    // Not streaming: one object with the same fields.
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(100, 5, false)),
    )
    .await;
    assert_eq!(code, 200);
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        5
    );
    assert_eq!(v["tandem"]["corrupt_chunks"], 0);

    // Malformed → 400 with the error object; models lists the model.
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(serde_json::json!({"max_tokens": "x"})),
    )
    .await;
    assert_eq!(code, 400);
    let e: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(e["error"]["code"], "malformed");
    let (code, m) = get_json(front, "/v1/models").await;
    assert_eq!(
        (code, m["data"][0]["id"].as_str()),
        (200, Some("llama-3-8b"))
    );

    // Reports: decode and prefill counters agree with what was served.
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["role"], "decode");
    assert_eq!(r["ready"], true);
    assert_eq!(r["counters"]["requests_ok"], 2);
    assert_eq!(r["counters"]["corrupt_pages_read"], 0);
    assert_eq!(r["counters"]["kv_bytes_received"], 4 * 512 * 8 * 64);
    let (_, pr) = get_json(w.addr(2, w.ports.health), "/report").await;
    assert_eq!(pr["role"], "prefill");
    assert_eq!(pr["counters"]["kv_bytes_sent"], 4 * 512 * 8 * 64);
    assert_eq!(pr["counters"]["prefix_lookup_tokens"], 1300);
    let (code, metrics) = http(health, "GET", "/metrics", None).await;
    assert_eq!(code, 200);
    assert!(text(&metrics).contains("tandem_requests_ok_total 2"));
    // worker/interfaces/README.md §2: worker RSS stays under 300 MiB.
    for (name, proc) in [("prefill", &p), ("decode", &d)] {
        let rss = proc.rss_mib();
        assert!(rss > 0 && rss < 300, "{name} RSS {rss} MiB");
    }
}

/// Seed 004: a request whose KV misses its deadline is aborted through the release protocol —
/// the prefill acks, no page is quarantined, and the pages serve the next request intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_deadline_aborts_the_room_through_the_release_protocol() {
    let r = kv_deadline_abort(47, "fence").await;
    assert_eq!(r["release_gate"]["proof"], "fence", "{r}");
    // Over TCP with the fence as proof, the fence or the ack frees the pages, whichever is first.
    assert_eq!(
        r["rooms"]["freed_on_ack"].as_u64().unwrap()
            + r["rooms"]["freed_on_transport"].as_u64().unwrap(),
        1,
        "{r}"
    );
}

/// The gate's ack-only mode (the proof rule RDMA needs, selected over TCP with
/// `TANDEM_DECODE_GATE_PROOF=ack-only`): the aborted room's pages come back on the prefill's ack and
/// never on the receiver's fence, and the next request reads intact KV from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_only_gate_frees_an_aborted_room_on_the_prefill_ack() {
    let r = kv_deadline_abort(141, "ack-only").await;
    assert_eq!(r["release_gate"]["proof"], "ack-only", "{r}");
    assert_eq!(r["rooms"]["freed_on_ack"], 1, "{r}");
    assert_eq!(r["rooms"]["freed_on_transport"], 0, "{r}");
}

/// `TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN`: the KV deadline grows with the prompt, so a long
/// prompt that computes at the prefill's speed is not aborted by a deadline meant for queueing;
/// with a per-token budget below the prefill's speed, the same prompt is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_deadline_grows_with_the_prompt() {
    let w = World::new(143);
    w.publish(&[2]);
    let _p = w.spawn(
        2,
        &config(WorkerRole::Prefill, "r1", w.ports),
        &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", "1000")],
    );
    let env = |per_token| {
        [
            ("TANDEM_DECODE_KV_DEADLINE_MS", "200"),
            ("TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN", per_token),
        ]
    };
    // 1024 tokens at 1 ms each: 200 ms + 1024 × 3 ms covers it, 200 ms + 1024 × 0.1 ms does not.
    let _spared = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &env("3000"));
    let _tight = w.spawn(8, &config(WorkerRole::Decode, "r1", w.ports), &env("100"));
    for (id, want, block) in [(9, 200, 21), (8, 503, 31)] {
        let health = w.addr(id, w.ports.health);
        until(Duration::from_secs(15), || async {
            status(health, "/readyz").await == Some(200)
        })
        .await;
        // Distinct prefixes: the second prompt must not hit what the first one computed.
        let mut body = completion(1024, 2, false);
        body["kv_block_hashes"] = serde_json::json!([block, block + 1]);
        let (code, frames) = http(
            w.addr(id, w.ports.front),
            "POST",
            "/v1/completions",
            Some(body),
        )
        .await;
        assert_eq!(code, want, "decode {id}: {}", text(&frames));
    }
    // A request's own `kv_deadline_ms` (the demo's abort probe) shortens the spared decode's
    // deadline for that request only; 0 is refused.
    let front = w.addr(9, w.ports.front);
    let mut probe = completion(1024, 2, false);
    probe["kv_block_hashes"] = serde_json::json!([41, 42]);
    probe["kv_deadline_ms"] = serde_json::json!(50);
    let (code, frames) = http(front, "POST", "/v1/completions", Some(probe.clone())).await;
    assert_eq!(code, 503, "{}", text(&frames));
    assert!(
        text(&frames).contains("kv_deadline_exceeded"),
        "{}",
        text(&frames)
    );
    probe["kv_deadline_ms"] = serde_json::json!(0);
    let (code, frames) = http(front, "POST", "/v1/completions", Some(probe)).await;
    assert_eq!(code, 400, "{}", text(&frames));
    assert!(
        text(&frames).contains("kv_deadline_ms"),
        "{}",
        text(&frames)
    );
}

/// Runs the KV-deadline abort of seed 004 with the given gate proof on loopback net `net`; returns
/// the decode's `/report` after the aborted room's pages served the next request intact.
async fn kv_deadline_abort(net: u8, proof: &str) -> Value {
    let w = World::new(net);
    w.publish(&[2]);
    let _p = w.spawn(
        2,
        &config(WorkerRole::Prefill, "r1", w.ports),
        &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", "2000")],
    );
    let _d = w.spawn(
        9,
        &config(WorkerRole::Decode, "r1", w.ports),
        &[
            ("TANDEM_DECODE_KV_DEADLINE_MS", "300"),
            ("TANDEM_DECODE_GATE_PROOF", proof),
        ],
    );
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    // 2048 tokens at 2 ms each: far past the 300 ms deadline.
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(2048, 2, true)),
    )
    .await;
    assert_eq!(code, 503, "{}", text(&frames));
    let e: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(e["error"]["code"], "kv_deadline_exceeded");
    until(Duration::from_secs(10), || async {
        let (_, r) = get_json(health, "/report").await;
        r["counters"]["abort_acks"] == 1
    })
    .await;
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["counters"]["rooms_aborted"], 1, "{r}");
    assert_eq!(r["counters"]["pages_quarantined"], 0, "{r}");
    let (_, pr) = get_json(w.addr(2, w.ports.health), "/report").await;
    assert_eq!(pr["counters"]["rooms_aborted"], 1, "{pr}");
    assert_eq!(pr["counters"]["abort_acks"], 1, "{pr}");
    // A short prompt fits the deadline and reads intact KV from the reused pages.
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(20, 2, false)),
    )
    .await;
    assert_eq!(code, 200, "{}", text(&frames));
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(v["tandem"]["corrupt_chunks"], 0);
    get_json(health, "/report").await.1
}

/// `transport: rdma` on a machine without a usable RDMA device (this one; and no build serves KV
/// over RDMA yet): both roles start, say why in `/readyz` and `/report`, and never become Ready;
/// the decode's front door refuses requests. The same world with `transport: tcp` serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_rdma_without_a_usable_device_is_never_ready_and_says_why() {
    let w = World::new(142);
    w.publish(&[2]);
    let with = |role, transport| {
        let mut c = config(role, "r1", w.ports);
        c.transport = transport;
        c
    };
    let _p = w.spawn(2, &with(WorkerRole::Prefill, TransportChoice::Rdma), &[]);
    let _d = w.spawn(9, &with(WorkerRole::Decode, TransportChoice::Rdma), &[]);
    for id in [2, 9] {
        let health = w.addr(id, w.ports.health);
        until(Duration::from_secs(15), || async {
            get_json(health, "/report").await.1["transport"]["in_use"] == "none"
        })
        .await;
        let (_, r) = get_json(health, "/report").await;
        assert_eq!(r["ready"], false, "{r}");
        assert_eq!(r["transport"]["requested"], "rdma", "{r}");
        // The built-in engine allocates no pool through the allocator: the report says so.
        assert!(
            r["config"]["unused"]
                .as_array()
                .is_some_and(|u| u.iter().any(|f| f["field"] == "memory.allocator")),
            "{r}"
        );
        let reason = r["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("RDMA"), "{r}");
        assert!(
            r["degraded"]
                .as_array()
                .is_some_and(|d| d.iter().any(|x| x["code"] == "TransportUnavailable")),
            "{r}"
        );
        assert_eq!(status(health, "/readyz").await, Some(503));
        let (_, m) = http(health, "GET", "/metrics", None).await;
        assert!(
            text(&m).contains("tandem_transport_in_use{transport=\"none\"} 1"),
            "{}",
            text(&m)
        );
    }
    let (code, _) = http(
        w.addr(9, w.ports.front),
        "POST",
        "/v1/completions",
        Some(completion(100, 2, false)),
    )
    .await;
    assert_eq!(code, 503);
    // Control: in the same world, a TCP prefill and an `Auto` decode (TCP here, logged) become
    // Ready and serve, so the refusal above is the transport's.
    let _p3 = w.spawn(3, &with(WorkerRole::Prefill, TransportChoice::Tcp), &[]);
    w.publish(&[3]);
    let _d8 = w.spawn(8, &with(WorkerRole::Decode, TransportChoice::Auto), &[]);
    let h8 = w.addr(8, w.ports.health);
    until(Duration::from_secs(15), || async {
        status(h8, "/readyz").await == Some(200)
    })
    .await;
    let (_, r) = get_json(h8, "/report").await;
    assert_eq!(r["transport"]["in_use"], "tcp", "{r}");
    assert!(
        r["transport"]["reason"]
            .as_str()
            .unwrap()
            .starts_with("Auto:"),
        "{r}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_refuses_a_prefill_of_another_revision() {
    let w = World::new(42);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r2", w.ports), &[]);
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    let health = w.addr(9, w.ports.health);
    until(Duration::from_secs(15), || async {
        get_json(health, "/report").await.1["counters"]["peer_revision_refusals"] == 1
    })
    .await;
    assert_eq!(status(health, "/readyz").await, Some(503));
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["ready"], false);
    assert!(r["reason"].as_str().unwrap().contains("revision"), "{r}");
    let (code, frames) = http(
        w.addr(9, w.ports.front),
        "POST",
        "/v1/completions",
        Some(completion(100, 2, true)),
    )
    .await;
    assert_eq!(code, 503);
    let e: Value = serde_json::from_str(&text(&frames)).unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("\"r2\"") && msg.contains("\"r1\""), "{msg}");

    // Negative control: an unversioned decode (empty revision) pairs with the same prefill, so
    // the refusal above is the revision check and nothing else.
    let _any = w.spawn(8, &config(WorkerRole::Decode, "", w.ports), &[]);
    let h8 = w.addr(8, w.ports.health);
    until(Duration::from_secs(15), || async {
        status(h8, "/readyz").await == Some(200)
    })
    .await;
    let (code, _) = http(
        w.addr(8, w.ports.front),
        "POST",
        "/v1/completions",
        Some(completion(100, 2, false)),
    )
    .await;
    assert_eq!(code, 200);
}

/// `TANDEM_DECODE_ROUTING` (issue 16 item 2): a decode reports the routing policy it was started
/// with in `/report.routing` (least-work by default), and a bad value refuses the start, naming the
/// variable and the values it takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_reports_its_routing_policy_and_refuses_a_bad_one() {
    let w = World::new(149);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let mut decodes = Vec::new();
    for (host, value, want) in [
        (7, None, serde_json::json!({"policy": "least-work"})),
        (
            8,
            Some("round-robin"),
            serde_json::json!({"policy": "round-robin"}),
        ),
        (
            9,
            Some("affinity:3"),
            serde_json::json!({"policy": "affinity", "max_skew": 3}),
        ),
    ] {
        let env: Vec<(&str, &str)> = value
            .map(|v| vec![("TANDEM_DECODE_ROUTING", v)])
            .unwrap_or_default();
        decodes.push(w.spawn(host, &config(WorkerRole::Decode, "r1", w.ports), &env));
        let (code, r) = get_json(w.addr(host, w.ports.health), "/report").await;
        assert_eq!((code, &r["routing"]), (200, &want), "{value:?}: {r}");
    }

    // A bad value: the process exits non-zero before serving, and says why on stderr.
    let root = w.root(10);
    std::fs::create_dir_all(root.join("etc/tandem")).unwrap();
    std::fs::write(
        root.join("etc/tandem").join(CONFIG_FILE),
        serde_json::to_vec(&config(WorkerRole::Decode, "r1", w.ports)).unwrap(),
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["decode", "--config", &format!("/etc/tandem/{CONFIG_FILE}")])
        .env("TANDEM_ROOT", &root)
        .env("TANDEM_HOSTS_FILE", w.hosts())
        .env("POD_IP", w.ip(10))
        .env("TANDEM_DECODE_ROUTING", "affinty")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains("TANDEM_DECODE_ROUTING=\"affinty\"") && stderr.contains("round-robin"),
        "{stderr}"
    );
}

/// Two prefill peers, the first (picked first) slow; kills it while it computes a request sent
/// to a decode with `retry_budget`; returns the status, the body and the decode's report.
async fn kill_the_prefill_mid_request(net: u8, retry_budget: &str) -> (u16, Value, Value) {
    let w = World::new(net);
    w.publish(&[2, 3]);
    // .2 sorts first and is picked first (the request below carries no prompt hashes, so there is
    // no prefix to be affine to and idle peers take turns); it computes slowly (4 ms per token)
    // and is killed.
    let slow = w.spawn(
        2,
        &config(WorkerRole::Prefill, "r1", w.ports),
        &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", "4000")],
    );
    let _fast = w.spawn(3, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(
        9,
        &config(WorkerRole::Decode, "r1", w.ports),
        &[("TANDEM_DECODE_RETRY_BUDGET", retry_budget)],
    );
    let health = w.addr(9, w.ports.health);
    until(Duration::from_secs(15), || async {
        get_json(health, "/report").await.1["peers"]
            .as_array()
            .map_or(0, Vec::len)
            == 2
    })
    .await;
    let front = w.addr(9, w.ports.front);
    let mut body = completion(2048, 3, false);
    body.as_object_mut().unwrap().remove("kv_block_hashes");
    let req = tokio::spawn(async move { http(front, "POST", "/v1/completions", Some(body)).await });
    // The slow prefill has the room (it looked the prompt up): kill it while it computes.
    let slow_health = w.addr(2, w.ports.health);
    until(Duration::from_secs(10), || async {
        get_json(slow_health, "/report").await.1["counters"]["prefix_lookup_tokens"]
            .as_u64()
            .is_some_and(|t| t >= 2048)
    })
    .await;
    assert!(
        !req.is_finished(),
        "the slow prefill must still be computing"
    );
    slow.signal(libc::SIGKILL);
    let (code, frames) = tokio::time::timeout(Duration::from_secs(20), req)
        .await
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    if code == 200 {
        assert_eq!(
            v["tandem"]["prefill_worker"],
            w.addr(3, w.ports.control).to_string()
        );
    }
    let (_, r) = get_json(health, "/report").await;
    (code, v, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_prefill_dies_is_retried_on_another_peer() {
    let (code, v, r) = kill_the_prefill_mid_request(43, "2").await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0);
    assert_eq!(r["counters"]["requests_retried"], 1, "{r}");
    assert_eq!(r["counters"]["rooms_aborted"], 1, "{r}");
}

/// Negative control: without a retry budget the same failure reaches the client — as a 503
/// (transient: the client may retry on another decode), never as a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_retry_budget_the_peer_failure_fails_the_request() {
    let (code, v, r) = kill_the_prefill_mid_request(45, "0").await;
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["error"]["code"], "prefill_unavailable");
    assert_eq!(r["counters"]["requests_retried"], 0, "{r}");
    assert_eq!(r["counters"]["requests_failed"], 1, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_turns_readiness_off_finishes_in_flight_work_and_exits_zero() {
    let w = World::new(44);
    w.publish(&[2]);
    let mut p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let mut d = w.spawn(
        9,
        &config(WorkerRole::Decode, "r1", w.ports),
        &[("TANDEM_SIM_TPOT_MS", "5")],
    );
    let health = w.addr(9, w.ports.health);
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    // 300 tokens at 5 ms: about 1.5 s of streaming in flight when SIGTERM lands.
    let front = w.addr(9, w.ports.front);
    let req = tokio::spawn(async move {
        http(
            front,
            "POST",
            "/v1/completions",
            Some(completion(600, 300, true)),
        )
        .await
    });
    // The KV arrived (observed in /report): the request is streaming its tokens now.
    until(Duration::from_secs(10), || async {
        get_json(health, "/report").await.1["counters"]["kv_bytes_received"]
            .as_u64()
            .is_some_and(|b| b > 0)
    })
    .await;
    assert!(!req.is_finished(), "the response is still streaming");
    d.signal(libc::SIGTERM);
    until(Duration::from_secs(2), || async {
        status(health, "/readyz").await == Some(503)
    })
    .await;
    let (code, _) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(100, 1, false)),
    )
    .await;
    assert_eq!(code, 503, "admission stops while draining");
    let (code, frames) = req.await.unwrap();
    assert_eq!(code, 200);
    let events = sse_events(&text(&frames));
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "in-flight stream finished"
    );
    assert_eq!(events.len(), 302);
    let st = d.wait_exit(Duration::from_secs(10)).expect("decode exits");
    assert!(st.success(), "{st:?}");

    // Prefill: readiness off, exit 0.
    let ph = w.addr(2, w.ports.health);
    assert_eq!(status(ph, "/readyz").await, Some(200));
    p.signal(libc::SIGTERM);
    let st = p.wait_exit(Duration::from_secs(10)).expect("prefill exits");
    assert!(st.success(), "{st:?}");
}

/// The Standalone sidecar: `store-client --config` owns its socket on the pod's shared `/dev/shm`
/// (under `$TANDEM_ROOT`), serves health on `ports.health + 1`, and exits 0 on SIGTERM through its
/// ordered teardown, leaving no socket behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_client_sidecar_serves_from_the_worker_config() {
    use tandem_worker::memory::AllocatorDomain;
    use tandem_worker::store_client::ClientMode;
    let w = World::new(48);
    let mut cfg = config(WorkerRole::Prefill, "r1", w.ports);
    cfg.memory.allocator = AllocatorDomain::SharedMemory;
    cfg.memory.client_mode = Some(ClientMode::Standalone);
    cfg.cache = Some(tandem_worker::config::CacheConfig {
        tier: "l3".into(),
        service: "l3-store.serving.svc".into(),
        replicas: 1,
        page_tokens: 512,
        write_policy: tandem_worker::config::WritePolicy::WriteThrough,
    });
    std::fs::create_dir_all(w.root(2).join("dev/shm")).unwrap();
    let mut sc = w.spawn_role(
        2,
        "store-client",
        tandem_worker::config::CONFIG_FILE,
        &serde_json::to_vec(&cfg).unwrap(),
        &[],
    );
    let socket = w.root(2).join("dev/shm/tandem-store-client.sock");
    assert!(socket.exists());
    let health = w.addr(2, w.ports.health + 1);
    until(Duration::from_secs(10), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["role"], "store-client");
    sc.signal(libc::SIGTERM);
    let st = sc
        .wait_exit(Duration::from_secs(10))
        .expect("store client exits");
    assert!(st.success(), "{st:?}");
    assert!(!socket.exists(), "socket removed at shutdown");
    // The sidecar stops through the ordered teardown (DESIGN contract 9), every step clean.
    w.assert_clean_teardown(
        2,
        &[
            "StopAdmission",
            "JoinThreads",
            "Deregister",
            "DestroyTransports",
            "FreeMemory",
        ],
    );
}
