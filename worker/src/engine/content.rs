//! Deterministic KV content and its verification.
//!
//! One *chunk* is the KV of `tokens` consecutive tokens of one layer, `token_bytes` per token (the
//! unit a page-first pool stores per (page, layer)). Each token row starts with a 16-byte tag —
//! `request u64 | layer u32 | token u32`, little-endian — followed by filler words from a SplitMix64
//! stream seeded by the tag. A row is therefore unique to (request, layer, token): a page holding
//! another request's KV, another layer, a shifted token, or a torn write fails verification, and the
//! tag says whose bytes were found.

/// Bytes of the per-row tag.
pub const TAG_BYTES: usize = 16;

/// Which KV a chunk holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkSpec {
    /// Request the KV belongs to.
    pub request: u64,
    /// Layer.
    pub layer: u32,
    /// Absolute position of the chunk's first token.
    pub first_token: u32,
    /// Tokens in the chunk.
    pub tokens: u32,
    /// Bytes per token (per layer); at least [`TAG_BYTES`].
    pub token_bytes: usize,
}

impl ChunkSpec {
    /// Bytes of the chunk.
    pub fn bytes(&self) -> usize {
        self.tokens as usize * self.token_bytes
    }
}

/// A verification failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "KV mismatch at byte {offset} (token {token}): expected request {expected}, found tag of request {found_request} layer {found_layer}"
)]
pub struct Corruption {
    /// Byte offset in the chunk of the first bad byte.
    pub offset: usize,
    /// Absolute token of the bad row.
    pub token: u32,
    /// The request whose KV was expected.
    pub expected: u64,
    /// The request named by the row's tag (garbage if the row is torn).
    pub found_request: u64,
    /// The layer named by the row's tag.
    pub found_layer: u32,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn row_seed(request: u64, layer: u32, token: u32) -> u64 {
    request.wrapping_mul(0x100_0000_01B3) ^ (u64::from(layer) << 32) ^ u64::from(token)
}

fn fill_row(row: &mut [u8], request: u64, layer: u32, token: u32) {
    row[0..8].copy_from_slice(&request.to_le_bytes());
    row[8..12].copy_from_slice(&layer.to_le_bytes());
    row[12..16].copy_from_slice(&token.to_le_bytes());
    let mut state = row_seed(request, layer, token);
    for word in row[TAG_BYTES..].chunks_mut(8) {
        let v = splitmix(&mut state).to_le_bytes();
        word.copy_from_slice(&v[..word.len()]);
    }
}

/// Writes the chunk's expected content into `buf` (`buf.len()` must equal `spec.bytes()`; a shorter
/// or longer buffer is filled row by row as far as whole rows fit).
pub fn fill_chunk(buf: &mut [u8], spec: &ChunkSpec) {
    if spec.token_bytes < TAG_BYTES {
        return;
    }
    for (i, row) in buf
        .chunks_exact_mut(spec.token_bytes)
        .take(spec.tokens as usize)
        .enumerate()
    {
        fill_row(row, spec.request, spec.layer, spec.first_token + i as u32);
    }
}

/// Verifies `buf` against the chunk's expected content.
pub fn verify_chunk(buf: &[u8], spec: &ChunkSpec) -> Result<(), Corruption> {
    let mut expected = vec![0u8; spec.token_bytes.max(TAG_BYTES)];
    for i in 0..spec.tokens as usize {
        let token = spec.first_token + i as u32;
        let start = i * spec.token_bytes;
        let row = buf.get(start..start + spec.token_bytes);
        fill_row(
            &mut expected[..spec.token_bytes.max(TAG_BYTES)],
            spec.request,
            spec.layer,
            token,
        );
        let Some(row) = row.filter(|r| r.len() >= TAG_BYTES) else {
            return Err(Corruption {
                offset: start,
                token,
                expected: spec.request,
                found_request: 0,
                found_layer: 0,
            });
        };
        if let Some(pos) = row.iter().zip(expected.iter()).position(|(a, b)| a != b) {
            let mut r = [0u8; 8];
            r.copy_from_slice(&row[0..8]);
            let mut l = [0u8; 4];
            l.copy_from_slice(&row[8..12]);
            return Err(Corruption {
                offset: start + pos,
                token,
                expected: spec.request,
                found_request: u64::from_le_bytes(r),
                found_layer: u32::from_le_bytes(l),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(request: u64) -> ChunkSpec {
        ChunkSpec {
            request,
            layer: 3,
            first_token: 32,
            tokens: 4,
            token_bytes: 40,
        }
    }

    #[test]
    fn round_trip_and_detects_foreign_or_torn_rows() {
        let mut buf = vec![0u8; spec(1).bytes()];
        fill_chunk(&mut buf, &spec(1));
        assert_eq!(verify_chunk(&buf, &spec(1)), Ok(()));
        let err = verify_chunk(&buf, &spec(2)).unwrap_err();
        assert_eq!(
            (err.expected, err.found_request, err.found_layer),
            (2, 1, 3)
        );
        let mut other = vec![0u8; spec(7).bytes()];
        fill_chunk(&mut other, &spec(7));
        buf[40..80].copy_from_slice(&other[40..80]);
        let err = verify_chunk(&buf, &spec(1)).unwrap_err();
        assert_eq!((err.token, err.found_request), (33, 7));
        fill_chunk(&mut buf, &spec(1));
        buf[150] ^= 1;
        assert_eq!(verify_chunk(&buf, &spec(1)).unwrap_err().token, 35);
        assert!(
            verify_chunk(&buf[..10], &spec(1)).is_err(),
            "short buffers fail, never panic"
        );
    }
}
