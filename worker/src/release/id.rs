//! Identifiers of rooms and ranks (DESIGN contract 3: every message carries room id and generation).

use std::fmt;

/// A transfer room id: one per request hand-off, chosen by decode (unique per decode instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RoomId(pub u64);

/// The incarnation of a room id. A retry of a request under the same room id must use a strictly
/// higher generation; messages of any other generation are stale and ignored (R-ABORT-7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u64);

impl Generation {
    /// The next incarnation.
    pub fn next(self) -> Generation {
        Generation(self.0.wrapping_add(1))
    }
}

/// `(room id, generation)`: the key of every room-scoped message, write frame and ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RoomKey {
    /// The room.
    pub room: RoomId,
    /// Its incarnation.
    pub generation: Generation,
}

impl RoomKey {
    /// Builds a key from raw wire values.
    pub fn new(room: u64, generation: u64) -> RoomKey {
        RoomKey {
            room: RoomId(room),
            generation: Generation(generation),
        }
    }
}

impl fmt::Display for RoomKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "room {}/gen {}", self.room.0, self.generation.0)
    }
}

/// A decode rank (TP/CP rank of the decode instance) that receives KV of a room and may abort it.
/// With MLA fan-out several decode ranks abort the same room; each needs its own ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DecodeRank(pub u32);

/// A prefill rank that may write into a room's decode pages; decode needs one ack from each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrefillRank(pub u32);
