//! Two processes: a real `tandem-worker store-client` and this test as the worker (DESIGN contracts 1,
//! 2 and 9; seed 000 R3 "standalone" case).
//!
//! The store client creates POSIX shm segments (so they are visible in /dev/shm and a leak is
//! observable), passes their fds over its Unix socket, and must leave nothing in /dev/shm after SIGTERM.
//! The negative control runs it with `--leak-segments-for-test` and checks the leak is detected.
//! The store client starts from the pool's worker config, as the sidecar of a pod does.

mod serve_support;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serve_support::{Proc, World, config};
use tandem_worker::config::{CONFIG_FILE, CacheConfig, WorkerRole, WritePolicy};
use tandem_worker::health::Health;
use tandem_worker::memory::capacity::CapacityPlan;
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{PageId, PoolLayout, PoolRole, PoolSpec};
use tandem_worker::memory::segment::dev_shm_entries;
use tandem_worker::memory::{Allocator, AllocatorDomain};
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::registration::metrics::RegistrationMetrics;
use tandem_worker::registration::{AttachOutcome, Phase, Registrar, RegistrarConfig};
use tandem_worker::store_client::standalone::StandaloneClient;
use tandem_worker::store_client::{ClientMode, StoreClient};
use tandem_worker::teardown::{Teardown, TeardownPhase};

fn spec(role: PoolRole) -> PoolSpec {
    PoolSpec {
        role,
        model: ModelIdentity {
            name: format!("{role}-model"),
            layers: 2,
            attention: Attention::Mla {
                kv_lora_rank: 96,
                rope_dim: 32,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        },
        page_tokens: 16,
        pages: 8,
        layout: PoolLayout::PageFirst,
    }
}

struct StoreClientProcess {
    proc: Proc,
    socket: PathBuf,
    prefix: String,
    _world: World,
}

impl StoreClientProcess {
    /// Starts `tandem-worker store-client --config` (a 16 MiB segment budget) with POSIX shm
    /// segments; `leak` adds the test-only `--leak-segments-for-test`. Its segments are named
    /// `tandem-sc-<pid>-<id>`.
    fn spawn(net: u8, leak: bool) -> Self {
        let world = World::new(net);
        let mut cfg = config(WorkerRole::Prefill, "r1", world.ports);
        cfg.memory.allocator = AllocatorDomain::SharedMemory;
        cfg.memory.client_mode = Some(ClientMode::Standalone);
        cfg.cache = Some(CacheConfig {
            tier: "l3".into(),
            service: "l3-store.serving.svc".into(),
            replicas: 1,
            page_tokens: 512,
            write_policy: WritePolicy::WriteThrough,
        });
        // A 16 MiB segment budget: the pools' sum, as the operator resolves it.
        cfg.memory.target_pool_bytes = 16 << 20;
        cfg.memory.segment_bytes = 16 << 20;
        let mut args = vec!["--backend", "posix-shm"];
        if leak {
            args.push("--leak-segments-for-test");
        }
        let (proc, listening) = world.start_role(
            2,
            "store-client",
            CONFIG_FILE,
            &serde_json::to_vec(&cfg).unwrap(),
            &[],
            &args,
        );
        let socket = world.root(2).join("dev/shm/tandem-store-client.sock");
        assert_eq!(Path::new(&listening), socket);
        // Segment `<prefix>-<id>`: the trailing dash keeps pid 12 from matching pid 123's segments.
        let prefix = format!("tandem-sc-{}-", proc.0.id());
        Self {
            proc,
            socket,
            prefix,
            _world: world,
        }
    }

    fn sigterm_and_wait(&mut self) -> ExitStatus {
        let pid = self.proc.0.id() as libc::pid_t;
        // SAFETY: plain kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.proc.0.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.proc.0.kill();
                panic!("store-client ignored SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for StoreClientProcess {
    fn drop(&mut self) {
        if self.proc.0.try_wait().ok().flatten().is_none() {
            let _ = self.proc.0.kill();
            let _ = self.proc.0.wait();
        }
        for name in dev_shm_entries(&self.prefix) {
            let _ = rustix::shm::unlink(format!("/{name}").as_str());
        }
    }
}

fn registrar(client: Arc<StandaloneClient>) -> Arc<Registrar> {
    Arc::new(Registrar::new(
        client,
        Arc::new(Health::new()),
        RegistrationMetrics::default(),
        RegistrarConfig::default(),
    ))
}

#[test]
fn seed_000_across_two_processes_and_teardown_leaves_nothing_in_dev_shm() {
    let mut sc = StoreClientProcess::spawn(81, false);
    let client = Arc::new(StandaloneClient::connect(&sc.socket, "it-worker").unwrap());
    assert_eq!(client.server_pid(), sc.proc.0.id());
    let plan =
        CapacityPlan::new(1 << 20, &[spec(PoolRole::Target), spec(PoolRole::Draft)]).unwrap();
    client.reserve(plan.required()).unwrap();
    let segments = dev_shm_entries(&sc.prefix);
    assert_eq!(
        segments.len(),
        1,
        "one POSIX shm segment owned by the store client"
    );

    let reg = registrar(client.clone());
    let tier = client.host_allocator().clone();
    assert!(matches!(
        reg.attach(spec(PoolRole::Target), &tier).unwrap(),
        AttachOutcome::Committed(_)
    ));

    // The seed's draft pool on plain mmap: refused at preflight, nothing sent to the store client.
    let mmap = Allocator::new("default host allocator", MmapBackend::new());
    let err = reg.attach(spec(PoolRole::Draft), &mmap).unwrap_err();
    assert_eq!(err.phase, Phase::Preflight);
    assert_eq!(client.remote_stats().unwrap(), (1, 1));
    assert_eq!(mmap.stats().live_buffers, 0);

    // Inheriting the tier's allocator: commits, and the bytes are the store client's segment.
    let AttachOutcome::Committed(draft) = reg.attach(spec(PoolRole::Draft), &tier).unwrap() else {
        panic!("draft did not commit")
    };
    assert_eq!(draft.pool.domain(), AllocatorDomain::SharedMemory);
    assert_eq!(client.remote_stats().unwrap(), (1, 2));
    let page = draft.pool.allocate(1).unwrap()[0];
    assert_eq!(page, PageId(0));
    let payload: Vec<u8> = (0..64u8).collect();
    draft.pool.write_chunk(page, 1, 0, &payload).unwrap();
    let region = draft.pool.chunk_region(page, 1).unwrap();
    let placement = draft.pool.buffer().placement().unwrap().clone();
    let file = std::fs::File::open(Path::new("/dev/shm").join(&segments[0])).unwrap();
    let mut seen = vec![0u8; payload.len()];
    file.read_exact_at(&mut seen, (placement.offset + region.offset) as u64)
        .unwrap();
    assert_eq!(
        seen, payload,
        "worker and store client share the segment's pages"
    );
    draft.pool.free(&[page]).unwrap();
    drop(draft);

    // Teardown (contract 9): deregister, then free memory; idempotent.
    let teardown = Teardown::new();
    teardown.register(TeardownPhase::StopAdmission, "stop admission", || Ok(()));
    reg.install_teardown(&teardown);
    let report = teardown.run();
    assert!(report.ok(), "{report:?}");
    let phases: Vec<_> = report.steps.iter().map(|s| s.phase).collect();
    assert_eq!(
        phases,
        [
            TeardownPhase::StopAdmission,
            TeardownPhase::Deregister,
            TeardownPhase::FreeMemory
        ]
    );
    assert_eq!(teardown.run(), report, "second teardown is a no-op");
    assert_eq!(reg.registry().active_count(), 0);
    assert_eq!(client.registered_count(), 0);
    assert!(reg.pools().is_empty());
    let stats = tier.stats();
    assert_eq!(
        (
            stats.live_buffers,
            stats.live_bytes,
            stats.quarantined_buffers
        ),
        (0, 0, 0)
    );

    let status = sc.sigterm_and_wait();
    assert!(status.success(), "{status:?}");
    assert!(
        dev_shm_entries(&sc.prefix).is_empty(),
        "nothing of ours in /dev/shm"
    );
    assert!(!sc.socket.exists(), "socket removed");
}

#[test]
fn sigterm_with_a_connected_worker_still_removes_every_segment() {
    let mut sc = StoreClientProcess::spawn(82, false);
    let client = StandaloneClient::connect(&sc.socket, "it-worker").unwrap();
    client.reserve(64 << 10).unwrap();
    client.reserve(64 << 10).unwrap();
    assert_eq!(dev_shm_entries(&sc.prefix).len(), 2);
    let status = sc.sigterm_and_wait();
    assert!(status.success(), "{status:?}");
    assert!(dev_shm_entries(&sc.prefix).is_empty());
    // The worker's mappings stay valid after the names are gone (the kernel keeps the pages).
    let buf = client.host_allocator().allocate(4096, "after").unwrap();
    // SAFETY: a live 4 KiB host buffer.
    unsafe { buf.host_ptr().unwrap().write_bytes(7, 4096) };
    buf.free().unwrap();
    assert!(
        client.remote_stats().is_err(),
        "the store client is gone: typed IPC error"
    );
}

#[test]
fn negative_control_a_store_client_that_skips_unlink_is_detected() {
    let mut sc = StoreClientProcess::spawn(83, true);
    let client = StandaloneClient::connect(&sc.socket, "it-worker").unwrap();
    client.reserve(64 << 10).unwrap();
    let status = sc.sigterm_and_wait();
    assert!(status.success());
    assert_eq!(
        dev_shm_entries(&sc.prefix).len(),
        1,
        "the leak check must see the leaked segment"
    );
    // `Drop` of `sc` removes it.
}
