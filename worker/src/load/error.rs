//! Errors of load-before-read: of loads, of waits on their events, and of the backends that run them
//! (the host backend in [`super::order`], the CUDA backend in `stream_cuda`).

use std::time::Duration;

use super::host_locks::UnlockUnderflow;
use super::plan::PlanViolation;
use crate::memory::pool::PoolRole;

/// Errors of loads and of waits on their events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// A wait on an event whose generation no submitted job recorded: the consumer reads a pool
    /// that no load covers (R-HIC-2; sglang PR #38472: a device wait on such an event returns at
    /// once, so it must be refused before it reaches the device).
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
    /// The executor (host thread or CUDA completion thread) is gone, or dropped the job unfinished.
    #[error("load executor is shut down")]
    ExecutorGone,
    /// Host lock bookkeeping broke.
    #[error(transparent)]
    Unlock(#[from] UnlockUnderflow),
    /// A plan broke an ordering rule (see [`super::plan::check_load_plan`]).
    #[error(transparent)]
    Plan(#[from] PlanViolation),
    /// The host and device pools of one role disagree on the bytes a page holds on a layer, so a
    /// copy would truncate or overrun.
    #[error("{pool}: host chunk is {host} bytes, device chunk is {device} bytes")]
    GeometryMismatch {
        /// Pool.
        pool: PoolRole,
        /// Host bytes per page-layer chunk.
        host: u64,
        /// Device bytes per page-layer chunk.
        device: u64,
    },
    /// A pool's bytes overflow the address space.
    #[error("{pool}: pool size overflows")]
    PoolTooLarge {
        /// Pool.
        pool: PoolRole,
    },
    /// No usable CUDA device: built without `cuda`, `libcuda` absent, or no such ordinal.
    #[error("CUDA device unavailable: {reason}")]
    DeviceUnavailable {
        /// Why.
        reason: String,
    },
    /// A CUDA driver call failed (the call's name and the driver's message).
    #[error("{call} failed: {message}")]
    Device {
        /// Driver call, e.g. `cuMemcpyHtoDAsync`.
        call: &'static str,
        /// Driver error text.
        message: String,
    },
}
