//! LayerSplit CP groups whose ranks compute through their engines (DESIGN contract 6 and §3.1
//! "Snapshot and LayerSplit"; seed 004 "KV Cache 分层存储 LayerSplit"; issue 15). The built-in
//! engine's groups are [`super::cp_group`]; this is the same protocol with the compute in the
//! engine beside each worker.
//!
//! A prefill pod of a pool with `parallelism.context` C > 1, `layerSplit` and an `engine` is one CP
//! rank of a group. At start its ranks connect the rank link and agree on the owner map
//! ([`super::cp_group::connect`], R-LS-1) **before any pool is allocated**; then each worker
//! allocates a target pool of only its owned layers and one receive slot and tells its engine so
//! at Attach ([`crate::engine_api::LayerSplitSeat`]): the same host memory holds `layers / (owned
//! + 1)` times the pages of a replicated pool (seed 004's token-capacity gain).
//!
//! Rooms run one at a time per group, in the same order on every rank:
//! 1. The leader (CP rank 0, the group's one room peer) opens each room its decodes send in the
//!    sender table ([`PrefillSide::open_room`]) and queues it. It starts the next one once the
//!    running one is released: one outstanding part per member ([`PrefillSide::begin_part`]), so
//!    that neither success nor an abort ack leaves before every rank's writes are terminal (DESIGN
//!    contract 3); then the `Step` (room, request, the decode's data address and pages) to every
//!    member; then the work to its own engine.
//! 2. Every rank's engine goes through the model's layers in order. An owned layer: it writes the
//!    layer's chunks and says PagesReady for it; the worker writes them into the decode's pages and
//!    broadcasts them to the other ranks — the chunks of the room's pages only, the pages in use,
//!    never the whole layer ([`EngineGroup::broadcast`]). Another layer: the engine calls
//!    AwaitLayer, answered once the owner's frame has landed and been copied into the receive slot
//!    of the engine's pages ([`EngineGroup`]'s [`LayerGroup::await_layer`]); only then does it read
//!    the slot. At the end, a PagesReady with `last` and no pages ends the room's input.
//! 3. A member's room is released once its writes are terminal; its `StepDone` then closes its part
//!    at the leader ([`PrefillSide::end_part`]), failing the room first when that part failed. The
//!    leader's room succeeds — its decode gets the last `ChunkDone` — only once its own writes and
//!    every part landed; the decode verifies every chunk it received from every rank.
//!
//! A rank link that closes (a rank went away) breaks the group: the running and queued rooms fail
//! and the worker stops, so the group re-forms when its pods restart (as with the built-in
//! engine). Every wait is bounded: a layer by the group's wait deadline, a room by its deadline.
//!
//! Reported in `/report.cp_group` ([`EngineGroup::report`]): the rank, its owned layers, the pool's
//! pages and page bytes against the replicated layout's, broadcast bytes against a whole-layer
//! broadcast, waits and how many the engine's work hid. The chunks an engine read from its receive
//! slot that did not hold their layer's KV are the engine's own count (the simulated engine's
//! `layer_corrupt_chunks`, 0 unless its negative control `--skip-layer-wait` reads the slot without
//! waiting).

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tonic::{Code, Status};

use crate::engine_api::LayerSplitSeat;
use crate::engine_api::error::ApiError;
use crate::engine_api::pb;
use crate::engine_api::prefill::{LayerGroup, PrefillSide};
use crate::layer_split::receive::{Arrival, LayerReceiver};
use crate::layer_split::tcp_link::TcpRankLink;
use crate::layer_split::transport::RankLink;
use crate::layer_split::wire::{Frame, LayerFrame, StepDoneFrame, StepFrame};
use crate::layer_split::{LayerSplitError, OwnerMap};
use crate::memory::pool::{KvPool, PageId};
use crate::release::RoomKey;
use crate::release::sender::SenderState;

use super::cp_group::GroupPlan;
use super::node::PrefillNode;

/// Rooms queued at the leader beyond the running one: more are refused with `UNAVAILABLE` (the
/// decode retries another peer) rather than queued without bound.
const QUEUE_DEPTH: usize = 256;
/// How long the control thread waits for a frame before it looks at the link again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// One slice of a layer wait: the receiver's lock is given up between slices, so the control
/// thread takes `Step`/`StepDone` frames while a wait goes on.
const WAIT_SLICE: Duration = Duration::from_millis(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The room a group runs now.
#[derive(Debug, Clone)]
struct Current {
    step: u64,
    key: RoomKey,
    request: u64,
    /// Leader: the members whose `StepDone` has not come (their parts are open).
    parts: BTreeSet<u32>,
}

#[derive(Debug, Default)]
struct Steps {
    /// Leader: rooms opened and waiting for their step, in arrival order.
    queue: VecDeque<(RoomKey, pb::PrefillWork)>,
    current: Option<Current>,
    next_step: u64,
}

/// Counters of this rank (monotonic), read by `/report`.
#[derive(Debug, Default)]
struct Stats {
    steps: AtomicU64,
    step_failures: AtomicU64,
    frames_sent: AtomicU64,
    broadcast_payload_bytes: AtomicU64,
    broadcast_frame_bytes: AtomicU64,
    whole_layer_broadcast_bytes: AtomicU64,
    waits: AtomicU64,
    waits_hidden: AtomicU64,
    link_broken: AtomicBool,
    last_error: Mutex<Option<String>>,
}

/// This pod's rank of a LayerSplit group whose ranks compute through their engines.
pub struct EngineGroup {
    plan: GroupPlan,
    seat: LayerSplitSeat,
    link: TcpRankLink,
    receiver: Mutex<LayerReceiver>,
    node: Weak<PrefillNode>,
    steps: Mutex<Steps>,
    stats: Stats,
    wait_timeout: Duration,
    chunk_bytes: usize,
    broken_tx: tokio::sync::watch::Sender<Option<String>>,
    /// The worker's runtime: a member's room opens from the control thread inside it (its
    /// deadline is a runtime timer).
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for EngineGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineGroup")
            .field("cp_rank", &self.plan.cp_rank)
            .field("cp_size", &self.plan.cp_size)
            .field("owned", &self.seat.owned)
            .finish()
    }
}

/// The LayerSplit seat of `plan`'s rank: its owned layers, which must be one contiguous range (the
/// engine's pool holds them in order before the receive slot).
///
/// # Errors
/// A text reason for a replicated plan or an owner map that gives this rank several ranges.
pub fn seat_of(plan: &GroupPlan) -> Result<LayerSplitSeat, String> {
    let map = plan
        .map
        .as_ref()
        .ok_or("a CP group with an engine runs only under layerSplit")?;
    let ranges = map.owned_ranges(plan.cp_rank);
    let [owned] = ranges.as_slice() else {
        return Err(format!(
            "CP rank {} owns {} layer ranges; an engine rank needs one contiguous range (its pool \
             holds the owned layers in order)",
            plan.cp_rank,
            ranges.len()
        ));
    };
    Ok(LayerSplitSeat {
        cp_rank: plan.cp_rank,
        cp_size: plan.cp_size,
        model_layers: plan.layers,
        owned: owned.clone(),
    })
}

/// A LayerSplit rank's connected rank link, before its engine seat is allocated ([`connect`]).
pub struct Connected {
    /// This pod's place in its group.
    pub plan: GroupPlan,
    /// Its seat: the owned layers its engine's pool holds.
    pub seat: LayerSplitSeat,
    link: TcpRankLink,
    receiver: LayerReceiver,
}

/// Connects a LayerSplit rank whose engine computes: its seat (the owned layers, one contiguous
/// range), then the rank link and the owner-map handshake ([`super::cp_group::connect`], bounded by
/// the group's connect deadline) — before the pools are allocated, so ranks on different maps
/// refuse each other with nothing allocated (R-LS-1). The receiver's scratch holds one layer of the
/// rank's pool (its page count under the seat: `api` is the seat's engine-API settings without
/// `layer_split`, which this fills in). Blocking: call it from a blocking context.
///
/// # Errors
/// A text reason: a non-contiguous owned range, pools that cannot be sized, a group that does not
/// connect or runs another owner map.
pub fn connect(
    plan: GroupPlan,
    mut api: crate::engine_api::EngineApiConfig,
    cfg: &crate::config::WorkerConfig,
    layout: crate::control::KvLayout,
    resolver: &crate::roles::resolve::Resolver,
    runtime: &tokio::runtime::Handle,
) -> Result<Connected, String> {
    let seat = seat_of(&plan)?;
    api.layer_split = Some(seat.clone());
    let pages = crate::engine_api::pools::PoolSet::page_count(cfg, &api)
        .map_err(|e| format!("sizing the rank's pool: {e}"))?;
    let timeout = super::cp_group::GroupOptions::default().connect_timeout;
    let (link, receiver) = super::cp_group::connect(
        &plan,
        resolver,
        runtime,
        timeout,
        pages,
        layout.chunk_bytes() as usize,
    )?;
    Ok(Connected {
        plan,
        seat,
        link,
        receiver,
    })
}

impl EngineGroup {
    /// The group over a [`Connected`] link, with its control thread started. `chunk_bytes` is one
    /// (page, layer) chunk of the transfer layout; `wait_timeout` bounds each layer wait; a
    /// member's rooms open inside `runtime`.
    ///
    /// # Errors
    /// A text reason when the control thread cannot start.
    pub fn start(
        connected: Connected,
        node: &Arc<PrefillNode>,
        chunk_bytes: usize,
        wait_timeout: Duration,
        runtime: tokio::runtime::Handle,
    ) -> Result<Arc<Self>, String> {
        let Connected {
            plan,
            seat,
            link,
            receiver,
        } = connected;
        let (broken_tx, _) = tokio::sync::watch::channel(None);
        let group = Arc::new(Self {
            plan,
            seat,
            link,
            receiver: Mutex::new(receiver),
            node: Arc::downgrade(node),
            steps: Mutex::new(Steps::default()),
            stats: Stats::default(),
            wait_timeout,
            chunk_bytes,
            broken_tx,
            runtime,
        });
        let weak = Arc::downgrade(&group);
        std::thread::Builder::new()
            .name(format!("cp-engine-rank{}", group.plan.cp_rank))
            .spawn(move || {
                while let Some(g) = weak.upgrade() {
                    if !g.tick() {
                        break;
                    }
                }
            })
            .map_err(|e| format!("starting the CP group's control thread: {e}"))?;
        tracing::info!(cp_rank = group.plan.cp_rank, cp_size = group.plan.cp_size,
            owned = ?group.seat.owned, "CP group connected; its ranks compute through their engines");
        Ok(group)
    }

    /// This rank's place in its group.
    pub fn plan(&self) -> &GroupPlan {
        &self.plan
    }

    /// Whether this rank is its group's leader (CP rank 0: the group's room peer).
    pub fn is_leader(&self) -> bool {
        self.plan.cp_rank == 0
    }

    /// Why the group broke, once it has.
    pub fn broken(&self) -> Option<String> {
        self.stats
            .link_broken
            .load(Ordering::SeqCst)
            .then(|| lock(&self.stats.last_error).clone().unwrap_or_default())
    }

    /// Resolves with the reason once the group breaks (the server then stops the worker, so the
    /// group re-forms when its pods restart).
    pub async fn broken_signal(&self) -> String {
        let mut rx = self.broken_tx.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone().unwrap_or_default(),
            Err(_) => "the CP group stopped".into(),
        }
    }

    fn side(&self) -> Option<Arc<PrefillSide>> {
        self.node.upgrade()?.engine_side()
    }

    /// The ranks other than the leader.
    fn members(&self) -> Vec<u32> {
        (1..self.plan.cp_size).collect()
    }

    /// The ranks other than this one.
    fn peers(&self) -> Vec<u32> {
        (0..self.plan.cp_size)
            .filter(|r| *r != self.plan.cp_rank)
            .collect()
    }

    /// The running room's step, when it is `key`.
    fn step_of(&self, key: RoomKey) -> Option<(u64, u64)> {
        lock(&self.steps)
            .current
            .as_ref()
            .filter(|c| c.key == key)
            .map(|c| (c.step, c.request))
    }

    /// Leader: a decode opened `work.room` (its plan is recorded at the node): the room opens in
    /// the sender table and waits for its step.
    ///
    /// # Errors
    /// `UNAVAILABLE`: the group is broken, no engine is attached, or the queue is full.
    pub fn open(&self, work: pb::PrefillWork) -> Result<(), Status> {
        if let Some(why) = self.broken() {
            return Err(Status::unavailable(format!("CP group broken: {why}")));
        }
        let side = self
            .side()
            .ok_or_else(|| Status::unavailable("no engine has attached to this prefill worker"))?;
        let key: RoomKey = work
            .room
            .ok_or_else(|| Status::invalid_argument("work without room"))?
            .into();
        if lock(&self.steps).queue.len() >= QUEUE_DEPTH {
            return Err(Status::unavailable(format!(
                "{QUEUE_DEPTH} rooms already queued for the CP group"
            )));
        }
        side.open_room(&work)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        lock(&self.steps).queue.push_back((key, work));
        self.start_next(&side);
        Ok(())
    }

    /// Leader: starts the next queued room that is still live, unless one runs.
    fn start_next(&self, side: &Arc<PrefillSide>) {
        loop {
            let (key, work) = {
                let mut st = lock(&self.steps);
                if st.current.is_some() {
                    return;
                }
                let Some(next) = st.queue.pop_front() else {
                    return;
                };
                next
            };
            // A room that failed while it queued (an abort, its deadline): nothing to compute.
            if !matches!(
                side.room_state(key),
                Some(
                    SenderState::Bootstrapping
                        | SenderState::WaitingForInput
                        | SenderState::Transferring
                )
            ) {
                continue;
            }
            let Some(node) = self.node.upgrade() else {
                return;
            };
            let Some((data_addr, region, dst_pages)) = node.room_destination(key) else {
                continue;
            };
            // 1. One open part per member before any of them can write.
            let members = self.members();
            let mut begun = 0;
            for _ in &members {
                if side.begin_part(key).is_err() {
                    break;
                }
                begun += 1;
            }
            if begun < members.len() {
                // The room failed meanwhile: nothing was sent for it.
                for _ in 0..begun {
                    side.end_part(key, true);
                }
                continue;
            }
            let step = {
                let mut st = lock(&self.steps);
                st.next_step += 1;
                let step = st.next_step;
                st.current = Some(Current {
                    step,
                    key,
                    request: work.request_id,
                    parts: members.iter().copied().collect(),
                });
                step
            };
            lock(&self.receiver).forget_before(step);
            self.stats.steps.fetch_add(1, Ordering::Relaxed);
            // 2. The step order.
            let frame = Frame::Step(StepFrame {
                step,
                request: work.request_id,
                room: key.room.0,
                generation: key.generation.0,
                region: region.0,
                dst_pages,
                data_addr,
            })
            .encode();
            for m in &members {
                if let Err(e) = self.link.send(*m, frame.clone()) {
                    self.broke(&format!("the step order did not reach CP rank {m}: {e}"));
                    return;
                }
            }
            // 3. This rank's own engine.
            side.emit_work(work);
            return;
        }
    }

    /// The room `key` is released on this rank (terminal, no write of it can still land; `sent`
    /// when it succeeded). The leader starts its next room; a member reports its part done.
    pub fn released(&self, key: RoomKey, sent: bool) {
        let current = {
            let mut st = lock(&self.steps);
            match &st.current {
                Some(c) if c.key == key => st.current.take(),
                _ => None,
            }
        };
        let Some(current) = current else {
            return;
        };
        if !sent {
            self.stats.step_failures.fetch_add(1, Ordering::Relaxed);
        }
        if self.is_leader() {
            if let Some(side) = self.side() {
                self.start_next(&side);
            }
            return;
        }
        let done = StepDoneFrame {
            from: self.plan.cp_rank,
            step: current.step,
            ok: sent,
            kv_bytes: 0,
            reason: if sent {
                String::new()
            } else {
                format!(
                    "CP rank {}: its part of {key} failed (see its log)",
                    self.plan.cp_rank
                )
            },
        };
        if let Err(e) = self.link.send(0, Frame::StepDone(done).encode()) {
            self.broke(&format!("the step report did not reach the leader: {e}"));
        }
    }

    /// Member: the leader's order to run a step. The room opens at the node (its plan from the
    /// frame) and goes to the engine; a room that cannot open is reported failed at once.
    fn member_step(&self, s: StepFrame) {
        let key = RoomKey::new(s.room, s.generation);
        {
            let mut st = lock(&self.steps);
            if let Some(c) = &st.current {
                tracing::warn!(
                    running = c.step,
                    next = s.step,
                    "a step came while another runs here; the running one is dropped"
                );
            }
            st.current = Some(Current {
                step: s.step,
                key,
                request: s.request,
                parts: BTreeSet::new(),
            });
        }
        lock(&self.receiver).forget_before(s.step);
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let opened = match self.node.upgrade() {
            Some(node) => {
                let _rt = self.runtime.enter();
                node.member_open(key, &s)
            }
            None => Err(Status::unavailable("the prefill node is gone")),
        };
        if let Err(status) = opened {
            lock(&self.steps).current = None;
            self.note_error(format!("step {} ({key}): {}", s.step, status.message()));
            let done = StepDoneFrame {
                from: self.plan.cp_rank,
                step: s.step,
                ok: false,
                kv_bytes: 0,
                reason: format!(
                    "CP rank {} could not open {key}: {}",
                    self.plan.cp_rank,
                    status.message()
                ),
            };
            if let Err(e) = self.link.send(0, Frame::StepDone(done).encode()) {
                self.broke(&format!("the step report did not reach the leader: {e}"));
            }
        }
    }

    /// Leader: a member's part of the running step is terminal.
    fn part_done(&self, d: StepDoneFrame) {
        let key = {
            let mut st = lock(&self.steps);
            let open = st
                .current
                .as_mut()
                .filter(|c| c.step == d.step)
                .and_then(|c| c.parts.remove(&d.from).then_some(c.key));
            let Some(key) = open else {
                tracing::debug!(
                    step = d.step,
                    from = d.from,
                    "StepDone of no open part; dropped"
                );
                return;
            };
            key
        };
        let Some(side) = self.side() else {
            return;
        };
        if !d.ok {
            self.note_error(d.reason.clone());
            side.fail_with(key, &d.reason);
        }
        side.end_part(key, d.ok);
    }

    /// Broadcasts the owned `layers` of the room's pages, read from `pool` (`pages`: the engine's
    /// source pages, room page k at index k), to every other rank: one frame per layer, tagged with
    /// the running step. Called for each accepted PagesReady of a LayerSplit room, before its pages
    /// go to the decode.
    ///
    /// # Errors
    /// A text reason: `key` is not the running room, the call does not name every page of the room
    /// from page 0 (each owned layer is broadcast once), a layer is not owned, a chunk cannot be
    /// read, or a peer's stream is gone (the group breaks).
    pub fn broadcast(
        &self,
        key: RoomKey,
        pool: &KvPool,
        pages: &[u32],
        first_page: u32,
        layers: Range<u32>,
        room_pages: usize,
    ) -> Result<(), String> {
        let (step, request) = self
            .step_of(key)
            .ok_or_else(|| format!("{key} is not the CP group's running room"))?;
        if first_page != 0 || pages.len() != room_pages {
            return Err(format!(
                "a LayerSplit rank says PagesReady for an owned layer once, naming every page of \
                 the room from page 0 (the layer is broadcast whole): {} of {room_pages} pages \
                 from page {first_page}",
                pages.len()
            ));
        }
        let chunk = self.chunk_bytes;
        let peers = self.peers();
        for layer in layers {
            let pool_layer = self.seat.pool_layer(layer).ok_or_else(|| {
                format!(
                    "layer {layer} is not owned by CP rank {}",
                    self.plan.cp_rank
                )
            })?;
            let mut payload = vec![0u8; pages.len() * chunk];
            for (k, &p) in pages.iter().enumerate() {
                read_engine_chunk(
                    pool,
                    p,
                    pool_layer,
                    &mut payload[k * chunk..(k + 1) * chunk],
                )
                .map_err(|e| format!("reading page {p} layer {layer}: {e}"))?;
            }
            let payload_len = payload.len() as u64;
            let frame = Frame::Layer(LayerFrame {
                from: self.plan.cp_rank,
                step,
                request,
                layer,
                chunk_bytes: chunk as u32,
                pages: (0..pages.len() as u32).collect(),
                payload,
            })
            .encode();
            for &peer in &peers {
                let bytes = frame.len() as u64;
                if let Err(e) = self.link.send(peer, frame.clone()) {
                    let why = format!("broadcasting layer {layer} to CP rank {peer}: {e}");
                    self.broke(&why);
                    return Err(why);
                }
                let s = &self.stats;
                s.frames_sent.fetch_add(1, Ordering::Relaxed);
                s.broadcast_payload_bytes
                    .fetch_add(payload_len, Ordering::Relaxed);
                s.broadcast_frame_bytes.fetch_add(bytes, Ordering::Relaxed);
                // What a whole-layer broadcast would have moved: every page of the pool's layer.
                s.whole_layer_broadcast_bytes.fetch_add(
                    u64::from(pool.geometry().pages) * chunk as u64,
                    Ordering::Relaxed,
                );
            }
        }
        Ok(())
    }

    /// One turn of the control thread: the link's health, then one `Step` or `StepDone` frame if
    /// one came. Returns false once the thread should end (the group broke).
    fn tick(&self) -> bool {
        let closed = self.link.closed_peers();
        if !closed.is_empty() {
            self.broke(&format!("CP ranks {closed:?} closed their rank link"));
        }
        if self.stats.link_broken.load(Ordering::SeqCst) {
            return false;
        }
        let next = lock(&self.receiver).next_control(&self.link, IDLE_POLL);
        match next {
            Ok(Some(Frame::Step(s))) if !self.is_leader() => self.member_step(s),
            Ok(Some(Frame::StepDone(d))) if self.is_leader() => self.part_done(d),
            Ok(Some(f)) => tracing::debug!(?f, "unexpected frame on the rank link; dropped"),
            Ok(None) => {}
            Err(LayerSplitError::Transport { reason, .. }) => self.broke(&reason),
            Err(e) => tracing::warn!(error = %e, "bad frame on the rank link; dropped"),
        }
        true
    }

    fn note_error(&self, what: String) {
        self.stats.step_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %what, "CP group step failed");
        *lock(&self.stats.last_error) = Some(what);
    }

    /// The group is broken (once): the running and queued rooms fail, open parts close failed, and
    /// the server is told (it stops the worker so that the group re-forms).
    fn broke(&self, why: &str) {
        if self.stats.link_broken.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::error!(error = %why, "CP group broken; rooms fail until the group re-forms");
        *lock(&self.stats.last_error) = Some(why.to_owned());
        let _ = self.broken_tx.send(Some(why.to_owned()));
        let (current, queued) = {
            let mut st = lock(&self.steps);
            (st.current.take(), std::mem::take(&mut st.queue))
        };
        let Some(side) = self.side() else {
            return;
        };
        let reason = format!("the CP group is broken ({why}); restarting");
        if let Some(c) = current {
            side.fail_with(c.key, &reason);
            for _ in &c.parts {
                side.end_part(c.key, false);
            }
        }
        for (key, _) in queued {
            side.fail_with(key, &reason);
        }
    }

    /// `/report.cp_group`: the rank and layout, the pool's pages and page bytes against the
    /// replicated layout's, the receive slot, broadcast bytes against a whole-layer broadcast,
    /// waits (and how many the engine's work hid), steps and failures.
    pub fn report(&self) -> Value {
        let s = &self.stats;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let chunk = self.chunk_bytes as u64;
        let pool_pages = self
            .side()
            .and_then(|side| side.pools().first().map(|p| p.geometry().pages))
            .unwrap_or(0);
        let owned = u64::from(self.seat.owned.end - self.seat.owned.start);
        let (queued, running) = {
            let st = lock(&self.steps);
            (st.queue.len(), st.current.as_ref().map(|c| c.step))
        };
        json!({
            "cp_rank": self.plan.cp_rank,
            "cp_size": self.plan.cp_size,
            "tp_rank": self.plan.tp_rank,
            "leader": self.is_leader(),
            "layout": "layer_split",
            "engine": true,
            "owned_layers": [[self.seat.owned.start, self.seat.owned.end]],
            "owner_map_digest": format!("{:016x}", self.plan.map.as_ref().map_or(0, OwnerMap::digest)),
            "pool_pages": pool_pages,
            "page_bytes": (owned + 1) * chunk,
            "replicated_page_bytes": u64::from(self.seat.model_layers) * chunk,
            "stored_kv_bytes": u64::from(pool_pages) * owned * chunk,
            "replicated_kv_bytes": u64::from(pool_pages) * u64::from(self.seat.model_layers) * chunk,
            "receive_slot_bytes": u64::from(pool_pages) * chunk,
            "steps": n(&s.steps),
            "step_failures": n(&s.step_failures),
            "rooms_queued": queued,
            "running_step": running,
            "frames_sent": n(&s.frames_sent),
            "broadcast_payload_bytes": n(&s.broadcast_payload_bytes),
            "broadcast_frame_bytes": n(&s.broadcast_frame_bytes),
            "whole_layer_broadcast_bytes": n(&s.whole_layer_broadcast_bytes),
            "waits": n(&s.waits),
            "waits_hidden": n(&s.waits_hidden),
            "link_broken": s.link_broken.load(Ordering::SeqCst),
            "last_error": *lock(&s.last_error),
        })
    }
}

/// Copies the chunk of the engine's `page` on pool layer `layer` into `dst`. The engine allocates
/// its own pages (the worker's page table does not know them), so this goes by the chunk's
/// address, like the transport's views of PagesReady pages.
fn read_engine_chunk(pool: &KvPool, page: u32, layer: u32, dst: &mut [u8]) -> Result<(), String> {
    let r = pool
        .chunk_region(PageId(page), layer)
        .map_err(|e| e.to_string())?;
    if r.len != dst.len() {
        return Err(format!("chunk of {} B, buffer of {} B", r.len, dst.len()));
    }
    let base = pool.buffer().host_ptr().map_err(|e| e.to_string())?;
    // SAFETY: `r` is a chunk of the pool's live mapping (checked by `chunk_region`). The engine
    // named `page` in a PagesReady and does not write it before its SourceFree.
    unsafe { std::ptr::copy_nonoverlapping(base.add(r.offset), dst.as_mut_ptr(), r.len) };
    Ok(())
}

/// Copies `src` into the chunk of the engine's `page` on pool layer `layer` (the receive slot).
fn write_engine_chunk(pool: &KvPool, page: u32, layer: u32, src: &[u8]) -> Result<(), String> {
    let r = pool
        .chunk_region(PageId(page), layer)
        .map_err(|e| e.to_string())?;
    if r.len != src.len() {
        return Err(format!("chunk of {} B, source of {} B", r.len, src.len()));
    }
    let base = pool.buffer().host_ptr().map_err(|e| e.to_string())?;
    // SAFETY: `r` is a chunk of the pool's live mapping (checked by `chunk_region`). The engine
    // named `page` in its AwaitLayer and reads the slot only after the answer (engine.proto).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(r.offset), r.len) };
    Ok(())
}

fn group_error(code: Code, reason: pb::ErrorReason, message: String) -> ApiError {
    ApiError::new(code, reason, message)
}

impl LayerGroup for EngineGroup {
    fn await_layer(
        &self,
        key: RoomKey,
        layer: u32,
        pages: &[u32],
        target: &KvPool,
    ) -> Result<(u32, bool), ApiError> {
        let (step, _) = self.step_of(key).ok_or_else(|| {
            group_error(
                Code::NotFound,
                pb::ErrorReason::UnknownRoom,
                format!("{key} is not the CP group's running room"),
            )
            .field("room")
        })?;
        let slot = self.seat.receive_slot();
        let deadline = Instant::now() + self.wait_timeout;
        let mut first = true;
        loop {
            if let Some(why) = self.broken() {
                return Err(group_error(
                    Code::Unavailable,
                    pb::ErrorReason::GroupBroken,
                    format!("CP group broken: {why}"),
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(group_error(
                    Code::DeadlineExceeded,
                    pb::ErrorReason::DeadlineExceeded,
                    format!(
                        "layer {layer} of {key} (step {step}) was not broadcast within {} ms",
                        self.wait_timeout.as_millis()
                    ),
                ));
            }
            let mut rx = lock(&self.receiver);
            match rx.wait(&self.link, step, layer, left.min(WAIT_SLICE)) {
                Ok(arrival) => {
                    let room_pages = rx.scratch_pages().to_vec();
                    if let Some(k) = room_pages.iter().find(|k| **k as usize >= pages.len()) {
                        return Err(ApiError::malformed(
                            "pages",
                            format!(
                                "the owner broadcast room page {k}; the call names {} pages",
                                pages.len()
                            ),
                        ));
                    }
                    for &k in &room_pages {
                        let chunk = rx.chunk(k).map_err(|e| ApiError::internal(e.to_string()))?;
                        write_engine_chunk(target, pages[k as usize], slot, chunk)
                            .map_err(ApiError::internal)?;
                    }
                    drop(rx);
                    let hidden = first && arrival == Arrival::AlreadyThere;
                    self.stats.waits.fetch_add(1, Ordering::Relaxed);
                    if hidden {
                        self.stats.waits_hidden.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok((room_pages.len() as u32, hidden));
                }
                Err(LayerSplitError::BroadcastTimeout { .. }) => {}
                Err(e @ LayerSplitError::NeverBroadcast { .. }) => {
                    drop(rx);
                    let why = e.to_string();
                    self.broke(&why);
                    return Err(group_error(
                        Code::Unavailable,
                        pb::ErrorReason::GroupBroken,
                        why,
                    ));
                }
                Err(e) => {
                    // A bad frame of a peer (dropped by the receiver): keep waiting for the one
                    // this call needs.
                    tracing::warn!(error = %e, step, layer, "bad frame while waiting for a layer");
                }
            }
            first = false;
        }
    }
}
