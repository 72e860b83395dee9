//! Load-before-read, CUDA backend (feature `cuda`): the plans of [`super::plan`] on a
//! non-blocking CUDA load stream beside the engine's forward stream, with one CUDA event per
//! (pool, layer) and job (DESIGN contract 5; seed 004 BugFix #2; reference/dataplane.md R-HIC-1..4).
//!
//! How each [`LoadOp`] runs, all enqueued by [`CudaLoadStream::submit`] before it returns:
//! - [`LoadOp::WaitFence`]: an event recorded on the forward stream at submission, which the load
//!   stream waits on (`cuStreamWaitEvent`), so no copy overwrites pages that compute enqueued
//!   earlier still reads (sglang PR #36738);
//! - [`LoadOp::Copy`]: `cuMemcpyHtoDAsync` of every page's chunk of that (pool, layer), from pinned
//!   host pages ([`PinnedPagePools`], `cuMemHostAlloc`: pageable memory would make the copy
//!   synchronous and staging-bound) into device pages ([`DevicePagePools`]);
//! - [`LoadOp::Record`]: `cuEventRecord` of a fresh event on the load stream, then the
//!   [`EventLedger`] record — so the ledger never shows a generation whose CUDA event does not exist
//!   yet, and a consumer can never enqueue a wait ahead of the record (sglang PR #38472:
//!   `cuStreamWaitEvent` on a never-recorded event returns at once);
//! - [`LoadOp::ReleaseHostPages`]: handed to a small completion thread, which synchronizes the job's
//!   events in order (blocking-sync events: it sleeps, never spins, and never blocks the forward
//!   stream), completes each in the ledger, and only after the final one unlocks the host pages and
//!   acknowledges the ticket (sglang PR #31427).
//!
//! Compute calls [`CudaLoadStream::wait_layer`] before enqueuing the kernels of layer *i*: it
//! enqueues `cuStreamWaitEvent` on the forward stream for every pool the layer reads (plan
//! [`plan_layer_reads`]) and returns without blocking the host; a pool no load recorded is
//! [`LoadError::NeverRecorded`].
//!
//! Without `libcuda` or a device, [`open_context`] returns [`LoadError::DeviceUnavailable`]; it checks
//! `is_culib_present()` before any other cudarc call, because an unguarded one panics when the
//! library is absent (reference/rust-stack.md §4). Every type here needs a context from it.
//!
//! Device check (a GPU machine): `cargo test -p tandem-worker --features cuda --test
//! load_order_cuda -- --include-ignored` runs the delayed-indexer-load scenario on the GPU
//! (with the waits: zero mismatches; without the indexer wait: the stale pages are found).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result, sys};

use super::error::LoadError;
use super::event_ledger::{Acknowledger, EventLedger, EventStatus, LoadTicket};
use super::host_locks::HostPageLocks;
use super::plan::{
    FencePolicy, LoadJob, LoadOp, LoadPlan, ReadOp, ReadPolicy, plan_layer_reads, plan_load,
};
use crate::memory::pool::{KvGeometry, PoolRole};
use crate::tier::page_key::PageKey;

/// Opens device `ordinal`'s primary context.
///
/// # Errors
/// [`LoadError::DeviceUnavailable`] when `libcuda` cannot be loaded (checked first, so no cudarc call
/// can panic) or the driver has no such device.
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, LoadError> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(LoadError::DeviceUnavailable {
            reason: "the CUDA driver library (libcuda.so) cannot be loaded".into(),
        });
    }
    CudaContext::new(ordinal).map_err(|e| LoadError::DeviceUnavailable {
        reason: format!("device {ordinal}: {e}"),
    })
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> LoadError {
    move |e| LoadError::Device {
        call,
        message: e.to_string(),
    }
}

/// Where each pool's chunks lie in one allocation: pools back to back, each laid out by its
/// [`KvGeometry`] (a chunk = one page on one layer).
#[derive(Debug, Clone)]
struct PoolSet {
    pools: Vec<(PoolRole, KvGeometry, u64)>,
    total: u64,
}

impl PoolSet {
    fn new(pools: &[(PoolRole, KvGeometry)]) -> Result<Self, LoadError> {
        let mut total = 0u64;
        let mut placed = Vec::with_capacity(pools.len());
        for (role, geometry) in pools {
            let bytes = geometry
                .total_bytes()
                .and_then(|b| total.checked_add(b))
                .ok_or(LoadError::PoolTooLarge { pool: *role })?;
            placed.push((*role, *geometry, total));
            total = bytes;
        }
        Ok(PoolSet {
            pools: placed,
            total,
        })
    }

    fn geometry(&self, pool: PoolRole) -> Option<&KvGeometry> {
        self.pools.iter().find(|p| p.0 == pool).map(|p| &p.1)
    }

    /// Byte offset and length of (pool, layer, page)'s chunk.
    fn chunk(&self, pool: PoolRole, layer: u32, page: u32) -> Result<(u64, u64), LoadError> {
        self.pools
            .iter()
            .find(|p| p.0 == pool)
            .and_then(|(_, g, base)| Some((base + g.chunk_offset(page, layer)?, g.chunk_bytes())))
            .ok_or(LoadError::OutOfRange { pool, layer, page })
    }
}

/// Pinned (page-locked, `cuMemHostAlloc`) host pages of several pools: the L2 side of a load.
/// Writes from the host are serialized; a page a load reads must be protected by the host page
/// lock (L2 eviction skips it), not by this type.
pub struct PinnedPagePools {
    ctx: Arc<CudaContext>,
    base: *mut u8,
    set: PoolSet,
    writes: Mutex<()>,
}

// SAFETY: `base` is a driver allocation owned by this value; host access goes through `writes` or
// copies out, and device access is by DMA, which the host page locks order against host writes.
unsafe impl Send for PinnedPagePools {}
// SAFETY: as for `Send`.
unsafe impl Sync for PinnedPagePools {}

impl PinnedPagePools {
    /// Zeroed pinned pages for `pools` (role, geometry).
    ///
    /// # Errors
    /// [`LoadError::PoolTooLarge`], or [`LoadError::Device`] (`cuMemHostAlloc`).
    pub fn new(
        ctx: &Arc<CudaContext>,
        pools: &[(PoolRole, KvGeometry)],
    ) -> Result<Self, LoadError> {
        let set = PoolSet::new(pools)?;
        let len = usize::try_from(set.total).map_err(|_| LoadError::PoolTooLarge {
            pool: pools.first().map_or(PoolRole::Target, |p| p.0),
        })?;
        let base = if len == 0 {
            std::ptr::null_mut()
        } else {
            ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
            // SAFETY: a fresh allocation of `len` bytes, zeroed below before any read.
            let p = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(driver("cuMemHostAlloc"))?
                .cast::<u8>();
            // SAFETY: `p` points to `len` writable bytes.
            unsafe { std::ptr::write_bytes(p, 0, len) };
            p
        };
        Ok(PinnedPagePools {
            ctx: Arc::clone(ctx),
            base,
            set,
            writes: Mutex::new(()),
        })
    }

    fn chunk_ptr(
        &self,
        pool: PoolRole,
        layer: u32,
        page: u32,
    ) -> Result<(*mut u8, usize), LoadError> {
        let (off, len) = self.set.chunk(pool, layer, page)?;
        // In range of the allocation, whose length fits in usize (checked in `new`).
        Ok((self.base.wrapping_add(off as usize), len as usize))
    }

    /// Overwrites (pool, layer, page) with `bytes`, truncated or zero-padded to the chunk.
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
        let (dst, len) = self.chunk_ptr(pool, layer, page)?;
        let n = bytes.len().min(len);
        let _serial = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `dst..dst+len` lies in this allocation; host writers are serialized by `writes`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, n);
            std::ptr::write_bytes(dst.add(n), 0, len - n);
        }
        Ok(())
    }

    /// A copy of (pool, layer, page).
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`].
    pub fn read(&self, pool: PoolRole, layer: u32, page: u32) -> Result<Vec<u8>, LoadError> {
        let (src, len) = self.chunk_ptr(pool, layer, page)?;
        let _serial = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `src..src+len` lies in this allocation; no host writer runs concurrently.
        Ok(unsafe { std::slice::from_raw_parts(src, len) }.to_vec())
    }
}

impl Drop for PinnedPagePools {
    fn drop(&mut self) {
        if self.base.is_null() {
            return;
        }
        // No copy can still read these pages: every load holds an `Arc` of them until its events
        // completed.
        let freed = self
            .ctx
            .bind_to_thread()
            // SAFETY: `base` came from `malloc_host` and is freed once, here.
            .and_then(|()| unsafe { result::free_host(self.base.cast::<c_void>()) });
        if let Err(e) = freed {
            tracing::error!(error = %e, "cuMemFreeHost of pinned load pages failed");
        }
    }
}

/// Device pages of several pools in one `cuMemAlloc` allocation: the L1 side of a load.
pub struct DevicePagePools {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    set: PoolSet,
}

impl DevicePagePools {
    /// Zeroed device pages for `pools` (role, geometry).
    ///
    /// # Errors
    /// [`LoadError::PoolTooLarge`], or [`LoadError::Device`] (`cuMemAlloc`, `cuMemsetD8`).
    pub fn new(
        ctx: &Arc<CudaContext>,
        pools: &[(PoolRole, KvGeometry)],
    ) -> Result<Self, LoadError> {
        let set = PoolSet::new(pools)?;
        let len = usize::try_from(set.total).map_err(|_| LoadError::PoolTooLarge {
            pool: pools.first().map_or(PoolRole::Target, |p| p.0),
        })?;
        let base = if len == 0 {
            0
        } else {
            ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
            // SAFETY: the context is current; freed once in `Drop`.
            let p = unsafe { result::malloc_sync(len) }.map_err(driver("cuMemAlloc"))?;
            // SAFETY: `p` is `len` bytes of device memory just allocated.
            if let Err(e) = unsafe { result::memset_d8_sync(p, 0, len) } {
                // SAFETY: nothing else references `p`.
                let _ = unsafe { result::free_sync(p) };
                return Err(driver("cuMemsetD8")(e));
            }
            p
        };
        Ok(DevicePagePools {
            ctx: Arc::clone(ctx),
            base,
            set,
        })
    }

    /// Device address and length of (pool, layer, page)'s chunk (what kernels read).
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`].
    pub fn chunk_ptr(
        &self,
        pool: PoolRole,
        layer: u32,
        page: u32,
    ) -> Result<(sys::CUdeviceptr, usize), LoadError> {
        let (off, len) = self.set.chunk(pool, layer, page)?;
        Ok((self.base + off, len as usize))
    }

    /// Overwrites (pool, layer, page) with `bytes` (truncated or zero-padded), synchronously: the
    /// whole context is synchronized after the copy. For setup and tests, never on the hot path.
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`] or [`LoadError::Device`].
    pub fn write_sync(
        &self,
        pool: PoolRole,
        layer: u32,
        page: u32,
        bytes: &[u8],
    ) -> Result<(), LoadError> {
        let (dst, len) = self.chunk_ptr(pool, layer, page)?;
        let mut chunk = bytes[..bytes.len().min(len)].to_vec();
        chunk.resize(len, 0);
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: `dst..dst+len` lies in this allocation.
        unsafe { result::memcpy_htod_sync(dst, &chunk) }.map_err(driver("cuMemcpyHtoD"))?;
        // A pageable HtoD copy may return before its DMA lands, and non-blocking streams do not
        // order behind it: synchronize so later stream work sees the bytes.
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
    }

    /// A copy of (pool, layer, page), after synchronizing the whole context. For verification and
    /// tests, never on the hot path.
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`] or [`LoadError::Device`].
    pub fn read_sync(&self, pool: PoolRole, layer: u32, page: u32) -> Result<Vec<u8>, LoadError> {
        let (src, len) = self.chunk_ptr(pool, layer, page)?;
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))?;
        let mut out = vec![0u8; len];
        // SAFETY: `src..src+len` lies in this allocation; the context is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, src) }.map_err(driver("cuMemcpyDtoH"))?;
        Ok(out)
    }

    /// Enqueues on `stream` a device-to-device copy of (pool, layer, page) into the same chunk of
    /// `to` — how the device check models compute reading a page (a kernel reads it the same way,
    /// in stream order).
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`] (also when the chunks differ in size) or [`LoadError::Device`].
    pub fn copy_chunk_async(
        &self,
        pool: PoolRole,
        layer: u32,
        page: u32,
        to: &DevicePagePools,
        stream: &CudaStream,
    ) -> Result<(), LoadError> {
        let (src, len) = self.chunk_ptr(pool, layer, page)?;
        let (dst, dst_len) = to.chunk_ptr(pool, layer, page)?;
        if dst_len != len {
            return Err(LoadError::OutOfRange { pool, layer, page });
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: both ranges lie in live allocations of this context.
        unsafe { result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
            .map_err(driver("cuMemcpyDtoDAsync"))
    }
}

impl Drop for DevicePagePools {
    fn drop(&mut self) {
        if self.base == 0 {
            return;
        }
        // Streams may still read these pages (compute holds no `Arc`): wait for the context first.
        let freed = self
            .ctx
            .synchronize()
            // SAFETY: `base` came from `malloc_sync` and is freed once, here.
            .and_then(|()| unsafe { result::free_sync(self.base) });
        if let Err(e) = freed {
            tracing::error!(error = %e, "cuMemFree of device load pages failed");
        }
    }
}

/// Options of the CUDA load stream, including the test-only fault and the negative control.
#[derive(Debug, Clone)]
pub struct CudaLoadOptions {
    /// Fence policy (`FencePolicy::UnsafeSkipFence` is a negative control).
    pub fence: FencePolicy,
    /// Test fault: hold the load stream for this long before the copy of this (pool, layer) (a
    /// host function on the stream; the "slow indexer load").
    pub delay: Option<(PoolRole, u32, Duration)>,
}

impl Default for CudaLoadOptions {
    fn default() -> Self {
        CudaLoadOptions {
            fence: FencePolicy::WaitForward,
            delay: None,
        }
    }
}

/// What the CUDA load stream copies between and the state it shares with compute. All CUDA objects
/// must belong to one context.
pub struct CudaLoadContext {
    /// The engine's forward stream (compute): fenced against, and made to wait on load events.
    pub forward: Arc<CudaStream>,
    /// Source pages (L2, pinned).
    pub host: Arc<PinnedPagePools>,
    /// Destination pages (L1).
    pub device: Arc<DevicePagePools>,
    /// Completion ledger shared with compute and L2 bookkeeping.
    pub events: Arc<EventLedger>,
    /// Host page locks shared with L2 eviction.
    pub locks: Arc<HostPageLocks>,
}

/// The latest not-yet-complete CUDA event per (pool, layer), with its generation.
type PendingMap = HashMap<(PoolRole, u32), (u64, Arc<CudaEvent>)>;
type PendingEvents = Mutex<PendingMap>;

/// One chunk an async copy moves: device destination, pinned host source, bytes.
type ChunkCopy = (sys::CUdeviceptr, *const u8, usize);

fn pending_table(p: &PendingEvents) -> MutexGuard<'_, PendingMap> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// A job whose operations are all enqueued, for the completion thread.
struct InFlight {
    generation: u64,
    keys: Vec<PageKey>,
    records: Vec<(PoolRole, u32, Arc<CudaEvent>)>,
    ack: Acknowledger,
}

#[derive(Default)]
struct SubmitState {
    generation: u64,
    fences: u64,
}

/// The CUDA load stream: executes load plans on its own non-blocking stream and makes the forward
/// stream wait on their per-(pool, layer) events.
pub struct CudaLoadStream {
    load: Arc<CudaStream>,
    forward: Arc<CudaStream>,
    host: Arc<PinnedPagePools>,
    device: Arc<DevicePagePools>,
    events: Arc<EventLedger>,
    locks: Arc<HostPageLocks>,
    options: CudaLoadOptions,
    pending: Arc<PendingEvents>,
    submit: Mutex<SubmitState>,
    tx: Option<mpsc::Sender<InFlight>>,
    thread: Option<JoinHandle<()>>,
}

impl CudaLoadStream {
    /// Creates the load stream (`cuStreamCreate`, non-blocking) and its completion thread.
    ///
    /// # Errors
    /// [`LoadError::GeometryMismatch`] when a device pool has no host pool of equal chunk size,
    /// [`LoadError::Device`] when the pools and the forward stream belong to different contexts or
    /// the stream cannot be created, [`LoadError::ExecutorGone`] if the thread cannot be spawned.
    pub fn new(ctx: CudaLoadContext, options: CudaLoadOptions) -> Result<Self, LoadError> {
        let cuda = ctx.forward.context();
        if *cuda != ctx.host.ctx || *cuda != ctx.device.ctx {
            return Err(LoadError::Device {
                call: "CudaLoadStream::new",
                message: "the forward stream and the page pools belong to different contexts"
                    .into(),
            });
        }
        for (pool, geometry, _) in &ctx.device.set.pools {
            let host = ctx
                .host
                .set
                .geometry(*pool)
                .map_or(0, KvGeometry::chunk_bytes);
            if host != geometry.chunk_bytes() {
                return Err(LoadError::GeometryMismatch {
                    pool: *pool,
                    host,
                    device: geometry.chunk_bytes(),
                });
            }
        }
        let load = cuda.new_stream().map_err(driver("cuStreamCreate"))?;
        let pending: Arc<PendingEvents> = Arc::default();
        let (tx, rx) = mpsc::channel::<InFlight>();
        let thread = {
            let (load, events, locks, pending) = (
                Arc::clone(&load),
                Arc::clone(&ctx.events),
                Arc::clone(&ctx.locks),
                Arc::clone(&pending),
            );
            std::thread::Builder::new()
                .name("load-completion".into())
                .spawn(move || {
                    for job in rx {
                        complete_job(job, &load, &events, &locks, &pending);
                    }
                })
                .map_err(|_| LoadError::ExecutorGone)?
        };
        Ok(CudaLoadStream {
            load,
            forward: ctx.forward,
            host: ctx.host,
            device: ctx.device,
            events: ctx.events,
            locks: ctx.locks,
            options,
            pending,
            submit: Mutex::new(SubmitState::default()),
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// The forward stream compute enqueues on.
    pub fn forward_stream(&self) -> &Arc<CudaStream> {
        &self.forward
    }

    /// Submits `job`: assigns its generation, plans it ([`plan_load`]), locks its host pages and
    /// enqueues every operation on the load stream (fence wait, async copies, event records),
    /// recording each event in the ledger as it is enqueued. Returns without waiting for the device.
    ///
    /// # Errors
    /// [`LoadError::OutOfRange`] for a page outside the pools (nothing is enqueued),
    /// [`LoadError::Device`] for a failed driver call (the plan's events are marked failed and the
    /// host pages released once the load stream is idle), [`LoadError::ExecutorGone`].
    pub fn submit(&self, job: LoadJob) -> Result<LoadTicket, LoadError> {
        // Held while enqueuing, so generations reach the load stream in order.
        let mut state = self.submit.lock().unwrap_or_else(|p| p.into_inner());
        let generation = state.generation + 1;
        let fence = state.fences + 1;
        let plan = plan_load(&job, generation, fence, self.options.fence);
        let copies = self.resolve_copies(&plan)?;
        state.generation = generation;
        state.fences = fence;

        let keys = plan.host_keys();
        self.locks.lock(&keys);
        let (ticket, ack) = LoadTicket::new(generation);
        let mut records = Vec::new();
        for (i, op) in plan.ops.iter().enumerate() {
            let enqueued = match *op {
                LoadOp::WaitFence { .. } => self.enqueue_fence(),
                LoadOp::Copy { pool, layer } => self.enqueue_copy(pool, layer, &copies[i]),
                LoadOp::Record {
                    pool,
                    layer,
                    generation,
                } => self.enqueue_record(pool, layer, generation).map(|event| {
                    records.push((pool, layer, event));
                }),
                LoadOp::ReleaseHostPages => {
                    let job = InFlight {
                        generation,
                        keys: keys.clone(),
                        records: std::mem::take(&mut records),
                        ack,
                    };
                    let sent = self.tx.as_ref().map(|tx| tx.send(job));
                    if !matches!(sent, Some(Ok(()))) {
                        // The job (and its acknowledger) is gone with the send error.
                        self.abort(&plan, &keys);
                        return Err(LoadError::ExecutorGone);
                    }
                    break;
                }
            };
            if let Err(e) = enqueued {
                self.abort(&plan, &keys);
                return Err(e);
            }
        }
        Ok(ticket)
    }

    /// The chunks each [`LoadOp::Copy`] of `plan` copies (dst, src, bytes), indexed like the ops.
    fn resolve_copies(&self, plan: &LoadPlan) -> Result<Vec<Vec<ChunkCopy>>, LoadError> {
        plan.ops
            .iter()
            .map(|op| match *op {
                LoadOp::Copy { pool, layer } => plan
                    .pages
                    .iter()
                    .map(|c| {
                        let (dst, len) = self.device.chunk_ptr(pool, layer, c.device_page)?;
                        let (src, _) = self.host.chunk_ptr(pool, layer, c.host_page)?;
                        Ok((dst, src.cast_const(), len))
                    })
                    .collect(),
                _ => Ok(Vec::new()),
            })
            .collect()
    }

    fn enqueue_fence(&self) -> Result<(), LoadError> {
        let fence = self
            .forward
            .record_event(None)
            .map_err(driver("cuEventRecord"))?;
        self.load.wait(&fence).map_err(driver("cuStreamWaitEvent"))
    }

    fn enqueue_copy(
        &self,
        pool: PoolRole,
        layer: u32,
        chunks: &[ChunkCopy],
    ) -> Result<(), LoadError> {
        if let Some((p, l, d)) = self.options.delay
            && p == pool
            && l == layer
        {
            hold_stream_for(&self.load, d)?;
        }
        self.load
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        for (dst, src, len) in chunks {
            // SAFETY: `src` is a chunk of the pinned pools and `dst` of the device pools; both stay
            // allocated until the job's events complete (the completion thread holds this stream's
            // `Arc`s, and `Drop` joins it), and the host page lock keeps `src` from being rewritten.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(*dst, src.cast::<c_void>(), *len, self.load.cu_stream())
            }
            .result()
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        Ok(())
    }

    fn enqueue_record(
        &self,
        pool: PoolRole,
        layer: u32,
        generation: u64,
    ) -> Result<Arc<CudaEvent>, LoadError> {
        let event = self
            .load
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(driver("cuEventCreate"))?;
        event.record(&self.load).map_err(driver("cuEventRecord"))?;
        let event = Arc::new(event);
        // The CUDA event exists before the ledger says "recorded": a waiter that sees the
        // generation recorded always finds an event to wait on.
        pending_table(&self.pending).insert((pool, layer), (generation, Arc::clone(&event)));
        self.events.record(pool, layer, generation);
        Ok(event)
    }

    /// A submission failed part-way: fail the plan's events, wait until no enqueued copy can still
    /// read the host pages, then release them (or keep them locked if the stream cannot be
    /// synchronized — a leak beats a page reused under a DMA).
    fn abort(&self, plan: &LoadPlan, keys: &[PageKey]) {
        self.events.fail_from(plan, 0);
        {
            let mut pending = pending_table(&self.pending);
            pending.retain(|_, (g, _)| *g != plan.generation);
        }
        match self.load.synchronize() {
            Ok(()) => {
                if let Err(e) = self.locks.unlock(keys) {
                    tracing::error!(generation = plan.generation, error = %e, "host page unlock after a failed submission");
                }
            }
            Err(e) => tracing::error!(
                generation = plan.generation,
                error = %e,
                pages = keys.len(),
                "load stream cannot be synchronized: host pages stay locked"
            ),
        }
    }

    /// Enqueues on the forward stream, before compute reads `layer`, a wait on that layer's event of
    /// every pool in `reads` for `generation` ([`plan_layer_reads`]). Does not block the host; a
    /// pair already complete needs no device wait.
    ///
    /// # Errors
    /// [`LoadError::NeverRecorded`] for a pool no load recorded (no wait is enqueued for it: on the
    /// device it would pass at once), [`LoadError::LoadFailed`], or [`LoadError::Device`].
    pub fn wait_layer(
        &self,
        layer: u32,
        reads: &[PoolRole],
        generation: u64,
        policy: ReadPolicy,
    ) -> Result<(), LoadError> {
        for op in plan_layer_reads(layer, reads, generation, policy) {
            let ReadOp::WaitEvent {
                pool,
                layer,
                generation,
            } = op;
            let event = match self.events.status(pool, layer, generation) {
                EventStatus::Complete => continue,
                EventStatus::Pending => pending_table(&self.pending)
                    .get(&(pool, layer))
                    .map(|(_, e)| Arc::clone(e)),
                EventStatus::NeverRecorded | EventStatus::Failed => None,
            };
            match event {
                Some(event) => self
                    .forward
                    .wait(&event)
                    .map_err(driver("cuStreamWaitEvent"))?,
                // No event: it completed or failed since the first look, or this load stream never
                // recorded it (pending in a ledger another executor shares) — nothing to wait on.
                None => match self.events.status(pool, layer, generation) {
                    EventStatus::Complete => {}
                    EventStatus::Failed => {
                        return Err(LoadError::LoadFailed {
                            pool,
                            layer,
                            generation,
                        });
                    }
                    EventStatus::NeverRecorded | EventStatus::Pending => {
                        return Err(LoadError::NeverRecorded {
                            pool,
                            layer,
                            generation,
                        });
                    }
                },
            }
        }
        Ok(())
    }
}

impl Drop for CudaLoadStream {
    fn drop(&mut self) {
        // The completion thread finishes the queued jobs (their events complete in stream order),
        // then ends with the channel; join it so no job outlives the pools.
        self.tx.take();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("load completion thread panicked");
        }
    }
}

/// Completion thread: observes `job`'s events in order, completes them in the ledger, and after the
/// final one releases the host pages and acknowledges the job.
fn complete_job(
    job: InFlight,
    load: &CudaStream,
    events: &EventLedger,
    locks: &HostPageLocks,
    pending: &PendingEvents,
) {
    let forget = |pool: PoolRole, layer: u32| {
        let mut p = pending_table(pending);
        if p.get(&(pool, layer))
            .is_some_and(|(g, _)| *g == job.generation)
        {
            p.remove(&(pool, layer));
        }
    };
    let mut result = Ok(());
    for (k, (pool, layer, event)) in job.records.iter().enumerate() {
        match event.synchronize() {
            Ok(()) => events.complete(*pool, *layer, job.generation),
            Err(e) => {
                for (pool, layer, _) in &job.records[k..] {
                    events.fail(*pool, *layer, job.generation);
                    forget(*pool, *layer);
                }
                result = Err(driver("cuEventSynchronize")(e));
                break;
            }
        }
        forget(*pool, *layer);
    }
    // After a failure, the copies behind the failed event may still be reading: release the host
    // pages only once the stream is idle.
    let idle = match &result {
        Ok(()) => Ok(()),
        Err(_) => load.synchronize(),
    };
    let unlocked = match idle {
        Ok(()) => locks.unlock(&job.keys).map_err(LoadError::from),
        Err(e) => {
            tracing::error!(generation = job.generation, error = %e, pages = job.keys.len(), "load stream cannot be synchronized: host pages stay locked");
            Ok(())
        }
    };
    job.ack.acknowledge(result.and(unlocked));
}

/// Holds `stream` for `d`: enqueues a host function that sleeps, so the stream's later work starts
/// no earlier than `d` after the stream reaches it. Fault injection for the device checks (a slow
/// load, a long compute round); not for production paths.
///
/// # Errors
/// [`LoadError::Device`] (`cuLaunchHostFunc`).
pub fn hold_stream_for(stream: &CudaStream, d: Duration) -> Result<(), LoadError> {
    unsafe extern "C" fn sleep_on_stream(arg: *mut c_void) {
        // SAFETY: `arg` is the `Box<Duration>` leaked by `hold_stream_for`, passed to exactly this
        // call; the function makes no CUDA call (a host function must not).
        let d = unsafe { Box::from_raw(arg.cast::<Duration>()) };
        std::thread::sleep(*d);
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(driver("cuCtxSetCurrent"))?;
    let arg = Box::into_raw(Box::new(d));
    // SAFETY: the stream is live; ownership of `arg` passes to the host function on success.
    let launched = unsafe {
        result::stream::launch_host_function(stream.cu_stream(), sleep_on_stream, arg.cast())
    };
    if launched.is_err() {
        // SAFETY: a failed launch did not pass `arg` on.
        drop(unsafe { Box::from_raw(arg) });
    }
    launched.map_err(driver("cuLaunchHostFunc"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::pool::PoolLayout;

    fn geometry(layers: u32, pages: u32, chunk: u64) -> KvGeometry {
        KvGeometry {
            bytes_per_token_layer: chunk,
            layers,
            page_tokens: 1,
            pages,
            layout: PoolLayout::LayerFirst,
        }
    }

    #[test]
    fn pools_lie_back_to_back_and_chunks_outside_them_are_typed_errors() {
        let set = PoolSet::new(&[
            (PoolRole::Target, geometry(2, 4, 64)),
            (PoolRole::Indexer, geometry(2, 4, 16)),
        ])
        .expect("fits");
        assert_eq!(set.total, 2 * 4 * 64 + 2 * 4 * 16);
        assert_eq!(set.chunk(PoolRole::Target, 1, 2), Ok(((4 + 2) * 64, 64)));
        assert_eq!(set.chunk(PoolRole::Indexer, 0, 1), Ok((512 + 16, 16)));
        assert!(matches!(
            set.chunk(PoolRole::Indexer, 2, 0),
            Err(LoadError::OutOfRange { .. })
        ));
        assert!(matches!(
            set.chunk(PoolRole::Draft, 0, 0),
            Err(LoadError::OutOfRange { .. })
        ));
    }
}
