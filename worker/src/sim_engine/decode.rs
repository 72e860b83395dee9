//! The simulated engine's decode serve mode (`tandem-worker sim-engine --serve` against a decode
//! worker): the engine container of a decode pod, a client of the engine API only (DESIGN §3.1).
//!
//! For every `DecodeWork` the worker's front door hands it (`Decode.WatchWork`), concurrently:
//! 1. **Reserve** the prompt's pages (waiting for a `SafeToReuse` while the pools are full, within
//!    the KV deadline). The reply names the last release of its pages (`after_release`); the engine
//!    waits until that SafeToReuse has arrived (up to [`RELEASE_WAIT`]: the reply and the release
//!    stream are separate streams), and then a reserved page must not belong to a room whose
//!    SafeToReuse has not arrived; otherwise it is counted in [`DecodeStats::early_reuse`] — the
//!    engine's own check that it gets pages back only on SafeToReuse. Release numbers must come
//!    without gaps ([`DecodeStats::release_gaps`]).
//! 2. **AwaitKv**; a failed room is reported (`DecodeEnd.kv_failed`) and its pages come back with
//!    the gate's SafeToReuse.
//! 3. **Verify** every chunk of every received page of the target pool: bytes that are a
//!    deterministic function of (request, layer, token) ([`crate::engine::content`]), written by the
//!    prefill (its simulated or built-in engine); a page holding another request's, layer's or
//!    token's bytes is counted corrupt. With a draft pool, the engine computes the draft KV of the
//!    prompt into the same page indices ([`DRAFT_LAYERS`] layers) and verifies it again before it
//!    Finishes (a page someone else wrote meanwhile is caught). The target pages are verified again
//!    then too (each step reads them): chunks corrupt then beyond those counted on arrival (a late
//!    write of another room into a page reused too early) are added to the corrupt count, not to
//!    the chunks verified.
//! 4. **Generate** `max_tokens` tokens: the first at once, then one verification step per
//!    `TANDEM_SIM_TPOT_MS` (its plan is the built-in engine's,
//!    [`crate::roles::decode::engine::decode_plan`], skewed by `TANDEM_SIM_SPEC_FAULT` in test
//!    builds); with speculative decoding each step is reported with `Spec.ReportSteps` before its
//!    tokens are emitted, and a tripped guard ends the attempt (`DecodeEnd.spec_guard`; the worker
//!    already aborted the room). Token ids are `request_id + position` (mod 2^32); every step's
//!    tokens go to `Decode.EmitTokens`; an attempt answered `cancelled` is Aborted.
//! 5. **Finish**, then the attempt's end (`DecodeEnd.done`).
//!
//! After each attempt the running [`Summary`] is published beside the socket
//! ([`super::tiers::publish_summary`]), where the worker's `/report` shows it as
//! `engine.engine_summary` (pages verified, corrupt chunks, early reuses).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_stream::StreamExt;

use super::{Args, SimError, Summary, chunk_spec};
use crate::engine::content::{fill_chunk, verify_chunk};
use crate::engine_api::client::{Attached, ClientError, EngineClient};
use crate::engine_api::pb;
use crate::memory::pool::PoolRole;
use crate::release::RoomKey;
use crate::roles::decode::engine::decode_plan;
use crate::roles::sim::SimKnobs;

/// How long a Reserve reply may wait for the SafeToReuse it names (`after_release`) before its
/// pages still owned by an unreleased room count as reused early. Generous: the wait only covers
/// the delivery lag of an event the worker already emitted (over 2 s seen under memory pressure).
pub const RELEASE_WAIT: Duration = Duration::from_secs(30);

/// What the decode serve mode did (the `decode` block of the summary line).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeStats {
    /// DecodeWork received.
    pub work: u64,
    /// Tokens emitted.
    pub tokens: u64,
    /// Pages handed out by Reserve while a room whose SafeToReuse never came still held them.
    pub early_reuse: u64,
    /// Reserve replies whose `after_release` had not arrived yet (the engine waited for it).
    #[serde(default)]
    pub release_waits: u64,
    /// SafeToReuse events whose `seq` was not the previous one plus 1 (events the worker dropped).
    #[serde(default)]
    pub release_gaps: u64,
    /// Attempts the worker answered `cancelled` (then Aborted).
    pub cancelled: u64,
    /// Attempts that ended with an engine error (a refused call).
    pub engine_errors: u64,
    /// Finished turns whose session KV was handed over with SyncSession (snapshot sync).
    #[serde(default)]
    pub sessions_synced: u64,
    /// Pages of session KV handed over.
    #[serde(default)]
    pub session_pages_synced: u64,
    /// SyncSession calls the worker refused (the turn still Finished).
    #[serde(default)]
    pub session_sync_errors: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Rooms whose SafeToReuse arrived before the engine recorded their Reserve, remembered (at most
/// this many, oldest forgotten first) so the late record is skipped.
const RELEASED_BEFORE_OWNED: usize = 4096;

/// Which room owns each page, from its Reserve until its SafeToReuse.
#[derive(Default)]
struct Book {
    owner: Mutex<Owners>,
    /// `seq` of the last SafeToReuse received.
    seen: AtomicU64,
    released: Notify,
}

/// The book's state, under one lock.
#[derive(Default)]
struct Owners {
    pages: HashMap<u32, RoomKey>,
    /// Rooms released before their Reserve reply was recorded: a room whose KV deadline passed
    /// right after Reserve (the abort probe's 30 ms) is released by the gate at once, and its
    /// SafeToReuse (release stream) can overtake the reply (another stream). Recording the reply
    /// afterwards would leave its pages owned for good and count their next Reserve as an early
    /// reuse (22 such pages in the full-trace run of session 18, 0 corrupt).
    /// Per such room, how many of its pages another room already owned when its release came (an
    /// early reuse its late record reports instead of checking again).
    released: HashMap<RoomKey, u64>,
    released_order: std::collections::VecDeque<RoomKey>,
}

impl Book {
    /// A SafeToReuse arrived: its room no longer owns its pages. Returns whether its `seq` skipped
    /// numbers (events the worker dropped).
    fn on_release(&self, ev: &pb::SafeToReuse) -> bool {
        if let Some(key) = ev.room.map(RoomKey::from) {
            let mut o = lock(&self.owner);
            let mut owned = false;
            for p in &ev.pages {
                if o.pages.get(p) == Some(&key) {
                    o.pages.remove(p);
                    owned = true;
                }
            }
            if !owned && !ev.pages.is_empty() && !o.released.contains_key(&key) {
                // Pages another room owns now were handed out before this release: early.
                let busy = ev.pages.iter().filter(|p| o.pages.contains_key(p)).count() as u64;
                o.released.insert(key, busy);
                o.released_order.push_back(key);
                if o.released_order.len() > RELEASED_BEFORE_OWNED
                    && let Some(old) = o.released_order.pop_front()
                {
                    o.released.remove(&old);
                }
            }
        }
        let before = self.seen.swap(ev.seq, Ordering::AcqRel);
        self.released.notify_waiters();
        let gap = ev.seq != before + 1;
        if gap {
            tracing::error!(
                seq = ev.seq,
                before,
                "SafeToReuse numbers skipped: events were lost"
            );
        }
        gap
    }

    /// Waits (bounded by `wait`) until the SafeToReuse numbered `after` has arrived, then records
    /// `key` as the owner of `pages`. Returns the pages still owned by an unreleased room (reused
    /// early: the worker handed them out without the release it named, or named none) and whether
    /// the engine had to wait.
    async fn own(&self, key: RoomKey, pages: &[u32], after: u64, wait: Duration) -> (u64, bool) {
        let until = Instant::now() + wait;
        let mut waited = false;
        loop {
            let notified = self.released.notified();
            if self.seen.load(Ordering::Acquire) >= after || Instant::now() >= until {
                break;
            }
            waited = true;
            let _ = tokio::time::timeout_at(until.into(), notified).await;
        }
        let mut o = lock(&self.owner);
        if let Some(busy) = o.released.remove(&key) {
            // Released before we got here: its pages are free again (maybe another room's now).
            o.released_order.retain(|k| *k != key);
            return (busy, waited);
        }
        let busy = pages.iter().filter(|p| o.pages.contains_key(p)).count() as u64;
        if busy > 0 {
            tracing::error!(%key, busy, after, "Reserve handed out pages whose SafeToReuse never came");
        }
        for p in pages {
            o.pages.insert(*p, key);
        }
        (busy, waited)
    }
}

/// What one attempt did.
#[derive(Debug, Default)]
struct Done {
    completed: bool,
    failed: bool,
    pages: u64,
    chunks: u64,
    corrupt: u64,
    spec_steps: u32,
    spec_trip: bool,
    tokens: u64,
    early_reuse: u64,
    release_wait: bool,
    cancelled: bool,
    engine_error: bool,
    session_synced: bool,
    session_pages: u64,
    session_error: bool,
}

struct Ctx {
    client: EngineClient,
    att: Arc<Attached>,
    book: Book,
    knobs: SimKnobs,
    call: Duration,
    /// Counts since the loop started, merged into the caller's summary when the loop ends or is
    /// dropped ([`Merge`]).
    acc: Mutex<Summary>,
    /// The caller's summary when the loop started (what [`Ctx::publish`] adds the counts to).
    base: Summary,
    /// The worker's socket directory (where the summary is published).
    socket_dir: std::path::PathBuf,
    /// Fault injection `--sync-page-twice-first` ([`sync_session`]).
    sync_fault: bool,
}

/// Merges the loop's counts into the caller's summary when the loop's future ends or is dropped
/// (SIGTERM drops it mid-flight).
struct Merge<'a> {
    total: &'a mut Summary,
    ctx: Arc<Ctx>,
}

impl Drop for Merge<'_> {
    fn drop(&mut self) {
        let acc = std::mem::take(&mut *lock(&self.ctx.acc));
        self.total.absorb(&acc);
    }
}

impl Ctx {
    /// Publishes the running summary (the caller's at the loop's start plus the loop's counts so
    /// far) beside the socket, where the worker's `/report` reads it as `engine.engine_summary`.
    fn publish(&self) {
        // The lock also keeps two attempts' tasks from writing the file at once.
        let acc = lock(&self.acc);
        let mut s = self.base.clone();
        s.absorb(&acc);
        super::tiers::publish_summary(&self.socket_dir, &s);
    }
}

/// Serves the decode worker's DecodeWork until the streams end (the attach ended) or the future is
/// dropped (SIGTERM: the caller detaches). Counts go into `total` as attempts end.
///
/// # Errors
/// [`SimError::Setup`] without a target pool or when the knobs are invalid; [`SimError::Client`]
/// when a stream cannot be opened or fails.
pub async fn serve_loop(
    args: &Args,
    client: &EngineClient,
    att: Arc<Attached>,
    total: &mut Summary,
) -> Result<(), SimError> {
    let id = att.id();
    if att.pool(PoolRole::Target).is_none() {
        return Err(SimError::Setup("no target pool".into()));
    }
    let knobs = SimKnobs::from_env().map_err(|e| SimError::Setup(e.to_string()))?;
    let mut c = client.clone();
    let mut work = c
        .decode
        .watch_work(tonic::Request::new(pb::WatchDecodeWorkRequest {
            attach_id: id,
        }))
        .await
        .map_err(ClientError::from)?
        .into_inner();
    let mut releases = c
        .decode
        .watch_releases(tonic::Request::new(pb::WatchReleasesRequest {
            attach_id: id,
        }))
        .await
        .map_err(ClientError::from)?
        .into_inner();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        att,
        book: Book::default(),
        knobs,
        call: Duration::from_millis(args.call_timeout_ms),
        acc: Mutex::new(Summary::default()),
        base: total.clone(),
        socket_dir: args.socket_dir.clone(),
        sync_fault: args.sync_fault(),
    });
    total.decode.get_or_insert_with(DecodeStats::default);
    let _merge = Merge {
        total,
        ctx: ctx.clone(),
    };
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            w = work.next() => {
                let w = w.ok_or_else(|| SimError::Setup("work stream ended".into()))?
                    .map_err(ClientError::from)?;
                {
                    let mut acc = lock(&ctx.acc);
                    acc.rooms += 1;
                    acc.decode.get_or_insert_with(DecodeStats::default).work += 1;
                }
                let ctx = ctx.clone();
                tasks.spawn(async move {
                    let (done, last) = serve_one(&ctx, id, w).await;
                    apply(&mut lock(&ctx.acc), done);
                    // Published before the end is sent: a `/report` read once the response
                    // is in must count this attempt.
                    ctx.publish();
                    if let Some(last) = last {
                        ctx.emit(last).await;
                    }
                });
            }
            r = releases.next() => {
                let ev = r.ok_or_else(|| SimError::Setup("release stream ended".into()))?
                    .map_err(ClientError::from)?;
                let gap = ctx.book.on_release(&ev);
                let mut acc = lock(&ctx.acc);
                acc.releases += 1;
                if gap {
                    acc.decode.get_or_insert_with(DecodeStats::default).release_gaps += 1;
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

fn apply(total: &mut Summary, d: Done) {
    total.completed += u32::from(d.completed);
    total.failed += u32::from(d.failed);
    total.pages += d.pages;
    total.chunks += d.chunks;
    total.corrupt_chunks += d.corrupt;
    total.spec_steps += d.spec_steps;
    total.spec_trips += u32::from(d.spec_trip);
    total.rooms_dropped += u32::from(d.cancelled);
    let s = total.decode.get_or_insert_with(DecodeStats::default);
    s.tokens += d.tokens;
    s.early_reuse += d.early_reuse;
    s.release_waits += u64::from(d.release_wait);
    s.cancelled += u64::from(d.cancelled);
    s.engine_errors += u64::from(d.engine_error);
    s.sessions_synced += u64::from(d.session_synced);
    s.session_pages_synced += d.session_pages;
    s.session_sync_errors += u64::from(d.session_error);
}

fn end(outcome: pb::decode_end::Outcome) -> Option<pb::DecodeEnd> {
    Some(pb::DecodeEnd {
        outcome: Some(outcome),
    })
}

impl Ctx {
    /// EmitTokens; `true` when the attempt is cancelled (or the worker cannot be told).
    async fn emit(&self, report: pb::EmitTokensRequest) -> bool {
        let mut c = self.client.clone();
        match c.decode.emit_tokens(self.client.req(report)).await {
            Ok(r) => r.into_inner().cancelled,
            Err(st) => {
                tracing::warn!(status = %st, "EmitTokens failed; the attempt stops");
                true
            }
        }
    }

    async fn abort(&self, id: u64, room: Option<pb::RoomRef>) {
        let mut c = self.client.clone();
        let r = self.client.req(pb::AbortRequest {
            attach_id: id,
            room,
            reason: pb::FailureReason::ClientAbort as i32,
        });
        if let Err(st) = c.decode.abort(r).await {
            tracing::debug!(status = %st, "Abort refused (the room already ended)");
        }
    }

    /// Reserve, waiting for releases while the pools are full (until the KV deadline).
    async fn reserve(&self, id: u64, w: &pb::DecodeWork) -> Result<pb::ReserveReply, ClientError> {
        let until = Instant::now() + Duration::from_millis(w.kv_deadline_ms.max(1));
        loop {
            let notified = self.book.released.notified();
            let mut c = self.client.clone();
            let r = self.client.req(pb::ReserveRequest {
                attach_id: id,
                request_id: w.request_id,
                tokens: w.prompt_tokens.max(1),
                kv_deadline_ms: w.kv_deadline_ms.max(1),
                hand_off_token: 0,
            });
            match c.decode.reserve(r).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(st) => {
                    let e = ClientError::from(st);
                    let full = e
                        .api()
                        .is_some_and(|a| a.reason == pb::ErrorReason::NoFreePages);
                    if !full || Instant::now() >= until {
                        return Err(e);
                    }
                    let _ = tokio::time::timeout_at(until.into(), notified).await;
                }
            }
        }
    }
}

/// Layers of the draft pool the engine computes and re-reads per page: the first only (a draft
/// model's page is large — 64 MiB for an 8B draft — and the check is about the page's owner).
pub const DRAFT_LAYERS: u32 = 1;

/// Reads and verifies the chunks of `pages` of `role`'s pool for `request` (whole pages; every
/// layer of the target, [`DRAFT_LAYERS`] of the draft); returns `(chunks, corrupt)`.
fn verify(att: &Attached, role: PoolRole, request: u64, pages: &[u32]) -> (u64, u64) {
    let Some(pool) = att.pool(role) else {
        return (0, 0);
    };
    let g = *pool.geometry();
    let layers = if role == PoolRole::Draft {
        g.layers.min(DRAFT_LAYERS)
    } else {
        g.layers
    };
    let tokens = (pages.len() as u32).saturating_mul(g.page_tokens);
    let (mut chunks, mut bad) = (0, 0);
    for (k, &page) in pages.iter().enumerate() {
        for layer in 0..layers {
            let spec = chunk_spec(pool, request, tokens, k as u32, layer);
            let mut buf = vec![0u8; spec.bytes()];
            chunks += 1;
            let why = match pool.read(page, layer, 0, &mut buf) {
                Ok(()) => verify_chunk(&buf, &spec).err().map(|c| c.to_string()),
                Err(e) => Some(e.to_string()),
            };
            if let Some(why) = why {
                bad += 1;
                tracing::error!(pool = %role, request, page, layer, error = %why, "corrupt KV chunk read");
            }
        }
    }
    (chunks, bad)
}

/// Computes the draft model's KV of the prompt into `pages` of the draft pool (if attached;
/// [`DRAFT_LAYERS`] layers).
fn fill_draft(att: &Attached, request: u64, pages: &[u32]) -> Result<(), ClientError> {
    let Some(pool) = att.pool(PoolRole::Draft) else {
        return Ok(());
    };
    let g = *pool.geometry();
    let tokens = (pages.len() as u32).saturating_mul(g.page_tokens);
    for (k, &page) in pages.iter().enumerate() {
        for layer in 0..g.layers.min(DRAFT_LAYERS) {
            let spec = chunk_spec(pool, request, tokens, k as u32, layer);
            let mut buf = vec![0u8; spec.bytes()];
            fill_chunk(&mut buf, &spec);
            pool.write(page, layer, 0, &buf)?;
        }
    }
    Ok(())
}

/// Hands the turn's session KV (`w.session_kv_hashes`) to the worker for snapshot sync: the
/// session's pages are laid out in page form ([`super::tiers::page_chunk`], the content L2 and L3
/// hold for a page and the prefill engine verifies when it loads one) into the room's pages, as
/// many as the room has at a time, each batch handed over with SyncSession (the worker copies it
/// before it answers, so the next batch may reuse the pages). The room's own KV was verified for
/// the last time before this. Returns the pages handed over.
///
/// # Errors
/// A refused call or a failed write, as text.
async fn sync_session(
    ctx: &Ctx,
    id: u64,
    w: &pb::DecodeWork,
    room: Option<pb::RoomRef>,
    pages: &[u32],
) -> Result<u64, String> {
    let pool = ctx
        .att
        .pool(PoolRole::Target)
        .ok_or_else(|| "no target pool".to_owned())?;
    if pages.is_empty() {
        return Err("the room has no pages".into());
    }
    let layers = pool.geometry().layers;
    let batches: Vec<&[u64]> = w.session_kv_hashes.chunks(pages.len()).collect();
    if ctx.sync_fault {
        // Fault injection: a first call naming a page twice, whose refusal is then ignored.
        let mut c = ctx.client.clone();
        let r = ctx.client.req(pb::SyncSessionRequest {
            attach_id: id,
            request_id: w.request_id,
            attempt: w.attempt,
            room,
            pages: vec![pages[0], pages[0]],
            last: false,
        });
        match c.decode.sync_session(r).await {
            Ok(_) => return Err("the worker took a page named twice".into()),
            Err(st) => tracing::warn!(error = %st, "fault injection: a SyncSession naming a page \
                twice was refused; going on as if it had not been sent"),
        }
    }
    let mut taken = 0u64;
    for (i, batch) in batches.iter().enumerate() {
        for (&hash, &page) in batch.iter().zip(pages) {
            let h =
                crate::engine_api::tiers::hash_of_key(crate::tier::PageKey::from_trace_id(hash));
            for layer in 0..layers {
                let spec = super::tiers::page_chunk(pool, &h, layer);
                let mut buf = vec![0u8; spec.bytes()];
                fill_chunk(&mut buf, &spec);
                pool.write(page, layer, 0, &buf)
                    .map_err(|e| e.to_string())?;
            }
        }
        let mut c = ctx.client.clone();
        let r = ctx.client.req(pb::SyncSessionRequest {
            attach_id: id,
            request_id: w.request_id,
            attempt: w.attempt,
            room,
            pages: pages[..batch.len()].to_vec(),
            last: i + 1 == batches.len(),
        });
        let reply = c
            .decode
            .sync_session(r)
            .await
            .map_err(|st| st.to_string())?
            .into_inner();
        taken = u64::from(reply.pages_taken);
    }
    Ok(taken)
}

/// Serves one attempt; returns what it did and its last EmitTokens (the end), which the caller
/// sends after recording the counts (so that a summary printed right after the end includes them).
async fn serve_one(ctx: &Ctx, id: u64, w: pb::DecodeWork) -> (Done, Option<pb::EmitTokensRequest>) {
    let mut d = Done::default();
    let base = pb::EmitTokensRequest {
        attach_id: id,
        request_id: w.request_id,
        attempt: w.attempt,
        ..pb::EmitTokensRequest::default()
    };
    let reply = match ctx.reserve(id, &w).await {
        Ok(r) => r,
        Err(e) => {
            d.engine_error = true;
            return (
                d,
                Some(pb::EmitTokensRequest {
                    end: end(pb::decode_end::Outcome::EngineError(format!(
                        "Reserve refused: {e}"
                    ))),
                    ..base
                }),
            );
        }
    };
    let Some(key) = reply.room.map(RoomKey::from) else {
        d.engine_error = true;
        return (d, None);
    };
    let room = reply.room;
    let base = pb::EmitTokensRequest { room, ..base };
    (d.early_reuse, d.release_wait) = ctx
        .book
        .own(key, &reply.pages, reply.after_release, RELEASE_WAIT)
        .await;
    let wait = ctx.client.req_within(
        pb::AwaitKvRequest {
            attach_id: id,
            room,
        },
        Duration::from_millis(w.kv_deadline_ms) + ctx.call,
    );
    let mut c = ctx.client.clone();
    let outcome = match c.decode.await_kv(wait).await {
        Ok(r) => r.into_inner().outcome,
        Err(st) => {
            d.engine_error = true;
            ctx.abort(id, room).await;
            return (
                d,
                Some(pb::EmitTokensRequest {
                    end: end(pb::decode_end::Outcome::EngineError(format!(
                        "AwaitKv failed: {st}"
                    ))),
                    ..base
                }),
            );
        }
    };
    let pages = match outcome {
        Some(pb::await_kv_reply::Outcome::Complete(c)) => c.pages,
        Some(pb::await_kv_reply::Outcome::Failed(f)) => {
            d.failed = true;
            tracing::info!(%key, reason = f.reason, message = %f.message, "the room's KV failed");
            return (
                d,
                Some(pb::EmitTokensRequest {
                    end: end(pb::decode_end::Outcome::KvFailed(f)),
                    ..base
                }),
            );
        }
        None => {
            d.engine_error = true;
            ctx.abort(id, room).await;
            return (d, None);
        }
    };
    d.completed = true;
    let (chunks, corrupt) = verify(&ctx.att, PoolRole::Target, w.request_id, &pages);
    d.pages = pages.len() as u64;
    d.chunks = chunks;
    d.corrupt = corrupt;
    if let Err(e) = fill_draft(&ctx.att, w.request_id, &pages) {
        tracing::error!(%key, error = %e, "writing the draft KV failed");
    }
    let token = |pos: u32| (w.request_id as u32).wrapping_add(pos);
    let first: Vec<u32> = if w.max_tokens > 0 {
        vec![token(0)]
    } else {
        Vec::new()
    };
    d.tokens += first.len() as u64;
    let cancelled = ctx
        .emit(pb::EmitTokensRequest {
            tokens: first,
            chunks_verified: chunks,
            corrupt_chunks: corrupt,
            ..base.clone()
        })
        .await;
    if cancelled {
        d.cancelled = true;
        ctx.abort(id, room).await;
        return (d, None);
    }
    let fault = ctx
        .knobs
        .spec_fault
        .filter(|f| f.applies_to(w.attempt))
        .map(|f| f.mode);
    let draft = (w.draft_tokens > 0).then_some(w.draft_tokens);
    let seed = w.request_id ^ (u64::from(w.attempt) << 48);
    let plan = decode_plan(w.max_tokens.saturating_sub(1), draft, seed, fault);
    let mut pos = 1u32;
    let (mut proposed, mut accepted, mut steps, mut emitted) = (0u64, 0u64, 0u64, 0u64);
    for step in plan.steps {
        tokio::time::sleep(ctx.knobs.tpot).await;
        if step.proposed > 0 {
            d.spec_steps += 1;
            let mut c = ctx.client.clone();
            let r = ctx.client.req(pb::SpecStepsRequest {
                attach_id: id,
                room,
                steps: vec![pb::SpecStep {
                    proposed: step.proposed,
                    accepted: step.accepted,
                }],
            });
            match c.spec.report_steps(r).await {
                Ok(r) => {
                    let r = r.into_inner();
                    if r.tripped {
                        // The worker aborted the room through the gate: stop reading it.
                        d.spec_trip = true;
                        return (
                            d,
                            Some(pb::EmitTokensRequest {
                                end: end(pb::decode_end::Outcome::SpecGuard(pb::SpecTrip {
                                    anomaly: r.anomaly,
                                    tokens: r.tokens,
                                    accept_length: r.accept_length,
                                    accept_rate: r.accept_rate,
                                })),
                                ..base
                            }),
                        );
                    }
                }
                Err(st) => {
                    d.engine_error = true;
                    ctx.abort(id, room).await;
                    return (
                        d,
                        Some(pb::EmitTokensRequest {
                            end: end(pb::decode_end::Outcome::EngineError(format!(
                                "ReportSteps failed: {st}"
                            ))),
                            ..base
                        }),
                    );
                }
            }
            proposed += u64::from(step.proposed);
            accepted += u64::from(step.accepted);
        }
        steps += 1;
        emitted += u64::from(step.tokens);
        let ids: Vec<u32> = (0..step.tokens).map(|i| token(pos + i)).collect();
        pos += step.tokens;
        d.tokens += ids.len() as u64;
        if ctx
            .emit(pb::EmitTokensRequest {
                tokens: ids,
                ..base.clone()
            })
            .await
        {
            d.cancelled = true;
            ctx.abort(id, room).await;
            return (d, None);
        }
    }
    // The draft KV must still be what this request wrote.
    let (dc, dbad) = verify(&ctx.att, PoolRole::Draft, w.request_id, &pages);
    d.chunks += dc;
    d.corrupt += dbad;
    // Every step read the target KV too: it must still be what this request received. A write of
    // another room landing in a page reused too early (seed 004: the release gate bypassed) is
    // caught here even when it landed after the check on arrival. Counted: the corrupt chunks
    // beyond those already counted on arrival (a chunk bad then is still bad); the chunks
    // themselves were counted verified once, on arrival.
    let tbad = verify(&ctx.att, PoolRole::Target, w.request_id, &pages)
        .1
        .saturating_sub(corrupt);
    d.corrupt += tbad;
    if !w.session_kv_hashes.is_empty() {
        match sync_session(ctx, id, &w, room, &pages).await {
            Ok(n) => {
                d.session_synced = true;
                d.session_pages = n;
            }
            Err(e) => {
                d.session_error = true;
                tracing::warn!(%key, error = %e, "SyncSession refused; the turn finishes unsynced");
            }
        }
    }
    let mut c = ctx.client.clone();
    let fin = ctx.client.req(pb::FinishRequest {
        attach_id: id,
        room,
    });
    if let Err(st) = c.decode.finish(fin).await {
        d.engine_error = true;
        return (
            d,
            Some(pb::EmitTokensRequest {
                end: end(pb::decode_end::Outcome::EngineError(format!(
                    "Finish refused: {st}"
                ))),
                ..base
            }),
        );
    }
    let (accept_length, accept_rate) = if proposed > 0 {
        (
            emitted as f64 / steps.max(1) as f64,
            accepted as f64 / proposed as f64,
        )
    } else {
        (0.0, 0.0)
    };
    (
        d,
        Some(pb::EmitTokensRequest {
            chunks_verified: dc,
            corrupt_chunks: dbad + tbad,
            end: end(pb::decode_end::Outcome::Done(pb::DecodeDone {
                accept_length,
                accept_rate,
            })),
            ..base
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One poll of `f` (no waiting): its output if it is ready now.
    fn now<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::Pin::new(f).poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    fn release(room: RoomKey, pages: &[u32], seq: u64) -> pb::SafeToReuse {
        pb::SafeToReuse {
            room: Some(room.into()),
            pages: pages.to_vec(),
            seq,
            ..pb::SafeToReuse::default()
        }
    }

    /// A Reserve reply that overtakes the release of its pages (separate streams) waits for the
    /// SafeToReuse it names and then finds the pages free: not an early reuse. Before the numbers,
    /// the engine could only wait a fixed 2 s and counted 1,179 pages of a full-trace run as reused
    /// early that were only late events.
    #[tokio::test]
    async fn a_reply_that_overtakes_its_release_waits_for_it() {
        let book = Book::default();
        let (a, b) = (RoomKey::new(1, 1), RoomKey::new(2, 1));
        assert_eq!(book.own(a, &[3, 4], 0, RELEASE_WAIT).await, (0, false));
        let mut own = Box::pin(book.own(b, &[4, 5], 1, RELEASE_WAIT));
        assert!(now(&mut own).is_none(), "waits for seq 1");
        assert!(!book.on_release(&release(a, &[3, 4], 1)));
        assert_eq!(own.await, (0, true), "page 4 came back before b owned it");
        assert_eq!(lock(&book.owner).pages.get(&4), Some(&b));
    }

    /// A room released before its Reserve reply was recorded (the gate freed it at its deadline and
    /// the release overtook the reply): recording it late must not leave its pages owned, or the
    /// next Reserve of those pages counts as an early reuse.
    #[tokio::test]
    async fn a_release_that_overtakes_its_own_reserve_reply_frees_the_pages() {
        let book = Book::default();
        let (a, b) = (RoomKey::new(1, 1), RoomKey::new(2, 1));
        assert!(!book.on_release(&release(a, &[3, 4], 1)));
        // The worker hands a's pages to b; b's reply names release 1, which has arrived.
        assert_eq!(book.own(b, &[3, 4], 1, RELEASE_WAIT).await, (0, false));
        // a's reply is recorded only now: skipped, and b keeps its pages.
        assert_eq!(book.own(a, &[3, 4], 0, RELEASE_WAIT).await, (0, false));
        assert_eq!(lock(&book.owner).pages.get(&3), Some(&b));
        assert!(lock(&book.owner).released.is_empty());
        assert!(lock(&book.owner).released_order.is_empty());
        assert!(!book.on_release(&release(b, &[3, 4], 2)));
        assert!(lock(&book.owner).pages.is_empty());

        // An early reuse is still caught for such a room: c owns page 9 when d's release (which
        // names 9) comes before d's reply was recorded.
        let (c, d) = (RoomKey::new(3, 1), RoomKey::new(4, 1));
        assert_eq!(book.own(c, &[9], 2, RELEASE_WAIT).await, (0, false));
        assert!(!book.on_release(&release(d, &[9], 3)));
        assert_eq!(book.own(d, &[9], 0, RELEASE_WAIT).await, (1, false));
    }

    /// Negative controls: a reply that names no release for a page a live room still owns is an
    /// early reuse at once, and a reply whose named release never comes is one after the wait.
    /// Skipped numbers are reported.
    #[tokio::test]
    async fn pages_handed_out_without_their_release_count_as_reused_early() {
        let book = Book::default();
        let (a, b, c) = (RoomKey::new(1, 1), RoomKey::new(2, 1), RoomKey::new(3, 1));
        book.own(a, &[7], 0, RELEASE_WAIT).await;
        let got = now(&mut Box::pin(book.own(b, &[7, 8], 0, RELEASE_WAIT)));
        assert_eq!(
            got,
            Some((1, false)),
            "named no release: counted without waiting"
        );
        assert_eq!(
            book.own(c, &[7], 5, Duration::from_millis(1)).await,
            (1, true),
            "the named release never came"
        );
        assert!(
            book.on_release(&release(a, &[], 3)),
            "seq 3 after 0 is a gap"
        );
        assert!(!book.on_release(&release(b, &[], 4)));
    }
}
