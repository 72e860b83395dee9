//! Shared helpers of the engine-API tests: worker configs, servers on temporary socket directories,
//! engines attached through the Rust client, side-effect counters, and KV content checks.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_worker::config::*;
use tandem_worker::engine::content::{fill_chunk, verify_chunk};
use tandem_worker::engine_api::client::{Attached, ClientError, EngineClient};
use tandem_worker::engine_api::decode::{KvSource, RoomOpen};
use tandem_worker::engine_api::pools::PoolSet;
use tandem_worker::engine_api::server::{self, RunningServer};
use tandem_worker::engine_api::service::{Backend, EngineApi};
use tandem_worker::engine_api::tiers::NoTiers;
use tandem_worker::engine_api::{ApiError, EngineApiConfig, pb};
use tandem_worker::health::Health;
use tandem_worker::memory::AllocatorDomain;
use tandem_worker::memory::pool::{PoolLayout, PoolRole};
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::registration::fault::{FaultInjector, FaultyClient};
use tandem_worker::registration::{
    FailurePolicy, Registrar, RegistrarConfig, metrics::RegistrationMetrics,
};
use tandem_worker::release::receiver::FailureCause;
use tandem_worker::release::{PrefillRank, RoomKey};
use tandem_worker::sim_engine::{chunk_spec, identity_from_config};
use tandem_worker::store_client::embedded::EmbeddedClient;
use tandem_worker::store_client::standalone::StandaloneClient;
use tandem_worker::store_client::{ClientMode, StoreClient};

pub const BIN: &str = env!("CARGO_BIN_EXE_tandem-worker");
pub const PAGE_TOKENS: u32 = 16;
pub const LAYERS: u32 = 4;

/// 32 B per token and layer (2 × 1 head × 8 × 2 B): a chunk is 512 B, a page 2 KiB.
pub fn model(name: &str) -> ModelIdentity {
    ModelIdentity {
        name: name.into(),
        layers: LAYERS,
        attention: Attention::Gqa {
            kv_heads: 1,
            head_dim: 8,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    }
}

pub fn draft_model() -> ModelIdentity {
    ModelIdentity {
        layers: 2,
        ..model("tiny-draft")
    }
}

pub fn page_bytes(m: &ModelIdentity) -> u64 {
    u64::from(PAGE_TOKENS) * m.bytes_per_token_layer() * u64::from(m.layers)
}

/// What a test worker has.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape {
    pub pages: u64,
    pub draft: bool,
    pub indexer: bool,
    /// `Some` = a CacheTier in this client mode.
    pub cache: Option<ClientMode>,
    pub spec_guard: Option<u32>,
}

pub fn worker_config(role: WorkerRole, s: Shape) -> WorkerConfig {
    let target = s.pages * page_bytes(&model("tiny"));
    let draft = if s.draft {
        s.pages * page_bytes(&draft_model())
    } else {
        0
    };
    let indexer_geom = IndexerGeometry {
        head_dim: 16,
        dtype_bytes: 1,
    };
    let indexer = if s.indexer {
        s.pages * u64::from(PAGE_TOKENS) * 16 * u64::from(LAYERS)
    } else {
        0
    };
    let cfg = WorkerConfig {
        api_version: CONFIG_API_VERSION.into(),
        role,
        namespace: "t".into(),
        pool: "p".into(),
        revision: "r1".into(),
        model: model("tiny"),
        indexer: s.indexer.then_some(indexer_geom),
        parallelism: Parallelism {
            tensor: 1,
            context: 1,
        },
        layer_split: None,
        memory: MemoryPolicy {
            allocator: AllocatorDomain::SharedMemory,
            client_mode: s.cache,
            registration_failure: FailurePolicy::FailClosed,
            target_pool_bytes: target,
            draft_pool_bytes: draft,
            indexer_pool_bytes: indexer,
            snapshot_buffer_bytes: 0,
            segment_bytes: target + draft + indexer,
        },
        cache: s.cache.map(|_| CacheConfig {
            tier: "l3".into(),
            service: "l3.t.svc".into(),
            replicas: 1,
            page_tokens: PAGE_TOKENS,
            write_policy: WritePolicy::WriteThrough,
        }),
        speculative: s.draft.then(|| Speculative {
            draft_model: draft_model(),
            draft_tokens: 4,
        }),
        spec_guard: s.spec_guard.map(|after| SpecGuard {
            min_accept_length: 1.4,
            max_accept_rate: 0.96,
            after_tokens: after,
            retry_budget: 1,
        }),
        kv_deadline: None,
        transport: TransportChoice::Tcp,
        engine: None,
        peers: Peers {
            prefill_service: None,
            decode_service: None,
            group_service: None,
        },
        ports: Ports {
            control: 0,
            data: 0,
            health: 0,
            front_door: None,
            rank_link: None,
        },
    };
    cfg.check().expect("test config is consistent");
    cfg
}

pub fn api_config(dir: &std::path::Path, cfg: &WorkerConfig) -> EngineApiConfig {
    let mut a = EngineApiConfig::for_worker(cfg, dir);
    a.page_tokens = PAGE_TOKENS;
    a.layout = PoolLayout::PageFirst;
    a.max_call = Duration::from_secs(10);
    a.ack_timeout = Duration::from_secs(10);
    a.claim_deadline = Duration::from_secs(10);
    a
}

pub fn identity(cfg: &WorkerConfig) -> pb::EngineIdentity {
    identity_from_config(cfg, PAGE_TOKENS, PoolLayout::PageFirst, 0)
}

/// A worker's engine API serving on a temporary directory.
pub struct Worker {
    pub dir: tempfile::TempDir,
    pub cfg: WorkerConfig,
    pub api: Arc<EngineApi>,
    pub server: RunningServer,
    /// The store client and registrar, for counting (Embedded cache only).
    pub store: Option<Arc<EmbeddedClient>>,
    pub registrar: Option<Arc<Registrar>>,
    pub metrics: RegistrationMetrics,
}

pub struct Options {
    pub tweak: Box<dyn FnOnce(&mut EngineApiConfig)>,
    /// The connected sidecar, for a Standalone cache.
    pub standalone: Option<Arc<StandaloneClient>>,
    /// Faults injected at the Embedded store client's registrations.
    pub faults: Option<Arc<FaultInjector>>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            tweak: Box::new(|_| {}),
            standalone: None,
            faults: None,
        }
    }
}

/// Starts a worker's engine API with `backend`. With an Embedded cache the pools are carved from an
/// embedded store client's memfd segment and registered; otherwise from a worker-owned segment.
pub fn start_worker(cfg: WorkerConfig, backend: Backend, opts: Options) -> Worker {
    let dir = tempfile::tempdir().unwrap();
    let mut api_cfg = api_config(dir.path(), &cfg);
    (opts.tweak)(&mut api_cfg);
    let health = Arc::new(Health::new());
    let metrics = RegistrationMetrics::default();
    let (pools, store, registrar) = match cfg.memory.client_mode {
        Some(ClientMode::Embedded) => {
            let client = Arc::new(EmbeddedClient::new(
                tandem_worker::memory::segment::SegmentBackend::Memfd,
            ));
            client
                .reserve(PoolSet::bytes_needed(&cfg, &api_cfg).unwrap() as usize)
                .unwrap();
            let store: Arc<dyn StoreClient> = match &opts.faults {
                Some(f) => Arc::new(FaultyClient::new(client.clone(), f.clone())),
                None => client.clone(),
            };
            let registrar = Arc::new(Registrar::new(
                store.clone(),
                health.clone(),
                metrics.clone(),
                RegistrarConfig {
                    policy: cfg.memory.registration_failure,
                    ..RegistrarConfig::default()
                },
            ));
            let pools = PoolSet::new(&cfg, &api_cfg, store, Some(registrar.clone())).unwrap();
            (pools, Some(client), Some(registrar))
        }
        Some(ClientMode::Standalone) => {
            let client = opts
                .standalone
                .expect("a Standalone worker needs its sidecar");
            client
                .reserve(PoolSet::bytes_needed(&cfg, &api_cfg).unwrap() as usize)
                .unwrap();
            let registrar = Arc::new(Registrar::new(
                client.clone() as Arc<dyn StoreClient>,
                health.clone(),
                metrics.clone(),
                RegistrarConfig {
                    policy: cfg.memory.registration_failure,
                    ..RegistrarConfig::default()
                },
            ));
            let pools = PoolSet::new(
                &cfg,
                &api_cfg,
                client as Arc<dyn StoreClient>,
                Some(registrar.clone()),
            )
            .unwrap();
            (pools, None, Some(registrar))
        }
        None => (PoolSet::unregistered(&cfg, &api_cfg).unwrap(), None, None),
    };
    let api = EngineApi::new(&cfg, api_cfg, pools, backend, Arc::new(NoTiers), health).unwrap();
    let server = server::start(api.clone()).unwrap();
    Worker {
        dir,
        cfg,
        api,
        server,
        store,
        registrar,
        metrics,
    }
}

impl Worker {
    pub async fn client(&self) -> EngineClient {
        EngineClient::connect(self.dir.path(), Duration::from_secs(10))
            .await
            .unwrap()
    }

    pub fn live_buffers(&self) -> u64 {
        match &self.store {
            Some(s) => s.host_allocator().stats().live_buffers,
            None => {
                self.api
                    .pools()
                    .store()
                    .host_allocator()
                    .stats()
                    .live_buffers
            }
        }
    }

    pub fn registrations(&self) -> usize {
        self.store.as_ref().map_or(0, |s| s.registered_count())
    }
}

/// Serialises the tests of one binary that count process-wide resources (memfds): tests of a binary
/// run on parallel threads of one process.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Open memfds of this process (`/proc/self/fd` links named `/memfd:…`).
pub fn memfd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("/memfd:"))
        .count()
}

/// The typed error of a failed call (panics on a success or an untyped failure).
pub fn api_err<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> ApiError {
    let st = r.expect_err("the call must be refused");
    ApiError::from_status(&st).unwrap_or_else(|| panic!("untyped refusal: {st:?}"))
}

pub fn client_err<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ApiError {
    match r.expect_err("the call must be refused") {
        ClientError::Api(e) => e,
        other => panic!("untyped failure: {other}"),
    }
}

/// A decode transport that records rooms and aborts and never writes by itself: tests deliver
/// chunks, completion and acks through the decode side.
#[derive(Default)]
pub struct ManualSource {
    pub opened: Mutex<Vec<RoomOpen>>,
    pub aborted: Mutex<Vec<(RoomKey, Vec<PrefillRank>, FailureCause)>>,
}

impl KvSource for ManualSource {
    fn writers(&self, _request_id: u64) -> Vec<PrefillRank> {
        vec![PrefillRank(0)]
    }
    fn open(&self, room: RoomOpen) -> Result<(), String> {
        self.opened.lock().unwrap().push(room);
        Ok(())
    }
    fn abort(&self, key: RoomKey, ranks: &[PrefillRank], cause: FailureCause) {
        self.aborted
            .lock()
            .unwrap()
            .push((key, ranks.to_vec(), cause));
    }
}

/// Waits (bounded) until `f` holds, polling an observable state.
pub async fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes request `request`'s KV for its room page `k` into engine page `page` of every pool.
pub fn write_room_page(att: &Attached, request: u64, tokens: u32, k: u32, page: u32) {
    for pool in &att.pools {
        for layer in 0..pool.geometry().layers {
            let spec = chunk_spec(pool, request, tokens, k, layer);
            let mut buf = vec![0u8; spec.bytes()];
            fill_chunk(&mut buf, &spec);
            pool.write(page, layer, 0, &buf).unwrap();
        }
    }
}

/// Verifies request `request`'s KV in `pages` of every pool; returns the corrupt chunks.
pub fn corrupt_chunks(att: &Attached, request: u64, tokens: u32, pages: &[u32]) -> u64 {
    let mut bad = 0;
    for pool in &att.pools {
        for (k, &page) in pages.iter().enumerate() {
            for layer in 0..pool.geometry().layers {
                let spec = chunk_spec(pool, request, tokens, k as u32, layer);
                let mut buf = vec![0u8; spec.bytes()];
                pool.read(page, layer, 0, &mut buf).unwrap();
                if verify_chunk(&buf, &spec).is_err() {
                    bad += 1;
                }
            }
        }
    }
    bad
}

pub fn target(att: &Attached) -> &tandem_worker::engine_api::client::MappedPool {
    att.pool(PoolRole::Target).unwrap()
}
