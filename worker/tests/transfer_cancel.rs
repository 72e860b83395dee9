//! A request's future dropped at each of its await points — the room open, the transfer wait,
//! the decode — hands its room to the release gate exactly once (DESIGN contract 3): the pages
//! return to the free list only on the gate's proof (the prefill's ack here: the receiver fence is
//! not taken as proof), once, and the region then serves a request of its full size with intact
//! KV. Issue 19: before the room guard, a future dropped while the prompt was in prefill left its
//! pages held for good.
//!
//! With `--features negative-controls` the guard's hand-over is switched off: the leak comes back
//! and [`DecodeNode::stranded`] (the decode's readiness check) reports the pages.

use std::future::Future;
use std::net::TcpListener as StdListener;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tandem_worker::control::KvLayout;
use tandem_worker::control::pb::RequestSpec;
use tandem_worker::release::RoomKey;
use tandem_worker::release::receiver::{GateMode, ReceiverState};
use tandem_worker::roles::decode::node::{
    DecodeConfig, DecodeError, DecodeNode, RoomTally, Stranded, TransferOutcome, room_base,
};
use tandem_worker::roles::prefill::node::{PrefillConfig, PrefillNode, PrefillService};
use tandem_worker::transfer::tcp::{TcpConfig, TcpTransport};
use tokio_stream::wrappers::TcpListenerStream;

const LAYOUT: KvLayout = KvLayout {
    layers: 4,
    page_tokens: 16,
    token_bytes: 256,
};
const PAGES: u32 = 32;
const WORKER: &str = "decode-cancel";

/// A prefill worker on the test's runtime; `compute_per_page` paces its engine.
async fn prefill(compute_per_page: Duration) -> (String, Arc<PrefillNode>) {
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let cfg = PrefillConfig {
        worker_id: format!("prefill-{addr}"),
        rank: 0,
        layout: LAYOUT,
        compute_per_page,
    };
    let node = PrefillNode::new(cfg, Arc::new(TcpTransport::new(TcpConfig::default())));
    let service = PrefillService::new(node.clone()).into_server();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (addr, node)
}

/// A decode node whose gate frees pages on the prefill's ack only (no fence proof), so that a
/// release observed here went through the gate.
fn decode() -> Arc<DecodeNode> {
    DecodeNode::start(DecodeConfig {
        worker_id: WORKER.into(),
        rank: 0,
        pages: PAGES,
        layout: LAYOUT,
        data_bind: "127.0.0.1:0".into(),
        ack_timeout: Duration::from_secs(20),
        heartbeat: Duration::from_millis(100),
        fence_is_proof: false,
        gate: GateMode::Safe,
    })
    .unwrap()
}

fn request(id: u64, pages: u32) -> RequestSpec {
    RequestSpec {
        request_id: id,
        input_tokens: pages * LAYOUT.page_tokens,
        output_tokens: 4,
        hash_ids: vec![],
    }
}

/// The key of the `n`-th room (0-based) this decode opens.
fn room(n: u64) -> RoomKey {
    RoomKey::new(room_base(WORKER) + n, 1)
}

async fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls `fut` once; true when it is suspended (pending) afterwards.
async fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> bool {
    let mut fut = fut;
    std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx).is_pending())).await
}

/// After the abandoned room's release: every page is free again, once, through the gate; nothing
/// is quarantined or stranded; and the region serves a request of its full size with intact KV
/// (a page freed twice, or reused while a write could land, would show as corrupt chunks).
async fn assert_released_once_then_full_size_works(
    d: &Arc<DecodeNode>,
    link: &tandem_worker::roles::decode::node::PrefillLink,
    acks_before: u64,
    via_ack: bool,
) {
    wait_until(
        "the abandoned room's pages back in the pool",
        Duration::from_secs(10),
        || d.pages().free == PAGES as usize,
    )
    .await;
    let pages = d.pages();
    assert_eq!((pages.held, pages.quarantined), (0, 0), "{pages:?}");
    assert_eq!(
        d.tally(),
        RoomTally {
            opened: 1,
            released: 1,
            quarantined: 0,
            abandoned: 1,
            // Which proof freed the pages is checked below.
            ..d.tally()
        }
    );
    if via_ack {
        assert_eq!(d.tally().freed_on_ack, 1, "{:?}", d.tally());
        assert!(
            d.acks_received() > acks_before,
            "the pages came back without the prefill's ack: the gate was bypassed"
        );
    }
    assert_eq!(d.stranded(Duration::ZERO), Stranded::default());
    assert_eq!(d.room_state(room(0)), None);
    // Exactly once: the full region is one request, and the abandoned room's pages are not in the
    // free list twice.
    let out = d
        .transfer(link, request(99, PAGES), Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        matches!(
            out,
            TransferOutcome::Completed {
                corrupt_chunks: 0,
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(d.pages().free, PAGES as usize);
    let t = d.tally();
    assert_eq!((t.opened, t.released, t.abandoned), (2, 2, 1), "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_while_its_room_opens_releases_its_pages_through_the_gate_once() {
    let d = decode();
    let (addr, _p) = prefill(Duration::from_millis(1)).await;
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    let acks = d.acks_received();
    {
        let mut fut = pin!(d.transfer_held(&link, request(1, 8), Duration::from_secs(10)));
        // One poll: the pages are taken and the OpenRoom call is in flight (its first await).
        assert!(
            poll_once(fut.as_mut()).await,
            "the transfer cannot finish in one poll"
        );
        assert_eq!(d.pages().held, 8);
        assert_eq!(d.room_state(room(0)), Some(ReceiverState::WaitingForInput));
        // The request's future is dropped here, suspended at the room open.
    }
    // The gate holds the room until the prefill acks the abort: a live release, not a leak.
    assert_eq!(d.stranded(Duration::ZERO), Stranded::default());
    assert_released_once_then_full_size_works(&d, &link, acks, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_while_waiting_for_its_kv_releases_its_pages_through_the_gate_once() {
    let d = decode();
    // 8 pages at 40 ms each: the KV is still coming when the request is dropped.
    let (addr, p) = prefill(Duration::from_millis(40)).await;
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    let acks = d.acks_received();
    {
        let mut fut = pin!(d.transfer_held(&link, request(2, 8), Duration::from_secs(10)));
        // Drive the transfer until the prefill has the room open and a first chunk has landed:
        // the future is then waiting for the rest of the KV.
        tokio::select! {
            out = &mut fut => panic!("the transfer ended before it was dropped: {out:?}"),
            () = wait_until("the first chunk", Duration::from_secs(5), || {
                p.rooms_held() > 0
                    && d.room_state(room(0)) == Some(ReceiverState::Transferring)
            }) => {}
        }
        assert_eq!(d.pages().held, 8);
    }
    // Held by the gate (the prefill acks once its write in flight, if any, is done), or already
    // released on that ack: never stranded.
    assert_eq!(d.stranded(Duration::ZERO), Stranded::default());
    assert_released_once_then_full_size_works(&d, &link, acks, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_while_decoding_releases_its_pages_once() {
    let d = decode();
    let (addr, _p) = prefill(Duration::from_millis(1)).await;
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    let (out, lease) = d
        .transfer_held(&link, request(3, 8), Duration::from_secs(10))
        .await
        .unwrap();
    assert!(matches!(out, TransferOutcome::Completed { .. }), "{out:?}");
    let lease = lease.unwrap();
    // The decode of the request: it holds the lease until the last token, which never comes.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let decoding = tokio::spawn(async move {
        let _lease = lease;
        let _ = started_tx.send(());
        std::future::pending::<()>().await;
    });
    started_rx.await.unwrap();
    assert_eq!(d.pages().held, 8);
    // A live lease is never stranded, however long it holds.
    assert_eq!(d.stranded(Duration::ZERO), Stranded::default());
    decoding.abort();
    assert!(decoding.await.unwrap_err().is_cancelled());
    // A concluded room has no write that can land: freed at once, without an ack.
    assert_released_once_then_full_size_works(&d, &link, 0, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ending_releases_once_and_a_prompt_larger_than_the_region_is_refused_for_good() {
    let d = decode();
    let (addr, _p) = prefill(Duration::from_millis(1)).await;
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    // Finished and aborted leases: released, not abandoned.
    let (_, lease) = d
        .transfer_held(&link, request(4, 8), Duration::from_secs(10))
        .await
        .unwrap();
    lease.unwrap().finish();
    let (_, lease) = d
        .transfer_held(&link, request(5, 8), Duration::from_secs(10))
        .await
        .unwrap();
    lease
        .unwrap()
        .abort(tandem_worker::release::receiver::FailureCause::SpecGuard);
    assert_eq!(
        d.tally(),
        RoomTally {
            opened: 2,
            released: 2,
            quarantined: 0,
            abandoned: 0,
            ..d.tally()
        }
    );
    assert_eq!(d.pages().free, PAGES as usize);
    // More pages than the region has: a typed refusal, not "no pages now"; nothing allocated.
    let e = d
        .transfer_held(&link, request(6, PAGES + 1), Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(e, DecodeError::TooLarge { need, total } if need == PAGES as usize + 1 && total == PAGES as usize),
        "{e:?}"
    );
    assert_eq!(d.tally().opened, 2);
    assert_eq!(d.capacity_tokens(), u64::from(PAGES * LAYOUT.page_tokens));
}

/// Negative control: with the guard's hand-over switched off, a request dropped while its KV is
/// in prefill leaks its pages for good (issue 19), and the stranded check reports them.
#[cfg(feature = "negative-controls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_the_hand_over_the_pages_leak_and_are_reported_stranded() {
    let d = decode();
    d.leak_abandoned_rooms(true);
    let (addr, _p) = prefill(Duration::from_millis(1)).await;
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    {
        let mut fut = pin!(d.transfer_held(&link, request(7, 8), Duration::from_secs(10)));
        assert!(poll_once(fut.as_mut()).await);
    }
    // Nobody is left to release the room (whether or not the OpenRoom call left before the drop,
    // and the prefill wrote it): the stranded check sees it at once.
    assert_eq!(d.stranded(Duration::ZERO), Stranded { rooms: 1, pages: 8 });
    // The room never failed: no abort was sent and no gate deadline armed, so nothing will ever
    // free its pages (today's positive tests see them back within milliseconds).
    assert!(matches!(
        d.room_state(room(0)),
        Some(ReceiverState::WaitingForInput | ReceiverState::Transferring | ReceiverState::Success)
    ));
    assert_eq!(d.pages().held, 8);
    let t = d.tally();
    assert_eq!((t.opened, t.released, t.abandoned), (1, 0, 0), "{t:?}");
    let e = d
        .transfer_held(&link, request(8, PAGES), Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(matches!(e, DecodeError::NoPages { free: 24, .. }), "{e:?}");
}
