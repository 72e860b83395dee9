//! The P:D ratio and GPU-budget transactions (DESIGN §2 `DecodePool.prefill`, `budget`).
//!
//! A DecodePool with `replicas = d` and ratio `P:D` wants `ceil(d × P / D)` prefill groups. A change
//! of either count is admitted as one transaction: if the target exceeds the budget it is refused
//! whole; otherwise it is applied as at most two steps, shrinks first, so no intermediate state
//! ever holds more GPUs than both the start and the end (and hence never more than the budget).

use tandem_crds::PdRatio;

/// Group counts of a paired decode and prefill pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Decode groups.
    pub decode: u32,
    /// Prefill groups.
    pub prefill: u32,
}

/// GPUs per group of each pool (`tensor × context`; one GPU per pod).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSizes {
    /// GPUs per decode group.
    pub decode: u32,
    /// GPUs per prefill group.
    pub prefill: u32,
}

impl Counts {
    /// The counts a DecodePool with `decode` groups wants under `ratio`.
    pub fn for_decode(decode: u32, ratio: PdRatio) -> Self {
        Self {
            decode,
            prefill: ratio.prefill_replicas_for(decode),
        }
    }

    /// GPUs these counts occupy.
    pub fn gpus(&self, sizes: GroupSizes) -> u64 {
        u64::from(self.decode) * u64::from(sizes.decode)
            + u64::from(self.prefill) * u64::from(sizes.prefill)
    }
}

/// The outcome of asking to move from `current` to `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Nothing to do.
    Steady,
    /// Apply these steps in order; the last equals the target. Each step is applied (and its
    /// shrink observed) before the next.
    Admitted(Vec<Counts>),
    /// The target needs `needed` GPUs but the budget is `budget`: nothing changes.
    OverBudget {
        /// GPUs the target needs.
        needed: u64,
        /// The budget.
        budget: u64,
    },
}

/// Plans the move from `current` to `target` within `budget` (None = unlimited).
///
/// Shrink before grow: the first step takes the smaller count of each pool, the second the
/// target. When `current` itself is over budget (the budget was lowered) a target that uses fewer
/// GPUs than `current` is still admitted, since no step then raises usage.
pub fn plan(current: Counts, target: Counts, sizes: GroupSizes, budget: Option<u64>) -> Transition {
    if current == target {
        return Transition::Steady;
    }
    let needed = target.gpus(sizes);
    if let Some(budget) = budget
        && needed > budget
        && needed > current.gpus(sizes)
    {
        return Transition::OverBudget { needed, budget };
    }
    let shrink = Counts {
        decode: current.decode.min(target.decode),
        prefill: current.prefill.min(target.prefill),
    };
    let mut steps = Vec::with_capacity(2);
    if shrink != current && shrink != target {
        steps.push(shrink);
    }
    steps.push(target);
    Transition::Admitted(steps)
}

/// The smallest budget that holds one group of each pool (checked against the PrefillPool's group
/// size, which the DecodePool's CEL rule cannot see).
pub fn minimum_budget(sizes: GroupSizes) -> u64 {
    u64::from(sizes.decode) + u64::from(sizes.prefill)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn four_to_one() {
        let r = PdRatio::new(4, 1).unwrap();
        assert_eq!(
            Counts::for_decode(2, r),
            Counts {
                decode: 2,
                prefill: 8
            }
        );
    }

    #[test]
    fn at_budget_a_ratio_change_shrinks_first() {
        let sizes = GroupSizes {
            decode: 2,
            prefill: 1,
        };
        // 2 decode (4 GPUs) + 8 prefill (8 GPUs) = 12 = budget. Ratio 4:1 → 2:1 and decode 2 → 3:
        // target 3 decode + 6 prefill = 12. Growing decode first would need 14.
        let cur = Counts {
            decode: 2,
            prefill: 8,
        };
        let tgt = Counts {
            decode: 3,
            prefill: 6,
        };
        let Transition::Admitted(steps) = plan(cur, tgt, sizes, Some(12)) else {
            panic!()
        };
        assert_eq!(
            steps,
            vec![
                Counts {
                    decode: 2,
                    prefill: 6
                },
                tgt
            ]
        );
    }

    #[test]
    fn over_budget_is_refused_whole() {
        let sizes = GroupSizes {
            decode: 1,
            prefill: 1,
        };
        let t = plan(
            Counts {
                decode: 1,
                prefill: 4,
            },
            Counts {
                decode: 2,
                prefill: 8,
            },
            sizes,
            Some(8),
        );
        assert_eq!(
            t,
            Transition::OverBudget {
                needed: 10,
                budget: 8
            }
        );
    }

    proptest! {
        /// No step of an admitted transition exceeds the budget, or the larger of start and end
        /// usage when there is no budget; the last step is the target.
        #[test]
        fn steps_never_exceed_the_budget(
            cd in 0u32..20, cp in 0u32..40, td in 0u32..20, tp in 0u32..40,
            sd in 1u32..8, sp in 1u32..8, budget in prop::option::of(1u64..400),
        ) {
            let sizes = GroupSizes { decode: sd, prefill: sp };
            let (cur, tgt) = (Counts { decode: cd, prefill: cp }, Counts { decode: td, prefill: tp });
            match plan(cur, tgt, sizes, budget) {
                Transition::Steady => prop_assert_eq!(cur, tgt),
                Transition::OverBudget { needed, budget: b } => {
                    prop_assert_eq!(Some(b), budget);
                    prop_assert!(needed > b && needed > cur.gpus(sizes));
                }
                Transition::Admitted(steps) => {
                    prop_assert_eq!(*steps.last().unwrap(), tgt);
                    let ceiling = cur.gpus(sizes).max(tgt.gpus(sizes));
                    for s in &steps {
                        prop_assert!(s.gpus(sizes) <= ceiling);
                        if let Some(b) = budget {
                            // Within budget, unless the start already exceeded it (budget lowered).
                            prop_assert!(s.gpus(sizes) <= b.max(cur.gpus(sizes)));
                            prop_assert!(s.gpus(sizes) <= b || s.gpus(sizes) <= cur.gpus(sizes));
                        }
                    }
                }
            }
        }
    }
}
