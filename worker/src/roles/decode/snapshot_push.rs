//! The decode side of snapshot sync (DESIGN contract 4; seed 002; issue 15): when a session's turn
//! finishes, push its KV into the snapshot buffer of the prefill that will serve its next turn.
//!
//! A finished turn whose request named `session_kv_hashes` (the chained hashes of the pages that
//! hold its prompt and generated tokens: the session's KV after this turn, worker/interfaces
//! README §3) is synced in the background, after the response ended:
//!
//! 1. the router picks the prefill as for a request with those hashes
//!    ([`super::peers::PeerSet::pick`]: the peer the session's prefix routes to);
//! 2. `SnapshotPrepare` on it: slots in its dedicated buffer, or `snapshot-buf-full` (or, in the
//!    negative control, `alloc-failed`) — counted, and the sync ends there (no silent fallback);
//! 3. every `(page, layer)` chunk is written over TCP to the prefill's snapshot receiver at the
//!    grant's offsets, tagged `(session, snapshot id)`: the receiver drops writes of any other
//!    generation, so a late write of an aborted sync never lands in a newer one's slots;
//! 4. `SnapshotSeal` once every write completed (the prefill finalizes into its KV pool and prefix
//!    index now, or when its pool frees pages), else `SnapshotAbort`;
//! 5. the peer is recorded in the routing table for those hashes, so the next turn goes there.
//!
//! Counters: `snapshot_sync_attempts`, `snapshot_sync_ok`, `snapshot_sync_failed_{buf_full, alloc,
//! transfer, other}`.
//!
//! The bytes pushed for a page are that page's content as every tier holds it
//! ([`PrefixCache::object_bytes`]: a function of the page key, what the L3 object of the page
//! holds and what the simulated engine verifies); the built-in decode's own pages hold the
//! request-keyed bytes of the built-in prefill, so it regenerates the page-keyed ones. The prefill
//! verifies every finalized chunk.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::peers::PeerSet;
use crate::control::KvLayout;
use crate::control::pb;
use crate::health::counters::Counters;
use crate::release::RoomKey;
use crate::roles::prefill::prefix_cache::PrefixCache;
use crate::tier::PageKey;
use crate::transfer::tcp::{TcpConfig, TcpTransport};
use crate::transfer::{RegionId, TransferHandle, TransferStatus, Transport, WriteBatch, WriteOp};

/// Longest one sync may take from prepare to seal before it is aborted.
pub const DEFAULT_SYNC_DEADLINE: Duration = Duration::from_secs(10);

/// Default of the most bytes of engine pages (SyncSession) held at once by syncs being handed
/// over or pushed (`TANDEM_DECODE_SNAPSHOT_SYNC_BUDGET_BYTES`).
/// An engine's pages are copied out of its pool and held until written; without a bound, many
/// long sessions finishing together would grow the decode worker past its pod limit (the L3
/// writer queue's lesson, `roles::prefill::tiers::L3_PUT_QUEUE_BYTES`). Beyond it SyncSession is
/// refused (`RESOURCE_EXHAUSTED`) and the turn finishes unsynced.
pub const SYNC_BUDGET_BYTES: u64 = 256 << 20;

/// How one sync ended (what the counters count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncOutcome {
    /// Sealed: finalized, or waiting in the prefill's buffer for pool pages.
    Ok {
        /// The prefill's control address.
        peer: String,
        /// Whether the prefill finalized at once (false: `alloc-failed-on-finalize`, queued).
        finalized: bool,
    },
    /// `snapshot-buf-full`.
    BufFull(String),
    /// `alloc-failed` (negative control only).
    AllocFailed(String),
    /// A write did not complete (the snapshot was aborted).
    Transfer(String),
    /// No peer, a disabled buffer, a refused or lost control call.
    Other(String),
}

/// Where the bytes of a synced page come from.
#[derive(Debug, Clone)]
pub enum PageSource {
    /// The built-in engine: regenerated from the page key ([`PrefixCache::object_bytes`]; its
    /// own pages hold request-keyed bytes).
    Regenerate,
    /// An engine's pages, handed over with SyncSession and copied out of its pool: entry k is the
    /// k-th page, every layer's chunk in layer order.
    Engine(Vec<Arc<[u8]>>),
}

/// Pushes finished turns' KV to prefill peers.
pub struct SnapshotPush {
    peers: Arc<PeerSet>,
    transport: Arc<TcpTransport>,
    layout: KvLayout,
    worker_id: String,
    counters: Counters,
    deadline: Duration,
    session_base: u64,
    next_session: AtomicU64,
    /// Pages of engine KV that may be held at once ([`SYNC_BUDGET_BYTES`] worth).
    budget: Arc<tokio::sync::Semaphore>,
    budget_pages: u32,
}

impl SnapshotPush {
    /// A pusher over `peers`, writing `layout`'s pages with its own TCP sender; at most
    /// `budget_bytes` of engine pages held at once (at least one page).
    pub fn new(
        peers: Arc<PeerSet>,
        layout: KvLayout,
        budget_bytes: u64,
        worker_id: &str,
        incarnation: u64,
        counters: Counters,
    ) -> Arc<SnapshotPush> {
        let budget_pages =
            u32::try_from((budget_bytes / layout.page_bytes().max(1)).max(1)).unwrap_or(u32::MAX);
        Arc::new(SnapshotPush {
            peers,
            transport: Arc::new(TcpTransport::new(TcpConfig::default())),
            layout,
            worker_id: worker_id.to_owned(),
            counters,
            deadline: DEFAULT_SYNC_DEADLINE,
            // Session ids are room ids at the prefill's snapshot receiver: unique per decode
            // process (worker id and incarnation), like room ids (issue 18).
            session_base: super::node::incarnation_room_base(worker_id, incarnation),
            next_session: AtomicU64::new(1),
            budget: Arc::new(tokio::sync::Semaphore::new(budget_pages as usize)),
            budget_pages,
        })
    }

    /// Holds room for `pages` engine pages in the sync budget ([`SYNC_BUDGET_BYTES`]), released
    /// when the permit drops (the push ended, or the hand-over was dropped); `None` when the
    /// budget cannot take them now.
    pub fn hold_pages(&self, pages: u32) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.budget.clone().try_acquire_many_owned(pages).ok()
    }

    /// Pages the sync budget holds in all.
    pub fn budget_pages(&self) -> u32 {
        self.budget_pages
    }

    /// Starts the sync of a finished turn of the built-in engine whose KV is the pages `hashes`,
    /// in the background (the bytes are regenerated from the keys: [`PageSource::Regenerate`]).
    pub fn spawn(self: &Arc<Self>, hashes: Vec<u64>) {
        if hashes.is_empty() {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let outcome = me.push(hashes, PageSource::Regenerate).await;
            tracing::debug!(?outcome, "snapshot sync");
        });
    }

    /// Starts the sync of a finished turn whose KV an engine handed over (SyncSession): `pages[k]`
    /// holds the page `hashes[k]` (every layer, layer order), in the background; `held` (from
    /// [`SnapshotPush::hold_pages`]) is released when the push ends. Pages beyond the shorter of
    /// the two are ignored.
    pub fn spawn_pages(
        self: &Arc<Self>,
        hashes: Vec<u64>,
        pages: Vec<Arc<[u8]>>,
        held: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let n = hashes.len().min(pages.len());
        if n == 0 {
            return;
        }
        let mut hashes = hashes;
        hashes.truncate(n);
        let me = self.clone();
        tokio::spawn(async move {
            let outcome = me.push(hashes, PageSource::Engine(pages)).await;
            drop(held);
            tracing::debug!(?outcome, "snapshot sync of an engine's session");
        });
    }

    /// One sync, counted.
    pub async fn push(&self, hashes: Vec<u64>, source: PageSource) -> SyncOutcome {
        let c = &self.counters;
        c.snapshot_sync_attempts.inc();
        let outcome = self.run(&hashes, &source).await;
        match &outcome {
            SyncOutcome::Ok { peer, .. } => {
                c.snapshot_sync_ok.inc();
                self.peers.routed(peer, &hashes);
            }
            SyncOutcome::BufFull(_) => {
                c.snapshot_sync_failed_buf_full.inc();
            }
            SyncOutcome::AllocFailed(_) => {
                c.snapshot_sync_failed_alloc.inc();
            }
            SyncOutcome::Transfer(_) => {
                c.snapshot_sync_failed_transfer.inc();
            }
            SyncOutcome::Other(_) => {
                c.snapshot_sync_failed_other.inc();
            }
        }
        if !matches!(outcome, SyncOutcome::Ok { .. }) {
            tracing::info!(?outcome, pages = hashes.len(), "snapshot sync failed");
        }
        outcome
    }

    async fn run(&self, hashes: &[u64], source: &PageSource) -> SyncOutcome {
        let Some(link) = self.peers.pick(&[], hashes) else {
            return SyncOutcome::Other("no prefill peer".into());
        };
        let peer = link.addr().to_owned();
        let mut client = link.client();
        let session = self
            .session_base
            .wrapping_add(self.next_session.fetch_add(1, Ordering::Relaxed));
        let prepare = pb::SnapshotPrepareRequest {
            session,
            page_keys: hashes.to_vec(),
            layout: Some(self.layout.into()),
            decode_worker: self.worker_id.clone(),
        };
        let grant =
            match tokio::time::timeout(self.deadline, client.snapshot_prepare(prepare)).await {
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(status)) => return SyncOutcome::Other(format!("prepare: {status}")),
                Err(_) => return SyncOutcome::Other("prepare timed out".into()),
            };
        drop(link);
        match pb::SnapshotOutcome::try_from(grant.outcome) {
            Ok(pb::SnapshotOutcome::Granted) => {}
            Ok(pb::SnapshotOutcome::BufFull) => return SyncOutcome::BufFull(grant.message),
            Ok(pb::SnapshotOutcome::AllocFailed) => return SyncOutcome::AllocFailed(grant.message),
            _ => return SyncOutcome::Other(format!("prepare refused: {}", grant.message)),
        }
        let Some(snapshot) = grant.snapshot else {
            return SyncOutcome::Other("grant without a snapshot".into());
        };
        let written =
            tokio::time::timeout(self.deadline, self.write(hashes, source, &grant, snapshot))
                .await
                .unwrap_or_else(|_| Err("writes timed out".into()));
        if let Err(why) = written {
            let _ = tokio::time::timeout(self.deadline, client.snapshot_abort(snapshot)).await;
            return SyncOutcome::Transfer(why);
        }
        match tokio::time::timeout(self.deadline, client.snapshot_seal(snapshot)).await {
            Ok(Ok(r)) => match pb::SnapshotOutcome::try_from(r.get_ref().outcome) {
                Ok(pb::SnapshotOutcome::Finalized) => SyncOutcome::Ok {
                    peer,
                    finalized: true,
                },
                Ok(pb::SnapshotOutcome::PendingFinalize) => SyncOutcome::Ok {
                    peer,
                    finalized: false,
                },
                _ => SyncOutcome::Other(format!("seal refused: {}", r.get_ref().message)),
            },
            Ok(Err(status)) => SyncOutcome::Other(format!("seal: {status}")),
            Err(_) => SyncOutcome::Other("seal timed out".into()),
        }
    }

    /// Writes every chunk of `hashes` at the grant's offsets, one batch per page; `Ok` when every
    /// write completed.
    async fn write(
        &self,
        hashes: &[u64],
        source: &PageSource,
        grant: &pb::SnapshotPrepareReply,
        snapshot: pb::SnapshotRef,
    ) -> Result<(), String> {
        let layers = grant.layers as usize;
        let chunk = grant.chunk_bytes as usize;
        if layers != self.layout.layers as usize
            || chunk as u64 != self.layout.chunk_bytes()
            || grant.chunk_offsets.len() != hashes.len() * layers
        {
            return Err("grant does not match the snapshot's pages".into());
        }
        let key = RoomKey::new(snapshot.session, snapshot.generation);
        let region = RegionId(grant.region_id);
        let (tx, mut rx) = mpsc::unbounded_channel::<bool>();
        let mut submitted = 0usize;
        for (page, hash) in hashes.iter().enumerate() {
            let bytes: Arc<[u8]> = match source {
                PageSource::Regenerate => {
                    PrefixCache::object_bytes(PageKey::from_trace_id(*hash), self.layout).into()
                }
                PageSource::Engine(pages) => match pages.get(page) {
                    Some(b) if b.len() == layers * chunk => b.clone(),
                    _ => return Err(format!("the engine's page {page} is not a whole page")),
                },
            };
            let ops = (0..layers)
                .map(|layer| WriteOp {
                    key,
                    region,
                    offset: grant.chunk_offsets[page * layers + layer],
                    // The page's own bytes, shared (no second copy of an engine's page).
                    data: Bytes::from_owner(bytes.clone())
                        .slice(layer * chunk..(layer + 1) * chunk),
                })
                .collect();
            let tx = tx.clone();
            let sink = Arc::new(move |_h: TransferHandle, status: &TransferStatus| {
                let _ = tx.send(*status == TransferStatus::Completed);
            });
            let transport = self.transport.clone();
            let addr = grant.data_addr.clone();
            let sent = tokio::task::spawn_blocking(move || {
                WriteBatch::new(ops, transport.limits())
                    .and_then(|b| transport.submit(&addr, b, Some(sink)))
                    .map(|_| ())
            })
            .await;
            match sent {
                Ok(Ok(())) => submitted += 1,
                Ok(Err(e)) => return Err(e.to_string()),
                Err(e) => return Err(e.to_string()),
            }
        }
        drop(tx);
        for _ in 0..submitted {
            match rx.recv().await {
                Some(true) => {}
                Some(false) => return Err("a snapshot write failed".into()),
                None => return Err("the transport dropped a completion".into()),
            }
        }
        Ok(())
    }
}
