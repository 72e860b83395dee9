//! Tandem data plane (see DESIGN §3). The crate has no Kubernetes dependency.

pub mod bench;
pub mod cache;
pub mod config;
pub mod control;
pub mod engine;
pub mod layer_split;
pub mod room;
pub mod serve;
pub mod snapshot;
pub mod spec_guard;
pub mod transfer;

pub mod health;
pub mod memory;
pub mod model;
pub mod pool;
pub mod registration;
pub mod store_client;
pub mod teardown;
