//! What the three KV cache tiers share — L1 device pool, L2 host pool, L3 CacheTier store: page
//! keys, the prefix index with per-tier residency, token-weighted hit accounting, and the policy of
//! prefetching from L3 into L2 (reference/dataplane.md R-HIC-5, R-HIC-6).
//!
//! This is its own module, not part of [`crate::l3`] or [`crate::load`], because all of those use it
//! and it uses none of them: the loads of contract 5 key host pages by [`PageKey`], the L3 store of
//! contract 7 names objects by it, and the serving roles look prefixes up in a [`PrefixIndex`].
//!
//! - [`page_key`]: chained page hashes;
//! - [`prefix_index`]: per-tier residency (pending is never a hit), LRU per tier;
//! - [`hit_accounting`]: token-weighted hits per tier;
//! - [`prefetch`]: L3 → L2 prefetch with a bounded wait, and the MIN publication rule over pools;
//! - [`trace`]: the Mooncake request trace (its format lives in `tandem-interfaces`) as page keys,
//!   and its replay through a [`PrefixIndex`].

pub mod hit_accounting;
pub mod page_key;
pub mod prefetch;
pub mod prefix_index;
pub mod trace;

pub use hit_accounting::HitAccounting;
pub use page_key::PageKey;
pub use prefix_index::{PrefixIndex, PrefixMatch, Residency, Tier};
