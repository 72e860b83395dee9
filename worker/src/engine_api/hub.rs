//! An event hub for the API's server streams (SafeToReuse, SourceFree, PrefillWork): every event
//! reaches every live watcher, and events emitted while nobody watches are kept (up to a bound) for
//! the next watcher — so a page release is never lost between Attach and WatchReleases.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::mpsc;

/// Most events kept while no watcher is connected; older ones are dropped with a warning.
pub const BACKLOG: usize = 65_536;

/// Fan-out of events of type `T` to watchers, with a backlog while there is none.
#[derive(Debug)]
pub struct EventHub<T> {
    name: &'static str,
    inner: Mutex<Inner<T>>,
}

#[derive(Debug)]
struct Inner<T> {
    watchers: Vec<mpsc::UnboundedSender<T>>,
    backlog: VecDeque<T>,
    dropped: u64,
}

impl<T: Clone> EventHub<T> {
    /// An empty hub; `name` appears in logs.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            inner: Mutex::new(Inner {
                watchers: Vec::new(),
                backlog: VecDeque::new(),
                dropped: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Delivers `event` to every live watcher, or keeps it for the next one.
    pub fn emit(&self, event: T) {
        let mut inner = self.lock();
        inner.watchers.retain(|w| !w.is_closed());
        if inner.watchers.is_empty() {
            if inner.backlog.len() >= BACKLOG {
                inner.backlog.pop_front();
                inner.dropped += 1;
                tracing::warn!(hub = self.name, "no watcher: oldest backlog event dropped");
            }
            inner.backlog.push_back(event);
            return;
        }
        for w in &inner.watchers {
            let _ = w.send(event.clone());
        }
    }

    /// A new watcher: it first receives the backlog, then every later event.
    pub fn watch(&self) -> mpsc::UnboundedReceiver<T> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inner = self.lock();
        for e in inner.backlog.drain(..) {
            let _ = tx.send(e);
        }
        inner.watchers.push(tx);
        rx
    }

    /// Drops every watcher (their streams end) and the backlog: the attach they belonged to ended.
    pub fn reset(&self) {
        let mut inner = self.lock();
        inner.watchers.clear();
        inner.backlog.clear();
    }

    /// Events dropped from a full backlog so far.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlog_reaches_the_first_watcher_then_events_fan_out() {
        let hub = EventHub::new("t");
        hub.emit(1);
        hub.emit(2);
        let mut a = hub.watch();
        let mut b = hub.watch();
        hub.emit(3);
        assert_eq!(a.try_recv().unwrap(), 1);
        assert_eq!(a.try_recv().unwrap(), 2);
        assert_eq!(a.try_recv().unwrap(), 3);
        assert_eq!(b.try_recv().unwrap(), 3);
        assert!(b.try_recv().is_err());
        hub.reset();
        assert!(a.try_recv().is_err());
        assert_eq!(hub.dropped(), 0);
    }
}
