//! Every accepted spec field is rendered or rejected (DESIGN §2: "no silently dropped fields").
//!
//! The test walks the CRD schemas and requires every leaf field to appear in a table saying
//! where it goes. A field whose disposition is `Rendered` must change the rendered output (worker
//! config, tier config, StatefulSets, Services) when it changes; `Controller` fields are used by
//! a reconciler (counts, references, deadlines) and name the function that reads them;
//! `Identity` fields are compared across kinds and raise `PolicyConflict` on a mismatch. A new
//! field added to a CRD without an entry here fails the test.
//!
//! The PrefillPool is checked with `spec.engine: {kind: Simulated}` added (so that the engine's image,
//! args, env and resources have a base to change); `spec.engine.kind` itself is covered by
//! [`every_engine_kind_renders_its_own_pod`]: unset, `Simulated`, `SGLang` and `vLLM` render four
//! different sets of objects on both pool kinds.

use std::collections::BTreeSet;
use std::path::Path;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::CustomResourceExt;
use serde_json::{Value, json};
use tandem_crds::{CacheTier, DecodePool, PrefillPool};
use tandem_operator::controller::revision::resolve_with;
use tandem_operator::policy::TierLookup;
use tandem_operator::render::{PoolView, tier, workload};

#[derive(Debug, Clone, Copy)]
enum Disposition {
    /// Changing the field to this value changes the rendered objects.
    Rendered(fn() -> Value),
    /// Read by a controller; the text names where.
    Controller(&'static str),
}
use Disposition::*;

fn sample(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file);
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Leaf field paths of a CRD's spec schema (arrays, maps and opaque objects are leaves).
fn leaves(schema: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    const OPAQUE: [&str; 2] = ["resources", "engine.resources"];
    match schema.get("properties").and_then(Value::as_object) {
        Some(props) if !OPAQUE.contains(&prefix) => {
            for (k, v) in props {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(v, &p, out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

fn spec_leaves(
    crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> BTreeSet<String> {
    let v = serde_json::to_value(crd).unwrap();
    let spec = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut out = BTreeSet::new();
    leaves(spec, "", &mut out);
    out
}

fn set(v: &mut Value, path: &str, value: Value) {
    let mut cur = v;
    let parts: Vec<&str> = path.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        if cur.get(*p).is_none_or(Value::is_null) {
            cur[*p] = json!({});
        }
        cur = &mut cur[*p];
    }
    cur[parts[parts.len() - 1]] = value;
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "serving.tandem.dev/v1alpha1".into(),
        kind: "X".into(),
        name: "x".into(),
        uid: "u".into(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// Everything a pool renders to, as one JSON value.
fn render_pool(pool: &Value, tier_v: &Value, decode: bool) -> Value {
    let tier: CacheTier = serde_json::from_value(tier_v.clone()).unwrap();
    let lookup = TierLookup::Found {
        name: "llama70b-l3",
        spec: &tier.spec,
        terminating: false,
    };
    let (p, d);
    let view = if decode {
        d = serde_json::from_value::<DecodePool>(pool.clone()).unwrap();
        PoolView::decode(&d)
    } else {
        p = serde_json::from_value::<PrefillPool>(pool.clone()).unwrap();
        PoolView::prefill(&p)
    };
    let r = resolve_with(&view, lookup).expect("renders");
    let mut cfg = r.config.clone();
    cfg.revision = r.own_revision.clone();
    let mut out = vec![
        serde_json::to_value(&cfg).unwrap(),
        serde_json::to_value(workload::group_statefulset(&view, &cfg, 0, &owner())).unwrap(),
        serde_json::to_value(workload::peers_service(&view, &owner())).unwrap(),
    ];
    if let Some(port) = view.front_door_port {
        out.push(
            serde_json::to_value(workload::front_door_service(&view, port, &owner())).unwrap(),
        );
    }
    Value::Array(out)
}

fn render_tier(tier_v: &Value) -> Value {
    let t: CacheTier = serde_json::from_value(tier_v.clone()).unwrap();
    let cfg = tier::tier_config(&t).unwrap();
    json!([
        cfg,
        tier::store_statefulset(&t, &cfg, t.spec.replicas, &owner()),
        tier::store_service(&t, &owner())
    ])
}

/// Gives the pool a Simulated engine, so the engine fields have a base to change.
fn with_engine(mut v: Value) -> Value {
    v["spec"]["engine"] = json!({"kind": "Simulated"});
    v
}

/// Gives the pool a `Preferred` zone placement, so `placement.mode` has a base to change.
fn with_placement(mut v: Value) -> Value {
    v["spec"]["placement"] = json!({"topologyKey": "topology.kubernetes.io/zone"});
    v
}

/// Gives every model of `v` an indexer, so the indexer fields have a base to change.
fn with_indexers(mut v: Value) -> Value {
    v["spec"]["model"]["indexer"] = json!({"headDim": 64});
    if v["spec"]["speculative"].is_object() {
        v["spec"]["speculative"]["draftModel"]["indexer"] = json!({"headDim": 64});
    }
    v
}

fn model_fields(prefix: &str) -> Vec<(String, Disposition)> {
    let f = |s: &str| format!("{prefix}.{s}");
    vec![
        (f("name"), Rendered(|| json!("llama-3-70b-instruct"))),
        (f("layers"), Rendered(|| json!(40))),
        (f("attention"), Rendered(|| json!("MHA"))),
        (f("kvHeads"), Rendered(|| json!(16))),
        (f("headDim"), Rendered(|| json!(64))),
        (
            f("kvLoraRank"),
            Controller(
                "rejected by CEL for GQA/MHA; rendered as Attention::Mla in render::config::model_identity",
            ),
        ),
        (
            f("ropeDim"),
            Controller(
                "rejected by CEL for GQA/MHA; rendered as Attention::Mla in render::config::model_identity",
            ),
        ),
        (f("dtype"), Rendered(|| json!("FP8"))),
        (f("indexer.headDim"), Rendered(|| json!(128))),
        (f("indexer.dtype"), Rendered(|| json!("BF16"))),
    ]
}

fn pool_common() -> Vec<(String, Disposition)> {
    let mut v = model_fields("model");
    v.extend([
        ("parallelism.tensor".into(), Rendered(|| json!(2))),
        ("parallelism.context".into(), Rendered(|| json!(4))),
        ("cacheTierRef.name".into(), Controller("controller::revision::resolve reads the tier; policy::resolve raises PolicyConflict")),
        ("hostPool.size".into(), Rendered(|| json!("2Gi"))),
        ("transport".into(), Rendered(|| json!("TCP"))),
        ("placement.topologyKey".into(), Rendered(|| json!("topology.tandem.dev/rack"))),
        ("placement.mode".into(), Rendered(|| json!("Required"))),
        ("image".into(), Rendered(|| json!("example/worker:2"))),
        ("maxGroupRestarts".into(), Controller("recovery::plan: whole-group restarts and the halt (ReplicaRestartBudgetExceeded); see controller.rs group_recovery tests")),
        ("resources".into(), Rendered(|| json!({"requests": {"cpu": "2"}}))),
        ("podTemplate.labels".into(), Rendered(|| json!({"team": "a"}))),
        ("podTemplate.annotations".into(), Rendered(|| json!({"a": "b"}))),
        ("podTemplate.nodeSelector".into(), Rendered(|| json!({"gpu": "h100"}))),
        ("podTemplate.tolerations".into(), Rendered(|| json!([{"key": "gpu", "operator": "Exists"}]))),
        ("podTemplate.priorityClassName".into(), Rendered(|| json!("serving"))),
        ("podTemplate.serviceAccountName".into(), Rendered(|| json!("worker"))),
        ("speculative.draftTokens".into(), Rendered(|| json!(2))),
        ("engine.kind".into(), Controller("render::engine (worker config engine seat, engine command and adapter flags) and workload::front_door_service; see every_engine_kind_renders_its_own_pod")),
        ("engine.image".into(), Rendered(|| json!("example/engine:2"))),
        ("engine.args".into(), Rendered(|| json!(["--requests", "4"]))),
        ("engine.env".into(), Rendered(|| json!([{"name": "HF_HOME", "value": "/models"}]))),
        ("engine.resources".into(), Rendered(|| json!({"requests": {"cpu": "1"}}))),
    ]);
    v.extend(model_fields("speculative.draftModel"));
    v
}

fn check(
    kind: &str,
    schema: BTreeSet<String>,
    table: Vec<(String, Disposition)>,
    base: Value,
    render: &dyn Fn(&Value) -> Value,
) {
    let listed: BTreeSet<String> = table.iter().map(|(p, _)| p.clone()).collect();
    let missing: Vec<_> = schema.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "{kind}: spec fields with no disposition: {missing:?}"
    );
    let extra: Vec<_> = listed.difference(&schema).collect();
    assert!(
        extra.is_empty(),
        "{kind}: table lists fields the schema lacks: {extra:?}"
    );
    let rendered = render(&base);
    for (path, d) in table {
        if let Controller(used_by) = d {
            assert!(
                used_by.len() > 10,
                "{kind}: spec.{path} must name the code that reads it"
            );
        }
        if let Rendered(value) = d {
            let mut changed = base.clone();
            set(&mut changed["spec"], &path, value());
            assert_ne!(
                render(&changed),
                rendered,
                "{kind}: spec.{path} is accepted but changes nothing rendered"
            );
        }
    }
}

#[test]
fn every_prefill_pool_field_is_rendered_or_used() {
    let tier = sample("cachetier.yaml");
    let mut table = pool_common();
    table.extend([
        ("replicas".into(), Controller("controller::prefill_pool: group count when no DecodePool pairs (else the pair's status.scaling.applied.prefill)")),
        ("layerSplit".into(), Rendered(|| json!(true))),
        ("snapshotBuffer.size".into(), Rendered(|| json!("1Gi"))),
    ]);
    let mut base = with_placement(with_engine(with_indexers(sample("prefillpool.yaml"))));
    base["spec"]["parallelism"]["context"] = json!(2); // so layerSplit may be set
    base["spec"]["speculative"] =
        with_indexers(sample("decodepool.yaml"))["spec"]["speculative"].clone();
    let t2 = tier.clone();
    check(
        "PrefillPool",
        spec_leaves(PrefillPool::crd()),
        table,
        base,
        &|p| {
            let mut t = t2.clone();
            // Model fields must match the tier's (else PolicyConflict); mirror them.
            t["spec"]["model"] = p["spec"]["model"].clone();
            render_pool(p, &t, false)
        },
    );
}

#[test]
fn every_decode_pool_field_is_rendered_or_used() {
    let tier = sample("cachetier.yaml");
    let mut table = pool_common();
    table.extend([
        (
            "replicas".into(),
            Controller("capacity::decide: decode group count of the scaling transaction"),
        ),
        (
            "prefill.poolRef.name".into(),
            Controller(
                "controller::decode_pool reads the PrefillPool; rendered as peers.prefillService",
            ),
        ),
        (
            "prefill.ratio".into(),
            Controller(
                "capacity::decide → scaling::Counts::for_decode: the PrefillPool's group count",
            ),
        ),
        (
            "budget.gpus".into(),
            Controller("capacity::decide → scaling::plan: OverBudget / shrink before grow"),
        ),
        (
            "unschedulableDeadlineSeconds".into(),
            Controller("capacity::decide: rollback deadline of an unschedulable scale-up"),
        ),
        (
            "prefill.kvDeadline.milliseconds".into(),
            Rendered(|| json!(2500)),
        ),
        (
            "prefill.kvDeadline.perTokenMicroseconds".into(),
            Rendered(|| json!(40)),
        ),
        ("specGuard.minAcceptLength".into(), Rendered(|| json!(1.2))),
        ("specGuard.maxAcceptRate".into(), Rendered(|| json!(0.9))),
        ("specGuard.afterTokens".into(), Rendered(|| json!(64))),
        ("specGuard.retryBudget".into(), Rendered(|| json!(3))),
        ("restart.id".into(), Rendered(|| json!("again"))),
        ("frontDoor.port".into(), Rendered(|| json!(9000))),
    ]);
    // The decode worker serves the engine API (issue 13): a Simulated engine on a DecodePool renders
    // like on a PrefillPool, so the base has one for the engine fields to change.
    let base = with_placement(with_engine(with_indexers(sample("decodepool.yaml"))));
    let t2 = tier.clone();
    check(
        "DecodePool",
        spec_leaves(DecodePool::crd()),
        table,
        base,
        &|p| {
            let mut t = t2.clone();
            t["spec"]["model"] = p["spec"]["model"].clone();
            render_pool(p, &t, true)
        },
    );
}

#[test]
fn every_cache_tier_field_is_rendered_or_used() {
    let mut table = model_fields("model");
    table.extend([
        (
            "clientMode".into(),
            Controller("policy::resolve → worker config memory.clientMode of every client pool"),
        ),
        (
            "allocator".into(),
            Controller("policy::resolve → worker config memory.allocator of every client pool"),
        ),
        (
            "registrationFailurePolicy".into(),
            Controller(
                "policy::resolve → worker config memory.registrationFailure of every client pool",
            ),
        ),
        ("pageTokens".into(), Rendered(|| json!(256))),
        ("replicas".into(), Rendered(|| json!(3))),
        ("memory".into(), Rendered(|| json!("8Gi"))),
        ("persistence.size".into(), Rendered(|| json!("40Gi"))),
        (
            "persistence.storageClassName".into(),
            Rendered(|| json!("fast")),
        ),
        (
            "eviction.policy".into(),
            Controller("only LRU exists; rendered as tier.json eviction.policy"),
        ),
        (
            "eviction.highWatermarkPercent".into(),
            Rendered(|| json!(70)),
        ),
        ("writePolicy".into(), Rendered(|| json!("WriteBack"))),
        ("image".into(), Rendered(|| json!("example/worker:2"))),
    ]);
    check(
        "CacheTier",
        spec_leaves(CacheTier::crd()),
        table,
        with_indexers(sample("cachetier.yaml")),
        &render_tier,
    );
}

/// The client-policy fields of a tier reach every pool's worker config.
#[test]
fn tier_policy_fields_reach_the_pool_config() {
    let tier = sample("cachetier.yaml");
    let pool = sample("decodepool.yaml");
    let base = render_pool(&pool, &tier, true);
    for (path, value) in [
        ("clientMode", json!("Embedded")),
        ("allocator", json!("Pinned")),
        ("registrationFailurePolicy", json!("FallbackToL2")),
    ] {
        let mut t = tier.clone();
        set(&mut t["spec"], path, value);
        if path == "allocator" {
            t["spec"]["clientMode"] = json!("Embedded");
        }
        assert_ne!(
            render_pool(&pool, &t, true),
            base,
            "tier spec.{path} does not reach the pool config"
        );
    }
}

/// `spec.engine.kind`: unset renders the worker alone; `Simulated`, `SGLang` and `vLLM` (with an
/// image, as admission requires) each render their own pod and config on both pool kinds (the
/// engine container with its command and the adapter's flags, the worker as its sidecar, the
/// config's engine seat; on a DecodePool the front-door Service's target too).
#[test]
fn every_engine_kind_renders_its_own_pod() {
    let t = sample("cachetier.yaml");
    for (file, decode) in [("prefillpool.yaml", false), ("decodepool.yaml", true)] {
        let plain = sample(file);
        let mut seen = vec![render_pool(&plain, &t, decode)];
        for kind in ["Simulated", "SGLang", "vLLM"] {
            let mut v = plain.clone();
            v["spec"]["engine"] = json!({"kind": kind, "image": "example/engine:1"});
            let out = render_pool(&v, &t, decode);
            assert!(
                !seen.contains(&out),
                "{file}: engine.kind {kind} renders the same objects as another kind"
            );
            seen.push(out);
        }
    }
}
