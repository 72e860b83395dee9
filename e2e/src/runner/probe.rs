//! Readiness probes: the kubelet's threshold rule (pure) and the three handlers.
//!
//! A container without a readiness probe is ready once running. With one, it starts not ready,
//! becomes ready after `successThreshold` consecutive successes and not ready after
//! `failureThreshold` consecutive failures; the first probe runs `initialDelaySeconds` after start,
//! then every `periodSeconds` (defaults 0, 10, 1, 3, timeout 1 s: `Probe` API reference).
//! Handlers: `httpGet` (host defaults to the pod IP, named ports resolved through the container's
//! `ports`), `tcpSocket` (connect), `exec` (exit code 0, run with the container's environment).
//! `grpc` is not implemented and counts as failing, so such a pod never turns Ready here.
//! Startup probes use the same state ([`super::pod`] runs them: they gate a native sidecar's init
//! sequence and the readiness probes); liveness probes are not run.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::http_get;

/// Threshold and timing state of one container's readiness probe.
#[derive(Debug, Clone)]
pub struct ProbeState {
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    success_threshold: u32,
    failure_threshold: u32,
    successes: u32,
    failures: u32,
    ready: bool,
    next_due: Option<Instant>,
}

impl ProbeState {
    /// State for `probe` (API defaults for absent fields; nonsensical values clamped to 1).
    pub fn new(probe: &Probe) -> Self {
        let secs =
            |v: Option<i32>, default: i32| Duration::from_secs(v.unwrap_or(default).max(0) as u64);
        Self {
            initial_delay: secs(probe.initial_delay_seconds, 0),
            period: secs(probe.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: secs(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
            success_threshold: probe.success_threshold.unwrap_or(1).max(1) as u32,
            failure_threshold: probe.failure_threshold.unwrap_or(3).max(1) as u32,
            successes: 0,
            failures: 0,
            ready: false,
            next_due: None,
        }
    }

    /// Resets for a fresh container start at `started`.
    pub fn restart(&mut self, started: Instant) {
        self.successes = 0;
        self.failures = 0;
        self.ready = false;
        self.next_due = Some(started + self.initial_delay);
    }

    /// Whether a probe is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.next_due.is_some_and(|t| now >= t)
    }

    /// The per-attempt timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Records one result at `now`; returns the readiness afterwards.
    pub fn record(&mut self, success: bool, now: Instant) -> bool {
        if success {
            self.successes += 1;
            self.failures = 0;
            if self.successes >= self.success_threshold {
                self.ready = true;
            }
        } else {
            self.failures += 1;
            self.successes = 0;
            if self.failures >= self.failure_threshold {
                self.ready = false;
            }
        }
        self.next_due = Some(now + self.period);
        self.ready
    }

    /// Current readiness.
    pub fn ready(&self) -> bool {
        self.ready
    }
}

/// Runs `probe` once for `container` of a pod at `pod_ip`, with `env` for `exec`.
pub async fn run_probe(
    probe: &Probe,
    container: &Container,
    pod_ip: IpAddr,
    env: &[(String, String)],
    cwd: &std::path::Path,
    timeout: Duration,
) -> bool {
    if let Some(h) = &probe.http_get {
        let Some(port) = resolve_port(&h.port, container) else {
            return false;
        };
        let host = h
            .host
            .as_deref()
            .and_then(|s| s.parse::<IpAddr>().ok())
            .unwrap_or(pod_ip);
        let path = h.path.as_deref().filter(|p| !p.is_empty()).unwrap_or("/");
        let headers: Vec<(String, String)> = h
            .http_headers
            .iter()
            .flatten()
            .map(|hh| (hh.name.clone(), hh.value.clone()))
            .collect();
        return http_get::probe(SocketAddr::new(host, port), path, &headers, timeout).await;
    }
    if let Some(t) = &probe.tcp_socket {
        let Some(port) = resolve_port(&t.port, container) else {
            return false;
        };
        let host = t
            .host
            .as_deref()
            .and_then(|s| s.parse::<IpAddr>().ok())
            .unwrap_or(pod_ip);
        let connect = tokio::net::TcpStream::connect(SocketAddr::new(host, port));
        return matches!(tokio::time::timeout(timeout, connect).await, Ok(Ok(_)));
    }
    if let Some(e) = &probe.exec {
        let Some((program, args)) = e.command.as_deref().and_then(|c| c.split_first()) else {
            return false;
        };
        let status = tokio::process::Command::new(program)
            .args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        return matches!(tokio::time::timeout(timeout, status).await, Ok(Ok(s)) if s.success());
    }
    false
}

/// A probe port: a number, or the name of one of the container's ports.
pub fn resolve_port(port: &IntOrString, container: &Container) -> Option<u16> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok(),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .or_else(|| name.parse().ok()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(success: i32, failure: i32) -> Probe {
        Probe {
            period_seconds: Some(1),
            initial_delay_seconds: Some(2),
            success_threshold: Some(success),
            failure_threshold: Some(failure),
            ..Default::default()
        }
    }

    #[test]
    fn thresholds_and_timing() {
        let t0 = Instant::now();
        let mut s = ProbeState::new(&probe(2, 2));
        assert!(!s.due(t0), "not armed before the container starts");
        s.restart(t0);
        assert!(!s.due(t0 + Duration::from_secs(1)), "initial delay");
        assert!(s.due(t0 + Duration::from_secs(2)));
        assert!(!s.record(true, t0), "one success of two");
        assert!(s.record(true, t0), "two successes: ready");
        assert!(s.record(false, t0), "one failure of two keeps ready");
        assert!(s.record(true, t0));
        assert!(s.record(false, t0));
        assert!(!s.record(false, t0), "two consecutive failures: not ready");
        s.restart(t0);
        assert!(!s.ready());
    }

    #[test]
    fn named_ports() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "c", "ports": [{"name": "http", "containerPort": 8080}]
        }))
        .unwrap();
        assert_eq!(
            resolve_port(&IntOrString::String("http".into()), &c),
            Some(8080)
        );
        assert_eq!(resolve_port(&IntOrString::Int(9), &c), Some(9));
        assert_eq!(resolve_port(&IntOrString::String("nope".into()), &c), None);
        assert_eq!(resolve_port(&IntOrString::Int(70000), &c), None);
    }

    #[tokio::test]
    async fn handlers_against_a_real_listener() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port() as i32;
        let c = Container::default();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let tcp: Probe =
            serde_json::from_value(serde_json::json!({"tcpSocket": {"port": port}})).unwrap();
        let cwd = std::env::temp_dir();
        let t = Duration::from_secs(1);
        assert!(run_probe(&tcp, &c, ip, &[], &cwd, t).await);
        let exec_ok: Probe = serde_json::from_value(
            serde_json::json!({"exec": {"command": ["sh", "-c", "test \"$X\" = 1"]}}),
        )
        .unwrap();
        let env = [
            ("X".to_string(), "1".to_string()),
            ("PATH".to_string(), std::env::var("PATH").unwrap()),
        ];
        assert!(run_probe(&exec_ok, &c, ip, &env, &cwd, t).await);
        assert!(!run_probe(&exec_ok, &c, ip, &env[1..], &cwd, t).await);
        drop(listener);
        assert!(!run_probe(&tcp, &c, ip, &[], &cwd, t).await);
        let grpc: Probe =
            serde_json::from_value(serde_json::json!({"grpc": {"port": port}})).unwrap();
        assert!(!run_probe(&grpc, &c, ip, &[], &cwd, t).await);
    }
}
