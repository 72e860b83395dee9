//! A same-host link between a prefill side and a decode side: the [`KvSource`] of the decode worker
//! and the [`KvSink`] of the prefill worker, moving KV by copying chunks between the two workers'
//! pools (both mapped in this process).
//!
//! It runs the whole room protocol for real — the decode room's gate ([`DecodeSide`]), the prefill
//! sender table ([`PrefillSide`]), aborts, acks — with a copy in place of the network, so the engine
//! API can be exercised end to end with two engines and no peer process. It offers no transport proof:
//! a failed room is released only by acks (the ack-only path the RDMA transport needs). The serving
//! path replaces it by the TCP/RDMA transfer between workers.
//!
//! Writes land through [`KvPool::write_chunk`](crate::memory::pool::KvPool::write_chunk), which refuses a
//! page that is not allocated; a page that was released and reserved again by another room is
//! written — the late-write hazard the release gate exists for (seed 004).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::memory::pool::{KvPool, PageId};
use crate::release::receiver::FailureCause;
use crate::release::sender::AbortAck;
use crate::release::{DecodeRank, PrefillRank, RoomKey};

use super::decode::{DecodeSide, KvSource, RoomOpen};
use super::pb;
use super::prefill::{KvSink, PagesSend, PrefillSide};
use super::service::EngineApi;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Default)]
struct LinkRoom {
    dst: Vec<u32>,
    outstanding: u32,
    last_done: bool,
    failed: bool,
}

impl LinkRoom {
    /// Books one write's end; true when the room's KV is complete: its last write landed, no write
    /// is in flight, and none failed. A failed write bars completion for good — its page was never
    /// written — even when its failure is booked after the last good write (the two run on
    /// different threads, so a completion decided without this flag could reach the gate before
    /// the failure and the room would be Success with a hole in it).
    fn write_done(&mut self, last: bool, ok: bool) -> bool {
        self.outstanding = self.outstanding.saturating_sub(1);
        self.failed |= !ok;
        self.last_done |= last && ok;
        !self.failed && self.last_done && self.outstanding == 0
    }
}

/// Links one decode worker's engine API to one prefill worker's, in one process.
#[derive(Debug)]
pub struct LocalLink {
    decode_rank: DecodeRank,
    prefill_rank: PrefillRank,
    decode: Mutex<Weak<EngineApi>>,
    prefill: Mutex<Weak<EngineApi>>,
    rooms: Mutex<HashMap<RoomKey, LinkRoom>>,
    me: Weak<LocalLink>,
}

impl LocalLink {
    /// An unbound link between decode rank `decode_rank` and prefill rank `prefill_rank`.
    pub fn new(decode_rank: u32, prefill_rank: u32) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            decode_rank: DecodeRank(decode_rank),
            prefill_rank: PrefillRank(prefill_rank),
            decode: Mutex::new(Weak::new()),
            prefill: Mutex::new(Weak::new()),
            rooms: Mutex::new(HashMap::new()),
            me: me.clone(),
        })
    }

    /// Binds the two workers (after both APIs were built with this link).
    pub fn bind(&self, decode: &Arc<EngineApi>, prefill: &Arc<EngineApi>) {
        *lock(&self.decode) = Arc::downgrade(decode);
        *lock(&self.prefill) = Arc::downgrade(prefill);
    }

    fn decode_side(&self) -> Option<Arc<DecodeSide>> {
        lock(&self.decode).upgrade()?.decode_side()
    }

    fn prefill_side(&self) -> Option<Arc<PrefillSide>> {
        lock(&self.prefill).upgrade()?.prefill_side()
    }

    /// Rooms the link still tracks (open, or aborted and not yet acked).
    pub fn rooms(&self) -> usize {
        lock(&self.rooms).len()
    }

    fn copy(
        &self,
        src_side: &PrefillSide,
        w: &PagesSend,
        decode: &DecodeSide,
    ) -> Result<(), String> {
        let dst = lock(&self.rooms)
            .get(&w.key)
            .map(|r| r.dst.clone())
            .ok_or_else(|| format!("{} has no destination", w.key))?;
        let dst_pools = decode.pools();
        for (i, &src) in w.pages.iter().enumerate() {
            let index = w.first_page as usize + i;
            let Some(&d) = dst.get(index) else {
                return Err(format!(
                    "{}: room page {index} beyond its {} destination pages",
                    w.key,
                    dst.len()
                ));
            };
            for sp in src_side.pools() {
                let Some(dp) = dst_pools.iter().find(|p| p.role() == sp.role()) else {
                    continue;
                };
                // A pool with fewer layers (the draft model) takes the part of the range it has.
                let top = sp.geometry().layers.min(dp.geometry().layers);
                for layer in w.layers.start.min(top)..w.layers.end.min(top) {
                    copy_chunk(sp, src, dp, d, layer)?;
                }
            }
        }
        Ok(())
    }
}

fn copy_chunk(src: &KvPool, sp: u32, dst: &KvPool, dp: u32, layer: u32) -> Result<(), String> {
    let region = src
        .chunk_region(PageId(sp), layer)
        .map_err(|e| e.to_string())?;
    let host = src.buffer().host_ptr().map_err(|e| e.to_string())?;
    // SAFETY: the region lies inside the prefill pool's live mapping (chunk_region checks the
    // indices); the engine does not write a page between PagesReady and its SourceFree, and the
    // worker holds the page for the room until then.
    let bytes = unsafe { std::slice::from_raw_parts(host.add(region.offset), region.len) };
    dst.write_chunk(PageId(dp), layer, 0, bytes)
        .map_err(|e| format!("writing page {dp} layer {layer}: {e}"))
}

impl KvSource for LocalLink {
    fn writers(&self, _request_id: u64) -> Vec<PrefillRank> {
        vec![self.prefill_rank]
    }

    fn open(&self, room: RoomOpen) -> Result<(), String> {
        let prefill = self
            .prefill_side()
            .ok_or("no prefill engine is attached to the linked worker")?;
        lock(&self.rooms).insert(
            room.key,
            LinkRoom {
                dst: room.pages.clone(),
                ..LinkRoom::default()
            },
        );
        let work = pb::PrefillWork {
            room: Some(room.key.into()),
            request_id: room.request_id,
            tokens: room.tokens,
            deadline_ms: room.deadline.as_millis() as u64,
            hand_off_token: room.hand_off_token,
            ..pb::PrefillWork::default()
        };
        prefill.submit_work(work).map_err(|e| {
            lock(&self.rooms).remove(&room.key);
            e.to_string()
        })
    }

    fn abort(&self, key: RoomKey, _ranks: &[PrefillRank], _cause: FailureCause) {
        match self.prefill_side() {
            Some(p) => p.abort(key, self.decode_rank),
            // No prefill engine: nothing can write the room; ack on its behalf.
            None => self.ack(AbortAck {
                key,
                prefill_rank: self.prefill_rank,
                decode_rank: self.decode_rank,
                kind: crate::release::sender::AckKind::NoneStarted,
            }),
        }
    }
}

impl KvSink for LocalLink {
    fn send(&self, side: &Arc<PrefillSide>, write: PagesSend) {
        if let Some(r) = lock(&self.rooms).get_mut(&write.key) {
            r.outstanding += 1;
        }
        let Some(link) = self.me.upgrade() else {
            side.write_done(write.key, false);
            return;
        };
        let side = side.clone();
        let run = move || {
            let key = write.key;
            let decode = link.decode_side();
            let result = match &decode {
                Some(d) => link.copy(&side, &write, d),
                None => Err("the decode worker is gone".into()),
            };
            let ok = result.is_ok();
            if let Err(e) = &result {
                tracing::warn!(%key, error = %e, "local KV write failed");
            }
            let complete = {
                let mut rooms = lock(&link.rooms);
                match rooms.get_mut(&key) {
                    Some(r) => {
                        let done = r.write_done(write.last, ok);
                        if done {
                            rooms.remove(&key);
                        }
                        done
                    }
                    None => false,
                }
            };
            if let Some(d) = &decode {
                if ok {
                    d.on_chunk(key);
                } else {
                    d.on_failed(key, FailureCause::TransferFailed);
                }
                if complete {
                    d.on_complete(key);
                }
            }
            side.write_done(key, ok);
        };
        std::thread::spawn(run);
    }

    fn ack(&self, ack: AbortAck) {
        lock(&self.rooms).remove(&ack.key);
        if let Some(d) = self.decode_side() {
            d.on_ack(ack.key, ack.prefill_rank);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LinkRoom;

    fn room(writes: u32) -> LinkRoom {
        LinkRoom {
            outstanding: writes,
            ..LinkRoom::default()
        }
    }

    #[test]
    fn a_room_completes_when_its_last_write_lands_and_none_is_in_flight() {
        let mut r = room(2);
        assert!(!r.write_done(true, true), "a write is still in flight");
        assert!(r.write_done(false, true));
    }

    #[test]
    fn a_failure_booked_after_the_last_good_write_bars_completion() {
        // The last write lands first; the earlier write's failure is booked after it (another
        // thread): the room must not complete with that page unwritten.
        let mut r = room(2);
        assert!(!r.write_done(true, true));
        assert!(!r.write_done(false, false));
        // Nor does anything booked later complete it.
        let mut r = room(3);
        assert!(!r.write_done(false, false));
        assert!(!r.write_done(false, true));
        assert!(!r.write_done(true, true));
    }
}
