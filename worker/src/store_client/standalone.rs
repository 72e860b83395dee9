//! The worker side of a standalone store client (reference/dataplane.md §1.3 "Mode B").
//!
//! It connects to the `tandem-worker store-client` process over its Unix seqpacket socket, asks it for
//! segments sized by the capacity plan, maps each received fd, and offers those segments as the tier's
//! `SharedMemory` allocator. Registration is allowed only for ranges inside a mapped segment; the check
//! runs locally before any IPC, and the server checks again.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::memory::segment::Segment;
use crate::memory::shared::{SegmentSet, SharedMemoryBackend};
use crate::memory::{Allocator, AllocatorDomain};

use super::protocol::{self, Request, Response};
use super::{BufferRef, ClientMode, StoreClient, StoreError, StoreHandle};

const STANDALONE_DOMAINS: &[AllocatorDomain] = &[AllocatorDomain::SharedMemory];

/// Worker-side client of a standalone store-client process.
#[derive(Debug)]
pub struct StandaloneClient {
    sock: Mutex<Option<OwnedFd>>,
    segments: Arc<SegmentSet>,
    allocator: Allocator,
    registrations: Mutex<BTreeMap<StoreHandle, (usize, usize)>>,
    server_pid: u32,
    shut: AtomicBool,
}

impl StandaloneClient {
    /// Connects to the store client at `socket` and introduces this worker as `worker`.
    ///
    /// # Errors
    /// [`StoreError::PeerIpc`] if the socket cannot be reached; [`StoreError::Protocol`] for an
    /// unexpected greeting.
    pub fn connect(socket: &Path, worker: &str) -> Result<Self, StoreError> {
        let ipc = |op| {
            move |e: rustix::io::Errno| StoreError::PeerIpc {
                op,
                source: e.into(),
            }
        };
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(ipc("socket"))?;
        super::socket_path::with_socket_address(socket, |a| {
            let addr = SocketAddrUnix::new(a)?;
            rustix::net::connect(&sock, &addr)?;
            Ok(())
        })
        .map_err(|source| StoreError::PeerIpc {
            op: "connect",
            source,
        })?;
        let segments = SegmentSet::new();
        let allocator = Allocator::new(
            "tier shared memory",
            SharedMemoryBackend::new(segments.clone(), "shm(standalone)"),
        );
        let mut client = Self {
            sock: Mutex::new(Some(sock)),
            segments,
            allocator,
            registrations: Mutex::new(BTreeMap::new()),
            server_pid: 0,
            shut: AtomicBool::new(false),
        };
        match client.call(
            "hello",
            &Request::Hello {
                worker: worker.to_owned(),
            },
        )? {
            (Response::Welcome { pid }, _) => client.server_pid = pid,
            (other, _) => return Err(unexpected("hello", &other)),
        }
        Ok(client)
    }

    /// The store-client process's pid.
    pub fn server_pid(&self) -> u32 {
        self.server_pid
    }

    /// Asks the store client for a segment of `bytes`, maps it and adds it to the tier allocator.
    ///
    /// # Errors
    /// [`StoreError::Remote`] (e.g. `Capacity`), [`StoreError::PeerIpc`], [`StoreError::Memory`] when
    /// the received fd cannot be mapped.
    pub fn reserve(&self, bytes: usize) -> Result<(), StoreError> {
        match self.call("create_segment", &Request::CreateSegment { bytes })? {
            (Response::SegmentCreated(info), Some(fd)) => {
                let seg = Segment::map_received(info, fd)?;
                self.segments.add(Arc::new(seg));
                Ok(())
            }
            (Response::SegmentCreated(_), None) => Err(StoreError::Protocol(
                "segment announced without its fd".into(),
            )),
            (other, _) => Err(unexpected("create_segment", &other)),
        }
    }

    /// Bytes of all mapped segments.
    pub fn capacity(&self) -> usize {
        self.segments.capacity()
    }

    /// The store client's counters for this connection: (segments, registrations).
    ///
    /// # Errors
    /// IPC errors.
    pub fn remote_stats(&self) -> Result<(usize, usize), StoreError> {
        match self.call("stats", &Request::Stats)? {
            (
                Response::Stats {
                    segments,
                    registrations,
                },
                _,
            ) => Ok((segments, registrations)),
            (other, _) => Err(unexpected("stats", &other)),
        }
    }

    fn regs(&self) -> MutexGuard<'_, BTreeMap<StoreHandle, (usize, usize)>> {
        self.registrations.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn call(
        &self,
        op: &'static str,
        req: &Request,
    ) -> Result<(Response, Option<OwnedFd>), StoreError> {
        let guard = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        let Some(sock) = guard.as_ref() else {
            return Err(StoreError::PeerIpc {
                op,
                source: std::io::Error::new(std::io::ErrorKind::NotConnected, "client shut down"),
            });
        };
        protocol::send(sock.as_fd(), req, None)
            .map_err(|source| StoreError::PeerIpc { op, source })?;
        match protocol::recv::<Response>(sock.as_fd()) {
            Ok(Some((Response::Error(e), _))) => Err(StoreError::Remote(e)),
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(StoreError::PeerIpc {
                op,
                source: std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "store client closed the connection",
                ),
            }),
            Err(source) => Err(StoreError::PeerIpc { op, source }),
        }
    }
}

fn unexpected(op: &str, got: &Response) -> StoreError {
    StoreError::Protocol(format!("unexpected answer to {op}: {got:?}"))
}

impl StoreClient for StandaloneClient {
    fn mode(&self) -> ClientMode {
        ClientMode::Standalone
    }
    fn host_allocator(&self) -> &Allocator {
        &self.allocator
    }
    fn accepted_domains(&self) -> &'static [AllocatorDomain] {
        STANDALONE_DOMAINS
    }
    fn check_registrable(&self, range: &BufferRef) -> Result<(), StoreError> {
        if range.len == 0 {
            return Err(StoreError::ZeroSize(range.buffer));
        }
        if !STANDALONE_DOMAINS.contains(&range.domain) {
            return Err(StoreError::DomainMismatch {
                buffer: range.buffer,
                owner: range.owner.clone(),
                domain: range.domain,
                allocator: range.allocator.clone(),
                mode: ClientMode::Standalone,
                accepted: STANDALONE_DOMAINS.to_vec(),
            });
        }
        // A SharedMemory buffer of another tier (another client's segments) is still foreign here.
        if self.segments.locate(range.addr, range.len).is_none() {
            return Err(StoreError::NotInSegment {
                buffer: range.buffer,
                addr: range.addr,
                len: range.len,
            });
        }
        Ok(())
    }
    fn register_buffer(&self, range: &BufferRef) -> Result<StoreHandle, StoreError> {
        self.check_registrable(range)?;
        let (segment, offset) =
            self.segments
                .locate(range.addr, range.len)
                .ok_or(StoreError::NotInSegment {
                    buffer: range.buffer,
                    addr: range.addr,
                    len: range.len,
                })?;
        let req = Request::Register {
            segment,
            offset,
            len: range.len,
        };
        match self.call("register", &req)? {
            (Response::Registered { handle }, _) => {
                let handle = StoreHandle(handle);
                self.regs().insert(handle, (range.addr, range.len));
                Ok(handle)
            }
            (other, _) => Err(unexpected("register", &other)),
        }
    }
    fn unregister_buffer(&self, handle: StoreHandle) -> Result<(), StoreError> {
        if !self.regs().contains_key(&handle) {
            return Err(StoreError::UnknownHandle(handle));
        }
        match self.call("unregister", &Request::Unregister { handle: handle.0 })? {
            (Response::Done, _) => {
                self.regs().remove(&handle);
                Ok(())
            }
            (other, _) => Err(unexpected("unregister", &other)),
        }
    }
    fn registered_count(&self) -> usize {
        self.regs().len()
    }
    fn segment_set(&self) -> Option<&Arc<SegmentSet>> {
        Some(&self.segments)
    }
    fn shutdown(&self) -> Result<(), StoreError> {
        if self.shut.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Closing the connection makes the store client drop this worker's registrations and
        // segments; our own mappings go when no buffer lies in them any more.
        let kept = self.segments.release_idle();
        if kept > 0 {
            tracing::warn!(
                kept,
                "segments still hold live or quarantined buffers at shutdown"
            );
        }
        self.regs().clear();
        drop(self.sock.lock().unwrap_or_else(|p| p.into_inner()).take());
        Ok(())
    }
}
