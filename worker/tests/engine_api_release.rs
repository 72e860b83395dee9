//! The decode calls over the release gate (DESIGN contract 3, seed 004): Finish and Abort hand the
//! pages to the gate, and the engine gets them back only with SafeToReuse — after every prefill rank
//! that could write acked (or a transport proof), never while a write can still land.
//!
//! The end-to-end scenario runs two workers (prefill and decode) linked by `LocalLink` with one
//! engine each, holds the prefill's write of a room in flight, aborts the room on decode, and checks
//! that its pages come back only after the write is terminal and that the next request's KV verifies.
//! Negative control (`--features negative-controls`): a decode worker that frees pages on Abort at once
//! breaks both checks.

mod engine_api_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine_api_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::engine_api::client::{Attached, EngineClient};
use tandem_worker::engine_api::local::LocalLink;
use tandem_worker::engine_api::pb;
use tandem_worker::engine_api::prefill::{KvSink, PagesSend, PrefillSide};
use tandem_worker::engine_api::service::Backend;
use tandem_worker::release::receiver::ReceiverState;
use tandem_worker::release::sender::AbortAck;
use tandem_worker::release::{PrefillRank, RoomKey};
use tokio::sync::Notify;
use tokio_stream::{Stream, StreamExt};
use tonic::Code;

fn key(r: Option<pb::RoomRef>) -> RoomKey {
    r.unwrap().into()
}

async fn watch(c: &mut EngineClient, id: u64) -> tonic::Streaming<pb::SafeToReuse> {
    let r = c.req_within(
        pb::WatchReleasesRequest { attach_id: id },
        Duration::from_secs(60),
    );
    c.decode.watch_releases(r).await.unwrap().into_inner()
}

async fn next_release(s: &mut tonic::Streaming<pb::SafeToReuse>) -> pb::SafeToReuse {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("a SafeToReuse event within 10 s")
        .unwrap()
        .unwrap()
}

fn manual_decode(
    shape: Shape,
    tweak: Box<dyn FnOnce(&mut tandem_worker::engine_api::EngineApiConfig)>,
) -> (Worker, Arc<ManualSource>) {
    let source = Arc::new(ManualSource::default());
    let w = start_worker(
        worker_config(WorkerRole::Decode, shape),
        Backend::Decode(source.clone()),
        Options {
            tweak,
            ..Options::default()
        },
    );
    (w, source)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_holds_the_pages_until_the_ack_then_releases_them() {
    let (w, source) = manual_decode(
        Shape {
            pages: 4,
            ..Shape::default()
        },
        Box::new(|_| {}),
    );
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let mut releases = watch(&mut c, id).await;
    let r = c
        .decode
        .reserve(c.req(pb::ReserveRequest {
            attach_id: id,
            request_id: 7,
            tokens: 3 * PAGE_TOKENS,
            kv_deadline_ms: 60_000,
            hand_off_token: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.pages.len(), 3);
    let k = key(r.room);
    assert_eq!(source.opened.lock().unwrap()[0].pages, r.pages);
    let d = w.api.decode_side().unwrap();
    d.on_chunk(k); // a write of the room has landed: a later one may still come
    let a = c
        .decode
        .abort(c.req(pb::AbortRequest {
            attach_id: id,
            room: r.room,
            reason: pb::FailureReason::ClientAbort as i32,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(
        !a.released,
        "an aborted room with a writer waits for its ack"
    );
    assert_eq!(source.aborted.lock().unwrap()[0].1, vec![PrefillRank(0)]);
    assert_eq!(d.room_state(k), Some(ReceiverState::ReleasePending));
    let h = c.health().await.unwrap();
    assert_eq!((h.pages_release_pending, h.pages_free), (3, 1));
    // The pages are not reusable yet: a request needing them is refused, and nothing was released.
    let e = api_err(
        c.decode
            .reserve(c.req(pb::ReserveRequest {
                attach_id: id,
                request_id: 8,
                tokens: 2 * PAGE_TOKENS,
                kv_deadline_ms: 60_000,
                hand_off_token: 0,
            }))
            .await,
    );
    assert_eq!(
        (e.code, e.reason),
        (Code::ResourceExhausted, pb::ErrorReason::NoFreePages)
    );
    assert!(
        futures_now(&mut releases).is_none(),
        "no SafeToReuse before the ack"
    );
    // A stale-generation ack and an ack from a rank that was not asked do not count.
    d.on_ack(RoomKey::new(k.room.0, k.generation.0 + 1), PrefillRank(0));
    d.on_ack(k, PrefillRank(9));
    assert_eq!(d.room_state(k), Some(ReceiverState::ReleasePending));
    // The ack releases them.
    d.on_ack(k, PrefillRank(0));
    let ev = next_release(&mut releases).await;
    assert_eq!(key(ev.room), k);
    assert_eq!(ev.proof, pb::ReleaseProof::AllAcks as i32);
    let (mut got, mut want) = (ev.pages.clone(), r.pages.clone());
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want);
    assert_eq!(c.health().await.unwrap().pages_free, 4);
    assert_eq!(
        d.counters
            .released_acks
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // The release is numbered, and a Reserve that gets its pages names it: an engine that reads
    // this reply before the event (separate streams) waits for seq `ev.seq` before it touches them.
    assert_eq!(ev.seq, 1, "the attach's first release");
    let again = c
        .decode
        .reserve(c.req(pb::ReserveRequest {
            attach_id: id,
            request_id: 9,
            tokens: 4 * PAGE_TOKENS,
            kv_deadline_ms: 60_000,
            hand_off_token: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.after_release, ev.seq, "{again:?}");
}

/// The next item of a stream if one is already buffered (no waiting).
fn futures_now<T>(s: &mut tonic::Streaming<T>) -> Option<T> {
    use std::task::{Context, Poll};
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    match std::pin::Pin::new(s).poll_next(&mut cx) {
        Poll::Ready(Some(Ok(v))) => Some(v),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_releases_at_once_and_a_missing_ack_quarantines_until_a_late_one() {
    let (w, _source) = manual_decode(
        Shape {
            pages: 4,
            ..Shape::default()
        },
        Box::new(|a| a.ack_timeout = Duration::from_millis(150)),
    );
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let mut releases = watch(&mut c, id).await;
    let d = w.api.decode_side().unwrap();
    let reserve = |request: u64| pb::ReserveRequest {
        attach_id: id,
        request_id: request,
        tokens: PAGE_TOKENS,
        kv_deadline_ms: 60_000,
        hand_off_token: 0,
    };
    // Finish: KV complete, decode done: released at once with proof CONCLUDED.
    let r = c
        .decode
        .reserve(c.req(reserve(1)))
        .await
        .unwrap()
        .into_inner();
    let k = key(r.room);
    let e = api_err(
        c.decode
            .finish(c.req(pb::FinishRequest {
                attach_id: id,
                room: r.room,
            }))
            .await,
    );
    assert_eq!(
        e.reason,
        pb::ErrorReason::RoomState,
        "Finish before the KV completed"
    );
    d.on_chunk(k);
    d.on_complete(k);
    let kv = c
        .decode
        .await_kv(c.req(pb::AwaitKvRequest {
            attach_id: id,
            room: r.room,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(
        matches!(kv.outcome, Some(pb::await_kv_reply::Outcome::Complete(ref x)) if x.pages == r.pages)
    );
    let f = c
        .decode
        .finish(c.req(pb::FinishRequest {
            attach_id: id,
            room: r.room,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(f.released);
    let ev = next_release(&mut releases).await;
    assert_eq!(
        (key(ev.room), ev.proof),
        (k, pb::ReleaseProof::Concluded as i32)
    );
    // Abort with no ack by the deadline: quarantined (never freed by a timer), then a late ack
    // recovers the pages.
    let r = c
        .decode
        .reserve(c.req(reserve(2)))
        .await
        .unwrap()
        .into_inner();
    let k = key(r.room);
    c.decode
        .abort(c.req(pb::AbortRequest {
            attach_id: id,
            room: r.room,
            reason: 0,
        }))
        .await
        .unwrap();
    until("the room is quarantined", Duration::from_secs(5), || {
        d.room_state(k) == Some(ReceiverState::Quarantined)
    })
    .await;
    let h = c.health().await.unwrap();
    assert_eq!((h.pages_quarantined, h.pages_free), (1, 3));
    assert!(
        futures_now(&mut releases).is_none(),
        "a timer alone never releases"
    );
    d.on_ack(k, PrefillRank(0));
    let ev = next_release(&mut releases).await;
    assert_eq!(key(ev.room), k);
    assert!(ev.from_quarantine);
    assert_eq!(c.health().await.unwrap().pages_free, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tripped_spec_guard_aborts_the_room_through_the_gate() {
    let (w, _source) = manual_decode(
        Shape {
            pages: 2,
            draft: true,
            spec_guard: Some(8),
            ..Shape::default()
        },
        Box::new(|_| {}),
    );
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let mut releases = watch(&mut c, id).await;
    let d = w.api.decode_side().unwrap();
    let r = c
        .decode
        .reserve(c.req(pb::ReserveRequest {
            attach_id: id,
            request_id: 1,
            tokens: 5,
            kv_deadline_ms: 60_000,
            hand_off_token: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    let k = key(r.room);
    d.on_complete(k);
    let step = |accepted| pb::SpecStep {
        proposed: 4,
        accepted,
    };
    // Healthy while warming: 4 steps of 3 tokens = 12 tokens > 8, accept length 3.
    let ok = c
        .spec
        .report_steps(c.req(pb::SpecStepsRequest {
            attach_id: id,
            room: r.room,
            steps: vec![step(2); 4],
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(!ok.tripped);
    assert_eq!(ok.tokens, 12);
    // A malformed step is refused and not recorded.
    let e = api_err(
        c.spec
            .report_steps(c.req(pb::SpecStepsRequest {
                attach_id: id,
                room: r.room,
                steps: vec![step(1), step(5)],
            }))
            .await,
    );
    assert_eq!(
        (e.reason, e.field.as_str()),
        (pb::ErrorReason::SpecStepInvalid, "steps[1]")
    );
    // Every draft token rejected: accept length falls below 1.4 → tripped, room aborted.
    let bad = c
        .spec
        .report_steps(c.req(pb::SpecStepsRequest {
            attach_id: id,
            room: r.room,
            steps: vec![step(0); 40],
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(bad.tripped);
    assert_eq!(bad.anomaly, "low_accept_length");
    let ev = next_release(&mut releases).await;
    assert_eq!(
        (key(ev.room), ev.proof),
        (k, pb::ReleaseProof::Concluded as i32)
    );
    assert_eq!(
        d.counters
            .spec_trips
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

/// A sink that holds the first write of the prefill side in flight until released.
struct HoldFirst {
    inner: Arc<LocalLink>,
    held: Mutex<Option<(Arc<PrefillSide>, PagesSend)>>,
    holding: Mutex<bool>,
    arrived: Notify,
}

impl HoldFirst {
    fn release(&self) {
        let held = self.held.lock().unwrap().take();
        if let Some((side, w)) = held {
            self.inner.send(&side, w);
        }
    }
}

impl KvSink for HoldFirst {
    fn send(&self, side: &Arc<PrefillSide>, write: PagesSend) {
        let mut holding = self.holding.lock().unwrap();
        if !*holding {
            *holding = true;
            *self.held.lock().unwrap() = Some((side.clone(), write));
            self.arrived.notify_one();
            return;
        }
        drop(holding);
        self.inner.send(side, write);
    }
    fn ack(&self, ack: AbortAck) {
        self.inner.ack(ack);
    }
}

/// One prefill engine step: take the next work, write its KV into source pages `src`, PagesReady.
async fn prefill_one(
    c: &mut EngineClient,
    att: &Attached,
    work: &mut tonic::Streaming<pb::PrefillWork>,
    src: &[u32],
) -> pb::PrefillWork {
    let w = tokio::time::timeout(Duration::from_secs(10), work.next())
        .await
        .expect("work within 10 s")
        .unwrap()
        .unwrap();
    for (k, &p) in src.iter().enumerate() {
        write_room_page(att, w.request_id, w.tokens, k as u32, p);
    }
    let ok = c
        .prefill
        .pages_ready(c.req(pb::PagesReadyRequest {
            attach_id: att.id(),
            room: w.room,
            pages: src.to_vec(),
            first_page: 0,
            layers: None,
            last: true,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(ok.accepted);
    w
}

/// The seed-004 race through the engine API. Returns the violations found (empty = safe).
async fn abort_scenario(bypass: bool) -> Vec<String> {
    let link = LocalLink::new(0, 0);
    let hold = Arc::new(HoldFirst {
        inner: link.clone(),
        held: Mutex::new(None),
        holding: Mutex::new(false),
        arrived: Notify::new(),
    });
    // Decode holds one room at a time (2 pages); prefill has room for two rooms' source pages.
    let p = start_worker(
        worker_config(
            WorkerRole::Prefill,
            Shape {
                pages: 4,
                draft: true,
                ..Shape::default()
            },
        ),
        Backend::Prefill(hold.clone()),
        Options::default(),
    );
    let d = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 2,
                draft: true,
                ..Shape::default()
            },
        ),
        Backend::Decode(link.clone()),
        Options {
            tweak: Box::new(move |_a| {
                #[cfg(feature = "negative-controls")]
                {
                    _a.unsafe_release_on_abort = bypass;
                }
            }),
            ..Options::default()
        },
    );
    #[cfg(not(feature = "negative-controls"))]
    assert!(!bypass, "the bypass needs --features negative-controls");
    link.bind(&d.api, &p.api);
    let mut pc = p.client().await;
    let patt = pc.attach(identity(&p.cfg)).await.unwrap();
    let mut dc = d.client().await;
    let datt = dc.attach(identity(&d.cfg)).await.unwrap();
    let (pid, did) = (patt.id(), datt.id());
    let long = Duration::from_secs(60);
    let mut work = pc
        .prefill
        .watch_work(pc.req_within(pb::WatchWorkRequest { attach_id: pid }, long))
        .await
        .unwrap()
        .into_inner();
    let mut freed = pc
        .prefill
        .watch_source_free(pc.req_within(pb::WatchSourceFreeRequest { attach_id: pid }, long))
        .await
        .unwrap()
        .into_inner();
    let mut releases = watch(&mut dc, did).await;
    let tokens = 2 * PAGE_TOKENS; // the whole decode pool
    let reserve = |request| pb::ReserveRequest {
        attach_id: did,
        request_id: request,
        tokens,
        kv_deadline_ms: 60_000,
        hand_off_token: 0,
    };
    let mut violations = Vec::new();

    // Request 7: its write is held in flight.
    let r7 = dc
        .decode
        .reserve(dc.req(reserve(7)))
        .await
        .unwrap()
        .into_inner();
    let k7 = key(r7.room);
    let w7 = prefill_one(&mut pc, &patt, &mut work, &[0, 1]).await;
    assert_eq!(key(w7.room), k7);
    tokio::time::timeout(Duration::from_secs(10), hold.arrived.notified())
        .await
        .unwrap();
    // Decode aborts request 7 while its write can still land.
    let a = dc
        .decode
        .abort(dc.req(pb::AbortRequest {
            attach_id: did,
            room: r7.room,
            reason: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    let mut still_held = true;
    let r8 = match dc.decode.reserve(dc.req(reserve(8))).await {
        Ok(r) => {
            violations.push(format!(
                "request 8 reserved request 7's pages while 7's write was in flight (Abort released={})",
                a.released
            ));
            let ev = next_release(&mut releases).await;
            assert_eq!(key(ev.room), k7);
            r.into_inner()
        }
        Err(st) => {
            let e = tandem_worker::engine_api::ApiError::from_status(&st).unwrap();
            assert_eq!(e.reason, pb::ErrorReason::NoFreePages);
            assert!(!a.released);
            let h = dc.health().await.unwrap();
            assert_eq!(h.pages_release_pending, 2);
            // The write drains, prefill acks, the gate releases; only then may request 8 reserve.
            hold.release();
            still_held = false;
            let f = tokio::time::timeout(Duration::from_secs(10), freed.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!((key(f.room), f.sent), (k7, false));
            let ev = next_release(&mut releases).await;
            assert_eq!(
                (key(ev.room), ev.proof),
                (k7, pb::ReleaseProof::AllAcks as i32)
            );
            dc.decode
                .reserve(dc.req(reserve(8)))
                .await
                .unwrap()
                .into_inner()
        }
    };
    // Request 8 is computed into fresh source pages and lands.
    let w8 = prefill_one(&mut pc, &patt, &mut work, &[2, 3]).await;
    assert_eq!(key(w8.room), key(r8.room));
    let kv = dc
        .decode
        .await_kv(dc.req(pb::AwaitKvRequest {
            attach_id: did,
            room: r8.room,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(
        matches!(kv.outcome, Some(pb::await_kv_reply::Outcome::Complete(_))),
        "{kv:?}"
    );
    if still_held {
        // Seed 004's race: request 7's late write lands after request 8's KV.
        hold.release();
        // Wait until 7's write is terminal (its SourceFree; 8's may come first).
        loop {
            let f = tokio::time::timeout(Duration::from_secs(10), freed.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            if key(f.room) == k7 {
                break;
            }
        }
    }
    let bad = corrupt_chunks(&datt, 8, tokens, &r8.pages);
    if bad > 0 {
        violations.push(format!("{bad} corrupt chunks read for request 8"));
    }
    violations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_pages_return_only_after_the_in_flight_write_is_acked() {
    let v = abort_scenario(false).await;
    assert!(v.is_empty(), "{v:?}");
}

/// Negative control: with the gate bypassed on Abort, the same scenario finds the page reused while
/// a write was in flight and the late write corrupting the next request's KV.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_releasing_on_abort_corrupts_the_next_request() {
    let v = abort_scenario(true).await;
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(v[1].contains("corrupt chunks"), "{v:?}");
}
