//! Issue 18, item 2: every request ends. A real decode process (loopback net 124–129) against a
//! fault-injecting prefill peer — a fake `Transfer` service in this test that accepts the hello and
//! the room and then goes silent — and against a real prefill with a decode too long for the
//! deadline. The request ends with a reason within its deadline (`TANDEM_DECODE_REQUEST_DEADLINE_MS`),
//! counted by stage, and its pages go back. The same fake answering a room as another incarnation
//! than its hello tests the decode's side of item 1 (a prefill restarted behind the link).

mod serve_support;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::control::pb::{self, peer_message::Body};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

/// How the fake prefill fails.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// OpenRoom is accepted and never answered.
    OpenRoomHangs,
    /// OpenRoom is answered, heartbeats too, but no page ever follows.
    SilentAfterOpen,
    /// OpenRoom is answered by another incarnation than the hello's (the prefill restarted on its
    /// address and the decode's channel reconnected to the new process, issue 18 item 1).
    RestartedBehindLink,
    /// Heartbeats are answered by another incarnation than the hello's.
    HeartbeatsFromAnother,
}

/// A prefill peer that handshakes like a real one (revision `r1`, the decode's layout) and then
/// fails as `fault` says.
#[derive(Clone)]
struct FakePrefill {
    fault: Fault,
    opened: Arc<AtomicU64>,
    aborts: Arc<AtomicU64>,
    hellos: Arc<AtomicU64>,
    heartbeats: Arc<AtomicU64>,
}

const FAKE_INCARNATION: u64 = 77;

type Events = Pin<Box<dyn Stream<Item = Result<pb::RoomEvent, Status>> + Send>>;
type Signals = Pin<Box<dyn Stream<Item = Result<pb::PeerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::transfer_server::Transfer for FakePrefill {
    async fn peer_hello(
        &self,
        req: Request<pb::PeerInfo>,
    ) -> Result<Response<pb::PeerInfo>, Status> {
        let peer = req.into_inner();
        self.hellos.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::PeerInfo {
            worker_id: "fake-prefill".into(),
            role: pb::Role::Prefill as i32,
            layout: peer.layout,
            revision: "r1".into(),
            incarnation: FAKE_INCARNATION,
            ..Default::default()
        }))
    }

    async fn open_room(
        &self,
        req: Request<pb::OpenRoomRequest>,
    ) -> Result<Response<pb::OpenRoomReply>, Status> {
        self.opened.fetch_add(1, Ordering::SeqCst);
        if self.fault == Fault::OpenRoomHangs {
            std::future::pending::<()>().await;
        }
        let incarnation = if self.fault == Fault::RestartedBehindLink {
            FAKE_INCARNATION + 1
        } else {
            FAKE_INCARNATION
        };
        Ok(Response::new(pb::OpenRoomReply {
            room: req.into_inner().room,
            incarnation,
            ..Default::default()
        }))
    }

    async fn submit_chunk(
        &self,
        _: Request<pb::SubmitChunkRequest>,
    ) -> Result<Response<pb::OpResult>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn abort_room(
        &self,
        req: Request<pb::Abort>,
    ) -> Result<Response<pb::AbortTicket>, Status> {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::AbortTicket {
            room: req.into_inner().room,
            immediate_ack: None,
        }))
    }

    type WatchRoomStream = Events;

    async fn watch_room(
        &self,
        _: Request<pb::RoomRef>,
    ) -> Result<Response<Self::WatchRoomStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::empty())))
    }

    async fn snapshot_prepare(
        &self,
        _req: Request<pb::SnapshotPrepareRequest>,
    ) -> Result<Response<pb::SnapshotPrepareReply>, Status> {
        Err(Status::unimplemented(
            "the fake prefill has no snapshot buffer",
        ))
    }

    async fn snapshot_seal(
        &self,
        _req: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::SnapshotReply>, Status> {
        Err(Status::unimplemented(
            "the fake prefill has no snapshot buffer",
        ))
    }

    async fn snapshot_abort(
        &self,
        _req: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::SnapshotReply>, Status> {
        Err(Status::unimplemented(
            "the fake prefill has no snapshot buffer",
        ))
    }

    type SignalStream = Signals;

    /// Answers heartbeats (the link stays alive) and acks aborts (nothing was written).
    async fn signal(
        &self,
        req: Request<Streaming<pb::PeerMessage>>,
    ) -> Result<Response<Self::SignalStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let aborts = self.aborts.clone();
        let fault = self.fault;
        let heartbeats = self.heartbeats.clone();
        tokio::spawn(async move {
            while let Some(Ok(m)) = inbound.next().await {
                if let Some(Body::Heartbeat(_)) = &m.body {
                    heartbeats.fetch_add(1, Ordering::SeqCst);
                }
                let reply = match m.body {
                    Some(Body::Heartbeat(_)) => Body::Heartbeat(pb::Heartbeat {
                        incarnation: if fault == Fault::HeartbeatsFromAnother {
                            FAKE_INCARNATION + 1
                        } else {
                            FAKE_INCARNATION
                        },
                        ..Default::default()
                    }),
                    Some(Body::Abort(a)) => {
                        aborts.fetch_add(1, Ordering::SeqCst);
                        Body::Ack(pb::AbortAck {
                            room: a.room,
                            prefill_rank: 0,
                            decode_rank: a.decode_rank,
                            kind: pb::AckKind::NoneStarted as i32,
                        })
                    }
                    _ => continue,
                };
                if tx.send(Ok(pb::PeerMessage { body: Some(reply) })).is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        )))
    }
}

/// Starts the fake prefill on `addr`; returns it (its counts).
async fn fake_prefill(addr: SocketAddr, fault: Fault) -> FakePrefill {
    let fake = FakePrefill {
        fault,
        opened: Arc::default(),
        aborts: Arc::default(),
        hellos: Arc::default(),
        heartbeats: Arc::default(),
    };
    let counts = fake.clone();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::transfer_server::TransferServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    counts
}

/// One completion; `Err` when nothing (complete) came back within `within`.
async fn completion_within(
    front: SocketAddr,
    body: Value,
    within: Duration,
) -> Result<(u16, String), String> {
    tokio::time::timeout(within, http(front, "POST", "/v1/completions", Some(body)))
        .await
        .map(|(code, frames)| (code, text(&frames)))
        .map_err(|_| format!("no answer within {within:?}"))
}

/// A decode (request deadline `deadline_ms`, KV deadline 60 s) whose only prefill is the fake.
async fn decode_against_the_fake(
    net: u8,
    fault: Fault,
    deadline_ms: &str,
    extra_env: &[(&str, &str)],
) -> (World, Proc, FakePrefill) {
    decode_against_the_fake_on(net, (2, 9), fault, deadline_ms, extra_env).await
}

/// As [`decode_against_the_fake`], the fake on host `hosts.0` and the decode on `hosts.1`.
async fn decode_against_the_fake_on(
    net: u8,
    hosts: (u8, u8),
    fault: Fault,
    deadline_ms: &str,
    extra_env: &[(&str, &str)],
) -> (World, Proc, FakePrefill) {
    let w = World::new(net);
    w.publish(&[hosts.0]);
    let counts = fake_prefill(w.addr(hosts.0, w.ports.control), fault).await;
    let mut env = vec![
        ("TANDEM_DECODE_KV_DEADLINE_MS", "60000"),
        ("TANDEM_DECODE_REQUEST_DEADLINE_MS", deadline_ms),
    ];
    env.extend_from_slice(extra_env);
    let d = w.spawn(hosts.1, &config(WorkerRole::Decode, "r1", w.ports), &env);
    let health = w.addr(hosts.1, w.ports.health);
    if fault == Fault::HeartbeatsFromAnother {
        // Ready only between a handshake and the first heartbeat's answer: wait for the hello.
        until(Duration::from_secs(30), || async {
            counts.hellos.load(Ordering::SeqCst) >= 1
        })
        .await;
    } else {
        until(Duration::from_secs(30), || async {
            status(health, "/readyz").await == Some(200)
        })
        .await;
    }
    (w, d, counts)
}

async fn report(addr: SocketAddr) -> Value {
    get_json(addr, "/report").await.1
}

async fn pages_all_free(health: SocketAddr) {
    until(Duration::from_secs(15), || async {
        let p = &report(health).await["kv_pages"];
        p["held"] == 0 && p["quarantined"] == 0 && p["free"] == p["total"]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_accepts_the_room_and_goes_silent_ends_the_request_at_its_deadline() {
    let (w, _d, fake) = decode_against_the_fake(124, Fault::SilentAfterOpen, "1500", &[]).await;
    let (opened, aborts) = (fake.opened, fake.aborts);
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    for stream in [false, true] {
        let sent = Instant::now();
        let (code, body) =
            completion_within(front, completion(1200, 4, stream), Duration::from_secs(10))
                .await
                .unwrap();
        let took = sent.elapsed();
        assert_eq!(code, 504, "{body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["code"], "request_deadline_exceeded", "{e}");
        assert_eq!(e["error"]["type"], "timeout", "{e}");
        assert!(
            took >= Duration::from_millis(1400) && took < Duration::from_secs(4),
            "ended after {took:?}"
        );
    }
    assert_eq!(opened.load(Ordering::SeqCst), 2);
    let r = report(health).await;
    assert_eq!(r["requests_deadline_exceeded"]["prefill"], 2, "{r}");
    assert_eq!(r["counters"]["requests_failed"], 2, "{r}");
    // The rooms went through the release gate: ABORT reached the peer, the pages came back.
    until(Duration::from_secs(10), || async {
        aborts.load(Ordering::SeqCst) >= 2
    })
    .await;
    pages_all_free(health).await;
    // The decode still serves (and is still ready: the peer is alive, only useless).
    assert_eq!(status(health, "/readyz").await, Some(200));
}

/// Negative control: the same silent peer without a short request deadline (10 min) leaves the
/// request unanswered — the deadline is what ends it (the KV deadline is 60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_the_deadline_the_silent_peer_hangs_the_request() {
    let (w, _d, _) = decode_against_the_fake(125, Fault::SilentAfterOpen, "600000", &[]).await;
    let front = w.addr(9, w.ports.front);
    let r = completion_within(front, completion(1200, 4, false), Duration::from_secs(3)).await;
    assert!(r.is_err(), "answered without the deadline: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_never_answers_the_room_ends_the_request_with_a_reason() {
    let (w, _d, fake) = decode_against_the_fake(126, Fault::OpenRoomHangs, "10000", &[]).await;
    let opened = fake.opened;
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let sent = Instant::now();
    let (code, body) = completion_within(front, completion(600, 4, false), Duration::from_secs(15))
        .await
        .unwrap();
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "{:?}",
        sent.elapsed()
    );
    assert!(code == 503 || code == 504, "{code} {body}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert!(e["error"]["code"].is_string(), "{e}");
    assert!(opened.load(Ordering::SeqCst) >= 1);
    pages_all_free(health).await;
}

/// A decode longer than the deadline (60000 tokens at 1 ms): the stream ends with the error as its
/// last event and no `[DONE]`, within the deadline; counted under `stream`; pages back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_its_deadline_ends_with_the_error_event() {
    let w = World::new(127);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(
        9,
        &config(WorkerRole::Decode, "r1", w.ports),
        &[("TANDEM_DECODE_REQUEST_DEADLINE_MS", "1500")],
    );
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(30), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let sent = Instant::now();
    let (code, body) = completion_within(
        front,
        completion(100, 60_000, true),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(
        sent.elapsed() < Duration::from_secs(4),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(code, 200);
    let events = sse_events(&body);
    assert!(events.len() > 2, "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "request_deadline_exceeded", "{last}");
    assert!(!events.iter().any(|e| e == "[DONE]"));
    let r = report(health).await;
    assert_eq!(r["requests_deadline_exceeded"]["stream"], 1, "{r}");
    pages_all_free(health).await;
    // A short request right after is served.
    let (code, body) = completion_within(front, completion(100, 3, false), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
}

/// Issue 18 item 1, the decode's side: a room answered by another incarnation than the link's hello
/// (the prefill restarted behind a reconnecting channel) fails at once through the release gate,
/// the new process is asked to drop it, and the link is dropped and handshaken again.
async fn room_on_a_restarted_peer(
    net: u8,
    env: &[(&str, &str)],
) -> (u16, String, Duration, Value, FakePrefill) {
    let (w, _d, fake) = decode_against_the_fake(net, Fault::RestartedBehindLink, "1500", env).await;
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    let sent = Instant::now();
    let (code, body) = completion_within(front, completion(600, 4, false), Duration::from_secs(10))
        .await
        .unwrap();
    let took = sent.elapsed();
    until(Duration::from_secs(10), || async {
        report(health).await["kv_pages"]["held"] == 0
    })
    .await;
    let r = report(health).await;
    if r["incarnation"] != 0 {
        // The new process was told to drop the room; the link is handshaken again at the next
        // refresh (2 s) and the decode is ready again.
        until(Duration::from_secs(10), || async {
            fake.aborts.load(Ordering::SeqCst) >= 1
                && fake.hellos.load(Ordering::SeqCst) >= 2
                && status(health, "/readyz").await == Some(200)
        })
        .await;
    }
    (code, body, took, r, fake)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_answered_by_a_new_incarnation_fails_at_once_and_the_link_is_handshaken_again() {
    let (code, body, took, r, fake) =
        room_on_a_restarted_peer(128, &[("RUST_LOG", "tandem_worker=debug")]).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"code\":\"prefill_unavailable\""), "{body}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert!(r["peer_restarts"].as_u64().is_some_and(|n| n >= 1), "{r}");
    // The new process was told to drop the room; the link was handshaken again.
    assert!(fake.aborts.load(Ordering::SeqCst) >= 1);
    assert!(fake.hellos.load(Ordering::SeqCst) >= 2);
    assert_eq!(r["kv_pages"]["quarantined"], 0, "{r}");
}

/// Negative control: ignoring incarnations, the room on the new process waits for KV that no
/// signal stream will announce, until the request's deadline.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_ignoring_the_incarnation_waits_on_the_restarted_peer() {
    let (code, body, took, r, _) =
        room_on_a_restarted_peer(129, &[("TANDEM_NEGATIVE_IGNORE_INCARNATION", "1")]).await;
    assert_eq!(code, 504, "{body}");
    assert!(took >= Duration::from_millis(1400), "{took:?}");
    assert_eq!(r["peer_restarts"], 0, "{r}");
}

/// A peer whose heartbeats name another incarnation than its hello is a restarted process: the
/// decode drops the link (its rooms through the gate) and handshakes again, each time.
async fn heartbeats_from_another(net: u8, env: &[(&str, &str)]) -> (Value, FakePrefill) {
    let (w, _d, fake) =
        decode_against_the_fake_on(net, (3, 10), Fault::HeartbeatsFromAnother, "1500", env).await;
    let health = w.addr(10, w.ports.health);
    // Three heartbeats answered, each naming the other incarnation (with the fix, each on a new
    // link: the decode reconnects at its refresh period, 2 s).
    until(Duration::from_secs(20), || async {
        fake.heartbeats.load(Ordering::SeqCst) >= 3
    })
    .await;
    (report(health).await, fake)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_from_a_new_incarnation_drop_the_link_and_it_is_handshaken_again() {
    let (r, fake) = heartbeats_from_another(124, &[]).await;
    assert!(r["peer_restarts"].as_u64().is_some_and(|n| n >= 2), "{r}");
    assert!(fake.hellos.load(Ordering::SeqCst) >= 3);
}

/// Negative control: ignoring incarnations, the link to the "restarted" peer is kept.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_ignoring_the_incarnation_keeps_the_stale_link() {
    let (r, fake) =
        heartbeats_from_another(125, &[("TANDEM_NEGATIVE_IGNORE_INCARNATION", "1")]).await;
    assert_eq!(r["peer_restarts"], 0, "{r}");
    assert_eq!(fake.hellos.load(Ordering::SeqCst), 1);
}
