//! Spec fragments shared by the three kinds: model identity and KV geometry, parallelism, host
//! pools, speculative decoding and pod overrides.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Attention variant, which decides the shape of one token's KV entry per layer.
///
/// Source: `../shared/data/models.json` (`kv_elems = 2 × kv_heads × head_dim` for MHA/GQA,
/// `kv_lora_rank + rope_dim` for MLA).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum AttentionKind {
    /// Multi-head attention: `kvHeads` equals the query heads.
    MHA,
    /// Grouped-query attention: `kvHeads` key/value heads shared by groups of query heads.
    GQA,
    /// Multi-head latent attention (DeepSeek): one compressed latent of `kvLoraRank + ropeDim`.
    MLA,
}

/// Element type of the KV cache.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum KvDtype {
    /// bfloat16, 2 bytes.
    BF16,
    /// IEEE half, 2 bytes.
    FP16,
    /// 8-bit float (E4M3), 1 byte.
    FP8,
    /// IEEE single, 4 bytes.
    FP32,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            KvDtype::FP8 => 1,
            KvDtype::BF16 | KvDtype::FP16 => 2,
            KvDtype::FP32 => 4,
        }
    }
}

/// The sparse-attention indexer cache (DeepSeek DSA "lightning indexer"): one key of `headDim`
/// elements per token and layer, kept in its own pool beside the KV pool (seed 004, BugFix #2).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct IndexerSpec {
    /// Elements per token and layer.
    #[x_kube(validation = Rule::new("self > 0").message("model.indexer.headDim must be positive"))]
    pub head_dim: i32,
    /// Element type of the indexer keys.
    #[serde(default = "default_indexer_dtype")]
    pub dtype: KvDtype,
}

fn default_indexer_dtype() -> KvDtype {
    KvDtype::FP8
}

/// Model identity: the name and the KV geometry. Two components may share KV pages only if
/// their identities are equal (a page written for one geometry is garbage for another).
///
/// Bytes per token = `layers × kv_elems × dtype bytes`, where `kv_elems = 2 × kvHeads × headDim`
/// (MHA, GQA) or `kvLoraRank + ropeDim` (MLA).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.attention == 'MLA' ? (has(self.kvLoraRank) && has(self.ropeDim) && !has(self.kvHeads) && !has(self.headDim)) : (has(self.kvHeads) && has(self.headDim) && !has(self.kvLoraRank) && !has(self.ropeDim))")
    .message("model geometry: MHA and GQA models set kvHeads and headDim; MLA models set kvLoraRank and ropeDim (and not the other pair)"))]
pub struct ModelSpec {
    /// Model name, e.g. `llama-3-70b` (an identifier, not a path to weights).
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 128").message("model.name must be 1 to 128 characters"))]
    pub name: String,
    /// Transformer layers that hold KV cache.
    #[x_kube(validation = Rule::new("self > 0 && self <= 1024").message("model.layers must be between 1 and 1024"))]
    pub layers: i32,
    /// Attention variant.
    pub attention: AttentionKind,
    /// Key/value heads (MHA, GQA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0").message("model.kvHeads must be positive"))]
    pub kv_heads: Option<i32>,
    /// Elements per head (MHA, GQA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0").message("model.headDim must be positive"))]
    pub head_dim: Option<i32>,
    /// Rank of the compressed KV latent (MLA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0").message("model.kvLoraRank must be positive"))]
    pub kv_lora_rank: Option<i32>,
    /// Decoupled RoPE key dimension (MLA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("model.ropeDim must not be negative"))]
    pub rope_dim: Option<i32>,
    /// KV element type.
    #[serde(default = "default_dtype")]
    pub dtype: KvDtype,
    /// Sparse-attention indexer cache, for models that have one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer: Option<IndexerSpec>,
}

fn default_dtype() -> KvDtype {
    KvDtype::BF16
}

impl ModelSpec {
    /// KV elements per token per layer; `None` when the geometry fields do not match the
    /// attention kind (the CEL rule rejects such specs at admission).
    pub fn kv_elems_per_token_per_layer(&self) -> Option<u64> {
        match self.attention {
            AttentionKind::MHA | AttentionKind::GQA => {
                let heads = u64::try_from(self.kv_heads?).ok()?;
                let dim = u64::try_from(self.head_dim?).ok()?;
                Some(2 * heads * dim)
            }
            AttentionKind::MLA => {
                let rank = u64::try_from(self.kv_lora_rank?).ok()?;
                let rope = u64::try_from(self.rope_dim?).ok()?;
                Some(rank + rope)
            }
        }
    }

    /// KV bytes per token across all layers (the `bytes_per_token` column of models.json).
    pub fn kv_bytes_per_token(&self) -> Option<u64> {
        let layers = u64::try_from(self.layers).ok()?;
        Some(layers * self.kv_elems_per_token_per_layer()? * self.dtype.bytes())
    }

    /// Indexer bytes per token across all layers; 0 without an indexer.
    pub fn indexer_bytes_per_token(&self) -> u64 {
        match (&self.indexer, u64::try_from(self.layers)) {
            (Some(ix), Ok(layers)) => {
                layers * u64::try_from(ix.head_dim).unwrap_or(0) * ix.dtype.bytes()
            }
            _ => 0,
        }
    }
}

/// Parallel layout of one instance. One replica of a pool is one group of
/// `tensor × context` pods with one GPU each; groups roll as units.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Parallelism {
    /// Tensor-parallel ranks (TP).
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 64").message("parallelism.tensor must be between 1 and 64"))]
    pub tensor: i32,
    /// Context-parallel ranks (CP); LayerSplit needs more than one.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 64").message("parallelism.context must be between 1 and 64"))]
    pub context: i32,
}

fn one() -> i32 {
    1
}

impl Default for Parallelism {
    fn default() -> Self {
        Self {
            tensor: 1,
            context: 1,
        }
    }
}

impl Parallelism {
    /// Pods (and GPUs) per group: `tensor × context`.
    pub fn group_size(&self) -> i64 {
        i64::from(self.tensor) * i64::from(self.context)
    }
}

/// Host (L2) KV pool of each worker pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostPoolSpec {
    /// Bytes of host memory for the target model's KV pages (quantity, e.g. `64Gi`). The draft
    /// and indexer pools are sized from the same token capacity and added on top.
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("hostPool.size must be a positive quantity such as 64Gi"))]
    pub size: Quantity,
}

/// Speculative decoding with a draft model. The draft model's host pools are sized for the same
/// token capacity and allocated in the **same allocator domain** as the target's (seed 000: a
/// draft pool on plain mmap beside a shared-memory target pool took a server down). There is
/// deliberately no allocator field here.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpeculativeSpec {
    /// The draft model's identity and KV geometry.
    pub draft_model: ModelSpec,
    /// Tokens proposed by the draft per verification step.
    #[serde(default = "default_draft_tokens")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 16").message("speculative.draftTokens must be between 1 and 16"))]
    pub draft_tokens: i32,
}

fn default_draft_tokens() -> i32 {
    4
}

/// A reference to an object of a known kind in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalRef {
    /// Name of the referenced object.
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 63").message("a reference needs a name of 1 to 63 characters"))]
    pub name: String,
}

/// Bulk KV transport between workers.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum Transport {
    /// RDMA when the pod has a usable ibverbs device, else TCP (logged at start).
    #[default]
    Auto,
    /// RDMA only: a pod without a usable device fails its readiness.
    RDMA,
    /// TCP only.
    TCP,
}

/// The narrow set of pod-template fields a user may override. A full PodTemplateSpec is not
/// accepted on purpose: every accepted field must be rendered or rejected (DESIGN §2), and the
/// operator owns containers, volumes and the GPU resource.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateOverrides {
    /// Extra pod labels (the operator's own labels win on conflict).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Extra pod annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Node selector added to the pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations added to the pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Priority class of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Service account of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
}

/// Which serving engine computes attention beside the worker (DESIGN §3.1).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum EngineKind {
    /// `tandem-worker sim-engine --serve`: the simulated engine as its own process, a client of
    /// the engine API only (deterministic KV bytes, verified on every read). Served now.
    Simulated,
    /// SGLang (`python3 -m sglang.launch_server`) with Tandem's HiCache L3 storage backend
    /// (`tandem_kv.sglang.TandemHiCacheStorage`, `--hicache-storage-backend dynamic`): its
    /// hierarchical cache reads and writes pages through the worker's tiers. The image must have
    /// the `tandem-kv` package installed.
    #[serde(rename = "SGLang")]
    SgLang,
    /// vLLM (`vllm serve`). With a CacheTier: Tandem's KV offloading tier
    /// (`tandem_kv.vllm.TandemSecondaryTier` behind vLLM's `OffloadingConnector` +
    /// `TieringOffloadingSpec`), offloaded blocks going to the worker's tiers, and the engine
    /// serving whole requests. Without one: prefill/decode through Tandem
    /// (`tandem_kv.vllm_pd.TandemConnector`; the DecodePool's front door hands each request to the
    /// chosen prefill's engine and to its own). The image must have the `tandem-kv` package
    /// installed.
    #[serde(rename = "vLLM")]
    Vllm,
}

impl EngineKind {
    /// The wire text (`Simulated`, `SGLang`, `vLLM`).
    pub const fn as_str(self) -> &'static str {
        match self {
            EngineKind::Simulated => "Simulated",
            EngineKind::SgLang => "SGLang",
            EngineKind::Vllm => "vLLM",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The serving engine of a pool's pods (DESIGN §3.1). When set, each pod runs the engine as its
/// main container `engine` and the worker as a native sidecar (it starts before and stops after
/// the engine); both share the engine-API sockets in an `emptyDir` mounted at
/// `/run/tandem/engine`. Unset: the worker runs its built-in in-process simulated engine, alone.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.kind == 'Simulated' || has(self.image)")
    .message("engine.image is required for kind SGLang and vLLM (only the Simulated engine defaults to the worker image)"))]
#[x_kube(validation = Rule::new(SGLANG_ARGS_RULE).message(SGLANG_ARGS_MESSAGE))]
#[x_kube(validation = Rule::new(VLLM_ARGS_RULE).message(VLLM_ARGS_MESSAGE))]
pub struct EngineSpec {
    /// The engine: `Simulated`, `SGLang` or `vLLM`.
    pub kind: EngineKind,
    /// Image of the engine container. `Simulated` defaults to the pool's worker image (it runs
    /// `tandem-worker sim-engine`); `SGLang` and `vLLM` must name one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() > 0").message("engine.image must not be empty"))]
    pub image: Option<String>,
    /// Extra arguments of the engine. Simulated: after the ones the operator renders (the socket
    /// directory, the worker config and the pod's ordinal). SGLang and vLLM: before the adapter's
    /// flags ([`SGLANG_OWNED_FLAGS`], [`VLLM_OWNED_FLAGS`]), which these must not repeat — refused
    /// at admission, alone or as `--flag=value` or `--flag.key=value`. SGLang's `--model-path` and
    /// vLLM's model (first) go here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128), inner(length(max = 4096)))]
    pub args: Vec<String>,
    /// Extra environment variables of the engine container, after the pod's own (`POD_NAME`,
    /// `POD_NAMESPACE`, ...) and the operator's (`TANDEM_ORDINAL`, `TANDEM_ENGINE_SOCKET_DIR`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    pub env: Vec<EnvVar>,
    /// CPU and memory of the engine container (not GPUs: the pod's one GPU is set by the
    /// operator).
    #[serde(default)]
    #[x_kube(validation = Rule::new(crate::prefill_pool::NO_GPU_IN_RESOURCES).message(ENGINE_NO_GPU_MESSAGE))]
    pub resources: ResourceRequirements,
}

/// The SGLang flags the operator renders for Tandem's adapter (`render::engine` of the operator);
/// `engine.args` of kind SGLang must not set them, alone or as `--flag=value`.
pub const SGLANG_OWNED_FLAGS: [&str; 10] = [
    "--host",
    "--port",
    "--page-size",
    "--enable-hierarchical-cache",
    "--hicache-size",
    "--hicache-ratio",
    "--hicache-storage-backend",
    "--hicache-storage-backend-extra-config",
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
];

/// The vLLM flags the operator renders for Tandem's adapter; `engine.args` of kind vLLM must not
/// set them (vLLM's own offloading flags would replace the Tandem tier's connector).
pub const VLLM_OWNED_FLAGS: [&str; 5] = [
    "--host",
    "--port",
    "--kv-transfer-config",
    "--kv-offloading-backend",
    "--kv-offloading-size",
];

/// CEL: no SGLang arg is one of [`SGLANG_OWNED_FLAGS`] (kept in step by a test).
const SGLANG_ARGS_RULE: &str = "self.kind != 'SGLang' || !has(self.args) || self.args.all(a, \
     !['--host', '--port', '--page-size', '--enable-hierarchical-cache', '--hicache-size', \
     '--hicache-ratio', '--hicache-storage-backend', '--hicache-storage-backend-extra-config', \
     '--disaggregation-mode', '--disaggregation-transfer-backend'] \
     .exists(f, a == f || a.startsWith(f + '=') || a.startsWith(f + '.')))";
const SGLANG_ARGS_MESSAGE: &str = "engine.args of kind SGLang must not set --host, --port, --page-size, \
     --enable-hierarchical-cache, --hicache-size, --hicache-ratio, \
     --hicache-storage-backend[-extra-config] or --disaggregation-{mode,transfer-backend}: the operator \
     sets them for Tandem's HiCache backend (the page size is the tier's pageTokens, the host pool \
     hostPool.size) or, without a CacheTier, for Tandem's PD transfer backend";

/// CEL: no vLLM arg is one of [`VLLM_OWNED_FLAGS`] (kept in step by a test).
const VLLM_ARGS_RULE: &str = "self.kind != 'vLLM' || !has(self.args) || self.args.all(a, \
     !['--host', '--port', '--kv-transfer-config', '--kv-offloading-backend', '--kv-offloading-size'] \
     .exists(f, a == f || a.startsWith(f + '=') || a.startsWith(f + '.')))";
const VLLM_ARGS_MESSAGE: &str = "engine.args of kind vLLM must not set --host, --port, --kv-transfer-config, \
     --kv-offloading-backend or --kv-offloading-size: the operator sets the KV \
     transfer config for Tandem's offloading tier";

/// CEL (both pool kinds): a pool whose engine is SGLang or vLLM has groups of one pod. The
/// operator renders `tensor × context` pods of one GPU per group, and each SGLang or vLLM pod runs
/// its own whole engine: the multi-node flags that would join them into one tensor- or
/// context-parallel engine are not rendered in this version, so such a group would run N
/// independent engines that cannot hold the model they were sized for.
pub(crate) const REAL_ENGINE_PARALLELISM_RULE: &str = "!has(self.engine) || self.engine.kind == 'Simulated' \
     || (self.parallelism.tensor == 1 && self.parallelism.context == 1)";
pub(crate) const REAL_ENGINE_PARALLELISM_MESSAGE: &str = "engine.kind SGLang and vLLM run one engine per pod \
     with the pod's one GPU in this version: set parallelism.tensor and parallelism.context to 1 (the \
     engines' multi-node tensor and context parallelism is not rendered)";

/// CEL (PrefillPool): `layerSplit` and `speculative` take effect only beside the Simulated
/// engine. The SGLang and vLLM adapters carry the KV tiers and (vLLM without a CacheTier) the
/// whole prompt's KV to the decode, not LayerSplit or a draft pool (issue 14), so a draft pool or
/// a LayerSplit group the worker sets up would sit unused while the status reported them —
/// refused instead ("a config field the worker ignores is a lie in the pool's status").
pub(crate) const REAL_ENGINE_PREFILL_RULE: &str = "!has(self.engine) || self.engine.kind == 'Simulated' \
     || (!self.layerSplit && !has(self.speculative))";
pub(crate) const REAL_ENGINE_PREFILL_MESSAGE: &str = "layerSplit and speculative take effect only with \
     engine.kind Simulated in this version: the SGLang and vLLM adapters carry the KV tiers, not \
     LayerSplit or the draft pool (run the engine's own speculative decoding through engine.args)";

/// CEL (DecodePool): `speculative` (with its spec guard) takes effect only beside the Simulated
/// engine, and `prefill.kvDeadline` beside it or on an SGLang or vLLM DecodePool without a
/// CacheTier (prefill/decode through Tandem: the front door hands the deadline to the engine's
/// transfer backend or connector). A DecodePool with a CacheTier serves whole requests on the
/// engine's own API in this version: no room, KV deadline, draft pool or spec guard is on its path.
pub(crate) const REAL_ENGINE_DECODE_RULE: &str = "!has(self.engine) || self.engine.kind == 'Simulated' \
     || (!has(self.speculative) && (!has(self.prefill.kvDeadline) || !has(self.cacheTierRef)))";
pub(crate) const REAL_ENGINE_DECODE_MESSAGE: &str = "speculative, and prefill.kvDeadline unless the \
     DecodePool has no CacheTier (prefill/decode through Tandem), take effect only with engine.kind \
     Simulated in this version: an SGLang or vLLM decode with a CacheTier serves whole requests on its \
     own API, so no draft pool, spec guard or KV deadline is on its path (run the engine's own \
     speculative decoding through engine.args)";

/// Message of the engine's GPU rule.
const ENGINE_NO_GPU_MESSAGE: &str =
    "engine.resources must not set nvidia.com/gpu: the operator sets the pod's one GPU";

/// Default of `spec.maxGroupRestarts` on both pool kinds.
pub const DEFAULT_MAX_GROUP_RESTARTS: i32 = 5;

/// `spec.maxGroupRestarts`' default ([`DEFAULT_MAX_GROUP_RESTARTS`]).
pub fn default_max_group_restarts() -> i32 {
    DEFAULT_MAX_GROUP_RESTARTS
}

/// Default worker image; the tag follows the crate version.
pub fn default_worker_image() -> String {
    format!(
        "ghcr.io/tandem-serving/tandem-worker:{}",
        env!("CARGO_PKG_VERSION")
    )
}
