//! The sample configs of worker/interfaces/README.md §2 (`samples/`) parse, pass the worker's
//! checks and serialise back to the same document; a changed or unknown field is refused.

use std::path::{Path, PathBuf};

use tandem_interfaces::config::{
    CACHE_TIER_CONFIG_FILE, CONFIG_FILE, CacheTierConfig, ConfigError, WorkerConfig, WorkerRole,
};
use tandem_interfaces::memory::{AllocatorDomain, ClientMode};

fn sample(name: &str) -> (PathBuf, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("samples")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    (path, text)
}

#[test]
fn the_sample_worker_config_round_trips() {
    let (path, text) = sample("decode-worker.json");
    let cfg = WorkerConfig::from_json(&text, &path).expect("the sample passes the checks");
    assert_eq!(cfg.role, WorkerRole::Decode);
    assert_eq!(cfg.memory.allocator, AllocatorDomain::SharedMemory);
    assert_eq!(cfg.memory.client_mode, Some(ClientMode::Standalone));
    assert_eq!(cfg.model.bytes_per_token(), 327_680);
    // The draft pool holds as many tokens as the target pool (3,276 of each).
    let spec = cfg.speculative.as_ref().unwrap();
    assert_eq!(
        cfg.memory.target_pool_bytes / cfg.model.bytes_per_token(),
        cfg.memory.draft_pool_bytes / spec.draft_model.bytes_per_token()
    );
    let file: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        serde_json::to_value(&cfg).unwrap(),
        file,
        "no field lost or added"
    );
    assert_eq!(CONFIG_FILE, "worker.json");

    // Negative controls: an unknown field and a broken invariant are refused.
    let mut v = file.clone();
    v["memory"]["surprise"] = serde_json::json!(1);
    assert!(matches!(
        WorkerConfig::from_json(&v.to_string(), &path),
        Err(ConfigError::Parse { .. })
    ));
    let mut v = file;
    v["memory"]["segmentBytes"] = serde_json::json!(1);
    assert!(matches!(
        WorkerConfig::from_json(&v.to_string(), &path),
        Err(ConfigError::Inconsistent(_))
    ));
}

#[test]
fn the_sample_tier_config_round_trips() {
    let (path, text) = sample("tier.json");
    let cfg = CacheTierConfig::from_json(&text, &path).expect("the sample passes the checks");
    assert_eq!(cfg.identity().tp_size, 64);
    assert_eq!(cfg.effective_budgets().0, (4u64 << 30) * 9 / 10);
    let file: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        serde_json::to_value(&cfg).unwrap(),
        file,
        "no field lost or added"
    );
    assert_eq!(CACHE_TIER_CONFIG_FILE, "tier.json");
    let mut v = file;
    v["apiVersion"] = serde_json::json!("tandem.dev/cache-tier-config/v0");
    assert!(matches!(
        CacheTierConfig::from_json(&v.to_string(), &path),
        Err(ConfigError::Version { .. })
    ));
}
