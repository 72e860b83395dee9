//! The decode worker's set of prefill peers (worker/interfaces/README.md §2, DESIGN §5).
//!
//! Every refresh (about every 2 s) resolves `peers.prefillService` through [`Resolver`], connects to
//! each new address's control port with a hello that carries this decode's revision, keeps the
//! links that answer with the same revision, and skips — logs once, counts in
//! `peer_revision_refusals`, reports in `/report` — those of another revision. Rooms go where
//! their prefix is, balanced against the work in flight per link — rooms, and the blocks they
//! compute there ([`super::routing`]); a request
//! whose peer failed is retried on another one by the caller ([`PeerSet::pick`] takes the
//! addresses already tried).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::node::{DecodeError, DecodeNode, PrefillLink};
use super::routing::{self, AffinityTable, Candidate, Routing};
use crate::health::counters::Counters;
use crate::roles::resolve::Resolver;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a CP group member stays out of the hellos before it is asked again.
pub const MEMBER_RECHECK: Duration = Duration::from_secs(30);

/// What the peer set dials.
#[derive(Debug, Clone)]
pub struct PeerTarget {
    /// DNS name of the prefill pool's Service.
    pub service: String,
    /// Control (gRPC) port of the prefill workers.
    pub port: u16,
    /// This decode's revision; only prefill peers of the same revision are kept.
    pub revision: String,
    /// Connect and hello timeout.
    pub connect_timeout: Duration,
}

/// The live links and the refusals, by peer address.
pub struct PeerSet {
    node: Arc<DecodeNode>,
    target: PeerTarget,
    resolver: Resolver,
    counters: Counters,
    links: Mutex<BTreeMap<String, PrefillLink>>,
    refused: Mutex<BTreeMap<String, String>>,
    /// CP group members other than leaders (not room peers), with why and when their hello
    /// said so; asked again after [`MEMBER_RECHECK`] (a restarted pod at the same address, or
    /// another parallelism, may lead a group now).
    members: Mutex<BTreeMap<String, (String, std::time::Instant)>>,
    last_error: Mutex<Option<String>>,
    next: AtomicUsize,
    routing: Routing,
    affinity: Mutex<AffinityTable>,
    in_flight: Arc<Mutex<BTreeMap<String, InFlight>>>,
}

/// What this decode has open on one peer: rooms, and the blocks they had to compute there.
#[derive(Debug, Clone, Copy, Default)]
struct InFlight {
    rooms: u32,
    blocks: u64,
}

/// A link chosen for one room: counts as in flight on its peer — one room and the blocks it
/// computes there, the load [`super::routing::choose`] balances — until [`RoutedLink::settle`]
/// (the room's KV is complete or the room ended) or until dropped.
pub struct RoutedLink {
    link: PrefillLink,
    blocks: u64,
    settled: AtomicBool,
    in_flight: Arc<Mutex<BTreeMap<String, InFlight>>>,
}

impl RoutedLink {
    /// The room no longer loads its peer's prefill (its last chunk landed, or it ended): its room
    /// and blocks leave the peer's count. Idempotent; dropping the link does it too. The engine
    /// paths keep the link until the request ends, so they settle when the KV is in.
    pub fn settle(&self) {
        if self.settled.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut counts = lock(&self.in_flight);
        if let Some(n) = counts.get_mut(self.link.addr()) {
            n.rooms = n.rooms.saturating_sub(1);
            n.blocks = n.blocks.saturating_sub(self.blocks);
            if n.rooms == 0 {
                counts.remove(self.link.addr());
            }
        }
    }
}

impl std::ops::Deref for RoutedLink {
    type Target = PrefillLink;
    fn deref(&self) -> &PrefillLink {
        &self.link
    }
}

impl Drop for RoutedLink {
    fn drop(&mut self) {
        self.settle();
    }
}

impl PeerSet {
    /// An empty set routing by `routing`; call [`PeerSet::refresh`] (or [`PeerSet::spawn_refresh`]) to fill it.
    pub fn new(
        node: Arc<DecodeNode>,
        target: PeerTarget,
        resolver: Resolver,
        counters: Counters,
        routing: Routing,
    ) -> Arc<Self> {
        Arc::new(Self {
            node,
            target,
            resolver,
            counters,
            links: Mutex::new(BTreeMap::new()),
            refused: Mutex::new(BTreeMap::new()),
            members: Mutex::new(BTreeMap::new()),
            last_error: Mutex::new(None),
            next: AtomicUsize::new(0),
            routing,
            affinity: Mutex::new(AffinityTable::new(routing::DEFAULT_BLOCKS_PER_PEER)),
            in_flight: Arc::new(Mutex::new(BTreeMap::new())),
        })
    }

    /// Resolves the service and reconciles the links with it; returns the live link count.
    pub async fn refresh(&self) -> usize {
        let addrs = match self
            .resolver
            .lookup(&self.target.service, self.target.port)
            .await
        {
            Ok(a) => {
                *lock(&self.last_error) = None;
                a
            }
            Err(e) => {
                *lock(&self.last_error) = Some(e.to_string());
                Vec::new()
            }
        };
        let wanted: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        {
            let mut links = lock(&self.links);
            let mut affinity = lock(&self.affinity);
            links.retain(|addr, link| {
                let keep = link.alive() && wanted.contains(addr);
                if !keep {
                    affinity.forget(addr); // gone or restarting: its cache is not ours to count on
                }
                keep
            });
            lock(&self.refused).retain(|addr, _| wanted.contains(addr));
            lock(&self.members)
                .retain(|addr, (_, at)| wanted.contains(addr) && at.elapsed() < MEMBER_RECHECK);
        }
        for addr in wanted {
            if lock(&self.links).contains_key(&addr) || lock(&self.members).contains_key(&addr) {
                continue;
            }
            match self
                .node
                .connect_revision(&addr, self.target.connect_timeout, &self.target.revision)
                .await
            {
                Ok(link) => {
                    tracing::info!(peer = %addr, revision = %self.target.revision, "prefill peer connected");
                    lock(&self.refused).remove(&addr);
                    lock(&self.links).insert(addr, link);
                }
                Err(e @ DecodeError::RevisionMismatch { .. }) => {
                    let reason = e.to_string();
                    let first = lock(&self.refused).insert(addr.clone(), reason.clone())
                        != Some(reason.clone());
                    if first {
                        self.counters.peer_revision_refusals.inc();
                        tracing::warn!(peer = %addr, error = %reason, "prefill peer of another revision skipped");
                    }
                }
                Err(e @ DecodeError::GroupMember { .. }) => {
                    // Not a room peer, and not an error: listed with its reason, logged once.
                    let reason = e.to_string();
                    let before = lock(&self.members)
                        .insert(addr.clone(), (reason.clone(), std::time::Instant::now()));
                    if before.map(|(r, _)| r).as_ref() != Some(&reason) {
                        tracing::info!(peer = %addr, why = %reason, "prefill peer is a CP group member");
                    }
                }
                Err(e) => {
                    tracing::debug!(peer = %addr, error = %e, "prefill peer not reachable yet");
                    *lock(&self.last_error) = Some(e.to_string());
                }
            }
        }
        self.live()
    }

    /// Refreshes every `every` until the task is aborted; `on_change` gets the live count after
    /// each refresh (readiness).
    pub fn spawn_refresh(
        self: &Arc<Self>,
        every: Duration,
        on_change: impl Fn(usize) + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let set = self.clone();
        tokio::spawn(async move {
            loop {
                let n = set.refresh().await;
                on_change(n);
                // A lost link is reported at once (readiness follows the last peer's loss); the
                // reconnect waits for the next refresh, so a flapping peer cannot spin the loop.
                let next = tokio::time::Instant::now() + every;
                loop {
                    tokio::select! {
                        () = tokio::time::sleep_until(next) => break,
                        () = set.node.link_lost() => on_change(set.live()),
                    }
                }
            }
        })
    }

    /// The routing policy in use.
    pub fn routing(&self) -> Routing {
        self.routing
    }

    /// Live links now.
    pub fn live(&self) -> usize {
        lock(&self.links).values().filter(|l| l.alive()).count()
    }

    /// The live link for a room whose prompt pages are `hashes` (the request's `kv_block_hashes`,
    /// possibly empty), skipping `tried` addresses; `None` when none is left. Chosen by the
    /// decode's [`Routing`] ([`super::routing`]); the room and the blocks of it the peer computes
    /// (its blocks the peer does not hold by this decode's table) count as in flight on the link
    /// until [`RoutedLink::settle`] or until the returned value is dropped.
    pub fn pick(&self, tried: &[String], hashes: &[u64]) -> Option<RoutedLink> {
        let links = lock(&self.links);
        let live: Vec<&PrefillLink> = links
            .values()
            .filter(|l| l.alive() && !tried.iter().any(|t| t == l.addr()))
            .collect();
        let mut counts = lock(&self.in_flight);
        let candidates: Vec<Candidate<'_>> = live
            .iter()
            .map(|l| {
                let n = counts.get(l.addr()).copied().unwrap_or_default();
                Candidate {
                    addr: l.addr(),
                    in_flight: n.rooms,
                    pending_blocks: n.blocks,
                }
            })
            .collect();
        let rr = self.next.fetch_add(1, Ordering::Relaxed);
        let table = lock(&self.affinity);
        let i = routing::choose(self.routing, &candidates, hashes, &table, rr)?;
        let blocks = (hashes.len() - table.leading_match(live[i].addr(), hashes)) as u64;
        drop(table);
        let link = live[i].clone();
        let n = counts.entry(link.addr().to_owned()).or_default();
        n.rooms += 1;
        n.blocks += blocks;
        Some(RoutedLink {
            link,
            blocks,
            settled: AtomicBool::new(false),
            in_flight: Arc::clone(&self.in_flight),
        })
    }

    /// Records that the peer at `addr` computed a room whose prompt pages are `hashes`: its next
    /// turns are routed there ([`super::routing::AffinityTable`]).
    pub fn routed(&self, addr: &str, hashes: &[u64]) {
        lock(&self.affinity).record(addr, hashes);
    }

    /// Drops the link to `addr` if it is dead (the next refresh reconnects).
    pub fn forget_if_dead(&self, addr: &str) {
        let mut links = lock(&self.links);
        if links.get(addr).is_some_and(|l| !l.alive()) {
            links.remove(addr);
        }
    }

    /// Why the set has no live link: refusals, resolution errors, or an empty service.
    pub fn not_ready_reason(&self) -> String {
        let refused = lock(&self.refused);
        let base = format!(
            "no prefill peer of revision {:?} connected (service {}:{})",
            self.target.revision, self.target.service, self.target.port
        );
        if let Some((addr, why)) = refused.iter().next() {
            return format!("{base}; refused {addr}: {why}");
        }
        match lock(&self.last_error).as_ref() {
            Some(e) => format!("{base}; last error: {e}"),
            None => base,
        }
    }

    /// Addresses refused for revision, with the reason.
    pub fn refused(&self) -> BTreeMap<String, String> {
        lock(&self.refused).clone()
    }

    /// Addresses of CP group members other than leaders (ranks that take no room), with why.
    pub fn group_members(&self) -> BTreeMap<String, String> {
        lock(&self.members)
            .iter()
            .map(|(a, (why, _))| (a.clone(), why.clone()))
            .collect()
    }

    /// Addresses of the live links.
    pub fn addrs(&self) -> Vec<String> {
        lock(&self.links)
            .values()
            .filter(|l| l.alive())
            .map(|l| l.addr().to_owned())
            .collect()
    }

    /// The incarnation each live link's peer said hello with (issue 18; 0: unversioned), by
    /// address: after a peer restarts on its address, the new process's incarnation appears here
    /// once the link is handshaken again.
    pub fn incarnations(&self) -> BTreeMap<String, u64> {
        lock(&self.links)
            .values()
            .filter(|l| l.alive())
            .map(|l| (l.addr().to_owned(), l.incarnation()))
            .collect()
    }
}
