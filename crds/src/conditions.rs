//! The status condition vocabulary shared by the operator and its users.
//!
//! Every kind reports `Ready`, `Progressing` and `Degraded`; pools add `PolicyConflict` and
//! `InsufficientCapacity`; a PrefillPool adds `ReplicasIgnored`; a CacheTier adds `CacheWarm`.
//! Conditions are a list map keyed by `type` so server-side apply merges them one by one.
//!
//! The types, statuses and reasons are enums ([`ConditionType`], [`ConditionStatus`],
//! [`Reason`]); the wire form is their [`as_str`](ConditionType::as_str) text, and the string
//! constants below are that text for readers that match on it (kubectl, e2e).

/// A condition type (`status.conditions[].type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConditionType {
    /// The resource serves: every desired group (or store replica) is ready.
    Ready,
    /// A change is being rolled out (scale, rolling restart, first start).
    Progressing,
    /// Serving continues with reduced function, or the resource cannot roll out or is being torn
    /// down.
    Degraded,
    /// The pool's model or memory policy contradicts the CacheTier it names; nothing is rolled out.
    PolicyConflict,
    /// A scale-up stayed unschedulable past its deadline or would exceed the GPU budget.
    InsufficientCapacity,
    /// PrefillPool only: its group count is not `spec.replicas` (a DecodePool's ratio owns it, or
    /// it keeps the count that ratio last set), so `spec.replicas` and any autoscaler writing
    /// `/scale` are ignored.
    ReplicasIgnored,
    /// The CacheTier finished loading its persisted objects back after a (re)start.
    CacheWarm,
}

impl ConditionType {
    /// The wire text.
    pub const fn as_str(self) -> &'static str {
        match self {
            ConditionType::Ready => "Ready",
            ConditionType::Progressing => "Progressing",
            ConditionType::Degraded => "Degraded",
            ConditionType::PolicyConflict => "PolicyConflict",
            ConditionType::InsufficientCapacity => "InsufficientCapacity",
            ConditionType::ReplicasIgnored => "ReplicasIgnored",
            ConditionType::CacheWarm => "CacheWarm",
        }
    }
}

impl std::fmt::Display for ConditionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A condition's status (`metav1.ConditionStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConditionStatus {
    /// `True`.
    True,
    /// `False`.
    False,
    /// `Unknown` (also what an unrecognised text reads as).
    Unknown,
}

impl ConditionStatus {
    /// The wire text.
    pub const fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }

    /// Reads the wire text; anything but `True` and `False` is `Unknown`.
    pub fn parse(text: &str) -> Self {
        match text {
            "True" => ConditionStatus::True,
            "False" => ConditionStatus::False,
            _ => ConditionStatus::Unknown,
        }
    }

    /// `True` for `true`, `False` for `false`.
    pub const fn from_bool(b: bool) -> Self {
        if b {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }

    /// Whether this is `True`.
    pub const fn is_true(self) -> bool {
        matches!(self, ConditionStatus::True)
    }
}

macro_rules! reasons {
    ($( $(#[$doc:meta])* $name:ident ),* $(,)?) => {
        /// A condition reason (CamelCase, stable): every reason the operator writes.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $( $(#[$doc])* $name, )*
        }

        impl Reason {
            /// Every reason, in declaration order.
            pub const ALL: &'static [Reason] = &[$(Reason::$name),*];

            /// The wire text (the variant's name).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( Reason::$name => stringify!($name), )*
                }
            }

            /// Reads the wire text; `None` for a reason this version does not write.
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $( stringify!($name) => Some(Reason::$name), )*
                    _ => None,
                }
            }
        }
    };
}

reasons! {
    // Ready.
    /// Ready: every desired group of the pool (and, for a DecodePool, of its PrefillPool) is Ready.
    AllGroupsReady,
    /// Ready=False: some desired group is not Ready.
    GroupsNotReady,
    /// CacheTier Ready: every store replica is Ready.
    AllReplicasReady,
    /// CacheTier Ready=False, CacheWarm=False: some store replica is not Ready.
    ReplicasNotReady,
    // Progressing.
    /// Progressing: a group is being restarted at a new revision.
    RollingRestart,
    /// Progressing: groups are created, removed or coming up (either pool of a pair).
    Scaling,
    /// Progressing (and InsufficientCapacity=False): a scale-up is applied and its pods are not
    /// all scheduled yet.
    ScaleUpPending,
    /// Progressing=False: the pools hold the admitted counts, below the target, which was refused
    /// for capacity.
    CapacityLimited,
    /// CacheTier Progressing: store replicas are being created or updated.
    RollingOut,
    /// Progressing=False: nothing to roll out.
    Settled,
    // Degraded and the blocking reasons.
    /// Degraded=False, PolicyConflict=False on a blocked resource: nothing observed.
    AsExpected,
    /// CacheTier Degraded: a store replica's volume is full — puts are refused and counted, reads
    /// keep serving (issue 18 item 5; from the replica's `/report` `degraded` entry `VolumeFull`).
    StoreVolumeFull,
    /// The config cannot be rendered.
    RenderFailed,
    /// A DecodePool's PrefillPool does not exist.
    PrefillPoolNotFound,
    /// A DecodePool's PrefillPool cannot roll out.
    PrefillPoolBlocked,
    /// A PrefillPool's DecodePool cannot roll out.
    DecodePoolBlocked,
    /// The resource is being deleted; its teardown runs.
    Terminating,
    /// Degraded: a group kept failing past `spec.maxGroupRestarts` at this revision; its
    /// StatefulSet is held at 0 pods (GPUs released) until the revision changes
    /// (kubernetes-sigs/lws KEP-820).
    ReplicaRestartBudgetExceeded,
    /// Degraded: a worker of the pool that is not Ready reports a degradation in its `/report`
    /// (e.g. its engine pools were refused before anything was registered, seed 000); the message
    /// names the pod and the worker's component, code and message.
    WorkerDegraded,
    /// Degraded: a pod of a pool with `spec.placement` runs on a node without the
    /// `placement.topologyKey` label (possible under `Preferred`), so the packing and pairing
    /// cannot hold for it; the message names the pod and the node (issue 17).
    NodeWithoutTopologyLabel,
    // PolicyConflict.
    /// PolicyConflict=False: the tier's policy resolved (the message says what).
    PolicyResolved,
    /// The named CacheTier does not exist.
    CacheTierNotFound,
    /// The named CacheTier is being deleted.
    CacheTierTerminating,
    /// The pool's model differs from its CacheTier's.
    ModelMismatch,
    /// A Standalone tier without SharedMemory.
    AllocatorMismatch,
    /// A DecodePool's model differs from its PrefillPool's.
    PrefillModelMismatch,
    /// A DecodePool's engine moves KV another way than its PrefillPool's (e.g. a vLLM decode
    /// through Tandem's connector beside a Simulated or SGLang prefill).
    PrefillEngineMismatch,
    /// Two live DecodePools pair with one PrefillPool.
    MultipleDecodePools,
    // InsufficientCapacity.
    /// InsufficientCapacity=False: the applied counts fit.
    WithinCapacity,
    /// The target needs more GPUs than `budget.gpus`.
    OverBudget,
    /// A scale-up (or a first start) stayed unschedulable past `unschedulableDeadlineSeconds`.
    Unschedulable,
    /// `budget.gpus` cannot hold one group of each pool.
    BudgetTooSmall,
    /// The target was refused for capacity before and has not changed.
    Refused,
    // ReplicasIgnored.
    /// ReplicasIgnored: a DecodePool's ratio owns the group count.
    DecodePoolRatio,
    /// ReplicasIgnored: the DecodePool that owned the count is gone; the pool keeps that count and
    /// revision until its own spec changes.
    ReleasedByDecodePool,
    /// ReplicasIgnored=False: the group count is `spec.replicas`.
    SpecReplicas,
    // CacheWarm.
    /// CacheWarm: every replica's `/report` says loadback finished.
    AllReplicasWarm,
    /// CacheWarm: every replica is Ready and some `/report` was unreachable.
    ReadyApproximation,
    /// CacheWarm=False: some replica is still loading objects back.
    LoadingBack,
    /// CacheWarm=False: no replica reported yet.
    NotStarted,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The resource serves: every desired group (or store replica) is ready.
pub const READY: &str = ConditionType::Ready.as_str();
/// A change is being rolled out (scale, rolling restart, first start).
pub const PROGRESSING: &str = ConditionType::Progressing.as_str();
/// Serving continues with reduced function (e.g. fallback to L2 after an L3 registration failure).
pub const DEGRADED: &str = ConditionType::Degraded.as_str();
/// The pool's model or memory policy contradicts the CacheTier it names; nothing is rolled out.
pub const POLICY_CONFLICT: &str = ConditionType::PolicyConflict.as_str();
/// A scale-up stayed unschedulable past its deadline or would exceed the GPU budget.
pub const INSUFFICIENT_CAPACITY: &str = ConditionType::InsufficientCapacity.as_str();
/// A PrefillPool's `spec.replicas` (and `/scale`) is ignored: see [`ConditionType::ReplicasIgnored`].
pub const REPLICAS_IGNORED: &str = ConditionType::ReplicasIgnored.as_str();
/// The CacheTier finished loading its persisted objects back after a (re)start.
pub const CACHE_WARM: &str = ConditionType::CacheWarm.as_str();

/// The condition types of a DecodePool, in the order status lists them.
pub const POOL_CONDITIONS: [ConditionType; 5] = [
    ConditionType::Ready,
    ConditionType::Progressing,
    ConditionType::Degraded,
    ConditionType::PolicyConflict,
    ConditionType::InsufficientCapacity,
];
/// The condition types of a PrefillPool: the pool's, then `ReplicasIgnored`.
pub const PREFILL_CONDITIONS: [ConditionType; 6] = [
    ConditionType::Ready,
    ConditionType::Progressing,
    ConditionType::Degraded,
    ConditionType::PolicyConflict,
    ConditionType::InsufficientCapacity,
    ConditionType::ReplicasIgnored,
];
/// The condition types of a CacheTier.
pub const TIER_CONDITIONS: [ConditionType; 4] = [
    ConditionType::Ready,
    ConditionType::Progressing,
    ConditionType::Degraded,
    ConditionType::CacheWarm,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_reads_back_from_its_text() {
        for r in Reason::ALL {
            assert_eq!(Reason::parse(r.as_str()), Some(*r));
        }
        assert_eq!(Reason::parse("NoSuchReason"), None);
        for s in [
            ConditionStatus::True,
            ConditionStatus::False,
            ConditionStatus::Unknown,
        ] {
            assert_eq!(ConditionStatus::parse(s.as_str()), s);
        }
        assert_eq!(ConditionStatus::parse("true"), ConditionStatus::Unknown);
    }
}
