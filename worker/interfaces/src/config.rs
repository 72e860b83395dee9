//! The resolved configurations: the one file a worker reads at start ([`WorkerConfig`]) and the one
//! a CacheTier store replica reads ([`CacheTierConfig`]) (worker/interfaces/README.md §2).
//!
//! The operator resolves a pool's spec, its CacheTier's policy and the cluster's topology into a
//! [`WorkerConfig`] and writes it as JSON into the pool's ConfigMap (DESIGN §2: "workers read only
//! that file"). This crate owns the types and has no Kubernetes dependency; the operator depends on
//! it to render, the worker to read. Unknown fields are rejected (`deny_unknown_fields`), so an
//! operator newer than the worker fails loudly instead of having a setting silently dropped.
//!
//! Versioning: [`CONFIG_API_VERSION`] names the schema; a worker refuses any other value.
//!
//! No I/O here: [`WorkerConfig::from_json`] and [`CacheTierConfig::from_json`] parse and check the
//! text of a file the caller read (the worker's `config::LoadConfig` reads it).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::memory::{AllocatorDomain, ClientMode, FailurePolicy, PoolLayout};
use crate::model::ModelIdentity;

/// Schema version of [`WorkerConfig`].
pub const CONFIG_API_VERSION: &str = "tandem.dev/worker-config/v1";

/// File name of the config inside the pool's ConfigMap volume.
pub const CONFIG_FILE: &str = "worker.json";

/// What a pod of the pool does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WorkerRole {
    /// Computes prompt KV and sends it to decode.
    Prefill,
    /// Receives KV, generates tokens, serves the front door.
    Decode,
}

/// Bulk KV transport choice (DESIGN §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TransportChoice {
    /// RDMA if an ibverbs device is usable, else TCP (logged).
    Auto,
    /// RDMA only.
    Rdma,
    /// TCP only.
    Tcp,
}

/// How host pages reach the L3 store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WritePolicy {
    /// L2 write completes after the L3 write.
    WriteThrough,
    /// L3 written on eviction from L2 and on drain.
    WriteBack,
}

/// Geometry of the sparse-attention indexer cache (one key per token and layer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IndexerGeometry {
    /// Elements per token and layer.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
}

/// Host-memory policy and the sizes of every host pool, in bytes (DESIGN contracts 1 and 2).
///
/// All pools — target, draft, indexer, snapshot buffer — are allocated in `allocator`; in
/// Standalone mode the store-client sidecar's segments are sized to `segment_bytes`, their sum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MemoryPolicy {
    /// Allocator domain of every host pool (the CacheTier's).
    pub allocator: AllocatorDomain,
    /// Store-client mode; `None` when the pool uses no CacheTier (no L3).
    pub client_mode: Option<ClientMode>,
    /// What a failed L3 registration does.
    pub registration_failure: FailurePolicy,
    /// Target model's host KV pool.
    pub target_pool_bytes: u64,
    /// Draft model's host KV pool (same token capacity as the target); 0 without speculation.
    pub draft_pool_bytes: u64,
    /// Indexer host pool (same token capacity); 0 without an indexer.
    pub indexer_pool_bytes: u64,
    /// Snapshot receive buffer (prefill only; DESIGN contract 4); 0 when disabled.
    pub snapshot_buffer_bytes: u64,
    /// Sum of the above: the shared-memory segment size in Standalone mode.
    pub segment_bytes: u64,
}

/// The L3 CacheTier a pool reads and writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CacheConfig {
    /// CacheTier name.
    pub tier: String,
    /// DNS name of the tier's headless Service (each replica is `<pod>.<service>`).
    pub service: String,
    /// Store replicas (pod ordinals `0..replicas`).
    pub replicas: u32,
    /// Tokens per KV page; L3 objects are whole pages.
    pub page_tokens: u32,
    /// L2→L3 write policy.
    pub write_policy: WritePolicy,
}

/// Parallel layout of one group; a pod's ranks follow from its ordinal `o`:
/// `tp_rank = o % tensor`, `cp_rank = o / tensor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Parallelism {
    /// Tensor-parallel ranks.
    pub tensor: u32,
    /// Context-parallel ranks.
    pub context: u32,
}

impl Parallelism {
    /// `(tp_rank, cp_rank)` of the pod with this ordinal in its group, or `None` if the ordinal is
    /// outside the group.
    pub fn ranks_of(&self, ordinal: u32) -> Option<(u32, u32)> {
        (self.tensor > 0 && ordinal < self.tensor.saturating_mul(self.context))
            .then(|| (ordinal % self.tensor, ordinal / self.tensor))
    }
}

/// LayerSplit owner map (seed 004, DESIGN contract 6): `owners[layer]` is the CP rank that stores
/// that layer's KV. Identical on all ranks because every rank reads it from this file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LayerSplit {
    /// Owner CP rank of each layer, `len == model.layers`.
    pub owners: Vec<u32>,
}

impl LayerSplit {
    /// Contiguous, balanced ranges: rank `r` owns layers `[r·L/C, (r+1)·L/C)` (integer division),
    /// so each rank owns ⌊L/C⌋ or ⌈L/C⌉ layers and each owned range is one L3 key range.
    /// `None` when `context` is 0 or exceeds `layers`.
    pub fn contiguous(layers: u32, context: u32) -> Option<Self> {
        if context == 0 || context > layers {
            return None;
        }
        let (l, c) = (u64::from(layers), u64::from(context));
        let owners = (0..l)
            .map(|i| {
                // The largest r with r·L/C ≤ i.
                let r = ((i + 1) * c - 1) / l;
                u32::try_from(r).unwrap_or(u32::MAX)
            })
            .collect();
        Some(Self { owners })
    }

    /// Layers owned by `cp_rank`, in order.
    pub fn owned_by(&self, cp_rank: u32) -> impl Iterator<Item = u32> + '_ {
        self.owners
            .iter()
            .enumerate()
            .filter(move |(_, o)| **o == cp_rank)
            .map(|(i, _)| u32::try_from(i).unwrap_or(u32::MAX))
    }
}

/// Speculative-decoding anomaly guard thresholds (seed 004; DESIGN contract 8).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SpecGuard {
    /// Abort below this mean accept length (tokens per step).
    pub min_accept_length: f64,
    /// Abort above this accept rate (fraction of draft tokens accepted).
    pub max_accept_rate: f64,
    /// Tokens generated before judging.
    pub after_tokens: u32,
    /// Retries on another instance.
    pub retry_budget: u32,
}

/// Most retries a spec-guard budget may ask for (the DecodePool CRD's bound).
pub const MAX_SPEC_GUARD_RETRIES: u32 = 10;

impl SpecGuard {
    /// Checks the bounds the DecodePool CRD enforces: `afterTokens ≥ 1`, `minAcceptLength ≥ 1.0`
    /// (one token per step is plain decoding), `maxAcceptRate` in `(0, 1]`, `retryBudget ≤ 10`.
    ///
    /// # Errors
    /// The first broken bound, as a message.
    pub fn check(&self) -> Result<(), String> {
        if self.after_tokens == 0 {
            return Err("specGuard.afterTokens must be at least 1".into());
        }
        if !(self.min_accept_length.is_finite() && self.min_accept_length >= 1.0) {
            return Err(format!(
                "specGuard.minAcceptLength {} must be at least 1.0",
                self.min_accept_length
            ));
        }
        if !(self.max_accept_rate > 0.0 && self.max_accept_rate <= 1.0) {
            return Err(format!(
                "specGuard.maxAcceptRate {} must be in (0, 1]",
                self.max_accept_rate
            ));
        }
        if self.retry_budget > MAX_SPEC_GUARD_RETRIES {
            return Err(format!(
                "specGuard.retryBudget {} exceeds {MAX_SPEC_GUARD_RETRIES}",
                self.retry_budget
            ));
        }
        Ok(())
    }
}

/// How long a decode waits for a request's KV from its prefill before it aborts the room through
/// the release gate and retries the request on another prefill: `milliseconds +
/// perTokenMicroseconds × prompt tokens` from the room's opening (queueing, compute and transfer
/// together). Seed 004: a timeout on prefill queueing bounds TTFT, and the aborts it causes are
/// the ones whose in-flight writes the release gate must fence. The DecodePool's
/// `spec.prefill.kvDeadline`; decode only. Unset: 30 s and no per-token part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvDeadline {
    /// Fixed part, milliseconds (100 ..= 600 000).
    pub milliseconds: u64,
    /// Added per prompt token, microseconds (0 ..= 100 000): a prefill computing at its usual
    /// speed meets the deadline whatever the prompt's length, so only queueing trips it.
    #[serde(default)]
    pub per_token_microseconds: u64,
}

/// Bounds of [`KvDeadline::milliseconds`] (the DecodePool CRD's CEL rule).
pub const KV_DEADLINE_MS_RANGE: std::ops::RangeInclusive<u64> = 100..=600_000;
/// Bounds of [`KvDeadline::per_token_microseconds`] (the DecodePool CRD's CEL rule).
pub const KV_DEADLINE_US_PER_TOKEN_RANGE: std::ops::RangeInclusive<u64> = 0..=100_000;

impl KvDeadline {
    /// Checks the bounds the DecodePool CRD enforces.
    ///
    /// # Errors
    /// The broken bound, as a message.
    pub fn check(&self) -> Result<(), String> {
        if !KV_DEADLINE_MS_RANGE.contains(&self.milliseconds) {
            return Err(format!(
                "kvDeadline.milliseconds {} is outside {KV_DEADLINE_MS_RANGE:?}",
                self.milliseconds
            ));
        }
        if !KV_DEADLINE_US_PER_TOKEN_RANGE.contains(&self.per_token_microseconds) {
            return Err(format!(
                "kvDeadline.perTokenMicroseconds {} is outside {KV_DEADLINE_US_PER_TOKEN_RANGE:?}",
                self.per_token_microseconds
            ));
        }
        Ok(())
    }
}

/// Speculative decoding: the draft model (its pools share the target's allocator domain).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Speculative {
    /// Draft model identity.
    pub draft_model: ModelIdentity,
    /// Draft tokens per verification step.
    pub draft_tokens: u32,
}

/// Where a worker finds its peers (DNS names of headless Services).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Peers {
    /// Headless Service of the prefill pool's pods (decode dials these).
    pub prefill_service: Option<String>,
    /// Headless Service of the decode pool's pods.
    pub decode_service: Option<String>,
    /// The worker's own pool's headless Service (`<pool>-peers.<ns>.svc`), set for a prefill of
    /// more than one CP rank: the CP ranks of a group find each other as `<pod>.<groupService>`
    /// (StatefulSet pod DNS), the pod being `<group StatefulSet>-<ordinal>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_service: Option<String>,
}

/// Ports a worker listens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Ports {
    /// gRPC control (rooms, acks, heartbeats).
    pub control: u16,
    /// Bulk KV data (TCP transport).
    pub data: u16,
    /// Health, readiness and metrics (HTTP).
    pub health: u16,
    /// OpenAI-compatible front door (decode only).
    pub front_door: Option<u16>,
    /// The rank link between the CP ranks of a prefill group (TCP; set for a prefill of more
    /// than one CP rank; layer broadcasts under LayerSplit, and the step orders).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_link: Option<u16>,
}

/// The resolved configuration of a prefill or decode worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerConfig {
    /// Must equal [`CONFIG_API_VERSION`].
    pub api_version: String,
    /// Prefill or decode.
    pub role: WorkerRole,
    /// Namespace of the pool.
    pub namespace: String,
    /// Pool name.
    pub pool: String,
    /// Revision of the pool's pod template; prefill and decode pair only within one revision
    /// while a rollout runs (DESIGN §5).
    pub revision: String,
    /// Target model identity.
    pub model: ModelIdentity,
    /// Indexer geometry, for models with a sparse-attention indexer.
    pub indexer: Option<IndexerGeometry>,
    /// Group layout.
    pub parallelism: Parallelism,
    /// LayerSplit owner map (prefill with `layerSplit: true`).
    pub layer_split: Option<LayerSplit>,
    /// Host-memory policy and pool sizes.
    pub memory: MemoryPolicy,
    /// The L3 tier, when the pool names one.
    pub cache: Option<CacheConfig>,
    /// Speculative decoding.
    pub speculative: Option<Speculative>,
    /// Speculative-decoding guard (decode only; applied when `speculative` is set).
    pub spec_guard: Option<SpecGuard>,
    /// The KV deadline of a room (decode only; see [`KvDeadline`]). Absent in configs written
    /// before it existed; not written when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_deadline: Option<KvDeadline>,
    /// Transport choice.
    pub transport: TransportChoice,
    /// Peers.
    pub peers: Peers,
    /// Listening ports.
    pub ports: Ports,
    /// The serving engine beside this worker, when the pod has one (DESIGN §3.1). `None`: the
    /// worker runs its built-in in-process simulated engine and serves no engine API.
    #[serde(default)]
    pub engine: Option<EngineSeat>,
}

/// Which serving engine computes attention beside the worker (DESIGN §3.1; the pool's
/// `spec.engine.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EngineKind {
    /// `tandem-worker sim-engine`: deterministic KV bytes, verified on every read.
    Simulated,
    /// SGLang through Tandem's adapters.
    #[serde(rename = "SGLang")]
    SgLang,
    /// vLLM through Tandem's KV connector.
    #[serde(rename = "vLLM")]
    Vllm,
}

/// Where the worker meets its engine: the engine-API sockets (`engine.sock`, `pools.sock`) live in
/// `socket_dir`, an `emptyDir` both containers of the pod mount (DESIGN §3.1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EngineSeat {
    /// The engine that attaches.
    pub kind: EngineKind,
    /// Directory of the engine-API sockets, as mounted in the worker container.
    pub socket_dir: std::path::PathBuf,
    /// The engine's own OpenAI-compatible HTTP port on the pod's loopback (SGLang, vLLM), to
    /// which a decode worker's front door hands the requests it admitted; unset:
    /// [`DEFAULT_ENGINE_HTTP_PORT`] (the operator's `engine-http` container port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_port: Option<u16>,
}

/// The engine's HTTP port when [`EngineSeat::http_port`] is unset: 8100, the container port
/// `engine-http` the operator renders for SGLang and vLLM (`tandem_crds::ports::ENGINE_HTTP_PORT`,
/// kept equal by an operator test).
pub const DEFAULT_ENGINE_HTTP_PORT: u16 = 8100;

impl EngineSeat {
    /// [`EngineSeat::http_port`], or [`DEFAULT_ENGINE_HTTP_PORT`].
    pub fn http_port(&self) -> u16 {
        self.http_port.unwrap_or(DEFAULT_ENGINE_HTTP_PORT)
    }
}

/// Errors reading a config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read (raised by the reader of the file, e.g. the worker's loader).
    #[error("cannot read worker config {path}: {source}")]
    Read {
        /// Path tried.
        path: std::path::PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Not valid JSON of this schema (the message names line, column and field).
    #[error("worker config {path} is malformed: {source}")]
    Parse {
        /// Path read.
        path: std::path::PathBuf,
        /// Parser error.
        source: serde_json::Error,
    },
    /// Written for another schema version.
    #[error("worker config has apiVersion {found:?}; this worker reads {CONFIG_API_VERSION:?}")]
    Version {
        /// Version found.
        found: String,
    },
    /// Internally inconsistent (an operator bug, or a hand-edited file).
    #[error("worker config is inconsistent: {0}")]
    Inconsistent(String),
}

/// Parses `text` (the file `origin`) as a `T`, then runs `check` on it.
fn parse_checked<T: serde::de::DeserializeOwned>(
    text: &str,
    origin: &Path,
    check: fn(&T) -> Result<(), ConfigError>,
) -> Result<T, ConfigError> {
    let cfg: T = serde_json::from_str(text).map_err(|source| ConfigError::Parse {
        path: origin.to_path_buf(),
        source,
    })?;
    check(&cfg)?;
    Ok(cfg)
}

/// [`ConfigError::Version`] unless `found` is `want`.
fn check_version(found: &str, want: &str) -> Result<(), ConfigError> {
    if found == want {
        Ok(())
    } else {
        Err(ConfigError::Version {
            found: found.to_owned(),
        })
    }
}

impl WorkerConfig {
    /// Parses and checks the text of a config file; `origin` names the file in errors.
    ///
    /// # Errors
    /// [`ConfigError`]: malformed, wrong version, or inconsistent.
    pub fn from_json(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        parse_checked(text, origin, Self::check)
    }

    /// Checks the invariants the operator guarantees: version, segment sum, owner-map length,
    /// client mode only with a cache, Standalone only in SharedMemory (seed 000), spec-guard bounds
    /// ([`SpecGuard::check`]), and beside an SGLang or vLLM engine no `speculative`, `layerSplit`
    /// or parallelism above 1, nor `kvDeadline` beside SGLang (issue 14: nothing on their path
    /// uses them yet).
    ///
    /// # Errors
    /// [`ConfigError::Version`] or [`ConfigError::Inconsistent`] naming the broken invariant.
    pub fn check(&self) -> Result<(), ConfigError> {
        check_version(&self.api_version, CONFIG_API_VERSION)?;
        let bad = |m: String| Err(ConfigError::Inconsistent(m));
        let m = &self.memory;
        let sum = [
            m.target_pool_bytes,
            m.draft_pool_bytes,
            m.indexer_pool_bytes,
            m.snapshot_buffer_bytes,
        ]
        .iter()
        .try_fold(0u64, |a, b| a.checked_add(*b));
        if sum != Some(m.segment_bytes) {
            return bad(format!(
                "segmentBytes {} is not the sum of the pools ({sum:?})",
                m.segment_bytes
            ));
        }
        if m.client_mode.is_some() != self.cache.is_some() {
            return bad("memory.clientMode is set exactly when cache is set".into());
        }
        if m.client_mode == Some(ClientMode::Standalone)
            && m.allocator != AllocatorDomain::SharedMemory
        {
            return bad(format!(
                "Standalone client mode with allocator {:?}; it requires SharedMemory",
                m.allocator
            ));
        }
        if self.speculative.is_some() != (m.draft_pool_bytes > 0) {
            return bad("draftPoolBytes is positive exactly when speculative is set".into());
        }
        if let Some(g) = &self.spec_guard {
            g.check().map_err(ConfigError::Inconsistent)?;
        }
        if let Some(d) = &self.kv_deadline {
            if self.role != WorkerRole::Decode {
                return bad(
                    "kvDeadline is a decode setting; a prefill has no room deadline".into(),
                );
            }
            d.check().map_err(ConfigError::Inconsistent)?;
        }
        if let Some(ls) = &self.layer_split {
            if ls.owners.len() != self.model.layers as usize {
                return bad(format!(
                    "layerSplit has {} owners for {} layers",
                    ls.owners.len(),
                    self.model.layers
                ));
            }
            if ls.owners.iter().any(|o| *o >= self.parallelism.context) {
                return bad("layerSplit names a CP rank outside parallelism.context".into());
            }
        }
        if let Some(e) = self
            .engine
            .as_ref()
            .filter(|e| e.kind != EngineKind::Simulated)
        {
            // Nothing on an SGLang or vLLM engine's path uses these in this version (the pools'
            // admission refuses them too: crds `REAL_ENGINE_*`); a worker that accepted them would
            // report settings it does not act on.
            let unused: Vec<&str> = [
                ("speculative", self.speculative.is_some()),
                // A decode without a cache hands its requests over with the KV deadline
                // (`roles::decode::own_api`); one serving the tier calls takes none.
                (
                    "kvDeadline",
                    self.kv_deadline.is_some() && self.cache.is_some(),
                ),
                ("layerSplit", self.layer_split.is_some()),
                (
                    "parallelism above 1",
                    self.parallelism.tensor > 1 || self.parallelism.context > 1,
                ),
            ]
            .into_iter()
            .filter_map(|(name, set)| set.then_some(name))
            .collect();
            if !unused.is_empty() {
                return bad(format!(
                    "{} set beside engine {:?}: not on this engine's path in this version (one \
                     engine per pod; no draft pool or LayerSplit; a room deadline only on the front \
                     door of a decode without a cache)",
                    unused.join(", "),
                    e.kind
                ));
            }
        }
        if self.role == WorkerRole::Prefill
            && self.parallelism.context > 1
            && (self.ports.rank_link.is_none() || self.peers.group_service.is_none())
        {
            return bad(
                "a prefill of more than one CP rank needs ports.rankLink and peers.groupService: \
                 the ranks of a group connect to each other"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Schema version of [`CacheTierConfig`].
pub const CACHE_TIER_CONFIG_API_VERSION: &str = "tandem.dev/cache-tier-config/v1";

/// File name of the tier config inside the tier's ConfigMap volume (`/etc/tandem/tier.json`).
pub const CACHE_TIER_CONFIG_FILE: &str = "tier.json";

/// Default data directory of a store replica (the PVC mount; worker/interfaces/README.md §2).
pub const DEFAULT_CACHE_DATA_DIR: &str = "/var/lib/tandem/cache";

fn default_cache_data_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(DEFAULT_CACHE_DATA_DIR)
}

/// Eviction order of a store replica (DESIGN §2 `CacheTier.eviction.policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum EvictionOrder {
    /// Least recently used (the only order the store implements).
    #[default]
    #[serde(rename = "LRU")]
    Lru,
}

/// Eviction within each replica's memory and disk budgets (DESIGN §2 `CacheTier.eviction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CacheEviction {
    /// Order of eviction.
    #[serde(default)]
    pub policy: EvictionOrder,
    /// Eviction starts when usage passes this percentage of a budget (50..=100); the replica
    /// applies it by sizing its effective budgets to `bytes × percent / 100`.
    #[serde(default = "default_high_watermark")]
    pub high_watermark_percent: u32,
}

fn default_high_watermark() -> u32 {
    90
}

impl Default for CacheEviction {
    fn default() -> Self {
        Self {
            policy: EvictionOrder::Lru,
            high_watermark_percent: default_high_watermark(),
        }
    }
}

/// Ports of a store replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CachePorts {
    /// L3 framed-TCP protocol (`l3::wire`), default 7420.
    #[serde(default = "default_store_port")]
    pub l3: u16,
    /// Health, readiness, metrics and `/report` (HTTP), default 8080.
    #[serde(default = "default_health_port")]
    pub health: u16,
}

/// Default L3 port of a store replica ([`CachePorts::l3`]; the operator renders
/// `tandem_crds::ports::L3_PORT`, the same number).
pub const DEFAULT_L3_PORT: u16 = 7420;

/// Default health port of a store replica ([`CachePorts::health`]; the operator renders
/// `tandem_crds::ports::HEALTH_PORT`, the same number).
pub const DEFAULT_HEALTH_PORT: u16 = 8080;

fn default_store_port() -> u16 {
    DEFAULT_L3_PORT
}

fn default_health_port() -> u16 {
    DEFAULT_HEALTH_PORT
}

impl Default for CachePorts {
    fn default() -> Self {
        Self {
            l3: default_store_port(),
            health: default_health_port(),
        }
    }
}

/// The resolved configuration of one CacheTier store replica (`tandem-worker cache --config
/// /etc/tandem/tier.json`; worker/interfaces/README.md §2, DESIGN §2 `CacheTier`, contract 7).
///
/// The operator renders it from the CacheTier spec into the tier's ConfigMap. Same rules as
/// [`WorkerConfig`]: versioned `apiVersion`, unknown fields rejected, no Kubernetes dependency.
/// Quantities are plain bytes (the operator converts `64Gi`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CacheTierConfig {
    /// Must equal [`CACHE_TIER_CONFIG_API_VERSION`].
    pub api_version: String,
    /// Namespace of the tier.
    pub namespace: String,
    /// CacheTier name.
    pub tier: String,
    /// Revision of the replicas' config (informational; the operator's rollout key).
    #[serde(default)]
    pub revision: String,
    /// Model identity and KV geometry of every stored object.
    pub model: ModelIdentity,
    /// Indexer geometry of the model, when it has a sparse-attention indexer (its keys are
    /// stored beside the KV pages).
    #[serde(default)]
    pub indexer: Option<IndexerGeometry>,
    /// Tokens per page; objects are whole pages.
    pub page_tokens: u32,
    /// Chunk order of object bytes, default `layerFirst`.
    #[serde(default)]
    pub layout: PoolLayout,
    /// Largest tensor-parallel size of a client pool (object shards must have `tpRank` below it),
    /// default [`DEFAULT_MAX_PARALLEL`].
    #[serde(default = "default_max_parallel")]
    pub max_tensor: u32,
    /// Largest context-parallel size of a client pool, default [`DEFAULT_MAX_PARALLEL`].
    #[serde(default = "default_max_parallel")]
    pub max_context: u32,
    /// Bytes of object data a replica keeps in memory (`CacheTier.memory`).
    pub memory_bytes: u64,
    /// Bytes of object data a replica keeps on disk (`CacheTier.persistence.size`; without
    /// persistence the operator renders the emptyDir budget it mounts).
    pub disk_bytes: u64,
    /// Whether `data_dir` survives a pod restart (a PVC). Informational: the replica loads back
    /// whatever it finds either way.
    #[serde(default)]
    pub persistent: bool,
    /// Data directory, default [`DEFAULT_CACHE_DATA_DIR`]; resolved through `$TANDEM_ROOT`.
    #[serde(default = "default_cache_data_dir")]
    pub data_dir: std::path::PathBuf,
    /// Listening ports.
    #[serde(default)]
    pub ports: CachePorts,
    /// Eviction within the budgets.
    #[serde(default)]
    pub eviction: CacheEviction,
    /// L2→L3 write policy of the tier's clients (reported; clients read theirs from
    /// [`CacheConfig::write_policy`]).
    pub write_policy: WritePolicy,
    /// What a failed L3 registration does in the tier's clients (reported; clients read theirs
    /// from [`MemoryPolicy::registration_failure`]); optional here.
    #[serde(default)]
    pub registration_failure: Option<FailurePolicy>,
}

/// What every object of one L3 store must agree on (DESIGN contract 7; the worker's
/// `l3::manifest` writes it into every object's manifest). A restart with a different value
/// (another model, layout, page size or parallel layout) makes every old object a miss
/// (reference TC-L3-02).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreIdentity {
    /// Model identity and KV geometry ([`ModelIdentity`]).
    pub model: ModelIdentity,
    /// Chunk order of the object bytes.
    pub layout: PoolLayout,
    /// Tokens per page (DESIGN §2 `pageTokens`).
    pub page_tokens: u32,
    /// Tensor-parallel size of the writers.
    pub tp_size: u32,
    /// Context-parallel size of the writers (LayerSplit splits layers across CP ranks).
    pub cp_size: u32,
}

/// Default of [`CacheTierConfig::max_tensor`] and [`CacheTierConfig::max_context`].
pub const DEFAULT_MAX_PARALLEL: u32 = 64;

fn default_max_parallel() -> u32 {
    DEFAULT_MAX_PARALLEL
}

impl CacheTierConfig {
    /// Parses and checks the text of a tier config file; `origin` names the file in errors.
    ///
    /// # Errors
    /// [`ConfigError`]: malformed, wrong version, or inconsistent.
    pub fn from_json(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        parse_checked(text, origin, Self::check)
    }

    /// Checks version, identity, budgets and the watermark range.
    ///
    /// # Errors
    /// [`ConfigError::Version`] or [`ConfigError::Inconsistent`] naming the broken invariant.
    pub fn check(&self) -> Result<(), ConfigError> {
        check_version(&self.api_version, CACHE_TIER_CONFIG_API_VERSION)?;
        let bad = |m: String| Err(ConfigError::Inconsistent(m));
        if let Err(e) = self.model.validate() {
            return bad(format!("model: {e}"));
        }
        if self.page_tokens == 0 || self.max_tensor == 0 || self.max_context == 0 {
            return bad("pageTokens, maxTensor and maxContext must be positive".into());
        }
        if self.memory_bytes == 0 {
            return bad("memoryBytes must be positive".into());
        }
        if !(50..=100).contains(&self.eviction.high_watermark_percent) {
            return bad(format!(
                "eviction.highWatermarkPercent {} is outside 50..=100",
                self.eviction.high_watermark_percent
            ));
        }
        Ok(())
    }

    /// What every stored object must agree on (DESIGN contract 7): model, layout, page size and
    /// the parallel bounds. A restart with another identity turns every old object into a miss.
    pub fn identity(&self) -> StoreIdentity {
        StoreIdentity {
            model: self.model.clone(),
            layout: self.layout,
            page_tokens: self.page_tokens,
            tp_size: self.max_tensor,
            cp_size: self.max_context,
        }
    }

    /// `(memory, disk)` budgets with the high watermark applied: eviction keeps usage at or below
    /// `bytes × percent / 100`.
    pub fn effective_budgets(&self) -> (u64, u64) {
        let pct = u128::from(self.eviction.high_watermark_percent);
        let scale = |b: u64| u64::try_from(u128::from(b) * pct / 100).unwrap_or(u64::MAX);
        (scale(self.memory_bytes), scale(self.disk_bytes))
    }
}

/// Resolves an absolute path a worker reads or writes under `root`, the value of `$TANDEM_ROOT`
/// (worker/interfaces/README.md §2 and §5: the e2e process runner has no mount namespace): with
/// root `/tmp/r`, `/etc/tandem/worker.json` becomes `/tmp/r/etc/tandem/worker.json`. Relative
/// paths, and every path when the root is `None` or empty, are returned unchanged. Pure: the
/// worker's `config::resolve_path` reads the variable.
pub fn resolve_path_under(root: Option<&Path>, path: &Path) -> std::path::PathBuf {
    match root {
        Some(root) if !root.as_os_str().is_empty() && path.is_absolute() => {
            let rel = path.strip_prefix("/").unwrap_or(path);
            root.join(rel)
        }
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier_json() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": CACHE_TIER_CONFIG_API_VERSION,
            "namespace": "serving",
            "tier": "l3",
            "revision": "abc",
            "model": {"name": "llama-3-8b", "layers": 32, "attention": "gqa",
                      "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2},
            "indexer": null,
            "pageTokens": 512,
            "memoryBytes": 1u64 << 30,
            "diskBytes": 16u64 << 30,
            "persistent": true,
            "dataDir": "/var/lib/tandem/cache",
            "eviction": {"policy": "LRU", "highWatermarkPercent": 90},
            "writePolicy": "writeThrough",
            "ports": {"l3": 7420, "health": 8080}
        })
    }

    #[test]
    fn cache_tier_config_defaults_and_round_trip() {
        let cfg: CacheTierConfig = serde_json::from_value(tier_json()).unwrap();
        cfg.check().unwrap();
        assert_eq!(cfg.data_dir, Path::new(DEFAULT_CACHE_DATA_DIR));
        assert_eq!(
            cfg.ports,
            CachePorts {
                l3: 7420,
                health: 8080
            }
        );
        assert_eq!(cfg.identity().tp_size, DEFAULT_MAX_PARALLEL);
        assert_eq!(cfg.registration_failure, None);
        assert_eq!(cfg.eviction.high_watermark_percent, 90);
        assert_eq!(
            cfg.effective_budgets(),
            ((1u64 << 30) * 9 / 10, (16u64 << 30) * 9 / 10)
        );
        let text = serde_json::to_string(&cfg).unwrap();
        let back: CacheTierConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, cfg);
        // Parsed back through the checked path.
        let path = Path::new(CACHE_TIER_CONFIG_FILE);
        assert_eq!(CacheTierConfig::from_json(&text, path).unwrap(), cfg);
    }

    #[test]
    fn cache_tier_config_rejects_unknown_fields_versions_and_bad_values() {
        let mut v = tier_json();
        v["surprise"] = serde_json::json!(1);
        assert!(serde_json::from_value::<CacheTierConfig>(v).is_err());
        let mut v = tier_json();
        v["apiVersion"] = serde_json::json!("tandem.dev/cache-tier-config/v0");
        let cfg: CacheTierConfig = serde_json::from_value(v).unwrap();
        assert!(matches!(cfg.check(), Err(ConfigError::Version { .. })));
        let mut v = tier_json();
        v["eviction"] = serde_json::json!({"highWatermarkPercent": 20});
        let cfg: CacheTierConfig = serde_json::from_value(v).unwrap();
        assert!(matches!(cfg.check(), Err(ConfigError::Inconsistent(_))));
        let mut v = tier_json();
        v["memoryBytes"] = serde_json::json!(0);
        let cfg: CacheTierConfig = serde_json::from_value(v).unwrap();
        assert!(matches!(cfg.check(), Err(ConfigError::Inconsistent(_))));
    }

    #[test]
    fn spec_guard_bounds_are_checked() {
        let ok = SpecGuard {
            min_accept_length: 1.4,
            max_accept_rate: 0.96,
            after_tokens: 128,
            retry_budget: 2,
        };
        ok.check().unwrap();
        let broken = [
            SpecGuard {
                after_tokens: 0,
                ..ok.clone()
            },
            SpecGuard {
                min_accept_length: 0.5,
                ..ok.clone()
            },
            SpecGuard {
                min_accept_length: f64::NAN,
                ..ok.clone()
            },
            SpecGuard {
                max_accept_rate: 0.0,
                ..ok.clone()
            },
            SpecGuard {
                max_accept_rate: 1.01,
                ..ok.clone()
            },
            SpecGuard {
                retry_budget: 11,
                ..ok.clone()
            },
        ];
        for g in broken {
            assert!(g.check().is_err(), "{g:?}");
        }
    }

    #[test]
    fn paths_resolve_under_the_root() {
        let root = Path::new("/tmp/r");
        assert_eq!(
            resolve_path_under(Some(root), Path::new("/etc/tandem/worker.json")),
            Path::new("/tmp/r/etc/tandem/worker.json")
        );
        assert_eq!(
            resolve_path_under(Some(root), Path::new("rel/x")),
            Path::new("rel/x")
        );
        assert_eq!(
            resolve_path_under(None, Path::new("/etc/x")),
            Path::new("/etc/x")
        );
        assert_eq!(
            resolve_path_under(Some(Path::new("")), Path::new("/etc/x")),
            Path::new("/etc/x")
        );
    }

    #[test]
    fn layer_split_is_contiguous_balanced_and_total() {
        for layers in 1..=96u32 {
            for cp in 1..=layers.min(8) {
                let ls = LayerSplit::contiguous(layers, cp).unwrap();
                assert_eq!(ls.owners.len() as u32, layers);
                // Monotone (contiguous ranges) and every rank owns ⌊L/C⌋ or ⌈L/C⌉ layers.
                assert!(ls.owners.windows(2).all(|w| w[0] <= w[1]));
                for r in 0..cp {
                    let n = ls.owned_by(r).count() as u32;
                    assert!(
                        n == layers / cp || n == layers.div_ceil(cp),
                        "L={layers} C={cp} r={r} n={n}"
                    );
                }
            }
        }
        assert_eq!(
            LayerSplit::contiguous(80, 4).unwrap().owned_by(1).next(),
            Some(20)
        );
        assert!(LayerSplit::contiguous(4, 0).is_none());
        assert!(LayerSplit::contiguous(2, 3).is_none());
    }

    #[test]
    fn ranks_follow_the_ordinal() {
        let p = Parallelism {
            tensor: 2,
            context: 3,
        };
        assert_eq!(p.ranks_of(0), Some((0, 0)));
        assert_eq!(p.ranks_of(3), Some((1, 1)));
        assert_eq!(p.ranks_of(5), Some((1, 2)));
        assert_eq!(p.ranks_of(6), None);
    }
}
