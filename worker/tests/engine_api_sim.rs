//! The simulated engine as its own process (`tandem-worker sim-engine`), using only the engine API:
//! a prefill engine and a decode engine attached to a prefill worker and a decode worker linked by
//! `LocalLink`. The prefill engine writes deterministic KV into its pages; the decode engine reads
//! and verifies every page of every pool, reports accept counts, and reuses pages only after
//! SafeToReuse. Negative control: a link that flips one byte of one chunk in flight makes the decode
//! engine report the corrupt chunk and exit non-zero.
//!
//! The prefill engine computes up to `--max-running-rooms` rooms at once: rooms opened together are
//! in flight together at the worker (between their first and last writes), never more than the
//! bound, and every page of every room verifies; with a bound of 1 they never overlap.

mod engine_api_support;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use engine_api_support::*;
use tandem_worker::config::{WorkerConfig, WorkerRole};
use tandem_worker::engine_api::local::LocalLink;
use tandem_worker::engine_api::pb as pb_api;
use tandem_worker::engine_api::prefill::{KvSink, PagesSend, PrefillSide};
use tandem_worker::engine_api::service::Backend;
use tandem_worker::memory::pool::PageId;
use tandem_worker::release::RoomKey;
use tandem_worker::release::sender::AbortAck;
use tandem_worker::sim_engine::Summary;

const REQUESTS: u32 = 6;

fn write_config(dir: &std::path::Path, name: &str, cfg: &WorkerConfig) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(cfg).unwrap()).unwrap();
    path
}

fn sim(dir: &std::path::Path, config: &std::path::Path, requests: u32) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(BIN);
    c.arg("sim-engine")
        .arg("--socket-dir")
        .arg(dir)
        .arg("--config")
        .arg(config)
        .args(["--page-tokens", &PAGE_TOKENS.to_string()])
        .args(["--requests", &requests.to_string()])
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
    let prefill = sim(p.dir.path(), &pcfg, REQUESTS).spawn().unwrap();
    // The decode engine starts once the prefill engine is attached (it opens rooms on it).
    until(
        "the prefill engine attaches",
        Duration::from_secs(30),
        || p.api.current_attach().is_some() && p.api.prefill_side().is_some(),
    )
    .await;
    let decode = sim(d.dir.path(), &dcfg, REQUESTS)
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

/// A link that records, in the order the worker moves them, each write's room and whether it is
/// the room's last (its second layer half).
struct Recording {
    inner: Arc<LocalLink>,
    log: std::sync::Mutex<Vec<(RoomKey, bool)>>,
}

impl KvSink for Recording {
    fn send(&self, side: &Arc<PrefillSide>, write: PagesSend) {
        self.log.lock().unwrap().push((write.key, write.last));
        self.inner.send(side, write);
    }
    fn ack(&self, ack: AbortAck) {
        self.inner.ack(ack);
    }
}

/// Most rooms the worker saw in flight at once: a room is in flight from its first write (the
/// first layer half's PagesReady) to its last.
fn peak_in_flight(log: &[(RoomKey, bool)]) -> usize {
    let mut open = std::collections::HashSet::new();
    let mut peak = 0;
    for (k, last) in log {
        if *last {
            open.remove(k);
        } else {
            open.insert(*k);
            peak = peak.max(open.len());
        }
    }
    peak
}

/// `rooms` rooms opened at once by a decode engine (this test, through the engine API) on a
/// prefill whose simulated engine runs at most `max_running` of them at a time, each costing
/// `us_per_token` per token. Returns the prefill engine's summary, the worker's write log and the
/// corrupt chunks the decode found in every page of every room.
async fn rooms_at_once(
    rooms: u32,
    max_running: u32,
    us_per_token: u64,
) -> (Summary, Vec<(RoomKey, bool)>, u64) {
    let tokens = 2 * PAGE_TOKENS + 5;
    let link = LocalLink::new(0, 0);
    let rec = Arc::new(Recording {
        inner: link.clone(),
        log: Default::default(),
    });
    // Source pages for every room at once: only `--max-running-rooms` bounds the compute.
    let p = start_worker(
        worker_config(
            WorkerRole::Prefill,
            Shape {
                pages: 3 * u64::from(rooms),
                draft: true,
                ..Shape::default()
            },
        ),
        Backend::Prefill(rec.clone()),
        Options::default(),
    );
    let d = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 3 * u64::from(rooms),
                draft: true,
                ..Shape::default()
            },
        ),
        Backend::Decode(link.clone()),
        Options::default(),
    );
    link.bind(&d.api, &p.api);
    let pcfg = write_config(p.dir.path(), "prefill.json", &p.cfg);
    let prefill = sim(p.dir.path(), &pcfg, rooms)
        .args(["--max-running-rooms", &max_running.to_string()])
        .args(["--prefill-us-per-token", &us_per_token.to_string()])
        .spawn()
        .unwrap();
    until(
        "the prefill engine attaches",
        Duration::from_secs(30),
        || p.api.current_attach().is_some() && p.api.prefill_side().is_some(),
    )
    .await;
    let mut c = d.client().await;
    let att = c.attach(identity(&d.cfg)).await.unwrap();
    let id = att.id();
    let mut reserved = Vec::new();
    for i in 0..rooms {
        let request = 100 + u64::from(i);
        let r = c
            .decode
            .reserve(c.req(pb_api::ReserveRequest {
                attach_id: id,
                request_id: request,
                tokens,
                kv_deadline_ms: 60_000,
                hand_off_token: 0,
            }))
            .await
            .unwrap()
            .into_inner();
        reserved.push((request, r));
    }
    let mut corrupt = 0;
    for (request, r) in &reserved {
        let mut wait = c.req(pb_api::AwaitKvRequest {
            attach_id: id,
            room: r.room,
        });
        wait.set_timeout(Duration::from_secs(60));
        let kv = c.decode.await_kv(wait).await.unwrap().into_inner();
        let Some(pb_api::await_kv_reply::Outcome::Complete(done)) = kv.outcome else {
            panic!("room of request {request} did not complete: {kv:?}");
        };
        corrupt += corrupt_chunks(&att, *request, tokens, &done.pages);
        c.decode
            .finish(c.req(pb_api::FinishRequest {
                attach_id: id,
                room: r.room,
            }))
            .await
            .unwrap();
    }
    let (ok, summary, err) = finish(prefill).await;
    assert!(ok, "prefill engine failed: {err}");
    let log = rec.log.lock().unwrap().clone();
    (summary.expect("prefill summary"), log, corrupt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_engine_computes_rooms_at_once_up_to_its_bound_and_every_page_verifies() {
    // 6 rooms, at most 3 at once, ~1.1 s per layer half each: the worker sees 3 rooms between
    // their first and last writes at once, never more; every page of every pool holds its bytes.
    let (s, log, corrupt) = rooms_at_once(6, 3, 60_000).await;
    assert_eq!(corrupt, 0, "{s:?}");
    assert_eq!((s.rooms, s.rooms_dropped), (6, 0), "{s:?}");
    assert_eq!(s.pages_ready_calls, 12, "two layer halves per room");
    assert_eq!(log.len(), 12, "{log:?}");
    assert_eq!(peak_in_flight(&log), 3, "{log:?}");
    assert_eq!(s.peak_running_rooms, 3, "{s:?}");
    assert!(s.releases >= 6, "every source page came back: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_running_room_the_prefill_engine_computes_them_one_after_the_other() {
    // The control of the test above: the same rooms with `--max-running-rooms 1` never overlap.
    let (s, log, corrupt) = rooms_at_once(3, 1, 5_000).await;
    assert_eq!(corrupt, 0, "{s:?}");
    assert_eq!(s.rooms, 3, "{s:?}");
    assert_eq!(peak_in_flight(&log), 1, "{log:?}");
    assert_eq!(s.peak_running_rooms, 1, "{s:?}");
}
