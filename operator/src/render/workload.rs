//! Kubernetes objects of a pool: one StatefulSet per group, the peers Service, the ConfigMap and
//! (DecodePool) the front-door Service.
//!
//! Each group StatefulSet has `tensor × context` pods with one GPU each and `updateStrategy:
//! OnDelete`: the operator restarts a group as a unit, one group at a time (DESIGN §5). In
//! Standalone client mode each pod gets the `store-client` as a native sidecar (an init container
//! with `restartPolicy: Always`: it starts before the worker and stops after it, the teardown order
//! of DESIGN §5) and a memory-backed `/dev/shm` sized for every host pool. With `spec.engine` the
//! worker becomes a native sidecar too, after the store-client, and the main container is the
//! engine ([`super::engine`]).
//!
//! A group of more than one pod also carries the readiness gate
//! [`crate::gang::GROUP_READY`]: its pods turn `Ready` (and join the Services' ready endpoints)
//! only once the operator saw the whole group `ContainersReady` ([`crate::gang`]). Single-pod
//! groups carry none (their `Ready` already is the group's), so their objects are unchanged.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec, StatefulSetUpdateStrategy};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, ObjectFieldSelector, PodReadinessGate, PodSpec, PodTemplateSpec,
    Probe, ResourceRequirements, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};
use tandem_crds::EngineKind;
use tandem_interfaces::config::{CONFIG_FILE, WorkerConfig};
use tandem_interfaces::memory::ClientMode;

use super::config::{CONTROL_PORT, DATA_PORT, FRONT_DOOR_PORT, HEALTH_PORT, RANK_LINK_PORT};
use super::{PoolView, engine};
use crate::labels::{self, Role};

/// Where the ConfigMap is mounted in every container.
pub const CONFIG_DIR: &str = "/etc/tandem";
/// Grace period for drain on deletion, seconds.
pub const TERMINATION_GRACE_SECONDS: i64 = 120;

/// The revision of a pool: a short hash of everything whose change needs a restart (the rendered
/// config, image, resources, pod overrides, `restart.id` and, when set, `spec.engine` and
/// `spec.placement`). Equal inputs, equal revision; a pool without `spec.engine` or
/// `spec.placement` keeps the revision it had before the field existed. Placement is a pod
/// template change the `OnDelete` StatefulSets never apply by themselves: a new revision is what
/// makes the rollout replace the pods, one group at a time, so they are scheduled by the new rule.
pub fn revision(pool: &PoolView<'_>, config_without_revision: &WorkerConfig) -> String {
    let mut h = Sha256::new();
    let mut feed = |v: serde_json::Value| h.update(v.to_string().as_bytes());
    let mut cfg = config_without_revision.clone();
    cfg.revision = String::new();
    feed(serde_json::to_value(&cfg).unwrap_or_default());
    feed(serde_json::Value::String(pool.image.to_owned()));
    feed(serde_json::to_value(pool.resources).unwrap_or_default());
    feed(serde_json::to_value(pool.pod_template).unwrap_or_default());
    feed(serde_json::Value::String(
        pool.restart_id.unwrap_or_default().to_owned(),
    ));
    if let Some(e) = pool.engine {
        feed(serde_json::to_value(e).unwrap_or_default());
    }
    if let Some(p) = pool.placement {
        feed(serde_json::to_value(p).unwrap_or_default());
    }
    let digest = h.finalize();
    digest.iter().take(5).map(|b| format!("{b:02x}")).collect()
}

fn meta(
    name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: &OwnerReference,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.into()),
        labels: Some(labels),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// The ConfigMap holding `worker.json`.
///
/// # Errors
/// JSON serialization failure (not expected).
pub fn config_map(
    pool: &PoolView<'_>,
    cfg: &WorkerConfig,
    owner: &OwnerReference,
) -> Result<ConfigMap, serde_json::Error> {
    Ok(ConfigMap {
        metadata: meta(
            labels::config_map(pool.name),
            pool.namespace,
            labels::common(pool.name, pool.role),
            owner,
        ),
        data: Some(BTreeMap::from([(
            CONFIG_FILE.to_owned(),
            serde_json::to_string_pretty(cfg)?,
        )])),
        ..ConfigMap::default()
    })
}

/// The headless Service that gives every pod a stable DNS name for peers.
pub fn peers_service(pool: &PoolView<'_>, owner: &OwnerReference) -> Service {
    Service {
        metadata: meta(
            labels::peers_service(pool.name),
            pool.namespace,
            labels::common(pool.name, pool.role),
            owner,
        ),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // Peers must find each other before they are ready (rooms are opened during warm-up).
            publish_not_ready_addresses: Some(true),
            selector: Some(labels::selector(pool.name, pool.role)),
            ports: Some(vec![port("control", CONTROL_PORT), port("data", DATA_PORT)]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// The DecodePool's front door: ready decode pods only. Port `http` targets the worker's front
/// door (also for SGLang and vLLM without a CacheTier, [`engine::pd_pool`]: the front door hands
/// requests to the engines), or — for an SGLang or vLLM engine with a CacheTier, which serve whole
/// requests on their own OpenAI-compatible API — the engine's `engine-http` port
/// ([`engine::ENGINE_HTTP_PORT`]; module docs of [`engine`]).
pub fn front_door_service(
    pool: &PoolView<'_>,
    service_port: i32,
    owner: &OwnerReference,
) -> Service {
    Service {
        metadata: meta(
            pool.name.to_owned(),
            pool.namespace,
            labels::common(pool.name, pool.role),
            owner,
        ),
        spec: Some(ServiceSpec {
            selector: Some(labels::selector(pool.name, pool.role)),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: service_port,
                target_port: Some(IntOrString::Int(i32::from(
                    match pool.engine.map(|e| e.kind) {
                        Some(EngineKind::SgLang | EngineKind::Vllm) if engine::pd_pool(pool) => {
                            FRONT_DOOR_PORT
                        }
                        Some(EngineKind::SgLang | EngineKind::Vllm) => engine::ENGINE_HTTP_PORT,
                        None | Some(EngineKind::Simulated) => FRONT_DOOR_PORT,
                    },
                ))),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn port(name: &str, p: u16) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port: i32::from(p),
        target_port: Some(IntOrString::Int(i32::from(p))),
        ..ServicePort::default()
    }
}

fn container_port(name: &str, p: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: i32::from(p),
        ..ContainerPort::default()
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// One group's StatefulSet at `revision`, with `cfg` already rendered for that revision.
pub fn group_statefulset(
    pool: &PoolView<'_>,
    cfg: &WorkerConfig,
    group: u32,
    owner: &OwnerReference,
) -> StatefulSet {
    let mut selector = labels::selector(pool.name, pool.role);
    selector.insert(labels::GROUP.into(), group.to_string());
    let mut pod_labels = pool.pod_template.labels.clone();
    pod_labels.extend(labels::common(pool.name, pool.role));
    pod_labels.insert(labels::GROUP.into(), group.to_string());
    pod_labels.insert(labels::REVISION.into(), cfg.revision.clone());
    let mut sts_labels = labels::common(pool.name, pool.role);
    sts_labels.insert(labels::GROUP.into(), group.to_string());
    sts_labels.insert(labels::REVISION.into(), cfg.revision.clone());

    let standalone = cfg.memory.client_mode == Some(ClientMode::Standalone);
    let config_mount = VolumeMount {
        name: "config".into(),
        mount_path: CONFIG_DIR.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    };
    let shm_mount = VolumeMount {
        name: "kv-shm".into(),
        mount_path: "/dev/shm".into(),
        ..VolumeMount::default()
    };
    let env = vec![
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        field_env("POD_IP", "status.podIP"),
        EnvVar {
            name: "TANDEM_GROUP".into(),
            value: Some(group.to_string()),
            ..EnvVar::default()
        },
    ];
    let config_arg = format!("{CONFIG_DIR}/{CONFIG_FILE}");

    let mut resources: ResourceRequirements = pool.resources.clone();
    // The pod's one GPU: the engine's when the pool has one (DESIGN §3.1), else the worker's.
    if pool.engine.is_none() {
        resources
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert(engine::GPU_RESOURCE.into(), Quantity("1".into()));
    }
    let mut ports = vec![
        container_port("control", CONTROL_PORT),
        container_port("data", DATA_PORT),
        container_port("health", HEALTH_PORT),
    ];
    if pool.role == Role::Decode {
        ports.push(container_port("http", FRONT_DOOR_PORT));
    }
    if pool.role == Role::Prefill && pool.parallelism.context > 1 {
        ports.push(container_port("rank-link", RANK_LINK_PORT));
    }
    let mut mounts = vec![config_mount.clone()];
    if standalone {
        mounts.push(shm_mount.clone());
    }
    let engine = pool.engine.map(|e| {
        mounts.push(engine::socket_mount());
        engine::engine_container(pool, e, cfg, &config_arg, &env, &config_mount)
    });
    let worker = Container {
        name: "worker".into(),
        image: Some(pool.image.into()),
        args: Some(vec![
            pool.role.as_str().into(),
            "--config".into(),
            config_arg.clone(),
        ]),
        env: Some(env.clone()),
        ports: Some(ports),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".into()),
                port: IntOrString::String("health".into()),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(2),
            ..Probe::default()
        }),
        resources: Some(resources),
        volume_mounts: Some(mounts),
        ..Container::default()
    };
    let mut volumes = vec![Volume {
        name: "config".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: labels::config_map(pool.name),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let mut init_containers = Vec::new();
    if standalone {
        volumes.push(Volume {
            name: "kv-shm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                // Every host pool lives in these segments: target + draft + indexer + snapshot.
                size_limit: Some(Quantity(cfg.memory.segment_bytes.to_string())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        });
        init_containers.push(Container {
            name: "store-client".into(),
            image: Some(pool.image.into()),
            args: Some(vec!["store-client".into(), "--config".into(), config_arg]),
            env: Some(env),
            restart_policy: Some("Always".into()),
            volume_mounts: Some(vec![config_mount, shm_mount]),
            ..Container::default()
        });
    }
    let containers = match engine {
        // The worker starts before the engine and stops after it (DESIGN §3.1).
        Some(engine) => {
            volumes.push(engine::socket_volume());
            volumes.extend(pool.engine.and_then(|e| engine::shm_volume(e.kind, cfg)));
            init_containers.push(engine::native_sidecar(worker));
            vec![engine]
        }
        None => vec![worker],
    };
    let o = pool.pod_template;
    StatefulSet {
        metadata: meta(
            labels::group_name(pool.name, group),
            pool.namespace,
            sts_labels,
            owner,
        ),
        spec: StatefulSetSpec {
            replicas: Some(i32::try_from(pool.group_size()).unwrap_or(i32::MAX)),
            service_name: Some(labels::peers_service(pool.name)),
            pod_management_policy: Some("Parallel".into()),
            update_strategy: Some(StatefulSetUpdateStrategy {
                type_: Some("OnDelete".into()),
                ..StatefulSetUpdateStrategy::default()
            }),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: (!o.annotations.is_empty()).then(|| o.annotations.clone()),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers,
                    init_containers: (!init_containers.is_empty()).then_some(init_containers),
                    volumes: Some(volumes),
                    node_selector: (!o.node_selector.is_empty()).then(|| o.node_selector.clone()),
                    tolerations: (!o.tolerations.is_empty()).then(|| o.tolerations.clone()),
                    priority_class_name: o.priority_class_name.clone(),
                    service_account_name: o.service_account_name.clone(),
                    termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
                    affinity: super::placement::affinity(pool, group),
                    readiness_gates: (pool.group_size() > 1).then(|| {
                        vec![PodReadinessGate {
                            condition_type: crate::gang::GROUP_READY.into(),
                        }]
                    }),
                    ..PodSpec::default()
                }),
            },
            ..StatefulSetSpec::default()
        },
        ..StatefulSet::default()
    }
}
