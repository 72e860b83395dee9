//! Prometheus counters of registration (seed 000: "Draft L3 disabled metric"; DESIGN contract 2).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Label set: the pool role (bounded: target, draft, indexer).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabel {
    /// Pool role.
    pub role: String,
}

/// Registration counters. Cheap to clone (the counters are shared).
#[derive(Debug, Clone, Default)]
pub struct RegistrationMetrics {
    /// Pools whose L3 registration failed and fell back to L2 (`tandem_l3_fallback_total{role}`).
    pub fallback: Family<RoleLabel, Counter>,
    /// Transactions rolled back (`tandem_registration_rollbacks_total{role}`).
    pub rollbacks: Family<RoleLabel, Counter>,
    /// Registrations quarantined because their undo failed (`tandem_registration_quarantined_total{role}`).
    pub quarantined: Family<RoleLabel, Counter>,
    /// Transactions committed (`tandem_registration_commits_total{role}`).
    pub commits: Family<RoleLabel, Counter>,
}

impl RegistrationMetrics {
    /// Adds the counters to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tandem_l3_fallback",
            "Pools whose L3 registration failed and that run on L2 only",
            self.fallback.clone(),
        );
        registry.register(
            "tandem_registration_rollbacks",
            "Registration transactions rolled back",
            self.rollbacks.clone(),
        );
        registry.register(
            "tandem_registration_quarantined",
            "Registrations quarantined after a failed undo",
            self.quarantined.clone(),
        );
        registry.register(
            "tandem_registration_commits",
            "Registration transactions committed",
            self.commits.clone(),
        );
    }

    /// The label for `role`.
    pub fn label(role: crate::memory::pool::PoolRole) -> RoleLabel {
        RoleLabel {
            role: role.as_str().to_owned(),
        }
    }
}
