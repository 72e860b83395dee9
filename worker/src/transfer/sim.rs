//! An in-process transport with one-sided (RDMA WRITE) semantics, for the abort stress and fault
//! injection (DESIGN §6 "a transport that fails the Nth call").
//!
//! What it models, and why it matters for contract 3: a posted write lands after its latency
//! **whatever the receiver's room state is** — there is no receiver-side generation check, exactly as
//! with RDMA WRITE into a registered MR. Cancelling a handle only drops writes not yet posted (all are
//! posted at submit, so cancel waits for them). The only transport proof is destroying the peer's
//! connection ([`SimTransport::destroy_peer`], the QP→ERROR analogue): posted writes that have not
//! started are flushed unapplied, a write being applied finishes, and after it returns nothing lands.
//!
//! One delivery thread applies writes in due-time order (a timer heap), so thousands of writes with
//! per-write latencies cost one thread.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::release::receiver::TransportProof;

use super::handles::{HandleTable, OpOutcome};
use super::region::{ReceiveRegion, RegionId};
use super::{
    BatchLimits, CompletionSink, TransferError, TransferHandle, Transport, TransportKind,
    WriteBatch, WriteOp,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Latency of one write (the stress test draws it at random).
pub type LatencyFn = Arc<dyn Fn(&WriteOp) -> Duration + Send + Sync>;

/// A fault plan: fail the write whose 1-based submission index is `nth` (counted across handles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailNth(pub u64);

struct Peer {
    regions: HashMap<RegionId, Arc<dyn ReceiveRegion>>,
    /// Read-held while a write is applied; write-held by `destroy_peer`.
    alive: RwLock<bool>,
}

struct Pending {
    due: Instant,
    seq: u64,
    handle: TransferHandle,
    peer: Arc<Peer>,
    op: WriteOp,
    fail: bool,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(other.due, other.seq))
    }
}

struct Shared {
    heap: Mutex<BinaryHeap<Reverse<Pending>>>,
    wake: Condvar,
    stop: AtomicBool,
    handles: HandleTable,
    applied_bytes: AtomicU64,
}

/// The simulated one-sided transport.
pub struct SimTransport {
    shared: Arc<Shared>,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    latency: LatencyFn,
    limits: BatchLimits,
    fail_nth: Option<FailNth>,
    submitted: AtomicU64,
    seq: AtomicU64,
    delivery: Option<thread::JoinHandle<()>>,
}

impl SimTransport {
    /// A transport whose writes land after `latency(op)`.
    pub fn new(
        latency: LatencyFn,
        limits: BatchLimits,
        fail_nth: Option<FailNth>,
    ) -> std::io::Result<SimTransport> {
        let shared = Arc::new(Shared {
            heap: Mutex::new(BinaryHeap::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            handles: HandleTable::default(),
            applied_bytes: AtomicU64::new(0),
        });
        let s = shared.clone();
        let delivery = thread::Builder::new()
            .name("sim-delivery".into())
            .spawn(move || delivery_loop(&s))?;
        Ok(SimTransport {
            shared,
            peers: Mutex::new(HashMap::new()),
            latency,
            limits,
            fail_nth,
            submitted: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            delivery: Some(delivery),
        })
    }

    /// Makes `regions` writable under the peer name `name` (the "registration + handshake").
    pub fn connect_peer(&self, name: &str, regions: HashMap<RegionId, Arc<dyn ReceiveRegion>>) {
        lock(&self.peers).insert(
            name.to_string(),
            Arc::new(Peer {
                regions,
                alive: RwLock::new(true),
            }),
        );
    }

    /// Destroys the connection to `name` (QP → ERROR): writes not yet started are flushed without
    /// landing; a write being applied completes first. After this returns no write to `name` lands.
    pub fn destroy_peer(&self, name: &str) -> Option<TransportProof> {
        let peer = lock(&self.peers).remove(name)?;
        *peer.alive.write().unwrap_or_else(PoisonError::into_inner) = false;
        Some(TransportProof::PeerConnectionsDestroyed)
    }

    /// Bytes applied so far.
    pub fn applied_bytes(&self) -> u64 {
        self.shared.applied_bytes.load(Ordering::Relaxed)
    }
}

impl Drop for SimTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
        if let Some(t) = self.delivery.take() {
            let _ = t.join();
        }
    }
}

fn delivery_loop(shared: &Shared) {
    let mut heap = lock(&shared.heap);
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            // Flush: nothing more lands once the transport is gone.
            let rest: Vec<_> = heap.drain().collect();
            drop(heap);
            for Reverse(p) in rest {
                shared.handles.op_done(p.handle, OpOutcome::NotSent);
            }
            return;
        }
        let now = Instant::now();
        let due = match heap.peek() {
            Some(Reverse(p)) if p.due <= now => heap.pop().map(|Reverse(p)| p),
            Some(Reverse(p)) => {
                let wait = p.due - now;
                heap = shared
                    .wake
                    .wait_timeout(heap, wait)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            None => {
                heap = shared
                    .wake
                    .wait(heap)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
        };
        let Some(p) = due else { continue };
        drop(heap);
        let outcome = apply(shared, &p);
        shared.handles.op_done(p.handle, outcome);
        heap = lock(&shared.heap);
    }
}

fn apply(shared: &Shared, p: &Pending) -> OpOutcome {
    let alive = p.peer.alive.read().unwrap_or_else(PoisonError::into_inner);
    if !*alive {
        return OpOutcome::NotSent;
    }
    if p.fail {
        return OpOutcome::Injected;
    }
    let Some(region) = p.peer.regions.get(&p.op.region) else {
        return OpOutcome::RejectedInvalid;
    };
    match region.write(p.op.offset, &p.op.data) {
        Ok(()) => {
            shared
                .applied_bytes
                .fetch_add(p.op.data.len() as u64, Ordering::Relaxed);
            OpOutcome::Applied
        }
        Err(_) => OpOutcome::RejectedInvalid,
    }
}

impl Transport for SimTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Simulated
    }

    // `cancel` is the trait's default: every write is posted at submit, so cancel cannot recall
    // them; it only records the request.
    fn handles(&self) -> &HandleTable {
        &self.shared.handles
    }

    fn submit(
        &self,
        peer: &str,
        batch: WriteBatch,
        on_terminal: Option<CompletionSink>,
    ) -> Result<TransferHandle, TransferError> {
        if batch.len() > self.limits.max_ops || batch.bytes() > self.limits.max_bytes {
            return Err(TransferError::BatchTooLarge {
                ops: batch.len(),
                bytes: batch.bytes(),
                max_ops: self.limits.max_ops,
                max_bytes: self.limits.max_bytes,
            });
        }
        let peer = lock(&self.peers)
            .get(peer)
            .cloned()
            .ok_or_else(|| TransferError::UnknownPeer(peer.to_string()))?;
        let handle = self.shared.handles.create(batch.len(), on_terminal);
        let now = Instant::now();
        let mut heap = lock(&self.shared.heap);
        for op in batch.into_ops() {
            let n = self.submitted.fetch_add(1, Ordering::Relaxed) + 1;
            let fail = self.fail_nth.is_some_and(|f| f.0 == n);
            heap.push(Reverse(Pending {
                due: now + (self.latency)(&op),
                seq: self.seq.fetch_add(1, Ordering::Relaxed),
                handle,
                peer: peer.clone(),
                op,
                fail,
            }));
        }
        drop(heap);
        self.shared.wake.notify_all();
        Ok(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::RoomKey;
    use crate::transfer::{FailureKind, HostRegion, TransferStatus};
    use bytes::Bytes;

    fn setup(latency_ms: u64, fail: Option<FailNth>) -> (SimTransport, Arc<HostRegion>) {
        let t = SimTransport::new(
            Arc::new(move |_| Duration::from_millis(latency_ms)),
            BatchLimits::default(),
            fail,
        )
        .unwrap();
        let region = Arc::new(HostRegion::new(4, 8));
        let mut regions: HashMap<RegionId, Arc<dyn ReceiveRegion>> = HashMap::new();
        regions.insert(RegionId(0), region.clone());
        t.connect_peer("d", regions);
        (t, region)
    }

    fn batch(n: usize) -> WriteBatch {
        let ops = (0..n)
            .map(|i| WriteOp {
                key: RoomKey::new(1, 1),
                region: RegionId(0),
                offset: (i * 8) as u64,
                data: Bytes::from(vec![i as u8 + 1; 8]),
            })
            .collect();
        WriteBatch::new(ops, BatchLimits::default()).unwrap()
    }

    #[test]
    fn posted_writes_land_even_after_cancel_and_deadline_is_not_failure() {
        let (t, region) = setup(30, None);
        let h = t.submit("d", batch(2), None).unwrap();
        assert_eq!(t.wait(h, Instant::now()).unwrap(), TransferStatus::InFlight);
        assert_eq!(t.cancel(h).unwrap(), TransferStatus::Cancelling);
        assert_eq!(
            t.wait(h, Instant::now() + Duration::from_secs(5)).unwrap(),
            TransferStatus::Completed
        );
        assert_eq!(
            region.page(1).unwrap()[0],
            2,
            "one-sided writes land regardless of cancel"
        );
    }

    #[test]
    fn destroyed_peer_flushes_unstarted_writes_and_is_proof() {
        let (t, region) = setup(200, None);
        let h = t.submit("d", batch(2), None).unwrap();
        assert_eq!(
            t.destroy_peer("d"),
            Some(TransportProof::PeerConnectionsDestroyed)
        );
        assert_eq!(
            t.wait(h, Instant::now() + Duration::from_secs(5)).unwrap(),
            TransferStatus::Failed(FailureKind::PeerLost)
        );
        assert_eq!(
            region.page(0).unwrap()[0],
            0,
            "nothing landed after the proof"
        );
        assert!(matches!(
            t.submit("d", batch(1), None),
            Err(TransferError::UnknownPeer(_))
        ));
    }

    #[test]
    fn injected_failure_fails_only_its_handle() {
        let (t, _) = setup(1, Some(FailNth(2)));
        let h1 = t.submit("d", batch(1), None).unwrap();
        let h2 = t.submit("d", batch(1), None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(t.wait(h1, deadline).unwrap(), TransferStatus::Completed);
        assert_eq!(
            t.wait(h2, deadline).unwrap(),
            TransferStatus::Failed(FailureKind::Injected)
        );
        assert!(t.drain(deadline).quiescent());
    }
}
