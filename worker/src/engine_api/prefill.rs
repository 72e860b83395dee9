//! The prefill side of the engine API: PrefillWork, PagesReady and SourceFree over the sender room
//! table of DESIGN contract 3 ([`SenderRooms`]).
//!
//! The prefill engine owns the allocation of its source pages (as SGLang's and vLLM's allocators
//! do); it computes a room's KV into them and says PagesReady. Each PagesReady is one write of the
//! sender table: begun before the transport ([`KvSink`]) gets it, ended when the transport reports it
//! terminal ([`PrefillSide::write_done`]). An abort from decode marks the room failed first and its
//! ack fires once nothing of the room is outstanding (R-ABORT-2/3/6); the source pages come back to
//! the engine in a SourceFree event exactly when the table says the send is terminal
//! ([`SenderEffect::ReleaseSource`]). The worker holds the pages of a live room: a PagesReady naming
//! a page another live room still holds is refused.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tonic::Code;

use crate::memory::pool::KvPool;
use crate::release::sender::{AbortAck, SenderEffect, SenderFailure, SenderRooms, SenderState};
use crate::release::{DecodeRank, PrefillRank, RoomKey};

use super::error::ApiError;
use super::hub::EventHub;
use super::pb;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One write handed to the transport: source pages of a room, for some layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagesSend {
    /// The room.
    pub key: RoomKey,
    /// Source page indices in this worker's pools, in token order.
    pub pages: Vec<u32>,
    /// The room's page number of `pages[0]`.
    pub first_page: u32,
    /// Layers to move.
    pub layers: Range<u32>,
    /// The room's last write.
    pub last: bool,
}

/// The transport that moves source pages to the decode side (the seam the serving path wires to
/// TCP/RDMA transfers; [`super::local`] for a same-host pair).
pub trait KvSink: Send + Sync + 'static {
    /// Moves one write. The implementation reports it terminal exactly once with
    /// [`PrefillSide::write_done`] (from any thread, possibly before `send` returns).
    fn send(&self, side: &Arc<PrefillSide>, write: PagesSend);
    /// Delivers an abort ack to its decode rank.
    fn ack(&self, ack: AbortAck);
    /// The room failed on this side for `reason` (the engine detached or died, or the worker gave
    /// up on it): the transport tells the decode side, which aborts it through its release gate
    /// (DESIGN contract 3). Default: nothing to tell.
    fn room_failed(&self, _key: RoomKey, _reason: &str) {}
    /// The room's send is terminal and quiescent (no write of it can still land): `sent` when every
    /// write landed and the input concluded (the room succeeded), false when it failed. Called once
    /// per room, after its source pages were handed back. Default: nothing to do.
    fn released(&self, _key: RoomKey, _sent: bool) {}
}

#[derive(Debug)]
struct Held {
    attach: u64,
    pages: BTreeSet<u32>,
    /// Model layers the room's accepted PagesReady covered (a pageless last call needs them all
    /// on a LayerSplit rank, and at least one write elsewhere).
    layers: BTreeSet<u32>,
}

#[derive(Debug)]
struct State {
    table: SenderRooms,
    held: HashMap<RoomKey, Held>,
    busy: HashMap<u32, RoomKey>,
    current_attach: u64,
    /// The attach that is live now (`None` between an attach's end and the next attach).
    live_attach: Option<u64>,
}

/// Counters of a prefill side (monotonic since start).
#[derive(Debug, Default)]
pub struct PrefillStats {
    /// Rooms handed to the engine as PrefillWork.
    pub rooms_submitted: AtomicU64,
    /// Rooms whose send succeeded (every write landed).
    pub rooms_sent: AtomicU64,
    /// Rooms whose send failed (aborted, transfer failure, engine gone, deadline).
    pub rooms_failed: AtomicU64,
    /// PagesReady calls accepted (one write each).
    pub writes: AtomicU64,
    /// Source pages returned to the engine in SourceFree events.
    pub pages_freed: AtomicU64,
}

/// The CP group a LayerSplit rank's rooms are computed with (DESIGN contract 6; seed 004): the
/// worker's rank link, which answers AwaitLayer (`roles::prefill::cp_engine`).
pub trait LayerGroup: Send + Sync + 'static {
    /// Blocks — at most `within` (the call's budget) and the group's own wait deadline — until the
    /// owner's broadcast of model layer `layer` for room `key` has landed, then writes room page
    /// k's chunk into the receive slot of `pages[k]` of `target` (validated: in the pool, none
    /// twice). Returns the room pages written and whether the broadcast had landed before the
    /// call. A wait that fails fails the room: it cannot go on without the layer.
    ///
    /// # Errors
    /// `UNKNOWN_ROOM` (not running here as a step), `ROOM_STATE` (the room failed or ended while
    /// waiting), `MALFORMED` (fewer pages than the owner's), `DEADLINE_EXCEEDED`, `GROUP_BROKEN`.
    fn await_layer(
        &self,
        key: RoomKey,
        layer: u32,
        pages: &[u32],
        target: &KvPool,
        within: std::time::Duration,
    ) -> Result<(u32, bool), ApiError>;
}

/// The prefill side of one worker's engine API.
pub struct PrefillSide {
    pools: Vec<Arc<KvPool>>,
    /// The LayerSplit seat of a rank of a LayerSplit group (PagesReady names owned layers only).
    layer_split: Option<super::LayerSplitSeat>,
    /// The group that answers AwaitLayer (set with `layer_split`).
    group: std::sync::OnceLock<Arc<dyn LayerGroup>>,
    sink: Arc<dyn KvSink>,
    state: Mutex<State>,
    work: EventHub<pb::PrefillWork>,
    source_free: EventHub<pb::SourceFree>,
    stats: PrefillStats,
}

impl std::fmt::Debug for PrefillSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillSide")
            .field("pools", &self.pools.len())
            .finish()
    }
}

impl PrefillSide {
    /// A prefill side of rank `rank` over `pools` (target first), moving pages through `sink`.
    pub fn new(pools: Vec<Arc<KvPool>>, sink: Arc<dyn KvSink>, rank: PrefillRank) -> Arc<Self> {
        Self::with_layer_split(pools, sink, rank, None)
    }

    /// [`PrefillSide::new`] for a rank of a LayerSplit group (`layer_split`): PagesReady names
    /// owned layers only, and AwaitLayer is answered once [`PrefillSide::set_group`] was called.
    pub fn with_layer_split(
        pools: Vec<Arc<KvPool>>,
        sink: Arc<dyn KvSink>,
        rank: PrefillRank,
        layer_split: Option<super::LayerSplitSeat>,
    ) -> Arc<Self> {
        Arc::new(Self {
            pools,
            layer_split,
            group: std::sync::OnceLock::new(),
            sink,
            state: Mutex::new(State {
                table: SenderRooms::new(rank),
                held: HashMap::new(),
                busy: HashMap::new(),
                current_attach: 0,
                live_attach: None,
            }),
            work: EventHub::new("PrefillWork"),
            source_free: EventHub::new("SourceFree"),
            stats: PrefillStats::default(),
        })
    }

    /// The pools (target first).
    pub fn pools(&self) -> &[Arc<KvPool>] {
        &self.pools
    }

    /// The LayerSplit seat, when this worker is a rank of a LayerSplit group.
    pub fn layer_split(&self) -> Option<&super::LayerSplitSeat> {
        self.layer_split.as_ref()
    }

    /// The group that answers AwaitLayer (set once; later calls are ignored).
    pub fn set_group(&self, group: Arc<dyn LayerGroup>) {
        let _ = self.group.set(group);
    }

    /// AwaitLayer (engine.proto): checks the layer and the pages, then waits through the group,
    /// at most `within`.
    ///
    /// # Errors
    /// `WRONG_ROLE` when this worker is no LayerSplit rank; `LAYER_OUT_OF_RANGE` for an owned or
    /// unknown layer; `MALFORMED` / `PAGE_OUT_OF_RANGE` for the pages; the group's errors
    /// ([`LayerGroup::await_layer`]).
    pub fn await_layer(
        &self,
        req: &pb::AwaitLayerRequest,
        within: std::time::Duration,
    ) -> Result<pb::AwaitLayerReply, ApiError> {
        let (Some(seat), Some(group)) = (&self.layer_split, self.group.get()) else {
            return Err(ApiError::new(
                Code::FailedPrecondition,
                pb::ErrorReason::WrongRole,
                "this prefill worker is no rank of a LayerSplit group: every layer is its own",
            ));
        };
        let key: RoomKey = req
            .room
            .ok_or_else(|| ApiError::malformed("room", "AwaitLayer names no room"))?
            .into();
        if req.layer >= seat.model_layers || seat.owned.contains(&req.layer) {
            return Err(ApiError::new(
                Code::InvalidArgument,
                pb::ErrorReason::LayerOutOfRange,
                format!(
                    "layer {} is {} (this rank owns {}..{} of {})",
                    req.layer,
                    if req.layer >= seat.model_layers {
                        "not a layer of the model"
                    } else {
                        "this rank's own: nobody broadcasts it here"
                    },
                    seat.owned.start,
                    seat.owned.end,
                    seat.model_layers
                ),
            )
            .field("layer"));
        }
        let target = &self.pools[0];
        let g = target.geometry();
        if req.pages.is_empty() {
            return Err(ApiError::malformed("pages", "AwaitLayer names no page"));
        }
        super::error::check_pages(&req.pages, g.pages)?;
        let (pages, already_there) =
            group.await_layer(key, req.layer, &req.pages, target, within)?;
        Ok(pb::AwaitLayerReply {
            pages,
            already_there,
        })
    }

    /// The work events, for WatchWork.
    pub fn work(&self) -> &EventHub<pb::PrefillWork> {
        &self.work
    }

    /// The SourceFree events.
    pub fn source_free(&self) -> &EventHub<pb::SourceFree> {
        &self.source_free
    }

    /// A new attach became current (and live: work is accepted for it).
    pub fn set_attach(&self, attach: u64) {
        {
            let mut st = lock(&self.state);
            st.current_attach = attach;
            st.live_attach = Some(attach);
        }
        self.work.reset();
        self.source_free.reset();
    }

    /// Source pages held by rooms whose send is not terminal.
    pub fn held_pages(&self) -> u32 {
        lock(&self.state).busy.len() as u32
    }

    /// Rooms in the sender table (live, or failed and still draining writes).
    pub fn rooms(&self) -> usize {
        lock(&self.state).table.len()
    }

    /// Writes of `key` begun and not yet terminal (0 for an unknown room).
    pub fn outstanding(&self, key: RoomKey) -> u32 {
        lock(&self.state).table.outstanding(key)
    }

    /// The attach that is live now, if any.
    pub fn live_attach(&self) -> Option<u64> {
        lock(&self.state).live_attach
    }

    /// The counters.
    pub fn stats(&self) -> &PrefillStats {
        &self.stats
    }

    /// The sender state of a room.
    pub fn room_state(&self, key: RoomKey) -> Option<SenderState> {
        lock(&self.state).table.state(key)
    }

    /// A decode worker opened `work.room` (its destination pages are known to the transport): the room
    /// opens in the sender table, belongs to the live attach (it fails when that attach ends) and the
    /// engine is asked to compute it.
    ///
    /// # Errors
    /// `MALFORMED` without a room; `NOT_ATTACHED` when no engine is attached (nobody would compute
    /// the room); `ROOM_STATE` when the room is already open.
    pub fn submit_work(&self, work: pb::PrefillWork) -> Result<(), ApiError> {
        self.open_room(&work)?;
        self.emit_work(work);
        Ok(())
    }

    /// The first half of [`PrefillSide::submit_work`]: the room opens in the sender table and
    /// belongs to the live attach, but the engine is not asked yet ([`PrefillSide::emit_work`]) —
    /// a LayerSplit group's leader queues its rooms and starts one at a time. An abort meanwhile
    /// fails it as any open room.
    ///
    /// # Errors
    /// As [`PrefillSide::submit_work`].
    pub fn open_room(&self, work: &pb::PrefillWork) -> Result<(), ApiError> {
        let key: RoomKey = work
            .room
            .ok_or_else(|| ApiError::malformed("room", "the work names no room"))?
            .into();
        {
            let mut st = lock(&self.state);
            let Some(attach) = st.live_attach else {
                return Err(ApiError::new(
                    Code::Unavailable,
                    pb::ErrorReason::NotAttached,
                    "no engine is attached to this prefill worker: nobody would compute the room",
                ));
            };
            st.table.open(key).map_err(|e| {
                ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::RoomState,
                    e.to_string(),
                )
                .field("room")
            })?;
            let _ = st.table.destination_ready(key);
            st.held.insert(
                key,
                Held {
                    attach,
                    pages: BTreeSet::new(),
                    layers: BTreeSet::new(),
                },
            );
        }
        self.stats.rooms_submitted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Hands a room opened with [`PrefillSide::open_room`] to the engine (WatchWork).
    pub fn emit_work(&self, work: pb::PrefillWork) {
        self.work.emit(work);
    }

    /// A part of the room written by another process begins (a LayerSplit rank writing its owned
    /// layers into the decode's pages): it counts as an outstanding write, so the room neither
    /// succeeds nor sends its abort ack before [`PrefillSide::end_part`] (DESIGN contract 3).
    ///
    /// # Errors
    /// `ROOM_STATE` once the room failed or concluded.
    pub fn begin_part(&self, key: RoomKey) -> Result<(), ApiError> {
        lock(&self.state).table.begin_write(key).map_err(|e| {
            ApiError::new(
                Code::FailedPrecondition,
                pb::ErrorReason::RoomState,
                e.to_string(),
            )
        })
    }

    /// The part begun by [`PrefillSide::begin_part`] is terminal (`ok`: every write of it landed).
    pub fn end_part(&self, key: RoomKey, ok: bool) {
        self.write_done(key, ok);
    }

    /// PagesReady: validates, begins one write of the room and hands it to the transport. Returns
    /// false when the room failed (the call's pages are returned at once in a SourceFree event).
    /// Layers are model layer numbers; a LayerSplit rank names its owned ones only. A last call
    /// without pages ends the room's input without a write.
    ///
    /// # Errors
    /// `MALFORMED` (no room, no pages without `last`, a page listed twice or held by another live
    /// room), `PAGE_OUT_OF_RANGE`, `LAYER_OUT_OF_RANGE` (outside the model, or outside a LayerSplit
    /// rank's owned layers), `UNKNOWN_ROOM`.
    pub fn pages_ready(
        self: &Arc<Self>,
        attach: u64,
        req: &pb::PagesReadyRequest,
    ) -> Result<bool, ApiError> {
        let key: RoomKey = req
            .room
            .ok_or_else(|| ApiError::malformed("room", "PagesReady names no room"))?
            .into();
        let g = *self.pools[0].geometry();
        if req.pages.is_empty() {
            if req.last {
                return self.end_input(key);
            }
            return Err(ApiError::malformed(
                "pages",
                "PagesReady names no page (only a last one may: it ends the room's input)",
            ));
        }
        super::error::check_pages(&req.pages, g.pages)?;
        // Model layer numbers; a LayerSplit rank's pool holds its owned ones only.
        let allowed = match &self.layer_split {
            Some(seat) => seat.owned.clone(),
            None => 0..g.layers,
        };
        let layers = match req.layers {
            None => allowed.clone(),
            Some(r) => r.start..r.end,
        };
        if layers.is_empty() || layers.start < allowed.start || layers.end > allowed.end {
            return Err(ApiError::new(
                Code::InvalidArgument,
                pb::ErrorReason::LayerOutOfRange,
                format!(
                    "layers {}..{} is empty or leaves {}..{}{}",
                    layers.start,
                    layers.end,
                    allowed.start,
                    allowed.end,
                    if self.layer_split.is_some() {
                        " (this LayerSplit rank's owned layers)"
                    } else {
                        ""
                    }
                ),
            )
            .field("layers"));
        }
        if req.first_page.checked_add(req.pages.len() as u32).is_none() {
            return Err(ApiError::malformed("first_page", "first_page overflows"));
        }
        let effects = {
            let mut st = lock(&self.state);
            if st.table.state(key).is_none() {
                return Err(ApiError::new(
                    Code::NotFound,
                    pb::ErrorReason::UnknownRoom,
                    format!("{key} is not open on this prefill worker"),
                )
                .field("room"));
            }
            if let Some((p, other)) = req
                .pages
                .iter()
                .find_map(|p| st.busy.get(p).filter(|k| **k != key).map(|k| (*p, *k)))
            {
                return Err(ApiError::malformed(
                    "pages",
                    format!("page {p} is still being sent for {other}; wait for its SourceFree"),
                ));
            }
            if st.table.begin_write(key).is_err() {
                // Pages an earlier write of this room still sends come back with the room's
                // release, once no write from them can be in flight; the others at once.
                let pages: Vec<u32> = req
                    .pages
                    .iter()
                    .copied()
                    .filter(|p| !st.busy.contains_key(p))
                    .collect();
                drop(st);
                self.source_free.emit(pb::SourceFree {
                    room: Some(key.into()),
                    pages,
                    sent: false,
                });
                return Ok(false);
            }
            let held = st.held.entry(key).or_insert_with(|| Held {
                attach,
                pages: BTreeSet::new(),
                layers: BTreeSet::new(),
            });
            held.pages.extend(req.pages.iter().copied());
            held.layers.extend(layers.clone());
            for &p in &req.pages {
                st.busy.insert(p, key);
            }
            if req.last {
                st.table.finish_input(key).unwrap_or_default()
            } else {
                Vec::new()
            }
        };
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.perform(effects);
        self.sink.send(
            self,
            PagesSend {
                key,
                pages: req.pages.clone(),
                first_page: req.first_page,
                layers,
                last: req.last,
            },
        );
        Ok(true)
    }

    /// A last PagesReady without pages: the room's input ends without a write (a LayerSplit
    /// rank's layer loop may await layers after its last owned one). `Ok(false)` when the room
    /// failed meanwhile.
    ///
    /// # Errors
    /// `UNKNOWN_ROOM`; `ROOM_STATE` when the room's KV was not all sent: on a LayerSplit rank an
    /// owned layer no PagesReady covered, elsewhere no PagesReady at all (the room would succeed
    /// without its KV).
    fn end_input(&self, key: RoomKey) -> Result<bool, ApiError> {
        let effects = {
            let mut st = lock(&self.state);
            match st.table.state(key) {
                None => {
                    return Err(ApiError::new(
                        Code::NotFound,
                        pb::ErrorReason::UnknownRoom,
                        format!("{key} is not open on this prefill worker"),
                    )
                    .field("room"));
                }
                Some(SenderState::Failed(_)) => return Ok(false),
                Some(_) => {}
            }
            let sent = st
                .held
                .get(&key)
                .map(|h| h.layers.clone())
                .unwrap_or_default();
            let missing: Vec<u32> = match &self.layer_split {
                Some(seat) => seat.owned.clone().filter(|l| !sent.contains(l)).collect(),
                None if sent.is_empty() => vec![0],
                None => Vec::new(),
            };
            if !missing.is_empty() {
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::RoomState,
                    match &self.layer_split {
                        Some(_) => format!(
                            "{key}: the input cannot end before every owned layer was sent; \
                             layers {missing:?} were not"
                        ),
                        None => format!("{key}: the input cannot end before any page was sent"),
                    },
                )
                .field("last"));
            }
            match st.table.finish_input(key) {
                Ok(e) => e,
                Err(_) => return Ok(false),
            }
        };
        self.perform(effects);
        Ok(true)
    }

    /// The transport reports one write of `key` terminal (`ok` = landed).
    pub fn write_done(&self, key: RoomKey, ok: bool) {
        let effects = lock(&self.state).table.end_write(key, ok);
        match effects {
            Ok(e) => self.perform(e),
            Err(e) => tracing::error!(%key, error = %e, "write_done without a begun write"),
        }
    }

    /// An ABORT from `decode_rank`: the room fails first; the ack is delivered once nothing of it is
    /// outstanding.
    pub fn abort(&self, key: RoomKey, decode_rank: DecodeRank) {
        let effects = lock(&self.state).table.abort(key, decode_rank);
        self.perform(effects);
    }

    /// The room fails on this side (transport error, local give-up).
    pub fn fail(&self, key: RoomKey, why: SenderFailure) {
        let effects = lock(&self.state).table.fail(key, why);
        self.perform(effects);
    }

    /// The attach ended: no work is accepted until the next attach, and every room of the attach
    /// (submitted, computing or sending) fails locally — the transport is told
    /// ([`KvSink::room_failed`]) and the pages stay held until the room's writes drain.
    pub fn end_attach(&self, attach: u64) {
        let keys: Vec<RoomKey> = {
            let mut st = lock(&self.state);
            if st.live_attach == Some(attach) {
                st.live_attach = None;
            }
            st.held
                .iter()
                .filter(|(_, h)| h.attach == attach)
                .map(|(k, _)| *k)
                .collect()
        };
        for k in keys {
            self.fail_with(k, "the engine detached or exited");
        }
    }

    /// The room fails on this side for `reason` (the engine never produced it, the engine went
    /// away): the table fails it first (no new write), the transport tells the decode side, and
    /// the source pages come back once no write of it can land. A terminal or unknown room is left
    /// as it is.
    pub fn fail_with(&self, key: RoomKey, reason: &str) {
        let live = matches!(
            lock(&self.state).table.state(key),
            Some(s) if s != SenderState::Success && !matches!(s, SenderState::Failed(_))
        );
        if !live {
            return;
        }
        self.sink.room_failed(key, reason);
        self.fail(key, SenderFailure::Local);
    }

    fn perform(&self, effects: Vec<SenderEffect>) {
        for e in effects {
            match e {
                SenderEffect::SendAck(ack) => self.sink.ack(ack),
                SenderEffect::ReleaseSource(key) => {
                    let (held, sent, current) = {
                        let mut st = lock(&self.state);
                        let held = st.held.remove(&key);
                        if let Some(h) = &held {
                            for p in &h.pages {
                                st.busy.remove(p);
                            }
                        }
                        let sent = st.table.state(key) == Some(SenderState::Success);
                        // Terminal and quiescent: the scheduler forgets it, so the entry goes.
                        let rest = st.table.clear(key);
                        debug_assert!(rest.is_empty(), "a terminal room has nothing left to fire");
                        (held, sent, st.current_attach)
                    };
                    if sent {
                        self.stats.rooms_sent.fetch_add(1, Ordering::Relaxed);
                    } else {
                        self.stats.rooms_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(h) = held
                        && h.attach == current
                        && !h.pages.is_empty()
                    {
                        self.stats
                            .pages_freed
                            .fetch_add(h.pages.len() as u64, Ordering::Relaxed);
                        self.source_free.emit(pb::SourceFree {
                            room: Some(key.into()),
                            pages: h.pages.into_iter().collect(),
                            sent,
                        });
                    }
                    self.sink.released(key, sent);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Allocator;
    use crate::memory::mmap::MmapBackend;
    use crate::memory::pool::{PoolLayout, PoolRole, PoolSpec};
    use crate::model::{Attention, ModelIdentity};

    const PAGES: u32 = 8;

    /// A transport that records the writes and reports each landed at once.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<PagesSend>>);

    impl KvSink for Recorder {
        fn send(&self, side: &Arc<PrefillSide>, write: PagesSend) {
            let key = write.key;
            lock(&self.0).push(write);
            side.write_done(key, true);
        }
        fn ack(&self, _ack: AbortAck) {}
    }

    /// A group that answers every wait with the pages named, recording the calls.
    #[derive(Default)]
    struct Waits(Mutex<Vec<(RoomKey, u32, Vec<u32>)>>);

    impl LayerGroup for Waits {
        fn await_layer(
            &self,
            key: RoomKey,
            layer: u32,
            pages: &[u32],
            _target: &KvPool,
            _within: std::time::Duration,
        ) -> Result<(u32, bool), ApiError> {
            lock(&self.0).push((key, layer, pages.to_vec()));
            Ok((pages.len() as u32, false))
        }
    }

    /// Rank 1 of a CP-2 group over 8 layers: owns 4..8, its pool holds them and the receive slot.
    fn seat() -> super::super::LayerSplitSeat {
        super::super::LayerSplitSeat {
            cp_rank: 1,
            cp_size: 2,
            model_layers: 8,
            owned: 4..8,
            max_owned: 4,
        }
    }

    fn side(sink: Arc<Recorder>) -> Arc<PrefillSide> {
        let spec = PoolSpec {
            role: PoolRole::Target,
            model: ModelIdentity {
                name: "tiny".into(),
                layers: seat().pool_layers(),
                attention: Attention::Gqa {
                    kv_heads: 1,
                    head_dim: 8,
                },
                dtype_bytes: 2,
                row_extra_bytes: 0,
            },
            page_tokens: 4,
            pages: PAGES,
            layout: PoolLayout::PageFirst,
        };
        let pool = Arc::new(KvPool::new(spec, &Allocator::new("t", MmapBackend::new())).unwrap());
        let side = PrefillSide::with_layer_split(vec![pool], sink, PrefillRank(0), Some(seat()));
        side.set_attach(1);
        side
    }

    fn work(room: u64) -> pb::PrefillWork {
        pb::PrefillWork {
            room: Some(pb::RoomRef {
                room_id: room,
                generation: 1,
            }),
            request_id: room,
            tokens: 8,
            deadline_ms: 1000,
            ..pb::PrefillWork::default()
        }
    }

    fn ready(
        room: u64,
        pages: Vec<u32>,
        layers: Option<(u32, u32)>,
        last: bool,
    ) -> pb::PagesReadyRequest {
        pb::PagesReadyRequest {
            attach_id: 1,
            room: Some(pb::RoomRef {
                room_id: room,
                generation: 1,
            }),
            pages,
            first_page: 0,
            layers: layers.map(|(start, end)| pb::LayerRange { start, end }),
            last,
        }
    }

    /// A LayerSplit rank says PagesReady in model layer numbers, for its owned layers only (no
    /// range: all of them); a last PagesReady without pages ends the input after its layer loop,
    /// and the room then succeeds once its writes landed — its pages come back in one SourceFree.
    #[test]
    fn a_layer_split_rank_sends_owned_layers_and_ends_its_input_without_a_write() {
        let sink = Arc::new(Recorder::default());
        let side = side(sink.clone());
        let mut freed = side.source_free().watch();
        side.submit_work(work(7)).unwrap();
        let key = RoomKey::new(7, 1);
        for outside in [(0, 4), (3, 5), (8, 9)] {
            let e = side
                .pages_ready(1, &ready(7, vec![0, 1], Some(outside), false))
                .unwrap_err();
            assert_eq!(e.reason, pb::ErrorReason::LayerOutOfRange, "{outside:?}");
        }
        assert!(
            side.pages_ready(1, &ready(7, vec![0, 1], Some((4, 5)), false))
                .unwrap()
        );
        assert!(
            side.pages_ready(1, &ready(7, vec![0, 1], None, false))
                .unwrap()
        );
        let layers: Vec<_> = lock(&sink.0).iter().map(|w| w.layers.clone()).collect();
        assert_eq!(
            layers,
            vec![4..5, 4..8],
            "model layer numbers, owned ones only"
        );
        assert_eq!(side.room_state(key), Some(SenderState::Transferring));
        // No pages and not last: refused. Last without pages: the input ends, no write — but
        // not before every owned layer was sent (the room would succeed without its KV).
        let e = side
            .pages_ready(1, &ready(7, vec![], None, false))
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::Malformed);
        side.submit_work(work(8)).unwrap();
        assert!(
            side.pages_ready(1, &ready(8, vec![2], Some((4, 7)), false))
                .unwrap()
        );
        let e = side
            .pages_ready(1, &ready(8, vec![], None, true))
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::RoomState, "{e}");
        assert!(e.message.contains("[7]"), "{e}");
        assert!(side.pages_ready(1, &ready(7, vec![], None, true)).unwrap());
        assert_eq!(lock(&sink.0).len(), 3, "the last call wrote nothing");
        let f = freed.try_recv().expect("the room's pages come back");
        assert!(f.sent);
        assert_eq!(f.pages, vec![0, 1]);
        assert_eq!(side.stats().rooms_sent.load(Ordering::Relaxed), 1);
    }

    /// AwaitLayer: refused for an owned or unknown layer and for bad pages, before the group is
    /// asked; otherwise the group answers. Without LayerSplit it is the wrong role.
    #[test]
    fn await_layer_is_checked_before_the_group_waits() {
        let side = side(Arc::new(Recorder::default()));
        let req = |layer: u32, pages: Vec<u32>| pb::AwaitLayerRequest {
            attach_id: 1,
            room: Some(pb::RoomRef {
                room_id: 7,
                generation: 1,
            }),
            layer,
            pages,
        };
        // No group yet: as without LayerSplit.
        let e = side
            .await_layer(&req(1, vec![0]), std::time::Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::WrongRole);
        let group = Arc::new(Waits::default());
        side.set_group(group.clone());
        for layer in [4, 7, 8] {
            let e = side
                .await_layer(&req(layer, vec![0]), std::time::Duration::from_secs(1))
                .unwrap_err();
            assert_eq!(e.reason, pb::ErrorReason::LayerOutOfRange, "layer {layer}");
        }
        let e = side
            .await_layer(&req(1, vec![0, 0]), std::time::Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::Malformed);
        let e = side
            .await_layer(&req(1, vec![PAGES]), std::time::Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::PageOutOfRange);
        assert!(lock(&group.0).is_empty(), "nothing reached the group");
        let r = side
            .await_layer(&req(3, vec![5, 2]), std::time::Duration::from_secs(1))
            .unwrap();
        assert_eq!(r.pages, 2);
        assert_eq!(*lock(&group.0), vec![(RoomKey::new(7, 1), 3, vec![5, 2])]);
        // A side without LayerSplit refuses the call.
        let plain = PrefillSide::new(
            side.pools().to_vec(),
            Arc::new(Recorder::default()),
            PrefillRank(0),
        );
        let e = plain
            .await_layer(&req(1, vec![0]), std::time::Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(e.reason, pb::ErrorReason::WrongRole);
    }
}
