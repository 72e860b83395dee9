//! PrefillPool: the prefill groups, through the pool stages of [`super::pool`].
//!
//! Who owns the group count (DESIGN §2):
//! - a DecodePool pairs with the pool: its `status.scaling.applied.prefill` (the ratio
//!   transaction), and the revision is the pair's; `spec.replicas` and any autoscaler writing
//!   `/scale` are ignored — `status.replicasOwner` names the DecodePool and the condition
//!   `ReplicasIgnored=True, DecodePoolRatio` (with a one-time event) says so;
//! - the DecodePool that owned it is gone (deleted, or pointed elsewhere): the pool **keeps** the
//!   count and revision the ratio last set (`ReplicasIgnored=True, ReleasedByDecodePool`) until
//!   its own spec changes (`metadata.generation` moves past the `observedGeneration` of that
//!   status), so a release — typically a teardown — never scales or restarts it by itself;
//! - otherwise `spec.replicas` and the pool's own revision (`ReplicasIgnored=False`).

use std::sync::Arc;

use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use tandem_crds::{DecodePool, PrefillPool};

use super::cache::{Caches, FIRST_LIST_WAIT};
use super::children::{self, normal};
use super::pool::observe::{PoolChildren, Read, observe_pods};
use super::pool::status::{CapacityState, resolved_conditions};
use super::pool::{self, Desired, Note, PoolKind, SPEC_REPLICAS};
use super::refusal::Refusal;
use super::revision::{self, Resolved, TierRead};
use super::{Context, Result};
use crate::capacity;
use crate::labels::Role;
use crate::render::PoolView;
use crate::status::{self, ConditionType, Decided, Reason};

/// Kind name for metrics and logs.
pub const KIND: &str = "PrefillPool";

/// The DecodePools in `ns` that pair with PrefillPool `name`, by name (from the caches with
/// [`Read::Cached`] when they run, else listed).
///
/// # Errors
/// API failures; [`NotListed`](super::cache::NotListed) when the caches have not listed in time.
pub async fn pairing_decode_pools(
    ctx: &Context,
    ns: &str,
    name: &str,
    read: Read,
) -> Result<Vec<DecodePool>> {
    let all = match ctx.caches().filter(|_| read == Read::Cached) {
        Some(c) => {
            c.ready(FIRST_LIST_WAIT).await?;
            Caches::in_namespace(&c.decodes, ns)
        }
        None => {
            let api: Api<DecodePool> = Api::namespaced(ctx.client.clone(), ns);
            api.list(&ListParams::default()).await?.items
        }
    };
    let mut v: Vec<DecodePool> = all
        .into_iter()
        .filter(|d| d.spec.prefill.pool_ref.name == name)
        .collect();
    v.sort_by_key(|d| d.name_any());
    Ok(v)
}

/// Reconciles one PrefillPool.
///
/// # Errors
/// API failures; they are retried with backoff.
pub async fn reconcile(pp: Arc<PrefillPool>, ctx: Arc<Context>) -> Result<Action> {
    pool::reconcile(pp, ctx).await
}

/// What a PrefillPool's reconcile reads besides the pool.
#[derive(Debug, Clone, Default)]
pub struct PrefillWorld {
    /// The DecodePools pairing with the pool, by name.
    pub pairs: Vec<DecodePool>,
    /// The pool's tier.
    pub tier: TierRead,
    /// The tier of [`PrefillWorld::pair`], when there is one.
    pub pair_tier: TierRead,
}

impl PrefillWorld {
    /// The DecodePool the pool follows: the live one, else a terminating one (its ratio still
    /// owns the count while it drains).
    pub fn pair(&self) -> Option<&DecodePool> {
        self.pairs
            .iter()
            .find(|d| !children::terminating(*d))
            .or(self.pairs.first())
    }
}

/// A PrefillPool that may roll out.
#[derive(Debug, Clone)]
pub struct PrefillValidated {
    /// The pool resolved against its tier.
    pub own: Resolved,
    /// The DecodePool it follows and that pool's own revision.
    pub pair: Option<(DecodePool, String)>,
}

impl PoolKind for PrefillPool {
    const ROLE: Role = Role::Prefill;
    type World = PrefillWorld;
    type Validated = PrefillValidated;

    fn view(&self) -> PoolView<'_> {
        PoolView::prefill(self)
    }

    async fn read(ctx: &Context, ns: &str, pp: &Self, read: Read) -> Result<PrefillWorld> {
        let mut world = PrefillWorld {
            pairs: pairing_decode_pools(ctx, ns, &pp.name_any(), read).await?,
            tier: revision::read_tier(ctx, &pp.view(), read).await?,
            pair_tier: TierRead::None,
        };
        let pair_tier = match world.pair() {
            Some(d) => revision::read_tier(ctx, &PoolView::decode(d), read).await?,
            None => TierRead::None,
        };
        world.pair_tier = pair_tier;
        Ok(world)
    }

    fn validate(pp: &Self, world: &PrefillWorld) -> Result<PrefillValidated, Refusal> {
        let live: Vec<String> = world
            .pairs
            .iter()
            .filter(|d| !children::terminating(*d))
            .map(|d| d.name_any())
            .collect();
        if live.len() > 1 {
            return Err(Refusal::MultipleDecodePools { pools: live });
        }
        let own = revision::resolve(&pp.view(), &world.tier)?;
        let pair =
            match world.pair() {
                None => None,
                Some(d) => {
                    let theirs = revision::resolve(&PoolView::decode(d), &world.pair_tier)
                        .map_err(|cause| Refusal::DecodePoolBlocked {
                            name: d.name_any(),
                            cause,
                        })?;
                    Some((d.clone(), theirs.own_revision))
                }
            };
        Ok(PrefillValidated { own, pair })
    }

    fn desire(
        pp: &Self,
        _world: &PrefillWorld,
        v: PrefillValidated,
        observed: &PoolChildren,
        _now: jiff::Timestamp,
    ) -> Desired {
        let prev = pp.status.as_ref();
        let count = count_owner(pp, v.pair.as_ref(), &v.own.own_revision, observed);
        let previous = prev.map(|s| s.conditions.as_slice()).unwrap_or_default();
        let notes = status::newly_true(previous, &count.ignored)
            .then(|| Note {
                type_: normal(),
                reason: ConditionType::ReplicasIgnored.as_str(),
                action: "Scale",
                message: count.ignored.message.clone(),
            })
            .into_iter()
            .collect();
        let [degraded, policy] = resolved_conditions(&v.own.policy);
        Desired {
            groups: count.groups,
            conditions: vec![degraded, policy, count.capacity, count.ignored],
            resolved: v.own.with_revision(count.revision),
            gate: None,
            replicas_owner: count.owner,
            scaling: None,
            admitted: None,
            pair: None,
            capacity: CapacityState::Steady,
            notes,
            busy: false,
            rolling: pool::rolling(prev),
        }
    }

    fn replicas_owner(pp: &Self, world: &PrefillWorld) -> String {
        match world.pair() {
            Some(d) => ratio_owner(d),
            None => pp
                .status
                .as_ref()
                .and_then(|s| s.replicas_owner.clone())
                .filter(|_| held(pp).is_some())
                .unwrap_or_else(|| SPEC_REPLICAS.into()),
        }
    }

    async fn teardown_blockers(ctx: &Context, pp: &Self) -> Result<Vec<String>> {
        // Decode drains first: wait while a pairing DecodePool still has pods.
        let ns = pp.namespace().unwrap_or_default();
        let mut blocking = Vec::new();
        for d in pairing_decode_pools(ctx, &ns, &pp.name_any(), Read::Listed).await? {
            // Teardown decides on pods listed now.
            let dpods = observe_pods(ctx, &ns, &d.name_any(), Role::Decode, Read::Listed).await?;
            if dpods > 0 {
                blocking.push(format!("DecodePool/{} ({dpods} pods left)", d.name_any()));
            }
        }
        Ok(blocking)
    }
}

/// `status.replicasOwner` of a pool whose count a DecodePool's ratio owns.
fn ratio_owner(d: &DecodePool) -> String {
    format!("DecodePool/{} ratio {}", d.name_any(), d.spec.prefill.ratio)
}

/// Who owns a PrefillPool's count, and what follows from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountOwner {
    /// Groups to run.
    pub groups: u32,
    /// Revision to run.
    pub revision: String,
    /// `status.replicasOwner`.
    pub owner: String,
    /// `InsufficientCapacity` (mirrored from the DecodePool that owns the count).
    pub capacity: Decided,
    /// `ReplicasIgnored`.
    pub ignored: Decided,
}

/// The count and revision a released PrefillPool keeps: those of its last status, while that
/// status said a DecodePool's ratio set them and the pool's spec has not changed since.
pub fn held(pp: &PrefillPool) -> Option<(u32, String)> {
    let s = pp.status.as_ref()?;
    let ignored = status::read(&s.conditions, ConditionType::ReplicasIgnored)?;
    let unchanged =
        s.observed_generation.is_some() && s.observed_generation == pp.metadata.generation;
    let revision = s.update_revision.clone()?;
    (ignored.is_true() && unchanged)
        .then(|| (u32::try_from(s.desired_replicas).unwrap_or(0), revision))
}

/// Decides who owns the count of `pp` (module docs): the DecodePool `pair` (with its own
/// revision), the count a released pool holds, or `spec.replicas`.
pub fn count_owner(
    pp: &PrefillPool,
    pair: Option<&(DecodePool, String)>,
    own_revision: &str,
    observed: &PoolChildren,
) -> CountOwner {
    let ic = ConditionType::InsufficientCapacity;
    let ri = ConditionType::ReplicasIgnored;
    let spec = pp.spec.replicas;
    if let Some((d, decode_revision)) = pair {
        let dstatus = d.status.as_ref();
        // Until the DecodePool admitted a count, keep what exists.
        let groups = dstatus
            .and_then(|s| s.scaling.as_ref())
            .map_or(observed.groups_existing(), |s| {
                capacity::counts(s.applied).prefill
            });
        let capacity = dstatus
            .and_then(|s| status::read(&s.conditions, ic))
            .map_or_else(
                || Decided::no(ic, Reason::WithinCapacity, "no scale-up pending"),
                |c| {
                    let message = format!("from DecodePool {}: {}", d.name_any(), c.message);
                    Decided { message, ..c }
                },
            );
        return CountOwner {
            groups,
            revision: revision::pair_revision(own_revision, decode_revision),
            owner: ratio_owner(d),
            capacity,
            ignored: Decided::yes(
                ri,
                Reason::DecodePoolRatio,
                format!(
                    "DecodePool {} owns the group count through its ratio {} ({groups} groups): \
                     spec.replicas ({spec}) and any autoscaler writing /scale are ignored",
                    d.name_any(),
                    d.spec.prefill.ratio
                ),
            ),
        };
    }
    let unpaired = Decided::no(
        ic,
        Reason::WithinCapacity,
        "no budget applies to an unpaired pool",
    );
    if let Some((groups, revision)) = held(pp) {
        let prev = pp.status.as_ref();
        let last = prev
            .and_then(|s| s.replicas_owner.clone())
            .unwrap_or_default();
        let was_ratio = prev
            .and_then(|s| status::read(&s.conditions, ri))
            .is_some_and(|c| c.reason == Reason::DecodePoolRatio);
        let owner = if was_ratio {
            format!("held from {last}")
        } else {
            last
        };
        return CountOwner {
            groups,
            ignored: Decided::yes(
                ri,
                Reason::ReleasedByDecodePool,
                format!(
                    "the DecodePool that owned the count is gone ({owner}): the pool keeps its \
                     {groups} groups at revision {revision} until its own spec changes; \
                     spec.replicas ({spec}) is ignored until then"
                ),
            ),
            revision,
            owner,
            capacity: unpaired,
        };
    }
    CountOwner {
        groups: u32::try_from(spec).unwrap_or(0),
        revision: own_revision.to_owned(),
        owner: SPEC_REPLICAS.into(),
        capacity: unpaired,
        ignored: Decided::no(
            ri,
            Reason::SpecReplicas,
            format!("the group count is spec.replicas ({spec})"),
        ),
    }
}
