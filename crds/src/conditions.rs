//! The status condition vocabulary shared by the operator and its users.
//!
//! Every kind reports `Ready`, `Progressing` and `Degraded`; pools add `PolicyConflict` and
//! `InsufficientCapacity`; a CacheTier adds `CacheWarm`. Conditions are a list map keyed by
//! `type` so server-side apply merges them one by one.

/// The resource serves: every desired group (or store replica) is ready.
pub const READY: &str = "Ready";
/// A change is being rolled out (scale, rolling restart, first start).
pub const PROGRESSING: &str = "Progressing";
/// Serving continues with reduced function (e.g. fallback to L2 after an L3 registration failure).
pub const DEGRADED: &str = "Degraded";
/// The pool's model or memory policy contradicts the CacheTier it names; nothing is rolled out.
pub const POLICY_CONFLICT: &str = "PolicyConflict";
/// A scale-up stayed unschedulable past its deadline or would exceed the GPU budget.
pub const INSUFFICIENT_CAPACITY: &str = "InsufficientCapacity";
/// The CacheTier finished loading its persisted objects back after a (re)start.
pub const CACHE_WARM: &str = "CacheWarm";

/// The condition types a kind may carry, in the order status lists them.
pub const POOL_CONDITIONS: [&str; 5] = [
    READY,
    PROGRESSING,
    DEGRADED,
    POLICY_CONFLICT,
    INSUFFICIENT_CAPACITY,
];
/// The condition types of a CacheTier.
pub const TIER_CONDITIONS: [&str; 4] = [READY, PROGRESSING, DEGRADED, CACHE_WARM];
