//! `cluster down`: stop the processes this cluster started — by recorded `(pid, start time)` only,
//! never by name — and remove the state dir.
//!
//! Order: the process runner (so it does not restart pods), its pod processes (whole process
//! groups), then kwok, kube-scheduler, kube-controller-manager, kube-apiserver, etcd. Each gets
//! SIGTERM, [`GRACE`], then SIGKILL.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{COMPONENTS, ClusterConfig};
use crate::pidfile::{Liveness, ProcessId, Termination};

/// Grace period between SIGTERM and SIGKILL for control-plane components.
pub const GRACE: Duration = Duration::from_secs(10);

/// Pid-file name of a `tandem-e2e runner` daemon attached to this cluster.
pub const RUNNER_PID_NAME: &str = "process-runner";

/// One process `down` dealt with.
#[derive(Debug, Clone)]
pub struct Stopped {
    /// Component name, or `pod <file stem>` for process-runner containers.
    pub name: String,
    /// Its identity.
    pub id: ProcessId,
    /// How it ended.
    pub how: Termination,
}

/// The components (and runner processes) of `config` whose recorded process still runs.
pub fn running_components(config: &ClusterConfig) -> Vec<(String, ProcessId)> {
    recorded(config)
        .into_iter()
        .filter(|(_, _, id)| id.state() == Liveness::Running)
        .map(|(name, _, id)| (name, id))
        .collect()
}

/// Stops every recorded process (blocking: up to [`GRACE`] + 5 s per stubborn process) and
/// removes the pid files. Malformed pid files are reported and left in place.
pub fn stop_components(config: &ClusterConfig) -> Vec<Stopped> {
    let mut stopped = Vec::new();
    for (name, file, id) in recorded(config) {
        // Runner pods lead their own process group: signal the group (children of a shell too).
        let group = name.starts_with("pod ");
        let how = id.terminate(GRACE, group);
        if how == Termination::Stuck {
            eprintln!(
                "[tandem-e2e] {name} (pid {}) survived SIGKILL; left in place",
                id.pid
            );
        } else {
            let _ = std::fs::remove_file(&file);
        }
        stopped.push(Stopped { name, id, how });
    }
    stopped
}

/// Stops everything (see [`stop_components`]) and, unless `keep_state`, removes the state dir.
/// Returns what was stopped; an error only if the state dir could not be removed.
pub async fn down(
    config: &ClusterConfig,
    keep_state: bool,
) -> Result<Vec<Stopped>, std::io::Error> {
    let cfg = config.clone();
    let stopped = tokio::task::spawn_blocking(move || stop_components(&cfg))
        .await
        .map_err(std::io::Error::other)?;
    for s in &stopped {
        let verb = match s.how {
            Termination::AlreadyGone => "was not running",
            Termination::Terminated => "stopped",
            Termination::Killed => "killed after the grace period",
            Termination::Stuck => "STUCK",
        };
        eprintln!("[tandem-e2e] {} (pid {}): {verb}", s.name, s.id.pid);
    }
    if !keep_state
        && config.state_dir.exists()
        && stopped.iter().all(|s| s.how != Termination::Stuck)
    {
        std::fs::remove_dir_all(&config.state_dir)?;
        eprintln!("[tandem-e2e] removed {}", config.state_dir.display());
    }
    Ok(stopped)
}

/// All pid files of this cluster, in stop order: (name, file, identity).
fn recorded(config: &ClusterConfig) -> Vec<(String, PathBuf, ProcessId)> {
    let mut out = Vec::new();
    let mut push = |name: String, file: PathBuf| match ProcessId::read(&file) {
        Ok(id) => out.push((name, file, id)),
        Err(e) => eprintln!("[tandem-e2e] skipping {}: {e}", file.display()),
    };
    let runner = config.pid_file(RUNNER_PID_NAME);
    if runner.is_file() {
        push(RUNNER_PID_NAME.to_owned(), runner);
    }
    for file in pid_files_in(&config.runner_dir().join("pids")) {
        let stem = file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        push(format!("pod {stem}"), file);
    }
    for component in COMPONENTS.iter().rev() {
        let file = config.pid_file(component);
        if file.is_file() {
            push((*component).to_owned(), file);
        }
    }
    out
}

fn pid_files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "pid"))
        .collect();
    files.sort();
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn down_stops_recorded_processes_only_and_removes_state() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = ClusterConfig::default_cli();
        config.state_dir = dir.path().join("state");
        // A fake "etcd" we started, and a bystander with no pid file.
        let mut ours = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let mut bystander = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let id = ProcessId::of_pid(ours.id() as i32).unwrap();
        id.write(&config.pid_file("etcd")).unwrap();
        // A stale record whose pid was "recycled": same pid as the bystander, other start time.
        let by = ProcessId::of_pid(bystander.id() as i32).unwrap();
        ProcessId {
            start_ticks: by.start_ticks + 7,
            ..by
        }
        .write(&config.pid_file("kwok"))
        .unwrap();
        assert_eq!(running_components(&config).len(), 1);

        let reaper = std::thread::spawn(move || ours.wait());
        let stopped = down(&config, false).await.unwrap();
        reaper.join().unwrap().unwrap();
        let how: Vec<_> = stopped.iter().map(|s| (s.name.as_str(), s.how)).collect();
        assert_eq!(
            how,
            [
                ("kwok", Termination::AlreadyGone),
                ("etcd", Termination::Terminated)
            ]
        );
        assert!(!config.state_dir.exists());
        assert_eq!(by.state(), Liveness::Running, "bystander must survive");
        bystander.kill().unwrap();
        bystander.wait().unwrap();
    }
}
