//! `GET http://<podIP>:8080/report` of a cache replica (worker/interfaces/README.md §4, parsed as
//! its [`WorkerReport`]): its `warm` flag and object counts, for the CacheTier's `CacheWarm`
//! condition and capacity figures, and a full store volume for its `Degraded` condition; and of
//! a pool's worker that is not Ready ([`worker_report`]): its `degraded` reasons (e.g. engine
//! pools refused before registration, seed 000), for the pool's `Degraded` condition.
//!
//! A plain HTTP/1.0 request over a TCP stream with a short deadline; any failure is `None` and the
//! caller falls back to pod readiness (the condition's reason says which source was used).

use std::time::Duration;

use tandem_interfaces::report::{DEGRADED_VOLUME_FULL, WorkerReport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The fields of a cache replica's report the operator reads (absent = `false` / 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheReport {
    /// Loadback finished.
    pub warm: bool,
    /// Objects held.
    pub objects: u64,
    /// Bytes held.
    pub bytes: u64,
    /// The replica's volume is full now: the message of its `degraded` entry with code
    /// [`DEGRADED_VOLUME_FULL`] (issue 18 item 5), `None` when it has none.
    pub volume_full: Option<String>,
}

/// One degradation a worker of a pool reports (its `/report` `degraded` entry), for the pool's
/// `Degraded` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFault {
    /// The pod.
    pub pod: String,
    /// The worker's component (e.g. `pools`).
    pub component: String,
    /// The worker's code (e.g. `PoolDomainMismatch`).
    pub code: String,
    /// The worker's message.
    pub message: String,
}

/// Most pods probed per reconcile: the probes run one after the other, each bounded by
/// [`PROBE_TIMEOUT`].
pub const MAX_PODS_PROBED: usize = 4;

/// The degradations that the pool's running, not Ready, not terminating pods with an IP report
/// on `GET /report` at `port` (at most [`MAX_PODS_PROBED`] pods; an unreachable report counts as
/// none).
pub async fn unready_worker_faults(
    pods: &[k8s_openapi::api::core::v1::Pod],
    port: u16,
) -> Vec<WorkerFault> {
    use kube::ResourceExt;
    let candidates = pods.iter().filter(|p| {
        !super::children::terminating(*p)
            && !super::children::pod_ready(p)
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    });
    let mut faults = Vec::new();
    for pod in candidates.take(MAX_PODS_PROBED) {
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) else {
            continue;
        };
        let Some(report) = worker_report(ip, port).await else {
            continue;
        };
        faults.extend(report.degraded.into_iter().map(|d| WorkerFault {
            pod: pod.name_any(),
            component: d.component,
            code: d.code,
            message: d.message,
        }));
    }
    faults
}

/// Deadline of one probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Fetches and parses the report of the replica at `ip:port`; `None` on any failure.
pub async fn cache_report(ip: &str, port: u16) -> Option<CacheReport> {
    Some(CacheReport::of(worker_report(ip, port).await?))
}

/// Fetches and parses the [`WorkerReport`] of the worker at `ip:port` (any role), within
/// [`PROBE_TIMEOUT`]; `None` on any failure.
pub async fn worker_report(ip: &str, port: u16) -> Option<WorkerReport> {
    let fut = async {
        let mut s = TcpStream::connect((ip, port)).await.ok()?;
        let req = format!("GET /report HTTP/1.0\r\nHost: {ip}\r\nAccept: application/json\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::with_capacity(4096);
        s.take(1 << 20).read_to_end(&mut buf).await.ok()?;
        parse_report(&buf)
    };
    tokio::time::timeout(PROBE_TIMEOUT, fut)
        .await
        .ok()
        .flatten()
}

/// Parses an HTTP/1.x response carrying a JSON [`WorkerReport`]; `None` unless the status is 200
/// and the body parses.
pub fn parse_report(buf: &[u8]) -> Option<WorkerReport> {
    let text = std::str::from_utf8(buf).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.lines().next()?.split_whitespace().nth(1)?;
    if status != "200" {
        return None;
    }
    serde_json::from_str(body.trim()).ok()
}

/// Parses an HTTP/1.x response carrying a cache replica's JSON report; `None` unless the status
/// is 200.
pub fn parse_response(buf: &[u8]) -> Option<CacheReport> {
    Some(CacheReport::of(parse_report(buf)?))
}

impl CacheReport {
    /// The cache figures of a replica's report.
    fn of(report: WorkerReport) -> Self {
        CacheReport {
            warm: report.warm.unwrap_or(false),
            objects: report.objects.unwrap_or(0),
            bytes: report.bytes.unwrap_or(0),
            volume_full: report
                .degraded
                .iter()
                .find(|d| d.code == DEGRADED_VOLUME_FULL)
                .map(|d| d.message.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_report_and_refuses_errors() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"ready\":true,\"warm\":true,\"objects\":7,\"bytes\":9,\"counters\":{}}";
        assert_eq!(
            parse_response(ok),
            Some(CacheReport {
                warm: true,
                objects: 7,
                bytes: 9,
                volume_full: None,
            })
        );
        let full = b"HTTP/1.1 200 OK\r\n\r\n{\"warm\":true,\"degraded\":[{\"component\":\"l3/volume\",\"code\":\"VolumeFull\",\"message\":\"3 put(s) refused\"}]}";
        assert_eq!(
            parse_response(full).and_then(|r| r.volume_full).as_deref(),
            Some("3 put(s) refused")
        );
        assert_eq!(parse_response(b"HTTP/1.1 503 x\r\n\r\n{}"), None);
        assert_eq!(parse_response(b"garbage"), None);
    }
}
