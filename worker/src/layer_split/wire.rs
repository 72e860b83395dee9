//! Frames between the CP ranks of a LayerSplit group: pure encode/decode, so any byte transport (the
//! in-process mesh of [`super::transport`], or a TCP stream with a length prefix) can carry them.
//!
//! Layout, little-endian: `magic "TLS1" | kind u8 | body`.
//! - `Hello` (kind 1): `rank u32 | owner-map digest u64` — the R-LS-1 init check.
//! - `Layer` (kind 2): `from u32 | step u64 | request u64 | layer u32 | chunk_bytes u32 |
//!   page_count u32 | pages u32×page_count | payload` where `payload` is `page_count × chunk_bytes`
//!   bytes: the layer's chunk of each listed page, in list order (seed 004: only the pages in use).
//! - `Step` (kind 3, leader → the other ranks on the serving path): `step u64 | request u64 |
//!   room u64 | generation u64 | region u32 | page_count u32 | dst pages u32×page_count |
//!   addr_len u16 | data address (UTF-8)` — run this room's prefill step and write the KV of
//!   your owned layers into the decode's pages.
//! - `StepDone` (kind 4, a rank → the leader): `from u32 | step u64 | ok u8 | kv_bytes u64 |
//!   reason_len u16 | reason (UTF-8)` — every write of the rank's part of the step is terminal.
//! - `StepAbort` (kind 5, leader → the other ranks on the engine path): `step u64 | reason_len u16
//!   | reason (UTF-8)` — the leader's room of this step failed (an abort, its deadline, the
//!   leader's engine went away): stop the step; its `StepDone` still follows once the rank's
//!   writes are terminal.

/// Frame magic.
const MAGIC: &[u8; 4] = b"TLS1";
const KIND_HELLO: u8 = 1;
const KIND_LAYER: u8 = 2;
const KIND_STEP: u8 = 3;
const KIND_STEP_DONE: u8 = 4;
const KIND_STEP_ABORT: u8 = 5;
/// Bytes of a `Layer` frame before its page list.
pub const LAYER_HEADER_BYTES: usize = 4 + 1 + 4 + 8 + 8 + 4 + 4 + 4;

/// A malformed frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than its header or declared lengths.
    #[error("frame truncated: {len} bytes, needed {needed}")]
    Truncated {
        /// Bytes received.
        len: usize,
        /// Bytes the header requires.
        needed: usize,
    },
    /// Not a LayerSplit frame.
    #[error("bad frame magic")]
    BadMagic,
    /// Unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A text field that is not UTF-8.
    #[error("text field is not UTF-8")]
    NotUtf8,
    /// Bytes left over after the last field of a fixed-shape frame.
    #[error("{0} bytes after the end of the frame")]
    Trailing(usize),
    /// Payload length differs from `page_count × chunk_bytes`.
    #[error("payload is {found} bytes, header says {expected}")]
    PayloadLength {
        /// From the header.
        expected: usize,
        /// Found.
        found: usize,
    },
}

/// One layer of KV for one step, from its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFrame {
    /// Sending (owner) rank.
    pub from: u32,
    /// Step: sequence number of the request in the group's schedule.
    pub step: u64,
    /// Request id.
    pub request: u64,
    /// Layer.
    pub layer: u32,
    /// Bytes of one page-layer chunk.
    pub chunk_bytes: u32,
    /// Page ids whose chunks the payload carries, in payload order.
    pub pages: Vec<u32>,
    /// `pages.len() × chunk_bytes` bytes.
    pub payload: Vec<u8>,
}

/// The leader's order to run one room's prefill step (the serving path, issue 15): every rank
/// runs the layer loop of `request` and writes its owned layers into the decode's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepFrame {
    /// Step: sequence number of the room in the group's schedule (the `step` of its layer frames).
    pub step: u64,
    /// Request id (seeds the KV content).
    pub request: u64,
    /// Room id at the decode.
    pub room: u64,
    /// Room generation (the decode's receiver refuses writes of another generation).
    pub generation: u64,
    /// Destination region at the decode.
    pub region: u32,
    /// Destination page ids at the decode, index = page of the request.
    pub dst_pages: Vec<u32>,
    /// The decode's data (KV transfer) address, `host:port`.
    pub data_addr: String,
}

/// A rank's report that its part of a step is over: the layer loop ran and every KV write it
/// issued is terminal (completed or failed). Until the leader has one from every rank, the room
/// has writes outstanding and no abort ack is sent for it (DESIGN contract 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepDoneFrame {
    /// Reporting rank.
    pub from: u32,
    /// The step.
    pub step: u64,
    /// Whether every write completed.
    pub ok: bool,
    /// KV bytes this rank wrote into the decode's pages.
    pub kv_bytes: u64,
    /// Why not, when `ok` is false (empty otherwise).
    pub reason: String,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Group setup: the sender's rank and owner-map digest.
    Hello {
        /// Sender.
        rank: u32,
        /// [`super::ownership::OwnerMap::digest`].
        digest: u64,
    },
    /// A layer broadcast.
    Layer(LayerFrame),
    /// The leader's order to run a step.
    Step(StepFrame),
    /// A rank's part of a step is over.
    StepDone(StepDoneFrame),
    /// The leader's room of a step failed: the other ranks stop it (the engine path).
    StepAbort {
        /// The step.
        step: u64,
        /// Why, for the ranks' logs.
        reason: String,
    },
}

fn put_text(out: &mut Vec<u8>, text: &str) {
    // Longer texts are cut at a char boundary below 64 KiB (addresses and reasons are short).
    let mut end = text.len().min(u16::MAX as usize);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..end]);
}

impl Frame {
    /// Encodes the frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        match self {
            Frame::Hello { rank, digest } => {
                out.push(KIND_HELLO);
                out.extend_from_slice(&rank.to_le_bytes());
                out.extend_from_slice(&digest.to_le_bytes());
            }
            Frame::Layer(f) => {
                out.reserve(LAYER_HEADER_BYTES + 4 * f.pages.len() + f.payload.len());
                out.push(KIND_LAYER);
                out.extend_from_slice(&f.from.to_le_bytes());
                out.extend_from_slice(&f.step.to_le_bytes());
                out.extend_from_slice(&f.request.to_le_bytes());
                out.extend_from_slice(&f.layer.to_le_bytes());
                out.extend_from_slice(&f.chunk_bytes.to_le_bytes());
                out.extend_from_slice(&(f.pages.len() as u32).to_le_bytes());
                for p in &f.pages {
                    out.extend_from_slice(&p.to_le_bytes());
                }
                out.extend_from_slice(&f.payload);
            }
            Frame::Step(f) => {
                out.push(KIND_STEP);
                for v in [f.step, f.request, f.room, f.generation] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&f.region.to_le_bytes());
                out.extend_from_slice(&(f.dst_pages.len() as u32).to_le_bytes());
                for p in &f.dst_pages {
                    out.extend_from_slice(&p.to_le_bytes());
                }
                put_text(&mut out, &f.data_addr);
            }
            Frame::StepDone(f) => {
                out.push(KIND_STEP_DONE);
                out.extend_from_slice(&f.from.to_le_bytes());
                out.extend_from_slice(&f.step.to_le_bytes());
                out.push(u8::from(f.ok));
                out.extend_from_slice(&f.kv_bytes.to_le_bytes());
                put_text(&mut out, &f.reason);
            }
            Frame::StepAbort { step, reason } => {
                out.push(KIND_STEP_ABORT);
                out.extend_from_slice(&step.to_le_bytes());
                put_text(&mut out, reason);
            }
        }
        out
    }

    /// Decodes a frame.
    ///
    /// # Errors
    /// [`WireError`] for a short, foreign or inconsistent frame; never panics.
    pub fn decode(buf: &[u8]) -> Result<Frame, WireError> {
        let mut r = Reader { buf, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(WireError::BadMagic);
        }
        match r.take(1)?[0] {
            KIND_HELLO => Ok(Frame::Hello {
                rank: r.u32()?,
                digest: r.u64()?,
            }),
            KIND_LAYER => {
                let from = r.u32()?;
                let step = r.u64()?;
                let request = r.u64()?;
                let layer = r.u32()?;
                let chunk_bytes = r.u32()?;
                let count = r.u32()? as usize;
                let mut pages = Vec::with_capacity(count.min(buf.len() / 4));
                for _ in 0..count {
                    pages.push(r.u32()?);
                }
                let payload = &buf[r.at..];
                let expected = count.saturating_mul(chunk_bytes as usize);
                if payload.len() != expected {
                    return Err(WireError::PayloadLength {
                        expected,
                        found: payload.len(),
                    });
                }
                Ok(Frame::Layer(LayerFrame {
                    from,
                    step,
                    request,
                    layer,
                    chunk_bytes,
                    pages,
                    payload: payload.to_vec(),
                }))
            }
            KIND_STEP => {
                let (step, request, room, generation) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
                let region = r.u32()?;
                let count = r.u32()? as usize;
                let mut dst_pages = Vec::with_capacity(count.min(buf.len() / 4));
                for _ in 0..count {
                    dst_pages.push(r.u32()?);
                }
                let data_addr = r.text()?;
                r.end()?;
                Ok(Frame::Step(StepFrame {
                    step,
                    request,
                    room,
                    generation,
                    region,
                    dst_pages,
                    data_addr,
                }))
            }
            KIND_STEP_DONE => {
                let from = r.u32()?;
                let step = r.u64()?;
                let ok = r.take(1)?[0] != 0;
                let kv_bytes = r.u64()?;
                let reason = r.text()?;
                r.end()?;
                Ok(Frame::StepDone(StepDoneFrame {
                    from,
                    step,
                    ok,
                    kv_bytes,
                    reason,
                }))
            }
            KIND_STEP_ABORT => {
                let step = r.u64()?;
                let reason = r.text()?;
                r.end()?;
                Ok(Frame::StepAbort { step, reason })
            }
            k => Err(WireError::UnknownKind(k)),
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.at.saturating_add(n);
        let s = self.buf.get(self.at..end).ok_or(WireError::Truncated {
            len: self.buf.len(),
            needed: end,
        })?;
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn text(&mut self) -> Result<String, WireError> {
        let mut b = [0u8; 2];
        b.copy_from_slice(self.take(2)?);
        let n = u16::from_le_bytes(b) as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| WireError::NotUtf8)
    }
    fn end(&self) -> Result<(), WireError> {
        match self.buf.len() - self.at {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_malformed_frames_are_errors() {
        let f = Frame::Layer(LayerFrame {
            from: 1,
            step: 7,
            request: 42,
            layer: 3,
            chunk_bytes: 4,
            pages: vec![5, 9],
            payload: vec![1, 2, 3, 4, 5, 6, 7, 8],
        });
        let bytes = f.encode();
        assert_eq!(bytes.len(), LAYER_HEADER_BYTES + 8 + 8);
        assert_eq!(Frame::decode(&bytes), Ok(f));
        let h = Frame::Hello { rank: 2, digest: 9 };
        assert_eq!(Frame::decode(&h.encode()), Ok(h));
        for cut in 0..bytes.len() {
            assert!(Frame::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(Frame::decode(&bad), Err(WireError::BadMagic));
        let mut bad = bytes;
        bad[4] = 9;
        assert_eq!(Frame::decode(&bad), Err(WireError::UnknownKind(9)));
    }

    #[test]
    fn step_frames_round_trip_and_malformed_ones_are_errors() {
        let step = Frame::Step(StepFrame {
            step: 3,
            request: 77,
            room: 12,
            generation: 2,
            region: 1,
            dst_pages: vec![4, 5, 6],
            data_addr: "127.0.3.2:7001".into(),
        });
        let done = Frame::StepDone(StepDoneFrame {
            from: 1,
            step: 3,
            ok: false,
            kv_bytes: 4096,
            reason: "write to 127.0.3.2:7001 timed out".into(),
        });
        let abort = Frame::StepAbort {
            step: 3,
            reason: "the decode aborted the room".into(),
        };
        for f in [step, done, abort] {
            let bytes = f.encode();
            assert_eq!(Frame::decode(&bytes), Ok(f.clone()));
            for cut in 0..bytes.len() {
                assert!(Frame::decode(&bytes[..cut]).is_err(), "{f:?} cut at {cut}");
            }
            let mut long = bytes.clone();
            long.push(0);
            assert_eq!(Frame::decode(&long), Err(WireError::Trailing(1)));
        }
        let mut bad = Frame::StepDone(StepDoneFrame {
            from: 0,
            step: 0,
            ok: true,
            kv_bytes: 0,
            reason: "ab".into(),
        })
        .encode();
        let n = bad.len();
        bad[n - 1] = 0xff;
        assert_eq!(Frame::decode(&bad), Err(WireError::NotUtf8));
    }
}
