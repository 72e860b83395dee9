//! Transport selection at start-up (dataplane.md R-XFER-3): RDMA when the `rdma` feature is built
//! and a device opens, TCP otherwise — the fallback is always logged with its reason.

use tandem_interfaces::config::TransportChoice;

use super::TransportKind;

/// What the worker will use, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The chosen transport.
    pub kind: TransportKind,
    /// Why (for the log line and the status).
    pub reason: String,
}

/// The transport the operator asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preference {
    /// RDMA if possible, else TCP.
    Auto,
    /// TCP only.
    Tcp,
}

/// Picks the transport. With [`Preference::Auto`], probes RDMA devices (feature `rdma`).
pub fn select(preference: Preference) -> Selection {
    let selection = match preference {
        Preference::Tcp => Selection {
            kind: TransportKind::Tcp,
            reason: "TCP requested".into(),
        },
        Preference::Auto => probe_rdma(),
    };
    if selection.kind == TransportKind::Tcp {
        tracing::info!(reason = %selection.reason, "KV transport: TCP");
    } else {
        tracing::info!(reason = %selection.reason, "KV transport: RDMA");
    }
    selection
}

/// Whether decode's receiver fence proves that no write of a fenced room can land (the
/// `fence_is_proof` of the decode node's release gate, DESIGN contract 3).
///
/// True only for TCP: its receiver checks every write's room generation and the fence waits out
/// writes being applied (R-XFER-6). RDMA WRITE and the simulated one-sided transport have no
/// receiver-side check — a posted write lands whatever the room's state — so their proof must come
/// from prefill's acks or from destroying the peer's queue pairs (R-XFER-4).
pub fn receiver_fence_is_proof(kind: TransportKind) -> bool {
    match kind {
        TransportKind::Tcp => true,
        TransportKind::Rdma | TransportKind::Simulated => false,
    }
}

/// The KV transport a serving role uses for the `transport` of its `WorkerConfig` (DESIGN §3;
/// the CRD's `transport` field), and whether it may serve at all.
///
/// The rule, per value:
/// - `Tcp`: TCP.
/// - `Auto`: RDMA devices are probed (feature `rdma`); the roles send KV over TCP whatever the probe
///   finds, because the RDMA transport is not on the serving path in this release (see
///   [`super::rdma`], "Not wired yet") — the reason says so, and it is logged.
/// - `Rdma`: never served over TCP. No usable device → a refusal naming the probe's error; a device
///   present → a refusal too, for the same not-wired reason. A refused worker stays not Ready with
///   the reason (the CRD promises "RDMA without a device fails readiness").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingTransport {
    /// What the config asked for.
    pub requested: TransportChoice,
    /// What KV moves over; `None` when refused.
    pub in_use: Option<TransportKind>,
    /// Why, in one line (logged, in `/report.transport`).
    pub reason: String,
}

impl ServingTransport {
    /// The refusal, when the worker may not serve with this transport.
    pub fn refusal(&self) -> Option<&str> {
        self.in_use.is_none().then_some(self.reason.as_str())
    }

    /// `/report.transport`: `{requested, in_use, reason}` (`in_use` is `"none"` when refused).
    pub fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "requested": format!("{:?}", self.requested).to_lowercase(),
            "in_use": self.in_use.map_or("none", TransportKind::as_str),
            "reason": self.reason,
        })
    }
}

/// [`ServingTransport`] for `choice`, probing this machine's RDMA devices.
pub fn for_serving(choice: TransportChoice) -> ServingTransport {
    let t = for_serving_with(choice, rdma_device);
    match t.in_use {
        Some(kind) => {
            tracing::info!(requested = ?choice, in_use = kind.as_str(), reason = %t.reason, "KV transport")
        }
        None => {
            tracing::error!(requested = ?choice, reason = %t.reason, "KV transport refused: not ready")
        }
    }
    t
}

const RDMA_NOT_WIRED: &str = "this release's serving path sends KV over TCP only (the RDMA transport is not wired into the roles)";

/// [`for_serving`] with the device probe injected (`Ok(device name)` or `Err(why not)`).
pub fn for_serving_with(
    choice: TransportChoice,
    probe: impl FnOnce() -> Result<String, String>,
) -> ServingTransport {
    let (in_use, reason) = match choice {
        TransportChoice::Tcp => (Some(TransportKind::Tcp), "TCP requested".to_owned()),
        TransportChoice::Auto => match probe() {
            Ok(device) => (
                Some(TransportKind::Tcp),
                format!("Auto: RDMA device {device} present, but {RDMA_NOT_WIRED}; TCP"),
            ),
            Err(why) => (
                Some(TransportKind::Tcp),
                format!("Auto: RDMA unavailable ({why}); TCP"),
            ),
        },
        TransportChoice::Rdma => match probe() {
            Ok(device) => (
                None,
                format!("transport RDMA requested: device {device} present, but {RDMA_NOT_WIRED}"),
            ),
            Err(why) => (
                None,
                format!("transport RDMA requested, but no usable RDMA device: {why}"),
            ),
        },
    };
    ServingTransport {
        requested: choice,
        in_use,
        reason,
    }
}

#[cfg(feature = "rdma")]
fn rdma_device() -> Result<String, String> {
    use super::rdma::transport::{RdmaConfig, probe};
    probe(&RdmaConfig::default())
        .map(|d| d.to_string())
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "rdma"))]
fn rdma_device() -> Result<String, String> {
    Err("built without the `rdma` feature".into())
}

#[cfg(feature = "rdma")]
fn probe_rdma() -> Selection {
    use super::rdma::transport::{RdmaConfig, probe};
    match probe(&RdmaConfig::default()) {
        Ok(device) => Selection {
            kind: TransportKind::Rdma,
            reason: format!("RDMA device {device} opened"),
        },
        Err(e) => {
            tracing::warn!(error = %e, "no usable RDMA device; falling back to TCP");
            Selection {
                kind: TransportKind::Tcp,
                reason: format!("RDMA unavailable ({e}); TCP fallback"),
            }
        }
    }
}

#[cfg(not(feature = "rdma"))]
fn probe_rdma() -> Selection {
    Selection {
        kind: TransportKind::Tcp,
        reason: "built without the `rdma` feature; TCP fallback".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_falls_back_to_tcp_with_a_reason() {
        // This machine has no RDMA device (and default builds have no `rdma` feature).
        let s = select(Preference::Auto);
        assert_eq!(s.kind, TransportKind::Tcp);
        assert!(s.reason.contains("TCP fallback"), "{}", s.reason);
        assert_eq!(select(Preference::Tcp).kind, TransportKind::Tcp);
    }

    #[test]
    fn serving_transport_follows_the_config_and_refuses_rdma_it_cannot_serve() {
        let dev = || Ok::<_, String>("mlx5_0".to_owned());
        let none = || Err::<String, _>("no RDMA device present".to_owned());
        let tcp = for_serving_with(TransportChoice::Tcp, || panic!("TCP must not probe"));
        assert_eq!(tcp.in_use, Some(TransportKind::Tcp));
        assert_eq!(tcp.refusal(), None);
        for probe in [dev as fn() -> Result<String, String>, none] {
            let auto = for_serving_with(TransportChoice::Auto, probe);
            assert_eq!(auto.in_use, Some(TransportKind::Tcp), "{}", auto.reason);
            assert!(auto.reason.starts_with("Auto: "), "{}", auto.reason);
            let rdma = for_serving_with(TransportChoice::Rdma, probe);
            assert_eq!(rdma.in_use, None);
            assert!(
                rdma.refusal().is_some_and(|r| r.contains("RDMA")),
                "{rdma:?}"
            );
            assert_eq!(rdma.report()["in_use"], "none");
        }
        let no_dev = for_serving_with(TransportChoice::Rdma, none);
        assert!(
            no_dev
                .reason
                .contains("no usable RDMA device: no RDMA device present")
        );
        assert_eq!(
            for_serving(TransportChoice::Rdma).in_use,
            None,
            "this machine has no RDMA device: RDMA must be refused"
        );
    }

    #[test]
    fn only_the_tcp_receiver_fence_is_transport_proof() {
        assert!(receiver_fence_is_proof(TransportKind::Tcp));
        assert!(!receiver_fence_is_proof(TransportKind::Rdma));
        assert!(!receiver_fence_is_proof(TransportKind::Simulated));
    }
}
