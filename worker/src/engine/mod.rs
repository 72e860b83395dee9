//! The simulated engine (DESIGN §3): it stands in for SGLang/vLLM so that everything around it —
//! memory, transfer, the release protocol — runs for real and a corrupted or stale page is *detected*.
//!
//! - [`content`]: KV bytes are a deterministic function of (request, layer, token); every read is
//!   verified against it, and a mismatch names the request whose bytes were found instead.
//! - [`cost`]: compute time from a cost model of the model and GPU (prefill FLOPs, decode memory
//!   traffic), so queueing and timeouts behave like a loaded prefill (seed 004).

pub mod content;
pub mod cost;

pub use content::{ChunkSpec, Corruption, fill_chunk, verify_chunk};
pub use cost::{CostModel, Gpu};
