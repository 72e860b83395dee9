//! The standalone store-client process's server (`tandem-worker store-client`).
//!
//! It creates and owns the shared-memory segments, hands their fds to workers over a Unix seqpacket
//! socket, and keeps the registrations. It validates every registration against its own segments, so
//! even a worker that skipped its preflight cannot register foreign memory (defence in depth for seed
//! 000). When a worker disconnects, that worker's registrations and segments are dropped. On shutdown
//! (SIGTERM in the role) every segment is destroyed — POSIX shm names unlinked — and the socket file
//! removed (DESIGN contract 9).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::memory::segment::{SEGMENT_NAME_PREFIX, Segment, SegmentBackend};

use super::protocol::{self, RemoteError, Request, Response};

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Path of the Unix socket to create (must not exist, or be a stale socket).
    pub socket: PathBuf,
    /// Segment backing.
    pub backend: SegmentBackend,
    /// Segment name prefix; must start with [`SEGMENT_NAME_PREFIX`].
    pub name_prefix: String,
    /// Total bytes of segments this process may create.
    pub budget_bytes: usize,
    /// Test-only negative control: on shutdown leave POSIX shm names behind. Feature
    /// `negative-controls`.
    #[cfg(feature = "negative-controls")]
    pub leak_segments_for_test: bool,
}

impl ServerConfig {
    /// A config with the default name prefix `tandem-sc-<pid>`.
    pub fn new(socket: PathBuf, backend: SegmentBackend, budget_bytes: usize) -> Self {
        Self {
            socket,
            backend,
            name_prefix: format!("{SEGMENT_NAME_PREFIX}sc-{}", std::process::id()),
            budget_bytes,
            #[cfg(feature = "negative-controls")]
            leak_segments_for_test: false,
        }
    }
}

/// Errors of the server itself (per-request refusals are [`RemoteError`]s sent to the worker).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Creating, binding or listening on the socket failed.
    #[error("store-client socket {path}: {source}")]
    Socket {
        /// Socket path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The name prefix would escape our naming convention (and so our leak checks).
    #[error("segment name prefix {0:?} must start with {SEGMENT_NAME_PREFIX:?}")]
    BadPrefix(String),
}

/// What a finished server did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeReport {
    /// Connections accepted.
    pub connections: u64,
    /// Segments destroyed when their worker disconnected or at shutdown.
    pub segments_released: usize,
    /// Registrations dropped at shutdown.
    pub registrations_dropped: usize,
}

#[derive(Debug)]
struct OwnedSegment {
    conn: u64,
    segment: Segment,
}

#[derive(Debug, Clone, Copy)]
struct Registration {
    conn: u64,
    segment: u64,
    offset: usize,
    len: usize,
}

#[derive(Debug, Default)]
struct State {
    segments: BTreeMap<u64, OwnedSegment>,
    registrations: BTreeMap<u64, Registration>,
    used_bytes: usize,
}

#[derive(Debug)]
struct Shared {
    config: ServerConfig,
    state: Mutex<State>,
    next_id: AtomicU64,
    stop: Arc<AtomicBool>,
    /// Connections open now.
    connections_open: AtomicU64,
    /// `Register` requests received so far (accepted or refused).
    register_requests: AtomicU64,
    /// Segments created so far.
    segments_created: AtomicU64,
}

/// What the store client holds now and did so far (the sidecar's `/report` `store_client` and its
/// `/metrics`): the seed-000 leak check of a pod counts from these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServerStats {
    /// Worker connections open now.
    pub connections_open: u64,
    /// Segments alive now (all workers).
    pub segments: u64,
    /// Bytes of the segments alive now.
    pub segment_bytes: u64,
    /// Registrations alive now (all workers).
    pub registrations: u64,
    /// `Register` requests received since start, accepted or refused: 0 means no worker ever asked
    /// to register a buffer.
    pub register_requests: u64,
    /// Segments created since start.
    pub segments_created: u64,
}

/// A handle on a server's [`ServerStats`], valid while and after it serves (cheap to clone).
#[derive(Debug, Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
    /// The figures now.
    pub fn snapshot(&self) -> ServerStats {
        let state = self.0.state();
        ServerStats {
            connections_open: self.0.connections_open.load(Ordering::Relaxed),
            segments: state.segments.len() as u64,
            segment_bytes: state.used_bytes as u64,
            registrations: state.registrations.len() as u64,
            register_requests: self.0.register_requests.load(Ordering::Relaxed),
            segments_created: self.0.segments_created.load(Ordering::Relaxed),
        }
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A bound store-client server.
#[derive(Debug)]
pub struct StoreClientServer {
    listener: OwnedFd,
    shared: Arc<Shared>,
}

const POLL_INTERVAL: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 100_000_000,
};

impl StoreClientServer {
    /// Creates the socket and starts listening; the path appears only once the socket accepts. A
    /// stale socket file at the path is replaced.
    ///
    /// # Errors
    /// [`ServerError::Socket`], [`ServerError::BadPrefix`].
    pub fn bind(config: ServerConfig) -> Result<Self, ServerError> {
        if !config.name_prefix.starts_with(SEGMENT_NAME_PREFIX) {
            return Err(ServerError::BadPrefix(config.name_prefix));
        }
        let path = config.socket.clone();
        let sock_err = |source: std::io::Error| ServerError::Socket {
            path: path.clone(),
            source,
        };
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                std::fs::remove_file(&path).map_err(sock_err)?;
            }
        }
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| sock_err(e.into()))?;
        // Bind and listen under a temporary name, then rename into place: the socket path appears
        // only once it accepts, so a worker that sees the file never gets ECONNREFUSED from a
        // socket that is bound but not yet listening.
        let mut staging = path.clone().into_os_string();
        staging.push(format!(".{}.binding", std::process::id()));
        let staging = std::path::PathBuf::from(staging);
        let _ = std::fs::remove_file(&staging);
        super::socket_path::with_socket_address(&staging, |a| {
            let addr = SocketAddrUnix::new(a)?;
            rustix::net::bind(&listener, &addr)?;
            Ok(())
        })
        .map_err(sock_err)?;
        rustix::net::listen(&listener, 16).map_err(|e| sock_err(e.into()))?;
        std::fs::rename(&staging, &path).map_err(|e| {
            let _ = std::fs::remove_file(&staging);
            sock_err(e)
        })?;
        Ok(Self {
            listener,
            shared: Arc::new(Shared {
                config,
                state: Mutex::new(State::default()),
                next_id: AtomicU64::new(1),
                stop: Arc::new(AtomicBool::new(false)),
                connections_open: AtomicU64::new(0),
                register_requests: AtomicU64::new(0),
                segments_created: AtomicU64::new(0),
            }),
        })
    }

    /// The flag that stops [`StoreClientServer::serve`] (set it from a signal handler task).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.shared.stop.clone()
    }

    /// A handle on the server's figures ([`ServerStats`]).
    pub fn stats(&self) -> StatsHandle {
        StatsHandle(self.shared.clone())
    }

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        &self.shared.config.socket
    }

    /// Accepts workers until the stop flag is set, then tears down: joins connection threads, destroys
    /// every segment and removes the socket file. Blocking. The same steps as
    /// [`StoreClientServer::accept_until_stopped`] followed by every [`StoppedServer`] step in order.
    ///
    /// # Errors
    /// [`ServerError::Socket`] when accepting fails for a reason other than an interrupted call.
    pub fn serve(self) -> Result<ServeReport, ServerError> {
        let mut stopped = self.accept_until_stopped();
        let _ = stopped.join_connections();
        stopped.drop_registrations();
        let _ = stopped.remove_socket();
        stopped.destroy_segments();
        stopped.finish()
    }

    /// Accepts workers until the stop flag is set; each connection is served on its own thread.
    /// Returns the stopped server whose teardown steps the caller runs, in the order of DESIGN
    /// contract 9 (the `store-client` role runs them as a [`crate::teardown::Teardown`] plan). Nothing
    /// is accepted after this returns; connection threads see the stop flag within 100 ms.
    pub fn accept_until_stopped(self) -> StoppedServer {
        let mut report = ServeReport::default();
        let mut workers: Vec<JoinHandle<usize>> = Vec::new();
        let result = loop {
            if self.shared.stop.load(Ordering::Acquire) {
                break Ok(());
            }
            let mut fds = [PollFd::new(&self.listener, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&POLL_INTERVAL)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => continue,
                Ok(_) => {}
                Err(e) => break Err(e),
            }
            match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC) {
                Ok(conn) => {
                    report.connections += 1;
                    let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
                    let shared = self.shared.clone();
                    workers.push(std::thread::spawn(move || {
                        serve_connection(&shared, id, conn)
                    }));
                }
                Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => continue,
                Err(e) => break Err(e),
            }
        };
        // Connection threads stop too, whatever ended the accept loop.
        self.shared.stop.store(true, Ordering::Release);
        StoppedServer {
            listener: Some(self.listener),
            shared: self.shared,
            workers,
            report,
            accept_error: result.err(),
        }
    }
}

/// A server that accepts nothing more, with its teardown steps still to run (DESIGN contract 9):
/// [`StoppedServer::join_connections`] (JoinThreads), [`StoppedServer::drop_registrations`]
/// (Deregister), [`StoppedServer::remove_socket`] (DestroyTransports),
/// [`StoppedServer::destroy_segments`] (FreeMemory), then [`StoppedServer::finish`]. Each step is
/// idempotent; a step skipped is done by `finish`, so no segment outlives the server.
#[derive(Debug)]
pub struct StoppedServer {
    listener: Option<OwnedFd>,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<usize>>,
    report: ServeReport,
    accept_error: Option<rustix::io::Errno>,
}

impl StoppedServer {
    /// Joins every connection thread (each exits within 100 ms of the stop flag; a worker's
    /// segments go with its connection).
    ///
    /// # Errors
    /// The number of connection threads that panicked (their segments are released by
    /// [`StoppedServer::destroy_segments`]).
    pub fn join_connections(&mut self) -> Result<(), String> {
        let mut panicked = 0usize;
        for w in self.workers.drain(..) {
            match w.join() {
                Ok(released) => self.report.segments_released += released,
                Err(_) => panicked += 1,
            }
        }
        if panicked == 0 {
            Ok(())
        } else {
            Err(format!("{panicked} connection thread(s) panicked"))
        }
    }

    /// Drops every registration still held; returns how many.
    pub fn drop_registrations(&mut self) -> usize {
        let mut state = self.shared.state();
        let n = state.registrations.len();
        state.registrations.clear();
        self.report.registrations_dropped += n;
        n
    }

    /// Closes the listening socket and removes its file, so no worker can connect to a server
    /// that is going away.
    ///
    /// # Errors
    /// The file could not be removed (already gone is not an error).
    pub fn remove_socket(&mut self) -> Result<(), String> {
        drop(self.listener.take());
        match std::fs::remove_file(&self.shared.config.socket) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!(
                "removing {}: {e}",
                self.shared.config.socket.display()
            )),
        }
    }

    /// Destroys every segment still owned (POSIX shm names unlinked; memfds closed); returns how
    /// many.
    pub fn destroy_segments(&mut self) -> usize {
        let mut state = self.shared.state();
        let owned = std::mem::take(&mut state.segments);
        let n = owned.len();
        for (_, owned) in owned {
            #[cfg(feature = "negative-controls")]
            if self.shared.config.leak_segments_for_test {
                owned.segment.leak_name_for_test();
            }
            drop(owned);
        }
        state.used_bytes = 0;
        drop(state);
        self.report.segments_released += n;
        n
    }

    /// What the server did; runs any step not run yet first.
    ///
    /// # Errors
    /// [`ServerError::Socket`] when the accept loop had ended on an error.
    pub fn finish(mut self) -> Result<ServeReport, ServerError> {
        let _ = self.join_connections();
        self.drop_registrations();
        let _ = self.remove_socket();
        self.destroy_segments();
        match self.accept_error {
            Some(e) => Err(ServerError::Socket {
                path: self.shared.config.socket.clone(),
                source: e.into(),
            }),
            None => Ok(self.report),
        }
    }
}

/// Serves one worker until it disconnects or the server stops; returns the segments released.
fn serve_connection(shared: &Shared, conn_id: u64, conn: OwnedFd) -> usize {
    shared.connections_open.fetch_add(1, Ordering::Relaxed);
    let mut worker = String::from("?");
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let mut fds = [PollFd::new(&conn, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&POLL_INTERVAL)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => break,
        }
        let (request, _fd) = match protocol::recv::<Request>(conn.as_fd()) {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let reply = Response::Error(RemoteError::Malformed {
                    message: e.to_string(),
                });
                if protocol::send(conn.as_fd(), &reply, None).is_err() {
                    break;
                }
                continue;
            }
            Err(_) => break,
        };
        if let Request::Hello { worker: w } = &request {
            worker = w.clone();
        }
        let (reply, seg_fd) = handle(shared, conn_id, request);
        let sent = match seg_fd {
            Some(id) => {
                let state = shared.state();
                match state.segments.get(&id) {
                    Some(s) => protocol::send(conn.as_fd(), &reply, Some(s.segment.fd())),
                    None => protocol::send(
                        conn.as_fd(),
                        &Response::Error(RemoteError::UnknownSegment { segment: id }),
                        None,
                    ),
                }
            }
            None => protocol::send(conn.as_fd(), &reply, None),
        };
        if sent.is_err() {
            break;
        }
    }
    // The worker is gone (or we stop): its registrations and segments go with it.
    let mut state = shared.state();
    state.registrations.retain(|_, r| r.conn != conn_id);
    let mine: Vec<u64> = state
        .segments
        .iter()
        .filter(|(_, s)| s.conn == conn_id)
        .map(|(&id, _)| id)
        .collect();
    let released = mine.len();
    for id in mine {
        if let Some(owned) = state.segments.remove(&id) {
            state.used_bytes -= owned.segment.len();
            #[cfg(feature = "negative-controls")]
            if shared.config.leak_segments_for_test {
                owned.segment.leak_name_for_test();
            }
        }
    }
    drop(state);
    shared.connections_open.fetch_sub(1, Ordering::Relaxed);
    tracing::info!(worker = %worker, released, "store-client connection closed; its segments released");
    released
}

/// Handles one request; returns the reply and, for a created segment, its id so the fd is attached.
fn handle(shared: &Shared, conn: u64, request: Request) -> (Response, Option<u64>) {
    let mut state = shared.state();
    match request {
        Request::Hello { .. } => (
            Response::Welcome {
                pid: std::process::id(),
            },
            None,
        ),
        Request::CreateSegment { bytes } => {
            let available = shared.config.budget_bytes.saturating_sub(state.used_bytes);
            if bytes == 0 {
                return (Response::Error(RemoteError::ZeroSize), None);
            }
            if bytes > available {
                return (
                    Response::Error(RemoteError::Capacity {
                        requested: bytes,
                        available,
                    }),
                    None,
                );
            }
            let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
            let name = format!("{}-{id}", shared.config.name_prefix);
            match Segment::create(id, &name, bytes, shared.config.backend) {
                Ok(segment) => {
                    shared.segments_created.fetch_add(1, Ordering::Relaxed);
                    let info = segment.info().clone();
                    state.used_bytes += segment.len();
                    state.segments.insert(id, OwnedSegment { conn, segment });
                    (Response::SegmentCreated(info), Some(id))
                }
                Err(e) => (
                    Response::Error(RemoteError::Os {
                        message: e.to_string(),
                    }),
                    None,
                ),
            }
        }
        Request::Register {
            segment,
            offset,
            len,
        } => {
            shared.register_requests.fetch_add(1, Ordering::Relaxed);
            let Some(owned) = state.segments.get(&segment).filter(|s| s.conn == conn) else {
                return (
                    Response::Error(RemoteError::UnknownSegment { segment }),
                    None,
                );
            };
            if len == 0 {
                return (Response::Error(RemoteError::ZeroSize), None);
            }
            let segment_len = owned.segment.len();
            if offset.checked_add(len).is_none_or(|end| end > segment_len) {
                return (
                    Response::Error(RemoteError::NotInSegment {
                        segment,
                        offset,
                        len,
                        segment_len,
                    }),
                    None,
                );
            }
            if let Some((&existing, _)) = state.registrations.iter().find(|(_, r)| {
                r.segment == segment && r.offset < offset + len && offset < r.offset + r.len
            }) {
                return (Response::Error(RemoteError::Overlap { existing }), None);
            }
            let handle = shared.next_id.fetch_add(1, Ordering::Relaxed);
            state.registrations.insert(
                handle,
                Registration {
                    conn,
                    segment,
                    offset,
                    len,
                },
            );
            (Response::Registered { handle }, None)
        }
        Request::Unregister { handle } => match state.registrations.get(&handle) {
            Some(r) if r.conn == conn => {
                state.registrations.remove(&handle);
                (Response::Done, None)
            }
            _ => (
                Response::Error(RemoteError::UnknownRegistration { handle }),
                None,
            ),
        },
        Request::ReleaseSegment { segment } => {
            if state.segments.get(&segment).is_none_or(|s| s.conn != conn) {
                return (
                    Response::Error(RemoteError::UnknownSegment { segment }),
                    None,
                );
            }
            let registrations = state
                .registrations
                .values()
                .filter(|r| r.segment == segment)
                .count();
            if registrations > 0 {
                return (
                    Response::Error(RemoteError::SegmentBusy {
                        segment,
                        registrations,
                    }),
                    None,
                );
            }
            if let Some(owned) = state.segments.remove(&segment) {
                state.used_bytes -= owned.segment.len();
                #[cfg(feature = "negative-controls")]
                if shared.config.leak_segments_for_test {
                    owned.segment.leak_name_for_test();
                }
            }
            (Response::Done, None)
        }
        Request::Stats => (
            Response::Stats {
                segments: state.segments.values().filter(|s| s.conn == conn).count(),
                registrations: state
                    .registrations
                    .values()
                    .filter(|r| r.conn == conn)
                    .count(),
            },
            None,
        ),
    }
}
