//! The pure builders against the sample stack in `manifests/samples/`.

use std::path::Path;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use tandem_crds::{CacheTier, DecodePool, PrefillPool};
use tandem_interfaces::config::WorkerConfig;
use tandem_interfaces::memory::AllocatorDomain;
use tandem_interfaces::memory::ClientMode;
use tandem_operator::policy::{self, TierLookup};
use tandem_operator::render::{PoolView, config::worker_config, workload};

fn load<T: serde::de::DeserializeOwned>(file: &str) -> T {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file);
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "serving.tandem.dev/v1alpha1".into(),
        kind: "DecodePool".into(),
        name: "llama70b-decode".into(),
        uid: "u-1".into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn rendered(pool: &PoolView<'_>, tier: &CacheTier) -> WorkerConfig {
    let lookup = TierLookup::Found {
        name: "llama70b-l3",
        spec: &tier.spec,
        terminating: false,
    };
    let policy = policy::resolve(pool.model, lookup).expect("sample policy resolves");
    let mut cfg = worker_config(pool, &policy, "").expect("sample renders");
    cfg.revision = workload::revision(pool, &cfg);
    cfg
}

/// Seed 000 at the operator level: the decode pool's draft pool is sized and placed in the tier's
/// SharedMemory domain, and the pod's shared-memory volume holds every pool.
#[test]
fn draft_pool_inherits_the_tier_domain_and_is_counted_in_the_segment() {
    let tier: CacheTier = load("cachetier.yaml");
    let decode: DecodePool = load("decodepool.yaml");
    let view = PoolView::decode(&decode);
    let cfg = rendered(&view, &tier);
    cfg.check()
        .expect("rendered config passes the worker's own checks");

    assert_eq!(cfg.memory.allocator, AllocatorDomain::SharedMemory);
    assert_eq!(cfg.memory.client_mode, Some(ClientMode::Standalone));
    // 1Gi of llama-3-70b KV (327,680 B/token) = 3,276 tokens; the llama-3-8b draft (131,072
    // B/token) needs the same number of tokens.
    assert_eq!(cfg.memory.target_pool_bytes, 1 << 30);
    assert_eq!(cfg.memory.draft_pool_bytes, 3_276 * 131_072);
    assert_eq!(cfg.memory.segment_bytes, (1 << 30) + 3_276 * 131_072);

    let sts = workload::group_statefulset(&view, &cfg, 0, &owner());
    let pod = sts.spec.template.spec.as_ref().unwrap();
    let shm = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "kv-shm")
        .expect("shm volume");
    assert_eq!(
        shm.empty_dir
            .as_ref()
            .unwrap()
            .size_limit
            .as_ref()
            .unwrap()
            .0,
        cfg.memory.segment_bytes.to_string()
    );
    let sidecar = &pod.init_containers.as_ref().expect("store-client sidecar")[0];
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    assert_eq!(sidecar.args.as_ref().unwrap()[0], "store-client");
}

#[test]
fn group_statefulset_shape() {
    let tier: CacheTier = load("cachetier.yaml");
    let mut prefill: PrefillPool = load("prefillpool.yaml");
    prefill.spec.parallelism.tensor = 2;
    prefill.spec.parallelism.context = 2;
    prefill.spec.layer_split = true;
    let view = PoolView::prefill(&prefill);
    let cfg = rendered(&view, &tier);
    let sts = workload::group_statefulset(&view, &cfg, 3, &owner());

    assert_eq!(sts.metadata.name.as_deref(), Some("llama70b-prefill-g3"));
    assert_eq!(
        sts.spec.replicas,
        Some(4),
        "a group is tensor × context pods"
    );
    assert_eq!(
        sts.spec.update_strategy.as_ref().unwrap().type_.as_deref(),
        Some("OnDelete")
    );
    let labels = sts
        .spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    assert_eq!(labels["serving.tandem.dev/group"], "3");
    assert_eq!(labels["serving.tandem.dev/role"], "prefill");
    assert_eq!(labels["serving.tandem.dev/revision"], cfg.revision);
    let worker = &sts.spec.template.spec.as_ref().unwrap().containers[0];
    let gpu = &worker.resources.as_ref().unwrap().limits.as_ref().unwrap()["nvidia.com/gpu"];
    assert_eq!(gpu.0, "1", "one GPU per pod");
    assert_eq!(
        sts.metadata.owner_references.as_ref().unwrap()[0].uid,
        "u-1"
    );
    // LayerSplit over 2 CP ranks: layers 0..40 on rank 0, 40..80 on rank 1.
    let ls = cfg.layer_split.as_ref().unwrap();
    assert_eq!(ls.owned_by(1).next(), Some(40));
}

#[test]
fn revision_changes_with_restart_id_and_image_only() {
    let tier: CacheTier = load("cachetier.yaml");
    let decode: DecodePool = load("decodepool.yaml");
    let base = rendered(&PoolView::decode(&decode), &tier).revision;
    assert_eq!(
        rendered(&PoolView::decode(&decode), &tier).revision,
        base,
        "deterministic"
    );

    let mut d2 = decode.clone();
    d2.spec.restart = Some(tandem_crds::RestartSpec {
        id: "second".into(),
    });
    assert_ne!(rendered(&PoolView::decode(&d2), &tier).revision, base);

    let mut d3 = decode.clone();
    d3.spec.image = "example/tandem-worker:next".into();
    assert_ne!(rendered(&PoolView::decode(&d3), &tier).revision, base);

    let mut d4 = decode.clone();
    d4.spec.replicas = 7; // scaling adds groups; it does not restart the running ones
    assert_eq!(rendered(&PoolView::decode(&d4), &tier).revision, base);
}

#[test]
fn config_file_round_trips_through_the_worker_loader() {
    let tier: CacheTier = load("cachetier.yaml");
    let prefill: PrefillPool = load("prefillpool.yaml");
    let view = PoolView::prefill(&prefill);
    let cfg = rendered(&view, &tier);
    let cm = workload::config_map(&view, &cfg, &owner()).unwrap();
    let text = &cm.data.as_ref().unwrap()["worker.json"];
    // The worker's loader reads the file and parses and checks its text with `from_json`.
    let path = Path::new("/etc/tandem/worker.json");
    assert_eq!(WorkerConfig::from_json(text, path).unwrap(), cfg);
    // A field the worker does not know is refused, not dropped.
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    v["memory"]["surprise"] = serde_json::json!(1);
    assert!(WorkerConfig::from_json(&v.to_string(), path).is_err());
}
