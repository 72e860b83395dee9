//! CacheTier builders against golden YAML fixtures (`tests/fixtures/golden/`).
//!
//! Regenerate after an intended change with `TANDEM_UPDATE_GOLDEN=1 cargo test -p
//! tandem-operator --test tier` and review the diff.

use std::path::{Path, PathBuf};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use tandem_crds::CacheTier;
use tandem_operator::render::tier::{
    self, DATA_DIR, L3_PORT, TIER_CONFIG_FILE, TierConfig, store_service, store_statefulset,
    tier_config, tier_config_map,
};

fn sample() -> CacheTier {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples/cachetier.yaml");
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "serving.tandem.dev/v1alpha1".into(),
        kind: "CacheTier".into(),
        name: "llama70b-l3".into(),
        uid: "u-tier".into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

/// Compares `value` rendered as YAML with the fixture `name` (or rewrites it when asked).
fn assert_golden<T: serde::Serialize>(name: &str, value: &T) {
    let text = serde_saphyr::to_string(value).unwrap();
    let path = golden(name);
    if std::env::var_os("TANDEM_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with TANDEM_UPDATE_GOLDEN=1)", path.display()));
    assert_eq!(
        text, want,
        "rendered {name} differs from the golden fixture"
    );
}

#[test]
fn persistent_tier_matches_golden_objects() {
    let t = sample();
    let cfg = tier_config(&t).unwrap();
    let sts = store_statefulset(&t, &cfg, t.spec.replicas, &owner());
    assert_golden("tier-persistent-statefulset.yaml", &sts);
    assert_golden("tier-service.yaml", &store_service(&t, &owner()));
    assert_golden(
        "tier-configmap.yaml",
        &tier_config_map(&t, &cfg, &owner()).unwrap(),
    );

    // The properties the fixture encodes, stated once more so a regenerated fixture cannot
    // silently lose them.
    assert_eq!(sts.metadata.name.as_deref(), Some("llama70b-l3-store"));
    assert_eq!(sts.spec.replicas, Some(2));
    let claims = sts
        .spec
        .volume_claim_templates
        .as_ref()
        .expect("PVC per replica");
    assert_eq!(claims[0].metadata.name.as_deref(), Some("data"));
    let pod = sts.spec.template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    assert_eq!(
        c.args.as_deref().unwrap(),
        ["cache", "--config", "/etc/tandem/tier.json"]
    );
    let mounts = c.volume_mounts.as_ref().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m.name == "data" && m.mount_path == DATA_DIR)
    );
    assert!(
        pod.volumes
            .as_ref()
            .unwrap()
            .iter()
            .all(|v| v.name != "data"),
        "a persistent tier's data volume comes from the claim template, not an emptyDir"
    );
    let svc = store_service(&t, &owner());
    let spec = svc.spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    let ports = spec.ports.as_ref().unwrap();
    assert_eq!(ports[0].name.as_deref(), Some("l3"));
    assert_eq!(ports[0].port, i32::from(L3_PORT));
    assert_eq!(ports[1].port, 8080);
}

#[test]
fn memory_only_tier_uses_an_empty_dir_and_no_claims() {
    let mut t = sample();
    t.spec.persistence = None;
    let cfg = tier_config(&t).unwrap();
    assert!(!cfg.persistent);
    assert_eq!(cfg.disk_bytes, cfg.memory_bytes);
    let sts = store_statefulset(&t, &cfg, 1, &owner());
    assert_golden("tier-memory-only-statefulset.yaml", &sts);
    assert!(sts.spec.volume_claim_templates.is_none());
    let vols = sts
        .spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .clone()
        .unwrap();
    let data = vols.iter().find(|v| v.name == "data").expect("data volume");
    assert!(data.empty_dir.is_some());
}

#[test]
fn tier_json_round_trips_and_refuses_unknown_fields() {
    let t = sample();
    let cfg = tier_config(&t).unwrap();
    let cm = tier_config_map(&t, &cfg, &owner()).unwrap();
    let text = &cm.data.as_ref().unwrap()[TIER_CONFIG_FILE];
    let back: TierConfig = serde_json::from_str(text).unwrap();
    assert_eq!(back, cfg);
    back.check()
        .expect("the worker's own checks accept the rendered tier.json");
    assert_eq!(cfg.memory_bytes, 4 << 30);
    assert_eq!(cfg.disk_bytes, 20 << 30);
    assert_eq!(cfg.page_tokens, 512);
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    v["surprise"] = serde_json::json!(true);
    assert!(serde_json::from_value::<TierConfig>(v).is_err());
}

#[test]
fn tier_revision_moves_with_config_and_image_not_replicas() {
    let t = sample();
    let base = tier_config(&t).unwrap().revision;
    let mut t2 = t.clone();
    t2.spec.replicas = 5;
    assert_eq!(tier_config(&t2).unwrap().revision, base);
    let mut t3 = t.clone();
    t3.spec.image = "example/tandem-worker:next".into();
    assert_ne!(tier_config(&t3).unwrap().revision, base);
    let mut t4 = t;
    t4.spec.eviction.high_watermark_percent = 70;
    assert_ne!(tier_config(&t4).unwrap().revision, base);
    let _ = tier::TIER_CONFIG_API_VERSION;
}

/// The ports and data dir the operator renders are the ones a store replica defaults to when its
/// `tier.json` leaves them out (worker/interfaces/README.md §2): one number on both sides.
#[test]
fn rendered_ports_are_the_store_defaults() {
    use tandem_interfaces::config::{
        CachePorts, DEFAULT_CACHE_DATA_DIR, DEFAULT_HEALTH_PORT, DEFAULT_L3_PORT,
    };
    assert_eq!(tandem_crds::ports::L3_PORT, DEFAULT_L3_PORT);
    assert_eq!(tandem_crds::ports::HEALTH_PORT, DEFAULT_HEALTH_PORT);
    assert_eq!(
        CachePorts::default(),
        CachePorts {
            l3: L3_PORT,
            health: tandem_crds::ports::HEALTH_PORT
        }
    );
    assert_eq!(DATA_DIR, DEFAULT_CACHE_DATA_DIR);
}
