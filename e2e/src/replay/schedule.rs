//! Pure timing rules of the replay: when each request is due, the retry back-off, and the
//! outcome classes.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The one time origin of a replay: request times, worker samples and demo events are all ms
/// since [`Clock::start`], so they can be plotted on one axis.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    /// Starts the clock now.
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// The origin.
    pub fn origin(&self) -> Instant {
        self.start
    }

    /// Milliseconds since the origin.
    pub fn ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0
    }
}

/// When a request is due, relative to the replay start: `(timestamp − first) × time_scale` ms.
/// The first request is due at once; a negative or non-finite scale counts as 0 (send at once).
pub fn scaled_offset(timestamp_ms: u64, first_timestamp_ms: u64, time_scale: f64) -> Duration {
    let scale = if time_scale.is_finite() && time_scale > 0.0 {
        time_scale
    } else {
        0.0
    };
    let ms = timestamp_ms.saturating_sub(first_timestamp_ms) as f64 * scale;
    Duration::from_secs_f64(ms / 1000.0)
}

/// Back-off before retry number `retry` (1-based): `base × 2^(retry−1)`, at most `max`.
pub fn backoff(retry: u32, base: Duration, max: Duration) -> Duration {
    let factor = 1u32
        .checked_shl(retry.saturating_sub(1))
        .unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(max)
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Completed on the first attempt.
    Ok,
    /// Completed after one or more retries within the budget.
    Retried,
    /// Not completed: the retry budget ran out or the front door refused it for good (4xx other
    /// than 429, 5xx other than 503).
    Failed,
}

/// The outcome of a request that took `attempts` attempts (≥ 1) and `completed` or not.
pub fn classify(attempts: u32, completed: bool) -> Outcome {
    match (completed, attempts) {
        (false, _) => Outcome::Failed,
        (true, 0 | 1) => Outcome::Ok,
        (true, _) => Outcome::Retried,
    }
}

/// Whether an HTTP status from the front door is worth retrying on another target (worker/interfaces/README.md
/// §3: 503 not ready / draining / no prefill peer of this revision, 429 at capacity now). Every other
/// refusal is final: a 400 (`malformed`, or `context_length_exceeded` — a prompt no decode pool of
/// this size can ever hold), 404, 405, 413, 415, 500.
pub fn retryable_status(status: u16) -> bool {
    matches!(status, 503 | 429)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_scale_from_the_first_request() {
        assert_eq!(scaled_offset(1000, 1000, 0.5), Duration::ZERO);
        assert_eq!(scaled_offset(3000, 1000, 0.5), Duration::from_secs(1));
        assert_eq!(scaled_offset(3000, 0, 2.0), Duration::from_secs(6));
        assert_eq!(scaled_offset(3000, 0, 0.0), Duration::ZERO);
        assert_eq!(scaled_offset(3000, 0, f64::NAN), Duration::ZERO);
        assert_eq!(scaled_offset(10, 20, 1.0), Duration::ZERO);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let (b, m) = (Duration::from_millis(50), Duration::from_millis(300));
        assert_eq!(backoff(1, b, m), Duration::from_millis(50));
        assert_eq!(backoff(2, b, m), Duration::from_millis(100));
        assert_eq!(backoff(3, b, m), Duration::from_millis(200));
        assert_eq!(backoff(4, b, m), m);
        assert_eq!(backoff(99, b, m), m);
    }

    #[test]
    fn classification() {
        assert_eq!(classify(1, true), Outcome::Ok);
        assert_eq!(classify(2, true), Outcome::Retried);
        assert_eq!(classify(4, false), Outcome::Failed);
        assert_eq!(classify(1, false), Outcome::Failed);
        assert!(retryable_status(503) && retryable_status(429));
        assert!(!retryable_status(400) && !retryable_status(500) && !retryable_status(200));
        // The front door's other final refusals (issue 19): too large, wrong type, route, method.
        for final_status in [404, 405, 413, 415] {
            assert!(!retryable_status(final_status), "{final_status}");
        }
    }
}
