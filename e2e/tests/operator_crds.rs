//! Issue 19 item 7: the operator does not stall silently after its CRDs come back.
//!
//! Own control plane (etcd and the API server only, ports + 4400: what is checked is the
//! operator's own writes and status, no pod has to run), with the workspace's `tandem-operator`
//! binary as a local process (admin kubeconfig, `--no-leader-election`). In order:
//!
//! 1. the CRDs and the sample stack are applied; every object gets a status (the three
//!    controllers and their watches run); the stack is deleted (teardown with no pods is quick);
//! 2. the CRDs are deleted under the running operator: `/readyz` turns 503 and names the failing
//!    watches, and the operator's log has a warning with the retry delay;
//! 3. the CRDs are re-applied and the sample stack created again: every object is reconciled
//!    (has `status.observedGeneration`) in under 10 s, and `/readyz` is 200 again.
//!
//! Before the fix, watch errors went to debug, one shared back-off paused every watch of a
//! controller, `/readyz` stayed 200 and the new objects got no status for minutes.
//!
//! Skips with a printed reason when the control-plane binaries or the operator binary are missing,
//! unless `TANDEM_E2E_REQUIRE_CLUSTER` is set.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{ClusterShape, PrivateCluster, poll, run_tool, start_cluster};
use tandem_e2e::cluster::down::down;
use tandem_e2e::cluster::up::RunningCluster;
use tandem_e2e::http_get;
use tandem_e2e::runner::image::locate_binary;

/// The bound on picking the kinds up again (the figure).
const RECONCILED_WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recreated_crds_are_reconciled_within_seconds() {
    let required = std::env::var_os("TANDEM_E2E_REQUIRE_CLUSTER").is_some();
    let operator = locate_binary("tandem-operator", "TANDEM_OPERATOR_BIN");
    if !operator.is_file() {
        assert!(
            !required,
            "{} not built (cargo build -p tandem-operator)",
            operator.display()
        );
        println!(
            "SKIPPED recreated_crds_are_reconciled_within_seconds: {} is not built \
             (cargo build -p tandem-operator)",
            operator.display()
        );
        return;
    }
    let Some(PrivateCluster { cluster, tmp }) = start_cluster(
        "recreated_crds_are_reconciled_within_seconds",
        ClusterShape::api_only(4400),
    )
    .await
    else {
        return;
    };
    let log = tmp.path().join("operator.log");
    let outcome = scenario(&cluster, &operator, &log).await;
    if outcome.is_err() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        println!("--- operator log (tail)");
        for l in tail.iter().rev() {
            println!("{l}");
        }
    }
    let _ = down(&cluster.config, false).await;
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

/// The operator process; killed when dropped.
struct Operator {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

fn start_operator(cluster: &RunningCluster, bin: &Path, log: &Path) -> Result<Operator, String> {
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
    let out = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    let child = Command::new(bin)
        .args([
            "--no-leader-election",
            "--metrics-addr",
            &addr.to_string(),
            "--log-format",
            "text",
        ])
        .env("KUBECONFIG", &cluster.kubeconfig)
        .env("RUST_LOG", "info,kube=warn")
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    Ok(Operator { child, addr })
}

fn kubectl(cluster: &RunningCluster, args: &[&str]) -> Result<String, String> {
    run_tool(&cluster.bin_dir.kubectl(), &cluster.kubeconfig, args)
}

async fn readyz(op: &Operator) -> Option<(u16, String)> {
    http_get::get(op.addr, "/readyz", &[], Duration::from_secs(2))
        .await
        .ok()
        .map(|r| (r.status, r.body))
}

fn apply_crds(cluster: &RunningCluster) -> Result<(), String> {
    kubectl(
        cluster,
        &["apply", "--server-side", "-f", "charts/tandem/crds/"],
    )?;
    kubectl(
        cluster,
        &[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ],
    )?;
    Ok(())
}

/// `kind/name` of the sample stack whose status has no `observedGeneration` yet.
fn unreconciled(cluster: &RunningCluster) -> Result<Vec<String>, String> {
    let mut left = Vec::new();
    for (kind, name) in [
        ("cachetier", "llama70b-l3"),
        ("prefillpool", "llama70b-prefill"),
        ("decodepool", "llama70b-decode"),
    ] {
        let seen = kubectl(
            cluster,
            &[
                "get",
                kind,
                name,
                "-o",
                "jsonpath={.status.observedGeneration}",
            ],
        )?;
        if seen.trim().is_empty() {
            left.push(format!("{kind}/{name}"));
        }
    }
    Ok(left)
}

async fn wait_reconciled(cluster: &RunningCluster, within: Duration) -> Result<Duration, String> {
    let started = Instant::now();
    let mut last = Vec::new();
    let done = poll(within, || {
        let now = unreconciled(cluster);
        if let Ok(l) = &now {
            last = l.clone();
        }
        async move { now.ok().filter(Vec::is_empty) }
    })
    .await;
    match done {
        Some(_) => Ok(started.elapsed()),
        None => Err(format!(
            "no status after {:.1} s on {last:?}",
            started.elapsed().as_secs_f64()
        )),
    }
}

async fn scenario(cluster: &RunningCluster, bin: &Path, log: &Path) -> Result<(), String> {
    apply_crds(cluster)?;
    let op = start_operator(cluster, bin, log)?;
    poll(Duration::from_secs(60), || async {
        readyz(&op).await.filter(|(s, _)| *s == 200)
    })
    .await
    .ok_or("the operator's /readyz was not 200 within 60 s")?;

    // 1. The controllers run: the stack gets a status; then it goes (no pods: quick teardown).
    kubectl(cluster, &["apply", "-f", "manifests/samples/"])?;
    let first = wait_reconciled(cluster, Duration::from_secs(60)).await?;
    println!("stack reconciled in {:.1} s", first.as_secs_f64());
    kubectl(
        cluster,
        &["delete", "-f", "manifests/samples/", "--timeout=90s"],
    )?;

    // 2. The CRDs go: the operator says its watches fail.
    kubectl(
        cluster,
        &["delete", "-f", "charts/tandem/crds/", "--timeout=60s"],
    )?;
    // Each watch fails on its own next attempt: wait until /readyz names all three (a first 503
    // may name one of them only).
    const KINDS: [&str; 3] = ["decodepools", "prefillpools", "cachetiers"];
    let (_, body) = poll(Duration::from_secs(30), || async {
        readyz(&op)
            .await
            .filter(|(s, b)| *s == 503 && KINDS.iter().all(|k| b.contains(k)))
    })
    .await
    .ok_or_else(|| {
        format!(
            "/readyz did not name the failing {KINDS:?} watches within 30 s of the CRDs' deletion"
        )
    })?;
    println!("/readyz while the CRDs are gone:\n{body}");
    let text = std::fs::read_to_string(log).map_err(|e| e.to_string())?;
    let warning = text
        .lines()
        .find(|l| l.contains("WARN") && l.contains("watch failed") && l.contains("retry_in_s"))
        .ok_or("no warning with the retry delay in the operator's log")?;
    println!("log: {warning}");

    // 3. The CRDs come back: new objects are reconciled within seconds.
    apply_crds(cluster)?;
    kubectl(cluster, &["apply", "-f", "manifests/samples/"])?;
    let took = wait_reconciled(cluster, Duration::from_secs(60)).await?;
    println!(
        "after the CRDs came back, the stack was reconciled in {:.1} s",
        took.as_secs_f64()
    );
    if took > RECONCILED_WITHIN {
        return Err(format!(
            "re-created kinds reconciled after {:.1} s, more than {RECONCILED_WITHIN:?}",
            took.as_secs_f64()
        ));
    }
    poll(Duration::from_secs(30), || async {
        readyz(&op).await.filter(|(s, _)| *s == 200)
    })
    .await
    .ok_or("/readyz did not return to 200 after the CRDs came back")?;
    Ok(())
}
