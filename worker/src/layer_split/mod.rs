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
//! On the serving path (issue 15): `roles::prefill::cp_group` runs a prefill pod of more than one
//! CP rank as one rank of its group — the group connects over [`tcp_link::TcpRankLink`] (peers by
//! pod DNS under `peers.groupService`, port `ports.rankLink`) and agrees on the owner map (or on
//! replication) before any [`rank_store::RankKvStore`] is allocated; each room's step runs on every
//! rank through [`group::RankStepper`] (the same steps as [`run_group`]), and under LayerSplit each
//! rank writes its owned layers into the decode's pages. Not yet: an engine beside the worker (the
//! engine API), and the L3 backup's keys per owned range ([`l3_key::LayerRangeKey`]; the leader's
//! write-back uses its own range's shard coordinates).
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
