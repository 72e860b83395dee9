//! A pool's resolved policy, config and revision; and the revision a DecodePool and its
//! PrefillPool share.
//!
//! Workers pair only with peers whose config `revision` equals their own
//! (worker/interfaces/README.md §2), so a paired decode and prefill pool must carry the **same**
//! revision string. It is the hash of both pools' own revisions
//! ([`crate::render::workload::revision`]: config, image, resources, pod overrides, `restart.id`).
//! Any change to either pool — including the DecodePool's `restart.id` — thus rolls both, prefill
//! first (see [`crate::rollout`]).

use kube::Api;
use sha2::{Digest, Sha256};
use tandem_crds::CacheTier;
use tandem_interfaces::config::WorkerConfig;

use super::cache::{Caches, FIRST_LIST_WAIT, Read};
use super::{Context, Result};
use crate::policy::{self, MemoryPolicy, PolicyConflict, TierLookup};
use crate::render::config::{RenderError, worker_config};
use crate::render::{PoolView, workload};

/// A pool whose policy resolved and whose config rendered.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The memory policy from its tier.
    pub policy: MemoryPolicy,
    /// The worker config; its `revision` is empty until [`Resolved::with_revision`] sets the
    /// revision the pool rolls out (its pair's, its own, or the one it holds).
    pub config: WorkerConfig,
    /// The pool's own revision (not yet combined with its pair's).
    pub own_revision: String,
}

impl Resolved {
    /// This resolution with the config's `revision` set to `revision`.
    pub fn with_revision(mut self, revision: String) -> Self {
        self.config.revision = revision;
        self
    }

    /// The config's revision (empty until set).
    pub fn revision(&self) -> &str {
        &self.config.revision
    }
}

/// Why a pool cannot roll out.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Blocked {
    /// The tier contradicts the pool (condition `PolicyConflict`).
    #[error(transparent)]
    Conflict(#[from] PolicyConflict),
    /// The config cannot be rendered (condition `Degraded`, reason `RenderFailed`).
    #[error(transparent)]
    Render(#[from] RenderError),
}

/// A pool's `cacheTierRef` as the read stage found it.
#[derive(Debug, Clone, Default)]
pub enum TierRead {
    /// The pool names no tier.
    #[default]
    None,
    /// The pool names `name`; `tier` is the object, when it exists.
    Named {
        /// The referenced name.
        name: String,
        /// The tier, if found (boxed: a CacheTier is large beside the empty variant).
        tier: Option<Box<CacheTier>>,
    },
}

impl TierRead {
    /// The lookup [`resolve_with`] takes.
    pub fn lookup(&self) -> TierLookup<'_> {
        match self {
            TierRead::None => TierLookup::None,
            TierRead::Named { name, tier: None } => TierLookup::Missing(name),
            TierRead::Named {
                name,
                tier: Some(t),
            } => TierLookup::Found {
                name,
                spec: &t.spec,
                terminating: t.metadata.deletion_timestamp.is_some(),
            },
        }
    }
}

/// Reads the tier a pool names (the I/O half of resolving a pool): from the caches with
/// [`Read::Cached`] when they run, else from the API server.
///
/// # Errors
/// API failures reading the tier (a missing tier is `Named { tier: None }`, not an error);
/// [`NotListed`](super::cache::NotListed) when the caches have not listed in time.
pub async fn read_tier(ctx: &Context, view: &PoolView<'_>, read: Read) -> Result<TierRead> {
    let Some(r) = view.cache_tier_ref else {
        return Ok(TierRead::None);
    };
    let tier = match ctx.caches().filter(|_| read == Read::Cached) {
        Some(c) => {
            c.ready(FIRST_LIST_WAIT).await?;
            Caches::get(&c.tiers, view.namespace, &r.name)
        }
        None => {
            let api: Api<CacheTier> = Api::namespaced(ctx.client.clone(), view.namespace);
            api.get_opt(&r.name).await?
        }
    };
    Ok(TierRead::Named {
        name: r.name.clone(),
        tier: tier.map(Box::new),
    })
}

/// Resolves a pool against the tier read for it: its policy, config and own revision.
///
/// # Errors
/// [`Blocked`] when the tier contradicts the pool or the config cannot be rendered.
pub fn resolve(view: &PoolView<'_>, tier: &TierRead) -> std::result::Result<Resolved, Blocked> {
    resolve_with(view, tier.lookup())
}

/// Resolves a pool against a tier lookup (pure).
///
/// # Errors
/// [`Blocked`]: the tier contradicts the pool, or the config cannot be rendered.
pub fn resolve_with(
    view: &PoolView<'_>,
    lookup: TierLookup<'_>,
) -> std::result::Result<Resolved, Blocked> {
    let policy = policy::resolve(view.model, lookup)?;
    let config = worker_config(view, &policy, "")?;
    let own_revision = workload::revision(view, &config);
    Ok(Resolved {
        policy,
        config,
        own_revision,
    })
}

/// The revision shared by a DecodePool and its PrefillPool: a short hash of both own revisions.
pub fn pair_revision(prefill_own: &str, decode_own: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"prefill:");
    h.update(prefill_own.as_bytes());
    h.update(b"\ndecode:");
    h.update(decode_own.as_bytes());
    h.finalize()
        .iter()
        .take(5)
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_revision_depends_on_both_sides_in_order() {
        let a = pair_revision("p1", "d1");
        assert_eq!(a, pair_revision("p1", "d1"));
        assert_ne!(a, pair_revision("p2", "d1"));
        assert_ne!(a, pair_revision("p1", "d2"));
        assert_ne!(pair_revision("x", "y"), pair_revision("y", "x"));
        assert_eq!(a.len(), 10);
    }
}
