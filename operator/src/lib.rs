//! Tandem operator (DESIGN §4): one controller per kind, each
//! `read → validate (pure) → build desired objects (pure) → server-side apply → status`.
//!
//! Pure parts, unit-tested from YAML fixtures with no API server:
//! - [`labels`]: names and labels of everything the operator creates;
//! - [`policy`]: a pool's KV host-memory policy resolved against its CacheTier, or a conflict;
//! - [`scaling`]: the P:D ratio and GPU-budget transactions;
//! - [`render`]: the worker config and the Kubernetes objects of a pool or tier.

pub mod labels;
pub mod policy;
pub mod quantity;
pub mod render;
pub mod scaling;
