//! The handle table shared by the transports: per-handle write accounting, terminal detection,
//! deadline waits and the completion callback. Every [`Transport`](super::Transport) exposes its
//! table through [`Transport::handles`](super::Transport::handles), and the trait's default
//! `poll`, `cancel`, `wait`, `release` and `drain` run on it; a transport only accounts its writes
//! (crate-internal `create` / `op_done`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::{
    CompletionSink, DrainReport, FailureKind, TransferError, TransferHandle, TransferStatus,
};

/// The outcome of one write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum OpOutcome {
    /// Landed.
    Applied,
    /// Never handed to the wire (cancelled or flushed before sending): cannot land.
    NotSent,
    /// Refused by the receiver because the room generation was stale.
    RejectedStale,
    /// Refused by the receiver (bounds, unknown region).
    RejectedInvalid,
    /// The connection broke before the receiver confirmed; the receiver stopped reading it.
    PeerLost,
    /// Injected fault.
    Injected,
}

struct Entry {
    status: TransferStatus,
    pending: usize,
    applied: usize,
    not_sent: usize,
    stale: u32,
    invalid: u32,
    failure: Option<FailureKind>,
    cancel: bool,
    notify: Option<CompletionSink>,
}

/// Every live handle of one transport: its status, the writes still to account for, and the
/// completion callback. Thread-safe; waits block on a condition variable, never spin.
#[derive(Default)]
pub struct HandleTable {
    entries: Mutex<HashMap<u64, Entry>>,
    changed: Condvar,
    next: AtomicU64,
}

impl HandleTable {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new in-flight handle with `ops` writes to account for.
    pub(crate) fn create(&self, ops: usize, notify: Option<CompletionSink>) -> TransferHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let entry = Entry {
            status: TransferStatus::InFlight,
            pending: ops,
            applied: 0,
            not_sent: 0,
            stale: 0,
            invalid: 0,
            failure: None,
            cancel: false,
            notify,
        };
        self.lock().insert(id, entry);
        TransferHandle(id)
    }

    /// True once cancel was requested (transports check before sending a queued write).
    pub(crate) fn cancel_requested(&self, h: TransferHandle) -> bool {
        self.lock().get(&h.0).is_none_or(|e| e.cancel)
    }

    /// Accounts one write. When the last write is accounted the handle turns terminal and the
    /// completion sink is called (outside the lock).
    pub(crate) fn op_done(&self, h: TransferHandle, outcome: OpOutcome) {
        let fire = {
            let mut map = self.lock();
            let Some(e) = map.get_mut(&h.0) else { return };
            if e.pending == 0 {
                return;
            }
            e.pending -= 1;
            match outcome {
                OpOutcome::Applied => e.applied += 1,
                OpOutcome::NotSent => e.not_sent += 1,
                OpOutcome::RejectedStale => e.stale += 1,
                OpOutcome::RejectedInvalid => e.invalid += 1,
                OpOutcome::PeerLost => {
                    e.failure.get_or_insert(FailureKind::PeerLost);
                }
                OpOutcome::Injected => {
                    e.failure.get_or_insert(FailureKind::Injected);
                }
            }
            if e.pending > 0 {
                return;
            }
            e.status = if let Some(f) = e.failure.clone() {
                TransferStatus::Failed(f)
            } else if e.stale > 0 || e.invalid > 0 {
                TransferStatus::Failed(FailureKind::Rejected {
                    stale: e.stale,
                    invalid: e.invalid,
                })
            } else if e.not_sent > 0 {
                if e.cancel {
                    TransferStatus::Cancelled
                } else {
                    TransferStatus::Failed(FailureKind::PeerLost)
                }
            } else {
                TransferStatus::Completed
            };
            self.changed.notify_all();
            e.notify.take().map(|n| (n, e.status.clone()))
        };
        if let Some((notify, status)) = fire {
            notify(h, &status);
        }
    }

    /// The current status of `h`, without blocking.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`] when `h` was never issued or was released.
    pub fn poll(&self, h: TransferHandle) -> Result<TransferStatus, TransferError> {
        self.lock()
            .get(&h.0)
            .map(|e| e.status.clone())
            .ok_or(TransferError::UnknownHandle(h))
    }

    /// Requests cancellation of `h`: a non-terminal handle turns `Cancelling` (writes not yet on
    /// the wire are dropped by the transport; posted ones are still accounted). Returns the status
    /// after the request.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`].
    pub fn cancel(&self, h: TransferHandle) -> Result<TransferStatus, TransferError> {
        let mut map = self.lock();
        let e = map.get_mut(&h.0).ok_or(TransferError::UnknownHandle(h))?;
        if !e.status.is_terminal() {
            e.cancel = true;
            e.status = TransferStatus::Cancelling;
        }
        Ok(e.status.clone())
    }

    /// Blocks until `h` is terminal or `deadline` passes; returns the status then (non-terminal
    /// at a passed deadline — a timeout is never a failure).
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`].
    pub fn wait(
        &self,
        h: TransferHandle,
        deadline: Instant,
    ) -> Result<TransferStatus, TransferError> {
        let mut map = self.lock();
        loop {
            let status = map
                .get(&h.0)
                .map(|e| e.status.clone())
                .ok_or(TransferError::UnknownHandle(h))?;
            let now = Instant::now();
            if status.is_terminal() || now >= deadline {
                return Ok(status);
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Forgets a terminal handle and returns its final status.
    ///
    /// # Errors
    /// [`TransferError::UnknownHandle`]; [`TransferError::NotTerminal`] (the handle is kept) while
    /// writes of it may still land.
    pub fn release(&self, h: TransferHandle) -> Result<TransferStatus, TransferError> {
        let mut map = self.lock();
        let status = map
            .get(&h.0)
            .map(|e| e.status.clone())
            .ok_or(TransferError::UnknownHandle(h))?;
        if !status.is_terminal() {
            return Err(TransferError::NotTerminal(h, status));
        }
        map.remove(&h.0);
        Ok(status)
    }

    /// Waits until every handle is terminal or `deadline` passes; reports those still in flight.
    pub fn drain(&self, deadline: Instant) -> DrainReport {
        let mut map = self.lock();
        loop {
            let in_flight: Vec<TransferHandle> = map
                .iter()
                .filter(|(_, e)| !e.status.is_terminal())
                .map(|(id, _)| TransferHandle(*id))
                .collect();
            let now = Instant::now();
            if in_flight.is_empty() || now >= deadline {
                let mut in_flight = in_flight;
                in_flight.sort();
                return DrainReport { in_flight };
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    #[test]
    fn terminal_only_when_every_write_is_accounted() {
        let t = HandleTable::default();
        let fired = Arc::new(AtomicUsize::new(0));
        let f = fired.clone();
        let h = t.create(
            2,
            Some(Arc::new(move |_, _| {
                f.fetch_add(1, Ordering::SeqCst);
            })),
        );
        assert_eq!(t.cancel(h).unwrap(), TransferStatus::Cancelling);
        t.op_done(h, OpOutcome::Applied);
        // A deadline never turns a live handle into a failure.
        assert_eq!(
            t.wait(h, Instant::now() + Duration::from_millis(5))
                .unwrap(),
            TransferStatus::Cancelling
        );
        assert!(matches!(t.release(h), Err(TransferError::NotTerminal(..))));
        t.op_done(h, OpOutcome::NotSent);
        assert_eq!(t.poll(h).unwrap(), TransferStatus::Cancelled);
        t.op_done(h, OpOutcome::Applied);
        assert_eq!(
            fired.load(Ordering::SeqCst),
            1,
            "completion fires exactly once"
        );
        assert!(t.drain(Instant::now()).quiescent());
        assert_eq!(t.release(h).unwrap(), TransferStatus::Cancelled);
        assert!(matches!(t.poll(h), Err(TransferError::UnknownHandle(_))));
    }

    #[test]
    fn rejected_writes_fail_the_handle() {
        let t = HandleTable::default();
        let h = t.create(2, None);
        t.op_done(h, OpOutcome::Applied);
        t.op_done(h, OpOutcome::RejectedStale);
        assert_eq!(
            t.poll(h).unwrap(),
            TransferStatus::Failed(FailureKind::Rejected {
                stale: 1,
                invalid: 0
            })
        );
        let h2 = t.create(1, None);
        assert_eq!(t.drain(Instant::now()).in_flight, vec![h2]);
    }
}
