//! The framed TCP protocol of the L3 store (`tandem-worker cache`), used by store clients and tests.
//!
//! Little-endian frames, one request then one response on a connection, repeated:
//! - request: `op: u8 | body_len: u32 | body`;
//! - response: `status: u8 | body_len: u32 | body`.
//!
//! | op | request body | OK response body |
//! |---|---|---|
//! | `PUT` 1 | `key_len: u16 | key (JSON ObjectKey) | data` | `1` stored or `0` already present |
//! | `GET` 2 | key (JSON) | the object's bytes (`MISS` when absent) |
//! | `LOOKUP` 3 | JSON array of keys | `u64`: leading keys present |
//! | `HEALTH` 4 | empty | JSON [`L3Health`](super::store::L3Health) |
//!
//! `ERROR` responses carry a UTF-8 message. Bodies above [`MAX_BODY`] are refused before allocation,
//! and any malformed frame is a typed [`WireError`]: the server answers what it can and closes that
//! connection, never the process. Bulk KV between instances moves over the transfer transports; this
//! protocol carries whole objects between a store client and its store.

use std::io::{self, Read, Write};

/// Largest accepted body: 1 GiB (one object plus its key).
pub const MAX_BODY: u32 = 1 << 30;

/// Request operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Store an object.
    Put = 1,
    /// Read an object.
    Get = 2,
    /// Count leading present keys.
    Lookup = 3,
    /// Health report.
    Health = 4,
    /// The most recently used object keys of one shard and pool (restart loadback of a
    /// worker's host cache): body `{"shard", "pool", "limit"}`, answer a JSON key list, most recent
    /// first.
    Hot = 5,
}

/// Response statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Done; the body is the answer.
    Ok = 0,
    /// The object is not (or not yet) in the store.
    Miss = 1,
    /// The request failed; the body is the message.
    Error = 2,
}

/// Frame errors.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed or closed mid-frame.
    #[error("L3 wire I/O: {0}")]
    Io(#[from] io::Error),
    /// Unknown op or status byte.
    #[error("unknown L3 {what} byte {byte}")]
    UnknownCode {
        /// `op` or `status`.
        what: &'static str,
        /// The byte.
        byte: u8,
    },
    /// A body above [`MAX_BODY`].
    #[error("L3 frame body of {0} bytes exceeds the limit")]
    TooLarge(u64),
    /// A body whose content does not parse.
    #[error("malformed L3 frame body: {0}")]
    Malformed(String),
}

impl TryFrom<u8> for Op {
    type Error = WireError;
    fn try_from(b: u8) -> Result<Self, WireError> {
        Ok(match b {
            1 => Op::Put,
            2 => Op::Get,
            3 => Op::Lookup,
            4 => Op::Health,
            5 => Op::Hot,
            byte => return Err(WireError::UnknownCode { what: "op", byte }),
        })
    }
}

impl TryFrom<u8> for Status {
    type Error = WireError;
    fn try_from(b: u8) -> Result<Self, WireError> {
        Ok(match b {
            0 => Status::Ok,
            1 => Status::Miss,
            2 => Status::Error,
            byte => {
                return Err(WireError::UnknownCode {
                    what: "status",
                    byte,
                });
            }
        })
    }
}

/// Writes one frame (`code | len | body`), the body given in parts to avoid copying object bytes.
///
/// # Errors
/// [`WireError::TooLarge`] or [`WireError::Io`].
pub fn write_frame(w: &mut impl Write, code: u8, parts: &[&[u8]]) -> Result<(), WireError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len32 = u32::try_from(len)
        .ok()
        .filter(|l| *l <= MAX_BODY)
        .ok_or(WireError::TooLarge(len as u64))?;
    let mut header = [0u8; 5];
    header[0] = code;
    header[1..].copy_from_slice(&len32.to_le_bytes());
    w.write_all(&header)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()?;
    Ok(())
}

/// Reads one frame: `Ok(None)` on a clean end of stream before the first byte.
///
/// # Errors
/// [`WireError::TooLarge`] (nothing allocated) or [`WireError::Io`].
pub fn read_frame(r: &mut impl Read) -> Result<Option<(u8, Vec<u8>)>, WireError> {
    let mut header = [0u8; 5];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]);
    if len > MAX_BODY {
        return Err(WireError::TooLarge(u64::from(len)));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok(Some((header[0], body)))
}

/// Splits a PUT body into (key JSON, data).
///
/// # Errors
/// [`WireError::Malformed`] when the key length runs past the body.
pub fn split_put(body: &[u8]) -> Result<(&[u8], &[u8]), WireError> {
    if body.len() < 2 {
        return Err(WireError::Malformed(
            "PUT body shorter than its key length".into(),
        ));
    }
    let key_len = usize::from(u16::from_le_bytes([body[0], body[1]]));
    let rest = &body[2..];
    if key_len > rest.len() {
        return Err(WireError::Malformed("PUT key length past the body".into()));
    }
    Ok(rest.split_at(key_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_typed_errors() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Op::Put as u8, &[&[3, 0], b"key", b"data"]).expect("write");
        let (code, body) = read_frame(&mut buf.as_slice())
            .expect("read")
            .expect("frame");
        assert_eq!(Op::try_from(code).expect("op"), Op::Put);
        assert_eq!(
            split_put(&body).expect("split"),
            (&b"key"[..], &b"data"[..])
        );
        assert!(read_frame(&mut [].as_slice()).expect("eof").is_none());
        assert!(matches!(
            read_frame(&mut [1u8, 9].as_slice()),
            Err(WireError::Io(_))
        ));
        let huge = [2u8, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            read_frame(&mut huge.as_slice()),
            Err(WireError::TooLarge(_))
        ));
        assert!(matches!(
            Op::try_from(9),
            Err(WireError::UnknownCode { .. })
        ));
        assert!(split_put(&[200, 0, 1]).is_err());
    }
}
