//! Why a resource is not rolled out, as a value: the result of the pure validate stage.
//!
//! Each [`Refusal`] variant has one condition type and one static [`Reason`]; its message (the
//! `Display` text) names the objects involved. A refused resource creates and updates no child;
//! its status says Ready and Progressing False with the reason, and the refusal's condition True
//! ([`super::blocked`]).

use crate::policy::PolicyConflict;
use crate::render::config::RenderError;
use crate::status::{ConditionType, Reason};

use super::revision::Blocked;

/// Why a resource cannot roll out.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    /// Several live DecodePools pair with this PrefillPool (all of them, by name). Admission cannot
    /// see across objects; two ratio transactions on one pool's groups would fight.
    #[error(
        "DecodePools {} all pair with this PrefillPool; one prefill pool serves one DecodePool \
         (its group count follows that pool's ratio)",
        pools.join(", ")
    )]
    MultipleDecodePools {
        /// The live DecodePools pairing with the pool.
        pools: Vec<String>,
    },
    /// This DecodePool's PrefillPool is also paired with other live DecodePools (the PrefillPool
    /// refuses them all, so a scale-up here would wait forever).
    #[error(
        "PrefillPool {prefill:?} is also paired with DecodePool {}; one prefill pool serves one \
         DecodePool",
        others.join(", ")
    )]
    SharedPrefillPool {
        /// The PrefillPool.
        prefill: String,
        /// The other live DecodePools pairing with it.
        others: Vec<String>,
    },
    /// The pool's CacheTier contradicts it (or is missing or terminating).
    #[error(transparent)]
    Policy(#[from] PolicyConflict),
    /// The config cannot be rendered.
    #[error(transparent)]
    Render(#[from] RenderError),
    /// The DecodePool's PrefillPool does not exist.
    #[error("PrefillPool {name:?} does not exist in {namespace}; nothing rolls out until it does")]
    PrefillPoolNotFound {
        /// The PrefillPool named by `spec.prefill.poolRef`.
        name: String,
        /// The namespace looked in.
        namespace: String,
    },
    /// The DecodePool's model differs from its PrefillPool's.
    #[error(
        "model differs from PrefillPool {prefill:?} ({detail}); KV pages cannot move between different geometries"
    )]
    PrefillModelMismatch {
        /// The PrefillPool.
        prefill: String,
        /// The first differing field.
        detail: String,
    },
    /// The DecodePool's engine moves KV another way than its PrefillPool's: no KV could move
    /// (e.g. a vLLM decode's connector waiting for rooms a Simulated or SGLang prefill never
    /// fills for it).
    #[error(
        "engines differ from PrefillPool {prefill:?}: this pool moves KV through {ours}, the PrefillPool through {theirs}; pair pools whose engines move KV the same way (both Simulated, or both vLLM without a CacheTier)"
    )]
    PrefillEngineMismatch {
        /// The PrefillPool.
        prefill: String,
        /// This DecodePool's path.
        ours: crate::render::engine::KvPath,
        /// The PrefillPool's path.
        theirs: crate::render::engine::KvPath,
    },
    /// The DecodePool's PrefillPool cannot roll out (its own conflict or render failure).
    #[error("PrefillPool {name:?} cannot roll out: {cause}")]
    PrefillPoolBlocked {
        /// The PrefillPool.
        name: String,
        /// Why.
        cause: Blocked,
    },
    /// The PrefillPool's DecodePool cannot roll out (the pair revision needs both).
    #[error("paired DecodePool {name:?} cannot roll out: {cause}")]
    DecodePoolBlocked {
        /// The DecodePool.
        name: String,
        /// Why.
        cause: Blocked,
    },
}

impl From<Blocked> for Refusal {
    fn from(b: Blocked) -> Self {
        match b {
            Blocked::Conflict(c) => Refusal::Policy(c),
            Blocked::Render(e) => Refusal::Render(e),
        }
    }
}

impl Refusal {
    /// The condition set True: `PolicyConflict` for a contradiction in the specs, `Degraded` for
    /// what blocks the rollout otherwise.
    pub fn condition(&self) -> ConditionType {
        match self {
            Refusal::MultipleDecodePools { .. }
            | Refusal::SharedPrefillPool { .. }
            | Refusal::Policy(_)
            | Refusal::PrefillModelMismatch { .. }
            | Refusal::PrefillEngineMismatch { .. } => ConditionType::PolicyConflict,
            Refusal::Render(_)
            | Refusal::PrefillPoolNotFound { .. }
            | Refusal::PrefillPoolBlocked { .. }
            | Refusal::DecodePoolBlocked { .. } => ConditionType::Degraded,
        }
    }

    /// The condition reason, also the reason of the one-time Warning event.
    pub fn reason(&self) -> Reason {
        match self {
            Refusal::MultipleDecodePools { .. } | Refusal::SharedPrefillPool { .. } => {
                Reason::MultipleDecodePools
            }
            Refusal::Policy(c) => c.reason(),
            Refusal::Render(_) => Reason::RenderFailed,
            Refusal::PrefillPoolNotFound { .. } => Reason::PrefillPoolNotFound,
            Refusal::PrefillModelMismatch { .. } => Reason::PrefillModelMismatch,
            Refusal::PrefillEngineMismatch { .. } => Reason::PrefillEngineMismatch,
            Refusal::PrefillPoolBlocked { .. } => Reason::PrefillPoolBlocked,
            Refusal::DecodePoolBlocked { .. } => Reason::DecodePoolBlocked,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_names_its_condition_reason_and_objects() {
        let r = Refusal::MultipleDecodePools {
            pools: vec!["a".into(), "b".into()],
        };
        assert_eq!(
            (r.condition(), r.reason()),
            (ConditionType::PolicyConflict, Reason::MultipleDecodePools)
        );
        assert!(
            r.to_string().starts_with("DecodePools a, b all pair"),
            "{r}"
        );
        let r = Refusal::PrefillPoolNotFound {
            name: "p".into(),
            namespace: "ns".into(),
        };
        assert_eq!(
            (r.condition(), r.reason()),
            (ConditionType::Degraded, Reason::PrefillPoolNotFound)
        );
        assert_eq!(
            r.to_string(),
            "PrefillPool \"p\" does not exist in ns; nothing rolls out until it does"
        );
        let r = Refusal::from(Blocked::Conflict(PolicyConflict::TierNotFound("t".into())));
        assert_eq!(r.reason(), Reason::CacheTierNotFound);
    }
}
