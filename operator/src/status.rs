//! Conditions, pure: build a condition list where `lastTransitionTime` moves only when a
//! condition's status flips, so recomputing the same facts yields an equal status and no write.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// One condition as the controller decided it this time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    /// Condition type (`tandem_crds::conditions`).
    pub type_: &'static str,
    /// True or false.
    pub status: bool,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

impl Decided {
    /// Shorthand constructor.
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason: reason.into(),
            message: message.into(),
        }
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
            let status = if d.status { "True" } else { "False" };
            let since = previous
                .iter()
                .find(|c| c.type_ == d.type_ && c.status == status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or(Time(now));
            Condition {
                type_: d.type_.into(),
                status: status.into(),
                reason: d.reason.clone(),
                message: d.message.clone(),
                observed_generation: generation,
                last_transition_time: since,
            }
        })
        .collect()
}

/// Whether `type_` is True in `list`.
pub fn is_true(list: &[Condition], type_: &str) -> bool {
    list.iter().any(|c| c.type_ == type_ && c.status == "True")
}

/// The condition of `type_` in `list`.
pub fn find<'a>(list: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    list.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_on_a_flip() {
        let t0 = Timestamp::from_second(1_800_000_000).unwrap();
        let t1 = Timestamp::from_second(1_800_000_100).unwrap();
        let d = [Decided::new("Ready", false, "Starting", "0/1")];
        let a = conditions(&[], &d, Some(1), t0);
        let d2 = [Decided::new("Ready", false, "Starting", "still 0/1")];
        let b = conditions(&a, &d2, Some(1), t1);
        assert_eq!(
            b[0].last_transition_time,
            Time(t0),
            "same status keeps the time"
        );
        let d3 = [Decided::new("Ready", true, "AllGroupsReady", "1/1")];
        let c = conditions(&b, &d3, Some(1), t1);
        assert_eq!(c[0].last_transition_time, Time(t1));
        assert!(is_true(&c, "Ready"));
        // Recomputing the same facts gives an equal list: no status write.
        assert_eq!(
            conditions(&c, &d3, Some(1), t1 + jiff::SignedDuration::from_secs(9)),
            c
        );
    }
}
