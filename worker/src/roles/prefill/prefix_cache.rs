//! The prefill worker's prefix cache around the simulated engine (DESIGN §2 `CacheTier`, issue 7):
//! an L2 host-tier [`PrefixIndex`] of page keys, and the L3 CacheTier store reached over the
//! framed TCP protocol ([`L3Client`]) at `<tier>-store` resolved like every peer.
//!
//! A room's prompt pages are keyed by the request's `kv_block_hashes` (the Mooncake `hash_ids`,
//! already chained: [`PageKey::from_trace_id`]) when pages are trace blocks (512 tokens). The
//! lookup takes the leading L2 pages, then the leading L3 pages after them; hit pages cost no
//! compute, the rest cost `TANDEM_SIM_PREFILL_US_PER_TOKEN` per token. After the room computed,
//! its pages enter L2 and, by write policy, L3: write-through puts every computed page at once;
//! write-back puts the pages L2 evicts. For the built-in engine L2 holds keys only (the bytes the
//! built-in engine sends are regenerated), so its capacity is the target pool's page count; with an
//! engine, L2 holds the pages' bytes (see below).
//!
//! With an engine (`config.engine`) this planner is not used: the engine reaches the tiers through
//! the engine API's tier calls, served by [`super::tiers::HostTiers`], whose L2 holds real page
//! bytes and which reaches L3 through this cache's replica access ([`PrefixCache::l3_get`],
//! [`PrefixCache::l3_put`], [`PrefixCache::l3_leading_pages`], [`PrefixCache::l3_hot`]).
//!
//! Only pages the store acknowledged count as L3 hits (a failed or pending put is not a hit;
//! DESIGN contract 7). A replica that cannot be reached is a miss and a degraded reason, never an
//! error of the request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::node::{ComputePlan, RoomPlanner};
use crate::config::WritePolicy;
use crate::control::KvLayout;
use crate::control::pb;
use crate::engine::{ChunkSpec, fill_chunk};
use crate::health::counters::Counters;
use crate::l3::client::L3Client;
use crate::l3::manifest::{ObjectKey, ShardCoords};
use crate::l3::placement::{self, Placement};
use crate::memory::pool::PoolRole;
use crate::roles::resolve::Resolver;
use crate::tier::hit_accounting::page_token_len;
use crate::tier::trace::TRACE_BLOCK_TOKENS;
use crate::tier::{PageKey, PrefixIndex, Residency, Tier};

/// The L3 protocol port of store replicas (worker/interfaces/README.md §2).
pub const L3_PORT: u16 = crate::config::DEFAULT_L3_PORT;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the L3 store is and how this worker writes it.
#[derive(Debug, Clone)]
pub struct L3Target {
    /// DNS name of the tier's Service (`<tier>-store…`).
    pub service: String,
    /// Protocol port.
    pub port: u16,
    /// This worker's shard (TP/CP rank and owned layers).
    pub shard: ShardCoords,
    /// L2→L3 write policy.
    pub write_policy: WritePolicy,
}

/// The planner the prefill service calls per room.
pub struct PrefixCache {
    index: Mutex<PrefixIndex>,
    l3: Option<L3Target>,
    resolver: Resolver,
    clients: Mutex<HashMap<SocketAddr, Arc<L3Client>>>,
    prefill_per_token: Duration,
    counters: Counters,
    health: Arc<dyn Fn(Option<String>) + Send + Sync>,
}

impl PrefixCache {
    /// A cache of `l2_pages` pages (at least 1) over `l3` (None: L2 only).
    /// `health` is called with `Some(reason)` when L3 becomes unreachable and `None` when it
    /// answers again.
    pub fn new(
        l2_pages: usize,
        l3: Option<L3Target>,
        resolver: Resolver,
        prefill_per_token: Duration,
        counters: Counters,
        health: Arc<dyn Fn(Option<String>) + Send + Sync>,
    ) -> Self {
        let cap = NonZeroUsize::new(l2_pages.max(1));
        Self {
            index: Mutex::new(PrefixIndex::new([None, cap, None])),
            l3,
            resolver,
            clients: Mutex::new(HashMap::new()),
            prefill_per_token,
            counters,
            health,
        }
    }

    /// Page keys of a request, or none when its blocks are not pages of this layout.
    fn keys(request: &pb::RequestSpec, layout: KvLayout) -> Vec<PageKey> {
        if u64::from(layout.page_tokens) != TRACE_BLOCK_TOKENS {
            return Vec::new();
        }
        let pages = request.input_tokens.max(1).div_ceil(layout.page_tokens) as usize;
        request
            .hash_ids
            .iter()
            .take(pages)
            .copied()
            .map(PageKey::from_trace_id)
            .collect()
    }

    fn object(&self, target: &L3Target, page: PageKey) -> ObjectKey {
        ObjectKey {
            page,
            pool: PoolRole::Target,
            shard: target.shard,
        }
    }

    /// The replica that owns `page` ([`placement::owner`]: rendezvous hashing, so a change of the
    /// replica set moves only the pages of the replica that changed).
    fn client_for(&self, target: &L3Target, page: PageKey) -> Option<Arc<L3Client>> {
        let addrs = match self.resolver.lookup_blocking(&target.service, target.port) {
            Ok(a) if !a.is_empty() => a,
            Ok(_) => {
                (self.health)(Some(format!("{} resolves to no replica", target.service)));
                return None;
            }
            Err(e) => {
                (self.health)(Some(e.to_string()));
                return None;
            }
        };
        let addr = placement::owner(page, &addrs, Placement::Rendezvous)?;
        if let Some(c) = lock(&self.clients).get(&addr) {
            return Some(c.clone());
        }
        match L3Client::connect(addr, Duration::from_millis(500)) {
            Ok(c) => {
                let c = Arc::new(c);
                lock(&self.clients).insert(addr, c.clone());
                (self.health)(None);
                Some(c)
            }
            Err(e) => {
                (self.health)(Some(format!("L3 replica {addr}: {e}")));
                None
            }
        }
    }

    fn drop_client(&self, client: &Arc<L3Client>) {
        lock(&self.clients).retain(|_, c| !Arc::ptr_eq(c, client));
    }

    /// Runs `call` on the replica owning `page`; a failed call drops that connection and is
    /// retried once on a fresh one (a restarted replica leaves a dead connection behind).
    fn with_replica<T>(
        &self,
        target: &L3Target,
        page: PageKey,
        what: &str,
        call: impl Fn(&L3Client) -> Result<T, crate::l3::client::L3ClientError>,
    ) -> Option<T> {
        for attempt in 0..2 {
            let client = self.client_for(target, page)?;
            match call(&client) {
                Ok(v) => return Some(v),
                Err(e) => {
                    self.drop_client(&client);
                    if attempt == 1 {
                        (self.health)(Some(format!("L3 {what}: {e}")));
                    }
                }
            }
        }
        None
    }

    /// Leading pages of `keys` present in L3.
    fn l3_leading(&self, target: &L3Target, keys: &[PageKey]) -> usize {
        let mut n = 0;
        for key in keys {
            let object = self.object(target, *key);
            match self.with_replica(target, *key, "lookup", |c| c.lookup(&[object])) {
                Some(1) => n += 1,
                _ => break,
            }
        }
        n
    }

    /// Bytes of the L3 object of `page`: every layer's chunk in layer order, generated from the
    /// page key (rows of [`fill_chunk`] keyed by [`PageKey::as_u64`], tokens from 0). The
    /// simulated engine writes and verifies exactly these bytes for a page it stores or loads.
    pub fn object_bytes(page: PageKey, layout: KvLayout) -> Vec<u8> {
        let id = page.as_u64();
        let mut out = vec![0u8; layout.page_bytes() as usize];
        for (layer, chunk) in out
            .chunks_exact_mut(layout.chunk_bytes() as usize)
            .enumerate()
        {
            let spec = ChunkSpec {
                request: id,
                layer: layer as u32,
                first_token: 0,
                tokens: layout.page_tokens,
                token_bytes: layout.token_bytes as usize,
            };
            fill_chunk(chunk, &spec);
        }
        out
    }

    fn put_l3(&self, target: &L3Target, pages: &[PageKey], layout: KvLayout) {
        for page in pages {
            let (object, bytes) = (
                self.object(target, *page),
                Self::object_bytes(*page, layout),
            );
            if self
                .with_replica(target, *page, "put", |c| c.put(&object, &bytes))
                .is_none()
            {
                return;
            }
            self.counters.l3_pages_written.inc();
        }
    }
}

/// L3 access for the engine API's tier backend ([`super::tiers::HostTiers`]): the same replica
/// resolution, placement, reconnect-once and degraded reasons as the built-in path.
impl PrefixCache {
    /// The L3 target, when a tier is configured.
    pub fn l3_target(&self) -> Option<&L3Target> {
        self.l3.as_ref()
    }

    /// Leading pages of `keys` present in L3 (0 without a tier or when no replica answers).
    pub fn l3_leading_pages(&self, keys: &[PageKey]) -> usize {
        match &self.l3 {
            Some(t) => self.l3_leading(t, keys),
            None => 0,
        }
    }

    /// The bytes of `page`'s target-pool object. `Ok(None)`: a miss (absent, or the store found
    /// its checksum or length bad and quarantined it).
    ///
    /// # Errors
    /// A reason when no tier is configured or no replica answered.
    pub fn l3_get(&self, page: PageKey) -> Result<Option<Vec<u8>>, String> {
        let target = self.l3.as_ref().ok_or("no L3 tier is configured")?;
        let object = self.object(target, page);
        self.with_replica(target, page, "get", |c| c.get(&object))
            .ok_or_else(|| format!("no L3 replica answered a get of page {page}"))
    }

    /// Puts `bytes` as `page`'s target-pool object; true when the store acknowledged it (counted
    /// in `l3_pages_written`).
    pub fn l3_put(&self, page: PageKey, bytes: &[u8]) -> bool {
        let Some(target) = &self.l3 else { return false };
        let object = self.object(target, page);
        let ok = self
            .with_replica(target, page, "put", |c| c.put(&object, bytes))
            .is_some();
        if ok {
            self.counters.l3_pages_written.inc();
        }
        ok
    }

    /// Up to `limit` of this shard's most recently used target-pool keys, over every replica
    /// (restart loadback).
    pub fn l3_hot(&self, limit: usize) -> Vec<PageKey> {
        let Some(target) = &self.l3 else {
            return Vec::new();
        };
        let addrs = match self.resolver.lookup_blocking(&target.service, target.port) {
            Ok(a) => a,
            Err(e) => {
                (self.health)(Some(e.to_string()));
                return Vec::new();
            }
        };
        let mut hot = Vec::new();
        for addr in addrs {
            match L3Client::connect(addr, Duration::from_millis(500))
                .and_then(|c| c.hot(target.shard, PoolRole::Target, limit))
            {
                Ok(keys) => hot.extend(keys.into_iter().map(|o| o.page)),
                Err(e) => (self.health)(Some(format!("L3 replica {addr}: {e}"))),
            }
        }
        hot.truncate(limit);
        hot
    }
}

impl PrefixCache {
    /// Restart loadback (DESIGN §5: "restart, load back from L3, admit when CacheWarm"): asks
    /// every replica for this shard's most recently used pages (up to the L2 capacity), reads
    /// each object, checks it byte for byte against the page it must hold, and publishes the good
    /// ones in L2, most recent last. Stops at `deadline`. Returns the pages loaded; a bad object
    /// counts in `corrupt_pages_read` and is skipped.
    pub fn load_back(&self, layout: KvLayout, limit: usize, deadline: Instant) -> u64 {
        let Some(target) = &self.l3 else { return 0 };
        let addrs = match self.resolver.lookup_blocking(&target.service, target.port) {
            Ok(a) => a,
            Err(e) => {
                (self.health)(Some(e.to_string()));
                return 0;
            }
        };
        let mut hot = Vec::new();
        for addr in addrs {
            match L3Client::connect(addr, Duration::from_millis(500))
                .and_then(|c| c.hot(target.shard, PoolRole::Target, limit))
            {
                Ok(keys) => hot.extend(keys),
                Err(e) => (self.health)(Some(format!("L3 replica {addr}: {e}"))),
            }
        }
        let mut loaded = 0;
        for object in hot.iter().take(limit).rev() {
            if Instant::now() >= deadline {
                tracing::warn!(loaded, "L3 loadback stopped at its deadline");
                break;
            }
            let expected = Self::object_bytes(object.page, layout);
            match self.with_replica(target, object.page, "get", |c| c.get(object)) {
                Some(Some(bytes)) if bytes == expected => {
                    lock(&self.index).insert(Tier::L2Host, &[object.page], Residency::Present);
                    self.counters.l3_pages_loaded_back.inc();
                    loaded += 1;
                }
                Some(Some(_)) => {
                    tracing::error!(%object, "L3 object does not hold its page; skipped");
                    self.counters.corrupt_pages_read.inc();
                }
                _ => {}
            }
        }
        loaded
    }

    /// Drain flush (DESIGN §5 "flush L2 to L3"): with write-back, puts every page L2 holds.
    /// Returns the pages written.
    pub fn flush(&self, layout: KvLayout) -> u64 {
        let Some(target) = &self.l3 else { return 0 };
        if target.write_policy != WritePolicy::WriteBack {
            return 0;
        }
        let keys = lock(&self.index).present_keys(Tier::L2Host);
        let before = self.counters.l3_pages_written.get();
        self.put_l3(target, &keys, layout);
        self.counters.l3_pages_written.get() - before
    }
}

impl RoomPlanner for PrefixCache {
    fn plan(&self, request: &pb::RequestSpec, layout: KvLayout, pages: u32) -> ComputePlan {
        let input = u64::from(request.input_tokens.max(1));
        let page_tokens = u64::from(layout.page_tokens);
        let keys = Self::keys(request, layout);
        let l2 = lock(&self.index).leading_present(Tier::L2Host, &keys);
        let l3 = match &self.l3 {
            Some(t) if l2 < keys.len() => self.l3_leading(t, &keys[l2..]),
            _ => 0,
        };
        if l3 > 0 {
            // Loaded from L3 for this room: now resident in L2 as well.
            lock(&self.index).insert(Tier::L2Host, &keys[l2..l2 + l3], Residency::Present);
        }
        let tokens = |range: std::ops::Range<usize>| -> u64 {
            range.map(|p| page_token_len(input, page_tokens, p)).sum()
        };
        let hits = pb::PrefixHits {
            l1: 0,
            l2: tokens(0..l2),
            l3: tokens(l2..l2 + l3),
        };
        let c = &self.counters;
        c.prefix_lookup_tokens.inc_by(input);
        c.prefix_hit_tokens_l2.inc_by(hits.l2);
        c.prefix_hit_tokens_l3.inc_by(hits.l3);
        let per_page = (0..pages as usize)
            .map(|p| {
                if p < l2 + l3 {
                    Duration::ZERO
                } else {
                    let t = page_token_len(input, page_tokens, p);
                    self.prefill_per_token * u32::try_from(t).unwrap_or(u32::MAX)
                }
            })
            .collect();
        ComputePlan { hits, per_page }
    }

    fn computed(&self, request: &pb::RequestSpec, layout: KvLayout, plan: &ComputePlan) {
        let keys = Self::keys(request, layout);
        let page_tokens = u64::from(layout.page_tokens).max(1);
        let cached = ((plan.hits.l1 + plan.hits.l2 + plan.hits.l3).div_ceil(page_tokens)) as usize;
        let fresh = &keys[cached.min(keys.len())..];
        let evicted = lock(&self.index).insert(Tier::L2Host, fresh, Residency::Present);
        let Some(target) = &self.l3 else { return };
        match target.write_policy {
            WritePolicy::WriteThrough => self.put_l3(target, fresh, layout),
            WritePolicy::WriteBack => self.put_l3(target, &evicted, layout),
        }
    }
}
