//! Load-before-read, host backend: a load executor ("load stream", a thread) beside compute
//! ("forward stream"), with a completion event per layer and per pool (DESIGN contract 5; seed 004
//! BugFix #2; reference/dataplane.md R-HIC-1..4).
//!
//! The rules — fence behind the forward stream, per-layer per-pool events, recorded before waited,
//! host pages locked until the load is acknowledged — are the plan's ([`super::plan`]); this
//! backend executes [`LoadPlan`]s op by op and keeps its events in the shared
//! [`EventLedger`], exactly as the CUDA backend (`stream_cuda`, feature `cuda`) does on CUDA
//! streams. Here "device" pages are host memory ([`PagePools`]), [`LoadOp::Record`] completes its
//! event when the load thread reaches it, and [`wait_layer`] blocks the calling thread.
//!
//! The negative controls (`ReadPolicy::UnsafeSkipPool`, `FencePolicy::UnsafeSkipFence`,
//! `EvictionPolicy::UnsafeIgnoreLocks`; feature `negative-controls`) exist only so tests can show
//! that removing a rule produces stale reads (`tests/load_order.rs`).

use std::collections::{BTreeSet, HashMap};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::LoadError;
use super::event_ledger::{Acknowledger, EventLedger, LoadTicket};
use super::host_locks::HostPageLocks;
use super::plan::{
    FencePolicy, LoadJob, LoadOp, LoadPlan, ReadOp, ReadPolicy, plan_layer_reads, plan_load,
};
use crate::memory::pool::PoolRole;

/// Host-backend page storage: for each pool, `layers × pages` pages of `page_bytes` bytes, each
/// behind its own lock (one page-layer chunk of the pool geometry).
pub struct PagePools {
    pools: HashMap<PoolRole, Vec<Mutex<Vec<u8>>>>,
    layers: u32,
    pages: u32,
    page_bytes: usize,
}

impl PagePools {
    /// Zeroed pools for `roles`, each `layers × pages` pages of `page_bytes`.
    pub fn new(roles: &[PoolRole], layers: u32, pages: u32, page_bytes: usize) -> Self {
        let n = layers as usize * pages as usize;
        let pools = roles
            .iter()
            .map(|r| {
                (
                    *r,
                    (0..n).map(|_| Mutex::new(vec![0u8; page_bytes])).collect(),
                )
            })
            .collect();
        PagePools {
            pools,
            layers,
            pages,
            page_bytes,
        }
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    fn page(
        &self,
        pool: PoolRole,
        layer: u32,
        page: u32,
    ) -> Result<MutexGuard<'_, Vec<u8>>, LoadError> {
        let oob = LoadError::OutOfRange { pool, layer, page };
        if layer >= self.layers || page >= self.pages {
            return Err(oob);
        }
        let slot = self
            .pools
            .get(&pool)
            .and_then(|p| p.get(layer as usize * self.pages as usize + page as usize))
            .ok_or(oob)?;
        Ok(slot.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A copy of one page.
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`].
    pub fn read(&self, pool: PoolRole, layer: u32, page: u32) -> Result<Vec<u8>, LoadError> {
        Ok(self.page(pool, layer, page)?.clone())
    }

    /// Overwrites one page with `bytes` (truncated or zero-padded to the page size).
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`].
    pub fn write(
        &self,
        pool: PoolRole,
        layer: u32,
        page: u32,
        bytes: &[u8],
    ) -> Result<(), LoadError> {
        let mut dst = self.page(pool, layer, page)?;
        let n = bytes.len().min(dst.len());
        dst[..n].copy_from_slice(&bytes[..n]);
        dst[n..].fill(0);
        Ok(())
    }
}

/// Waits, before compute reads `layer`, on that layer's events of every pool in `reads` — the
/// waits of [`plan_layer_reads`] (R-HIC-1), each blocking this thread at most `timeout`.
///
/// # Errors
/// The first [`EventLedger::wait`] error ([`LoadError::NeverRecorded`] for a pool no load covers).
pub fn wait_layer(
    events: &EventLedger,
    layer: u32,
    reads: &[PoolRole],
    generation: u64,
    timeout: Duration,
    policy: ReadPolicy,
) -> Result<(), LoadError> {
    for op in plan_layer_reads(layer, reads, generation, policy) {
        let ReadOp::WaitEvent {
            pool,
            layer,
            generation,
        } = op;
        events.wait(pool, layer, generation, timeout)?;
    }
    Ok(())
}

/// The forward stream's progress, for fencing loads behind compute rounds already submitted.
#[derive(Default)]
pub struct ForwardStream {
    state: Mutex<ForwardState>,
    changed: Condvar,
}

#[derive(Default)]
struct ForwardState {
    submitted: u64,
    in_flight: BTreeSet<u64>,
}

impl ForwardStream {
    /// A stream with no rounds.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, ForwardState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a compute round (it reads pages until [`ForwardStream::end_round`]); returns its id.
    pub fn begin_round(&self) -> u64 {
        let mut s = self.state();
        s.submitted += 1;
        let id = s.submitted;
        s.in_flight.insert(id);
        id
    }

    /// Ends round `id`.
    pub fn end_round(&self, id: u64) {
        self.state().in_flight.remove(&id);
        self.changed.notify_all();
    }

    /// The fence a load submitted now must wait for: every round begun so far.
    pub fn fence(&self) -> u64 {
        self.state().submitted
    }

    /// Blocks until no round with id ≤ `fence` is in flight, at most `timeout`.
    ///
    /// # Errors
    /// [`LoadError::FenceTimeout`].
    pub fn wait_fence(&self, fence: u64, timeout: Duration) -> Result<(), LoadError> {
        let start = Instant::now();
        let mut s = self.state();
        while s.in_flight.first().is_some_and(|oldest| *oldest <= fence) {
            let waited = start.elapsed();
            let Some(left) = timeout.checked_sub(waited) else {
                return Err(LoadError::FenceTimeout { fence, waited });
            };
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }
}

/// Executor options, including the test-only fault and the negative control.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Fence policy.
    pub fence: FencePolicy,
    /// Longest wait for the fence.
    pub fence_timeout: Duration,
    /// Test fault: delay the copy of this (pool, layer) by this long (the "slow indexer load").
    pub delay: Option<(PoolRole, u32, Duration)>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            fence: FencePolicy::WaitForward,
            fence_timeout: Duration::from_secs(30),
            delay: None,
        }
    }
}

struct Submitted {
    plan: LoadPlan,
    ack: Acknowledger,
}

/// The load stream: one thread running jobs' plans in submission order.
pub struct LoadExecutor {
    tx: Option<mpsc::Sender<Submitted>>,
    thread: Option<JoinHandle<()>>,
    events: Arc<EventLedger>,
    forward: Arc<ForwardStream>,
    locks: Arc<HostPageLocks>,
    fence: FencePolicy,
    next_generation: Mutex<u64>,
}

/// What the executor copies between and the state it shares with compute.
pub struct LoadContext {
    /// Source pages (L2 host pool).
    pub host: Arc<PagePools>,
    /// Destination pages (L1 device pool; host memory in this backend).
    pub device: Arc<PagePools>,
    /// Completion events shared with compute.
    pub events: Arc<EventLedger>,
    /// The forward stream loads are fenced behind.
    pub forward: Arc<ForwardStream>,
    /// Host page locks shared with L2 eviction.
    pub locks: Arc<HostPageLocks>,
}

impl LoadExecutor {
    /// Starts the load stream.
    ///
    /// # Errors
    /// [`LoadError::ExecutorGone`] if the thread cannot be spawned.
    pub fn spawn(ctx: LoadContext, options: LoadOptions) -> Result<Self, LoadError> {
        let (tx, rx) = mpsc::channel::<Submitted>();
        let (events, forward, locks) = (
            Arc::clone(&ctx.events),
            Arc::clone(&ctx.forward),
            Arc::clone(&ctx.locks),
        );
        let fence = options.fence;
        let thread = std::thread::Builder::new()
            .name("load-stream".into())
            .spawn(move || {
                for s in rx {
                    let result = run_plan(&ctx, &options, &s.plan);
                    s.ack.acknowledge(result);
                }
            })
            .map_err(|_| LoadError::ExecutorGone)?;
        Ok(LoadExecutor {
            tx: Some(tx),
            thread: Some(thread),
            events,
            forward,
            locks,
            fence,
            next_generation: Mutex::new(0),
        })
    }

    /// Submits `job`: assigns its generation, captures the forward fence, plans it
    /// ([`plan_load`]), records the plan's events and locks its host pages, then queues it. Returns
    /// at once.
    ///
    /// # Errors
    /// [`LoadError::ExecutorGone`] (the host locks taken are released again and the plan's events
    /// marked failed).
    pub fn submit(&self, job: LoadJob) -> Result<LoadTicket, LoadError> {
        // Held until the job is queued: generations must reach the load thread in order, or a
        // later job completing first would make an earlier one read as loaded (the ledger keeps
        // the highest completed generation per (pool, layer)).
        let mut next = self
            .next_generation
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *next += 1;
        let generation = *next;
        let plan = plan_load(&job, generation, self.forward.fence(), self.fence);
        self.events.record_plan(&plan);
        let keys = plan.host_keys();
        self.locks.lock(&keys);
        let (ticket, ack) = LoadTicket::new(generation);
        let sent = self.tx.as_ref().map(|tx| tx.send(Submitted { plan, ack }));
        match sent {
            Some(Ok(())) => Ok(ticket),
            Some(Err(mpsc::SendError(s))) => {
                self.events.fail_from(&s.plan, 0);
                self.locks.unlock(&keys)?;
                Err(LoadError::ExecutorGone)
            }
            None => {
                self.locks.unlock(&keys)?;
                Err(LoadError::ExecutorGone)
            }
        }
    }
}

impl Drop for LoadExecutor {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the queued jobs; join it (teardown, contract 9).
        self.tx.take();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("load stream thread panicked");
        }
    }
}

/// Runs `plan` op by op on the load thread. On the first failure the plan's remaining events are
/// marked failed and its host pages released (every copy of this backend is synchronous, so none is
/// still reading them).
fn run_plan(ctx: &LoadContext, options: &LoadOptions, plan: &LoadPlan) -> Result<(), LoadError> {
    let mut released = false;
    for (i, op) in plan.ops.iter().enumerate() {
        let step = match *op {
            LoadOp::WaitFence { fence } => ctx.forward.wait_fence(fence, options.fence_timeout),
            LoadOp::Copy { pool, layer } => {
                if let Some((p, l, d)) = options.delay
                    && p == pool
                    && l == layer
                {
                    std::thread::sleep(d);
                }
                plan.pages.iter().try_for_each(|copy| {
                    let bytes = ctx.host.read(pool, layer, copy.host_page)?;
                    ctx.device.write(pool, layer, copy.device_page, &bytes)
                })
            }
            LoadOp::Record {
                pool,
                layer,
                generation,
            } => {
                ctx.events.complete(pool, layer, generation);
                Ok(())
            }
            LoadOp::ReleaseHostPages => {
                released = true;
                ctx.locks.unlock(&plan.host_keys()).map_err(LoadError::from)
            }
        };
        if let Err(e) = step {
            ctx.events.fail_from(plan, i);
            if !released && let Err(unlock) = ctx.locks.unlock(&plan.host_keys()) {
                tracing::error!(generation = plan.generation, error = %unlock, "host page unlock after a failed load");
            }
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_waits_only_for_rounds_begun_before_it() {
        let fwd = ForwardStream::new();
        let a = fwd.begin_round();
        let fence = fwd.fence();
        let b = fwd.begin_round();
        let t = Duration::from_millis(10);
        assert!(matches!(
            fwd.wait_fence(fence, t),
            Err(LoadError::FenceTimeout { .. })
        ));
        fwd.end_round(a);
        assert_eq!(
            fwd.wait_fence(fence, t),
            Ok(()),
            "round b began after the fence"
        );
        fwd.end_round(b);
    }
}
