//! The Attach identity check (DESIGN §3.1 "Attach"): the engine's identity against the worker config.
//!
//! Pure: it decides, before any side effect, whether the engine may attach and which pools it gets.
//! The first difference is refused with `IDENTITY_MISMATCH` naming the field and both values; a pool
//! that is not configured is `POOL_NOT_CONFIGURED`; a pool the engine would bring in another domain
//! than the configured one is `POOL_DOMAIN_MISMATCH` (seed 000); malformed input is `MALFORMED`.

use tonic::Code;

use crate::config::{IndexerGeometry, WorkerConfig};
use crate::memory::AllocatorDomain;
use crate::memory::pool::{PoolLayout, PoolRole};
use crate::model::{Attention, ModelIdentity};

use super::error::ApiError;
use super::{EngineApiConfig, pb};

/// What an accepted identity gets: the pools, in delivery (`fd_index`) order — target, draft, indexer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachPlan {
    /// Pool roles, each once.
    pub pools: Vec<PoolRole>,
}

/// The canonical text of a model identity that [`fingerprint`] hashes:
/// `tandem-model-v1;name=<name>;layers=<n>;attention=<gqa|mha|mla>;<widths>;dtype_bytes=<n>;row_extra_bytes=<n>`
/// with widths `kv_heads=<n>;head_dim=<n>` (GQA, MHA) or `kv_lora_rank=<n>;rope_dim=<n>` (MLA).
pub fn canonical_text(m: &ModelIdentity) -> String {
    let (kind, widths) = match m.attention {
        Attention::Gqa { kv_heads, head_dim } => {
            ("gqa", format!("kv_heads={kv_heads};head_dim={head_dim}"))
        }
        Attention::Mha { kv_heads, head_dim } => {
            ("mha", format!("kv_heads={kv_heads};head_dim={head_dim}"))
        }
        Attention::Mla {
            kv_lora_rank,
            rope_dim,
        } => (
            "mla",
            format!("kv_lora_rank={kv_lora_rank};rope_dim={rope_dim}"),
        ),
    };
    format!(
        "tandem-model-v1;name={};layers={};attention={kind};{widths};dtype_bytes={};row_extra_bytes={}",
        m.name, m.layers, m.dtype_bytes, m.row_extra_bytes
    )
}

/// The model fingerprint: lowercase hex (16 digits) of xxh3-64 over [`canonical_text`].
pub fn fingerprint(m: &ModelIdentity) -> String {
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(canonical_text(m).as_bytes())
    )
}

/// The wire form of a model identity.
pub fn model_to_proto(m: &ModelIdentity) -> pb::ModelIdentity {
    let kind = match m.attention {
        Attention::Gqa { kv_heads, head_dim } => {
            pb::attention::Kind::Gqa(pb::Gqa { kv_heads, head_dim })
        }
        Attention::Mha { kv_heads, head_dim } => {
            pb::attention::Kind::Mha(pb::Gqa { kv_heads, head_dim })
        }
        Attention::Mla {
            kv_lora_rank,
            rope_dim,
        } => pb::attention::Kind::Mla(pb::Mla {
            kv_lora_rank,
            rope_dim,
        }),
    };
    pb::ModelIdentity {
        name: m.name.clone(),
        layers: m.layers,
        attention: Some(pb::Attention { kind: Some(kind) }),
        dtype_bytes: m.dtype_bytes,
        row_extra_bytes: m.row_extra_bytes,
    }
}

/// A model identity from the wire, validated ([`ModelIdentity::validate`]).
///
/// # Errors
/// `MALFORMED` naming `<field>.attention` or the invalid field.
pub fn model_from_proto(field: &str, m: &pb::ModelIdentity) -> Result<ModelIdentity, ApiError> {
    let attention = match m.attention.as_ref().and_then(|a| a.kind.as_ref()) {
        Some(pb::attention::Kind::Gqa(g)) => Attention::Gqa {
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
        },
        Some(pb::attention::Kind::Mha(g)) => Attention::Mha {
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
        },
        Some(pb::attention::Kind::Mla(l)) => Attention::Mla {
            kv_lora_rank: l.kv_lora_rank,
            rope_dim: l.rope_dim,
        },
        None => {
            return Err(ApiError::malformed(
                &format!("{field}.attention"),
                "the attention family (gqa, mha or mla) is missing",
            ));
        }
    };
    let model = ModelIdentity {
        name: m.name.clone(),
        layers: m.layers,
        attention,
        dtype_bytes: m.dtype_bytes,
        row_extra_bytes: m.row_extra_bytes,
    };
    model.validate().map_err(|e| match e {
        crate::model::ModelError::Invalid { field: f, .. } => {
            ApiError::malformed(&format!("{field}.{f}"), e.to_string())
        }
        other => ApiError::malformed(field, other.to_string()),
    })?;
    Ok(model)
}

/// The wire form of a pool layout.
pub fn layout_to_proto(l: PoolLayout) -> pb::PoolLayout {
    match l {
        PoolLayout::LayerFirst => pb::PoolLayout::LayerFirst,
        PoolLayout::PageFirst => pb::PoolLayout::PageFirst,
    }
}

/// The wire form of a domain.
pub fn domain_to_proto(d: AllocatorDomain) -> pb::Domain {
    match d {
        AllocatorDomain::SharedMemory => pb::Domain::SharedMemory,
        AllocatorDomain::Mmap => pb::Domain::Mmap,
        AllocatorDomain::Pinned => pb::Domain::Pinned,
        AllocatorDomain::Device => pb::Domain::Device,
    }
}

/// A domain from the wire; `None` for unspecified or unknown values.
pub fn domain_from_proto(v: i32) -> Option<AllocatorDomain> {
    match pb::Domain::try_from(v).ok()? {
        pb::Domain::SharedMemory => Some(AllocatorDomain::SharedMemory),
        pb::Domain::Mmap => Some(AllocatorDomain::Mmap),
        pb::Domain::Pinned => Some(AllocatorDomain::Pinned),
        pb::Domain::Device => Some(AllocatorDomain::Device),
        pb::Domain::Unspecified => None,
    }
}

/// The wire form of a pool role.
pub fn kind_to_proto(r: PoolRole) -> pb::PoolKind {
    match r {
        PoolRole::Target => pb::PoolKind::Target,
        PoolRole::Draft => pb::PoolKind::Draft,
        PoolRole::Indexer => pb::PoolKind::Indexer,
    }
}

/// A pool role from the wire; `None` for unspecified or unknown values.
pub fn kind_from_proto(v: i32) -> Option<PoolRole> {
    match pb::PoolKind::try_from(v).ok()? {
        pb::PoolKind::Target => Some(PoolRole::Target),
        pb::PoolKind::Draft => Some(PoolRole::Draft),
        pb::PoolKind::Indexer => Some(PoolRole::Indexer),
        pb::PoolKind::Unspecified => None,
    }
}

fn mismatch(field: &str, ours: impl ToString, theirs: impl ToString) -> ApiError {
    let (ours, theirs) = (ours.to_string(), theirs.to_string());
    ApiError::new(
        Code::FailedPrecondition,
        pb::ErrorReason::IdentityMismatch,
        format!("{field}: the worker is configured with {ours}, the engine presents {theirs}"),
    )
    .field(field)
    .sides(ours, theirs)
}

/// The first field in which two model identities differ, as `(field, ours, theirs)`.
fn model_difference(
    ours: &ModelIdentity,
    theirs: &ModelIdentity,
) -> Option<(String, String, String)> {
    let d = |f: &str, a: &dyn ToString, b: &dyn ToString| {
        Some((f.to_owned(), a.to_string(), b.to_string()))
    };
    if ours.name != theirs.name {
        return d("name", &ours.name, &theirs.name);
    }
    if ours.layers != theirs.layers {
        return d("layers", &ours.layers, &theirs.layers);
    }
    let family = |a: &Attention| match a {
        Attention::Gqa { .. } => "gqa",
        Attention::Mha { .. } => "mha",
        Attention::Mla { .. } => "mla",
    };
    match (ours.attention, theirs.attention) {
        (
            Attention::Gqa {
                kv_heads: a,
                head_dim: b,
            },
            Attention::Gqa {
                kv_heads: c,
                head_dim: e,
            },
        )
        | (
            Attention::Mha {
                kv_heads: a,
                head_dim: b,
            },
            Attention::Mha {
                kv_heads: c,
                head_dim: e,
            },
        ) => {
            if a != c {
                return d("attention.kv_heads", &a, &c);
            }
            if b != e {
                return d("attention.head_dim", &b, &e);
            }
        }
        (
            Attention::Mla {
                kv_lora_rank: a,
                rope_dim: b,
            },
            Attention::Mla {
                kv_lora_rank: c,
                rope_dim: e,
            },
        ) => {
            if a != c {
                return d("attention.kv_lora_rank", &a, &c);
            }
            if b != e {
                return d("attention.rope_dim", &b, &e);
            }
        }
        (a, b) => return d("attention", &family(&a), &family(&b)),
    }
    if ours.dtype_bytes != theirs.dtype_bytes {
        return d("dtype_bytes", &ours.dtype_bytes, &theirs.dtype_bytes);
    }
    if ours.row_extra_bytes != theirs.row_extra_bytes {
        return d(
            "row_extra_bytes",
            &ours.row_extra_bytes,
            &theirs.row_extra_bytes,
        );
    }
    None
}

/// The configured byte size of a pool role (0 = not configured).
pub fn configured_bytes(cfg: &WorkerConfig, role: PoolRole) -> u64 {
    match role {
        PoolRole::Target => cfg.memory.target_pool_bytes,
        PoolRole::Draft => cfg.memory.draft_pool_bytes,
        PoolRole::Indexer => cfg.memory.indexer_pool_bytes,
    }
}

/// The engine name an identity of `kind` presents before its `/version` (`simulated`, `sglang`,
/// `vllm`; the config's `engine.kind`, DESIGN §3.1).
pub fn engine_name(kind: crate::config::EngineKind) -> &'static str {
    match kind {
        crate::config::EngineKind::Simulated => "simulated",
        crate::config::EngineKind::SgLang => "sglang",
        crate::config::EngineKind::Vllm => "vllm",
    }
}

/// Whether an identity's `engine` text (`<name>/<version>`, name case-insensitive) names `kind`.
pub fn engine_matches(kind: crate::config::EngineKind, engine: &str) -> bool {
    let name = engine.split('/').next().unwrap_or_default();
    name.eq_ignore_ascii_case(engine_name(kind))
}

/// Checks `id` against the worker config and API settings; decides the pools.
///
/// # Errors
/// `IDENTITY_MISMATCH` (field `engine`) when the config names an engine kind the identity's
/// `engine` does not ([`engine_matches`]); then `MALFORMED`, `IDENTITY_MISMATCH`,
/// `POOL_NOT_CONFIGURED`, `POOL_DOMAIN_MISMATCH` or `ADOPTION_UNSUPPORTED`, in the order the fields
/// are checked; nothing has happened yet.
pub fn check(
    cfg: &WorkerConfig,
    api: &EngineApiConfig,
    id: &pb::EngineIdentity,
) -> Result<AttachPlan, ApiError> {
    if let Some(seat) = &cfg.engine
        && !engine_matches(seat.kind, &id.engine)
    {
        return Err(mismatch(
            "engine",
            format!("{}/…", engine_name(seat.kind)),
            &id.engine,
        ));
    }
    let pm = id
        .model
        .as_ref()
        .ok_or_else(|| ApiError::malformed("identity.model", "the target model is missing"))?;
    let model = model_from_proto("identity.model", pm)?;
    if let Some((f, ours, theirs)) = model_difference(&cfg.model, &model) {
        return Err(mismatch(&format!("model.{f}"), ours, theirs));
    }
    if !id.model_fingerprint.is_empty() {
        let ours = fingerprint(&cfg.model);
        if id.model_fingerprint != ours {
            return Err(mismatch("model_fingerprint", ours, &id.model_fingerprint));
        }
    }
    if id.page_tokens == 0 {
        return Err(ApiError::malformed(
            "identity.page_tokens",
            "page_tokens must be at least 1",
        ));
    }
    if id.page_tokens != api.page_tokens {
        return Err(mismatch("page_tokens", api.page_tokens, id.page_tokens));
    }
    let layout = match pb::PoolLayout::try_from(id.layout) {
        Ok(pb::PoolLayout::LayerFirst) => PoolLayout::LayerFirst,
        Ok(pb::PoolLayout::PageFirst) => PoolLayout::PageFirst,
        _ => {
            return Err(ApiError::malformed(
                "identity.layout",
                format!("layout {} is not a known pool layout", id.layout),
            ));
        }
    };
    if layout != api.layout {
        return Err(mismatch(
            "layout",
            layout_to_proto(api.layout).as_str_name(),
            layout_to_proto(layout).as_str_name(),
        ));
    }
    let par = cfg.parallelism;
    if id.tp_size != par.tensor {
        return Err(mismatch("tp_size", par.tensor, id.tp_size));
    }
    if id.cp_size != par.context {
        return Err(mismatch("cp_size", par.context, id.cp_size));
    }
    if id.tp_rank >= id.tp_size {
        return Err(ApiError::malformed(
            "identity.tp_rank",
            format!("tp_rank {} is not below tp_size {}", id.tp_rank, id.tp_size),
        ));
    }
    if id.cp_rank >= id.cp_size {
        return Err(ApiError::malformed(
            "identity.cp_rank",
            format!("cp_rank {} is not below cp_size {}", id.cp_rank, id.cp_size),
        ));
    }
    if let Some((tp, cp)) = api.ranks {
        if id.tp_rank != tp {
            return Err(mismatch("tp_rank", tp, id.tp_rank));
        }
        if id.cp_rank != cp {
            return Err(mismatch("cp_rank", cp, id.cp_rank));
        }
    }
    let mut roles = Vec::new();
    for (i, req) in id.pools.iter().enumerate() {
        let field = format!("identity.pools[{i}]");
        let role = kind_from_proto(req.kind).ok_or_else(|| {
            ApiError::malformed(
                &format!("{field}.kind"),
                format!("pool kind {} is not target, draft or indexer", req.kind),
            )
        })?;
        if roles.contains(&role) {
            return Err(ApiError::malformed(
                &format!("{field}.kind"),
                format!("the {role} pool is asked for twice"),
            ));
        }
        check_pool(cfg, role, req, &field)?;
        roles.push(role);
    }
    if !roles.contains(&PoolRole::Target) {
        return Err(ApiError::malformed(
            "identity.pools",
            "the target pool must be among the pools",
        ));
    }
    roles.sort();
    Ok(AttachPlan { pools: roles })
}

fn not_configured(role: PoolRole, why: &str) -> ApiError {
    ApiError::new(
        Code::FailedPrecondition,
        pb::ErrorReason::PoolNotConfigured,
        format!("the {role} pool is not configured on this worker: {why}"),
    )
    .field(format!("pools.{role}"))
}

fn check_pool(
    cfg: &WorkerConfig,
    role: PoolRole,
    req: &pb::PoolRequest,
    field: &str,
) -> Result<(), ApiError> {
    match role {
        PoolRole::Target => {}
        PoolRole::Draft => {
            let Some(spec) = &cfg.speculative else {
                return Err(not_configured(
                    role,
                    "the pool has no `speculative` section",
                ));
            };
            let dm = req.draft_model.as_ref().ok_or_else(|| {
                ApiError::malformed(
                    &format!("{field}.draft_model"),
                    "a draft pool names its draft model",
                )
            })?;
            let theirs = model_from_proto(&format!("{field}.draft_model"), dm)?;
            if let Some((f, a, b)) = model_difference(&spec.draft_model, &theirs) {
                return Err(mismatch(&format!("speculative.draft_model.{f}"), a, b));
            }
        }
        PoolRole::Indexer => {
            let Some(ours) = &cfg.indexer else {
                return Err(not_configured(role, "the model has no `indexer` geometry"));
            };
            let g = req.indexer.as_ref().ok_or_else(|| {
                ApiError::malformed(
                    &format!("{field}.indexer"),
                    "an indexer pool names its geometry",
                )
            })?;
            let theirs = IndexerGeometry {
                head_dim: g.head_dim,
                dtype_bytes: g.dtype_bytes,
            };
            if theirs.head_dim != ours.head_dim {
                return Err(mismatch("indexer.head_dim", ours.head_dim, theirs.head_dim));
            }
            if theirs.dtype_bytes != ours.dtype_bytes {
                return Err(mismatch(
                    "indexer.dtype_bytes",
                    ours.dtype_bytes,
                    theirs.dtype_bytes,
                ));
            }
        }
    }
    if configured_bytes(cfg, role) == 0 {
        return Err(not_configured(role, "its configured size is 0 bytes"));
    }
    match pb::PoolSource::try_from(req.source) {
        Ok(pb::PoolSource::Worker) => Ok(()),
        Ok(pb::PoolSource::Engine) => {
            let theirs = domain_from_proto(req.engine_domain).ok_or_else(|| {
                ApiError::malformed(
                    &format!("{field}.engine_domain"),
                    "an engine-provided pool names its allocator domain",
                )
            })?;
            let ours = cfg.memory.allocator;
            if theirs != ours {
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::PoolDomainMismatch,
                    format!(
                        "the engine's {role} pool is in the {theirs} domain but every pool of this worker must be in {ours} (seed 000: a pool outside the store client's memory cannot be registered); let the worker allocate it"
                    ),
                )
                .field(format!("pools.{role}.engine_domain"))
                .sides(ours.as_str(), theirs.as_str()));
            }
            Err(ApiError::new(
                Code::Unimplemented,
                pb::ErrorReason::AdoptionUnsupported,
                format!(
                    "this worker allocates every pool itself; ask for the {role} pool with source POOL_SOURCE_WORKER"
                ),
            )
            .field(format!("pools.{role}.source")))
        }
        Err(_) => Err(ApiError::malformed(
            &format!("{field}.source"),
            format!("pool source {} is unknown", req.source),
        )),
    }
}

/// The pool model used for geometry: the target or draft model, or for the indexer a synthetic
/// identity whose row is `head_dim × dtype_bytes` bytes on each of the target's layers.
pub fn pool_model(cfg: &WorkerConfig, role: PoolRole) -> Option<ModelIdentity> {
    match role {
        PoolRole::Target => Some(cfg.model.clone()),
        PoolRole::Draft => cfg.speculative.as_ref().map(|s| s.draft_model.clone()),
        PoolRole::Indexer => cfg.indexer.as_ref().map(|g| ModelIdentity {
            name: format!("{}/indexer", cfg.model.name),
            layers: cfg.model.layers,
            attention: Attention::Mla {
                kv_lora_rank: g.head_dim,
                rope_dim: 0,
            },
            dtype_bytes: g.dtype_bytes,
            row_extra_bytes: 0,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelIdentity {
        ModelIdentity {
            name: "m".into(),
            layers: 4,
            attention: Attention::Gqa {
                kv_heads: 2,
                head_dim: 8,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        }
    }

    #[test]
    fn the_engine_kind_of_the_config_must_name_the_attaching_engine() {
        use crate::config::EngineKind;
        assert!(engine_matches(EngineKind::Simulated, "simulated/0.1.0"));
        assert!(engine_matches(EngineKind::SgLang, "SGLang/0.5.23"));
        assert!(engine_matches(EngineKind::Vllm, "vllm"));
        assert!(!engine_matches(EngineKind::SgLang, "simulated/0.1.0"));
        assert!(!engine_matches(EngineKind::Simulated, ""));
        assert!(!engine_matches(EngineKind::Vllm, "vllm-fork/1"));
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive_to_every_field() {
        let a = fingerprint(&model());
        assert_eq!(a.len(), 16);
        assert_eq!(a, fingerprint(&model()));
        let mut m = model();
        m.row_extra_bytes = 4;
        assert_ne!(a, fingerprint(&m));
        assert_eq!(
            canonical_text(&model()),
            "tandem-model-v1;name=m;layers=4;attention=gqa;kv_heads=2;head_dim=8;dtype_bytes=2;row_extra_bytes=0"
        );
    }

    #[test]
    fn model_round_trips_and_the_first_difference_is_named() {
        let m = model();
        assert_eq!(model_from_proto("x", &model_to_proto(&m)).unwrap(), m);
        let mut other = m.clone();
        other.attention = Attention::Gqa {
            kv_heads: 2,
            head_dim: 16,
        };
        assert_eq!(
            model_difference(&m, &other),
            Some(("attention.head_dim".into(), "8".into(), "16".into()))
        );
        let mut bad = model_to_proto(&m);
        bad.attention = None;
        assert_eq!(
            model_from_proto("identity.model", &bad).unwrap_err().field,
            "identity.model.attention"
        );
        bad = model_to_proto(&m);
        bad.layers = 0;
        assert_eq!(
            model_from_proto("identity.model", &bad).unwrap_err().field,
            "identity.model.layers"
        );
    }
}
