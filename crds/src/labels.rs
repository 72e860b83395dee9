//! The `serving.tandem.dev/*` labels every object the operator creates carries (DESIGN §4), and the
//! values of the role label. Selectors of the operator, the e2e harness and `kubectl` use these.

/// `serving.tandem.dev/pool`: the owning pool or tier.
pub const POOL: &str = "serving.tandem.dev/pool";
/// `serving.tandem.dev/role`: [`ROLE_PREFILL`], [`ROLE_DECODE`] or [`ROLE_CACHE`].
pub const ROLE: &str = "serving.tandem.dev/role";
/// `serving.tandem.dev/group`: the replica group index (`0`, `1`, …).
pub const GROUP: &str = "serving.tandem.dev/group";
/// `serving.tandem.dev/revision`: hash of everything that requires a restart when it changes;
/// prefill and decode pair only within one revision (DESIGN §5).
pub const REVISION: &str = "serving.tandem.dev/revision";

/// Role label value of a PrefillPool's worker pods.
pub const ROLE_PREFILL: &str = "prefill";
/// Role label value of a DecodePool's worker pods.
pub const ROLE_DECODE: &str = "decode";
/// Role label value of a CacheTier's store replicas.
pub const ROLE_CACHE: &str = "cache";
