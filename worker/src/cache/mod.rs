//! Hierarchical KV cache: the prefix index and hit accounting shared by the tiers (L1 device pool, L2
//! host pool, L3 CacheTier store), the L3 store with atomic manifests and restart loadback (DESIGN
//! contract 7), and load-before-read ordering between the load executor and compute (DESIGN contract
//! 5, seed 004 BugFix #2).
//!
//! Map:
//! - keys and lookups: [`page_key`] (chained page hashes), [`prefix_index`] (per-tier residency,
//!   pending never a hit, LRU per tier), [`hit_accounting`] (token-weighted, per tier), [`trace`]
//!   (the Mooncake trace and its replay);
//! - L2/L1 loads: [`load_plan`] (the pure plan: fence, per-layer per-pool copies and events, host
//!   release; and the waits compute enqueues), [`event_ledger`] (recorded / complete / failed per
//!   (pool, layer) and generation, job acknowledgements), [`load_error`]; two backends run the same
//!   plans: [`load_order`] (host: a load thread) and `load_stream_cuda` (feature `cuda`: CUDA
//!   streams and events); [`host_locks`] (host pages locked until the load is acknowledged),
//!   [`prefetch`] (bounded wait, MIN publication);
//! - L3: [`placement`] (which replica owns a page: rendezvous hashing), [`manifest`] (object
//!   identity, atomic manifest), [`l3_store`] (disk + memory tiers, LRU,
//!   loadback, health), [`l3_wire`] / [`l3_server`] / [`l3_client`] (the `cache` role's protocol),
//!   [`l3_replay`] (hit ratio of a trace against a store), [`l3_backup`] (L2 → L3 write-through that
//!   marks pages pending until acknowledged).

pub mod event_ledger;
pub mod hit_accounting;
pub mod host_locks;
pub mod l3_backup;
pub mod l3_client;
pub mod l3_replay;
pub mod l3_server;
pub mod l3_store;
pub mod l3_wire;
pub mod load_error;
pub mod load_order;
pub mod load_plan;
#[cfg(feature = "cuda")]
pub mod load_stream_cuda;
pub mod manifest;
pub mod page_key;
pub mod placement;
pub mod prefetch;
pub mod prefix_index;
pub mod trace;

pub use hit_accounting::HitAccounting;
pub use page_key::PageKey;
pub use prefix_index::{PrefixIndex, PrefixMatch, Residency, Tier};
