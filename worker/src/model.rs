//! Model identity and KV-cache geometry: the types cross the operator/worker boundary and live in
//! `tandem-interfaces` (worker/interfaces/README.md §2); re-exported here.

pub use tandem_interfaces::model::*;
