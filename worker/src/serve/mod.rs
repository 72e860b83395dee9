//! Long-running serving processes of the worker roles (worker/interfaces/README.md §2, §3, §4):
//! what `tandem-worker <role> --config FILE` runs in a pod.
//!
//! Map:
//! - [`sim`]: the simulation knobs (`TANDEM_SIM_*`) and the KV layout they imply;
//! - [`counters`], [`health`]: the `/report` counters and the health port of every role;
//! - [`resolve`]: Service names through `$TANDEM_HOSTS_FILE` or DNS;
//! - [`peers`]: the decode worker's same-revision prefill peer set;
//! - [`prefix_cache`]: L2 index + L3 store around the prefill's simulated engine;
//! - [`prefill`], [`decode`]: the two serving roles; [`front_door`]: the OpenAI-compatible HTTP API;
//! - [`signals`]: SIGTERM/SIGINT as a future.

pub mod counters;
pub mod decode;
pub mod front_door;
pub mod health;
pub mod peers;
pub mod prefill;
pub mod prefix_cache;
pub mod resolve;
pub mod signals;
pub mod sim;

use std::net::{IpAddr, Ipv4Addr};

/// Errors starting a serving process.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A port could not be bound.
    #[error("binding the {0} port: {1}")]
    Bind(&'static str, std::io::Error),
    /// The config cannot be served by this role.
    #[error("config: {0}")]
    Config(String),
    /// The decode transfer side could not start.
    #[error(transparent)]
    Decode(#[from] crate::control::decode::DecodeError),
}

/// `$POD_IP` when set and valid, else `0.0.0.0` (worker/interfaces/README.md §2).
pub fn pod_ip() -> IpAddr {
    std::env::var("POD_IP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// The pod's ordinal: the numeric suffix of `$POD_NAME` (`pool-g0-3` → 3), else 0.
pub fn ordinal_from_env() -> u32 {
    std::env::var("POD_NAME")
        .ok()
        .as_deref()
        .and_then(ordinal_of)
        .unwrap_or(0)
}

/// The numeric suffix after the last `-` of a StatefulSet pod name.
pub fn ordinal_of(pod_name: &str) -> Option<u32> {
    pod_name.rsplit_once('-').and_then(|(_, n)| n.parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ordinal_is_the_pod_name_suffix() {
        assert_eq!(super::ordinal_of("p-g0-3"), Some(3));
        assert_eq!(super::ordinal_of("p-g0"), None);
        assert_eq!(super::ordinal_of("solo"), None);
    }
}
