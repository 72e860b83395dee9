//! Shared helpers of the serving-process tests: real `tandem-worker` processes on their own loopback
//! addresses (like the e2e process runner), configs under a `$TANDEM_ROOT` per process, and one
//! `$TANDEM_HOSTS_FILE` per test standing in for the Services.
#![allow(dead_code)]

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
use tandem_worker::memory::pool::PoolLayout;
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::registration::FailurePolicy;

pub const BIN: &str = env!("CARGO_BIN_EXE_tandem-worker");
pub const SERVICE: &str = "p-peers.serving.svc.cluster.local";
/// The CacheTier Service of the tests with an L3 tier.
pub const L3_SERVICE: &str = "l3-store.serving.svc.cluster.local";

pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, sig) };
    }

    /// Resident set size of the process, MiB (from /proc).
    pub fn rss_mib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb / 1024)
    }

    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
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
pub struct PortSet {
    pub control: u16,
    pub data: u16,
    pub health: u16,
    pub front: u16,
}

/// Four distinct free ports. The listeners are held until all four are taken: released one by
/// one, the kernel may hand the same port out twice (a test once failed with its health and front
/// ports equal: "binding the health port: Address already in use").
pub fn ports() -> PortSet {
    let held: Vec<std::net::TcpListener> = (0..4)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let port = |i: usize| held[i].local_addr().unwrap().port();
    PortSet {
        control: port(0),
        data: port(1),
        health: port(2),
        front: port(3),
    }
}

pub fn config(role: WorkerRole, revision: &str, p: PortSet) -> WorkerConfig {
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
        kv_deadline: None,
        transport: TransportChoice::Tcp,
        engine: None,
        peers: Peers {
            prefill_service: Some(SERVICE.into()),
            decode_service: None,
            group_service: None,
        },
        ports: Ports {
            control: p.control,
            data: p.data,
            health: p.health,
            front_door: (role == WorkerRole::Decode).then_some(p.front),
            rank_link: None,
        },
    }
}

/// The CacheTier config (`/etc/tandem/tier.json`) of a replica serving `model`'s prefill: port
/// 7420, 64 MiB memory, 256 MiB disk, persistent, write-through.
pub fn tier(w: &World, model: &WorkerConfig) -> CacheTierConfig {
    CacheTierConfig {
        api_version: CACHE_TIER_CONFIG_API_VERSION.into(),
        namespace: "serving".into(),
        tier: "l3".into(),
        revision: "t1".into(),
        model: model.model.clone(),
        indexer: None,
        page_tokens: 512,
        layout: PoolLayout::LayerFirst,
        max_tensor: DEFAULT_MAX_PARALLEL,
        max_context: DEFAULT_MAX_PARALLEL,
        memory_bytes: 64 << 20,
        disk_bytes: 256 << 20,
        persistent: true,
        data_dir: DEFAULT_CACHE_DATA_DIR.into(),
        ports: CachePorts {
            l3: 7420,
            health: w.ports.health,
        },
        eviction: CacheEviction::default(),
        write_policy: WritePolicy::WriteThrough,
        registration_failure: None,
    }
}

/// One test's world: a TANDEM_ROOT per process and a shared hosts file.
pub struct World {
    pub dir: tempfile::TempDir,
    pub net: u8,
    pub ports: PortSet,
}

impl World {
    pub fn new(net: u8) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            net,
            ports: ports(),
        }
    }

    pub fn ip(&self, host: u8) -> String {
        format!("127.0.{}.{host}", self.net)
    }

    pub fn hosts(&self) -> PathBuf {
        self.dir.path().join("hosts")
    }

    /// Makes `SERVICE` resolve to these hosts.
    pub fn publish(&self, hosts: &[u8]) {
        self.publish_names(&[(SERVICE, hosts)]);
    }

    /// The names of a CP-2 prefill group: the prefill Service naming both ranks, and each rank's
    /// pod DNS name (`p-g0-0`, `p-g0-1` under `group_service`) resolving to its own host.
    pub fn publish_group(&self, group_service: &str, leader: u8, member: u8) {
        let (l, m) = (
            format!("p-g0-0.{group_service}"),
            format!("p-g0-1.{group_service}"),
        );
        self.publish_names(&[
            (SERVICE, &[leader, member]),
            (&l, &[leader]),
            (&m, &[member]),
        ]);
    }

    /// A free TCP port none of this world's [`PortSet`] uses (a rank link's; each process listens
    /// on its own IP). The world's ports were released after they were picked, so the kernel may
    /// hand one of them out again: a rank link on the health port did not start (CI).
    pub fn free_port(&self) -> u16 {
        let p = &self.ports;
        loop {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            if ![p.control, p.data, p.health, p.front].contains(&port) {
                return port;
            }
        }
    }

    /// Makes each name resolve to its hosts.
    pub fn publish_names(&self, names: &[(&str, &[u8])]) {
        let text: String = names
            .iter()
            .flat_map(|(name, hosts)| {
                hosts
                    .iter()
                    .map(move |h| format!("{} {name}\n", self.ip(*h)))
            })
            .collect();
        let tmp = self.dir.path().join("hosts.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.hosts()).unwrap();
    }

    pub fn spawn(&self, host: u8, cfg: &WorkerConfig, env: &[(&str, &str)]) -> Proc {
        let role = match cfg.role {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        };
        self.spawn_role(
            host,
            role,
            CONFIG_FILE,
            &serde_json::to_vec(cfg).unwrap(),
            env,
        )
    }

    /// Starts a CacheTier replica with `cfg` as its `/etc/tandem/tier.json`.
    pub fn spawn_cache(&self, host: u8, cfg: &CacheTierConfig) -> Proc {
        self.spawn_role(
            host,
            "cache",
            CACHE_TIER_CONFIG_FILE,
            &serde_json::to_vec(cfg).unwrap(),
            &[],
        )
    }

    /// The `$TANDEM_ROOT` of the process on `host`.
    pub fn root(&self, host: u8) -> PathBuf {
        self.dir.path().join(format!("root-{host}"))
    }

    /// The lines a worker started on `host` by [`World::start_role`] printed after its
    /// `listening on` line (every process of the host, in order).
    pub fn stdout_lines(&self, host: u8) -> Vec<String> {
        std::fs::read_to_string(self.root(host).join("stdout"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Asserts that the worker on `host` exited through a clean teardown whose steps ran in
    /// `phases` (contract 9's order for its role).
    pub fn assert_clean_teardown(&self, host: u8, phases: &[&str]) {
        let (ok, steps) = self.teardown_of(host);
        assert!(ok, "{steps:?}");
        let seen: Vec<&str> = steps.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(seen, phases, "{steps:?}");
    }

    /// The last teardown report a serving worker on `host` printed when it exited
    /// (`teardown {json}`, `tandem_worker::roles::print_teardown`), as (phase, step, error) rows;
    /// panics without one. Call after the process exited (the reader thread may trail it by a
    /// moment: bounded retry).
    pub fn teardown_of(&self, host: u8) -> (bool, Vec<(String, String, Option<String>)>) {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let last = self
                .stdout_lines(host)
                .into_iter()
                .rev()
                .find_map(|l| l.strip_prefix("teardown ").map(str::to_owned));
            if let Some(json) = last {
                let v: Value = serde_json::from_str(&json).expect("teardown JSON");
                let rows = v["steps"]
                    .as_array()
                    .expect("teardown steps")
                    .iter()
                    .map(|s| {
                        (
                            s["phase"].as_str().unwrap_or_default().to_owned(),
                            s["step"].as_str().unwrap_or_default().to_owned(),
                            s["error"].as_str().map(str::to_owned),
                        )
                    })
                    .collect();
                return (v["ok"] == true, rows);
            }
            assert!(
                Instant::now() < end,
                "no teardown line from host {host}: {:?}",
                self.stdout_lines(host)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn spawn_role(
        &self,
        host: u8,
        role: &str,
        file: &str,
        json: &[u8],
        env: &[(&str, &str)],
    ) -> Proc {
        self.start_role(host, role, file, json, env, &[]).0
    }

    /// Starts `tandem-worker <role> --config /etc/tandem/<file> <args>` the way a pod does: `json`
    /// written to `<root>/etc/tandem/<file>` under this host's `$TANDEM_ROOT`, `$POD_IP` and
    /// `$POD_NAME` set. Waits (at most 60 s) for the first stdout line `listening on ADDR` and
    /// returns the process and `ADDR`.
    pub fn start_role(
        &self,
        host: u8,
        role: &str,
        file: &str,
        json: &[u8],
        env: &[(&str, &str)],
        args: &[&str],
    ) -> (Proc, String) {
        self.try_start_role(host, role, file, json, env, args, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`World::start_role`] for a worker that may refuse to start: `Err` with what it printed
    /// first (empty when it exited silently; its stderr went to the test's) when no `listening
    /// on` line came within `within`.
    #[allow(clippy::too_many_arguments)]
    pub fn try_start_role(
        &self,
        host: u8,
        role: &str,
        file: &str,
        json: &[u8],
        env: &[(&str, &str)],
        args: &[&str],
        within: Duration,
    ) -> Result<(Proc, String), String> {
        let root = self.root(host);
        let etc = root.join("etc/tandem");
        std::fs::create_dir_all(&etc).unwrap();
        // The store client's socket lives on the pod's /dev/shm volume.
        std::fs::create_dir_all(root.join("dev/shm")).unwrap();
        std::fs::write(etc.join(file), json).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args([role, "--config", &format!("/etc/tandem/{file}")])
            .args(args)
            .env("TANDEM_ROOT", &root)
            .env("TANDEM_HOSTS_FILE", self.hosts())
            .env("POD_IP", self.ip(host))
            .env("POD_NAME", format!("{role}-g0-{host}"))
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
        let stdout = child.stdout.take().unwrap();
        let proc = Proc(child);
        let (tx, rx) = std::sync::mpsc::channel();
        // The first line answers the start; later ones (the teardown report) are appended to
        // `<root>/stdout` ([`World::stdout_lines`]). Reading on keeps the pipe open.
        let log = root.join("stdout");
        std::thread::spawn(move || {
            use std::io::Write as _;
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
            let mut line = String::new();
            while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                if let Ok(mut f) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                {
                    let _ = f.write_all(line.as_bytes());
                }
                line.clear();
            }
        });
        let line = rx
            .recv_timeout(within)
            .map_err(|_| format!("{role} printed nothing within {within:?}"))?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .ok_or_else(|| format!("{role} did not start: {line:?}"))?
            .to_owned();
        Ok((proc, addr))
    }

    pub fn addr(&self, host: u8, port: u16) -> SocketAddr {
        format!("{}:{port}", self.ip(host)).parse().unwrap()
    }
}

/// One HTTP/1.1 request; returns status and the body frames with their arrival times.
pub async fn http(
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

pub fn text(frames: &[(Instant, Bytes)]) -> String {
    frames
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .collect()
}

pub async fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (s, f) = http(addr, "GET", path, None).await;
    (s, serde_json::from_str(&text(&f)).unwrap_or(Value::Null))
}

pub async fn status(addr: SocketAddr, path: &str) -> Option<u16> {
    tokio::net::TcpStream::connect(addr).await.ok()?;
    Some(http(addr, "GET", path, None).await.0)
}

/// Waits until `f` holds, polling every 50 ms.
pub async fn until<F: std::future::Future<Output = bool>>(
    within: Duration,
    mut f: impl FnMut() -> F,
) {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("condition not met within {within:?}");
}

pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_owned))
        .collect()
}

pub fn completion(input_tokens: u32, max_tokens: u32, stream: bool) -> Value {
    serde_json::json!({"model": "llama-3-8b", "prompt": "hello", "max_tokens": max_tokens,
        "stream": stream, "input_tokens": input_tokens, "kv_block_hashes": [11, 12, 13]})
}
