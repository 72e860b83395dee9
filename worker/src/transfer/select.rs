//! Transport selection at start-up (dataplane.md R-XFER-3): RDMA when the `rdma` feature is built
//! and a device opens, TCP otherwise — the fallback is always logged with its reason.

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
    fn only_the_tcp_receiver_fence_is_transport_proof() {
        assert!(receiver_fence_is_proof(TransportKind::Tcp));
        assert!(!receiver_fence_is_proof(TransportKind::Rdma));
        assert!(!receiver_fence_is_proof(TransportKind::Simulated));
    }
}
