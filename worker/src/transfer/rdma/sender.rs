//! [`RdmaSender`]: the [`Transport`] machinery of RDMA WRITE over connected queue pairs, written
//! against the [`QueuePairOps`] seam so that it is built and tested without a device (the verbs
//! implementation is `RdmaTransport`, feature `rdma`; the tests use a scripted fake).
//!
//! Life of a batch: [`Transport::submit`] plans it ([`super::plan`]: every write bounds- and
//! registration-checked; an invalid batch fails its handle as `Rejected` with **nothing posted**),
//! hands the plan to the peer's [`QpLedger`] and posts what fits the send queue. A completion-poller
//! thread polls every peer's queue pair, feeds the ledger (which retires requests and accounts
//! writes), posts what the freed credit admits, and turns accounted writes into handle status
//! outside every lock. Handles follow the [`Transport`] contract: terminal only when every posted
//! request is accounted; a deadline returns the live status, never a failure.
//!
//! A queue pair that failed (an error completion, or a failed post) stays failed: new batches to
//! that peer fail at once (`NotSent` → `Failed(PeerLost)`) until the control plane removes the peer
//! ([`RdmaSender::remove_peer`], the transport proof) and connects a new queue pair.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use super::completions::{Accounted, QpLedger, QpState, TrackerMode, WcStatus, WrSpec};
use super::plan::{LocalMr, LocalMrTable, PostLimits, RemoteRegionTable, TableError, plan_writes};
use crate::release::receiver::TransportProof;
use crate::transfer::handles::{HandleTable, OpOutcome};
use crate::transfer::{
    BatchLimits, CompletionSink, TransferError, TransferHandle, TransferStatus, Transport,
    TransportKind, WriteBatch,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `ibv_post_send` accepted only the first `posted` requests of a list.
#[derive(Debug, thiserror::Error)]
#[error("post accepted {posted} request(s): {source}")]
pub struct PostFailure {
    /// Requests accepted before the failing one.
    pub posted: usize,
    /// The cause.
    pub source: io::Error,
}

/// The device operations of one connected RC queue pair (and its own completion queue).
/// Dropping the value destroys the queue pair.
pub trait QueuePairOps: Send + Sync {
    /// Posts `wrs` as one list of RDMA WRITE requests, in order.
    ///
    /// # Errors
    /// [`PostFailure`] with how many requests were posted before the failure.
    fn post(&self, wrs: &[WrSpec]) -> Result<(), PostFailure>;

    /// Appends available completions as `(wr_id, status)` to `out` without blocking.
    ///
    /// # Errors
    /// When the completion queue cannot be polled.
    fn poll(&self, out: &mut Vec<(u64, WcStatus)>) -> io::Result<()>;

    /// Moves the queue pair to ERROR (it stops executing; outstanding requests are flushed).
    ///
    /// # Errors
    /// When the transition is refused.
    fn set_error(&self) -> io::Result<()>;
}

/// Sender settings.
#[derive(Clone, Copy, Debug)]
pub struct SenderConfig {
    /// Limits on one submitted batch.
    pub limits: BatchLimits,
    /// Grouping of work requests into posts.
    pub post_limits: PostLimits,
    /// Send-queue depth of every queue pair.
    pub max_send_wr: usize,
    /// Longest sleep of the completion poller when idle.
    pub max_poll_sleep: Duration,
}

struct LinkState {
    remote: RemoteRegionTable,
    ledger: QpLedger,
}

/// How long [`RdmaSender::remove_peer`] waits for the poller to let go of a link.
pub const REMOVE_PEER_WAIT: Duration = Duration::from_secs(5);

struct Link {
    name: String,
    qp: Box<dyn QueuePairOps>,
    state: Mutex<LinkState>,
}

struct Inner {
    config: SenderConfig,
    handles: HandleTable,
    links: Mutex<HashMap<String, Arc<Link>>>,
    local: RwLock<LocalMrTable>,
    stop: AtomicBool,
}

/// RDMA WRITE over connected queue pairs (see the module docs).
pub struct RdmaSender {
    inner: Arc<Inner>,
    poller: Option<thread::JoinHandle<()>>,
}

impl RdmaSender {
    /// Starts the completion poller.
    ///
    /// # Errors
    /// When the poller thread cannot be spawned.
    pub fn start(config: SenderConfig) -> io::Result<RdmaSender> {
        let inner = Arc::new(Inner {
            config,
            handles: HandleTable::default(),
            links: Mutex::new(HashMap::new()),
            local: RwLock::new(LocalMrTable::new()),
            stop: AtomicBool::new(false),
        });
        let i = inner.clone();
        let poller = thread::Builder::new()
            .name("rdma-poller".into())
            .spawn(move || poll_loop(&i))?;
        Ok(RdmaSender {
            inner,
            poller: Some(poller),
        })
    }

    /// Makes a local registration usable as a write source.
    ///
    /// # Errors
    /// [`TableError::LocalOverlap`] for an empty or overlapping registration.
    pub fn add_local(&self, mr: LocalMr) -> Result<(), TableError> {
        self.inner
            .local
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(mr)
    }

    /// Adds the connected queue pair `qp` to `peer`, whose registrations are `remote`. A queue pair
    /// already connected to `peer` is removed first (as by [`RdmaSender::remove_peer`]).
    pub fn add_peer(&self, peer: &str, qp: Box<dyn QueuePairOps>, remote: RemoteRegionTable) {
        let _ = self.remove_peer(peer);
        let link = Arc::new(Link {
            name: peer.to_string(),
            qp,
            state: Mutex::new(LinkState {
                remote,
                ledger: QpLedger::new(self.inner.config.max_send_wr, TrackerMode::Safe),
            }),
        });
        lock(&self.inner.links).insert(peer.to_string(), link);
    }

    /// Moves `peer`'s queue pair to ERROR, destroys it and only then accounts every request still
    /// outstanding (releasing their source pages): after it returns `Some`, no write to `peer` can
    /// land — the transport proof for the release gate (R-XFER-4). `None` if `peer` had no queue
    /// pair, or if the poller still held the link after [`REMOVE_PEER_WAIT`]: then no proof is
    /// given, the handles stay non-terminal and the sources stay pinned until the last holder
    /// drops the link (the queue pair is destroyed before the ledger holding the sources).
    pub fn remove_peer(&self, peer: &str) -> Option<TransportProof> {
        let link = lock(&self.inner.links).remove(peer)?;
        if let Err(e) = link.qp.set_error() {
            tracing::warn!(peer, error = %e, "cannot move the QP to ERROR; destroying it");
        }
        // The poller holds a snapshot of the link for at most one pass.
        let deadline = Instant::now() + REMOVE_PEER_WAIT;
        while Arc::strong_count(&link) > 1 && Instant::now() < deadline {
            thread::sleep(Duration::from_micros(100));
        }
        let Ok(Link { qp, state, .. }) = Arc::try_unwrap(link) else {
            tracing::error!(
                peer,
                "the link is still in use after {REMOVE_PEER_WAIT:?}: no transport proof"
            );
            return None;
        };
        drop(qp); // ibv_destroy_qp: the device reads no source and writes nothing after this
        let accounted = state
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .ledger
            .destroyed();
        apply(&self.inner.handles, accounted);
        Some(TransportProof::PeerConnectionsDestroyed)
    }

    /// Stops the poller and removes every peer (their handles turn terminal).
    pub fn shutdown(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.poller.take() {
            let _ = t.join();
        }
        let names: Vec<String> = lock(&self.inner.links).keys().cloned().collect();
        for name in names {
            let _ = self.remove_peer(&name);
        }
    }
}

impl Drop for RdmaSender {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn apply(handles: &HandleTable, accounted: Accounted) {
    for (h, outcome) in accounted {
        handles.op_done(h, OpOutcome::from(outcome));
    }
}

/// Posts what the send queue admits. On a failed post the queue pair is moved to ERROR (its
/// posted head is flushed) and the ledger stops posting.
fn post_ready(link: &Link, st: &mut LinkState, out: &mut Accounted) {
    while let Some(post) = st.ledger.next_post() {
        if let Err(e) = link.qp.post(&post.wrs) {
            tracing::error!(peer = %link.name, error = %e, "RDMA post failed; failing the queue pair");
            out.extend(st.ledger.post_failed(post.wrs.len(), e.posted));
            if let Err(e) = link.qp.set_error() {
                tracing::error!(peer = %link.name, error = %e, "cannot move the QP to ERROR");
            }
            return;
        }
    }
}

fn poll_loop(inner: &Inner) {
    let mut sleep = Duration::from_micros(1);
    let mut completions = Vec::new();
    while !inner.stop.load(Ordering::SeqCst) {
        let links: Vec<Arc<Link>> = lock(&inner.links).values().cloned().collect();
        let mut busy = false;
        for link in &links {
            completions.clear();
            if let Err(e) = link.qp.poll(&mut completions) {
                tracing::error!(peer = %link.name, error = %e, "polling the completion queue failed");
                continue;
            }
            if completions.is_empty() {
                continue;
            }
            busy = true;
            let mut accounted = Accounted::new();
            {
                let mut st = lock(&link.state);
                let was_ready = st.ledger.state() == QpState::Ready;
                for &(wr_id, status) in &completions {
                    accounted.extend(st.ledger.on_completion(wr_id, status));
                }
                if was_ready && st.ledger.state() == QpState::Error {
                    tracing::warn!(
                        peer = %link.name,
                        status = ?st.ledger.first_error(),
                        outstanding = st.ledger.outstanding(),
                        "RDMA queue pair failed; its outstanding writes are being flushed"
                    );
                }
                post_ready(link, &mut st, &mut accounted);
            }
            apply(&inner.handles, accounted);
        }
        drop(links);
        if busy {
            sleep = Duration::from_micros(1);
        } else {
            thread::sleep(sleep);
            sleep = (sleep * 2).min(inner.config.max_poll_sleep);
        }
    }
}

impl Transport for RdmaSender {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn handles(&self) -> &HandleTable {
        &self.inner.handles
    }

    fn submit(
        &self,
        peer: &str,
        batch: WriteBatch,
        on_terminal: Option<CompletionSink>,
    ) -> Result<TransferHandle, TransferError> {
        if self.inner.stop.load(Ordering::SeqCst) {
            return Err(TransferError::Shutdown);
        }
        let limits = self.inner.config.limits;
        if batch.len() > limits.max_ops || batch.bytes() > limits.max_bytes {
            return Err(TransferError::BatchTooLarge {
                ops: batch.len(),
                bytes: batch.bytes(),
                max_ops: limits.max_ops,
                max_bytes: limits.max_bytes,
            });
        }
        let link = lock(&self.inner.links)
            .get(peer)
            .cloned()
            .ok_or_else(|| TransferError::UnknownPeer(peer.to_string()))?;
        let mut accounted = Accounted::new();
        let mut st = lock(&link.state);
        let plan = {
            let local = self
                .inner
                .local
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            plan_writes(
                batch.ops(),
                &st.remote,
                &local,
                self.inner.config.post_limits,
            )
        };
        let handle = self.inner.handles.create(batch.len(), on_terminal);
        match plan {
            Ok(plan) => {
                accounted.extend(st.ledger.enqueue(handle, plan));
                post_ready(&link, &mut st, &mut accounted);
                drop(st);
            }
            Err(e) => {
                drop(st);
                tracing::warn!(peer, error = %e, "RDMA batch refused before posting");
                for i in 0..batch.len() {
                    let outcome = if i == e.op() {
                        OpOutcome::RejectedInvalid
                    } else {
                        OpOutcome::NotSent
                    };
                    self.inner.handles.op_done(handle, outcome);
                }
            }
        }
        apply(&self.inner.handles, accounted);
        Ok(handle)
    }

    fn cancel(&self, handle: TransferHandle) -> Result<TransferStatus, TransferError> {
        let status = self.inner.handles.cancel(handle)?;
        if status.is_terminal() {
            return Ok(status);
        }
        let links: Vec<Arc<Link>> = lock(&self.inner.links).values().cloned().collect();
        for link in links {
            let accounted = lock(&link.state).ledger.cancel(handle);
            apply(&self.inner.handles, accounted);
        }
        self.inner.handles.poll(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::RoomKey;
    use crate::transfer::rdma::endpoint::RemoteMr;
    use crate::transfer::{FailureKind, RegionId, WriteOp};
    use bytes::Bytes;
    use std::collections::VecDeque;

    /// A scripted queue pair: records posts; in `auto` mode every signaled request completes at
    /// once, otherwise the test pushes completions.
    #[derive(Default)]
    struct FakeQp {
        posted: Mutex<Vec<WrSpec>>,
        cqes: Mutex<VecDeque<(u64, WcStatus)>>,
        auto: bool,
        errored: AtomicBool,
    }

    impl QueuePairOps for Arc<FakeQp> {
        fn post(&self, wrs: &[WrSpec]) -> Result<(), PostFailure> {
            lock(&self.posted).extend_from_slice(wrs);
            if self.auto {
                let mut cqes = lock(&self.cqes);
                cqes.extend(
                    wrs.iter()
                        .filter(|w| w.signaled)
                        .map(|w| (w.wr_id, WcStatus::Success)),
                );
            }
            Ok(())
        }
        fn poll(&self, out: &mut Vec<(u64, WcStatus)>) -> io::Result<()> {
            out.extend(lock(&self.cqes).drain(..));
            Ok(())
        }
        fn set_error(&self) -> io::Result<()> {
            self.errored.store(true, Ordering::SeqCst);
            Ok(())
        }
    }

    impl FakeQp {
        fn push(&self, wr_id: u64, status: WcStatus) {
            lock(&self.cqes).push_back((wr_id, status));
        }
        fn posted(&self) -> Vec<WrSpec> {
            lock(&self.posted).clone()
        }
    }

    const REMOTE_BASE: u64 = 0x7000_0000;

    struct Rig {
        sender: RdmaSender,
        qp: Arc<FakeQp>,
        arena: Bytes,
    }

    /// A sender with one peer `d` (region 0: 64 KiB at `REMOTE_BASE`, rkey 9) and a registered
    /// 64 KiB source arena (lkey 5).
    fn rig(auto: bool, max_send_wr: usize, per_post: usize) -> Rig {
        let sender = RdmaSender::start(SenderConfig {
            limits: BatchLimits::default(),
            post_limits: PostLimits::new(per_post, 1 << 20).unwrap(),
            max_send_wr,
            max_poll_sleep: Duration::from_micros(100),
        })
        .unwrap();
        let arena = Bytes::from(vec![3u8; 64 << 10]);
        sender
            .add_local(LocalMr {
                addr: arena.as_ptr() as u64,
                len: arena.len() as u64,
                lkey: 5,
            })
            .unwrap();
        let qp = Arc::new(FakeQp {
            auto,
            ..FakeQp::default()
        });
        let remote = RemoteRegionTable::new(&[RemoteMr {
            region: RegionId(0),
            region_offset: 0,
            addr: REMOTE_BASE,
            rkey: 9,
            len: 64 << 10,
        }])
        .unwrap();
        sender.add_peer("d", Box::new(qp.clone()), remote);
        Rig { sender, qp, arena }
    }

    impl Rig {
        /// `n` writes of 4 KiB: source page i → region offset `offset + i·4 KiB`.
        fn batch(&self, n: usize, offset: u64) -> WriteBatch {
            let ops = (0..n)
                .map(|i| WriteOp {
                    key: RoomKey::new(1, 1),
                    region: RegionId(0),
                    offset: offset + (i as u64) * 4096,
                    data: self.arena.slice(i * 4096..(i + 1) * 4096),
                })
                .collect();
            WriteBatch::new(ops, BatchLimits::default()).unwrap()
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn writes_are_posted_to_the_peers_addresses_and_complete() {
        let r = rig(true, 16, 4);
        let h = r.sender.submit("d", r.batch(3, 8192), None).unwrap();
        assert_eq!(r.sender.wait(h, soon()).unwrap(), TransferStatus::Completed);
        let posted = r.qp.posted();
        let base = r.arena.as_ptr() as u64;
        let shape: Vec<_> = posted
            .iter()
            .map(|w| {
                (
                    w.local_addr - base,
                    w.lkey,
                    w.remote_addr,
                    w.rkey,
                    w.len,
                    w.signaled,
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                (0, 5, REMOTE_BASE + 8192, 9, 4096, false),
                (4096, 5, REMOTE_BASE + 12288, 9, 4096, false),
                (8192, 5, REMOTE_BASE + 16384, 9, 4096, true),
            ]
        );
        assert_eq!(r.sender.release(h).unwrap(), TransferStatus::Completed);
    }

    #[test]
    fn an_out_of_range_batch_is_rejected_with_nothing_posted() {
        let r = rig(true, 16, 4);
        // The third write ends 4 KiB past the 64 KiB region.
        let h = r.sender.submit("d", r.batch(3, 56 << 10), None).unwrap();
        assert_eq!(
            r.sender.poll(h).unwrap(),
            TransferStatus::Failed(FailureKind::Rejected {
                stale: 0,
                invalid: 1
            })
        );
        assert!(r.qp.posted().is_empty(), "nothing may reach the QP");
        assert!(matches!(
            r.sender.submit("nobody", r.batch(1, 0), None),
            Err(TransferError::UnknownPeer(_))
        ));
    }

    #[test]
    fn an_error_completion_leaves_the_handle_live_until_the_flushes() {
        let r = rig(false, 16, 2);
        let h = r.sender.submit("d", r.batch(4, 0), None).unwrap();
        let ids: Vec<u64> = r.qp.posted().iter().map(|w| w.wr_id).collect();
        assert_eq!(ids.len(), 4);
        r.qp.push(ids[0], WcStatus::RetryExceeded);
        // A deadline returns the live status, never a failure, while 3 requests are unaccounted.
        let at_deadline = r
            .sender
            .wait(h, Instant::now() + Duration::from_millis(50))
            .unwrap();
        assert_eq!(at_deadline, TransferStatus::InFlight);
        assert!(matches!(
            r.sender.release(h),
            Err(TransferError::NotTerminal(..))
        ));
        // Later batches to the failed QP fail at once, nothing posted.
        let late = r.sender.submit("d", r.batch(1, 0), None).unwrap();
        assert_eq!(
            r.sender.wait(late, soon()).unwrap(),
            TransferStatus::Failed(FailureKind::PeerLost)
        );
        assert_eq!(r.qp.posted().len(), 4);
        r.qp.push(ids[3], WcStatus::Flushed);
        assert_eq!(
            r.sender.wait(h, soon()).unwrap(),
            TransferStatus::Failed(FailureKind::PeerLost)
        );
    }

    #[test]
    fn the_send_queue_bounds_posting_and_cancel_drops_what_is_queued() {
        let r = rig(false, 4, 2);
        let h = r.sender.submit("d", r.batch(10, 0), None).unwrap();
        assert_eq!(
            r.qp.posted().len(),
            4,
            "two posts of two fill the queue of four"
        );
        let second_signaled = r.qp.posted()[3].wr_id;
        r.qp.push(r.qp.posted()[1].wr_id, WcStatus::Success);
        let deadline = soon();
        while r.qp.posted().len() < 6 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(r.qp.posted().len(), 6, "credit of one post admits the next");
        assert_eq!(r.sender.cancel(h).unwrap(), TransferStatus::Cancelling);
        r.qp.push(second_signaled, WcStatus::Success);
        let last = r.qp.posted()[5].wr_id;
        assert_eq!(
            r.sender
                .wait(h, Instant::now() + Duration::from_millis(50))
                .unwrap(),
            TransferStatus::Cancelling,
            "two requests are still on the device"
        );
        r.qp.push(last, WcStatus::Success);
        assert_eq!(r.sender.wait(h, soon()).unwrap(), TransferStatus::Cancelled);
        assert_eq!(r.qp.posted().len(), 6, "queued posts were never posted");
    }

    #[test]
    fn removing_the_peer_destroys_the_qp_and_is_proof() {
        let r = rig(false, 16, 4);
        let h = r.sender.submit("d", r.batch(2, 0), None).unwrap();
        assert_eq!(r.sender.poll(h).unwrap(), TransferStatus::InFlight);
        assert_eq!(
            r.sender.remove_peer("d"),
            Some(TransportProof::PeerConnectionsDestroyed)
        );
        assert!(r.qp.errored.load(Ordering::SeqCst), "moved to ERROR first");
        assert_eq!(
            Arc::strong_count(&r.qp),
            1,
            "the sender dropped (destroyed) its queue pair before returning"
        );
        assert_eq!(
            r.sender.poll(h).unwrap(),
            TransferStatus::Failed(FailureKind::PeerLost)
        );
        assert!(r.sender.drain(Instant::now()).quiescent());
        assert!(matches!(
            r.sender.submit("d", r.batch(1, 0), None),
            Err(TransferError::UnknownPeer(_))
        ));
        assert_eq!(r.sender.remove_peer("d"), None);
    }
}
