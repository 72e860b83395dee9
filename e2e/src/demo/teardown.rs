//! The teardown order check (DESIGN §5): when a stack is deleted, every decode pod is gone before
//! any prefill pod is gone, and every prefill pod before any cache-store pod.
//!
//! Input: for each pod, its role and the time (ms, one clock) the pod object disappeared, as seen
//! by a pod watch started before the delete. The API server's `deletionTimestamp` has one-second
//! resolution, too coarse to order pods that drain in milliseconds, so "gone" times are used, and
//! the first `deletionTimestamp` observation per pod is recorded alongside for the report.

use serde::{Deserialize, Serialize};
use tandem_crds::labels::{ROLE_CACHE, ROLE_DECODE, ROLE_PREFILL};

/// The pod roles of a stack (label `serving.tandem.dev/role`) in teardown order.
pub const TEARDOWN_ORDER: [&str; 3] = [ROLE_DECODE, ROLE_PREFILL, ROLE_CACHE];

/// One pod's end, as observed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodEnd {
    /// Pod name.
    pub pod: String,
    /// Its role label.
    pub role: String,
    /// When the watch first saw `deletionTimestamp` set (ms), if it did.
    pub deletion_seen_ms: Option<f64>,
    /// When the watch saw the object deleted (ms); `None`: still there when the watch ended.
    pub gone_ms: Option<f64>,
}

/// The first pair of pods out of order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum TeardownViolation {
    /// A pod of a later role was gone before a pod of an earlier role.
    #[error(
        "{later_role} pod {later_pod} was gone at {later_ms:.0} ms, before {earlier_role} pod \
         {earlier_pod} (gone at {earlier_ms:.0} ms)"
    )]
    OutOfOrder {
        /// The role that must go first.
        earlier_role: String,
        /// Its last pod to go.
        earlier_pod: String,
        /// When that pod was gone.
        earlier_ms: f64,
        /// The role that must go later.
        later_role: String,
        /// Its first pod to go.
        later_pod: String,
        /// When that pod was gone.
        later_ms: f64,
    },
    /// A pod of the stack was never gone.
    #[error("{role} pod {pod} was not deleted")]
    NotGone {
        /// Pod name.
        pod: String,
        /// Its role.
        role: String,
    },
}

/// What the report shows about teardown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeardownReport {
    /// Every pod's end.
    pub pods: Vec<PodEnd>,
    /// The order held.
    pub order_held: bool,
    /// The violation, if any.
    pub violation: Option<TeardownViolation>,
}

/// Checks [`TEARDOWN_ORDER`] on `ends`: for consecutive roles present, the last pod of the earlier
/// role is gone no later than the first pod of the later role. Pods with other roles are ignored.
///
/// Errors: [`TeardownViolation::NotGone`] for a pod of an ordered role that never went,
/// [`TeardownViolation::OutOfOrder`] for the first inversion found.
pub fn check_teardown_order(ends: &[PodEnd]) -> Result<(), TeardownViolation> {
    if let Some(p) = ends
        .iter()
        .find(|p| TEARDOWN_ORDER.contains(&p.role.as_str()) && p.gone_ms.is_none())
    {
        return Err(TeardownViolation::NotGone {
            pod: p.pod.clone(),
            role: p.role.clone(),
        });
    }
    // (first gone, last gone) per role present, in teardown order.
    let spans: Vec<(&str, &PodEnd, &PodEnd)> = TEARDOWN_ORDER
        .iter()
        .filter_map(|&role| {
            let of_role = || ends.iter().filter(move |p| p.role == role);
            let key = |p: &&PodEnd| p.gone_ms.unwrap_or(f64::INFINITY);
            let first = of_role().min_by(|a, b| key(a).total_cmp(&key(b)))?;
            let last = of_role().max_by(|a, b| key(a).total_cmp(&key(b)))?;
            Some((role, first, last))
        })
        .collect();
    for w in spans.windows(2) {
        let ((er, _, elast), (lr, lfirst, _)) = (w[0], w[1]);
        let (e_ms, l_ms) = (
            elast.gone_ms.unwrap_or(f64::INFINITY),
            lfirst.gone_ms.unwrap_or(f64::INFINITY),
        );
        if l_ms < e_ms {
            return Err(TeardownViolation::OutOfOrder {
                earlier_role: er.to_owned(),
                earlier_pod: elast.pod.clone(),
                earlier_ms: e_ms,
                later_role: lr.to_owned(),
                later_pod: lfirst.pod.clone(),
                later_ms: l_ms,
            });
        }
    }
    Ok(())
}

/// [`check_teardown_order`] packaged for the report.
pub fn teardown_report(pods: Vec<PodEnd>) -> TeardownReport {
    let violation = check_teardown_order(&pods).err();
    TeardownReport {
        order_held: violation.is_none(),
        violation,
        pods,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(pod: &str, role: &str, gone: Option<f64>) -> PodEnd {
        PodEnd {
            pod: pod.into(),
            role: role.into(),
            deletion_seen_ms: gone.map(|g| g - 50.0),
            gone_ms: gone,
        }
    }

    #[test]
    fn ordered_teardown_passes() {
        let ends = [
            end("c-0", "cache", Some(900.0)),
            end("p-1", "prefill", Some(600.0)),
            end("d-0", "decode", Some(100.0)),
            end("p-0", "prefill", Some(400.0)),
            end("d-1", "decode", Some(400.0)),
            end("x", "operator", None),
        ];
        assert_eq!(check_teardown_order(&ends), Ok(()));
        assert!(teardown_report(ends.to_vec()).order_held);
    }

    #[test]
    fn negative_control_prefill_before_last_decode_fails() {
        let ends = [
            end("d-0", "decode", Some(100.0)),
            end("d-1", "decode", Some(700.0)),
            end("p-0", "prefill", Some(500.0)),
            end("c-0", "cache", Some(900.0)),
        ];
        let err = check_teardown_order(&ends).unwrap_err();
        assert!(matches!(
            &err,
            TeardownViolation::OutOfOrder { earlier_pod, later_pod, .. }
                if earlier_pod == "d-1" && later_pod == "p-0"
        ));
        let r = teardown_report(ends.to_vec());
        assert!(!r.order_held && r.violation.is_some());
    }

    #[test]
    fn cache_before_prefill_and_pods_left_behind_fail() {
        let cache_first = [
            end("p-0", "prefill", Some(500.0)),
            end("c-0", "cache", Some(100.0)),
        ];
        assert!(matches!(
            check_teardown_order(&cache_first),
            Err(TeardownViolation::OutOfOrder { .. })
        ));
        let left = [end("d-0", "decode", Some(1.0)), end("c-0", "cache", None)];
        assert!(matches!(
            check_teardown_order(&left),
            Err(TeardownViolation::NotGone { .. })
        ));
        // Decode skipped entirely (no decode pods): prefill before cache still checked.
        let no_decode = [
            end("p-0", "prefill", Some(1.0)),
            end("c-0", "cache", Some(2.0)),
        ];
        assert_eq!(check_teardown_order(&no_decode), Ok(()));
    }
}
