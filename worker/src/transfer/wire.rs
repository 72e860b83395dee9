//! The TCP data-plane wire format (little-endian, fixed-size headers).
//!
//! ```text
//! write frame  (sender → receiver): WriteHeader (56 B) followed by `len` payload bytes
//!   magic u32 = "TNDW" | version u8 = 1 | pad u8 ×3 | seq u64 | room u64 | generation u64
//!   | region u32 | pad u32 | offset u64 | len u64
//! reply frame  (receiver → sender): Reply (16 B), one per write frame, in order
//!   seq u64 | status u8 | pad u8 ×7
//! ```
//!
//! Parsing never panics: a bad magic or version is a [`WireError`] and the connection is closed.

use crate::release::RoomKey;

use super::RegionId;

/// Magic of a write frame.
pub const WRITE_MAGIC: u32 = u32::from_le_bytes(*b"TNDW");
/// Wire version.
pub const VERSION: u8 = 1;
/// Size of [`WriteHeader`] on the wire.
pub const WRITE_HEADER_BYTES: usize = 56;
/// Size of [`Reply`] on the wire.
pub const REPLY_BYTES: usize = 16;
/// Largest payload one frame may carry (1 GiB); larger lengths are malformed.
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// Malformed input.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a Tandem frame.
    #[error("bad magic {0:#x}")]
    BadMagic(u32),
    /// Unsupported version.
    #[error("unsupported wire version {0}")]
    BadVersion(u8),
    /// Payload length above [`MAX_PAYLOAD`].
    #[error("payload length {0} exceeds the limit")]
    PayloadTooLarge(u64),
    /// Unknown reply status byte.
    #[error("unknown reply status {0}")]
    BadStatus(u8),
}

/// Header of one write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteHeader {
    /// Per-connection sequence number, echoed in the reply.
    pub seq: u64,
    /// Room and generation.
    pub key: RoomKey,
    /// Destination region.
    pub region: RegionId,
    /// Destination offset.
    pub offset: u64,
    /// Payload length.
    pub len: u64,
}

impl WriteHeader {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; WRITE_HEADER_BYTES] {
        let mut b = [0u8; WRITE_HEADER_BYTES];
        b[0..4].copy_from_slice(&WRITE_MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.room.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.generation.0.to_le_bytes());
        b[32..36].copy_from_slice(&self.region.0.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a header.
    pub fn decode(b: &[u8; WRITE_HEADER_BYTES]) -> Result<WriteHeader, WireError> {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != WRITE_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(WireError::BadVersion(b[4]));
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let len = u64_at(48);
        if len > MAX_PAYLOAD {
            return Err(WireError::PayloadTooLarge(len));
        }
        Ok(WriteHeader {
            seq: u64_at(8),
            key: RoomKey::new(u64_at(16), u64_at(24)),
            region: RegionId(u32::from_le_bytes([b[32], b[33], b[34], b[35]])),
            offset: u64_at(40),
            len,
        })
    }
}

/// What the receiver did with one write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteStatus {
    /// The bytes landed.
    Applied = 0,
    /// Dropped: the room is not open at this generation (late write of an aborted room).
    Stale = 1,
    /// Dropped: outside the region.
    OutOfBounds = 2,
    /// Dropped: no such region.
    UnknownRegion = 3,
}

/// One reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    /// Sequence number of the write.
    pub seq: u64,
    /// Outcome.
    pub status: WriteStatus,
}

impl Reply {
    /// Serialises the reply.
    pub fn encode(&self) -> [u8; REPLY_BYTES] {
        let mut b = [0u8; REPLY_BYTES];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8] = self.status as u8;
        b
    }

    /// Parses a reply.
    pub fn decode(b: &[u8; REPLY_BYTES]) -> Result<Reply, WireError> {
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[0..8]);
        let status = match b[8] {
            0 => WriteStatus::Applied,
            1 => WriteStatus::Stale,
            2 => WriteStatus::OutOfBounds,
            3 => WriteStatus::UnknownRegion,
            other => return Err(WireError::BadStatus(other)),
        };
        Ok(Reply {
            seq: u64::from_le_bytes(s),
            status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_reply_round_trip_and_reject_garbage() {
        let h = WriteHeader {
            seq: 9,
            key: RoomKey::new(3, 4),
            region: RegionId(2),
            offset: 1 << 40,
            len: 65536,
        };
        assert_eq!(WriteHeader::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert!(matches!(
            WriteHeader::decode(&bad),
            Err(WireError::BadMagic(_))
        ));
        let mut big = h;
        big.len = MAX_PAYLOAD + 1;
        assert_eq!(
            WriteHeader::decode(&big.encode()),
            Err(WireError::PayloadTooLarge(MAX_PAYLOAD + 1))
        );
        let r = Reply {
            seq: 5,
            status: WriteStatus::Stale,
        };
        assert_eq!(Reply::decode(&r.encode()), Ok(r));
        let mut rb = r.encode();
        rb[8] = 77;
        assert_eq!(Reply::decode(&rb), Err(WireError::BadStatus(77)));
    }
}
