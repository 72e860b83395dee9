//! Send-queue and completion accounting of one RC queue pair (pure; always compiled).
//!
//! [`QpLedger`] owns the work requests of one queue pair from planning to retirement:
//! - **queued** posts wait for send-queue credit (at most `max_send_wr` requests outstanding, so
//!   `ibv_post_send` never fails for a full queue and the CQ — one per QP, sized to the send queue —
//!   cannot overflow);
//! - **outstanding** requests were handed to the device, in posting order; `wr_id` is that order.
//!
//! Completion rules (RC, InfiniBand spec ch. 10/11; rdmamojo `ibv_poll_cq`):
//! - a successful completion of request `w` retires every earlier request of the QP: they were
//!   executed in order (selective signaling: only the last request of a post asks for one);
//! - an error completion moves the QP to ERROR. Requests before `w` had completed; `w` failed;
//!   every later one is **flushed** and completes with an error (signaled or not). Until its
//!   completion arrives a later request is unaccounted — it may have been on the wire already;
//! - destroying the QP ([`QpLedger::destroyed`]) accounts everything left: after `ibv_destroy_qp`
//!   nothing of it can land (R-XFER-4).
//!
//! A write (one [`WriteOp`]) is accounted when all of its requests are, and its handle is terminal
//! when all of its writes are (the transports' handle table). So a handle never turns `Failed` on
//! the first error while requests of it are still outstanding — declaring it early is seed 004's race:
//! decode frees the pages, and the request still on the wire writes into the next room's KV.
//! `TrackerMode::EagerFailure` is that bug, kept as the negative control (feature
//! `negative-controls`).
//!
//! Cancel drops the handle's queued posts (never handed to the device); posted requests cannot be
//! recalled, so the handle reads `Cancelling` until their completions arrive.
//!
//! [`WriteOp`]: crate::transfer::WriteOp

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::plan::{PlannedWr, WritePlan};
use crate::transfer::TransferHandle;
use crate::transfer::handles::OpOutcome;

/// How one write (all of its work requests) ended. Every variant is final: nothing more of the
/// write can land.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Every request of it completed successfully.
    Landed,
    /// Some request never reached the device (cancelled, or the QP had failed); the others are
    /// accounted.
    NotPosted,
    /// The peer or the local device refused a request (address, rkey, length).
    Rejected,
    /// A request failed or was flushed after the QP went to ERROR (peer gone, ACK lost).
    Lost,
}

impl WriteOutcome {
    /// Merge order: the worst outcome of a write's requests wins.
    fn severity(self) -> u8 {
        match self {
            WriteOutcome::Landed => 0,
            WriteOutcome::NotPosted => 1,
            WriteOutcome::Rejected => 2,
            WriteOutcome::Lost => 3,
        }
    }
}

impl From<WriteOutcome> for OpOutcome {
    fn from(o: WriteOutcome) -> OpOutcome {
        match o {
            WriteOutcome::Landed => OpOutcome::Applied,
            WriteOutcome::NotPosted => OpOutcome::NotSent,
            WriteOutcome::Rejected => OpOutcome::RejectedInvalid,
            WriteOutcome::Lost => OpOutcome::PeerLost,
        }
    }
}

/// Work-completion status, as far as accounting needs it (from `ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success,
    /// `IBV_WC_WR_FLUSH_ERR`: the QP was in ERROR; the request was not executed after that.
    Flushed,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the address or rkey.
    RemoteAccess,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer refused the request (length, opcode).
    RemoteInvalidRequest,
    /// `IBV_WC_LOC_PROT_ERR`: the source is not in a registered MR.
    LocalProtection,
    /// `IBV_WC_LOC_LEN_ERR`: the request exceeds the port's message size.
    LocalLength,
    /// `IBV_WC_RETRY_EXC_ERR`: no ACK from the peer after every retry (peer gone, or an ACK lost:
    /// the write may have landed).
    RetryExceeded,
    /// Any other status (raw `ibv_wc_status` value).
    Other(u32),
}

impl WcStatus {
    /// How a request that completed with this status is accounted.
    fn outcome(self) -> WriteOutcome {
        match self {
            WcStatus::Success => WriteOutcome::Landed,
            WcStatus::RemoteAccess
            | WcStatus::RemoteInvalidRequest
            | WcStatus::LocalProtection
            | WcStatus::LocalLength => WriteOutcome::Rejected,
            WcStatus::Flushed | WcStatus::RetryExceeded | WcStatus::Other(_) => WriteOutcome::Lost,
        }
    }
}

/// When a handle may be declared failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackerMode {
    /// Only when every request of it is accounted (the contract).
    Safe,
    /// NEGATIVE CONTROL ONLY: on the first error completion, every write of that handle still in
    /// flight is declared failed at once — while its requests may still land. Feature
    /// `negative-controls`.
    #[cfg(feature = "negative-controls")]
    EagerFailure,
}

/// State of the queue pair as the ledger sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Posting.
    Ready,
    /// An error completion (or a failed post) moved it to ERROR: nothing more is posted; the
    /// outstanding requests are being flushed.
    Error,
    /// Destroyed: nothing of it can land.
    Destroyed,
}

/// One work request as the verbs layer posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrSpec {
    /// Work request id (the ledger's posting sequence).
    pub wr_id: u64,
    /// Source address.
    pub local_addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Source lkey.
    pub lkey: u32,
    /// Destination address on the peer.
    pub remote_addr: u64,
    /// Destination rkey.
    pub rkey: u32,
    /// `IBV_SEND_SIGNALED`.
    pub signaled: bool,
}

/// A post the ledger released for `ibv_post_send`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyPost {
    /// The handle its requests belong to.
    pub handle: TransferHandle,
    /// The requests, in order (the last one signaled).
    pub wrs: Vec<WrSpec>,
}

/// Writes accounted by one ledger call: feed each to the handle table.
pub type Accounted = Vec<(TransferHandle, WriteOutcome)>;

struct Queued {
    handle: TransferHandle,
    wrs: Vec<PlannedWr>,
}

struct Outstanding {
    wr_id: u64,
    handle: TransferHandle,
    op_index: usize,
    /// Keeps the source bytes alive until the request is retired.
    _source: Bytes,
}

struct OpProgress {
    worst: WriteOutcome,
    wrs_left: usize,
}

/// The send queue of one RC queue pair (see the module docs).
pub struct QpLedger {
    #[cfg_attr(
        not(feature = "negative-controls"),
        allow(dead_code, reason = "read only by the negative control")
    )]
    mode: TrackerMode,
    max_outstanding: usize,
    next_wr_id: u64,
    queued: VecDeque<Queued>,
    outstanding: VecDeque<Outstanding>,
    ops: HashMap<(TransferHandle, usize), OpProgress>,
    state: QpState,
    first_error: Option<WcStatus>,
    unknown_completions: u64,
}

impl QpLedger {
    /// A ledger for a queue pair whose send queue holds `max_send_wr` requests.
    pub fn new(max_send_wr: usize, mode: TrackerMode) -> QpLedger {
        QpLedger {
            mode,
            max_outstanding: max_send_wr.max(1),
            next_wr_id: 1,
            queued: VecDeque::new(),
            outstanding: VecDeque::new(),
            ops: HashMap::new(),
            state: QpState::Ready,
            first_error: None,
            unknown_completions: 0,
        }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// The completion status that moved the QP to ERROR, if any.
    pub fn first_error(&self) -> Option<WcStatus> {
        self.first_error
    }

    /// Requests handed to the device and not yet retired.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Requests of `handle` handed to the device and not yet retired (they may still land).
    pub fn outstanding_of(&self, handle: TransferHandle) -> usize {
        self.outstanding
            .iter()
            .filter(|o| o.handle == handle)
            .count()
    }

    /// Requests waiting for send-queue credit.
    pub fn queued(&self) -> usize {
        self.queued.iter().map(|q| q.wrs.len()).sum()
    }

    /// Completions whose `wr_id` was not outstanding (already retired, or foreign): ignored.
    pub fn unknown_completions(&self) -> u64 {
        self.unknown_completions
    }

    /// Adds the plan of `handle`. Zero-byte writes are accounted at once; on a QP that is no
    /// longer ready, every write is accounted `NotSent`.
    pub fn enqueue(&mut self, handle: TransferHandle, plan: WritePlan) -> Accounted {
        let mut out: Accounted = plan
            .empty_ops
            .iter()
            .map(|_| (handle, WriteOutcome::Landed))
            .collect();
        for post in &plan.posts {
            for wr in &post.wrs {
                self.ops
                    .entry((handle, wr.op_index))
                    .or_insert(OpProgress {
                        worst: WriteOutcome::Landed,
                        wrs_left: 0,
                    })
                    .wrs_left += 1;
            }
        }
        for post in plan.posts {
            if self.state == QpState::Ready {
                self.queued.push_back(Queued {
                    handle,
                    wrs: post.wrs,
                });
            } else {
                for wr in post.wrs {
                    self.retire(handle, wr.op_index, WriteOutcome::NotPosted, &mut out);
                }
            }
        }
        out
    }

    /// The next post that fits the send queue, with its `wr_id`s assigned; it is outstanding from
    /// now on. `None` when nothing is queued, the queue is full, or the QP is not ready.
    pub fn next_post(&mut self) -> Option<ReadyPost> {
        if self.state != QpState::Ready {
            return None;
        }
        let front = self.queued.front()?;
        // A post larger than the whole queue (a planning bug) still goes alone, never deadlocks.
        if !self.outstanding.is_empty()
            && self.outstanding.len() + front.wrs.len() > self.max_outstanding
        {
            return None;
        }
        let q = self.queued.pop_front()?;
        let mut wrs = Vec::with_capacity(q.wrs.len());
        for wr in q.wrs {
            let wr_id = self.next_wr_id;
            self.next_wr_id += 1;
            wrs.push(WrSpec {
                wr_id,
                local_addr: wr.local_addr(),
                len: wr.len(),
                lkey: wr.lkey,
                remote_addr: wr.remote_addr,
                rkey: wr.rkey,
                signaled: wr.signaled,
            });
            self.outstanding.push_back(Outstanding {
                wr_id,
                handle: q.handle,
                op_index: wr.op_index,
                _source: wr.source,
            });
        }
        Some(ReadyPost {
            handle: q.handle,
            wrs,
        })
    }

    /// `ibv_post_send` accepted only the first `posted` requests of the last [`ReadyPost`]
    /// (`bad_wr`). The rest never reached the device (`NotSent`); the QP must be moved to ERROR by
    /// the caller so the posted head is flushed (none of it is signaled); nothing more is posted.
    pub fn post_failed(&mut self, post_len: usize, posted: usize) -> Accounted {
        let mut out = Accounted::new();
        for _ in posted..post_len {
            if let Some(o) = self.outstanding.pop_back() {
                self.retire(o.handle, o.op_index, WriteOutcome::NotPosted, &mut out);
            }
        }
        if self.state == QpState::Ready {
            self.state = QpState::Error;
        }
        self.drop_queued(None, &mut out);
        out
    }

    /// Accounts one work completion (see the module docs for the rules).
    pub fn on_completion(&mut self, wr_id: u64, status: WcStatus) -> Accounted {
        let mut out = Accounted::new();
        let known = self.state != QpState::Destroyed
            && self.outstanding.front().is_some_and(|f| f.wr_id <= wr_id)
            && self.outstanding.back().is_some_and(|b| b.wr_id >= wr_id);
        if !known {
            self.unknown_completions += 1;
            return out;
        }
        // Earlier requests finished before this one: executed while the QP was ready, flushed
        // after it went to ERROR.
        let earlier = if self.state == QpState::Ready {
            WriteOutcome::Landed
        } else {
            WriteOutcome::Lost
        };
        while let Some(o) = self.outstanding.pop_front() {
            if o.wr_id == wr_id {
                self.retire(o.handle, o.op_index, status.outcome(), &mut out);
                if status != WcStatus::Success && self.state == QpState::Ready {
                    self.state = QpState::Error;
                    self.first_error = Some(status);
                    self.drop_queued(None, &mut out);
                    #[cfg(feature = "negative-controls")]
                    if self.mode == TrackerMode::EagerFailure {
                        self.declare_failed_now(o.handle, &mut out);
                    }
                }
                break;
            }
            self.retire(o.handle, o.op_index, earlier, &mut out);
        }
        out
    }

    /// Drops the queued posts of `handle` (`NotSent`); its outstanding requests stay until their
    /// completions arrive.
    pub fn cancel(&mut self, handle: TransferHandle) -> Accounted {
        let mut out = Accounted::new();
        self.drop_queued(Some(handle), &mut out);
        out
    }

    /// The QP was destroyed: outstanding requests are accounted as lost (nothing of them can land
    /// any more), queued ones as `NotSent`.
    pub fn destroyed(&mut self) -> Accounted {
        let mut out = Accounted::new();
        self.state = QpState::Destroyed;
        while let Some(o) = self.outstanding.pop_front() {
            self.retire(o.handle, o.op_index, WriteOutcome::Lost, &mut out);
        }
        self.drop_queued(None, &mut out);
        out
    }

    fn drop_queued(&mut self, only: Option<TransferHandle>, out: &mut Accounted) {
        let (drop, keep): (Vec<Queued>, Vec<Queued>) = self
            .queued
            .drain(..)
            .partition(|q| only.is_none_or(|h| h == q.handle));
        self.queued = keep.into();
        for q in drop {
            for wr in q.wrs {
                self.retire(q.handle, wr.op_index, WriteOutcome::NotPosted, out);
            }
        }
    }

    /// The negative control: every write of `handle` still in progress is reported lost now.
    #[cfg(feature = "negative-controls")]
    fn declare_failed_now(&mut self, handle: TransferHandle, out: &mut Accounted) {
        let mut pending: Vec<usize> = self
            .ops
            .keys()
            .filter(|(h, _)| *h == handle)
            .map(|(_, i)| *i)
            .collect();
        pending.sort_unstable();
        for i in pending {
            self.ops.remove(&(handle, i));
            out.push((handle, WriteOutcome::Lost));
        }
    }

    fn retire(
        &mut self,
        handle: TransferHandle,
        op_index: usize,
        outcome: WriteOutcome,
        out: &mut Accounted,
    ) {
        let key = (handle, op_index);
        let Some(p) = self.ops.get_mut(&key) else {
            return; // already reported (negative control only)
        };
        if outcome.severity() > p.worst.severity() {
            p.worst = outcome;
        }
        p.wrs_left -= 1;
        if p.wrs_left == 0
            && let Some(p) = self.ops.remove(&key)
        {
            out.push((handle, p.worst));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::handles::HandleTable;
    use crate::transfer::rdma::plan::Post;
    use crate::transfer::{FailureKind, TransferStatus};
    use std::collections::HashSet;

    /// A plan of `wrs_per_op.len()` writes, posts of `per_post` requests.
    fn plan(wrs_per_op: &[usize], per_post: usize) -> WritePlan {
        let arena = Bytes::from(vec![7u8; 64]);
        let wrs: Vec<PlannedWr> = wrs_per_op
            .iter()
            .enumerate()
            .flat_map(|(op, &n)| {
                let arena = arena.clone();
                (0..n).map(move |k| PlannedWr {
                    op_index: op,
                    source: arena.slice(k..k + 1),
                    lkey: 1,
                    remote_addr: 0x1000 + k as u64,
                    rkey: 2,
                    signaled: false,
                    last_of_op: k + 1 == n,
                })
            })
            .collect();
        let posts = wrs
            .chunks(per_post)
            .map(|c| {
                let mut wrs = c.to_vec();
                if let Some(l) = wrs.last_mut() {
                    l.signaled = true;
                }
                Post { wrs }
            })
            .collect();
        WritePlan {
            posts,
            ops: wrs_per_op.len(),
            empty_ops: vec![],
        }
    }

    /// Ledger + handle table, the way the transport glues them.
    struct Rig {
        ledger: QpLedger,
        table: HandleTable,
    }

    impl Rig {
        fn new(max_send_wr: usize, mode: TrackerMode) -> Rig {
            Rig {
                ledger: QpLedger::new(max_send_wr, mode),
                table: HandleTable::default(),
            }
        }
        fn submit(&mut self, wrs_per_op: &[usize], per_post: usize) -> TransferHandle {
            let h = self.table.create(wrs_per_op.len(), None);
            let acc = self.ledger.enqueue(h, plan(wrs_per_op, per_post));
            self.apply(acc);
            h
        }
        fn apply(&self, acc: Accounted) {
            for (h, o) in acc {
                self.table.op_done(h, o.into());
            }
        }
        fn complete(&mut self, wr_id: u64, status: WcStatus) {
            let acc = self.ledger.on_completion(wr_id, status);
            self.apply(acc);
        }
        fn status(&self, h: TransferHandle) -> TransferStatus {
            self.table.poll(h).unwrap()
        }
        fn post_all(&mut self) -> Vec<ReadyPost> {
            std::iter::from_fn(|| self.ledger.next_post()).collect()
        }
    }

    #[test]
    fn a_signaled_completion_retires_the_whole_post_and_frees_credit() {
        let mut r = Rig::new(4, TrackerMode::Safe);
        let h = r.submit(&[1, 2, 1, 2], 3); // 6 requests: posts of 3 + 3
        let posts = r.post_all();
        assert_eq!(posts.len(), 1, "the second post waits for credit");
        assert_eq!(
            posts[0].wrs.iter().map(|w| w.signaled).collect::<Vec<_>>(),
            vec![false, false, true]
        );
        r.complete(posts[0].wrs[2].wr_id, WcStatus::Success);
        assert_eq!(r.status(h), TransferStatus::InFlight);
        assert_eq!(r.ledger.outstanding(), 0);
        let next = r.post_all();
        assert_eq!(next.len(), 1);
        r.complete(next[0].wrs[2].wr_id, WcStatus::Success);
        assert_eq!(r.status(h), TransferStatus::Completed);
        // A duplicate or foreign completion is ignored, never double-counted.
        r.complete(next[0].wrs[2].wr_id, WcStatus::Success);
        assert_eq!(r.ledger.unknown_completions(), 1);
    }

    #[test]
    fn an_error_fails_the_handle_only_after_every_request_is_flushed() {
        let mut r = Rig::new(8, TrackerMode::Safe);
        let h = r.submit(&[1, 1, 1, 1], 2);
        let other = r.submit(&[1], 1);
        let queued_behind = r.submit(&[1, 1], 2);
        let posts = r.post_all();
        let ids: Vec<u64> = posts
            .iter()
            .flat_map(|p| p.wrs.iter().map(|w| w.wr_id))
            .collect();
        assert_eq!(ids.len(), 7);
        // The first request is retried out: the QP goes to ERROR.
        r.complete(ids[0], WcStatus::RetryExceeded);
        assert_eq!(r.ledger.state(), QpState::Error);
        assert_eq!(
            r.status(h),
            TransferStatus::InFlight,
            "3 requests may still land"
        );
        assert_eq!(r.ledger.outstanding_of(h), 3);
        for &id in &ids[1..4] {
            r.complete(id, WcStatus::Flushed);
        }
        assert_eq!(r.status(h), TransferStatus::Failed(FailureKind::PeerLost));
        assert_eq!(r.status(other), TransferStatus::InFlight);
        // Unsignaled flushes may not be reported: a later one retires the earlier ones.
        r.complete(ids[6], WcStatus::Flushed);
        assert!(r.status(other).is_terminal());
        assert!(r.status(queued_behind).is_terminal());
        assert_eq!(r.ledger.outstanding(), 0);
    }

    #[test]
    fn remote_access_errors_read_as_rejected_writes() {
        let mut r = Rig::new(8, TrackerMode::Safe);
        let h = r.submit(&[1, 1], 2);
        let p = r.post_all();
        r.complete(p[0].wrs[0].wr_id, WcStatus::RemoteAccess);
        r.complete(p[0].wrs[1].wr_id, WcStatus::Flushed);
        assert_eq!(
            r.status(h),
            TransferStatus::Failed(FailureKind::PeerLost),
            "a flushed write outranks the rejected one: both are accounted, none can land"
        );
        let mut r = Rig::new(8, TrackerMode::Safe);
        let h = r.submit(&[1], 1);
        let p = r.post_all();
        r.complete(p[0].wrs[0].wr_id, WcStatus::RemoteAccess);
        assert_eq!(
            r.status(h),
            TransferStatus::Failed(FailureKind::Rejected {
                stale: 0,
                invalid: 1
            })
        );
    }

    #[test]
    fn cancel_drops_queued_posts_and_waits_for_posted_ones() {
        let mut r = Rig::new(2, TrackerMode::Safe);
        let h = r.submit(&[1, 1, 1, 1], 2);
        let posted = r.post_all();
        assert_eq!(posted.len(), 1);
        assert_eq!(r.table.cancel(h).unwrap(), TransferStatus::Cancelling);
        let acc = r.ledger.cancel(h);
        r.apply(acc);
        assert_eq!(r.ledger.queued(), 0);
        assert_eq!(
            r.status(h),
            TransferStatus::Cancelling,
            "2 requests are on the device"
        );
        r.complete(posted[0].wrs[1].wr_id, WcStatus::Success);
        assert_eq!(r.status(h), TransferStatus::Cancelled);
    }

    #[test]
    fn a_partial_post_fails_the_tail_and_stops_posting() {
        let mut r = Rig::new(8, TrackerMode::Safe);
        let h = r.submit(&[1, 1, 1], 3);
        let later = r.submit(&[1], 1);
        let post = r.ledger.next_post().unwrap();
        let acc = r.ledger.post_failed(post.wrs.len(), 1);
        r.apply(acc);
        assert_eq!(r.ledger.state(), QpState::Error);
        assert_eq!(r.ledger.next_post(), None);
        assert_eq!(
            r.status(later),
            TransferStatus::Failed(FailureKind::PeerLost)
        );
        assert_eq!(
            r.status(h),
            TransferStatus::InFlight,
            "the posted head may land"
        );
        let acc = r.ledger.destroyed();
        r.apply(acc);
        assert_eq!(r.status(h), TransferStatus::Failed(FailureKind::PeerLost));
        assert_eq!(r.ledger.outstanding(), 0);
    }

    /// The negative control: declaring the handle failed on the first error completion makes it
    /// terminal while three of its requests are still on the device.
    #[test]
    fn eager_failure_reports_terminal_while_writes_may_still_land() {
        for (mode, expect_early_terminal) in [
            (TrackerMode::Safe, false),
            (TrackerMode::EagerFailure, true),
        ] {
            let mut r = Rig::new(8, mode);
            let h = r.submit(&[1, 1, 1, 1], 4);
            let p = r.post_all();
            r.complete(p[0].wrs[0].wr_id, WcStatus::RetryExceeded);
            let terminal_while_live = r.status(h).is_terminal() && r.ledger.outstanding_of(h) > 0;
            assert_eq!(terminal_while_live, expect_early_terminal, "{mode:?}");
        }
    }

    /// A device model for the property test: requests execute in order; an error moves the QP to
    /// ERROR and the rest are flushed one by one. A request is "live" (may still land) from its
    /// post until the device executed or flushed it.
    struct Device {
        queue: VecDeque<(u64, bool, TransferHandle)>,
        errored: bool,
        live: HashSet<u64>,
        owner: HashMap<u64, TransferHandle>,
        cqes: VecDeque<(u64, WcStatus)>,
        /// Drop flush completions of unsignaled requests (allowed by some providers).
        quiet_flush: bool,
    }

    fn run_model(mode: TrackerMode, script: &[(u8, u8)], quiet_flush: bool) -> Result<(), String> {
        let mut r = Rig::new(6, mode);
        let mut handles: Vec<TransferHandle> = Vec::new();
        let mut d = Device {
            queue: VecDeque::new(),
            errored: false,
            live: HashSet::new(),
            owner: HashMap::new(),
            cqes: VecDeque::new(),
            quiet_flush,
        };
        let check = |r: &Rig, d: &Device, handles: &[TransferHandle]| -> Result<(), String> {
            for h in handles {
                let live = d.live.iter().filter(|id| d.owner[id] == *h).count();
                if r.status(*h).is_terminal() && live > 0 {
                    return Err(format!("{h:?} terminal with {live} live requests"));
                }
            }
            Ok(())
        };
        let steps = script
            .iter()
            .copied()
            .chain(std::iter::repeat_n((9, 0), 200));
        for (action, arg) in steps {
            match action % 10 {
                0 | 1 => {
                    let ops: Vec<usize> = (0..=(arg % 4) as usize).map(|i| 1 + (i % 3)).collect();
                    handles.push(r.submit(&ops, 1 + (arg as usize % 3)));
                }
                2 => {
                    if let Some(&h) = handles.get(arg as usize % handles.len().max(1)) {
                        let _ = r.table.cancel(h);
                        let acc = r.ledger.cancel(h);
                        r.apply(acc);
                    }
                }
                3 if !d.errored => {
                    if let Some((id, _, _)) = d.queue.pop_front() {
                        d.live.remove(&id);
                        d.errored = true;
                        d.cqes.push_back((id, WcStatus::RetryExceeded));
                    }
                }
                _ => {
                    // Post what fits, let the device run one request, deliver one completion.
                    while let Some(p) = r.ledger.next_post() {
                        for w in &p.wrs {
                            d.queue.push_back((w.wr_id, w.signaled, p.handle));
                            d.live.insert(w.wr_id);
                            d.owner.insert(w.wr_id, p.handle);
                        }
                    }
                    if d.queue.len() > 6 {
                        return Err("send queue overrun".into());
                    }
                    if let Some((id, signaled, _)) = d.queue.pop_front() {
                        d.live.remove(&id);
                        if d.errored {
                            if signaled || !d.quiet_flush {
                                d.cqes.push_back((id, WcStatus::Flushed));
                            }
                        } else if signaled {
                            d.cqes.push_back((id, WcStatus::Success));
                        }
                    }
                    if let Some((id, st)) = d.cqes.pop_front() {
                        r.complete(id, st);
                    }
                }
            }
            check(&r, &d, &handles)?;
        }
        // Destroying the QP accounts whatever the provider never reported.
        d.live.clear();
        let acc = r.ledger.destroyed();
        r.apply(acc);
        for h in &handles {
            if !r.status(*h).is_terminal() {
                return Err(format!("{h:?} never became terminal"));
            }
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        #[test]
        fn no_handle_is_terminal_while_its_requests_are_live(
            script in proptest::collection::vec((0u8..10, 0u8..12), 1..60),
            quiet_flush in proptest::bool::ANY,
        ) {
            proptest::prop_assert_eq!(run_model(TrackerMode::Safe, &script, quiet_flush), Ok(()));
        }
    }

    /// The property test has teeth: on the same random scripts the eager mode is caught (about
    /// 40% of scripts when measured), the safe mode never.
    #[test]
    fn random_scripts_catch_the_eager_failure_mode() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut eager, mut safe) = (0, 0);
        for _ in 0..300 {
            let len = 1 + (next() % 59) as usize;
            let script: Vec<(u8, u8)> = (0..len)
                .map(|_| ((next() % 10) as u8, (next() % 12) as u8))
                .collect();
            let quiet = next() % 2 == 0;
            eager += usize::from(run_model(TrackerMode::EagerFailure, &script, quiet).is_err());
            safe += usize::from(run_model(TrackerMode::Safe, &script, quiet).is_err());
        }
        assert_eq!(safe, 0);
        assert!(
            eager >= 30,
            "eager failure caught in only {eager}/300 scripts"
        );
    }

    #[test]
    fn the_model_catches_the_eager_failure_mode() {
        // Two handles, posted; the first request errors.
        let script = [(0, 3), (0, 3), (9, 0), (3, 0), (9, 0)];
        assert_eq!(run_model(TrackerMode::Safe, &script, false), Ok(()));
        assert!(run_model(TrackerMode::EagerFailure, &script, false).is_err());
    }
}
