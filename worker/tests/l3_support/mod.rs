//! Shared helpers of the L3 and trace tests: a small store identity, deterministic object bytes,
//! the Mooncake trace.
#![allow(dead_code)] // each test file uses a subset

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_worker::l3::manifest::{ObjectKey, StoreIdentity};
use tandem_worker::l3::store::L3Config;
use tandem_worker::memory::pool::PoolLayout;
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::tier::trace::{TraceRequest, read_trace};

pub fn identity(name: &str) -> StoreIdentity {
    StoreIdentity {
        model: ModelIdentity {
            name: name.into(),
            layers: 4,
            attention: Attention::Gqa {
                kv_heads: 2,
                head_dim: 8,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        },
        layout: PoolLayout::PageFirst,
        page_tokens: 512,
        tp_size: 1,
        cp_size: 1,
    }
}

pub fn config(dir: &Path, identity: StoreIdentity) -> L3Config {
    L3Config {
        progress_interval: Duration::from_millis(100),
        fsync: false,
        ..L3Config::new(dir.to_owned(), identity, 1 << 20, 1 << 30)
    }
}

/// Object bytes: a deterministic function of the key, `len` bytes.
pub fn object_bytes_len(key: &ObjectKey, len: usize) -> Vec<u8> {
    let seed = key.page.as_u64().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ key.shard.layer_end as u64;
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8))
        .collect()
}

pub fn object_bytes(key: &ObjectKey) -> Vec<u8> {
    object_bytes_len(key, 256)
}

pub fn trace_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_MOONCAKE_TRACE") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/mooncake/conversation_trace.jsonl")
}

/// The Mooncake trace, or `None` with a printed reason.
pub fn load_trace() -> Option<Vec<TraceRequest>> {
    let path = trace_path();
    let Ok(file) = File::open(&path) else {
        // CI sets TANDEM_REQUIRE_DATA=1: missing test data fails instead of skipping.
        assert!(
            std::env::var_os("TANDEM_REQUIRE_DATA").is_none_or(|v| v != "1"),
            "TANDEM_REQUIRE_DATA=1 and the Mooncake trace is not at {}",
            path.display()
        );
        println!(
            "SKIP: Mooncake trace not found at {} (set TANDEM_MOONCAKE_TRACE)",
            path.display()
        );
        return None;
    };
    Some(read_trace(BufReader::new(file)).expect("the shared trace is valid"))
}
