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
//! Replicas are re-resolved on every call and kept in a [`ReplicaBook`] (issue 18 item 4): a
//! replica that attaches empty gets a share of writes that ramps up instead of the whole refill
//! (kvcache-ai/Mooncake#3688), reads that miss on a page's owner try the page's second-ranked
//! replica, a refused address backs off (bounded), and the time to reattach after an outage is
//! logged and reported ([`super::l3_report`]).
//!
//! Only pages the store acknowledged count as L3 hits (a failed or pending put is not a hit;
//! DESIGN contract 7). A replica that cannot be reached is a miss and a degraded reason, never an
//! error of the request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::l3_report::{self, L3Metrics};
use super::loadback::{self, StreamConns};
use super::node::{ComputePlan, RoomPlanner};
use crate::config::WritePolicy;
use crate::control::KvLayout;
use crate::control::pb;
use crate::engine::{ChunkSpec, fill_chunk};
use crate::health::counters::Counters;
use crate::l3::client::L3Client;
use crate::l3::manifest::{ObjectKey, ShardCoords};
use crate::l3::placement;
use crate::l3::replicas::{BookConfig, ReplicaBook};
use crate::memory::pool::PoolRole;
use crate::roles::resolve::Resolver;
use crate::tier::hit_accounting::{marked_tokens, page_token_len};
use crate::tier::trace::TRACE_BLOCK_TOKENS;
use crate::tier::{PageKey, PrefixIndex, Residency, Tier};

/// The L3 protocol port of store replicas (worker/interfaces/README.md §2).
pub const L3_PORT: u16 = crate::config::DEFAULT_L3_PORT;

/// Connect (and per-call I/O) timeout of a replica connection.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

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
    book: Mutex<ReplicaBook>,
    metrics: L3Metrics,
    prefill_per_token: Duration,
    counters: Counters,
    health: Arc<dyn Fn(Option<String>) + Send + Sync>,
    /// Keys a finalized snapshot added to L2 (issue 15; bounded like L2): hits on them count in
    /// `snapshot_hit_tokens`.
    from_snapshot: Mutex<lru::LruCache<PageKey, ()>>,
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
            book: Mutex::new(ReplicaBook::new(BookConfig::default())),
            metrics: L3Metrics::default(),
            prefill_per_token,
            counters,
            health,
            from_snapshot: Mutex::new(lru::LruCache::new(cap.unwrap_or(NonZeroUsize::MIN))),
        }
    }

    /// Runs `f` on the prefix index (L2 of the built-in engine; snapshot finalize inserts here).
    pub fn with_index<R>(&self, f: impl FnOnce(&mut PrefixIndex) -> R) -> R {
        f(&mut lock(&self.index))
    }

    /// Remembers `keys` as added to L2 by a snapshot sync (not computed here).
    pub fn mark_from_snapshot(&self, keys: &[PageKey]) {
        let mut set = lock(&self.from_snapshot);
        for k in keys {
            set.put(*k, ());
        }
    }

    /// With the replica book's knobs `book` (write ramp, rate window, backoff) and the `/metrics`
    /// gauges it updates (registered by the caller).
    pub fn with_replica_book(mut self, book: BookConfig, metrics: L3Metrics) -> Self {
        self.book = Mutex::new(ReplicaBook::new(book));
        self.metrics = metrics;
        self
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

    /// The resolved replica set (re-resolved on every call, so a replica that moved is followed
    /// at the next call: kvcache-ai/Mooncake#2185, #3740), recorded in the book; connections to
    /// addresses no longer listed are closed.
    fn resolve(&self, target: &L3Target) -> Option<Vec<SocketAddr>> {
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
        lock(&self.book).observe_set(&addrs, Instant::now());
        lock(&self.clients).retain(|a, _| addrs.contains(a));
        Some(addrs)
    }

    /// The replicas to try for `page`, best first. A write goes to the weighted owner
    /// ([`placement::weighted_owner`]: rendezvous hashing, a replica that attached empty weighted
    /// by its ramp) among the replicas not backing off; a read tries that one, then the other of
    /// the page's two highest-ranked replicas ([`placement::top_two`]), where a page written
    /// under another weight (during a ramp, or while its owner was away) lies.
    fn route(&self, target: &L3Target, page: PageKey, read: bool) -> Vec<SocketAddr> {
        let Some(addrs) = self.resolve(target) else {
            return Vec::new();
        };
        let placeable = lock(&self.book).placeable(&addrs, Instant::now());
        let Some(first) = placement::weighted_owner(page, &placeable) else {
            (self.health)(Some(format!(
                "every replica of {} refused a connection; backing off",
                target.service
            )));
            return Vec::new();
        };
        let mut route = vec![first];
        if read {
            let up: Vec<SocketAddr> = placeable.iter().map(|(a, _)| *a).collect();
            let (a, b) = placement::top_two(page, &up);
            if let Some(other) = [a, b].into_iter().flatten().find(|c| *c != first) {
                route.push(other);
            }
        }
        route
    }

    /// The open connection to `addr`, or a new one whose health call answered. A new connection
    /// is an attachment in the book: it ends an open outage (logged and reported with its
    /// length) and starts the write ramp when the replica is empty. A refused connection backs
    /// the address off.
    fn client(&self, addr: SocketAddr) -> Option<Arc<L3Client>> {
        if let Some(c) = lock(&self.clients).get(&addr) {
            return Some(c.clone());
        }
        let attached = L3Client::connect(addr, CONNECT_TIMEOUT).and_then(|c| {
            let h = c.health()?;
            Ok((c, h))
        });
        let now = Instant::now();
        match attached {
            Ok((c, h)) => {
                let empty = h.objects == 0 && h.loadback.total == 0;
                let (event, ramp) = {
                    let mut book = lock(&self.book);
                    let event = book.attached(addr, empty, now);
                    // Below 1 exactly while it ramps, whatever the replica count (≥ 2).
                    (event, book.weight(&addr, now, 2) < 1.0)
                };
                if let Some(r) = event {
                    tracing::info!(%addr, outage_s = r.outage_s, since_listed_s = r.since_listed_s,
                        "L3 replica reattached");
                }
                if ramp {
                    tracing::info!(%addr, "L3 replica attached empty: its share of writes ramps up");
                }
                let c = Arc::new(c);
                lock(&self.clients).insert(addr, c.clone());
                (self.health)(None);
                Some(c)
            }
            Err(e) => {
                lock(&self.book).connect_failed(addr, now);
                (self.health)(Some(format!("L3 replica {addr}: {e}")));
                None
            }
        }
    }

    /// Re-checks the tier between calls: resolves its Service and attaches (or keeps) a
    /// connection to every listed replica, so that a degraded reason ("resolves to no replica",
    /// "replica … refused") clears once the tier is reachable again even when no request
    /// touches L3 (issue 18: the reason used to stay until the next L3 call). Returns whether a
    /// replica answered; blocking (name lookup, connect with [`CONNECT_TIMEOUT`]): run it off the
    /// async workers. A tierless cache answers `false` and changes nothing.
    pub fn probe_tier(&self) -> bool {
        let Some(target) = &self.l3 else {
            return false;
        };
        let Some(addrs) = self.resolve(target) else {
            return false;
        };
        let placeable = lock(&self.book).placeable(&addrs, Instant::now());
        let attached = placeable
            .iter()
            .filter(|(a, _)| self.client(*a).is_some())
            .count();
        if attached > 0 {
            (self.health)(None);
        }
        attached > 0
    }

    fn drop_client(&self, client: &Arc<L3Client>) {
        lock(&self.clients).retain(|_, c| !Arc::ptr_eq(c, client));
    }

    /// Runs `call` on `addr`; a failed call drops that connection and is retried once on a fresh
    /// one (a restarted replica leaves a dead connection behind).
    fn call_on<T>(
        &self,
        addr: SocketAddr,
        what: &str,
        call: impl Fn(&L3Client) -> Result<T, crate::l3::client::L3ClientError>,
    ) -> Option<T> {
        for attempt in 0..2 {
            let client = self.client(addr)?;
            match call(&client) {
                Ok(v) => return Some(v),
                // A refusal the server explained (`ERROR`, e.g. its volume is full): the
                // connection is in step and the same call would be refused again, so it is
                // neither dropped nor retried (retrying counted every refused put twice).
                Err(e @ crate::l3::client::L3ClientError::Server(_)) => {
                    (self.health)(Some(format!("L3 {what}: {e}")));
                    return None;
                }
                Err(e) => {
                    // The connection is gone (a store restart): once more on a fresh one.
                    self.drop_client(&client);
                    lock(&self.book).call_failed(addr, Instant::now());
                    if attempt == 1 {
                        (self.health)(Some(format!("L3 {what}: {e}")));
                    }
                }
            }
        }
        None
    }

    /// Runs `call` on `addr` over `conns`, connections of one caller's own (a loadback stream,
    /// [`super::loadback`]) rather than the shared ones: opened on first use — after the shared
    /// connection to `addr` is attached ([`Self::client`]), so the replica book records the
    /// attachment (outage ended, backoff cleared, write ramp) exactly as on the serving path — and
    /// like [`Self::call_on`] a failed call drops its connection and is retried once on a fresh
    /// one, counted in the book.
    fn call_own<T>(
        &self,
        conns: &mut StreamConns,
        addr: SocketAddr,
        what: &str,
        call: impl Fn(&L3Client) -> Result<T, crate::l3::client::L3ClientError>,
    ) -> Option<T> {
        for attempt in 0..2 {
            let client = match conns.0.entry(addr) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    // Attached (or refused, and booked as such) through the shared path first.
                    self.client(addr)?;
                    match L3Client::connect(addr, CONNECT_TIMEOUT) {
                        Ok(c) => v.insert(c),
                        Err(e) => {
                            lock(&self.book).connect_failed(addr, Instant::now());
                            (self.health)(Some(format!("L3 replica {addr}: {e}")));
                            return None;
                        }
                    }
                }
            };
            match call(client) {
                Ok(v) => return Some(v),
                Err(e @ crate::l3::client::L3ClientError::Server(_)) => {
                    (self.health)(Some(format!("L3 {what}: {e}")));
                    return None;
                }
                Err(e) => {
                    conns.0.remove(&addr);
                    lock(&self.book).call_failed(addr, Instant::now());
                    if attempt == 1 {
                        (self.health)(Some(format!("L3 {what}: {e}")));
                    }
                }
            }
        }
        None
    }

    /// A read of `page` along its [`route`](Self::route), each replica asked through `on`: the
    /// first answer that `hit` accepts, else the last answer (a miss), else `None` when no
    /// replica answered.
    fn read<T>(
        &self,
        target: &L3Target,
        page: PageKey,
        mut on: impl FnMut(SocketAddr) -> Option<T>,
        hit: impl Fn(&T) -> bool,
    ) -> Option<T> {
        let mut last = None;
        for addr in self.route(target, page, true) {
            match on(addr) {
                Some(v) if hit(&v) => return Some(v),
                Some(v) => last = Some(v),
                None => {}
            }
        }
        last
    }

    /// Puts `bytes` as `page`'s object on its weighted owner; true when acknowledged (stored, or
    /// already present), recorded in the book's per-replica rates.
    fn write(&self, target: &L3Target, page: PageKey, object: &ObjectKey, bytes: &[u8]) -> bool {
        let Some(addr) = self.route(target, page, false).first().copied() else {
            return false;
        };
        match self.call_on(addr, "put", |c| c.put(object, bytes)) {
            Some(stored) => {
                lock(&self.book).put_done(addr, bytes.len() as u64, stored, Instant::now());
                true
            }
            None => false,
        }
    }

    /// The `l3` section of `/report` ([`l3_report::section`]) and the `/metrics` gauges, now.
    pub fn l3_report(&self) -> serde_json::Value {
        let now = Instant::now();
        let book = lock(&self.book);
        self.metrics.update(&book, now);
        l3_report::section(&book, now)
    }

    /// Leading pages of `keys` present in L3.
    fn l3_leading(&self, target: &L3Target, keys: &[PageKey]) -> usize {
        let mut n = 0;
        for key in keys {
            let object = self.object(target, *key);
            let lookup = |a| self.call_on(a, "lookup", |c| c.lookup(std::slice::from_ref(&object)));
            match self.read(target, *key, lookup, |n| *n > 0) {
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
            if !self.write(target, *page, &object, &bytes) {
                return;
            }
            self.counters.l3_pages_written.inc();
        }
    }
}

/// L3 access for the engine API's tier backend ([`super::tiers::HostTiers`]): the same replica
/// resolution, placement, write ramp, reconnect-once and degraded reasons as the built-in path.
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
        self.read(
            target,
            page,
            |a| self.call_on(a, "get", |c| c.get(&object)),
            Option::is_some,
        )
        .ok_or_else(|| format!("no L3 replica answered a get of page {page}"))
    }

    /// [`Self::l3_get`] over a loadback stream's own connections `conns` (so that several
    /// streams read at once instead of queueing on the shared connection per replica).
    ///
    /// # Errors
    /// As [`Self::l3_get`].
    pub(super) fn l3_get_on(
        &self,
        conns: &mut StreamConns,
        page: PageKey,
    ) -> Result<Option<Vec<u8>>, String> {
        let target = self.l3.as_ref().ok_or("no L3 tier is configured")?;
        let object = self.object(target, page);
        self.read(
            target,
            page,
            |a| self.call_own(conns, a, "get", |c| c.get(&object)),
            Option::is_some,
        )
        .ok_or_else(|| format!("no L3 replica answered a get of page {page}"))
    }

    /// Puts `bytes` as `page`'s target-pool object; true when the store acknowledged it (counted
    /// in `l3_pages_written`).
    pub fn l3_put(&self, page: PageKey, bytes: &[u8]) -> bool {
        let Some(target) = &self.l3 else { return false };
        let object = self.object(target, page);
        let ok = self.write(target, page, &object, bytes);
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
            match L3Client::connect(addr, CONNECT_TIMEOUT)
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
    /// every replica for this shard's most recently used pages (up to `limit`), reads each object
    /// over `streams` read streams ([`loadback::read_in_order`]), checks it byte for byte against
    /// the page it must hold, and publishes the good ones in L2, most recent last. Stops at
    /// `deadline`. Returns the pages loaded; a bad object counts in `corrupt_pages_read` and is
    /// skipped.
    pub fn load_back(
        &self,
        layout: KvLayout,
        limit: usize,
        streams: usize,
        deadline: Instant,
    ) -> u64 {
        let order: Vec<PageKey> = self.l3_hot(limit).into_iter().rev().collect();
        let mut loaded = 0;
        let done =
            loadback::read_in_order(self, &order, streams, deadline, |page, read| match read {
                Ok(Some(bytes)) if bytes == Self::object_bytes(page, layout) => {
                    lock(&self.index).insert(Tier::L2Host, &[page], Residency::Present);
                    self.counters.l3_pages_loaded_back.inc();
                    loaded += 1;
                }
                Ok(Some(_)) => {
                    tracing::error!(%page, "L3 object does not hold its page; skipped");
                    self.counters.corrupt_pages_read.inc();
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(%page, error = %e, "loadback get failed"),
            });
        if done.stopped_at_deadline {
            tracing::warn!(
                loaded,
                of = order.len(),
                "L3 loadback stopped at its deadline"
            );
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
        let from_snapshot = {
            let set = lock(&self.from_snapshot);
            marked_tokens(&keys, l2, input, page_tokens, |k| set.contains(k))
        };
        self.counters
            .record_prefix_lookup(input, hits.l2, hits.l3, from_snapshot);
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
