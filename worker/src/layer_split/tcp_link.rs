//! [`TcpRankLink`]: the [`RankLink`] between the pods of a CP group (issue 15), one TCP stream per
//! ordered pair of ranks.
//!
//! Rank `r` listens on `addrs[r]`; it dials every peer for the frames it sends, and accepts one
//! stream from every peer for the frames it receives. A dialled stream opens with a preamble
//! `magic "TLSC" | from u32 | cp_size u32 | digest u64` — the sender's rank, the group size and the
//! owner-map digest it runs (0 for a replicated rank) — so an acceptor refuses a stream from a
//! stranger (bad magic, another group size, a rank outside the group, a rank already connected)
//! before reading any frame. Frames then flow as `len u32 (LE) | frame` ([`super::wire`]), `len` at
//! most [`TcpLinkConfig::max_frame_bytes`].
//!
//! Threads: a writer per peer drains an unbounded queue, so [`RankLink::send`] never blocks on the
//! receiver (the owner issues layer `i`'s broadcast and goes on with the indexer, seed 004
//! "通信隐藏"); a reader per peer decodes the length prefix and feeds one inbox. Dropping the link
//! closes its queues: each writer flushes what is queued and shuts its stream down, so a peer's
//! [`RankLink::recv`] says [`Received::Closed`] once every peer has gone — the same contract as the
//! in-process [`super::transport::ChannelLink`]. A malformed length or a short read ends that
//! peer's stream (counted as closed), never a panic.
//!
//! Every wait is bounded: [`TcpRankLink::connect`] gives up at its deadline, naming the peers that
//! never connected (a silent connection's preamble read is bounded by what is left of it); socket
//! writes and reads of a started frame use `io_timeout` (zero timeouts are refused). Dropping the
//! link shuts its incoming streams down and joins every thread it started.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::LayerSplitError;
use super::transport::{RankLink, Received};

/// Preamble magic of a dialled stream.
const PREAMBLE_MAGIC: &[u8; 4] = b"TLSC";
/// Bytes of the preamble: magic, rank, CP size, digest.
const PREAMBLE_BYTES: usize = 4 + 4 + 4 + 8;
/// TCP keepalive of every rank stream: a peer whose host vanished without a FIN (a dead node, a
/// partition) ends its streams after about 10 s idle + 3 probes 5 s apart, instead of never.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

/// Turns TCP keepalive on for a rank stream ([`KEEPALIVE_IDLE`]); best effort.
fn keepalive(s: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    if let Err(e) = socket2::SockRef::from(s).set_tcp_keepalive(&ka) {
        tracing::debug!(error = %e, "rank stream keepalive not set");
    }
}

/// Limits of a [`TcpRankLink`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLinkConfig {
    /// Deadline of [`TcpRankLink::connect`]: every peer dialled and every peer accepted.
    pub connect_timeout: Duration,
    /// Deadline of one socket write, and of reading the rest of a frame once its length arrived.
    pub io_timeout: Duration,
    /// Largest frame accepted (a longer length prefix ends the peer's stream): the broadcast of
    /// one layer's chunks of a whole pool plus its header.
    pub max_frame_bytes: u32,
}

impl Default for TcpLinkConfig {
    /// 30 s to connect, 30 s per write, frames up to 256 MiB.
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(30),
            max_frame_bytes: 256 << 20,
        }
    }
}

/// One rank's end of a TCP mesh.
pub struct TcpRankLink {
    rank: u32,
    cp_size: u32,
    /// Writer queue per peer (`None` at our own index).
    queues: Vec<Option<Sender<Vec<u8>>>>,
    /// The frames of every peer, in arrival order. Behind a lock so that the link is `Sync`: one
    /// thread receives at a time while any thread may send (the engine path's broadcasts leave
    /// while a layer wait receives, `roles::prefill::cp_engine`).
    inbox: Mutex<Receiver<Vec<u8>>>,
    writers: Vec<JoinHandle<()>>,
    /// A handle on each incoming stream, shut down on drop so its reader ends even when the
    /// peer vanished without closing (no FIN: a dead node, a partition).
    incoming: Vec<TcpStream>,
    readers: Vec<JoinHandle<()>>,
    /// Peers whose stream ended (EOF, reset, keepalive, a bad frame length, a failed write).
    closed: Arc<Mutex<std::collections::BTreeSet<u32>>>,
}

fn transport(peer: u32, reason: impl Into<String>) -> LayerSplitError {
    LayerSplitError::Transport {
        peer,
        reason: reason.into(),
    }
}

fn preamble(rank: u32, cp_size: u32, digest: u64) -> [u8; PREAMBLE_BYTES] {
    let mut p = [0u8; PREAMBLE_BYTES];
    p[..4].copy_from_slice(PREAMBLE_MAGIC);
    p[4..8].copy_from_slice(&rank.to_le_bytes());
    p[8..12].copy_from_slice(&cp_size.to_le_bytes());
    p[12..].copy_from_slice(&digest.to_le_bytes());
    p
}

/// Why a dialled stream was refused.
enum Refusal {
    /// The peer runs another owner map (R-LS-1): the group cannot start.
    OwnerMap {
        /// The peer's rank.
        from: u32,
        /// Its digest.
        digest: u64,
    },
    /// Not a peer of this group (logged and dropped; the real peer may still connect).
    Stranger(String),
}

/// Reads and checks a peer's preamble; returns its rank.
fn accept_preamble(
    stream: &mut TcpStream,
    rank: u32,
    cp_size: u32,
    digest: u64,
    connected: &[bool],
) -> Result<u32, Refusal> {
    let mut p = [0u8; PREAMBLE_BYTES];
    stream
        .read_exact(&mut p)
        .map_err(|e| Refusal::Stranger(format!("preamble: {e}")))?;
    if &p[..4] != PREAMBLE_MAGIC {
        return Err(Refusal::Stranger(
            "not a LayerSplit rank stream (bad preamble magic)".into(),
        ));
    }
    let u32_at = |i: usize| u32::from_le_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]);
    let (from, cp) = (u32_at(4), u32_at(8));
    let mut d = [0u8; 8];
    d.copy_from_slice(&p[12..20]);
    let peer_digest = u64::from_le_bytes(d);
    if cp != cp_size {
        return Err(Refusal::Stranger(format!(
            "rank {from} runs a group of {cp}, this one has {cp_size}"
        )));
    }
    if from >= cp_size || from == rank {
        return Err(Refusal::Stranger(format!(
            "rank {from} is not a peer of rank {rank} in 0..{cp_size}"
        )));
    }
    if connected[from as usize] {
        return Err(Refusal::Stranger(format!("rank {from} connected twice")));
    }
    if peer_digest != digest {
        // Refused before any frame: the outcome the hello exchange gives on a mesh that connects
        // anyway (R-LS-1).
        return Err(Refusal::OwnerMap {
            from,
            digest: peer_digest,
        });
    }
    Ok(from)
}

impl TcpRankLink {
    /// Connects rank `rank` of the group whose ranks listen on `addrs` (index = rank), accepting on
    /// `listener` (bound to `addrs[rank]` by the caller, so that its port is known before any peer
    /// dials). `digest` is the owner map this rank runs ([`super::OwnerMap::digest`]; 0 when
    /// replicated): a peer dialling with another digest is refused.
    ///
    /// # Errors
    /// [`LayerSplitError::RankOutOfRange`] when `rank` is outside `addrs`;
    /// [`LayerSplitError::OwnerMapMismatch`] when a peer's preamble names another owner map;
    /// [`LayerSplitError::Transport`] when the deadline passes first (naming the peers missing) or
    /// a socket fails.
    pub fn connect(
        rank: u32,
        addrs: &[SocketAddr],
        listener: TcpListener,
        digest: u64,
        cfg: TcpLinkConfig,
    ) -> Result<Self, LayerSplitError> {
        Self::connect_with(
            rank,
            addrs.len() as u32,
            |peer| addrs.get(peer as usize).copied(),
            listener,
            digest,
            cfg,
        )
    }

    /// [`TcpRankLink::connect`] with each peer's address asked of `dial_addr` before every dial
    /// of a peer not dialled yet (`None`: not known yet, try again later): a pod's name may
    /// still resolve to the pod it replaces while that one terminates.
    ///
    /// # Errors
    /// As [`TcpRankLink::connect`].
    pub fn connect_with(
        rank: u32,
        cp_size: u32,
        mut dial_addr: impl FnMut(u32) -> Option<SocketAddr>,
        listener: TcpListener,
        digest: u64,
        cfg: TcpLinkConfig,
    ) -> Result<Self, LayerSplitError> {
        if rank >= cp_size {
            return Err(LayerSplitError::RankOutOfRange { rank, cp_size });
        }
        if cfg.connect_timeout.is_zero() || cfg.io_timeout.is_zero() {
            // A zero socket timeout is refused by the OS and would leave reads unbounded.
            return Err(transport(
                rank,
                "connect_timeout and io_timeout must be above zero",
            ));
        }
        let deadline = Instant::now() + cfg.connect_timeout;
        listener
            .set_nonblocking(true)
            .map_err(|e| transport(rank, format!("listener: {e}")))?;
        let mut outgoing: Vec<Option<TcpStream>> = (0..cp_size).map(|_| None).collect();
        let mut incoming: Vec<Option<TcpStream>> = (0..cp_size).map(|_| None).collect();
        let peers = || (0..cp_size).filter(|p| *p != rank);
        let mut refused: Option<LayerSplitError> = None;
        loop {
            // Dial every peer not yet dialled (a peer may not listen yet: retry until the deadline).
            for peer in peers() {
                if outgoing[peer as usize].is_some() {
                    continue;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt = left
                    .min(Duration::from_millis(200))
                    .max(Duration::from_millis(1));
                let Some(addr) = dial_addr(peer) else {
                    continue;
                };
                if let Ok(mut s) = TcpStream::connect_timeout(&addr, attempt) {
                    let ok = s.set_nodelay(true).is_ok()
                        && s.set_write_timeout(Some(cfg.io_timeout)).is_ok()
                        && s.write_all(&preamble(rank, cp_size, digest)).is_ok();
                    if ok {
                        keepalive(&s);
                        outgoing[peer as usize] = Some(s);
                    }
                }
            }
            // Accept what has arrived.
            loop {
                match listener.accept() {
                    Ok((mut s, from_addr)) => {
                        // The preamble read is bounded by what is left of the deadline, so a
                        // silent connection cannot hold the loop past it.
                        let left = deadline.saturating_duration_since(Instant::now());
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_read_timeout(Some(
                            cfg.io_timeout.min(left).max(Duration::from_millis(1)),
                        ));
                        let connected: Vec<bool> = incoming.iter().map(Option::is_some).collect();
                        match accept_preamble(&mut s, rank, cp_size, digest, &connected) {
                            Ok(from) => {
                                keepalive(&s);
                                incoming[from as usize] = Some(s);
                            }
                            Err(Refusal::OwnerMap { from, digest: peer }) => {
                                refused.get_or_insert(LayerSplitError::OwnerMapMismatch {
                                    local_rank: rank,
                                    local: digest,
                                    peer_rank: from,
                                    peer,
                                });
                            }
                            Err(Refusal::Stranger(reason)) => {
                                tracing::warn!(rank, %from_addr, reason, "refused a rank stream");
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    // A connection reset before it was accepted, or a signal: try again.
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::ConnectionAborted
                                | io::ErrorKind::ConnectionReset
                                | io::ErrorKind::Interrupted
                        ) => {}
                    Err(e) => return Err(transport(rank, format!("accept: {e}"))),
                }
            }
            if let Some(e) = refused {
                return Err(e);
            }
            let missing: Vec<u32> = peers()
                .filter(|p| outgoing[*p as usize].is_none() || incoming[*p as usize].is_none())
                .collect();
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(transport(
                    missing[0],
                    format!(
                        "rank {rank}: peers {missing:?} not connected within {:?}",
                        cfg.connect_timeout
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let (inbox_tx, inbox) = channel();
        let mut handles = Vec::new();
        let mut readers = Vec::new();
        let closed = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        for (peer, stream) in incoming.into_iter().enumerate() {
            if let Some(s) = stream {
                let handle = s
                    .try_clone()
                    .map_err(|e| transport(peer as u32, format!("stream handle: {e}")))?;
                let tx = inbox_tx.clone();
                let max = cfg.max_frame_bytes;
                let gone = closed.clone();
                let h = std::thread::Builder::new()
                    .name(format!("ls-r{rank}-from{peer}"))
                    .spawn(move || {
                        read_frames(s, max, cfg.io_timeout, &tx);
                        lock_set(&gone).insert(peer as u32);
                    })
                    .map_err(|e| transport(peer as u32, format!("reader thread: {e}")))?;
                handles.push(handle);
                readers.push(h);
            }
        }
        drop(inbox_tx);
        let mut queues = Vec::with_capacity(cp_size as usize);
        let mut writers = Vec::new();
        for (peer, stream) in outgoing.into_iter().enumerate() {
            match stream {
                Some(s) => {
                    let (tx, rx) = channel::<Vec<u8>>();
                    let gone = closed.clone();
                    let h = std::thread::Builder::new()
                        .name(format!("ls-r{rank}-to{peer}"))
                        .spawn(move || {
                            if !write_frames(s, &rx) {
                                lock_set(&gone).insert(peer as u32);
                            }
                        })
                        .map_err(|e| transport(peer as u32, format!("writer thread: {e}")))?;
                    queues.push(Some(tx));
                    writers.push(h);
                }
                None => queues.push(None),
            }
        }
        Ok(Self {
            rank,
            cp_size,
            queues,
            inbox: Mutex::new(inbox),
            writers,
            incoming: handles,
            readers,
            closed,
        })
    }

    /// Peers whose stream to or from this rank has ended (EOF, reset, keepalive expiry, a bad
    /// frame length, a failed write), in rank order. A group cannot run a step without every
    /// rank, so one entry means the group is broken; empty while the link is whole.
    pub fn closed_peers(&self) -> Vec<u32> {
        lock_set(&self.closed).iter().copied().collect()
    }
}

fn lock_set(
    m: &Mutex<std::collections::BTreeSet<u32>>,
) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<u32>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reader thread: `len u32 | frame` into `inbox` until EOF, a bad length or a failed read.
fn read_frames(mut s: TcpStream, max: u32, io_timeout: Duration, inbox: &Sender<Vec<u8>>) {
    loop {
        // Between frames the stream may idle as long as the group does: no timeout on the length.
        let _ = s.set_read_timeout(None);
        let mut len = [0u8; 4];
        if s.read_exact(&mut len).is_err() {
            return;
        }
        let len = u32::from_le_bytes(len);
        if len > max {
            tracing::warn!(len, max, "rank stream sent an oversized frame; closing it");
            return;
        }
        let _ = s.set_read_timeout(Some(io_timeout));
        let mut frame = vec![0u8; len as usize];
        if s.read_exact(&mut frame).is_err() || inbox.send(frame).is_err() {
            return;
        }
    }
}

/// Writer thread: every queued frame as `len u32 | frame`, then a write shutdown once the queue
/// closes (the link was dropped) or a write fails. Returns false when a write failed.
fn write_frames(mut s: TcpStream, queue: &Receiver<Vec<u8>>) -> bool {
    let mut ok = true;
    while let Ok(frame) = queue.recv() {
        let Ok(len) = u32::try_from(frame.len()) else {
            ok = false;
            break;
        };
        if s.write_all(&len.to_le_bytes()).is_err() || s.write_all(&frame).is_err() {
            ok = false;
            break;
        }
    }
    let _ = s.shutdown(Shutdown::Write);
    ok
}

impl RankLink for TcpRankLink {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn cp_size(&self) -> u32 {
        self.cp_size
    }

    fn send(&self, to: u32, frame: Vec<u8>) -> Result<(), LayerSplitError> {
        let queue = self
            .queues
            .get(to as usize)
            .and_then(Option::as_ref)
            .ok_or(LayerSplitError::RankOutOfRange {
                rank: to,
                cp_size: self.cp_size,
            })?;
        queue
            .send(frame)
            .map_err(|_| transport(to, "stream to the peer failed or closed"))
    }

    fn recv(&self, timeout: Duration) -> Received {
        let inbox = self
            .inbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match inbox.recv_timeout(timeout) {
            Ok(f) => Received::Frame(f),
            Err(RecvTimeoutError::Timeout) => Received::Timeout,
            Err(RecvTimeoutError::Disconnected) => Received::Closed,
        }
    }
}

impl Drop for TcpRankLink {
    /// Closes the queues and waits for the writers to flush them (each write is bounded by
    /// `io_timeout`), so frames sent before the drop reach the peers; then shuts the incoming
    /// streams down and joins their readers, so no thread or socket outlives the link even when
    /// a peer vanished without closing.
    fn drop(&mut self) {
        self.queues.clear();
        for w in self.writers.drain(..) {
            let _ = w.join();
        }
        for s in self.incoming.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

/// Binds `cp_size` listeners on loopback ports chosen by the OS and returns them with their
/// addresses (index = rank): the setup of a mesh inside one process (tests, `tandem-bench`).
///
/// # Errors
/// A bind failure, as [`LayerSplitError::Transport`].
pub fn loopback_listeners(
    cp_size: u32,
) -> Result<(Vec<TcpListener>, Vec<SocketAddr>), LayerSplitError> {
    (0..cp_size)
        .map(|r| {
            let l = TcpListener::bind("127.0.0.1:0").map_err(|e| transport(r, e.to_string()))?;
            let a = l.local_addr().map_err(|e| transport(r, e.to_string()))?;
            Ok((l, a))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|v| v.into_iter().unzip())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick() -> TcpLinkConfig {
        TcpLinkConfig {
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(10),
            max_frame_bytes: 1 << 20,
        }
    }

    /// Connects a whole loopback mesh, one thread per rank.
    fn mesh(cp: u32, digest: u64) -> Vec<TcpRankLink> {
        let (listeners, addrs) = loopback_listeners(cp).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let addrs = &addrs;
                    s.spawn(move || TcpRankLink::connect(r as u32, addrs, l, digest, quick()))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        })
    }

    fn recv_frame(link: &TcpRankLink) -> Vec<u8> {
        match link.recv(Duration::from_secs(10)) {
            Received::Frame(f) => f,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    #[test]
    fn frames_cross_both_ways_and_a_dropped_peer_reads_as_closed_after_its_frames() {
        let mut links = mesh(2, 7);
        let b = links.pop().unwrap();
        let a = links.pop().unwrap();
        a.send(1, b"to one".to_vec()).unwrap();
        b.send(0, vec![9u8; 300_000]).unwrap();
        assert_eq!(recv_frame(&b), b"to one");
        assert_eq!(recv_frame(&a), vec![9u8; 300_000]);
        assert!(matches!(
            a.send(0, vec![]),
            Err(LayerSplitError::RankOutOfRange { rank: 0, .. })
        ));
        // Frames queued before the drop are delivered, then the link reads as closed.
        b.send(0, b"last".to_vec()).unwrap();
        drop(b);
        assert_eq!(recv_frame(&a), b"last");
        assert!(matches!(a.recv(Duration::from_secs(10)), Received::Closed));
    }

    /// In a group of three, one rank going away is seen by the others as that one peer closed,
    /// although the link as a whole still has a live peer (`recv` does not say `Closed`).
    #[test]
    fn a_peer_that_goes_away_is_named_among_the_closed_peers() {
        let mut links = mesh(3, 7);
        let c = links.pop().unwrap();
        let (b, a) = (links.pop().unwrap(), links.pop().unwrap());
        assert!(a.closed_peers().is_empty() && b.closed_peers().is_empty());
        // `c`'s last frame reaches `a` before its stream ends: synchronise on it.
        c.send(0, b"bye".to_vec()).unwrap();
        drop(c);
        assert_eq!(recv_frame(&a), b"bye");
        let end = Instant::now() + Duration::from_secs(10);
        while a.closed_peers() != vec![2] && Instant::now() < end {
            std::thread::yield_now();
        }
        assert_eq!(a.closed_peers(), vec![2]);
        // The link still carries the live peer's frames.
        b.send(0, b"still here".to_vec()).unwrap();
        assert_eq!(recv_frame(&a), b"still here");
    }

    /// A peer that stays connected but silent (no FIN, as a dead node) does not keep the link's
    /// reader alive: dropping the link returns (its reader joined), and a silent connection
    /// cannot hold `connect` past its deadline.
    #[test]
    fn drop_ends_the_readers_of_a_silent_peer_and_connect_refuses_zero_timeouts() {
        let (mut listeners, addrs) = loopback_listeners(2).unwrap();
        let (l0, l1) = (listeners.remove(0), listeners.remove(0));
        let addr0 = addrs[0];
        let peer = std::thread::spawn(move || {
            let (from0, _) = l1.accept().unwrap();
            let mut to0 = TcpStream::connect(addr0).unwrap();
            to0.write_all(&preamble(1, 2, 7)).unwrap();
            (from0, to0) // kept open, never written again
        });
        let link = TcpRankLink::connect(0, &addrs, l0, 7, quick()).unwrap();
        let streams = peer.join().unwrap();
        assert!(matches!(
            link.recv(Duration::from_millis(50)),
            Received::Timeout
        ));
        let t = Instant::now();
        drop(link); // shuts the silent stream down and joins its reader
        assert!(t.elapsed() < Duration::from_secs(5));
        // The peer sees its stream closed: the link kept no reader or socket behind (a detached
        // reader would still hold it open, and this read would time out).
        let (_from0, mut to0) = streams;
        to0.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(to0.read(&mut buf).unwrap(), 0, "EOF");

        let (mut listeners, addrs) = loopback_listeners(2).unwrap();
        let cfg = TcpLinkConfig {
            io_timeout: Duration::ZERO,
            ..quick()
        };
        let err = TcpRankLink::connect(0, &addrs, listeners.remove(0), 7, cfg)
            .err()
            .expect("zero io timeout");
        assert!(err.to_string().contains("above zero"), "{err}");
    }

    #[test]
    fn connect_gives_up_at_its_deadline_naming_the_missing_peer() {
        let (mut listeners, addrs) = loopback_listeners(3).unwrap();
        let cfg = TcpLinkConfig {
            connect_timeout: Duration::from_millis(300),
            ..quick()
        };
        // Ranks 1 and 2 never start (their listeners stay open but nobody accepts or dials).
        let l0 = listeners.remove(0);
        let t = Instant::now();
        let err = TcpRankLink::connect(0, &addrs, l0, 7, cfg)
            .err()
            .expect("no peer ran");
        assert!(t.elapsed() < Duration::from_secs(5), "bounded wait");
        let msg = err.to_string();
        assert!(
            msg.contains("[1, 2]") && msg.contains("not connected"),
            "{msg}"
        );
    }

    /// A stream that is not a peer (bad magic, another group size, itself) is refused and the
    /// real peer still connects; an oversized frame ends that peer's stream without a panic.
    #[test]
    fn strangers_are_refused_and_an_oversized_frame_closes_the_stream() {
        let (mut listeners, addrs) = loopback_listeners(2).unwrap();
        let (l0, l1) = (listeners.remove(0), listeners.remove(0));
        // Each stranger stays connected and sends a well-formed frame after its preamble: had
        // it been taken for rank 1, rank 0 would receive that frame.
        let mut strangers = Vec::new();
        for bad in [
            b"HTTP/1.1 GET / and then some".to_vec(),
            preamble(1, 5, 7).to_vec(),
            preamble(0, 2, 7).to_vec(),
        ] {
            let mut s = TcpStream::connect(addrs[0]).unwrap();
            s.write_all(&bad[..PREAMBLE_BYTES]).unwrap();
            s.write_all(&8u32.to_le_bytes()).unwrap();
            s.write_all(b"stranger").unwrap();
            strangers.push(s);
        }
        // Rank 1, by hand: accept rank 0's dial, dial rank 0 with a good preamble, then send a
        // length above the limit.
        let addr0 = addrs[0];
        let peer = std::thread::spawn(move || {
            let (mut from0, _) = l1.accept().unwrap();
            let mut p = [0u8; PREAMBLE_BYTES];
            from0.read_exact(&mut p).unwrap();
            assert_eq!(&p[..4], PREAMBLE_MAGIC);
            let mut to0 = TcpStream::connect(addr0).unwrap();
            to0.write_all(&preamble(1, 2, 7)).unwrap();
            to0.write_all(&(2u32 << 20).to_le_bytes()).unwrap();
            to0.write_all(&[0u8; 64]).unwrap();
            (from0, to0)
        });
        let link = TcpRankLink::connect(0, &addrs, l0, 7, quick()).expect("rank 1 connects");
        let _streams = peer.join().unwrap();
        // Closed at once: the reader refused the length (had it waited for 2 MiB, this would
        // time out, since the stream stays open with 64 bytes sent), and no stranger's frame came.
        assert!(matches!(
            link.recv(Duration::from_secs(5)),
            Received::Closed
        ));
    }

    #[test]
    fn a_peer_on_another_owner_map_is_refused_with_both_digests() {
        let (mut listeners, addrs) = loopback_listeners(2).unwrap();
        let (l0, l1) = (listeners.remove(0), listeners.remove(0));
        let a = &addrs;
        let (r0, r1) = std::thread::scope(|s| {
            let h0 = s.spawn(move || TcpRankLink::connect(0, a, l0, 0xaa, quick()));
            let h1 = s.spawn(move || TcpRankLink::connect(1, a, l1, 0xbb, quick()));
            (h0.join().unwrap(), h1.join().unwrap())
        });
        match r0.err() {
            Some(LayerSplitError::OwnerMapMismatch {
                local_rank: 0,
                local: 0xaa,
                peer_rank: 1,
                peer: 0xbb,
            }) => {}
            other => panic!("rank 0: {other:?}"),
        }
        assert!(matches!(
            r1.err(),
            Some(LayerSplitError::OwnerMapMismatch { peer: 0xaa, .. })
        ));
    }
}
