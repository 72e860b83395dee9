//! The engine API, server side (DESIGN §3.1): the one seam between a serving engine and the worker.
//!
//! An engine (SGLang, vLLM, or [`crate::sim_engine`]) talks `tandem.engine.v1`
//! (`worker/interfaces/proto/tandem/engine/v1/engine.proto`, where every message and unit is
//! documented) over gRPC on a UNIX socket. Host KV pools are memfd-backed shared-memory ranges
//! allocated in the configured allocator domain through [`crate::memory`] and registered through
//! [`crate::registration`]; their fds cross a second UNIX socket once, by SCM_RIGHTS
//! ([`fd_pass`]); afterwards messages carry page indices only.
//!
//! - [`identity`]: the Attach identity check against the worker config (typed refusal, no side effect);
//! - [`pools`]: the pools of an attach — domain check, allocation, transactional registration, fds;
//! - [`fd_pass`]: the pools socket (claim protocol, one delivery per attach, liveness of the attach);
//! - [`decode`]: Reserve / AwaitKv / Finish / Abort / SafeToReuse over the release gate of
//!   [`crate::release::receiver`] (contract 3) and the spec guard (contract 8), plus the requests a
//!   worker's front door hands its engine (DecodeWork) and the tokens it gets back (EmitTokens);
//! - [`prefill`]: PrefillWork / PagesReady / SourceFree over the sender room table of
//!   [`crate::release::sender`];
//! - [`local`]: a same-host link between a prefill side and a decode side (copies between pools; the
//!   serving path replaces it by the TCP/RDMA transfer);
//! - [`tiers`]: the seam for Lookup / Load / Store (contract 5, 7);
//! - [`service`]: the API state and the tonic services; [`server`]: the UNIX-socket server and
//!   deadlines; [`client`]: the Rust client the simulated engine and the tests use;
//! - [`error`]: typed refusals.

pub mod client;
pub mod decode;
pub mod error;
pub mod fd_pass;
pub mod hub;
pub mod identity;
pub mod local;
pub mod pools;
pub mod prefill;
pub mod server;
pub mod service;
pub mod tiers;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{WorkerConfig, WorkerRole};
use crate::memory::pool::PoolLayout;

pub use error::ApiError;

/// Generated protobuf types, clients and servers of `tandem.engine.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("tandem.engine.v1");
}

/// File name of the gRPC socket inside the socket directory.
pub const ENGINE_SOCKET: &str = "engine.sock";

/// File name of the pools (fd-passing) socket inside the socket directory.
pub const POOLS_SOCKET: &str = "pools.sock";

/// Default tokens per page when the worker has no CacheTier (the CacheTier default, DESIGN §2).
pub const DEFAULT_PAGE_TOKENS: u32 = 512;

/// File in the socket directory where a serving simulated engine publishes its running summary
/// (JSON, replaced atomically after every room), so that the worker's `/report` can show the
/// engine's own verification figures (`engine.engine_summary`). A real engine writes none. Here,
/// beside the sockets, because both sides of the socket directory name it.
pub const SIM_SUMMARY_FILE: &str = "sim-engine-summary.json";

/// Settings of the engine-API server that the worker config does not carry.
#[derive(Debug, Clone)]
pub struct EngineApiConfig {
    /// Directory holding [`ENGINE_SOCKET`] and [`POOLS_SOCKET`] (the pod's shared emptyDir).
    pub socket_dir: PathBuf,
    /// Tokens per page (the CacheTier's `pageTokens` when there is one).
    pub page_tokens: u32,
    /// Chunk order of every pool.
    pub layout: PoolLayout,
    /// This engine's `(tp_rank, cp_rank)` when the worker knows its ordinal; Attach checks it.
    pub ranks: Option<(u32, u32)>,
    /// Longest a unary call may take regardless of the client's deadline.
    pub max_call: Duration,
    /// Longest KV deadline a Reserve may ask for.
    pub max_kv_deadline: Duration,
    /// How long after Attach the engine has to claim its fds.
    pub claim_deadline: Duration,
    /// How long a failed room waits for acks or proof before its pages are quarantined (contract 3).
    pub ack_timeout: Duration,
    /// This worker's decode rank (abort acks are addressed to it).
    pub decode_rank: u32,
    /// This worker's prefill rank (its acks carry it).
    pub prefill_rank: u32,
    /// Simulation scaling (`TANDEM_SIM_KV_BYTES_PER_TOKEN`, worker/interfaces/README.md §2): bytes
    /// per token and layer of the target pool instead of the model's, so that a many-worker demo
    /// fits one machine. `None` (default, and always with a real engine): the model's geometry.
    pub target_token_bytes: Option<u64>,
    /// First room id this worker hands out (distinct per decode worker so that prefill tables of
    /// shared peers never see two decode workers' rooms collide).
    pub room_base: u64,
    /// This worker's rank of a LayerSplit CP group with its engine (DESIGN contract 6): the target
    /// pool then holds only the owned layers and a receive slot, and Attach tells the engine so
    /// (engine.proto `LayerSplitSeat`). `None`: every pool holds every layer.
    pub layer_split: Option<LayerSplitSeat>,
    /// Negative control: free a failed room's pages at once instead of waiting for the gate's
    /// proof, as the decode did before seed 004's fix — its prefill writers are not told (no
    /// ABORT) and the transport keeps the room open, so their late writes land in the reused pages.
    /// A serving decode worker sets it from `$TANDEM_NEGATIVE_GATE_BYPASS=1`
    /// ([`crate::roles::gate_bypass_from_env`]).
    #[cfg(feature = "negative-controls")]
    pub unsafe_release_on_abort: bool,
}

impl EngineApiConfig {
    /// Settings for `cfg` with sockets in `socket_dir`: the CacheTier's page size (else
    /// [`DEFAULT_PAGE_TOKENS`]), page-first layout (the transfer layout), a 30 s call maximum,
    /// a 120 s KV deadline maximum, 10 s to claim fds, a 5 s ack timeout.
    pub fn for_worker(cfg: &WorkerConfig, socket_dir: &Path) -> Self {
        Self {
            socket_dir: socket_dir.to_path_buf(),
            page_tokens: cfg
                .cache
                .as_ref()
                .map_or(DEFAULT_PAGE_TOKENS, |c| c.page_tokens),
            layout: PoolLayout::PageFirst,
            ranks: None,
            max_call: Duration::from_secs(30),
            max_kv_deadline: Duration::from_secs(120),
            claim_deadline: Duration::from_secs(10),
            ack_timeout: Duration::from_secs(5),
            decode_rank: 0,
            prefill_rank: 0,
            target_token_bytes: None,
            room_base: (xxhash_rust::xxh3::xxh3_64(
                format!("{}/{}/{}", cfg.namespace, cfg.pool, std::process::id()).as_bytes(),
            ) & 0x7FFF_FFFF)
                << 32
                | 1,
            layer_split: None,
            #[cfg(feature = "negative-controls")]
            unsafe_release_on_abort: false,
        }
    }

    /// Path of the gRPC socket.
    pub fn engine_socket(&self) -> PathBuf {
        self.socket_dir.join(ENGINE_SOCKET)
    }

    /// Path of the pools socket.
    pub fn pools_socket(&self) -> PathBuf {
        self.socket_dir.join(POOLS_SOCKET)
    }
}

/// A LayerSplit rank's place and the layout of its target pool (engine.proto `LayerSplitSeat`;
/// DESIGN contract 6; seed 004).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSplitSeat {
    /// This rank.
    pub cp_rank: u32,
    /// Ranks of the group.
    pub cp_size: u32,
    /// Layers of the model.
    pub model_layers: u32,
    /// The model layers this rank owns (contiguous).
    pub owned: std::ops::Range<u32>,
    /// The most layers any rank of the group owns: every rank's pool has that many layers and the
    /// receive slot, so every rank has the same page count (a room that fits one fits all).
    pub max_owned: u32,
}

impl LayerSplitSeat {
    /// Layers of the target pool: the group's largest owned range and the receive slot (a rank
    /// owning fewer leaves the layers between its owned ones and the slot unused).
    pub fn pool_layers(&self) -> u32 {
        self.max_owned.max(self.owned.len() as u32) + 1
    }

    /// Pool layer index of the receive slot (the pool's last layer).
    pub fn receive_slot(&self) -> u32 {
        self.pool_layers() - 1
    }

    /// The pool layer index of model layer `layer`, when this rank owns it.
    pub fn pool_layer(&self, layer: u32) -> Option<u32> {
        self.owned
            .contains(&layer)
            .then(|| layer - self.owned.start)
    }

    /// The wire form.
    pub fn to_proto(&self) -> pb::LayerSplitSeat {
        pb::LayerSplitSeat {
            cp_rank: self.cp_rank,
            cp_size: self.cp_size,
            model_layers: self.model_layers,
            owned: Some(pb::LayerRange {
                start: self.owned.start,
                end: self.owned.end,
            }),
            receive_slot: self.receive_slot(),
        }
    }
}

/// The role name the API reports (`prefill`, `decode`).
pub fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
    }
}
