//! The simulated prefill engine's use of the tier calls (DESIGN §3.1 "Tiers", contract 5), for a
//! PrefillWork that carries prefix hashes:
//!
//! 1. **Lookup** the hashes: the leading L2 pages, then the L3 pages after them, are loadable.
//! 2. **Load** them into the room's first source pages and read each layer only after its
//!    `LayerLoaded` event (each event awaited is a load wait); every loaded chunk is verified byte
//!    for byte against the page's deterministic content ([`page_chunk`], the L3 object form of
//!    [`crate::roles::prefill::prefix_cache::PrefixCache::object_bytes`]): a mismatch is a corrupt
//!    loaded chunk. A `LoadFailed` keeps the pages it says loaded; the rest are computed.
//! 3. The pages after the loaded ones are computed; once the room's compute time has passed, their
//!    page content is written into staging pages and **Store**d (the worker copies them into L2
//!    and, per the write policy, L3) — a sibling room never loads KV that is not computed yet.
//!
//! The decode side verifies rows keyed by the request ([`super::chunk_spec`]), so after this the
//! engine writes the room's rows into every page as before; a loaded page costs no compute time.
//!
//! Negative controls (feature `negative-controls`; [`HitUse`]): `--skip-load-wait` reads every
//! loaded layer right after the Load call, before its event — each such read counts as
//! read-before-ready, and a layer not copied yet holds stale bytes (a corrupt loaded chunk);
//! `--regenerate-hits` computes the hit pages again instead of loading them — the KV is right, but
//! no page is loaded, so every loaded-bytes count (`loaded_pages` here, the worker's
//! `/report.engine.tiers` `pages_loaded*`) stays 0 however many hits the Lookup answered;
//! `--load-beyond-hit` asks a Load for one page past the hits (a page evicted between Lookup and
//! Load) so the load fails partway, and `--ignore-load-coverage` then reads the page the failed
//! fetch never wrote as loaded (corrupt loaded chunks).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use tokio_stream::StreamExt;

use super::Summary;
use crate::engine::content::{ChunkSpec, fill_chunk, verify_chunk};
use crate::engine_api::client::{Attached, ClientError, EngineClient, MappedPool};
use crate::engine_api::pb;
use crate::engine_api::tiers::key_of_hash;
use crate::memory::pool::PoolRole;

/// File in the socket directory where a serving simulated engine publishes its running
/// [`Summary`] ([`crate::engine_api::SIM_SUMMARY_FILE`]).
pub const SUMMARY_FILE: &str = crate::engine_api::SIM_SUMMARY_FILE;

/// Publishes `s` as [`SUMMARY_FILE`] in `socket_dir` (resolved under `$TANDEM_ROOT`); a failure is
/// logged and otherwise ignored (the figures are a report, not the protocol).
pub fn publish_summary(socket_dir: &Path, s: &Summary) {
    let dir = crate::config::resolve_path(socket_dir);
    let tmp = dir.join(format!(".{SUMMARY_FILE}.tmp"));
    let write = serde_json::to_vec(s)
        .map_err(std::io::Error::other)
        .and_then(|b| std::fs::write(&tmp, b))
        .and_then(|()| std::fs::rename(&tmp, dir.join(SUMMARY_FILE)));
    if let Err(e) = write {
        tracing::warn!(error = %e, "cannot publish the engine summary");
    }
}

/// The chunk of the page named by `hash` on `layer` of `pool`: the page's own content (keyed by its
/// page key, tokens from 0), as L2 and L3 hold it.
pub fn page_chunk(pool: &MappedPool, hash: &[u8], layer: u32) -> ChunkSpec {
    let g = pool.geometry();
    ChunkSpec {
        request: key_of_hash(hash).as_u64(),
        layer,
        first_token: 0,
        tokens: g.page_tokens,
        token_bytes: g.bytes_per_token_layer as usize,
    }
}

fn verify_layer(pool: &MappedPool, hashes: &[Vec<u8>], pages: &[u32], layer: u32, s: &mut Summary) {
    for (h, &page) in hashes.iter().zip(pages) {
        let spec = page_chunk(pool, h, layer);
        let mut buf = vec![0u8; spec.bytes()];
        s.loaded_chunks += 1;
        let bad = match pool.read(page, layer, 0, &mut buf) {
            Ok(()) => verify_chunk(&buf, &spec).err().map(|c| c.to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = bad {
            s.loaded_corrupt_chunks += 1;
            tracing::error!(page, layer, error = %why, "a loaded chunk does not hold its page");
        }
    }
}

/// How a prefill engine uses the hits of its Lookup (DESIGN contract 5).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HitUse {
    /// Load the hit pages and read each layer only after its `LayerLoaded` (the contract).
    #[default]
    LoadAndWait,
    /// Negative control `--skip-load-wait`: load, but read every layer right after the Load call.
    #[cfg(feature = "negative-controls")]
    LoadSkipWait,
    /// Negative control `--regenerate-hits`: do not load; compute and Store the hit pages like
    /// the missed ones.
    #[cfg(feature = "negative-controls")]
    Regenerate,
    /// Fault injection `--load-beyond-hit`: when a Lookup hits some but not all pages, ask the
    /// Load for one page past the hits (as if it had been evicted between Lookup and Load), so
    /// the worker's fetch fails partway and the load ends `LoadFailed` after the leading pages.
    /// With `trust_coverage: false` (`--ignore-load-coverage`, the negative control) the engine
    /// also verifies the pages a `LayerLoaded` does not cover — the stale read that
    /// `LayerLoaded.pages` exists to prevent.
    #[cfg(feature = "negative-controls")]
    LoadBeyondHit {
        /// Verify only the pages each event covers (the contract).
        trust_coverage: bool,
    },
}

impl HitUse {
    /// Whether loaded layers are read before their events (never without the feature).
    fn skips_wait(self) -> bool {
        #[cfg(feature = "negative-controls")]
        if self == Self::LoadSkipWait {
            return true;
        }
        false
    }

    /// Pages to ask the Load for, given `hit` of `m` pages hit (always `hit` without the feature).
    fn asked(self, hit: usize, m: usize) -> usize {
        #[cfg(feature = "negative-controls")]
        if matches!(self, Self::LoadBeyondHit { .. }) && hit > 0 && hit < m {
            return hit + 1;
        }
        let _ = m;
        hit
    }

    /// Whether a `LayerLoaded` is read as covering every page asked for, whatever its `pages`
    /// says (never without the feature).
    fn ignores_coverage(self) -> bool {
        #[cfg(feature = "negative-controls")]
        if self
            == (Self::LoadBeyondHit {
                trust_coverage: false,
            })
        {
            return true;
        }
        false
    }

    /// Whether hits are computed again instead of loaded (never without the feature).
    fn regenerates(self) -> bool {
        #[cfg(feature = "negative-controls")]
        if self == Self::Regenerate {
            return true;
        }
        false
    }
}

/// Lookup and Load (waiting per layer, verifying) for one room whose source pages are `pages` (in
/// token order); returns the leading pages that were loaded (their compute is saved). The pages
/// after them are computed and then [`store`]d.
///
/// # Errors
/// A refused tier call; a Load stream that ends without its `LoadDone`/`LoadFailed` or outlives
/// `bound`.
pub async fn load(
    client: &mut EngineClient,
    att: &Attached,
    hashes: &[Vec<u8>],
    pages: &[u32],
    bound: Duration,
    hit_use: HitUse,
    s: &mut Summary,
) -> Result<usize, ClientError> {
    let skip_wait = hit_use.skips_wait();
    let id = att.id();
    let Some(target) = att.pool(PoolRole::Target) else {
        return Ok(0);
    };
    let m = hashes.len().min(pages.len());
    if m == 0 {
        return Ok(0);
    }
    let (hashes, pages) = (&hashes[..m], &pages[..m]);
    let r = client.req(pb::LookupRequest {
        attach_id: id,
        prefix_hashes: hashes.to_vec(),
    });
    let hits = client.tiers.lookup(r).await?.into_inner().hits;
    s.lookups += 1;
    let mut hit: usize = hits.iter().map(|h| h.pages as usize).sum::<usize>().min(m);
    if hit_use.regenerates() && hit > 0 {
        // Negative control: the hits are computed again below instead of loaded.
        tracing::warn!(
            hit,
            "negative control: regenerating hit pages instead of loading them"
        );
        hit = 0;
    }
    let mut loaded = 0;
    if hit > 0 {
        let asked = hit_use.asked(hit, m);
        let r = client.req_within(
            pb::LoadRequest {
                attach_id: id,
                prefix_hashes: hashes[..asked].to_vec(),
                pages: pages[..asked].to_vec(),
                pools: vec![pb::PoolKind::Target as i32],
            },
            bound,
        );
        let mut events = client.tiers.load(r).await?.into_inner();
        let layers = target.geometry().layers;
        let mut ready: BTreeSet<u32> = BTreeSet::new();
        if skip_wait {
            // Negative control: read every layer now, whatever the events say — last layer first,
            // the one the load copies last.
            for layer in (0..layers).rev() {
                s.read_before_ready += 1;
                verify_layer(target, &hashes[..hit], &pages[..hit], layer, s);
            }
        }
        let outcome = tokio::time::timeout(bound, async {
            while let Some(ev) = events.next().await {
                match ev?.event {
                    Some(pb::load_event::Event::Layer(l)) => {
                        s.load_waits += 1;
                        // Only the leading pages the event covers were written (0: a worker
                        // without the field, every page); a page behind a failed fetch is not
                        // ours to read.
                        let covered = match l.pages as usize {
                            _ if hit_use.ignores_coverage() => asked,
                            0 => asked,
                            n => n.min(asked),
                        };
                        if l.pool == pb::PoolKind::Target as i32 && ready.insert(l.layer) && !skip_wait
                        {
                            verify_layer(
                                target,
                                &hashes[..covered],
                                &pages[..covered],
                                l.layer,
                                s,
                            );
                        }
                    }
                    Some(pb::load_event::Event::Done(d)) => return Ok(d.pages as usize),
                    Some(pb::load_event::Event::Failed(f)) => {
                        s.load_failures += 1;
                        tracing::warn!(message = %f.message, pages_loaded = f.pages_loaded, "load failed");
                        return Ok(f.pages_loaded as usize);
                    }
                    None => {}
                }
            }
            Err(ClientError::Status(tonic::Status::internal(
                "the Load stream ended without LoadDone or LoadFailed",
            )))
        })
        .await
        .map_err(|_| {
            ClientError::Status(tonic::Status::deadline_exceeded(format!(
                "the Load did not end within {bound:?}"
            )))
        })??;
        loaded = outcome.min(asked);
        if loaded > 0 && ready.len() < layers as usize {
            // Every loaded page's layers must have had their events.
            s.load_failures += 1;
            tracing::error!(
                events = ready.len(),
                layers,
                "LoadDone before every layer's LayerLoaded"
            );
            loaded = 0;
        }
        s.loaded_pages += loaded as u64;
    }
    Ok(loaded)
}

/// Stores the pages named by `hashes` — computed by now: call it only once the room's compute time
/// has passed — through `staging`, pages of the target pool no room holds: each page's content
/// ([`page_chunk`]) is written into a staging page and the worker copies it into L2 (and, per the
/// write policy, L3) before the reply, so the staging pages are free again once this returns.
/// Stores `min(hashes, staging)` pages; none without staging pages.
///
/// The room's own pages cannot be used: they hold the decode's request-keyed rows
/// ([`super::chunk_spec`]) and may still be read by the transport. Storing before the compute time
/// has passed would let a sibling room with the same prefix load KV not computed yet and finish at
/// once (a flaky test showed it, CI stop 32).
///
/// # Errors
/// A refused Store; a page that cannot be written.
pub async fn store(
    client: &mut EngineClient,
    att: &Attached,
    hashes: &[Vec<u8>],
    staging: &[u32],
    s: &mut Summary,
) -> Result<(), ClientError> {
    let Some(target) = att.pool(PoolRole::Target) else {
        return Ok(());
    };
    let n = hashes.len().min(staging.len());
    if n == 0 {
        return Ok(());
    }
    let g = *target.geometry();
    for (h, &page) in hashes[..n].iter().zip(&staging[..n]) {
        for layer in 0..g.layers {
            let spec = page_chunk(target, h, layer);
            let mut buf = vec![0u8; spec.bytes()];
            fill_chunk(&mut buf, &spec);
            target.write(page, layer, 0, &buf)?;
        }
    }
    let r = client.req(pb::StoreRequest {
        attach_id: att.id(),
        prefix_hashes: hashes[..n].to_vec(),
        pages: staging[..n].to_vec(),
    });
    let stored = client.tiers.store(r).await?.into_inner().pages;
    s.stored_pages += u64::from(stored);
    Ok(())
}
