//! Processes we started, identified by `(pid, start time)` so a recycled pid is never signalled.
//!
//! A pid file holds one line, `"<pid> <starttime>"`, where `<starttime>` is field 22 of
//! `/proc/<pid>/stat`: the process start time in clock ticks since boot (proc(5)). The pair is
//! unique for the life of the machine, unlike the pid alone. `e2e/tools/run-controlplane.sh` writes
//! the same format for the control-plane components, and the process runner for its containers.
//!
//! Stopping follows the kubelet's order: SIGTERM, a grace period, then SIGKILL (DESIGN §6, the brief
//! of issue 4: "down stops only our pids").

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

/// Errors reading or writing a pid file.
#[derive(Debug, thiserror::Error)]
pub enum PidFileError {
    /// The file could not be read or written.
    #[error("pid file {path}: {source}")]
    Io {
        /// The pid file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file does not hold `"<pid> <starttime>"`.
    #[error("pid file {path}: malformed content {content:?} (expected \"<pid> <starttime>\")")]
    Malformed {
        /// The pid file.
        path: PathBuf,
        /// What it held.
        content: String,
    },
}

/// A process identity: pid plus start time (clock ticks since boot, `/proc/<pid>/stat` field 22).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId {
    /// The pid (> 0).
    pub pid: i32,
    /// Start time in clock ticks since boot.
    pub start_ticks: u64,
}

/// What [`ProcessId::state`] found in `/proc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// The process exists, is not a zombie, and its start time matches: it is ours.
    Running,
    /// No such process, a zombie, or the pid now belongs to another process.
    Gone,
}

impl ProcessId {
    /// Reads the identity of a live pid from `/proc`; `None` if it does not exist.
    pub fn of_pid(pid: i32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (_, start_ticks) = parse_stat(&stat)?;
        Some(Self { pid, start_ticks })
    }

    /// Parses the pid file format `"<pid> <starttime>"` (surrounding whitespace ignored).
    pub fn parse(content: &str) -> Option<Self> {
        let mut it = content.split_whitespace();
        let pid: i32 = it.next()?.parse().ok()?;
        let start_ticks: u64 = it.next()?.parse().ok()?;
        if pid <= 0 || it.next().is_some() {
            return None;
        }
        Some(Self { pid, start_ticks })
    }

    /// Reads a pid file.
    pub fn read(path: &Path) -> Result<Self, PidFileError> {
        let content = std::fs::read_to_string(path).map_err(|source| PidFileError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&content).ok_or_else(|| PidFileError::Malformed {
            path: path.to_owned(),
            content,
        })
    }

    /// Writes this identity to `path` (creating parent directories).
    pub fn write(&self, path: &Path) -> Result<(), PidFileError> {
        let io = |source| PidFileError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        std::fs::write(path, format!("{} {}\n", self.pid, self.start_ticks)).map_err(io)
    }

    /// Whether this exact process still runs (a zombie counts as gone: it has exited).
    pub fn state(&self) -> Liveness {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) else {
            return Liveness::Gone;
        };
        match parse_stat(&stat) {
            Some((state, ticks)) if ticks == self.start_ticks && state != 'Z' && state != 'X' => {
                Liveness::Running
            }
            _ => Liveness::Gone,
        }
    }

    /// Sends `signal` to the process, or to its whole process group when `group` is set (the
    /// process must lead its group). Does nothing if the process is gone.
    pub fn signal(&self, signal: Signal, group: bool) {
        if self.state() == Liveness::Gone {
            return;
        }
        let Some(pid) = Pid::from_raw(self.pid) else {
            return;
        };
        // ESRCH between the check and the kill means it just exited: nothing to do.
        let _ = if group {
            rustix::process::kill_process_group(pid, signal)
        } else {
            rustix::process::kill_process(pid, signal)
        };
    }

    /// SIGTERM, wait up to `grace` for the process to go, then SIGKILL and wait up to 5 s more.
    /// Returns how it ended.
    pub fn terminate(&self, grace: Duration, group: bool) -> Termination {
        if self.state() == Liveness::Gone {
            return Termination::AlreadyGone;
        }
        self.signal(Signal::TERM, group);
        if self.wait_gone(grace) {
            return Termination::Terminated;
        }
        self.signal(Signal::KILL, group);
        if self.wait_gone(Duration::from_secs(5)) {
            Termination::Killed
        } else {
            Termination::Stuck
        }
    }

    fn wait_gone(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.state() == Liveness::Gone {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// How [`ProcessId::terminate`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// It was not running.
    AlreadyGone,
    /// It exited within the grace period after SIGTERM.
    Terminated,
    /// It needed SIGKILL.
    Killed,
    /// It survived SIGKILL for 5 s (uninterruptible sleep?); reported, not hidden.
    Stuck,
}

/// Parses `/proc/<pid>/stat`: returns (state char, start time ticks). The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after the *last* `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // rest starts at field 3 (state); starttime is field 22 -> index 19 of `rest`.
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_spaces_and_parens_in_comm() {
        let stat = "4242 (we (ird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 \
                    1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        assert_eq!(parse_stat(stat), Some(('S', 987654)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn pid_file_round_trip_and_rejects_malformed() {
        assert_eq!(
            ProcessId::parse(" 12 345\n"),
            Some(ProcessId {
                pid: 12,
                start_ticks: 345
            })
        );
        for bad in ["", "12", "x 3", "-1 3", "0 3", "1 2 3"] {
            assert_eq!(ProcessId::parse(bad), None, "{bad:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b.pid");
        let me = ProcessId::of_pid(std::process::id() as i32).unwrap();
        me.write(&path).unwrap();
        assert_eq!(ProcessId::read(&path).unwrap(), me);
        std::fs::write(&path, "nonsense").unwrap();
        assert!(matches!(
            ProcessId::read(&path),
            Err(PidFileError::Malformed { .. })
        ));
    }

    #[test]
    fn a_recycled_pid_is_not_ours() {
        let me = ProcessId::of_pid(std::process::id() as i32).unwrap();
        assert_eq!(me.state(), Liveness::Running);
        let impostor = ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert_eq!(impostor.state(), Liveness::Gone);
        // Signalling the impostor must not touch us: SIGKILL would end this test process.
        impostor.signal(Signal::KILL, false);
        assert_eq!(me.state(), Liveness::Running);
    }

    #[test]
    fn terminate_escalates_to_kill_for_a_process_ignoring_term() {
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "trap '' TERM; echo trapped; while :; do sleep 0.05; done",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let id = ProcessId::of_pid(child.id() as i32).unwrap();
        // sh says when its trap is installed (a dead sh ends the read with EOF instead).
        let mut line = String::new();
        let stdout = child.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
        assert_eq!(line.trim(), "trapped");
        let reaper = std::thread::spawn(move || child.wait());
        assert_eq!(
            id.terminate(Duration::from_millis(300), false),
            Termination::Killed
        );
        reaper.join().unwrap().unwrap();
        assert_eq!(
            id.terminate(Duration::ZERO, false),
            Termination::AlreadyGone
        );
    }
}
