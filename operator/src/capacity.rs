//! The scaling transaction of a DecodePool and its PrefillPool over time, pure (DESIGN §2
//! `budget`, issue 3 "InsufficientCapacity").
//!
//! [`crate::scaling::plan`] decides whether a move between two count pairs fits the GPU budget
//! and splits it into shrink-then-grow steps. This module walks those steps across reconciles,
//! with the state persisted in `DecodePool.status.scaling`:
//!
//! - `applied` — the counts both pools are rendered with now;
//! - `scheduled` — the last applied counts whose pods were all scheduled (the rollback point);
//! - `appliedAt` — when `applied` last changed;
//! - `refused` — a target refused (over budget, or rolled back as unschedulable), not retried
//!   until the user changes the target.
//!
//! Rules: a grow step waits until the previous shrink is observed (the extra groups are gone); a
//! scale-up whose pods stay `Unschedulable` past `unschedulableDeadlineSeconds` after `appliedAt`
//! rolls back to `scheduled` (unless nothing was ever fully scheduled: then the counts stay and the
//! condition says so); a scale-down is applied at once, also while a scale-up is pending.

use jiff::{SignedDuration, Timestamp};
use tandem_crds::{GroupCounts, PdRatio, ScalingStatus};

use crate::scaling::{self, Counts, GroupSizes, Transition};

/// What the controller observed this time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityObservation {
    /// Group StatefulSets that exist now, per pool.
    pub existing: Counts,
    /// Some pod of either pool has `PodScheduled=False` with reason `Unschedulable`.
    pub unschedulable: bool,
    /// Every pod of the applied counts exists and is scheduled.
    pub all_scheduled: bool,
}

/// What happened to the transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapacityOutcome {
    /// `applied` equals the target and nothing is pending.
    Steady,
    /// A scale-up is applied and its pods are not all scheduled yet (within the deadline).
    Pending,
    /// `applied` moved one step.
    Step {
        /// Counts before.
        from: Counts,
        /// Counts now.
        to: Counts,
    },
    /// The previous shrink step has not been observed yet; the grow step waits.
    WaitingForShrink,
    /// The target needs more GPUs than the budget; nothing changed.
    OverBudget {
        /// GPUs the target needs.
        needed: u64,
        /// The budget.
        budget: u64,
    },
    /// The scale-up stayed unschedulable past the deadline and was rolled back.
    RolledBack {
        /// The counts that could not be scheduled.
        from: Counts,
        /// The last fully scheduled counts.
        to: Counts,
    },
    /// The first counts ever applied stayed unschedulable past the deadline. There is no
    /// earlier fully scheduled state to return to (rolling back would remove every group), so
    /// the counts are kept and reported.
    Unschedulable {
        /// The applied counts.
        counts: Counts,
    },
    /// The target was refused before and has not changed.
    Refused,
}

/// Inputs of one decision.
#[derive(Debug, Clone, Copy)]
pub struct CapacityInput<'a> {
    /// Decode groups asked (`spec.replicas`).
    pub decode_replicas: u32,
    /// The P:D ratio.
    pub ratio: PdRatio,
    /// GPUs per group.
    pub sizes: GroupSizes,
    /// `budget.gpus`, if set.
    pub budget: Option<u64>,
    /// `unschedulableDeadlineSeconds`.
    pub deadline_seconds: i64,
    /// Persisted state (`None` on the first reconcile).
    pub status: Option<&'a ScalingStatus>,
    /// Observed state.
    pub observed: CapacityObservation,
    /// Now.
    pub now: Timestamp,
}

/// Counts from the persisted form (negative values read as 0).
pub fn counts(g: GroupCounts) -> Counts {
    Counts {
        decode: u32::try_from(g.decode).unwrap_or(0),
        prefill: u32::try_from(g.prefill).unwrap_or(0),
    }
}

/// Counts into the persisted form.
pub fn group_counts(c: Counts) -> GroupCounts {
    GroupCounts {
        decode: i32::try_from(c.decode).unwrap_or(i32::MAX),
        prefill: i32::try_from(c.prefill).unwrap_or(i32::MAX),
    }
}

/// Decides the next state of the transaction: the new persisted state and what happened.
pub fn decide(input: &CapacityInput<'_>) -> (ScalingStatus, CapacityOutcome) {
    let target = Counts::for_decode(input.decode_replicas, input.ratio);
    let mut st = input.status.cloned().unwrap_or_else(|| ScalingStatus {
        applied: group_counts(input.observed.existing),
        scheduled: group_counts(input.observed.existing),
        applied_at: None,
        refused: None,
    });
    let applied = counts(st.applied);
    if input.observed.all_scheduled {
        st.scheduled = st.applied;
    }
    let refused = st.refused.map(counts);
    if refused == Some(target) {
        return (st, CapacityOutcome::Refused);
    }
    st.refused = None;
    if applied != target {
        return match scaling::plan(applied, target, input.sizes, input.budget) {
            Transition::Steady => (st, CapacityOutcome::Steady),
            Transition::OverBudget { needed, budget } => {
                st.refused = Some(group_counts(target));
                (st, CapacityOutcome::OverBudget { needed, budget })
            }
            Transition::Admitted(steps) => {
                let next = steps[0];
                let grows = next.decode > applied.decode || next.prefill > applied.prefill;
                let shrink_pending = input.observed.existing.decode > applied.decode
                    || input.observed.existing.prefill > applied.prefill;
                if grows && shrink_pending {
                    return (st, CapacityOutcome::WaitingForShrink);
                }
                st.applied = group_counts(next);
                st.applied_at = Some(input.now.to_string());
                let scheduled = counts(st.scheduled);
                if next.decode <= scheduled.decode && next.prefill <= scheduled.prefill {
                    // A shrink below the rollback point moves the rollback point with it.
                    st.scheduled = st.applied;
                }
                (
                    st,
                    CapacityOutcome::Step {
                        from: applied,
                        to: next,
                    },
                )
            }
        };
    }
    let scheduled = counts(st.scheduled);
    let grew = applied.decode > scheduled.decode || applied.prefill > scheduled.prefill;
    if !grew || input.observed.all_scheduled {
        return (st, CapacityOutcome::Steady);
    }
    let since = st
        .applied_at
        .as_deref()
        .and_then(|t| t.parse::<Timestamp>().ok())
        .unwrap_or(input.now);
    let elapsed = input.now.duration_since(since);
    if input.observed.unschedulable && elapsed >= SignedDuration::from_secs(input.deadline_seconds)
    {
        if scheduled.decode == 0 && scheduled.prefill == 0 {
            // Nothing was ever fully scheduled: rolling back would delete the whole stack.
            return (st, CapacityOutcome::Unschedulable { counts: applied });
        }
        st.applied = st.scheduled;
        st.applied_at = Some(input.now.to_string());
        st.refused = Some(group_counts(target));
        return (
            st,
            CapacityOutcome::RolledBack {
                from: applied,
                to: scheduled,
            },
        );
    }
    (st, CapacityOutcome::Pending)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: GroupSizes = GroupSizes {
        decode: 1,
        prefill: 1,
    };

    fn obs(decode: u32, prefill: u32, unschedulable: bool, all: bool) -> CapacityObservation {
        CapacityObservation {
            existing: Counts { decode, prefill },
            unschedulable,
            all_scheduled: all,
        }
    }

    fn input<'a>(
        decode: u32,
        status: Option<&'a ScalingStatus>,
        observed: CapacityObservation,
        now: Timestamp,
    ) -> CapacityInput<'a> {
        CapacityInput {
            decode_replicas: decode,
            ratio: PdRatio::new(2, 1).unwrap(),
            sizes: SIZES,
            budget: Some(12),
            deadline_seconds: 60,
            status,
            observed,
            now,
        }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn first_reconcile_applies_the_target() {
        let (st, out) = decide(&input(2, None, obs(0, 0, false, true), t(0)));
        assert_eq!(
            counts(st.applied),
            Counts {
                decode: 2,
                prefill: 4
            }
        );
        assert!(matches!(out, CapacityOutcome::Step { .. }));
    }

    #[test]
    fn unschedulable_scale_up_rolls_back_after_the_deadline_only() {
        let (st, _) = decide(&input(2, None, obs(0, 0, false, true), t(0)));
        // Now everything scheduled: the rollback point is 2/4.
        let (st, out) = decide(&input(2, Some(&st), obs(2, 4, false, true), t(5)));
        assert_eq!(out, CapacityOutcome::Steady);
        assert_eq!(
            counts(st.scheduled),
            Counts {
                decode: 2,
                prefill: 4
            }
        );
        // Scale to 4/8 (12 GPUs = budget): pods stay unschedulable.
        let (st, out) = decide(&input(4, Some(&st), obs(2, 4, false, false), t(10)));
        assert!(matches!(out, CapacityOutcome::Step { .. }));
        let (st2, out) = decide(&input(4, Some(&st), obs(4, 8, true, false), t(30)));
        assert_eq!(out, CapacityOutcome::Pending, "within the deadline");
        let (st3, out) = decide(&input(4, Some(&st2), obs(4, 8, true, false), t(71)));
        assert_eq!(
            out,
            CapacityOutcome::RolledBack {
                from: Counts {
                    decode: 4,
                    prefill: 8
                },
                to: Counts {
                    decode: 2,
                    prefill: 4
                }
            }
        );
        assert_eq!(
            counts(st3.applied),
            Counts {
                decode: 2,
                prefill: 4
            }
        );
        // Not retried while the target stays the same.
        let (_, out) = decide(&input(4, Some(&st3), obs(2, 4, false, true), t(200)));
        assert_eq!(out, CapacityOutcome::Refused);
        // A new target is tried again.
        let (_, out) = decide(&input(3, Some(&st3), obs(2, 4, false, true), t(201)));
        assert!(matches!(out, CapacityOutcome::Step { .. }));
    }

    #[test]
    fn scale_down_applies_while_a_scale_up_is_pending() {
        let (st, _) = decide(&input(2, None, obs(0, 0, false, true), t(0)));
        let (st, _) = decide(&input(2, Some(&st), obs(2, 4, false, true), t(1)));
        let (st, _) = decide(&input(4, Some(&st), obs(2, 4, false, false), t(2)));
        // Pending and unschedulable, user scales down to 1.
        let (st, out) = decide(&input(1, Some(&st), obs(4, 8, true, false), t(3)));
        assert_eq!(
            out,
            CapacityOutcome::Step {
                from: Counts {
                    decode: 4,
                    prefill: 8
                },
                to: Counts {
                    decode: 1,
                    prefill: 2
                }
            }
        );
        assert_eq!(
            counts(st.scheduled),
            Counts {
                decode: 1,
                prefill: 2
            }
        );
    }

    #[test]
    fn a_first_start_that_never_schedules_is_reported_not_deleted() {
        let (st, _) = decide(&input(2, None, obs(0, 0, false, true), t(0)));
        let (st2, out) = decide(&input(2, Some(&st), obs(2, 4, true, false), t(61)));
        assert_eq!(
            out,
            CapacityOutcome::Unschedulable {
                counts: Counts {
                    decode: 2,
                    prefill: 4
                }
            }
        );
        assert_eq!(st2.applied, st.applied);
    }

    #[test]
    fn over_budget_target_is_refused_without_change() {
        let (st, _) = decide(&input(2, None, obs(0, 0, false, true), t(0)));
        let (st2, out) = decide(&input(5, Some(&st), obs(2, 4, false, true), t(1)));
        assert_eq!(
            out,
            CapacityOutcome::OverBudget {
                needed: 15,
                budget: 12
            }
        );
        assert_eq!(st2.applied, st.applied);
    }

    #[test]
    fn grow_waits_for_the_shrink_to_be_observed() {
        let sizes = GroupSizes {
            decode: 2,
            prefill: 1,
        };
        let st = ScalingStatus {
            applied: GroupCounts {
                decode: 2,
                prefill: 8,
            },
            scheduled: GroupCounts {
                decode: 2,
                prefill: 8,
            },
            applied_at: None,
            refused: None,
        };
        let mut i = input(3, Some(&st), obs(2, 8, false, true), t(0));
        i.sizes = sizes;
        i.ratio = PdRatio::new(2, 1).unwrap();
        // 3 decode × 2 GPUs + 6 prefill = 12: shrink prefill to 6 first.
        let (st, out) = decide(&i);
        assert_eq!(
            out,
            CapacityOutcome::Step {
                from: Counts {
                    decode: 2,
                    prefill: 8
                },
                to: Counts {
                    decode: 2,
                    prefill: 6
                }
            }
        );
        let mut i = input(3, Some(&st), obs(2, 8, false, true), t(1));
        i.sizes = sizes;
        assert_eq!(decide(&i).1, CapacityOutcome::WaitingForShrink);
        let mut i = input(3, Some(&st), obs(2, 6, false, true), t(2));
        i.sizes = sizes;
        assert!(matches!(decide(&i).1, CapacityOutcome::Step { .. }));
    }

    proptest::proptest! {
        /// Over any sequence of targets and observations, with a world that catches up with
        /// the applied counts only now and then (a shrink is observed late), the groups that can
        /// exist at once — the old ones not yet gone plus the newly applied ones — never need
        /// more GPUs than the budget.
        #[test]
        fn existing_and_applied_together_stay_within_the_budget(
            ops in proptest::collection::vec(
                (
                    (0u32..10, 1u32..5, 1u32..4),
                    proptest::bool::ANY,
                    proptest::bool::ANY,
                    0i64..120,
                    proptest::bool::ANY,
                ),
                1..40,
            ),
            sd in 1u32..4, sp in 1u32..4, budget in 2u64..60,
        ) {
            let sizes = GroupSizes { decode: sd, prefill: sp };
            let mut st: Option<ScalingStatus> = None;
            let mut existing = Counts { decode: 0, prefill: 0 };
            let mut now = 0;
            for ((decode, p, d), unschedulable, all_scheduled, dt, caught_up) in ops {
                now += dt;
                let input = CapacityInput {
                    decode_replicas: decode,
                    ratio: PdRatio::new(p, d).unwrap(),
                    sizes,
                    budget: Some(budget),
                    deadline_seconds: 60,
                    status: st.as_ref(),
                    observed: CapacityObservation { existing, unschedulable, all_scheduled },
                    now: t(now),
                };
                let (next, _) = decide(&input);
                let applied = counts(next.applied);
                let together = Counts {
                    decode: applied.decode.max(existing.decode),
                    prefill: applied.prefill.max(existing.prefill),
                };
                proptest::prop_assert!(
                    together.gpus(sizes) <= budget,
                    "existing {existing:?} + applied {applied:?} = {} GPUs > {budget}",
                    together.gpus(sizes)
                );
                if caught_up {
                    existing = applied;
                }
                st = Some(next);
            }
        }
    }
}
