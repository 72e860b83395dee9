//! LayerSplit CP groups whose ranks compute through their engines (DESIGN contract 6 and §3.1
//! "Snapshot and LayerSplit"; seed 004 "KV Cache 分层存储 LayerSplit"; issue 15). The built-in
//! engine's groups are [`super::cp_group`]; this is the same protocol with the compute in the
//! engine beside each worker.
//!
//! A prefill pod of a pool with `parallelism.context` C > 1, `layerSplit` and a Simulated `engine`
//! is one CP rank of a group. At start its ranks connect the rank link and agree on the owner map
//! ([`connect`], R-LS-1) **before any pool is allocated**; then each worker allocates a target pool
//! of the group's largest owned range and one receive slot and tells its engine so at Attach
//! ([`crate::engine_api::LayerSplitSeat`]): the same host memory holds `layers / (max owned + 1)`
//! times the pages of a replicated pool (seed 004's token-capacity gain), the same on every rank.
//!
//! Rooms run one at a time per group, in the same order on every rank:
//! 1. The leader (CP rank 0, the group's one room peer) opens each room its decodes send in the
//!    sender table ([`PrefillSide::open_room`]) and queues it. It starts the next one once the
//!    running one is released — the slot is taken under one lock with the pop, so two rooms never
//!    run at once: one outstanding part per member ([`PrefillSide::begin_part`]), so that neither
//!    success nor an abort ack leaves before every rank's writes are terminal (DESIGN contract 3);
//!    then the `Step` (room, request, the decode's data address and pages) to every member; then
//!    the work to its own engine.
//! 2. Every rank's engine goes through the model's layers in order. An owned layer: it writes the
//!    layer's chunks and says PagesReady for it; the worker writes them into the decode's pages and
//!    broadcasts them to the other ranks — the chunks of the room's pages only, the pages in use,
//!    never the whole layer ([`EngineGroup::broadcast`]). Another layer: the engine calls
//!    AwaitLayer, answered once the owner's frame has been accepted and copied into the receive
//!    slot of the engine's pages ([`LayerGroup::await_layer`]); only then does it read the slot.
//!    At the end, a PagesReady with `last` and no pages ends the room's input (refused until every
//!    owned layer was sent).
//! 3. A member's room is released once its writes are terminal; its `StepDone` then closes its part
//!    at the leader ([`PrefillSide::end_part`]), failing the room first when that part failed. The
//!    leader's room succeeds — its decode gets the last `ChunkDone` — only once its own writes and
//!    every part landed; the decode verifies every chunk it received from every rank. A part closes
//!    only on its `StepDone`, however late (until then that rank's writes may still land).
//! 4. When the leader's room fails mid-step (the decode aborts it, its deadline, its engine went
//!    away) the leader sends `StepAbort`: each member fails its room at once (its engine's next
//!    call is refused), and its `StepDone` follows when its writes are terminal. A member whose
//!    AwaitLayer fails (the broadcast did not come in time) fails its room the same way.
//!
//! One thread per rank reads the rank link ([`EngineGroup::tick`]): layer frames wait in the
//! receiver for their AwaitLayer (woken through a condition variable, never by reading the link
//! themselves), `Step`, `StepDone` and `StepAbort` are handled as they come. A link that closes (a
//! rank went away) breaks the group: the running and queued rooms fail — the running room's open
//! parts stay open, since a member still alive may still write — and the worker stops, so the group
//! re-forms when its pods restart (as with the built-in engine). Waits are bounded: a layer by the
//! group's wait deadline and the call's, a member's room by its deadline, a room's parts by the
//! members' rooms.
//!
//! Reported in `/report.cp_group` ([`EngineGroup::report`]): the rank, its owned layers, the pool's
//! pages and page bytes against the replicated layout's, broadcast bytes against a whole-layer
//! broadcast, waits and how many the engine's work hid. The chunks an engine read from its receive
//! slot that did not hold their layer's KV are the engine's own count (the simulated engine's
//! `layer_corrupt_chunks`, 0 unless its negative control `--skip-layer-wait` reads the slot without
//! waiting).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tonic::{Code, Status};

use crate::engine_api::LayerSplitSeat;
use crate::engine_api::error::ApiError;
use crate::engine_api::pb;
use crate::engine_api::prefill::{LayerGroup, PrefillSide};
use crate::layer_split::OwnerMap;
use crate::layer_split::receive::LayerReceiver;
use crate::layer_split::tcp_link::TcpRankLink;
use crate::layer_split::transport::{RankLink, Received};
use crate::layer_split::wire::{Frame, LayerFrame, StepDoneFrame, StepFrame};
use crate::memory::pool::{KvPool, PageId};
use crate::release::RoomKey;
use crate::release::sender::SenderState;

use super::cp_group::GroupPlan;
use super::node::PrefillNode;

/// Rooms queued at the leader beyond the running one: more are refused with `UNAVAILABLE` (the
/// decode retries another peer) rather than queued without bound.
const QUEUE_DEPTH: usize = 256;
/// How long the reader thread waits for a frame before it looks at the link's health again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// Longest a layer wait sleeps before it looks at its room and the group again.
const WAIT_SLICE: Duration = Duration::from_millis(50);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The leader's running step.
#[derive(Debug, Clone)]
struct Current {
    step: u64,
    key: RoomKey,
    /// The members whose `StepDone` has not come (their parts are open).
    parts: BTreeSet<u32>,
    /// `StepAbort` went to the members.
    aborted: bool,
}

#[derive(Debug, Default)]
struct Steps {
    /// Leader: rooms opened and waiting for their step, in arrival order.
    queue: VecDeque<(RoomKey, pb::PrefillWork)>,
    /// Leader: the running step (the slot is taken in the same critical section as the pop).
    current: Option<Current>,
    next_step: u64,
    /// Every rank: the rooms running here as a step, `room → (step, request)` (AwaitLayer, the
    /// broadcasts, a member's `StepDone`).
    rooms: HashMap<RoomKey, (u64, u64)>,
}

/// Counters of this rank (monotonic), read by `/report`.
#[derive(Debug, Default)]
struct Stats {
    steps: AtomicU64,
    step_failures: AtomicU64,
    steps_aborted: AtomicU64,
    frames_sent: AtomicU64,
    broadcast_payload_bytes: AtomicU64,
    broadcast_frame_bytes: AtomicU64,
    whole_layer_broadcast_bytes: AtomicU64,
    waits: AtomicU64,
    waits_hidden: AtomicU64,
    wait_failures: AtomicU64,
    link_broken: AtomicBool,
    last_error: Mutex<Option<String>>,
}

/// This pod's rank of a LayerSplit group whose ranks compute through their engines.
pub struct EngineGroup {
    plan: GroupPlan,
    seat: LayerSplitSeat,
    link: TcpRankLink,
    /// Layer frames kept for their waits, control frames for the reader thread; only the reader
    /// thread reads the link.
    receiver: Mutex<LayerReceiver>,
    /// Signalled whenever the reader thread accepted a frame (a layer wait looks again).
    arrived: Condvar,
    node: Weak<PrefillNode>,
    steps: Mutex<Steps>,
    stats: Stats,
    wait_timeout: Duration,
    chunk_bytes: usize,
    broken_tx: tokio::sync::watch::Sender<Option<String>>,
    /// The worker's runtime: a member's room opens from the reader thread inside it (its deadline
    /// is a runtime timer).
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
/// engine's pool holds them in order before the receive slot), and the group's largest share.
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
    let max_owned = (0..plan.cp_size)
        .map(|r| map.owned(r).len() as u32)
        .max()
        .unwrap_or(0);
    Ok(LayerSplitSeat {
        cp_rank: plan.cp_rank,
        cp_size: plan.cp_size,
        model_layers: plan.layers,
        owned: owned.clone(),
        max_owned,
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
    /// The group over a [`Connected`] link, with its reader thread started. `chunk_bytes` is one
    /// (page, layer) chunk of the transfer layout; `wait_timeout` bounds each layer wait; a
    /// member's rooms open inside `runtime`.
    ///
    /// # Errors
    /// A text reason when the reader thread cannot start.
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
            arrived: Condvar::new(),
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
            .map_err(|e| format!("starting the CP group's reader thread: {e}"))?;
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

    /// The step and request of `key`, while it runs here.
    fn step_of(&self, key: RoomKey) -> Option<(u64, u64)> {
        lock(&self.steps).rooms.get(&key).copied()
    }

    /// Leader: a decode opened `work.room` (its plan is recorded at the node): the room opens in
    /// the sender table and waits for its step.
    ///
    /// # Errors
    /// `UNAVAILABLE`: the group is broken, no engine is attached, or the queue is full.
    pub fn open(&self, work: pb::PrefillWork) -> Result<(), Status> {
        let side = self
            .side()
            .ok_or_else(|| Status::unavailable("no engine has attached to this prefill worker"))?;
        let key: RoomKey = work
            .room
            .ok_or_else(|| Status::invalid_argument("work without room"))?
            .into();
        {
            // Under the lock that `broke` drains the queue under: a room is either refused here
            // or failed there, never left in a queue nobody serves.
            let mut st = lock(&self.steps);
            if let Some(why) = self.broken() {
                return Err(Status::unavailable(format!("CP group broken: {why}")));
            }
            if st.queue.len() >= QUEUE_DEPTH {
                return Err(Status::unavailable(format!(
                    "{QUEUE_DEPTH} rooms already queued for the CP group"
                )));
            }
            side.open_room(&work)
                .map_err(|e| Status::unavailable(e.to_string()))?;
            st.queue.push_back((key, work));
        }
        self.start_next(&side);
        Ok(())
    }

    /// Leader: starts the next queued room that is still live, unless one runs. The slot is taken
    /// together with the pop, so concurrent callers (OpenRoom handlers, release callbacks) never
    /// start two rooms.
    fn start_next(&self, side: &Arc<PrefillSide>) {
        let members = self.members();
        loop {
            let (key, work, step) = {
                let mut st = lock(&self.steps);
                if st.current.is_some() || self.stats.link_broken.load(Ordering::SeqCst) {
                    return;
                }
                let Some((key, work)) = st.queue.pop_front() else {
                    return;
                };
                st.next_step += 1;
                let step = st.next_step;
                st.current = Some(Current {
                    step,
                    key,
                    parts: members.iter().copied().collect(),
                    aborted: false,
                });
                st.rooms.insert(key, (step, work.request_id));
                (key, work, step)
            };
            // Gives the slot back when the room cannot start (it failed while it queued).
            let abandon = || {
                let mut st = lock(&self.steps);
                if st.current.as_ref().is_some_and(|c| c.step == step) {
                    st.current = None;
                }
                st.rooms.remove(&key);
            };
            let live = matches!(
                side.room_state(key),
                Some(
                    SenderState::Bootstrapping
                        | SenderState::WaitingForInput
                        | SenderState::Transferring
                )
            );
            let dest = self.node.upgrade().and_then(|n| n.room_destination(key));
            let Some((data_addr, region, dst_pages)) = dest.filter(|_| live) else {
                abandon();
                continue;
            };
            // 1. One open part per member before any of them can write.
            let mut begun = 0;
            for _ in &members {
                if side.begin_part(key).is_err() {
                    break;
                }
                begun += 1;
            }
            if begun < members.len() {
                // The room failed meanwhile: no Step left for it.
                for _ in 0..begun {
                    side.end_part(key, true);
                }
                abandon();
                continue;
            }
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
            for (i, m) in members.iter().enumerate() {
                if let Err(e) = self.link.send(*m, frame.clone()) {
                    // The members from this one on have no Step: their parts close now (they
                    // write nothing); those that have it close on their StepDone.
                    let why = format!("the step order did not reach CP rank {m}: {e}");
                    {
                        let mut st = lock(&self.steps);
                        if let Some(c) = st.current.as_mut().filter(|c| c.step == step) {
                            for unsent in &members[i..] {
                                c.parts.remove(unsent);
                            }
                        }
                    }
                    side.fail_with(key, &why);
                    for _ in &members[i..] {
                        side.end_part(key, false);
                    }
                    self.broke(&why);
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
        let (step, was_current) = {
            let mut st = lock(&self.steps);
            let step = st.rooms.remove(&key);
            let was_current = st.current.as_ref().is_some_and(|c| c.key == key);
            if was_current {
                st.current = None;
            }
            (step, was_current)
        };
        if step.is_some() && !sent {
            self.stats.step_failures.fetch_add(1, Ordering::Relaxed);
        }
        if self.is_leader() {
            if was_current && let Some(side) = self.side() {
                self.start_next(&side);
            }
            return;
        }
        let Some((step, _)) = step else {
            return;
        };
        let done = StepDoneFrame {
            from: self.plan.cp_rank,
            step,
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

    /// Leader: the room `key` failed here (`why`): when it is the running step, the members are
    /// told once (`StepAbort`) to stop theirs; their `StepDone`s still close their parts.
    pub fn abort_members(&self, key: RoomKey, why: &str) {
        if !self.is_leader() {
            return;
        }
        let step = {
            let mut st = lock(&self.steps);
            match st.current.as_mut() {
                Some(c) if c.key == key && !c.aborted => {
                    c.aborted = true;
                    c.step
                }
                _ => return,
            }
        };
        self.stats.steps_aborted.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::StepAbort {
            step,
            reason: why.to_owned(),
        }
        .encode();
        for m in self.members() {
            if let Err(e) = self.link.send(m, frame.clone()) {
                self.broke(&format!("the step abort did not reach CP rank {m}: {e}"));
                return;
            }
        }
    }

    /// Member: the leader's order to run a step. The room opens at the node (its plan from the
    /// frame) and goes to the engine; a room that cannot open is reported failed at once.
    fn member_step(&self, s: StepFrame) {
        let key = RoomKey::new(s.room, s.generation);
        {
            let mut st = lock(&self.steps);
            if let Some(other) = st.rooms.values().find(|(step, _)| *step >= s.step) {
                tracing::warn!(
                    step = s.step,
                    running = other.0,
                    "a step not newer than one running here; dropped"
                );
                return;
            }
            st.rooms.insert(key, (s.step, s.request));
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
            lock(&self.steps).rooms.remove(&key);
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

    /// Member: the leader's room of `step` failed: this rank's room of it fails too (its engine's
    /// next call is refused); its `StepDone` follows once its writes are terminal.
    fn member_abort(&self, step: u64, reason: &str) {
        let key = lock(&self.steps)
            .rooms
            .iter()
            .find(|(_, (s, _))| *s == step)
            .map(|(k, _)| *k);
        let (Some(key), Some(side)) = (key, self.side()) else {
            return;
        };
        self.stats.steps_aborted.fetch_add(1, Ordering::Relaxed);
        side.fail_with(key, &format!("the leader's room failed: {reason}"));
        // A waiting AwaitLayer of it sees the failure at its next look.
        self.arrived.notify_all();
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
    /// the room's step. Called for each accepted PagesReady of a LayerSplit room, before its pages
    /// go to the decode.
    ///
    /// # Errors
    /// A text reason: `key` is not running here as a step, the call does not name every page of
    /// the room from page 0 (each owned layer is broadcast once), a layer is not owned, a chunk
    /// cannot be read, or a peer's stream is gone (the group breaks).
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
            .ok_or_else(|| format!("{key} is not running as a step of the CP group"))?;
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

    /// One turn of the reader thread: the link's health, then at most one frame from the link
    /// (kept for its wait, or handled). Returns false once the thread should end (the group broke).
    fn tick(&self) -> bool {
        let closed = self.link.closed_peers();
        if !closed.is_empty() {
            self.broke(&format!("CP ranks {closed:?} closed their rank link"));
        }
        if self.stats.link_broken.load(Ordering::SeqCst) {
            return false;
        }
        match self.link.recv(IDLE_POLL) {
            Received::Frame(bytes) => {
                if let Err(e) = lock(&self.receiver).accept_bytes(&bytes) {
                    // A peer's bug must not stop this rank: the frame is dropped.
                    tracing::warn!(error = %e, "bad frame on the rank link; dropped");
                }
                self.arrived.notify_all();
            }
            Received::Timeout => {}
            Received::Closed => {
                self.broke("every peer link closed");
                return false;
            }
        }
        // Control frames (also those the handshake kept), handled without the receiver's lock.
        loop {
            let Some(frame) = lock(&self.receiver).pop_control() else {
                break;
            };
            match frame {
                Frame::Step(s) if !self.is_leader() => self.member_step(s),
                Frame::StepAbort { step, reason } if !self.is_leader() => {
                    self.member_abort(step, &reason);
                }
                Frame::StepDone(d) if self.is_leader() => self.part_done(d),
                f => tracing::debug!(?f, "unexpected frame on the rank link; dropped"),
            }
        }
        true
    }

    fn note_error(&self, what: String) {
        self.stats.step_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %what, "CP group step failed");
        *lock(&self.stats.last_error) = Some(what);
    }

    /// The group is broken (once): the running and queued rooms fail and the server is told (it
    /// stops the worker so that the group re-forms). The running room's open parts stay open: a
    /// member still alive may still write into the decode's pages, and its `StepDone` (or the
    /// decode's ack timeout) ends them.
    fn broke(&self, why: &str) {
        if self.stats.link_broken.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::error!(error = %why, "CP group broken; rooms fail until the group re-forms");
        *lock(&self.stats.last_error) = Some(why.to_owned());
        let _ = self.broken_tx.send(Some(why.to_owned()));
        let (running, queued) = {
            let mut st = lock(&self.steps);
            let running: Vec<RoomKey> = st.rooms.keys().copied().collect();
            (running, std::mem::take(&mut st.queue))
        };
        self.arrived.notify_all();
        let Some(side) = self.side() else {
            return;
        };
        let reason = format!("the CP group is broken ({why}); restarting");
        for key in running {
            side.fail_with(key, &reason);
        }
        for (key, _) in queued {
            side.fail_with(key, &reason);
        }
    }

    /// `/report.cp_group`: the rank and layout, the pool's pages and page bytes against the
    /// replicated layout's, the receive slot, broadcast bytes against a whole-layer broadcast,
    /// waits (and how many the engine's work hid), steps, aborts and failures.
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
            (
                st.queue.len(),
                st.rooms.values().map(|(step, _)| *step).max(),
            )
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
            "page_bytes": u64::from(self.seat.pool_layers()) * chunk,
            "replicated_page_bytes": u64::from(self.seat.model_layers) * chunk,
            "stored_kv_bytes": u64::from(pool_pages) * owned * chunk,
            "replicated_kv_bytes": u64::from(pool_pages) * u64::from(self.seat.model_layers) * chunk,
            "receive_slot_bytes": u64::from(pool_pages) * chunk,
            "steps": n(&s.steps),
            "step_failures": n(&s.step_failures),
            "steps_aborted": n(&s.steps_aborted),
            "rooms_queued": queued,
            "running_step": running,
            "frames_sent": n(&s.frames_sent),
            "broadcast_payload_bytes": n(&s.broadcast_payload_bytes),
            "broadcast_frame_bytes": n(&s.broadcast_frame_bytes),
            "whole_layer_broadcast_bytes": n(&s.whole_layer_broadcast_bytes),
            "waits": n(&s.waits),
            "waits_hidden": n(&s.waits_hidden),
            "wait_failures": n(&s.wait_failures),
            "link_broken": s.link_broken.load(Ordering::SeqCst),
            "last_error": *lock(&s.last_error),
        })
    }

    /// The wait of [`LayerGroup::await_layer`], without failing the room (the caller does, outside
    /// every lock): until `deadline`, for the frame of (`step`, `layer`), then the copy into the
    /// receive slot of `pages`.
    fn wait_layer(
        &self,
        key: RoomKey,
        step: u64,
        layer: u32,
        pages: &[u32],
        target: &KvPool,
        deadline: Instant,
    ) -> Result<(u32, bool), ApiError> {
        let slot = self.seat.receive_slot();
        let mut rx = lock(&self.receiver);
        let mut first = true;
        loop {
            if let Some(why) = self.broken() {
                return Err(ApiError::new(
                    Code::Unavailable,
                    pb::ErrorReason::GroupBroken,
                    format!("CP group broken: {why}"),
                ));
            }
            // The room may have failed or ended meanwhile (an abort, its deadline).
            let running = self.step_of(key).map(|(s, _)| s) == Some(step)
                && self.side().is_some_and(|s| {
                    matches!(
                        s.room_state(key),
                        Some(
                            SenderState::Bootstrapping
                                | SenderState::WaitingForInput
                                | SenderState::Transferring
                        )
                    )
                });
            if !running {
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::RoomState,
                    format!("{key} failed or ended while waiting for layer {layer}"),
                )
                .field("room"));
            }
            match rx.take_layer(step, layer) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Err(ApiError::internal(e.to_string())),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ApiError::new(
                    Code::DeadlineExceeded,
                    pb::ErrorReason::DeadlineExceeded,
                    format!("layer {layer} of {key} (step {step}) was not broadcast in time"),
                ));
            }
            first = false;
            rx = self
                .arrived
                .wait_timeout(rx, left.min(WAIT_SLICE))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
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
        Ok((room_pages.len() as u32, first))
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

impl LayerGroup for EngineGroup {
    fn await_layer(
        &self,
        key: RoomKey,
        layer: u32,
        pages: &[u32],
        target: &KvPool,
        within: Duration,
    ) -> Result<(u32, bool), ApiError> {
        let (step, _) = self.step_of(key).ok_or_else(|| {
            ApiError::new(
                Code::NotFound,
                pb::ErrorReason::UnknownRoom,
                format!("{key} is not running as a step of the CP group"),
            )
            .field("room")
        })?;
        let deadline = Instant::now() + self.wait_timeout.min(within);
        let out = self.wait_layer(key, step, layer, pages, target, deadline);
        match &out {
            Ok((_, hidden)) => {
                self.stats.waits.fetch_add(1, Ordering::Relaxed);
                if *hidden {
                    self.stats.waits_hidden.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                // The room cannot go on without the layer: it fails here (outside every lock),
                // so that its part ends once its writes are terminal instead of at its deadline.
                self.stats.wait_failures.fetch_add(1, Ordering::Relaxed);
                if let Some(side) = self.side() {
                    side.fail_with(key, &format!("waiting for layer {layer}: {}", e.message));
                }
            }
        }
        out
    }
}
