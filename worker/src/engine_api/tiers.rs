//! The tier calls (Lookup, Load, Store; DESIGN §3.1 "Tiers", contracts 5 and 7): the seam where the
//! serving path plugs its L2 host store and L3 client in. The API validates every request (hash
//! counts, page indices) before a backend sees it; a worker with no backend answers
//! `TIER_UNAVAILABLE`.

use tokio::sync::mpsc;
use tonic::Code;

use crate::memory::pool::PoolRole;

use super::error::ApiError;
use super::pb;

/// Most hashes one Lookup, Load or Store may carry.
pub const MAX_HASHES: usize = 4096;

/// A validated load: hashes, one destination page each, and the pools to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadJob {
    /// Chained page hashes, in prefix order.
    pub hashes: Vec<Vec<u8>>,
    /// Destination page indices (reserved by the engine), one per hash.
    pub pages: Vec<u32>,
    /// Pools to load.
    pub pools: Vec<PoolRole>,
}

/// What a tier backend does. Implementations emit the load's events in order: one
/// [`pb::LayerLoaded`] per (pool, layer) once every page of that layer landed (contract 5), then
/// [`pb::LoadDone`] or [`pb::LoadFailed`].
pub trait TierBackend: Send + Sync + 'static {
    /// Leading pages present per tier.
    ///
    /// # Errors
    /// A typed refusal.
    fn lookup(&self, hashes: &[Vec<u8>]) -> Result<Vec<pb::TierHits>, ApiError>;
    /// Starts a load; events go to `events` (dropping the sender ends the stream).
    ///
    /// # Errors
    /// A typed refusal before anything was loaded.
    fn load(
        &self,
        job: LoadJob,
        events: mpsc::UnboundedSender<pb::LoadEvent>,
    ) -> Result<(), ApiError>;
    /// Accepts source pages for write to the tiers; returns the pages accepted.
    ///
    /// # Errors
    /// A typed refusal.
    fn store(&self, hashes: &[Vec<u8>], pages: &[u32]) -> Result<u32, ApiError>;
}

/// The backend of a worker whose tiers are not wired: every call is `TIER_UNAVAILABLE`.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoTiers;

fn unavailable() -> ApiError {
    ApiError::new(
        Code::FailedPrecondition,
        pb::ErrorReason::TierUnavailable,
        "no cache tier is wired to this worker's engine API",
    )
}

impl TierBackend for NoTiers {
    fn lookup(&self, _hashes: &[Vec<u8>]) -> Result<Vec<pb::TierHits>, ApiError> {
        Err(unavailable())
    }
    fn load(
        &self,
        _job: LoadJob,
        _events: mpsc::UnboundedSender<pb::LoadEvent>,
    ) -> Result<(), ApiError> {
        Err(unavailable())
    }
    fn store(&self, _hashes: &[Vec<u8>], _pages: &[u32]) -> Result<u32, ApiError> {
        Err(unavailable())
    }
}

/// Checks a hash list: 1..=[`MAX_HASHES`] non-empty hashes.
///
/// # Errors
/// `MALFORMED` naming `prefix_hashes`.
pub fn check_hashes(hashes: &[Vec<u8>]) -> Result<(), ApiError> {
    if hashes.is_empty() || hashes.len() > MAX_HASHES {
        return Err(ApiError::malformed(
            "prefix_hashes",
            format!("{} hashes; 1..={MAX_HASHES} allowed", hashes.len()),
        ));
    }
    if let Some(i) = hashes.iter().position(|h| h.is_empty()) {
        return Err(ApiError::malformed(
            "prefix_hashes",
            format!("hash {i} is empty"),
        ));
    }
    Ok(())
}

/// The page key a prefix hash names: 8 bytes are the big-endian key itself (Mooncake `hash_ids`
/// taken as is, engine.proto `PrefillWork.prefix_hashes`); any other length is hashed (xxh3-64).
pub fn key_of_hash(h: &[u8]) -> crate::tier::PageKey {
    match <[u8; 8]>::try_from(h) {
        Ok(b) => crate::tier::PageKey::from_trace_id(u64::from_be_bytes(b)),
        Err(_) => crate::tier::PageKey::from_trace_id(xxhash_rust::xxh3::xxh3_64(h)),
    }
}

/// The 8-byte prefix hash of `key` (inverse of [`key_of_hash`]).
pub fn hash_of_key(key: crate::tier::PageKey) -> Vec<u8> {
    key.as_u64().to_be_bytes().to_vec()
}
