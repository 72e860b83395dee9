//! Kubernetes objects of a CacheTier: the store StatefulSet of `tandem-worker cache` replicas, its
//! headless Service `<tier>-store` and the ConfigMap `<tier>-config` holding `tier.json`.
//!
//! The store keeps its objects under [`DATA_DIR`]. With `spec.persistence` that directory is a
//! PersistentVolumeClaim per replica (a `volumeClaimTemplate`), so a restarted replica loads its
//! objects back (DESIGN contract 7); without it the directory is an `emptyDir` that dies with the
//! pod (memory-only tier: nothing survives a restart). Claims are retained when the StatefulSet is
//! deleted or scaled down: deleting cached data is a separate, explicit act.
//!
//! The StatefulSet uses `RollingUpdate` (one replica at a time, the next only once the previous is
//! Ready): a store replica is Ready as soon as it serves, while loadback continues in the
//! background (worker/interfaces/README.md §2: "warming is NOT unready for cache"), so clients lose
//! at most one replica's objects at a time, and only until its loadback ends.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    StatefulSet, StatefulSetPersistentVolumeClaimRetentionPolicy, StatefulSetSpec,
    StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, ObjectFieldSelector, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PodSpec, PodTemplateSpec, Probe, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};
use tandem_crds::{
    CacheTier, EvictionPolicy, RegistrationFailurePolicy, WritePolicy as TierWritePolicy,
};
use tandem_interfaces::config::{
    CACHE_TIER_CONFIG_API_VERSION, CACHE_TIER_CONFIG_FILE, CacheEviction, CachePorts,
    CacheTierConfig, DEFAULT_MAX_PARALLEL, EvictionOrder, IndexerGeometry, WritePolicy,
};
use tandem_interfaces::memory::FailurePolicy;
use tandem_interfaces::memory::PoolLayout;

use super::config::{HEALTH_PORT, RenderError, model_identity};
use super::workload::CONFIG_DIR;
use crate::labels::{self, Role};
use crate::quantity;

/// L3 protocol port of every store replica (defined in `tandem-crds`; worker/interfaces/README.md
/// §2).
pub use tandem_crds::ports::L3_PORT;
/// Data directory of a store replica (worker/interfaces/README.md §2).
pub const DATA_DIR: &str = tandem_interfaces::config::DEFAULT_CACHE_DATA_DIR;
/// File name of the tier config inside `<tier>-config`.
pub const TIER_CONFIG_FILE: &str = CACHE_TIER_CONFIG_FILE;
/// Schema version of [`TierConfig`].
pub const TIER_CONFIG_API_VERSION: &str = CACHE_TIER_CONFIG_API_VERSION;
/// Grace period of a store replica: its SIGTERM path syncs the manifest (DESIGN §5).
pub const STORE_TERMINATION_GRACE_SECONDS: i64 = 60;

/// The resolved config of one store replica: the worker's [`CacheTierConfig`] (from
/// `tandem-interfaces`, worker/interfaces/README.md §2), written as `tier.json` and read by
/// `tandem-worker cache --config /etc/tandem/tier.json`.
///
/// Every CacheTier spec field lands here, in the client pools' worker config (allocator, client
/// mode, registration-failure policy, write policy, page tokens — see `render::config`), or in the
/// StatefulSet (image, replicas, persistence); `tests/fields.rs` enumerates them.
pub type TierConfig = CacheTierConfig;

/// Renders the tier config of `tier` (revision filled in).
///
/// # Errors
/// [`RenderError`] when `memory` or `persistence.size` is not a byte quantity or the model geometry
/// does not match its attention kind (admission normally refuses both).
pub fn tier_config(tier: &CacheTier) -> Result<TierConfig, RenderError> {
    let s = &tier.spec;
    let memory_bytes = quantity::bytes("spec.memory", &s.memory)?;
    let disk_bytes = match &s.persistence {
        Some(p) => quantity::bytes("spec.persistence.size", &p.size)?,
        None => memory_bytes,
    };
    let mut cfg = CacheTierConfig {
        api_version: CACHE_TIER_CONFIG_API_VERSION.into(),
        namespace: tier.metadata.namespace.clone().unwrap_or_default(),
        tier: tier.metadata.name.clone().unwrap_or_default(),
        revision: String::new(),
        model: model_identity("target", &s.model)?,
        indexer: s.model.indexer.as_ref().map(|ix| IndexerGeometry {
            head_dim: u32::try_from(ix.head_dim).unwrap_or(0),
            dtype_bytes: u32::try_from(ix.dtype.bytes()).unwrap_or(u32::MAX),
        }),
        page_tokens: u32::try_from(s.page_tokens).unwrap_or(0),
        layout: PoolLayout::default(),
        max_tensor: DEFAULT_MAX_PARALLEL,
        max_context: DEFAULT_MAX_PARALLEL,
        memory_bytes,
        disk_bytes,
        persistent: s.persistence.is_some(),
        data_dir: DATA_DIR.into(),
        eviction: CacheEviction {
            policy: match s.eviction.policy {
                EvictionPolicy::LRU => EvictionOrder::Lru,
            },
            high_watermark_percent: u32::try_from(s.eviction.high_watermark_percent).unwrap_or(90),
        },
        write_policy: match s.write_policy {
            TierWritePolicy::WriteThrough => WritePolicy::WriteThrough,
            TierWritePolicy::WriteBack => WritePolicy::WriteBack,
        },
        ports: CachePorts {
            l3: L3_PORT,
            health: HEALTH_PORT,
        },
        registration_failure: Some(match s.registration_failure_policy {
            RegistrationFailurePolicy::FailClosed => FailurePolicy::FailClosed,
            RegistrationFailurePolicy::FallbackToL2 => FailurePolicy::FallbackToL2,
        }),
    };
    cfg.revision = tier_revision(&cfg, &s.image);
    Ok(cfg)
}

/// Short hash of the config (revision blanked) and the image: equal inputs, equal revision.
pub fn tier_revision(cfg: &TierConfig, image: &str) -> String {
    let mut c = cfg.clone();
    c.revision = String::new();
    let mut h = Sha256::new();
    h.update(serde_json::to_string(&c).unwrap_or_default().as_bytes());
    h.update(image.as_bytes());
    h.finalize()
        .iter()
        .take(5)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn meta(tier: &CacheTier, name: String, owner: &OwnerReference) -> ObjectMeta {
    let name_of_tier = tier.metadata.name.as_deref().unwrap_or_default();
    ObjectMeta {
        name: Some(name),
        namespace: tier.metadata.namespace.clone(),
        labels: Some(labels::common(name_of_tier, Role::Cache)),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// The ConfigMap `<tier>-config` with `tier.json`.
///
/// # Errors
/// JSON serialization failure (not expected).
pub fn tier_config_map(
    tier: &CacheTier,
    cfg: &TierConfig,
    owner: &OwnerReference,
) -> Result<ConfigMap, serde_json::Error> {
    let name = tier.metadata.name.as_deref().unwrap_or_default();
    Ok(ConfigMap {
        metadata: meta(tier, labels::config_map(name), owner),
        data: Some(BTreeMap::from([(
            TIER_CONFIG_FILE.to_owned(),
            serde_json::to_string_pretty(cfg)?,
        )])),
        ..ConfigMap::default()
    })
}

/// The headless Service `<tier>-store`: replica `i` is `<tier>-store-<i>.<tier>-store`. Only
/// ready (serving) replicas are published.
pub fn store_service(tier: &CacheTier, owner: &OwnerReference) -> Service {
    let name = tier.metadata.name.as_deref().unwrap_or_default();
    Service {
        metadata: meta(tier, labels::store_name(name), owner),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(labels::selector(name, Role::Cache)),
            ports: Some(vec![
                service_port("l3", L3_PORT),
                service_port("health", HEALTH_PORT),
            ]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn service_port(name: &str, p: u16) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port: i32::from(p),
        target_port: Some(IntOrString::Int(i32::from(p))),
        ..ServicePort::default()
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

/// The store StatefulSet `<tier>-store` with `replicas` replicas (the controller passes
/// `spec.replicas`, or 0 during teardown).
pub fn store_statefulset(
    tier: &CacheTier,
    cfg: &TierConfig,
    replicas: i32,
    owner: &OwnerReference,
) -> StatefulSet {
    let name = tier.metadata.name.as_deref().unwrap_or_default();
    let s = &tier.spec;
    let mut pod_labels = labels::common(name, Role::Cache);
    pod_labels.insert(labels::REVISION.into(), cfg.revision.clone());
    let mut sts_meta = meta(tier, labels::store_name(name), owner);
    if let Some(l) = sts_meta.labels.as_mut() {
        l.insert(labels::REVISION.into(), cfg.revision.clone());
    }
    let data_volume = "data";
    let (volumes_extra, claims) = match &s.persistence {
        Some(p) => (
            None,
            Some(vec![PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some(data_volume.into()),
                    labels: Some(labels::common(name, Role::Cache)),
                    ..ObjectMeta::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    access_modes: Some(vec!["ReadWriteOnce".into()]),
                    storage_class_name: p.storage_class_name.clone(),
                    resources: Some(VolumeResourceRequirements {
                        requests: Some(BTreeMap::from([("storage".into(), p.size.clone())])),
                        ..VolumeResourceRequirements::default()
                    }),
                    ..PersistentVolumeClaimSpec::default()
                }),
                ..PersistentVolumeClaim::default()
            }]),
        ),
        None => (
            Some(Volume {
                name: data_volume.into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    size_limit: Some(s.memory.clone()),
                    ..EmptyDirVolumeSource::default()
                }),
                ..Volume::default()
            }),
            None,
        ),
    };
    let mut volumes = vec![Volume {
        name: "config".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: labels::config_map(name),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    volumes.extend(volumes_extra);
    let container = Container {
        name: "store".into(),
        image: Some(s.image.clone()),
        args: Some(vec![
            "cache".into(),
            "--config".into(),
            format!("{CONFIG_DIR}/{TIER_CONFIG_FILE}"),
        ]),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IP", "status.podIP"),
        ]),
        ports: Some(vec![
            ContainerPort {
                name: Some("l3".into()),
                container_port: i32::from(L3_PORT),
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("health".into()),
                container_port: i32::from(HEALTH_PORT),
                ..ContainerPort::default()
            },
        ]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".into()),
                port: IntOrString::String("health".into()),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(2),
            ..Probe::default()
        }),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "config".into(),
                mount_path: CONFIG_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: data_volume.into(),
                mount_path: DATA_DIR.into(),
                ..VolumeMount::default()
            },
        ]),
        ..Container::default()
    };
    StatefulSet {
        metadata: sts_meta,
        spec: StatefulSetSpec {
            replicas: Some(replicas),
            service_name: Some(labels::store_name(name)),
            pod_management_policy: Some("Parallel".into()),
            update_strategy: Some(StatefulSetUpdateStrategy {
                type_: Some("RollingUpdate".into()),
                ..StatefulSetUpdateStrategy::default()
            }),
            // The claims hold the tier's L3 data: they survive scale-down and every restart
            // (that is what loadback reads), and go with the tier when it is deleted — a deleted
            // stack leaves nothing but the CRDs (issue 4, suite 6).
            persistent_volume_claim_retention_policy: Some(
                StatefulSetPersistentVolumeClaimRetentionPolicy {
                    when_deleted: Some("Delete".into()),
                    when_scaled: Some("Retain".into()),
                },
            ),
            selector: LabelSelector {
                match_labels: Some(labels::selector(name, Role::Cache)),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: Some(volumes),
                    termination_grace_period_seconds: Some(STORE_TERMINATION_GRACE_SECONDS),
                    ..PodSpec::default()
                }),
            },
            volume_claim_templates: claims,
            ..StatefulSetSpec::default()
        },
        ..StatefulSet::default()
    }
}
