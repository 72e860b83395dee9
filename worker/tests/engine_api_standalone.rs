//! Seed 000 through the engine API, across processes: a speculative decode worker with a Standalone
//! store client. A real `tandem-worker store-client` process owns the memfd segments; the worker maps
//! them (fds over the sidecar's socket), carves the target and draft pools in them, registers both
//! with the sidecar, and passes the same memfds on to the engine. An engine draft pool on plain mmap
//! is refused before anything is allocated or registered in the sidecar; teardown leaves no
//! registration behind.

mod engine_api_support;
mod serve_support;

use std::path::PathBuf;
use std::sync::Arc;

use engine_api_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::engine_api::pb;
use tandem_worker::engine_api::service::Backend;
use tandem_worker::memory::pool::{PageId, PoolRole};
use tandem_worker::store_client::ClientMode;
use tandem_worker::store_client::standalone::StandaloneClient;
use tonic::Code;

struct Sidecar {
    _proc: serve_support::Proc,
    socket: PathBuf,
    prefix: String,
    _world: serve_support::World,
}

impl Sidecar {
    /// `tandem-worker store-client --config` with memfd segments (a 16 MiB budget), started from
    /// a pool's worker config as a pod's sidecar is; its segments are named `tandem-sc-<pid>-<id>`.
    fn spawn() -> Self {
        use tandem_worker::config::{CONFIG_FILE, CacheConfig, WritePolicy};
        use tandem_worker::memory::AllocatorDomain;
        let world = serve_support::World::new(84);
        let mut cfg = serve_support::config(WorkerRole::Prefill, "r1", world.ports);
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
        let (proc, listening) = world.start_role(
            2,
            "store-client",
            CONFIG_FILE,
            &serde_json::to_vec(&cfg).unwrap(),
            &[],
            &["--backend", "memfd"],
        );
        let socket = PathBuf::from(listening);
        let prefix = format!("tandem-sc-{}-", proc.0.id());
        Self {
            _proc: proc,
            socket,
            prefix,
            _world: world,
        }
    }
}

fn memfd_name(fd: std::os::fd::BorrowedFd<'_>) -> String {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_pool_lives_in_the_sidecar_segment_and_mmap_is_refused_first() {
    let sc = Sidecar::spawn();
    let client = Arc::new(StandaloneClient::connect(&sc.socket, "engine-api-it").unwrap());
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 4,
                draft: true,
                cache: Some(ClientMode::Standalone),
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options {
            standalone: Some(client.clone()),
            ..Options::default()
        },
    );
    assert_eq!(
        client.remote_stats().unwrap(),
        (1, 0),
        "one segment, nothing registered"
    );
    let mut c = w.client().await;

    // Negative control first: the engine's draft pool on plain mmap.
    let mut id = identity(&w.cfg);
    id.pools[1].source = pb::PoolSource::Engine as i32;
    id.pools[1].engine_domain = pb::Domain::Mmap as i32;
    let e = client_err(c.attach_only(id).await);
    assert_eq!(
        (e.code, e.reason),
        (
            Code::FailedPrecondition,
            pb::ErrorReason::PoolDomainMismatch
        )
    );
    assert_eq!(
        client.remote_stats().unwrap(),
        (1, 0),
        "nothing registered in the sidecar"
    );
    assert_eq!(
        client.host_allocator_live(),
        0,
        "nothing carved from its segment"
    );

    // The worker allocates both pools inside the sidecar's segment and registers them there.
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    assert_eq!(client.remote_stats().unwrap(), (1, 2));
    for p in &att.pools {
        assert_eq!(
            p.descriptor.registration,
            pb::RegistrationState::Committed as i32
        );
        assert_eq!(p.descriptor.domain, pb::Domain::SharedMemory as i32);
        // The engine maps the sidecar's own memfd.
        let name = memfd_name(p.fd());
        assert!(name.starts_with(&format!("/memfd:{}", sc.prefix)), "{name}");
    }
    // Same bytes on both sides in the draft pool.
    let draft = att.pool(PoolRole::Draft).unwrap();
    let chunk = draft.geometry().chunk_bytes() as usize;
    let pattern: Vec<u8> = (0..chunk).map(|i| (i % 251) as u8).collect();
    draft.write(3, 1, 0, &pattern).unwrap();
    let pool = w.api.pools().pool(PoolRole::Draft).unwrap();
    let region = pool.chunk_region(PageId(3), 1).unwrap();
    // SAFETY: inside the pool's live mapping; the engine wrote it above and nothing writes now.
    let seen = unsafe {
        std::slice::from_raw_parts(pool.buffer().host_ptr().unwrap().add(region.offset), chunk)
    };
    assert_eq!(seen, &pattern[..]);
    let h = c.health().await.unwrap();
    assert!(
        h.pools
            .iter()
            .all(|p| p.registration == pb::RegistrationState::Committed as i32)
    );
    drop(pool);

    // Teardown: the attach ends, the pools are deregistered from the sidecar and freed.
    drop(att);
    let mut w = w;
    w.server.stop().await;
    let errors = w.api.release_pools();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        client.remote_stats().unwrap(),
        (1, 0),
        "no registration left in the sidecar"
    );
    assert_eq!(client.host_allocator_live(), 0);
}

/// Seed 000's preflight across the pools of one attach: with the draft pool carved from plain mmap
/// (the negative control's allocator), the attach is refused before the target pool — which
/// comes first and is fine — is allocated or registered; the sidecar sees no registration and its
/// segment stays whole. The same pool set without the override commits both pools.
#[test]
fn a_draft_pool_on_mmap_is_refused_before_the_target_registers() {
    use tandem_worker::engine_api::pools::PoolSet;
    use tandem_worker::health::Health;
    use tandem_worker::memory::Allocator;
    use tandem_worker::memory::mmap::MmapBackend;
    use tandem_worker::registration::metrics::RegistrationMetrics;
    use tandem_worker::registration::{Registrar, RegistrarConfig};
    use tandem_worker::store_client::StoreClient;

    let sc = Sidecar::spawn();
    let client = Arc::new(StandaloneClient::connect(&sc.socket, "preflight-it").unwrap());
    let cfg = worker_config(
        WorkerRole::Decode,
        Shape {
            pages: 4,
            draft: true,
            cache: Some(ClientMode::Standalone),
            ..Shape::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let api_cfg = api_config(dir.path(), &cfg);
    client
        .reserve(PoolSet::bytes_needed(&cfg, &api_cfg).unwrap() as usize)
        .unwrap();
    let metrics = RegistrationMetrics::default();
    let pools = |draft: Option<Allocator>| {
        let registrar = Arc::new(Registrar::new(
            client.clone() as Arc<dyn StoreClient>,
            Arc::new(Health::new()),
            metrics.clone(),
            RegistrarConfig::default(),
        ));
        let set = PoolSet::new(
            &cfg,
            &api_cfg,
            client.clone() as Arc<dyn StoreClient>,
            Some(registrar),
        )
        .unwrap();
        match draft {
            Some(a) => set.with_draft_allocator(a),
            None => set,
        }
    };
    let mmap = Allocator::new("default host allocator", MmapBackend::new());
    let refused = pools(Some(mmap.clone()));
    let e = refused
        .attach(&[PoolRole::Target, PoolRole::Draft])
        .unwrap_err();
    assert_eq!(
        (e.code, e.reason, e.field.as_str()),
        (
            Code::FailedPrecondition,
            pb::ErrorReason::PoolDomainMismatch,
            "pools.draft"
        ),
        "{e}"
    );
    assert!(e.theirs.contains("Mmap"), "{e:?}");
    assert_eq!(
        client.remote_stats().unwrap(),
        (1, 0),
        "nothing registered, not even the target"
    );
    assert_eq!(client.host_allocator_live(), 0, "no pool carved");
    assert_eq!(mmap.stats().live_buffers, 0, "nothing mapped outside");
    assert!(refused.attached().is_empty());
    drop(refused);

    let fixed = pools(None);
    let att = fixed.attach(&[PoolRole::Target, PoolRole::Draft]).unwrap();
    assert_eq!(att.len(), 2);
    assert_eq!(client.remote_stats().unwrap(), (1, 2));
    drop(att);
    assert!(fixed.release().is_empty());
    assert_eq!(client.remote_stats().unwrap(), (1, 0));
}

trait Live {
    fn host_allocator_live(&self) -> u64;
}

impl Live for StandaloneClient {
    fn host_allocator_live(&self) -> u64 {
        use tandem_worker::store_client::StoreClient;
        self.host_allocator().stats().live_buffers
    }
}
