//! The prefill node's engine path (DESIGN §3.1 "Prefill side"): the rooms are computed by the engine
//! beside the worker, through the engine API, and moved from its shared pool by the TCP transport.
//!
//! 1. A decode worker opens a room (peer `OpenRoom`): the room opens in the engine API's sender table
//!    ([`PrefillSide::submit_work`], DESIGN contract 3) and the engine receives a `PrefillWork` on its
//!    WatchWork stream, with the request's prefix hashes; the worker looks the prefix up in its tiers
//!    first ([`HostTiers::open_lookup`]: the hits the decode is told) and the engine then Loads the
//!    hit pages and Stores the pages it computed through the tier calls. No engine attached: the
//!    open is refused (`UNAVAILABLE`), the decode fails the request with the reason.
//! 2. The engine writes the room's KV into pages of the shared target pool and says `PagesReady`
//!    (per layer range); the side begins one write and hands it here ([`KvSink::send`]).
//! 3. Those source pages are moved to the decode's destination pages by the TCP transport, straight
//!    from the memfd-backed pool: each write's bytes are a view of the pool's mapping that the
//!    transport holds until the write is terminal. The write ends ([`PrefillSide::write_done`]) only
//!    then, so the engine's `SourceFree` comes when no write from those pages can still be in flight.
//! 4. Completion, failure and abort acks reach the decode over the peer signal stream (`ChunkDone`,
//!    `RoomFailed`, `AbortAck`), exactly as with the built-in engine; the decode side is unchanged and
//!    verifies every byte it receives.
//!
//! Every wait is bounded: a room the engine has not produced by the decode's deadline fails with a
//! reason (the decode aborts it, the ack follows when no write can land); an engine that detaches or
//! dies fails all its rooms at once ([`PrefillSide::end_attach`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tonic::Status;

use super::{Body, PrefillNode, PrefillService, RoomPlan, ack_msg, lock, msg};
use crate::control::pb;
use crate::engine_api::prefill::{KvSink, PagesSend, PrefillSide};
use crate::engine_api::service::EngineApi;
use crate::memory::pool::{KvPool, PageId};
use crate::release::RoomKey;
use crate::release::sender::{AbortAck, SenderState};
use crate::roles::prefill::tiers::HostTiers;
use crate::transfer::{RegionId, TransferHandle, TransferStatus, Transport, WriteBatch, WriteOp};

/// Default time an engine has to produce a room whose open names no deadline.
pub const DEFAULT_ROOM_DEADLINE: Duration = Duration::from_secs(30);

/// Bytes of one chunk of a pool, borrowed from its mapping for as long as the transport holds the
/// write (the pool stays mapped while this lives).
struct PoolChunk {
    _pool: Arc<KvPool>,
    ptr: usize,
    len: usize,
}

impl AsRef<[u8]> for PoolChunk {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is a chunk of the pool's live mapping (checked by `chunk_region`
        // when the view was made), kept mapped by `_pool`. The engine does not write the page
        // between its PagesReady and its SourceFree, and SourceFree comes only after every write
        // holding this view is terminal.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl PrefillNode {
    /// Serves through `api`'s engine from now on (set once, before the first room; later calls are
    /// ignored). The node holds `api` weakly: the engine API owns the pools.
    pub fn set_engine(&self, api: &Arc<EngineApi>) {
        let _ = self.engine.set(Arc::downgrade(api));
    }

    /// The engine path's tier backend (set once, with the engine; later calls are ignored).
    pub fn set_tiers(&self, tiers: Arc<HostTiers>) {
        let _ = self.tiers.set(tiers);
    }

    /// This pod's rank of a LayerSplit group computing through its engine (set once, before the
    /// first room; later calls are ignored).
    pub fn set_engine_group(&self, group: Arc<super::super::cp_engine::EngineGroup>) {
        let _ = self.engine_group.set(group);
    }

    /// The LayerSplit group of the engine path, when this pod is one of its ranks.
    pub fn engine_group(&self) -> Option<&Arc<super::super::cp_engine::EngineGroup>> {
        self.engine_group.get()
    }

    /// A LayerSplit member's part of its leader's step `s` (`super::super::cp_engine`): the room's
    /// plan from the frame (the decode's address and pages; no decode stream to tell), then the
    /// work to the engine with the default room deadline. The decode's KV deadline is the
    /// leader's to enforce; this one bounds the engine.
    ///
    /// # Errors
    /// `ALREADY_EXISTS` for a room open here; `UNAVAILABLE` without an attached engine.
    pub fn member_open(
        &self,
        key: RoomKey,
        s: &crate::layer_split::wire::StepFrame,
    ) -> Result<(), Status> {
        let pages = s.dst_pages.len() as u32;
        {
            let mut plans = lock(&self.plans);
            if plans.contains_key(&key) {
                return Err(Status::already_exists(format!("{key} is already open")));
            }
            plans.insert(
                key,
                RoomPlan {
                    decode_worker: String::new(),
                    data_addr: s.data_addr.clone(),
                    region: RegionId(s.region),
                    pages: s.dst_pages.clone(),
                    request: s.request,
                    pages_done: 0,
                    decode_rank: 0,
                    decode_incarnation: 0,
                    group_member: true,
                },
            );
        }
        if let Err(status) =
            self.engine_open(key, s.request, pages, DEFAULT_ROOM_DEADLINE, Vec::new(), 0)
        {
            lock(&self.plans).remove(&key);
            return Err(status);
        }
        Ok(())
    }

    /// True when the node serves through an engine (`config.engine`).
    pub fn engine_mode(&self) -> bool {
        self.engine.get().is_some()
    }

    /// The engine API's prefill side, once an engine attached (it outlives attaches).
    pub fn engine_side(&self) -> Option<Arc<PrefillSide>> {
        self.engine.get()?.upgrade()?.prefill_side()
    }

    /// Hands room `key` (the decode's `pages` destination pages for `request`, Reserved under
    /// `hand_off_token` or 0) to the engine; the room fails with a reason if the engine has not
    /// produced it within `deadline`.
    fn engine_open(
        &self,
        key: RoomKey,
        request: u64,
        pages: u32,
        deadline: Duration,
        prefix_hashes: Vec<Vec<u8>>,
        hand_off_token: u64,
    ) -> Result<(), Status> {
        let side = self
            .engine_side()
            .ok_or_else(|| Status::unavailable("no engine has attached to this prefill worker"))?;
        let work = crate::engine_api::pb::PrefillWork {
            room: Some(key.into()),
            request_id: request,
            // Whole pages: the decode verifies every token row of every page it receives.
            tokens: pages.saturating_mul(self.cfg.layout.page_tokens),
            deadline_ms: deadline.as_millis() as u64,
            prefix_hashes,
            hand_off_token,
        };
        match self.engine_group() {
            // A LayerSplit leader's room waits for its step (one room at a time per group).
            Some(group) if group.is_leader() => group.open(work)?,
            _ => side
                .submit_work(work)
                .map_err(|e| Status::unavailable(e.to_string()))?,
        }
        let weak = Arc::downgrade(&side);
        tokio::spawn(async move {
            tokio::time::sleep(deadline).await;
            if let Some(side) = weak.upgrade() {
                side.fail_with(
                    key,
                    &format!(
                        "the engine did not produce the room's KV within {} ms",
                        deadline.as_millis()
                    ),
                );
            }
        });
        Ok(())
    }

    /// Moves one PagesReady write: the target pool's chunks of `write.pages` for `write.layers`, to
    /// the room's destination pages, in batches within the transport's limits; ends the write once
    /// every batch is terminal. Blocking (the transport may connect).
    fn engine_submit(self: &Arc<Self>, side: &Arc<PrefillSide>, write: PagesSend) {
        let key = write.key;
        let plan = lock(&self.plans).get(&key).map(|p| {
            (
                p.data_addr.clone(),
                p.region,
                p.pages.clone(),
                p.decode_worker.clone(),
            )
        });
        let Some((addr, region, dst, worker)) = plan else {
            tracing::warn!(%key, "PagesReady for a room with no destination");
            side.write_done(key, false);
            return;
        };
        // A LayerSplit rank's owned layers also go to the group's other ranks (the pages in use).
        let broadcast = match (self.engine_group(), side.pools().first()) {
            (Some(group), Some(pool)) => group.broadcast(
                key,
                pool,
                &write.pages,
                write.first_page,
                write.layers.clone(),
                dst.len(),
            ),
            _ => Ok(()),
        };
        let ops = broadcast.and_then(|()| self.engine_ops(side, &write, region, &dst));
        let ops = match ops {
            Ok(ops) => ops,
            Err(e) => {
                tracing::error!(%key, error = %e, "cannot move the engine's pages");
                self.send_to(&worker, failed_msg(key, self.cfg.rank, &e));
                side.fail_with(key, &e);
                side.write_done(key, false);
                return;
            }
        };
        let bytes: u64 = ops.iter().map(|o| o.data.len() as u64).sum();
        // A page is done once its last layer landed (`ChunkDone.pages_done` counts whole pages).
        let pages = if write.layers.end >= self.cfg.layout.layers {
            write.pages.len() as u32
        } else {
            0
        };
        let batches = match WriteBatch::split(ops, self.transport.limits()) {
            Ok(b) => b,
            Err(e) => {
                self.send_to(&worker, failed_msg(key, self.cfg.rank, &e.to_string()));
                side.write_done(key, false);
                return;
            }
        };
        let pending = Arc::new(AtomicUsize::new(batches.len()));
        let all_ok = Arc::new(AtomicBool::new(true));
        let finish = {
            let (node, side, worker) = (self.clone(), side.clone(), worker.clone());
            Arc::new(move |ok: bool, why: Option<String>| {
                if !ok {
                    all_ok.store(false, Ordering::SeqCst);
                }
                if pending.fetch_sub(1, Ordering::SeqCst) != 1 {
                    return;
                }
                let ok = all_ok.load(Ordering::SeqCst);
                node.engine_write_terminal(&side, key, &worker, ok, bytes, pages, why);
            })
        };
        let mut batches = batches.into_iter();
        while let Some(batch) = batches.next() {
            let f = finish.clone();
            let sink = Arc::new(move |_h: TransferHandle, status: &TransferStatus| {
                let ok = *status == TransferStatus::Completed;
                f(ok, (!ok).then(|| format!("{status:?}")));
            });
            if let Err(e) = self.transport.submit(&addr, batch, Some(sink)) {
                // This batch and the rest were never posted: nothing of them can land.
                let why = e.to_string();
                finish(false, Some(why.clone()));
                for _ in batches.by_ref() {
                    finish(false, Some(why.clone()));
                }
                break;
            }
        }
    }

    fn engine_ops(
        &self,
        side: &PrefillSide,
        write: &PagesSend,
        region: RegionId,
        dst: &[u32],
    ) -> Result<Vec<WriteOp>, String> {
        let layout = self.cfg.layout;
        let pool = side
            .pools()
            .first()
            .ok_or("the engine API has no target pool")?
            .clone();
        let g = *pool.geometry();
        // A LayerSplit rank's pool holds its owned layers (then the receive slot): model layer
        // `l` is its pool layer `l - owned.start`.
        let seat = side.layer_split();
        let pool_layers = seat.map_or(layout.layers, |s| s.pool_layers());
        if g.chunk_bytes() != layout.chunk_bytes() || g.layers != pool_layers {
            return Err(format!(
                "the target pool's chunks ({} B, {} layers) are not the transfer layout's ({} B, {} layers)",
                g.chunk_bytes(),
                g.layers,
                layout.chunk_bytes(),
                pool_layers
            ));
        }
        let base = pool.buffer().host_ptr().map_err(|e| e.to_string())? as usize;
        let mut ops = Vec::with_capacity(write.pages.len() * write.layers.len());
        for (i, &src) in write.pages.iter().enumerate() {
            let index = write.first_page as usize + i;
            let &d = dst.get(index).ok_or_else(|| {
                format!(
                    "room page {index} lies beyond the room's {} destination pages",
                    dst.len()
                )
            })?;
            for layer in write.layers.start..write.layers.end.min(layout.layers) {
                let pool_layer = match seat {
                    Some(s) => s
                        .pool_layer(layer)
                        .ok_or_else(|| format!("layer {layer} is not this rank's"))?,
                    None => layer,
                };
                let r = pool
                    .chunk_region(PageId(src), pool_layer)
                    .map_err(|e| e.to_string())?;
                ops.push(WriteOp {
                    key: write.key,
                    region,
                    offset: u64::from(d) * layout.page_bytes()
                        + u64::from(layer) * layout.chunk_bytes(),
                    data: Bytes::from_owner(PoolChunk {
                        _pool: pool.clone(),
                        ptr: base + r.offset,
                        len: r.len,
                    }),
                });
            }
        }
        if ops.is_empty() {
            return Err("the write names no chunk".into());
        }
        Ok(ops)
    }

    /// Every batch of one engine write is terminal: progress (or the failure) to the decode, then
    /// the write ends in the side's table (which may release the room's source pages).
    #[allow(clippy::too_many_arguments)]
    fn engine_write_terminal(
        &self,
        side: &PrefillSide,
        key: RoomKey,
        worker: &str,
        ok: bool,
        bytes: u64,
        pages: u32,
        why: Option<String>,
    ) {
        if ok {
            self.stats.kv_bytes_sent.fetch_add(bytes, Ordering::Relaxed);
            let done = lock(&self.plans).get_mut(&key).map(|p| {
                p.pages_done += pages;
                p.pages_done
            });
            if let Some(d) = done {
                self.send_to(
                    worker,
                    msg(Body::Chunk(pb::ChunkDone {
                        room: Some(key.into()),
                        prefill_rank: self.cfg.rank,
                        pages_done: d,
                        last: false,
                    })),
                );
            }
        } else {
            let why = why.unwrap_or_else(|| "transfer failed".into());
            tracing::warn!(%key, error = %why, "an engine write failed");
            self.send_to(worker, failed_msg(key, self.cfg.rank, &why));
        }
        side.write_done(key, ok);
        self.publish(key);
    }
}

fn failed_msg(key: RoomKey, rank: u32, reason: &str) -> pb::PeerMessage {
    msg(Body::Failed(pb::RoomFailed {
        room: Some(key.into()),
        prefill_rank: rank,
        reason: reason.to_owned(),
    }))
}

impl KvSink for PrefillNode {
    fn send(&self, side: &Arc<PrefillSide>, write: PagesSend) {
        let Some(node) = self.me.upgrade() else {
            side.write_done(write.key, false);
            return;
        };
        let side = side.clone();
        let run = move || node.engine_submit(&side, write);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(run);
            }
            Err(_) => {
                std::thread::spawn(run);
            }
        }
    }

    fn ack(&self, ack: AbortAck) {
        let from_plan = lock(&self.plans)
            .get(&ack.key)
            .map(|p| p.decode_worker.clone());
        let from_abort = lock(&self.abort_from).remove(&ack.key);
        match from_plan.or(from_abort) {
            Some(w) => {
                self.stats.acks_sent.fetch_add(1, Ordering::Relaxed);
                self.send_to(&w, msg(Body::Ack(ack_msg(&ack))));
            }
            None => tracing::warn!(key = %ack.key, "abort ack with no decode worker to send it to"),
        }
    }

    fn room_failed(&self, key: RoomKey, reason: &str) {
        let worker = lock(&self.plans).get(&key).map(|p| p.decode_worker.clone());
        tracing::warn!(%key, reason, "room failed on the engine side");
        if let Some(w) = worker {
            self.send_to(&w, failed_msg(key, self.cfg.rank, reason));
        }
        // A LayerSplit leader's members stop their part of it too.
        if let Some(group) = self.engine_group() {
            group.abort_members(key, reason);
        }
    }

    fn released(&self, key: RoomKey, sent: bool) {
        let plan = lock(&self.plans).remove(&key);
        // A LayerSplit member's part reports to its leader, not to the decode.
        let member = plan.as_ref().is_some_and(|p| p.group_member);
        if sent && !member {
            self.stats.rooms_completed.fetch_add(1, Ordering::Relaxed);
            if let Some(plan) = &plan {
                self.send_to(
                    &plan.decode_worker,
                    msg(Body::Chunk(pb::ChunkDone {
                        room: Some(key.into()),
                        prefill_rank: self.cfg.rank,
                        pages_done: plan.pages.len() as u32,
                        last: true,
                    })),
                );
            }
        }
        let state = if sent {
            SenderState::Success
        } else {
            SenderState::Failed(crate::release::sender::SenderFailure::Local)
        };
        self.publish_state(key, Some(state), 0);
        if let Some(group) = self.engine_group() {
            // The leader starts its next room; a member reports its part done.
            group.released(key, sent);
        }
    }
}

impl PrefillService {
    /// OpenRoom with an engine: the room's plan is recorded, the prefix is looked up in the tiers
    /// (the hits the decode is told, counted as the built-in planner counts them) and the engine
    /// gets the work with the request's prefix hashes.
    pub(super) async fn open_engine_room(
        &self,
        key: RoomKey,
        request: u64,
        r: pb::OpenRoomRequest,
    ) -> Result<pb::OpenRoomReply, Status> {
        let spec = r.request.clone().unwrap_or_default();
        let layout = self.node.cfg.layout;
        let hashes = HostTiers::hashes_of(&spec, layout);
        let hits = match self.node.tiers.get().cloned() {
            Some(tiers) => {
                let (s, h) = (spec.clone(), hashes.clone());
                tokio::task::spawn_blocking(move || tiers.open_lookup(&s, &h))
                    .await
                    .unwrap_or_default()
            }
            None => pb::PrefixHits::default(),
        };
        let deadline = if r.deadline_ms == 0 {
            DEFAULT_ROOM_DEADLINE
        } else {
            Duration::from_millis(r.deadline_ms)
        };
        let pages = r.dst_pages.len() as u32;
        let hand_off_token = r.hand_off_token;
        {
            let mut plans = lock(&self.node.plans);
            if plans.contains_key(&key) {
                return Err(Status::already_exists(format!("{key} is already open")));
            }
            plans.insert(
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
        }
        if let Err(status) =
            self.node
                .engine_open(key, request, pages, deadline, hashes, hand_off_token)
        {
            lock(&self.node.plans).remove(&key);
            tracing::warn!(%key, %status, "room refused: no engine to compute it");
            return Err(status);
        }
        self.node.publish(key);
        Ok(pb::OpenRoomReply {
            room: Some(key.into()),
            prefill_rank: self.node.cfg.rank,
            result: None,
            hits: Some(hits),
            incarnation: self.node.incarnation(),
        })
    }
}
