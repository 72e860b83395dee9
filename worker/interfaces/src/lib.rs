//! Tandem's process boundaries: every type that one process writes and another reads
//! (DESIGN §1; the document is `worker/interfaces/README.md`, the "§n" below).
//!
//! - [`config`]: the worker config the operator renders into a pool's ConfigMap and the cache-tier
//!   config of a store replica (§2), with [`model`] (model identity and KV geometry) and
//!   [`memory`] (allocator domain, client mode, registration failure policy, pool layout) that they
//!   embed;
//! - [`peer`]: the gRPC peer protocol between workers (§6);
//! - [`report`]: the `/report` document of every worker role (§4);
//! - [`trace`]: the one trace request type, the Mooncake FAST'25 schema (§7).
//!
//! No I/O, no async runtime, no gRPC stack: parsing works on strings and readers the caller opened;
//! the peer protocol's client and server are generated in the worker.

pub mod config;
pub mod memory;
pub mod model;
pub mod peer;
pub mod report;
pub mod trace;
