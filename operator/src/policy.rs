//! A pool's KV host-memory policy, resolved against the CacheTier it names (DESIGN §2, contract 1).
//!
//! The tier decides the allocator domain, the client mode, the registration-failure policy and the
//! page size for **every** host pool of every client: target, draft and indexer alike. There is no
//! per-pool allocator in the API, so the seed-000 outage (a draft pool on plain mmap beside a
//! shared-memory target pool, in Standalone mode) cannot be expressed. What can still go wrong is a
//! pool whose model differs from the tier's: that is a [`PolicyConflict`], and nothing rolls out.

use tandem_crds::conditions::Reason;
use tandem_crds::{
    AllocatorDomain as TierAllocator, CacheTierSpec, ClientMode as TierClientMode, ModelSpec,
    RegistrationFailurePolicy, WritePolicy as TierWritePolicy,
};
use tandem_interfaces::config::WritePolicy;
use tandem_interfaces::memory::AllocatorDomain;
use tandem_interfaces::memory::ClientMode;
use tandem_interfaces::memory::FailurePolicy;

/// The resolved policy a pool's workers get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPolicy {
    /// Allocator domain of every host pool.
    pub allocator: AllocatorDomain,
    /// Store-client mode and the tier's L3 settings; `None` without a tier.
    pub l3: Option<L3Policy>,
}

/// L3 settings inherited from the tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L3Policy {
    /// Tier name.
    pub tier: String,
    /// Where the store client runs.
    pub client_mode: ClientMode,
    /// What a failed registration does.
    pub registration_failure: FailurePolicy,
    /// L2→L3 writes.
    pub write_policy: WritePolicy,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Store replicas.
    pub replicas: u32,
}

/// Why a pool cannot use the tier it names. Reported as the `PolicyConflict` condition with
/// [`PolicyConflict::reason`] and the display text as message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyConflict {
    /// The tier does not exist (yet). Not a conflict in the spec, but nothing may roll out.
    #[error("CacheTier {0:?} does not exist in this namespace")]
    TierNotFound(String),
    /// The tier stores another model; its pages would be garbage for this pool.
    #[error(
        "model {pool_model:?} differs from CacheTier {tier:?}'s model {tier_model:?} ({detail}); a tier serves exactly one model identity"
    )]
    ModelMismatch {
        /// Tier name.
        tier: String,
        /// The pool's model name.
        pool_model: String,
        /// The tier's model name.
        tier_model: String,
        /// The first differing field.
        detail: String,
    },
    /// A Standalone tier with a non-SharedMemory allocator (possible only if admission was
    /// bypassed, e.g. CRD validation disabled).
    #[error(
        "CacheTier {tier:?} is Standalone with allocator {allocator:?}; Standalone requires SharedMemory (seed 000)"
    )]
    StandaloneNeedsSharedMemory {
        /// Tier name.
        tier: String,
        /// The allocator found.
        allocator: String,
    },
    /// The tier is being deleted; a pool may not start using it.
    #[error("CacheTier {0:?} is being deleted")]
    TierTerminating(String),
}

impl PolicyConflict {
    /// The condition reason (one per variant).
    pub fn reason(&self) -> Reason {
        match self {
            PolicyConflict::TierNotFound(_) => Reason::CacheTierNotFound,
            PolicyConflict::ModelMismatch { .. } => Reason::ModelMismatch,
            PolicyConflict::StandaloneNeedsSharedMemory { .. } => Reason::AllocatorMismatch,
            PolicyConflict::TierTerminating(_) => Reason::CacheTierTerminating,
        }
    }
}

/// The tier a pool names, as the controller found it.
#[derive(Debug, Clone, Copy)]
pub enum TierLookup<'a> {
    /// The pool names no tier.
    None,
    /// The pool names `name`, which does not exist.
    Missing(&'a str),
    /// Found; `terminating` when it has a deletion timestamp.
    Found {
        /// Tier name.
        name: &'a str,
        /// Tier spec.
        spec: &'a CacheTierSpec,
        /// Whether the tier is being deleted.
        terminating: bool,
    },
}

/// Resolves the policy of a pool with model `model` and the tier it names.
///
/// Without a tier, host pools use private page-aligned mmap and there is no L3.
///
/// # Errors
/// [`PolicyConflict`] when the tier is missing, terminating, for another model, or inconsistent.
pub fn resolve(model: &ModelSpec, tier: TierLookup<'_>) -> Result<MemoryPolicy, PolicyConflict> {
    let (name, spec, terminating) = match tier {
        TierLookup::None => {
            return Ok(MemoryPolicy {
                allocator: AllocatorDomain::Mmap,
                l3: None,
            });
        }
        TierLookup::Missing(name) => return Err(PolicyConflict::TierNotFound(name.into())),
        TierLookup::Found {
            name,
            spec,
            terminating,
        } => (name, spec, terminating),
    };
    if terminating {
        return Err(PolicyConflict::TierTerminating(name.into()));
    }
    if let Some(detail) = model_difference(model, &spec.model) {
        return Err(PolicyConflict::ModelMismatch {
            tier: name.into(),
            pool_model: model.name.clone(),
            tier_model: spec.model.name.clone(),
            detail,
        });
    }
    let allocator = match spec.allocator {
        TierAllocator::SharedMemory => AllocatorDomain::SharedMemory,
        TierAllocator::Mmap => AllocatorDomain::Mmap,
        TierAllocator::Pinned => AllocatorDomain::Pinned,
    };
    let client_mode = match spec.client_mode {
        TierClientMode::Embedded => ClientMode::Embedded,
        TierClientMode::Standalone => ClientMode::Standalone,
    };
    if client_mode == ClientMode::Standalone && allocator != AllocatorDomain::SharedMemory {
        return Err(PolicyConflict::StandaloneNeedsSharedMemory {
            tier: name.into(),
            allocator: format!("{:?}", spec.allocator),
        });
    }
    Ok(MemoryPolicy {
        allocator,
        l3: Some(L3Policy {
            tier: name.into(),
            client_mode,
            registration_failure: match spec.registration_failure_policy {
                RegistrationFailurePolicy::FailClosed => FailurePolicy::FailClosed,
                RegistrationFailurePolicy::FallbackToL2 => FailurePolicy::FallbackToL2,
            },
            write_policy: match spec.write_policy {
                TierWritePolicy::WriteThrough => WritePolicy::WriteThrough,
                TierWritePolicy::WriteBack => WritePolicy::WriteBack,
            },
            page_tokens: u32::try_from(spec.page_tokens).unwrap_or(0),
            replicas: u32::try_from(spec.replicas).unwrap_or(0),
        }),
    })
}

/// The first field in which two model identities differ, or `None` if they are equal.
pub fn model_difference(a: &ModelSpec, b: &ModelSpec) -> Option<String> {
    macro_rules! cmp {
        ($($f:ident),*) => {$(
            if a.$f != b.$f {
                return Some(format!("{}: {:?} vs {:?}", stringify!($f), a.$f, b.$f));
            }
        )*};
    }
    cmp!(
        name,
        layers,
        attention,
        kv_heads,
        head_dim,
        kv_lora_rank,
        rope_dim,
        dtype,
        indexer
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(yaml: &str) -> CacheTierSpec {
        serde_saphyr::from_str(yaml).expect("tier spec")
    }

    const MODEL: &str = "{name: llama-3-70b, layers: 80, attention: GQA, kvHeads: 8, headDim: 128}";

    #[test]
    fn standalone_tier_gives_every_pool_shared_memory() {
        let t = tier(&format!(
            "{{clientMode: Standalone, allocator: SharedMemory, model: {MODEL}, memory: 1Gi}}"
        ));
        let model: ModelSpec = serde_saphyr::from_str(MODEL).unwrap();
        let p = resolve(
            &model,
            TierLookup::Found {
                name: "t",
                spec: &t,
                terminating: false,
            },
        )
        .unwrap();
        assert_eq!(p.allocator, AllocatorDomain::SharedMemory);
        let l3 = p.l3.unwrap();
        assert_eq!(l3.client_mode, ClientMode::Standalone);
        assert_eq!(l3.registration_failure, FailurePolicy::FailClosed);
        assert_eq!(l3.page_tokens, 512);
    }

    #[test]
    fn model_mismatch_is_a_conflict_naming_the_field() {
        let t = tier(&format!("{{model: {MODEL}, memory: 1Gi}}"));
        let other: ModelSpec = serde_saphyr::from_str(
            "{name: llama-3-70b, layers: 80, attention: GQA, kvHeads: 8, headDim: 64}",
        )
        .unwrap();
        let err = resolve(
            &other,
            TierLookup::Found {
                name: "t",
                spec: &t,
                terminating: false,
            },
        )
        .unwrap_err();
        assert_eq!(err.reason().as_str(), "ModelMismatch");
        assert!(
            err.to_string().contains("head_dim: Some(64) vs Some(128)"),
            "{err}"
        );
    }

    #[test]
    fn bypassed_admission_still_cannot_mix_standalone_and_mmap() {
        // The CEL rule refuses this at admission; the operator refuses it again (defence in depth).
        let t = tier(&format!(
            "{{clientMode: Standalone, allocator: Mmap, model: {MODEL}, memory: 1Gi}}"
        ));
        let model: ModelSpec = serde_saphyr::from_str(MODEL).unwrap();
        let err = resolve(
            &model,
            TierLookup::Found {
                name: "t",
                spec: &t,
                terminating: false,
            },
        )
        .unwrap_err();
        assert_eq!(err.reason().as_str(), "AllocatorMismatch");
    }

    #[test]
    fn missing_and_terminating_tiers_block_rollout() {
        let model: ModelSpec = serde_saphyr::from_str(MODEL).unwrap();
        assert_eq!(
            resolve(&model, TierLookup::Missing("x"))
                .unwrap_err()
                .reason()
                .as_str(),
            "CacheTierNotFound"
        );
        let t = tier(&format!("{{model: {MODEL}, memory: 1Gi}}"));
        let err = resolve(
            &model,
            TierLookup::Found {
                name: "t",
                spec: &t,
                terminating: true,
            },
        )
        .unwrap_err();
        assert_eq!(err.reason().as_str(), "CacheTierTerminating");
        let none = resolve(&model, TierLookup::None).unwrap();
        assert_eq!((none.allocator, none.l3), (AllocatorDomain::Mmap, None));
    }
}
