//! The pools socket: where an attached engine receives its pool fds, once, by SCM_RIGHTS
//! (DESIGN §3.1; gRPC cannot carry fds).
//!
//! A `SOCK_SEQPACKET` UNIX socket next to the gRPC socket (`<dir>/pools.sock`), speaking the store
//! client's message format ([`crate::store_client::protocol::send`] / `recv`: one JSON object per
//! message, at most one fd attached). The protocol (engine.proto, "The pools socket"):
//!
//! ```text
//! engine → worker  {"op":"claim","attach_id":A,"claim_token":T}
//! worker → engine  {"op":"pool","kind":"target","fd_index":0}  + fd      (one per pool, in order)
//!                  {"op":"done","pools":N}
//!             or   {"op":"error","reason":"ALREADY_CLAIMED"|"NOT_ATTACHED"|"MALFORMED","message":...}
//! ```
//!
//! The connection then stays open for the life of the attach; when the engine closes it (or dies), the
//! attach ends ([`Claims::closed`]). A claim is accepted once per attach.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use serde::{Deserialize, Serialize};

use crate::store_client::protocol;
use crate::store_client::socket_path::with_socket_address;

/// Engine → worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PoolsRequest {
    /// Claim the fds of an attach.
    Claim {
        /// From AttachReply.
        attach_id: u64,
        /// From AttachReply.
        claim_token: u64,
    },
}

/// Worker → engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PoolsResponse {
    /// One pool's fd is attached to this message.
    Pool {
        /// `target`, `draft` or `indexer`.
        kind: String,
        /// Its index in the delivery (AttachReply's `fd_index`).
        fd_index: u32,
    },
    /// Every pool was sent.
    Done {
        /// Pools sent.
        pools: u32,
    },
    /// The claim was refused.
    Error {
        /// `ALREADY_CLAIMED`, `NOT_ATTACHED` or `MALFORMED` (engine.proto `ErrorReason` names).
        reason: String,
        /// Detail.
        message: String,
    },
}

/// A refused claim: reason name and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRefused {
    /// The `ErrorReason` name.
    pub reason: &'static str,
    /// Detail.
    pub message: String,
}

/// What the pools socket asks of the API state.
pub trait Claims: Send + Sync + 'static {
    /// Takes the fds of `attach_id` (once), as `(kind, fd)` in `fd_index` order.
    ///
    /// # Errors
    /// [`ClaimRefused`] for an unknown attach, a wrong token or a second claim.
    fn claim(
        &self,
        attach_id: u64,
        claim_token: u64,
    ) -> Result<Vec<(String, OwnedFd)>, ClaimRefused>;
    /// The connection of a successful claim closed: the attach ends.
    fn closed(&self, attach_id: u64);
}

/// Errors of binding the pools socket.
#[derive(Debug, thiserror::Error)]
#[error("pools socket {path}: {source}")]
pub struct BindError {
    /// The path.
    pub path: PathBuf,
    /// The OS error.
    pub source: std::io::Error,
}

const POLL: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 50_000_000,
};

/// The running pools socket: an accept thread and one thread per connection.
#[derive(Debug)]
pub struct PoolsSocket {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl PoolsSocket {
    /// Binds `path` (a stale socket file is replaced; the path appears only once it accepts) and
    /// serves claims against `claims`.
    ///
    /// # Errors
    /// [`BindError`].
    pub fn start(path: &Path, claims: Arc<dyn Claims>) -> Result<Self, BindError> {
        let err = |source: std::io::Error| BindError {
            path: path.to_path_buf(),
            source,
        };
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                std::fs::remove_file(path).map_err(err)?;
            }
        }
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| err(e.into()))?;
        let mut staging = path.as_os_str().to_owned();
        staging.push(format!(".{}.binding", std::process::id()));
        let staging = PathBuf::from(staging);
        let _ = std::fs::remove_file(&staging);
        with_socket_address(&staging, |a| {
            rustix::net::bind(&listener, &SocketAddrUnix::new(a)?)?;
            Ok(())
        })
        .map_err(err)?;
        rustix::net::listen(&listener, 16).map_err(|e| err(e.into()))?;
        std::fs::rename(&staging, path).map_err(|e| {
            let _ = std::fs::remove_file(&staging);
            err(e)
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let accept = std::thread::Builder::new()
            .name("engine-pools-accept".into())
            .spawn(move || accept_loop(listener, claims, s))
            .map_err(err)?;
        Ok(Self {
            path: path.to_path_buf(),
            stop,
            accept: Some(accept),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, ends every connection (their attaches end) and removes the socket file.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for PoolsSocket {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: OwnedFd, claims: Arc<dyn Claims>, stop: Arc<AtomicBool>) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&POLL)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::error!(error = %e, "pools socket poll failed; no more claims");
                break;
            }
        }
        match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(conn) => {
                let (c, s) = (claims.clone(), stop.clone());
                conns.retain(|h| !h.is_finished());
                match std::thread::Builder::new()
                    .name("engine-pools-conn".into())
                    .spawn(move || serve_conn(conn, c, s))
                {
                    Ok(h) => conns.push(h),
                    Err(e) => tracing::error!(error = %e, "cannot serve a pools connection"),
                }
            }
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => {}
            Err(e) => {
                tracing::error!(error = %e, "pools socket accept failed; no more claims");
                break;
            }
        }
    }
    for h in conns {
        let _ = h.join();
    }
}

/// Waits until `conn` is readable, the peer hung up, or `stop` is set; true when readable or hung up.
fn readable(conn: &OwnedFd, stop: &AtomicBool) -> bool {
    loop {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        let mut fds = [PollFd::new(conn, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&POLL)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => return true,
            Err(_) => return false,
        }
    }
}

fn refuse(conn: &OwnedFd, reason: &str, message: String) {
    let _ = protocol::send(
        conn.as_fd(),
        &PoolsResponse::Error {
            reason: reason.into(),
            message,
        },
        None,
    );
}

fn serve_conn(conn: OwnedFd, claims: Arc<dyn Claims>, stop: Arc<AtomicBool>) {
    // One claim per connection; anything else is refused and the connection closed.
    if !readable(&conn, &stop) {
        return;
    }
    let (attach_id, token) = match protocol::recv::<PoolsRequest>(conn.as_fd()) {
        Ok(Some((
            PoolsRequest::Claim {
                attach_id,
                claim_token,
            },
            stray,
        ))) => {
            drop(stray);
            (attach_id, claim_token)
        }
        Ok(None) => return,
        Err(e) => {
            refuse(&conn, "MALFORMED", format!("not a claim: {e}"));
            return;
        }
    };
    let pools = match claims.claim(attach_id, token) {
        Ok(p) => p,
        Err(r) => {
            refuse(&conn, r.reason, r.message);
            return;
        }
    };
    let n = pools.len() as u32;
    for (i, (kind, fd)) in pools.iter().enumerate() {
        let msg = PoolsResponse::Pool {
            kind: kind.clone(),
            fd_index: i as u32,
        };
        if let Err(e) = protocol::send(conn.as_fd(), &msg, Some(fd.as_fd())) {
            tracing::warn!(attach_id, error = %e, "sending a pool fd failed; the attach ends");
            claims.closed(attach_id);
            return;
        }
    }
    if protocol::send(conn.as_fd(), &PoolsResponse::Done { pools: n }, None).is_err() {
        claims.closed(attach_id);
        return;
    }
    drop(pools);
    tracing::info!(attach_id, pools = n, "engine claimed its pool fds");
    // The attach lives as long as this connection.
    while readable(&conn, &stop) {
        match protocol::recv::<PoolsRequest>(conn.as_fd()) {
            Ok(None) | Err(_) => break,
            Ok(Some(_)) => refuse(
                &conn,
                "ALREADY_CLAIMED",
                "the fds were already passed".into(),
            ),
        }
    }
    claims.closed(attach_id);
}

/// Engine side: claims the fds of an attach; returns the connection (keep it open for the life of the
/// attach) and the `(kind, fd)` pairs in `fd_index` order.
///
/// # Errors
/// Socket errors; a refusal as `PermissionDenied` carrying `reason: message`; a protocol violation as
/// `InvalidData`.
pub fn claim(
    path: &Path,
    attach_id: u64,
    claim_token: u64,
) -> std::io::Result<(OwnedFd, Vec<(String, OwnedFd)>)> {
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    with_socket_address(path, |a| {
        rustix::net::connect(&sock, &SocketAddrUnix::new(a)?)?;
        Ok(())
    })?;
    protocol::send(
        sock.as_fd(),
        &PoolsRequest::Claim {
            attach_id,
            claim_token,
        },
        None,
    )?;
    let mut out = Vec::new();
    loop {
        match protocol::recv::<PoolsResponse>(sock.as_fd())? {
            Some((PoolsResponse::Pool { kind, fd_index }, Some(fd))) => {
                if fd_index as usize != out.len() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("pool fd_index {fd_index} out of order"),
                    ));
                }
                out.push((kind, fd));
            }
            Some((PoolsResponse::Pool { .. }, None)) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "pool message without its fd",
                ));
            }
            Some((PoolsResponse::Done { pools }, _)) => {
                if pools as usize != out.len() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("done after {} pools, announced {pools}", out.len()),
                    ));
                }
                return Ok((sock, out));
            }
            Some((PoolsResponse::Error { reason, message }, _)) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{reason}: {message}"),
                ));
            }
            None => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "the worker closed the pools socket",
                ));
            }
        }
    }
}
