//! Replaying a request trace against an L3 store, in process or over the wire: the prefix hit ratio
//! the store gives (restart tests and benchmarks compare it before and after a restart).

use super::manifest::{ObjectKey, ShardCoords};
use super::store::{L3Error, L3Store};
use crate::memory::pool::PoolRole;
use crate::tier::PageKey;
use crate::tier::hit_accounting::HitAccounting;
use crate::tier::trace::{TRACE_BLOCK_TOKENS, TracePageKeys, TraceRequest};

/// A request a replay runs: its prompt length and the page keys of its prompt. The Mooncake trace's
/// [`TraceRequest`] is one (its pages are the trace's 512-token blocks, keyed by
/// [`crate::tier::trace`]); the replay itself knows no trace format.
pub trait ReplayRequest {
    /// Prompt tokens.
    fn input_tokens(&self) -> u64;
    /// Tokens per page of [`ReplayRequest::page_keys`] (the last page may be partial).
    fn page_tokens(&self) -> u64;
    /// The prompt's page keys, first page first.
    fn page_keys(&self) -> Vec<PageKey>;
}

/// What a replay needs from a store.
pub trait L3Backend {
    /// Error of a store call.
    type Error: std::error::Error;
    /// Number of leading `keys` the store would serve.
    ///
    /// # Errors
    /// The backend's error (I/O, protocol).
    fn leading_present(&self, keys: &[ObjectKey]) -> Result<usize, Self::Error>;
    /// Stores one object.
    ///
    /// # Errors
    /// The backend's error.
    fn put(&self, key: ObjectKey, data: &[u8]) -> Result<(), Self::Error>;
}

impl ReplayRequest for TraceRequest {
    fn input_tokens(&self) -> u64 {
        u64::from(self.input_length)
    }

    fn page_tokens(&self) -> u64 {
        TRACE_BLOCK_TOKENS
    }

    fn page_keys(&self) -> Vec<PageKey> {
        TracePageKeys::page_keys(self)
    }
}

impl L3Backend for L3Store {
    type Error = L3Error;

    fn leading_present(&self, keys: &[ObjectKey]) -> Result<usize, L3Error> {
        Ok(L3Store::leading_present(self, keys))
    }

    fn put(&self, key: ObjectKey, data: &[u8]) -> Result<(), L3Error> {
        L3Store::put(self, key, data).map(|_| ())
    }
}

/// Whether a replay writes the missing pages after each lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayMode {
    /// Look up, then put every page the lookup missed (a write-through prefill).
    Fill,
    /// Look up only: measures the store as it is.
    LookupOnly,
}

/// The object keys of a request: one target-pool object per page, written by `shard`.
pub fn request_objects(req: &impl ReplayRequest, shard: ShardCoords) -> Vec<ObjectKey> {
    req.page_keys()
        .into_iter()
        .map(|page| ObjectKey {
            page,
            pool: PoolRole::Target,
            shard,
        })
        .collect()
}

/// Replays `requests` against `store` and returns the token hit accounting (hits attributed to L3).
/// `object_bytes` makes the bytes of a missing object in [`ReplayMode::Fill`].
///
/// # Errors
/// The first backend error.
pub fn replay_l3<B: L3Backend, R: ReplayRequest>(
    store: &B,
    requests: &[R],
    shard: ShardCoords,
    mode: ReplayMode,
    object_bytes: impl Fn(&ObjectKey) -> Vec<u8>,
) -> Result<HitAccounting, B::Error> {
    let mut acc = HitAccounting::default();
    for req in requests {
        let keys = request_objects(req, shard);
        let hit = store.leading_present(&keys)?;
        let matched = crate::tier::prefix_index::PrefixMatch {
            tiers: vec![crate::tier::prefix_index::Tier::L3Store; hit],
        };
        acc.record(req.input_tokens(), req.page_tokens(), &matched);
        if mode == ReplayMode::Fill {
            for key in &keys[hit..] {
                store.put(*key, &object_bytes(key))?;
            }
        }
    }
    Ok(acc)
}
