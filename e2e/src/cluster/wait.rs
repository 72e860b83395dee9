//! Deadline-based readiness waits with progress lines (never fixed sleeps: controlplane.md §9.15).

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use super::ClusterError;

/// Polls `check` every `interval` until it returns `Some(value)`, for at most `timeout`.
///
/// Prints `waiting for <what> ...` every 10 s and `<what> ready after N.Ns` at the end, so a slow
/// start on a loaded 2-core machine is visibly alive. `check` returning `None` means "not yet";
/// errors are the caller's to map into `None` (a refused connection during startup is normal).
/// On timeout: [`ClusterError::NotReady`] naming `logs`.
pub async fn wait_for<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    logs: &Path,
    mut check: F,
) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    let mut next_note = started + Duration::from_secs(10);
    loop {
        if let Some(v) = check().await {
            eprintln!(
                "[tandem-e2e] {what} ready after {:.1}s",
                started.elapsed().as_secs_f64()
            );
            return Ok(v);
        }
        let now = Instant::now();
        if now.duration_since(started) >= timeout {
            return Err(ClusterError::NotReady {
                what: what.to_owned(),
                seconds: timeout.as_secs(),
                logs: logs.to_owned(),
            });
        }
        if now >= next_note {
            eprintln!(
                "[tandem-e2e] waiting for {what} ({}s)",
                now.duration_since(started).as_secs()
            );
            next_note = now + Duration::from_secs(10);
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_first_value_and_times_out_otherwise() {
        let mut n = 0;
        let got = wait_for(
            "thing",
            Duration::from_secs(5),
            Duration::from_millis(1),
            Path::new("/x"),
            || {
                n += 1;
                let v = (n >= 3).then_some(n);
                async move { v }
            },
        )
        .await
        .unwrap();
        assert_eq!(got, 3);
        let err = wait_for(
            "never",
            Duration::from_millis(30),
            Duration::from_millis(5),
            Path::new("/x/log"),
            || async { None::<()> },
        )
        .await
        .unwrap_err();
        assert!(matches!(err, ClusterError::NotReady { ref what, .. } if what == "never"));
    }
}
