//! `GET http://<podIP>:8080/report` of a cache replica (worker/interfaces/README.md §4, parsed as
//! its [`WorkerReport`]): its `warm` flag and object counts, for the CacheTier's `CacheWarm`
//! condition and capacity figures.
//!
//! A plain HTTP/1.0 request over a TCP stream with a short deadline; any failure is `None` and the
//! caller falls back to pod readiness (the condition's reason says which source was used).

use std::time::Duration;

use tandem_interfaces::report::WorkerReport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The fields of a cache replica's report the operator reads (absent = `false` / 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheReport {
    /// Loadback finished.
    pub warm: bool,
    /// Objects held.
    pub objects: u64,
    /// Bytes held.
    pub bytes: u64,
}

/// Deadline of one probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Fetches and parses the report of the replica at `ip:port`; `None` on any failure.
pub async fn cache_report(ip: &str, port: u16) -> Option<CacheReport> {
    let fut = async {
        let mut s = TcpStream::connect((ip, port)).await.ok()?;
        let req = format!("GET /report HTTP/1.0\r\nHost: {ip}\r\nAccept: application/json\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::with_capacity(4096);
        s.take(1 << 20).read_to_end(&mut buf).await.ok()?;
        parse_response(&buf)
    };
    tokio::time::timeout(PROBE_TIMEOUT, fut)
        .await
        .ok()
        .flatten()
}

/// Parses an HTTP/1.x response carrying a JSON report; `None` unless the status is 200.
pub fn parse_response(buf: &[u8]) -> Option<CacheReport> {
    let text = std::str::from_utf8(buf).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.lines().next()?.split_whitespace().nth(1)?;
    if status != "200" {
        return None;
    }
    let report: WorkerReport = serde_json::from_str(body.trim()).ok()?;
    Some(CacheReport {
        warm: report.warm.unwrap_or(false),
        objects: report.objects.unwrap_or(0),
        bytes: report.bytes.unwrap_or(0),
    })
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
                bytes: 9
            })
        );
        assert_eq!(parse_response(b"HTTP/1.1 503 x\r\n\r\n{}"), None);
        assert_eq!(parse_response(b"garbage"), None);
    }
}
