//! Hierarchical KV cache: the prefix index and hit accounting shared by the tiers (L1 device pool, L2
//! host pool, L3 CacheTier store), the L3 store with atomic manifests and restart loadback (DESIGN
//! contract 7), and load-before-read ordering between the load executor and compute (DESIGN contract
//! 5, seed 004 BugFix #2).

pub mod hit_accounting;
pub mod host_locks;
pub mod l3_client;
pub mod l3_replay;
pub mod l3_server;
pub mod l3_store;
pub mod l3_wire;
pub mod load_order;
pub mod manifest;
pub mod page_key;
pub mod prefix_index;
pub mod trace;

pub use hit_accounting::HitAccounting;
pub use page_key::PageKey;
pub use prefix_index::{PrefixIndex, PrefixMatch, Residency, Tier};
