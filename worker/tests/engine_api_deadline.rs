//! Deadlines of the engine API (engine.proto, "Deadlines"): a call that would block past the client's
//! `grpc-timeout` — or past the worker's own maximum when the client sends none — answers
//! DEADLINE_EXCEEDED with a typed reason and leaves the room as it was; a room whose KV misses its
//! own deadline fails through the gate (KV_TIMEOUT); a stream with a deadline ends with it.

mod engine_api_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_api_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::engine_api::pb;
use tandem_worker::engine_api::service::Backend;
use tandem_worker::release::RoomKey;
use tandem_worker::release::receiver::ReceiverState;
use tokio_stream::StreamExt;
use tonic::Code;

fn worker(max_call: Duration) -> Worker {
    start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 4,
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options {
            tweak: Box::new(move |a| a.max_call = max_call),
            ..Options::default()
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn await_kv_past_its_deadline_is_deadline_exceeded_and_the_room_stays() {
    let w = worker(Duration::from_millis(400));
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let r = c
        .decode
        .reserve(c.req(pb::ReserveRequest {
            attach_id: id,
            request_id: 1,
            tokens: 4,
            kv_deadline_ms: 60_000,
            hand_off_token: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    let k: RoomKey = r.room.unwrap().into();
    // The client's deadline (200 ms) is shorter than the worker's maximum (400 ms).
    let t0 = Instant::now();
    let e = api_err(
        c.decode
            .await_kv(c.req_within(
                pb::AwaitKvRequest {
                    attach_id: id,
                    room: r.room,
                },
                Duration::from_millis(200),
            ))
            .await,
    );
    let took = t0.elapsed();
    assert_eq!(
        (e.code, e.reason),
        (Code::DeadlineExceeded, pb::ErrorReason::DeadlineExceeded),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // The room is untouched by a call's deadline.
    let d = w.api.decode_side().unwrap();
    assert_eq!(d.room_state(k), Some(ReceiverState::WaitingForInput));
    // Without a client deadline, the worker's maximum applies.
    let t0 = Instant::now();
    let mut req = tonic::Request::new(pb::AwaitKvRequest {
        attach_id: id,
        room: r.room,
    });
    req.metadata_mut().remove("grpc-timeout");
    let e = api_err(c.decode.await_kv(req).await);
    assert_eq!(e.reason, pb::ErrorReason::DeadlineExceeded);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // Once the KV is there, the same call answers at once.
    d.on_complete(k);
    let kv = c
        .decode
        .await_kv(c.req_within(
            pb::AwaitKvRequest {
                attach_id: id,
                room: r.room,
            },
            Duration::from_millis(200),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(
        kv.outcome,
        Some(pb::await_kv_reply::Outcome::Complete(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_past_its_kv_deadline_fails_through_the_gate() {
    let w = worker(Duration::from_secs(10));
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let r = c
        .decode
        .reserve(c.req(pb::ReserveRequest {
            attach_id: id,
            request_id: 1,
            tokens: 4,
            kv_deadline_ms: 100,
            hand_off_token: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    let kv = c
        .decode
        .await_kv(c.req(pb::AwaitKvRequest {
            attach_id: id,
            room: r.room,
        }))
        .await
        .unwrap()
        .into_inner();
    match kv.outcome {
        Some(pb::await_kv_reply::Outcome::Failed(f)) => {
            assert_eq!(f.reason, pb::FailureReason::KvTimeout as i32)
        }
        other => panic!("expected KV_TIMEOUT, got {other:?}"),
    }
    // The timeout takes the gate like any failure: the pages wait for the writer's ack.
    let k: RoomKey = r.room.unwrap().into();
    assert_eq!(
        w.api.decode_side().unwrap().room_state(k),
        Some(ReceiverState::ReleasePending)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_a_deadline_ends_with_deadline_exceeded() {
    let w = worker(Duration::from_secs(10));
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let t0 = Instant::now();
    let mut s = c
        .decode
        .watch_releases(c.req_within(
            pb::WatchReleasesRequest {
                attach_id: att.id(),
            },
            Duration::from_millis(300),
        ))
        .await
        .unwrap()
        .into_inner();
    let end = tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .expect("the stream ends within 5 s");
    let st = end.expect("an item").expect_err("the deadline status");
    let e = tandem_worker::engine_api::ApiError::from_status(&st).expect("typed");
    assert_eq!(e.reason, pb::ErrorReason::DeadlineExceeded);
    assert!(t0.elapsed() >= Duration::from_millis(250));
}
