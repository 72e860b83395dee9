//! Quarantined pages: pages of failed rooms whose safety could not be proven by the ack deadline.
//!
//! They stay out of the free list (a page a late write may still hit is never reused, R-ABORT-4) and
//! every admission raises an alarm (an `error!` log line and the `alarms` counter, exported as a
//! metric by the role). A late proof for the same `(room, generation)` takes the pages back out.

use std::collections::HashMap;
use std::time::Instant;

use super::id::RoomKey;
use super::receiver::FailureCause;

/// One quarantined room.
#[derive(Debug)]
pub struct QuarantineEntry<P> {
    /// The room's pages.
    pub pages: Vec<P>,
    /// Why the room failed.
    pub cause: Option<FailureCause>,
    /// When it entered quarantine.
    pub since: Instant,
}

/// The quarantine registry of one decode rank. `P` is the caller's page handle type.
#[derive(Debug)]
pub struct Quarantine<P> {
    entries: HashMap<RoomKey, QuarantineEntry<P>>,
    alarms: u64,
    recovered: u64,
}

impl<P> Default for Quarantine<P> {
    fn default() -> Self {
        Quarantine {
            entries: HashMap::new(),
            alarms: 0,
            recovered: 0,
        }
    }
}

impl<P> Quarantine<P> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Quarantines the pages of `key` and raises the alarm.
    pub fn admit(
        &mut self,
        key: RoomKey,
        pages: Vec<P>,
        cause: Option<FailureCause>,
        now: Instant,
    ) {
        self.alarms += 1;
        tracing::error!(
            room = key.room.0,
            generation = key.generation.0,
            pages = pages.len(),
            ?cause,
            "KV pages quarantined: no abort ack and no transport proof before the deadline"
        );
        self.entries.insert(
            key,
            QuarantineEntry {
                pages,
                cause,
                since: now,
            },
        );
    }

    /// Takes the pages of `key` out after a late proof; `None` if it was not quarantined.
    pub fn release(&mut self, key: RoomKey) -> Option<Vec<P>> {
        let entry = self.entries.remove(&key)?;
        self.recovered += 1;
        tracing::warn!(
            room = key.room.0,
            generation = key.generation.0,
            "quarantined KV pages recovered by a late proof"
        );
        Some(entry.pages)
    }

    /// Alarms raised so far.
    pub fn alarms(&self) -> u64 {
        self.alarms
    }

    /// Rooms released from quarantine by a late proof.
    pub fn recovered(&self) -> u64 {
        self.recovered
    }

    /// Pages currently held.
    pub fn pages_held(&self) -> usize {
        self.entries.values().map(|e| e.pages.len()).sum()
    }

    /// Rooms currently held.
    pub fn rooms(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admit_counts_alarm_and_release_returns_pages_once() {
        let mut q = Quarantine::new();
        let k = RoomKey::new(1, 1);
        q.admit(
            k,
            vec![3u32, 4],
            Some(FailureCause::Timeout),
            Instant::now(),
        );
        assert_eq!((q.alarms(), q.pages_held()), (1, 2));
        assert_eq!(q.release(k), Some(vec![3, 4]));
        assert_eq!(q.release(k), None);
        assert_eq!((q.pages_held(), q.recovered()), (0, 1));
    }
}
