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
//! The `Simulated` engine runs the worker image's `tandem-worker sim-engine --serve`, given the
//! same config file the worker reads and the pod's ordinal in its group (the StatefulSet pod
//! index, which is also the numeric suffix of `$POD_NAME` the worker reads), on both pool kinds
//! (the decode worker hands its front door's requests to the engine). Only `Simulated` is served by
//! this version; [`supported`] refuses the others before anything is rendered.

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector,
    Probe, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tandem_crds::{EngineKind, EngineSpec};
use tandem_interfaces::config::{EngineKind as SeatKind, EngineSeat};

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

/// A pool names an engine this version does not serve (condition `Degraded`, reason
/// `EngineUnsupported`; nothing is created or changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EngineUnsupported {
    /// SGLang or vLLM: their adapters are issue 14.
    #[error(
        "spec.engine.kind {kind} is not served by this version: the worker serves the engine API to \
         the Simulated engine only (the SGLang and vLLM adapters are not built yet); set \
         engine.kind: Simulated or remove spec.engine"
    )]
    Kind {
        /// The kind asked for.
        kind: EngineKind,
    },
}

/// Whether the pool's engine (if any) is one this version serves: `Simulated`, on either pool
/// kind.
///
/// # Errors
/// [`EngineUnsupported::Kind`] for `SGLang` and `vLLM`.
pub fn supported(pool: &PoolView<'_>) -> Result<(), EngineUnsupported> {
    match pool.engine.map(|e| e.kind) {
        None | Some(EngineKind::Simulated) => Ok(()),
        Some(kind) => Err(EngineUnsupported::Kind { kind }),
    }
}

/// The worker config's engine seat: `Some` exactly when the pool has `spec.engine`.
pub fn seat(pool: &PoolView<'_>) -> Option<EngineSeat> {
    pool.engine.map(|e| EngineSeat {
        kind: match e.kind {
            EngineKind::Simulated => SeatKind::Simulated,
            EngineKind::SgLang => SeatKind::SgLang,
            EngineKind::Vllm => SeatKind::Vllm,
        },
        socket_dir: ENGINE_SOCKET_DIR.into(),
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

/// The socket volume's mount, the same in the worker and the engine.
pub fn socket_mount() -> VolumeMount {
    VolumeMount {
        name: ENGINE_SOCKET_VOLUME.into(),
        mount_path: ENGINE_SOCKET_DIR.into(),
        ..VolumeMount::default()
    }
}

/// The engine's command line after the image's entrypoint (`tandem-worker` for `Simulated`):
///
/// `sim-engine --serve --socket-dir /run/tandem/engine --config <config_path> --ordinal
/// $(TANDEM_ORDINAL)` then `spec.engine.args`. For `SGLang` and `vLLM` (refused for now, see
/// [`supported`]) only `spec.engine.args`: their adapters' flags come with the adapters.
pub fn engine_args(engine: &EngineSpec, config_path: &str) -> Vec<String> {
    let mut args: Vec<String> = match engine.kind {
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
        EngineKind::SgLang | EngineKind::Vllm => Vec::new(),
    };
    args.extend(engine.args.iter().cloned());
    args
}

/// The `engine` main container of a pool with `spec.engine`: its image (the worker image for a
/// `Simulated` engine without one), [`engine_args`], the pod env the worker gets plus
/// [`ORDINAL_ENV`] (from the [`POD_INDEX_LABEL`] label), `spec.engine.resources`, and the config
/// and socket mounts.
pub fn engine_container(
    pool: &PoolView<'_>,
    engine: &EngineSpec,
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
    Container {
        name: ENGINE_CONTAINER.into(),
        image: Some(engine.image.as_deref().unwrap_or(pool.image).to_owned()),
        args: Some(engine_args(engine, config_path)),
        env: Some(env),
        resources: Some(engine.resources.clone()),
        volume_mounts: Some(vec![config_mount.clone(), socket_mount()]),
        ..Container::default()
    }
}

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
