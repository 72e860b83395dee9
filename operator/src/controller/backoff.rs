//! Exponential backoff with a cap: for a failed reconcile (per object, reset on its next success)
//! and for a failing watch (per watch, reset on its next event).
//!
//! The delay after the `n`-th consecutive failure (`n ≥ 1`) is `min(base × 2^(n−1), cap)`, with
//! no jitter (the controllers are few and their objects are keyed, so there is no herd to spread):
//!
//! | policy | base | cap | sequence |
//! | --- | --- | --- | --- |
//! | [`RECONCILE`] | 1 s | 120 s | 1, 2, 4, 8, 16, 32, 64, 120, 120, … s |
//! | [`WATCH`] | 250 ms | 5 s | 0.25, 0.5, 1, 2, 4, 5, 5, … s |
//!
//! The watch cap is what bounds how long the operator takes to see its kinds again after their
//! CRDs were deleted and re-applied (a watch of a kind whose CRD is gone fails until it is back).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// An exponential backoff curve: `base` doubled per consecutive failure, at most `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exponential {
    /// Delay after the first failure.
    pub base: Duration,
    /// The longest delay.
    pub cap: Duration,
}

/// The curve of a failed reconcile (`error_policy`).
pub const RECONCILE: Exponential = Exponential {
    base: Duration::from_secs(1),
    cap: Duration::from_secs(120),
};

/// The curve of a failing watch.
pub const WATCH: Exponential = Exponential {
    base: Duration::from_millis(250),
    cap: Duration::from_secs(5),
};

impl Exponential {
    /// The delay after `failures` consecutive failures (`0` reads as `1`).
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.base
            .checked_mul(1u32 << doublings)
            .map_or(self.cap, |d| d.min(self.cap))
    }
}

/// Per-object failure counts of one controller set, for `error_policy`: a failure lengthens the
/// object's next retry along [`RECONCILE`], a success forgets it.
#[derive(Debug, Default)]
pub struct ErrorBackoff {
    failures: Mutex<HashMap<String, (u32, Instant)>>,
}

impl ErrorBackoff {
    /// Records one more failure of `key` (e.g. `DecodePool/ns/name`) and returns the delay before
    /// its retry. Entries of objects that stopped failing long ago (deleted while failing) are
    /// dropped here, so the map stays bounded by the objects failing recently.
    pub fn failed(&self, key: &str) -> Duration {
        let Ok(mut map) = self.failures.lock() else {
            return RECONCILE.cap;
        };
        let now = Instant::now();
        map.retain(|_, (_, at)| now.duration_since(*at) < RECONCILE.cap * 4);
        let entry = map.entry(key.to_owned()).or_insert((0, now));
        entry.0 = entry.0.saturating_add(1);
        entry.1 = now;
        RECONCILE.delay(entry.0)
    }

    /// Forgets `key`'s failures (its reconcile succeeded).
    pub fn succeeded(&self, key: &str) {
        if let Ok(mut map) = self.failures.lock() {
            map.remove(key);
        }
    }

    /// Consecutive failures recorded for `key`.
    pub fn failures(&self, key: &str) -> u32 {
        self.failures
            .lock()
            .ok()
            .and_then(|m| m.get(key).map(|e| e.0))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(v: &[f64]) -> Vec<Duration> {
        v.iter().map(|s| Duration::from_secs_f64(*s)).collect()
    }

    #[test]
    fn the_documented_sequences() {
        let r: Vec<Duration> = (1..=10).map(|n| RECONCILE.delay(n)).collect();
        assert_eq!(
            r,
            secs(&[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 120.0, 120.0, 120.0])
        );
        let w: Vec<Duration> = (1..=8).map(|n| WATCH.delay(n)).collect();
        assert_eq!(w, secs(&[0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]));
        assert_eq!(RECONCILE.delay(0), RECONCILE.base);
        assert_eq!(RECONCILE.delay(u32::MAX), RECONCILE.cap, "no overflow");
    }

    #[test]
    fn per_object_counts_grow_independently_and_reset_on_success() {
        let b = ErrorBackoff::default();
        let seq: Vec<Duration> = (0..4).map(|_| b.failed("DecodePool/ns/a")).collect();
        assert_eq!(seq, secs(&[1.0, 2.0, 4.0, 8.0]));
        assert_eq!(
            b.failed("DecodePool/ns/b"),
            Duration::from_secs(1),
            "own count"
        );
        b.succeeded("DecodePool/ns/a");
        assert_eq!(b.failures("DecodePool/ns/a"), 0);
        assert_eq!(b.failed("DecodePool/ns/a"), Duration::from_secs(1), "reset");
        assert_eq!(b.failures("DecodePool/ns/b"), 1);
    }
}
