//! Names and labels of the objects the operator creates (DESIGN §4).
//!
//! Labels: the `app.kubernetes.io/*` set plus `serving.tandem.dev/{pool,role,group,revision}`.
//! Names: a pool `p` has StatefulSets `p-g0, p-g1, …` (one per group), a headless Service `p-peers`,
//! a ConfigMap `p-config`; a DecodePool also has its front-door Service `p`; a CacheTier `t` has a
//! StatefulSet and headless Service `t-store` and a ConfigMap `t-config`. Pool names are at most 40
//! characters (CEL), so every derived name fits a DNS label.

use std::collections::BTreeMap;

/// The `serving.tandem.dev/{pool,role,group,revision}` label keys (defined in `tandem-crds`, which
/// e2e shares).
pub use tandem_crds::labels::{GROUP, POOL, REVISION, ROLE};
/// The field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "tandem-operator";

/// The role of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A PrefillPool's workers.
    Prefill,
    /// A DecodePool's workers.
    Decode,
    /// A CacheTier's store replicas.
    Cache,
}

impl Role {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => tandem_crds::labels::ROLE_PREFILL,
            Role::Decode => tandem_crds::labels::ROLE_DECODE,
            Role::Cache => tandem_crds::labels::ROLE_CACHE,
        }
    }
}

/// Labels that select every pod of a pool (stable across revisions).
pub fn selector(pool: &str, role: Role) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "tandem".into()),
        ("app.kubernetes.io/instance".into(), pool.into()),
        ("app.kubernetes.io/component".into(), role.as_str().into()),
        (POOL.into(), pool.into()),
        (ROLE.into(), role.as_str().into()),
    ])
}

/// Labels of an object the operator manages (selector labels plus management labels).
pub fn common(pool: &str, role: Role) -> BTreeMap<String, String> {
    let mut l = selector(pool, role);
    l.insert("app.kubernetes.io/managed-by".into(), FIELD_MANAGER.into());
    l.insert("app.kubernetes.io/part-of".into(), "tandem".into());
    l
}

/// The selector string of a pool (for the scale subresource's `status.selector`).
pub fn selector_string(pool: &str, role: Role) -> String {
    selector(pool, role)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// StatefulSet of group `index`.
pub fn group_name(pool: &str, index: u32) -> String {
    format!("{pool}-g{index}")
}

/// Headless Service for peer discovery.
pub fn peers_service(pool: &str) -> String {
    format!("{pool}-peers")
}

/// ConfigMap with the resolved worker config.
pub fn config_map(pool: &str) -> String {
    format!("{pool}-config")
}

/// StatefulSet and headless Service of a CacheTier's store.
pub fn store_name(tier: &str) -> String {
    format!("{tier}-store")
}
