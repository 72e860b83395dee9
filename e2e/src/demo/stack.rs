//! The demo's cluster-side steps: worker/operator binaries, the process-runner daemon, `helm
//! install`, the sample stack, readiness waits, the pod table, and the mid-replay patches.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, CustomResourceExt};
use serde::de::DeserializeOwned;
use tandem_crds::labels::{ROLE_CACHE, ROLE_DECODE, ROLE_PREFILL};
use tandem_crds::{CacheTier, DecodePool, PrefillPool};

use crate::replay::targets::{GROUP_LABEL, POOL_LABEL, REVISION_LABEL, ROLE_LABEL, pod_serving};

/// The CRDs the chart installs (`cachetiers.serving.tandem.dev`, …).
pub fn crd_names() -> [&'static str; 3] {
    [
        CacheTier::crd_name(),
        PrefillPool::crd_name(),
        DecodePool::crd_name(),
    ]
}

/// A Tandem kind of `tandem-crds` whose status carries standard conditions.
pub trait TandemKind:
    kube::Resource<Scope = NamespaceResourceScope, DynamicType = ()>
    + Clone
    + DeserializeOwned
    + std::fmt::Debug
{
    /// The status conditions (none before the operator's first status write).
    fn conditions(&self) -> &[Condition];
}

impl TandemKind for CacheTier {
    fn conditions(&self) -> &[Condition] {
        self.status.as_ref().map_or(&[], |s| &s.conditions)
    }
}

impl TandemKind for PrefillPool {
    fn conditions(&self) -> &[Condition] {
        self.status.as_ref().map_or(&[], |s| &s.conditions)
    }
}

impl TandemKind for DecodePool {
    fn conditions(&self) -> &[Condition] {
        self.status.as_ref().map_or(&[], |s| &s.conditions)
    }
}

/// Why a step failed (the demo wraps it with the phase).
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// A command (helm, kubectl, cargo) failed.
    #[error("{command}: {message}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and the tail of its output.
        message: String,
    },
    /// The API server refused or failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Something did not happen in time.
    #[error("{what} not reached after {seconds} s; last seen: {last}")]
    Timeout {
        /// The condition awaited.
        what: String,
        /// The deadline.
        seconds: u64,
        /// The last observation (conditions, counts).
        last: String,
    },
    /// A file or binary is missing.
    #[error("{0}")]
    Missing(String),
}

/// Runs a command, failing with its output's tail on a non-zero exit.
pub async fn run_command(program: &Path, args: &[&str]) -> Result<String, StackError> {
    let line = format!("{} {}", program.display(), args.join(" "));
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| StackError::Command {
            command: line.clone(),
            message: e.to_string(),
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        let tail: String = text
            .chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(StackError::Command {
            command: line,
            message: format!("{}: {tail}", out.status),
        });
    }
    Ok(text)
}

/// The repository root (the workspace this binary was built from).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_owned)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Makes sure `tandem-worker` and `tandem-operator` sit next to the running executable (where
/// the process runner looks for them, unless `$TANDEM_WORKER_BIN` / `$TANDEM_OPERATOR_BIN` point
/// elsewhere): builds them with cargo, same profile, target dir and feature set as this
/// executable, when they are missing or older than their sources would warrant (cargo decides; a
/// no-op build takes a second).
pub async fn ensure_binaries() -> Result<(), StackError> {
    ensure_binaries_with(&[]).await
}

/// [`ensure_binaries`] with extra cargo `--features` (e.g. `negative-controls` for a
/// cluster suite that runs a negative control: the worker honours its switches only when built
/// with that feature). From a test executable (`target/<profile>/deps/`) the binaries go to
/// `target/<profile>/`, where the process runner finds them.
///
/// # Errors
/// As [`ensure_binaries`].
pub async fn ensure_binaries_with(features: &[&str]) -> Result<(), StackError> {
    let exe = std::env::current_exe().map_err(|e| StackError::Missing(e.to_string()))?;
    let Some(mut profile_dir) = exe.parent() else {
        return Err(StackError::Missing(format!(
            "{} has no parent",
            exe.display()
        )));
    };
    if profile_dir.file_name().is_some_and(|n| n == "deps")
        && let Some(up) = profile_dir.parent()
    {
        profile_dir = up;
    }
    let overridden = std::env::var_os("TANDEM_WORKER_BIN").is_some()
        && std::env::var_os("TANDEM_OPERATOR_BIN").is_some();
    if overridden {
        return Ok(());
    }
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let target_dir = profile_dir.parent().unwrap_or(profile_dir);
    let cargo = std::env::var_os("CARGO").map_or_else(|| PathBuf::from("cargo"), PathBuf::from);
    // tandem-e2e is selected too: with it (and its `tandem-demo-deps`) every shared dependency
    // gets the feature set this executable was built with, so nothing but the two binaries'
    // own crates compiles here (e2e/demo-deps/Cargo.toml).
    let mut args = vec![
        "build",
        "-p",
        "tandem-worker",
        "-p",
        "tandem-operator",
        "-p",
        "tandem-e2e",
    ];
    if release {
        args.push("--release");
    }
    let features = features.join(",");
    if !features.is_empty() {
        args.extend(["--features", &features]);
    }
    let manifest = repo_root().join("Cargo.toml");
    let manifest = manifest.to_string_lossy().into_owned();
    args.extend(["--manifest-path", &manifest]);
    eprintln!(
        "[demo] building tandem-worker and tandem-operator (cargo {})",
        args.join(" ")
    );
    let out = tokio::process::Command::new(&cargo)
        .args(&args)
        .env("CARGO_TARGET_DIR", target_dir)
        .stdin(std::process::Stdio::null())
        .status()
        .await
        .map_err(|e| StackError::Command {
            command: format!("cargo {}", args.join(" ")),
            message: e.to_string(),
        })?;
    if !out.success() {
        return Err(StackError::Command {
            command: format!("cargo {}", args.join(" ")),
            message: out.to_string(),
        });
    }
    for bin in ["tandem-worker", "tandem-operator"] {
        if !profile_dir.join(bin).is_file() {
            return Err(StackError::Missing(format!(
                "{} not found after the build",
                profile_dir.join(bin).display()
            )));
        }
    }
    Ok(())
}

/// Whether `worker` is a `tandem-worker` built with the `negative-controls` feature: its
/// `sim-engine` knows the hidden flag `--regenerate-hits` (a release build refuses it as an
/// unexpected argument before `--help` is reached).
pub async fn has_negative_controls(worker: &Path) -> bool {
    tokio::process::Command::new(worker)
        .args(["sim-engine", "--regenerate-hits", "--help"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success())
}

/// A `tandem-worker` with the `negative-controls` feature, for the stack-level negative controls
/// (e2e/tests/stack_negative.rs), linked as `negative-controls/tandem-worker` beside the running
/// executable's profile directory, so that a later build of the plain binary does not swap it
/// under running pods. `$TANDEM_NC_WORKER_BIN` names one explicitly. Otherwise the
/// `tandem-worker` next to the executable is taken when it has the feature (`cargo test
/// --workspace` builds it so: the worker's dev-dependency on itself turns the feature on), else
/// cargo builds it with `--features negative-controls` (same profile and target dir; tandem-e2e
/// is selected too, as in [`ensure_binaries`]; cargo 1.95 ignores the `tandem-worker/…` spelling
/// for a package selected with `-p`, which then built the plain binary again). The e2e crate still
/// does not depend on the worker crate: this is a binary on disk.
///
/// # Errors
/// [`StackError::Command`] when cargo fails, [`StackError::Missing`] when no binary with the
/// feature results.
pub async fn negative_controls_worker() -> Result<PathBuf, StackError> {
    if let Some(p) = std::env::var_os("TANDEM_NC_WORKER_BIN") {
        let p = PathBuf::from(p);
        return if has_negative_controls(&p).await {
            Ok(p)
        } else {
            Err(StackError::Missing(format!(
                "$TANDEM_NC_WORKER_BIN={} lacks the negative-controls feature",
                p.display()
            )))
        };
    }
    let exe = std::env::current_exe().map_err(|e| StackError::Missing(e.to_string()))?;
    let mut profile_dir = exe
        .parent()
        .ok_or_else(|| StackError::Missing(format!("{} has no parent", exe.display())))?
        .to_path_buf();
    // A test executable lives in `target/<profile>/deps/`.
    if profile_dir.file_name().is_some_and(|n| n == "deps") {
        profile_dir.pop();
    }
    let plain = profile_dir.join("tandem-worker");
    if !has_negative_controls(&plain).await {
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let target_dir = profile_dir
            .parent()
            .unwrap_or(profile_dir.as_path())
            .to_path_buf();
        let manifest = repo_root()
            .join("Cargo.toml")
            .to_string_lossy()
            .into_owned();
        let mut args = vec![
            "build",
            "-p",
            "tandem-worker",
            "-p",
            "tandem-e2e",
            "--features",
            "negative-controls",
            "--manifest-path",
            &manifest,
        ];
        if release {
            args.push("--release");
        }
        eprintln!(
            "[demo] building tandem-worker with negative controls (cargo {})",
            args.join(" ")
        );
        let cargo = std::env::var_os("CARGO").map_or_else(|| PathBuf::from("cargo"), PathBuf::from);
        let status = tokio::process::Command::new(&cargo)
            .args(&args)
            .env("CARGO_TARGET_DIR", &target_dir)
            .stdin(std::process::Stdio::null())
            .status()
            .await
            .map_err(|e| StackError::Command {
                command: format!("cargo {}", args.join(" ")),
                message: e.to_string(),
            })?;
        if !status.success() {
            return Err(StackError::Command {
                command: format!("cargo {}", args.join(" ")),
                message: status.to_string(),
            });
        }
        if !has_negative_controls(&plain).await {
            return Err(StackError::Missing(format!(
                "{} lacks the negative-controls feature after the build",
                plain.display()
            )));
        }
    }
    let dir = profile_dir.join("negative-controls");
    let linked = dir.join("tandem-worker");
    let io = |e: std::io::Error| StackError::Missing(format!("{}: {e}", linked.display()));
    std::fs::create_dir_all(&dir).map_err(io)?;
    match std::fs::remove_file(&linked) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    // A hard link keeps this inode when cargo later replaces the plain binary; a copy otherwise.
    if std::fs::hard_link(&plain, &linked).is_err() {
        std::fs::copy(&plain, &linked).map_err(io)?;
    }
    Ok(linked)
}

/// Polls `check` every 500 ms until it returns `Ok(Some(v))`, for at most `timeout`; prints a
/// progress line every 10 s with the last observation. `check` returns `Ok(None)` with a
/// description in `last` for "not yet"; API errors count as "not yet" (the description says so).
pub async fn poll<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, StackError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (Option<T>, String)>,
{
    let started = Instant::now();
    let mut note = started + Duration::from_secs(10);
    let mut last = String::new();
    loop {
        let (got, seen) = check().await;
        if let Some(v) = got {
            eprintln!(
                "[demo] {what}: done after {:.1} s",
                started.elapsed().as_secs_f64()
            );
            return Ok(v);
        }
        last = if seen.is_empty() { last } else { seen };
        if started.elapsed() >= timeout {
            return Err(StackError::Timeout {
                what: what.to_owned(),
                seconds: timeout.as_secs(),
                last,
            });
        }
        if Instant::now() >= note {
            eprintln!(
                "[demo] waiting for {what} ({:.0} s): {last}",
                started.elapsed().as_secs_f64()
            );
            note += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until every CRD of [`crd_names`] is `Established`.
pub async fn wait_crds_established(
    client: &kube::Client,
    timeout: Duration,
) -> Result<(), StackError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    poll("Tandem CRDs Established", timeout, || {
        let api = api.clone();
        async move {
            let mut missing = Vec::new();
            for name in crd_names() {
                let ok = api.get_opt(name).await.ok().flatten().is_some_and(|c| {
                    c.status.and_then(|s| s.conditions).is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    })
                });
                if !ok {
                    missing.push(name);
                }
            }
            let seen = format!("not established: {missing:?}");
            (missing.is_empty().then_some(()), seen)
        }
    })
    .await
}

/// Waits until every Deployment in `namespace` (at least one) has all replicas available.
pub async fn wait_deployments_available(
    client: &kube::Client,
    namespace: &str,
    timeout: Duration,
) -> Result<(), StackError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    poll(
        &format!("operator Deployment in {namespace} available"),
        timeout,
        || {
            let api = api.clone();
            async move {
                let list = match api.list(&ListParams::default()).await {
                    Ok(l) => l.items,
                    Err(e) => return (None, format!("list failed: {e}")),
                };
                let state: Vec<String> = list
                    .iter()
                    .map(|d| {
                        let want = d.spec.replicas.unwrap_or(1);
                        let have = d
                            .status
                            .as_ref()
                            .and_then(|s| s.available_replicas)
                            .unwrap_or(0);
                        format!(
                            "{} {have}/{want}",
                            d.metadata.name.as_deref().unwrap_or("?")
                        )
                    })
                    .collect();
                let ok = !list.is_empty()
                    && list.iter().all(|d| {
                        let want = d.spec.replicas.unwrap_or(1);
                        d.status
                            .as_ref()
                            .and_then(|s| s.available_replicas)
                            .unwrap_or(0)
                            >= want
                    });
                (ok.then_some(()), format!("{state:?}"))
            }
        },
    )
    .await
}

/// `(type, status, reason)` of each condition.
pub fn conditions(cs: &[Condition]) -> Vec<(String, String, String)> {
    cs.iter()
        .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
        .collect()
}

/// True when the `Ready` condition is `True`.
pub fn is_ready(cs: &[Condition]) -> bool {
    cs.iter()
        .any(|c| c.type_ == tandem_crds::conditions::READY && c.status == "True")
}

/// Whether object `name` of kind `K` is Ready, and a line describing what was seen.
async fn ready_state<K: TandemKind>(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> (bool, String) {
    let kind = K::kind(&());
    match Api::<K>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
    {
        Ok(Some(o)) => {
            let cs: Vec<String> = conditions(o.conditions())
                .into_iter()
                .map(|(t, s, r)| {
                    format!(
                        "{t}={s}{}",
                        if r.is_empty() {
                            String::new()
                        } else {
                            format!("({r})")
                        }
                    )
                })
                .collect();
            (
                is_ready(o.conditions()),
                format!("{kind}/{name} [{}]", cs.join(" ")),
            )
        }
        Ok(None) => (false, format!("{kind}/{name} absent")),
        Err(e) => (false, format!("{kind}/{name}: {e}")),
    }
}

/// Names of the three objects of a stack.
#[derive(Debug, Clone, Copy)]
pub struct StackNames<'a> {
    /// The CacheTier.
    pub tier: &'a str,
    /// The PrefillPool.
    pub prefill: &'a str,
    /// The DecodePool.
    pub decode: &'a str,
}

/// Waits until the CacheTier, the PrefillPool and the DecodePool of `names` are Ready.
pub async fn wait_resources_ready(
    client: &kube::Client,
    namespace: &str,
    names: StackNames<'_>,
    timeout: Duration,
) -> Result<(), StackError> {
    poll(
        "CacheTier, PrefillPool and DecodePool Ready",
        timeout,
        || async move {
            let seen = [
                ready_state::<CacheTier>(client, namespace, names.tier).await,
                ready_state::<PrefillPool>(client, namespace, names.prefill).await,
                ready_state::<DecodePool>(client, namespace, names.decode).await,
            ];
            let all = seen.iter().all(|(ready, _)| *ready);
            let lines: Vec<&str> = seen.iter().map(|(_, l)| l.as_str()).collect();
            (all.then_some(()), lines.join("; "))
        },
    )
    .await
}

/// A row of the "what is running" table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRow {
    /// Pod name.
    pub name: String,
    /// Role label.
    pub role: String,
    /// Pool label.
    pub pool: String,
    /// Group label.
    pub group: String,
    /// Revision label.
    pub revision: String,
    /// Pod IP.
    pub ip: String,
    /// Phase.
    pub phase: String,
    /// Serving (Ready, Running, not deleting).
    pub ready: bool,
}

/// Table rows for Tandem pods, sorted by role (cache, prefill, decode), pool, group, name.
pub fn pod_rows(pods: &[Pod]) -> Vec<PodRow> {
    let label = |p: &Pod, k: &str| {
        p.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(k))
            .cloned()
            .unwrap_or_else(|| "-".to_owned())
    };
    let mut rows: Vec<PodRow> = pods
        .iter()
        .map(|p| PodRow {
            name: p.metadata.name.clone().unwrap_or_default(),
            role: label(p, ROLE_LABEL),
            pool: label(p, POOL_LABEL),
            group: label(p, GROUP_LABEL),
            revision: label(p, REVISION_LABEL),
            ip: p
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.clone())
                .unwrap_or_else(|| "-".to_owned()),
            phase: p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_else(|| "-".to_owned()),
            ready: pod_serving(p),
        })
        .collect();
    let rank = |r: &str| match r {
        ROLE_CACHE => 0,
        ROLE_PREFILL => 1,
        ROLE_DECODE => 2,
        _ => 3,
    };
    rows.sort_by(|a, b| {
        (rank(&a.role), &a.pool, &a.group, &a.name).cmp(&(
            rank(&b.role),
            &b.pool,
            &b.group,
            &b.name,
        ))
    });
    rows
}

/// The rows as an aligned text table.
pub fn render_table(rows: &[PodRow]) -> String {
    let mut cells = vec![[
        "NAME".to_owned(),
        "ROLE".to_owned(),
        "POOL".to_owned(),
        "GROUP".to_owned(),
        "REVISION".to_owned(),
        "IP".to_owned(),
        "PHASE".to_owned(),
        "READY".to_owned(),
    ]];
    for r in rows {
        cells.push([
            r.name.clone(),
            r.role.clone(),
            r.pool.clone(),
            r.group.clone(),
            r.revision.clone(),
            r.ip.clone(),
            r.phase.clone(),
            if r.ready { "yes" } else { "no" }.to_owned(),
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|i| cells.iter().map(|c| c[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for c in &cells {
        let line: Vec<String> = c
            .iter()
            .zip(&widths)
            .map(|(s, w)| format!("{s:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// Tandem pods (any pod with a role label) in `namespace`.
pub async fn list_tandem_pods(
    client: &kube::Client,
    namespace: &str,
) -> Result<Vec<Pod>, StackError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    Ok(api
        .list(&ListParams::default().labels(ROLE_LABEL))
        .await?
        .items)
}

/// `spec.replicas` of a DecodePool.
pub async fn decode_replicas(
    client: &kube::Client,
    namespace: &str,
    pool: &str,
) -> Result<i64, StackError> {
    let o = Api::<DecodePool>::namespaced(client.clone(), namespace)
        .get(pool)
        .await?;
    Ok(i64::from(o.spec.replicas))
}

/// Merge-patches a DecodePool's spec.
pub async fn patch_decode_pool(
    client: &kube::Client,
    namespace: &str,
    pool: &str,
    spec: serde_json::Value,
) -> Result<(), StackError> {
    Api::<DecodePool>::namespaced(client.clone(), namespace)
        .patch(
            pool,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": spec })),
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_orders_roles_and_aligns() {
        let pod = |name: &str, role: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "labels": {ROLE_LABEL: role, POOL_LABEL: "p", GROUP_LABEL: "0", REVISION_LABEL: "r1"}},
                "status": {"phase": "Running", "podIP": "127.100.0.9", "conditions": [{"type": "Ready", "status": "True"}]}
            }))
            .unwrap()
        };
        let rows = pod_rows(&[
            pod("d-0", "decode"),
            pod("c-0", "cache"),
            pod("p-0", "prefill"),
        ]);
        let roles: Vec<&str> = rows.iter().map(|r| r.role.as_str()).collect();
        assert_eq!(roles, ["cache", "prefill", "decode"]);
        let t = render_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAME  ROLE"));
        assert!(lines[1].starts_with("c-0   cache"));
        assert!(lines[1].ends_with("yes"));
    }

    #[test]
    fn conditions_of_a_typed_status() {
        let cs: Vec<Condition> = serde_json::from_value(serde_json::json!([
            {"type": "Ready", "status": "True", "reason": "AllGroupsReady", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]))
        .unwrap();
        assert!(is_ready(&cs));
        assert_eq!(conditions(&cs)[0].2, "AllGroupsReady");
        let mut not_ready = cs.clone();
        not_ready[0].status = "False".into();
        assert!(!is_ready(&not_ready) && !is_ready(&[]));
        assert_eq!(
            crd_names(),
            [
                "cachetiers.serving.tandem.dev",
                "prefillpools.serving.tandem.dev",
                "decodepools.serving.tandem.dev"
            ]
        );
    }
}
