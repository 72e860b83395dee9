//! Tandem data plane (see DESIGN §3). The crate has no Kubernetes dependency.
//!
//! One module per DESIGN contract (each module's docs give its rules and sources):
//!
//! | contract | module |
//! |---|---|
//! | 1. allocator domains | [`memory`] (domains, allocators, shared segments, capacity planning) with the KV pools in [`memory::pool`] |
//! | 2. transactional registration | [`registration`], over the store clients of [`store_client`] (embedded / standalone) |
//! | 3. abort-safe release | [`release`] (room state machines, the release gate, quarantine) |
//! | 4. snapshot receive buffer | [`snapshot`] |
//! | 5. load-before-read | [`load`] (the plan, the event ledger, the host and CUDA backends, host-page locks) |
//! | 6. LayerSplit | [`layer_split`] |
//! | 7. L3 loadback | [`l3`] (store, manifests, placement, wire / server / client, backup, replay) |
//! | 8. spec guard | [`spec_guard`] |
//! | 9. teardown | [`teardown`] |
//!
//! Around them:
//! - [`transfer`]: the KV transports (TCP, the simulated one-sided transport, RDMA WRITE) behind
//!   one [`transfer::Transport`] contract;
//! - [`control`]: the peer protocol between workers (gRPC messages and their conversions);
//! - [`tier`]: what the three cache tiers share — page keys, the prefix index with per-tier
//!   residency, hit accounting, the L3 → L2 prefetch policy. Its own module because [`load`],
//!   [`l3`] and the roles all use it and it uses none of them;
//! - [`health`]: the health report, the `/report` counters and the health port of every role;
//! - [`roles`]: one module per role of the binary (`prefill`, `decode`, `cache`, `store_client`),
//!   wiring the modules above; the config file ([`config`]) is their only start path;
//! - [`engine_api`]: the server side of the engine API (DESIGN §3.1: `tandem.engine.v1` on a UNIX
//!   socket, host pools as memfds passed once); [`sim_engine`]: the simulated engine as a process
//!   that speaks only that API;
//! - [`engine`]: the simulated engine's KV content and cost model; [`model`]: model identity and KV
//!   geometry.
//!
//! No import cycles between these modules: `tests/module_graph.rs` parses the `crate::` paths of
//! every source file and fails on a cycle. The benchmarks are the `tandem-bench` binary's own
//! modules (src/bin/tandem-bench/), not part of this API. Negative controls — the unsafe modes that
//! tests run to show a mechanism matters — exist only with the `negative-controls` feature, which
//! the tests enable and release builds leave off.

pub mod config;
pub mod control;
pub mod engine;
pub mod engine_api;
pub mod health;
pub mod l3;
pub mod layer_split;
pub mod load;
pub mod memory;
pub mod model;
pub mod registration;
pub mod release;
pub mod roles;
pub mod sim_engine;
pub mod snapshot;
pub mod spec_guard;
pub mod store_client;
pub mod teardown;
pub mod tier;
pub mod transfer;
