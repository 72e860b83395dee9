//! Context-parallel (CP) prefill groups on the built-in engine's serving path, with or without
//! LayerSplit (issue 15; DESIGN contract 6; seed 004 "KV Cache 分层存储 LayerSplit").
//!
//! A prefill pod of a pool with `parallelism.context` C > 1 is one CP rank of a group: the pods of
//! one group StatefulSet (`<sts>-<ordinal>`) with the same TP rank. The group computes each room
//! together, as CP ranks do; with `layerSplit` each rank stores only its owned layers, without it
//! every rank stores every layer (the replicated layout LayerSplit replaces). At start, **before any
//! KV store is allocated**, a rank resolves its peers as `<sts>-<ordinal>.<groupService>`
//! (StatefulSet pod DNS), connects the TCP rank link ([`TcpRankLink`], `ports.rankLink`; its
//! preamble refuses a peer on another owner map, 0 standing for replicated) and runs the hello
//! handshake (R-LS-1). Only then does it allocate its [`RankKvStore`].
//!
//! Rooms. The group's CP rank 0 (the *leader*) is the group's one room peer. Every rank's hello
//! names its place in the group (`PeerInfo.group`), and a decode keeps the other ranks out of its
//! room peers (`DecodeError::GroupMember`); their `OpenRoom` is refused. For each room the
//! leader's engine thread:
//! 1. counts one outstanding *part* per other rank in its sender room table
//!    ([`PrefillNode::begin_room_part`]): no abort ack leaves before every rank's writes are
//!    terminal (DESIGN contract 3);
//! 2. sends the `Step` (room, generation, request, the decode's data address and pages) to every
//!    other rank;
//! 3. runs the step like every rank ([`RankStepper`]): writes the KV of the layers it stores, and
//!    for each layer `i` in order — under LayerSplit the owner broadcasts the chunks of the pages in
//!    use and a non-owner waits on the layer's event — runs the indexer, then attention reads and
//!    verifies the request's chunks of layer `i`;
//! 4. writes its layers of every page into the decode's pages
//!    ([`PrefillNode::submit_page_writes`]; `ChunkDone` per page): under LayerSplit its owned
//!    layers, replicated all of them;
//! 5. takes each rank's `StepDone` (that rank's layers are written into the decode's pages, every
//!    write terminal; none under replication) and ends its part ([`PrefillNode::end_room_part`]).
//!
//! Under LayerSplit the decode so receives each layer range from its owner, and its verification
//! of every chunk covers all of them. Steps run one at a time per group, numbered by the leader, so
//! every rank's store hands a request the same page ids (the broadcast's page list is checked).
//!
//! Capacity (seed 004's token-capacity gain): a LayerSplit rank holds `owned / layers` of each
//! page, so the same host memory per rank caches `layers / max owned` times the pages; the leader's
//! prefix cache is sized so ([`GroupPlan::prefix_cache_pages`]).
//!
//! Reported in `/report.cp_group`: the layout, per-rank KV bytes against the replicated layout's,
//! broadcast bytes against a whole-layer broadcast, waits (and how many the indexer hid), and the
//! chunks attention read that did not hold their KV (`corrupt_chunks_read`, 0 unless the negative
//! control `TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT=1` — feature `negative-controls` — makes
//! LayerSplit ranks attend without waiting, reading another layer's bytes from the scratch).

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
use crate::transfer::{RegionId, TransferStatus, Transport, WriteBatch};

use super::node::{PrefillNode, page_write_ops};

/// Negative control (feature `negative-controls`): `1` makes every rank of a LayerSplit group
/// attend without waiting on the layer's event.
pub const SKIP_WAIT_ENV: &str = "TANDEM_NEGATIVE_LAYER_SPLIT_SKIP_WAIT";

/// Longest the leader waits for a rank's `StepDone` after its own part before it fails the room
/// (a rank's layer waits, [`GroupSpec::wait_timeout`], fit inside). The part itself stays open
/// until its `StepDone` comes, however late: until then that rank's writes may still land.
const STEP_REPORT_WAIT: Duration = Duration::from_secs(120);
/// How often a rank looks a peer's name up again while it has not dialled it.
const RESOLVE_EVERY: Duration = Duration::from_millis(500);
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
    /// The owner map of `layerSplit`; `None`: replicated (every rank stores every layer).
    pub map: Option<OwnerMap>,
    /// Layers of the model.
    pub layers: u32,
    /// Host name of every CP rank of the link, index = CP rank (`<sts>-<ordinal>.<groupService>`).
    pub peer_hosts: Vec<String>,
    /// The rank-link port (every rank listens on it).
    pub port: u16,
}

/// The group plan of a prefill with `cfg` running as pod `pod_name`; `Ok(None)` for a single CP
/// rank (`parallelism.context` 1).
///
/// # Errors
/// A text reason: no `ports.rankLink` or `peers.groupService`, a pod name without an ordinal, an
/// ordinal outside the group, an owner map the layers cannot take.
pub fn plan(cfg: &WorkerConfig, pod_name: &str) -> Result<Option<GroupPlan>, String> {
    let (tensor, cp_size) = (cfg.parallelism.tensor.max(1), cfg.parallelism.context);
    if cp_size <= 1 {
        return Ok(None);
    }
    let port = cfg
        .ports
        .rank_link
        .ok_or("a CP group needs ports.rankLink (the rank link's port)")?;
    let service = cfg
        .peers
        .group_service
        .as_deref()
        .ok_or("a CP group needs peers.groupService (where the group's pods are named)")?;
    let (set, ordinal) = pod_name
        .rsplit_once('-')
        .and_then(|(set, n)| Some((set, n.parse::<u32>().ok()?)))
        .ok_or_else(|| format!("pod name {pod_name:?} has no -<ordinal> suffix"))?;
    let (tp_rank, cp_rank) = cfg.parallelism.ranks_of(ordinal).ok_or_else(|| {
        format!("ordinal {ordinal} is outside a group of {tensor} × {cp_size} ranks")
    })?;
    let map = cfg
        .layer_split
        .as_ref()
        .map(|ls| OwnerMap::new(ls, cp_size))
        .transpose()
        .map_err(|e| e.to_string())?;
    let peer_hosts = (0..cp_size)
        .map(|cp| format!("{set}-{}.{service}", cp * tensor + tp_rank))
        .collect();
    Ok(Some(GroupPlan {
        cp_rank,
        cp_size,
        tp_rank,
        map,
        layers: cfg.model.layers,
        peer_hosts,
        port,
    }))
}

impl GroupPlan {
    /// Whether the group splits layers (LayerSplit).
    pub fn layer_split(&self) -> bool {
        self.map.is_some()
    }

    /// The layers this rank stores, in order.
    pub fn stored_layers(&self) -> Vec<u32> {
        match &self.map {
            Some(m) => m.owned(self.cp_rank),
            None => (0..self.layers).collect(),
        }
    }

    /// The layers this rank writes into a decode's pages: its owned layers under LayerSplit; all
    /// of them at the leader of a replicated group, none at its other ranks.
    pub fn written_layers(&self) -> Vec<u32> {
        match &self.map {
            Some(m) => m.owned(self.cp_rank),
            None if self.cp_rank == 0 => (0..self.layers).collect(),
            None => Vec::new(),
        }
    }

    /// This rank's stored layers as one range `start..end` (the hello's `owned_layers`; a
    /// contiguous map, as the operator renders, gives exactly the owned layers).
    pub fn owned_range(&self) -> (u32, u32) {
        match &self.map {
            Some(m) => {
                let r = m.owned_ranges(self.cp_rank);
                (
                    r.first().map_or(0, |r| r.start),
                    r.last().map_or(0, |r| r.end),
                )
            }
            None => (0, self.layers),
        }
    }

    /// Pages the group's prefix cache holds when one rank's host pool holds `replicated` whole
    /// pages: under LayerSplit a rank holds `owned / layers` of each page, so the same memory
    /// holds `layers / max owned` times as many (seed 004's token-capacity gain; the largest
    /// share bounds it). `replicated` unchanged without LayerSplit.
    pub fn prefix_cache_pages(&self, replicated: usize) -> usize {
        let Some(m) = &self.map else {
            return replicated;
        };
        let most = (0..self.cp_size)
            .map(|r| m.owned(r).len())
            .max()
            .unwrap_or(1)
            .max(1);
        replicated.saturating_mul(self.layers as usize) / most
    }
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
struct GroupStats {
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
    /// The engine thread has returned (its link dropped with it).
    engine_exited: AtomicBool,
    last_error: Mutex<Option<String>>,
}

/// This pod's rank of a CP group, connected, with its engine thread running.
pub struct GroupRank {
    plan: GroupPlan,
    jobs: Option<SyncSender<StepJob>>,
    stats: Arc<GroupStats>,
    stored_kv_bytes: u64,
    replicated_kv_bytes: u64,
    scratch_bytes: u64,
    skip_wait: bool,
    prefix_cache_pages: (usize, usize),
    broken_rx: tokio::sync::watch::Receiver<Option<String>>,
}

/// Knobs of [`GroupRank::start`].
#[derive(Debug, Clone, Copy)]
pub struct GroupOptions {
    /// Pages of the rank's store (the replicated pool's page count: under LayerSplit the bytes
    /// shrink, the pages do not).
    pub pool_pages: u32,
    /// Deadline of the group's connect and handshake.
    pub connect_timeout: Duration,
    /// Deadline of each layer wait.
    pub wait_timeout: Duration,
    /// Indexer work rounds per layer (what a broadcast hides behind).
    pub indexer_work: u32,
    /// Pages of the leader's prefix cache ([`GroupPlan::prefix_cache_pages`]) and of a
    /// replicated rank's, for the report.
    pub prefix_cache_pages: (usize, usize),
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            pool_pages: 64,
            connect_timeout: Duration::from_secs(120),
            wait_timeout: Duration::from_secs(30),
            indexer_work: 64,
            prefix_cache_pages: (0, 0),
        }
    }
}

/// Whether the skip-wait negative control is on (always false without `negative-controls`).
fn skip_wait_from_env() -> bool {
    cfg!(feature = "negative-controls")
        && std::env::var(SKIP_WAIT_ENV).is_ok_and(|v| v.trim() == "1")
}

impl GroupRank {
    /// Connects this pod's group and starts its engine thread. Blocking: resolves every peer,
    /// connects the link and runs the handshake (each bounded by `opts.connect_timeout`), then
    /// allocates the store of the layers this rank keeps. Call from a blocking context, before
    /// admitting.
    ///
    /// # Errors
    /// A text reason: a peer never resolved or connected, an owner-map mismatch (refused before
    /// any store is allocated), a store that cannot be allocated.
    pub fn start(
        plan: GroupPlan,
        layout: KvLayout,
        node: Arc<PrefillNode>,
        opts: GroupOptions,
        resolver: &Resolver,
        runtime: &tokio::runtime::Handle,
    ) -> Result<GroupRank, String> {
        let chunk_bytes = layout.chunk_bytes() as usize;
        let (link, receiver) = connect(
            &plan,
            resolver,
            runtime,
            opts.connect_timeout,
            opts.pool_pages,
            chunk_bytes,
        )?;
        let model = crate::roles::sim::layout_model(layout);
        let owners: Vec<u32> = match &plan.map {
            Some(m) => (0..layout.layers)
                .map(|l| m.owner(l))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?,
            None => vec![plan.cp_rank; layout.layers as usize],
        };
        let stored = plan.stored_layers();
        let store = RankKvStore::new(
            plan.cp_rank,
            &model,
            &stored,
            &owners,
            layout.page_tokens,
            opts.pool_pages,
            &Allocator::new(format!("cp{} KV store", plan.cp_rank), MmapBackend::new()),
        )
        .map_err(|e| format!("allocating the rank's KV store: {e}"))?;
        let skip_wait = plan.layer_split() && skip_wait_from_env();
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
            layout: match &plan.map {
                Some(m) => GroupLayout::Split(m.clone()),
                None => GroupLayout::Replicated,
            },
            scope: BroadcastScope::PagesInUse,
            wait: wait_policy(skip_wait),
            indexer_work: opts.indexer_work,
            wait_timeout: opts.wait_timeout,
        };
        let stats = Arc::new(GroupStats::default());
        let (broken_tx, broken_rx) = tokio::sync::watch::channel(None);
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
            written: plan.written_layers(),
            split: plan.layer_split(),
            link,
            receiver,
            store,
            node,
            stats: stats.clone(),
            broken: broken_tx,
            next_step: 1,
            open_parts: std::collections::BTreeMap::new(),
            unfinished: Vec::new(),
        };
        let exited = stats.clone();
        std::thread::Builder::new()
            .name(format!("cp-group-rank{}", plan.cp_rank))
            .spawn(move || {
                match inbox {
                    Some(inbox) => engine.run_leader(inbox),
                    None => engine.run_member(),
                }
                exited.engine_exited.store(true, Ordering::SeqCst);
            })
            .map_err(|e| format!("starting the CP group's engine thread: {e}"))?;
        tracing::info!(cp_rank = plan.cp_rank, cp_size = plan.cp_size, layer_split = plan.layer_split(),
            stored = ?plan.owned_range(), stored_kv_bytes, replicated_kv_bytes, "CP group connected");
        Ok(GroupRank {
            plan,
            jobs,
            stats,
            stored_kv_bytes,
            replicated_kv_bytes,
            scratch_bytes,
            skip_wait,
            prefix_cache_pages: opts.prefix_cache_pages,
            broken_rx,
        })
    }

    /// Whether this rank is its group's leader (CP rank 0: the group's room peer).
    pub fn is_leader(&self) -> bool {
        self.plan.cp_rank == 0
    }

    /// This rank's place in its group.
    pub fn plan(&self) -> &GroupPlan {
        &self.plan
    }

    /// Resolves with the reason once the group breaks (a peer's rank link closed): a group
    /// cannot run a step without every rank, and a rank that restarted can only rejoin a group
    /// whose ranks all connect anew, so the server stops the worker (the pod restarts).
    pub async fn broken_signal(&self) -> String {
        let mut rx = self.broken_rx.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone().unwrap_or_default(),
            // The engine thread is gone without a reason: treat as broken.
            Err(_) => "the CP group's engine thread stopped".into(),
        }
    }

    /// Teardown of a rank other than the leader (blocking): it keeps running its leader's steps
    /// — the leader's rooms drain through them — until the leader leaves the group (its link
    /// closes: the engine thread sends its last `StepDone`s and returns) or `deadline`. Returns
    /// whether the engine thread ended in time. The leader returns at once: its rooms drain
    /// through the server's own drain.
    pub fn drain_member(&self, deadline: Instant) -> bool {
        if self.is_leader() {
            return true;
        }
        while !self.stats.engine_exited.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stats.engine_exited.load(Ordering::SeqCst)
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
            .ok_or("this rank is not its CP group's leader")?;
        jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => format!("{QUEUE_DEPTH} rooms already queued for the group"),
            TrySendError::Disconnected(_) => "the CP group's engine thread has stopped".into(),
        })
    }

    /// `/report.cp_group`: the rank, the layout (`layer_split` or `replicated`), its stored
    /// layers, `stored_kv_bytes` against `replicated_kv_bytes` (bytes), the scratch, the
    /// broadcast bytes against a whole-layer broadcast, waits, `corrupt_chunks_read`, and the KV
    /// bytes a non-leader rank wrote into decodes (the leader's are the `kv_bytes_sent` counter).
    pub fn report(&self) -> Value {
        let s = &self.stats;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "cp_rank": self.plan.cp_rank,
            "cp_size": self.plan.cp_size,
            "tp_rank": self.plan.tp_rank,
            "leader": self.is_leader(),
            "layout": if self.plan.layer_split() { "layer_split" } else { "replicated" },
            "owned_layers": match &self.plan.map {
                Some(m) => m.owned_ranges(self.plan.cp_rank)
                    .iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
                None => vec![[0, self.plan.layers]],
            },
            "owner_map_digest": format!("{:016x}", self.plan.map.as_ref().map_or(0, OwnerMap::digest)),
            "stored_kv_bytes": self.stored_kv_bytes,
            "replicated_kv_bytes": self.replicated_kv_bytes,
            "scratch_bytes": self.scratch_bytes,
            "prefix_cache_pages": self.prefix_cache_pages.0,
            "replicated_prefix_cache_pages": self.prefix_cache_pages.1,
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

/// Connects `plan`'s rank link and runs the owner-map handshake (R-LS-1), both within
/// `connect_timeout`: resolves every rank's pod name, listens on the rank-link port, dials the
/// peers (looking a name up again while it is not dialled) and exchanges hellos. Returns the link
/// and a receiver whose scratch holds one layer of `pool_pages` chunks of `chunk_bytes` (no
/// scratch when replicated). Blocking: call it before anything is allocated. Shared by the
/// built-in engine's groups and the engine path's ([`super::cp_engine`]).
///
/// # Errors
/// A text reason: a peer never resolved or connected, the port cannot be bound, an owner-map
/// mismatch (refused before any frame).
pub fn connect(
    plan: &GroupPlan,
    resolver: &Resolver,
    runtime: &tokio::runtime::Handle,
    connect_timeout: Duration,
    pool_pages: u32,
    chunk_bytes: usize,
) -> Result<(TcpRankLink, LayerReceiver), String> {
    let deadline = Instant::now() + connect_timeout;
    let addrs = resolve_peers(plan, resolver, runtime, deadline)?;
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
    let digest = plan.map.as_ref().map_or(0, OwnerMap::digest);
    // Each peer's name is looked up again (at most every RESOLVE_EVERY) until it is dialled:
    // a restarted pod's name may still point at the pod it replaces while that one drains.
    let mut known: Vec<(Option<SocketAddr>, Instant)> =
        addrs.iter().map(|a| (Some(*a), Instant::now())).collect();
    let dial = |peer: u32| {
        let (addr, at) = known.get_mut(peer as usize)?;
        if at.elapsed() >= RESOLVE_EVERY {
            let host = &plan.peer_hosts[peer as usize];
            *addr = runtime
                .block_on(resolver.lookup(host, plan.port))
                .ok()
                .and_then(|a| a.first().copied())
                .or(*addr);
            *at = Instant::now();
        }
        *addr
    };
    let link =
        TcpRankLink::connect_with(plan.cp_rank, plan.cp_size, dial, listener, digest, link_cfg)
            .map_err(|e| format!("connecting the CP group: {e}"))?;
    let mut receiver = match &plan.map {
        Some(m) => LayerReceiver::new(plan.cp_rank, m.clone(), pool_pages, chunk_bytes),
        None => LayerReceiver::replicated(plan.cp_rank, plan.cp_size),
    };
    // R-LS-1: every rank runs the same owner map before anything is allocated.
    receiver
        .handshake(&link, deadline.saturating_duration_since(Instant::now()))
        .map_err(|e| format!("CP group handshake: {e}"))?;
    Ok((link, receiver))
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
                "CP group peers never resolved: {}",
                missing.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A member's step whose writes into the decode are not all terminal yet: its `StepDone` leaves
/// once they are (DESIGN contract 3: the leader's part stays open until then).
struct Unfinished {
    done: StepDoneFrame,
    /// Write outcomes `(completed, bytes)`, one per batch issued.
    outcomes: std::sync::mpsc::Receiver<(bool, u64)>,
    left: usize,
}

/// The rank's engine thread: owns the link, the receiver and the store.
struct Engine {
    layout: KvLayout,
    spec: GroupSpec,
    owners: Vec<u32>,
    /// The layers this rank writes into a decode's pages ([`GroupPlan::written_layers`]).
    written: Vec<u32>,
    /// LayerSplit (the receiver takes layer frames) or replicated.
    split: bool,
    link: TcpRankLink,
    receiver: LayerReceiver,
    store: RankKvStore,
    node: Arc<PrefillNode>,
    stats: Arc<GroupStats>,
    broken: tokio::sync::watch::Sender<Option<String>>,
    next_step: u64,
    /// Leader: the parts still open per step — the room and the ranks whose `StepDone` has not
    /// come. A part closes only on its `StepDone`, however late.
    open_parts: std::collections::BTreeMap<u64, (RoomKey, BTreeSet<u32>)>,
    /// Member: steps whose writes are still in flight.
    unfinished: Vec<Unfinished>,
}

/// How long an idle engine thread waits for its next frame or room before it looks at the link.
const IDLE_POLL: Duration = Duration::from_millis(50);

impl Engine {
    /// The leader: one room at a time, until the node drops its sender or the group breaks.
    fn run_leader(mut self, inbox: Receiver<StepJob>) {
        loop {
            if self.check_link().is_err() {
                // Rooms still queued fail at once: the group cannot run them.
                while let Ok(job) = inbox.try_recv() {
                    self.node
                        .fail_room(job.key, "the CP group is broken; restarting");
                    let _ = job.done.send(false);
                }
            }
            match inbox.recv_timeout(IDLE_POLL) {
                Ok(job) => {
                    let ok = self.lead_step(job.key, job.request, job.compute);
                    let _ = job.done.send(ok);
                }
                Err(RecvTimeoutError::Timeout) => self.take_control(Duration::ZERO),
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// A member: runs each `Step` its leader sends, and reports each once its writes are
    /// terminal, until the group breaks.
    fn run_member(mut self) {
        loop {
            self.report_finished();
            if self.check_link().is_err() {
                if self.unfinished.is_empty() {
                    return;
                }
                // Broken, writes still in flight: wait for them (nothing else will come).
                std::thread::sleep(IDLE_POLL);
                continue;
            }
            // While writes are in flight, look for their outcomes often: the leader's step
            // waits on this rank's StepDone.
            let wait = if self.unfinished.is_empty() {
                IDLE_POLL
            } else {
                Duration::from_millis(2)
            };
            match self.receiver.next_control(&self.link, wait) {
                Ok(Some(Frame::Step(s))) => self.member_step(s),
                Ok(Some(other)) => tracing::debug!(?other, "unexpected frame at a member; ignored"),
                Ok(None) => {}
                Err(e) => self.frame_error(&e),
            }
        }
    }

    /// Whether every peer of the group is still connected; the first time one is not, the group
    /// is broken: reported (the server stops and restarts the pod, so the group re-forms).
    fn check_link(&self) -> Result<(), ()> {
        let closed = self.link.closed_peers();
        if closed.is_empty() && !self.stats.link_broken.load(Ordering::SeqCst) {
            return Ok(());
        }
        if !closed.is_empty() {
            self.broke(&format!("CP ranks {closed:?} closed their rank link"));
        }
        Err(())
    }

    /// A frame error: a closed link breaks the group; a malformed or unexpected frame is logged
    /// and dropped (a peer's bug must not stop this rank).
    fn frame_error(&self, e: &LayerSplitError) {
        match e {
            LayerSplitError::Transport { .. } => self.broke(&e.to_string()),
            _ => tracing::warn!(error = %e, "bad frame on the rank link; dropped"),
        }
    }

    fn broke(&self, why: &str) {
        if !self.stats.link_broken.swap(true, Ordering::SeqCst) {
            tracing::error!(error = %why, "CP group broken; rooms fail until the group re-forms");
            *lock(&self.stats.last_error) = Some(why.to_owned());
            let _ = self.broken.send(Some(why.to_owned()));
        }
    }

    /// Leader: takes the control frames that have come within `wait`, closing the parts their
    /// `StepDone` report.
    fn take_control(&mut self, wait: Duration) {
        match self.receiver.next_control(&self.link, wait) {
            Ok(Some(Frame::StepDone(d))) => self.part_done(d),
            Ok(Some(f)) => tracing::debug!(?f, "unexpected frame at the leader; dropped"),
            Ok(None) => {}
            Err(e) => self.frame_error(&e),
        }
    }

    /// Leader: a rank's part of a step is terminal.
    fn part_done(&mut self, d: StepDoneFrame) {
        let Some((key, waiting)) = self.open_parts.get_mut(&d.step) else {
            tracing::debug!(
                step = d.step,
                from = d.from,
                "StepDone of no open part; dropped"
            );
            return;
        };
        let key = *key;
        if !waiting.remove(&d.from) {
            return;
        }
        if waiting.is_empty() {
            self.open_parts.remove(&d.step);
        }
        if !d.ok {
            self.note_error(d.reason.clone());
        }
        self.node.end_room_part(key, d.ok, &d.reason);
    }

    fn note_error(&self, what: String) {
        self.stats.step_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %what, "CP group step failed");
        *lock(&self.stats.last_error) = Some(what);
    }

    /// Folds a step's rank report into the counters.
    fn account(&self, r: &RankReport) {
        let s = &self.stats;
        s.steps.fetch_add(1, Ordering::Relaxed);
        s.frames_sent.fetch_add(r.frames_sent, Ordering::Relaxed);
        s.broadcast_payload_bytes
            .fetch_add(r.broadcast_payload_bytes, Ordering::Relaxed);
        s.broadcast_frame_bytes
            .fetch_add(r.broadcast_frame_bytes, Ordering::Relaxed);
        // What a whole-layer broadcast would have moved: every page of the layer per frame.
        let whole = r.frames_sent * u64::from(self.spec.pool_pages) * self.layout.chunk_bytes();
        s.whole_layer_broadcast_bytes
            .fetch_add(whole, Ordering::Relaxed);
        s.waits.fetch_add(r.waits, Ordering::Relaxed);
        s.waits_hidden.fetch_add(r.waits_hidden, Ordering::Relaxed);
        s.corrupt_chunks_read
            .fetch_add(r.corrupt_chunks_read, Ordering::Relaxed);
    }

    /// Runs step `step` of `request` over `pages` pages; `write(store, pages)` sends this rank's
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
            self.split.then_some(&mut self.receiver),
            &mut report,
            write,
        );
        self.account(&report);
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

    /// Layers `layers` of page `page` as `(layer, chunk)` pairs.
    fn layer_chunks(
        store: &RankKvStore,
        layers: &[u32],
        page: crate::memory::pool::PageId,
        chunk_bytes: usize,
    ) -> Result<Vec<(u32, Bytes)>, LayerSplitError> {
        layers
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
        if self.check_link().is_err() {
            self.node
                .fail_room(key, "the CP group is broken; restarting");
            return false;
        }
        if !self.node.room_open(key) {
            return false; // aborted while it queued: no compute spent on it
        }
        if !compute.is_zero() {
            std::thread::sleep(compute);
        }
        let members: Vec<u32> = (1..self.spec.cp_size).collect();
        // 1. one outstanding part per member, before any of them can write.
        let mut claimed = BTreeSet::new();
        for m in &members {
            if self.node.begin_room_part(key).is_err() {
                break;
            }
            claimed.insert(*m);
        }
        if claimed.len() != members.len() {
            // The room failed (an abort) before anything was sent: nothing to wait for.
            for _ in &claimed {
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
        let mut unsent = Vec::new();
        for m in &members {
            if let Err(e) = self.link.send(*m, frame.clone()) {
                // The Step never left: that rank writes nothing for it.
                claimed.remove(m);
                self.node
                    .end_room_part(key, false, &format!("CP rank {m}: {e}"));
                unsent.push(*m);
            }
        }
        if !claimed.is_empty() {
            self.open_parts.insert(step, (key, claimed));
        }
        if !unsent.is_empty() {
            // A rank without the step: the group cannot run it (nor any other).
            self.broke(&format!("the step order did not reach CP ranks {unsent:?}"));
            self.node
                .fail_room(key, "the CP group is broken; restarting");
            return false;
        }
        let mut ok = true;
        // 3–4. the step, then this rank's layers into the decode's pages.
        let pages = dst_pages.len() as u32;
        let (node, layers, chunk) = (
            self.node.clone(),
            self.written.clone(),
            self.layout.chunk_bytes() as usize,
        );
        let ran = self.run_step(step, request, pages, |store, held| {
            for (k, page) in held.iter().enumerate() {
                let chunks = Self::layer_chunks(store, &layers, *page, chunk)?;
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
                .fail_room(key, &format!("CP group step {step}: {e}"));
        }
        // 5. every member's part, bounded: a part still open at the deadline stays open (its
        // writes may still land; the room's ack waits for its StepDone, however late), and the
        // room fails so that its decode stops waiting.
        let deadline = Instant::now() + STEP_REPORT_WAIT;
        while self.open_parts.contains_key(&step) && !self.stats.link_broken.load(Ordering::SeqCst)
        {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = format!(
                    "CP ranks {:?} did not report step {step} within {} s",
                    self.open_parts.get(&step).map(|(_, w)| w.clone()),
                    STEP_REPORT_WAIT.as_secs()
                );
                self.note_error(why.clone());
                self.node.fail_room(key, &why);
                return false;
            }
            self.take_control(left.min(IDLE_POLL));
            let _ = self.check_link();
        }
        if self.open_parts.contains_key(&step) {
            self.node
                .fail_room(key, "the CP group broke during the step; restarting");
            return false;
        }
        if ok {
            ok = self.node.finish_room_input(key).is_ok();
        }
        ok
    }

    /// A member's part of a step: the layer loop, its layers into the decode's pages; the
    /// `StepDone` leaves once every write is terminal ([`Engine::report_finished`]).
    fn member_step(&mut self, s: StepFrame) {
        let key = RoomKey::new(s.room, s.generation);
        let transport = self.node.transport().clone();
        let (layers, chunk) = (self.written.clone(), self.layout.chunk_bytes());
        let layout = self.layout;
        let (tx, outcomes) = std::sync::mpsc::channel::<(bool, u64)>();
        let mut issued = 0usize;
        let (dst, addr, region) = (s.dst_pages.clone(), s.data_addr.clone(), RegionId(s.region));
        let ran = self.run_step(s.step, s.request, dst.len() as u32, |store, held| {
            // A replicated group's other ranks write nothing: the leader sends whole pages.
            let held = if layers.is_empty() { &[][..] } else { held };
            for (k, page) in held.iter().enumerate() {
                let Some(dst_page) = dst.get(k) else {
                    return Err(LayerSplitError::BadFrame(format!(
                        "step {}: page {k} has no destination",
                        s.step
                    )));
                };
                let chunks = Self::layer_chunks(store, &layers, *page, chunk as usize)?;
                let (ops, bytes) = page_write_ops(layout, key, region, *dst_page, chunks);
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
            done.reason = format!("CP rank {}: {e}", self.link.rank());
        }
        self.unfinished.push(Unfinished {
            done,
            outcomes,
            left: issued,
        });
        self.report_finished();
    }

    /// Member: sends the `StepDone` of every step whose writes are all terminal (a step whose
    /// write hangs holds back no other step's report).
    fn report_finished(&mut self) {
        let rank = self.link.rank();
        for u in &mut self.unfinished {
            while u.left > 0 {
                match u.outcomes.try_recv() {
                    Ok((ok, bytes)) => {
                        u.left -= 1;
                        if ok {
                            u.done.kv_bytes += bytes;
                        } else if u.done.ok {
                            u.done.ok = false;
                            u.done.reason =
                                format!("CP rank {rank}: a write into the decode failed");
                        }
                    }
                    Err(_) => break,
                }
            }
        }
        let (finished, still): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unfinished)
            .into_iter()
            .partition(|u| u.left == 0);
        self.unfinished = still;
        for u in finished {
            self.stats
                .kv_bytes_written
                .fetch_add(u.done.kv_bytes, Ordering::Relaxed);
            if !u.done.ok {
                self.note_error(u.done.reason.clone());
            }
            if let Err(e) = self.link.send(0, Frame::StepDone(u.done).encode()) {
                self.broke(&e.to_string());
            }
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
    fn one_rank_means_no_group_and_bad_setups_are_named() {
        assert_eq!(plan(&cfg(1, 1), "p-g0-0"), Ok(None));
        let mut c = cfg(1, 2);
        c.ports.rank_link = None;
        assert!(plan(&c, "p-g0-0").unwrap_err().contains("rankLink"));
        let mut c = cfg(1, 2);
        c.peers.group_service = None;
        assert!(plan(&c, "p-g0-0").unwrap_err().contains("groupService"));
        assert!(plan(&cfg(1, 2), "prefill").unwrap_err().contains("ordinal"));
        assert!(plan(&cfg(1, 2), "p-g0-2").unwrap_err().contains("outside"));
    }

    #[test]
    fn a_replicated_group_stores_everything_and_only_its_leader_writes() {
        let mut c = cfg(1, 4);
        c.layer_split = None;
        let leader = plan(&c, "p-g0-0").unwrap().unwrap();
        let member = plan(&c, "p-g0-2").unwrap().unwrap();
        assert!(!leader.layer_split());
        assert_eq!(member.stored_layers().len(), c.model.layers as usize);
        assert_eq!(leader.written_layers().len(), c.model.layers as usize);
        assert!(member.written_layers().is_empty());
        assert_eq!(member.owned_range(), (0, c.model.layers));
        assert_eq!(leader.prefix_cache_pages(100), 100);
    }

    #[test]
    fn under_layer_split_each_rank_writes_what_it_owns_and_the_cache_grows() {
        // 80 layers over CP 4: 20 each, so the same memory caches 4 × the pages.
        let c = cfg(1, 4);
        assert_eq!(c.model.layers, 80);
        let ranks: Vec<GroupPlan> = (0..4)
            .map(|o| plan(&c, &format!("p-g0-{o}")).unwrap().unwrap())
            .collect();
        let mut all: Vec<u32> = ranks.iter().flat_map(GroupPlan::written_layers).collect();
        all.sort_unstable();
        assert_eq!(all, (0..80).collect::<Vec<_>>(), "each layer written once");
        for r in &ranks {
            assert_eq!(r.stored_layers(), r.written_layers());
            assert_eq!(r.prefix_cache_pages(100), 400);
        }
        assert_eq!(ranks[1].owned_range(), (20, 40));
        // An uneven split is bounded by the largest share: 61 layers over 4 → 16 at most.
        let mut c = cfg(1, 4);
        c.model.layers = 61;
        c.layer_split = LayerSplit::contiguous(61, 4);
        let p = plan(&c, "p-g0-0").unwrap().unwrap();
        assert_eq!(p.prefix_cache_pages(160), 160 * 61 / 16);
    }
}
