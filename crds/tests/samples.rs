//! The samples deserialize into the typed API and defaults apply as documented.

use std::path::Path;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tandem_crds::{
    AllocatorDomain, AttentionKind, CacheTier, ClientMode, DecodePool, EvictionPolicy, KvDtype,
    PdRatio, PrefillPool, RegistrationFailurePolicy, Transport, WritePolicy,
};

fn load<T: serde::de::DeserializeOwned>(file: &str) -> T {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("sample exists");
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

#[test]
fn sample_stack_is_typed_and_consistent() {
    let tier: CacheTier = load("cachetier.yaml");
    let prefill: PrefillPool = load("prefillpool.yaml");
    let decode: DecodePool = load("decodepool.yaml");

    assert_eq!(tier.spec.client_mode, ClientMode::Standalone);
    assert_eq!(tier.spec.allocator, AllocatorDomain::SharedMemory);
    // llama-3-70b in ../shared/data/models.json: 327,680 bytes of KV per token.
    assert_eq!(tier.spec.model.kv_bytes_per_token(), Some(327_680));
    assert_eq!(prefill.spec.model, tier.spec.model);
    assert_eq!(decode.spec.model, tier.spec.model);
    assert_eq!(decode.spec.prefill.ratio, PdRatio::new(4, 1).unwrap());
    assert_eq!(
        decode.spec.prefill.pool_ref.name,
        prefill.metadata.name.clone().unwrap()
    );
    assert_eq!(
        decode
            .spec
            .prefill
            .ratio
            .prefill_replicas_for(decode.spec.replicas as u32),
        4
    );
    let draft = &decode.spec.speculative.as_ref().expect("draft").draft_model;
    // llama-3-8b: 131,072 bytes per token.
    assert_eq!(draft.kv_bytes_per_token(), Some(131_072));
}

/// The LayerSplit sample: deepseek-v3 (MLA, ../shared/data/models.json: 70,272 bytes of KV per
/// token) in CP-4 groups with layerSplit, one group per decode replica.
#[test]
fn layer_split_sample_is_typed_and_consistent() {
    let prefill: PrefillPool = load("layersplit/prefillpool.yaml");
    let decode: DecodePool = load("layersplit/decodepool.yaml");
    assert!(prefill.spec.layer_split);
    assert_eq!(prefill.spec.parallelism.context, 4);
    assert_eq!(prefill.spec.model.kv_bytes_per_token(), Some(70_272));
    assert_eq!(decode.spec.model, prefill.spec.model);
    assert_eq!(
        decode.spec.prefill.pool_ref.name,
        prefill.metadata.name.clone().unwrap()
    );
    assert_eq!(decode.spec.prefill.ratio, PdRatio::new(1, 1).unwrap());
}

#[test]
fn defaults_apply_as_documented() {
    let minimal = r#"
apiVersion: serving.tandem.dev/v1alpha1
kind: PrefillPool
metadata: {name: p}
spec:
  model: {name: m, layers: 2, attention: GQA, kvHeads: 1, headDim: 8}
  hostPool: {size: 1Gi}
"#;
    let p: PrefillPool = serde_saphyr::from_str(minimal).unwrap();
    assert_eq!(p.spec.replicas, 1);
    assert_eq!(
        (p.spec.parallelism.tensor, p.spec.parallelism.context),
        (1, 1)
    );
    assert!(!p.spec.layer_split);
    assert_eq!(p.spec.model.dtype, KvDtype::BF16);
    assert_eq!(p.spec.snapshot_buffer.size, Quantity("8Gi".into()));
    assert_eq!(p.spec.transport, Transport::Auto);
    assert!(
        p.spec
            .image
            .starts_with("ghcr.io/tandem-serving/tandem-worker:")
    );

    let minimal = r#"
apiVersion: serving.tandem.dev/v1alpha1
kind: DecodePool
metadata: {name: d}
spec:
  model: {name: m, layers: 2, attention: MLA, kvLoraRank: 512, ropeDim: 64}
  hostPool: {size: 1Gi}
  prefill: {poolRef: {name: p}, ratio: "3:2"}
"#;
    let d: DecodePool = serde_saphyr::from_str(minimal).unwrap();
    assert_eq!(d.spec.model.attention, AttentionKind::MLA);
    let g = &d.spec.spec_guard;
    assert_eq!(
        (
            g.min_accept_length,
            g.max_accept_rate,
            g.after_tokens,
            g.retry_budget
        ),
        (1.4, 0.96, 128, 1)
    );
    assert_eq!(d.spec.front_door.port, 8000);
    assert_eq!(d.spec.unschedulable_deadline_seconds, 300);
    assert!(d.spec.budget.is_none());

    let minimal = r#"
apiVersion: serving.tandem.dev/v1alpha1
kind: CacheTier
metadata: {name: t}
spec:
  model: {name: m, layers: 2, attention: GQA, kvHeads: 1, headDim: 8}
  memory: 1Gi
"#;
    let t: CacheTier = serde_saphyr::from_str(minimal).unwrap();
    assert_eq!(t.spec.page_tokens, 512);
    assert_eq!(t.spec.client_mode, ClientMode::Embedded);
    assert_eq!(t.spec.allocator, AllocatorDomain::SharedMemory);
    assert_eq!(t.spec.replicas, 1);
    assert_eq!(t.spec.eviction.policy, EvictionPolicy::LRU);
    assert_eq!(t.spec.eviction.high_watermark_percent, 90);
    assert_eq!(
        t.spec.registration_failure_policy,
        RegistrationFailurePolicy::FailClosed
    );
    assert_eq!(t.spec.write_policy, WritePolicy::WriteThrough);
}

/// The defaults the API server applies (from the schema) equal the ones serde applies, so a
/// worker config rendered from either is the same.
#[test]
fn schema_defaults_match_serde_defaults() {
    use kube::CustomResourceExt;
    let crd = DecodePool::crd();
    let schema = serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap();
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(spec["specGuard"]["default"]["minAcceptLength"], 1.4);
    assert_eq!(spec["specGuard"]["default"]["maxAcceptRate"], 0.96);
    assert_eq!(spec["specGuard"]["default"]["afterTokens"], 128);
    assert_eq!(spec["unschedulableDeadlineSeconds"]["default"], 300);
    assert_eq!(spec["frontDoor"]["default"]["port"], 8000);
}

#[test]
fn bad_ratio_is_a_clear_deserialization_error() {
    let text = r#"{poolRef: {name: p}, ratio: "4:0"}"#;
    let err = serde_saphyr::from_str::<tandem_crds::PrefillPairing>(text).unwrap_err();
    assert!(
        err.to_string()
            .contains("both sides must be integers from 1 to 9999"),
        "{err}"
    );
}
