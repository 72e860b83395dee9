//! The `prefill` and `decode` roles as real processes, started from their config files like pods
//! (the only start path): a SIGKILLed prefill process mid-transfer, and the decode role running
//! requests against a prefill process end to end.

mod serve_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serve_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::control::KvLayout;
use tandem_worker::control::pb::RequestSpec;
use tandem_worker::release::RoomKey;
use tandem_worker::release::receiver::{FailureCause, GateMode, ReceiverState};
use tandem_worker::roles::decode::node::{DecodeConfig, DecodeNode, TransferOutcome, room_base};

/// The layout a prefill started from `serve_support::config` produces under the test knobs: the
/// model's 8 layers, 512-token pages (no cache tier), `TANDEM_SIM_KV_BYTES_PER_TOKEN=512` spread
/// over the layers (64 B per token per layer).
const LAYOUT: KvLayout = KvLayout {
    layers: 8,
    page_tokens: 512,
    token_bytes: 64,
};

/// Starts `tandem-worker prefill --config` on host `host` of `w`, computing each prompt token in
/// `us_per_token` µs; returns it with its control address.
fn prefill(w: &World, host: u8, us_per_token: u64) -> (Proc, String) {
    let per_token = us_per_token.to_string();
    let p = w.spawn(
        host,
        &config(WorkerRole::Prefill, "r1", w.ports),
        &[("TANDEM_SIM_PREFILL_US_PER_TOKEN", per_token.as_str())],
    );
    (p, w.addr(host, w.ports.control).to_string())
}

fn decode() -> Arc<DecodeNode> {
    DecodeNode::start(DecodeConfig {
        worker_id: "decode-p".into(),
        rank: 0,
        pages: 64,
        layout: LAYOUT,
        data_bind: "127.0.0.1:0".into(),
        ack_timeout: Duration::from_secs(5),
        heartbeat: Duration::from_millis(100),
        fence_is_proof: true,
        gate: GateMode::Safe,
    })
    .unwrap()
}

fn request(id: u64, pages: u32) -> RequestSpec {
    RequestSpec {
        request_id: id,
        input_tokens: pages * LAYOUT.page_tokens,
        output_tokens: 1,
        hash_ids: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_prefill_process_fails_the_room_and_a_restarted_one_serves() {
    let w = World::new(51);
    let d = decode();
    // 40 µs per token: ~20 ms of compute per 512-token page, ~650 ms for the 32-page room.
    let (proc_a, addr_a) = prefill(&w, 2, 40);
    let link = d.connect(&addr_a, Duration::from_secs(5)).await.unwrap();
    let (d2, l2) = (d.clone(), link.clone());
    let t0 = Instant::now();
    let transfer = tokio::spawn(async move {
        d2.transfer(&l2, request(1, 32), Duration::from_secs(30))
            .await
    });
    // Kill it mid-transfer: once KV is landing in the room (observed), long before the last page.
    let room = RoomKey::new(room_base("decode-p"), 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.room_state(room) != Some(ReceiverState::Transferring) {
        assert!(
            Instant::now() < deadline,
            "no KV landed: {:?}",
            d.room_state(room)
        );
        assert!(
            !transfer.is_finished(),
            "the transfer ended before the kill"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    proc_a.signal(libc::SIGKILL);
    let out = transfer.await.unwrap().unwrap();
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
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "failed after {:?}",
        t0.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while d.pages().free != 64 {
        assert!(
            Instant::now() < deadline,
            "pages not released: {:?}",
            d.pages()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.pages().alarms, 0);

    let (_proc_b, addr_b) = prefill(&w, 3, 0);
    let link_b = d.connect(&addr_b, Duration::from_secs(5)).await.unwrap();
    let out = d
        .transfer(&link_b, request(2, 16), Duration::from_secs(10))
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_role_runs_requests_against_a_prefill_process() {
    let w = World::new(52);
    w.publish(&[2]);
    let _p = w.spawn(2, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    let (health, front) = (w.addr(9, w.ports.health), w.addr(9, w.ports.front));
    until(Duration::from_secs(15), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    for _ in 0..5 {
        let (code, frames) = http(
            front,
            "POST",
            "/v1/completions",
            Some(completion(100, 1, false)),
        )
        .await;
        let body = text(&frames);
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{v}");
    }
    // completed=5 failed=0 corrupt_chunks=0 quarantined_pages=0, as the decode reports them.
    let (_, r) = get_json(health, "/report").await;
    let c = &r["counters"];
    assert_eq!(c["requests_ok"], 5, "{r}");
    assert_eq!(c["requests_failed"], 0, "{r}");
    assert_eq!(c["corrupt_pages_read"], 0, "{r}");
    assert_eq!(c["pages_quarantined"], 0, "{r}");
    assert_eq!(r["kv_pages"]["quarantined"], 0, "{r}");
}
