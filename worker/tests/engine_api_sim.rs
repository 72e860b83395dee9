//! The simulated engine as its own process (`tandem-worker sim-engine`), using only the engine API:
//! a prefill engine and a decode engine attached to a prefill worker and a decode worker linked by
//! `LocalLink`. The prefill engine writes deterministic KV into its pages; the decode engine reads
//! and verifies every page of every pool, reports accept counts, and reuses pages only after
//! SafeToReuse. Negative control: a link that flips one byte of one chunk in flight makes the decode
//! engine report the corrupt chunk and exit non-zero.

mod engine_api_support;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use engine_api_support::*;
use tandem_worker::config::{WorkerConfig, WorkerRole};
use tandem_worker::engine_api::local::LocalLink;
use tandem_worker::engine_api::prefill::{KvSink, PagesSend, PrefillSide};
use tandem_worker::engine_api::service::Backend;
use tandem_worker::memory::pool::PageId;
use tandem_worker::release::sender::AbortAck;
use tandem_worker::sim_engine::Summary;

const REQUESTS: u32 = 6;

fn write_config(dir: &std::path::Path, name: &str, cfg: &WorkerConfig) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(cfg).unwrap()).unwrap();
    path
}

fn sim(dir: &std::path::Path, config: &std::path::Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(BIN);
    c.arg("sim-engine")
        .arg("--socket-dir")
        .arg(dir)
        .arg("--config")
        .arg(config)
        .args(["--page-tokens", &PAGE_TOKENS.to_string()])
        .args(["--requests", &REQUESTS.to_string()])
        .args(["--run-timeout-s", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

async fn finish(child: tokio::process::Child) -> (bool, Option<Summary>, String) {
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
        .await
        .expect("the simulated engine exits within 90 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let summary = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Summary>(l).ok());
    (out.status.success(), summary, stderr)
}

/// A link that corrupts one byte of the first chunk it moves (at the source, before the copy).
struct Corrupting {
    inner: Arc<LocalLink>,
    done: std::sync::atomic::AtomicBool,
}

impl KvSink for Corrupting {
    fn send(&self, side: &Arc<PrefillSide>, write: PagesSend) {
        if !self.done.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let pool = &side.pools()[0];
            let region = pool
                .chunk_region(PageId(write.pages[0]), write.layers.start)
                .unwrap();
            let base = pool.buffer().host_ptr().unwrap();
            // SAFETY: inside the pool's live mapping; the engine does not touch the page until
            // SourceFree, so this test is the only writer.
            unsafe { *base.add(region.offset + 20) ^= 0x40 };
        }
        self.inner.send(side, write);
    }
    fn ack(&self, ack: AbortAck) {
        self.inner.ack(ack);
    }
}

async fn run_pair(
    corrupt: bool,
) -> (
    (bool, Option<Summary>, String),
    (bool, Option<Summary>, String),
) {
    let shape = Shape {
        pages: 6,
        draft: true,
        indexer: true,
        ..Shape::default()
    };
    let link = LocalLink::new(0, 0);
    let sink: Arc<dyn KvSink> = if corrupt {
        Arc::new(Corrupting {
            inner: link.clone(),
            done: Default::default(),
        })
    } else {
        link.clone()
    };
    let p = start_worker(
        worker_config(WorkerRole::Prefill, shape),
        Backend::Prefill(sink),
        Options::default(),
    );
    let d = start_worker(
        worker_config(WorkerRole::Decode, Shape { pages: 4, ..shape }),
        Backend::Decode(link.clone()),
        Options::default(),
    );
    link.bind(&d.api, &p.api);
    let pcfg = write_config(p.dir.path(), "prefill.json", &p.cfg);
    let dcfg = write_config(d.dir.path(), "decode.json", &d.cfg);
    let prefill = sim(p.dir.path(), &pcfg).spawn().unwrap();
    // The decode engine starts once the prefill engine is attached (it opens rooms on it).
    until(
        "the prefill engine attaches",
        Duration::from_secs(30),
        || p.api.current_attach().is_some() && p.api.prefill_side().is_some(),
    )
    .await;
    let decode = sim(d.dir.path(), &dcfg)
        .args(["--tokens", &(2 * PAGE_TOKENS + 5).to_string()])
        .spawn()
        .unwrap();
    let dres = finish(decode).await;
    let pres = if corrupt {
        // The prefill engine may wait for work that never comes once decode gave up.
        (false, None, String::new())
    } else {
        finish(prefill).await
    };
    (pres, dres)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_engines_move_and_verify_every_page_through_the_api() {
    let ((pok, ps, perr), (dok, ds, derr)) = run_pair(false).await;
    assert!(dok, "decode engine failed: {derr}");
    assert!(pok, "prefill engine failed: {perr}");
    let ds = ds.expect("decode summary");
    let ps = ps.expect("prefill summary");
    // 2 × 16 + 5 tokens = 3 pages per request; 3 pools; target and indexer have 4 layers, the
    // draft model 2.
    assert_eq!(
        (ds.role.as_str(), ds.rooms, ds.completed, ds.failed),
        ("decode", REQUESTS, REQUESTS, 0)
    );
    assert_eq!(ds.pools, ["target", "draft", "indexer"]);
    assert_eq!(ds.pages, u64::from(REQUESTS) * 3 * 3);
    assert_eq!(ds.chunks, u64::from(REQUESTS) * 3 * (4 + 2 + 4));
    assert_eq!(ds.corrupt_chunks, 0);
    assert!(ds.releases >= REQUESTS);
    assert_eq!(ds.spec_steps, REQUESTS * 4);
    assert_eq!(ps.role, "prefill");
    assert_eq!(ps.rooms, REQUESTS);
    assert_eq!(
        ps.pages_ready_calls,
        REQUESTS * 2,
        "two layer halves per room"
    );
    assert_eq!(ps.chunks, ds.chunks, "every chunk written was verified");
    assert!(ps.releases >= REQUESTS, "every source page came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_flipped_byte_is_found_by_the_decode_engine() {
    let (_, (dok, ds, derr)) = run_pair(true).await;
    assert!(!dok, "the decode engine must fail on a corrupt page");
    let ds = ds.unwrap_or_else(|| panic!("decode summary missing: {derr}"));
    assert_eq!(ds.corrupt_chunks, 1, "{ds:?}");
    assert!(derr.contains("corrupt KV chunk read"), "{derr}");
}
