//! Issue 18 item 3, ready means wired: a prefill that admits no room (loading its hot prefixes back
//! from L3, or draining) refuses the hello, so no decode counts it towards its readiness; once it
//! admits, the same decode connects. (The decode's side — not ready and 503 until a same-revision
//! peer is connected — is `serve_processes.rs` and `serve_restart.rs`.)

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tandem_worker::control::KvLayout;
use tandem_worker::release::receiver::GateMode;
use tandem_worker::roles::decode::node::{DecodeConfig, DecodeError, DecodeNode};
use tandem_worker::roles::prefill::node::{PrefillConfig, PrefillNode, PrefillService};
use tandem_worker::transfer::tcp::{TcpConfig, TcpTransport};
use tokio_stream::wrappers::TcpListenerStream;

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    page_tokens: 16,
    token_bytes: 128,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_admits_no_room_refuses_the_hello_until_it_does() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let node = PrefillNode::new(
        PrefillConfig {
            worker_id: "prefill-r".into(),
            rank: 0,
            layout: LAYOUT,
            compute_per_page: Duration::ZERO,
        },
        Arc::new(TcpTransport::new(TcpConfig::default())),
    );
    let service = PrefillService::new(node);
    let admitting = service.admitting.clone();
    admitting.store(false, Ordering::SeqCst);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let d = DecodeNode::start(DecodeConfig {
        worker_id: "decode-r".into(),
        rank: 0,
        pages: 16,
        layout: LAYOUT,
        data_bind: "127.0.0.1:0".into(),
        ack_timeout: Duration::from_secs(5),
        heartbeat: Duration::from_millis(100),
        fence_is_proof: true,
        gate: GateMode::Safe,
    })
    .unwrap();
    match d.connect(&addr, Duration::from_secs(2)).await {
        Err(DecodeError::Peer { message, .. }) => {
            assert!(message.contains("not admitting"), "{message}");
        }
        other => panic!(
            "a prefill that admits nothing was paired: {:?}",
            other.map(|l| l.addr().to_owned())
        ),
    }
    admitting.store(true, Ordering::SeqCst);
    let link = d.connect(&addr, Duration::from_secs(2)).await.unwrap();
    assert!(link.alive());
    assert_ne!(
        link.incarnation(),
        0,
        "the prefill's hello names its incarnation"
    );
}
