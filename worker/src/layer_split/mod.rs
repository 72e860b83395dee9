//! LayerSplit: each context-parallel (CP) rank stores only its layers' KV, and the owner of layer `i`
//! broadcasts the pages in use of that layer to the other CP ranks before attention on layer `i`,
//! overlapped with the indexer computation (DESIGN contract 6; seed 004 "KV Cache 分层存储
//! LayerSplit"; reference/dataplane.md §2.5, R-LS-1..3, TC-LS-01..03).
//!
//! One concern per module:
//! - [`ownership`]: the layer → rank owner map (from the config's `layerSplit`), its validation, owned
//!   ranges and the digest the ranks compare at setup;
//! - [`rank_store`]: a rank's KV pool holding only its owned layers;
//! - [`wire`]: the frames between ranks (hello with the digest; a layer's chunks of the pages in use);
//! - [`transport`]: the seam the frames cross ([`transport::RankLink`]) and its in-process mesh;
//! - [`tcp_link`]: the TCP [`transport::RankLink`] between the pods of a group;
//! - [`receive`]: the per-layer event and receive scratch of a consumer rank;
//! - [`attention`]: the simulated indexer and attention (a deterministic function of the KV read);
//! - [`l3_key`]: L3 object keys per owned layer range;
//! - [`group`]: a CP group of threads running prefill steps under the replicated or split layout;
//! - [`cost_model`]: the throughput model behind seed 004's +10 %..+132 % (pure arithmetic, no
//!   measurement).
//!
//! Not wired into serving yet (issue 15). Where it plugs in: when `parallelism.context` is above 1
//! and the config has a `layerSplit`, the prefill role (`roles::prefill`, pool setup) builds one
//! [`rank_store::RankKvStore`] instead of the full target pool, connects a
//! [`tcp_link::TcpRankLink`] to its CP peers (their addresses from the group's peers Service; the
//! preamble already refuses a peer on another owner map) and runs
//! [`receive::LayerReceiver::handshake`] before admitting, and its engine step calls the broadcast/wait pair of [`group`] around
//! each layer's attention; the L3 backup (`l3::backup`) names objects with
//! [`l3_key::LayerRangeKey`]. The operator already writes the owner map into the worker config
//! (DESIGN §2); it needs no change.
//!
//! Measured by `tandem-bench layer-split`; tested in `tests/layer_split_contract.rs`.

pub mod attention;
pub mod cost_model;
pub mod error;
pub mod group;
pub mod l3_key;
pub mod ownership;
pub mod rank_store;
pub mod receive;
pub mod tcp_link;
pub mod transport;
pub mod wire;

pub use error::LayerSplitError;
pub use group::{
    BroadcastScope, GroupSpec, KvLayout, RankReport, RequestSpec, WaitPolicy, run_group,
};
pub use ownership::OwnerMap;
