//! Simulated per-layer compute: the indexer (what the broadcast overlaps, seed 004 "通信隐藏") and
//! attention (what must read the right KV).
//!
//! Attention here is a deterministic function of exactly the bytes attention would read — the chunks
//! of the request's pages on one layer, in page-list order — and of who computes it (CP rank: each
//! rank attends with its own shard of queries). Two layouts that feed it the same bytes give the same
//! output bit for bit; one stale or missing byte changes it. That is the check of contract 6
//! "attention results identical to the replicated layout".

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Output of attention on one layer: xxh3 of each chunk chained through the seed
/// `(rank, layer, request)`, chunks in page-list order.
pub fn attend<'a>(
    rank: u32,
    layer: u32,
    request: u64,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> u64 {
    let mut h = request ^ (u64::from(rank) << 48) ^ (u64::from(layer) << 32);
    for c in chunks {
        h = xxh3_64_with_seed(c, h);
    }
    h
}

/// The indexer computation of one layer: `work` rounds of a hash chain over `(rank, layer, request)`
/// (CPU time standing in for the sparse-attention indexer; it reads no KV).
pub fn indexer(rank: u32, layer: u32, request: u64, work: u32) -> u64 {
    let mut h = request ^ u64::from(layer) ^ (u64::from(rank) << 40);
    for _ in 0..work {
        h = xxh3_64_with_seed(&h.to_le_bytes(), h);
    }
    h
}

/// Folds one layer's output into the request's running output (order-sensitive).
pub fn fold(acc: u64, layer_out: u64) -> u64 {
    xxh3_64_with_seed(&layer_out.to_le_bytes(), acc)
}
