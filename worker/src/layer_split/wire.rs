//! Frames between the CP ranks of a LayerSplit group: pure encode/decode, so any byte transport (the
//! in-process mesh of [`super::transport`], or a TCP stream with a length prefix) can carry them.
//!
//! Layout, little-endian: `magic "TLS1" | kind u8 | body`.
//! - `Hello` (kind 1): `rank u32 | owner-map digest u64` — the R-LS-1 init check.
//! - `Layer` (kind 2): `from u32 | step u64 | request u64 | layer u32 | chunk_bytes u32 |
//!   page_count u32 | pages u32×page_count | payload` where `payload` is `page_count × chunk_bytes`
//!   bytes: the layer's chunk of each listed page, in list order (seed 004: only the pages in use).

/// Frame magic.
const MAGIC: &[u8; 4] = b"TLS1";
const KIND_HELLO: u8 = 1;
const KIND_LAYER: u8 = 2;
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
}
