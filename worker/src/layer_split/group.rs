//! One CP group running prefill steps under a KV layout: every rank a thread, the ranks linked by a
//! [`RankLink`] mesh (DESIGN contract 6; seed 004 "协同计算").
//!
//! Per step (one request) each rank: allocates the request's pages, writes the KV of the layers it
//! stores, then for every layer `i` in order —
//! 1. if it owns `i` and others need it: builds the frame of the pages in use (or, in the
//!    [`BroadcastScope::UnsafeWholeBuffer`] control, of every page of the layer) and sends it to every
//!    peer (non-blocking: the broadcast is in flight while the next line runs);
//! 2. runs the indexer of layer `i` (the computation the broadcast hides behind);
//! 3. if it does not own `i`: waits on the layer's event ([`LayerReceiver::wait`]) — skipped in the
//!    `WaitPolicy::UnsafeSkipWait` control (feature `negative-controls`);
//! 4. attends over the request's chunks of layer `i` (local pool, or the receive scratch).
//!
//! [`KvLayout::Replicated`] is the baseline: every rank stores every layer and nothing is sent.

use std::time::Duration;

use crate::engine::content::{ChunkSpec, fill_chunk, verify_chunk};
use crate::memory::Allocator;
use crate::memory::mmap::MmapBackend;
use crate::memory::pool::PageId;
use crate::model::ModelIdentity;

use super::attention::{attend, fold, indexer};
use super::error::LayerSplitError;
use super::ownership::OwnerMap;
use super::rank_store::RankKvStore;
use super::receive::{Arrival, LayerReceiver};
use super::tcp_link::{TcpLinkConfig, TcpRankLink, loopback_listeners};
use super::transport::{RankLink, channel_mesh};
use super::wire::{Frame, LayerFrame};

/// Where a group keeps its KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvLayout {
    /// Every rank stores all layers (the layout LayerSplit replaces).
    Replicated,
    /// Each rank stores its owned layers of the map and broadcasts them.
    Split(OwnerMap),
}

/// What a layer broadcast carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BroadcastScope {
    /// The chunks of the request's pages only (seed 004: only the pages in use).
    #[default]
    PagesInUse,
    /// NEGATIVE CONTROL: every page of the layer, as a naive whole-layer-buffer broadcast would move.
    /// Pages not allocated to the request are sent as zeros (their content is irrelevant; the bytes
    /// moved are what this mode measures).
    UnsafeWholeBuffer,
}

/// Whether attention waits for the layer's event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WaitPolicy {
    /// Wait on the per-layer event before attention (contract 6).
    #[default]
    Wait,
    /// NEGATIVE CONTROL: attend over the receive scratch without waiting on the layer's event. No
    /// frame is then ever delivered into the scratch, so attention reads whatever it held before
    /// (zeros, or an earlier layer) — what a kernel launched ahead of the broadcast would read.
    /// Feature `negative-controls`.
    #[cfg(feature = "negative-controls")]
    UnsafeSkipWait,
}

/// A group to run.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    /// The model (its `layers` and per-token bytes fix the chunk).
    pub model: ModelIdentity,
    /// CP size (threads).
    pub cp_size: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Pages per rank pool.
    pub pool_pages: u32,
    /// Layout.
    pub layout: KvLayout,
    /// Broadcast scope.
    pub scope: BroadcastScope,
    /// Wait policy.
    pub wait: WaitPolicy,
    /// Indexer work rounds per layer.
    pub indexer_work: u32,
    /// Deadline of the handshake and of each layer wait.
    pub wait_timeout: Duration,
}

/// One request: its id and how many pages its KV occupies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestSpec {
    /// Request id (seeds the KV content).
    pub id: u64,
    /// Pages in use.
    pub pages: u32,
}

/// What one rank did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankReport {
    /// The rank.
    pub rank: u32,
    /// Layers it stored.
    pub stored_layers: u32,
    /// Bytes of its KV pool buffer.
    pub stored_kv_bytes: u64,
    /// Bytes of its receive scratch (0 when replicated).
    pub scratch_bytes: u64,
    /// KV payload bytes it broadcast, summed over peers.
    pub broadcast_payload_bytes: u64,
    /// Frame bytes it broadcast (payload + headers + page lists), summed over peers.
    pub broadcast_frame_bytes: u64,
    /// Layer frames sent.
    pub frames_sent: u64,
    /// Layer waits (non-owned layers × requests).
    pub waits: u64,
    /// Waits whose frame had landed before the wait began (broadcast hidden behind the indexer).
    pub waits_hidden: u64,
    /// Chunks attention read that did not hold the KV of their (request, layer, token) — the
    /// engine verifies every chunk it reads (local pool or receive scratch). 0 unless a wait was
    /// skipped (the negative control) or a frame carried the wrong bytes.
    pub corrupt_chunks_read: u64,
    /// Attention output per request, in request order.
    pub outputs: Vec<u64>,
}

/// Runs `requests` through a group whose ranks all use `spec.layout`.
///
/// # Errors
/// The first rank error, by rank order.
pub fn run_group(
    spec: &GroupSpec,
    requests: &[RequestSpec],
) -> Result<Vec<RankReport>, LayerSplitError> {
    let maps = match &spec.layout {
        KvLayout::Replicated => vec![None; spec.cp_size as usize],
        KvLayout::Split(m) => vec![Some(m.clone()); spec.cp_size as usize],
    };
    run_group_with_maps(spec, requests, &maps)
        .into_iter()
        .collect()
}

/// Runs the group with one owner map per rank (`None` = replicated rank) — a test seam so that
/// ranks started from different maps can be shown to refuse each other. Returns each rank's result;
/// `maps.len()` must equal `spec.cp_size` (otherwise every rank gets
/// [`LayerSplitError::InvalidOwnerMap`]).
pub fn run_group_with_maps(
    spec: &GroupSpec,
    requests: &[RequestSpec],
    maps: &[Option<OwnerMap>],
) -> Vec<Result<RankReport, LayerSplitError>> {
    if maps.len() != spec.cp_size as usize {
        let reason = format!("{} owner maps for {} ranks", maps.len(), spec.cp_size);
        return (0..spec.cp_size)
            .map(|_| Err(LayerSplitError::InvalidOwnerMap(reason.clone())))
            .collect();
    }
    let links = PerRank::new(channel_mesh(spec.cp_size));
    run_group_with_links(spec, requests, maps, |rank| {
        Ok(Box::new(links.take(rank, spec.cp_size)?))
    })
}

/// One value per rank (index = rank), each taken once by its rank's thread.
struct PerRank<T>(Vec<std::sync::Mutex<Option<T>>>);

impl<T> PerRank<T> {
    fn new(items: Vec<T>) -> Self {
        Self(
            items
                .into_iter()
                .map(|x| std::sync::Mutex::new(Some(x)))
                .collect(),
        )
    }

    /// Rank `rank`'s value; `RankOutOfRange` when there is none (or it was taken).
    fn take(&self, rank: u32, cp_size: u32) -> Result<T, LayerSplitError> {
        self.0
            .get(rank as usize)
            .and_then(|m| m.lock().ok()?.take())
            .ok_or(LayerSplitError::RankOutOfRange { rank, cp_size })
    }
}

/// Runs the group over TCP on loopback ([`TcpRankLink`], one stream per ordered pair of ranks):
/// the same steps as [`run_group_with_maps`], with each rank's link connected inside its own
/// thread, as the pods of a group connect. A rank's preamble carries its owner-map digest (0 when
/// replicated), so ranks on different maps refuse each other at connect.
pub fn run_group_over_tcp(
    spec: &GroupSpec,
    requests: &[RequestSpec],
    maps: &[Option<OwnerMap>],
    cfg: TcpLinkConfig,
) -> Vec<Result<RankReport, LayerSplitError>> {
    let (listeners, addrs) = match loopback_listeners(spec.cp_size) {
        Ok(x) => x,
        Err(e) => {
            let reason = e.to_string();
            return (0..spec.cp_size)
                .map(|peer| {
                    Err(LayerSplitError::Transport {
                        peer,
                        reason: reason.clone(),
                    })
                })
                .collect();
        }
    };
    let listeners = PerRank::new(listeners);
    run_group_with_links(spec, requests, maps, |rank| {
        let listener = listeners.take(rank, spec.cp_size)?;
        let digest = maps
            .get(rank as usize)
            .and_then(Option::as_ref)
            .map_or(0, OwnerMap::digest);
        Ok(Box::new(TcpRankLink::connect(
            rank, &addrs, listener, digest, cfg,
        )?))
    })
}

/// Runs one thread per rank; each makes its link with `link_for(rank)` and runs the steps.
fn run_group_with_links<F>(
    spec: &GroupSpec,
    requests: &[RequestSpec],
    maps: &[Option<OwnerMap>],
    link_for: F,
) -> Vec<Result<RankReport, LayerSplitError>>
where
    F: Fn(u32) -> Result<Box<dyn RankLink>, LayerSplitError> + Sync,
{
    if maps.len() != spec.cp_size as usize {
        let reason = format!("{} owner maps for {} ranks", maps.len(), spec.cp_size);
        return (0..spec.cp_size)
            .map(|_| Err(LayerSplitError::InvalidOwnerMap(reason.clone())))
            .collect();
    }
    let link_for = &link_for;
    let results: Vec<RankOutcome> = std::thread::scope(|s| {
        let handles: Vec<_> = maps
            .iter()
            .cloned()
            .enumerate()
            .map(|(rank, map)| {
                let rank = rank as u32;
                let h = s.spawn(move || {
                    let link = link_for(rank)?;
                    run_rank(spec, requests, map, link.as_ref()).map(|r| (r, link))
                });
                (rank, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(LayerSplitError::Thread {
                        rank,
                        reason: "panicked".into(),
                    })
                })
            })
            .collect()
    });
    // Links of ranks that finished stay open until every rank has finished (a rank that skipped its
    // waits may finish while its peers still send); a failed rank's link closed when it returned.
    results.into_iter().map(|r| r.map(|(rep, _)| rep)).collect()
}

/// A rank's report with its link, kept open until the whole group has finished.
type RankOutcome = Result<(RankReport, Box<dyn RankLink>), LayerSplitError>;

fn run_rank(
    spec: &GroupSpec,
    requests: &[RequestSpec],
    map: Option<OwnerMap>,
    link: &dyn RankLink,
) -> Result<RankReport, LayerSplitError> {
    let rank = link.rank();
    let layers = spec.model.layers;
    let chunk_bytes = spec.model.bytes_per_token_layer() as usize * spec.page_tokens as usize;
    // Handshake before any allocation or write (R-LS-1).
    let mut receiver = match &map {
        Some(m) => {
            if m.layers() != layers || m.cp_size() != spec.cp_size {
                return Err(LayerSplitError::InvalidOwnerMap(format!(
                    "map is for {} layers over {} ranks, group has {layers} over {}",
                    m.layers(),
                    m.cp_size(),
                    spec.cp_size
                )));
            }
            let mut r = LayerReceiver::new(rank, m.clone(), spec.pool_pages, chunk_bytes);
            r.handshake(link, spec.wait_timeout)?;
            Some(r)
        }
        None => None,
    };
    let (stored, owners): (Vec<u32>, Vec<u32>) = match &map {
        Some(m) => (
            m.owned(rank),
            (0..layers).map(|l| m.owner(l)).collect::<Result<_, _>>()?,
        ),
        None => ((0..layers).collect(), vec![rank; layers as usize]),
    };
    let allocator = Allocator::new(format!("layer-split-rank{rank}"), MmapBackend::new());
    let store = RankKvStore::new(
        rank,
        &spec.model,
        &stored,
        &owners,
        spec.page_tokens,
        spec.pool_pages,
        &allocator,
    )?;
    let mut report = RankReport {
        rank,
        stored_layers: store.stored_layers(),
        stored_kv_bytes: store.stored_bytes(),
        scratch_bytes: receiver.as_ref().map_or(0, LayerReceiver::scratch_bytes),
        ..RankReport::default()
    };
    let ctx = RankStepper::new(spec, link, &store, &owners);
    let run: Result<(), LayerSplitError> =
        requests.iter().enumerate().try_for_each(|(step, req)| {
            let out = ctx.step(step as u64, req, receiver.as_mut(), &mut report)?;
            report.outputs.push(out);
            Ok(())
        });
    let destroyed = store.destroy();
    run?;
    destroyed?;
    Ok(report)
}

/// One rank's prefill steps over its store and link: what every rank of a group runs per request,
/// in the thread group above and on the serving path (`roles::prefill::layer_split`).
pub struct RankStepper<'a> {
    spec: &'a GroupSpec,
    link: &'a dyn RankLink,
    store: &'a RankKvStore,
    owners: &'a [u32],
    chunk_bytes: usize,
}

impl<'a> RankStepper<'a> {
    /// A stepper for the rank of `link`, storing in `store`; `owners[layer]` is the owner of each
    /// layer (every entry this rank when replicated).
    pub fn new(
        spec: &'a GroupSpec,
        link: &'a dyn RankLink,
        store: &'a RankKvStore,
        owners: &'a [u32],
    ) -> Self {
        let chunk_bytes = spec.model.bytes_per_token_layer() as usize * spec.page_tokens as usize;
        Self {
            spec,
            link,
            store,
            owners,
            chunk_bytes,
        }
    }

    /// One step (one request, `step` its number in the group's schedule, the same on every rank):
    /// the steps of the module docs; returns the attention output. `receiver` is `None` when
    /// replicated.
    ///
    /// # Errors
    /// Pool exhaustion, transport, wait and frame errors ([`LayerSplitError`]).
    pub fn step(
        &self,
        step: u64,
        req: &RequestSpec,
        receiver: Option<&mut LayerReceiver>,
        report: &mut RankReport,
    ) -> Result<u64, LayerSplitError> {
        self.step_then(step, req, receiver, report, |_, _| Ok(()))
    }

    /// [`RankStepper::step`], then `then(store, pages)` while the request's pages are still held
    /// (the serving path sends the owned layers of those pages to the decode from there).
    ///
    /// # Errors
    /// As [`RankStepper::step`], and whatever `then` returns.
    pub fn step_then(
        &self,
        step: u64,
        req: &RequestSpec,
        mut receiver: Option<&mut LayerReceiver>,
        report: &mut RankReport,
        then: impl FnOnce(&RankKvStore, &[PageId]) -> Result<(), LayerSplitError>,
    ) -> Result<u64, LayerSplitError> {
        let rank = self.link.rank();
        if let Some(rx) = receiver.as_deref_mut() {
            rx.forget_before(step);
        }
        let pages = self.store.allocate(req.pages as usize)?;
        let result = (|| {
            self.write_kv(req, &pages)?;
            let mut acc = 0u64;
            let mut buf = vec![0u8; self.chunk_bytes];
            let mut local = Vec::with_capacity(pages.len());
            for layer in 0..self.spec.model.layers {
                let owned_here = self.store.stores(layer);
                if let Some(rx) = receiver.as_deref_mut() {
                    if self.owners[layer as usize] == rank {
                        self.broadcast(step, req, layer, &pages, report)?;
                    }
                    acc = fold(acc, indexer(rank, layer, req.id, self.spec.indexer_work));
                    if !owned_here {
                        if self.spec.wait == WaitPolicy::Wait {
                            let arrival =
                                rx.wait(self.link, step, layer, self.spec.wait_timeout)?;
                            report.waits += 1;
                            report.waits_hidden += u64::from(arrival == Arrival::AlreadyThere);
                            check_pages(rx, step, layer, req, &pages)?;
                        }
                        let chunks = pages
                            .iter()
                            .map(|p| rx.chunk(p.0))
                            .collect::<Result<Vec<_>, _>>()?;
                        report.corrupt_chunks_read += self.corrupt(req, layer, &chunks);
                        acc = fold(acc, attend(rank, layer, req.id, chunks));
                        continue;
                    }
                } else {
                    acc = fold(acc, indexer(rank, layer, req.id, self.spec.indexer_work));
                }
                local.clear();
                for p in &pages {
                    self.store.read_chunk(*p, layer, &mut buf)?;
                    local.push(buf.clone());
                }
                let views: Vec<&[u8]> = local.iter().map(Vec::as_slice).collect();
                report.corrupt_chunks_read += self.corrupt(req, layer, &views);
                acc = fold(
                    acc,
                    attend(rank, layer, req.id, local.iter().map(Vec::as_slice)),
                );
            }
            then(self.store, &pages)?;
            Ok(acc)
        })();
        self.store.free(&pages)?;
        result
    }

    /// How many of `chunks` (the request's pages in order, on `layer`) do not hold the KV of
    /// their tokens.
    fn corrupt(&self, req: &RequestSpec, layer: u32, chunks: &[&[u8]]) -> u64 {
        let token_bytes = self.spec.model.bytes_per_token_layer() as usize;
        chunks
            .iter()
            .enumerate()
            .filter(|(k, c)| {
                let spec = ChunkSpec {
                    request: req.id,
                    layer,
                    first_token: *k as u32 * self.spec.page_tokens,
                    tokens: self.spec.page_tokens,
                    token_bytes,
                };
                verify_chunk(c, &spec).is_err()
            })
            .count() as u64
    }

    /// Prefill's KV writes: the deterministic content of (request, layer, token) for every stored
    /// layer and every page in use.
    fn write_kv(&self, req: &RequestSpec, pages: &[PageId]) -> Result<(), LayerSplitError> {
        let mut chunk = vec![0u8; self.chunk_bytes];
        let token_bytes = self.spec.model.bytes_per_token_layer() as usize;
        for layer in (0..self.spec.model.layers).filter(|l| self.store.stores(*l)) {
            for (k, page) in pages.iter().enumerate() {
                fill_chunk(
                    &mut chunk,
                    &ChunkSpec {
                        request: req.id,
                        layer,
                        first_token: k as u32 * self.spec.page_tokens,
                        tokens: self.spec.page_tokens,
                        token_bytes,
                    },
                );
                self.store.write_chunk(*page, layer, &chunk)?;
            }
        }
        Ok(())
    }

    fn broadcast(
        &self,
        step: u64,
        req: &RequestSpec,
        layer: u32,
        pages: &[PageId],
        report: &mut RankReport,
    ) -> Result<(), LayerSplitError> {
        let rank = self.link.rank();
        let cp = self.link.cp_size();
        if cp < 2 {
            return Ok(());
        }
        let ids: Vec<u32> = match self.spec.scope {
            BroadcastScope::PagesInUse => pages.iter().map(|p| p.0).collect(),
            BroadcastScope::UnsafeWholeBuffer => (0..self.store.pool_pages()).collect(),
        };
        let mut payload = vec![0u8; ids.len() * self.chunk_bytes];
        for (k, id) in ids.iter().enumerate() {
            if pages.iter().any(|p| p.0 == *id) {
                let dst = &mut payload[k * self.chunk_bytes..(k + 1) * self.chunk_bytes];
                self.store.read_chunk(PageId(*id), layer, dst)?;
            }
        }
        let payload_bytes = payload.len() as u64;
        let frame = Frame::Layer(LayerFrame {
            from: rank,
            step,
            request: req.id,
            layer,
            chunk_bytes: self.chunk_bytes as u32,
            pages: ids,
            payload,
        })
        .encode();
        for peer in (0..cp).filter(|p| *p != rank) {
            self.link.send(peer, frame.clone())?;
            report.frames_sent += 1;
            report.broadcast_frame_bytes += frame.len() as u64;
            report.broadcast_payload_bytes += payload_bytes;
        }
        Ok(())
    }
}

/// After the wait: the frame must be this request's and carry every page the request reads.
fn check_pages(
    rx: &LayerReceiver,
    step: u64,
    layer: u32,
    req: &RequestSpec,
    pages: &[PageId],
) -> Result<(), LayerSplitError> {
    if rx.scratch_request() != Some(req.id) {
        return Err(LayerSplitError::RequestMismatch {
            step,
            expected: req.id,
            found: rx.scratch_request().unwrap_or(u64::MAX),
        });
    }
    match pages.iter().find(|p| !rx.scratch_pages().contains(&p.0)) {
        Some(p) => Err(LayerSplitError::MissingPage {
            step,
            layer,
            request: req.id,
            page: p.0,
        }),
        None => Ok(()),
    }
}
