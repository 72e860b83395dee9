//! Wire protocol between a worker and its standalone store-client process.
//!
//! Transport: a Unix `SOCK_SEQPACKET` socket, so every `sendmsg` is one message with its boundaries
//! kept and a segment's fd rides along as SCM_RIGHTS ancillary data (reference/dataplane.md §1.3:
//! Mooncake's dummy/real clients pass memfds the same way). Payload: one JSON object per message,
//! at most [`MAX_MESSAGE`] bytes. Strictly request/response, one request in flight per connection.
//!
//! Errors are typed ([`RemoteError`]), never a bare −1.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

use crate::memory::segment::SegmentInfo;

/// Largest message in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// Worker → store client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// First message: who is connecting.
    Hello {
        /// Worker name for logs.
        worker: String,
    },
    /// Create a segment of at least `bytes`; the answer carries its fd.
    CreateSegment {
        /// Size asked for.
        bytes: usize,
    },
    /// Register `len` bytes at `offset` of `segment`.
    Register {
        /// Segment id.
        segment: u64,
        /// Offset from the segment's base.
        offset: usize,
        /// Length.
        len: usize,
    },
    /// Undo a registration.
    Unregister {
        /// Handle from `Registered`.
        handle: u64,
    },
    /// Destroy a segment (refused while registrations lie in it).
    ReleaseSegment {
        /// Segment id.
        segment: u64,
    },
    /// Counters of this connection.
    Stats,
}

/// Store client → worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    /// Answer to `Hello`.
    Welcome {
        /// The store client's pid.
        pid: u32,
    },
    /// Answer to `CreateSegment`; the fd is attached.
    SegmentCreated(SegmentInfo),
    /// Answer to `Register`.
    Registered {
        /// Handle to unregister with.
        handle: u64,
    },
    /// Answer to `Unregister` and `ReleaseSegment`.
    Done,
    /// Answer to `Stats`.
    Stats {
        /// Segments owned for this connection.
        segments: usize,
        /// Registrations held for this connection.
        registrations: usize,
    },
    /// A typed refusal.
    Error(RemoteError),
}

/// Typed refusals of the store-client process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum RemoteError {
    /// The segment id is not one of this connection's segments.
    #[error("unknown segment {segment}")]
    UnknownSegment {
        /// Segment id.
        segment: u64,
    },
    /// The range leaves the segment.
    #[error("range {offset}+{len} is outside segment {segment} of {segment_len} bytes")]
    NotInSegment {
        /// Segment id.
        segment: u64,
        /// Offset.
        offset: usize,
        /// Length.
        len: usize,
        /// Segment size.
        segment_len: usize,
    },
    /// Zero-length registration.
    #[error("zero-size registration")]
    ZeroSize,
    /// The range overlaps an existing registration.
    #[error("range overlaps registration {existing}")]
    Overlap {
        /// Handle of the registration it overlaps.
        existing: u64,
    },
    /// The handle is not known.
    #[error("unknown registration {handle}")]
    UnknownRegistration {
        /// Handle.
        handle: u64,
    },
    /// The segment still holds registrations.
    #[error("segment {segment} still holds {registrations} registrations")]
    SegmentBusy {
        /// Segment id.
        segment: u64,
        /// Registrations inside.
        registrations: usize,
    },
    /// The store client's memory budget is spent.
    #[error("store client budget exhausted: {requested} B requested, {available} B left")]
    Capacity {
        /// Asked.
        requested: usize,
        /// Left.
        available: usize,
    },
    /// An OS call failed in the store client.
    #[error("store client OS error: {message}")]
    Os {
        /// The error.
        message: String,
    },
    /// The request could not be decoded.
    #[error("malformed request: {message}")]
    Malformed {
        /// The decoder's error.
        message: String,
    },
}

/// Sends one JSON message, with `fd` attached as SCM_RIGHTS if given.
///
/// # Errors
/// Encoding or socket errors, as `std::io::Error`.
pub fn send<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fd: Option<BorrowedFd<'_>>,
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(std::io::Error::other("message exceeds MAX_MESSAGE"));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        if !cmsg.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(std::io::Error::other("ancillary buffer too small"));
        }
    }
    let sent = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(&bytes)],
        &mut cmsg,
        SendFlags::NOSIGNAL,
    )?;
    if sent != bytes.len() {
        return Err(std::io::Error::other("short send on a seqpacket socket"));
    }
    Ok(())
}

/// Receives one JSON message and an attached fd, if any. `Ok(None)` when the peer closed the socket.
///
/// # Errors
/// Socket errors, a truncated message, or a payload that does not decode.
pub fn recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
) -> std::io::Result<Option<(T, Option<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut buf)],
        &mut cmsg,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // Keep the first; extra fds (never sent by us) are closed on drop.
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    if got
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
    {
        return Err(std::io::Error::other("truncated store-client message"));
    }
    if got.bytes == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..got.bytes])
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(Some((msg, fd)))
}

/// A seqpacket socket pair (tests and in-process servers).
///
/// # Errors
/// The socketpair error.
pub fn seqpacket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Convenience for `fd.as_fd()` on owned sockets.
pub fn borrow(fd: &OwnedFd) -> BorrowedFd<'_> {
    fd.as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_serialises() {
        // Internally tagged enums cannot carry bare strings: each variant must round-trip.
        let all = [
            RemoteError::UnknownSegment { segment: 1 },
            RemoteError::NotInSegment {
                segment: 1,
                offset: 2,
                len: 3,
                segment_len: 4,
            },
            RemoteError::ZeroSize,
            RemoteError::Overlap { existing: 5 },
            RemoteError::UnknownRegistration { handle: 6 },
            RemoteError::SegmentBusy {
                segment: 7,
                registrations: 8,
            },
            RemoteError::Capacity {
                requested: 9,
                available: 10,
            },
            RemoteError::Os {
                message: "enospc".into(),
            },
            RemoteError::Malformed {
                message: "bad".into(),
            },
        ];
        for e in all {
            let json = serde_json::to_string(&Response::Error(e.clone())).unwrap();
            let back: Response = serde_json::from_str(&json).unwrap();
            assert_eq!(back, Response::Error(e));
        }
    }

    #[test]
    fn request_and_fd_cross_a_socketpair() {
        let (a, b) = seqpacket_pair().unwrap();
        let memfd =
            rustix::fs::memfd_create("tandem-proto-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        send(
            a.as_fd(),
            &Request::CreateSegment { bytes: 7 },
            Some(memfd.as_fd()),
        )
        .unwrap();
        let (req, fd): (Request, _) = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!(req, Request::CreateSegment { bytes: 7 });
        assert!(fd.is_some());
        send(a.as_fd(), &Response::Error(RemoteError::ZeroSize), None).unwrap();
        let (resp, fd): (Response, _) = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!(resp, Response::Error(RemoteError::ZeroSize));
        assert!(fd.is_none());
        rustix::net::send(&a, b"{not json", rustix::net::SendFlags::empty()).unwrap();
        let e = recv::<Request>(b.as_fd()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e:?}");
        drop(a);
        assert!(recv::<Request>(b.as_fd()).unwrap().is_none());
    }
}
