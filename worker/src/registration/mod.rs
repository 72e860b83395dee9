//! Transactional registration of KV pools with the L3 store (DESIGN contract 2, seed 000).
//!
//! - [`registry`]: the worker's registration table (duplicates, overlaps, busy, quarantine);
//! - [`txn`]: the transaction ALLOCATED → REGISTERING → COMMITTED / FALLBACK_L2 / FAILED, its policy and
//!   the [`txn::PoolMap`] that is the only visible state;
//! - [`metrics`]: fallback / rollback / quarantine counters;
//! - [`fault`]: fault injection at every external call, for tests and benchmarks.

pub mod fault;
pub mod metrics;
pub mod registry;
pub mod txn;

pub use registry::{DeregisterError, RegisterError, RegistrationId, RegistrationState, Registry};
pub use txn::{
    AttachOutcome, CommittedPool, FailurePolicy, Phase, PoolMap, Registrar, RegistrarConfig,
    RegistrationFailure, TxnOrder, TxnState,
};
