//! The TCP transport (always available; DESIGN §3, dataplane.md R-XFER-6).
//!
//! Receiver ([`TcpReceiver`], decode side): one thread per connection reads write frames
//! ([`super::wire`]). A write lands only if its region exists, `offset + len` fits the region, and its
//! room is open **at the frame's generation**; otherwise the payload is read and discarded, the write
//! is counted as dropped and the sender is told why. [`TcpReceiver::fence`] closes a room: after it
//! returns `Ok`, no write of that room can land (writes already being applied have finished; later
//! ones are dropped) — the transport proof the release gate accepts.
//!
//! Sender ([`TcpTransport`], prefill side): one connection per peer with a writer thread (queued
//! batches, cancellation before a write is put on the wire) and a reader thread (replies). When the
//! connection breaks, every unconfirmed write is failed as `PeerLost`, the connection is forgotten
//! and the next submit to that peer reconnects (Mooncake PR #4264: evict the stale segment).

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::release::receiver::TransportProof;
use crate::release::{Generation, RoomId, RoomKey};

use super::handles::{HandleTable, OpOutcome};
use super::region::{ReceiveRegion, RegionError, RegionId, check_bounds};
use super::wire::{REPLY_BYTES, Reply, WRITE_HEADER_BYTES, WireError, WriteHeader, WriteStatus};
use super::{
    BatchLimits, CompletionSink, TransferError, TransferHandle, Transport, TransportKind,
    WriteBatch, WriteOp,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ------------------------------------------------------------------------------------------------
// Receiver
// ------------------------------------------------------------------------------------------------

/// Counters of one receiver (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Writes applied.
    pub applied: u64,
    /// Bytes applied.
    pub applied_bytes: u64,
    /// Late writes dropped: room not open at the frame's generation.
    pub dropped_stale: u64,
    /// Writes dropped for bounds or an unknown region.
    pub dropped_invalid: u64,
    /// Connections closed for malformed frames or I/O errors.
    pub broken_connections: u64,
}

/// Whether the receiver checks room generations. `Unchecked` is the negative control of the late-write
/// test only (feature `negative-controls`): it applies every in-bounds write, as a one-sided RDMA
/// write would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenerationCheck {
    /// Drop writes whose room is not open at their generation (R-XFER-6).
    Enforced,
    /// Apply regardless (negative control).
    #[cfg(feature = "negative-controls")]
    Unchecked,
}

#[derive(Debug)]
struct FenceState {
    generation: Generation,
    open: bool,
    applying: u32,
}

#[derive(Debug)]
struct RoomFence {
    state: Mutex<FenceState>,
    idle: Condvar,
}

/// The room could not be fenced before the deadline: a write is still being applied.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {applying} write(s) still being applied at the fence deadline")]
pub struct FenceTimeout {
    /// The room.
    pub key: RoomKey,
    /// Writes in progress.
    pub applying: u32,
}

struct ReceiverShared {
    regions: RwLock<HashMap<RegionId, Arc<dyn ReceiveRegion>>>,
    rooms: Mutex<HashMap<RoomId, Arc<RoomFence>>>,
    check: GenerationCheck,
    stats: Mutex<ReceiverStats>,
    connections: Mutex<Vec<TcpStream>>,
    stopped: AtomicBool,
}

/// The decode-side TCP receiver.
pub struct TcpReceiver {
    addr: SocketAddr,
    shared: Arc<ReceiverShared>,
    accept: Option<thread::JoinHandle<()>>,
}

impl TcpReceiver {
    /// Binds `bind` (e.g. `127.0.0.1:0`) and starts accepting.
    pub fn bind(bind: &str, check: GenerationCheck) -> io::Result<TcpReceiver> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(ReceiverShared {
            regions: RwLock::new(HashMap::new()),
            rooms: Mutex::new(HashMap::new()),
            check,
            stats: Mutex::new(ReceiverStats::default()),
            connections: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
        });
        let s = shared.clone();
        let accept = thread::Builder::new()
            .name("tcp-recv-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(TcpReceiver {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address senders connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Registers a region writes may target.
    pub fn register_region(&self, id: RegionId, region: Arc<dyn ReceiveRegion>) {
        self.shared
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, region);
    }

    /// Deregisters region `id` (DESIGN contract 9: memory leaves the transport before it is
    /// freed): later writes to it are dropped as [`WriteStatus::UnknownRegion`]; a frame being
    /// applied keeps its reference until that frame is done. Returns the region, if registered.
    pub fn deregister_region(&self, id: RegionId) -> Option<Arc<dyn ReceiveRegion>> {
        self.shared
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id)
    }

    /// Opens `key` for writes: only frames of `key.generation` land in this room from now on. A
    /// previous generation of the same room id is fenced implicitly (its writes are dropped).
    pub fn open_room(&self, key: RoomKey) {
        let mut rooms = lock(&self.shared.rooms);
        match rooms.get(&key.room) {
            Some(f) => {
                let mut st = lock(&f.state);
                st.generation = key.generation;
                st.open = true;
            }
            None => {
                rooms.insert(
                    key.room,
                    Arc::new(RoomFence {
                        state: Mutex::new(FenceState {
                            generation: key.generation,
                            open: true,
                            applying: 0,
                        }),
                        idle: Condvar::new(),
                    }),
                );
            }
        }
    }

    /// Closes `key` and waits until no write of it is being applied. After `Ok`, no write of `key`
    /// can land: the proof for the release gate. A room that is unknown or open at another
    /// generation is already fenced for `key`.
    pub fn fence(&self, key: RoomKey, deadline: Instant) -> Result<TransportProof, FenceTimeout> {
        let fence = match lock(&self.shared.rooms).get(&key.room) {
            Some(f) => f.clone(),
            None => return Ok(TransportProof::ReceiverFenced),
        };
        let mut st = lock(&fence.state);
        if st.generation == key.generation {
            st.open = false;
        }
        // Writes being applied may belong to `key` (if it was current) — wait for all of them.
        loop {
            if st.applying == 0 {
                return Ok(TransportProof::ReceiverFenced);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FenceTimeout {
                    key,
                    applying: st.applying,
                });
            }
            st = fence
                .idle
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Forgets a fenced room id (call after its pages are released). Refused silently if the room is
    /// open again or a write is still applying.
    pub fn forget_room(&self, room: RoomId) {
        let mut rooms = lock(&self.shared.rooms);
        if let Some(f) = rooms.get(&room) {
            let st = lock(&f.state);
            if !st.open && st.applying == 0 {
                drop(st);
                rooms.remove(&room);
            }
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> ReceiverStats {
        *lock(&self.shared.stats)
    }

    /// Stops accepting and closes every connection (their threads exit).
    pub fn shutdown(&mut self) {
        if self.shared.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        for c in lock(&self.shared.connections).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wake the accept loop with a throwaway connection.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// No delay on both ends; socket buffers are left to Linux autotuning unless
/// `TANDEM_TCP_SOCKET_BUFFER` (bytes) pins them (a fixed size disables autotuning).
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    if let Some(bytes) = std::env::var("TANDEM_TCP_SOCKET_BUFFER")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let sock = socket2::SockRef::from(stream);
        let _ = sock.set_recv_buffer_size(bytes);
        let _ = sock.set_send_buffer_size(bytes);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ReceiverShared>) {
    for conn in listener.incoming() {
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        tune(&stream);
        if let Ok(c) = stream.try_clone() {
            lock(&shared.connections).push(c);
        }
        let s = shared.clone();
        let spawned = thread::Builder::new()
            .name("tcp-recv-conn".into())
            .spawn(move || {
                if let Err(e) = serve_connection(stream, &s) {
                    if !s.stopped.load(Ordering::SeqCst) {
                        tracing::debug!(error = %e, "tcp receiver connection closed");
                    }
                    lock(&s.stats).broken_connections += 1;
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn tcp receiver thread");
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Bytes a connection's [`FrameReader`] reads ahead: a header and the start of its payload, or a run
/// of small frames.
const LOOKAHEAD_BYTES: usize = 4 << 10;
const _: () = assert!(LOOKAHEAD_BYTES >= WRITE_HEADER_BYTES);

/// Replies are flushed at least once per this many payload bytes applied (and whenever the next
/// header is not buffered yet, before the reader may block), so the sender's window keeps moving.
const REPLY_FLUSH_BYTES: u64 = 256 << 10;

/// The receiving half of a connection: frames are read with one syscall per payload, which lands
/// straight in the region.
///
/// A read at least [`LOOKAHEAD_BYTES`] long made while nothing is buffered is one `readv` into the
/// caller's slice (the region's page) and the look-ahead buffer: the payload's tail and the next
/// frame's header (and the first bytes of its payload) arrive together. Shorter reads (headers,
/// small payloads) are served from the buffer, filled by up to [`LOOKAHEAD_BYTES`] at a time. At most
/// [`LOOKAHEAD_BYTES`] of a payload are copied twice. A `BufReader` page-sized or larger copied
/// every payload twice (socket → buffer → region), ~20% of the receiving thread at 64 KiB pages.
struct FrameReader {
    stream: TcpStream,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl FrameReader {
    fn new(stream: TcpStream) -> FrameReader {
        FrameReader {
            stream,
            buf: vec![0u8; LOOKAHEAD_BYTES].into_boxed_slice(),
            pos: 0,
            end: 0,
        }
    }

    /// Bytes read from the socket and not yet consumed.
    fn buffered(&self) -> usize {
        self.end - self.pos
    }
}

impl Read for FrameReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        if self.pos == self.end {
            (self.pos, self.end) = (0, 0);
            if out.len() >= LOOKAHEAD_BYTES {
                let want = out.len();
                let n = self.stream.read_vectored(&mut [
                    io::IoSliceMut::new(out),
                    io::IoSliceMut::new(&mut self.buf),
                ])?;
                if n <= want {
                    return Ok(n);
                }
                self.end = n - want;
                return Ok(want);
            }
            self.end = self.stream.read(&mut self.buf)?;
        }
        let n = out.len().min(self.end - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

fn serve_connection(stream: TcpStream, shared: &ReceiverShared) -> Result<(), ConnError> {
    let mut reader = FrameReader::new(stream.try_clone()?);
    let mut writer = BufWriter::with_capacity(4096, stream);
    let mut header = [0u8; WRITE_HEADER_BYTES];
    let mut unflushed = 0u64;
    loop {
        // Flush replies before the reader may block for the next frame, and every
        // `REPLY_FLUSH_BYTES` while frames keep arriving.
        if reader.buffered() < WRITE_HEADER_BYTES || unflushed >= REPLY_FLUSH_BYTES {
            writer.flush()?;
            unflushed = 0;
        }
        match reader.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let h = WriteHeader::decode(&header)?;
        let status = apply(&h, &mut reader, shared)?;
        writer.write_all(&Reply { seq: h.seq, status }.encode())?;
        unflushed = unflushed.saturating_add(h.len.max(1));
    }
}

/// Applies one write frame whose header was read; consumes its payload in every case.
fn apply(
    h: &WriteHeader,
    reader: &mut impl Read,
    shared: &ReceiverShared,
) -> Result<WriteStatus, ConnError> {
    let region = shared
        .regions
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&h.region)
        .cloned();
    let Some(region) = region else {
        discard(reader, h.len)?;
        lock(&shared.stats).dropped_invalid += 1;
        return Ok(WriteStatus::UnknownRegion);
    };
    if check_bounds(h.offset, h.len, region.len()).is_err() {
        discard(reader, h.len)?;
        lock(&shared.stats).dropped_invalid += 1;
        return Ok(WriteStatus::OutOfBounds);
    }
    let fence = lock(&shared.rooms).get(&h.key.room).cloned();
    let admitted = match (&fence, shared.check) {
        #[cfg(feature = "negative-controls")]
        (_, GenerationCheck::Unchecked) => true,
        (None, GenerationCheck::Enforced) => false,
        (Some(f), GenerationCheck::Enforced) => {
            let mut st = lock(&f.state);
            let ok = st.open && st.generation == h.key.generation;
            if ok {
                st.applying += 1;
            }
            ok
        }
    };
    if !admitted {
        discard(reader, h.len)?;
        lock(&shared.stats).dropped_stale += 1;
        return Ok(WriteStatus::Stale);
    }
    let result = region.write_from(h.offset, h.len, reader);
    if shared.check == GenerationCheck::Enforced
        && let Some(f) = &fence
    {
        let mut st = lock(&f.state);
        st.applying -= 1;
        if st.applying == 0 {
            f.idle.notify_all();
        }
    }
    match result {
        Ok(()) => {
            let mut s = lock(&shared.stats);
            s.applied += 1;
            s.applied_bytes += h.len;
            Ok(WriteStatus::Applied)
        }
        Err(RegionError::Source { source, .. }) => Err(source.into()),
        Err(RegionError::OutOfBounds { .. } | RegionError::Refused(_)) => {
            lock(&shared.stats).dropped_invalid += 1;
            Ok(WriteStatus::OutOfBounds)
        }
    }
}

fn discard(reader: &mut impl Read, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut reader.take(len), &mut io::sink())?;
    if copied < len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "payload truncated",
        ));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Sender
// ------------------------------------------------------------------------------------------------

/// Sender configuration.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// Connect timeout per attempt.
    pub connect_timeout: Duration,
    /// Limits on one batch.
    pub limits: BatchLimits,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connect_timeout: Duration::from_secs(2),
            limits: BatchLimits::default(),
        }
    }
}

struct Job {
    handle: TransferHandle,
    ops: Vec<WriteOp>,
}

struct Connection {
    peer: String,
    queue: Mutex<Option<Sender<Job>>>,
    /// seq → handle of writes on the wire awaiting a reply.
    unconfirmed: Mutex<HashMap<u64, TransferHandle>>,
    /// No new frames may be sent.
    closing: AtomicBool,
    /// The reader saw the end of the connection; no reply will come.
    broken: AtomicBool,
    stream: TcpStream,
}

/// The prefill-side TCP transport.
pub struct TcpTransport {
    config: TcpConfig,
    handles: Arc<HandleTable>,
    connections: Mutex<HashMap<String, Arc<Connection>>>,
    shut: AtomicBool,
}

impl TcpTransport {
    /// A transport with no connection yet.
    pub fn new(config: TcpConfig) -> TcpTransport {
        TcpTransport {
            config,
            handles: Arc::new(HandleTable::default()),
            connections: Mutex::new(HashMap::new()),
            shut: AtomicBool::new(false),
        }
    }

    /// Batch limits of this transport.
    pub fn limits(&self) -> BatchLimits {
        self.config.limits
    }

    /// Stops sending to `peer`; the next submit reconnects. Writes already on the wire stay in
    /// flight until the receiver answers or closes.
    pub fn disconnect(&self, peer: &str) {
        if let Some(c) = lock(&self.connections).remove(peer) {
            close_write(&c);
        }
    }

    /// Stops sending on every connection (see [`TcpTransport::disconnect`]).
    pub fn shutdown(&self) {
        self.shut.store(true, Ordering::SeqCst);
        let conns: Vec<_> = lock(&self.connections).drain().map(|(_, c)| c).collect();
        for c in conns {
            close_write(&c);
        }
    }

    fn connection(&self, peer: &str) -> Result<Arc<Connection>, TransferError> {
        let mut conns = lock(&self.connections);
        if let Some(c) = conns.get(peer) {
            if !c.closing.load(Ordering::SeqCst) {
                return Ok(c.clone());
            }
            conns.remove(peer);
        }
        let connect_err = |source| TransferError::Connect {
            peer: peer.to_string(),
            source,
        };
        let addr = peer
            .to_socket_addrs()
            .map_err(connect_err)?
            .next()
            .ok_or_else(|| connect_err(io::Error::new(io::ErrorKind::NotFound, "no address")))?;
        let stream =
            TcpStream::connect_timeout(&addr, self.config.connect_timeout).map_err(connect_err)?;
        tune(&stream);
        let (tx, rx) = mpsc::channel::<Job>();
        let conn = Arc::new(Connection {
            peer: peer.to_string(),
            queue: Mutex::new(Some(tx)),
            unconfirmed: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            stream: stream.try_clone().map_err(connect_err)?,
        });
        let (c1, h1) = (conn.clone(), self.handles.clone());
        let write_stream = stream.try_clone().map_err(connect_err)?;
        thread::Builder::new()
            .name("tcp-send-writer".into())
            .spawn(move || writer_loop(write_stream, rx, &c1, &h1))
            .map_err(connect_err)?;
        let (c2, h2) = (conn.clone(), self.handles.clone());
        thread::Builder::new()
            .name("tcp-send-reader".into())
            .spawn(move || reader_loop(stream, &c2, &h2))
            .map_err(connect_err)?;
        conns.insert(peer.to_string(), conn.clone());
        Ok(conn)
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Stops sending on the connection: queued writes are dropped unsent, the write half is closed. The
/// reader keeps draining replies until the receiver closes, so every write already on the wire is
/// accounted for by what the receiver really did (a live receiver applies frames it already read).
fn close_write(conn: &Connection) {
    if conn.closing.swap(true, Ordering::SeqCst) {
        return;
    }
    lock(&conn.queue).take();
    let _ = conn.stream.shutdown(Shutdown::Write);
}

/// The connection is gone (EOF, reset or malformed reply): the receiver no longer reads it, so
/// writes without a reply did not land.
fn connection_lost(conn: &Connection, handles: &HandleTable) {
    conn.closing.store(true, Ordering::SeqCst);
    lock(&conn.queue).take();
    let _ = conn.stream.shutdown(Shutdown::Both);
    let lost: Vec<TransferHandle> = {
        let mut unconfirmed = lock(&conn.unconfirmed);
        conn.broken.store(true, Ordering::SeqCst);
        unconfirmed.drain().map(|(_, h)| h).collect()
    };
    if !lost.is_empty() {
        tracing::warn!(peer = %conn.peer, unconfirmed = lost.len(), "tcp connection to peer lost");
    }
    for h in lost {
        handles.op_done(h, OpOutcome::PeerLost);
    }
}

fn writer_loop(stream: TcpStream, rx: Receiver<Job>, conn: &Connection, handles: &HandleTable) {
    let mut stream = stream;
    let mut seq = 0u64;
    while let Ok(job) = rx.recv() {
        for op in job.ops {
            if conn.closing.load(Ordering::SeqCst) || handles.cancel_requested(job.handle) {
                handles.op_done(job.handle, OpOutcome::NotSent);
                continue;
            }
            seq += 1;
            {
                // Registered under the lock that `connection_lost` drains under: a write is either
                // registered before the drain (and failed by it) or sees `broken` and is not sent.
                let mut unconfirmed = lock(&conn.unconfirmed);
                if conn.broken.load(Ordering::SeqCst) {
                    drop(unconfirmed);
                    handles.op_done(job.handle, OpOutcome::NotSent);
                    continue;
                }
                unconfirmed.insert(seq, job.handle);
            }
            let header = WriteHeader {
                seq,
                key: op.key,
                region: op.region,
                offset: op.offset,
                len: op.data.len() as u64,
            };
            if let Err(e) = write_frame(&mut stream, &header.encode(), &op.data) {
                tracing::debug!(peer = %conn.peer, error = %e, "tcp write failed; closing the connection");
                // A failed send means the peer reset or vanished: let the reader observe it.
                conn.closing.store(true, Ordering::SeqCst);
                let _ = conn.stream.shutdown(Shutdown::Both);
            }
        }
    }
}

fn write_frame(stream: &mut TcpStream, header: &[u8], payload: &[u8]) -> io::Result<()> {
    let (mut h, mut p) = (header, payload);
    while !h.is_empty() || !p.is_empty() {
        let n = stream.write_vectored(&[IoSlice::new(h), IoSlice::new(p)])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed"));
        }
        let from_h = n.min(h.len());
        h = &h[from_h..];
        p = &p[n - from_h..];
    }
    Ok(())
}

fn reader_loop(stream: TcpStream, conn: &Connection, handles: &HandleTable) {
    let mut reader = BufReader::with_capacity(64 << 10, stream);
    let mut buf = [0u8; REPLY_BYTES];
    loop {
        if reader.read_exact(&mut buf).is_err() {
            break;
        }
        let Ok(reply) = Reply::decode(&buf) else {
            break;
        };
        let Some(h) = lock(&conn.unconfirmed).remove(&reply.seq) else {
            continue;
        };
        let outcome = match reply.status {
            WriteStatus::Applied => OpOutcome::Applied,
            WriteStatus::Stale => OpOutcome::RejectedStale,
            WriteStatus::OutOfBounds | WriteStatus::UnknownRegion => OpOutcome::RejectedInvalid,
        };
        handles.op_done(h, outcome);
    }
    connection_lost(conn, handles);
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn handles(&self) -> &HandleTable {
        &self.handles
    }

    fn submit(
        &self,
        peer: &str,
        batch: WriteBatch,
        on_terminal: Option<CompletionSink>,
    ) -> Result<TransferHandle, TransferError> {
        if self.shut.load(Ordering::SeqCst) {
            return Err(TransferError::Shutdown);
        }
        let limits = self.config.limits;
        if batch.len() > limits.max_ops || batch.bytes() > limits.max_bytes {
            return Err(TransferError::BatchTooLarge {
                ops: batch.len(),
                bytes: batch.bytes(),
                max_ops: limits.max_ops,
                max_bytes: limits.max_bytes,
            });
        }
        let conn = self.connection(peer)?;
        let handle = self.handles.create(batch.len(), on_terminal);
        let job = Job {
            handle,
            ops: batch.into_ops(),
        };
        let rejected = match lock(&conn.queue).as_ref() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = rejected {
            // The connection closed between lookup and enqueue: nothing was sent.
            for _ in &job.ops {
                self.handles.op_done(handle, OpOutcome::NotSent);
            }
        }
        Ok(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames of every size class around the look-ahead (smaller, equal, larger, pages) read back
    /// through [`FrameReader`] exactly as written, however the sender's writes are split.
    #[test]
    fn frame_reader_returns_the_stream_byte_for_byte() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let sizes = [
            1usize,
            WRITE_HEADER_BYTES,
            LOOKAHEAD_BYTES - 1,
            LOOKAHEAD_BYTES,
            LOOKAHEAD_BYTES + 1,
            64 << 10,
            (1 << 20) + 3,
            7,
        ];
        let expected: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j * 7) as u8).collect())
            .collect();
        let sent = expected.clone();
        let writer = thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            // Odd-sized writes so frames straddle the reader's reads.
            let all: Vec<u8> = sent.concat();
            for chunk in all.chunks(3001) {
                s.write_all(chunk).unwrap();
            }
        });
        let (stream, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(stream);
        for want in &expected {
            let mut got = vec![0u8; want.len()];
            r.read_exact(&mut got).unwrap();
            assert_eq!(&got, want);
        }
        writer.join().unwrap();
        let mut rest = [0u8; 1];
        assert_eq!(r.read(&mut rest).unwrap(), 0, "nothing beyond the frames");
        assert_eq!(r.buffered(), 0);
    }
}
