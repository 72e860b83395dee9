//! Issue 18, item 1: a peer that restarts on the same address (SIGKILL, then a new process on the
//! same IP and ports) is a new incarnation. Real `tandem-worker` processes on loopback net 121–123
//! (like the e2e process runner).
//!
//! - A prefill restarted under traffic: every in-flight request ends with a reason within its
//!   deadline, readiness is false while no prefill is connected (and the front door refuses), the
//!   decode handshakes with the new process, new requests succeed, no page is corrupt or leaked.
//! - A decode restarted while a prefill computes one of its rooms: the prefill drops the old
//!   incarnation's room at the new incarnation's hello, the new decode's rooms reuse no room id of
//!   the old one, new requests succeed at once with intact KV. The negative control (feature
//!   `negative-controls`, `TANDEM_NEGATIVE_IGNORE_INCARNATION=1`: no incarnation anywhere) shows
//!   the failure this prevents: the new decode's first room collides with the old incarnation's
//!   room still open on the prefill, and the request fails.

mod serve_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::WorkerRole;

/// One HTTP request that tolerates a peer going away: `Err` with what failed (connection reset,
/// truncated body) instead of a panic; `Err` too past `within`.
async fn try_http(
    addr: SocketAddr,
    body: Value,
    within: Duration,
) -> Result<(u16, String), String> {
    use http_body_util::{BodyExt, Full};
    let run = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = hyper::Request::builder()
            .method("POST")
            .uri("/v1/completions")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let code = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((code, String::from_utf8_lossy(&bytes).into_owned()))
    };
    tokio::time::timeout(within, run)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {within:?}")))
}

async fn report(addr: SocketAddr) -> Value {
    get_json(addr, "/report").await.1
}

/// The decode's pages are all back: nothing held, nothing quarantined.
async fn pages_all_free(health: SocketAddr) {
    until(Duration::from_secs(15), || async {
        let r = report(health).await;
        let p = &r["kv_pages"];
        p["held"] == 0 && p["quarantined"] == 0 && p["free"] == p["total"]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_restarted_on_its_address_under_traffic_is_handshaken_again() {
    let w = World::new(121);
    w.publish(&[2]);
    let pcfg = config(WorkerRole::Prefill, "r1", w.ports);
    let kv_deadline = Duration::from_secs(20);
    // The decode first: ready means wired (item 3), so it is not ready and admits nothing until
    // its prefill is connected.
    let _d = w.spawn(
        9,
        &config(WorkerRole::Decode, "r1", w.ports),
        &[("TANDEM_DECODE_KV_DEADLINE_MS", "20000")],
    );
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let p_health = w.addr(2, w.ports.health);
    // After its first refresh it says why; not ready throughout.
    until(Duration::from_secs(15), || async {
        assert_eq!(status(health, "/readyz").await, Some(503));
        report(health).await["reason"]
            .as_str()
            .is_some_and(|why| why.contains("no prefill peer of revision \"r1\""))
    })
    .await;
    let (code, body) = try_http(front, completion(64, 2, false), kv_deadline)
        .await
        .unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"code\":\"not_ready\""), "{body}");
    // 2 ms per prompt token: a 2048-token room computes for about 4 s.
    let mut p1 = w.spawn(2, &pcfg, &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", "2000")]);
    until(Duration::from_secs(30), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let (code, body) = try_http(front, completion(64, 2, false), kv_deadline)
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
    // The decode names the incarnation it handshook with, the prefill's own.
    let peer = w.addr(2, w.ports.control).to_string();
    let old = report(p_health).await["incarnation"].clone();
    assert!(old.as_u64().is_some_and(|n| n != 0), "{old}");
    assert_eq!(report(health).await["peer_incarnations"][&peer], old);

    // Traffic: four long prompts in flight when the prefill dies.
    let in_flight: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(async move {
                let sent = Instant::now();
                let r = try_http(front, completion(2048, 2, i % 2 == 0), kv_deadline * 2).await;
                (r, sent.elapsed())
            })
        })
        .collect();
    // Every room is open on the prefill (it looked each prompt up) before the kill.
    until(Duration::from_secs(15), || async {
        report(p_health).await["counters"]["prefix_lookup_tokens"]
            .as_u64()
            .is_some_and(|n| n >= 64 + 4 * 2048)
    })
    .await;
    p1.signal(libc::SIGKILL);
    assert!(p1.wait_exit(Duration::from_secs(10)).is_some());

    // Readiness tells the truth at once: no prefill connected, not ready, and the front door
    // refuses with 503 and the reason.
    until(Duration::from_secs(5), || async {
        status(health, "/readyz").await == Some(503)
    })
    .await;
    let (code, body) = try_http(front, completion(64, 2, false), kv_deadline)
        .await
        .unwrap();
    assert_eq!(code, 503, "{body}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert!(e["error"]["code"].is_string(), "{e}");

    // Every in-flight request ended with a reason, within its deadline.
    let mut failed = 0;
    for t in in_flight {
        let (r, took) = t.await.unwrap();
        assert!(took < kv_deadline, "a request took {took:?}");
        let (code, body) = r.expect("the decode answers every in-flight request");
        match code {
            200 => {
                // Finished before the kill: intact.
                let v: Value = serde_json::from_str(&body).unwrap_or_default();
                assert!(
                    body.contains("\"corrupt_chunks\":0") || v["tandem"]["corrupt_chunks"] == 0,
                    "{body}"
                );
            }
            503 => {
                // Plain: the error object; streamed after its first byte: an error event.
                assert!(
                    body.contains("\"code\":\"prefill_unavailable\""),
                    "an in-flight request failed without the reason: {body}"
                );
                failed += 1;
            }
            other => panic!("in-flight request ended with {other}: {body}"),
        }
    }
    // Their rooms needed seconds of compute: the kill caught them.
    assert!(failed >= 1, "no request was in flight at the kill");
    assert_eq!(status(health, "/readyz").await, Some(503));

    // The prefill comes back on the same IP and port: a new incarnation, handshaken again.
    let _p2 = w.spawn(2, &pcfg, &[]);
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let r = report(health).await;
    assert_eq!(r["peers"], serde_json::json!([peer]), "{r}");
    let new = report(p_health).await["incarnation"].clone();
    assert!(
        new.as_u64().is_some_and(|n| n != 0) && new != old,
        "{old} {new}"
    );
    assert_eq!(r["peer_incarnations"][&peer], new, "{r}");
    for _ in 0..5 {
        let (code, body) = try_http(front, completion(700, 3, false), kv_deadline)
            .await
            .unwrap();
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    }
    let r = report(health).await;
    assert_eq!(r["counters"]["corrupt_pages_read"], 0, "{r}");
    pages_all_free(health).await;
    let r = report(health).await;
    assert_eq!(r["counters"]["pages_quarantined"], 0, "{r}");
}

/// What a decode restart left behind: the first requests on the new decode and the counters.
struct DecodeRestart {
    /// Status and body of each request sent right after the new decode turned ready.
    after: Vec<(u16, String)>,
    /// Seconds from readiness to the first request's answer.
    first_took: Duration,
    /// The prefill's aborted rooms after the restart.
    prefill_rooms_aborted: u64,
    /// The decode's incarnations before and after.
    incarnations: (Value, Value),
    /// `corrupt_pages_read` of the new decode.
    corrupt: Value,
}

/// SIGKILLs a decode while the prefill computes one of its rooms (4 s per page) and starts it
/// again on the same IP and ports with the same worker id; sends three short requests.
async fn restart_the_decode(net: u8, env: &[(&str, &str)]) -> DecodeRestart {
    let w = World::new(net);
    w.publish(&[2]);
    let mut penv = vec![("TANDEM_SIM_PREFILL_US_PER_TOKEN", "8000")];
    penv.extend_from_slice(env);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &penv);
    let dcfg = config(WorkerRole::Decode, "r1", w.ports);
    let mut d1 = w.spawn(9, &dcfg, env);
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let p_health = w.addr(2, w.ports.health);
    until(Duration::from_secs(30), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let before = report(health).await["incarnation"].clone();
    // A 2048-token prompt: 4 pages of about 4 s each on the prefill.
    let a = tokio::spawn(try_http(
        front,
        completion(2048, 2, false),
        Duration::from_secs(60),
    ));
    until(Duration::from_secs(15), || async {
        report(p_health).await["counters"]["prefix_lookup_tokens"]
            .as_u64()
            .is_some_and(|n| n >= 2048)
    })
    .await;
    d1.signal(libc::SIGKILL);
    assert!(d1.wait_exit(Duration::from_secs(10)).is_some());
    // The in-flight request ends with its decode: the connection is gone (its reason).
    let ended = tokio::time::timeout(Duration::from_secs(5), a)
        .await
        .expect("the in-flight request ends when its decode dies")
        .unwrap();
    assert!(ended.is_err(), "{ended:?}");

    let _d2 = w.spawn(9, &dcfg, env);
    until(Duration::from_secs(30), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let ready = Instant::now();
    let mut after = Vec::new();
    let mut first_took = Duration::ZERO;
    for i in 0..3 {
        let r = try_http(front, completion(100, 2, false), Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| (0, e));
        if i == 0 {
            first_took = ready.elapsed();
        }
        after.push(r);
    }
    let r = report(health).await;
    let pr = report(p_health).await;
    DecodeRestart {
        after,
        first_took,
        prefill_rooms_aborted: pr["counters"]["rooms_aborted"].as_u64().unwrap_or(0),
        incarnations: (before, r["incarnation"].clone()),
        corrupt: r["counters"]["corrupt_pages_read"].clone(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_restarted_on_its_address_reuses_nothing_of_its_old_incarnation() {
    let out = restart_the_decode(122, &[]).await;
    let (old, new) = &out.incarnations;
    assert!(old.as_u64().is_some_and(|n| n != 0), "{old}");
    assert!(
        new.as_u64().is_some_and(|n| n != 0) && new != old,
        "{old} {new}"
    );
    for (code, body) in &out.after {
        assert_eq!(*code, 200, "{body}");
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    }
    // The old incarnation's room was dropped at the new hello, not left to finish its 16 s.
    assert_eq!(out.prefill_rooms_aborted, 1);
    assert!(
        out.first_took < Duration::from_secs(4),
        "{:?}",
        out.first_took
    );
    assert_eq!(out.corrupt, 0);
}

/// Negative control: without incarnations the new decode's first room id is the old one's, still
/// open on the prefill, and the first request after the restart fails.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_ignoring_the_incarnation_fails_the_requests_after_a_decode_restart() {
    let out = restart_the_decode(123, &[("TANDEM_NEGATIVE_IGNORE_INCARNATION", "1")]).await;
    assert_eq!(out.incarnations.1, 0);
    let failed = out.after.iter().filter(|(code, _)| *code != 200).count();
    assert!(
        failed >= 1,
        "without incarnations every request still succeeded: the test cannot fail"
    );
}
