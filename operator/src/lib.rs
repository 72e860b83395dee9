//! Tandem operator (DESIGN §4): one controller per kind, each
//! `read → validate (pure) → the desired set (pure) → server-side apply → status (pure)`; the two
//! pool kinds share one staged path ([`controller::pool`]).
//!
//! Pure parts, unit-tested with no API server:
//! - [`labels`]: names and labels of everything the operator creates;
//! - [`policy`]: a pool's KV host-memory policy resolved against its CacheTier, or a conflict;
//! - [`scaling`]: the P:D ratio and GPU-budget transactions; [`capacity`]: that transaction
//!   across reconciles (shrink before grow, unschedulable rollback);
//! - [`render`]: the worker and tier configs and the Kubernetes objects of a pool or tier;
//! - [`rollout`]: the rolling-restart state machine; [`recovery`]: bounded group recovery
//!   (`maxGroupRestarts`); [`teardown`]: the teardown step planner;
//! - [`status`]: typed conditions whose transition time moves only on a flip;
//! - [`gang`]: the group-ready readiness gate of multi-pod groups (a partial group never serves).
//!
//! I/O: [`controller`] (the reconcilers, tested against a mock API with tower-test),
//! [`metrics`] (Prometheus), and the `tandem-operator` binary (`src/main.rs`).

pub mod capacity;
pub mod controller;
pub mod gang;
pub mod labels;
pub mod metrics;
pub mod policy;
pub mod quantity;
pub mod recovery;
pub mod render;
pub mod rollout;
pub mod scaling;
pub mod status;
pub mod teardown;
