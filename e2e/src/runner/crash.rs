//! Crashing a container the way a node sees a crash (issue 18): SIGKILL to the container's process
//! group, from outside the runner, with no API call.
//!
//! The pod's supervisor ([`super::pod`]) then finds the process gone at its next step, records the
//! exit (`lastState.terminated`, exit code 137, signal 9), and restarts the container under the
//! pod's `restartPolicy` (`Always` for StatefulSet pods) after the back-off — in the same pod, so
//! on the same pod IP and ports, with `restartCount` one higher: what the kubelet does when a
//! container is OOM-killed or segfaults. The container is found through the pid file the runner
//! writes for it, `<runner dir>/pids/<pod uid>-<container>.pid` ([`crate::pidfile`]), whose
//! `(pid, start time)` pair makes sure a recycled pid is never signalled.

use std::path::{Path, PathBuf};

use rustix::process::Signal;

use crate::pidfile::{Liveness, PidFileError, ProcessId};

/// Why a container could not be crashed.
#[derive(Debug, thiserror::Error)]
pub enum CrashError {
    /// The pid file is missing or malformed (the container never started on this runner).
    #[error(transparent)]
    PidFile(#[from] PidFileError),
    /// The pid file names a process that is not running (between two restarts, or finished).
    #[error("container {container} of pod {uid}: process {pid} is not running")]
    NotRunning {
        /// Pod uid.
        uid: String,
        /// Container name.
        container: String,
        /// The pid the file names.
        pid: i32,
    },
}

/// The pid file of container `container` of the pod with uid `uid`, under a runner's working dir.
pub fn pid_file(runner_dir: &Path, uid: &str, container: &str) -> PathBuf {
    runner_dir
        .join("pids")
        .join(format!("{uid}-{container}.pid"))
}

/// The running process of a container, `None` while it is not running (not started yet, between
/// two restarts, finished).
pub fn container_process(runner_dir: &Path, uid: &str, container: &str) -> Option<ProcessId> {
    ProcessId::read(&pid_file(runner_dir, uid, container))
        .ok()
        .filter(|id| id.state() == Liveness::Running)
}

/// SIGKILLs the process group of container `container` of pod `uid` (a runner under
/// `runner_dir` runs it) and returns the identity of the process it killed; the runner restarts it
/// (module docs).
///
/// # Errors
/// [`CrashError`] when the container has no running process.
pub fn kill_container(
    runner_dir: &Path,
    uid: &str,
    container: &str,
) -> Result<ProcessId, CrashError> {
    let id = ProcessId::read(&pid_file(runner_dir, uid, container))?;
    if id.state() != Liveness::Running {
        return Err(CrashError::NotRunning {
            uid: uid.to_owned(),
            container: container.to_owned(),
            pid: id.pid,
        });
    }
    id.signal(Signal::KILL, true);
    tracing::info!(pod_uid = %uid, %container, pid = id.pid, "container SIGKILLed");
    Ok(id)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};

    use super::*;

    #[test]
    fn kills_the_named_container_group_and_refuses_a_dead_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .process_group(0)
            .spawn()
            .unwrap();
        let id = ProcessId::of_pid(child.id() as i32).unwrap();
        id.write(&pid_file(dir.path(), "u1", "worker")).unwrap();
        assert_eq!(container_process(dir.path(), "u1", "worker"), Some(id));
        assert!(matches!(
            kill_container(dir.path(), "u1", "other"),
            Err(CrashError::PidFile(_))
        ));
        assert_eq!(kill_container(dir.path(), "u1", "worker").unwrap(), id);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(9));
        assert_eq!(container_process(dir.path(), "u1", "worker"), None);
        assert!(matches!(
            kill_container(dir.path(), "u1", "worker"),
            Err(CrashError::NotRunning { .. })
        ));
    }
}
