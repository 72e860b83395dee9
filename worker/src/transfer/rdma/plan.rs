//! Turning a [`WriteBatch`]'s writes into RDMA WRITE work requests (pure; always compiled, so the
//! default CI tests it).
//!
//! Inputs: the peer's registrations ([`RemoteRegionTable`], from its [`RdmaEndpoint`]) and this
//! worker's ([`LocalMrTable`]: address ranges → lkey). Output: a [`WritePlan`] — posts of at most
//! [`PostLimits::max_wrs_per_post`] work requests, only the last of each post signaled (selective
//! signaling: one completion per post, and the send-queue slots of a post are reclaimed together).
//!
//! Every write is checked **before anything is posted**, and a plan is all or nothing:
//! - the destination must lie inside the peer's registered region (an out-of-range RDMA WRITE fails
//!   with `IBV_WC_REM_ACCESS_ERR` and moves the queue pair to ERROR, which fails every room sharing
//!   it — so it is refused here as [`PlanError::OutOfBounds`], Mooncake#2017);
//! - the source bytes must lie inside memory registered on this worker ([`PlanError::NotRegistered`];
//!   the device would fail it with `IBV_WC_LOC_PROT_ERR`, with the same collateral damage).
//!
//! A write that crosses a registration boundary (local or remote) or exceeds
//! [`PostLimits::max_bytes_per_wr`] becomes several work requests, in order.
//!
//! [`WriteBatch`]: crate::transfer::WriteBatch
//! [`RdmaEndpoint`]: super::endpoint::RdmaEndpoint

use std::collections::HashMap;

use bytes::Bytes;

use super::endpoint::RemoteMr;
use crate::transfer::{RegionId, WriteOp};

/// Why a batch cannot be posted. Nothing of the batch was posted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The destination region is not registered by the peer.
    #[error("write {op}: region {} is not registered by the peer", region.0)]
    UnknownRegion {
        /// Index of the write in its batch.
        op: usize,
        /// The region.
        region: RegionId,
    },
    /// `offset + len` exceeds the peer's registered region.
    #[error("write {op}: {len} B at offset {offset} exceeds region {} of {region_len} B", region.0)]
    OutOfBounds {
        /// Index of the write in its batch.
        op: usize,
        /// The region.
        region: RegionId,
        /// Destination offset (bytes).
        offset: u64,
        /// Length (bytes).
        len: u64,
        /// Registered length of the region (bytes).
        region_len: u64,
    },
    /// The source bytes are not (entirely) inside memory registered on this worker.
    #[error("write {op}: source {len} B at {addr:#x} is not inside a registered memory region")]
    NotRegistered {
        /// Index of the write in its batch.
        op: usize,
        /// Source address.
        addr: u64,
        /// Source length (bytes).
        len: u64,
    },
}

impl PlanError {
    /// Index (in its batch) of the write refused.
    pub fn op(&self) -> usize {
        match self {
            PlanError::UnknownRegion { op, .. }
            | PlanError::OutOfBounds { op, .. }
            | PlanError::NotRegistered { op, .. } => *op,
        }
    }
}

/// A malformed registration table (refused when the peer connects or memory is registered).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// A region's registrations do not tile `[0, len)` without gaps or overlaps.
    #[error("region {region}: registrations leave a gap or overlap at offset {at}")]
    RegionGap {
        /// The region.
        region: u32,
        /// The first offset not covered exactly once.
        at: u64,
    },
    /// Two local registrations overlap, or one is empty or overflows.
    #[error("local registration at {addr:#x}: empty, overflowing or overlapping another")]
    LocalOverlap {
        /// Its address.
        addr: u64,
    },
    /// Post limits of zero, or a work request size below 4 KiB or above 2 GiB (the RDMA maximum).
    #[error("invalid post limits: {0}")]
    Limits(&'static str),
}

/// A peer's registered regions: region offset → (remote address, rkey).
#[derive(Clone, Debug, Default)]
pub struct RemoteRegionTable {
    regions: HashMap<RegionId, RemoteRegion>,
}

#[derive(Clone, Debug)]
struct RemoteRegion {
    /// Sorted by `region_offset`, tiling `[0, len)`.
    mrs: Vec<RemoteMr>,
    len: u64,
}

impl RemoteRegionTable {
    /// Builds the table from a peer's advertised registrations.
    ///
    /// # Errors
    /// [`TableError::RegionGap`] when a region's registrations do not tile `[0, len)` exactly.
    pub fn new(mrs: &[RemoteMr]) -> Result<RemoteRegionTable, TableError> {
        let mut by_region: HashMap<RegionId, Vec<RemoteMr>> = HashMap::new();
        for mr in mrs {
            by_region.entry(mr.region).or_default().push(*mr);
        }
        let mut regions = HashMap::new();
        for (id, mut mrs) in by_region {
            mrs.sort_by_key(|m| m.region_offset);
            let mut end = 0u64;
            for m in &mrs {
                if m.region_offset != end || m.len == 0 || m.addr.checked_add(m.len).is_none() {
                    return Err(TableError::RegionGap {
                        region: id.0,
                        at: end,
                    });
                }
                end = m
                    .region_offset
                    .checked_add(m.len)
                    .ok_or(TableError::RegionGap {
                        region: id.0,
                        at: end,
                    })?;
            }
            regions.insert(id, RemoteRegion { mrs, len: end });
        }
        Ok(RemoteRegionTable { regions })
    }

    /// Registered length of `region`, if the peer registered it.
    pub fn region_len(&self, region: RegionId) -> Option<u64> {
        self.regions.get(&region).map(|r| r.len)
    }
}

impl RemoteRegion {
    /// The registration holding region offset `offset` (which must be `< len`).
    fn at(&self, offset: u64) -> &RemoteMr {
        let i = self.mrs.partition_point(|m| m.region_offset <= offset);
        &self.mrs[i.saturating_sub(1)]
    }
}

/// One registration on this worker: bytes `[addr, addr + len)` usable as a source under `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalMr {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
}

/// This worker's registrations, sorted by address, non-overlapping.
#[derive(Clone, Debug, Default)]
pub struct LocalMrTable {
    mrs: Vec<LocalMr>,
}

impl LocalMrTable {
    /// An empty table.
    pub fn new() -> LocalMrTable {
        LocalMrTable::default()
    }

    /// Adds a registration.
    ///
    /// # Errors
    /// [`TableError::LocalOverlap`] if it is empty, overflows or overlaps one already present.
    pub fn insert(&mut self, mr: LocalMr) -> Result<(), TableError> {
        let bad = TableError::LocalOverlap { addr: mr.addr };
        let end = mr.addr.checked_add(mr.len).ok_or(bad.clone())?;
        if mr.len == 0 {
            return Err(bad);
        }
        let i = self.mrs.partition_point(|m| m.addr < mr.addr);
        let overlaps_prev = i > 0 && self.mrs[i - 1].addr + self.mrs[i - 1].len > mr.addr;
        let overlaps_next = self.mrs.get(i).is_some_and(|n| n.addr < end);
        if overlaps_prev || overlaps_next {
            return Err(bad);
        }
        self.mrs.insert(i, mr);
        Ok(())
    }

    /// Removes the registration starting at `addr`; returns it.
    pub fn remove(&mut self, addr: u64) -> Option<LocalMr> {
        let i = self.mrs.iter().position(|m| m.addr == addr)?;
        Some(self.mrs.remove(i))
    }

    /// The registration containing byte `addr`.
    pub fn containing(&self, addr: u64) -> Option<&LocalMr> {
        let i = self.mrs.partition_point(|m| m.addr <= addr);
        let m = self.mrs.get(i.checked_sub(1)?)?;
        (addr < m.addr + m.len).then_some(m)
    }
}

/// How work requests are grouped into posts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostLimits {
    /// Work requests per `ibv_post_send` call (≤ the queue pair's `max_send_wr`).
    pub max_wrs_per_post: usize,
    /// Bytes per work request (≤ the port's `max_msg_sz`; 4 KiB ..= 2 GiB).
    pub max_bytes_per_wr: u64,
}

impl PostLimits {
    /// Posts of half the send queue (so the next post can be queued on the device while one
    /// completes), work requests of at most `max_msg_bytes` (capped to 2 GiB, the RDMA maximum).
    ///
    /// # Errors
    /// [`TableError::Limits`] for a zero send queue or a message size under 4 KiB.
    pub fn for_qp(max_send_wr: u32, max_msg_bytes: u64) -> Result<PostLimits, TableError> {
        PostLimits::new(
            (max_send_wr as usize / 2).max(1),
            max_msg_bytes.min(1 << 31),
        )
    }

    /// Explicit limits.
    ///
    /// # Errors
    /// [`TableError::Limits`] for zero work requests per post or a work request size outside
    /// 4 KiB ..= 2 GiB.
    pub fn new(max_wrs_per_post: usize, max_bytes_per_wr: u64) -> Result<PostLimits, TableError> {
        if max_wrs_per_post == 0 {
            return Err(TableError::Limits("zero work requests per post"));
        }
        if !(4096..=1 << 31).contains(&max_bytes_per_wr) {
            return Err(TableError::Limits(
                "work request size outside 4 KiB ..= 2 GiB",
            ));
        }
        Ok(PostLimits {
            max_wrs_per_post,
            max_bytes_per_wr,
        })
    }
}

/// One RDMA WRITE work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedWr {
    /// Index of the write (in its batch) this request is part of.
    pub op_index: usize,
    /// The source bytes: a view of the write's data, kept alive until the request is retired.
    pub source: Bytes,
    /// Local key of the registration holding `source`.
    pub lkey: u32,
    /// Destination virtual address on the peer.
    pub remote_addr: u64,
    /// Remote key of the destination registration.
    pub rkey: u32,
    /// Ask for a completion (`IBV_SEND_SIGNALED`): the last request of each post.
    pub signaled: bool,
    /// The last request of its write: the write is accounted when this one is retired.
    pub last_of_op: bool,
}

impl PlannedWr {
    /// Source address.
    pub fn local_addr(&self) -> u64 {
        self.source.as_ptr() as u64
    }

    /// Length in bytes (≤ [`PostLimits::max_bytes_per_wr`] ≤ 2 GiB, so it fits `u32`).
    pub fn len(&self) -> u32 {
        self.source.len() as u32
    }

    /// True for a zero-length request (never planned).
    pub fn is_empty(&self) -> bool {
        self.source.is_empty()
    }
}

/// One `ibv_post_send` call: a linked list of work requests, the last one signaled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Post {
    /// The requests, in order.
    pub wrs: Vec<PlannedWr>,
}

/// The plan of one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WritePlan {
    /// Posts, in order.
    pub posts: Vec<Post>,
    /// Writes in the batch.
    pub ops: usize,
    /// Writes of zero bytes: nothing to post, they are complete at once.
    pub empty_ops: Vec<usize>,
}

impl WritePlan {
    /// Work requests over all posts.
    pub fn wr_count(&self) -> usize {
        self.posts.iter().map(|p| p.wrs.len()).sum()
    }
}

/// Plans `ops` (one batch) against the peer's `remote` table and this worker's `local` one.
///
/// # Errors
/// The first invalid write's [`PlanError`]; then nothing of the batch may be posted.
pub fn plan_writes(
    ops: &[WriteOp],
    remote: &RemoteRegionTable,
    local: &LocalMrTable,
    limits: PostLimits,
) -> Result<WritePlan, PlanError> {
    let mut wrs: Vec<PlannedWr> = Vec::new();
    let mut empty_ops = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let len = op.data.len() as u64;
        let region = remote
            .regions
            .get(&op.region)
            .ok_or(PlanError::UnknownRegion {
                op: i,
                region: op.region,
            })?;
        let out_of_bounds = PlanError::OutOfBounds {
            op: i,
            region: op.region,
            offset: op.offset,
            len,
            region_len: region.len,
        };
        match op.offset.checked_add(len) {
            Some(end) if end <= region.len => {}
            _ => return Err(out_of_bounds),
        }
        if len == 0 {
            empty_ops.push(i);
            continue;
        }
        let src = op.data.as_ptr() as u64;
        let not_registered = PlanError::NotRegistered {
            op: i,
            addr: src,
            len,
        };
        if src.checked_add(len).is_none() {
            return Err(not_registered);
        }
        let mut pos = 0u64;
        while pos < len {
            let lmr = local
                .containing(src + pos)
                .ok_or_else(|| not_registered.clone())?;
            let rmr = region.at(op.offset + pos);
            let local_room = lmr.addr + lmr.len - (src + pos);
            let remote_room = rmr.region_offset + rmr.len - (op.offset + pos);
            let n = (len - pos)
                .min(local_room)
                .min(remote_room)
                .min(limits.max_bytes_per_wr);
            wrs.push(PlannedWr {
                op_index: i,
                source: op.data.slice(pos as usize..(pos + n) as usize),
                lkey: lmr.lkey,
                remote_addr: rmr.addr + (op.offset + pos - rmr.region_offset),
                rkey: rmr.rkey,
                signaled: false,
                last_of_op: pos + n == len,
            });
            pos += n;
        }
    }
    let mut posts = Vec::new();
    let mut rest = wrs.into_iter().peekable();
    while rest.peek().is_some() {
        let mut post: Vec<PlannedWr> = rest.by_ref().take(limits.max_wrs_per_post).collect();
        if let Some(last) = post.last_mut() {
            last.signaled = true;
        }
        posts.push(Post { wrs: post });
    }
    Ok(WritePlan {
        posts,
        ops: ops.len(),
        empty_ops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::RoomKey;

    const KIB: u64 = 1024;

    fn remote() -> RemoteRegionTable {
        // Region 0: 64 KiB in two registrations at unrelated addresses.
        RemoteRegionTable::new(&[
            RemoteMr {
                region: RegionId(0),
                region_offset: 32 * KIB,
                addr: 0x9000_0000,
                rkey: 2,
                len: 32 * KIB,
            },
            RemoteMr {
                region: RegionId(0),
                region_offset: 0,
                addr: 0x7000_0000,
                rkey: 1,
                len: 32 * KIB,
            },
        ])
        .unwrap()
    }

    /// A source arena and a table registering it as two MRs split at `split`.
    fn arena(len: usize, split: u64) -> (Bytes, LocalMrTable) {
        let data = Bytes::from((0..len).map(|i| i as u8).collect::<Vec<u8>>());
        let base = data.as_ptr() as u64;
        let mut t = LocalMrTable::new();
        t.insert(LocalMr {
            addr: base,
            len: split,
            lkey: 100,
        })
        .unwrap();
        t.insert(LocalMr {
            addr: base + split,
            len: len as u64 - split,
            lkey: 200,
        })
        .unwrap();
        (data, t)
    }

    fn op(data: Bytes, offset: u64) -> WriteOp {
        WriteOp {
            key: RoomKey::new(1, 1),
            region: RegionId(0),
            offset,
            data,
        }
    }

    fn limits(per_post: usize) -> PostLimits {
        PostLimits::new(per_post, 16 * KIB).unwrap()
    }

    #[test]
    fn writes_split_at_registration_and_size_boundaries() {
        let (data, local) = arena(64 * KIB as usize, 8 * KIB);
        let base = data.as_ptr() as u64;
        // 40 KiB from source offset 0 to region offset 24 KiB: pieces end at the local MR split
        // (8 KiB), the remote MR split (region 32 KiB) and the 16 KiB request cap.
        let plan = plan_writes(
            &[op(data.slice(0..40 * KIB as usize), 24 * KIB)],
            &remote(),
            &local,
            limits(16),
        )
        .unwrap();
        let wrs = &plan.posts[0].wrs;
        let shape: Vec<_> = wrs
            .iter()
            .map(|w| {
                (
                    w.local_addr() - base,
                    w.len() as u64,
                    w.lkey,
                    w.remote_addr,
                    w.rkey,
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                (0, 8 * KIB, 100, 0x7000_0000 + 24 * KIB, 1),
                (8 * KIB, 16 * KIB, 200, 0x9000_0000, 2),
                (24 * KIB, 16 * KIB, 200, 0x9000_0000 + 16 * KIB, 2),
            ]
        );
        assert_eq!(
            wrs.iter().map(|w| w.last_of_op).collect::<Vec<_>>(),
            vec![false, false, true]
        );
        // The pieces carry exactly the source bytes, in order.
        let joined: Vec<u8> = wrs.iter().flat_map(|w| w.source.to_vec()).collect();
        assert_eq!(joined, data[..40 * KIB as usize].to_vec());
    }

    #[test]
    fn posts_are_bounded_and_only_their_last_request_is_signaled() {
        let (data, local) = arena(64 * KIB as usize, 32 * KIB);
        let ops: Vec<_> = (0..7)
            .map(|i| op(data.slice(i * 4096..(i + 1) * 4096), (i * 4096) as u64))
            .collect();
        let plan = plan_writes(&ops, &remote(), &local, limits(3)).unwrap();
        let sizes: Vec<_> = plan.posts.iter().map(|p| p.wrs.len()).collect();
        assert_eq!(sizes, vec![3, 3, 1]);
        for post in &plan.posts {
            let signaled: Vec<_> = post.wrs.iter().map(|w| w.signaled).collect();
            let mut expect = vec![false; post.wrs.len()];
            *expect.last_mut().unwrap() = true;
            assert_eq!(signaled, expect);
        }
        assert_eq!(plan.wr_count(), 7);
    }

    #[test]
    fn out_of_bounds_and_unregistered_sources_are_refused_whole() {
        let (data, local) = arena(64 * KIB as usize, 32 * KIB);
        let good = op(data.slice(0..4096), 0);
        // One byte past the 64 KiB region.
        let past = op(data.slice(0..4096), 60 * KIB + 1);
        assert_eq!(
            plan_writes(&[good.clone(), past], &remote(), &local, limits(4)),
            Err(PlanError::OutOfBounds {
                op: 1,
                region: RegionId(0),
                offset: 60 * KIB + 1,
                len: 4096,
                region_len: 64 * KIB,
            })
        );
        let wrap = op(data.slice(0..1), u64::MAX);
        assert!(matches!(
            plan_writes(&[wrap], &remote(), &local, limits(4)),
            Err(PlanError::OutOfBounds { .. })
        ));
        let heap = op(Bytes::from(vec![1u8; 4096]), 0);
        assert!(matches!(
            plan_writes(&[good.clone(), heap], &remote(), &local, limits(4)),
            Err(PlanError::NotRegistered { op: 1, .. })
        ));
        let mut other = good;
        other.region = RegionId(9);
        assert_eq!(
            plan_writes(&[other], &remote(), &local, limits(4)),
            Err(PlanError::UnknownRegion {
                op: 0,
                region: RegionId(9)
            })
        );
        // A source running past the end of its registration is not registered either.
        let mut t = LocalMrTable::new();
        t.insert(LocalMr {
            addr: data.as_ptr() as u64,
            len: 100,
            lkey: 1,
        })
        .unwrap();
        assert!(matches!(
            plan_writes(&[op(data.slice(0..101), 0)], &remote(), &t, limits(4)),
            Err(PlanError::NotRegistered { .. })
        ));
    }

    #[test]
    fn empty_writes_post_nothing_and_tables_refuse_gaps_and_overlaps() {
        let (data, local) = arena(8192, 4096);
        let plan = plan_writes(&[op(data.slice(0..0), 0)], &remote(), &local, limits(4)).unwrap();
        assert!(plan.posts.is_empty());
        assert_eq!(plan.empty_ops, vec![0]);
        let gap = RemoteRegionTable::new(&[RemoteMr {
            region: RegionId(3),
            region_offset: 4096,
            addr: 1,
            rkey: 1,
            len: 10,
        }]);
        assert_eq!(gap.err(), Some(TableError::RegionGap { region: 3, at: 0 }));
        let mut t = LocalMrTable::new();
        t.insert(LocalMr {
            addr: 1000,
            len: 100,
            lkey: 1,
        })
        .unwrap();
        for (addr, len) in [(1099, 10), (900, 101), (1000, 0)] {
            assert!(t.insert(LocalMr { addr, len, lkey: 2 }).is_err(), "{addr}");
        }
        assert_eq!(t.containing(1099).map(|m| m.lkey), Some(1));
        assert!(t.containing(1100).is_none());
        assert!(PostLimits::for_qp(0, 1 << 30).is_ok_and(|l| l.max_wrs_per_post == 1));
        assert!(PostLimits::new(1, 100).is_err());
    }
}
