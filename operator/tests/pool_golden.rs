//! The sample pools' objects against golden YAML fixtures (`tests/fixtures/golden/`): a pool
//! without `spec.engine` renders exactly the pod it rendered before the engine field existed
//! (the worker alone, plus the store-client sidecar in Standalone mode), with the same revision,
//! so an operator upgrade restarts no running group.
//!
//! Regenerate after an intended change with `TANDEM_UPDATE_GOLDEN=1 cargo test -p
//! tandem-operator --test pool_golden` and review the diff.

use std::path::{Path, PathBuf};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use tandem_crds::{CacheTier, DecodePool, PrefillPool};
use tandem_operator::policy::{self, TierLookup};
use tandem_operator::render::{PoolView, config::worker_config, workload};

mod samples;
use samples::{engine_sample, load, pools_sample};

fn owner(kind: &str, name: &str) -> OwnerReference {
    OwnerReference {
        api_version: "serving.tandem.dev/v1alpha1".into(),
        kind: kind.into(),
        name: name.into(),
        uid: "u-pool".into(),
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

/// Config map and group StatefulSet of `view` against the sample tier, revision included.
fn assert_pool_golden(view: &PoolView<'_>, prefix: &str, owner: &OwnerReference) {
    let tier: CacheTier = load("cachetier.yaml");
    let lookup = TierLookup::Found {
        name: "llama70b-l3",
        spec: &tier.spec,
        terminating: false,
    };
    let policy = policy::resolve(view.model, lookup).expect("sample policy resolves");
    let mut cfg = worker_config(view, &policy, "").expect("sample renders");
    cfg.revision = workload::revision(view, &cfg);
    assert_golden(
        &format!("{prefix}-configmap.yaml"),
        &workload::config_map(view, &cfg, owner).unwrap(),
    );
    assert_golden(
        &format!("{prefix}-statefulset.yaml"),
        &workload::group_statefulset(view, &cfg, 1, owner),
    );
}

#[test]
fn decode_pool_without_engine_matches_golden_objects() {
    let d: DecodePool = load("decodepool.yaml");
    assert_pool_golden(
        &PoolView::decode(&d),
        "decode-pool",
        &owner("DecodePool", "llama70b-decode"),
    );
}

#[test]
fn prefill_pool_without_engine_matches_golden_objects() {
    let p: PrefillPool = load("prefillpool.yaml");
    assert_pool_golden(
        &PoolView::prefill(&p),
        "prefill-pool",
        &owner("PrefillPool", "llama70b-prefill"),
    );
}

/// Config map and group StatefulSet of both pools of an engine sample, and the DecodePool's
/// front-door Service, against their golden fixtures (`engine-<kind>-…`): the engine's command
/// and the adapter's flags as a user would read them in `kubectl get -o yaml`.
fn assert_engine_golden(kind: &str) {
    let file = format!("engines/{kind}.yaml");
    let (tier, p, d) = if kind.ends_with("-pd") {
        let (p, d) = pools_sample(&file);
        (None, p, d)
    } else {
        let (tier, p, d) = engine_sample(&file);
        (Some(tier), p, d)
    };
    let tier_name = tier.as_ref().map(|t| t.metadata.name.clone().unwrap());
    for (view, role) in [
        (PoolView::prefill(&p), "prefill"),
        (PoolView::decode(&d), "decode"),
    ] {
        let lookup = match (&tier, &tier_name) {
            (Some(t), Some(name)) => TierLookup::Found {
                name,
                spec: &t.spec,
                terminating: false,
            },
            _ => TierLookup::None,
        };
        let policy = policy::resolve(view.model, lookup).expect("sample policy resolves");
        let mut cfg = worker_config(&view, &policy, "").expect("sample renders");
        cfg.revision = workload::revision(&view, &cfg);
        let owner = owner(
            if role == "prefill" {
                "PrefillPool"
            } else {
                "DecodePool"
            },
            view.name,
        );
        let prefix = format!("engine-{kind}-{role}");
        assert_golden(
            &format!("{prefix}-configmap.yaml"),
            &workload::config_map(&view, &cfg, &owner).unwrap(),
        );
        assert_golden(
            &format!("{prefix}-statefulset.yaml"),
            &workload::group_statefulset(&view, &cfg, 0, &owner),
        );
        if let Some(port) = view.front_door_port {
            assert_golden(
                &format!("{prefix}-service.yaml"),
                &workload::front_door_service(&view, port, &owner),
            );
        }
    }
}

#[test]
fn sglang_engine_pools_match_golden_objects() {
    assert_engine_golden("sglang");
}

#[test]
fn sglang_pd_engine_pools_match_golden_objects() {
    assert_engine_golden("sglang-pd");
}

#[test]
fn vllm_pd_engine_pools_match_golden_objects() {
    assert_engine_golden("vllm-pd");
}

#[test]
fn vllm_engine_pools_match_golden_objects() {
    assert_engine_golden("vllm");
}
