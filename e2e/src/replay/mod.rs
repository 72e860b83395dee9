//! Trace replay against a DecodePool's front door (issue 8).
//!
//! * [`workload`]: the Mooncake trace schema, its loader, and a seeded generator in the same schema.
//! * [`schedule`]: pure timing rules (scaled send times, back-off, outcome classes).
//! * [`front_door`]: the wire format of worker/interfaces/README.md §3 and an incremental SSE
//!   decoder.
//! * [`targets`]: fixed URLs or the Ready decode pods of a DecodePool, refreshed while it runs.
//! * [`driver`]: sends each request at its scaled time, streams it, times it, retries elsewhere.

pub mod driver;
pub mod front_door;
pub mod schedule;
pub mod targets;
pub mod workload;

pub use driver::{ReplayConfig, ReplayProgress, RequestResult, replay};
pub use schedule::{Clock, Outcome};
pub use targets::TargetSet;
pub use workload::{GeneratorConfig, TraceRequest};
