//! The standalone store-client server's own checks, spoken to over its raw protocol — as a worker that
//! skipped its preflight would (defence in depth for seed 000): every refusal is a typed
//! `RemoteError`, never a bare −1.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use tandem_worker::memory::segment::SegmentBackend;
use tandem_worker::store_client::protocol::{self, RemoteError, Request, Response};
use tandem_worker::store_client::server::{ServerConfig, ServerError, StoreClientServer};

struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: tempfile::TempDir,
}

impl Server {
    fn start(budget: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config =
            ServerConfig::new(dir.path().join("s.sock"), SegmentBackend::Memfd, budget);
        config.name_prefix = format!("tandem-test-raw-{}", std::process::id());
        let server = StoreClientServer::bind(config).unwrap();
        let stop = server.stop_flag();
        let thread = Some(std::thread::spawn(move || {
            server.serve().unwrap();
        }));
        Self { stop, thread, dir }
    }
    fn connect(&self) -> OwnedFd {
        connect(&self.dir.path().join("s.sock"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

fn connect(path: &Path) -> OwnedFd {
    let s = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    rustix::net::connect(&s, &SocketAddrUnix::new(path).unwrap()).unwrap();
    s
}

fn call(sock: &OwnedFd, req: Request) -> (Response, Option<OwnedFd>) {
    protocol::send(sock.as_fd(), &req, None).unwrap();
    protocol::recv(sock.as_fd()).unwrap().unwrap()
}

fn err(sock: &OwnedFd, req: Request) -> RemoteError {
    match call(sock, req).0 {
        Response::Error(e) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn server_refuses_foreign_overlapping_and_unknown_ranges_with_typed_errors() {
    let server = Server::start(1 << 20);
    let w = server.connect();
    let (resp, fd) = call(&w, Request::CreateSegment { bytes: 10_000 });
    let Response::SegmentCreated(info) = resp else {
        panic!("{resp:?}")
    };
    assert!(fd.is_some(), "the segment's fd is passed with SCM_RIGHTS");
    assert_eq!(info.len, 12_288, "rounded up to pages");
    let seg = info.id;

    assert_eq!(
        err(
            &w,
            Request::Register {
                segment: seg,
                offset: 8192,
                len: 8192
            }
        ),
        RemoteError::NotInSegment {
            segment: seg,
            offset: 8192,
            len: 8192,
            segment_len: 12_288
        }
    );
    assert_eq!(
        err(
            &w,
            Request::Register {
                segment: seg,
                offset: usize::MAX,
                len: 2
            }
        ),
        RemoteError::NotInSegment {
            segment: seg,
            offset: usize::MAX,
            len: 2,
            segment_len: 12_288
        }
    );
    assert_eq!(
        err(
            &w,
            Request::Register {
                segment: seg,
                offset: 0,
                len: 0
            }
        ),
        RemoteError::ZeroSize
    );
    assert_eq!(
        err(
            &w,
            Request::Register {
                segment: 999,
                offset: 0,
                len: 1
            }
        ),
        RemoteError::UnknownSegment { segment: 999 }
    );
    let (Response::Registered { handle }, _) = call(
        &w,
        Request::Register {
            segment: seg,
            offset: 0,
            len: 4096,
        },
    ) else {
        panic!()
    };
    assert_eq!(
        err(
            &w,
            Request::Register {
                segment: seg,
                offset: 2048,
                len: 4096
            }
        ),
        RemoteError::Overlap { existing: handle }
    );
    assert_eq!(
        err(&w, Request::ReleaseSegment { segment: seg }),
        RemoteError::SegmentBusy {
            segment: seg,
            registrations: 1
        }
    );
    assert_eq!(
        err(
            &w,
            Request::Unregister {
                handle: handle + 1000
            }
        ),
        RemoteError::UnknownRegistration {
            handle: handle + 1000
        }
    );
    assert_eq!(call(&w, Request::Unregister { handle }).0, Response::Done);
    assert_eq!(
        call(&w, Request::ReleaseSegment { segment: seg }).0,
        Response::Done
    );
    assert_eq!(
        call(&w, Request::Stats).0,
        Response::Stats {
            segments: 0,
            registrations: 0
        }
    );
}

#[test]
fn budget_and_isolation_between_workers_and_cleanup_on_disconnect() {
    let server = Server::start(64 << 10);
    let a = server.connect();
    let b = server.connect();
    let (Response::SegmentCreated(info), _) = call(&a, Request::CreateSegment { bytes: 48 << 10 })
    else {
        panic!()
    };
    assert_eq!(
        err(&b, Request::CreateSegment { bytes: 32 << 10 }),
        RemoteError::Capacity {
            requested: 32 << 10,
            available: 16 << 10
        }
    );
    // Worker b cannot register inside worker a's segment.
    assert_eq!(
        err(
            &b,
            Request::Register {
                segment: info.id,
                offset: 0,
                len: 4096
            }
        ),
        RemoteError::UnknownSegment { segment: info.id }
    );
    assert!(matches!(
        call(
            &a,
            Request::Register {
                segment: info.id,
                offset: 0,
                len: 4096
            }
        )
        .0,
        Response::Registered { .. }
    ));
    // a disconnects: its segment and registration go, and the budget is free again.
    drop(a);
    let mut tries = 0;
    loop {
        match call(&b, Request::CreateSegment { bytes: 60 << 10 }).0 {
            Response::SegmentCreated(_) => break,
            Response::Error(RemoteError::Capacity { .. }) if tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => panic!("{other:?}"),
        }
    }
    // Malformed input is a typed refusal and the connection survives.
    rustix::net::send(&b, b"{not json", rustix::net::SendFlags::empty()).unwrap();
    let (resp, _): (Response, _) = protocol::recv(b.as_fd()).unwrap().unwrap();
    assert!(matches!(
        resp,
        Response::Error(RemoteError::Malformed { .. })
    ));
    assert_eq!(
        call(&b, Request::Stats).0,
        Response::Stats {
            segments: 1,
            registrations: 0
        }
    );
}

#[test]
fn bad_prefix_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::new(dir.path().join("x.sock"), SegmentBackend::Memfd, 1);
    config.name_prefix = "other-".into();
    assert!(matches!(
        StoreClientServer::bind(config),
        Err(ServerError::BadPrefix(_))
    ));
}
