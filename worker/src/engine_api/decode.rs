//! The decode side of the engine API: Reserve, AwaitKv, Finish, Abort, SafeToReuse and the spec
//! stats, over the release gate of DESIGN contract 3 and the spec guard of contract 8.
//!
//! Every decision about a room's pages is the gate's: each room is a
//! [`ReceiverRoom`] whose [`GateVerdict`]s this module only
//! carries out, and pages whose release is not proven by the ack deadline sit in the
//! [`Quarantine`] until a late proof. Finish and Abort hand the
//! pages to the gate; the engine gets them back only in a [`pb::SafeToReuse`] event. The transport
//! that fills the pages is a [`KvSource`] (a prefill peer in the serving path; [`super::local`] for a
//! same-host pair): it reports chunks, completion, acks and transport proofs back through
//! [`DecodeSide::on_chunk`], [`DecodeSide::on_complete`], [`DecodeSide::on_ack`],
//! [`DecodeSide::on_transport_proof`] and [`DecodeSide::on_failed`].
//!
//! Page index `i` names page `i` of every pool of the attach; the pools' page tables are kept in
//! lockstep (every allocation and free is applied to each, in the same order).
//!
//! A worker that receives the client requests (the Tandem front door) hands them to the engine as
//! [`pb::DecodeWork`] events ([`DecodeSide::work`], `Decode.WatchWork`) and gets the engine's tokens
//! back through [`KvSource::emit_tokens`] (`Decode.EmitTokens`); the serving path's source is
//! `roles::decode::node::engine_rooms`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tonic::Code;

use crate::memory::pool::{KvPool, PageError, PageId, PoolError};
use crate::release::quarantine::Quarantine;
use crate::release::receiver::{
    AckOutcome, FailureCause, GateMode, GateVerdict, ReceiverRoom, ReceiverState, ReleaseProof,
    TransportProof,
};
use crate::release::{PrefillRank, RoomKey};
use crate::spec_guard::{SpecGuard, Thresholds, Verdict};

use super::error::ApiError;
use super::hub::EventHub;
use super::pb;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A reserved room, as the transport needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomOpen {
    /// Room and generation.
    pub key: RoomKey,
    /// The engine's request id.
    pub request_id: u64,
    /// Prompt tokens whose KV must land.
    pub tokens: u32,
    /// Destination page indices, in token order.
    pub pages: Vec<u32>,
    /// How long the KV may take.
    pub deadline: Duration,
    /// The Reserve's hand-off token (`ReserveRequest.hand_off_token`; 0 when none).
    pub hand_off_token: u64,
}

/// The transport that delivers a room's KV into this worker's pools (the seam the serving path wires
/// to its prefill peers). Implementations must not call back into the [`DecodeSide`] synchronously
/// from [`KvSource::open`]; [`KvSource::abort`] may (an ack can be immediate).
pub trait KvSource: Send + Sync + 'static {
    /// The prefill ranks that may write a room of `request_id` (each must ack an abort).
    fn writers(&self, request_id: u64) -> Vec<PrefillRank>;
    /// Starts delivering the room's KV.
    ///
    /// # Errors
    /// Why the room cannot be delivered (no prefill peer); nothing was started.
    fn open(&self, room: RoomOpen) -> Result<(), String>;
    /// The room failed: tell `ranks` (ABORT); their acks come back via [`DecodeSide::on_ack`].
    fn abort(&self, key: RoomKey, ranks: &[PrefillRank], cause: FailureCause);
    /// Asks for a transport proof that no write of `key` can land (e.g. the TCP receiver fence),
    /// reported via [`DecodeSide::on_transport_proof`]. The default offers none (ack-only path).
    fn request_proof(&self, _key: RoomKey) {}
    /// The gate released the room's pages (its SafeToReuse was emitted): the transport forgets the
    /// room. Called with the decode side's state lock held: must not call back into it. Default:
    /// nothing to forget.
    fn released(&self, _key: RoomKey) {}
    /// EmitTokens of a [`pb::DecodeWork`] attempt: the tokens and the end reach whoever handed out
    /// the work (the worker's front door). Returns whether the attempt is cancelled (nobody waits
    /// for it). May call back into the decode side.
    ///
    /// # Errors
    /// `WRONG_ROLE` by default: this transport hands out no DecodeWork.
    fn emit_tokens(&self, _report: &pb::EmitTokensRequest) -> Result<bool, ApiError> {
        Err(ApiError::new(
            Code::FailedPrecondition,
            pb::ErrorReason::WrongRole,
            "this worker hands out no DecodeWork: there is nothing to emit tokens for",
        ))
    }
    /// SyncSession of a [`pb::DecodeWork`] attempt (snapshot sync, contract 4): the next pages of
    /// the attempt's session KV, in room `handed.room`. The implementation checks the attempt and
    /// holds its memory budget *before* it calls `handed.copy` (which copies the pages out of the
    /// engine's pool), then pairs the copies with the session's hashes and starts the push. It must
    /// not hold its own locks across `copy`, and may not call back into the decode side.
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` by default: this transport hands out no DecodeWork, so no attempt has
    /// a session to sync.
    fn sync_session(&self, _handed: SessionHandOver<'_>) -> Result<pb::SyncSessionReply, ApiError> {
        Err(ApiError::new(
            Code::FailedPrecondition,
            pb::ErrorReason::WrongRole,
            "this worker hands out no DecodeWork: there is no session to sync",
        ))
    }
    /// The decode side refused a SyncSession of attempt `attempt` of `request_id` before handing
    /// it over (`why`: a malformed page list, a page not of the room, a room whose KV is not
    /// complete): the attempt's hand-over ends as if [`KvSource::sync_session`] had refused it —
    /// pages pair with hashes by position, so an engine that went on after a refused call would
    /// pair its next pages with the wrong hashes (engine.proto `SyncSessionRequest`). Must not
    /// call back into the decode side. Nothing to end by default.
    fn sync_refused(&self, _request_id: u64, _attempt: u32, _why: &str) {}
}

/// Pages of a session's KV an engine hands over with SyncSession ([`KvSource::sync_session`]).
pub struct SessionHandOver<'a> {
    /// The attempt's request id.
    pub request_id: u64,
    /// The attempt.
    pub attempt: u32,
    /// The room the pages are in (the attempt's).
    pub room: RoomKey,
    /// How many pages this call hands over.
    pub pages: usize,
    /// No more pages follow.
    pub last: bool,
    /// Copies the pages out of the engine's target pool, in the order named: one entry per page,
    /// every layer's chunk in layer order (`layers × chunk_bytes` bytes). Fails (`UNKNOWN_ROOM`)
    /// when the room was released meanwhile: its pages may hold another room's KV by then.
    pub copy: &'a (dyn Fn() -> Result<Vec<std::sync::Arc<[u8]>>, ApiError> + Sync),
}

impl std::fmt::Debug for SessionHandOver<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHandOver")
            .field("request_id", &self.request_id)
            .field("attempt", &self.attempt)
            .field("room", &self.room)
            .field("pages", &self.pages)
            .field("last", &self.last)
            .finish()
    }
}

/// How a room ended, for AwaitKv.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Complete,
    Failed(FailureCause),
}

struct Room {
    room: ReceiverRoom,
    pages: Vec<PageId>,
    attach: u64,
    tokens: u32,
    /// When the room's KV deadline passes (Reserve time + its `kv_deadline`).
    kv_deadline_at: Instant,
    outcome: watch::Sender<Option<Outcome>>,
    guard: SpecGuard,
}

#[derive(Default)]
struct State {
    rooms: HashMap<RoomKey, Room>,
    quarantine: Quarantine<PageId>,
    current_attach: u64,
    /// `seq` of the last SafeToReuse emitted to the current attach (1, 2, ...; 0 before the first).
    release_seq: u64,
    /// Per page, the `seq` of the SafeToReuse that last released it to the current attach (absent:
    /// none did, or the release was not reported because the room was an older attach's).
    page_release: HashMap<u32, u64>,
    /// Rooms that failed and were released, with their cause ([`EndedRooms`]).
    ended: EndedRooms,
}

/// Rooms remembered by [`EndedRooms`] (the oldest are forgotten first).
const ENDED_ROOMS: usize = 4096;

/// The rooms that were released (the gate freed their pages and the room left the table: every
/// release follows a failure, Finish's included as `ClientAbort`), with their attach and cause, so
/// that a late AwaitKv answers the room's failure (a finished room's: `CLIENT_ABORT`) and a late
/// Abort answers "released". A room's KV deadline can pass between Reserve's reply and the
/// engine's AwaitKv — the demo's abort probe (30 ms deadline, debug engines) saw it — and a room
/// with no write in flight is freed at once; answering that AwaitKv `UNKNOWN_ROOM` made the engine
/// end the request as an engine error (HTTP 500, not retried) instead of the retryable KV timeout
/// it was. Bounded FIFO of [`ENDED_ROOMS`] rooms (a burst of more releases than that before the
/// engine asks — a prefill crash failing thousands of rooms at once — answers the oldest
/// `UNKNOWN_ROOM` again, as before).
#[derive(Default)]
struct EndedRooms {
    cause: HashMap<RoomKey, (u64, FailureCause)>,
    order: std::collections::VecDeque<RoomKey>,
}

impl EndedRooms {
    fn record(&mut self, key: RoomKey, attach: u64, cause: FailureCause) {
        if self.cause.insert(key, (attach, cause)).is_none() {
            self.order.push_back(key);
            if self.order.len() > ENDED_ROOMS
                && let Some(old) = self.order.pop_front()
            {
                self.cause.remove(&old);
            }
        }
    }

    /// The cause `key` failed with, if it was a room of `attach` that ended that way.
    fn of(&self, key: RoomKey, attach: u64) -> Option<FailureCause> {
        self.cause
            .get(&key)
            .filter(|(a, _)| *a == attach)
            .map(|(_, c)| *c)
    }
}

/// What Reserve handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// The room opened.
    pub key: RoomKey,
    /// Page indices in token order.
    pub pages: Vec<u32>,
    /// The `seq` of the last SafeToReuse that released any of `pages` (0: none); the engine waits
    /// for it before touching them (`ReserveReply.after_release`).
    pub after_release: u64,
}

/// Counters of the decode side (exported by the role as metrics).
#[derive(Debug, Default)]
pub struct DecodeCounters {
    /// Rooms reserved.
    pub reserved: AtomicU64,
    /// Rooms that completed.
    pub completed: AtomicU64,
    /// Rooms failed (any cause).
    pub failed: AtomicU64,
    /// Releases by proof: concluded, acks, transport, bypassed.
    pub released_concluded: AtomicU64,
    /// See `released_concluded`.
    pub released_acks: AtomicU64,
    /// See `released_concluded`.
    pub released_transport: AtomicU64,
    /// See `released_concluded`.
    pub released_bypassed: AtomicU64,
    /// Abort acks counted by the gate.
    pub acks: AtomicU64,
    /// Rooms quarantined (deadline without proof).
    pub quarantined: AtomicU64,
    /// Spec-guard trips.
    pub spec_trips: AtomicU64,
}

/// Settings of the decode side.
#[derive(Debug, Clone, Copy)]
pub struct DecodeSettings {
    /// Gate mode (`GateMode::UnsafeBypass` only as a negative control).
    pub gate: GateMode,
    /// Ack deadline of a failed room before its pages are quarantined.
    pub ack_timeout: Duration,
    /// Longest KV deadline.
    pub max_kv_deadline: Duration,
    /// First room id.
    pub room_base: u64,
    /// Spec-guard thresholds (`None`: steps are counted, never judged).
    pub thresholds: Option<Thresholds>,
}

/// The decode side of one worker's engine API.
pub struct DecodeSide {
    pools: Vec<Arc<KvPool>>,
    source: Arc<dyn KvSource>,
    settings: DecodeSettings,
    next_room: AtomicU64,
    state: Mutex<State>,
    /// Held across every allocation and free of the pools' page tables ([`DecodeSide::alloc_all`],
    /// [`DecodeSide::free_all`]): each pool must see the same operations in the same order to stay
    /// in lockstep, so a Reserve's allocation cannot interleave with a release's free (taken after
    /// `state` when both are held).
    tables: Mutex<()>,
    releases: EventHub<pb::SafeToReuse>,
    work: EventHub<pb::DecodeWork>,
    runtime: tokio::runtime::Handle,
    me: Weak<DecodeSide>,
    /// Counters.
    pub counters: DecodeCounters,
}

impl std::fmt::Debug for DecodeSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeSide")
            .field("pools", &self.pools.len())
            .field("settings", &self.settings)
            .finish()
    }
}

/// Page counts of the decode side.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodePages {
    /// Free in the pools.
    pub free: u32,
    /// Held by live rooms (reserved, landing, complete, decoding).
    pub held: u32,
    /// Held by failed rooms waiting for the gate's proof.
    pub release_pending: u32,
    /// Quarantined (no proof by the ack deadline).
    pub quarantined: u32,
}

fn wire_proof(p: ReleaseProof) -> pb::ReleaseProof {
    match p {
        ReleaseProof::Concluded => pb::ReleaseProof::Concluded,
        ReleaseProof::AllAcks => pb::ReleaseProof::AllAcks,
        ReleaseProof::Transport(_) => pb::ReleaseProof::Transport,
        #[cfg(feature = "negative-controls")]
        ReleaseProof::Bypassed => pb::ReleaseProof::Bypassed,
    }
}

/// The wire reason of a failure cause.
pub fn wire_reason(c: FailureCause) -> pb::FailureReason {
    match c {
        FailureCause::ClientAbort => pb::FailureReason::ClientAbort,
        FailureCause::Timeout => pb::FailureReason::KvTimeout,
        FailureCause::TransferFailed => pb::FailureReason::TransferFailed,
        FailureCause::HeartbeatLost => pb::FailureReason::PeerLost,
        FailureCause::PrefillFailed => pb::FailureReason::PrefillFailed,
        FailureCause::SpecGuard => pb::FailureReason::SpecGuard,
        FailureCause::Shutdown => pb::FailureReason::Shutdown,
    }
}

/// A failure cause from the wire (`CLIENT_ABORT` for unspecified).
///
/// # Errors
/// `MALFORMED` for an unknown value.
pub fn cause_from_wire(v: i32) -> Result<FailureCause, ApiError> {
    Ok(match pb::FailureReason::try_from(v) {
        Ok(pb::FailureReason::Unspecified | pb::FailureReason::ClientAbort) => {
            FailureCause::ClientAbort
        }
        Ok(pb::FailureReason::KvTimeout) => FailureCause::Timeout,
        Ok(pb::FailureReason::TransferFailed) => FailureCause::TransferFailed,
        Ok(pb::FailureReason::PeerLost) => FailureCause::HeartbeatLost,
        Ok(pb::FailureReason::PrefillFailed) => FailureCause::PrefillFailed,
        Ok(pb::FailureReason::SpecGuard) => FailureCause::SpecGuard,
        Ok(pb::FailureReason::Shutdown) => FailureCause::Shutdown,
        Err(_) => {
            return Err(ApiError::malformed(
                "reason",
                format!("failure reason {v} is unknown"),
            ));
        }
    })
}

fn unknown_room(key: RoomKey) -> ApiError {
    ApiError::new(
        Code::NotFound,
        pb::ErrorReason::UnknownRoom,
        format!("{key} is not a live room of this attach"),
    )
    .field("room")
}

impl DecodeSide {
    /// A decode side over `pools` (target first; all with the same page count) fed by `source`;
    /// its deadline timers run on `runtime`.
    pub fn new(
        pools: Vec<Arc<KvPool>>,
        source: Arc<dyn KvSource>,
        settings: DecodeSettings,
        runtime: tokio::runtime::Handle,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            pools,
            source,
            next_room: AtomicU64::new(settings.room_base.max(1)),
            settings,
            state: Mutex::new(State::default()),
            tables: Mutex::new(()),
            releases: EventHub::new("SafeToReuse"),
            work: EventHub::new("DecodeWork"),
            runtime,
            me: me.clone(),
            counters: DecodeCounters::default(),
        })
    }

    /// The pools (target first).
    pub fn pools(&self) -> &[Arc<KvPool>] {
        &self.pools
    }

    fn target(&self) -> &KvPool {
        &self.pools[0]
    }

    /// Page count of every pool.
    pub fn page_count(&self) -> u32 {
        self.target().geometry().pages
    }

    /// The release events (SafeToReuse), for WatchReleases.
    pub fn releases(&self) -> &EventHub<pb::SafeToReuse> {
        &self.releases
    }

    /// The requests handed to the engine (DecodeWork), for WatchWork.
    pub fn work(&self) -> &EventHub<pb::DecodeWork> {
        &self.work
    }

    /// The transport (and request source) of this side.
    pub fn source(&self) -> &Arc<dyn KvSource> {
        &self.source
    }

    /// The attach whose rooms are current.
    pub fn current_attach(&self) -> u64 {
        lock(&self.state).current_attach
    }

    /// A new attach became current: later releases of older attaches' rooms are not reported, and
    /// work handed to an older attach is not delivered.
    pub fn set_attach(&self, attach: u64) {
        {
            let mut st = lock(&self.state);
            st.current_attach = attach;
            // Release numbers are per attach: the new engine saw none of the old ones.
            st.release_seq = 0;
            st.page_release.clear();
        }
        self.releases.reset();
        self.work.reset();
    }

    /// Page counts now.
    pub fn pages(&self) -> DecodePages {
        let st = lock(&self.state);
        let mut p = DecodePages {
            free: self.target().stats().free,
            quarantined: st.quarantine.pages_held() as u32,
            ..DecodePages::default()
        };
        for r in st.rooms.values() {
            let n = r.pages.len() as u32;
            match r.room.state() {
                ReceiverState::ReleasePending => p.release_pending += n,
                ReceiverState::Quarantined | ReceiverState::ReleaseSafe(_) => {}
                _ => p.held += n,
            }
        }
        p
    }

    /// The gate state of a room (`None` once its pages were released).
    pub fn room_state(&self, key: RoomKey) -> Option<ReceiverState> {
        lock(&self.state).rooms.get(&key).map(|r| r.room.state())
    }

    /// Allocates `n` pages in every pool (the same indices: the tables are in lockstep).
    fn alloc_all(&self, n: usize) -> Result<Vec<PageId>, PoolError> {
        let _tables = lock(&self.tables);
        let pages = self.target().allocate(n)?;
        for (i, pool) in self.pools.iter().enumerate().skip(1) {
            match pool.allocate(n) {
                Ok(p) if p == pages => {}
                other => {
                    if let Ok(p) = other {
                        let _ = pool.free(&p);
                    }
                    for q in &self.pools[..i] {
                        let _ = q.free(&pages);
                    }
                    return Err(PoolError::Invalid(format!(
                        "pool {i}'s page table left lockstep with the target's"
                    )));
                }
            }
        }
        Ok(pages)
    }

    /// Frees `pages` in every pool, as one step with respect to [`DecodeSide::alloc_all`].
    fn free_all(&self, pages: &[PageId]) {
        let _tables = lock(&self.tables);
        for pool in &self.pools {
            if let Err(e) = pool.free(pages) {
                tracing::error!(pool = %pool.role(), error = %e, "freeing released pages failed");
            }
        }
    }

    /// Reserves pages for `tokens` tokens of `request_id` and opens the room on the transport.
    ///
    /// The reply names the last SafeToReuse that released any of the pages
    /// ([`Reserved::after_release`]): the engine must see that event before it uses them, since the
    /// reply and the release stream are not ordered with respect to each other.
    ///
    /// # Errors
    /// `MALFORMED` (tokens or deadline 0), `EXCEEDS_POOL`, `NO_FREE_PAGES`, or `UNAVAILABLE` /
    /// `INTERNAL` when the transport cannot open the room (its pages are freed: no writer knew it).
    pub fn reserve(
        &self,
        attach: u64,
        request_id: u64,
        tokens: u32,
        kv_deadline: Duration,
    ) -> Result<Reserved, ApiError> {
        self.reserve_handed(attach, request_id, tokens, kv_deadline, 0)
    }

    /// [`DecodeSide::reserve`] carrying the hand-off token of a request the front door handed to
    /// the engine over its own HTTP API (`ReserveRequest.hand_off_token`; the source checks it).
    ///
    /// # Errors
    /// As [`DecodeSide::reserve`].
    pub fn reserve_handed(
        &self,
        attach: u64,
        request_id: u64,
        tokens: u32,
        kv_deadline: Duration,
        hand_off_token: u64,
    ) -> Result<Reserved, ApiError> {
        if tokens == 0 {
            return Err(ApiError::malformed("tokens", "tokens must be at least 1"));
        }
        if kv_deadline.is_zero() {
            return Err(ApiError::malformed(
                "kv_deadline_ms",
                "kv_deadline_ms must be at least 1",
            ));
        }
        let deadline = kv_deadline.min(self.settings.max_kv_deadline);
        let g = *self.target().geometry();
        let need = tokens.div_ceil(g.page_tokens);
        if need > g.pages {
            return Err(ApiError::new(
                Code::OutOfRange,
                pb::ErrorReason::ExceedsPool,
                format!(
                    "{tokens} tokens need {need} pages; the pools have {} in total",
                    g.pages
                ),
            )
            .field("tokens"));
        }
        let pages = self.alloc_all(need as usize).map_err(|e| match e {
            PoolError::Page(PageError::Exhausted { requested, free }) => ApiError::new(
                Code::ResourceExhausted,
                pb::ErrorReason::NoFreePages,
                format!("need {requested} pages, {free} free; retry after SafeToReuse"),
            ),
            other => ApiError::internal(other.to_string()),
        })?;
        let key = RoomKey::new(self.next_room.fetch_add(1, Ordering::Relaxed), 1);
        let writers = self.source.writers(request_id);
        let (tx, _rx) = watch::channel(None);
        let thresholds = self.settings.thresholds.unwrap_or(Thresholds {
            min_accept_length: 0.0,
            max_accept_rate: f64::INFINITY,
            after_tokens: u32::MAX,
        });
        let wire: Vec<u32> = pages.iter().map(|p| p.0).collect();
        let after_release = {
            let mut st = lock(&self.state);
            st.rooms.insert(
                key,
                Room {
                    room: ReceiverRoom::new(key, writers, self.settings.gate),
                    pages: pages.clone(),
                    attach,
                    tokens,
                    kv_deadline_at: Instant::now() + deadline,
                    outcome: tx,
                    guard: SpecGuard::new(thresholds),
                },
            );
            // A page's release was recorded (under this lock) before it was freed, and it was
            // allocated after the free: the record is here.
            wire.iter()
                .filter_map(|p| st.page_release.get(p).copied())
                .max()
                .unwrap_or(0)
        };
        let open = RoomOpen {
            key,
            request_id,
            tokens,
            pages: wire.clone(),
            deadline,
            hand_off_token,
        };
        if let Err(e) = self.source.open(open) {
            // No writer knows the room: its pages can go back at once.
            if let Some(room) = lock(&self.state).rooms.remove(&key) {
                self.free_all(&room.pages);
            }
            return Err(ApiError::new(
                Code::Unavailable,
                pb::ErrorReason::Internal,
                format!("the KV transport cannot open {key}: {e}"),
            ));
        }
        self.counters.reserved.fetch_add(1, Ordering::Relaxed);
        let me = self.me.clone();
        self.runtime.spawn(async move {
            tokio::time::sleep(deadline).await;
            if let Some(me) = me.upgrade() {
                let waiting = matches!(
                    me.room_state(key),
                    Some(ReceiverState::WaitingForInput | ReceiverState::Transferring)
                );
                if waiting {
                    tracing::info!(%key, ?deadline, "KV deadline passed; the room fails through the gate");
                    me.fail(key, FailureCause::Timeout);
                }
            }
        });
        Ok(Reserved {
            key,
            pages: wire,
            after_release,
        })
    }

    fn room_of(&self, st: &State, attach: u64, key: RoomKey) -> Result<(), ApiError> {
        match st.rooms.get(&key) {
            Some(r) if r.attach == attach => Ok(()),
            _ => Err(unknown_room(key)),
        }
    }

    /// Waits until the room's KV is complete (the room is then committed to the engine: it may read
    /// the pages until Finish or Abort) or the room failed. Cancel-safe: dropping the future changes
    /// nothing.
    ///
    /// A room that already failed and was released answers its failure ([`EndedRooms`]).
    ///
    /// # Errors
    /// `UNKNOWN_ROOM`.
    pub async fn await_kv(&self, attach: u64, key: RoomKey) -> Result<pb::AwaitKvReply, ApiError> {
        let failed = |cause: FailureCause| pb::AwaitKvReply {
            outcome: Some(pb::await_kv_reply::Outcome::Failed(pb::KvFailed {
                reason: wire_reason(cause) as i32,
                message: format!("{key} failed: {cause:?}"),
            })),
        };
        let mut rx = {
            let st = lock(&self.state);
            if let Some(cause) = st.ended.of(key, attach) {
                return Ok(failed(cause));
            }
            self.room_of(&st, attach, key)?;
            st.rooms[&key].outcome.subscribe()
        };
        let outcome = loop {
            if let Some(o) = *rx.borrow_and_update() {
                break o;
            }
            if rx.changed().await.is_err() {
                // The room was released (e.g. a bypassed gate) before an outcome was published.
                return match lock(&self.state).ended.of(key, attach) {
                    Some(cause) => Ok(failed(cause)),
                    None => Err(unknown_room(key)),
                };
            }
        };
        let reply = match outcome {
            Outcome::Complete => {
                let mut st = lock(&self.state);
                // Ended between the wake-up and here (a detach, the guard, a Finish of another
                // caller): answered like an AwaitKv that came after.
                if let Some(cause) = st.ended.of(key, attach) {
                    return Ok(failed(cause));
                }
                let room = st.rooms.get_mut(&key).ok_or_else(|| unknown_room(key))?;
                if room.room.state() == ReceiverState::Success {
                    let _ = room.room.commit();
                }
                pb::await_kv_reply::Outcome::Complete(pb::KvComplete {
                    pages: room.pages.iter().map(|p| p.0).collect(),
                    tokens: room.tokens,
                })
            }
            Outcome::Failed(cause) => return Ok(failed(cause)),
        };
        Ok(pb::AwaitKvReply {
            outcome: Some(reply),
        })
    }

    /// SyncSession (snapshot sync, contract 4): checks that room `key` is this attach's, its KV
    /// complete and not Finished, and that every page is one of its own, each at most once; then
    /// hands the [`KvSource`] a copier of those pages (it holds its budget first). The copy is made
    /// outside the state lock and kept only if the room is still live afterwards: a room released
    /// meanwhile may have had its pages reserved again, so its bytes are not trusted. A call
    /// refused here ends the attempt's hand-over too ([`KvSource::sync_refused`]). Blocking (a
    /// memory copy of whole pages): call it off the async runtime.
    ///
    /// # Errors
    /// `UNKNOWN_ROOM`; `ROOM_STATE` while the KV is incomplete or the room failed (not yet
    /// released); `INVALID_ARGUMENT` for a page not in the room, a repeated page, or no page
    /// without `last`; the source's errors.
    pub fn sync_session(
        &self,
        attach: u64,
        request_id: u64,
        attempt: u32,
        key: RoomKey,
        pages: &[u32],
        last: bool,
    ) -> Result<pb::SyncSessionReply, ApiError> {
        if request_id == 0 {
            return Err(ApiError::malformed(
                "request_id",
                "SyncSession names no request",
            ));
        }
        let live = |st: &State| -> Result<(), ApiError> {
            self.room_of(st, attach, key)?;
            let room = &st.rooms[&key];
            if !matches!(
                room.room.state(),
                ReceiverState::Success | ReceiverState::Committed
            ) {
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::RoomState,
                    format!(
                        "{key} is {:?}: SyncSession needs the room's KV complete",
                        room.room.state()
                    ),
                )
                .field("room"));
            }
            Ok(())
        };
        let checked = (|| {
            if pages.is_empty() && !last {
                return Err(ApiError::malformed(
                    "pages",
                    "SyncSession without pages must be the last",
                ));
            }
            let st = lock(&self.state);
            live(&st)?;
            let owned: std::collections::HashSet<u32> =
                st.rooms[&key].pages.iter().map(|p| p.0).collect();
            let mut seen = std::collections::HashSet::new();
            for p in pages {
                if !owned.contains(p) {
                    return Err(ApiError::malformed(
                        "pages",
                        format!("page {p} is not a page of {key}"),
                    ));
                }
                if !seen.insert(*p) {
                    return Err(ApiError::malformed(
                        "pages",
                        format!("page {p} named twice"),
                    ));
                }
            }
            Ok(())
        })();
        if let Err(e) = checked {
            // Outside the lock: the source ends the attempt's hand-over.
            self.source.sync_refused(request_id, attempt, &e.message);
            return Err(e);
        }
        let copy = || -> Result<Vec<Arc<[u8]>>, ApiError> {
            let target = self.target();
            let (layers, chunk) = {
                let g = target.geometry();
                (g.layers as usize, g.chunk_bytes() as usize)
            };
            let mut copied = Vec::with_capacity(pages.len());
            for p in pages {
                let mut bytes = vec![0u8; layers * chunk];
                for (layer, dst) in bytes.chunks_exact_mut(chunk.max(1)).enumerate() {
                    target
                        .read_chunk(PageId(*p), layer as u32, 0, dst)
                        .map_err(|e| {
                            ApiError::new(
                                Code::Internal,
                                pb::ErrorReason::Unspecified,
                                e.to_string(),
                            )
                        })?;
                }
                copied.push(Arc::<[u8]>::from(bytes));
            }
            live(&lock(&self.state))?;
            Ok(copied)
        };
        self.source.sync_session(SessionHandOver {
            request_id,
            attempt,
            room: key,
            pages: pages.len(),
            last,
            copy: &copy,
        })
    }

    /// Decoding ended normally: the room's pages are released (every write concluded) and a
    /// SafeToReuse event is emitted.
    ///
    /// # Errors
    /// `UNKNOWN_ROOM`; `ROOM_STATE` when the KV has not completed (use Abort).
    pub fn finish(&self, attach: u64, key: RoomKey) -> Result<bool, ApiError> {
        let mut st = lock(&self.state);
        self.room_of(&st, attach, key)?;
        let room = st.rooms.get_mut(&key).ok_or_else(|| unknown_room(key))?;
        if room.room.state() == ReceiverState::Success {
            let _ = room.room.commit();
        }
        if room.room.state() != ReceiverState::Committed {
            return Err(ApiError::new(
                Code::FailedPrecondition,
                pb::ErrorReason::RoomState,
                format!(
                    "{key} is {:?}: Finish needs complete KV; use Abort",
                    room.room.state()
                ),
            )
            .field("room"));
        }
        // A committed room has no write that can land: the gate frees it at once (proof Concluded).
        let (_, verdict) = room.room.fail(
            FailureCause::ClientAbort,
            Instant::now(),
            self.settings.ack_timeout,
        );
        self.apply(&mut st, key, verdict);
        Ok(matches!(verdict, GateVerdict::Free { .. }))
    }

    /// The engine abandons the room: it fails through the gate. Returns whether the pages were
    /// released at once — true for a room that had already failed and been released (its
    /// SafeToReuse was emitted then; [`EndedRooms`]).
    ///
    /// # Errors
    /// `UNKNOWN_ROOM`.
    pub fn abort(&self, attach: u64, key: RoomKey, cause: FailureCause) -> Result<bool, ApiError> {
        {
            let st = lock(&self.state);
            if st.ended.of(key, attach).is_some() {
                return Ok(true);
            }
            self.room_of(&st, attach, key)?;
        }
        Ok(match self.fail(key, cause) {
            Some(verdict) => matches!(verdict, GateVerdict::Free { .. }),
            // Released between the check and the fail (its deadline ran out meanwhile).
            None => lock(&self.state).ended.of(key, attach).is_some(),
        })
    }

    /// Whether the gate runs as the negative control `GateMode::UnsafeBypass` (seed 004 before its
    /// fix: a failed room's pages are reused at once, its writers are not told, and the transport
    /// keeps the room open, so a late write lands as a posted RDMA write would). Always false
    /// without the `negative-controls` feature.
    fn bypassed(&self) -> bool {
        #[cfg(feature = "negative-controls")]
        if self.settings.gate == GateMode::UnsafeBypass {
            return true;
        }
        false
    }

    /// Fails a room through the gate (any cause): notifies its writers, asks for a transport proof
    /// and arms the ack deadline. Returns the gate's verdict, `None` for an unknown room.
    pub fn fail(&self, key: RoomKey, cause: FailureCause) -> Option<GateVerdict> {
        self.fail_if(key, |_| Some(cause))
    }

    /// [`Self::fail`] with the cause decided by `decide` from the room, under the same lock as the
    /// failure itself (`None`: the room is left as it is, and so is the result).
    fn fail_if(
        &self,
        key: RoomKey,
        decide: impl FnOnce(&Room) -> Option<FailureCause>,
    ) -> Option<GateVerdict> {
        let (notify, verdict, was_live, cause) = {
            let mut st = lock(&self.state);
            let room = st.rooms.get_mut(&key)?;
            let cause = decide(room)?;
            let was_live = !matches!(
                room.room.state(),
                ReceiverState::ReleasePending
                    | ReceiverState::Quarantined
                    | ReceiverState::ReleaseSafe(_)
            );
            let (notify, verdict) =
                room.room
                    .fail(cause, Instant::now(), self.settings.ack_timeout);
            room.outcome.send_if_modified(|o| {
                if o.is_none() {
                    *o = Some(Outcome::Failed(cause));
                    true
                } else {
                    false
                }
            });
            self.apply(&mut st, key, verdict);
            (notify, verdict, was_live, cause)
        };
        if !was_live {
            return Some(verdict);
        }
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        if !notify.is_empty() && !self.bypassed() {
            self.source.abort(key, &notify, cause);
        }
        if verdict == GateVerdict::Hold {
            self.source.request_proof(key);
            let me = self.me.clone();
            let timeout = self.settings.ack_timeout;
            self.runtime.spawn(async move {
                tokio::time::sleep(timeout).await;
                if let Some(me) = me.upgrade() {
                    let mut st = lock(&me.state);
                    if let Some(room) = st.rooms.get_mut(&key) {
                        let v = room.room.on_tick(Instant::now());
                        me.apply(&mut st, key, v);
                    }
                }
            });
        }
        Some(verdict)
    }

    /// Carries out a verdict with the state lock held.
    fn apply(&self, st: &mut State, key: RoomKey, verdict: GateVerdict) {
        match verdict {
            GateVerdict::Hold => {}
            GateVerdict::Free {
                proof,
                from_quarantine,
            } => {
                let room = st.rooms.remove(&key);
                // Every release is through a failure (Finish fails a committed room with
                // ClientAbort); the room's cause is what a late AwaitKv or Abort is answered.
                if let Some(r) = &room {
                    let cause = match *r.outcome.borrow() {
                        Some(Outcome::Failed(c)) => Some(c),
                        _ => r.room.cause(),
                    };
                    if let Some(cause) = cause {
                        st.ended.record(key, r.attach, cause);
                    }
                }
                let pages = if from_quarantine {
                    st.quarantine.release(key).unwrap_or_default()
                } else {
                    room.as_ref().map(|r| r.pages.clone()).unwrap_or_default()
                };
                // Number the release and record it per page before the pages can be handed out
                // again (a Reserve that gets them reads the record under the same lock).
                let report = room.as_ref().is_some_and(|r| r.attach == st.current_attach);
                let seq = if report {
                    st.release_seq += 1;
                    let seq = st.release_seq;
                    for p in &pages {
                        st.page_release.insert(p.0, seq);
                    }
                    seq
                } else {
                    for p in &pages {
                        st.page_release.remove(&p.0);
                    }
                    0
                };
                self.free_all(&pages);
                let c = &self.counters;
                match proof {
                    ReleaseProof::Concluded => &c.released_concluded,
                    ReleaseProof::AllAcks => &c.released_acks,
                    ReleaseProof::Transport(_) => &c.released_transport,
                    #[cfg(feature = "negative-controls")]
                    ReleaseProof::Bypassed => &c.released_bypassed,
                }
                .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%key, ?proof, pages = pages.len(), "room pages released");
                #[cfg(feature = "negative-controls")]
                let forget = proof != ReleaseProof::Bypassed;
                #[cfg(not(feature = "negative-controls"))]
                let forget = true;
                if forget {
                    self.source.released(key);
                }
                if report {
                    self.releases.emit(pb::SafeToReuse {
                        room: Some(key.into()),
                        pages: pages.iter().map(|p| p.0).collect(),
                        proof: wire_proof(proof) as i32,
                        from_quarantine,
                        seq,
                    });
                }
            }
            GateVerdict::Quarantine => {
                if let Some(room) = st.rooms.get_mut(&key) {
                    let pages = std::mem::take(&mut room.pages);
                    let cause = room.room.cause();
                    st.quarantine.admit(key, pages, cause, Instant::now());
                    self.counters.quarantined.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// The first KV of the room landed.
    pub fn on_chunk(&self, key: RoomKey) {
        if let Some(room) = lock(&self.state).rooms.get_mut(&key) {
            let _ = room.room.on_chunk();
        }
    }

    /// All KV of the room landed and the prefill side concluded it.
    pub fn on_complete(&self, key: RoomKey) {
        let mut st = lock(&self.state);
        if let Some(room) = st.rooms.get_mut(&key)
            && room.room.on_complete().is_ok()
        {
            self.counters.completed.fetch_add(1, Ordering::Relaxed);
            room.outcome.send_if_modified(|o| {
                if o.is_none() {
                    *o = Some(Outcome::Complete);
                    true
                } else {
                    false
                }
            });
        }
    }

    /// The transport or the prefill side reports the room failed.
    ///
    /// A prefill gives up on a room at the same KV deadline (it started its timer when the room
    /// opened there, after this side's Reserve), and its `RoomFailed` can arrive before this
    /// side's own deadline timer has run (a CI rehearsal answered `prefill_unavailable` where the
    /// request's `kv_deadline_ms` had passed): once the room's deadline has passed, a prefill's
    /// failure is reported as the deadline (`KV_TIMEOUT`), not as a peer to retry.
    ///
    /// A room whose KV is complete (`Success`, or `Committed` to the engine) is not failed: every
    /// write concluded, so nothing the prefill or the transport reports can touch its pages, and
    /// the engine may be reading them — failing it would free them under the engine (released
    /// `Concluded`, handed to the next Reserve). Such a room ends by the engine (Finish, Abort),
    /// its detach or the worker's shutdown, or the speculative-decoding guard — never by a
    /// transport report, as `peer_lost` of the decode role already assumed.
    pub fn on_failed(&self, key: RoomKey, cause: FailureCause) {
        // Decided under the failure's own lock: an `on_complete` on another thread (the fence at
        // completion, a write thread) cannot slip between the check and the failure.
        self.fail_if(key, |r| {
            if matches!(
                r.room.state(),
                ReceiverState::Success | ReceiverState::Committed
            ) {
                tracing::info!(%key, ?cause, "a failure reported after the room's KV completed; the room stays the engine's");
                return None;
            }
            Some(match cause {
                FailureCause::PrefillFailed if Instant::now() >= r.kv_deadline_at => {
                    FailureCause::Timeout
                }
                other => other,
            })
        });
    }

    /// An abort ack from prefill rank `rank` for `key`.
    pub fn on_ack(&self, key: RoomKey, rank: PrefillRank) {
        let mut st = lock(&self.state);
        let Some(room) = st.rooms.get_mut(&key) else {
            tracing::debug!(%key, "ack for a released room ignored");
            return;
        };
        if let AckOutcome::Counted { verdict, .. } = room.room.on_ack(key, rank) {
            self.counters.acks.fetch_add(1, Ordering::Relaxed);
            self.apply(&mut st, key, verdict);
        }
    }

    /// The transport proved no write of `key` can land.
    pub fn on_transport_proof(&self, key: RoomKey, proof: TransportProof) {
        let mut st = lock(&self.state);
        if let Some(room) = st.rooms.get_mut(&key) {
            let v = room.room.on_transport_proof(proof);
            self.apply(&mut st, key, v);
        }
    }

    /// Feeds verification steps to the room's spec guard (contract 8); a trip aborts the room
    /// through the gate (cause `SpecGuard`).
    ///
    /// # Errors
    /// `UNKNOWN_ROOM`; `ROOM_STATE` before the KV completed; `SPEC_STEP_INVALID` (nothing recorded).
    pub fn report_steps(
        &self,
        attach: u64,
        key: RoomKey,
        steps: &[pb::SpecStep],
    ) -> Result<pb::SpecStepsReply, ApiError> {
        if let Some((i, s)) = steps
            .iter()
            .enumerate()
            .find(|(_, s)| s.proposed == 0 || s.accepted > s.proposed)
        {
            return Err(ApiError::new(
                Code::InvalidArgument,
                pb::ErrorReason::SpecStepInvalid,
                format!(
                    "step {i}: {} accepted of {} proposed (need 1 <= proposed, accepted <= proposed)",
                    s.accepted, s.proposed
                ),
            )
            .field(format!("steps[{i}]")));
        }
        let (reply, trip) = {
            let mut st = lock(&self.state);
            self.room_of(&st, attach, key)?;
            let room = st.rooms.get_mut(&key).ok_or_else(|| unknown_room(key))?;
            if !matches!(
                room.room.state(),
                ReceiverState::Success | ReceiverState::Committed
            ) {
                return Err(ApiError::new(
                    Code::FailedPrecondition,
                    pb::ErrorReason::RoomState,
                    format!("{key} is {:?}: it is not decoding", room.room.state()),
                )
                .field("room"));
            }
            let mut verdict = None;
            for s in steps {
                match room.guard.observe(s.proposed, s.accepted) {
                    Ok(v) => verdict = Some(v),
                    Err(e) => return Err(ApiError::internal(e.to_string())),
                }
            }
            let g = &room.guard;
            let anomaly = match verdict {
                Some(Verdict::Anomaly(a)) => Some(a),
                _ => g.anomaly(),
            };
            (
                pb::SpecStepsReply {
                    tripped: anomaly.is_some(),
                    anomaly: anomaly
                        .map(|a| a.reason.code().to_owned())
                        .unwrap_or_default(),
                    tokens: g.tokens(),
                    accept_length: g.accept_length(),
                    accept_rate: g.accept_rate(),
                },
                anomaly.is_some(),
            )
        };
        if trip {
            self.counters.spec_trips.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%key, anomaly = %reply.anomaly, "spec guard tripped; the room is aborted through the gate");
            self.fail(key, FailureCause::SpecGuard);
        }
        Ok(reply)
    }

    /// The attach ended: every live room of it fails through the gate (cause `Shutdown`). Returns
    /// the rooms failed.
    pub fn end_attach(&self, attach: u64) -> u32 {
        let keys: Vec<RoomKey> = lock(&self.state)
            .rooms
            .iter()
            .filter(|(_, r)| {
                r.attach == attach
                    && !matches!(
                        r.room.state(),
                        ReceiverState::ReleasePending
                            | ReceiverState::Quarantined
                            | ReceiverState::ReleaseSafe(_)
                    )
            })
            .map(|(k, _)| *k)
            .collect();
        for key in &keys {
            self.fail(*key, FailureCause::Shutdown);
        }
        keys.len() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Allocator;
    use crate::memory::mmap::MmapBackend;
    use crate::memory::pool::{PoolLayout, PoolRole, PoolSpec};
    use crate::model::{Attention, ModelIdentity};

    /// A transport with no writer: rooms are completed or failed by the test itself.
    struct NoWriters;

    impl KvSource for NoWriters {
        fn writers(&self, _request_id: u64) -> Vec<PrefillRank> {
            Vec::new()
        }
        fn open(&self, _room: RoomOpen) -> Result<(), String> {
            Ok(())
        }
        fn abort(&self, _key: RoomKey, _ranks: &[PrefillRank], _cause: FailureCause) {}
    }

    const PAGES: u32 = 32;

    fn pool(role: PoolRole, layers: u32) -> Arc<KvPool> {
        let spec = PoolSpec {
            role,
            model: ModelIdentity {
                name: "tiny".into(),
                layers,
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
        Arc::new(KvPool::new(spec, &Allocator::new("t", MmapBackend::new())).unwrap())
    }

    /// A current-thread runtime for the side's timers (never driven unless a test blocks on it).
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn side(rt: &tokio::runtime::Runtime) -> Arc<DecodeSide> {
        side_over(rt, Arc::new(NoWriters))
    }

    fn side_over(rt: &tokio::runtime::Runtime, source: Arc<dyn KvSource>) -> Arc<DecodeSide> {
        DecodeSide::new(
            vec![pool(PoolRole::Target, 2)],
            source,
            DecodeSettings {
                gate: GateMode::Safe,
                ack_timeout: Duration::from_secs(60),
                max_kv_deadline: Duration::from_secs(600),
                room_base: 1,
                thresholds: None,
            },
            rt.handle().clone(),
        )
    }

    /// A transport with no writer that records the session pages SyncSession hands over.
    #[derive(Default)]
    struct Sessions(Mutex<Vec<Handed>>, Mutex<Vec<(u64, u32)>>);

    impl KvSource for Sessions {
        fn writers(&self, _request_id: u64) -> Vec<PrefillRank> {
            Vec::new()
        }
        fn open(&self, _room: RoomOpen) -> Result<(), String> {
            Ok(())
        }
        fn abort(&self, _key: RoomKey, _ranks: &[PrefillRank], _cause: FailureCause) {}
        fn sync_session(
            &self,
            handed: SessionHandOver<'_>,
        ) -> Result<pb::SyncSessionReply, ApiError> {
            let pages = (handed.copy)()?;
            let n = pages.len() as u32;
            lock(&self.0).push(Handed {
                request_id: handed.request_id,
                attempt: handed.attempt,
                room: handed.room,
                pages,
                last: handed.last,
            });
            Ok(pb::SyncSessionReply {
                pages_taken: n,
                started: true,
            })
        }
        fn sync_refused(&self, request_id: u64, attempt: u32, _why: &str) {
            lock(&self.1).push((request_id, attempt));
        }
    }

    /// What [`Sessions`] recorded of one hand-over.
    struct Handed {
        request_id: u64,
        attempt: u32,
        room: RoomKey,
        pages: Vec<Arc<[u8]>>,
        last: bool,
    }

    /// SyncSession (snapshot sync, contract 4) copies only pages the engine owns with its KV in:
    /// before the KV completed it is refused, a page of no room or a page named twice is refused,
    /// the copy keeps the order the engine named (each page every layer, layer order), and after
    /// Finish the room is unknown — its pages may already hold another room's KV.
    #[test]
    fn sync_session_copies_only_the_rooms_own_pages_once_its_kv_is_complete() {
        let rt = runtime();
        let src = Arc::new(Sessions::default());
        let side = side_over(&rt, src.clone());
        let r = side.reserve(0, 7, 8, Duration::from_secs(600)).unwrap();
        let (a, b) = (r.pages[0], r.pages[1]);
        let reason = |e: ApiError| e.reason;
        assert_eq!(
            side.sync_session(0, 7, 0, r.key, &[a], false)
                .map_err(reason),
            Err(pb::ErrorReason::RoomState),
            "the KV has not completed"
        );
        side.on_complete(r.key);
        let target = side.pools()[0].clone();
        let chunk = target.geometry().chunk_bytes() as usize;
        for (page, fill) in [(a, 0xA0u8), (b, 0xB0)] {
            for layer in 0..2u32 {
                let bytes = vec![fill + layer as u8; chunk];
                target.write_chunk(PageId(page), layer, 0, &bytes).unwrap();
            }
        }
        let foreign = (0..PAGES).find(|p| !r.pages.contains(p)).unwrap();
        assert_eq!(
            side.sync_session(0, 7, 0, r.key, &[a, foreign], false)
                .map_err(reason),
            Err(pb::ErrorReason::Malformed),
            "page {foreign} is not the room's"
        );
        assert_eq!(
            side.sync_session(0, 7, 0, r.key, &[a, a], false)
                .map_err(reason),
            Err(pb::ErrorReason::Malformed),
            "a page twice"
        );
        assert!(
            lock(&src.0).is_empty(),
            "nothing handed over by refused calls"
        );
        assert_eq!(
            *lock(&src.1),
            vec![(7, 0); 3],
            "each refusal ends the attempt's hand-over at the source"
        );
        let reply = side.sync_session(0, 7, 0, r.key, &[b, a], true).unwrap();
        assert_eq!(reply.pages_taken, 2);
        let handed = lock(&src.0).pop().unwrap();
        assert_eq!(
            (handed.request_id, handed.attempt, handed.room),
            (7, 0, r.key)
        );
        assert!(handed.last);
        let expect = |fill: u8| -> Vec<u8> {
            let mut v = vec![fill; chunk];
            v.extend(vec![fill + 1; chunk]);
            v
        };
        assert_eq!(&*handed.pages[0], expect(0xB0).as_slice());
        assert_eq!(&*handed.pages[1], expect(0xA0).as_slice());
        assert!(side.finish(0, r.key).unwrap());
        assert_eq!(
            side.sync_session(0, 7, 0, r.key, &[a], true)
                .map_err(reason),
            Err(pb::ErrorReason::UnknownRoom),
            "a finished room's pages are the gate's"
        );
    }

    /// A Reserve that hands out pages a release freed names that release's `seq`, and the
    /// SafeToReuse carries the same number (1, 2, ... per attach): an engine that reads the reply
    /// before the event (separate streams) knows to wait for it. A release of an older attach's
    /// room is not reported, so a Reserve of its pages names nothing to wait for, and numbers start
    /// again at 1 for the new attach.
    #[test]
    fn reserve_names_the_release_its_pages_came_from() {
        let rt = runtime();
        let side = side(&rt);
        let mut events = side.releases().watch();
        let all = 4 * PAGES;
        let first = side.reserve(0, 1, all, Duration::from_secs(600)).unwrap();
        assert_eq!(first.after_release, 0, "fresh pages follow no release");
        side.on_complete(first.key);
        assert!(side.finish(0, first.key).unwrap());
        let ev = events
            .try_recv()
            .expect("a SafeToReuse for the finished room");
        assert_eq!(ev.seq, 1);
        let second = side.reserve(0, 2, 4, Duration::from_secs(600)).unwrap();
        assert_eq!(second.after_release, 1, "{second:?}");
        side.fail(second.key, FailureCause::ClientAbort);
        assert_eq!(events.try_recv().expect("the abort's release").seq, 2);
        let third = side.reserve(0, 3, all, Duration::from_secs(600)).unwrap();
        assert_eq!(
            third.after_release, 2,
            "one page was released twice: the later seq"
        );

        // A new attach: the old room's release is not reported and names nothing.
        side.set_attach(7);
        side.fail(third.key, FailureCause::Shutdown);
        let fourth = side.reserve(7, 4, 4, Duration::from_secs(600)).unwrap();
        assert_eq!(fourth.after_release, 0, "{fourth:?}");
        let mut events = side.releases().watch();
        side.fail(fourth.key, FailureCause::ClientAbort);
        assert_eq!(events.try_recv().expect("the new attach's release").seq, 1);
        assert_eq!(
            side.reserve(7, 5, 4, Duration::from_secs(600))
                .unwrap()
                .after_release,
            1
        );
    }

    /// A room whose KV deadline passed before its engine asked (freed at once: no write was in
    /// flight) still answers AwaitKv with its failure — the retryable `KV_TIMEOUT` — and Abort
    /// with "released", as it would have a moment earlier; the demo's abort probe saw the
    /// deadline win that race and the request end as an engine error (HTTP 500). Another
    /// attach, or a room never reserved, is still `UNKNOWN_ROOM`.
    #[test]
    fn a_room_released_before_its_engine_asked_answers_its_failure() {
        let rt = runtime();
        let side = side(&rt);
        let mut events = side.releases().watch();
        let r = side.reserve(0, 1, 4, Duration::from_secs(600)).unwrap();
        assert!(
            matches!(
                side.fail(r.key, FailureCause::Timeout),
                Some(GateVerdict::Free { .. })
            ),
            "no writer: released at once"
        );
        assert!(events.try_recv().is_ok(), "the room was released");
        assert!(side.room_state(r.key).is_none(), "the room left the table");
        match rt.block_on(side.await_kv(0, r.key)) {
            Ok(pb::AwaitKvReply {
                outcome: Some(pb::await_kv_reply::Outcome::Failed(f)),
            }) => assert_eq!(f.reason, pb::FailureReason::KvTimeout as i32, "{f:?}"),
            other => panic!("expected the room's failure, got {other:?}"),
        }
        assert_eq!(side.abort(0, r.key, FailureCause::ClientAbort), Ok(true));
        assert!(events.try_recv().is_err(), "no second release");
        let unknown = |res: Result<pb::AwaitKvReply, ApiError>| matches!(res, Err(e) if e.reason == pb::ErrorReason::UnknownRoom);
        assert!(
            unknown(rt.block_on(side.await_kv(9, r.key))),
            "another attach"
        );
        assert!(unknown(rt.block_on(side.await_kv(0, RoomKey::new(777, 1)))));
    }

    /// A failure the transport or a prefill reports after the room's KV completed leaves the room
    /// to the engine: its pages are not released under it (no SafeToReuse) until it Finishes —
    /// whether it has already taken the KV (Committed) or not yet (Success, then AwaitKv still
    /// answers Complete).
    #[test]
    fn a_failure_reported_after_the_kv_completed_does_not_free_the_engines_pages() {
        let rt = runtime();
        let side = side(&rt);
        let mut events = side.releases().watch();
        for (n, take_first) in [(1, true), (2, false)] {
            let r = side.reserve(0, n, 4, Duration::from_secs(600)).unwrap();
            side.on_complete(r.key);
            let complete = |reply: Result<pb::AwaitKvReply, ApiError>| {
                matches!(
                    reply,
                    Ok(pb::AwaitKvReply {
                        outcome: Some(pb::await_kv_reply::Outcome::Complete(_))
                    })
                )
            };
            if take_first {
                assert!(complete(rt.block_on(side.await_kv(0, r.key))));
            }
            side.on_failed(r.key, FailureCause::PrefillFailed);
            side.on_failed(r.key, FailureCause::TransferFailed);
            assert!(events.try_recv().is_err(), "released under the engine");
            assert!(side.room_state(r.key).is_some(), "the room is still live");
            if !take_first {
                assert!(complete(rt.block_on(side.await_kv(0, r.key))));
            }
            assert_eq!(side.finish(0, r.key), Ok(true));
            assert!(events.try_recv().is_ok(), "released at Finish");
        }
    }

    /// A prefill's `RoomFailed` that arrives once the room's KV deadline has passed is the
    /// deadline (`KvTimeout`: the request fails with `kv_deadline_exceeded`), even before this
    /// side's own timer ran (the runtime here is never driven, so that timer cannot); before the
    /// deadline it is the prefill's failure (a peer to retry).
    #[test]
    fn a_prefill_failure_past_the_kv_deadline_reports_the_deadline() {
        let rt = runtime();
        let side = side(&rt);
        // The AwaitKv reason of room `key` failed by the prefill: the call subscribes (first
        // poll), the failure lands, the call answers — polled by hand, so no timer task runs.
        let reason = |key| {
            use std::future::Future;
            use std::task::{Context, Poll, Waker};
            let mut cx = Context::from_waker(Waker::noop());
            let mut call = std::pin::pin!(side.await_kv(0, key));
            assert!(call.as_mut().poll(&mut cx).is_pending(), "no outcome yet");
            side.on_failed(key, FailureCause::PrefillFailed);
            match call.as_mut().poll(&mut cx) {
                Poll::Ready(Ok(pb::AwaitKvReply {
                    outcome: Some(pb::await_kv_reply::Outcome::Failed(f)),
                })) => f.reason,
                other => panic!("{other:?}"),
            }
        };
        let early = side.reserve(0, 1, 4, Duration::from_secs(600)).unwrap();
        assert_eq!(reason(early.key), pb::FailureReason::PrefillFailed as i32);

        let late = side.reserve(0, 2, 4, Duration::from_millis(1)).unwrap();
        let passed = Instant::now() + Duration::from_millis(1);
        while Instant::now() < passed {
            std::hint::spin_loop();
        }
        assert_eq!(reason(late.key), pb::FailureReason::KvTimeout as i32);
    }

    /// Reserves on some threads while rooms are released on others (Finish after a complete KV,
    /// or a failure): every Reserve gets the same page indices in the target and the draft pool —
    /// an allocation interleaved with a release's free used to leave the tables out of lockstep
    /// (`INTERNAL` "pool 1's page table left lockstep with the target's", then every later
    /// Reserve refused).
    #[test]
    fn concurrent_reserves_and_releases_keep_the_page_tables_in_lockstep() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let pools = vec![pool(PoolRole::Target, 2), pool(PoolRole::Draft, 1)];
        let side = DecodeSide::new(
            pools.clone(),
            Arc::new(NoWriters),
            DecodeSettings {
                gate: GateMode::Safe,
                ack_timeout: Duration::from_secs(60),
                max_kv_deadline: Duration::from_secs(600),
                room_base: 1,
                thresholds: None,
            },
            rt.handle().clone(),
        );
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let side = &side;
                s.spawn(move || {
                    for i in 0..3_000u32 {
                        let tokens = 4 * (1 + (i + t) % 5);
                        match side.reserve(0, u64::from(i), tokens, Duration::from_secs(600)) {
                            Ok(r) if (i + t) % 2 == 0 => {
                                side.on_complete(r.key);
                                side.finish(0, r.key).unwrap();
                            }
                            Ok(r) => {
                                side.fail(r.key, FailureCause::ClientAbort);
                            }
                            Err(e) => assert_eq!(e.reason, pb::ErrorReason::NoFreePages, "{e:?}"),
                        }
                    }
                });
            }
        });
        for p in &pools {
            assert_eq!(p.stats().free, PAGES, "{}", p.role());
        }
        assert_eq!(
            side.target().allocate(PAGES as usize).unwrap().len(),
            PAGES as usize
        );
    }
}
