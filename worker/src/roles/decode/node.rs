//! The decode worker's side of KV transfer: the KV region and its TCP receiver, rooms on prefill peers,
//! and the release gate that decides every page's fate (DESIGN contract 3).
//!
//! A transfer allocates pages, opens the room on the receiver (only this generation's writes land),
//! asks the prefill peer to open it, and waits with a deadline. Whatever ends a room early — the
//! deadline (seed 004: prefill queueing), a prefill-reported failure, the signal stream breaking or
//! heartbeats stopping — takes the same path: [`ReceiverRoom::fail`], ABORT to the prefill rank, and
//! pages kept until every ack arrives or the transport proves nothing can land (the receiver fence,
//! when enabled). Past the ack deadline without proof the pages are quarantined with an alarm.
//!
//! A completed room stays open on the node: its pages are held by a [`KvLease`] while the request
//! decodes (the KV must stay resident while decoding reads it), and return when the lease finishes,
//! is dropped, or is aborted through the gate (e.g. by the spec guard, DESIGN contract 8). A prefill
//! peer dying after its writes concluded does not touch such a room.
//!
//! **Ownership of pages (no leak by cancellation).** Pages leave the free list only in one critical
//! section that also records the room and creates its owner, a private `RoomGuard`; nothing else
//! ever holds a room's pages. The guard lives in the transfer future, then inside the [`KvLease`].
//! Every way a request ends goes through it exactly once: finished ([`KvLease::finish`]), failed or
//! timed out (the gate, with the cause), aborted ([`KvLease::abort`]), or — the guard dropped without
//! an ending because the future holding it was dropped at any await point (a client that hung up
//! while its prompt was in prefill) — abandoned: its `Drop` fails the room through the same gate
//! with [`FailureCause::ClientAbort`] and counts it in [`RoomTally::abandoned`]. A `Drop` cannot
//! await, so [`DecodeNode::fail`] never awaits nor needs a runtime: its state change and ABORT are
//! synchronous, and the waiting (receiver fence, ack deadline) is handed over a channel to the gate
//! task the node started, which outlives every request. [`DecodeNode::stranded`] is the independent
//! check: pages of a room whose guard is gone and that the gate is not releasing (a leak this design
//! rules out; the decode's readiness turns false on it).
//!
//! With an engine beside the worker (`config.engine`), the rooms of that engine's Reserves are
//! [`engine_rooms`]: they open on the same peers and land through the same TCP receiver, into the
//! engine's pool, and their pages are decided by the engine API's release gate; this module routes
//! their peer signals, peer losses and heartbeats there.

pub mod engine_rooms;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::engine::verify_chunk;
use crate::release::quarantine::Quarantine;
use crate::release::receiver::{
    AckOutcome, FailureCause, GateMode, GateVerdict, ReceiverRoom, ReceiverState,
};
use crate::release::{DecodeRank, PrefillRank, RoomKey};
use crate::transfer::tcp::{GenerationCheck, TcpReceiver};
use crate::transfer::{HostRegion, RegionId};

use crate::control::pb::transfer_client::TransferClient;
use crate::control::pb::{self, peer_message::Body};
use crate::control::{
    INCARNATION_HEADER, KvLayout, REVISION_HEADER, WORKER_ID_HEADER, incarnation_changed, room_of,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The region id decode registers its KV pages under.
pub const KV_REGION: RegionId = RegionId(0);

/// Decode worker configuration.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// Worker id (signal-stream identity).
    pub worker_id: String,
    /// Decode rank.
    pub rank: u32,
    /// Pages in the KV region.
    pub pages: u32,
    /// KV layout (must match the prefill peers').
    pub layout: KvLayout,
    /// Where the TCP receiver binds (e.g. `127.0.0.1:0`).
    pub data_bind: String,
    /// How long a failed room waits for acks or proof before its pages are quarantined.
    pub ack_timeout: Duration,
    /// Heartbeat interval on each signal stream; a peer silent for 3 intervals is dead.
    pub heartbeat: Duration,
    /// Use the TCP receiver fence as transport proof. Derive it from the transport that delivers the
    /// KV with [`crate::transfer::select::receiver_fence_is_proof`]: true for TCP only; under RDMA
    /// (no receiver-side check of one-sided writes) the gate must rely on acks or QP teardown.
    pub fence_is_proof: bool,
    /// Release gate mode (`GateMode::UnsafeBypass` only as a negative control, feature
    /// `negative-controls`).
    pub gate: GateMode,
}

/// Errors of the decode side.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not enough free pages for the request.
    #[error("need {need} pages, {free} free")]
    NoPages {
        /// Pages needed.
        need: usize,
        /// Pages free.
        free: usize,
    },
    /// The prefill peer could not be reached or refused.
    #[error("prefill peer {peer}: {message}")]
    Peer {
        /// Peer address.
        peer: String,
        /// What failed.
        message: String,
    },
    /// The prefill peer belongs to another pool revision (DESIGN §5): refused by either side in
    /// the hello; the peer must be skipped, never paired.
    #[error("prefill peer {peer} has revision {theirs:?}, this decode has {ours:?}")]
    RevisionMismatch {
        /// Peer address.
        peer: String,
        /// This decode's revision.
        ours: String,
        /// The peer's revision (from its hello, or from its refusal's metadata; empty if unknown).
        theirs: String,
    },
    /// The peer is a CP rank of a prefill group other than its leader (its hello's `group`): it
    /// writes its part of a room's KV into this decode's pages when its leader orders it, but
    /// takes no room itself; rooms go to the group's leader, CP rank 0 (issue 15).
    #[error(
        "prefill peer {peer} is CP rank {cp_rank} of a group of {cp_size}; rooms go to CP rank 0"
    )]
    GroupMember {
        /// Peer address.
        peer: String,
        /// Its CP rank (not 0).
        cp_rank: u32,
        /// Its group's CP size.
        cp_size: u32,
    },
    /// The prompt needs more pages than the region has in total: it can never be served here
    /// (retrying cannot help, unlike [`DecodeError::NoPages`]); the transfer never started.
    #[error("need {need} pages, the region has {total}")]
    TooLarge {
        /// Pages needed.
        need: usize,
        /// Pages of the whole region.
        total: usize,
    },
    /// The data receiver could not start.
    #[error("data receiver: {0}")]
    Receiver(#[from] std::io::Error),
    /// [`DecodeNode::start`] was called outside a Tokio runtime: the release gate task has nowhere
    /// to run.
    #[error("the decode node must start inside a Tokio runtime (its release gate task runs there)")]
    NoRuntime,
}

/// How a transfer ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferOutcome {
    /// All KV arrived and verified: `corrupt_chunks` chunks failed verification (must be 0).
    Completed {
        /// The room.
        key: RoomKey,
        /// Chunks that failed verification.
        corrupt_chunks: u64,
        /// Prompt tokens the prefill served from its cache tiers.
        hits: pb::PrefixHits,
        /// KV bytes received (pages × page bytes).
        kv_bytes: u64,
    },
    /// The room failed; its pages follow the gate.
    Failed {
        /// The room.
        key: RoomKey,
        /// Why.
        cause: FailureCause,
    },
}

struct Entry {
    room: ReceiverRoom,
    pages: Vec<u32>,
    peer: String,
    done: Option<oneshot::Sender<Result<(), FailureCause>>>,
    /// The receiver fence failed when the room completed: its pages go to quarantine, never to
    /// the free list.
    unfenced: bool,
    /// The token of the [`RoomGuard`] that owns the room: dead once the guard is gone, which
    /// [`DecodeNode::stranded`] checks independently of the guard's own `Drop`.
    holder: Weak<()>,
    /// When the pages were allocated.
    opened: Instant,
}

/// The one owner of a room's pages from their allocation until they are handed to the release
/// gate (DESIGN contract 3). Created in the critical section that takes the pages off the free list;
/// not `Clone`. Ending it explicitly ([`RoomGuard::finish`], [`RoomGuard::fail`]) or dropping it
/// hands the room over exactly once; a drop without an ending is an abandoned request (its future was
/// dropped at an await point): the room fails through the gate with [`FailureCause::ClientAbort`].
struct RoomGuard {
    node: Arc<DecodeNode>,
    key: RoomKey,
    /// Kept alive as long as the guard; the room's entry holds a [`Weak`] of it.
    _token: Arc<()>,
    ended: bool,
}

impl RoomGuard {
    /// The request ended normally after its decode: a committed room's pages return (to
    /// quarantine when the receiver fence failed at completion).
    fn finish(mut self) {
        self.ended = true;
        self.node.finish(self.key);
    }

    /// The room failed for `cause`: the release gate decides its pages' fate.
    fn fail(mut self, cause: FailureCause) {
        self.ended = true;
        self.node.fail(self.key, cause);
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        #[cfg(feature = "negative-controls")]
        if self.node.leak_on_drop.load(Ordering::SeqCst) {
            // Negative control: the pre-fix behaviour, nothing releases the room.
            return;
        }
        self.node.abandon(self.key);
    }
}

/// A completed room's pages, held while the request decodes: the KV must stay resident while
/// decoding reads it. [`KvLease::finish`] (decode ended) or [`KvLease::abort`] (e.g. the spec guard,
/// DESIGN contract 8) returns them through the release gate of contract 3. Dropping the lease
/// without either (the request's future was dropped: its client went away) hands the room to the
/// gate as abandoned ([`RoomTally::abandoned`]); a completed room has no write that can still land,
/// so its pages are freed at once. No path forgets the pages.
#[must_use = "dropping the lease releases the KV pages at once, counted as abandoned"]
pub struct KvLease {
    guard: RoomGuard,
}

impl KvLease {
    /// The room whose pages are held.
    pub fn key(&self) -> RoomKey {
        self.guard.key
    }

    /// Decoding ended normally: the pages return to the pool.
    pub fn finish(self) {
        self.guard.finish();
    }

    /// Decoding was aborted for `cause`: the room fails through the release gate (a completed room
    /// has no write that can still land, so its pages are freed at once).
    pub fn abort(self, cause: FailureCause) {
        self.guard.fail(cause);
    }
}

impl std::fmt::Debug for KvLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvLease")
            .field("key", &self.guard.key)
            .finish()
    }
}

/// Lifetime counts of the region's rooms (monotonic). A room is opened once, and its pages go back
/// to the free list at most once (`released`) or to quarantine at most once (`quarantined`; a late
/// proof then releases them too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoomTally {
    /// Rooms whose pages were allocated.
    pub opened: u64,
    /// Rooms whose pages returned to the free list.
    pub released: u64,
    /// Rooms whose pages were quarantined.
    pub quarantined: u64,
    /// Rooms whose owner was dropped without an ending (the request's future was dropped: a
    /// client that went away); each was failed through the gate with [`FailureCause::ClientAbort`].
    pub abandoned: u64,
    /// Failed rooms whose pages were freed on the prefill's acks (the ack-only path; DESIGN
    /// contract 3).
    pub freed_on_ack: u64,
    /// Failed rooms whose pages were freed on a transport proof (the TCP receiver's fence, or the
    /// peer's transport torn down).
    pub freed_on_transport: u64,
}

/// Pages no live request holds and the gate is not releasing (see [`DecodeNode::stranded`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stranded {
    /// Such rooms.
    pub rooms: usize,
    /// Their pages.
    pub pages: usize,
}

#[derive(Default)]
struct State {
    free: Vec<u32>,
    rooms: HashMap<RoomKey, Entry>,
    quarantine: Quarantine<u32>,
    links: HashMap<String, Arc<LinkState>>,
    tally: RoomTally,
}

struct LinkState {
    alive: AtomicBool,
    /// The peer's incarnation from its hello (0: unknown); a heartbeat or room reply naming
    /// another one means the peer restarted behind this link.
    incarnation: u64,
    signal: mpsc::UnboundedSender<pb::PeerMessage>,
    last_heard: Mutex<Instant>,
}

/// A connected prefill peer.
#[derive(Clone)]
pub struct PrefillLink {
    addr: String,
    rank: PrefillRank,
    client: TransferClient<Channel>,
    state: Arc<LinkState>,
}

impl PrefillLink {
    /// The peer's control address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Whether the signal stream is up and heartbeats are answered.
    pub fn alive(&self) -> bool {
        self.state.alive.load(Ordering::SeqCst)
    }

    /// The peer's incarnation from its hello (0: unknown).
    pub fn incarnation(&self) -> u64 {
        self.state.incarnation
    }

    /// A handle on the peer's `Transfer` client (snapshot sync's control calls).
    pub fn client(&self) -> TransferClient<Channel> {
        self.client.clone()
    }
}

/// Page counts of the decode region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageCounts {
    /// Free pages.
    pub free: usize,
    /// Pages held by live or release-pending rooms.
    pub held: usize,
    /// Pages quarantined.
    pub quarantined: usize,
    /// Quarantine alarms raised.
    pub alarms: u64,
}

/// The decode worker's transfer side.
pub struct DecodeNode {
    cfg: DecodeConfig,
    receiver: TcpReceiver,
    region: Arc<HostRegion>,
    state: Mutex<State>,
    next_room: AtomicU64,
    acks_received: AtomicU64,
    /// Failed rooms the gate must watch (receiver fence, ack deadline): consumed by the gate task.
    gate: mpsc::UnboundedSender<RoomKey>,
    /// This process's incarnation (0: unversioned; see [`DecodeNode::start_incarnation`]).
    incarnation: u64,
    /// Links dropped because their peer answered as another incarnation (it restarted).
    peer_restarts: AtomicU64,
    /// Signalled when a link is lost: the peer set refreshes (and readiness follows) at once.
    link_lost: tokio::sync::Notify,
    /// Negative control: an abandoned room is not handed to the gate (the pre-fix leak).
    #[cfg(feature = "negative-controls")]
    leak_on_drop: AtomicBool,
    /// The rooms of an engine beside the worker ([`engine_rooms`]): their signals, peer losses and
    /// heartbeats go there.
    engine_rooms: std::sync::OnceLock<Weak<engine_rooms::EngineRooms>>,
}

impl DecodeNode {
    /// Allocates the KV region, registers it, starts the TCP receiver and the release gate task
    /// (on the current Tokio runtime; it ends when the node is dropped).
    ///
    /// # Errors
    /// [`DecodeError::Receiver`] when the data port cannot be bound; [`DecodeError::NoRuntime`]
    /// outside a Tokio runtime.
    pub fn start(cfg: DecodeConfig) -> Result<Arc<DecodeNode>, DecodeError> {
        Self::start_incarnation(cfg, 0)
    }

    /// [`DecodeNode::start`] as incarnation `incarnation` of this worker (issue 18; a serving
    /// process draws it with [`crate::control::new_incarnation`]). Non-zero: the hello, the
    /// heartbeats and every OpenRoom carry it, room ids start at
    /// [`incarnation_room_base`]`(worker_id, incarnation)` (so no room id of an earlier process of
    /// the same worker id is reused: a late write or signal for one finds no room here), and a peer
    /// that answers as another incarnation than its hello's is dropped — its rooms fail through the
    /// release gate — and handshaken again at the next refresh. 0: unversioned (room ids from
    /// [`room_base`], peers' incarnations not compared).
    ///
    /// # Errors
    /// As [`DecodeNode::start`].
    pub fn start_incarnation(
        cfg: DecodeConfig,
        incarnation: u64,
    ) -> Result<Arc<DecodeNode>, DecodeError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| DecodeError::NoRuntime)?;
        let receiver = TcpReceiver::bind(&cfg.data_bind, GenerationCheck::Enforced)?;
        let region = Arc::new(HostRegion::new(cfg.pages, cfg.layout.page_bytes()));
        receiver.register_region(KV_REGION, region.clone());
        let state = State {
            free: (0..cfg.pages).rev().collect(),
            ..State::default()
        };
        let base = if incarnation == 0 {
            room_base(&cfg.worker_id)
        } else {
            incarnation_room_base(&cfg.worker_id, incarnation)
        };
        let (gate, jobs) = mpsc::unbounded_channel();
        let node = Arc::new(DecodeNode {
            cfg,
            receiver,
            region,
            state: Mutex::new(state),
            next_room: AtomicU64::new(base),
            acks_received: AtomicU64::new(0),
            gate,
            incarnation,
            peer_restarts: AtomicU64::new(0),
            link_lost: tokio::sync::Notify::new(),
            #[cfg(feature = "negative-controls")]
            leak_on_drop: AtomicBool::new(false),
            engine_rooms: std::sync::OnceLock::new(),
        });
        runtime.spawn(gate_task(Arc::downgrade(&node), jobs));
        Ok(node)
    }

    /// Negative control (feature `negative-controls`): when on, a room whose owner is dropped
    /// without an ending is left as it is — the leak this module's ownership design closes.
    #[cfg(feature = "negative-controls")]
    pub fn leak_abandoned_rooms(&self, on: bool) {
        self.leak_on_drop.store(on, Ordering::SeqCst);
    }

    /// The data address prefill writes to.
    pub fn data_addr(&self) -> String {
        self.receiver.addr().to_string()
    }

    /// Page counts now.
    pub fn pages(&self) -> PageCounts {
        let st = lock(&self.state);
        PageCounts {
            free: st.free.len(),
            held: st.rooms.values().map(|e| e.pages.len()).sum(),
            quarantined: st.quarantine.pages_held(),
            alarms: st.quarantine.alarms(),
        }
    }

    /// Lifetime room counts.
    pub fn tally(&self) -> RoomTally {
        lock(&self.state).tally
    }

    /// Pages of the region in all (free, held and quarantined together).
    pub fn total_pages(&self) -> usize {
        self.cfg.pages as usize
    }

    /// Prompt tokens the whole region holds (pages × tokens per page).
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.cfg.pages) * u64::from(self.cfg.layout.page_tokens)
    }

    /// Pages that no live request holds and that the release gate is not releasing, in rooms
    /// opened more than `older_than` ago: the room's owner is gone, and the room either never
    /// failed (nothing will ever free it) or is still waiting for acks more than `older_than` past
    /// its ack deadline (the gate's deadline never fired). The ownership design makes this 0; a
    /// non-zero value means the region can no longer admit what it could hold, and the serving
    /// decode reports itself not ready.
    pub fn stranded(&self, older_than: Duration) -> Stranded {
        let now = Instant::now();
        let st = lock(&self.state);
        let mut out = Stranded::default();
        for e in st.rooms.values() {
            let orphan = !e.pages.is_empty()
                && e.holder.strong_count() == 0
                && now.saturating_duration_since(e.opened) > older_than;
            let gate_waiting = e.room.state() == ReceiverState::ReleasePending
                && e.room.deadline().is_some_and(|d| now < d + older_than);
            if orphan && !gate_waiting {
                out.rooms += 1;
                out.pages += e.pages.len();
            }
        }
        out
    }

    /// State of a room (None once its pages were released).
    pub fn room_state(&self, key: RoomKey) -> Option<ReceiverState> {
        lock(&self.state).rooms.get(&key).map(|e| e.room.state())
    }

    /// Late writes the receiver dropped so far.
    pub fn dropped_late_writes(&self) -> u64 {
        self.receiver.stats().dropped_stale
    }

    /// Abort acks received from prefill peers so far.
    pub fn acks_received(&self) -> u64 {
        self.acks_received.load(Ordering::Relaxed)
    }

    /// This node's incarnation (0: unversioned).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Links dropped so far because their peer answered as a new incarnation (it restarted on
    /// the same address); each one's unfinished rooms failed through the release gate.
    pub fn peer_restarts(&self) -> u64 {
        self.peer_restarts.load(Ordering::Relaxed)
    }

    /// Completes once a link is lost after the call (or was lost since the last waiter): the peer
    /// set's refresh waits on it besides its period, so readiness turns false as soon as the last
    /// prefill peer is gone rather than at the next period.
    pub async fn link_lost(&self) {
        self.link_lost.notified().await;
    }

    /// Whether `seen` (a peer's incarnation in a heartbeat or room reply) names another process
    /// than the link's hello did. Never true on an unversioned node.
    fn restarted(&self, link: &PrefillLink, seen: u64) -> bool {
        self.incarnation != 0 && incarnation_changed(link.state.incarnation, seen)
    }

    /// Connects to a prefill peer without a revision (never refused for revision).
    pub async fn connect(
        self: &Arc<Self>,
        addr: &str,
        timeout: Duration,
    ) -> Result<PrefillLink, DecodeError> {
        self.connect_revision(addr, timeout, "").await
    }

    /// Connects to a prefill peer: hello (layout and revision check), signal stream, heartbeats.
    ///
    /// # Errors
    /// [`DecodeError::RevisionMismatch`] when `revision` is non-empty and the peer's differs (the
    /// peer refused, or its hello names another one); [`DecodeError::Peer`] when it cannot be
    /// reached or refuses for another reason.
    pub async fn connect_revision(
        self: &Arc<Self>,
        addr: &str,
        timeout: Duration,
        revision: &str,
    ) -> Result<PrefillLink, DecodeError> {
        let mismatch = |theirs: String| DecodeError::RevisionMismatch {
            peer: addr.to_string(),
            ours: revision.to_string(),
            theirs,
        };
        let peer_err = |message: String| DecodeError::Peer {
            peer: addr.to_string(),
            message,
        };
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| peer_err(e.to_string()))?
            .connect_timeout(timeout)
            .timeout(timeout);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| peer_err(e.to_string()))?;
        let mut client = TransferClient::new(channel);
        let hello = pb::PeerInfo {
            worker_id: self.cfg.worker_id.clone(),
            role: pb::Role::Decode as i32,
            rank: self.cfg.rank,
            data_addr: self.data_addr(),
            transport: pb::TransportKind::TransportTcp as i32,
            segments: vec![pb::Segment {
                region_id: KV_REGION.0,
                bytes: self.cfg.layout.page_bytes() * u64::from(self.cfg.pages),
                page_bytes: self.cfg.layout.page_bytes(),
            }],
            layout: Some(self.cfg.layout.into()),
            revision: revision.to_string(),
            incarnation: self.incarnation,
            ..Default::default()
        };
        let info = match client.peer_hello(hello).await {
            Ok(reply) => reply.into_inner(),
            Err(s) => {
                if let Some(theirs) = s
                    .metadata()
                    .get(REVISION_HEADER)
                    .and_then(|v| v.to_str().ok())
                {
                    return Err(mismatch(theirs.to_string()));
                }
                return Err(peer_err(s.message().to_string()));
            }
        };
        if !revision.is_empty() && !info.revision.is_empty() && info.revision != revision {
            return Err(mismatch(info.revision));
        }
        if let Some(g) = info.group.filter(|g| g.cp_rank != 0) {
            return Err(DecodeError::GroupMember {
                peer: addr.to_string(),
                cp_rank: g.cp_rank,
                cp_size: g.cp_size,
            });
        }
        let (tx, rx) = mpsc::unbounded_channel::<pb::PeerMessage>();
        let mut request = tonic::Request::new(UnboundedReceiverStream::new(rx));
        let id = self
            .cfg
            .worker_id
            .parse()
            .map_err(|_| peer_err("worker id is not a valid header value".into()))?;
        request.metadata_mut().insert(WORKER_ID_HEADER, id);
        request
            .metadata_mut()
            .insert(INCARNATION_HEADER, self.incarnation.into());
        // The stream request itself has no deadline: it lives as long as the peer.
        let mut stream_client = client.clone();
        let inbound = stream_client
            .signal(request)
            .await
            .map_err(|s| peer_err(s.message().to_string()))?
            .into_inner();
        let link_state = Arc::new(LinkState {
            alive: AtomicBool::new(true),
            incarnation: info.incarnation,
            signal: tx,
            last_heard: Mutex::new(Instant::now()),
        });
        lock(&self.state)
            .links
            .insert(addr.to_string(), link_state.clone());
        let link = PrefillLink {
            addr: addr.to_string(),
            rank: PrefillRank(info.rank),
            client,
            state: link_state,
        };
        let node = self.clone();
        let l2 = link.clone();
        tokio::spawn(async move { node.inbound(l2, inbound).await });
        let node = self.clone();
        let l3 = link.clone();
        tokio::spawn(async move { node.heartbeats(l3).await });
        Ok(link)
    }

    async fn inbound(
        self: Arc<Self>,
        link: PrefillLink,
        mut inbound: tonic::Streaming<pb::PeerMessage>,
    ) {
        loop {
            match inbound.next().await {
                Some(Ok(m)) => {
                    // A dropped link (its peer restarted, or it was declared dead) reads nothing
                    // more: a new link to the same address owns that address's rooms now.
                    if !link.alive() {
                        break;
                    }
                    if let Some(Body::Heartbeat(h)) = &m.body
                        && self.restarted(&link, h.incarnation)
                    {
                        tracing::warn!(peer = %link.addr, old = link.state.incarnation,
                            new = h.incarnation, "prefill peer restarted: dropping its link");
                        self.peer_restarts.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    *lock(&link.state.last_heard) = Instant::now();
                    self.on_message(&link, m);
                }
                Some(Err(status)) => {
                    tracing::warn!(peer = %link.addr, %status, "signal stream failed");
                    break;
                }
                None => break,
            }
        }
        self.peer_lost(&link);
    }

    async fn heartbeats(self: Arc<Self>, link: PrefillLink) {
        let mut tick = tokio::time::interval(self.cfg.heartbeat);
        loop {
            tick.tick().await;
            if !link.alive() {
                return;
            }
            if lock(&link.state.last_heard).elapsed() > self.cfg.heartbeat * 3 {
                tracing::warn!(peer = %link.addr, "prefill peer missed 3 heartbeats");
                self.peer_lost(&link);
                return;
            }
            let mut live: Vec<pb::RoomRef> = lock(&self.state)
                .rooms
                .iter()
                .filter(|(_, e)| e.peer == link.addr)
                .map(|(k, _)| (*k).into())
                .collect();
            if let Some(e) = self.engine_rooms() {
                live.extend(e.live_rooms(&link.addr));
            }
            let _ = link.state.signal.send(pb::PeerMessage {
                body: Some(Body::Heartbeat(pb::Heartbeat {
                    seq: 0,
                    live_rooms: live,
                    incarnation: self.incarnation,
                })),
            });
        }
    }

    /// The peer is gone: every room it could write fails through the gate (R-ABORT-5).
    fn peer_lost(self: &Arc<Self>, link: &PrefillLink) {
        if !link.state.alive.swap(false, Ordering::SeqCst) {
            return;
        }
        {
            let mut st = lock(&self.state);
            // Only this link's entry: a new link to the same address may have replaced it.
            if st
                .links
                .get(&link.addr)
                .is_some_and(|l| Arc::ptr_eq(l, &link.state))
            {
                st.links.remove(&link.addr);
            }
        }
        self.link_lost.notify_one();
        let keys: Vec<RoomKey> = lock(&self.state)
            .rooms
            .iter()
            // A room whose writes all concluded is being decoded; the peer's death cannot touch it.
            .filter(|(_, e)| {
                e.peer == link.addr
                    && !matches!(
                        e.room.state(),
                        ReceiverState::Success | ReceiverState::Committed
                    )
            })
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            self.fail(key, FailureCause::HeartbeatLost);
        }
        if let Some(e) = self.engine_rooms() {
            e.peer_lost(&link.addr);
        }
    }

    fn engine_rooms(&self) -> Option<Arc<engine_rooms::EngineRooms>> {
        self.engine_rooms.get()?.upgrade()
    }

    fn on_message(self: &Arc<Self>, link: &PrefillLink, m: pb::PeerMessage) {
        if let Some(e) = self.engine_rooms()
            && e.on_message(&m)
        {
            return;
        }
        match m.body {
            Some(Body::Ack(a)) => {
                let Some(key) = room_of(a.room) else { return };
                self.acks_received.fetch_add(1, Ordering::Relaxed);
                let mut st = lock(&self.state);
                let Some(entry) = st.rooms.get_mut(&key).filter(|e| e.peer == link.addr) else {
                    tracing::debug!(%key, "ack for a released room (or another peer's) ignored");
                    return;
                };
                if let AckOutcome::Counted { verdict, .. } =
                    entry.room.on_ack(key, PrefillRank(a.prefill_rank))
                {
                    self.apply_locked(&mut st, key, verdict);
                }
            }
            Some(Body::Chunk(c)) => {
                let Some(key) = room_of(c.room) else { return };
                let mut st = lock(&self.state);
                let Some(entry) = st.rooms.get_mut(&key).filter(|e| e.peer == link.addr) else {
                    return;
                };
                if entry.room.on_chunk().is_err() {
                    return;
                }
                if c.last
                    && entry.room.on_complete().is_ok()
                    && let Some(done) = entry.done.take()
                {
                    let _ = done.send(Ok(()));
                }
            }
            Some(Body::Failed(f)) => {
                let own = |key: &RoomKey| {
                    lock(&self.state)
                        .rooms
                        .get(key)
                        .is_some_and(|e| e.peer == link.addr)
                };
                if let Some(key) = room_of(f.room).filter(own) {
                    tracing::info!(%key, peer = %link.addr, reason = %f.reason, "prefill reported the room failed");
                    self.fail(key, FailureCause::PrefillFailed);
                }
            }
            Some(Body::Heartbeat(_)) | Some(Body::Abort(_)) | None => {}
        }
    }

    /// Fails a room through the release gate: ABORT to its writer; unless the verdict frees the
    /// pages at once, the gate task then watches the room (receiver fence as proof when enabled,
    /// quarantine at the ack deadline). Never awaits and needs no runtime (a guard's `Drop` calls
    /// it). A room that already failed, or that is unknown (released), is left as it is.
    pub fn fail(&self, key: RoomKey, cause: FailureCause) {
        let (notify, verdict, peer) = {
            let mut st = lock(&self.state);
            let Some(entry) = st.rooms.get_mut(&key) else {
                return;
            };
            if matches!(
                entry.room.state(),
                ReceiverState::ReleasePending
                    | ReceiverState::ReleaseSafe(_)
                    | ReceiverState::Quarantined
            ) {
                return;
            }
            let (notify, verdict) = entry.room.fail(cause, Instant::now(), self.cfg.ack_timeout);
            if let Some(done) = entry.done.take() {
                let _ = done.send(Err(cause));
            }
            let peer = entry.peer.clone();
            self.apply_locked(&mut st, key, verdict);
            (notify, verdict, peer)
        };
        if notify.is_empty() && verdict != GateVerdict::Hold {
            return;
        }
        let link = lock(&self.state).links.get(&peer).cloned();
        if let Some(link) = link {
            for _rank in &notify {
                let abort = pb::Abort {
                    room: Some(key.into()),
                    decode_rank: self.cfg.rank,
                    reason: abort_reason(cause) as i32,
                };
                let _ = link.signal.send(pb::PeerMessage {
                    body: Some(Body::Abort(abort)),
                });
            }
        }
        if verdict == GateVerdict::Hold && self.gate.send(key).is_err() {
            tracing::error!(%key, "release gate task is gone: the room waits for acks only");
        }
    }

    /// A room's owner was dropped without an ending: counted, and failed through the gate.
    fn abandon(&self, key: RoomKey) {
        lock(&self.state).tally.abandoned += 1;
        tracing::info!(%key, "request abandoned: its room goes through the release gate");
        self.fail(key, FailureCause::ClientAbort);
    }

    /// The gate's watch over a failed room (run by the gate task): the receiver fence as transport
    /// proof (when it is one), and the ack deadline, past which the pages are quarantined.
    fn watch(self: &Arc<Self>, key: RoomKey) {
        if self.cfg.fence_is_proof {
            let node = self.clone();
            tokio::task::spawn_blocking(move || {
                if let Ok(proof) = node
                    .receiver
                    .fence(key, Instant::now() + Duration::from_secs(1))
                {
                    let mut st = lock(&node.state);
                    if let Some(entry) = st.rooms.get_mut(&key) {
                        let v = entry.room.on_transport_proof(proof);
                        node.apply_locked(&mut st, key, v);
                    }
                }
            });
        }
        let node = self.clone();
        let ack_timeout = self.cfg.ack_timeout;
        tokio::spawn(async move {
            tokio::time::sleep(ack_timeout).await;
            let mut st = lock(&node.state);
            if let Some(entry) = st.rooms.get_mut(&key) {
                let v = entry.room.on_tick(Instant::now());
                node.apply_locked(&mut st, key, v);
            }
        });
    }

    /// Acts on a verdict with the state lock held.
    fn apply_locked(&self, st: &mut State, key: RoomKey, verdict: GateVerdict) {
        match verdict {
            GateVerdict::Hold => {}
            GateVerdict::Free {
                from_quarantine,
                proof,
            } => {
                tracing::debug!(%key, ?proof, "room pages released");
                match proof {
                    crate::release::receiver::ReleaseProof::AllAcks => st.tally.freed_on_ack += 1,
                    crate::release::receiver::ReleaseProof::Transport(_) => {
                        st.tally.freed_on_transport += 1;
                    }
                    _ => {}
                }
                let pages = if from_quarantine {
                    st.quarantine.release(key).unwrap_or_default()
                } else {
                    st.rooms
                        .get(&key)
                        .map(|e| e.pages.clone())
                        .unwrap_or_default()
                };
                let unfenced = st.rooms.remove(&key).is_some_and(|e| e.unfenced);
                // Whatever the proof, the receiver refuses the room's writes from now on (closing
                // never waits here): an OpenRoom the ABORT overtook — a request abandoned while
                // its room opened — cannot land a write in pages the pool hands out again. The
                // bypass (negative control) keeps the pre-fix behaviour.
                #[cfg(feature = "negative-controls")]
                let fence = proof != crate::release::receiver::ReleaseProof::Bypassed;
                #[cfg(not(feature = "negative-controls"))]
                let fence = true;
                if fence {
                    let _ = self.receiver.fence(key, Instant::now());
                }
                if unfenced && !from_quarantine {
                    st.quarantine.admit(key, pages, None, Instant::now());
                    st.tally.quarantined += 1;
                } else {
                    st.free.extend(pages);
                    st.tally.released += 1;
                }
                self.receiver.forget_room(key.room);
            }
            GateVerdict::Quarantine => {
                if let Some(entry) = st.rooms.get(&key) {
                    let (pages, cause) = (entry.pages.clone(), entry.room.cause());
                    st.quarantine.admit(key, pages, cause, Instant::now());
                    st.tally.quarantined += 1;
                }
                // The entry stays so that a late ack or proof can still release the pages.
                if let Some(e) = st.rooms.get_mut(&key) {
                    e.pages.clear();
                }
            }
        }
    }

    /// Transfers one request's KV from `link` within `deadline`, verifies every chunk on arrival,
    /// and returns the pages to the pool at once (a transfer-only client: tests and benches).
    ///
    /// # Errors
    /// As [`DecodeNode::transfer_held`].
    pub async fn transfer(
        self: &Arc<Self>,
        link: &PrefillLink,
        request: pb::RequestSpec,
        deadline: Duration,
    ) -> Result<TransferOutcome, DecodeError> {
        let (outcome, lease) = self.transfer_held(link, request, deadline).await?;
        if let Some(lease) = lease {
            lease.finish();
        }
        Ok(outcome)
    }

    /// Transfers one request's KV from `link` within `deadline` and verifies every chunk on
    /// arrival. On [`TransferOutcome::Completed`] the pages stay held by the returned [`KvLease`]
    /// for the decode that reads them; a failed room's pages follow the release gate. Dropping the
    /// returned future at any await point (the room open, the transfer wait) hands the room to the
    /// gate as abandoned (see the module docs).
    ///
    /// # Errors
    /// [`DecodeError::NoPages`] when the free pages cannot hold the prompt now,
    /// [`DecodeError::TooLarge`] when the whole region could not; the transfer never started.
    pub async fn transfer_held(
        self: &Arc<Self>,
        link: &PrefillLink,
        request: pb::RequestSpec,
        deadline: Duration,
    ) -> Result<(TransferOutcome, Option<KvLease>), DecodeError> {
        let layout = self.cfg.layout;
        let need = (request.input_tokens.max(1)).div_ceil(layout.page_tokens) as usize;
        let key = RoomKey::new(self.next_room.fetch_add(1, Ordering::Relaxed), 1);
        let (done_tx, done_rx) = oneshot::channel();
        // The pages leave the free list, the room is recorded and its owner is created in one
        // critical section: from here on every exit of this future ends or drops the guard.
        let (guard, pages) = {
            let mut st = lock(&self.state);
            if need > self.total_pages() {
                return Err(DecodeError::TooLarge {
                    need,
                    total: self.total_pages(),
                });
            }
            if st.free.len() < need {
                return Err(DecodeError::NoPages {
                    need,
                    free: st.free.len(),
                });
            }
            let at = st.free.len() - need;
            let pages: Vec<u32> = st.free.split_off(at);
            self.receiver.open_room(key);
            let room = ReceiverRoom::new(key, [link.rank], self.cfg.gate);
            let token = Arc::new(());
            st.rooms.insert(
                key,
                Entry {
                    room,
                    pages: pages.clone(),
                    peer: link.addr.clone(),
                    done: Some(done_tx),
                    unfenced: false,
                    holder: Arc::downgrade(&token),
                    opened: Instant::now(),
                },
            );
            st.tally.opened += 1;
            let guard = RoomGuard {
                node: self.clone(),
                key,
                _token: token,
                ended: false,
            };
            (guard, pages)
        };
        let open = pb::OpenRoomRequest {
            room: Some(key.into()),
            decode_rank: self.cfg.rank,
            request: Some(request.clone()),
            decode_worker: self.cfg.worker_id.clone(),
            data_addr: self.data_addr(),
            dst_region: KV_REGION.0,
            dst_pages: pages.clone(),
            layout: Some(layout.into()),
            deadline_ms: deadline.as_millis() as u64,
            decode_incarnation: self.incarnation,
            hand_off_token: 0,
        };
        let mut client = link.client.clone();
        let hits = match client.open_room(open).await {
            Ok(reply) if self.restarted(link, reply.get_ref().incarnation) => {
                // The channel reconnected to a new process on the peer's address: the room was
                // opened on an incarnation this link never handshook with (no signal stream carries
                // its ChunkDone). Fail it through the gate, ask that process to drop it, and drop
                // the link: the next refresh handshakes with the new incarnation.
                let theirs = reply.get_ref().incarnation;
                tracing::warn!(%key, peer = %link.addr, old = link.state.incarnation, new = theirs,
                    "room opened on a restarted prefill: failed, link dropped");
                self.peer_restarts.fetch_add(1, Ordering::Relaxed);
                let abort = pb::Abort {
                    room: Some(key.into()),
                    decode_rank: self.cfg.rank,
                    reason: pb::AbortReason::PeerDead as i32,
                };
                let mut c = link.client.clone();
                tokio::spawn(async move {
                    let _ = c.abort_room(abort).await;
                });
                guard.fail(FailureCause::HeartbeatLost);
                self.peer_lost(link);
                return Ok((
                    TransferOutcome::Failed {
                        key,
                        cause: FailureCause::HeartbeatLost,
                    },
                    None,
                ));
            }
            Ok(reply) => reply.into_inner().hits.unwrap_or_default(),
            Err(status) => {
                tracing::warn!(%key, %status, "OpenRoom failed");
                guard.fail(FailureCause::TransferFailed);
                return Ok((
                    TransferOutcome::Failed {
                        key,
                        cause: FailureCause::TransferFailed,
                    },
                    None,
                ));
            }
        };
        let result = tokio::time::timeout(deadline, done_rx).await;
        match result {
            Ok(Ok(Ok(()))) => {
                // Verifying every chunk is CPU work proportional to the KV (61 layers × the
                // pages): the runtime's other tasks move off this thread meanwhile, or heartbeats
                // of every link wait behind it (a CP-4 group's live run lost its prefill to
                // `HeartbeatLost` that way). No await point: a client hanging up cannot cut the
                // room between its verification and its commit.
                let corrupt = match tokio::runtime::Handle::current().runtime_flavor() {
                    tokio::runtime::RuntimeFlavor::MultiThread => {
                        tokio::task::block_in_place(|| self.verify(request.request_id, &pages))
                    }
                    _ => self.verify(request.request_id, &pages),
                };
                if let Some(entry) = lock(&self.state).rooms.get_mut(&key) {
                    let _ = entry.room.commit();
                }
                // Every write of the room completed; the fence closes the room on the receiver so
                // that nothing lands in its pages while the request decodes. Without the fence the
                // pages are quarantined when the lease ends.
                let fenced = self
                    .receiver
                    .fence(key, Instant::now() + Duration::from_secs(1))
                    .is_ok();
                if let Some(entry) = lock(&self.state).rooms.get_mut(&key) {
                    entry.unfenced = !fenced;
                }
                Ok((
                    TransferOutcome::Completed {
                        key,
                        corrupt_chunks: corrupt,
                        hits,
                        kv_bytes: layout.page_bytes() * pages.len() as u64,
                    },
                    Some(KvLease { guard }),
                ))
            }
            Ok(Ok(Err(cause))) => {
                // Whoever reported the cause already failed the room; ending the guard is a no-op
                // on the gate and only records that the request ended.
                guard.fail(cause);
                Ok((TransferOutcome::Failed { key, cause }, None))
            }
            Ok(Err(_)) | Err(_) => {
                guard.fail(FailureCause::Timeout);
                Ok((
                    TransferOutcome::Failed {
                        key,
                        cause: FailureCause::Timeout,
                    },
                    None,
                ))
            }
        }
    }

    /// Ends a completed room after its decode: its pages return to the pool (to quarantine when
    /// the receiver fence failed at completion). A room that failed meanwhile follows the gate
    /// instead; an unknown room is ignored.
    fn finish(&self, key: RoomKey) {
        let mut st = lock(&self.state);
        let committed = st
            .rooms
            .get(&key)
            .is_some_and(|e| e.room.state() == ReceiverState::Committed);
        if !committed {
            return;
        }
        if let Some(entry) = st.rooms.remove(&key) {
            if entry.unfenced {
                st.quarantine.admit(key, entry.pages, None, Instant::now());
                st.tally.quarantined += 1;
            } else {
                st.free.extend(entry.pages);
                st.tally.released += 1;
            }
        }
        drop(st);
        self.receiver.forget_room(key.room);
    }

    /// Verifies every chunk of a request's pages; returns the number of bad chunks.
    fn verify(&self, request: u64, pages: &[u32]) -> u64 {
        let layout = self.cfg.layout;
        let mut bad = 0;
        for (index, page) in pages.iter().enumerate() {
            let Some(guard) = self.region.page(*page) else {
                bad += u64::from(layout.layers);
                continue;
            };
            for layer in 0..layout.layers {
                let start = (u64::from(layer) * layout.chunk_bytes()) as usize;
                let chunk = &guard[start..start + layout.chunk_bytes() as usize];
                if let Err(c) = verify_chunk(chunk, &layout.chunk(request, index as u32, layer)) {
                    tracing::error!(request, page, layer, error = %c, "corrupt KV chunk read");
                    bad += 1;
                }
            }
        }
        bad
    }

    /// The decode rank.
    pub fn rank(&self) -> DecodeRank {
        DecodeRank(self.cfg.rank)
    }
}

/// First room id of a decode worker: the worker id's hash in the high 31 bits, so the rooms of the
/// decode workers sharing one prefill never collide (room ids are per prefill table).
pub fn room_base(worker_id: &str) -> u64 {
    ((xxhash_rust::xxh3::xxh3_64(worker_id.as_bytes()) & 0x7FFF_FFFF) << 32) | 1
}

/// First room id of incarnation `incarnation` of decode worker `worker_id`: like [`room_base`],
/// with the incarnation mixed into the high 31 bits, so a restarted worker (same id, new process)
/// reuses none of its earlier process's room ids (issue 18).
pub fn incarnation_room_base(worker_id: &str, incarnation: u64) -> u64 {
    let mut key = worker_id.as_bytes().to_vec();
    key.extend_from_slice(&incarnation.to_le_bytes());
    ((xxhash_rust::xxh3::xxh3_64(&key) & 0x7FFF_FFFF) << 32) | 1
}

/// The gate task: watches every failed room handed over by [`DecodeNode::fail`] (receiver fence,
/// ack deadline). It holds the node weakly and ends with it.
async fn gate_task(node: Weak<DecodeNode>, mut jobs: mpsc::UnboundedReceiver<RoomKey>) {
    while let Some(key) = jobs.recv().await {
        let Some(node) = node.upgrade() else {
            return;
        };
        node.watch(key);
    }
}

fn abort_reason(cause: FailureCause) -> pb::AbortReason {
    match cause {
        FailureCause::ClientAbort => pb::AbortReason::Client,
        FailureCause::Timeout => pb::AbortReason::Timeout,
        FailureCause::TransferFailed => pb::AbortReason::TransferFailed,
        FailureCause::HeartbeatLost => pb::AbortReason::PeerDead,
        FailureCause::PrefillFailed => pb::AbortReason::PrefillFailed,
        FailureCause::SpecGuard => pb::AbortReason::SpecGuard,
        FailureCause::Shutdown => pb::AbortReason::Shutdown,
    }
}
