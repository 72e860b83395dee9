//! The prefill worker's tier backend for an engine (DESIGN §3.1 "Tiers", contracts 5 and 7): the
//! engine API's Lookup, Load and Store served from an L2 host store of real page bytes and the L3
//! CacheTier store.
//!
//! - **L2** holds the bytes of whole target-pool pages (every layer, in layer order — the L3 object
//!   form), keyed by [`PageKey`], LRU, with the built-in path's capacity (the target pool's page
//!   count, `memory.targetPoolBytes / page bytes`). Each entry keeps its xxh3 checksum
//!   ([`crate::l3::manifest::checksum`]), checked again before its bytes are copied into a page.
//! - **L3** is reached through the prefix cache's replica access ([`PrefixCache::l3_get`] /
//!   [`PrefixCache::l3_put`]): the store checks each object's length and checksum on read (a bad
//!   object is quarantined and answers a miss); this side checks the length again.
//! - **Lookup**: the leading pages present in L2, then the pages after them present in L3.
//! - **Load** (on a thread of its own): fetches every page's bytes (L2, else L3 — an L3 page enters
//!   L2), then runs the load plan of [`crate::load::plan`] over the pages it has: every
//!   `(pool, layer)` copy into the engine's pages is followed by its record, which completes the
//!   [`EventLedger`] event and sends `LayerLoaded` — the event the engine waits on before it reads
//!   that layer (contract 5); then `LoadDone { pages, bytes }`. A page that is missing, fails its
//!   checksum or length, or whose replica does not answer ends the load there: the pages before it
//!   are loaded (with their events) and `LoadFailed { pages_loaded }` follows. Every `LayerLoaded`
//!   names the leading pages it covers (`pages`), known before the first copy, so an engine never
//!   reads a page behind the failure as loaded.
//! - **Store** copies the source pages' bytes into L2 before it answers (the engine may reuse the
//!   pages at once) and hands pages to a background L3 writer per the write policy
//!   (write-through: every stored page; write-back: the pages L2 evicts, and every page at drain).
//!   A Store naming a page that a load still writes is refused and counted (read before ready).
//!
//! Hit accounting keeps the built-in path's meaning: the worker looks the prefix up when the decode
//! opens the room ([`HostTiers::open_lookup`]) and counts `prefix_lookup_tokens` and
//! `prefix_hit_tokens_{l2,l3}` there, and answers the same hits to the decode; `/report.engine.tiers`
//! and `tandem_engine_load_*` count what was actually loaded.
//!
//! Negative control (feature `negative-controls`, env `TANDEM_NC_TIERS_SKIP_COPY=1`): the load
//! sends its events without copying any byte — the engine's loaded-bytes check must fail.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc as std_mpsc};
use std::time::Instant;

use lru::LruCache;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tonic::Code;

use super::prefix_cache::PrefixCache;
use crate::config::WritePolicy;
use crate::control::{KvLayout, pb as cpb};
use crate::engine_api::error::ApiError;
use crate::engine_api::pb;
use crate::engine_api::tiers::{LoadJob, TierBackend, hash_of_key, key_of_hash};
use crate::health::counters::Counters;
use crate::l3::manifest::checksum;
use crate::load::event_ledger::EventLedger;
use crate::load::plan::{self as load_plan, FencePolicy, LoadOp, PageCopy};
use crate::memory::pool::{KvPool, PageId, PoolRole};
use crate::tier::PageKey;
use crate::tier::hit_accounting::{marked_tokens, page_token_len};
use crate::tier::trace::TRACE_BLOCK_TOKENS;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The background L3 writer's queue.
type PutSender = std_mpsc::SyncSender<(PageKey, Arc<[u8]>)>;

/// Most pages waiting for the background L3 writer; beyond it a put is dropped and counted.
pub const L3_PUT_QUEUE: usize = 4096;

/// Most bytes of page copies waiting for the background L3 writer (the queue's real bound:
/// [`put_queue_pages`]). A slow or restarting store must not grow the prefill's memory past its
/// pod limit: with the sample's 640 KiB pages a 4,096-page queue held 2.5 GiB, and the engine
/// path's full-trace run had prefill workers OOM-killed at 3–4.6 GiB anonymous memory while the
/// store replicas restarted (issue 13 note). A put beyond it is dropped and counted
/// (`l3_puts_dropped`); the page stays in L2.
pub const L3_PUT_QUEUE_BYTES: usize = 128 << 20;

/// The L3 writer queue's length in pages for pages of `page_bytes`: [`L3_PUT_QUEUE_BYTES`] worth,
/// at least 16 and at most [`L3_PUT_QUEUE`].
pub fn put_queue_pages(page_bytes: usize) -> usize {
    (L3_PUT_QUEUE_BYTES / page_bytes.max(1)).clamp(16, L3_PUT_QUEUE)
}

/// What the tier backend did (monotonic since start).
#[derive(Debug, Default)]
pub struct TierStats {
    /// Lookup calls answered.
    pub lookups: AtomicU64,
    /// Load calls started.
    pub loads: AtomicU64,
    /// Loads that ended in LoadFailed.
    pub loads_failed: AtomicU64,
    /// `LayerLoaded` events delivered: the per-(pool, layer) events the engine waits on before
    /// it reads a loaded layer.
    pub layer_events: AtomicU64,
    /// Pages copied into engine pages from L2 bytes.
    pub pages_loaded_l2: AtomicU64,
    /// Pages copied into engine pages from bytes fetched from L3 by that load.
    pub pages_loaded_l3: AtomicU64,
    /// Pages copied into engine pages whose bytes came from L3 (fetched by the load, or loaded
    /// back into L2 at restart).
    pub pages_loaded_from_l3_bytes: AtomicU64,
    /// Bytes copied from L2.
    pub bytes_loaded_l2: AtomicU64,
    /// Bytes copied from L3.
    pub bytes_loaded_l3: AtomicU64,
    /// L2 entries or L3 objects refused by this side's checksum or length check.
    pub corrupt_objects: AtomicU64,
    /// Stores refused because they read a page a load still writes (read before ready).
    pub read_before_ready: AtomicU64,
    /// Pages copied into L2 by Store.
    pub pages_stored: AtomicU64,
    /// L3 puts dropped because the writer's queue was full.
    pub l3_puts_dropped: AtomicU64,
    /// Pages loaded back from L3 into L2 at start.
    pub pages_loaded_back: AtomicU64,
    /// Pages finalized snapshots put into L2 (snapshot sync, contract 4).
    pub snapshot_pages: AtomicU64,
    /// Of those, pages L2 did not hold before (what sync added).
    pub snapshot_pages_new: AtomicU64,
}

impl TierStats {
    /// The `/report.engine.tiers` value.
    pub fn report(&self, l2_pages: usize, l2_capacity: usize) -> Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "l2_pages": l2_pages,
            "l2_capacity_pages": l2_capacity,
            "lookups": g(&self.lookups),
            "loads": g(&self.loads),
            "loads_failed": g(&self.loads_failed),
            "load_waits": g(&self.layer_events),
            "read_before_ready": g(&self.read_before_ready),
            "pages_loaded": {"l2": g(&self.pages_loaded_l2), "l3": g(&self.pages_loaded_l3)},
            "bytes_loaded": {"l2": g(&self.bytes_loaded_l2), "l3": g(&self.bytes_loaded_l3)},
            "pages_loaded_from_l3_bytes": g(&self.pages_loaded_from_l3_bytes),
            "corrupt_objects": g(&self.corrupt_objects),
            "pages_stored": g(&self.pages_stored),
            "l3_puts_dropped": g(&self.l3_puts_dropped),
            "pages_loaded_back": g(&self.pages_loaded_back),
            "snapshot_pages": g(&self.snapshot_pages),
            "snapshot_pages_new": g(&self.snapshot_pages_new),
        })
    }
}

#[derive(Debug, Clone)]
struct L2Page {
    bytes: Arc<[u8]>,
    checksum: u64,
    /// The bytes came from L3 (a load's fetch or the restart loadback).
    from_l3: bool,
}

/// Where a load's page bytes came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    L2 { from_l3: bool },
    L3,
}

struct Fetched {
    key: PageKey,
    bytes: Arc<[u8]>,
    source: Source,
}

/// The tier backend of a prefill worker with an engine.
pub struct HostTiers {
    /// The target pool; taken by [`HostTiers::close`] so that teardown can free it.
    pool: Mutex<Option<Arc<KvPool>>>,
    layout: KvLayout,
    l2: Mutex<LruCache<PageKey, L2Page>>,
    l2_capacity: usize,
    /// L2 pages a finalized snapshot added (absent before it): a lookup hitting them counts
    /// `snapshot_hit_tokens`. A page leaves the set when L2 evicts it, so it never outgrows L2.
    from_snapshot: Mutex<std::collections::HashSet<PageKey>>,
    cache: Arc<PrefixCache>,
    write_policy: Option<WritePolicy>,
    counters: Counters,
    stats: Arc<TierStats>,
    /// Destination pages of loads in flight (page → loads writing it).
    loading: Mutex<HashMap<u32, u32>>,
    ledger: Arc<EventLedger>,
    generation: AtomicU64,
    puts: Mutex<Option<PutSender>>,
    skip_copy: bool,
    me: std::sync::Weak<HostTiers>,
}

impl std::fmt::Debug for HostTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTiers")
            .field("l2_capacity", &self.l2_capacity)
            .finish()
    }
}

/// Why the tier backend cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TiersError {
    /// The target pool's geometry is not the transfer layout's.
    #[error(
        "the target pool's chunks ({pool_chunk} B, {pool_layers} layers) are not the KV layout's ({chunk} B, {layers} layers)"
    )]
    Geometry {
        /// Pool chunk bytes.
        pool_chunk: u64,
        /// Pool layers.
        pool_layers: u32,
        /// Layout chunk bytes.
        chunk: u64,
        /// Layout layers.
        layers: u32,
    },
    /// The L3 writer thread could not start.
    #[error("L3 writer thread: {0}")]
    Thread(String),
}

fn tier_error(code: Code, reason: pb::ErrorReason, msg: impl Into<String>) -> ApiError {
    ApiError::new(code, reason, msg)
}

impl HostTiers {
    /// A backend over the target `pool` (whose geometry must be `layout`'s), with an L2 of
    /// `l2_pages` pages (at least 1) and L3 through `cache` (none when `cache` has no tier).
    ///
    /// # Errors
    /// [`TiersError`].
    pub fn new(
        pool: Arc<KvPool>,
        layout: KvLayout,
        l2_pages: usize,
        cache: Arc<PrefixCache>,
        counters: Counters,
    ) -> Result<Arc<Self>, TiersError> {
        let g = *pool.geometry();
        if g.chunk_bytes() != layout.chunk_bytes() || g.layers != layout.layers {
            return Err(TiersError::Geometry {
                pool_chunk: g.chunk_bytes(),
                pool_layers: g.layers,
                chunk: layout.chunk_bytes(),
                layers: layout.layers,
            });
        }
        let cap = NonZeroUsize::new(l2_pages.max(1)).unwrap_or(NonZeroUsize::MIN);
        let write_policy = cache.l3_target().map(|t| t.write_policy);
        let stats = Arc::new(TierStats::default());
        let puts = if write_policy.is_some() {
            let page_bytes = usize::try_from(layout.page_bytes()).unwrap_or(usize::MAX);
            let (tx, rx) =
                std_mpsc::sync_channel::<(PageKey, Arc<[u8]>)>(put_queue_pages(page_bytes));
            let c = cache.clone();
            std::thread::Builder::new()
                .name("l3-writer".into())
                .spawn(move || {
                    for (key, bytes) in rx {
                        if !c.l3_put(key, &bytes) {
                            tracing::warn!(page = %key, "L3 put failed; the page stays in L2 only");
                        }
                    }
                })
                .map_err(|e| TiersError::Thread(e.to_string()))?;
            Some(tx)
        } else {
            None
        };
        Ok(Arc::new_cyclic(|me| Self {
            pool: Mutex::new(Some(pool)),
            layout,
            l2: Mutex::new(LruCache::new(cap)),
            l2_capacity: cap.get(),
            from_snapshot: Mutex::new(std::collections::HashSet::new()),
            cache,
            write_policy,
            counters,
            stats,
            loading: Mutex::new(HashMap::new()),
            ledger: Arc::new(EventLedger::new()),
            generation: AtomicU64::new(0),
            puts: Mutex::new(puts),
            skip_copy: skip_copy_from_env(),
            me: me.clone(),
        }))
    }

    fn pool(&self) -> Result<Arc<KvPool>, String> {
        lock(&self.pool)
            .clone()
            .ok_or_else(|| "the tier backend is closed (worker shutdown)".to_owned())
    }

    /// Teardown (DESIGN contract 9): drops this backend's hold on the target pool (so the seat can
    /// free it) and stops the L3 writer; later loads and stores are refused.
    pub fn close(&self) {
        lock(&self.pool).take();
        lock(&self.puts).take();
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<TierStats> {
        &self.stats
    }

    /// Pages in L2 now.
    pub fn l2_len(&self) -> usize {
        lock(&self.l2).len()
    }

    /// L2 capacity in pages.
    pub fn l2_capacity(&self) -> usize {
        self.l2_capacity
    }

    /// The `/report.engine.tiers` value.
    pub fn report(&self) -> Value {
        self.stats.report(self.l2_len(), self.l2_capacity)
    }

    fn page_bytes(&self) -> usize {
        self.layout.page_bytes() as usize
    }

    /// The prefix hashes of `request` for the engine's tier calls: its `hash_ids` of the pages it
    /// fills, when pages are trace blocks (512 tokens; the built-in path's rule), else none.
    pub fn hashes_of(request: &cpb::RequestSpec, layout: KvLayout) -> Vec<Vec<u8>> {
        if u64::from(layout.page_tokens) != TRACE_BLOCK_TOKENS {
            return Vec::new();
        }
        let pages = request.input_tokens.max(1).div_ceil(layout.page_tokens) as usize;
        request
            .hash_ids
            .iter()
            .take(pages)
            .map(|id| hash_of_key(PageKey::from_trace_id(*id)))
            .collect()
    }

    /// The open-time lookup of a room (blocking: L3 answers over the network): counts
    /// `prefix_lookup_tokens` and `prefix_hit_tokens_{l2,l3}` as the built-in planner does and
    /// returns the hits the decode is told.
    pub fn open_lookup(&self, request: &cpb::RequestSpec, hashes: &[Vec<u8>]) -> cpb::PrefixHits {
        let input = u64::from(request.input_tokens.max(1));
        let page_tokens = u64::from(self.layout.page_tokens);
        let keys: Vec<PageKey> = hashes.iter().map(|h| key_of_hash(h)).collect();
        let (l2, l3) = self.leading(&keys);
        let tokens = |range: std::ops::Range<usize>| -> u64 {
            range.map(|p| page_token_len(input, page_tokens, p)).sum()
        };
        let hits = cpb::PrefixHits {
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
        hits
    }

    /// A finalized snapshot (DESIGN contract 4, the engine path: L2 is the host tier the engine's
    /// next Lookup and Load read): each `(key, bytes)` page — every layer of the target pool, in
    /// layer order, [`KvLayout::page_bytes`] long — that L2 does not hold enters it (checksum kept)
    /// and is marked as brought by a snapshot, so a later lookup hitting it counts
    /// `snapshot_hit_tokens`. A page L2 already holds keeps its bytes — what this prefill computed
    /// or loaded — and only becomes the most recently used. Snapshot pages never go to L3 (neither
    /// written through nor written back when evicted): L3 holds what prefills computed, and a
    /// decode's bytes must not replace an object another prefill wrote. Returns the pages added.
    ///
    /// # Errors
    /// A page of the wrong length (nothing is inserted then), or a closed backend (shutdown).
    pub fn insert_snapshot(&self, pages: Vec<(PageKey, Arc<[u8]>)>) -> Result<u64, String> {
        lock(&self.pool)
            .as_ref()
            .ok_or_else(|| "the tier backend is closed (worker shutdown)".to_owned())?;
        if let Some((k, b)) = pages.iter().find(|(_, b)| b.len() != self.page_bytes()) {
            return Err(format!(
                "snapshot page {k} has {} bytes, a page has {}",
                b.len(),
                self.page_bytes()
            ));
        }
        let n = pages.len() as u64;
        let mut added = 0u64;
        for (key, bytes) in pages {
            // Checked and inserted under one L2 lock: a Store of the same key in between would
            // otherwise be overwritten by the decode's bytes.
            let evicted = {
                let mut l2 = lock(&self.l2);
                if l2.get(&key).is_some() {
                    continue;
                }
                let page = L2Page {
                    checksum: checksum(&bytes),
                    bytes: bytes.clone(),
                    from_l3: false,
                };
                let mut set = lock(&self.from_snapshot);
                let evicted = l2.push(key, page).filter(|(k, _)| *k != key);
                set.insert(key);
                // An evicted snapshot page is dropped, not written back.
                evicted
                    .filter(|(k, _)| !set.remove(k))
                    .map(|(k, old)| (k, old.bytes))
            };
            added += 1;
            self.write_back(evicted.into_iter().collect());
        }
        self.stats.snapshot_pages.fetch_add(n, Ordering::Relaxed);
        self.stats
            .snapshot_pages_new
            .fetch_add(added, Ordering::Relaxed);
        Ok(added)
    }

    /// Leading L2 pages of `keys`, then the L3 pages after them.
    fn leading(&self, keys: &[PageKey]) -> (usize, usize) {
        let l2 = {
            let l2 = lock(&self.l2);
            keys.iter().take_while(|k| l2.contains(*k)).count()
        };
        let l3 = if l2 < keys.len() {
            self.cache.l3_leading_pages(&keys[l2..])
        } else {
            0
        };
        (l2, l3)
    }

    /// Inserts `bytes` for `key` into L2; returns the evicted pages (write-back puts them).
    fn l2_insert(
        &self,
        key: PageKey,
        bytes: Arc<[u8]>,
        from_l3: bool,
    ) -> Vec<(PageKey, Arc<[u8]>)> {
        let page = L2Page {
            checksum: checksum(&bytes),
            bytes,
            from_l3,
        };
        let mut l2 = lock(&self.l2);
        let mut evicted = Vec::new();
        if let Some((k, old)) = l2.push(key, page)
            && k != key
            // A snapshot page leaves L2 without going to L3 (see `insert_snapshot`).
            && !lock(&self.from_snapshot).remove(&k)
        {
            evicted.push((k, old.bytes));
        }
        evicted
    }

    fn queue_put(&self, key: PageKey, bytes: Arc<[u8]>) {
        let tx = lock(&self.puts).clone();
        if let Some(tx) = tx
            && tx.try_send((key, bytes)).is_err()
        {
            self.stats.l3_puts_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(page = %key, "L3 writer queue full: put dropped");
        }
    }

    fn write_back(&self, evicted: Vec<(PageKey, Arc<[u8]>)>) {
        if self.write_policy == Some(WritePolicy::WriteBack) {
            for (k, b) in evicted {
                self.queue_put(k, b);
            }
        }
    }

    /// One page's bytes: L2 (checksum checked), else L3 (length checked; enters L2).
    fn fetch(&self, key: PageKey) -> Result<Fetched, String> {
        let hit = lock(&self.l2).get(&key).cloned();
        if let Some(p) = hit {
            if checksum(&p.bytes) == p.checksum && p.bytes.len() == self.page_bytes() {
                return Ok(Fetched {
                    key,
                    bytes: p.bytes,
                    source: Source::L2 { from_l3: p.from_l3 },
                });
            }
            lock(&self.l2).pop(&key);
            lock(&self.from_snapshot).remove(&key);
            self.stats.corrupt_objects.fetch_add(1, Ordering::Relaxed);
            return Err(format!("L2 page {key} failed its checksum; dropped"));
        }
        if self.write_policy.is_none() {
            return Err(format!(
                "page {key} is not in L2 and no L3 tier is configured"
            ));
        }
        match self.cache.l3_get(key)? {
            Some(b) if b.len() == self.page_bytes() => {
                let bytes: Arc<[u8]> = Arc::from(b);
                let evicted = self.l2_insert(key, bytes.clone(), true);
                self.write_back(evicted);
                Ok(Fetched {
                    key,
                    bytes,
                    source: Source::L3,
                })
            }
            Some(b) => {
                self.stats.corrupt_objects.fetch_add(1, Ordering::Relaxed);
                Err(format!(
                    "L3 object of page {key} has {} bytes; a page has {}",
                    b.len(),
                    self.page_bytes()
                ))
            }
            None => Err(format!(
                "page {key} is missing from L3 (absent, or quarantined by its checksum)"
            )),
        }
    }

    /// Copies layer `layer` of every fetched page into its destination page.
    fn copy_layer(&self, fetched: &[Fetched], dst: &[u32], layer: u32) -> Result<(), String> {
        if self.skip_copy {
            return Ok(());
        }
        let chunk = self.layout.chunk_bytes() as usize;
        let pool = self.pool()?;
        let base = pool.buffer().host_ptr().map_err(|e| e.to_string())?;
        for (f, &d) in fetched.iter().zip(dst) {
            let r = pool
                .chunk_region(PageId(d), layer)
                .map_err(|e| e.to_string())?;
            let src = f
                .bytes
                .get(layer as usize * chunk..(layer as usize + 1) * chunk)
                .ok_or("a page's bytes end before its layer")?;
            if r.len != src.len() {
                return Err(format!("chunk of {} B, source of {} B", r.len, src.len()));
            }
            // SAFETY: `r` is a chunk of the pool's live mapping (checked by `chunk_region`); the
            // pool outlives this call (held by `pool`). The engine reserved `d` for this load and
            // reads it only after this layer's LayerLoaded (contract 5).
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(r.offset), r.len) };
        }
        Ok(())
    }

    /// Runs one load on the calling thread (see the module docs); returns its terminal event
    /// (`LoadDone` or `LoadFailed`), which the caller sends once the destination pages are no
    /// longer marked loading — or `None` when the engine went away.
    fn run_load(
        &self,
        job: &LoadJob,
        events: &mpsc::UnboundedSender<pb::LoadEvent>,
    ) -> Option<pb::load_event::Event> {
        let send = |e: pb::load_event::Event| events.send(pb::LoadEvent { event: Some(e) }).is_ok();
        let mut fetched = Vec::with_capacity(job.hashes.len());
        let mut failure = None;
        for h in &job.hashes {
            match self.fetch(key_of_hash(h)) {
                Ok(f) => fetched.push(f),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let n = fetched.len();
        let dst = &job.pages[..n];
        if n > 0 {
            let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
            let plan_job = load_plan::LoadJob {
                pools: vec![PoolRole::Target],
                layers: self.layout.layers,
                pages: fetched
                    .iter()
                    .enumerate()
                    .map(|(i, f)| PageCopy {
                        key: f.key,
                        host_page: i as u32,
                        device_page: dst[i],
                    })
                    .collect(),
            };
            let plan = load_plan::plan_load(&plan_job, generation, 0, FencePolicy::WaitForward);
            if let Err(v) = load_plan::check_load_plan(&plan, &plan_job) {
                tracing::error!(violation = %v, "refusing a load plan that breaks contract 5");
                self.stats.loads_failed.fetch_add(1, Ordering::Relaxed);
                return Some(pb::load_event::Event::Failed(pb::LoadFailed {
                    message: format!("load plan: {v}"),
                    pages_loaded: 0,
                }));
            }
            self.ledger.record_plan(&plan);
            for (i, op) in plan.ops.iter().enumerate() {
                match *op {
                    // The forward stream is the engine's, in its own process: it issues a Load only
                    // for pages no compute of its reads, so there is nothing to fence behind here.
                    LoadOp::WaitFence { .. } | LoadOp::ReleaseHostPages => {}
                    LoadOp::Copy { layer, .. } => {
                        if let Err(e) = self.copy_layer(&fetched, dst, layer) {
                            self.ledger.fail_from(&plan, i);
                            self.stats.loads_failed.fetch_add(1, Ordering::Relaxed);
                            return Some(pb::load_event::Event::Failed(pb::LoadFailed {
                                message: format!("copy of layer {layer}: {e}"),
                                pages_loaded: 0,
                            }));
                        }
                    }
                    LoadOp::Record {
                        pool,
                        layer,
                        generation,
                    } => {
                        self.ledger.complete(pool, layer, generation);
                        if !send(pb::load_event::Event::Layer(pb::LayerLoaded {
                            pool: crate::engine_api::identity::kind_to_proto(pool) as i32,
                            layer,
                            pages: n as u32,
                        })) {
                            // The engine went away: nobody reads these pages.
                            self.ledger.fail_from(&plan, i + 1);
                            return None;
                        }
                        self.stats.layer_events.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let page = self.page_bytes() as u64;
            for f in &fetched {
                let (pages, bytes) = match f.source {
                    Source::L2 { from_l3 } => {
                        if from_l3 {
                            self.stats
                                .pages_loaded_from_l3_bytes
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        (&self.stats.pages_loaded_l2, &self.stats.bytes_loaded_l2)
                    }
                    Source::L3 => {
                        self.stats
                            .pages_loaded_from_l3_bytes
                            .fetch_add(1, Ordering::Relaxed);
                        (&self.stats.pages_loaded_l3, &self.stats.bytes_loaded_l3)
                    }
                };
                pages.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(page, Ordering::Relaxed);
            }
        }
        Some(match failure {
            None => pb::load_event::Event::Done(pb::LoadDone {
                pages: n as u32,
                bytes: (n * self.page_bytes()) as u64,
            }),
            Some(message) => {
                tracing::warn!(pages_loaded = n, %message, "load failed");
                self.stats.loads_failed.fetch_add(1, Ordering::Relaxed);
                pb::load_event::Event::Failed(pb::LoadFailed {
                    message,
                    pages_loaded: n as u32,
                })
            }
        })
    }

    fn end_loading(&self, pages: &[u32]) {
        let mut l = lock(&self.loading);
        for p in pages {
            if let Some(n) = l.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    l.remove(p);
                }
            }
        }
    }

    /// Restart loadback (DESIGN §5): this shard's most recently used pages from L3 into L2 (up to
    /// `limit` and the L2 capacity), each read whole over `streams` read streams
    /// ([`super::loadback::read_in_order`]; the store checks its checksum, this side its length)
    /// and published most recent last; stops at `deadline`. Returns the pages loaded back (also
    /// counted in `l3_pages_loaded_back`).
    pub fn load_back(&self, limit: usize, streams: usize, deadline: Instant) -> u64 {
        if self.write_policy.is_none() {
            return 0;
        }
        let order: Vec<PageKey> = self
            .cache
            .l3_hot(limit.min(self.l2_capacity))
            .into_iter()
            .rev()
            .collect();
        let mut loaded = 0;
        let done = super::loadback::read_in_order(
            &self.cache,
            &order,
            streams,
            deadline,
            |key, read| match read {
                Ok(Some(b)) if b.len() == self.page_bytes() => {
                    let evicted = self.l2_insert(key, Arc::from(b), true);
                    self.write_back(evicted);
                    self.counters.l3_pages_loaded_back.inc();
                    self.stats.pages_loaded_back.fetch_add(1, Ordering::Relaxed);
                    loaded += 1;
                }
                Ok(Some(b)) => {
                    self.stats.corrupt_objects.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(page = %key, len = b.len(), "L3 object of the wrong length; skipped");
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(page = %key, error = %e, "loadback get failed"),
            },
        );
        if done.stopped_at_deadline {
            tracing::warn!(
                loaded,
                of = order.len(),
                "L3 loadback stopped at its deadline"
            );
        }
        loaded
    }

    /// Drain flush (DESIGN §5): with write-back, puts every page L2 holds, waiting at most until
    /// `deadline`. Returns the pages written.
    pub fn flush(&self, deadline: Instant) -> u64 {
        // Stop the background writer first so no put races the flush's.
        lock(&self.puts).take();
        if self.write_policy != Some(WritePolicy::WriteBack) {
            return 0;
        }
        let pages: Vec<(PageKey, Arc<[u8]>)> = lock(&self.l2)
            .iter()
            .map(|(k, p)| (*k, p.bytes.clone()))
            .collect();
        let mut written = 0;
        for (k, b) in pages {
            if Instant::now() >= deadline {
                break;
            }
            if self.cache.l3_put(k, &b) {
                written += 1;
            }
        }
        written
    }
}

#[cfg(feature = "negative-controls")]
fn skip_copy_from_env() -> bool {
    let on = std::env::var("TANDEM_NC_TIERS_SKIP_COPY").is_ok_and(|v| v.trim() == "1");
    if on {
        tracing::warn!("negative control: loads send their events without copying any byte");
    }
    on
}

#[cfg(not(feature = "negative-controls"))]
fn skip_copy_from_env() -> bool {
    false
}

impl TierBackend for HostTiers {
    fn lookup(&self, hashes: &[Vec<u8>]) -> Result<Vec<pb::TierHits>, ApiError> {
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let keys: Vec<PageKey> = hashes.iter().map(|h| key_of_hash(h)).collect();
        let (l2, l3) = self.leading(&keys);
        let mut hits = vec![pb::TierHits {
            tier: pb::Tier::L2 as i32,
            pages: l2 as u32,
        }];
        if self.write_policy.is_some() {
            hits.push(pb::TierHits {
                tier: pb::Tier::L3 as i32,
                pages: l3 as u32,
            });
        }
        Ok(hits)
    }

    fn load(
        &self,
        job: LoadJob,
        events: mpsc::UnboundedSender<pb::LoadEvent>,
    ) -> Result<(), ApiError> {
        if job.pools.iter().any(|p| *p != PoolRole::Target) {
            return Err(tier_error(
                Code::FailedPrecondition,
                pb::ErrorReason::TierUnavailable,
                "only the target pool is tiered on this worker",
            )
            .field("pools"));
        }
        {
            let mut l = lock(&self.loading);
            if let Some(p) = job.pages.iter().find(|p| l.contains_key(*p)) {
                return Err(ApiError::malformed(
                    "pages",
                    format!("page {p} is the destination of a load still in flight"),
                ));
            }
            for p in &job.pages {
                *l.entry(*p).or_insert(0) += 1;
            }
        }
        let Some(me) = self.me.upgrade() else {
            self.end_loading(&job.pages);
            return Err(tier_error(
                Code::Unavailable,
                pb::ErrorReason::ShuttingDown,
                "the tier backend is shutting down",
            ));
        };
        self.stats.loads.fetch_add(1, Ordering::Relaxed);
        let pages = job.pages.clone();
        let spawned = std::thread::Builder::new()
            .name("tier-load".into())
            .spawn(move || {
                let end = me.run_load(&job, &events);
                // Unmarked first: the engine may Store the pages the moment it reads the end.
                me.end_loading(&job.pages);
                if let Some(e) = end {
                    let _ = events.send(pb::LoadEvent { event: Some(e) });
                }
            });
        spawned.map(|_| ()).map_err(|e| {
            self.end_loading(&pages);
            tier_error(
                Code::Internal,
                pb::ErrorReason::Internal,
                format!("load thread: {e}"),
            )
        })
    }

    fn store(&self, hashes: &[Vec<u8>], pages: &[u32]) -> Result<u32, ApiError> {
        {
            let l = lock(&self.loading);
            if let Some(p) = pages.iter().find(|p| l.contains_key(*p)) {
                self.stats.read_before_ready.fetch_add(1, Ordering::Relaxed);
                return Err(tier_error(
                    Code::FailedPrecondition,
                    pb::ErrorReason::RoomState,
                    format!("page {p} is still being loaded: storing it now reads it before ready"),
                )
                .field("pages"));
            }
        }
        let chunk = self.layout.chunk_bytes() as usize;
        let pool = self
            .pool()
            .map_err(|e| tier_error(Code::Unavailable, pb::ErrorReason::ShuttingDown, e))?;
        let base = pool
            .buffer()
            .host_ptr()
            .map_err(|e| tier_error(Code::Internal, pb::ErrorReason::Internal, e.to_string()))?;
        let mut stored = 0u32;
        for (h, &p) in hashes.iter().zip(pages) {
            let key = key_of_hash(h);
            let mut bytes = vec![0u8; self.page_bytes()];
            for layer in 0..self.layout.layers {
                let r = pool.chunk_region(PageId(p), layer).map_err(|e| {
                    ApiError::malformed("pages", format!("page {p} layer {layer}: {e}"))
                })?;
                let dst = &mut bytes[layer as usize * chunk..(layer as usize + 1) * chunk];
                if r.len != dst.len() {
                    return Err(tier_error(
                        Code::Internal,
                        pb::ErrorReason::Internal,
                        format!("chunk of {} B, page layout of {} B", r.len, dst.len()),
                    ));
                }
                // SAFETY: `r` is a chunk of the pool's live mapping; the engine does not write a
                // page it stores until Store answered.
                unsafe {
                    std::ptr::copy_nonoverlapping(base.add(r.offset), dst.as_mut_ptr(), r.len);
                }
            }
            let bytes: Arc<[u8]> = Arc::from(bytes);
            let evicted = self.l2_insert(key, bytes.clone(), false);
            // Computed here: no longer a page only a snapshot brought.
            lock(&self.from_snapshot).remove(&key);
            if self.write_policy == Some(WritePolicy::WriteThrough) {
                self.queue_put(key, bytes);
            }
            self.write_back(evicted);
            stored += 1;
        }
        self.stats
            .pages_stored
            .fetch_add(u64::from(stored), Ordering::Relaxed);
        Ok(stored)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::memory::Allocator;
    use crate::memory::mmap::MmapBackend;
    use crate::memory::pool::{PoolLayout, PoolSpec};
    use crate::model::{Attention, ModelIdentity};
    use crate::roles::resolve::Resolver;

    /// 2 layers, 4 tokens per page, 32 B per token and layer; 8 pages, all allocated.
    fn rig(l2: usize) -> (Arc<HostTiers>, Arc<KvPool>) {
        let model = ModelIdentity {
            name: "t".into(),
            layers: 2,
            attention: Attention::Gqa {
                kv_heads: 1,
                head_dim: 8,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        };
        let spec = PoolSpec {
            role: PoolRole::Target,
            model,
            page_tokens: 4,
            pages: 8,
            layout: PoolLayout::PageFirst,
        };
        let pool = Arc::new(KvPool::new(spec, &Allocator::new("t", MmapBackend::new())).unwrap());
        pool.allocate(8).unwrap();
        let layout = KvLayout {
            layers: 2,
            page_tokens: 4,
            token_bytes: 32,
        };
        let cache = Arc::new(PrefixCache::new(
            l2,
            None,
            Resolver::from_env(),
            Duration::ZERO,
            Counters::default(),
            Arc::new(|_| {}),
        ));
        let t = HostTiers::new(pool.clone(), layout, l2, cache, Counters::default()).unwrap();
        (t, pool)
    }

    fn fill(pool: &KvPool, page: u32, byte: u8) {
        for layer in 0..2 {
            pool.write_chunk(
                PageId(page),
                layer,
                0,
                &[byte.wrapping_add(layer as u8); 128],
            )
            .unwrap();
        }
    }

    fn chunk(pool: &KvPool, page: u32, layer: u32) -> Vec<u8> {
        let mut b = vec![0u8; 128];
        pool.read_chunk(PageId(page), layer, 0, &mut b).unwrap();
        b
    }

    fn h(id: u64) -> Vec<u8> {
        hash_of_key(PageKey::from_trace_id(id))
    }

    /// Every event of one load, in order (bounded wait).
    fn events_of(
        t: &HostTiers,
        hashes: Vec<Vec<u8>>,
        pages: Vec<u32>,
    ) -> Vec<pb::load_event::Event> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        t.load(
            LoadJob {
                hashes,
                pages,
                pools: vec![PoolRole::Target],
            },
            tx,
        )
        .unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let mut out = Vec::new();
        loop {
            match rx.try_recv() {
                Ok(e) => out.push(e.event.unwrap()),
                Err(mpsc::error::TryRecvError::Disconnected) => return out,
                Err(mpsc::error::TryRecvError::Empty) => {
                    assert!(Instant::now() < end, "load did not end: {out:?}");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    fn layer(l: u32, pages: u32) -> pb::load_event::Event {
        pb::load_event::Event::Layer(pb::LayerLoaded {
            pool: pb::PoolKind::Target as i32,
            layer: l,
            pages,
        })
    }

    #[test]
    fn the_l3_put_queue_is_bounded_in_bytes() {
        // The sample's 640 KiB pages: 204 pages (128 MiB), not 4,096 (2.5 GiB).
        assert_eq!(super::put_queue_pages(640 << 10), 204);
        assert!(super::put_queue_pages(640 << 10) * (640 << 10) <= super::L3_PUT_QUEUE_BYTES);
        // Small pages keep the page bound; huge pages keep a few slots.
        assert_eq!(super::put_queue_pages(256), super::L3_PUT_QUEUE);
        assert_eq!(super::put_queue_pages(64 << 20), 16);
        assert_eq!(super::put_queue_pages(0), super::L3_PUT_QUEUE);
    }

    #[test]
    fn stored_bytes_load_into_another_page_layer_by_layer() {
        let (t, pool) = rig(4);
        fill(&pool, 0, 10);
        fill(&pool, 1, 20);
        assert_eq!(t.store(&[h(1), h(2)], &[0, 1]).unwrap(), 2);
        let hits = t.lookup(&[h(1), h(2), h(3)]).unwrap();
        assert_eq!(
            hits,
            vec![pb::TierHits {
                tier: pb::Tier::L2 as i32,
                pages: 2
            }]
        );
        let ev = events_of(&t, vec![h(1), h(2)], vec![5, 6]);
        assert_eq!(
            ev,
            vec![
                layer(0, 2),
                layer(1, 2),
                pb::load_event::Event::Done(pb::LoadDone {
                    pages: 2,
                    bytes: 512
                })
            ]
        );
        for l in 0..2 {
            assert_eq!(chunk(&pool, 5, l), chunk(&pool, 0, l));
            assert_eq!(chunk(&pool, 6, l), chunk(&pool, 1, l));
        }
        assert_eq!(t.stats().pages_loaded_l2.load(Ordering::Relaxed), 2);
        assert_eq!(t.stats().layer_events.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_missing_page_ends_the_load_with_the_pages_before_it() {
        let (t, pool) = rig(4);
        fill(&pool, 0, 1);
        t.store(&[h(1)], &[0]).unwrap();
        let ev = events_of(&t, vec![h(1), h(9)], vec![3, 4]);
        assert_eq!(ev.len(), 3, "{ev:?}");
        // The layer events cover the one page loaded, not the page behind the failure.
        assert_eq!(ev[..2], [layer(0, 1), layer(1, 1)]);
        match &ev[2] {
            pb::load_event::Event::Failed(f) => assert_eq!(f.pages_loaded, 1, "{f:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(chunk(&pool, 3, 1), chunk(&pool, 0, 1));
    }

    #[test]
    fn a_corrupt_l2_entry_is_refused_and_dropped() {
        let (t, pool) = rig(4);
        fill(&pool, 0, 1);
        t.store(&[h(1)], &[0]).unwrap();
        lock(&t.l2)
            .get_mut(&PageKey::from_trace_id(1))
            .unwrap()
            .checksum ^= 1;
        let ev = events_of(&t, vec![h(1)], vec![3]);
        assert!(
            matches!(&ev[..], [pb::load_event::Event::Failed(f)] if f.pages_loaded == 0),
            "{ev:?}"
        );
        assert_eq!(t.stats().corrupt_objects.load(Ordering::Relaxed), 1);
        assert_eq!(t.lookup(&[h(1)]).unwrap()[0].pages, 0, "dropped");
    }

    #[test]
    fn refusals_are_typed_and_nothing_is_left_marked() {
        let (t, _pool) = rig(1);
        let (tx, _rx) = mpsc::unbounded_channel();
        let e = t
            .load(
                LoadJob {
                    hashes: vec![h(1)],
                    pages: vec![0],
                    pools: vec![PoolRole::Draft],
                },
                tx,
            )
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::TierUnavailable);
        assert!(lock(&t.loading).is_empty());
        // A Store that reads a page a load still writes: refused, counted.
        lock(&t.loading).insert(2, 1);
        let e = t.store(&[h(1)], &[2]).unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::RoomState);
        assert_eq!(t.stats().read_before_ready.load(Ordering::Relaxed), 1);
        lock(&t.loading).clear();
        // L2 of one page: the second store evicts the first.
        t.store(&[h(1)], &[0]).unwrap();
        t.store(&[h(2)], &[1]).unwrap();
        assert_eq!(t.lookup(&[h(1)]).unwrap()[0].pages, 0);
        assert_eq!(t.lookup(&[h(2)]).unwrap()[0].pages, 1);
        // Closed: stores refused, no panic.
        t.close();
        assert_eq!(
            t.store(&[h(3)], &[0]).unwrap_err().reason,
            pb::ErrorReason::ShuttingDown
        );
    }
}
