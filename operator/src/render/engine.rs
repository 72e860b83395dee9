//! The engine side of a pool's pod (DESIGN §3.1): the `engine` main container, the socket
//! `emptyDir` it shares with the worker, and the worker config's [`EngineSeat`].
//!
//! With `spec.engine` set, a pod is (in start order): the `store-client` native sidecar
//! (Standalone client mode only), the `worker` as a native sidecar (an init container with
//! `restartPolicy: Always`: it starts before the engine and stops after it), then the main
//! container [`ENGINE_CONTAINER`]. Both the worker and the engine mount the `emptyDir`
//! [`ENGINE_SOCKET_VOLUME`] at [`ENGINE_SOCKET_DIR`], where the worker serves the engine API
//! (`engine.sock`, `pools.sock`). Without `spec.engine` the pod is the worker alone, as before.
//!
//! The engine container holds the pod's GPU (`nvidia.com/gpu: 1`); the worker sidecar none.
//!
//! Per kind ([`engine_command`], [`engine_args`]):
//! - `Simulated` runs the worker image's `tandem-worker sim-engine --serve`, given the same config
//!   file the worker reads and the pod's ordinal in its group (the StatefulSet pod index, which is
//!   also the numeric suffix of `$POD_NAME` the worker reads), on both pool kinds (the decode
//!   worker hands its front door's requests to the engine).
//! - `SGLang` with a CacheTier runs `python3 -m sglang.launch_server` with Tandem's HiCache L3
//!   backend (`tandem_kv.sglang.TandemHiCacheStorage` through `--hicache-storage-backend
//!   dynamic`), its page size set to the worker's and the worker config's model in the backend's
//!   extra config (so the attach identity is the worker's own model, never a guess from the host
//!   pool). Without one ([`pd_through_tandem`]) it runs in SGLang's PD mode with Tandem's transfer
//!   backend (`--disaggregation-mode prefill|decode --disaggregation-transfer-backend tandem`,
//!   `tandem_kv.sglang_pd`, configured by [`SGLANG_PD_CONFIG_ENV`]).
//! - `vLLM` with a CacheTier runs `vllm serve` with `OffloadingConnector` +
//!   `TieringOffloadingSpec` and Tandem's secondary tier (`tandem_kv.vllm.TandemSecondaryTier`):
//!   one offloaded chunk is one worker page (`block_size` = the page's tokens) and vLLM's own CPU
//!   tier is `hostPool.size`. Without one ([`pd_through_tandem`]) it runs with Tandem's PD connector
//!   (`tandem_kv.vllm_pd.TandemConnector`, `kv_producer` / `kv_consumer`, failed loads
//!   recomputed).
//!
//! SGLang and vLLM serve their OpenAI-compatible API on [`ENGINE_HTTP_PORT`] (container port
//! `engine-http`, with a readiness probe on its `/health`). The DecodePool Service's `http` port
//! targets it — the engines serve whole requests, and Tandem their KV tiers (L2 in the worker, L3
//! in the CacheTier) — except without a CacheTier (prefill/decode through Tandem), where it
//! targets the worker's front door, which hands each request to the chosen prefill's engine and
//! to its own (README "Engines on Kubernetes").

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, Probe, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::json;
use tandem_crds::{EngineKind, EngineSpec};
use tandem_interfaces::config::{EngineKind as SeatKind, EngineSeat, WorkerConfig};

use super::PoolView;

/// Name of the engine's main container.
pub const ENGINE_CONTAINER: &str = "engine";
/// Name of the `emptyDir` volume holding the engine-API sockets.
pub const ENGINE_SOCKET_VOLUME: &str = "engine-socket";
/// Where [`ENGINE_SOCKET_VOLUME`] is mounted in the worker and the engine container; the
/// worker config's `engine.socketDir`.
pub const ENGINE_SOCKET_DIR: &str = "/run/tandem/engine";
/// The engine container's variable holding the pod's ordinal in its group.
pub const ORDINAL_ENV: &str = "TANDEM_ORDINAL";
/// The pod label the StatefulSet controller sets to the pod's ordinal (Kubernetes ≥ 1.28).
pub const POD_INDEX_LABEL: &str = "apps.kubernetes.io/pod-index";
/// The engine container's variable naming [`ENGINE_SOCKET_DIR`] (the adapters' default).
pub const SOCKET_DIR_ENV: &str = "TANDEM_ENGINE_SOCKET_DIR";
/// Name of the engine's HTTP port (SGLang and vLLM: their OpenAI-compatible API).
pub const ENGINE_HTTP_PORT_NAME: &str = "engine-http";
pub use tandem_crds::ports::ENGINE_HTTP_PORT;

/// The worker config's engine seat: `Some` exactly when the pool has `spec.engine`.
pub fn seat(pool: &PoolView<'_>) -> Option<EngineSeat> {
    pool.engine.map(|e| EngineSeat {
        kind: match e.kind {
            EngineKind::Simulated => SeatKind::Simulated,
            EngineKind::SgLang => SeatKind::SgLang,
            EngineKind::Vllm => SeatKind::Vllm,
        },
        socket_dir: ENGINE_SOCKET_DIR.into(),
        http_port: None,
    })
}

/// The socket volume (a plain, disk-backed `emptyDir`: it holds two UNIX sockets; the KV pools
/// cross as file descriptors, never through it).
pub fn socket_volume() -> Volume {
    Volume {
        name: ENGINE_SOCKET_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// Name of the memory-backed `emptyDir` an SGLang or vLLM engine gets as its `/dev/shm`.
pub const ENGINE_SHM_VOLUME: &str = "engine-shm";
/// Bytes of `/dev/shm` an SGLang or vLLM engine gets besides vLLM's CPU tier: the engines'
/// own shared memory (NCCL and gloo buffers, SGLang's IPC between its processes). A container
/// runtime's default `/dev/shm` is 64 MiB.
pub const ENGINE_SHM_BASE_BYTES: u64 = 2 << 30;

/// The engine's `/dev/shm` (SGLang and vLLM; `None` for `Simulated`): a memory-backed `emptyDir`
/// of [`ENGINE_SHM_BASE_BYTES`], plus, for vLLM, its CPU offload tier — a file of
/// `cpu_bytes_to_use` (the target pool's bytes, [`engine_args`]) under `/dev/shm`
/// (vLLM 0.33 `kv_offload/cpu/shared_offload_region.py`). Memory-backed: it counts against the
/// pod's memory.
pub fn shm_volume(kind: EngineKind, cfg: &WorkerConfig) -> Option<Volume> {
    let bytes = match kind {
        EngineKind::Simulated => return None,
        EngineKind::SgLang => ENGINE_SHM_BASE_BYTES,
        EngineKind::Vllm if pd_through_tandem(cfg) => ENGINE_SHM_BASE_BYTES,
        EngineKind::Vllm => ENGINE_SHM_BASE_BYTES + cfg.memory.target_pool_bytes,
    };
    Some(Volume {
        name: ENGINE_SHM_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".into()),
            size_limit: Some(Quantity(bytes.to_string())),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    })
}

/// Whether an SGLang or vLLM pool with this worker config runs prefill/decode through Tandem (no
/// CacheTier): a vLLM engine gets `TandemConnector` (`tandem_kv.vllm_pd`; `kv_producer` on a
/// PrefillPool, `kv_consumer` on a DecodePool), an SGLang engine SGLang's PD mode with the
/// `tandem` transfer backend (`tandem_kv.sglang_pd`), and the DecodePool Service targets the
/// worker's front door, which hands each request to the chosen prefill's engine and to its own.
/// With a CacheTier the engine gets the KV tier instead (SGLang's HiCache L3 backend, vLLM's
/// offloading tier) and serves whole requests on its own API: both on one worker pool (the pool's
/// pages split between them) are not rendered yet.
pub fn pd_through_tandem(cfg: &WorkerConfig) -> bool {
    cfg.cache.is_none()
        && cfg
            .engine
            .as_ref()
            .is_some_and(|e| matches!(e.kind, SeatKind::Vllm | SeatKind::SgLang))
}

/// The engine container's variable holding the `tandem` SGLang transfer backend's config (JSON:
/// `socket_dir` and the worker config's `model`; `tandem_kv.sglang_pd.CONFIG_ENV`).
pub const SGLANG_PD_CONFIG_ENV: &str = "TANDEM_SGLANG_PD";

/// How a pool's engine moves prefill → decode KV: what must be equal on a DecodePool and its
/// PrefillPool for any KV to move (the DecodePool refuses a pair that differs,
/// `PrefillEngineMismatch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPath {
    /// Through the engine API: the Simulated engine (or none: the worker's built-in one).
    EngineApi,
    /// Through `tandem_kv.vllm_pd.TandemConnector` ([`pd_pool`]).
    VllmConnector,
    /// Through SGLang's `tandem` transfer backend, `tandem_kv.sglang_pd` ([`pd_pool`]).
    SglangBackend,
    /// Not at all: the engine serves whole requests (SGLang; vLLM with a CacheTier).
    WholeRequests,
}

impl std::fmt::Display for KvPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvPath::EngineApi => "the engine API (Simulated engine)",
            KvPath::VllmConnector => "vLLM's TandemConnector (vLLM without a CacheTier)",
            KvPath::SglangBackend => {
                "SGLang's tandem transfer backend (SGLang without a CacheTier)"
            }
            KvPath::WholeRequests => "no transfer (the engine serves whole requests)",
        })
    }
}

/// The [`KvPath`] of `pool`.
pub fn kv_path(pool: &PoolView<'_>) -> KvPath {
    match pool.engine.map(|e| e.kind) {
        None | Some(EngineKind::Simulated) => KvPath::EngineApi,
        Some(EngineKind::Vllm) if pd_pool(pool) => KvPath::VllmConnector,
        Some(EngineKind::SgLang) if pd_pool(pool) => KvPath::SglangBackend,
        Some(EngineKind::Vllm | EngineKind::SgLang) => KvPath::WholeRequests,
    }
}

/// [`pd_through_tandem`] read from the pool (its worker config's `cache` is set exactly when the
/// pool has a `cacheTierRef`).
pub fn pd_pool(pool: &PoolView<'_>) -> bool {
    pool.cache_tier_ref.is_none()
        && pool
            .engine
            .is_some_and(|e| matches!(e.kind, EngineKind::Vllm | EngineKind::SgLang))
}

/// The socket volume's mount, the same in the worker and the engine.
pub fn socket_mount() -> VolumeMount {
    VolumeMount {
        name: ENGINE_SOCKET_VOLUME.into(),
        mount_path: ENGINE_SOCKET_DIR.into(),
        ..VolumeMount::default()
    }
}

/// The engine container's command: `None` for `Simulated` (the worker image's entrypoint,
/// `tandem-worker`); `python3 -m sglang.launch_server` for SGLang; `vllm serve` for vLLM.
pub fn engine_command(kind: EngineKind) -> Option<Vec<String>> {
    let argv: &[&str] = match kind {
        EngineKind::Simulated => return None,
        EngineKind::SgLang => &["python3", "-m", "sglang.launch_server"],
        EngineKind::Vllm => &["vllm", "serve"],
    };
    Some(argv.iter().map(|a| (*a).to_owned()).collect())
}

/// The engine's arguments. `Simulated`: the operator's, then `spec.engine.args`. SGLang and vLLM:
/// `spec.engine.args` first (vLLM wants its model as the first argument: `vllm serve <model>`,
/// and refuses `--served-model-name` otherwise), then the operator's — last, so that they win over
/// a user flag argparse reads as the same option (an abbreviation, `_` for `-`); admission refuses
/// user args that repeat them outright (`tandem_crds::SGLANG_OWNED_FLAGS`,
/// `tandem_crds::VLLM_OWNED_FLAGS`).
///
/// - `Simulated`: `sim-engine --serve --socket-dir /run/tandem/engine --config <config_path>
///   --ordinal $(TANDEM_ORDINAL)`.
/// - `SGLang` through Tandem ([`pd_through_tandem`]): `--host 0.0.0.0 --port 8100 --page-size
///   <page tokens> --disaggregation-mode prefill|decode --disaggregation-transfer-backend tandem`
///   (the backend's config is [`SGLANG_PD_CONFIG_ENV`]).
/// - `SGLang` with a CacheTier: `--host 0.0.0.0 --port 8100 --page-size <page tokens> --enable-hierarchical-cache
///   --hicache-size <hostPool.size in GiB, rounded up> --hicache-storage-backend dynamic
///   --hicache-storage-backend-extra-config <json>`, the JSON naming
///   `tandem_kv.sglang.TandemHiCacheStorage`, the socket directory and the worker's model (SGLang
///   0.5.23 `HiCacheStorageConfig.extra_config`; keys in `tandem_kv/sglang.py`). Without
///   `--hicache-size` SGLang sizes its host pool from the memory it sees (the node's).
/// - `vLLM`: `--host 0.0.0.0 --port 8100 --kv-transfer-config <json>`: `OffloadingConnector`,
///   `kv_both`, `TieringOffloadingSpec` with `block_size` = the worker's page tokens (one offloaded
///   chunk is one worker page, which the tier checks at attach), `cpu_bytes_to_use` = the target
///   pool's bytes, and the secondary tier `TandemSecondaryTier` from `tandem_kv.vllm` with the
///   socket directory and the worker's model (vLLM 0.33.0 `kv_offload/tiering`; keys in
///   `tandem_kv/vllm.py`).
///
/// `cfg` is the pool's rendered worker config (its model, page size and pool bytes).
pub fn engine_args(engine: &EngineSpec, cfg: &WorkerConfig, config_path: &str) -> Vec<String> {
    let page_tokens = cfg
        .cache
        .as_ref()
        .map_or(super::config::DEFAULT_PAGE_TOKENS, |c| c.page_tokens);
    let model = serde_json::to_value(&cfg.model).unwrap_or_default();
    let http = ["--host", "0.0.0.0", "--port"].map(str::to_owned);
    let ours: Vec<String> = match engine.kind {
        EngineKind::Simulated => [
            "sim-engine",
            "--serve",
            "--socket-dir",
            ENGINE_SOCKET_DIR,
            "--config",
            config_path,
            "--ordinal",
            &format!("$({ORDINAL_ENV})"),
        ]
        .map(str::to_owned)
        .to_vec(),
        EngineKind::SgLang if pd_through_tandem(cfg) => {
            let mut a = http.to_vec();
            a.extend([
                ENGINE_HTTP_PORT.to_string(),
                "--page-size".into(),
                page_tokens.to_string(),
                "--disaggregation-mode".into(),
                match cfg.role {
                    tandem_interfaces::config::WorkerRole::Prefill => "prefill",
                    tandem_interfaces::config::WorkerRole::Decode => "decode",
                }
                .into(),
                "--disaggregation-transfer-backend".into(),
                "tandem".into(),
            ]);
            a
        }
        EngineKind::SgLang => {
            let extra = json!({
                "backend_name": "tandem",
                "module_path": "tandem_kv.sglang",
                "class_name": "TandemHiCacheStorage",
                "interface_v1": 1,
                "socket_dir": ENGINE_SOCKET_DIR,
                "model": model,
            });
            let gib = cfg.memory.target_pool_bytes.div_ceil(1 << 30).max(1);
            let mut a = http.to_vec();
            a.extend([
                ENGINE_HTTP_PORT.to_string(),
                "--page-size".into(),
                page_tokens.to_string(),
                "--enable-hierarchical-cache".into(),
                "--hicache-size".into(),
                gib.to_string(),
                "--hicache-storage-backend".into(),
                "dynamic".into(),
                "--hicache-storage-backend-extra-config".into(),
                extra.to_string(),
            ]);
            a
        }
        EngineKind::Vllm => {
            let transfer = if pd_through_tandem(cfg) {
                json!({
                    "kv_connector": "TandemConnector",
                    "kv_connector_module_path": "tandem_kv.vllm_pd",
                    "kv_role": match cfg.role {
                        tandem_interfaces::config::WorkerRole::Prefill => "kv_producer",
                        tandem_interfaces::config::WorkerRole::Decode => "kv_consumer",
                    },
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "socket_dir": ENGINE_SOCKET_DIR,
                        "model": model,
                    },
                })
            } else {
                json!({
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "spec_name": "TieringOffloadingSpec",
                        "block_size": page_tokens,
                        "cpu_bytes_to_use": cfg.memory.target_pool_bytes,
                        "secondary_tiers": [{
                            "type": "TandemSecondaryTier",
                            "module_path": "tandem_kv.vllm",
                            "socket_dir": ENGINE_SOCKET_DIR,
                            "model": model,
                        }],
                    },
                })
            };
            let mut a = http.to_vec();
            a.extend([
                ENGINE_HTTP_PORT.to_string(),
                "--kv-transfer-config".into(),
                transfer.to_string(),
            ]);
            a
        }
    };
    match engine.kind {
        EngineKind::Simulated => ours
            .into_iter()
            .chain(engine.args.iter().cloned())
            .collect(),
        EngineKind::SgLang | EngineKind::Vllm => engine.args.iter().cloned().chain(ours).collect(),
    }
}

/// The `engine` main container of a pool with `spec.engine`: its image (the worker image for a
/// `Simulated` engine without one), [`engine_command`] and [`engine_args`], the pod env the worker
/// gets plus [`ORDINAL_ENV`] (from the [`POD_INDEX_LABEL`] label), [`SOCKET_DIR_ENV`] and
/// `spec.engine.env`, `spec.engine.resources` with the pod's one GPU, the `engine-http` port
/// and a readiness probe on its `/health` (SGLang and vLLM), and the config and socket mounts
/// (plus [`shm_volume`] at `/dev/shm` for SGLang and vLLM).
pub fn engine_container(
    pool: &PoolView<'_>,
    engine: &EngineSpec,
    cfg: &WorkerConfig,
    config_path: &str,
    pod_env: &[EnvVar],
    config_mount: &VolumeMount,
) -> Container {
    let mut env = pod_env.to_vec();
    env.push(EnvVar {
        name: ORDINAL_ENV.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: format!("metadata.labels['{POD_INDEX_LABEL}']"),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    });
    env.push(EnvVar {
        name: SOCKET_DIR_ENV.into(),
        value: Some(ENGINE_SOCKET_DIR.into()),
        ..EnvVar::default()
    });
    if engine.kind == EngineKind::SgLang && pd_through_tandem(cfg) {
        let pd = json!({"socket_dir": ENGINE_SOCKET_DIR, "model": cfg.model});
        env.push(EnvVar {
            name: SGLANG_PD_CONFIG_ENV.into(),
            value: Some(pd.to_string()),
            ..EnvVar::default()
        });
    }
    env.extend(engine.env.iter().cloned());
    let mut resources = engine.resources.clone();
    resources
        .limits
        .get_or_insert_with(BTreeMap::new)
        .insert(GPU_RESOURCE.into(), Quantity("1".into()));
    let serves_http = engine.kind != EngineKind::Simulated;
    let ports = serves_http.then(|| {
        vec![ContainerPort {
            name: Some(ENGINE_HTTP_PORT_NAME.into()),
            container_port: i32::from(ENGINE_HTTP_PORT),
            ..ContainerPort::default()
        }]
    });
    // The pod is Ready only once the engine's API answers (after the model loaded), not merely
    // once the adapter attached to the worker: the Service targets that API, or (PD) the
    // front door, which hands requests to it, and the prefills' API takes the front doors'.
    let readiness_probe = serves_http.then(|| Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/health".into()),
            port: IntOrString::String(ENGINE_HTTP_PORT_NAME.into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(5),
        ..Probe::default()
    });
    let mut mounts = vec![config_mount.clone(), socket_mount()];
    if shm_volume(engine.kind, cfg).is_some() {
        mounts.push(VolumeMount {
            name: ENGINE_SHM_VOLUME.into(),
            mount_path: "/dev/shm".into(),
            ..VolumeMount::default()
        });
    }
    Container {
        name: ENGINE_CONTAINER.into(),
        image: Some(engine.image.as_deref().unwrap_or(pool.image).to_owned()),
        command: engine_command(engine.kind),
        args: Some(engine_args(engine, cfg, config_path)),
        env: Some(env),
        ports,
        readiness_probe,
        resources: Some(resources),
        volume_mounts: Some(mounts),
        ..Container::default()
    }
}

/// The extended resource of the pod's one GPU (on the engine container when the pool has an
/// engine, else on the worker).
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// Seconds between startup probes of the worker sidecar.
const STARTUP_PERIOD_SECONDS: i32 = 1;
/// Startup probes the worker sidecar may fail before the kubelet restarts it (5 min at one a
/// second: pool allocation and registration run before the health port answers).
const STARTUP_FAILURE_THRESHOLD: i32 = 300;

/// `worker` (the container a pool without engine runs) as a native sidecar: `restartPolicy:
/// Always`, and a startup probe on `GET /healthz` of the health port, so that the kubelet starts
/// the engine only once the worker's process serves (a native sidecar's startup probe gates the
/// containers after it). Everything else — args, env, ports, readiness probe (`/readyz`, which
/// counts for the pod's readiness), resources with the pod's GPU, mounts — is unchanged.
pub fn native_sidecar(worker: Container) -> Container {
    Container {
        restart_policy: Some("Always".into()),
        startup_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz".into()),
                port: IntOrString::String("health".into()),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(STARTUP_PERIOD_SECONDS),
            failure_threshold: Some(STARTUP_FAILURE_THRESHOLD),
            ..Probe::default()
        }),
        ..worker
    }
}
