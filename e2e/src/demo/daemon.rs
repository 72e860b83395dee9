//! Starting the process runner as a background daemon of a cluster (`cluster up --runner-nodes`,
//! and the demo): it outlives the command that started it, and `cluster down` stops it by pid.

use std::os::unix::process::CommandExt;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;

use crate::cluster::down::RUNNER_PID_NAME;
use crate::cluster::up::node_ready;
use crate::cluster::wait::wait_for;
use crate::cluster::{ClusterConfig, ClusterError, client_for};
use crate::pidfile::ProcessId;

/// Starts `<this executable> runner --nodes N --gpus G --state-dir DIR [--pod-env K=V]...` in its
/// own process group, records its pid for `cluster down`, and waits until its nodes are Ready.
///
/// The running executable must be `tandem-e2e` (its `runner` subcommand). Errors: the spawn, the
/// pid file, or the nodes not Ready within 60 s ([`ClusterError::NotReady`], naming the log).
pub async fn start_runner_daemon(
    config: &ClusterConfig,
    nodes: u32,
    gpus: u32,
    pod_env: &[String],
) -> Result<(), ClusterError> {
    let io = |path: &std::path::Path| {
        let path = path.to_owned();
        move |source| ClusterError::Io { path, source }
    };
    let exe = std::env::current_exe().map_err(io(std::path::Path::new("tandem-e2e")))?;
    let log_path = config.log_file(RUNNER_PID_NAME);
    let log = std::fs::File::create(&log_path).map_err(io(&log_path))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args([
        "runner",
        "--nodes",
        &nodes.to_string(),
        "--gpus",
        &gpus.to_string(),
        "--state-dir",
    ])
    .arg(&config.state_dir);
    for kv in pod_env {
        cmd.args(["--pod-env", kv]);
    }
    let child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(io(&log_path))?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(io(&log_path))?;
    let pid_file = config.pid_file(RUNNER_PID_NAME);
    let id = ProcessId::of_pid(child.id() as i32).ok_or_else(|| ClusterError::NotReady {
        what: "process runner (exited at once)".to_owned(),
        seconds: 0,
        logs: log_path.clone(),
    })?;
    id.write(&pid_file)
        .map_err(|e| io(&pid_file)(std::io::Error::other(e)))?;
    eprintln!(
        "[tandem-e2e] started process runner (pid {}, log {})",
        id.pid,
        log_path.display()
    );
    let client = client_for(&config.kubeconfig()).await?;
    let api: Api<Node> = Api::all(client);
    let want = nodes as usize;
    wait_for(
        &format!("{want} runner node(s) Ready"),
        Duration::from_secs(60),
        Duration::from_millis(500),
        &log_path,
        || {
            let api = api.clone();
            async move {
                let list = api
                    .list(&ListParams::default().labels("tandem.dev/node-kind=process"))
                    .await
                    .ok()?;
                (list.items.iter().filter(|n| node_ready(n)).count() >= want).then_some(())
            }
        },
    )
    .await
}
