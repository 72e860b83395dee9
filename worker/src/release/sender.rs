//! The prefill-side room table: the sender half of the abort-safe release protocol.
//!
//! Rules (DESIGN contract 3; dataplane.md R-ABORT-2/3/6, the SGLang PR #35049/#38961 cases):
//! - An abort marks the room **failed first**; no write may begin on a failed room.
//! - Each abort registers an ack target `(room, generation, decode rank)`. The ack is sent exactly
//!   once per target: immediately when no write is outstanding, otherwise when the last outstanding
//!   write of the room becomes terminal.
//! - `clear()` (the scheduler forgetting a room) never drops ack targets nor outstanding counts: the
//!   entry stays until it is quiescent, so a cleared room with a write in flight acks only after the
//!   write drains.
//! - An abort for an unknown key (never opened, already quiescent and removed, or an old generation)
//!   acks immediately with [`AckKind::NoneStarted`]: the table removes an entry only when nothing of
//!   it is outstanding, so an unknown key cannot have a write in flight.
//! - Source pages of a room are held until its send is terminal: success with nothing outstanding,
//!   or failure with nothing outstanding. [`SenderEffect::ReleaseSource`] is emitted exactly once.
//!
//! The table is pure; the prefill role serialises calls through one lock and performs the effects.

use std::collections::{BTreeSet, HashMap};

use super::id::{DecodeRank, PrefillRank, RoomKey};

/// Why a sender room failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SenderFailure {
    /// Decode (or any peer) asked to abort the room.
    Aborted,
    /// A write of the room failed or was rejected by the receiver.
    TransferFailed,
    /// The prefill side gave up on its own (engine error, its own timeout, shutdown).
    Local,
}

/// The sender room states (dataplane.md §8, state machine 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SenderState {
    /// Opened; destination pages not yet known.
    Bootstrapping,
    /// Destination known; no write begun yet.
    WaitingForInput,
    /// At least one write has begun.
    Transferring,
    /// Every chunk was sent and every write completed.
    Success,
    /// Failed; no new writes. Ack targets fire once outstanding writes drain.
    Failed(SenderFailure),
}

/// What an ack asserts about the room's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckKind {
    /// No write of this room was ever begun by this rank.
    NoneStarted,
    /// Writes were begun and every one of them is terminal: nothing more can land.
    AllDrained,
}

/// An ABORT_ACK to send to one decode rank: "this prefill rank will never write this room again".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbortAck {
    /// Room and generation the ack is for.
    pub key: RoomKey,
    /// The acking prefill rank.
    pub prefill_rank: PrefillRank,
    /// The decode rank that asked (the ack's destination).
    pub decode_rank: DecodeRank,
    /// What the ack asserts.
    pub kind: AckKind,
}

/// An action the caller must perform after a table call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SenderEffect {
    /// Send this ack to its decode rank.
    SendAck(AbortAck),
    /// The room's send is terminal: its source pages may be returned to the prefill pool.
    ReleaseSource(RoomKey),
}

/// Errors of the sender table. None of them changes state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SenderError {
    /// The key is not open (unknown, removed, or another generation).
    #[error("{0} is not open on this prefill rank")]
    Unknown(RoomKey),
    /// The key is already open.
    #[error("{0} is already open")]
    AlreadyOpen(RoomKey),
    /// The room failed: no write may begin (R-ABORT-2).
    #[error("{0} failed ({1:?}); no new writes")]
    Failed(RoomKey, SenderFailure),
    /// The room was cleared by the scheduler: no write may begin.
    #[error("{0} was cleared; no new writes")]
    Cleared(RoomKey),
    /// The room concluded: all chunks were already submitted.
    #[error("{0} already concluded")]
    Concluded(RoomKey),
    /// `end_write` without a matching `begin_write`.
    #[error("{0} has no outstanding write to end")]
    NothingOutstanding(RoomKey),
}

#[derive(Debug)]
struct SenderRoom {
    state: SenderState,
    outstanding: u32,
    ever_started: bool,
    input_done: bool,
    cleared: bool,
    source_released: bool,
    pending_targets: BTreeSet<DecodeRank>,
    acked_targets: BTreeSet<DecodeRank>,
}

impl SenderRoom {
    fn quiescent(&self) -> bool {
        self.outstanding == 0
    }
    fn terminal(&self) -> bool {
        matches!(self.state, SenderState::Success | SenderState::Failed(_)) && self.quiescent()
    }
}

/// The prefill rank's table of sender rooms, keyed by `(room, generation)`.
#[derive(Debug)]
pub struct SenderRooms {
    rank: PrefillRank,
    rooms: HashMap<RoomKey, SenderRoom>,
}

impl SenderRooms {
    /// An empty table for prefill rank `rank`.
    pub fn new(rank: PrefillRank) -> SenderRooms {
        SenderRooms {
            rank,
            rooms: HashMap::new(),
        }
    }

    /// This table's prefill rank.
    pub fn rank(&self) -> PrefillRank {
        self.rank
    }

    /// Opens a room in `Bootstrapping`.
    pub fn open(&mut self, key: RoomKey) -> Result<(), SenderError> {
        if self.rooms.contains_key(&key) {
            return Err(SenderError::AlreadyOpen(key));
        }
        self.rooms.insert(
            key,
            SenderRoom {
                state: SenderState::Bootstrapping,
                outstanding: 0,
                ever_started: false,
                input_done: false,
                cleared: false,
                source_released: false,
                pending_targets: BTreeSet::new(),
                acked_targets: BTreeSet::new(),
            },
        );
        Ok(())
    }

    /// The destination pages are known: `Bootstrapping → WaitingForInput`.
    pub fn destination_ready(&mut self, key: RoomKey) -> Result<(), SenderError> {
        let room = self.live_room(key)?;
        if room.state == SenderState::Bootstrapping {
            room.state = SenderState::WaitingForInput;
        }
        Ok(())
    }

    /// Current state of a key, `None` if unknown.
    pub fn state(&self, key: RoomKey) -> Option<SenderState> {
        self.rooms.get(&key).map(|r| r.state)
    }

    /// Outstanding (begun, not terminal) writes of a key; 0 if unknown.
    pub fn outstanding(&self, key: RoomKey) -> u32 {
        self.rooms.get(&key).map_or(0, |r| r.outstanding)
    }

    /// Number of entries still held (live or draining).
    pub fn len(&self) -> usize {
        self.rooms.len()
    }

    /// True when the table holds no entry.
    pub fn is_empty(&self) -> bool {
        self.rooms.is_empty()
    }

    /// Begins one write. Must be called (and succeed) **before** the transport is handed the write;
    /// refused once the room failed, was cleared or concluded.
    pub fn begin_write(&mut self, key: RoomKey) -> Result<(), SenderError> {
        let room = self.live_room(key)?;
        if room.input_done {
            return Err(SenderError::Concluded(key));
        }
        room.outstanding += 1;
        room.ever_started = true;
        room.state = SenderState::Transferring;
        Ok(())
    }

    /// Ends one write that the transport reported terminal (`ok` = completed, else failed or
    /// cancelled-and-quiescent). Fires pending acks and the source release when the room drains.
    pub fn end_write(&mut self, key: RoomKey, ok: bool) -> Result<Vec<SenderEffect>, SenderError> {
        let room = self.rooms.get_mut(&key).ok_or(SenderError::Unknown(key))?;
        if room.outstanding == 0 {
            return Err(SenderError::NothingOutstanding(key));
        }
        room.outstanding -= 1;
        if !ok && !matches!(room.state, SenderState::Failed(_)) {
            room.state = SenderState::Failed(SenderFailure::TransferFailed);
        }
        if room.quiescent() && room.input_done && room.state == SenderState::Transferring {
            room.state = SenderState::Success;
        }
        Ok(self.settle(key))
    }

    /// All chunks of the room were submitted. The room becomes `Success` once its writes drain.
    pub fn finish_input(&mut self, key: RoomKey) -> Result<Vec<SenderEffect>, SenderError> {
        let room = self.live_room(key)?;
        room.input_done = true;
        if room.quiescent() {
            room.state = SenderState::Success;
        }
        Ok(self.settle(key))
    }

    /// Fails the room on the prefill side's own initiative (engine error, local timeout, shutdown).
    /// No ack is sent by itself: decode learns of the failure, aborts, and gets its ack through
    /// [`SenderRooms::abort`] — the same gate for every failure kind (R-ABORT-5).
    pub fn fail(&mut self, key: RoomKey, why: SenderFailure) -> Vec<SenderEffect> {
        if let Some(room) = self.rooms.get_mut(&key)
            && room.state != SenderState::Success
            && !matches!(room.state, SenderState::Failed(_))
        {
            room.state = SenderState::Failed(why);
        }
        self.settle(key)
    }

    /// An ABORT from `decode_rank` for `key`. Marks the room failed first, then registers the ack
    /// target; the ack fires now if nothing is outstanding, else when the room drains. A second
    /// abort from the same decode rank for the same key produces no second ack.
    pub fn abort(&mut self, key: RoomKey, decode_rank: DecodeRank) -> Vec<SenderEffect> {
        let rank = self.rank;
        let Some(room) = self.rooms.get_mut(&key) else {
            // Unknown key: entries are removed only when quiescent, so nothing can be in flight.
            return vec![SenderEffect::SendAck(AbortAck {
                key,
                prefill_rank: rank,
                decode_rank,
                kind: AckKind::NoneStarted,
            })];
        };
        if room.state != SenderState::Success && !matches!(room.state, SenderState::Failed(_)) {
            room.state = SenderState::Failed(SenderFailure::Aborted);
        }
        if !room.acked_targets.contains(&decode_rank) {
            room.pending_targets.insert(decode_rank);
        }
        self.settle(key)
    }

    /// The scheduler forgets the room. Outstanding writes and ack targets survive: the entry is
    /// removed only once it is terminal and quiescent.
    pub fn clear(&mut self, key: RoomKey) -> Vec<SenderEffect> {
        if let Some(room) = self.rooms.get_mut(&key) {
            room.cleared = true;
            if !matches!(room.state, SenderState::Success | SenderState::Failed(_)) {
                room.state = SenderState::Failed(SenderFailure::Local);
            }
        }
        self.settle(key)
    }

    /// Keys that still have outstanding writes (for drain at teardown).
    pub fn draining(&self) -> Vec<RoomKey> {
        self.rooms
            .iter()
            .filter(|(_, r)| !r.quiescent())
            .map(|(k, _)| *k)
            .collect()
    }

    fn live_room(&mut self, key: RoomKey) -> Result<&mut SenderRoom, SenderError> {
        let room = self.rooms.get_mut(&key).ok_or(SenderError::Unknown(key))?;
        if let SenderState::Failed(why) = room.state {
            return Err(SenderError::Failed(key, why));
        }
        if room.cleared {
            return Err(SenderError::Cleared(key));
        }
        if room.state == SenderState::Success {
            return Err(SenderError::Concluded(key));
        }
        Ok(room)
    }

    /// Fires what the room's current state allows: acks when quiescent, the source release when
    /// terminal, and removal when terminal, quiescent and cleared.
    fn settle(&mut self, key: RoomKey) -> Vec<SenderEffect> {
        let rank = self.rank;
        let mut effects = Vec::new();
        let Some(room) = self.rooms.get_mut(&key) else {
            return effects;
        };
        if room.quiescent() && !room.pending_targets.is_empty() {
            let kind = if room.ever_started {
                AckKind::AllDrained
            } else {
                AckKind::NoneStarted
            };
            for decode_rank in std::mem::take(&mut room.pending_targets) {
                room.acked_targets.insert(decode_rank);
                effects.push(SenderEffect::SendAck(AbortAck {
                    key,
                    prefill_rank: rank,
                    decode_rank,
                    kind,
                }));
            }
        }
        if room.terminal() && !room.source_released {
            room.source_released = true;
            effects.push(SenderEffect::ReleaseSource(key));
        }
        if room.terminal() && room.cleared {
            self.rooms.remove(&key);
        }
        effects
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P0: PrefillRank = PrefillRank(0);
    const D0: DecodeRank = DecodeRank(0);
    const D1: DecodeRank = DecodeRank(1);

    fn key(g: u64) -> RoomKey {
        RoomKey::new(7, g)
    }

    fn acks(effects: &[SenderEffect]) -> Vec<AbortAck> {
        effects
            .iter()
            .filter_map(|e| match e {
                SenderEffect::SendAck(a) => Some(*a),
                SenderEffect::ReleaseSource(_) => None,
            })
            .collect()
    }

    fn releases(effects: &[SenderEffect]) -> usize {
        effects
            .iter()
            .filter(|e| matches!(e, SenderEffect::ReleaseSource(_)))
            .count()
    }

    fn open_ready(t: &mut SenderRooms, k: RoomKey) {
        t.open(k).unwrap();
        t.destination_ready(k).unwrap();
    }

    #[test]
    fn abort_with_nothing_started_acks_immediately() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        let fx = t.abort(key(1), D0);
        assert_eq!(
            acks(&fx),
            vec![AbortAck {
                key: key(1),
                prefill_rank: P0,
                decode_rank: D0,
                kind: AckKind::NoneStarted
            }]
        );
        assert_eq!(
            t.state(key(1)),
            Some(SenderState::Failed(SenderFailure::Aborted))
        );
        assert_eq!(
            releases(&fx),
            1,
            "a failed quiescent room releases its source pages"
        );
    }

    #[test]
    fn abort_of_unknown_room_acks_none_started() {
        let mut t = SenderRooms::new(P0);
        let fx = t.abort(key(3), D0);
        assert_eq!(acks(&fx)[0].kind, AckKind::NoneStarted);
        assert!(t.is_empty());
    }

    #[test]
    fn ack_held_while_outstanding_and_fires_once_on_drain() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.begin_write(key(1)).unwrap();
        assert!(
            acks(&t.abort(key(1), D0)).is_empty(),
            "no ack while writes are outstanding"
        );
        assert_eq!(
            t.begin_write(key(1)),
            Err(SenderError::Failed(key(1), SenderFailure::Aborted)),
            "failed before ack registration: no new write"
        );
        assert!(acks(&t.end_write(key(1), true).unwrap()).is_empty());
        let fx = t.end_write(key(1), true).unwrap();
        assert_eq!(
            acks(&fx),
            vec![AbortAck {
                key: key(1),
                prefill_rank: P0,
                decode_rank: D0,
                kind: AckKind::AllDrained
            }]
        );
        assert_eq!(
            releases(&fx),
            1,
            "source pages released only when the send is terminal"
        );
        assert!(
            acks(&t.abort(key(1), D0)).is_empty(),
            "once per (room, generation, decode rank)"
        );
    }

    #[test]
    fn ack_once_per_target_even_with_duplicate_aborts() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.abort(key(1), D0);
        t.abort(key(1), D0);
        let fx = t.end_write(key(1), true).unwrap();
        assert_eq!(acks(&fx).len(), 1);
        assert!(acks(&t.abort(key(1), D0)).is_empty());
    }

    #[test]
    fn two_decode_ranks_aborting_one_room_get_two_acks() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.abort(key(1), D0);
        t.abort(key(1), D1);
        let got = acks(&t.end_write(key(1), true).unwrap());
        let ranks: Vec<_> = got.iter().map(|a| a.decode_rank).collect();
        assert_eq!(ranks, vec![D0, D1]);
        // A rank whose abort arrives after the drain is acked immediately, still once.
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(2));
        assert_eq!(acks(&t.abort(key(2), D0)).len(), 1);
        assert_eq!(acks(&t.abort(key(2), D1)).len(), 1);
        assert_eq!(acks(&t.abort(key(2), D1)).len(), 0);
    }

    #[test]
    fn cleared_room_with_outstanding_write_acks_only_after_drain() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.abort(key(1), D0);
        assert!(
            acks(&t.clear(key(1))).is_empty(),
            "clear must not ack nor drop the target"
        );
        assert_eq!(
            t.len(),
            1,
            "entry survives clear while a write is outstanding"
        );
        // A second abort arriving while draining (e.g. from another decode rank) must not ack early.
        assert!(acks(&t.abort(key(1), D1)).is_empty());
        let fx = t.end_write(key(1), false).unwrap();
        assert_eq!(acks(&fx).len(), 2);
        assert_eq!(releases(&fx), 1);
        assert!(t.is_empty(), "terminal, quiescent, cleared → removed");
    }

    #[test]
    fn clear_before_abort_still_acks_after_drain() {
        // PR #38961 item 1: the scheduler clears the room while the worker is inside the transfer.
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.clear(key(1));
        assert!(acks(&t.abort(key(1), D0)).is_empty());
        assert_eq!(acks(&t.end_write(key(1), true).unwrap()).len(), 1);
    }

    #[test]
    fn concluded_room_acks_immediately() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.finish_input(key(1)).unwrap();
        let fx = t.end_write(key(1), true).unwrap();
        assert_eq!(t.state(key(1)), Some(SenderState::Success));
        assert_eq!(releases(&fx), 1);
        let fx = t.abort(key(1), D0);
        assert_eq!(acks(&fx)[0].kind, AckKind::AllDrained);
        assert_eq!(
            t.state(key(1)),
            Some(SenderState::Success),
            "a concluded room stays Success"
        );
    }

    #[test]
    fn generations_are_independent() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        open_ready(&mut t, key(2));
        // Abort of the new generation acks at once; the old one is still writing.
        assert_eq!(acks(&t.abort(key(2), D0))[0].key, key(2));
        assert_eq!(t.outstanding(key(1)), 1);
        assert_eq!(t.state(key(1)), Some(SenderState::Transferring));
    }

    #[test]
    fn prefill_side_failure_acks_through_the_same_gate() {
        // R-ABORT-5: a failure the prefill side starts sends no ack by itself; decode's abort gets
        // one, and only after the outstanding write drains.
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        assert!(acks(&t.fail(key(1), SenderFailure::Local)).is_empty());
        assert_eq!(
            t.begin_write(key(1)),
            Err(SenderError::Failed(key(1), SenderFailure::Local))
        );
        assert!(acks(&t.abort(key(1), D0)).is_empty());
        let fx = t.end_write(key(1), true).unwrap();
        assert_eq!(acks(&fx)[0].kind, AckKind::AllDrained);
        assert_eq!(
            t.state(key(1)),
            Some(SenderState::Failed(SenderFailure::Local)),
            "the first cause is kept"
        );
    }

    #[test]
    fn failed_write_fails_room_and_source_is_held_until_drained() {
        let mut t = SenderRooms::new(P0);
        open_ready(&mut t, key(1));
        t.begin_write(key(1)).unwrap();
        t.begin_write(key(1)).unwrap();
        let fx = t.end_write(key(1), false).unwrap();
        assert_eq!(releases(&fx), 0, "one write still reads the source pages");
        assert_eq!(
            t.state(key(1)),
            Some(SenderState::Failed(SenderFailure::TransferFailed))
        );
        assert_eq!(releases(&t.end_write(key(1), true).unwrap()), 1);
        assert_eq!(
            t.end_write(key(1), true),
            Err(SenderError::NothingOutstanding(key(1)))
        );
    }
}
