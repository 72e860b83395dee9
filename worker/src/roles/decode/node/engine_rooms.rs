//! The decode node's engine rooms (DESIGN §3.1 "Decode side"): the [`KvSource`] behind the engine
//! API of a decode worker whose config names an engine, and the hand-off of the front door's
//! requests to that engine.
//!
//! 1. The front door admits a request and its router picks the prefill peer; [`EngineRooms::submit`]
//!    records the attempt and hands it to the engine as a [`DecodeWork`](api::DecodeWork).
//! 2. The engine Reserves pages for it; [`KvSource::open`] opens the room on the chosen peer over
//!    the peer protocol, with the engine's target pool (registered on the node's TCP receiver as
//!    [`ENGINE_REGION`], a [`PoolRegion`]) as the destination: the prefill writes straight into the
//!    engine's pages, and the receiver admits only the room's generation (contract 3).
//! 3. The peer's signals for the room (`ChunkDone`, `RoomFailed`, `AbortAck`), a lost peer and the
//!    receiver fence reach the engine API's [`DecodeSide`], whose release gate decides every page's
//!    fate; the engine gets pages back only in its `SafeToReuse` ([`KvSource::released`] then forgets
//!    the room on the receiver).
//! 4. The engine's EmitTokens (tokens, verification, the attempt's end) go back to the waiting front
//!    door ([`EngineEvent`]); an attempt nobody waits for any more is answered `cancelled`.
//!
//! Nothing here calls back into the decode side while holding this module's locks: the decode side
//! calls [`KvSource::released`] with its own lock held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tonic::Code;

use super::{DecodeNode, abort_reason, lock};
use crate::control::pb::{self as cpb, peer_message::Body};
use crate::control::{KvLayout, room_of};
use crate::engine_api::ApiError;
use crate::engine_api::decode::{DecodeSide, KvSource, RoomOpen, SessionHandOver};
use crate::engine_api::pb as api;
use crate::engine_api::service::EngineApi;
use crate::memory::pool::PoolRole;
use crate::release::receiver::FailureCause;
use crate::release::{PrefillRank, RoomKey};
use crate::roles::decode::peers::RoutedLink;
use crate::roles::decode::snapshot_push::SnapshotPush;
use crate::transfer::RegionId;
use crate::transfer::pool_region::PoolRegion;

/// The region id the engine's target pool is registered under on the node's TCP receiver.
pub const ENGINE_REGION: RegionId = RegionId(1);

/// What the engine path tells a waiting front-door request.
#[derive(Debug, Clone)]
pub enum EngineEvent {
    /// The engine reserved the attempt's pages; the room is opening on the prefill peer.
    Reserved(RoomKey),
    /// The prefill peer opened the room: the prefix hits its open-time lookup found (the tokens of
    /// the prompt it loads from L2 and L3 instead of computing them; the response's
    /// `prefix_hit_tokens`). Always sent before the room's KV can complete.
    Opened(cpb::PrefixHits),
    /// An EmitTokens of the attempt (tokens, verification, maybe its end).
    Report(api::EmitTokensRequest),
    /// The engine detached or died: the attempt cannot end otherwise (its room, if any, failed
    /// through the gate).
    EngineLost(String),
}

struct Pending {
    attempt: u32,
    /// The hand-off token a Reserve must carry (0: none, a DecodeWork hand-off).
    token: u64,
    link: RoutedLink,
    spec: cpb::RequestSpec,
    tx: mpsc::UnboundedSender<EngineEvent>,
    room: Option<RoomKey>,
    /// Why the prefill will not compute the prompt (its engine refused the front door's
    /// hand-off), once known: no room opens any more, and an open one has failed.
    refused: Option<String>,
    /// The attempt's session KV for snapshot sync (SyncSession).
    session: SessionKv,
}

/// A turn's session KV on its way to the prefill of the next turn (snapshot sync, contract 4).
#[derive(Default)]
struct SessionKv {
    /// The session's page hashes after the turn (`DecodeWork.session_kv_hashes`); empty: no sync.
    hashes: Vec<u64>,
    /// Pages the engine handed over so far, in session order.
    staged: Vec<Arc<[u8]>>,
    /// The push started (no more pages are taken).
    started: bool,
    /// The staged pages' room in the sync budget ([`SnapshotPush::hold_pages`]).
    held: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Pages of calls being copied now (counted against the session's length before the copy).
    copying: usize,
    /// Why the hand-over failed: a refused or failed call ends it, since the pages after it could
    /// no longer be paired with the right hashes (pairing is by position).
    failed: Option<String>,
}

impl SessionKv {
    /// Ends the hand-over for `why` (the first reason stays): the staged copies and their room in
    /// the sync budget go at once, and every later call of the attempt is refused.
    fn fail(&mut self, why: String) {
        self.failed.get_or_insert(why);
        self.staged.clear();
        self.held = None;
    }
}

#[derive(Debug, Clone)]
struct EngineRoom {
    peer: String,
    complete: bool,
    /// The peer answered OpenRoom (its hits went to the attempt).
    opened: bool,
    /// The last chunk landed before the OpenRoom answer: the completion waits for it, so that the
    /// attempt learns the hits before its KV is complete.
    complete_on_open: bool,
}

/// Counters of the engine path (monotonic).
#[derive(Debug, Default)]
pub struct EngineRoomStats {
    /// Attempts handed to the engine as DecodeWork.
    pub work_submitted: AtomicU64,
    /// Rooms opened on prefill peers for the engine's Reserves.
    pub rooms_opened: AtomicU64,
    /// Rooms whose KV landed completely (and the receiver fenced them).
    pub rooms_complete: AtomicU64,
    /// Tokens the engine emitted.
    pub tokens_emitted: AtomicU64,
    /// Chunks the engine verified.
    pub chunks_verified: AtomicU64,
    /// Chunks the engine found corrupt.
    pub corrupt_chunks: AtomicU64,
    /// Attempts that ended because the engine detached or died.
    pub engine_lost: AtomicU64,
    /// EmitTokens answered `cancelled`.
    pub cancelled_reports: AtomicU64,
    /// Hand-offs whose prefill engine refused the request ([`EngineRooms::prefill_refused`]).
    pub prefill_refused: AtomicU64,
    /// Session syncs started from pages the engine handed over (SyncSession).
    pub sessions_synced: AtomicU64,
    /// Pages of session KV the engine handed over.
    pub session_pages: AtomicU64,
    /// Pages of session KV refused because the sync budget was full
    /// ([`crate::roles::decode::snapshot_push::SYNC_BUDGET_BYTES`]).
    pub session_pages_refused: AtomicU64,
}

/// The engine rooms of one decode node.
pub struct EngineRooms {
    node: Arc<DecodeNode>,
    layout: KvLayout,
    api: OnceLock<Weak<EngineApi>>,
    pending: Mutex<HashMap<u64, Pending>>,
    rooms: Mutex<HashMap<RoomKey, EngineRoom>>,
    /// Snapshot sync of finished turns (unset: sync off, SyncSession refused).
    snapshots: OnceLock<Arc<SnapshotPush>>,
    runtime: tokio::runtime::Handle,
    /// Counters.
    pub stats: EngineRoomStats,
}

impl std::fmt::Debug for EngineRooms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineRooms")
            .field("layout", &self.layout)
            .finish()
    }
}

impl EngineRooms {
    /// The engine rooms of `node`, whose rooms move KV in `layout` (the engine's target pool must
    /// have that geometry, page-first). Must be created inside a Tokio runtime.
    ///
    /// # Errors
    /// When called outside a Tokio runtime.
    pub fn new(node: &Arc<DecodeNode>, layout: KvLayout) -> Result<Arc<Self>, String> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| "the engine rooms need a Tokio runtime".to_owned())?;
        let me = Arc::new(Self {
            node: node.clone(),
            layout,
            api: OnceLock::new(),
            pending: Mutex::new(HashMap::new()),
            rooms: Mutex::new(HashMap::new()),
            snapshots: OnceLock::new(),
            runtime,
            stats: EngineRoomStats::default(),
        });
        let _ = node.engine_rooms.set(Arc::downgrade(&me));
        Ok(me)
    }

    /// Turns snapshot sync on: the session KV an engine hands over with SyncSession is pushed by
    /// `push` (set once; later calls are ignored).
    pub fn set_snapshots(&self, push: Arc<SnapshotPush>) {
        let _ = self.snapshots.set(push);
    }

    /// Whether snapshot sync is on (DecodeWork then carries the session's hashes).
    pub fn syncs_sessions(&self) -> bool {
        self.snapshots.get().is_some()
    }

    /// Binds the engine API whose decode side these rooms feed, and registers its target pool as
    /// [`ENGINE_REGION`] on the node's TCP receiver.
    ///
    /// # Errors
    /// No target pool, a pool outside the host domains, or a pool geometry that is not the
    /// transfer layout (page-first, same chunk bytes and layers).
    pub fn bind(&self, api: &Arc<EngineApi>) -> Result<(), String> {
        let pool = api
            .pools()
            .pool(PoolRole::Target)
            .ok_or("the engine API has no target pool")?;
        let g = *pool.geometry();
        if g.layout != crate::memory::pool::PoolLayout::PageFirst
            || g.chunk_bytes() != self.layout.chunk_bytes()
            || g.layers != self.layout.layers
            || g.page_tokens != self.layout.page_tokens
        {
            return Err(format!(
                "the engine's target pool ({g:?}) is not the transfer layout {:?}",
                self.layout
            ));
        }
        let region = PoolRegion::for_tcp(pool).map_err(|e| e.to_string())?;
        self.node
            .receiver
            .register_region(ENGINE_REGION, Arc::new(region));
        let _ = self.api.set(Arc::downgrade(api));
        Ok(())
    }

    /// Teardown (DESIGN contract 9, "deregister memory from the transports"): the engine's target
    /// pool leaves the node's TCP receiver, which held it since [`EngineRooms::bind`]; writes that
    /// still arrive are dropped. Returns whether it was registered.
    pub fn unbind(&self) -> bool {
        self.node
            .receiver
            .deregister_region(ENGINE_REGION)
            .is_some()
    }

    fn api(&self) -> Option<Arc<EngineApi>> {
        self.api.get()?.upgrade()
    }

    fn side(&self) -> Option<Arc<DecodeSide>> {
        self.api()?.decode_side()
    }

    /// Pages of the engine's pools in all.
    pub fn total_pages(&self) -> u32 {
        self.api().map_or(0, |a| a.pools().pages())
    }

    /// Prompt tokens the engine's pools hold in all.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.total_pages()) * u64::from(self.layout.page_tokens)
    }

    /// Tokens per page.
    pub fn page_tokens(&self) -> u32 {
        self.layout.page_tokens
    }

    /// Bytes of one page of KV as it is moved (the target pool's page).
    pub fn page_bytes(&self) -> u64 {
        self.layout.page_bytes()
    }

    /// Attempts waiting on the engine now.
    pub fn pending(&self) -> usize {
        lock(&self.pending).len()
    }

    /// Rooms of the engine the node tracks (open, or failed and not yet released).
    pub fn rooms(&self) -> usize {
        lock(&self.rooms).len()
    }

    /// Hands attempt `work.attempt` of request `work.request_id`, whose room goes to `link`, to the
    /// engine (a newer attempt replaces an older one). Returns the attempt's events.
    ///
    /// # Errors
    /// No engine attached (nobody would decode it).
    pub fn submit(
        &self,
        work: api::DecodeWork,
        link: RoutedLink,
        spec: cpb::RequestSpec,
    ) -> Result<mpsc::UnboundedReceiver<EngineEvent>, String> {
        let (rx, side) = self.hand_over(work.request_id, work.attempt, 0, link, spec)?;
        if !work.session_kv_hashes.is_empty()
            && let Some(p) = lock(&self.pending)
                .get_mut(&work.request_id)
                .filter(|p| p.attempt == work.attempt)
        {
            p.session.hashes = work.session_kv_hashes.clone();
        }
        side.work().emit(work);
        Ok(rx)
    }

    /// Records attempt `attempt` of `request_id`, whose room goes to `link`, as handed to the
    /// engine without a `DecodeWork`: an engine that serves its own API (vLLM) learns of the
    /// request from the front door's HTTP hand-off (`roles::decode::own_api`) and Reserves under
    /// this id with `token` (non-zero: a Reserve without it opens no room). Returns the attempt's
    /// events and the decode side.
    ///
    /// # Errors
    /// No engine attached (nobody would decode it).
    pub fn hand_over(
        &self,
        request_id: u64,
        attempt: u32,
        token: u64,
        link: RoutedLink,
        spec: cpb::RequestSpec,
    ) -> Result<(mpsc::UnboundedReceiver<EngineEvent>, Arc<DecodeSide>), String> {
        let api = self.api().ok_or("the engine API is gone")?;
        let attach = api
            .current_attach()
            .ok_or("no decode engine is attached to this worker")?;
        let side = api
            .decode_side()
            .ok_or("no decode engine is attached to this worker")?;
        if side.current_attach() != attach {
            return Err("the decode engine is attaching".into());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let old = lock(&self.pending).insert(
            request_id,
            Pending {
                attempt,
                token,
                link,
                spec,
                tx,
                room: None,
                refused: None,
                session: SessionKv::default(),
            },
        );
        if let Some(old) = old {
            self.abandon(old);
        }
        self.stats.work_submitted.fetch_add(1, Ordering::Relaxed);
        Ok((rx, side))
    }

    /// Nobody waits for attempt `attempt` of `request` any more (it ended, or its front-door
    /// request was dropped): forgotten; a room still waiting for its KV fails through the gate
    /// (cause `ClientAbort`). A room being decoded is left to the engine, whose next EmitTokens is
    /// answered `cancelled` (it then Aborts).
    pub fn forget(&self, request: u64, attempt: u32) {
        let mut pending = lock(&self.pending);
        if pending.get(&request).is_some_and(|p| p.attempt == attempt) {
            let p = pending.remove(&request);
            drop(pending);
            if let Some(p) = p {
                self.abandon(p);
            }
        }
    }

    /// The prefill's engine refused attempt `attempt` of `request` (the front door's hand-off to
    /// it failed: an error status, or no connection; `roles::decode::own_api`), so no KV will
    /// come: a room already reserved fails now through the gate (cause `PrefillFailed`), and a
    /// later Reserve under this id is refused — the decode engine recomputes at once instead of
    /// waiting out the KV deadline. Safe whatever the prefill did: a late write of a failed room
    /// is fenced out by the gate like any other.
    pub fn prefill_refused(&self, request: u64, attempt: u32, why: &str) {
        let room = {
            let mut pending = lock(&self.pending);
            let Some(p) = pending
                .get_mut(&request)
                .filter(|p| p.attempt == attempt && p.refused.is_none())
            else {
                return;
            };
            p.refused = Some(why.to_owned());
            // No room of this attempt will compute on that peer.
            p.link.settle();
            p.room
        };
        self.stats.prefill_refused.fetch_add(1, Ordering::Relaxed);
        let Some(key) = room else { return };
        let complete = lock(&self.rooms).get(&key).is_none_or(|r| r.complete);
        if !complete && let Some(side) = self.side() {
            side.fail(key, FailureCause::PrefillFailed);
        }
    }

    fn abandon(&self, p: Pending) {
        let Some(key) = p.room else { return };
        let complete = lock(&self.rooms).get(&key).is_none_or(|r| r.complete);
        if !complete && let Some(side) = self.side() {
            side.fail(key, FailureCause::ClientAbort);
        }
    }

    /// The engine's attach ended: every waiting attempt is told (its room already failed through
    /// the gate, cause `Shutdown`).
    pub fn engine_lost(&self, why: &str) {
        let pending = lock(&self.pending);
        for p in pending.values() {
            self.stats.engine_lost.fetch_add(1, Ordering::Relaxed);
            let _ = p.tx.send(EngineEvent::EngineLost(why.to_owned()));
        }
    }

    /// A peer signal: handled (true) when it names one of the engine's rooms.
    pub(super) fn on_message(&self, m: &cpb::PeerMessage) -> bool {
        let key = match &m.body {
            Some(Body::Ack(a)) => room_of(a.room),
            Some(Body::Chunk(c)) => room_of(c.room),
            Some(Body::Failed(f)) => room_of(f.room),
            _ => None,
        };
        let Some(key) = key else { return false };
        if !lock(&self.rooms).contains_key(&key) {
            return false;
        }
        let Some(side) = self.side() else {
            return true;
        };
        match &m.body {
            Some(Body::Ack(a)) => {
                self.node.acks_received.fetch_add(1, Ordering::Relaxed);
                side.on_ack(key, PrefillRank(a.prefill_rank));
            }
            Some(Body::Chunk(c)) => {
                side.on_chunk(key);
                if c.last {
                    self.settle_link(key);
                    let now = lock(&self.rooms).get_mut(&key).is_some_and(|r| {
                        r.complete = true;
                        r.complete_on_open = !r.opened;
                        r.opened
                    });
                    if now {
                        complete(&self.node, &self.runtime, side, key);
                    }
                    self.stats.rooms_complete.fetch_add(1, Ordering::Relaxed);
                }
            }
            Some(Body::Failed(f)) => {
                tracing::info!(%key, reason = %f.reason, "prefill reported an engine room failed");
                side.on_failed(key, FailureCause::PrefillFailed);
            }
            _ => {}
        }
        true
    }

    /// The attempt whose room is `key` no longer loads its prefill peer (its KV is in, or the room
    /// ended): its link leaves the peer's routing load ([`RoutedLink::settle`]); the link itself
    /// stays with the attempt until the request ends.
    fn settle_link(&self, key: RoomKey) {
        for p in lock(&self.pending).values() {
            if p.room == Some(key) {
                p.link.settle();
            }
        }
    }

    /// The prefill peer at `addr` is gone: every engine room it could still write fails through the
    /// gate (a complete room is being decoded; the peer's death cannot touch it).
    pub(super) fn peer_lost(&self, addr: &str) {
        let keys: Vec<RoomKey> = lock(&self.rooms)
            .iter()
            .filter(|(_, r)| r.peer == addr && !r.complete)
            .map(|(k, _)| *k)
            .collect();
        if let Some(side) = self.side() {
            for k in keys {
                side.on_failed(k, FailureCause::HeartbeatLost);
            }
        }
    }

    /// The engine rooms on the peer at `addr` (its heartbeat lists them as live).
    pub(super) fn live_rooms(&self, addr: &str) -> Vec<cpb::RoomRef> {
        lock(&self.rooms)
            .iter()
            .filter(|(_, r)| r.peer == addr)
            .map(|(k, _)| (*k).into())
            .collect()
    }
}

/// Every write of `key` concluded: the receiver closes the room (nothing lands in its pages while
/// the engine reads them), then the KV is complete.
fn failed_precondition(msg: String) -> ApiError {
    ApiError::new(Code::FailedPrecondition, api::ErrorReason::Unspecified, msg)
}

/// The session of the attempt a SyncSession names, still taking pages.
///
/// # Errors
/// `FAILED_PRECONDITION` when nobody waits for the attempt, it names no session KV or its sync
/// started; `UNKNOWN_ROOM` when the room is not the attempt's.
fn session_of<'p>(
    pending: &'p mut HashMap<u64, Pending>,
    handed: &SessionHandOver<'_>,
) -> Result<&'p mut SessionKv, ApiError> {
    let p = pending
        .get_mut(&handed.request_id)
        .filter(|p| p.attempt == handed.attempt)
        .ok_or_else(|| {
            failed_precondition(format!(
                "nobody waits for attempt {} of request {} any more",
                handed.attempt, handed.request_id
            ))
        })?;
    if p.room != Some(handed.room) {
        return Err(ApiError::new(
            Code::NotFound,
            api::ErrorReason::UnknownRoom,
            format!(
                "{} is not the room of attempt {} of request {}",
                handed.room, p.attempt, handed.request_id
            ),
        )
        .field("room"));
    }
    let s = &mut p.session;
    if s.hashes.is_empty() {
        return Err(failed_precondition(format!(
            "attempt {} of request {} names no session KV",
            handed.attempt, handed.request_id
        )));
    }
    if s.started {
        return Err(failed_precondition(format!(
            "the session of request {} is already syncing",
            handed.request_id
        )));
    }
    if let Some(why) = &s.failed {
        return Err(failed_precondition(format!(
            "the session hand-over of request {} failed earlier: {why}",
            handed.request_id
        )));
    }
    Ok(s)
}

fn complete(
    node: &Arc<DecodeNode>,
    runtime: &tokio::runtime::Handle,
    side: Arc<DecodeSide>,
    key: RoomKey,
) {
    let node = node.clone();
    runtime.spawn_blocking(move || {
        match node
            .receiver
            .fence(key, Instant::now() + Duration::from_secs(1))
        {
            Ok(_) => side.on_complete(key),
            Err(e) => {
                tracing::warn!(%key, error = %e, "fence at completion failed");
                side.on_failed(key, FailureCause::TransferFailed);
            }
        }
    });
}

impl EngineRooms {
    /// The peer answered the OpenRoom of `key`: the attempt gets the hits, then a completion that
    /// waited for the answer runs.
    fn opened(&self, key: RoomKey, hits: cpb::PrefixHits, tx: &mpsc::UnboundedSender<EngineEvent>) {
        let _ = tx.send(EngineEvent::Opened(hits));
        let waiting = lock(&self.rooms).get_mut(&key).is_some_and(|r| {
            r.opened = true;
            std::mem::take(&mut r.complete_on_open)
        });
        if waiting && let Some(side) = self.side() {
            complete(&self.node, &self.runtime, side, key);
        }
    }
}

impl KvSource for EngineRooms {
    fn writers(&self, request_id: u64) -> Vec<PrefillRank> {
        lock(&self.pending)
            .get(&request_id)
            .map(|p| vec![p.link.rank])
            .unwrap_or_default()
    }

    fn open(&self, room: RoomOpen) -> Result<(), String> {
        let (link, spec, tx) = {
            let mut pending = lock(&self.pending);
            let p = pending.get_mut(&room.request_id).ok_or_else(|| {
                format!(
                    "request {} was not handed to this engine (or nobody waits for it any more)",
                    room.request_id
                )
            })?;
            if p.token != room.hand_off_token {
                return Err(format!(
                    "request {} was handed over with another hand-off token: the Reserve must \
                     carry the token of kv_transfer_params.tandem",
                    room.request_id
                ));
            }
            if let Some(k) = p.room {
                return Err(format!(
                    "attempt {} of request {} already reserved {k}",
                    p.attempt, room.request_id
                ));
            }
            if let Some(why) = &p.refused {
                return Err(format!(
                    "request {}: the prefill's engine refused it ({why}); no KV will come",
                    room.request_id
                ));
            }
            p.room = Some(room.key);
            // Known in `rooms` before the pending lock goes (lock order: pending, then rooms), so
            // that `prefill_refused` or `abandon` never takes the room for a complete one.
            lock(&self.rooms).insert(
                room.key,
                EngineRoom {
                    peer: p.link.addr().to_owned(),
                    complete: false,
                    opened: false,
                    complete_on_open: false,
                },
            );
            ((*p.link).clone(), p.spec.clone(), p.tx.clone())
        };
        self.node.receiver.open_room(room.key);
        self.stats.rooms_opened.fetch_add(1, Ordering::Relaxed);
        let _ = tx.send(EngineEvent::Reserved(room.key));
        let open = cpb::OpenRoomRequest {
            room: Some(room.key.into()),
            decode_rank: self.node.cfg.rank,
            request: Some(cpb::RequestSpec {
                input_tokens: room.tokens,
                ..spec
            }),
            decode_worker: self.node.cfg.worker_id.clone(),
            data_addr: self.node.data_addr(),
            dst_region: ENGINE_REGION.0,
            dst_pages: room.pages.clone(),
            layout: Some(self.layout.into()),
            deadline_ms: room.deadline.as_millis() as u64,
            decode_incarnation: self.node.incarnation,
            hand_off_token: room.hand_off_token,
        };
        let mut client = link.client.clone();
        let api = self.api.get().cloned();
        let key = room.key;
        let me = self.node.engine_rooms.get().cloned();
        self.runtime.spawn(async move {
            match client.open_room(open).await {
                Ok(reply) => {
                    let hits = reply.into_inner().hits.unwrap_or_default();
                    if let Some(me) = me.and_then(|w| w.upgrade()) {
                        me.opened(key, hits, &tx);
                    }
                }
                Err(status) => {
                    tracing::warn!(%key, %status, "OpenRoom of an engine room failed");
                    if let Some(side) = api.and_then(|a| a.upgrade()).and_then(|a| a.decode_side())
                    {
                        side.on_failed(key, FailureCause::TransferFailed);
                    }
                }
            }
        });
        Ok(())
    }

    fn abort(&self, key: RoomKey, ranks: &[PrefillRank], cause: FailureCause) {
        let Some(peer) = lock(&self.rooms).get(&key).map(|r| r.peer.clone()) else {
            return;
        };
        // The room failed: it no longer loads the peer's prefill, whenever its pages come back.
        self.settle_link(key);
        let link = lock(&self.node.state).links.get(&peer).cloned();
        let Some(link) = link else {
            // The peer is gone: its link's loss failed the room; the fence or the ack deadline
            // decides the pages.
            return;
        };
        for _ in ranks {
            let _ = link.signal.send(cpb::PeerMessage {
                body: Some(Body::Abort(cpb::Abort {
                    room: Some(key.into()),
                    decode_rank: self.node.cfg.rank,
                    reason: abort_reason(cause) as i32,
                })),
            });
        }
    }

    fn request_proof(&self, key: RoomKey) {
        if !self.node.cfg.fence_is_proof {
            return;
        }
        let node = self.node.clone();
        let api = self.api.get().cloned();
        self.runtime.spawn_blocking(move || {
            if let Ok(proof) = node
                .receiver
                .fence(key, Instant::now() + Duration::from_secs(1))
                && let Some(side) = api.and_then(|a| a.upgrade()).and_then(|a| a.decode_side())
            {
                side.on_transport_proof(key, proof);
            }
        });
    }

    fn released(&self, key: RoomKey) {
        lock(&self.rooms).remove(&key);
        self.settle_link(key);
        // Closing never waits here (deadline now): the gate proved no write can land.
        let _ = self.node.receiver.fence(key, Instant::now());
        self.node.receiver.forget_room(key.room);
    }

    fn sync_session(&self, handed: SessionHandOver<'_>) -> Result<api::SyncSessionReply, ApiError> {
        let push = self
            .snapshots
            .get()
            .cloned()
            .ok_or_else(|| failed_precondition("snapshot sync is off on this worker".into()))?;
        // 1. The attempt, its session and the budget, before any byte is copied: the whole
        //    session's pages are held at its first call, so a session either has its room in the
        //    budget for all its calls or is refused at once. Any refusal from here on ends the
        //    hand-over (`SessionKv::failed`).
        {
            let mut pending = lock(&self.pending);
            let s = session_of(&mut pending, &handed)?;
            let left = s.hashes.len() - s.staged.len() - s.copying;
            if handed.pages > left {
                let e = ApiError::malformed(
                    "pages",
                    format!(
                        "{} pages handed over, {left} of the session's {} left",
                        handed.pages,
                        s.hashes.len()
                    ),
                );
                s.fail(e.message.clone());
                return Err(e);
            }
            if s.held.is_none() && handed.pages > 0 {
                let want = u32::try_from(s.hashes.len()).unwrap_or(u32::MAX);
                let Some(permit) = push.hold_pages(want) else {
                    self.stats
                        .session_pages_refused
                        .fetch_add(u64::from(want), Ordering::Relaxed);
                    let budget = push.budget_pages();
                    let why = if want > budget {
                        format!(
                            "snapshot sync: a session of {want} pages exceeds the whole budget of \
                             {budget} pages (TANDEM_DECODE_SNAPSHOT_SYNC_BUDGET_BYTES); the turn \
                             finishes unsynced"
                        )
                    } else {
                        format!(
                            "snapshot sync: a session of {want} pages does not fit the budget of \
                             {budget} pages with the syncs in flight now; the turn finishes unsynced"
                        )
                    };
                    s.fail(why.clone());
                    return Err(ApiError::new(
                        Code::ResourceExhausted,
                        api::ErrorReason::Unspecified,
                        why,
                    ));
                };
                s.held = Some(permit);
            }
            s.copying += handed.pages;
        }
        // 2. The copy, outside this module's locks.
        let copied = if handed.pages > 0 {
            (handed.copy)()
        } else {
            Ok(Vec::new())
        };
        // 3. Staged; the push starts with the last page.
        let (hashes, pages, held) = {
            let mut pending = lock(&self.pending);
            let s = session_of(&mut pending, &handed)?;
            s.copying = s.copying.saturating_sub(handed.pages);
            let pages = match copied {
                Ok(p) => p,
                Err(e) => {
                    s.fail(e.message.clone());
                    return Err(e);
                }
            };
            self.stats
                .session_pages
                .fetch_add(pages.len() as u64, Ordering::Relaxed);
            s.staged.extend(pages);
            let taken = s.staged.len();
            if taken == 0 || (!handed.last && taken < s.hashes.len()) {
                return Ok(api::SyncSessionReply {
                    pages_taken: taken as u32,
                    started: false,
                });
            }
            s.started = true;
            (
                s.hashes[..taken].to_vec(),
                std::mem::take(&mut s.staged),
                s.held.take(),
            )
        };
        let taken = pages.len() as u32;
        self.stats.sessions_synced.fetch_add(1, Ordering::Relaxed);
        let _guard = self.runtime.enter();
        push.spawn_pages(hashes, pages, held);
        Ok(api::SyncSessionReply {
            pages_taken: taken,
            started: true,
        })
    }

    fn sync_refused(&self, request_id: u64, attempt: u32, why: &str) {
        let mut pending = lock(&self.pending);
        if let Some(p) = pending
            .get_mut(&request_id)
            .filter(|p| p.attempt == attempt)
        {
            let s = &mut p.session;
            if !s.hashes.is_empty() && !s.started {
                s.fail(format!("a SyncSession was refused: {why}"));
            }
        }
    }

    fn emit_tokens(&self, report: &api::EmitTokensRequest) -> Result<bool, ApiError> {
        let pending = lock(&self.pending);
        let Some(p) = pending
            .get(&report.request_id)
            .filter(|p| p.attempt == report.attempt)
        else {
            self.stats.cancelled_reports.fetch_add(1, Ordering::Relaxed);
            return Ok(true);
        };
        if let Some(r) = report.room {
            let named = RoomKey::from(r);
            if p.room != Some(named) {
                return Err(ApiError::new(
                    Code::NotFound,
                    api::ErrorReason::UnknownRoom,
                    format!(
                        "{named} is not the room of attempt {} of request {}",
                        p.attempt, report.request_id
                    ),
                )
                .field("room"));
            }
        }
        let s = &self.stats;
        s.tokens_emitted
            .fetch_add(report.tokens.len() as u64, Ordering::Relaxed);
        s.chunks_verified
            .fetch_add(report.chunks_verified, Ordering::Relaxed);
        s.corrupt_chunks
            .fetch_add(report.corrupt_chunks, Ordering::Relaxed);
        let gone = p.tx.send(EngineEvent::Report(report.clone())).is_err();
        if gone {
            s.cancelled_reports.fetch_add(1, Ordering::Relaxed);
        }
        Ok(gone)
    }
}
