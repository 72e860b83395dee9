//! The L3 CacheTier store and its loadback (DESIGN contract 7; reference/dataplane.md R-L3-1..5):
//! objects are written, then manifested atomically; after a restart the store scans, verifies
//! (identity, layout, checksum) and publishes; a mismatch is a miss, never a crash; serving starts
//! before loadback ends.
//!
//! - [`manifest`]: object identity and the atomic per-object manifest;
//! - [`store`]: disk and memory tiers, LRU within both budgets, loadback, health;
//! - [`placement`]: which replica owns a page (rendezvous hashing, weighted for a write ramp);
//! - [`replicas`]: a writer's book of replicas: write ramp, per-replica write rates, reconnect
//!   backoff, reattach times;
//! - [`wire`] / [`server`] / [`client`]: the framed TCP protocol of the `cache` role;
//! - [`backup`]: L2 → L3 write-through that marks pages pending until the store acknowledged them;
//! - [`replay`]: the hit ratio a request trace gets from a store (restart tests, benchmarks).

pub mod backup;
pub mod client;
pub mod manifest;
pub mod placement;
pub mod replay;
pub mod replicas;
pub mod server;
pub mod store;
pub mod wire;
