//! The resolved worker config of a pool (DESIGN §2: "every field that is accepted is rendered into
//! that config or rejected").

use tandem_crds::{AttentionKind, ModelSpec, Transport};
use tandem_interfaces::config::{
    CONFIG_API_VERSION, CacheConfig, IndexerGeometry, KvDeadline, LayerSplit,
    MemoryPolicy as ConfigMemory, Parallelism, Peers, Ports, SpecGuard, Speculative,
    TransportChoice, WorkerConfig, WorkerRole,
};
use tandem_interfaces::memory::AllocatorDomain;
use tandem_interfaces::model::{Attention, ModelIdentity};

use super::PoolView;
use crate::labels::{self, Role};
use crate::policy::MemoryPolicy;
use crate::quantity::{self, QuantityError};

/// The ports every worker listens on (defined in `tandem-crds`, which e2e shares).
pub use tandem_crds::ports::{
    CONTROL_PORT, DATA_PORT, FRONT_DOOR_PORT, HEALTH_PORT, RANK_LINK_PORT,
};

/// Why a pool's config cannot be rendered (reported as a `Degraded` condition; nothing rolls out).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RenderError {
    /// A size is not a byte quantity.
    #[error(transparent)]
    Quantity(#[from] QuantityError),
    /// The model geometry does not match its attention kind (admission normally refuses this).
    #[error("{which} model {name:?} has no valid geometry for attention {attention:?}")]
    Geometry {
        /// `target` or `draft`.
        which: &'static str,
        /// Model name.
        name: String,
        /// Attention kind.
        attention: AttentionKind,
    },
    /// The host pool is smaller than one page of tokens of the target model.
    #[error(
        "hostPool.size {bytes} B holds {tokens} tokens of {model:?}, fewer than one page of {page_tokens}"
    )]
    HostPoolTooSmall {
        /// Bytes given.
        bytes: u64,
        /// Tokens they hold.
        tokens: u64,
        /// Model name.
        model: String,
        /// Page size in tokens.
        page_tokens: u32,
    },
    /// LayerSplit asked with more CP ranks than layers.
    #[error(
        "layerSplit over {context} context ranks needs at least that many layers (model has {layers})"
    )]
    LayerSplit {
        /// CP ranks.
        context: u32,
        /// Layers.
        layers: u32,
    },
}

/// Converts the API's model identity into the worker's.
///
/// # Errors
/// [`RenderError::Geometry`] when the fields do not match the attention kind.
pub fn model_identity(which: &'static str, m: &ModelSpec) -> Result<ModelIdentity, RenderError> {
    let bad = || RenderError::Geometry {
        which,
        name: m.name.clone(),
        attention: m.attention,
    };
    let pos = |v: Option<i32>| v.and_then(|x| u32::try_from(x).ok()).filter(|x| *x > 0);
    let attention = match m.attention {
        AttentionKind::GQA => Attention::Gqa {
            kv_heads: pos(m.kv_heads).ok_or_else(bad)?,
            head_dim: pos(m.head_dim).ok_or_else(bad)?,
        },
        AttentionKind::MHA => Attention::Mha {
            kv_heads: pos(m.kv_heads).ok_or_else(bad)?,
            head_dim: pos(m.head_dim).ok_or_else(bad)?,
        },
        AttentionKind::MLA => Attention::Mla {
            kv_lora_rank: pos(m.kv_lora_rank).ok_or_else(bad)?,
            rope_dim: m
                .rope_dim
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(bad)?,
        },
    };
    Ok(ModelIdentity {
        name: m.name.clone(),
        layers: u32::try_from(m.layers)
            .ok()
            .filter(|l| *l > 0)
            .ok_or_else(bad)?,
        attention,
        dtype_bytes: u32::try_from(m.dtype.bytes()).unwrap_or(u32::MAX),
        row_extra_bytes: 0,
    })
}

/// Page size when the pool has no tier (the CacheTier default).
pub(crate) const DEFAULT_PAGE_TOKENS: u32 = 512;

/// Renders the worker config of `pool` under `policy` at `revision`.
///
/// Sizing: the host pool's token capacity is `hostPool.size / target bytes-per-token`; the draft and
/// indexer pools hold the same number of tokens in their own geometry, in the same allocator domain
/// (seed 000) — the draft pool includes the draft model's indexer keys when it has an indexer; the
/// segment is the sum of all pools plus the snapshot buffer.
///
/// # Errors
/// [`RenderError`] for sizes that are not byte quantities, a pool smaller than one page, or an
/// inconsistent geometry.
pub fn worker_config(
    pool: &PoolView<'_>,
    policy: &MemoryPolicy,
    revision: &str,
) -> Result<WorkerConfig, RenderError> {
    let model = model_identity("target", pool.model)?;
    let target_bytes = quantity::bytes("spec.hostPool.size", &pool.host_pool.size)?;
    let tokens = target_bytes / model.bytes_per_token();
    let page_tokens = policy
        .l3
        .as_ref()
        .map_or(DEFAULT_PAGE_TOKENS, |l3| l3.page_tokens);
    if tokens < u64::from(page_tokens) {
        return Err(RenderError::HostPoolTooSmall {
            bytes: target_bytes,
            tokens,
            model: model.name.clone(),
            page_tokens,
        });
    }
    let speculative = pool
        .speculative
        .map(|s| -> Result<_, RenderError> {
            Ok(Speculative {
                draft_model: model_identity("draft", &s.draft_model)?,
                draft_tokens: u32::try_from(s.draft_tokens).unwrap_or(1),
            })
        })
        .transpose()?;
    // The draft pool holds the draft's KV and, for a draft with an indexer, its indexer keys,
    // for the same token capacity (same allocator domain, seed 000).
    let draft_bytes = speculative
        .as_ref()
        .map_or(0, |s| tokens * s.draft_model.bytes_per_token())
        + pool
            .speculative
            .map_or(0, |s| tokens * s.draft_model.indexer_bytes_per_token());
    let indexer = pool.model.indexer.as_ref().map(|ix| IndexerGeometry {
        head_dim: u32::try_from(ix.head_dim).unwrap_or(0),
        dtype_bytes: u32::try_from(ix.dtype.bytes()).unwrap_or(u32::MAX),
    });
    let indexer_bytes = tokens * pool.model.indexer_bytes_per_token();
    let snapshot_bytes = match pool.snapshot_buffer {
        Some(q) => quantity::bytes("spec.snapshotBuffer.size", q)?,
        None => 0,
    };
    let parallelism = Parallelism {
        tensor: u32::try_from(pool.parallelism.tensor).unwrap_or(1),
        context: u32::try_from(pool.parallelism.context).unwrap_or(1),
    };
    let layer_split = if pool.layer_split {
        Some(
            LayerSplit::contiguous(model.layers, parallelism.context).ok_or(
                RenderError::LayerSplit {
                    context: parallelism.context,
                    layers: model.layers,
                },
            )?,
        )
    } else {
        None
    };
    let svc = |name: String| format!("{name}.{}.svc", pool.namespace);
    // The CP ranks of a prefill group talk to each other (the rank link: step orders, and the
    // layer broadcasts of LayerSplit); a single rank has no peer.
    let grouped = pool.role == Role::Prefill && parallelism.context > 1;
    Ok(WorkerConfig {
        api_version: CONFIG_API_VERSION.into(),
        role: match pool.role {
            Role::Decode => WorkerRole::Decode,
            Role::Prefill | Role::Cache => WorkerRole::Prefill,
        },
        namespace: pool.namespace.into(),
        pool: pool.name.into(),
        revision: revision.into(),
        indexer,
        parallelism,
        layer_split,
        memory: ConfigMemory {
            // An engine maps the host pools the worker passes it as memfds (DESIGN §3.1): with no
            // CacheTier to decide the domain, that is SharedMemory rather than private mmap.
            allocator: if pool.engine.is_some() && policy.l3.is_none() {
                AllocatorDomain::SharedMemory
            } else {
                policy.allocator
            },
            client_mode: policy.l3.as_ref().map(|l3| l3.client_mode),
            registration_failure: policy
                .l3
                .as_ref()
                .map(|l3| l3.registration_failure)
                .unwrap_or_default(),
            target_pool_bytes: target_bytes,
            draft_pool_bytes: draft_bytes,
            indexer_pool_bytes: indexer_bytes,
            snapshot_buffer_bytes: snapshot_bytes,
            segment_bytes: target_bytes + draft_bytes + indexer_bytes + snapshot_bytes,
        },
        cache: policy.l3.as_ref().map(|l3| CacheConfig {
            tier: l3.tier.clone(),
            service: svc(labels::store_name(&l3.tier)),
            replicas: l3.replicas,
            page_tokens: l3.page_tokens,
            write_policy: l3.write_policy,
        }),
        speculative,
        spec_guard: pool.spec_guard.map(|g| SpecGuard {
            min_accept_length: g.min_accept_length,
            max_accept_rate: g.max_accept_rate,
            after_tokens: u32::try_from(g.after_tokens).unwrap_or(1),
            retry_budget: u32::try_from(g.retry_budget).unwrap_or(0),
        }),
        kv_deadline: pool.kv_deadline.map(|d| KvDeadline {
            milliseconds: u64::try_from(d.milliseconds).unwrap_or(0),
            per_token_microseconds: u64::try_from(d.per_token_microseconds).unwrap_or(0),
        }),
        transport: match pool.transport {
            Transport::Auto => TransportChoice::Auto,
            Transport::RDMA => TransportChoice::Rdma,
            Transport::TCP => TransportChoice::Tcp,
        },
        peers: Peers {
            prefill_service: pool.paired_prefill.map(|p| svc(labels::peers_service(p))),
            decode_service: None,
            // A LayerSplit group's ranks dial each other by pod DNS under the pool's own
            // headless Service (the StatefulSets' serviceName).
            group_service: grouped.then(|| svc(labels::peers_service(pool.name))),
        },
        ports: Ports {
            control: CONTROL_PORT,
            data: DATA_PORT,
            health: HEALTH_PORT,
            front_door: pool.front_door_port.map(|_| FRONT_DOOR_PORT),
            rank_link: grouped.then_some(RANK_LINK_PORT),
        },
        // `spec.engine`: the engine-API seat (None: the worker's built-in engine).
        engine: super::engine::seat(pool),
        model,
    })
}
