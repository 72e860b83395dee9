//! The control-plane binaries: found in the cache, or built by `e2e/tools/build-controlplane.sh`.
//!
//! The script owns the recipe (versions, consumer modules, ldflags, cache stamp, lock); this module
//! runs it and keeps the user informed: a cold build takes tens of minutes on 2 cores (figures in
//! `e2e/README.md`), so a heartbeat line is printed every 30 s with the elapsed time and the last
//! step the script reported. The script's full stderr goes to
//! `~/.cache/tandem-e2e/logs/build-<unix time>.log`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::{ClusterError, cache_root, io_err, tools_dir};

/// Exit status of `build-controlplane.sh` under `E2E_CHECK_ONLY=1` when nothing is cached.
const EXIT_NOT_CACHED: i32 = 3;

/// How to obtain the binaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildMode {
    /// Use the cache; build (minutes to tens of minutes) when it misses.
    BuildIfMissing,
    /// Use the cache; fail with [`ClusterError::NotBuilt`] when it misses (tests that skip).
    CachedOnly,
}

/// A finished bin dir of the build script (it holds a `.complete` marker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinDir(pub PathBuf);

impl BinDir {
    /// Path of one binary in the dir (`etcd`, `kube-apiserver`, `kubectl`, `helm`, `kwok`, ...).
    pub fn tool(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// kubectl built from the same k8s.io/kubernetes version as the API server.
    pub fn kubectl(&self) -> PathBuf {
        self.tool("kubectl")
    }

    /// helm v3 built from `helm.sh/helm/v3`.
    pub fn helm(&self) -> PathBuf {
        self.tool("helm")
    }

    /// The `VERSIONS` file the script writes (component versions, Go version, build date).
    pub fn versions(&self) -> String {
        std::fs::read_to_string(self.0.join("VERSIONS")).unwrap_or_default()
    }
}

/// Returns the bin dir, building it when `mode` allows and the cache misses.
///
/// Errors: [`ClusterError::NotBuilt`] (cache miss under [`BuildMode::CachedOnly`]),
/// [`ClusterError::Script`] (the script failed: its log path is in the message).
pub async fn ensure_binaries(mode: BuildMode) -> Result<BinDir, ClusterError> {
    let script = tools_dir().join("build-controlplane.sh");
    match mode {
        BuildMode::CachedOnly => check_cache(&script).await,
        BuildMode::BuildIfMissing => match check_cache(&script).await {
            Ok(dir) => Ok(dir),
            Err(ClusterError::NotBuilt) => run_build(&script).await,
            Err(e) => Err(e),
        },
    }
}

async fn check_cache(script: &Path) -> Result<BinDir, ClusterError> {
    let out = tokio::process::Command::new("bash")
        .arg(script)
        .env("E2E_CHECK_ONLY", "1")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .await
        .map_err(|e| script_err(script, format!("cannot run: {e}")))?;
    match out.status.code() {
        Some(0) => bin_dir_from_stdout(script, &out.stdout),
        Some(EXIT_NOT_CACHED) => Err(ClusterError::NotBuilt),
        _ => Err(script_err(
            script,
            format!("cache check failed ({})", out.status),
        )),
    }
}

async fn run_build(script: &Path) -> Result<BinDir, ClusterError> {
    let logs = cache_root().join("logs");
    std::fs::create_dir_all(&logs).map_err(io_err(&logs))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let log_path = logs.join(format!("build-{stamp}.log"));
    eprintln!(
        "[tandem-e2e] building the control plane (cold: tens of minutes on 2 cores); log: {}",
        log_path.display()
    );
    let mut log = tokio::fs::File::create(&log_path)
        .await
        .map_err(io_err(&log_path))?;
    let mut child = tokio::process::Command::new("bash")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| script_err(script, format!("cannot run: {e}")))?;
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(script_err(script, "no pipes to the child".into()));
    };
    let stdout_task = tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        let mut last = String::new();
        while let Ok(Some(line)) = lines.next_line().await {
            last = line;
        }
        last
    });
    let started = Instant::now();
    let mut lines = BufReader::new(stderr).lines();
    let mut heartbeat = tokio::time::interval(Duration::from_secs(30));
    heartbeat.tick().await;
    let mut last_step = String::from("starting");
    loop {
        tokio::select! {
            line = lines.next_line() => match line {
                Ok(Some(line)) => {
                    let _ = log.write_all(format!("{line}\n").as_bytes()).await;
                    // The script's own steps start with "[k8s-tools]"; `go: downloading` lines
                    // (hundreds on a cold cache) only go to the log.
                    if line.starts_with("[k8s-tools]") {
                        eprintln!("[tandem-e2e] {line}");
                        last_step = line;
                    } else if line.contains("error") || line.contains("cannot") {
                        eprintln!("[tandem-e2e]   {line}");
                    }
                }
                _ => break,
            },
            _ = heartbeat.tick() => {
                eprintln!(
                    "[tandem-e2e] still building: {} elapsed; last step: {last_step}",
                    fmt_elapsed(started.elapsed())
                );
            }
        }
    }
    let status = child
        .wait()
        .await
        .map_err(|e| script_err(script, format!("wait: {e}")))?;
    let last_line = stdout_task.await.unwrap_or_default();
    if !status.success() {
        return Err(script_err(
            script,
            format!("build failed ({status}); see {}", log_path.display()),
        ));
    }
    eprintln!(
        "[tandem-e2e] control plane built in {}",
        fmt_elapsed(started.elapsed())
    );
    bin_dir_from_stdout(script, last_line.as_bytes())
}

fn bin_dir_from_stdout(script: &Path, stdout: &[u8]) -> Result<BinDir, ClusterError> {
    let text = String::from_utf8_lossy(stdout);
    let dir = text.lines().last().unwrap_or("").trim();
    let dir = PathBuf::from(dir);
    if dir.as_os_str().is_empty() || !dir.join(".complete").is_file() {
        return Err(script_err(
            script,
            format!("printed {dir:?}, which is not a complete bin dir"),
        ));
    }
    Ok(BinDir(dir))
}

fn script_err(script: &Path, message: String) -> ClusterError {
    ClusterError::Script {
        script: script.to_owned(),
        message,
    }
}

/// `"12m05s"` / `"41s"`.
pub fn fmt_elapsed(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elapsed_format() {
        assert_eq!(fmt_elapsed(Duration::from_secs(41)), "41s");
        assert_eq!(fmt_elapsed(Duration::from_secs(725)), "12m05s");
    }

    #[test]
    fn bin_dir_must_be_complete() {
        let dir = tempfile::tempdir().unwrap();
        let script = Path::new("build.sh");
        let out = format!("noise\n{}\n", dir.path().display());
        assert!(bin_dir_from_stdout(script, out.as_bytes()).is_err());
        std::fs::write(dir.path().join(".complete"), "").unwrap();
        let got = bin_dir_from_stdout(script, out.as_bytes()).unwrap();
        assert_eq!(got.0, dir.path());
        assert_eq!(got.kubectl(), dir.path().join("kubectl"));
        assert!(bin_dir_from_stdout(script, b"").is_err());
    }
}
