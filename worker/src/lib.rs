//! Tandem data plane (see DESIGN §3). The crate has no Kubernetes dependency.

pub mod memory;
pub mod model;
pub mod pool;
pub mod room;
pub mod transfer;
