//! A container's environment and command line, resolved as the kubelet does (pure).
//!
//! Order (Kubernetes API reference, `Container.env` / `envFrom`): the runner's base variables, then
//! `envFrom` sources in order (with their `prefix`), then `env` entries in order, later ones
//! overriding earlier ones. `$(VAR)` in `env` values refers to variables defined before it; in
//! `command` and `args` to the final environment. `$$` escapes a `$`, and an undefined `$(VAR)` is
//! kept verbatim (k8s.io/kubernetes `third_party/forked/golang/expansion`).
//!
//! Supported `valueFrom`: `fieldRef` (`metadata.name|namespace|uid`, `metadata.labels['k']`,
//! `metadata.annotations['k']`, `spec.nodeName`, `spec.serviceAccountName`, `status.podIP`,
//! `status.podIPs`, `status.hostIP`, `status.hostIPs`), `configMapKeyRef`, `secretKeyRef` (both
//! honouring `optional`). `resourceFieldRef` and `fileKeyRef` are refused with
//! [`EnvError::Unsupported`] rather than silently dropped.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVarSource, Pod, Secret};

/// What the runner fetched for a pod: the ConfigMaps and Secrets it references, by name
/// (a missing object is simply absent).
#[derive(Debug, Clone, Default)]
pub struct PodSources {
    /// ConfigMaps of the pod's namespace.
    pub config_maps: BTreeMap<String, ConfigMap>,
    /// Secrets of the pod's namespace.
    pub secrets: BTreeMap<String, Secret>,
}

/// The addresses the runner assigned.
#[derive(Debug, Clone)]
pub struct PodAddresses {
    /// The pod's IP (127.x.y.z).
    pub pod_ip: String,
    /// The node's IP.
    pub host_ip: String,
}

/// Why an environment could not be built (the kubelet's `CreateContainerConfigError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A referenced, non-optional ConfigMap or Secret does not exist.
    #[error("{kind} {name:?} not found")]
    MissingObject {
        /// `configmap` or `secret`.
        kind: &'static str,
        /// Its name.
        name: String,
    },
    /// A referenced, non-optional key does not exist.
    #[error("couldn't find key {key} in {kind} {name:?}")]
    MissingKey {
        /// `configmap` or `secret`.
        kind: &'static str,
        /// Object name.
        name: String,
        /// The key.
        key: String,
    },
    /// A `valueFrom` kind or field path this runner does not implement.
    #[error("env {var}: unsupported source: {what}")]
    Unsupported {
        /// The variable.
        var: String,
        /// What is unsupported.
        what: String,
    },
}

/// The names of all ConfigMaps and Secrets a pod references (env, envFrom, volumes, projected).
pub fn referenced_objects(pod: &Pod) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut cms = BTreeSet::new();
    let mut secrets = BTreeSet::new();
    let Some(spec) = &pod.spec else {
        return (cms, secrets);
    };
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter());
    for c in containers {
        for f in c.env_from.iter().flatten() {
            if let Some(r) = &f.config_map_ref {
                cms.insert(r.name.clone());
            }
            if let Some(r) = &f.secret_ref {
                secrets.insert(r.name.clone());
            }
        }
        for e in c.env.iter().flatten() {
            if let Some(src) = &e.value_from {
                if let Some(r) = &src.config_map_key_ref {
                    cms.insert(r.name.clone());
                }
                if let Some(r) = &src.secret_key_ref {
                    secrets.insert(r.name.clone());
                }
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        if let Some(cm) = &v.config_map {
            cms.insert(cm.name.clone());
        }
        if let Some(s) = &v.secret
            && let Some(n) = &s.secret_name
        {
            secrets.insert(n.clone());
        }
        if let Some(p) = &v.projected {
            for src in p.sources.iter().flatten() {
                if let Some(cm) = &src.config_map {
                    cms.insert(cm.name.clone());
                }
                if let Some(s) = &src.secret {
                    secrets.insert(s.name.clone());
                }
            }
        }
    }
    (cms, secrets)
}

/// A test-only pod annotation, not a Kubernetes feature: its value, whitespace-separated `K=V`
/// entries (the `--pod-env` syntax), is added to every container's environment of the pod, after
/// the runner's base variables and before `envFrom`/`env`. It lets a suite switch a worker's
/// negative control per pool through the pool's `spec.podTemplate.annotations` (rendered onto the
/// pods by the operator, which renders no free-form env), e.g. `TANDEM_NEGATIVE_GATE_BYPASS=1` in
/// e2e/tests/stack_negative.rs. A real kubelet ignores it.
pub const POD_ENV_ANNOTATION: &str = "e2e.tandem.dev/pod-env";

/// The `K=V` entries of the pod's [`POD_ENV_ANNOTATION`], in order (none without it).
///
/// # Errors
/// [`EnvError::Unsupported`] naming the first entry that is not `K=V` with `K` a C identifier.
pub fn annotation_env(pod: &Pod) -> Result<Vec<(String, String)>, EnvError> {
    let Some(value) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_ENV_ANNOTATION))
    else {
        return Ok(Vec::new());
    };
    value
        .split_whitespace()
        .map(|entry| {
            super::PodDefaults::parse_env(entry).ok_or_else(|| EnvError::Unsupported {
                var: POD_ENV_ANNOTATION.to_owned(),
                what: format!("entry {entry:?} is not K=V"),
            })
        })
        .collect()
}

/// The final environment of `container`: `base` first, then the [`POD_ENV_ANNOTATION`] entries,
/// then envFrom, then env (see module doc).
pub fn container_env(
    pod: &Pod,
    container: &Container,
    addrs: &PodAddresses,
    sources: &PodSources,
    base: &[(String, String)],
) -> Result<Vec<(String, String)>, EnvError> {
    let mut env = EnvMap::default();
    for (k, v) in base {
        env.set(k, v.clone());
    }
    for (k, v) in annotation_env(pod)? {
        env.set(&k, v);
    }
    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.as_deref().unwrap_or("");
        if let Some(r) = &from.config_map_ref {
            match sources.config_maps.get(&r.name) {
                Some(cm) => {
                    for (k, v) in cm.data.iter().flatten() {
                        env.set(&format!("{prefix}{k}"), v.clone());
                    }
                }
                None if r.optional == Some(true) => {}
                None => return Err(missing("configmap", &r.name)),
            }
        }
        if let Some(r) = &from.secret_ref {
            match sources.secrets.get(&r.name) {
                Some(s) => {
                    for (k, v) in secret_strings(s) {
                        env.set(&format!("{prefix}{k}"), v);
                    }
                }
                None if r.optional == Some(true) => {}
                None => return Err(missing("secret", &r.name)),
            }
        }
    }
    for e in container.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (_, Some(src)) => match value_from(pod, addrs, sources, &e.name, src)? {
                Some(v) => v,
                None => continue, // optional and absent: the variable is not set
            },
            (Some(v), None) => expand(v, &env.lookup()),
            (None, None) => String::new(),
        };
        env.set(&e.name, value);
    }
    Ok(env.into_vec())
}

/// Expands `$(VAR)` in each of `words` against `env` (command and args of a container).
pub fn expand_all(words: &[String], env: &[(String, String)]) -> Vec<String> {
    let map: BTreeMap<&str, &str> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    words.iter().map(|w| expand(w, &map)).collect()
}

/// Kubernetes `$(VAR)` expansion of one string.
pub fn expand(input: &str, vars: &BTreeMap<&str, &str>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$'); // "$$" -> "$"
            rest = stripped;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(end) => {
                    let name = &body[..end];
                    match vars.get(name) {
                        Some(v) => out.push_str(v),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &body[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = body;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn value_from(
    pod: &Pod,
    addrs: &PodAddresses,
    sources: &PodSources,
    var: &str,
    src: &EnvVarSource,
) -> Result<Option<String>, EnvError> {
    if let Some(f) = &src.field_ref {
        return field_value(pod, addrs, &f.field_path)
            .map(Some)
            .ok_or_else(|| EnvError::Unsupported {
                var: var.to_owned(),
                what: format!("fieldRef {}", f.field_path),
            });
    }
    if let Some(r) = &src.config_map_key_ref {
        let optional = r.optional == Some(true);
        return match sources.config_maps.get(&r.name) {
            None if optional => Ok(None),
            None => Err(missing("configmap", &r.name)),
            Some(cm) => match cm.data.as_ref().and_then(|d| d.get(&r.key)) {
                Some(v) => Ok(Some(v.clone())),
                None if optional => Ok(None),
                None => Err(missing_key("configmap", &r.name, &r.key)),
            },
        };
    }
    if let Some(r) = &src.secret_key_ref {
        let optional = r.optional == Some(true);
        return match sources.secrets.get(&r.name) {
            None if optional => Ok(None),
            None => Err(missing("secret", &r.name)),
            Some(s) => match secret_strings(s).into_iter().find(|(k, _)| *k == r.key) {
                Some((_, v)) => Ok(Some(v)),
                None if optional => Ok(None),
                None => Err(missing_key("secret", &r.name, &r.key)),
            },
        };
    }
    let what = if src.resource_field_ref.is_some() {
        "resourceFieldRef"
    } else {
        "valueFrom kind"
    };
    Err(EnvError::Unsupported {
        var: var.to_owned(),
        what: what.to_owned(),
    })
}

/// The value of a downward-API field path, or `None` if the path is not supported.
pub fn field_value(pod: &Pod, addrs: &PodAddresses, path: &str) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let from_map = |map: &Option<BTreeMap<String, String>>, prefix: &str| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(
            map.as_ref()
                .and_then(|m| m.get(key))
                .cloned()
                .unwrap_or_default(),
        )
    };
    match path {
        "metadata.name" => meta.name.clone(),
        "metadata.namespace" => meta.namespace.clone(),
        "metadata.uid" => meta.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" | "status.podIPs" => Some(addrs.pod_ip.clone()),
        "status.hostIP" | "status.hostIPs" => Some(addrs.host_ip.clone()),
        _ => from_map(&meta.labels, "metadata.labels['")
            .or_else(|| from_map(&meta.annotations, "metadata.annotations['")),
    }
}

/// A Secret's entries as strings: `data` (bytes, lossy UTF-8) overridden by `stringData`.
fn secret_strings(s: &Secret) -> Vec<(String, String)> {
    let mut m: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in s.data.iter().flatten() {
        m.insert(k.clone(), String::from_utf8_lossy(&v.0).into_owned());
    }
    for (k, v) in s.string_data.iter().flatten() {
        m.insert(k.clone(), v.clone());
    }
    m.into_iter().collect()
}

fn missing(kind: &'static str, name: &str) -> EnvError {
    EnvError::MissingObject {
        kind,
        name: name.to_owned(),
    }
}

fn missing_key(kind: &'static str, name: &str, key: &str) -> EnvError {
    EnvError::MissingKey {
        kind,
        name: name.to_owned(),
        key: key.to_owned(),
    }
}

/// Insertion-ordered variables where a later `set` replaces the value in place.
#[derive(Default)]
struct EnvMap {
    vars: Vec<(String, String)>,
}

impl EnvMap {
    fn set(&mut self, k: &str, v: String) {
        match self.vars.iter_mut().find(|(name, _)| name == k) {
            Some(slot) => slot.1 = v,
            None => self.vars.push((k.to_owned(), v)),
        }
    }
    fn lookup(&self) -> BTreeMap<&str, &str> {
        self.vars
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
    fn into_vec(self) -> Vec<(String, String)> {
        self.vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p1", "namespace": "ns", "uid": "u-1", "labels": {"app": "a"}},
            "spec": {"nodeName": "n0", "serviceAccountName": "sa", "containers": [{
                "name": "c", "image": "tandem-worker",
                "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "URL", "value": "http://$(POD_IP):8080/$(UNDEFINED)/$$(POD_IP)"},
                    {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                    {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": true}}},
                    {"name": "CM_a", "value": "overridden"}
                ]
            }]}
        }))
        .unwrap()
    }

    fn sources() -> PodSources {
        let cm: ConfigMap =
            serde_json::from_value(serde_json::json!({"data": {"a": "1", "b": "2"}})).unwrap();
        // Secret data is base64 on the wire: "aHVudGVyMg==" = "hunter2".
        let sec: Secret =
            serde_json::from_value(serde_json::json!({"data": {"pw": "aHVudGVyMg=="}})).unwrap();
        PodSources {
            config_maps: BTreeMap::from([("cm".into(), cm)]),
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
    fn resolves_like_the_kubelet() {
        let p = pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let base = vec![("PATH".to_string(), "/bin".to_string())];
        let env = container_env(&p, c, &addrs(), &sources(), &base).unwrap();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PATH"), Some("/bin"));
        assert_eq!(get("CM_a"), Some("overridden"));
        assert_eq!(get("CM_b"), Some("2"));
        assert_eq!(get("POD_NAME"), Some("p1"));
        assert_eq!(get("APP"), Some("a"));
        assert_eq!(
            get("URL"),
            Some("http://127.100.0.2:8080/$(UNDEFINED)/$(POD_IP)")
        );
        assert_eq!(get("PASS"), Some("hunter2"));
        assert_eq!(get("OPT"), None, "optional and absent: not set");
        assert_eq!(
            expand_all(&["--bind=$(POD_IP)".to_string()], &env),
            vec!["--bind=127.100.0.2".to_string()]
        );
    }

    #[test]
    fn the_pod_env_annotation_sits_between_base_and_env() {
        let mut p = pod();
        p.metadata.annotations = Some(BTreeMap::from([(
            POD_ENV_ANNOTATION.to_string(),
            "TANDEM_NEGATIVE_GATE_BYPASS=1\n PATH=/x  POD_NAME=ignored".to_string(),
        )]));
        let c = p.spec.as_ref().unwrap().containers[0].clone();
        let base = vec![("PATH".to_string(), "/bin".to_string())];
        let env = container_env(&p, &c, &addrs(), &sources(), &base).unwrap();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("TANDEM_NEGATIVE_GATE_BYPASS"), Some("1"));
        assert_eq!(get("PATH"), Some("/x"), "the annotation overrides the base");
        assert_eq!(
            get("POD_NAME"),
            Some("p1"),
            "the container's env overrides it"
        );
        p.metadata.annotations = Some(BTreeMap::from([(
            POD_ENV_ANNOTATION.to_string(),
            "OK=1 not-an-entry".to_string(),
        )]));
        assert!(matches!(
            container_env(&p, &c, &addrs(), &sources(), &base),
            Err(EnvError::Unsupported { .. })
        ));
        p.metadata.annotations = None;
        assert_eq!(annotation_env(&p), Ok(Vec::new()));
    }

    #[test]
    fn missing_references_are_errors() {
        let p = pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let mut s = sources();
        s.secrets.clear();
        assert_eq!(
            container_env(&p, c, &addrs(), &s, &[]),
            Err(EnvError::MissingObject {
                kind: "secret",
                name: "s".into()
            })
        );
        let mut s = sources();
        s.secrets.get_mut("s").unwrap().data = Some(BTreeMap::new());
        assert!(matches!(
            container_env(&p, c, &addrs(), &s, &[]),
            Err(EnvError::MissingKey { .. })
        ));
        let (cms, secrets) = referenced_objects(&p);
        assert_eq!(cms, BTreeSet::from(["cm".to_string(), "nope".to_string()]));
        assert_eq!(secrets, BTreeSet::from(["s".to_string()]));
    }

    #[test]
    fn expansion_edge_cases() {
        let vars = BTreeMap::from([("A", "x")]);
        assert_eq!(expand("$(A)$(A)", &vars), "xx");
        assert_eq!(expand("$A $( $(A", &vars), "$A $( $(A");
        assert_eq!(expand("$$$$", &vars), "$$");
        assert_eq!(expand("tail$", &vars), "tail$");
    }
}
