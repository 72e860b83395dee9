//! Local persistent volumes: the `tandem-e2e-local` StorageClass and its provisioner
//! (worker/interfaces/README.md §5).
//!
//! `cluster up` creates [`storage_class`], the cluster's default class (provisioner
//! [`PROVISIONER`], `Immediate` binding, reclaim `Delete`). The runner plays the external
//! provisioner: for every `Pending` claim of that class without a volume it creates a
//! PersistentVolume ([`volume_for_claim`]) — a `hostPath` directory `<runner dir>/volumes/pvc-<uid>`
//! pre-bound to the claim through `claimRef` — and kube-controller-manager's PV controller then binds
//! the pair, exactly as with a CSI provisioner. When a claim is deleted the volume goes `Released`;
//! the runner removes the directory (only one under its own dir) and the PersistentVolume
//! ([`should_reclaim`]).
//!
//! Pods mount such a claim as that directory ([`claim_directory`]), so data outlives the pod: a
//! StatefulSet pod deleted and recreated finds what it wrote (the L3 store's loadback after a rolling
//! restart depends on it). Capacity is not enforced and `readOnly` is not honoured (no mount
//! namespace); access modes are copied from the claim.
//!
//! Except in the second class, [`SIZED_STORAGE_CLASS`] (same provisioner, not the default): its
//! volume directory is a `tmpfs` mounted with the claim's requested size ([`tmpfs_bytes`]), so a
//! write past the capacity fails with `ENOSPC` as on a real volume that is too small (issue 18
//! item 5: the L3 store's disk fills). Mounting needs `CAP_SYS_ADMIN` (root); without it the
//! claim stays `Pending` and the runner logs why ([`can_mount_tmpfs`] tells a test beforehand).
//! The data lives in memory, as long as the runner: it unmounts them when it stops
//! ([`unmount_all`]) or reclaims the volume.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    HostPathVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeSpec,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;

/// Name of the default StorageClass `cluster up` creates.
pub const STORAGE_CLASS: &str = "tandem-e2e-local";
/// Name of the class whose volumes have an enforced capacity (a `tmpfs` of the claim's size).
pub const SIZED_STORAGE_CLASS: &str = "tandem-e2e-sized";
/// Its provisioner name.
pub const PROVISIONER: &str = "tandem.dev/e2e-local";
/// Annotation the provisioner sets on volumes it made (the external-provisioner convention).
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// Annotation marking the default StorageClass.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";

/// Why a claim cannot be mounted (the pod waits with `CreateContainerConfigError` and retries).
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The claim does not exist.
    #[error("persistentvolumeclaim {0:?} not found")]
    NotFound(String),
    /// The claim has no volume yet.
    #[error("persistentvolumeclaim {0:?} is not bound yet")]
    NotBound(String),
    /// Its volume is not a `hostPath` volume (nothing else exists on this machine).
    #[error("persistentvolume {0:?} is not a hostPath volume")]
    NotHostPath(String),
    /// The API failed.
    #[error("persistentvolumeclaim {claim:?}: {source}")]
    Api {
        /// The claim.
        claim: String,
        /// The API error.
        source: kube::Error,
    },
    /// The directory could not be created.
    #[error("{path}: {source}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// The default StorageClass of an e2e cluster.
pub fn storage_class() -> StorageClass {
    StorageClass {
        metadata: ObjectMeta {
            name: Some(STORAGE_CLASS.to_owned()),
            annotations: Some(BTreeMap::from([(
                DEFAULT_CLASS_ANNOTATION.to_owned(),
                "true".to_owned(),
            )])),
            ..Default::default()
        },
        provisioner: PROVISIONER.to_owned(),
        reclaim_policy: Some("Delete".to_owned()),
        volume_binding_mode: Some("Immediate".to_owned()),
        ..Default::default()
    }
}

/// The StorageClass of volumes with an enforced capacity (module docs): not the default.
pub fn sized_storage_class() -> StorageClass {
    StorageClass {
        metadata: ObjectMeta {
            name: Some(SIZED_STORAGE_CLASS.to_owned()),
            ..Default::default()
        },
        provisioner: PROVISIONER.to_owned(),
        reclaim_policy: Some("Delete".to_owned()),
        volume_binding_mode: Some("Immediate".to_owned()),
        ..Default::default()
    }
}

/// Bytes of a storage quantity (`<n>`, `<n>Ki|Mi|Gi|Ti`, `<n>k|M|G|T`), `None` for any other form
/// (fractions, exponents, milli): the size of a [`SIZED_STORAGE_CLASS`] volume.
pub fn tmpfs_bytes(quantity: &str) -> Option<u64> {
    let q = quantity.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (digits, unit) = q.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let mult: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult).filter(|&b| b > 0)
}

/// Whether this process can mount a `tmpfs` (a [`SIZED_STORAGE_CLASS`] volume): tried on a
/// scratch directory under `dir`, unmounted at once.
pub fn can_mount_tmpfs(dir: &Path) -> bool {
    let probe = dir.join(".tmpfs-probe");
    if std::fs::create_dir_all(&probe).is_err() {
        return false;
    }
    let ok = mount_tmpfs(&probe, 4096).is_ok();
    if ok {
        let _ = unmount(&probe);
    }
    let _ = std::fs::remove_dir(&probe);
    ok
}

/// Mounts a `tmpfs` of `bytes` at `dir` (created if missing).
fn mount_tmpfs(dir: &Path, bytes: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let out = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={bytes},mode=0777"),
            "tmpfs",
        ])
        .arg(dir)
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "mount -t tmpfs at {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Detaches the mount at `dir` (`umount -l`).
fn unmount(dir: &Path) -> std::io::Result<()> {
    let out = std::process::Command::new("umount")
        .arg("-l")
        .arg(dir)
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "umount {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Mount points at or under `dir` (from `/proc/self/mountinfo`, field 5), deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(PathBuf::from)
        .filter(|m| m.starts_with(dir))
        .collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    found
}

/// Unmounts every [`SIZED_STORAGE_CLASS`] volume under `volumes_dir` (the runner stops: their
/// data goes with it); failures are logged.
pub fn unmount_all(volumes_dir: &Path) {
    for m in mounts_under(volumes_dir) {
        if let Err(e) = unmount(&m) {
            tracing::warn!("{e}");
        }
    }
}

/// Whether the runner must provision a volume for `claim`: of our class, `Pending` (or no status
/// yet), no `volumeName`, not being deleted.
pub fn needs_volume(claim: &PersistentVolumeClaim) -> bool {
    let Some(spec) = &claim.spec else {
        return false;
    };
    let phase = claim.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(
        spec.storage_class_name.as_deref(),
        Some(STORAGE_CLASS | SIZED_STORAGE_CLASS)
    ) && spec.volume_name.as_deref().unwrap_or("").is_empty()
        && matches!(phase, None | Some("Pending"))
        && claim.metadata.deletion_timestamp.is_none()
}

/// The PersistentVolume for `claim`: `pvc-<claim uid>`, a `hostPath` directory under `volumes_dir`,
/// capacity = the claim's storage request (1Gi if it has none), the claim's access modes and volume
/// mode and class, reclaim `Delete`, pre-bound by `claimRef` (namespace, name, uid).
pub fn volume_for_claim(claim: &PersistentVolumeClaim, volumes_dir: &Path) -> PersistentVolume {
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let name = format!("pvc-{uid}");
    let spec = claim.spec.clone().unwrap_or_default();
    let storage = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage").cloned())
        .unwrap_or_else(|| Quantity("1Gi".into()));
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            annotations: Some(BTreeMap::from([(
                PROVISIONED_BY.to_owned(),
                PROVISIONER.to_owned(),
            )])),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_owned(), storage)])),
            access_modes: spec
                .access_modes
                .clone()
                .or_else(|| Some(vec!["ReadWriteOnce".into()])),
            volume_mode: spec.volume_mode.clone(),
            storage_class_name: Some(
                spec.storage_class_name
                    .clone()
                    .unwrap_or_else(|| STORAGE_CLASS.to_owned()),
            ),
            persistent_volume_reclaim_policy: Some("Delete".to_owned()),
            host_path: Some(HostPathVolumeSource {
                path: volumes_dir.join(&name).display().to_string(),
                type_: Some("DirectoryOrCreate".to_owned()),
            }),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("PersistentVolumeClaim".into()),
                namespace: claim.metadata.namespace.clone(),
                name: claim.metadata.name.clone(),
                uid: Some(uid),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// The directory of a volume this runner provisioned and may now delete: `Released` (its claim is
/// gone), reclaim `Delete`, provisioned by us, its `hostPath` inside `volumes_dir`. `None` otherwise
/// — a volume of another runner, or one whose path points elsewhere, is never touched.
pub fn should_reclaim(volume: &PersistentVolume, volumes_dir: &Path) -> Option<PathBuf> {
    let ours = volume
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PROVISIONED_BY))
        .is_some_and(|p| p == PROVISIONER);
    let spec = volume.spec.as_ref()?;
    let released = volume.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released");
    let delete = spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete");
    let path = PathBuf::from(&spec.host_path.as_ref()?.path);
    let inside = path.parent() == Some(volumes_dir)
        && path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("pvc-"));
    (ours && released && delete && inside).then_some(path)
}

/// The directory backing claim `claim` in `namespace`: its bound volume's `hostPath` (created if
/// missing, `DirectoryOrCreate`).
pub async fn claim_directory(
    client: &Client,
    namespace: &str,
    claim: &str,
) -> Result<PathBuf, ClaimError> {
    let api_err = |source| ClaimError::Api {
        claim: claim.to_owned(),
        source,
    };
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let pvc = claims
        .get_opt(claim)
        .await
        .map_err(api_err)?
        .ok_or_else(|| ClaimError::NotFound(claim.to_owned()))?;
    let bound = pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let volume = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty() && bound)
        .ok_or_else(|| ClaimError::NotBound(claim.to_owned()))?;
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let pv = volumes.get(&volume).await.map_err(api_err)?;
    let path = pv
        .spec
        .and_then(|s| s.host_path)
        .map(|h| PathBuf::from(h.path))
        .ok_or(ClaimError::NotHostPath(volume))?;
    std::fs::create_dir_all(&path).map_err(|source| ClaimError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The runner task: provisions volumes for new claims of [`STORAGE_CLASS`] and reclaims released
/// ones under `volumes_dir`, until `shutdown` turns true.
pub async fn provision_volumes(
    client: Client,
    volumes_dir: PathBuf,
    mut shutdown: watch::Receiver<bool>,
) {
    let claims = watcher(
        Api::<PersistentVolumeClaim>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .applied_objects()
    .map(|r| r.map(|c| Work::Claim(Box::new(c))));
    let volumes = watcher(
        Api::<PersistentVolume>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .applied_objects()
    .map(|r| r.map(|v| Work::Volume(Box::new(v))));
    let events = futures::stream::select(claims, volumes);
    futures::pin_mut!(events);
    let pv_api: Api<PersistentVolume> = Api::all(client);
    loop {
        let ev = tokio::select! {
            _ = shutdown.changed() => return,
            ev = events.next() => ev,
        };
        match ev {
            Some(Ok(Work::Claim(claim))) if needs_volume(&claim) => {
                let pv = volume_for_claim(&claim, &volumes_dir);
                if let Err(e) = enforce_capacity(&pv, &volumes_dir) {
                    tracing::warn!(claim = ?claim.metadata.name, "provisioning: {e}");
                    continue;
                }
                match pv_api.create(&PostParams::default(), &pv).await {
                    Ok(_) => tracing::info!(
                        claim = ?claim.metadata.name,
                        namespace = ?claim.metadata.namespace,
                        volume = ?pv.metadata.name,
                        "provisioned"
                    ),
                    Err(kube::Error::Api(s)) if s.code == 409 => {}
                    Err(e) => tracing::warn!(claim = ?claim.metadata.name, "provisioning: {e}"),
                }
            }
            Some(Ok(Work::Volume(pv))) => {
                let Some(path) = should_reclaim(&pv, &volumes_dir) else {
                    continue;
                };
                for m in mounts_under(&path) {
                    if let Err(e) = unmount(&m) {
                        tracing::warn!("reclaiming: {e}");
                    }
                }
                if let Err(e) = std::fs::remove_dir_all(&path)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(path = %path.display(), "reclaiming: {e}");
                    continue;
                }
                let name = pv.metadata.name.clone().unwrap_or_default();
                match pv_api.delete(&name, &Default::default()).await {
                    Ok(_) => tracing::info!(volume = %name, "reclaimed"),
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => tracing::warn!(volume = %name, "reclaiming: {e}"),
                }
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => tracing::warn!("storage watch: {e}"),
            None => return,
        }
    }
}

/// Mounts the `tmpfs` of a [`SIZED_STORAGE_CLASS`] volume before it is created (once: a volume
/// already mounted is kept, with its data); nothing for other classes.
fn enforce_capacity(pv: &PersistentVolume, volumes_dir: &Path) -> std::io::Result<()> {
    let Some(spec) = &pv.spec else { return Ok(()) };
    if spec.storage_class_name.as_deref() != Some(SIZED_STORAGE_CLASS) {
        return Ok(());
    }
    let dir = volumes_dir.join(pv.metadata.name.as_deref().unwrap_or_default());
    if mounts_under(&dir).contains(&dir) {
        return Ok(());
    }
    let quantity = spec
        .capacity
        .as_ref()
        .and_then(|c| c.get("storage"))
        .map(|q| q.0.clone())
        .unwrap_or_default();
    let bytes = tmpfs_bytes(&quantity).ok_or_else(|| {
        std::io::Error::other(format!(
            "{SIZED_STORAGE_CLASS}: storage request {quantity:?} is not a plain byte quantity"
        ))
    })?;
    mount_tmpfs(&dir, bytes)?;
    tracing::info!(dir = %dir.display(), bytes, "sized volume mounted (tmpfs)");
    Ok(())
}

enum Work {
    Claim(Box<PersistentVolumeClaim>),
    Volume(Box<PersistentVolume>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(class: &str, phase: Option<&str>, volume: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "data", "namespace": "ns", "uid": "u-1"},
            "spec": {"storageClassName": class, "volumeName": volume,
                     "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "2Gi"}}},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn only_pending_unbound_claims_of_our_class_get_a_volume() {
        assert!(needs_volume(&claim(STORAGE_CLASS, Some("Pending"), None)));
        assert!(needs_volume(&claim(STORAGE_CLASS, None, None)));
        assert!(!needs_volume(&claim("other", Some("Pending"), None)));
        assert!(needs_volume(&claim(SIZED_STORAGE_CLASS, None, None)));
        let sized = volume_for_claim(&claim(SIZED_STORAGE_CLASS, None, None), Path::new("/r"));
        assert_eq!(
            sized.spec.unwrap().storage_class_name.as_deref(),
            Some(SIZED_STORAGE_CLASS)
        );
        assert!(!needs_volume(&claim(
            STORAGE_CLASS,
            Some("Bound"),
            Some("pv")
        )));
        assert!(!needs_volume(&claim(
            STORAGE_CLASS,
            Some("Pending"),
            Some("pv")
        )));
    }

    #[test]
    fn the_volume_is_pre_bound_to_the_claim_with_its_size_and_modes() {
        let pv = volume_for_claim(
            &claim(STORAGE_CLASS, Some("Pending"), None),
            Path::new("/r/volumes"),
        );
        assert_eq!(pv.metadata.name.as_deref(), Some("pvc-u-1"));
        let spec = pv.spec.unwrap();
        assert_eq!(spec.capacity.unwrap()["storage"].0, "2Gi");
        assert_eq!(spec.access_modes.unwrap(), ["ReadWriteOnce"]);
        assert_eq!(spec.host_path.unwrap().path, "/r/volumes/pvc-u-1");
        let r = spec.claim_ref.unwrap();
        assert_eq!(
            (r.namespace.as_deref(), r.name.as_deref(), r.uid.as_deref()),
            (Some("ns"), Some("data"), Some("u-1"))
        );
        assert_eq!(spec.storage_class_name.as_deref(), Some(STORAGE_CLASS));
    }

    #[test]
    fn only_our_released_volumes_inside_our_dir_are_reclaimed() {
        let dir = Path::new("/r/volumes");
        let mut pv = volume_for_claim(&claim(STORAGE_CLASS, None, None), dir);
        assert_eq!(should_reclaim(&pv, dir), None, "no status: still in use");
        pv.status = Some(serde_json::from_value(json!({"phase": "Released"})).unwrap());
        assert_eq!(
            should_reclaim(&pv, dir),
            Some(PathBuf::from("/r/volumes/pvc-u-1"))
        );
        assert_eq!(
            should_reclaim(&pv, Path::new("/other/volumes")),
            None,
            "another runner's volume"
        );
        let mut escaped = pv.clone();
        escaped
            .spec
            .as_mut()
            .unwrap()
            .host_path
            .as_mut()
            .unwrap()
            .path = "/etc".into();
        assert_eq!(should_reclaim(&escaped, Path::new("/")), None);
        let mut retained = pv.clone();
        retained
            .spec
            .as_mut()
            .unwrap()
            .persistent_volume_reclaim_policy = Some("Retain".into());
        assert_eq!(should_reclaim(&retained, dir), None);
        let mut foreign = pv;
        foreign.metadata.annotations = None;
        assert_eq!(should_reclaim(&foreign, dir), None);
    }

    #[test]
    fn sized_volumes_take_plain_byte_quantities() {
        assert_eq!(tmpfs_bytes("2Mi"), Some(2 << 20));
        assert_eq!(tmpfs_bytes("1Gi"), Some(1 << 30));
        assert_eq!(tmpfs_bytes("500k"), Some(500_000));
        assert_eq!(tmpfs_bytes("4096"), Some(4096));
        for bad in ["", "0", "1.5Gi", "1e9", "100m", "Mi", "-1Mi"] {
            assert_eq!(tmpfs_bytes(bad), None, "{bad:?}");
        }
        let c = sized_storage_class();
        assert!(c.metadata.annotations.is_none(), "not the default class");
        assert_eq!(c.provisioner, PROVISIONER);
    }

    #[test]
    fn the_class_is_the_default_and_binds_immediately() {
        let c = storage_class();
        assert_eq!(
            c.metadata.annotations.unwrap()[DEFAULT_CLASS_ANNOTATION],
            "true"
        );
        assert_eq!(c.provisioner, PROVISIONER);
        assert_eq!(c.volume_binding_mode.as_deref(), Some("Immediate"));
    }
}
