//! The serving processes end to end: `tandem-worker prefill --config` and `decode --config` as real
//! processes on their own loopback addresses (like the e2e process runner), peers found through a
//! `$TANDEM_HOSTS_FILE`, configs read through `$TANDEM_ROOT`, and completions through the front door.
//!
//! Each test uses its own `127.0.<net>.x` addresses so tests run in parallel without port clashes.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tandem_worker::config::*;
use tandem_worker::memory::AllocatorDomain;
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::registration::FailurePolicy;

const BIN: &str = env!("CARGO_BIN_EXE_tandem-worker");
const SERVICE: &str = "p-peers.serving.svc.cluster.local";

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, sig) };
    }

    fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.0.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

/// Ports shared by every process of a test (each process has its own IP).
#[derive(Clone, Copy)]
struct PortSet {
    control: u16,
    data: u16,
    health: u16,
    front: u16,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn ports() -> PortSet {
    PortSet {
        control: free_port(),
        data: free_port(),
        health: free_port(),
        front: free_port(),
    }
}

fn config(role: WorkerRole, revision: &str, p: PortSet) -> WorkerConfig {
    WorkerConfig {
        api_version: CONFIG_API_VERSION.into(),
        role,
        namespace: "serving".into(),
        pool: match role {
            WorkerRole::Prefill => "p".into(),
            WorkerRole::Decode => "d".into(),
        },
        revision: revision.into(),
        model: ModelIdentity {
            name: "llama-3-8b".into(),
            layers: 8,
            attention: Attention::Gqa {
                kv_heads: 8,
                head_dim: 128,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        },
        indexer: None,
        parallelism: Parallelism {
            tensor: 1,
            context: 1,
        },
        layer_split: None,
        memory: MemoryPolicy {
            allocator: AllocatorDomain::Mmap,
            client_mode: None,
            registration_failure: FailurePolicy::FailClosed,
            target_pool_bytes: 64 << 20,
            draft_pool_bytes: 0,
            indexer_pool_bytes: 0,
            snapshot_buffer_bytes: 0,
            segment_bytes: 64 << 20,
        },
        cache: None,
        speculative: None,
        spec_guard: None,
        transport: TransportChoice::Tcp,
        peers: Peers {
            prefill_service: Some(SERVICE.into()),
            decode_service: None,
        },
        ports: Ports {
            control: p.control,
            data: p.data,
            health: p.health,
            front_door: (role == WorkerRole::Decode).then_some(p.front),
        },
    }
}

/// One test's world: a TANDEM_ROOT per process and a shared hosts file.
struct World {
    dir: tempfile::TempDir,
    net: u8,
    ports: PortSet,
}

impl World {
    fn new(net: u8) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            net,
            ports: ports(),
        }
    }

    fn ip(&self, host: u8) -> String {
        format!("127.0.{}.{host}", self.net)
    }

    fn hosts(&self) -> PathBuf {
        self.dir.path().join("hosts")
    }

    /// Makes `SERVICE` resolve to these hosts.
    fn publish(&self, hosts: &[u8]) {
        let text: String = hosts
            .iter()
            .map(|h| format!("{} {SERVICE}\n", self.ip(*h)))
            .collect();
        let tmp = self.dir.path().join("hosts.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.hosts()).unwrap();
    }

    fn spawn(&self, host: u8, cfg: &WorkerConfig, env: &[(&str, &str)]) -> Proc {
        let role = match cfg.role {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        };
        let root = self.dir.path().join(format!("root-{host}"));
        let etc = root.join("etc/tandem");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join(CONFIG_FILE), serde_json::to_vec(cfg).unwrap()).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args([role, "--config", "/etc/tandem/worker.json"])
            .env("TANDEM_ROOT", &root)
            .env("TANDEM_HOSTS_FILE", self.hosts())
            .env("POD_IP", self.ip(host))
            .env("POD_NAME", format!("{}-g0-{host}", cfg.pool))
            .env("TANDEM_SIM_KV_BYTES_PER_TOKEN", "512")
            .env("TANDEM_SIM_TPOT_MS", "1")
            .env("TANDEM_SIM_PREFILL_US_PER_TOKEN", "2")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("listening on"),
            "{role} did not start: {line:?}"
        );
        Proc(child)
    }

    fn addr(&self, host: u8, port: u16) -> SocketAddr {
        format!("{}:{port}", self.ip(host)).parse().unwrap()
    }
}

/// One HTTP/1.1 request; returns status and the body frames with their arrival times.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Vec<(Instant, Bytes)>) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut frames = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            frames.push((Instant::now(), d));
        }
    }
    (status, frames)
}

fn text(frames: &[(Instant, Bytes)]) -> String {
    frames
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .collect()
}

async fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (s, f) = http(addr, "GET", path, None).await;
    (s, serde_json::from_str(&text(&f)).unwrap_or(Value::Null))
}

async fn status(addr: SocketAddr, path: &str) -> Option<u16> {
    tokio::net::TcpStream::connect(addr).await.ok()?;
    Some(http(addr, "GET", path, None).await.0)
}

/// Waits until `f` holds, polling every 50 ms.
async fn until<F: std::future::Future<Output = bool>>(within: Duration, mut f: impl FnMut() -> F) {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("condition not met within {within:?}");
}

fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_owned))
        .collect()
}

fn completion(input_tokens: u32, max_tokens: u32, stream: bool) -> Value {
    serde_json::json!({"model": "llama-3-8b", "prompt": "hello", "max_tokens": max_tokens,
        "stream": stream, "input_tokens": input_tokens, "kv_block_hashes": [11, 12, 13]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_plain_completions_through_prefill_and_decode() {
    let w = World::new(41);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_prefill_dies_is_retried_on_another_peer() {
    let w = World::new(43);
    w.publish(&[2, 3]);
    // .2 sorts first and is picked first; it computes slowly (4 ms per token) and is killed.
    let slow = w.spawn(
        2,
        &config(WorkerRole::Prefill, "r1", w.ports),
        &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", "4000")],
    );
    let _fast = w.spawn(3, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    let health = w.addr(9, w.ports.health);
    until(Duration::from_secs(15), || async {
        get_json(health, "/report").await.1["peers"]
            .as_array()
            .map_or(0, Vec::len)
            == 2
    })
    .await;
    let front = w.addr(9, w.ports.front);
    let req = tokio::spawn(async move {
        http(
            front,
            "POST",
            "/v1/completions",
            Some(completion(2048, 3, false)),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        !req.is_finished(),
        "the slow prefill must still be computing"
    );
    slow.signal(libc::SIGKILL);
    let (code, frames) = tokio::time::timeout(Duration::from_secs(20), req)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(code, 200, "{}", text(&frames));
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(
        v["tandem"]["prefill_worker"],
        w.addr(3, w.ports.control).to_string()
    );
    assert_eq!(v["tandem"]["corrupt_chunks"], 0);
    let (_, r) = get_json(health, "/report").await;
    assert_eq!(r["counters"]["requests_retried"], 1, "{r}");
    assert_eq!(r["counters"]["rooms_aborted"], 1, "{r}");
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
    tokio::time::sleep(Duration::from_millis(300)).await;
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
