//! The Mooncake request trace and its replay through the prefix index ([`trace`]).
//!
//! Transitional: the trace format moves to `tandem-interfaces`; the tiers' shared index is
//! [`crate::tier`], load-before-read [`crate::load`] and the L3 store [`crate::l3`]. `config.rs`
//! still names the L3 object identity as `crate::cache::manifest`, hence the alias below (it goes
//! when the config moves to `tandem-interfaces`).

pub mod trace;

#[doc(hidden)]
pub use crate::l3::manifest;

impl crate::l3::replay::ReplayRequest for trace::TraceRequest {
    fn input_tokens(&self) -> u64 {
        self.input_length
    }

    fn page_tokens(&self) -> u64 {
        trace::TRACE_BLOCK_TOKENS
    }

    fn page_keys(&self) -> Vec<crate::tier::PageKey> {
        trace::TraceRequest::page_keys(self)
    }
}
