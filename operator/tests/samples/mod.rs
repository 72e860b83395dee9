//! The samples in `manifests/samples/`, as the render tests read them (shared by `engine.rs` and
//! `pool_golden.rs`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use tandem_crds::{CacheTier, DecodePool, PrefillPool};

fn path(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file)
}

/// The one document of sample `file`.
pub fn load<T: serde::de::DeserializeOwned>(file: &str) -> T {
    serde_saphyr::from_str(&std::fs::read_to_string(path(file)).unwrap()).unwrap()
}

/// The document of `kind` in the multi-document sample `file`, as its type.
fn document<T: serde::de::DeserializeOwned>(file: &str, kind: &str) -> T {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&std::fs::read_to_string(path(file)).unwrap()).unwrap();
    let doc = docs
        .into_iter()
        .find(|v| v["kind"] == kind)
        .unwrap_or_else(|| panic!("{file} has no {kind}"));
    serde_json::from_value(doc).unwrap()
}

/// The (CacheTier, PrefillPool, DecodePool) of a multi-document engine sample
/// (`engines/<kind>.yaml`).
pub fn engine_sample(file: &str) -> (CacheTier, PrefillPool, DecodePool) {
    (
        document(file, "CacheTier"),
        document(file, "PrefillPool"),
        document(file, "DecodePool"),
    )
}

/// The (PrefillPool, DecodePool) of a multi-document engine sample without a CacheTier
/// (`engines/vllm-pd.yaml`, `engines/sglang-pd.yaml`).
pub fn pools_sample(file: &str) -> (PrefillPool, DecodePool) {
    (document(file, "PrefillPool"), document(file, "DecodePool"))
}
