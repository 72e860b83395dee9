//! The event ledger: per (pool, layer), which load generations were recorded, completed or failed,
//! and each job's acknowledgement. Shared by both load backends so they obey one bookkeeping
//! (DESIGN contract 5; reference/dataplane.md R-HIC-2):
//!
//! - a backend records every [`LoadOp::Record`] of a plan at submission, before it returns the
//!   job's [`LoadTicket`] (the host backend with [`EventLedger::record_plan`]; the CUDA backend pair
//!   by pair, each right after its `cuEventRecord`), so a consumer can never wait ahead of the
//!   record (sglang PR #38472);
//! - the host backend completes an event when its load thread passes the plan's
//!   [`LoadOp::Record`]; the CUDA backend when its completion thread observes the CUDA event done;
//! - a wait on a generation nobody recorded is [`LoadError::NeverRecorded`], never a silent pass.
//!
//! Generations grow with submission order and one load stream runs jobs in that order, so per
//! (pool, layer) the ledger keeps the highest generation recorded and completed — but every failed
//! generation individually: a later job completing loads only its own pages, so it must never make
//! an earlier failed generation read as loaded.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::LoadError;
use super::plan::{LoadOp, LoadPlan};
use crate::memory::pool::PoolRole;

/// What the ledger knows of one (pool, layer).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EventState {
    /// Highest generation recorded (submitted).
    pub recorded: u64,
    /// Highest generation whose pages are loaded (one stream runs jobs in order, so every earlier
    /// generation that did not fail is loaded too).
    pub completed: u64,
    /// Every generation whose load failed.
    pub failed: BTreeSet<u64>,
}

/// Where one generation of one (pool, layer) stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventStatus {
    /// No job recorded this generation (or a later one) for the pair.
    NeverRecorded,
    /// Recorded; the pages are still being loaded.
    Pending,
    /// Loaded: the pages may be read.
    Complete,
    /// The load failed: the pages must not be read.
    Failed,
}

impl EventState {
    /// The status of `generation`. A failed generation stays failed whatever completes after it.
    pub fn status(&self, generation: u64) -> EventStatus {
        if self.recorded < generation {
            EventStatus::NeverRecorded
        } else if self.failed.contains(&generation) {
            EventStatus::Failed
        } else if self.completed >= generation {
            EventStatus::Complete
        } else {
            EventStatus::Pending
        }
    }
}

/// Completion events per (pool, layer), by generation (one generation per load job). Thread-safe.
#[derive(Debug, Default)]
pub struct EventLedger {
    table: Mutex<HashMap<(PoolRole, u32), EventState>>,
    changed: Condvar,
}

impl EventLedger {
    /// An empty ledger: every event is unrecorded.
    pub fn new() -> Self {
        Self::default()
    }

    fn table(&self) -> MutexGuard<'_, HashMap<(PoolRole, u32), EventState>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that the load of `generation` will complete (pool, layer).
    pub fn record(&self, pool: PoolRole, layer: u32, generation: u64) {
        let mut t = self.table();
        let e = t.entry((pool, layer)).or_default();
        e.recorded = e.recorded.max(generation);
    }

    /// Records every [`LoadOp::Record`] of `plan` (done at submission, before the ticket exists).
    pub fn record_plan(&self, plan: &LoadPlan) {
        for op in &plan.ops {
            if let LoadOp::Record {
                pool,
                layer,
                generation,
            } = *op
            {
                self.record(pool, layer, generation);
            }
        }
    }

    /// Completes (pool, layer) for `generation`: its pages are loaded.
    pub fn complete(&self, pool: PoolRole, layer: u32, generation: u64) {
        let mut t = self.table();
        let e = t.entry((pool, layer)).or_default();
        e.completed = e.completed.max(generation);
        drop(t);
        self.changed.notify_all();
    }

    /// Marks (pool, layer) of `generation` failed: waiters get [`LoadError::LoadFailed`].
    pub fn fail(&self, pool: PoolRole, layer: u32, generation: u64) {
        let mut t = self.table();
        let e = t.entry((pool, layer)).or_default();
        e.failed.insert(generation);
        drop(t);
        self.changed.notify_all();
    }

    /// Marks failed every pair `plan` records at operation index `from` or later (the operation at
    /// `from` failed, so nothing after it ran).
    pub fn fail_from(&self, plan: &LoadPlan, from: usize) {
        for (pool, layer) in plan.records_from(from) {
            self.fail(pool, layer, plan.generation);
        }
    }

    /// What the ledger knows of (pool, layer).
    pub fn state(&self, pool: PoolRole, layer: u32) -> EventState {
        self.table()
            .get(&(pool, layer))
            .cloned()
            .unwrap_or_default()
    }

    /// Where `generation` of (pool, layer) stands, without blocking.
    pub fn status(&self, pool: PoolRole, layer: u32, generation: u64) -> EventStatus {
        self.state(pool, layer).status(generation)
    }

    /// Blocks until (pool, layer) is complete for `generation`, at most `timeout`.
    ///
    /// # Errors
    /// [`LoadError::NeverRecorded`] if no job recorded that generation for (pool, layer),
    /// [`LoadError::LoadFailed`], or [`LoadError::Timeout`].
    pub fn wait(
        &self,
        pool: PoolRole,
        layer: u32,
        generation: u64,
        timeout: Duration,
    ) -> Result<(), LoadError> {
        let start = Instant::now();
        let mut t = self.table();
        loop {
            let status = t
                .get(&(pool, layer))
                .map_or(EventStatus::NeverRecorded, |s| s.status(generation));
            match status {
                EventStatus::NeverRecorded => {
                    return Err(LoadError::NeverRecorded {
                        pool,
                        layer,
                        generation,
                    });
                }
                EventStatus::Complete => return Ok(()),
                EventStatus::Failed => {
                    return Err(LoadError::LoadFailed {
                        pool,
                        layer,
                        generation,
                    });
                }
                EventStatus::Pending => {}
            }
            let waited = start.elapsed();
            let Some(left) = timeout.checked_sub(waited) else {
                return Err(LoadError::Timeout {
                    pool,
                    layer,
                    generation,
                    waited,
                });
            };
            t = self
                .changed
                .wait_timeout(t, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[derive(Debug, Default)]
struct AckSlot {
    result: Mutex<Option<Result<(), LoadError>>>,
    done: Condvar,
}

impl AckSlot {
    fn set_once(&self, result: Result<(), LoadError>) {
        let mut r = self.result.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some(result);
        }
        drop(r);
        self.done.notify_all();
    }
}

/// A submitted job: its generation (what consumers wait for) and its acknowledgement.
#[derive(Debug)]
pub struct LoadTicket {
    /// Generation of the job's events.
    pub generation: u64,
    ack: Arc<AckSlot>,
}

/// The executor's side of a ticket: acknowledges the job once. Dropped unacknowledged (the executor
/// shut down with the job queued), it acknowledges [`LoadError::ExecutorGone`].
#[derive(Debug)]
pub(crate) struct Acknowledger {
    slot: Arc<AckSlot>,
}

impl Acknowledger {
    /// Acknowledges the job: `Ok` once every copy is done and its host pages are unlocked.
    pub(crate) fn acknowledge(self, result: Result<(), LoadError>) {
        self.slot.set_once(result);
    }
}

impl Drop for Acknowledger {
    fn drop(&mut self) {
        self.slot.set_once(Err(LoadError::ExecutorGone));
    }
}

impl LoadTicket {
    /// A ticket for `generation` and the executor's side of it.
    pub(crate) fn new(generation: u64) -> (LoadTicket, Acknowledger) {
        let slot = Arc::new(AckSlot::default());
        (
            LoadTicket {
                generation,
                ack: Arc::clone(&slot),
            },
            Acknowledger { slot },
        )
    }

    /// Blocks until the job is acknowledged (all copies done, host pages unlocked) or failed, at
    /// most `timeout`.
    ///
    /// # Errors
    /// The job's error, [`LoadError::ExecutorGone`] if the executor dropped it, or
    /// [`LoadError::AckTimeout`] (the caller must then keep the destination pages out of use).
    pub fn wait_ack(&self, timeout: Duration) -> Result<(), LoadError> {
        let start = Instant::now();
        let mut r = self.ack.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(result) = r.as_ref() {
                return result.clone();
            }
            let waited = start.elapsed();
            let Some(left) = timeout.checked_sub(waited) else {
                return Err(LoadError::AckTimeout {
                    generation: self.generation,
                    waited,
                });
            };
            r = self
                .ack
                .done
                .wait_timeout(r, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::plan::{FencePolicy, LoadJob, plan_load};

    #[test]
    fn a_failed_generation_stays_failed_when_a_later_one_completes() {
        // Job 1's copy failed, job 2 (other pages of the same pool and layer) loaded: a reader of
        // job 1's pages must still be refused, not told they are loaded.
        let ev = EventLedger::new();
        for g in [1, 2] {
            ev.record(PoolRole::Indexer, 0, g);
        }
        ev.fail(PoolRole::Indexer, 0, 1);
        ev.complete(PoolRole::Indexer, 0, 2);
        assert_eq!(ev.status(PoolRole::Indexer, 0, 1), EventStatus::Failed);
        assert_eq!(ev.status(PoolRole::Indexer, 0, 2), EventStatus::Complete);
        assert!(matches!(
            ev.wait(PoolRole::Indexer, 0, 1, Duration::from_millis(10)),
            Err(LoadError::LoadFailed { generation: 1, .. })
        ));
    }

    #[test]
    fn waiting_on_an_unrecorded_event_is_an_error_not_a_no_op() {
        let ev = EventLedger::new();
        let t = Duration::from_millis(10);
        assert_eq!(
            ev.wait(PoolRole::Indexer, 0, 1, t),
            Err(LoadError::NeverRecorded {
                pool: PoolRole::Indexer,
                layer: 0,
                generation: 1
            })
        );
        ev.record(PoolRole::Indexer, 0, 1);
        assert!(matches!(
            ev.wait(PoolRole::Indexer, 0, 1, t),
            Err(LoadError::Timeout { .. })
        ));
        ev.complete(PoolRole::Indexer, 0, 1);
        assert_eq!(ev.wait(PoolRole::Indexer, 0, 1, t), Ok(()));
        ev.record(PoolRole::Indexer, 0, 2);
        ev.fail(PoolRole::Indexer, 0, 2);
        assert!(matches!(
            ev.wait(PoolRole::Indexer, 0, 2, t),
            Err(LoadError::LoadFailed { .. })
        ));
    }

    #[test]
    fn a_plan_is_recorded_whole_at_submission_and_fails_from_the_failed_op() {
        let job = LoadJob {
            pools: vec![PoolRole::Target, PoolRole::Indexer],
            layers: 2,
            pages: Vec::new(),
        };
        let plan = plan_load(&job, 3, 0, FencePolicy::WaitForward);
        let ev = EventLedger::new();
        ev.record_plan(&plan);
        for layer in 0..2 {
            for pool in [PoolRole::Target, PoolRole::Indexer] {
                assert_eq!(ev.status(pool, layer, 3), EventStatus::Pending);
            }
        }
        assert_eq!(ev.status(PoolRole::Draft, 0, 3), EventStatus::NeverRecorded);
        ev.complete(PoolRole::Target, 0, 3);
        ev.complete(PoolRole::Indexer, 0, 3);
        // ops: fence, (copy, record) × 4, release; index 5 is the copy of (Target, 1).
        ev.fail_from(&plan, 5);
        assert_eq!(ev.status(PoolRole::Indexer, 0, 3), EventStatus::Complete);
        assert_eq!(ev.status(PoolRole::Target, 1, 3), EventStatus::Failed);
        assert_eq!(ev.status(PoolRole::Indexer, 1, 3), EventStatus::Failed);
        // An older generation stays complete once a newer one is recorded.
        assert_eq!(ev.status(PoolRole::Target, 0, 2), EventStatus::Complete);
    }

    #[test]
    fn a_ticket_dropped_by_its_executor_reads_as_executor_gone() {
        let (ticket, ack) = LoadTicket::new(7);
        assert!(matches!(
            ticket.wait_ack(Duration::from_millis(5)),
            Err(LoadError::AckTimeout { generation: 7, .. })
        ));
        drop(ack);
        assert_eq!(
            ticket.wait_ack(Duration::from_millis(5)),
            Err(LoadError::ExecutorGone)
        );
        let (ticket, ack) = LoadTicket::new(8);
        ack.acknowledge(Ok(()));
        assert_eq!(ticket.wait_ack(Duration::ZERO), Ok(()));
    }
}
