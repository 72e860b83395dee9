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

/// The prefill side of one worker's engine API.
pub struct PrefillSide {
    pools: Vec<Arc<KvPool>>,
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
        Arc::new(Self {
            pools,
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
                },
            );
        }
        self.stats.rooms_submitted.fetch_add(1, Ordering::Relaxed);
        self.work.emit(work);
        Ok(())
    }

    /// PagesReady: validates, begins one write of the room and hands it to the transport. Returns
    /// false when the room failed (the call's pages are returned at once in a SourceFree event).
    ///
    /// # Errors
    /// `MALFORMED` (no room, no pages, a page listed twice or held by another live room),
    /// `PAGE_OUT_OF_RANGE`, `LAYER_OUT_OF_RANGE`, `UNKNOWN_ROOM`.
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
            return Err(ApiError::malformed("pages", "PagesReady names no page"));
        }
        let mut seen = BTreeSet::new();
        for &p in &req.pages {
            if p >= g.pages {
                return Err(ApiError::page_out_of_range(p, g.pages));
            }
            if !seen.insert(p) {
                return Err(ApiError::malformed(
                    "pages",
                    format!("page {p} is listed twice"),
                ));
            }
        }
        let layers = match req.layers {
            None => 0..g.layers,
            Some(r) => r.start..r.end,
        };
        if layers.is_empty() || layers.end > g.layers {
            return Err(ApiError::new(
                Code::InvalidArgument,
                pb::ErrorReason::LayerOutOfRange,
                format!(
                    "layers {}..{} is empty or leaves 0..{}",
                    layers.start, layers.end, g.layers
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
            });
            held.pages.extend(req.pages.iter().copied());
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
