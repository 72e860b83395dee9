//! Pod volumes as files, and container mount paths rewritten under a per-container root.
//!
//! There is no mount namespace: a volume is a directory `<pod dir>/volumes/<name>/`, and each
//! `volumeMount` becomes a symlink `<container root>/<mountPath>` → that directory (or its
//! `subPath`). The container learns its root from `TANDEM_ROOT` ([`ROOT_ENV`]); a program honours
//! it by reading an absolute in-container path `P` from `$TANDEM_ROOT/P` (see `e2e/README.md`).
//! The service-account volume that admission injects (`kube-api-access-*`: a projected token,
//! `kube-root-ca.crt`'s `ca.crt` and the namespace) therefore lands at
//! `$TANDEM_ROOT/var/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}`.
//!
//! Supported: `configMap`, `secret`, `downwardAPI`, `emptyDir`, `projected` (configMap, secret,
//! downwardAPI, serviceAccountToken). Anything else is refused with
//! [`VolumeError::Unsupported`] (the pod waits with `CreateContainerConfigError`). Volumes are
//! written once at start; later ConfigMap edits are not propagated (the kubelet would, within a
//! minute) — pods that need new config are restarted by their controller anyway.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::{
    ConfigMap, Container, DownwardAPIVolumeFile, KeyToPath, Pod, Secret, Volume,
};

use super::env::{PodAddresses, PodSources, field_value};

/// The environment variable naming a container's root directory.
pub const ROOT_ENV: &str = "TANDEM_ROOT";

/// Default file mode of configMap/secret/downwardAPI/projected files (Kubernetes: 0644).
const DEFAULT_MODE: u32 = 0o644;

/// Why volumes could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// A referenced, non-optional object does not exist.
    #[error("volume {volume}: {kind} {name:?} not found")]
    MissingObject {
        /// Volume name.
        volume: String,
        /// `configmap` or `secret`.
        kind: &'static str,
        /// Object name.
        name: String,
    },
    /// An `items` key is absent from its object.
    #[error("volume {volume}: key {key:?} not found in {kind} {name:?}")]
    MissingKey {
        /// Volume name.
        volume: String,
        /// `configmap` or `secret`.
        kind: &'static str,
        /// Object name.
        name: String,
        /// The key.
        key: String,
    },
    /// A volume type or source this runner does not implement.
    #[error("volume {volume}: unsupported: {what}")]
    Unsupported {
        /// Volume name.
        volume: String,
        /// What is unsupported.
        what: String,
    },
    /// A path escapes its directory (`..`, absolute) — refused like the API server would.
    #[error("volume {volume}: invalid path {path:?}")]
    BadPath {
        /// Volume name.
        volume: String,
        /// The path.
        path: String,
    },
    /// A mount refers to a volume the pod does not declare.
    #[error("container {container}: mount of unknown volume {volume:?}")]
    UnknownVolume {
        /// Container name.
        container: String,
        /// Volume name.
        volume: String,
    },
    /// A projected token was not fetched.
    #[error("volume {volume}: no service-account token for source {index}")]
    MissingToken {
        /// Volume name.
        volume: String,
        /// Index of the source in `projected.sources`.
        index: usize,
    },
    /// Writing files failed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A service-account token a projected volume asks for (filled by the runner via TokenRequest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenNeed {
    /// Volume name.
    pub volume: String,
    /// Index of the source in `projected.sources`.
    pub index: usize,
    /// Requested audience (`None`: the API server's default audiences).
    pub audience: Option<String>,
    /// Requested lifetime in seconds (Kubernetes default 3600, minimum 600).
    pub expiration_seconds: i64,
}

/// Tokens fetched for a pod, keyed by (volume, source index).
pub type Tokens = BTreeMap<(String, usize), String>;

/// One file of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeFile {
    /// Path relative to the volume directory.
    pub path: PathBuf,
    /// Content.
    pub bytes: Vec<u8>,
    /// Permission bits.
    pub mode: u32,
}

/// The projected service-account tokens a pod needs.
pub fn token_needs(pod: &Pod) -> Vec<TokenNeed> {
    let mut out = Vec::new();
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let Some(p) = &v.projected else { continue };
        for (index, src) in p.sources.iter().flatten().enumerate() {
            if let Some(t) = &src.service_account_token {
                out.push(TokenNeed {
                    volume: v.name.clone(),
                    index,
                    audience: t.audience.clone(),
                    expiration_seconds: t.expiration_seconds.unwrap_or(3600).max(600),
                });
            }
        }
    }
    out
}

/// The files of one volume; `None` for an `emptyDir` (an empty directory).
pub fn plan_volume(
    pod: &Pod,
    volume: &Volume,
    addrs: &PodAddresses,
    sources: &PodSources,
    tokens: &Tokens,
) -> Result<Option<Vec<VolumeFile>>, VolumeError> {
    let vname = volume.name.as_str();
    if volume.empty_dir.is_some() {
        return Ok(None);
    }
    let mut files = Vec::new();
    if let Some(cm) = &volume.config_map {
        let mode = cm.default_mode.map_or(DEFAULT_MODE, |m| m as u32);
        config_map_files(
            vname,
            &cm.name,
            cm.items.as_deref(),
            cm.optional,
            mode,
            sources,
            &mut files,
        )?;
    } else if let Some(s) = &volume.secret {
        let name = s.secret_name.clone().unwrap_or_default();
        let mode = s.default_mode.map_or(DEFAULT_MODE, |m| m as u32);
        secret_files(
            vname,
            &name,
            s.items.as_deref(),
            s.optional,
            mode,
            sources,
            &mut files,
        )?;
    } else if let Some(d) = &volume.downward_api {
        let mode = d.default_mode.map_or(DEFAULT_MODE, |m| m as u32);
        downward_files(vname, pod, addrs, d.items.as_deref(), mode, &mut files)?;
    } else if let Some(p) = &volume.projected {
        let mode = p.default_mode.map_or(DEFAULT_MODE, |m| m as u32);
        for (index, src) in p.sources.iter().flatten().enumerate() {
            if let Some(cm) = &src.config_map {
                config_map_files(
                    vname,
                    &cm.name,
                    cm.items.as_deref(),
                    cm.optional,
                    mode,
                    sources,
                    &mut files,
                )?;
            } else if let Some(s) = &src.secret {
                secret_files(
                    vname,
                    &s.name,
                    s.items.as_deref(),
                    s.optional,
                    mode,
                    sources,
                    &mut files,
                )?;
            } else if let Some(d) = &src.downward_api {
                downward_files(vname, pod, addrs, d.items.as_deref(), mode, &mut files)?;
            } else if let Some(t) = &src.service_account_token {
                let token = tokens.get(&(vname.to_owned(), index)).ok_or_else(|| {
                    VolumeError::MissingToken {
                        volume: vname.to_owned(),
                        index,
                    }
                })?;
                // The kubelet writes tokens 0600 unless defaultMode says otherwise.
                let mode = p.default_mode.map_or(0o600, |m| m as u32);
                push(vname, &mut files, &t.path, token.as_bytes().to_vec(), mode)?;
            } else {
                return Err(VolumeError::Unsupported {
                    volume: vname.to_owned(),
                    what: "projected source other than configMap/secret/downwardAPI/serviceAccountToken".into(),
                });
            }
        }
    } else {
        return Err(VolumeError::Unsupported {
            volume: vname.to_owned(),
            what: "volume type (supported: configMap, secret, downwardAPI, emptyDir, projected)"
                .into(),
        });
    }
    Ok(Some(files))
}

fn config_map_files(
    volume: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: Option<bool>,
    mode: u32,
    sources: &PodSources,
    files: &mut Vec<VolumeFile>,
) -> Result<(), VolumeError> {
    let Some(cm) = sources.config_maps.get(name) else {
        return if optional == Some(true) {
            Ok(())
        } else {
            Err(VolumeError::MissingObject {
                volume: volume.into(),
                kind: "configmap",
                name: name.into(),
            })
        };
    };
    let entries = config_map_entries(cm);
    keyed_files(
        volume,
        "configmap",
        name,
        &entries,
        items,
        optional,
        mode,
        files,
    )
}

fn secret_files(
    volume: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: Option<bool>,
    mode: u32,
    sources: &PodSources,
    files: &mut Vec<VolumeFile>,
) -> Result<(), VolumeError> {
    let Some(s) = sources.secrets.get(name) else {
        return if optional == Some(true) {
            Ok(())
        } else {
            Err(VolumeError::MissingObject {
                volume: volume.into(),
                kind: "secret",
                name: name.into(),
            })
        };
    };
    let entries = secret_entries(s);
    keyed_files(
        volume, "secret", name, &entries, items, optional, mode, files,
    )
}

#[allow(clippy::too_many_arguments)]
fn keyed_files(
    volume: &str,
    kind: &'static str,
    name: &str,
    entries: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    optional: Option<bool>,
    mode: u32,
    files: &mut Vec<VolumeFile>,
) -> Result<(), VolumeError> {
    match items {
        None => {
            for (k, v) in entries {
                push(volume, files, k, v.clone(), mode)?;
            }
        }
        Some(items) => {
            for it in items {
                match entries.get(&it.key) {
                    Some(v) => push(
                        volume,
                        files,
                        &it.path,
                        v.clone(),
                        it.mode.map_or(mode, |m| m as u32),
                    )?,
                    None if optional == Some(true) => {}
                    None => {
                        return Err(VolumeError::MissingKey {
                            volume: volume.into(),
                            kind,
                            name: name.into(),
                            key: it.key.clone(),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

fn downward_files(
    volume: &str,
    pod: &Pod,
    addrs: &PodAddresses,
    items: Option<&[DownwardAPIVolumeFile]>,
    mode: u32,
    files: &mut Vec<VolumeFile>,
) -> Result<(), VolumeError> {
    for it in items.into_iter().flatten() {
        let value = match &it.field_ref {
            Some(f) => {
                field_value(pod, addrs, &f.field_path).ok_or_else(|| VolumeError::Unsupported {
                    volume: volume.into(),
                    what: format!("downwardAPI fieldRef {}", f.field_path),
                })?
            }
            None => {
                return Err(VolumeError::Unsupported {
                    volume: volume.into(),
                    what: "downwardAPI resourceFieldRef".into(),
                });
            }
        };
        push(
            volume,
            files,
            &it.path,
            value.into_bytes(),
            it.mode.map_or(mode, |m| m as u32),
        )?;
    }
    Ok(())
}

fn config_map_entries(cm: &ConfigMap) -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    for (k, v) in cm.data.iter().flatten() {
        m.insert(k.clone(), v.clone().into_bytes());
    }
    for (k, v) in cm.binary_data.iter().flatten() {
        m.insert(k.clone(), v.0.clone());
    }
    m
}

fn secret_entries(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    for (k, v) in s.data.iter().flatten() {
        m.insert(k.clone(), v.0.clone());
    }
    for (k, v) in s.string_data.iter().flatten() {
        m.insert(k.clone(), v.clone().into_bytes());
    }
    m
}

fn push(
    volume: &str,
    files: &mut Vec<VolumeFile>,
    rel: &str,
    bytes: Vec<u8>,
    mode: u32,
) -> Result<(), VolumeError> {
    let path = safe_relative(rel).ok_or_else(|| VolumeError::BadPath {
        volume: volume.into(),
        path: rel.into(),
    })?;
    files.push(VolumeFile { path, bytes, mode });
    Ok(())
}

/// `rel` as a relative path with only normal components (no `..`, no root); `None` otherwise.
pub fn safe_relative(rel: &str) -> Option<PathBuf> {
    let p = Path::new(rel);
    let ok = !rel.is_empty() && p.components().all(|c| matches!(c, Component::Normal(_)));
    ok.then(|| p.to_path_buf())
}

/// Writes `files` (or an empty directory for `None`) into `dir`, replacing its previous content.
pub fn write_volume(dir: &Path, files: Option<&[VolumeFile]>) -> Result<(), VolumeError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| VolumeError::Io { path, source }
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for f in files.into_iter().flatten() {
        let path = dir.join(&f.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        std::fs::write(&path, &f.bytes).map_err(io(&path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(f.mode))
            .map_err(io(&path))?;
    }
    Ok(())
}

/// Builds a container root: for each `volumeMount`, a symlink `root/<mountPath>` → the volume dir
/// (joined with `subPath`). `volume_dir(name)` gives a volume's directory.
pub fn link_mounts(
    root: &Path,
    container: &Container,
    declared: &[Volume],
    volume_dir: impl Fn(&str) -> PathBuf,
) -> Result<(), VolumeError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| VolumeError::Io { path, source }
    };
    std::fs::create_dir_all(root).map_err(io(root))?;
    for m in container.volume_mounts.iter().flatten() {
        if !declared.iter().any(|v| v.name == m.name) {
            return Err(VolumeError::UnknownVolume {
                container: container.name.clone(),
                volume: m.name.clone(),
            });
        }
        let rel = safe_relative(m.mount_path.trim_start_matches('/')).ok_or_else(|| {
            VolumeError::BadPath {
                volume: m.name.clone(),
                path: m.mount_path.clone(),
            }
        })?;
        let mut target = volume_dir(&m.name);
        if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            let sub = safe_relative(sub).ok_or_else(|| VolumeError::BadPath {
                volume: m.name.clone(),
                path: sub.into(),
            })?;
            target = target.join(sub);
        }
        let link = root.join(rel);
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(&link).map_err(io(&link))?;
        }
        std::os::unix::fs::symlink(&target, &link).map_err(io(&link))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "containers": [{"name": "c", "image": "x", "volumeMounts": [
                    {"name": "cfg", "mountPath": "/etc/tandem"},
                    {"name": "sa", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
                    {"name": "cfg", "mountPath": "/etc/one.yaml", "subPath": "a.yaml"}
                ]}],
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "cm"}},
                    {"name": "sec", "secret": {"secretName": "s", "items": [{"key": "k", "path": "dir/k.txt", "mode": 256}]}},
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "sa", "projected": {"sources": [
                        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}
                    ]}},
                    {"name": "host", "hostPath": {"path": "/etc"}}
                ]
            }
        }))
        .unwrap()
    }

    fn sources() -> PodSources {
        let cm = |data: serde_json::Value| -> ConfigMap {
            serde_json::from_value(serde_json::json!({ "data": data })).unwrap()
        };
        // "dg==" = base64("v")
        let sec: Secret =
            serde_json::from_value(serde_json::json!({"data": {"k": "dg=="}})).unwrap();
        PodSources {
            config_maps: BTreeMap::from([
                ("cm".into(), cm(serde_json::json!({"a.yaml": "x: 1"}))),
                (
                    "kube-root-ca.crt".into(),
                    cm(serde_json::json!({"ca.crt": "PEM"})),
                ),
            ]),
            secrets: BTreeMap::from([("s".into(), sec)]),
        }
    }

    fn addrs() -> PodAddresses {
        PodAddresses {
            pod_ip: "127.100.0.2".into(),
            host_ip: "127.100.0.1".into(),
        }
    }

    #[test]
    fn plans_every_supported_volume_and_refuses_others() {
        let p = pod();
        let vols = p.spec.as_ref().unwrap().volumes.clone().unwrap();
        let needs = token_needs(&p);
        assert_eq!(needs.len(), 1);
        assert_eq!(
            (
                needs[0].volume.as_str(),
                needs[0].index,
                needs[0].expiration_seconds
            ),
            ("sa", 0, 3607)
        );
        let tokens = Tokens::from([(("sa".to_string(), 0), "jwt".to_string())]);
        let plan = |i: usize| plan_volume(&p, &vols[i], &addrs(), &sources(), &tokens);
        assert_eq!(plan(0).unwrap().unwrap()[0].path, PathBuf::from("a.yaml"));
        let sec = plan(1).unwrap().unwrap();
        assert_eq!(
            (sec[0].path.to_str().unwrap(), sec[0].mode),
            ("dir/k.txt", 0o400)
        );
        assert_eq!(plan(2).unwrap(), None);
        let sa = plan(3).unwrap().unwrap();
        let names: Vec<_> = sa.iter().map(|f| f.path.to_str().unwrap()).collect();
        assert_eq!(names, ["token", "ca.crt", "namespace"]);
        assert_eq!(sa[0].mode, 0o600);
        assert_eq!(sa[2].bytes, b"ns");
        assert!(matches!(plan(4), Err(VolumeError::Unsupported { .. })));
        // Without the token, the projected volume cannot be built.
        assert!(matches!(
            plan_volume(&p, &vols[3], &addrs(), &sources(), &Tokens::new()),
            Err(VolumeError::MissingToken { .. })
        ));
        let mut missing = sources();
        missing.config_maps.remove("cm");
        assert!(matches!(
            plan_volume(&p, &vols[0], &addrs(), &missing, &tokens),
            Err(VolumeError::MissingObject { .. })
        ));
    }

    #[test]
    fn writes_files_and_links_mounts_under_the_root() {
        let p = pod();
        let vols = p.spec.as_ref().unwrap().volumes.clone().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let vdir = |n: &str| tmp.path().join("volumes").join(n);
        let tokens = Tokens::from([(("sa".to_string(), 0), "jwt".to_string())]);
        for v in &vols[..4] {
            let files = plan_volume(&p, v, &addrs(), &sources(), &tokens).unwrap();
            write_volume(&vdir(&v.name), files.as_deref()).unwrap();
        }
        let root = tmp.path().join("root");
        let c = &p.spec.as_ref().unwrap().containers[0];
        link_mounts(&root, c, &vols, vdir).unwrap();
        let read = |rel: &str| std::fs::read_to_string(root.join(rel)).unwrap();
        assert_eq!(read("etc/tandem/a.yaml"), "x: 1");
        assert_eq!(read("etc/one.yaml"), "x: 1");
        assert_eq!(
            read("var/run/secrets/kubernetes.io/serviceaccount/token"),
            "jwt"
        );
        assert_eq!(
            read("var/run/secrets/kubernetes.io/serviceaccount/namespace"),
            "ns"
        );
        // Idempotent: linking again replaces the links.
        link_mounts(&root, c, &vols, vdir).unwrap();
    }

    #[test]
    fn paths_may_not_escape() {
        assert!(safe_relative("a/b").is_some());
        for bad in ["", "/abs", "../x", "a/../../x"] {
            assert!(safe_relative(bad).is_none(), "{bad}");
        }
    }
}
