//! The gRPC control surface driven by an external engine: SubmitChunk pushes pages of an open room,
//! WatchRoom streams its states, and a chunk submitted after an abort is refused (R-ABORT-2).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_worker::control::KvLayout;
use tandem_worker::control::pb::transfer_client::TransferClient;
use tandem_worker::control::pb::{Abort, RequestSpec, RoomRef, RoomState, SubmitChunkRequest};
use tandem_worker::release::receiver::GateMode;
use tandem_worker::roles::decode::node::{DecodeConfig, DecodeNode, TransferOutcome, room_base};
use tandem_worker::roles::prefill::node::{PrefillConfig, PrefillNode, PrefillService};
use tandem_worker::transfer::tcp::{TcpConfig, TcpTransport};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    page_tokens: 16,
    token_bytes: 128,
};

async fn prefill_without_engine() -> (String, Arc<PrefillNode>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let cfg = PrefillConfig {
        worker_id: "prefill-x".into(),
        rank: 0,
        layout: LAYOUT,
        compute_per_page: Duration::ZERO,
    };
    let node = PrefillNode::new(cfg, Arc::new(TcpTransport::new(TcpConfig::default())));
    let mut service = PrefillService::new(node.clone());
    service.drive_engine = false;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (addr, node)
}

fn decode() -> Arc<DecodeNode> {
    DecodeNode::start(DecodeConfig {
        worker_id: "decode-x".into(),
        rank: 0,
        pages: 16,
        layout: LAYOUT,
        data_bind: "127.0.0.1:0".into(),
        ack_timeout: Duration::from_secs(5),
        heartbeat: Duration::from_millis(100),
        fence_is_proof: true,
        gate: GateMode::Safe,
    })
    .unwrap()
}

async fn wait_open(node: &PrefillNode) {
    let t0 = Instant::now();
    while node.rooms_held() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "room never opened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_pushes_chunks_and_watch_room_reports_states() {
    let (addr, node) = prefill_without_engine().await;
    let d = decode();
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    let (d2, l2) = (d.clone(), link.clone());
    let request = RequestSpec {
        request_id: 5,
        input_tokens: 4 * LAYOUT.page_tokens,
        output_tokens: 1,
        hash_ids: vec![],
    };
    let transfer =
        tokio::spawn(async move { d2.transfer(&l2, request, Duration::from_secs(10)).await });
    wait_open(&node).await;
    let room = RoomRef {
        room_id: room_base("decode-x"),
        generation: 1,
    };
    let mut client = TransferClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let mut events = client.watch_room(room).await.unwrap().into_inner();
    let first = events.next().await.unwrap().unwrap();
    assert_eq!(first.state(), RoomState::WaitingForInput);
    client
        .submit_chunk(SubmitChunkRequest {
            room: Some(room),
            first_page: 0,
            pages: 2,
            last: false,
        })
        .await
        .unwrap();
    client
        .submit_chunk(SubmitChunkRequest {
            room: Some(room),
            first_page: 2,
            pages: 2,
            last: true,
        })
        .await
        .unwrap();
    let out = transfer.await.unwrap().unwrap();
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
    let mut states = Vec::new();
    while let Ok(Some(Ok(ev))) =
        tokio::time::timeout(Duration::from_millis(500), events.next()).await
    {
        states.push(ev.state());
        if ev.state() == RoomState::Success {
            break;
        }
    }
    assert!(states.contains(&RoomState::Transferring), "{states:?}");
    assert_eq!(states.last(), Some(&RoomState::Success), "{states:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_after_abort_is_refused_and_an_idle_room_acks_at_once() {
    let (addr, node) = prefill_without_engine().await;
    let d = decode();
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    let (d2, l2) = (d.clone(), link.clone());
    let request = RequestSpec {
        request_id: 6,
        input_tokens: 2 * LAYOUT.page_tokens,
        output_tokens: 1,
        hash_ids: vec![],
    };
    let transfer =
        tokio::spawn(async move { d2.transfer(&l2, request, Duration::from_secs(10)).await });
    wait_open(&node).await;
    let room = RoomRef {
        room_id: room_base("decode-x"),
        generation: 1,
    };
    let mut client = TransferClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let ticket = client
        .abort_room(Abort {
            room: Some(room),
            decode_rank: 0,
            reason: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        ticket.immediate_ack.is_some(),
        "nothing was written: immediate NONE_STARTED ack"
    );
    let refused = client
        .submit_chunk(SubmitChunkRequest {
            room: Some(room),
            first_page: 0,
            pages: 1,
            last: true,
        })
        .await;
    assert!(
        refused.is_err(),
        "no chunk may be enqueued after the room failed"
    );
    let again = client
        .abort_room(Abort {
            room: Some(room),
            decode_rank: 0,
            reason: 1,
        })
        .await
        .unwrap()
        .into_inner();
    // The room is gone (quiescent and released): an unknown key acks NONE_STARTED again, harmlessly.
    assert!(again.immediate_ack.is_some());
    transfer.abort();
}
