//! The one staged reconcile both pool kinds share (DESIGN §4); the kinds
//! ([`super::prefill_pool`], [`super::decode_pool`]) supply only what differs, through
//! [`PoolKind`]:
//!
//! 1. **read** (I/O): a fresh (quorum) copy of the pool, its children ([`observe`]), and what the
//!    kind reads besides ([`PoolKind::read`]: the pair, the tiers);
//! 2. **validate** (pure): [`PoolKind::validate`] gives the kind's validated value or a
//!    [`Refusal`], which [`blocked::report`] turns into conditions and one event, touching no
//!    child (the running pods' gang gate, [`apply::gang_gates`], is still kept);
//! 3. **desired** (pure): [`PoolKind::desire`] gives the desired set as a value, [`Desired`]:
//!    group count, config at its revision, the rollout gate, the kind's conditions and the events
//!    its decisions raise; then (I/O, with `probe_reports`) the `/report` of the pool's unready
//!    workers: a degradation one reports turns `Degraded` True, reason `WorkerDegraded`, with a
//!    Warning event of that reason ([`status::worker_degraded`]; e.g. engine pools refused before
//!    registration, seed 000);
//! 4. **apply** (I/O): [`apply::converge`] writes the children and acts on the rollout plan;
//! 5. **status** (pure): [`status::pool_status`]; then the status patch (only when it changed).
//!
//! Once `deletionTimestamp` is set only the teardown steps run ([`crate::teardown`]).

pub mod apply;
pub mod observe;
pub mod status;

use std::future::Future;
use std::sync::Arc;

use jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tandem_crds::{PoolStatus, ScalingStatus};

use self::observe::{PoolChildren, Read};
use self::status::{CapacityState, PairProgress, StatusFacts, blocked_status};
use super::blocked::{self, Block, Reported};
use super::children::{self, need, normal};
use super::refusal::Refusal;
use super::revision::Resolved;
use super::{BUSY, Context, Result, teardown};
use crate::labels::Role;
use crate::recovery;
use crate::render::PoolView;
use crate::rollout::{PrefillGate, RolloutPlan, phase};
use crate::status::Decided;
use crate::teardown::TeardownObservation;

/// `status.replicasOwner` of a pool whose count is its own `spec.replicas`.
pub const SPEC_REPLICAS: &str = "spec.replicas";

/// An event a decision raises, decided by a pure stage and published by the reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// Normal or Warning.
    pub type_: EventType,
    /// Event reason (CamelCase).
    pub reason: &'static str,
    /// Event action (CamelCase).
    pub action: &'static str,
    /// The note.
    pub message: String,
}

/// The desired set of a pool, as a value: what the apply stage converges to and the status stage
/// reports.
#[derive(Debug, Clone)]
pub struct Desired {
    /// Groups to run.
    pub groups: u32,
    /// The pool's resolved policy and config, the config's `revision` set to the one to roll out.
    pub resolved: Resolved,
    /// The rollout gate: a DecodePool's [`PrefillGate`] (a stale group restarts only once enough
    /// prefill groups of the revision are Updated); `None` for a PrefillPool (never waits).
    pub gate: Option<PrefillGate>,
    /// `status.replicasOwner`.
    pub replicas_owner: String,
    /// The scaling transaction (DecodePool).
    pub scaling: Option<ScalingStatus>,
    /// Decode groups admitted (DecodePool).
    pub admitted: Option<u32>,
    /// The PrefillPool's progress (DecodePool).
    pub pair: Option<PairProgress>,
    /// Where the scaling transaction stands (DecodePool).
    pub capacity: CapacityState,
    /// The kind's conditions after `Ready` and `Progressing`.
    pub conditions: Vec<Decided>,
    /// Events the decisions raise (published before the apply stage).
    pub notes: Vec<Note>,
    /// Something is moving besides the rollout (requeue soon).
    pub busy: bool,
    /// A rollout is under way ([`rolling`] of the pool's status): it ends only once every
    /// group is Updated ([`crate::rollout::plan_rollout`]).
    pub rolling: bool,
}

/// What distinguishes a pool kind; the stages that are the same for both live in this module.
pub trait PoolKind: Reported<Status = PoolStatus> {
    /// The role of the pool's workers.
    const ROLE: Role;
    /// What the read stage fetches besides the pool and its children.
    type World: Send + Sync;
    /// The validated pool: what the desired stage needs from validation.
    type Validated: Send;

    /// The pool as the render layer sees it.
    fn view(&self) -> PoolView<'_>;

    /// The read stage's kind-specific reads (the pool lives in `ns`), from the caches or the API
    /// server as `read` says.
    fn read(
        ctx: &Context,
        ns: &str,
        pool: &Self,
        read: Read,
    ) -> impl Future<Output = Result<Self::World>> + Send;

    /// The validate stage (pure).
    ///
    /// # Errors
    /// The [`Refusal`] that keeps the pool from rolling out.
    fn validate(pool: &Self, world: &Self::World) -> Result<Self::Validated, Refusal>;

    /// The desired stage (pure).
    fn desire(
        pool: &Self,
        world: &Self::World,
        validated: Self::Validated,
        observed: &PoolChildren,
        now: Timestamp,
    ) -> Desired;

    /// `status.replicasOwner` while the pool is refused.
    fn replicas_owner(pool: &Self, world: &Self::World) -> String;

    /// What the pool's teardown waits for (e.g. `DecodePool/d (2 pods left)`).
    fn teardown_blockers(
        ctx: &Context,
        pool: &Self,
    ) -> impl Future<Output = Result<Vec<String>>> + Send;
}

/// A Warning event of `reason` for a condition just decided True (`d`), unless `previous` already
/// held it True with the same reason (an event per flip, not per reconcile).
fn warning_on_flip(
    previous: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    d: Option<crate::status::Decided>,
    reason: &'static str,
) -> Option<Note> {
    let d = d.filter(|d| crate::status::newly_true(previous, d))?;
    Some(Note {
        type_: EventType::Warning,
        reason,
        action: "Observe",
        message: d.message,
    })
}

/// Reconciles one pool of kind `K` through the stages of the module docs.
///
/// # Errors
/// API failures; they are retried along [`super::backoff::RECONCILE`].
pub async fn reconcile<K: PoolKind>(handed: Arc<K>, ctx: Arc<Context>) -> Result<Action> {
    // Read.
    let ns = need(handed.namespace(), "metadata.namespace")?;
    let name = handed.name_any();
    let key = format!("{ns}/{name}");
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    // The scaling transaction and the count a released PrefillPool holds live in status. The copy
    // a reconcile is handed comes from the reflector and can predate our own last status write (a
    // child's event triggers the reconcile before the watch delivers that write); deciding from it
    // replays a finished step. So decide from a fresh (quorum) read.
    let pool = if ctx.trust_cached_status() {
        handed
    } else {
        match api.get_opt(&name).await? {
            Some(fresh) => Arc::new(fresh),
            None => return Ok(Action::await_change()),
        }
    };
    // Whether any read below may come from the caches (they may settle or unsettle between two
    // reads: asked before and after).
    let caches_before = ctx.caches().is_some();
    let mut observed = observe::observe(&ctx, &ns, &name, K::ROLE, Read::Cached).await?;
    if children::terminating(pool.as_ref()) && !ctx.reconcile_while_deleting() {
        ctx.metrics.set_state(K::KIND, &key, Some("Terminating"));
        // Teardown deletes and counts pods: it decides on children listed now.
        if observed.cached {
            observed = observe::observe_listed(&ctx, &ns, &name, K::ROLE).await?;
        }
        return teardown_pool(&ctx, &api, pool.as_ref(), &observed).await;
    }
    children::ensure_finalizer(&ctx, K::KIND, &api, pool.as_ref()).await?;
    let owner = need(pool.controller_owner_ref(&()), "metadata.uid")?;
    let mut world = K::read(&ctx, &ns, &pool, Read::Cached).await?;
    let mut cached = caches_before || ctx.caches().is_some();
    let view = pool.view();
    let prev = pool.status();

    // Validate, desired; decided from the caches, and once more from the API server when the
    // decision refuses the pool or deletes something (module `cache`: decide from the cache, act
    // on a fresh read; a refusal publishes a Warning, and a pool applied together with its pair
    // may not be in the cache yet). At most two passes: a listed observation is final.
    let (mut desired, recovery) = loop {
        let validated = match K::validate(&pool, &world) {
            Ok(v) => v,
            Err(_) if cached => {
                ctx.metrics.fresh_read(K::KIND);
                observed = observe::observe_listed(&ctx, &ns, &name, K::ROLE).await?;
                world = K::read(&ctx, &ns, &pool, Read::Listed).await?;
                cached = false;
                continue;
            }
            Err(refusal) => {
                // A refused pool touches no child, but the pods it already runs keep gang
                // readiness: a partial group must leave the endpoints whatever the spec says.
                let pods = Api::namespaced(ctx.client.clone(), &ns);
                apply::gang_gates(&ctx, K::KIND, &pods, view.group_size(), &observed).await?;
                let block = Block::from(&refusal);
                let owner = K::replicas_owner(&pool, &world);
                let status = blocked_status(pool.as_ref(), &observed, &block, owner);
                return blocked::report(&ctx, &api, pool.as_ref(), &block, status).await;
            }
        };
        let desired = K::desire(&pool, &world, validated, &observed, Timestamp::now());
        let recovery = recovery::plan(
            &observed.observations(desired.groups, view.group_size()),
            prev.map(|s| s.group_restarts.as_slice())
                .unwrap_or_default(),
            &desired.resolved.config.revision,
            view.max_group_restarts,
        );
        if cached
            && !ctx.act_on_cached_children()
            && apply::would_delete(&view, &desired, &observed, &recovery)
        {
            ctx.metrics.fresh_read(K::KIND);
            observed = observe::observe_listed(&ctx, &ns, &name, K::ROLE).await?;
            world = K::read(&ctx, &ns, &pool, Read::Listed).await?;
            cached = false;
            continue;
        }
        break (desired, recovery);
    };
    status::degrade_for_recovery(&mut desired.conditions, &recovery, view.max_group_restarts);
    // What the pool's unready workers say about themselves, and (issue 17) pods on nodes without
    // the placement's topology label (I/O; the merges are pure). Each raises a Warning on the flip.
    let previous = prev.map(|s| s.conditions.as_slice()).unwrap_or_default();
    if ctx.probe_reports {
        let port = desired.resolved.config.ports.health;
        let faults = super::probe::unready_worker_faults(&observed.pods, port).await;
        let d = status::worker_degraded(&mut desired.conditions, &faults);
        desired
            .notes
            .extend(warning_on_flip(previous, d, "WorkerDegraded"));
    }
    if let Some(p) = view.placement {
        let key = p.topology_key.as_str();
        let misplaced = observe::pods_on_unlabeled_nodes(&ctx, &observed.pods, key).await;
        let d = status::placement_degraded(&mut desired.conditions, key, &misplaced);
        desired
            .notes
            .extend(warning_on_flip(previous, d, "NodeWithoutTopologyLabel"));
    }
    let parent = pool.object_ref(&());
    for n in &desired.notes {
        ctx.event(&parent, n.type_, n.reason, n.action, n.message.clone())
            .await;
    }

    // Apply.
    let plan = apply::converge(
        &ctx,
        K::KIND,
        &parent,
        &view,
        &desired,
        &owner,
        &observed,
        &recovery,
    )
    .await?;

    // Status.
    let ready = observed.ready_groups(desired.groups, view.group_size());
    let halted = recovery.halted_groups().len() as u32;
    let status = status::pool_status(&StatusFacts {
        previous: prev,
        generation: pool.meta().generation,
        role: K::ROLE,
        name: &name,
        desired: desired.groups,
        existing: observed.groups_in_range(desired.groups),
        ready,
        rollout: &plan,
        revision: desired.resolved.revision(),
        replicas_owner: desired.replicas_owner.clone(),
        scaling: desired.scaling.clone(),
        admitted: desired.admitted,
        pair: desired.pair.as_ref(),
        capacity: desired.capacity,
        extra: &desired.conditions,
        group_restarts: &recovery.records,
    });
    if let Some(n) = rollout_complete(prev, &plan, desired.resolved.revision()) {
        ctx.event(&parent, n.type_, n.reason, n.action, n.message)
            .await;
    }
    ctx.metrics
        .set_state(K::KIND, &key, Some(K::state(&status)));
    children::patch_status_if_changed(&ctx, K::KIND, &api, &name, prev, &status).await?;
    // A halted group stays down until the revision changes: nothing to poll for.
    let busy = desired.busy || plan.phase != phase::IDLE || ready + halted < desired.groups;
    Ok(Action::requeue(if busy { BUSY } else { ctx.resync }))
}

/// Whether `status` says a rollout is under way: its `rollout.phase` is not Idle.
pub fn rolling(status: Option<&PoolStatus>) -> bool {
    status
        .and_then(|p| p.rollout.as_ref())
        .is_some_and(|r| r.phase != phase::IDLE)
}

/// `RolloutComplete` when the previous status had a rollout under way and this plan is idle
/// (every group Updated: [`crate::rollout::plan_rollout`]).
pub fn rollout_complete(
    prev: Option<&PoolStatus>,
    plan: &RolloutPlan,
    revision: &str,
) -> Option<Note> {
    (rolling(prev) && plan.phase == phase::IDLE).then(|| Note {
        type_: normal(),
        reason: "RolloutComplete",
        action: "Rollout",
        message: format!("every group runs revision {revision}"),
    })
}

/// Teardown (DESIGN §5): wait for what the kind waits for → stop routing (a DecodePool's front
/// door) → scale groups to 0 → wait for pods → release.
async fn teardown_pool<K: PoolKind>(
    ctx: &Context,
    api: &Api<K>,
    pool: &K,
    observed: &PoolChildren,
) -> Result<Action> {
    if !teardown::holds_finalizer(pool) {
        return Ok(Action::await_change());
    }
    let obs = TeardownObservation {
        blocking: K::teardown_blockers(ctx, pool).await?,
        front_door_present: observed
            .services
            .get(&pool.name_any())
            .is_some_and(|s| !children::terminating(s)),
        scaled_up: teardown::scaled_up(observed),
        pods_left: observed.pods.len() as u32,
    };
    let owner = pool
        .status()
        .and_then(|p| p.replicas_owner.clone())
        .unwrap_or_else(|| SPEC_REPLICAS.into());
    teardown::advance(ctx, api, pool, &obs, |b| {
        blocked_status(pool, observed, b, owner)
    })
    .await
}
