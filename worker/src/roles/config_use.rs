//! Which fields of its `WorkerConfig` a serving role does not act on (issue 13: "a config field the
//! worker ignores is a lie in the pool's status").
//!
//! Every field the operator renders is either acted on by the role that reads the config, refused
//! at start (e.g. `transport: RDMA` this worker cannot serve: [`super::apply_transport`]), or named
//! here. [`unused`] is pure: the rule table below, per role and engine mode, says which set fields
//! change nothing in this release and why. At start each role calls [`apply`]: every unused field
//! is logged as a warning and listed in `/report.config.unused` as `{field, why}`, so that a user
//! reading the pod's report sees what the pool's spec asked for and did not get.
//! `worker/tests/config_fields.rs` holds the worker-side field test: every leaf of the config is
//! either shown to change what the worker does, or is listed here when set.
//!
//! The table shrinks as mechanisms reach the serving path; a rule is removed together with the
//! change that makes the role act on the field.

use serde_json::{Value, json};

use crate::config::{WorkerConfig, WorkerRole};
use crate::health::http::ServeState;

/// A set config field the role does not act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unused {
    /// The field's path in the config file (camelCase, as the operator writes it).
    pub field: &'static str,
    /// Why it changes nothing, in one line.
    pub why: &'static str,
}

const BUILTIN_NO_POOLS: &str = "the built-in engine allocates no host pool through the allocator \
     (its KV lives in a plain process-private buffer) and registers nothing with a store client; \
     pools are allocated and registered only behind the engine API (`engine` set)";

/// The set fields of `cfg` that its role does not act on in this release. Optional fields at
/// their "off" value (`None`, 0) are never listed; fields that are always present
/// (`memory.allocator`, `memory.registrationFailure`) are listed whenever the mode ignores them.
pub fn unused(cfg: &WorkerConfig) -> Vec<Unused> {
    let mut out = Vec::new();
    let mut note = |set: bool, field: &'static str, why: &'static str| {
        if set {
            out.push(Unused { field, why });
        }
    };
    let m = &cfg.memory;
    let builtin = cfg.engine.is_none();
    let decode = cfg.role == WorkerRole::Decode;
    let simulated = cfg
        .engine
        .as_ref()
        .is_some_and(|e| e.kind == crate::config::EngineKind::Simulated);
    note(
        cfg.layer_split.is_some() && !builtin && !simulated && !decode,
        "layerSplit",
        "SGLang and vLLM engines do not compute layer by layer through AwaitLayer yet: each pod \
         stores and sends all layers; only a prefill's L3 shard keys follow the owner map (the \
         built-in and the Simulated engine run LayerSplit groups)",
    );
    // A LayerSplit rank with its engine (`prefill::cp_engine`): its pool holds its owned layers,
    // so the tier calls and the snapshot finalize into them are not served yet.
    let split_engine = cfg.layer_split.is_some() && simulated && !decode;
    note(
        split_engine && cfg.cache.is_some(),
        "cache.tier, cache.service, cache.replicas, cache.writePolicy",
        "a LayerSplit rank with an engine serves no tier calls yet (its L2 and L3 would need keys \
         per owned layer range on the engine path): its engine computes every page",
    );
    note(
        split_engine && m.snapshot_buffer_bytes > 0,
        "memory.snapshotBufferBytes",
        "a LayerSplit rank with an engine keeps no snapshot buffer yet: a snapshot is finalized \
         into the tier L2 its engine loads from, which such a rank does not serve",
    );
    note(
        cfg.layer_split.is_some() && decode,
        "layerSplit",
        "LayerSplit is a prefill group's layout: a decode receives each layer range from its \
         owner whatever the map",
    );
    note(builtin, "memory.allocator", BUILTIN_NO_POOLS);
    note(
        builtin && m.client_mode.is_some(),
        "memory.clientMode",
        BUILTIN_NO_POOLS,
    );
    note(builtin, "memory.registrationFailure", BUILTIN_NO_POOLS);
    note(
        builtin && m.draft_pool_bytes > 0,
        "memory.draftPoolBytes",
        BUILTIN_NO_POOLS,
    );
    note(
        builtin && m.indexer_pool_bytes > 0,
        "memory.indexerPoolBytes",
        BUILTIN_NO_POOLS,
    );
    note(
        m.snapshot_buffer_bytes > 0 && decode,
        "memory.snapshotBufferBytes",
        "the snapshot receive buffer is a prefill's: a decode pushes into its prefill peers' \
         buffers",
    );
    let own_api_engine = cfg
        .engine
        .as_ref()
        .is_some_and(|e| e.kind != crate::config::EngineKind::Simulated);
    note(
        m.snapshot_buffer_bytes > 0 && !decode && own_api_engine,
        "memory.snapshotBufferBytes",
        "snapshot sync needs decode engines that hand over their finished turns' KV (SyncSession, \
         which the Simulated engine does); SGLang and vLLM decode engines serve their own API and \
         hand over none yet, so this prefill's buffer receives nothing",
    );
    note(
        builtin && cfg.indexer.is_some(),
        "indexer",
        "the built-in engine has no indexer cache: the geometry sizes only the indexer pool \
         behind the engine API",
    );
    note(
        decode && cfg.cache.is_some(),
        "cache.tier, cache.service, cache.replicas, cache.writePolicy",
        "a decode worker reads only cache.pageTokens (its page size): its KV comes from the \
         prefill peers, which read and write L2/L3",
    );
    out
}

/// `/report.config`: `{"unused": [{field, why}]}`.
pub fn report(unused: &[Unused]) -> Value {
    json!({
        "unused": unused
            .iter()
            .map(|u| json!({"field": u.field, "why": u.why}))
            .collect::<Vec<_>>(),
    })
}

/// Logs each unused field of `cfg` as a warning and records the list in `/report.config`.
pub fn apply(cfg: &WorkerConfig, state: &ServeState) -> Vec<Unused> {
    let list = unused(cfg);
    for u in &list {
        tracing::warn!(
            field = u.field,
            why = u.why,
            "config field set but not acted on"
        );
    }
    state.set_section("config", report(&list));
    list
}
