//! Tandem data plane (see DESIGN §3). The crate has no Kubernetes dependency.
//!
//! Where each DESIGN contract lives (each module's docs give its rules and sources):
//! 1. allocator domains: `memory` (domains, allocators, shared segments), `pool` (KV pools);
//! 2. transactional registration: `registration`, `store_client` (embedded / standalone);
//! 3. abort-safe release: `room` (room state machines, release gate, quarantine), `transfer`
//!    (TCP, simulated one-sided and RDMA WRITE transports), `control` (gRPC between workers);
//! 4. snapshot receive buffer: `snapshot`;
//! 5. load-before-read: `cache` (`load_plan`, `event_ledger`, `load_order`, and
//!    `load_stream_cuda` under `cuda`);
//! 6. LayerSplit: `layer_split`;
//! 7. L3 loadback: `cache` (`l3_store`, `manifest`, `placement`), the `cache` role;
//! 8. spec guard: `spec_guard`;
//! 9. teardown: `teardown`.
//!
//! The engine API (DESIGN §3.1) is `engine_api` (server side and Rust client); the simulated engine
//! as a process, a client of that API, is `sim_engine` (content and cost model in `engine`). The
//! roles of the one binary (`prefill`, `decode`, `cache`, `store-client`) are the binary's `roles`
//! over this crate's `serve`; `bench` holds the `tandem-bench` subcommands.

pub mod bench;
pub mod cache;
pub mod config;
pub mod control;
pub mod engine;
pub mod engine_api;
pub mod layer_split;
pub mod room;
pub mod serve;
pub mod sim_engine;
pub mod snapshot;
pub mod spec_guard;
pub mod transfer;

pub mod health;
pub mod memory;
pub mod model;
pub mod pool;
pub mod registration;
pub mod store_client;
pub mod teardown;
