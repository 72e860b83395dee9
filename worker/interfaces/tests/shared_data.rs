//! The interfaces against the real data in the workplace's `shared/data/` (never copied into the
//! repository): the model catalogue and the Mooncake FAST'25 trace.
//!
//! The directory is `$TANDEM_DATA_DIR`, else `../shared/data` beside the repository. When it is
//! absent a test prints why and passes — unless `TANDEM_REQUIRE_DATA=1` (CI), then it fails.

use std::io::BufReader;
use std::path::PathBuf;

use tandem_interfaces::model::ModelCatalog;
use tandem_interfaces::trace::{BLOCK_TOKENS, TraceReader, TraceRequest};

fn data_file(rel: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("TANDEM_DATA_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
        PathBuf::from,
    );
    let path = dir.join(rel);
    if path.is_file() {
        return Some(path);
    }
    let required = std::env::var("TANDEM_REQUIRE_DATA").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "TANDEM_REQUIRE_DATA=1 but {} is missing (set TANDEM_DATA_DIR)",
        path.display()
    );
    println!(
        "SKIP: {} not found (set TANDEM_DATA_DIR; TANDEM_REQUIRE_DATA=1 makes this fail)",
        path.display()
    );
    None
}

#[test]
fn shared_catalogue_loads_and_matches_stated_sizes() {
    let Some(path) = data_file("models.json") else {
        return;
    };
    let cat =
        ModelCatalog::from_json(&std::fs::read_to_string(path).unwrap()).expect("catalogue loads");
    assert_eq!(cat.get("llama-3-8b").unwrap().bytes_per_token(), 131_072);
    assert_eq!(cat.get("deepseek-v3").unwrap().bytes_per_token(), 70_272);
    // The check line in the file: llama-3-70b, 128 Ki tokens = 40 GiB.
    assert_eq!(
        cat.get("llama-3-70b").unwrap().bytes_per_token() * 128 * 1024,
        40 << 30
    );
}

#[test]
fn the_mooncake_trace_parses_with_the_schema_widths() {
    let Some(path) = data_file("mooncake/conversation_trace.jsonl") else {
        return;
    };
    let file = std::fs::File::open(path).unwrap();
    let all: Vec<TraceRequest> = TraceReader::new(BufReader::new(file))
        .collect::<Result<_, _>>()
        .expect("the shared trace is valid");
    // The figures of shared/data/mooncake/README.md.
    assert_eq!(all.len(), 12_031);
    assert_eq!(
        all[0],
        TraceRequest {
            timestamp: 0,
            input_length: 6758,
            output_length: 500,
            hash_ids: (0..14).collect(),
        }
    );
    assert_eq!(all.iter().map(|r| r.input_length).max(), Some(126_195));
    assert_eq!(all.iter().map(|r| r.output_length).max(), Some(2_000));
    assert_eq!(all.last().unwrap().timestamp, 3_536_999);
    let refs: usize = all.iter().map(|r| r.hash_ids.len()).sum();
    assert_eq!(refs, 288_500);
    assert!(all.iter().all(|r| r.blocks() == r.hash_ids.len()));
    let tokens: u64 = all.iter().map(|r| u64::from(r.input_length)).sum();
    assert!(tokens <= refs as u64 * u64::from(BLOCK_TOKENS));
}
