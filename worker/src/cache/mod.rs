//! The Mooncake request trace and its replay through the prefix index ([`trace`]).
//!
//! The trace format itself lives in `tandem-interfaces` (worker/interfaces/README.md §7); this
//! module maps it onto the tiers: the page keys of a request and its replay through the shared
//! index ([`crate::tier`]) or the L3 store ([`crate::l3::replay`]).

pub mod trace;

impl crate::l3::replay::ReplayRequest for trace::TraceRequest {
    fn input_tokens(&self) -> u64 {
        u64::from(self.input_length)
    }

    fn page_tokens(&self) -> u64 {
        trace::TRACE_BLOCK_TOKENS
    }

    fn page_keys(&self) -> Vec<crate::tier::PageKey> {
        trace::TracePageKeys::page_keys(self)
    }
}
