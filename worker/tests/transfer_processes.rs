//! The `prefill` and `decode` roles as real processes: a SIGKILLed prefill process mid-transfer, and the
//! decode role running requests against a prefill process end to end.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_worker::control::KvLayout;
use tandem_worker::control::decode::{DecodeConfig, DecodeNode, TransferOutcome};
use tandem_worker::control::pb::RequestSpec;
use tandem_worker::room::receiver::{FailureCause, GateMode};

const BIN: &str = env!("CARGO_BIN_EXE_tandem-worker");
const LAYOUT: KvLayout = KvLayout {
    layers: 4,
    page_tokens: 16,
    token_bytes: 256,
};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tandem-worker prefill` and returns it with its control address.
fn prefill(compute_per_page_us: u64) -> (Proc, String) {
    let mut child = Command::new(BIN)
        .args([
            "prefill",
            "--listen",
            "127.0.0.1:0",
            "--layers",
            "4",
            "--page-tokens",
            "16",
            "--token-bytes",
            "256",
        ])
        .args(["--compute-per-page-us", &compute_per_page_us.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (Proc(child), addr)
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
    let d = decode();
    let (mut proc_a, addr_a) = prefill(20_000);
    let link = d.connect(&addr_a, Duration::from_secs(5)).await.unwrap();
    let (d2, l2) = (d.clone(), link.clone());
    let t0 = Instant::now();
    let transfer = tokio::spawn(async move {
        d2.transfer(&l2, request(1, 32), Duration::from_secs(30))
            .await
    });
    tokio::time::sleep(Duration::from_millis(250)).await;
    proc_a.0.kill().unwrap();
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

    let (_proc_b, addr_b) = prefill(100);
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

#[test]
fn decode_role_runs_requests_against_a_prefill_process() {
    let (_p, addr) = prefill(100);
    let out = Command::new(BIN)
        .args([
            "decode",
            "--prefill",
            &addr,
            "--requests",
            "5",
            "--input-tokens",
            "100",
            "--data-bind",
            "127.0.0.1:0",
        ])
        .args([
            "--pages",
            "64",
            "--layers",
            "4",
            "--page-tokens",
            "16",
            "--token-bytes",
            "256",
        ])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("completed=5 failed=0 corrupt_chunks=0 quarantined_pages=0"),
        "{stdout}"
    );
}
