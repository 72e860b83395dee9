//! A plain-HTTP GET with a deadline: etcd's `/health` and pods' `httpGet` readiness probes.
//!
//! The kubelet counts a probe as a success when the status is `200..=399` (Kubernetes docs,
//! "Configure Liveness, Readiness and Startup Probes"); [`probe`] applies the same rule.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// Why a GET did not produce a response.
#[derive(Debug, thiserror::Error)]
pub enum HttpGetError {
    /// Connecting, sending or reading failed.
    #[error("GET http://{addr}{path}: {message}")]
    Failed {
        /// Target address.
        addr: SocketAddr,
        /// Request path.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// No complete response within the timeout.
    #[error("GET http://{addr}{path}: no response within {timeout:?}")]
    Timeout {
        /// Target address.
        addr: SocketAddr,
        /// Request path.
        path: String,
        /// The deadline that passed.
        timeout: Duration,
    },
}

/// A response: status code and body (lossy UTF-8, at most what the server sent).
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// HTTP status code.
    pub status: u16,
    /// Body text.
    pub body: String,
}

/// GET `http://{addr}{path}` with extra `headers`, failing after `timeout` (connect + response).
pub async fn get(
    addr: SocketAddr,
    path: &str,
    headers: &[(String, String)],
    timeout: Duration,
) -> Result<HttpResponse, HttpGetError> {
    let failed = |message: String| HttpGetError::Failed {
        addr,
        path: path.to_owned(),
        message,
    };
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| failed(format!("connect: {e}")))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failed(format!("handshake: {e}")))?;
        let conn = tokio::spawn(conn);
        let mut request = http::Request::get(path).header(http::header::HOST, addr.to_string());
        for (name, value) in headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(format!("request: {e}")))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| failed(format!("send: {e}")))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| failed(format!("body: {e}")))?
            .to_bytes();
        conn.abort();
        Ok(HttpResponse {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| HttpGetError::Timeout {
            addr,
            path: path.to_owned(),
            timeout,
        })?
}

/// A kubelet-style `httpGet` probe: `true` iff a response came within `timeout` with status
/// `200..=399`.
pub async fn probe(
    addr: SocketAddr,
    path: &str,
    headers: &[(String, String)],
    timeout: Duration,
) -> bool {
    matches!(get(addr, path, headers, timeout).await, Ok(r) if (200..400).contains(&r.status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn serve_once(status_line: &'static str) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let reply =
                format!("{status_line}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
            let _ = s.write_all(reply.as_bytes()).await;
        });
        addr
    }

    #[tokio::test]
    async fn probe_follows_the_kubelet_status_rule() {
        let t = Duration::from_secs(2);
        assert!(probe(serve_once("HTTP/1.1 200 OK").await, "/", &[], t).await);
        assert!(probe(serve_once("HTTP/1.1 302 Found").await, "/", &[], t).await);
        assert!(!probe(serve_once("HTTP/1.1 503 Unavailable").await, "/", &[], t).await);
        let r = get(serve_once("HTTP/1.1 200 OK").await, "/health", &[], t)
            .await
            .unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));
    }

    #[tokio::test]
    async fn silent_server_times_out_and_closed_port_fails() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let err = get(addr, "/", &[], Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, HttpGetError::Timeout { .. }), "{err}");
        drop(listener);
        assert!(!probe(addr, "/", &[], Duration::from_secs(1)).await);
    }
}
