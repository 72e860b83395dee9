//! LayerSplit on the built-in engine's serving path (issue 15; DESIGN contract 6; seed 004
//! "KV Cache 分层存储 LayerSplit").
//!
//! A prefill pod of a pool with `layerSplit` and `parallelism.context` C > 1 is one CP rank of a
//! group: the pods of one group StatefulSet (`<sts>-<ordinal>`) with the same TP rank. At start,
//! **before any KV store is allocated**, it resolves its peers as `<sts>-<ordinal>.<groupService>`
//! (StatefulSet pod DNS), connects the TCP rank link ([`TcpRankLink`], `ports.rankLink`; its
//! preamble refuses a peer on another owner map) and runs the hello handshake (R-LS-1). Only then
//! does it allocate its [`RankKvStore`], which holds its owned layers only.
//!
//! Rooms. The group's CP rank 0 (the *leader*) is the group's one room peer: its hello names every
//! layer. The other ranks answer a decode's hello with their owned range, and the decode keeps
//! them out of its room peers (`DecodeError::GroupMember`); their `OpenRoom` is refused. For each
//! room the leader's engine thread:
//! 1. counts one outstanding *part* per other rank in its sender room table
//!    ([`PrefillNode::begin_room_part`]): no abort ack leaves before every rank's writes are
//!    terminal (DESIGN contract 3);
//! 2. sends the `Step` (room, generation, request, the decode's data address and pages) to every
//!    other rank;
//! 3. runs the step like every rank ([`RankStepper`]): writes the KV of its owned layers, and for
//!    each layer `i` in order the owner broadcasts the chunks of the pages in use, every rank runs
//!    the indexer, a non-owner waits on the layer's event, and attention reads — and verifies —
//!    the request's chunks of layer `i`;
//! 4. writes its owned layers of every page into the decode's pages
//!    ([`PrefillNode::submit_page_writes`]; `ChunkDone` per page as before);
//! 5. takes each rank's `StepDone` (that rank's owned layers are written into the decode's pages,
//!    every write terminal) and ends its part ([`PrefillNode::end_room_part`]).
//!
//! The decode so receives each layer range from its owner, and its verification of every chunk
//! covers all of them. Steps run one at a time per group, numbered by the leader, so every rank's
//! store hands a request the same page ids (the broadcast's page list is checked).
//!
//! Reported in `/report.layer_split`: per-rank KV bytes against the replicated layout, broadcast
//! bytes against a whole-layer broadcast, waits (and how many the indexer hid), and the chunks
//! attention read that did not hold their KV (`corrupt_chunks_read`, 0 unless the negative
//! control `TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1` — feature `negative-controls` — makes the
//! ranks attend without waiting, reading another layer's bytes from the scratch).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};

use crate::config::WorkerConfig;
use crate::control::KvLayout;
use crate::layer_split::group::RankStepper;
use crate::layer_split::rank_store::RankKvStore;
use crate::layer_split::receive::LayerReceiver;
use crate::layer_split::tcp_link::{TcpLinkConfig, TcpRankLink};
use crate::layer_split::transport::RankLink;
use crate::layer_split::wire::{Frame, StepDoneFrame, StepFrame};
use crate::layer_split::{
    BroadcastScope, GroupSpec, KvLayout as GroupLayout, LayerSplitError, OwnerMap, RankReport,
    RequestSpec, WaitPolicy,
};
use crate::memory::Allocator;
use crate::memory::mmap::MmapBackend;
use crate::release::RoomKey;
use crate::roles::resolve::Resolver;
use crate::transfer::{RegionId, TransferStatus, Transport, WriteBatch, WriteOp};

use super::node::PrefillNode;

/// Negative control (feature `negative-controls`): `1` makes every rank of the group attend
/// without waiting on the layer's event.
pub const SKIP_WAIT_ENV: &str = "TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT";

/// Longest a rank waits for its own KV writes into a decode to become terminal before it reports
/// the step failed (the TCP transport's writes end well before: connect 2 s, then the socket).
const WRITE_WAIT: Duration = Duration::from_secs(60);
/// Longest the leader waits for a rank's `StepDone` after its own part: a rank's layer waits
/// ([`GroupSpec::wait_timeout`]) plus its writes ([`WRITE_WAIT`]) fit inside.
const STEP_REPORT_WAIT: Duration = Duration::from_secs(120);
/// Rooms queued at the leader beyond the one running: more are refused with `UNAVAILABLE` (the
/// decode retries another peer) rather than queued without bound.
const QUEUE_DEPTH: usize = 256;

/// Where this pod stands in its group: pure, from the config and the pod name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    /// This pod's CP rank.
    pub cp_rank: u32,
    /// CP size of the group.
    pub cp_size: u32,
    /// This pod's TP rank (its group link joins the CP ranks of this TP rank).
    pub tp_rank: u32,
    /// The owner map of `layerSplit`.
    pub map: OwnerMap,
    /// Host name of every CP rank of the link, index = CP rank (`<sts>-<ordinal>.<groupService>`).
    pub peer_hosts: Vec<String>,
    /// The rank-link port (every rank listens on it).
    pub port: u16,
}

/// The group plan of a prefill with `cfg` running as pod `pod_name`; `Ok(None)` when the config
/// has no `layerSplit` or a single CP rank.
///
/// # Errors
/// A text reason: no `ports.rankLink` or `peers.groupService`, a pod name without an ordinal, an
/// ordinal outside the group, an owner map the layers cannot take.
pub fn plan(cfg: &WorkerConfig, pod_name: &str) -> Result<Option<GroupPlan>, String> {
    let Some(ls) = &cfg.layer_split else {
        return Ok(None);
    };
    let (tensor, cp_size) = (cfg.parallelism.tensor.max(1), cfg.parallelism.context);
    if cp_size <= 1 {
        return Ok(None);
    }
    let port = cfg
        .ports
        .rank_link
        .ok_or("layerSplit needs ports.rankLink (the rank link's port)")?;
    let service = cfg
        .peers
        .group_service
        .as_deref()
        .ok_or("layerSplit needs peers.groupService (where the group's pods are named)")?;
    let (set, ordinal) = pod_name
        .rsplit_once('-')
        .and_then(|(set, n)| Some((set, n.parse::<u32>().ok()?)))
        .ok_or_else(|| format!("pod name {pod_name:?} has no -<ordinal> suffix"))?;
    let (tp_rank, cp_rank) = cfg.parallelism.ranks_of(ordinal).ok_or_else(|| {
        format!("ordinal {ordinal} is outside a group of {tensor} × {cp_size} ranks")
    })?;
    let map = OwnerMap::new(ls, cp_size).map_err(|e| e.to_string())?;
    let peer_hosts = (0..cp_size)
        .map(|cp| format!("{set}-{}.{service}", cp * tensor + tp_rank))
        .collect();
    Ok(Some(GroupPlan {
        cp_rank,
        cp_size,
        tp_rank,
        map,
        peer_hosts,
        port,
    }))
}

/// One room for the leader's engine thread.
pub struct StepJob {
    /// The room (its plan at the node names the decode's pages).
    pub key: RoomKey,
    /// Request id (seeds the KV).
    pub request: u64,
    /// Simulated compute time of the room (the cost model's, shortened by cache hits).
    pub compute: Duration,
    /// Told whether every rank's part completed.
    pub done: tokio::sync::oneshot::Sender<bool>,
}

/// Counters of this rank (monotonic), read by `/report`.
#[derive(Debug, Default)]
struct SplitStats {
    steps: AtomicU64,
    step_failures: AtomicU64,
    frames_sent: AtomicU64,
    broadcast_payload_bytes: AtomicU64,
    broadcast_frame_bytes: AtomicU64,
    whole_layer_broadcast_bytes: AtomicU64,
    waits: AtomicU64,
    waits_hidden: AtomicU64,
    corrupt_chunks_read: AtomicU64,
    kv_bytes_written: AtomicU64,
    link_broken: AtomicBool,
    last_error: Mutex<Option<String>>,
}

/// This pod's rank of a LayerSplit group, connected, with its engine thread running.
pub struct SplitRank {
    plan: GroupPlan,
    jobs: Option<SyncSender<StepJob>>,
    stats: Arc<SplitStats>,
    stored_kv_bytes: u64,
    replicated_kv_bytes: u64,
    scratch_bytes: u64,
    skip_wait: bool,
}

/// Knobs of [`SplitRank::start`].
#[derive(Debug, Clone, Copy)]
pub struct SplitOptions {
    /// Pages of the rank's store (the replicated pool's page count: bytes shrink, pages do not).
    pub pool_pages: u32,
    /// Deadline of the group's connect and handshake.
    pub connect_timeout: Duration,
    /// Deadline of each layer wait.
    pub wait_timeout: Duration,
    /// Indexer work rounds per layer (what a broadcast hides behind).
    pub indexer_work: u32,
}

impl Default for SplitOptions {
    fn default() -> Self {
        Self {
            pool_pages: 64,
            connect_timeout: Duration::from_secs(120),
            wait_timeout: Duration::from_secs(30),
            indexer_work: 64,
        }
    }
}

/// Whether the skip-wait negative control is on (always false without `negative-controls`).
fn skip_wait_from_env() -> bool {
    cfg!(feature = "negative-controls")
        && std::env::var(SKIP_WAIT_ENV).is_ok_and(|v| v.trim() == "1")
}

impl SplitRank {
    /// Connects this pod's group and starts its engine thread. Blocking: resolves every peer,
    /// connects the link and runs the handshake (each bounded by `opts.connect_timeout`), then
    /// allocates the store of the owned layers. Call from a blocking context, before admitting.
    ///
    /// # Errors
    /// A text reason: a peer never resolved or connected, an owner-map mismatch (refused before
    /// any store is allocated), a store that cannot be allocated.
    pub fn start(
        plan: GroupPlan,
        layout: KvLayout,
        node: Arc<PrefillNode>,
        opts: SplitOptions,
        resolver: &Resolver,
        runtime: &tokio::runtime::Handle,
    ) -> Result<SplitRank, String> {
        let deadline = Instant::now() + opts.connect_timeout;
        let addrs = resolve_peers(&plan, resolver, runtime, deadline)?;
        let listener = TcpListener::bind(SocketAddr::new(
            addrs[plan.cp_rank as usize].ip(),
            plan.port,
        ))
        .or_else(|_| TcpListener::bind(("0.0.0.0", plan.port)))
        .map_err(|e| format!("binding the rank link on port {}: {e}", plan.port))?;
        let link_cfg = TcpLinkConfig {
            connect_timeout: deadline.saturating_duration_since(Instant::now()),
            ..TcpLinkConfig::default()
        };
        let link =
            TcpRankLink::connect(plan.cp_rank, &addrs, listener, plan.map.digest(), link_cfg)
                .map_err(|e| format!("connecting the LayerSplit group: {e}"))?;
        let model = crate::roles::sim::layout_model(layout);
        let chunk_bytes = layout.chunk_bytes() as usize;
        let mut receiver =
            LayerReceiver::new(plan.cp_rank, plan.map.clone(), opts.pool_pages, chunk_bytes);
        // R-LS-1: every rank runs the same owner map before anything is allocated.
        receiver
            .handshake(&link, deadline.saturating_duration_since(Instant::now()))
            .map_err(|e| format!("LayerSplit group handshake: {e}"))?;
        let owners: Vec<u32> = (0..layout.layers)
            .map(|l| plan.map.owner(l))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let owned = plan.map.owned(plan.cp_rank);
        let store = RankKvStore::new(
            plan.cp_rank,
            &model,
            &owned,
            &owners,
            layout.page_tokens,
            opts.pool_pages,
            &Allocator::new(
                format!("layer-split cp{} store", plan.cp_rank),
                MmapBackend::new(),
            ),
        )
        .map_err(|e| format!("allocating the owned-layer store: {e}"))?;
        let skip_wait = skip_wait_from_env();
        if skip_wait {
            tracing::warn!(
                "NEGATIVE CONTROL: LayerSplit ranks attend without waiting on the layer event"
            );
        }
        let spec = GroupSpec {
            model,
            cp_size: plan.cp_size,
            page_tokens: layout.page_tokens,
            pool_pages: opts.pool_pages,
            layout: GroupLayout::Split(plan.map.clone()),
            scope: BroadcastScope::PagesInUse,
            wait: wait_policy(skip_wait),
            indexer_work: opts.indexer_work,
            wait_timeout: opts.wait_timeout,
        };
        let stats = Arc::new(SplitStats::default());
        let stored_kv_bytes = store.stored_bytes();
        let replicated_kv_bytes =
            u64::from(opts.pool_pages) * u64::from(layout.layers) * layout.chunk_bytes();
        let scratch_bytes = receiver.scratch_bytes();
        let (jobs, inbox) = if plan.cp_rank == 0 {
            let (tx, rx) = sync_channel(QUEUE_DEPTH);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let engine = Engine {
            layout,
            spec,
            owners,
            owned,
            link,
            receiver,
            store,
            node,
            stats: stats.clone(),
            next_step: 1,
        };
        std::thread::Builder::new()
            .name(format!("layer-split-cp{}", plan.cp_rank))
            .spawn(move || match inbox {
                Some(inbox) => engine.run_leader(inbox),
                None => engine.run_member(),
            })
            .map_err(|e| format!("starting the LayerSplit engine thread: {e}"))?;
        tracing::info!(cp_rank = plan.cp_rank, cp_size = plan.cp_size, owned = ?plan.map.owned_ranges(plan.cp_rank),
            stored_kv_bytes, replicated_kv_bytes, "LayerSplit group connected");
        Ok(SplitRank {
            plan,
            jobs,
            stats,
            stored_kv_bytes,
            replicated_kv_bytes,
            scratch_bytes,
            skip_wait,
        })
    }

    /// Whether this rank is its group's leader (CP rank 0: the group's room peer).
    pub fn is_leader(&self) -> bool {
        self.plan.cp_rank == 0
    }

    /// This rank's owned layers as one range `start..end` (the hello's `owned_layers`; a
    /// contiguous map, as the operator renders, gives exactly the owned layers).
    pub fn owned_range(&self) -> (u32, u32) {
        let r = self.plan.map.owned_ranges(self.plan.cp_rank);
        (
            r.first().map_or(0, |r| r.start),
            r.last().map_or(0, |r| r.end),
        )
    }

    /// Whether the group's link broke (a peer went away): rooms fail until the pod restarts.
    pub fn broken(&self) -> Option<String> {
        self.stats
            .link_broken
            .load(Ordering::SeqCst)
            .then(|| lock(&self.stats.last_error).clone().unwrap_or_default())
    }

    /// Queues a room for the group (leader only).
    ///
    /// # Errors
    /// A text reason: not the leader, the queue is full, or the engine thread has stopped.
    pub fn submit(&self, job: StepJob) -> Result<(), String> {
        let jobs = self
            .jobs
            .as_ref()
            .ok_or("this rank is not its LayerSplit group's leader")?;
        jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => format!("{QUEUE_DEPTH} rooms already queued for the group"),
            TrySendError::Disconnected(_) => "the LayerSplit engine thread has stopped".into(),
        })
    }

    /// `/report.layer_split`: the rank, its owned layers, `stored_kv_bytes` against
    /// `replicated_kv_bytes` (bytes), the scratch, the broadcast bytes against a whole-layer
    /// broadcast, waits, `corrupt_chunks_read`, KV bytes this rank wrote into decodes.
    pub fn report(&self) -> Value {
        let s = &self.stats;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "cp_rank": self.plan.cp_rank,
            "cp_size": self.plan.cp_size,
            "tp_rank": self.plan.tp_rank,
            "leader": self.is_leader(),
            "owned_layers": self.plan.map.owned_ranges(self.plan.cp_rank)
                .iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            "owner_map_digest": format!("{:016x}", self.plan.map.digest()),
            "stored_kv_bytes": self.stored_kv_bytes,
            "replicated_kv_bytes": self.replicated_kv_bytes,
            "scratch_bytes": self.scratch_bytes,
            "steps": n(&s.steps),
            "step_failures": n(&s.step_failures),
            "frames_sent": n(&s.frames_sent),
            "broadcast_payload_bytes": n(&s.broadcast_payload_bytes),
            "broadcast_frame_bytes": n(&s.broadcast_frame_bytes),
            "whole_layer_broadcast_bytes": n(&s.whole_layer_broadcast_bytes),
            "waits": n(&s.waits),
            "waits_hidden": n(&s.waits_hidden),
            "corrupt_chunks_read": n(&s.corrupt_chunks_read),
            "kv_bytes_written": n(&s.kv_bytes_written),
            "link_broken": s.link_broken.load(Ordering::SeqCst),
            "last_error": *lock(&s.last_error),
            "negative_control_skip_wait": self.skip_wait,
        })
    }
}

fn wait_policy(skip: bool) -> WaitPolicy {
    #[cfg(feature = "negative-controls")]
    if skip {
        return WaitPolicy::UnsafeSkipWait;
    }
    let _ = skip;
    WaitPolicy::Wait
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Resolves every rank's host (a starting pod's name appears once it has an IP), retrying until
/// `deadline`.
fn resolve_peers(
    plan: &GroupPlan,
    resolver: &Resolver,
    runtime: &tokio::runtime::Handle,
    deadline: Instant,
) -> Result<Vec<SocketAddr>, String> {
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; plan.peer_hosts.len()];
    loop {
        for (i, host) in plan.peer_hosts.iter().enumerate() {
            if addrs[i].is_none() {
                let found = runtime.block_on(resolver.lookup(host, plan.port));
                addrs[i] = found.ok().and_then(|a| a.first().copied());
            }
        }
        if addrs.iter().all(Option::is_some) {
            return Ok(addrs.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            let missing: Vec<&str> = plan
                .peer_hosts
                .iter()
                .zip(&addrs)
                .filter(|(_, a)| a.is_none())
                .map(|(h, _)| h.as_str())
                .collect();
            return Err(format!(
                "LayerSplit group peers never resolved: {}",
                missing.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The rank's engine thread: owns the link, the receiver and the store.
struct Engine {
    layout: KvLayout,
    spec: GroupSpec,
    owners: Vec<u32>,
    owned: Vec<u32>,
    link: TcpRankLink,
    receiver: LayerReceiver,
    store: RankKvStore,
    node: Arc<PrefillNode>,
    stats: Arc<SplitStats>,
    next_step: u64,
}

impl Engine {
    /// The leader: one room at a time, until the node drops its sender.
    fn run_leader(mut self, inbox: Receiver<StepJob>) {
        loop {
            match inbox.recv_timeout(Duration::from_millis(500)) {
                Ok(job) => {
                    let ok = self.lead_step(job.key, job.request, job.compute);
                    let _ = job.done.send(ok);
                }
                Err(RecvTimeoutError::Timeout) => self.drain_idle(),
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// A member: runs each `Step` its leader sends, until the link closes.
    fn run_member(mut self) {
        loop {
            match self
                .receiver
                .next_control(&self.link, Duration::from_secs(1))
            {
                Ok(Some(Frame::Step(s))) => self.member_step(s),
                Ok(Some(other)) => tracing::debug!(?other, "unexpected frame at a member; ignored"),
                Ok(None) => {}
                Err(e) => {
                    self.broke(&e);
                    return;
                }
            }
        }
    }

    /// Between rooms at the leader: stray `StepDone`s of steps it gave up on are dropped; a closed
    /// link is noted.
    fn drain_idle(&mut self) {
        match self.receiver.next_control(&self.link, Duration::ZERO) {
            Ok(Some(f)) => tracing::debug!(?f, "stale frame at the leader; dropped"),
            Ok(None) => {}
            Err(e) => self.broke(&e),
        }
    }

    fn broke(&self, e: &LayerSplitError) {
        if !self.stats.link_broken.swap(true, Ordering::SeqCst) {
            tracing::error!(error = %e, "LayerSplit group link broke; rooms fail until restart");
        }
        *lock(&self.stats.last_error) = Some(e.to_string());
    }

    fn note_error(&self, what: String) {
        self.stats.step_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %what, "LayerSplit step failed");
        *lock(&self.stats.last_error) = Some(what);
    }

    /// Folds a step's rank report into the counters.
    fn account(&self, r: &RankReport, pages: u32) {
        let s = &self.stats;
        s.steps.fetch_add(1, Ordering::Relaxed);
        s.frames_sent.fetch_add(r.frames_sent, Ordering::Relaxed);
        s.broadcast_payload_bytes
            .fetch_add(r.broadcast_payload_bytes, Ordering::Relaxed);
        s.broadcast_frame_bytes
            .fetch_add(r.broadcast_frame_bytes, Ordering::Relaxed);
        // What a whole-layer broadcast would have moved: every page of the layer per frame.
        let whole = r.frames_sent * u64::from(self.spec.pool_pages) * self.layout.chunk_bytes();
        let _ = pages;
        s.whole_layer_broadcast_bytes
            .fetch_add(whole, Ordering::Relaxed);
        s.waits.fetch_add(r.waits, Ordering::Relaxed);
        s.waits_hidden.fetch_add(r.waits_hidden, Ordering::Relaxed);
        s.corrupt_chunks_read
            .fetch_add(r.corrupt_chunks_read, Ordering::Relaxed);
    }

    /// Runs step `step` of `request` over `pages` pages; `write(store, pages)` sends the owned
    /// layers while the pages are held.
    fn run_step(
        &mut self,
        step: u64,
        request: u64,
        pages: u32,
        write: impl FnOnce(&RankKvStore, &[crate::memory::pool::PageId]) -> Result<(), LayerSplitError>,
    ) -> Result<(), LayerSplitError> {
        let mut report = RankReport::default();
        let stepper = RankStepper::new(&self.spec, &self.link, &self.store, &self.owners);
        let out = stepper.step_then(
            step,
            &RequestSpec { id: request, pages },
            Some(&mut self.receiver),
            &mut report,
            write,
        );
        self.account(&report, pages);
        if report.corrupt_chunks_read > 0 {
            tracing::error!(
                step,
                request,
                corrupt = report.corrupt_chunks_read,
                "attention read chunks that do not hold their KV"
            );
        }
        out.map(|_| ())
    }

    /// The owned layers of page `page` as `(layer, chunk)` pairs.
    fn owned_chunks(
        store: &RankKvStore,
        owned: &[u32],
        page: crate::memory::pool::PageId,
        chunk_bytes: usize,
    ) -> Result<Vec<(u32, Bytes)>, LayerSplitError> {
        owned
            .iter()
            .map(|layer| {
                let mut buf = vec![0u8; chunk_bytes];
                store.read_chunk(page, *layer, &mut buf)?;
                Ok((*layer, Bytes::from(buf)))
            })
            .collect()
    }

    /// The leader's room (module docs, steps 1–5). Returns whether every part completed.
    fn lead_step(&mut self, key: RoomKey, request: u64, compute: Duration) -> bool {
        let Some((data_addr, region, dst_pages)) = self.node.room_destination(key) else {
            return false; // released meanwhile
        };
        if let Some(e) = self.stats.link_broken.load(Ordering::SeqCst).then(|| {
            lock(&self.stats.last_error)
                .clone()
                .unwrap_or_else(|| "link closed".into())
        }) {
            self.node
                .fail_room(key, &format!("LayerSplit group link broken: {e}"));
            return false;
        }
        if !compute.is_zero() {
            std::thread::sleep(compute);
        }
        let members: Vec<u32> = (1..self.spec.cp_size).collect();
        // 1. one outstanding part per member, before any of them can write.
        let mut waiting = BTreeSet::new();
        for m in &members {
            if self.node.begin_room_part(key).is_err() {
                break;
            }
            waiting.insert(*m);
        }
        if waiting.len() != members.len() {
            // The room failed (an abort) before anything was sent: nothing to wait for.
            for _ in &waiting {
                self.node.end_room_part(key, true, "");
            }
            return false;
        }
        let step = self.next_step;
        self.next_step += 1;
        // 2. the step order.
        let frame = Frame::Step(StepFrame {
            step,
            request,
            room: key.room.0,
            generation: key.generation.0,
            region: region.0,
            dst_pages: dst_pages.clone(),
            data_addr,
        })
        .encode();
        for m in &members {
            if let Err(e) = self.link.send(*m, frame.clone()) {
                waiting.remove(m);
                self.node
                    .end_room_part(key, false, &format!("LayerSplit rank {m}: {e}"));
            }
        }
        // 3–4. the step, then the owned layers into the decode's pages.
        let pages = dst_pages.len() as u32;
        let (node, owned, chunk) = (
            self.node.clone(),
            self.owned.clone(),
            self.layout.chunk_bytes() as usize,
        );
        let mut ok = true;
        let ran = self.run_step(step, request, pages, |store, held| {
            for (k, page) in held.iter().enumerate() {
                let chunks = Self::owned_chunks(store, &owned, *page, chunk)?;
                node.submit_page_writes(key, k as u32, chunks)
                    .map_err(|s| LayerSplitError::Transport {
                        peer: u32::MAX,
                        reason: format!("writing into the decode: {}", s.message()),
                    })?;
            }
            Ok(())
        });
        if let Err(e) = ran {
            ok = false;
            self.note_error(format!("step {step} (request {request}): {e}"));
            self.node
                .fail_room(key, &format!("LayerSplit step {step}: {e}"));
        }
        // 5. every member's part.
        let deadline = Instant::now() + STEP_REPORT_WAIT;
        while !waiting.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.receiver.next_control(&self.link, left) {
                Ok(Some(Frame::StepDone(d))) if d.step == step && waiting.remove(&d.from) => {
                    ok &= d.ok;
                    self.node.end_room_part(key, d.ok, &d.reason);
                }
                Ok(Some(f)) => tracing::debug!(?f, step, "stale frame at the leader; dropped"),
                Ok(None) | Err(_) => {
                    let why = format!(
                        "LayerSplit ranks {waiting:?} did not report step {step} within {} s",
                        STEP_REPORT_WAIT.as_secs()
                    );
                    self.note_error(why.clone());
                    for _ in &waiting {
                        self.node.end_room_part(key, false, &why);
                    }
                    ok = false;
                    break;
                }
            }
        }
        if ok {
            let _ = self.node.finish_room_input(key);
        }
        ok
    }

    /// A member's part of a step: the layer loop, its owned layers into the decode's pages, every
    /// write terminal, then `StepDone` to the leader.
    fn member_step(&mut self, s: StepFrame) {
        let key = RoomKey::new(s.room, s.generation);
        let transport = self.node.transport().clone();
        let (owned, chunk) = (self.owned.clone(), self.layout.chunk_bytes());
        let page_bytes = self.layout.page_bytes();
        let (tx, rx) = std::sync::mpsc::channel::<(bool, u64)>();
        let mut issued = 0usize;
        let (dst, addr, region) = (s.dst_pages.clone(), s.data_addr.clone(), RegionId(s.region));
        let ran = self.run_step(s.step, s.request, dst.len() as u32, |store, held| {
            for (k, page) in held.iter().enumerate() {
                let chunks = Self::owned_chunks(store, &owned, *page, chunk as usize)?;
                let bytes: u64 = chunks.iter().map(|(_, c)| c.len() as u64).sum();
                let ops = chunks
                    .into_iter()
                    .map(|(layer, data)| WriteOp {
                        key,
                        region,
                        offset: u64::from(dst[k]) * page_bytes + u64::from(layer) * chunk,
                        data,
                    })
                    .collect();
                let tx = tx.clone();
                let sink = Arc::new(move |_h, st: &TransferStatus| {
                    let _ = tx.send((*st == TransferStatus::Completed, bytes));
                });
                WriteBatch::new(ops, transport.limits())
                    .and_then(|b| transport.submit(&addr, b, Some(sink)))
                    .map_err(|e| LayerSplitError::Transport {
                        peer: u32::MAX,
                        reason: format!("writing into the decode at {addr}: {e}"),
                    })?;
                issued += 1;
            }
            Ok(())
        });
        let mut done = StepDoneFrame {
            from: self.link.rank(),
            step: s.step,
            ok: true,
            kv_bytes: 0,
            reason: String::new(),
        };
        if let Err(e) = ran {
            done.ok = false;
            done.reason = format!("LayerSplit rank {}: {e}", self.link.rank());
        }
        // Every write issued must be terminal before the leader may let an ack go.
        let deadline = Instant::now() + WRITE_WAIT;
        for _ in 0..issued {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((true, b)) => done.kv_bytes += b,
                Ok((false, _)) => {
                    done.ok = false;
                    if done.reason.is_empty() {
                        done.reason = format!(
                            "LayerSplit rank {}: a write into the decode failed",
                            self.link.rank()
                        );
                    }
                }
                Err(_) => {
                    done.ok = false;
                    done.reason = format!(
                        "LayerSplit rank {}: writes not terminal within {} s",
                        self.link.rank(),
                        WRITE_WAIT.as_secs()
                    );
                    break;
                }
            }
        }
        self.stats
            .kv_bytes_written
            .fetch_add(done.kv_bytes, Ordering::Relaxed);
        if !done.ok {
            self.note_error(done.reason.clone());
        }
        if let Err(e) = self.link.send(0, Frame::StepDone(done).encode()) {
            self.broke(&e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LayerSplit, Parallelism};

    fn cfg(tensor: u32, context: u32) -> WorkerConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("interfaces/samples/decode-worker.json");
        let mut c: WorkerConfig =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        c.parallelism = Parallelism { tensor, context };
        c.layer_split = LayerSplit::contiguous(c.model.layers, context);
        c.ports.rank_link = Some(7002);
        c.peers.group_service = Some("p-peers.ns.svc".into());
        c
    }

    #[test]
    fn a_pod_finds_its_cp_peers_of_the_same_tp_rank_by_pod_dns() {
        // TP 2 × CP 2: ordinal o has tp = o % 2, cp = o / 2; pod p-g1-3 is tp 1, cp 1.
        let p = plan(&cfg(2, 2), "p-g1-3").unwrap().unwrap();
        assert_eq!((p.tp_rank, p.cp_rank, p.cp_size, p.port), (1, 1, 2, 7002));
        assert_eq!(
            p.peer_hosts,
            vec!["p-g1-1.p-peers.ns.svc", "p-g1-3.p-peers.ns.svc"]
        );
        let q = plan(&cfg(1, 4), "p-g0-0").unwrap().unwrap();
        assert_eq!(q.cp_rank, 0);
        assert_eq!(q.peer_hosts.len(), 4);
        assert_eq!(q.peer_hosts[3], "p-g0-3.p-peers.ns.svc");
    }

    #[test]
    fn no_split_or_one_rank_means_no_group_and_bad_setups_are_named() {
        let mut c = cfg(1, 2);
        c.layer_split = None;
        assert_eq!(plan(&c, "p-g0-0"), Ok(None));
        let one = cfg(1, 1);
        assert_eq!(plan(&one, "p-g0-0"), Ok(None));
        let mut c = cfg(1, 2);
        c.ports.rank_link = None;
        assert!(plan(&c, "p-g0-0").unwrap_err().contains("rankLink"));
        let mut c = cfg(1, 2);
        c.peers.group_service = None;
        assert!(plan(&c, "p-g0-0").unwrap_err().contains("groupService"));
        assert!(plan(&cfg(1, 2), "prefill").unwrap_err().contains("ordinal"));
        assert!(plan(&cfg(1, 2), "p-g0-2").unwrap_err().contains("outside"));
    }
}
