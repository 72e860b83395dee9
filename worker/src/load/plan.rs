//! The load-before-read plan: which stream operations a backend enqueues for a load job and which
//! waits compute enqueues before it reads a layer. Pure: no threads, no devices. Both backends — the
//! host one ([`super::order`]) and the CUDA one (`stream_cuda`, feature `cuda`) — execute
//! exactly these operations, so the rules live here once (DESIGN contract 5; reference/dataplane.md
//! R-HIC-1..4):
//!
//! 1. **Fence behind the forward stream** ([`LoadOp::WaitFence`] first): the load stream writes
//!    nothing until the forward stream has passed its position at submission, so a load never
//!    overwrites pages that in-flight compute still reads (sglang PR #36738).
//! 2. **Per-layer, per-pool events** ([`LoadOp::Copy`] then [`LoadOp::Record`] for every (pool, layer)
//!    of the job, the record after that pair's copies): compute for layer *i* waits on layer *i*'s event
//!    of every pool it reads ([`plan_layer_reads`]). The indexer kernel that ran on a half-loaded
//!    indexer cache is seed 004 BugFix #2 (sglang PR #22811; #27504 for extra pools never awaited).
//! 3. **Recorded before waited**: a backend records every [`LoadOp::Record`] of a plan in the
//!    [`super::event_ledger::EventLedger`] before it hands out the job's ticket, and refuses a wait
//!    on a generation never recorded (sglang PR #38472: `cuStreamWaitEvent` on a never-recorded event
//!    returns at once).
//! 4. **Host pages locked until the load is acknowledged** ([`LoadOp::ReleaseHostPages`] last, run only
//!    once the final record has completed; sglang PR #31427).
//!
//! [`check_load_plan`] and [`check_layer_reads`] verify a plan against these rules; the unsafe
//! policies (`FencePolicy::UnsafeSkipFence`, `ReadPolicy::UnsafeSkipPool`) exist only as negative
//! controls (feature `negative-controls`), and the checks reject the plans they produce.

use crate::memory::pool::PoolRole;
use crate::tier::page_key::PageKey;

/// One page of a load: host (L2) slot → device (L1) page, named by its key for the host lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// Key of the page (locked on the host while the job runs).
    pub key: PageKey,
    /// Source page index in the host pools.
    pub host_page: u32,
    /// Destination page index in the device pools.
    pub device_page: u32,
}

/// A load job: `pages` of every pool in `pools`, layers `0..layers`, loaded layer by layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadJob {
    /// Pools to load (e.g. the KV pool and the indexer pool).
    pub pools: Vec<PoolRole>,
    /// Layers to load, from 0.
    pub layers: u32,
    /// Pages to copy.
    pub pages: Vec<PageCopy>,
}

/// Whether a load waits for the forward rounds submitted before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FencePolicy {
    /// Wait (the rule, R-HIC-3).
    WaitForward,
    /// Negative control: write at once (the sglang PR #36738 bug).
    #[cfg(feature = "negative-controls")]
    UnsafeSkipFence,
}

/// Which pools a consumer waits on before reading a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPolicy {
    /// Wait on every pool read (the rule).
    WaitEveryPool,
    /// Negative control: skip the wait on one pool (the seed 004 BugFix #2 bug when it is the
    /// indexer pool).
    #[cfg(feature = "negative-controls")]
    UnsafeSkipPool(PoolRole),
}

impl ReadPolicy {
    /// Whether a consumer under this policy waits on `pool`'s events before reading.
    #[cfg_attr(not(feature = "negative-controls"), allow(unused_variables))]
    pub fn waits_on(self, pool: PoolRole) -> bool {
        match self {
            ReadPolicy::WaitEveryPool => true,
            #[cfg(feature = "negative-controls")]
            ReadPolicy::UnsafeSkipPool(skipped) => skipped != pool,
        }
    }
}

/// One operation a backend enqueues on its load stream, in plan order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOp {
    /// Wait until the forward stream has passed `fence`, its position when the job was submitted
    /// (host backend: the last compute round begun; CUDA backend: an event recorded on the forward
    /// stream at submission, which the load stream waits on).
    WaitFence {
        /// Forward-stream position.
        fence: u64,
    },
    /// Copy every page of the plan ([`LoadPlan::pages`]) of `pool` on `layer`, host → device.
    Copy {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
    },
    /// Record (pool, layer)'s completion event for `generation`, after that pair's copies.
    Record {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// The job's generation.
        generation: u64,
    },
    /// Release the host page locks of the plan's pages. A backend runs it only once every record
    /// before it has completed (the job is then acknowledged).
    ReleaseHostPages,
}

/// The operations of one load job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    /// Generation of the job's events (one per job, increasing in submission order).
    pub generation: u64,
    /// Pages every [`LoadOp::Copy`] copies; their keys are the host locks.
    pub pages: Vec<PageCopy>,
    /// Operations in load-stream order.
    pub ops: Vec<LoadOp>,
}

impl LoadPlan {
    /// Keys of the host pages the job reads (locked from submission until acknowledgement).
    pub fn host_keys(&self) -> Vec<PageKey> {
        self.pages.iter().map(|p| p.key).collect()
    }

    /// The (pool, layer) pairs recorded by the operations at index `from` and after — what a
    /// backend marks failed when the operation at `from` fails.
    pub fn records_from(&self, from: usize) -> impl Iterator<Item = (PoolRole, u32)> + '_ {
        self.ops.iter().skip(from).filter_map(|op| match op {
            LoadOp::Record { pool, layer, .. } => Some((*pool, *layer)),
            _ => None,
        })
    }
}

/// The plan of `job` as generation `generation`, submitted when the forward stream was at `fence`:
/// `[WaitFence] (Copy, Record) per layer per pool, ReleaseHostPages` (module rules 1, 2, 4). With
/// `FencePolicy::UnsafeSkipFence` the fence is left out (negative control).
pub fn plan_load(job: &LoadJob, generation: u64, fence: u64, policy: FencePolicy) -> LoadPlan {
    let mut ops = Vec::with_capacity(2 + 2 * job.layers as usize * job.pools.len());
    if policy == FencePolicy::WaitForward {
        ops.push(LoadOp::WaitFence { fence });
    }
    for layer in 0..job.layers {
        for pool in &job.pools {
            ops.push(LoadOp::Copy { pool: *pool, layer });
            ops.push(LoadOp::Record {
                pool: *pool,
                layer,
                generation,
            });
        }
    }
    ops.push(LoadOp::ReleaseHostPages);
    LoadPlan {
        generation,
        pages: job.pages.clone(),
        ops,
    }
}

/// One operation compute enqueues on the forward stream before it reads a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOp {
    /// Wait on (pool, layer)'s event of `generation` (host: block until complete; CUDA:
    /// `cuStreamWaitEvent` on the forward stream).
    WaitEvent {
        /// Pool read.
        pool: PoolRole,
        /// Layer read.
        layer: u32,
        /// Generation of the load that wrote the pages.
        generation: u64,
    },
}

/// The waits compute enqueues before reading `layer` of the pools in `reads`, loaded by
/// `generation`: one per pool read (module rule 2). `ReadPolicy::UnsafeSkipPool` drops that pool's
/// wait (negative control).
pub fn plan_layer_reads(
    layer: u32,
    reads: &[PoolRole],
    generation: u64,
    policy: ReadPolicy,
) -> Vec<ReadOp> {
    reads
        .iter()
        .filter(|pool| policy.waits_on(**pool))
        .map(|pool| ReadOp::WaitEvent {
            pool: *pool,
            layer,
            generation,
        })
        .collect()
}

/// A plan that breaks a module rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanViolation {
    /// The plan does not start with the fence (rule 1).
    #[error("the load does not wait for the forward stream before its first copy")]
    MissingFence,
    /// A (pool, layer) of the job has no copy, or more than one.
    #[error("{pool} layer {layer}: {copies} copies, expected exactly 1")]
    CopyCount {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// Copies found.
        copies: usize,
    },
    /// A (pool, layer) of the job is never recorded, or not after its copy (rule 2).
    #[error("{pool} layer {layer}: no record of generation {generation} after its copy")]
    MissingRecord {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// The plan's generation.
        generation: u64,
    },
    /// The plan copies or records a (pool, layer) outside the job.
    #[error("{pool} layer {layer} is not part of the job")]
    OutsideJob {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
    },
    /// The host pages are released before the final record, or never (rule 4).
    #[error("host pages are not released exactly once, after the final record")]
    ReleaseNotLast,
    /// Compute reads a pool of a layer without waiting on its event (rule 2; seed 004 BugFix #2).
    #[error("compute reads {pool} layer {layer} without waiting on generation {generation}")]
    MissingWait {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// Generation that wrote the pages.
        generation: u64,
    },
}

/// Checks `plan` against the module rules for `job`: fence first, exactly one copy per (pool,
/// layer) of the job followed by that pair's record of the plan's generation, nothing outside the
/// job, and the host release last.
///
/// # Errors
/// The first [`PlanViolation`] found.
pub fn check_load_plan(plan: &LoadPlan, job: &LoadJob) -> Result<(), PlanViolation> {
    let in_job = |pool: PoolRole, layer: u32| layer < job.layers && job.pools.contains(&pool);
    if !matches!(plan.ops.first(), Some(LoadOp::WaitFence { .. })) {
        return Err(PlanViolation::MissingFence);
    }
    for op in &plan.ops {
        match *op {
            LoadOp::Copy { pool, layer } | LoadOp::Record { pool, layer, .. }
                if !in_job(pool, layer) =>
            {
                return Err(PlanViolation::OutsideJob { pool, layer });
            }
            _ => {}
        }
    }
    for layer in 0..job.layers {
        for pool in &job.pools {
            let pool = *pool;
            let copies: Vec<usize> = positions(plan, |op| op == LoadOp::Copy { pool, layer });
            let [copy] = copies[..] else {
                return Err(PlanViolation::CopyCount {
                    pool,
                    layer,
                    copies: copies.len(),
                });
            };
            let record = LoadOp::Record {
                pool,
                layer,
                generation: plan.generation,
            };
            if !plan.ops[copy..].contains(&record) {
                return Err(PlanViolation::MissingRecord {
                    pool,
                    layer,
                    generation: plan.generation,
                });
            }
        }
    }
    let releases = positions(plan, |op| op == LoadOp::ReleaseHostPages);
    if releases != [plan.ops.len() - 1] {
        return Err(PlanViolation::ReleaseNotLast);
    }
    Ok(())
}

fn positions(plan: &LoadPlan, pred: impl Fn(LoadOp) -> bool) -> Vec<usize> {
    plan.ops
        .iter()
        .enumerate()
        .filter(|(_, op)| pred(**op))
        .map(|(i, _)| i)
        .collect()
}

/// Checks that `ops`, enqueued before compute reads `layer` of the pools in `reads`, wait on every
/// one of them for `generation`.
///
/// # Errors
/// [`PlanViolation::MissingWait`] for the first pool read without a wait.
pub fn check_layer_reads(
    ops: &[ReadOp],
    layer: u32,
    reads: &[PoolRole],
    generation: u64,
) -> Result<(), PlanViolation> {
    for pool in reads {
        let wait = ReadOp::WaitEvent {
            pool: *pool,
            layer,
            generation,
        };
        if !ops.contains(&wait) {
            return Err(PlanViolation::MissingWait {
                pool: *pool,
                layer,
                generation,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const POOLS: [PoolRole; 2] = [PoolRole::Target, PoolRole::Indexer];

    fn job() -> LoadJob {
        LoadJob {
            pools: POOLS.to_vec(),
            layers: 3,
            pages: (0..4)
                .map(|i| PageCopy {
                    key: PageKey::from_trace_id(100 + u64::from(i)),
                    host_page: i,
                    device_page: 7 - i,
                })
                .collect(),
        }
    }

    #[test]
    fn plan_fences_then_copies_and_records_every_pool_of_every_layer_then_releases() {
        let plan = plan_load(&job(), 5, 9, FencePolicy::WaitForward);
        assert_eq!(plan.ops.len(), 1 + 2 * 3 * 2 + 1);
        assert_eq!(plan.ops[0], LoadOp::WaitFence { fence: 9 });
        assert_eq!(
            plan.ops[3..5],
            [
                LoadOp::Copy {
                    pool: PoolRole::Indexer,
                    layer: 0
                },
                LoadOp::Record {
                    pool: PoolRole::Indexer,
                    layer: 0,
                    generation: 5
                }
            ]
        );
        assert_eq!(plan.ops.last(), Some(&LoadOp::ReleaseHostPages));
        assert_eq!(plan.host_keys().len(), 4);
        assert_eq!(check_load_plan(&plan, &job()), Ok(()));
    }

    #[test]
    fn records_from_a_failed_op_cover_it_and_everything_after() {
        let plan = plan_load(&job(), 1, 0, FencePolicy::WaitForward);
        // ops[5] is the copy of (Target, 1): layer 0 is complete, layers 1 and 2 fail.
        let failed: Vec<_> = plan.records_from(5).collect();
        assert_eq!(failed.len(), 4);
        assert_eq!(failed[0], (PoolRole::Target, 1));
        assert_eq!(plan.records_from(0).count(), 6);
    }

    #[test]
    fn read_plan_waits_on_every_pool_the_layer_reads() {
        let ops = plan_layer_reads(2, &POOLS, 4, ReadPolicy::WaitEveryPool);
        assert_eq!(ops.len(), 2);
        assert_eq!(check_layer_reads(&ops, 2, &POOLS, 4), Ok(()));
        // Waiting on the wrong layer or generation does not count.
        let other_layer = plan_layer_reads(1, &POOLS, 4, ReadPolicy::WaitEveryPool);
        assert!(check_layer_reads(&other_layer, 2, &POOLS, 4).is_err());
        let older = plan_layer_reads(2, &POOLS, 3, ReadPolicy::WaitEveryPool);
        assert!(check_layer_reads(&older, 2, &POOLS, 4).is_err());
    }

    #[test]
    fn negative_control_a_read_plan_without_the_indexer_wait_is_caught() {
        let ops = plan_layer_reads(2, &POOLS, 4, ReadPolicy::UnsafeSkipPool(PoolRole::Indexer));
        assert_eq!(
            check_layer_reads(&ops, 2, &POOLS, 4),
            Err(PlanViolation::MissingWait {
                pool: PoolRole::Indexer,
                layer: 2,
                generation: 4
            })
        );
    }

    #[test]
    fn negative_control_a_plan_without_the_fence_is_caught() {
        let plan = plan_load(&job(), 1, 3, FencePolicy::UnsafeSkipFence);
        assert_eq!(
            check_load_plan(&plan, &job()),
            Err(PlanViolation::MissingFence)
        );
    }

    #[test]
    fn plans_that_break_the_event_or_release_order_are_caught() {
        let job = job();
        let good = plan_load(&job, 2, 0, FencePolicy::WaitForward);
        let record_of = |pool, layer| LoadOp::Record {
            pool,
            layer,
            generation: 2,
        };

        // The indexer pool of layer 1 never recorded (sglang #27504).
        let mut missing = good.clone();
        missing
            .ops
            .retain(|op| *op != record_of(PoolRole::Indexer, 1));
        assert_eq!(
            check_load_plan(&missing, &job),
            Err(PlanViolation::MissingRecord {
                pool: PoolRole::Indexer,
                layer: 1,
                generation: 2
            })
        );

        // Recorded before its copy: waiters would pass before the bytes land.
        let mut early = good.clone();
        let copy = early
            .ops
            .iter()
            .position(|op| {
                *op == LoadOp::Copy {
                    pool: PoolRole::Target,
                    layer: 2,
                }
            })
            .expect("copy present");
        early.ops.swap(copy, copy + 1);
        assert!(matches!(
            check_load_plan(&early, &job),
            Err(PlanViolation::MissingRecord { .. })
        ));

        // A job whose pools were never all planned (the indexer pool forgotten).
        let target_only = LoadJob {
            pools: vec![PoolRole::Target],
            ..job.clone()
        };
        let partial = plan_load(&target_only, 2, 0, FencePolicy::WaitForward);
        assert!(matches!(
            check_load_plan(&partial, &job),
            Err(PlanViolation::CopyCount {
                pool: PoolRole::Indexer,
                copies: 0,
                ..
            })
        ));

        // Host pages released before the final record.
        let mut released_early = good.clone();
        let last = released_early.ops.len() - 1;
        released_early.ops.swap(last - 1, last);
        assert_eq!(
            check_load_plan(&released_early, &job),
            Err(PlanViolation::ReleaseNotLast)
        );

        // Copies into a layer outside the job.
        let mut outside = good;
        outside.ops.insert(
            1,
            LoadOp::Copy {
                pool: PoolRole::Draft,
                layer: 0,
            },
        );
        assert_eq!(
            check_load_plan(&outside, &job),
            Err(PlanViolation::OutsideJob {
                pool: PoolRole::Draft,
                layer: 0
            })
        );
    }
}
