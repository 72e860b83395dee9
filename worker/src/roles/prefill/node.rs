//! The prefill worker's `Transfer` service.
//!
//! A room opened by decode is computed by the simulated engine (cost-model time, then page bytes that
//! are a function of (request, layer, token)) and sent page by page over the data transport, one
//! bounded batch per page. The sender room table decides everything about aborts (contract 3): a
//! failed room accepts no new write, and the ack for each `(room, generation, decode rank)` is sent
//! once, when no write is outstanding. Source pages (the batch payloads) are held by the transport
//! until each write is terminal; the room's `ReleaseSource` fires only when all of them are.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::engine::fill_chunk;
use crate::release::sender::{AbortAck, AckKind, SenderEffect, SenderRooms, SenderState};
use crate::release::{DecodeRank, PrefillRank, RoomKey};
use crate::transfer::tcp::TcpTransport;
use crate::transfer::{RegionId, TransferHandle, TransferStatus, Transport, WriteBatch, WriteOp};

use crate::control::pb::transfer_server::Transfer;
use crate::control::pb::{self, peer_message::Body};
use crate::control::{KvLayout, REVISION_HEADER, WORKER_ID_HEADER, incarnation_changed, room_of};
use crate::engine_api::service::EngineApi;

pub mod engine;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Prefill worker configuration.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// Worker id (for logs and hello).
    pub worker_id: String,
    /// This worker's prefill rank.
    pub rank: u32,
    /// KV layout this worker produces; decode must use the same.
    pub layout: KvLayout,
    /// Simulated compute time per page before it is sent (the cost model's prefill time per page).
    pub compute_per_page: Duration,
}

struct RoomPlan {
    decode_worker: String,
    data_addr: String,
    region: RegionId,
    pages: Vec<u32>,
    request: u64,
    pages_done: u32,
    /// The opening decode's rank (an incarnation drop aborts the room for it).
    decode_rank: u32,
    /// The opening decode's incarnation (0: unknown).
    decode_incarnation: u64,
    /// A LayerSplit member rank's part of its leader's room (`super::cp_engine`): its writes go
    /// to the decode, its progress and outcome to the leader (no decode stream is told).
    group_member: bool,
}

type SignalTx = mpsc::UnboundedSender<Result<pb::PeerMessage, Status>>;

/// Counters of one prefill node (monotonic; the serving layer exports them in `/report`).
#[derive(Debug, Default)]
pub struct PrefillStats {
    /// Aborts received (signal stream or `AbortRoom`), one per (room, generation, decode rank).
    pub aborts_received: AtomicU64,
    /// Abort acks sent.
    pub acks_sent: AtomicU64,
    /// KV bytes whose writes completed.
    pub kv_bytes_sent: AtomicU64,
    /// Rooms whose every write completed.
    pub rooms_completed: AtomicU64,
    /// Rooms dropped because their decode worker came back as a new incarnation (issue 18).
    pub stale_rooms_dropped: AtomicU64,
    /// Room messages not sent because their room belongs to an old decode incarnation.
    pub stale_messages_dropped: AtomicU64,
}

/// What the simulated engine does for one room, decided before it starts (DESIGN §3: compute time
/// from a cost model; cache tiers shorten it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComputePlan {
    /// Prompt tokens served per tier instead of computed.
    pub hits: pb::PrefixHits,
    /// Simulated time before page `i` is sent; `len` = pages of the room.
    pub per_page: Vec<Duration>,
}

/// The serving layer's hook into the simulated engine: prefix-cache lookup before a room's compute
/// and write-back after it. Both calls may block (L3 network I/O); they run on the blocking pool.
pub trait RoomPlanner: Send + Sync {
    /// Plans the room of `request` over `pages` pages of `layout`.
    fn plan(&self, request: &pb::RequestSpec, layout: KvLayout, pages: u32) -> ComputePlan;
    /// Every page of the room was computed and handed to the transport (write policy hook).
    fn computed(&self, request: &pb::RequestSpec, layout: KvLayout, plan: &ComputePlan);
}

/// The writes of `(layer, chunk)` pairs into decode page `page` of `region` (offset
/// `page × page_bytes + layer × chunk_bytes` of `layout`), and their bytes: one page's batch, as
/// the built-in engine and every rank of a CP group send it.
pub fn page_write_ops(
    layout: KvLayout,
    key: RoomKey,
    region: RegionId,
    page: u32,
    chunks: Vec<(u32, Bytes)>,
) -> (Vec<WriteOp>, u64) {
    let bytes = chunks.iter().map(|(_, c)| c.len() as u64).sum();
    let ops = chunks
        .into_iter()
        .map(|(layer, data)| WriteOp {
            key,
            region,
            offset: u64::from(page) * layout.page_bytes() + u64::from(layer) * layout.chunk_bytes(),
            data,
        })
        .collect();
    (ops, bytes)
}

/// The prefill side of every room on this worker.
///
/// With the built-in engine the node owns the sender room table; with an engine beside it
/// ([`PrefillNode::set_engine`], `config.engine`), the engine API's [`PrefillSide`](crate::engine_api::prefill::PrefillSide) owns the table and
/// the node carries the peer protocol and the transfers ([`engine`]).
pub struct PrefillNode {
    cfg: PrefillConfig,
    rooms: Mutex<SenderRooms>,
    plans: Mutex<HashMap<RoomKey, RoomPlan>>,
    transport: Arc<TcpTransport>,
    peers: Mutex<HashMap<String, SignalTx>>,
    events: broadcast::Sender<pb::RoomEvent>,
    stats: PrefillStats,
    engine: std::sync::OnceLock<std::sync::Weak<EngineApi>>,
    /// The engine path's tier backend (L2 bytes, L3), set with the engine.
    tiers: std::sync::OnceLock<Arc<super::tiers::HostTiers>>,
    /// This pod's rank of a LayerSplit group computing through its engine (issue 15).
    engine_group: std::sync::OnceLock<Arc<super::cp_engine::EngineGroup>>,
    abort_from: Mutex<HashMap<RoomKey, String>>,
    me: std::sync::Weak<PrefillNode>,
    /// This process's incarnation (issue 18), sent in the hello, heartbeats and room replies.
    incarnation: u64,
    /// The latest incarnation each decode worker id said hello with.
    decode_incarnations: Mutex<HashMap<String, u64>>,
    /// Rooms of old decode incarnations still draining: nothing about them is sent any more.
    stale_rooms: Mutex<HashSet<RoomKey>>,
}

fn msg(body: Body) -> pb::PeerMessage {
    pb::PeerMessage { body: Some(body) }
}

fn ack_msg(ack: &AbortAck) -> pb::AbortAck {
    pb::AbortAck {
        room: Some(ack.key.into()),
        prefill_rank: ack.prefill_rank.0,
        decode_rank: ack.decode_rank.0,
        kind: match ack.kind {
            AckKind::NoneStarted => pb::AckKind::NoneStarted as i32,
            AckKind::AllDrained => pb::AckKind::AllDrained as i32,
        },
    }
}

fn state_code(s: Option<SenderState>) -> pb::RoomState {
    match s {
        None => pb::RoomState::Unspecified,
        Some(SenderState::Bootstrapping) => pb::RoomState::Bootstrapping,
        Some(SenderState::WaitingForInput) => pb::RoomState::WaitingForInput,
        Some(SenderState::Transferring) => pb::RoomState::Transferring,
        Some(SenderState::Success) => pb::RoomState::Success,
        Some(SenderState::Failed(_)) => pb::RoomState::Failed,
    }
}

impl PrefillNode {
    /// A node sending through `transport`.
    pub fn new(cfg: PrefillConfig, transport: Arc<TcpTransport>) -> Arc<PrefillNode> {
        let (events, _) = broadcast::channel(1024);
        Arc::new_cyclic(|me| PrefillNode {
            rooms: Mutex::new(SenderRooms::new(PrefillRank(cfg.rank))),
            cfg,
            plans: Mutex::new(HashMap::new()),
            transport,
            peers: Mutex::new(HashMap::new()),
            events,
            stats: PrefillStats::default(),
            engine: std::sync::OnceLock::new(),
            tiers: std::sync::OnceLock::new(),
            engine_group: std::sync::OnceLock::new(),
            abort_from: Mutex::new(HashMap::new()),
            me: me.clone(),
            incarnation: if crate::control::incarnation_ignored() {
                0
            } else {
                crate::control::new_incarnation()
            },
            decode_incarnations: Mutex::new(HashMap::new()),
            stale_rooms: Mutex::new(HashSet::new()),
        })
    }

    /// This process's incarnation (issue 18; 0 only under the negative control).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Records the incarnation a decode worker said hello with. When it replaces another one (the
    /// decode restarted on the same worker id), every room of the old incarnation is dropped: its
    /// plan goes (the engine stops sending, no ChunkDone follows), it is aborted in the sender
    /// table (source pages are released once its writes in flight are terminal), and no message
    /// about it is sent any more — the new incarnation's signal stream carries the same worker id.
    /// Returns the rooms dropped.
    pub fn decode_hello(&self, worker: &str, incarnation: u64) -> usize {
        if self.incarnation == 0 || incarnation == 0 {
            return 0;
        }
        let old = lock(&self.decode_incarnations).insert(worker.to_owned(), incarnation);
        if !old.is_some_and(|o| incarnation_changed(o, incarnation)) {
            return 0;
        }
        let dropped: Vec<(RoomKey, u32)> = {
            let mut plans = lock(&self.plans);
            let keys: Vec<(RoomKey, u32)> = plans
                .iter()
                .filter(|(_, p)| p.decode_worker == worker && p.decode_incarnation != incarnation)
                .map(|(k, p)| (*k, p.decode_rank))
                .collect();
            let mut stale = lock(&self.stale_rooms);
            if stale.len() > 65_536 {
                stale.clear(); // bounded: entries of rooms long gone
            }
            for (k, _) in &keys {
                plans.remove(k);
                stale.insert(*k);
            }
            keys
        };
        tracing::warn!(
            decode = worker,
            old = old.unwrap_or(0),
            new = incarnation,
            rooms = dropped.len(),
            "decode worker restarted: dropping its old incarnation's rooms"
        );
        for (key, rank) in &dropped {
            self.stats
                .stale_rooms_dropped
                .fetch_add(1, Ordering::Relaxed);
            self.abort(*key, DecodeRank(*rank), "");
        }
        dropped.len()
    }

    /// Whether a room opened by `worker` as `incarnation` belongs to an incarnation older than
    /// the one it last said hello with.
    fn stale_decode(&self, worker: &str, incarnation: u64) -> bool {
        self.incarnation != 0
            && lock(&self.decode_incarnations)
                .get(worker)
                .is_some_and(|known| incarnation_changed(*known, incarnation))
    }

    /// Counters of this node.
    pub fn stats(&self) -> &PrefillStats {
        &self.stats
    }

    /// The data transport (teardown closes it).
    pub fn transport(&self) -> &Arc<TcpTransport> {
        &self.transport
    }

    /// Rooms still held (live or draining), in whichever table owns them.
    pub fn rooms_held(&self) -> usize {
        match self.engine_side() {
            Some(side) => side.rooms(),
            None => lock(&self.rooms).len(),
        }
    }

    /// The sender state and outstanding writes of a room, from whichever table owns it.
    fn room_view(&self, key: RoomKey) -> (Option<SenderState>, u32) {
        match self.engine_side() {
            Some(side) => (side.room_state(key), side.outstanding(key)),
            None => {
                let rooms = lock(&self.rooms);
                (rooms.state(key), rooms.outstanding(key))
            }
        }
    }

    fn publish(&self, key: RoomKey) {
        let (state, outstanding) = self.room_view(key);
        self.publish_state(key, state, outstanding);
    }

    fn publish_state(&self, key: RoomKey, state: Option<SenderState>, outstanding: u32) {
        let _ = self.events.send(pb::RoomEvent {
            room: Some(key.into()),
            state: state_code(state) as i32,
            outstanding,
        });
    }

    fn send_to(&self, decode_worker: &str, m: pb::PeerMessage) {
        let room = match &m.body {
            Some(Body::Ack(a)) => a.room,
            Some(Body::Chunk(c)) => c.room,
            Some(Body::Failed(f)) => f.room,
            _ => None,
        };
        if let Some(key) = room_of(room)
            && lock(&self.stale_rooms).contains(&key)
        {
            self.stats
                .stale_messages_dropped
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Some(tx) = lock(&self.peers).get(decode_worker) {
            let _ = tx.send(Ok(m));
        }
    }

    /// Performs table effects: acks to their decode worker, source release (and the final
    /// ChunkDone when the room succeeded).
    fn perform(&self, effects: Vec<SenderEffect>, fallback_worker: Option<&str>) {
        for e in effects {
            match e {
                SenderEffect::SendAck(ack) => {
                    let worker = lock(&self.plans)
                        .get(&ack.key)
                        .map(|p| p.decode_worker.clone());
                    if let Some(w) = worker.as_deref().or(fallback_worker) {
                        self.stats.acks_sent.fetch_add(1, Ordering::Relaxed);
                        self.send_to(w, msg(Body::Ack(ack_msg(&ack))));
                    }
                }
                SenderEffect::ReleaseSource(key) => {
                    let state = lock(&self.rooms).state(key);
                    let plan = lock(&self.plans).remove(&key);
                    if let (Some(SenderState::Success), Some(plan)) = (state, &plan) {
                        self.stats.rooms_completed.fetch_add(1, Ordering::Relaxed);
                        let done = pb::ChunkDone {
                            room: Some(key.into()),
                            prefill_rank: self.cfg.rank,
                            pages_done: plan.pages.len() as u32,
                            last: true,
                        };
                        self.send_to(&plan.decode_worker, msg(Body::Chunk(done)));
                    }
                    self.publish(key);
                    lock(&self.rooms).clear(key);
                    lock(&self.stale_rooms).remove(&key);
                }
            }
        }
    }

    fn abort(&self, key: RoomKey, decode_rank: DecodeRank, from_worker: &str) -> Vec<AbortAck> {
        self.stats.aborts_received.fetch_add(1, Ordering::Relaxed);
        if let Some(side) = self.engine_side() {
            // The engine side's table decides; its acks reach the decode worker through
            // `KvSink::ack` on the signal stream.
            lock(&self.abort_from).insert(key, from_worker.to_owned());
            side.abort(key, decode_rank);
            // A LayerSplit leader's members stop their part of it too.
            if let Some(group) = self.engine_group.get() {
                group.abort_members(key, "the decode aborted the room");
            }
            self.publish(key);
            return Vec::new();
        }
        let effects = lock(&self.rooms).abort(key, decode_rank);
        let immediate: Vec<AbortAck> = effects
            .iter()
            .filter_map(|e| match e {
                SenderEffect::SendAck(a) => Some(*a),
                SenderEffect::ReleaseSource(_) => None,
            })
            .collect();
        self.perform(effects, Some(from_worker));
        self.publish(key);
        immediate
    }

    /// Sends pages `[first, first + n)` of a room, one batch per page; stops at the first refusal.
    /// Blocking (connects and enqueues); call from a blocking context.
    pub fn submit_pages(
        self: &Arc<Self>,
        key: RoomKey,
        first: u32,
        n: u32,
        last: bool,
    ) -> Result<(), Status> {
        let layout = self.cfg.layout;
        for index in first..first.saturating_add(n) {
            let request = lock(&self.plans)
                .get(&key)
                .map(|p| p.request)
                .ok_or_else(|| Status::not_found(format!("{key} has no plan")))?;
            let chunks = (0..layout.layers)
                .map(|layer| {
                    let spec = layout.chunk(request, index, layer);
                    let mut buf = vec![0u8; spec.bytes()];
                    fill_chunk(&mut buf, &spec);
                    (layer, Bytes::from(buf))
                })
                .collect();
            self.submit_page_writes(key, index, chunks)?;
        }
        if last {
            self.finish_room_input(key)?;
        }
        Ok(())
    }

    /// Sends the `(layer, chunk)` pairs of page `index` of a room as one batch into the decode's
    /// page (offset `page × page_bytes + layer × chunk_bytes`); on completion a `ChunkDone`, on
    /// failure a `RoomFailed` (the room fails). Refused once the room failed (R-ABORT-2). Blocking
    /// (connects and enqueues); call from a blocking context.
    ///
    /// # Errors
    /// `NOT_FOUND` without a plan, `INVALID_ARGUMENT` for a page index outside the room,
    /// `FAILED_PRECONDITION` for a failed room, `UNAVAILABLE` when the transport refuses.
    pub fn submit_page_writes(
        self: &Arc<Self>,
        key: RoomKey,
        index: u32,
        chunks: Vec<(u32, Bytes)>,
    ) -> Result<(), Status> {
        let layout = self.cfg.layout;
        let (addr, region, page, worker) = {
            let plans = lock(&self.plans);
            let plan = plans
                .get(&key)
                .ok_or_else(|| Status::not_found(format!("{key} has no plan")))?;
            let page = *plan
                .pages
                .get(index as usize)
                .ok_or_else(|| Status::invalid_argument("page index out of range"))?;
            (
                plan.data_addr.clone(),
                plan.region,
                page,
                plan.decode_worker.clone(),
            )
        };
        // Failed first, then no new write (R-ABORT-2).
        if let Err(e) = lock(&self.rooms).begin_write(key) {
            return Err(Status::failed_precondition(e.to_string()));
        }
        let (ops, bytes) = page_write_ops(layout, key, region, page, chunks);
        let (node, to) = (self.clone(), worker.clone());
        let sink = Arc::new(move |_h: TransferHandle, status: &TransferStatus| {
            let worker = &to;
            let ok = *status == TransferStatus::Completed;
            if ok {
                node.stats.kv_bytes_sent.fetch_add(bytes, Ordering::Relaxed);
            }
            let effects = lock(&node.rooms).end_write(key, ok).unwrap_or_default();
            if ok {
                let done = {
                    let mut plans = lock(&node.plans);
                    plans.get_mut(&key).map(|p| {
                        p.pages_done += 1;
                        p.pages_done
                    })
                };
                if let Some(d) = done {
                    node.send_to(
                        worker,
                        msg(Body::Chunk(pb::ChunkDone {
                            room: Some(key.into()),
                            prefill_rank: node.cfg.rank,
                            pages_done: d,
                            last: false,
                        })),
                    );
                }
            } else {
                node.room_failed_to(worker, key, format!("{status:?}"));
            }
            node.perform(effects, None);
        });
        let submitted = WriteBatch::new(ops, self.transport.limits())
            .and_then(|b| self.transport.submit(&addr, b, Some(sink)));
        if let Err(e) = submitted {
            let effects = lock(&self.rooms).end_write(key, false).unwrap_or_default();
            self.room_failed_to(&worker, key, e.to_string());
            self.perform(effects, None);
            return Err(Status::unavailable(e.to_string()));
        }
        self.publish(key);
        Ok(())
    }

    /// Tells the room's decode worker that the room failed here (`RoomFailed`).
    fn room_failed_to(&self, worker: &str, key: RoomKey, reason: String) {
        self.send_to(
            worker,
            msg(Body::Failed(pb::RoomFailed {
                room: Some(key.into()),
                prefill_rank: self.cfg.rank,
                reason,
            })),
        );
    }

    /// Every chunk of the room was handed over: it succeeds once its writes (and parts) drain.
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` for an unknown or concluded room.
    pub fn finish_room_input(&self, key: RoomKey) -> Result<(), Status> {
        let effects = lock(&self.rooms)
            .finish_input(key)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        self.perform(effects, None);
        Ok(())
    }

    /// A part of the room written by another process (a LayerSplit rank writing its owned
    /// layers, `super::cp_group`) begins: it counts as an outstanding write, so no abort ack
    /// leaves before [`PrefillNode::end_room_part`] (DESIGN contract 3).
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` once the room failed or concluded (R-ABORT-2).
    pub fn begin_room_part(&self, key: RoomKey) -> Result<(), Status> {
        lock(&self.rooms)
            .begin_write(key)
            .map_err(|e| Status::failed_precondition(e.to_string()))
    }

    /// The part begun by [`PrefillNode::begin_room_part`] is terminal: `ok` when every write of
    /// it completed, else the room fails with `reason` (sent to the decode as `RoomFailed`).
    pub fn end_room_part(&self, key: RoomKey, ok: bool, reason: &str) {
        let effects = lock(&self.rooms).end_write(key, ok).unwrap_or_default();
        if !ok {
            let worker = lock(&self.plans).get(&key).map(|p| p.decode_worker.clone());
            if let Some(w) = worker {
                self.room_failed_to(&w, key, reason.to_owned());
            }
        }
        self.perform(effects, None);
        self.publish(key);
    }

    /// Fails the room on this side's initiative (its engine step failed): `RoomFailed` to the
    /// decode, which aborts it and gets its ack once the room's writes drain.
    pub fn fail_room(&self, key: RoomKey, reason: &str) {
        let effects = lock(&self.rooms).fail(key, crate::release::sender::SenderFailure::Local);
        let worker = lock(&self.plans).get(&key).map(|p| p.decode_worker.clone());
        if let Some(w) = worker {
            self.room_failed_to(&w, key, reason.to_owned());
        }
        self.perform(effects, None);
        self.publish(key);
    }

    /// Whether the room is open here and has neither failed nor concluded (an abort marks it
    /// failed at once).
    pub fn room_open(&self, key: RoomKey) -> bool {
        matches!(
            lock(&self.rooms).state(key),
            Some(
                SenderState::Bootstrapping
                    | SenderState::WaitingForInput
                    | SenderState::Transferring
            )
        )
    }

    /// The room's destination as its `OpenRoom` named it: `(data address, region, decode page
    /// ids)`; `None` for an unknown room.
    pub fn room_destination(&self, key: RoomKey) -> Option<(String, RegionId, Vec<u32>)> {
        lock(&self.plans)
            .get(&key)
            .map(|p| (p.data_addr.clone(), p.region, p.pages.clone()))
    }

    /// The simulated engine: compute each page (`delays[i]`, else the configured per-page time),
    /// then send it. Returns whether every page was handed to the transport.
    async fn run_engine(self: Arc<Self>, key: RoomKey, pages: u32, delays: Vec<Duration>) -> bool {
        for index in 0..pages {
            let delay = delays
                .get(index as usize)
                .copied()
                .unwrap_or(self.cfg.compute_per_page);
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let node = self.clone();
            let last = index + 1 == pages;
            let sent =
                tokio::task::spawn_blocking(move || node.submit_pages(key, index, 1, last)).await;
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(status)) => {
                    tracing::debug!(%key, %status, "prefill engine stopped sending");
                    return false;
                }
                Err(e) => {
                    tracing::error!(%key, error = %e, "prefill send task failed");
                    return false;
                }
            }
        }
        true
    }
}

/// The tonic service over a [`PrefillNode`].
#[derive(Clone)]
pub struct PrefillService {
    node: Arc<PrefillNode>,
    /// Run the simulated engine on OpenRoom (false: an external engine calls SubmitChunk).
    pub drive_engine: bool,
    /// This worker's pool revision; a decode hello with another non-empty revision is refused
    /// (DESIGN §5). Empty: unversioned, accepts every decode.
    pub revision: String,
    /// Prefix-cache lookup and write-back around the simulated engine; `None`: compute every page.
    pub planner: Option<Arc<dyn RoomPlanner>>,
    /// Cleared at drain (SIGTERM): new rooms are refused with `UNAVAILABLE`, running ones finish.
    pub admitting: Arc<AtomicBool>,
    /// The prefill KV pool the built-in engine's rooms hold pages of while they compute (issue
    /// 15); `None`: rooms hold no pool pages.
    pub pages: Option<Arc<super::snapshot_sync::PrefillPages>>,
    /// The snapshot service (DESIGN contract 4); `None`: `SnapshotPrepare` answers `DISABLED`.
    pub snapshots: Option<Arc<super::snapshot_sync::SnapshotSync>>,
    /// This pod's rank of a CP group (issue 15): the leader runs every room through the group;
    /// another rank takes no room, and its hello says where it stands in the group.
    pub cp_group: Option<Arc<super::cp_group::GroupRank>>,
    /// This pod's rank of a LayerSplit group computing through its engine (issue 15): as
    /// `cp_group` for the hello and OpenRoom; the rooms run through `super::cp_engine`.
    pub cp_engine: Option<Arc<super::cp_engine::EngineGroup>>,
}

impl PrefillService {
    /// A service that runs the simulated engine for every opened room.
    pub fn new(node: Arc<PrefillNode>) -> PrefillService {
        PrefillService {
            node,
            drive_engine: true,
            revision: String::new(),
            planner: None,
            admitting: Arc::new(AtomicBool::new(true)),
            pages: None,
            snapshots: None,
            cp_group: None,
            cp_engine: None,
        }
    }

    /// This pod's place in its CP group, with the built-in engine or with its own engine.
    fn group_plan(&self) -> Option<&super::cp_group::GroupPlan> {
        match (&self.cp_group, &self.cp_engine) {
            (Some(g), _) => Some(g.plan()),
            (None, Some(g)) => Some(g.plan()),
            (None, None) => None,
        }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::transfer_server::TransferServer<PrefillService> {
        pb::transfer_server::TransferServer::new(self)
    }
}

fn abort_from(a: &pb::Abort) -> Result<(RoomKey, DecodeRank), Status> {
    let key = room_of(a.room).ok_or_else(|| Status::invalid_argument("abort without room"))?;
    Ok((key, DecodeRank(a.decode_rank)))
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::RoomEvent, Status>> + Send>>;
type SignalStream = Pin<Box<dyn Stream<Item = Result<pb::PeerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl Transfer for PrefillService {
    async fn peer_hello(
        &self,
        req: Request<pb::PeerInfo>,
    ) -> Result<Response<pb::PeerInfo>, Status> {
        let peer = req.into_inner();
        // Ready means wired (issue 18 item 3): a prefill that admits no room — still loading its
        // hot prefixes back, or draining — is no peer a decode may count towards its readiness.
        if !self.admitting.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "prefill is not admitting rooms (starting or draining)",
            ));
        }
        if self.node.engine_mode() && self.node.engine_side().is_none() {
            return Err(Status::unavailable(
                "no engine has attached to this prefill worker yet",
            ));
        }
        if !self.revision.is_empty() && !peer.revision.is_empty() && peer.revision != self.revision
        {
            tracing::warn!(decode = %peer.worker_id, theirs = %peer.revision, ours = %self.revision,
                "refusing a decode peer of another revision");
            let mut meta = tonic::metadata::MetadataMap::new();
            if let Ok(v) = self.revision.parse() {
                meta.insert(REVISION_HEADER, v);
            }
            return Err(Status::with_metadata(
                tonic::Code::FailedPrecondition,
                format!(
                    "revision mismatch: decode {:?}, prefill {:?}",
                    peer.revision, self.revision
                ),
                meta,
            ));
        }
        if let Some(l) = peer.layout
            && KvLayout::from(l) != self.node.cfg.layout
        {
            return Err(Status::failed_precondition(format!(
                "KV layout mismatch: decode {l:?}, prefill {:?}",
                self.node.cfg.layout
            )));
        }
        // A decode back as a new incarnation: its old incarnation's rooms go (issue 18).
        self.node.decode_hello(&peer.worker_id, peer.incarnation);
        Ok(Response::new(pb::PeerInfo {
            worker_id: self.node.cfg.worker_id.clone(),
            role: pb::Role::Prefill as i32,
            rank: self.node.cfg.rank,
            transport: pb::TransportKind::TransportTcp as i32,
            layout: Some(self.node.cfg.layout.into()),
            revision: self.revision.clone(),
            incarnation: self.node.incarnation,
            // A rank of a CP group names its place (the decode takes rooms to its leader only)
            // and the layers it stores; a prefill of one rank stores every layer.
            owned_layers: Some(match self.group_plan() {
                Some(p) => {
                    let (start, end) = p.owned_range();
                    pb::LayerRange { start, end }
                }
                None => pb::LayerRange {
                    start: 0,
                    end: self.node.cfg.layout.layers,
                },
            }),
            group: self.group_plan().map(|p| pb::CpGroup {
                cp_rank: p.cp_rank,
                cp_size: p.cp_size,
                layer_split: p.layer_split(),
            }),
            ..Default::default()
        }))
    }

    async fn open_room(
        &self,
        req: Request<pb::OpenRoomRequest>,
    ) -> Result<Response<pb::OpenRoomReply>, Status> {
        let r = req.into_inner();
        let key = room_of(r.room).ok_or_else(|| Status::invalid_argument("open without room"))?;
        if !self.admitting.load(Ordering::SeqCst) {
            return Err(Status::unavailable("prefill is draining"));
        }
        if let Some(plan) = self.group_plan() {
            if plan.cp_rank != 0 {
                return Err(Status::failed_precondition(
                    "a CP rank other than its group's leader takes no room: rooms go to CP rank 0",
                ));
            }
            let broken = match (&self.cp_group, &self.cp_engine) {
                (Some(g), _) => g.broken(),
                (None, Some(g)) => g.broken(),
                (None, None) => None,
            };
            if let Some(why) = broken {
                return Err(Status::unavailable(format!("CP group link broken: {why}")));
            }
        }
        let layout = r
            .layout
            .map(KvLayout::from)
            .ok_or_else(|| Status::invalid_argument("open without layout"))?;
        if layout != self.node.cfg.layout {
            return Err(Status::failed_precondition("KV layout mismatch"));
        }
        if r.dst_pages.is_empty() {
            return Err(Status::invalid_argument("room without destination pages"));
        }
        if self
            .node
            .stale_decode(&r.decode_worker, r.decode_incarnation)
        {
            return Err(Status::failed_precondition(format!(
                "decode {} incarnation {} was replaced by a newer one",
                r.decode_worker, r.decode_incarnation
            )));
        }
        let spec = r.request.clone().unwrap_or_default();
        let request = r.request.as_ref().map_or(key.room.0, |q| q.request_id);
        if self.node.engine_mode() {
            return self
                .open_engine_room(key, request, r)
                .await
                .map(Response::new);
        }
        {
            let mut rooms = lock(&self.node.rooms);
            rooms
                .open(key)
                .map_err(|e| Status::already_exists(e.to_string()))?;
            rooms
                .destination_ready(key)
                .map_err(|e| Status::failed_precondition(e.to_string()))?;
        }
        let pages = r.dst_pages.len() as u32;
        lock(&self.node.plans).insert(
            key,
            RoomPlan {
                decode_worker: r.decode_worker,
                data_addr: r.data_addr,
                region: RegionId(r.dst_region),
                pages: r.dst_pages,
                request,
                pages_done: 0,
                decode_rank: r.decode_rank,
                decode_incarnation: r.decode_incarnation,
                group_member: false,
            },
        );
        self.node.publish(key);
        let plan = match &self.planner {
            Some(planner) => {
                let (planner, spec) = (planner.clone(), spec.clone());
                tokio::task::spawn_blocking(move || planner.plan(&spec, layout, pages))
                    .await
                    .unwrap_or_default()
            }
            None => ComputePlan::default(),
        };
        let hits = plan.hits;
        if self.drive_engine {
            let node = self.node.clone();
            let planner = self.planner.clone();
            let pool = self.pages.clone();
            let group = self.cp_group.clone();
            let hold_until = tokio::time::Instant::now()
                + Duration::from_millis(if r.deadline_ms > 0 {
                    r.deadline_ms
                } else {
                    30_000
                });
            tokio::spawn(async move {
                let delays = plan.per_page.clone();
                // The room's pages of the prefill KV pool, held while it computes and sends.
                let held = match &pool {
                    Some(p) => {
                        let got = p.acquire(pages as usize, hold_until).await;
                        if got.is_none() {
                            tracing::warn!(%key, "prefill KV pool stayed full; computing without pool pages");
                        }
                        got
                    }
                    None => None,
                };
                let sent = match &group {
                    // A CP group computes it together; each rank writes its layers.
                    Some(group) => {
                        let compute = (0..pages)
                            .map(|i| {
                                delays
                                    .get(i as usize)
                                    .copied()
                                    .unwrap_or(node.cfg.compute_per_page)
                            })
                            .sum();
                        let (done, rx) = tokio::sync::oneshot::channel();
                        let job = super::cp_group::StepJob {
                            key,
                            request,
                            compute,
                            done,
                        };
                        match group.submit(job) {
                            Ok(()) => rx.await.unwrap_or(false),
                            Err(why) => {
                                node.fail_room(key, &why);
                                false
                            }
                        }
                    }
                    None => node.run_engine(key, pages, delays).await,
                };
                if let (Some(p), Some(held)) = (&pool, held) {
                    p.release(&held);
                }
                if sent && let Some(planner) = planner {
                    let _ = tokio::task::spawn_blocking(move || {
                        planner.computed(&spec, layout, &plan);
                    })
                    .await;
                }
            });
        }
        Ok(Response::new(pb::OpenRoomReply {
            room: Some(key.into()),
            prefill_rank: self.node.cfg.rank,
            result: None,
            hits: Some(hits),
            incarnation: self.node.incarnation,
        }))
    }

    async fn submit_chunk(
        &self,
        req: Request<pb::SubmitChunkRequest>,
    ) -> Result<Response<pb::OpResult>, Status> {
        let r = req.into_inner();
        let key = room_of(r.room).ok_or_else(|| Status::invalid_argument("chunk without room"))?;
        if self.node.engine_mode() {
            return Err(Status::failed_precondition(
                "this prefill worker serves through its engine: pages come from the engine's PagesReady",
            ));
        }
        let node = self.node.clone();
        tokio::task::spawn_blocking(move || node.submit_pages(key, r.first_page, r.pages, r.last))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::OpResult::default()))
    }

    async fn abort_room(
        &self,
        req: Request<pb::Abort>,
    ) -> Result<Response<pb::AbortTicket>, Status> {
        let worker = req
            .metadata()
            .get(WORKER_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let (key, rank) = abort_from(req.get_ref())?;
        let worker = lock(&self.node.plans)
            .get(&key)
            .map(|p| p.decode_worker.clone())
            .unwrap_or(worker);
        let acks = self.node.abort(key, rank, &worker);
        Ok(Response::new(pb::AbortTicket {
            room: Some(key.into()),
            immediate_ack: acks.first().map(ack_msg),
        }))
    }

    type WatchRoomStream = EventStream;

    async fn watch_room(
        &self,
        req: Request<pb::RoomRef>,
    ) -> Result<Response<Self::WatchRoomStream>, Status> {
        let key = RoomKey::from(req.into_inner());
        let rx = self.node.events.subscribe();
        let first = {
            let (state, outstanding) = self.node.room_view(key);
            pb::RoomEvent {
                room: Some(key.into()),
                state: state_code(state) as i32,
                outstanding,
            }
        };
        let want: pb::RoomRef = key.into();
        let updates =
            tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(move |e| match e {
                Ok(ev) if ev.room == Some(want) => Some(Ok(ev)),
                _ => None,
            });
        Ok(Response::new(Box::pin(
            tokio_stream::once(Ok(first)).chain(updates),
        )))
    }

    type SignalStream = SignalStream;

    async fn signal(
        &self,
        req: Request<Streaming<pb::PeerMessage>>,
    ) -> Result<Response<Self::SignalStream>, Status> {
        let worker = req
            .metadata()
            .get(WORKER_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "signal stream needs the {WORKER_ID_HEADER} header"
                ))
            })?
            .to_string();
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.node.peers).insert(worker.clone(), tx.clone());
        let node = self.node.clone();
        tokio::spawn(async move {
            let mut seq = 0u64;
            while let Some(Ok(m)) = inbound.next().await {
                match m.body {
                    Some(Body::Abort(a)) => match abort_from(&a) {
                        Ok((key, rank)) => {
                            node.abort(key, rank, &worker);
                        }
                        Err(e) => tracing::warn!(%e, "malformed abort ignored"),
                    },
                    Some(Body::Heartbeat(h)) => {
                        if node.stale_decode(&worker, h.incarnation) {
                            tracing::info!(decode = %worker, "signal stream of an old decode incarnation closed");
                            break;
                        }
                        seq += 1;
                        let live = lock(&node.plans).keys().map(|k| (*k).into()).collect();
                        let _ = tx.send(Ok(msg(Body::Heartbeat(pb::Heartbeat {
                            seq,
                            live_rooms: live,
                            incarnation: node.incarnation,
                        }))));
                    }
                    _ => {}
                }
            }
            // Only this stream's entry: a new incarnation's stream may have replaced it.
            let mut peers = lock(&node.peers);
            if peers.get(&worker).is_some_and(|t| t.same_channel(&tx)) {
                peers.remove(&worker);
            }
            drop(peers);
            tracing::info!(decode = %worker, "signal stream closed");
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn snapshot_prepare(
        &self,
        req: Request<pb::SnapshotPrepareRequest>,
    ) -> Result<Response<pb::SnapshotPrepareReply>, Status> {
        let r = req.into_inner();
        let Some(sync) = self.snapshots.clone() else {
            return Ok(Response::new(pb::SnapshotPrepareReply {
                outcome: pb::SnapshotOutcome::Disabled as i32,
                message: "this prefill has no snapshot buffer (memory.snapshotBufferBytes 0)"
                    .into(),
                ..Default::default()
            }));
        };
        if !self.admitting.load(Ordering::SeqCst) {
            return Err(Status::unavailable("prefill is not admitting"));
        }
        if r.page_keys.is_empty() {
            return Err(Status::invalid_argument("snapshot without page keys"));
        }
        tokio::task::spawn_blocking(move || sync.prepare(&r))
            .await
            .map(Response::new)
            .map_err(|e| Status::internal(e.to_string()))
    }

    async fn snapshot_seal(
        &self,
        req: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::SnapshotReply>, Status> {
        self.on_snapshot(req.into_inner(), super::snapshot_sync::SnapshotSync::seal)
            .await
    }

    async fn snapshot_abort(
        &self,
        req: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::SnapshotReply>, Status> {
        self.on_snapshot(req.into_inner(), super::snapshot_sync::SnapshotSync::abort)
            .await
    }
}

impl PrefillService {
    /// Runs a SnapshotSeal or SnapshotAbort `call` on the snapshot buffer, off the async runtime.
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` without a snapshot buffer; `INTERNAL` when the task died.
    async fn on_snapshot(
        &self,
        r: pb::SnapshotRef,
        call: fn(&super::snapshot_sync::SnapshotSync, pb::SnapshotRef) -> pb::SnapshotReply,
    ) -> Result<Response<pb::SnapshotReply>, Status> {
        let sync = self
            .snapshots
            .clone()
            .ok_or_else(|| Status::failed_precondition("no snapshot buffer"))?;
        tokio::task::spawn_blocking(move || call(&sync, r))
            .await
            .map(Response::new)
            .map_err(|e| Status::internal(e.to_string()))
    }
}
