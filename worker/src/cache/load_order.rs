//! Load-before-read: a load executor ("load stream") beside compute ("forward stream"), with a
//! completion event per layer and per pool (DESIGN contract 5; seed 004 BugFix #2; reference/
//! dataplane.md R-HIC-1..4).
//!
//! The rules, each with the failure it prevents:
//! - **Per-layer, per-pool events.** A load job copies layer by layer and, for every pool it loads
//!   (the KV pool and sidecars such as the indexer pool), completes that (pool, layer)'s event after
//!   the layer's copies. Compute for layer *i* waits on layer *i*'s event of **every** pool it reads
//!   ([`wait_layer`]): the indexer kernel that ran on a half-loaded indexer cache is seed 004 BugFix #2
//!   (sglang PR #22811; #27504 for the extra pools' IO never awaited).
//! - **Recorded before waited.** Events are recorded when the job is submitted (the CPU side of
//!   `cudaEventRecord`); waiting on an event whose generation was never recorded is
//!   [`LoadError::NeverRecorded`], not a silent no-op (sglang PR #38472: a device wait on an
//!   unrecorded event returns at once).
//! - **Fence behind the forward stream.** A job captures the forward stream's position at submission
//!   and writes nothing until every forward round submitted before it has finished, so a load never
//!   overwrites pages that in-flight compute still reads (sglang PR #36738).
//! - **Host lock until ack.** The job's source host pages are locked in [`HostPageLocks`] from
//!   submission until the job is acknowledged; L2 eviction skips them (sglang PR #31427).
//!
//! This is the host backend: "device" pages are host memory ([`PagePools`]) and the load stream is a
//! thread. The negative controls ([`ReadPolicy::UnsafeSkipPool`], [`FencePolicy::UnsafeSkipFence`],
//! `EvictionPolicy::UnsafeIgnoreLocks`) exist only so tests can show that removing a rule produces
//! stale reads (`tests/cache_load_order.rs`).

use std::collections::{BTreeSet, HashMap};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::host_locks::{HostPageLocks, UnlockUnderflow};
use super::page_key::PageKey;
use crate::pool::PoolRole;

/// Errors of loads and of waits on their events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// A wait on an event whose generation no submitted job recorded: the consumer reads a pool
    /// that no load covers (R-HIC-2).
    #[error("waited on {pool} layer {layer} generation {generation}, which was never recorded")]
    NeverRecorded {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// Generation waited for.
        generation: u64,
    },
    /// The event did not complete within the wait's deadline.
    #[error("{pool} layer {layer} generation {generation} not loaded after {waited:?}")]
    Timeout {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// Generation waited for.
        generation: u64,
        /// Time waited.
        waited: Duration,
    },
    /// The load of that (pool, layer) failed; its pages must not be read.
    #[error("{pool} layer {layer} generation {generation}: load failed")]
    LoadFailed {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// Generation of the failed load.
        generation: u64,
    },
    /// The forward rounds a job is fenced behind did not finish in time; nothing was written.
    #[error("fence at forward round {fence} not reached after {waited:?}")]
    FenceTimeout {
        /// The fence position.
        fence: u64,
        /// Time waited.
        waited: Duration,
    },
    /// A page index, layer or pool outside the pools' geometry.
    #[error("{pool} layer {layer} page {page} is outside the pool")]
    OutOfRange {
        /// Pool.
        pool: PoolRole,
        /// Layer.
        layer: u32,
        /// Page.
        page: u32,
    },
    /// A job was not acknowledged within the wait's deadline.
    #[error("load generation {generation} not acknowledged after {waited:?}")]
    AckTimeout {
        /// Generation of the job.
        generation: u64,
        /// Time waited.
        waited: Duration,
    },
    /// The executor thread is gone (shut down).
    #[error("load executor is shut down")]
    ExecutorGone,
    /// Host lock bookkeeping broke.
    #[error(transparent)]
    Unlock(#[from] UnlockUnderflow),
}

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

#[derive(Debug, Default, Clone, Copy)]
struct EventState {
    recorded: u64,
    completed: u64,
    failed: u64,
}

/// Completion events per (pool, layer), by generation (one generation per load job).
#[derive(Default)]
pub struct LayerEvents {
    table: Mutex<HashMap<(PoolRole, u32), EventState>>,
    changed: Condvar,
}

impl LayerEvents {
    /// An empty table: every event is unrecorded.
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
        e.failed = e.failed.max(generation);
        drop(t);
        self.changed.notify_all();
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
            let e = t.get(&(pool, layer)).copied().unwrap_or_default();
            if e.recorded < generation {
                return Err(LoadError::NeverRecorded {
                    pool,
                    layer,
                    generation,
                });
            }
            if e.completed >= generation {
                return Ok(());
            }
            if e.failed >= generation {
                return Err(LoadError::LoadFailed {
                    pool,
                    layer,
                    generation,
                });
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

/// Which pools a consumer waits on before reading a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPolicy {
    /// Wait on every pool read (the rule).
    WaitEveryPool,
    /// Negative control: skip the wait on one pool (the seed 004 BugFix #2 bug when it is the
    /// indexer pool).
    UnsafeSkipPool(PoolRole),
}

/// Waits, before compute reads `layer`, on that layer's events of every pool in `reads`
/// (R-HIC-1).
///
/// # Errors
/// The first [`LayerEvents::wait`] error.
pub fn wait_layer(
    events: &LayerEvents,
    layer: u32,
    reads: &[PoolRole],
    generation: u64,
    timeout: Duration,
    policy: ReadPolicy,
) -> Result<(), LoadError> {
    for pool in reads {
        if policy == ReadPolicy::UnsafeSkipPool(*pool) {
            continue;
        }
        events.wait(*pool, layer, generation, timeout)?;
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

/// Whether a load waits for the forward rounds submitted before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FencePolicy {
    /// Wait (the rule, R-HIC-3).
    WaitForward,
    /// Negative control: write at once (sglang PR #36738 bug).
    UnsafeSkipFence,
}

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
#[derive(Debug, Clone)]
pub struct LoadJob {
    /// Pools to load (e.g. the KV pool and the indexer pool).
    pub pools: Vec<PoolRole>,
    /// Layers to load, from 0.
    pub layers: u32,
    /// Pages to copy.
    pub pages: Vec<PageCopy>,
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

type AckSlot = Arc<(Mutex<Option<Result<(), LoadError>>>, Condvar)>;

/// A submitted job: its generation (what consumers wait for) and its acknowledgement.
pub struct LoadTicket {
    /// Generation of the job's events.
    pub generation: u64,
    ack: AckSlot,
}

impl LoadTicket {
    /// Blocks until the job is acknowledged (all copies done, host pages unlocked) or failed, at
    /// most `timeout`.
    ///
    /// # Errors
    /// The job's error, or [`LoadError::AckTimeout`] (also what a dead executor looks like: the
    /// caller must then keep the destination pages out of use).
    pub fn wait_ack(&self, timeout: Duration) -> Result<(), LoadError> {
        let start = Instant::now();
        let (slot, cv) = &*self.ack;
        let mut r = slot.lock().unwrap_or_else(|p| p.into_inner());
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
            r = cv
                .wait_timeout(r, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

struct Submitted {
    job: LoadJob,
    generation: u64,
    fence: u64,
    ack: AckSlot,
}

/// The load stream: one thread running jobs in submission order.
pub struct LoadExecutor {
    tx: Option<mpsc::Sender<Submitted>>,
    thread: Option<JoinHandle<()>>,
    events: Arc<LayerEvents>,
    forward: Arc<ForwardStream>,
    locks: Arc<HostPageLocks>,
    next_generation: Mutex<u64>,
}

/// What the executor copies between and the state it shares with compute.
pub struct LoadContext {
    /// Source pages (L2 host pool).
    pub host: Arc<PagePools>,
    /// Destination pages (L1 device pool; host memory in this backend).
    pub device: Arc<PagePools>,
    /// Completion events shared with compute.
    pub events: Arc<LayerEvents>,
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
        let thread = std::thread::Builder::new()
            .name("load-stream".into())
            .spawn(move || {
                for s in rx {
                    let result = run_job(&ctx, &options, &s);
                    let keys: Vec<PageKey> = s.job.pages.iter().map(|p| p.key).collect();
                    let unlocked = ctx.locks.unlock(&keys).map_err(LoadError::from);
                    let (slot, cv) = &*s.ack;
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(result.and(unlocked));
                    cv.notify_all();
                }
            })
            .map_err(|_| LoadError::ExecutorGone)?;
        Ok(LoadExecutor {
            tx: Some(tx),
            thread: Some(thread),
            events,
            forward,
            locks,
            next_generation: Mutex::new(0),
        })
    }

    /// Submits `job`: assigns its generation, records its events, captures the forward fence and
    /// locks its host pages, then queues it. Returns at once.
    ///
    /// # Errors
    /// [`LoadError::ExecutorGone`] (the host locks taken are released again).
    pub fn submit(&self, job: LoadJob) -> Result<LoadTicket, LoadError> {
        let generation = {
            let mut g = self
                .next_generation
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *g += 1;
            *g
        };
        for layer in 0..job.layers {
            for pool in &job.pools {
                self.events.record(*pool, layer, generation);
            }
        }
        let keys: Vec<PageKey> = job.pages.iter().map(|p| p.key).collect();
        self.locks.lock(&keys);
        let ack: AckSlot = Arc::new((Mutex::new(None), Condvar::new()));
        let submitted = Submitted {
            job,
            generation,
            fence: self.forward.fence(),
            ack: Arc::clone(&ack),
        };
        let sent = self.tx.as_ref().map(|tx| tx.send(submitted));
        if !matches!(sent, Some(Ok(()))) {
            self.locks.unlock(&keys)?;
            return Err(LoadError::ExecutorGone);
        }
        Ok(LoadTicket { generation, ack })
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

fn run_job(ctx: &LoadContext, options: &LoadOptions, s: &Submitted) -> Result<(), LoadError> {
    let fail_from = |layer: u32| {
        for l in layer..s.job.layers {
            for pool in &s.job.pools {
                ctx.events.fail(*pool, l, s.generation);
            }
        }
    };
    if options.fence == FencePolicy::WaitForward
        && let Err(e) = ctx.forward.wait_fence(s.fence, options.fence_timeout)
    {
        fail_from(0);
        return Err(e);
    }
    for layer in 0..s.job.layers {
        for pool in &s.job.pools {
            if let Some((p, l, d)) = options.delay
                && p == *pool
                && l == layer
            {
                std::thread::sleep(d);
            }
            for copy in &s.job.pages {
                let copied = ctx
                    .host
                    .read(*pool, layer, copy.host_page)
                    .and_then(|bytes| ctx.device.write(*pool, layer, copy.device_page, &bytes));
                if let Err(e) = copied {
                    fail_from(layer);
                    return Err(e);
                }
            }
            ctx.events.complete(*pool, layer, s.generation);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_on_an_unrecorded_event_is_an_error_not_a_no_op() {
        let ev = LayerEvents::new();
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
