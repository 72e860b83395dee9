//! Page keys: chained hashes over fixed-size token pages.
//!
//! Page `i` of a sequence is named by a hash of its own tokens chained with the key of page `i - 1`, so
//! two sequences share the key of page `i` only if they share the whole prefix up to and including that
//! page. This is the key scheme of SGLang HiCache, vLLM prefix caching and Mooncake Store, and it is why
//! the Mooncake trace's `hash_ids` (one id per 512-token block, equal ids = equal prefix) map onto
//! [`PageKey`] one to one ([`PageKey::from_trace_id`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the first page of a sequence (no parent). Any fixed value works; it only has to be stable
/// across processes and releases, because keys are persisted in L3 manifests.
const ROOT_SEED: u64 = 0x7461_6e64_656d_4b56; // "tandemKV"

/// Name of one page of KV: a 64-bit chained hash (see the module docs).
///
/// Displayed and parsed as 16 lower-case hex digits (the L3 object file names use that form).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PageKey(u64);

impl PageKey {
    /// Key of the page holding `tokens`, following the page keyed `parent` (`None` for the first page).
    ///
    /// `tokens` is the page's token ids in order; a partial last page hashes only the tokens it has, so
    /// it never collides with the full page that later extends it.
    pub fn chain(parent: Option<PageKey>, tokens: &[u32]) -> PageKey {
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let seed = parent.map_or(ROOT_SEED, |p| p.0);
        PageKey(xxh3_64_with_seed(&bytes, seed))
    }

    /// Keys of every page of `tokens` cut into pages of `page_tokens` tokens (the last page may be
    /// partial). `page_tokens` of 0 yields no pages.
    pub fn chain_sequence(tokens: &[u32], page_tokens: usize) -> Vec<PageKey> {
        if page_tokens == 0 {
            return Vec::new();
        }
        let mut parent = None;
        tokens
            .chunks(page_tokens)
            .map(|page| {
                let key = PageKey::chain(parent, page);
                parent = Some(key);
                key
            })
            .collect()
    }

    /// A key taken as is from a trace whose ids are already chained prefix hashes (the Mooncake
    /// trace's `hash_ids`).
    pub const fn from_trace_id(id: u64) -> PageKey {
        PageKey(id)
    }

    /// The raw 64-bit value.
    pub const fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageKey({:016x})", self.0)
    }
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A string that is not 16 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("page key {0:?} is not 16 hex digits")]
pub struct ParsePageKeyError(String);

impl FromStr for PageKey {
    type Err = ParsePageKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 16 {
            return Err(ParsePageKeyError(s.to_owned()));
        }
        u64::from_str_radix(s, 16)
            .map(PageKey)
            .map_err(|_| ParsePageKeyError(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_keys_and_divergence_changes_every_later_key() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[17] = 999; // page 2 of 8-token pages (tokens 16..24)
        let ka = PageKey::chain_sequence(&a, 8);
        let kb = PageKey::chain_sequence(&b, 8);
        assert_eq!(ka.len(), 5);
        assert_eq!(ka[..2], kb[..2]);
        for i in 2..5 {
            assert_ne!(ka[i], kb[i], "page {i} must differ once the prefix differs");
        }
    }

    #[test]
    fn partial_last_page_differs_from_the_full_page() {
        let full: Vec<u32> = (0..16).collect();
        let partial = &full[..12];
        assert_ne!(
            PageKey::chain_sequence(&full, 8)[1],
            PageKey::chain_sequence(partial, 8)[1]
        );
    }

    #[test]
    fn hex_round_trip_and_rejects_malformed() {
        let k = PageKey::chain(None, &[1, 2, 3]);
        assert_eq!(k.to_string().parse::<PageKey>(), Ok(k));
        assert!("xyz".parse::<PageKey>().is_err());
        assert!("000000000000000g".parse::<PageKey>().is_err());
    }
}
