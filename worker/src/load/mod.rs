//! Load-before-read (DESIGN contract 5; seed 004 BugFix #2; reference/dataplane.md R-HIC-1..4):
//! per layer and per pool, a load completion event; compute for layer `i` waits on the events of
//! every pool it reads (KV and indexer); waiting on an event that was never recorded is an error;
//! a load may not overwrite pages that in-flight compute still reads.
//!
//! - [`plan`]: the pure plan — fence, per-layer per-pool copies and events, host release — and the
//!   waits compute enqueues, with checkers of both;
//! - [`event_ledger`]: recorded / complete / failed per (pool, layer) and generation, and job
//!   acknowledgements, shared by both backends;
//! - [`error`]: errors of loads, waits and backends;
//! - two backends run the same plans: [`order`] (host: a load thread beside compute) and
//!   `stream_cuda` (feature `cuda`: CUDA streams and events);
//! - [`host_locks`]: host pages locked until the load (or backup) that reads them is acknowledged.

pub mod error;
pub mod event_ledger;
pub mod host_locks;
pub mod order;
pub mod plan;
#[cfg(feature = "cuda")]
pub mod stream_cuda;
