//! Conditions, pure: build a condition list where `lastTransitionTime` moves only when a
//! condition's status flips, so recomputing the same facts yields an equal status and no write.
//!
//! Conditions are typed ([`ConditionType`], [`ConditionStatus`], [`Reason`] from
//! `tandem_crds::conditions`); the strings of `metav1.Condition` are written and read only here.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
pub use tandem_crds::conditions::{ConditionStatus, ConditionType, Reason};

/// One condition as the controller decided it this time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    /// Condition type.
    pub type_: ConditionType,
    /// True or False (the operator never writes Unknown).
    pub status: ConditionStatus,
    /// CamelCase reason.
    pub reason: Reason,
    /// Human-readable message.
    pub message: String,
}

impl Decided {
    /// A condition with status `status`.
    pub fn new(
        type_: ConditionType,
        status: ConditionStatus,
        reason: Reason,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }

    /// `type_` True.
    pub fn yes(type_: ConditionType, reason: Reason, message: impl Into<String>) -> Self {
        Self::new(type_, ConditionStatus::True, reason, message)
    }

    /// `type_` False.
    pub fn no(type_: ConditionType, reason: Reason, message: impl Into<String>) -> Self {
        Self::new(type_, ConditionStatus::False, reason, message)
    }

    /// The decided form of a written condition of type `type_`; `None` when its reason is not one
    /// this version writes.
    pub fn read(type_: ConditionType, c: &Condition) -> Option<Self> {
        Some(Self::new(
            type_,
            ConditionStatus::parse(&c.status),
            Reason::parse(&c.reason)?,
            c.message.clone(),
        ))
    }

    /// Whether this condition is True.
    pub fn is_true(&self) -> bool {
        self.status.is_true()
    }
}

/// The condition list for `decided`, in that order, keeping the transition time of every
/// condition of `previous` whose status did not change.
pub fn conditions(
    previous: &[Condition],
    decided: &[Decided],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    decided
        .iter()
        .map(|d| {
            let since = find(previous, d.type_)
                .filter(|c| ConditionStatus::parse(&c.status) == d.status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or(Time(now));
            Condition {
                type_: d.type_.as_str().into(),
                status: d.status.as_str().into(),
                reason: d.reason.as_str().into(),
                message: d.message.clone(),
                observed_generation: generation,
                last_transition_time: since,
            }
        })
        .collect()
}

/// The condition of `type_` in `list`.
pub fn find(list: &[Condition], type_: ConditionType) -> Option<&Condition> {
    list.iter().find(|c| c.type_ == type_.as_str())
}

/// The status of `type_` in `list` (`None` when absent).
pub fn status_of(list: &[Condition], type_: ConditionType) -> Option<ConditionStatus> {
    find(list, type_).map(|c| ConditionStatus::parse(&c.status))
}

/// Whether `type_` is True in `list`.
pub fn is_true(list: &[Condition], type_: ConditionType) -> bool {
    status_of(list, type_).is_some_and(ConditionStatus::is_true)
}

/// The decided form of `type_` in `list`, when present with a known reason.
pub fn read(list: &[Condition], type_: ConditionType) -> Option<Decided> {
    find(list, type_).and_then(|c| Decided::read(type_, c))
}

/// True when `decided` is True and `previous` did not already hold it True with the same reason:
/// the moment for a one-time event.
pub fn newly_true(previous: &[Condition], decided: &Decided) -> bool {
    decided.is_true()
        && !read(previous, decided.type_).is_some_and(|p| p.is_true() && p.reason == decided.reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_on_a_flip() {
        let t0 = Timestamp::from_second(1_800_000_000).unwrap();
        let t1 = Timestamp::from_second(1_800_000_100).unwrap();
        let ready = ConditionType::Ready;
        let d = [Decided::no(ready, Reason::GroupsNotReady, "0/1")];
        let a = conditions(&[], &d, Some(1), t0);
        let d2 = [Decided::no(ready, Reason::GroupsNotReady, "still 0/1")];
        let b = conditions(&a, &d2, Some(1), t1);
        assert_eq!(
            b[0].last_transition_time,
            Time(t0),
            "same status keeps the time"
        );
        let d3 = [Decided::yes(ready, Reason::AllGroupsReady, "1/1")];
        let c = conditions(&b, &d3, Some(1), t1);
        assert_eq!(c[0].last_transition_time, Time(t1));
        assert!(is_true(&c, ready));
        assert_eq!(c[0].status, "True");
        assert_eq!(read(&c, ready), Some(d3[0].clone()));
        // Recomputing the same facts gives an equal list: no status write.
        assert_eq!(
            conditions(&c, &d3, Some(1), t1 + jiff::SignedDuration::from_secs(9)),
            c
        );
    }

    #[test]
    fn newly_true_only_on_a_flip_or_a_new_reason() {
        let t = Timestamp::from_second(1_800_000_000).unwrap();
        let ic = ConditionType::InsufficientCapacity;
        let over = Decided::yes(ic, Reason::OverBudget, "x");
        assert!(newly_true(&[], &over));
        let written = conditions(&[], std::slice::from_ref(&over), None, t);
        assert!(
            !newly_true(&written, &over),
            "already True with that reason"
        );
        let unsched = Decided::yes(ic, Reason::Unschedulable, "y");
        assert!(newly_true(&written, &unsched), "a new reason is news");
        assert!(!newly_true(
            &[],
            &Decided::no(ic, Reason::WithinCapacity, "")
        ));
    }
}
