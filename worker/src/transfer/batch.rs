//! Bounded write batches (dataplane.md R-XFER-2; SGLang PR #32758: one oversized batch killed the
//! session). A batch holds at most `max_ops` writes and `max_bytes` bytes; longer transfers are split
//! into ordered sub-batches that the caller submits in order, stopping at the first failure.

use super::{TransferError, WriteOp};

/// Limits on one submitted batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Writes per batch (default 1024, SGLang's `MAX_TRANSFER_BATCH_INDICES`).
    pub max_ops: usize,
    /// Bytes per batch (default 1 GiB).
    pub max_bytes: u64,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_ops: 1024,
            max_bytes: 1 << 30,
        }
    }
}

/// A non-empty batch within its limits.
#[derive(Clone, Debug)]
pub struct WriteBatch {
    ops: Vec<WriteOp>,
}

impl WriteBatch {
    /// One batch, refused if it exceeds `limits` or is empty (an empty batch is `BatchTooLarge` with
    /// zero writes: nothing to submit is a caller bug, not a transfer).
    pub fn new(ops: Vec<WriteOp>, limits: BatchLimits) -> Result<WriteBatch, TransferError> {
        let bytes: u64 = ops.iter().map(|o| o.data.len() as u64).sum();
        if ops.is_empty() || ops.len() > limits.max_ops || bytes > limits.max_bytes {
            return Err(TransferError::BatchTooLarge {
                ops: ops.len(),
                bytes,
                max_ops: limits.max_ops,
                max_bytes: limits.max_bytes,
            });
        }
        Ok(WriteBatch { ops })
    }

    /// Splits `ops` into ordered batches within `limits`. A single write larger than `max_bytes`
    /// is refused.
    pub fn split(ops: Vec<WriteOp>, limits: BatchLimits) -> Result<Vec<WriteBatch>, TransferError> {
        let mut out = Vec::new();
        let mut cur: Vec<WriteOp> = Vec::new();
        let mut cur_bytes = 0u64;
        for op in ops {
            let len = op.data.len() as u64;
            if len > limits.max_bytes {
                return Err(TransferError::BatchTooLarge {
                    ops: 1,
                    bytes: len,
                    max_ops: limits.max_ops,
                    max_bytes: limits.max_bytes,
                });
            }
            if !cur.is_empty()
                && (cur.len() == limits.max_ops || cur_bytes + len > limits.max_bytes)
            {
                out.push(WriteBatch {
                    ops: std::mem::take(&mut cur),
                });
                cur_bytes = 0;
            }
            cur_bytes += len;
            cur.push(op);
        }
        if !cur.is_empty() {
            out.push(WriteBatch { ops: cur });
        }
        Ok(out)
    }

    /// The writes, in order.
    pub fn ops(&self) -> &[WriteOp] {
        &self.ops
    }

    /// Takes the writes.
    pub fn into_ops(self) -> Vec<WriteOp> {
        self.ops
    }

    /// Number of writes.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Always false (batches are non-empty).
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Total payload bytes.
    pub fn bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.data.len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::RoomKey;
    use crate::transfer::RegionId;
    use bytes::Bytes;

    fn op(i: u64, len: usize) -> WriteOp {
        WriteOp {
            key: RoomKey::new(1, 1),
            region: RegionId(0),
            offset: i,
            data: Bytes::from(vec![0u8; len]),
        }
    }

    #[test]
    fn split_keeps_order_and_limits() {
        let limits = BatchLimits {
            max_ops: 3,
            max_bytes: 100,
        };
        let batches = WriteBatch::split((0..7).map(|i| op(i, 10)).collect(), limits).unwrap();
        let sizes: Vec<_> = batches.iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![3, 3, 1]);
        let offsets: Vec<_> = batches
            .iter()
            .flat_map(|b| b.ops().iter().map(|o| o.offset))
            .collect();
        assert_eq!(offsets, (0..7).collect::<Vec<_>>());
        let by_bytes = WriteBatch::split((0..4).map(|i| op(i, 40)).collect(), limits).unwrap();
        assert_eq!(
            by_bytes.iter().map(|b| b.len()).collect::<Vec<_>>(),
            vec![2, 2]
        );
        assert!(WriteBatch::split(vec![op(0, 101)], limits).is_err());
        assert!(WriteBatch::new((0..4).map(|i| op(i, 1)).collect(), limits).is_err());
        assert!(WriteBatch::new(vec![], limits).is_err());
    }
}
