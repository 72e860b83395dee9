//! Prefill and decode workers over real gRPC control and TCP data on loopback (DESIGN contract 3).
//!
//! - A prefill peer killed mid-transfer: the room fails within its deadline, the gate decides the
//!   pages' fate (freed on the receiver-fence proof; quarantined with an alarm when no proof is
//!   allowed), and the next transfer to a restarted peer works.
//! - A decode timeout with no transport proof frees the pages only on the prefill ack.
//! - A completed room's pages stay held by its lease while the request decodes — even when the
//!   prefill peer dies meanwhile — and return on finish, on a spec-guard abort, or on drop.

use std::net::TcpListener as StdListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_worker::control::KvLayout;
use tandem_worker::control::pb::RequestSpec;
use tandem_worker::release::RoomKey;
use tandem_worker::release::receiver::{FailureCause, GateMode, ReceiverState};
use tandem_worker::roles::decode::node::{DecodeConfig, DecodeNode, TransferOutcome, room_base};
use tandem_worker::roles::prefill::node::{PrefillConfig, PrefillNode, PrefillService};
use tandem_worker::transfer::tcp::{TcpConfig, TcpTransport};
use tokio::runtime::Runtime;
use tokio_stream::wrappers::TcpListenerStream;

const LAYOUT: KvLayout = KvLayout {
    layers: 4,
    page_tokens: 16,
    token_bytes: 256,
};
const PAGES: u32 = 64;

struct Prefill {
    runtime: Option<Runtime>,
    addr: String,
    node: Arc<PrefillNode>,
}

impl Prefill {
    /// A prefill worker on its own runtime (so that it can be killed without touching the test's).
    fn start(compute_per_page: Duration) -> Prefill {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
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
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        Prefill {
            runtime: Some(runtime),
            addr,
            node,
        }
    }

    /// Kills the worker: every task stops and every connection closes, with no goodbye.
    ///
    /// The runtime goes first, taking the control stream with it; only then do the data
    /// connections close. The other order lets a still-running task see its write fail and
    /// report `Failed` over the control stream — a goodbye a killed process never sends (this
    /// race failed CI once: `PrefillFailed` where `HeartbeatLost` was due).
    fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
        self.node.transport().shutdown();
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        self.kill();
    }
}

fn decode(fence_is_proof: bool, ack_timeout: Duration) -> Arc<DecodeNode> {
    DecodeNode::start(DecodeConfig {
        worker_id: "decode-0".into(),
        rank: 0,
        pages: PAGES,
        layout: LAYOUT,
        data_bind: "127.0.0.1:0".into(),
        ack_timeout,
        heartbeat: Duration::from_millis(100),
        fence_is_proof,
        gate: GateMode::Safe,
    })
    .unwrap()
}

fn request(id: u64, pages: u32) -> RequestSpec {
    RequestSpec {
        request_id: id,
        input_tokens: pages * LAYOUT.page_tokens,
        output_tokens: 8,
        hash_ids: vec![],
    }
}

/// The room failed because its prefill peer was declared dead.
fn assert_heartbeat_lost(out: &TransferOutcome) {
    assert!(
        matches!(
            out,
            TransferOutcome::Failed {
                cause: FailureCause::HeartbeatLost,
                ..
            }
        ),
        "{out:?}"
    );
}

async fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (at most 5 s) until KV is landing in the first room of `d` (a fresh decode's first
/// transfer, still running): the moment to kill its prefill mid-transfer.
async fn wait_kv_landing<T>(d: &DecodeNode, transfer: &tokio::task::JoinHandle<T>) {
    wait_kv_landing_in(d, 0, transfer).await;
}

/// Waits (at most 5 s) until KV is landing in room `n` of `d` (its `n`-th transfer, from 0,
/// still running).
async fn wait_kv_landing_in<T>(d: &DecodeNode, n: u64, transfer: &tokio::task::JoinHandle<T>) {
    let room = RoomKey::new(room_base("decode-0") + n, 1);
    let t0 = Instant::now();
    while d.room_state(room) != Some(ReceiverState::Transferring) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no KV landed: {:?}",
            d.room_state(room)
        );
        assert!(
            !transfer.is_finished(),
            "the transfer ended before the kill"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_completes_and_verifies() {
    let d = decode(true, Duration::from_secs(2));
    let p = Prefill::start(Duration::from_millis(1));
    let link = d.connect(&p.addr, Duration::from_secs(2)).await.unwrap();
    let out = d
        .transfer(&link, request(11, 8), Duration::from_secs(5))
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_room_stays_held_while_decoding_until_its_lease_ends() {
    let d = decode(true, Duration::from_secs(2));
    // Slow enough that a transfer is still running when the peer is killed (the last step).
    let mut p = Prefill::start(Duration::from_millis(20));
    let link = d.connect(&p.addr, Duration::from_secs(2)).await.unwrap();

    // Finished normally: held until finish.
    let (out, lease) = d
        .transfer_held(&link, request(51, 8), Duration::from_secs(5))
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
    let lease = lease.expect("a completed room is leased");
    assert_eq!(d.pages().held, 8);
    assert_eq!(d.room_state(lease.key()), Some(ReceiverState::Committed));
    lease.finish();
    assert_eq!(d.pages().free, PAGES as usize);

    // Aborted by the spec guard: the gate frees a concluded room at once, nothing quarantined.
    let (_, lease) = d
        .transfer_held(&link, request(52, 8), Duration::from_secs(5))
        .await
        .unwrap();
    let lease = lease.unwrap();
    assert_eq!(d.pages().held, 8);
    lease.abort(FailureCause::SpecGuard);
    assert_eq!(d.pages().free, PAGES as usize);
    assert_eq!(d.pages().quarantined, 0);

    // The prefill peer dies while the request decodes: its writes all concluded, so the pages
    // stay with the decode until the lease is dropped. A second room (54) is still landing when
    // the peer dies: its failure and release are the observed end of the decode's handling of the
    // death (one pass over the peer's rooms), after which room 53 must be as it was.
    let (_, lease) = d
        .transfer_held(&link, request(53, 8), Duration::from_secs(5))
        .await
        .unwrap();
    let lease = lease.unwrap();
    let (d2, l2) = (d.clone(), link.clone());
    let landing = tokio::spawn(async move {
        d2.transfer(&l2, request(54, 32), Duration::from_secs(30))
            .await
    });
    wait_kv_landing_in(&d, 3, &landing).await;
    p.kill();
    let out = tokio::time::timeout(Duration::from_secs(5), landing)
        .await
        .expect("the landing room fails within the heartbeat deadline")
        .unwrap()
        .unwrap();
    assert_heartbeat_lost(&out);
    assert!(!link.alive(), "peer declared dead");
    // The landing room's pages return on the receiver-fence proof; the leased room's stay.
    let landing_room = RoomKey::new(room_base("decode-0") + 3, 1);
    wait_until("the landing room released", Duration::from_secs(3), || {
        d.room_state(landing_room).is_none()
    })
    .await;
    assert_eq!(
        d.pages().held,
        8,
        "a dead peer must not free pages being decoded"
    );
    assert_eq!(d.room_state(lease.key()), Some(ReceiverState::Committed));
    drop(lease);
    assert_eq!(d.pages().free, PAGES as usize);
    assert_eq!(d.pages().alarms, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_transfer_fails_room_frees_on_proof_and_restarted_peer_works() {
    let d = decode(true, Duration::from_secs(5));
    let mut p = Prefill::start(Duration::from_millis(20));
    let link = d.connect(&p.addr, Duration::from_secs(2)).await.unwrap();
    let d2 = d.clone();
    let l2 = link.clone();
    let t0 = Instant::now();
    let transfer = tokio::spawn(async move {
        d2.transfer(&l2, request(21, 32), Duration::from_secs(30))
            .await
    });
    wait_kv_landing(&d, &transfer).await;
    assert!(d.pages().held > 0, "transfer in progress");
    p.kill();
    let out = transfer.await.unwrap().unwrap();
    let failed_after = t0.elapsed();
    assert_heartbeat_lost(&out);
    assert!(
        failed_after < Duration::from_secs(2),
        "room must fail within the heartbeat deadline, took {failed_after:?}"
    );
    // The receiver fence proves no write can land: pages return without any ack.
    wait_until("pages released", Duration::from_secs(3), || {
        d.pages().free == PAGES as usize
    })
    .await;
    assert_eq!(d.pages().alarms, 0);
    assert!(!link.alive());

    // A restarted peer (new process, new address): the next transfer works end to end.
    let p2 = Prefill::start(Duration::from_millis(1));
    let link2 = d.connect(&p2.addr, Duration::from_secs(2)).await.unwrap();
    let out = d
        .transfer(&link2, request(22, 16), Duration::from_secs(5))
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_without_transport_proof_quarantines_with_alarm() {
    // As over RDMA: no receiver-side check counts as proof, and a dead peer can never ack.
    let d = decode(false, Duration::from_millis(300));
    let mut p = Prefill::start(Duration::from_millis(20));
    let link = d.connect(&p.addr, Duration::from_secs(2)).await.unwrap();
    let d2 = d.clone();
    let transfer = tokio::spawn(async move {
        d2.transfer(&link, request(31, 32), Duration::from_secs(30))
            .await
    });
    wait_kv_landing(&d, &transfer).await;
    p.kill();
    let out = transfer.await.unwrap().unwrap();
    assert_heartbeat_lost(&out);
    wait_until("quarantine", Duration::from_secs(3), || {
        d.pages().alarms == 1
    })
    .await;
    let pages = d.pages();
    assert_eq!(pages.quarantined, 32, "{pages:?}");
    assert_eq!(
        pages.free,
        (PAGES - 32) as usize,
        "quarantined pages never return to the free list"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_without_proof_frees_only_on_prefill_ack() {
    let d = decode(false, Duration::from_secs(5));
    let p = Prefill::start(Duration::from_millis(30));
    let link = d.connect(&p.addr, Duration::from_secs(2)).await.unwrap();
    let out = d
        .transfer(&link, request(41, 10), Duration::from_millis(100))
        .await
        .unwrap();
    let TransferOutcome::Failed {
        key,
        cause: FailureCause::Timeout,
    } = out
    else {
        panic!("{out:?}")
    };
    // Pages are held until the ack arrives over the signal stream (prefill drains its writes first).
    wait_until("ack release", Duration::from_secs(3), || {
        d.pages().free == PAGES as usize
    })
    .await;
    assert_eq!(d.room_state(key), None);
    assert_eq!(d.pages().alarms, 0);
    wait_until("prefill room drained", Duration::from_secs(3), || {
        p.node.rooms_held() == 0
    })
    .await;
}
