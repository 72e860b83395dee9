//! The speculative-decoding anomaly guard (DESIGN contract 8; seed 004).
//!
//! Seed 004: garbled output and rare characters came with an absurdly low `spec_accept_length` (the
//! target model rejected nearly every draft token: the draft's and the target's KV state no longer
//! agreed), and repetition loops came with an accept rate near 1 (a corrupted KV cache degraded
//! attention into a confident repeating pattern). Decoding on silently emits that garbage to the
//! client. The fix was an online monitor: once a generation passes 128 tokens, a mean accept length
//! below 1.4 or an accept rate above 0.96 ends the generation and hands the request back for a retry
//! elsewhere. This module is that monitor, pure: the serving path feeds it one verification step at
//! a time and acts on its [`Verdict`] (abort through the release gate of contract 3, retry within the
//! budget).
//!
//! Definitions (per request, cumulative from its first verification step):
//! - a step proposes `proposed` draft tokens; the target accepts the first `accepted` of them and
//!   emits one more token of its own, so the step emits `accepted + 1` tokens;
//! - accept length = tokens emitted / steps (tokens per step, ≥ 1);
//! - accept rate = draft tokens accepted / draft tokens proposed (in `[0, 1]`).
//!
//! Nothing is judged before `after_tokens` tokens were emitted; from then on every step is judged,
//! and the first anomaly latches. A value exactly at a threshold is healthy (the rule is a strict
//! `<` and `>`). The means are cumulative, so corruption that starts late in a long generation is
//! diluted by the healthy steps before it.

use crate::config;

/// Thresholds of the guard (the worker config's `specGuard`, without the retry budget).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Anomalous below this mean accept length (tokens per step); seed 004: 1.4.
    pub min_accept_length: f64,
    /// Anomalous above this accept rate (fraction of draft tokens accepted); seed 004: 0.96.
    pub max_accept_rate: f64,
    /// Tokens emitted before anything is judged; seed 004: 128.
    pub after_tokens: u32,
}

impl Thresholds {
    /// The thresholds of seed 004 and DESIGN contract 8: 1.4, 0.96, 128 tokens.
    pub const SEED_004: Self = Self {
        min_accept_length: 1.4,
        max_accept_rate: 0.96,
        after_tokens: 128,
    };
}

impl From<&config::SpecGuard> for Thresholds {
    fn from(g: &config::SpecGuard) -> Self {
        Self {
            min_accept_length: g.min_accept_length,
            max_accept_rate: g.max_accept_rate,
            after_tokens: g.after_tokens,
        }
    }
}

/// Why a generation was judged anomalous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnomalyReason {
    /// Mean accept length below the minimum: draft and target disagree (garbled output).
    LowAcceptLength,
    /// Accept rate above the maximum: degenerate attention (repetition loop).
    HighAcceptRate,
}

impl AnomalyReason {
    /// Every reason, in a fixed order.
    pub const ALL: [Self; 2] = [Self::LowAcceptLength, Self::HighAcceptRate];

    /// The stable reason code used in metrics labels, logs and responses.
    pub const fn code(self) -> &'static str {
        match self {
            Self::LowAcceptLength => "low_accept_length",
            Self::HighAcceptRate => "high_accept_rate",
        }
    }
}

impl std::fmt::Display for AnomalyReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

/// An anomalous generation: the reason and the statistics when it tripped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Anomaly {
    /// Which threshold was crossed.
    pub reason: AnomalyReason,
    /// Mean accept length (tokens per step) at the trip.
    pub accept_length: f64,
    /// Accept rate (accepted / proposed draft tokens) at the trip.
    pub accept_rate: f64,
    /// Tokens emitted when it tripped (including the tripping step).
    pub tokens: u64,
}

impl std::fmt::Display for Anomaly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "speculative decoding anomaly {} after {} tokens (accept length {:.3}, accept rate {:.3})",
            self.reason, self.tokens, self.accept_length, self.accept_rate
        )
    }
}

/// The guard's verdict after a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Fewer than `after_tokens` tokens so far: not judged yet.
    Warming,
    /// Judged and within the thresholds.
    Healthy,
    /// Judged anomalous (latched: every later step returns the same anomaly).
    Anomaly(Anomaly),
}

/// A malformed verification step (the caller's bug; nothing is recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// More draft tokens accepted than proposed.
    #[error("{accepted} draft tokens accepted of {proposed} proposed")]
    AcceptedExceedsProposed {
        /// Draft tokens proposed.
        proposed: u32,
        /// Draft tokens accepted.
        accepted: u32,
    },
    /// A step that proposed no draft token is not a speculative step.
    #[error("a verification step proposed no draft token")]
    NothingProposed,
}

/// The guard of one request: feed every verification step to [`SpecGuard::observe`].
#[derive(Debug, Clone)]
pub struct SpecGuard {
    thresholds: Thresholds,
    steps: u64,
    proposed: u64,
    accepted: u64,
    tripped: Option<Anomaly>,
}

impl SpecGuard {
    /// A guard with no step observed.
    pub fn new(thresholds: Thresholds) -> Self {
        Self {
            thresholds,
            steps: 0,
            proposed: 0,
            accepted: 0,
            tripped: None,
        }
    }

    /// Records one verification step (`proposed` draft tokens, the first `accepted` of them
    /// accepted; `accepted + 1` tokens emitted) and judges the request.
    ///
    /// # Errors
    /// [`StepError`] when `accepted > proposed` or `proposed == 0`; the step is not recorded.
    pub fn observe(&mut self, proposed: u32, accepted: u32) -> Result<Verdict, StepError> {
        if proposed == 0 {
            return Err(StepError::NothingProposed);
        }
        if accepted > proposed {
            return Err(StepError::AcceptedExceedsProposed { proposed, accepted });
        }
        if let Some(a) = self.tripped {
            return Ok(Verdict::Anomaly(a));
        }
        self.steps += 1;
        self.proposed += u64::from(proposed);
        self.accepted += u64::from(accepted);
        Ok(self.judge())
    }

    fn judge(&mut self) -> Verdict {
        let tokens = self.tokens();
        if tokens < u64::from(self.thresholds.after_tokens) {
            return Verdict::Warming;
        }
        let (accept_length, accept_rate) = (self.accept_length(), self.accept_rate());
        let reason = if accept_length < self.thresholds.min_accept_length {
            AnomalyReason::LowAcceptLength
        } else if accept_rate > self.thresholds.max_accept_rate {
            AnomalyReason::HighAcceptRate
        } else {
            return Verdict::Healthy;
        };
        let a = Anomaly {
            reason,
            accept_length,
            accept_rate,
            tokens,
        };
        self.tripped = Some(a);
        Verdict::Anomaly(a)
    }

    /// Tokens emitted so far (`accepted + 1` per step).
    pub fn tokens(&self) -> u64 {
        self.accepted + self.steps
    }

    /// Verification steps so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Mean accept length (tokens per step); 0.0 before the first step.
    pub fn accept_length(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.tokens() as f64 / self.steps as f64
        }
    }

    /// Accept rate (accepted / proposed draft tokens); 0.0 before the first step.
    pub fn accept_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }

    /// The anomaly, once tripped.
    pub fn anomaly(&self) -> Option<Anomaly> {
        self.tripped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn guard(after: u32) -> SpecGuard {
        SpecGuard::new(Thresholds {
            after_tokens: after,
            ..Thresholds::SEED_004
        })
    }

    /// Feeds `n` steps of (`proposed`, `accepted`); returns the last verdict.
    fn feed(g: &mut SpecGuard, n: usize, proposed: u32, accepted: u32) -> Verdict {
        let mut v = Verdict::Warming;
        for _ in 0..n {
            v = g.observe(proposed, accepted).unwrap();
        }
        v
    }

    #[test]
    fn a_rejecting_draft_trips_low_accept_length_only_after_the_warmup() {
        let mut g = guard(128);
        // Every draft token rejected: one token per step, accept length 1.0.
        assert_eq!(feed(&mut g, 127, 4, 0), Verdict::Warming);
        let Verdict::Anomaly(a) = g.observe(4, 0).unwrap() else {
            panic!("not tripped at 128 tokens")
        };
        assert_eq!(a.reason, AnomalyReason::LowAcceptLength);
        assert_eq!(a.tokens, 128);
        assert!((a.accept_length - 1.0).abs() < 1e-12);
        assert!(a.accept_rate.abs() < 1e-12);
        assert_eq!(a.reason.code(), "low_accept_length");
    }

    #[test]
    fn an_accept_all_draft_trips_high_accept_rate() {
        let mut g = guard(128);
        // 4 of 4 accepted: 5 tokens per step; 25 steps = 125 tokens, 26 = 130.
        assert_eq!(feed(&mut g, 25, 4, 4), Verdict::Warming);
        let Verdict::Anomaly(a) = g.observe(4, 4).unwrap() else {
            panic!("not tripped")
        };
        assert_eq!(a.reason, AnomalyReason::HighAcceptRate);
        assert_eq!(a.tokens, 130);
        assert!((a.accept_rate - 1.0).abs() < 1e-12);
        assert!((a.accept_length - 5.0).abs() < 1e-12);
        assert_eq!(a.reason.code(), "high_accept_rate");
    }

    #[test]
    fn a_healthy_draft_stays_healthy() {
        let mut g = guard(128);
        // Alternating 2 and 3 of 4 accepted: accept length 3.5, rate 0.625.
        for i in 0..200 {
            let v = g.observe(4, 2 + i % 2).unwrap();
            assert!(!matches!(v, Verdict::Anomaly(_)), "{v:?} at step {i}");
        }
        assert_eq!(g.observe(4, 2).unwrap(), Verdict::Healthy);
        assert!(g.anomaly().is_none());
    }

    #[test]
    fn exactly_at_the_thresholds_is_healthy() {
        // Accept length exactly 1.4: 2 of 5 steps accept one token (7 tokens / 5 steps).
        let mut g = SpecGuard::new(Thresholds {
            after_tokens: 7,
            ..Thresholds::SEED_004
        });
        for accepted in [1, 0, 1, 0] {
            assert_eq!(g.observe(1, accepted).unwrap(), Verdict::Warming);
        }
        assert_eq!(g.observe(1, 0).unwrap(), Verdict::Healthy);
        assert!((g.accept_length() - 1.4).abs() < 1e-12);
        // One more rejecting step goes below: 8 tokens / 6 steps = 1.333.
        assert!(matches!(
            g.observe(1, 0).unwrap(),
            Verdict::Anomaly(Anomaly {
                reason: AnomalyReason::LowAcceptLength,
                ..
            })
        ));

        // Accept rate exactly 0.96: 24 of 25 accepted.
        let mut g = SpecGuard::new(Thresholds {
            after_tokens: 1,
            max_accept_rate: 0.96,
            min_accept_length: 1.0,
        });
        assert_eq!(g.observe(25, 24).unwrap(), Verdict::Healthy);
        assert!((g.accept_rate() - 0.96).abs() < 1e-12);
        // 49 of 50: 0.98.
        assert!(matches!(
            g.observe(25, 25).unwrap(),
            Verdict::Anomaly(Anomaly {
                reason: AnomalyReason::HighAcceptRate,
                ..
            })
        ));
    }

    #[test]
    fn the_first_anomaly_latches() {
        let mut g = guard(4);
        let Verdict::Anomaly(first) = feed(&mut g, 4, 2, 0) else {
            panic!("not tripped")
        };
        // Healthy steps afterwards do not clear it, nor change what it reports.
        assert_eq!(feed(&mut g, 100, 2, 1), Verdict::Anomaly(first));
        assert_eq!(g.anomaly(), Some(first));
        assert_eq!(g.steps(), 4);
    }

    #[test]
    fn malformed_steps_are_typed_errors_and_not_recorded() {
        let mut g = guard(1);
        assert_eq!(
            g.observe(2, 3),
            Err(StepError::AcceptedExceedsProposed {
                proposed: 2,
                accepted: 3
            })
        );
        assert_eq!(g.observe(0, 0), Err(StepError::NothingProposed));
        assert_eq!(g.steps(), 0);
        assert_eq!(g.tokens(), 0);
        assert!(g.accept_length().abs() < f64::EPSILON);
    }

    #[test]
    fn thresholds_come_from_the_config() {
        let c = config::SpecGuard {
            min_accept_length: 1.4,
            max_accept_rate: 0.96,
            after_tokens: 128,
            retry_budget: 2,
        };
        assert_eq!(Thresholds::from(&c), Thresholds::SEED_004);
    }

    proptest! {
        /// The statistics are the definitions, nothing is judged before `after_tokens`, and a
        /// verdict is an anomaly exactly when a threshold is crossed strictly.
        #[test]
        fn verdicts_follow_the_definitions(
            after in 1u32..300,
            steps in proptest::collection::vec((1u32..9, 0u32..9), 1..200),
        ) {
            let mut g = guard(after);
            let (mut n, mut prop, mut acc) = (0u64, 0u64, 0u64);
            for (proposed, a) in steps {
                let accepted = a.min(proposed);
                let v = g.observe(proposed, accepted).unwrap();
                n += 1;
                prop += u64::from(proposed);
                acc += u64::from(accepted);
                let tokens = acc + n;
                prop_assert_eq!(g.tokens(), tokens);
                let len = tokens as f64 / n as f64;
                let rate = acc as f64 / prop as f64;
                let expect = if tokens < u64::from(after) {
                    Verdict::Warming
                } else if len < 1.4 {
                    Verdict::Anomaly(Anomaly {
                        reason: AnomalyReason::LowAcceptLength,
                        accept_length: len,
                        accept_rate: rate,
                        tokens,
                    })
                } else if rate > 0.96 {
                    Verdict::Anomaly(Anomaly {
                        reason: AnomalyReason::HighAcceptRate,
                        accept_length: len,
                        accept_rate: rate,
                        tokens,
                    })
                } else {
                    Verdict::Healthy
                };
                prop_assert_eq!(v, expect);
                if let Verdict::Anomaly(_) = expect {
                    // Latched: a further (healthy) step is not recorded and repeats the verdict.
                    prop_assert_eq!(g.observe(4, 2).unwrap(), expect);
                    prop_assert_eq!(g.steps(), n);
                    break;
                }
            }
        }
    }
}
