//! The worker-side field test (issue 13): every leaf of `WorkerConfig` is acted on, refused at
//! start, or named by the worker as unused — never silently dropped.
//!
//! The test walks the leaves of a fully populated config (every optional section set) and requires
//! a row for each. A row says how the worker treats the field:
//! - `Derived`: changing the field changes what the worker derives from the config through the
//!   same functions its roles call at start (KV layout, region pages, pool set, model identity,
//!   spec-guard thresholds, transport); the probe's output must differ;
//! - `Refused`: the changed value is refused before anything starts (`WorkerConfig::check`, or
//!   the role check of `roles::check_role`);
//! - `Unused`: the worker lists the field in `/report.config.unused` (`roles::config_use`) in the
//!   mode where it does not act on it; the test requires the listing;
//! - `Wired`: bound or resolved at start (ports, Service names, pool identity); the row names the
//!   process test that shows it, and the test checks that test still exists.
//!
//! A field added to the config without a row fails [`every_config_leaf_has_a_row`].

use std::collections::BTreeSet;

use serde_json::Value;
use tandem_worker::config::{
    EngineKind, EngineSeat, IndexerGeometry, KvDeadline, LayerSplit, TransportChoice, WorkerConfig,
    WorkerRole,
};
use tandem_worker::engine_api::identity::{fingerprint, pool_model};
use tandem_worker::engine_api::pools::roles_configured;
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::roles::config_use::unused;
use tandem_worker::roles::decode::kv_deadline_of;
use tandem_worker::roles::sim::{SimKnobs, region_pages};
use tandem_worker::spec_guard::Thresholds;
use tandem_worker::store_client::ClientMode;
use tandem_worker::transfer::select::for_serving_with;

/// The sample decode config of worker/interfaces with every optional section set.
fn full(role: WorkerRole) -> WorkerConfig {
    let text = include_str!("../interfaces/samples/decode-worker.json");
    let mut c: WorkerConfig = serde_json::from_str(text).unwrap();
    c.role = role;
    c.indexer = Some(IndexerGeometry {
        head_dim: 128,
        dtype_bytes: 1,
    });
    c.memory.indexer_pool_bytes = 64 << 20;
    c.memory.snapshot_buffer_bytes = 32 << 20;
    c.memory.segment_bytes = c.memory.target_pool_bytes
        + c.memory.draft_pool_bytes
        + c.memory.indexer_pool_bytes
        + c.memory.snapshot_buffer_bytes;
    c.parallelism.context = 2;
    c.layer_split = LayerSplit::contiguous(c.model.layers, 2);
    c.peers.decode_service = Some("d-peers".into());
    c.peers.group_service = Some("p-peers.serving.svc".into());
    c.ports.rank_link = Some(7002);
    c.engine = Some(EngineSeat {
        kind: EngineKind::Simulated,
        socket_dir: "/run/tandem/engine".into(),
        http_port: Some(8100),
    });
    // A decode setting: a prefill config carrying it is refused (the `DecodeOnly` rows).
    c.kv_deadline = (role == WorkerRole::Decode).then_some(KvDeadline {
        milliseconds: 3_000,
        per_token_microseconds: 50,
    });
    c.check().expect("the full config is valid");
    c
}

/// What the worker derives from a config at start, through the functions its roles call.
fn derived(c: &WorkerConfig) -> String {
    let knobs = SimKnobs::from_lookup(|_| None).unwrap();
    let layout = knobs.layout(c);
    let pools: Vec<_> = roles_configured(c)
        .into_iter()
        .map(|r| (r, pool_model(c, r).map(|m| fingerprint(&m))))
        .collect();
    format!(
        "layout {layout:?} pages {} model {} ranks {:?} pools {pools:?} guard {:?} transport {:?} \
         kv deadline {:?}",
        region_pages(c.memory.target_pool_bytes, layout),
        fingerprint(&c.model),
        c.parallelism.ranks_of(1),
        c.spec_guard.as_ref().map(Thresholds::from),
        for_serving_with(c.transport, || Err("no device".into())),
        kv_deadline_of(c, |_| None),
    )
}

type Mutate = fn(&mut WorkerConfig);

/// Sets a GQA model's KV heads or head width (the attention fields are flattened into the model).
fn gqa(m: &mut ModelIdentity, heads: Option<u32>, dim: Option<u32>) {
    if let Attention::Gqa { kv_heads, head_dim } = &mut m.attention {
        *kv_heads = heads.unwrap_or(*kv_heads);
        *head_dim = dim.unwrap_or(*head_dim);
    } else {
        panic!("the sample models are GQA");
    }
}

/// The same KV sizes under multi-head attention.
fn as_mha(m: &mut ModelIdentity) {
    if let Attention::Gqa { kv_heads, head_dim } = m.attention {
        m.attention = Attention::Mha { kv_heads, head_dim };
    }
}

enum Row {
    Derived(Mutate),
    Refused(Mutate),
    /// Listed as unused in the builtin mode (`engine` unset) when set.
    UnusedBuiltin,
    /// Listed as unused by a decode worker when set (and, for `cache.*`, by a LayerSplit rank
    /// with its engine, which serves no tier calls yet); acted on by a prefill without LayerSplit.
    UnusedDecode,
    /// A prefill group's layout: acted on by a prefill with the built-in or the Simulated engine
    /// (the named process test), listed unused by a decode and beside SGLang or vLLM.
    PrefillGroup(&'static str, &'static str),
    /// The process test that shows it: (file under worker/tests, test fn).
    Wired(&'static str, &'static str),
    /// A decode setting: derived by a decode (as `Derived`), refused in a prefill's config.
    DecodeOnly(Mutate),
}
use Row::*;

fn rows() -> Vec<(&'static str, Row)> {
    vec![
        (
            "apiVersion",
            Refused(|c| c.api_version = "tandem.dev/worker-config/v0".into()),
        ),
        (
            "role",
            Refused(|c| {
                c.role = match c.role {
                    WorkerRole::Prefill => WorkerRole::Decode,
                    WorkerRole::Decode => WorkerRole::Prefill,
                }
            }),
        ),
        (
            "namespace",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "pool",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "revision",
            Wired(
                "serve_processes.rs",
                "decode_refuses_a_prefill_of_another_revision",
            ),
        ),
        ("model.name", Derived(|c| c.model.name = "other".into())),
        ("model.layers", Derived(|c| c.model.layers = 40)),
        (
            "model.attention",
            Derived(|c| {
                as_mha(&mut c.model);
            }),
        ),
        (
            "model.kv_heads",
            Derived(|c| gqa(&mut c.model, Some(4), None)),
        ),
        (
            "model.head_dim",
            Derived(|c| gqa(&mut c.model, None, Some(64))),
        ),
        ("model.dtype_bytes", Derived(|c| c.model.dtype_bytes = 1)),
        (
            "indexer.headDim",
            Derived(|c| c.indexer.as_mut().unwrap().head_dim = 64),
        ),
        (
            "indexer.dtypeBytes",
            Derived(|c| c.indexer.as_mut().unwrap().dtype_bytes = 2),
        ),
        ("parallelism.tensor", Derived(|c| c.parallelism.tensor = 2)),
        (
            "parallelism.context",
            Derived(|c| {
                c.parallelism.context = 1;
                c.layer_split = None;
            }),
        ),
        (
            "layerSplit.owners",
            PrefillGroup(
                "serve_engine_layer_split.rs",
                "a_layer_split_group_of_engines_serves_each_layer_range_from_its_owner",
            ),
        ),
        ("memory.allocator", UnusedBuiltin),
        ("memory.clientMode", UnusedBuiltin),
        ("memory.registrationFailure", UnusedBuiltin),
        (
            "memory.targetPoolBytes",
            Derived(|c| {
                c.memory.target_pool_bytes /= 2;
                c.memory.segment_bytes -= c.memory.target_pool_bytes;
            }),
        ),
        ("memory.draftPoolBytes", UnusedBuiltin),
        ("memory.indexerPoolBytes", UnusedBuiltin),
        (
            "memory.snapshotBufferBytes",
            Wired(
                "serve_engine_decode.rs",
                "snapshot_sync_through_the_engine_api_the_next_turn_loads_the_decode_engines_pages",
            ),
        ),
        (
            "memory.segmentBytes",
            Refused(|c| c.memory.segment_bytes += 1),
        ),
        ("cache.tier", UnusedDecode),
        ("cache.service", UnusedDecode),
        ("cache.replicas", UnusedDecode),
        (
            "cache.pageTokens",
            Derived(|c| c.cache.as_mut().unwrap().page_tokens = 256),
        ),
        ("cache.writePolicy", UnusedDecode),
        (
            "speculative.draftModel.name",
            Derived(|c| {
                c.speculative.as_mut().unwrap().draft_model.name = "other-draft".into();
            }),
        ),
        (
            "speculative.draftModel.layers",
            Derived(|c| {
                c.speculative.as_mut().unwrap().draft_model.layers = 16;
            }),
        ),
        (
            "speculative.draftModel.attention",
            Derived(|c| {
                as_mha(&mut c.speculative.as_mut().unwrap().draft_model);
            }),
        ),
        (
            "speculative.draftModel.kv_heads",
            Derived(|c| {
                gqa(
                    &mut c.speculative.as_mut().unwrap().draft_model,
                    Some(4),
                    None,
                );
            }),
        ),
        (
            "speculative.draftModel.head_dim",
            Derived(|c| {
                gqa(
                    &mut c.speculative.as_mut().unwrap().draft_model,
                    None,
                    Some(64),
                );
            }),
        ),
        (
            "speculative.draftModel.dtype_bytes",
            Derived(|c| {
                c.speculative.as_mut().unwrap().draft_model.dtype_bytes = 1;
            }),
        ),
        (
            "speculative.draftTokens",
            Wired(
                "serve_spec_guard.rs",
                "the_guard_aborts_an_anomalous_decode_and_retries_or_refuses",
            ),
        ),
        (
            "specGuard.minAcceptLength",
            Derived(|c| c.spec_guard.as_mut().unwrap().min_accept_length = 2.0),
        ),
        (
            "specGuard.maxAcceptRate",
            Derived(|c| c.spec_guard.as_mut().unwrap().max_accept_rate = 0.5),
        ),
        (
            "specGuard.afterTokens",
            Derived(|c| c.spec_guard.as_mut().unwrap().after_tokens = 64),
        ),
        (
            "specGuard.retryBudget",
            Wired(
                "serve_spec_guard.rs",
                "the_guard_aborts_an_anomalous_decode_and_retries_or_refuses",
            ),
        ),
        (
            "kvDeadline.milliseconds",
            DecodeOnly(|c| {
                c.kv_deadline
                    .get_or_insert(KvDeadline {
                        milliseconds: 100,
                        per_token_microseconds: 0,
                    })
                    .milliseconds = 7_000;
            }),
        ),
        (
            "kvDeadline.perTokenMicroseconds",
            DecodeOnly(|c| {
                c.kv_deadline
                    .get_or_insert(KvDeadline {
                        milliseconds: 100,
                        per_token_microseconds: 0,
                    })
                    .per_token_microseconds = 400;
            }),
        ),
        (
            "transport",
            Derived(|c| c.transport = TransportChoice::Rdma),
        ),
        (
            "peers.prefillService",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "peers.groupService",
            Wired(
                "serve_layer_split.rs",
                "a_layer_split_group_serves_each_layer_range_from_its_owner",
            ),
        ),
        (
            "ports.rankLink",
            Wired(
                "serve_layer_split.rs",
                "a_layer_split_group_serves_each_layer_range_from_its_owner",
            ),
        ),
        (
            "peers.decodeService",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "ports.control",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "ports.data",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "ports.health",
            Wired(
                "serve_processes.rs",
                "sigterm_turns_readiness_off_finishes_in_flight_work_and_exits_zero",
            ),
        ),
        (
            "ports.frontDoor",
            Wired(
                "serve_processes.rs",
                "streaming_and_plain_completions_through_prefill_and_decode",
            ),
        ),
        (
            "engine.kind",
            Wired(
                "serve_engine.rs",
                "requests_are_served_by_the_engine_through_the_engine_api",
            ),
        ),
        (
            "engine.socketDir",
            Wired(
                "serve_engine.rs",
                "requests_are_served_by_the_engine_through_the_engine_api",
            ),
        ),
        (
            // The decode front door hands requests to a vLLM engine on this port (a Python test:
            // the vLLM venv's real Scheduler behind a real decode worker).
            "engine.httpPort",
            Wired(
                "../python/tests/test_vllm_pd.py",
                "test_a_request_through_the_front_door_lands_the_prefills_bytes_in_vllms_blocks",
            ),
        ),
    ]
}

/// Leaf paths of a JSON value (objects recurse; arrays and scalars are leaves).
fn leaves(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v.as_object() {
        Some(o) => {
            for (k, v) in o {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(v, &p, out);
            }
        }
        None => {
            out.insert(prefix.to_owned());
        }
    }
}

#[test]
fn every_config_leaf_has_a_row() {
    let mut all = BTreeSet::new();
    leaves(
        &serde_json::to_value(full(WorkerRole::Decode)).unwrap(),
        "",
        &mut all,
    );
    let covered: BTreeSet<String> = rows().iter().map(|(p, _)| (*p).to_owned()).collect();
    let missing: Vec<_> = all.difference(&covered).collect();
    let stale: Vec<_> = covered.difference(&all).collect();
    assert!(
        missing.is_empty(),
        "config fields without a row: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "rows for fields the config no longer has: {stale:?}"
    );
}

fn unused_names(c: &WorkerConfig) -> String {
    unused(c)
        .iter()
        .map(|u| u.field)
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
fn every_field_is_acted_on_refused_or_named_unused() {
    let tests_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    for role in [WorkerRole::Decode, WorkerRole::Prefill] {
        let base = full(role);
        let mut builtin = base.clone();
        builtin.engine = None;
        for (path, row) in rows() {
            match row {
                Derived(m) => {
                    let mut c = base.clone();
                    m(&mut c);
                    assert_ne!(
                        derived(&base),
                        derived(&c),
                        "{path}: changing it changes nothing"
                    );
                }
                Refused(m) => {
                    let mut c = base.clone();
                    m(&mut c);
                    let refused =
                        c.check().is_err() || tandem_worker::roles::check_role(&c, role).is_err();
                    assert!(refused, "{path}: the changed value is accepted");
                }
                UnusedBuiltin => {
                    let names = unused_names(&builtin);
                    assert!(
                        names.contains(path),
                        "{path}: builtin mode lists only [{names}]"
                    );
                    assert!(
                        !unused_names(&base).contains(path),
                        "{path}: listed unused behind the engine API too"
                    );
                }
                UnusedDecode => {
                    let names = unused_names(&base);
                    // The base prefill is a LayerSplit rank with the Simulated engine.
                    let split_engine = role == WorkerRole::Prefill && path.starts_with("cache.");
                    assert_eq!(
                        names.contains(path),
                        role == WorkerRole::Decode || split_engine,
                        "{path} ({role:?}): [{names}]"
                    );
                    let mut plain = base.clone();
                    plain.layer_split = None;
                    let names = unused_names(&plain);
                    assert_eq!(
                        names.contains(path),
                        role == WorkerRole::Decode,
                        "{path} ({role:?}, no LayerSplit): [{names}]"
                    );
                }
                PrefillGroup(file, test) => {
                    let p = path.split('.').next().unwrap();
                    let decode = role == WorkerRole::Decode;
                    assert_eq!(unused_names(&base).contains(p), decode, "{path} ({role:?})");
                    assert_eq!(
                        unused_names(&builtin).contains(p),
                        decode,
                        "{path} ({role:?}) in builtin mode"
                    );
                    let mut sglang = base.clone();
                    if let Some(e) = sglang.engine.as_mut() {
                        e.kind = EngineKind::SgLang;
                    }
                    assert!(unused_names(&sglang).contains(p), "{path} beside SGLang");
                    let src = std::fs::read_to_string(tests_dir.join(file))
                        .unwrap_or_else(|e| panic!("{path}: {file}: {e}"));
                    assert!(src.contains(test), "{path}: {file} lacks {test}");
                }
                DecodeOnly(m) => {
                    let mut c = base.clone();
                    m(&mut c);
                    if role == WorkerRole::Decode {
                        assert_ne!(
                            derived(&base),
                            derived(&c),
                            "{path}: changing it changes nothing"
                        );
                    } else {
                        assert!(c.check().is_err(), "{path}: a prefill accepts it");
                    }
                }
                Wired(file, test) => {
                    let src = std::fs::read_to_string(tests_dir.join(file))
                        .unwrap_or_else(|e| panic!("{path}: {file}: {e}"));
                    assert!(src.contains(test), "{path}: {file} lacks {test}");
                }
            }
        }
    }
}

/// The rows' mutations are real: each Derived field's probe would be blind if the worker's
/// derivation ignored it (negative control of the probe: a field the worker does not read, the
/// snapshot buffer, changes nothing derived).
#[test]
fn the_probe_does_not_see_fields_the_worker_ignores() {
    let base = full(WorkerRole::Prefill);
    let mut c = base.clone();
    c.memory.snapshot_buffer_bytes *= 2;
    c.memory.segment_bytes += base.memory.snapshot_buffer_bytes;
    assert_eq!(derived(&base), derived(&c));
    // Read by a prefill beside the Simulated engine (snapshot sync), not beside SGLang's, nor by
    // a LayerSplit rank with its engine (no tier to finalize into yet).
    assert!(unused_names(&c).contains("memory.snapshotBufferBytes"));
    c.layer_split = None;
    assert!(!unused_names(&c).contains("memory.snapshotBufferBytes"));
    let mut own_api = c.clone();
    if let Some(e) = own_api.engine.as_mut() {
        e.kind = EngineKind::SgLang;
    }
    assert!(unused_names(&own_api).contains("memory.snapshotBufferBytes"));
    let mut standalone = base.clone();
    standalone.memory.client_mode = Some(ClientMode::Embedded);
    assert!(standalone.check().is_ok());
}
