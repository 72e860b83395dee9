//! The blocked report every kind shares: a resource that is refused ([`Refusal`]) or being torn
//! down reports Ready and Progressing False with the reason, the blocking condition True, and
//! otherwise keeps what it knew; a refusal also raises one Warning event per transition and
//! touches no child.

use std::fmt::Debug;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tandem_crds::conditions::{POOL_CONDITIONS, PREFILL_CONDITIONS, TIER_CONDITIONS};
use tandem_crds::{CacheTier, CacheTierStatus, DecodePool, PoolStatus, PrefillPool};

use super::children::{self, warning};
use super::refusal::Refusal;
use super::{Context, Result, cache_tier, decode_pool, prefill_pool};
use crate::status::{self, ConditionType, Decided, Reason};
use crate::teardown::TeardownStep;

/// Why a resource does not roll out now: the condition set True, its reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Condition type (`Degraded` or `PolicyConflict`).
    pub condition: ConditionType,
    /// Condition reason, also the event reason.
    pub reason: Reason,
    /// Human-readable message.
    pub message: String,
}

impl From<&Refusal> for Block {
    fn from(r: &Refusal) -> Self {
        Self {
            condition: r.condition(),
            reason: r.reason(),
            message: r.to_string(),
        }
    }
}

impl Block {
    /// `Degraded=True, Terminating` with the message of the teardown step under way.
    pub fn terminating(step: &TeardownStep) -> Self {
        Self {
            condition: ConditionType::Degraded,
            reason: Reason::Terminating,
            message: super::teardown::message(step),
        }
    }

    /// The blocking condition as decided.
    pub fn decided(&self) -> Decided {
        Decided::yes(self.condition, self.reason, self.message.clone())
    }
}

/// The conditions of a blocked resource whose kind lists `kind_conditions` (in that order):
/// Ready and Progressing False with the block's reason and message; the block's condition True;
/// conditions that hold an observation of their own (`InsufficientCapacity`, `ReplicasIgnored`,
/// `CacheWarm`) keep their previous value (or their initial one); the others False `AsExpected`.
pub fn blocked_conditions(
    block: &Block,
    previous: &[Condition],
    kind_conditions: &[ConditionType],
) -> Vec<Decided> {
    kind_conditions
        .iter()
        .map(|&t| match t {
            ConditionType::Ready | ConditionType::Progressing => {
                Decided::no(t, block.reason, block.message.clone())
            }
            _ if t == block.condition => block.decided(),
            ConditionType::InsufficientCapacity
            | ConditionType::ReplicasIgnored
            | ConditionType::CacheWarm => status::read(previous, t).unwrap_or_else(|| initial(t)),
            _ => Decided::no(t, Reason::AsExpected, ""),
        })
        .collect()
}

/// The value a carried condition starts from.
fn initial(t: ConditionType) -> Decided {
    match t {
        ConditionType::CacheWarm => Decided::no(t, Reason::NotStarted, "no replica reported yet"),
        ConditionType::ReplicasIgnored => Decided::no(
            t,
            Reason::SpecReplicas,
            "nothing rolled out yet: the group count is decided once the pool is not blocked",
        ),
        _ => Decided::no(t, Reason::WithinCapacity, "no scale-up pending"),
    }
}

/// A kind whose status carries conditions and can be reported blocked.
pub trait Reported:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + Serialize
    + Debug
    + Send
    + Sync
    + 'static
{
    /// Kind name for metrics, logs and events.
    const KIND: &'static str;
    /// The condition types the kind reports, in order.
    const CONDITIONS: &'static [ConditionType];
    /// The status type.
    type Status: Serialize + PartialEq + Clone + Default + Debug + Send + Sync;
    /// The current status.
    fn status(&self) -> Option<&Self::Status>;
    /// The conditions of a status.
    fn conditions(status: &Self::Status) -> &[Condition];
    /// The `tandem_operator_resources` state of a status.
    fn state(status: &Self::Status) -> &'static str {
        state_of(Self::conditions(status))
    }
}

/// `impl Reported` for a kind whose `status` field holds a `$status` with `conditions`.
macro_rules! reported {
    ($kind:ty, $status:ty, $name:expr, $conditions:expr) => {
        impl Reported for $kind {
            const KIND: &'static str = $name;
            const CONDITIONS: &'static [ConditionType] = &$conditions;
            type Status = $status;

            fn status(&self) -> Option<&$status> {
                self.status.as_ref()
            }

            fn conditions(status: &$status) -> &[Condition] {
                &status.conditions
            }
        }
    };
}

reported!(
    CacheTier,
    CacheTierStatus,
    cache_tier::KIND,
    TIER_CONDITIONS
);
reported!(
    PrefillPool,
    PoolStatus,
    prefill_pool::KIND,
    PREFILL_CONDITIONS
);
reported!(DecodePool, PoolStatus, decode_pool::KIND, POOL_CONDITIONS);

/// The conditions of `obj`'s current status (empty without one).
pub fn previous_conditions<K: Reported>(obj: &K) -> &[Condition] {
    obj.status().map(K::conditions).unwrap_or_default()
}

/// Reports a refusal of `obj`: a Warning event the first time its condition turns True with this
/// reason, the resource state, and `status` (built by the kind from [`blocked_conditions`]);
/// touches no child and requeues at the resync period.
///
/// # Errors
/// The status patch's API error.
pub async fn report<K: Reported>(
    ctx: &Context,
    api: &Api<K>,
    obj: &K,
    block: &Block,
    status: K::Status,
) -> Result<Action> {
    if status::newly_true(previous_conditions(obj), &block.decided()) {
        ctx.event(
            &obj.object_ref(&()),
            warning(),
            block.reason.as_str(),
            "Block",
            format!("{}; no child is created or updated", block.message),
        )
        .await;
    }
    let key = format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any());
    ctx.metrics
        .set_state(K::KIND, &key, Some(K::state(&status)));
    children::patch_status_if_changed(ctx, K::KIND, api, &obj.name_any(), obj.status(), &status)
        .await?;
    Ok(Action::requeue(ctx.resync))
}

/// The resources-gauge state of a condition list: the first of `PolicyConflict`,
/// `InsufficientCapacity`, `Ready`, `Progressing` that is True, else `NotReady`.
pub fn state_of(conditions: &[Condition]) -> &'static str {
    [
        (ConditionType::PolicyConflict, "PolicyConflict"),
        (ConditionType::InsufficientCapacity, "InsufficientCapacity"),
        (ConditionType::Ready, "Ready"),
        (ConditionType::Progressing, "Progressing"),
    ]
    .into_iter()
    .find(|(t, _)| status::is_true(conditions, *t))
    .map_or("NotReady", |(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_sets_its_condition_and_keeps_observations() {
        let now = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        let prev = status::conditions(
            &[],
            &[Decided::yes(
                ConditionType::InsufficientCapacity,
                Reason::OverBudget,
                "needs 20",
            )],
            None,
            now,
        );
        let block = Block {
            condition: ConditionType::PolicyConflict,
            reason: Reason::ModelMismatch,
            message: "m".into(),
        };
        let d = blocked_conditions(&block, &prev, &POOL_CONDITIONS);
        let got: Vec<(ConditionType, bool, Reason)> =
            d.iter().map(|d| (d.type_, d.is_true(), d.reason)).collect();
        assert_eq!(
            got,
            [
                (ConditionType::Ready, false, Reason::ModelMismatch),
                (ConditionType::Progressing, false, Reason::ModelMismatch),
                (ConditionType::Degraded, false, Reason::AsExpected),
                (ConditionType::PolicyConflict, true, Reason::ModelMismatch),
                (
                    ConditionType::InsufficientCapacity,
                    true,
                    Reason::OverBudget
                ),
            ]
        );
        let tier = blocked_conditions(&block, &[], &TIER_CONDITIONS);
        assert_eq!(tier[3].reason, Reason::NotStarted, "CacheWarm starts cold");
    }
}
