//! `tandem-bench abort-stress`: the seed 004 BugFix #1 race under load, in one process.
//!
//! Setup: one decode rank with a small KV region whose free list is LIFO (a freed page is the next
//! one handed out: immediate reuse), two prefill ranks that each write half of every page's layers
//! through the simulated one-sided transport (RDMA WRITE semantics: a posted write lands whatever the
//! receiver thinks), slow prefill (a queue, cost-model compute time, random write latency with
//! spikes), random client aborts and timeouts. Every request verifies every chunk of its pages twice
//! (when committed, and after its simulated decode time); a chunk that holds anything but its own
//! request's KV counts as a corrupt page.
//!
//! Safe mode runs the real protocol: decode aborts through [`ReceiverRoom::fail`], prefill answers
//! through [`SenderRooms::abort`], pages return to the free list only on the gate's `Free` verdict.
//! `--unsafe` bypasses the gate (pages freed at abort, as before the fix): the negative control,
//! which must find corrupt pages; only in builds with the `negative-controls` feature. The last
//! output line is `corrupt_pages=<n>`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use tandem_worker::engine::{ChunkSpec, fill_chunk, verify_chunk};
use tandem_worker::release::quarantine::Quarantine;
use tandem_worker::release::receiver::{
    AckOutcome, FailureCause, GateMode, GateVerdict, ReceiverRoom, ReceiverState,
};
use tandem_worker::release::sender::{AbortAck, SenderEffect, SenderRooms, SenderState};
use tandem_worker::release::{DecodeRank, PrefillRank, RoomKey};
use tandem_worker::transfer::sim::SimTransport;
use tandem_worker::transfer::{
    BatchLimits, HostRegion, ReceiveRegion, RegionId, TransferHandle, TransferStatus, Transport,
    WriteBatch, WriteOp,
};

/// Parameters of a stress run.
#[derive(Clone, Debug, clap::Args)]
pub struct AbortStressArgs {
    /// Requests to run.
    #[arg(long, default_value_t = 10_000)]
    pub requests: u64,
    /// Bypass the release gate (negative control: must find corrupt pages). The flag exists only
    /// in builds with the `negative-controls` feature.
    #[cfg_attr(feature = "negative-controls", arg(long = "unsafe"))]
    #[cfg_attr(not(feature = "negative-controls"), arg(skip))]
    pub unsafe_gate: bool,
    /// Pages in the decode region.
    #[arg(long, default_value_t = 96)]
    pub pages: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Probability that a request is aborted by its client at a random time.
    #[arg(long, default_value_t = 0.15)]
    pub abort_probability: f64,
    /// Probability that a request gets a short timeout (a slow prefill makes it fire).
    #[arg(long, default_value_t = 0.15)]
    pub timeout_probability: f64,
    /// Random seed.
    #[arg(long, default_value_t = 4)]
    pub seed: u64,
    /// Ack deadline before a failed room's pages are quarantined (ms).
    #[arg(long, default_value_t = 5_000)]
    pub ack_timeout_ms: u64,
}

impl AbortStressArgs {
    /// Defaults with `requests` and `unsafe_gate` set.
    #[allow(
        dead_code,
        reason = "used by tests/release_abort_stress.rs, which compiles this module"
    )]
    pub fn with(requests: u64, unsafe_gate: bool) -> AbortStressArgs {
        AbortStressArgs {
            requests,
            unsafe_gate,
            pages: 96,
            concurrency: 32,
            abort_probability: 0.15,
            timeout_probability: 0.15,
            seed: 4,
            ack_timeout_ms: 5_000,
        }
    }
}

/// What a run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AbortStressReport {
    /// Requests admitted.
    pub requests: u64,
    /// Requests whose KV arrived and was decoded.
    pub completed: u64,
    /// Requests aborted by the client.
    pub client_aborts: u64,
    /// Requests that timed out waiting for KV.
    pub timeouts: u64,
    /// Rooms failed by a transfer failure.
    pub transfer_failures: u64,
    /// Acks counted by decode.
    pub acks: u64,
    /// Acks ignored (stale, duplicate, not waiting).
    pub acks_ignored: u64,
    /// Rooms quarantined (alarms).
    pub quarantined: u64,
    /// Quarantined rooms recovered by a late ack.
    pub recovered: u64,
    /// Pages still quarantined at the end.
    pub pages_quarantined_at_end: u64,
    /// Source-page holds not released at the end (must be 0).
    pub source_leaks: u64,
    /// Chunks verified.
    pub chunks_verified: u64,
    /// Pages that failed verification.
    pub corrupt_pages: u64,
    /// Wall time (ms).
    pub elapsed_ms: u64,
}

impl AbortStressReport {
    /// The report lines; the last one is `corrupt_pages=<n>`.
    pub fn lines(&self, unsafe_gate: bool) -> Vec<String> {
        vec![
            format!(
                "mode={} requests={} completed={} client_aborts={} timeouts={} transfer_failures={}",
                if unsafe_gate { "unsafe" } else { "safe" },
                self.requests,
                self.completed,
                self.client_aborts,
                self.timeouts,
                self.transfer_failures
            ),
            format!(
                "acks={} acks_ignored={} quarantined={} recovered={} pages_quarantined_at_end={} source_leaks={}",
                self.acks,
                self.acks_ignored,
                self.quarantined,
                self.recovered,
                self.pages_quarantined_at_end,
                self.source_leaks
            ),
            format!(
                "chunks_verified={} elapsed_ms={}",
                self.chunks_verified, self.elapsed_ms
            ),
            format!("corrupt_pages={}", self.corrupt_pages),
        ]
    }
}

/// Errors that stop a run.
#[derive(Debug, thiserror::Error)]
pub enum AbortStressError {
    /// A thread could not be started.
    #[error("cannot start thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// Bad parameters.
    #[error("invalid parameters: {0}")]
    Invalid(String),
    /// The run did not finish (a request never reached a terminal state).
    #[error("stress run stalled: {0}")]
    Stalled(String),
}

// Geometry: small pages so 100k requests run in seconds.
const LAYERS: u32 = 4;
const PAGE_TOKENS: u32 = 16;
const TOKEN_BYTES: usize = 64;
const CHUNK_BYTES: u64 = PAGE_TOKENS as u64 * TOKEN_BYTES as u64;
const PAGE_BYTES: u64 = CHUNK_BYTES * LAYERS as u64;
const PREFILL_RANKS: u32 = 2;
const WORKERS_PER_RANK: usize = 2;
const DECODE_RANK: DecodeRank = DecodeRank(0);
const PEER: &str = "decode-0";

/// The release gate of a run: the real one, or (negative control, feature `negative-controls`)
/// the bypass.
fn gate_mode(unsafe_gate: bool) -> Result<GateMode, AbortStressError> {
    if !unsafe_gate {
        return Ok(GateMode::Safe);
    }
    #[cfg(feature = "negative-controls")]
    return Ok(GateMode::UnsafeBypass);
    #[cfg(not(feature = "negative-controls"))]
    Err(AbortStressError::Invalid(
        "the gate bypass exists only in builds with the negative-controls feature".into(),
    ))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Prefill → decode messages (the in-process stand-in for the gRPC signal stream).
enum ToDecode {
    Ack(AbortAck),
    /// A rank finished every write of the room (its sender room reached Success).
    RankDone(RoomKey, PrefillRank),
    /// A rank's writes failed.
    RankFailed(RoomKey, PrefillRank),
}

struct Work {
    key: RoomKey,
    pages: Vec<u32>,
    compute: Duration,
}

struct PrefillRankState {
    rank: PrefillRank,
    rooms: Mutex<SenderRooms>,
    queue: Mutex<VecDeque<Work>>,
    ready: Condvar,
    source_holds: AtomicU64,
}

impl PrefillRankState {
    fn perform(&self, effects: Vec<SenderEffect>, to_decode: &Sender<ToDecode>) {
        for e in effects {
            match e {
                SenderEffect::SendAck(ack) => {
                    let _ = to_decode.send(ToDecode::Ack(ack));
                }
                SenderEffect::ReleaseSource(key) => {
                    self.source_holds.fetch_sub(1, Ordering::SeqCst);
                    let state = lock(&self.rooms).state(key);
                    if state == Some(SenderState::Success) {
                        let _ = to_decode.send(ToDecode::RankDone(key, self.rank));
                    }
                    lock(&self.rooms).clear(key);
                }
            }
        }
    }
}

/// Runs the stress test.
pub fn run(args: &AbortStressArgs) -> Result<AbortStressReport, AbortStressError> {
    if args.pages < 4 || args.concurrency == 0 {
        return Err(AbortStressError::Invalid(
            "need --pages >= 4 and --concurrency >= 1".into(),
        ));
    }
    let started = Instant::now();
    let region = Arc::new(HostRegion::new(args.pages, PAGE_BYTES));
    let latency_rng = Mutex::new(SmallRng::seed_from_u64(args.seed ^ 0x5eed));
    let transport = Arc::new(SimTransport::new(
        Arc::new(move |_op: &WriteOp| {
            let mut r = lock(&latency_rng);
            // Mostly fast, with spikes: a write posted before an abort often lands after it.
            if r.random_bool(0.2) {
                Duration::from_micros(r.random_range(1_000..10_000))
            } else {
                Duration::from_micros(r.random_range(20..800))
            }
        }),
        BatchLimits::default(),
        None,
    )?);
    let mut regions: HashMap<RegionId, Arc<dyn ReceiveRegion>> = HashMap::new();
    regions.insert(RegionId(0), region.clone());
    transport.connect_peer(PEER, regions);

    let (to_decode_tx, to_decode_rx) = mpsc::channel::<ToDecode>();
    let stop = Arc::new(AtomicBool::new(false));
    let ranks: Vec<Arc<PrefillRankState>> = (0..PREFILL_RANKS)
        .map(|r| {
            Arc::new(PrefillRankState {
                rank: PrefillRank(r),
                rooms: Mutex::new(SenderRooms::new(PrefillRank(r))),
                queue: Mutex::new(VecDeque::new()),
                ready: Condvar::new(),
                source_holds: AtomicU64::new(0),
            })
        })
        .collect();
    let mut workers = Vec::new();
    for rank in &ranks {
        for w in 0..WORKERS_PER_RANK {
            let (rank, transport, tx, stop) = (
                rank.clone(),
                transport.clone(),
                to_decode_tx.clone(),
                stop.clone(),
            );
            workers.push(
                thread::Builder::new()
                    .name(format!("prefill-{}-{w}", rank.rank.0))
                    .spawn(move || prefill_worker(&rank, &transport, &tx, &stop))?,
            );
        }
    }
    drop(to_decode_tx);

    let mode = gate_mode(args.unsafe_gate)?;
    let report = decode_loop(args, mode, &region, &ranks, &to_decode_rx);

    stop.store(true, Ordering::SeqCst);
    for rank in &ranks {
        rank.ready.notify_all();
    }
    for w in workers {
        let _ = w.join();
    }
    let mut report = report?;
    report.source_leaks = ranks
        .iter()
        .map(|r| r.source_holds.load(Ordering::SeqCst))
        .sum();
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

fn prefill_worker(
    rank: &Arc<PrefillRankState>,
    transport: &SimTransport,
    to_decode: &Sender<ToDecode>,
    stop: &AtomicBool,
) {
    loop {
        let work = {
            let mut q = lock(&rank.queue);
            loop {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(w) = q.pop_front() {
                    break w;
                }
                q = rank
                    .ready
                    .wait_timeout(q, Duration::from_millis(20))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        };
        // Slow prefill: the engine computes before the first write.
        thread::sleep(work.compute);
        send_room(rank, transport, to_decode, &work);
    }
}

/// Sends this rank's layers of every page, one batch per page, stopping as soon as the room fails.
fn send_room(
    rank: &Arc<PrefillRankState>,
    transport: &SimTransport,
    to_decode: &Sender<ToDecode>,
    work: &Work,
) {
    let key = work.key;
    for (i, page) in work.pages.iter().enumerate() {
        // Failed first, then no new write: begin_write refuses once the room failed.
        if lock(&rank.rooms).begin_write(key).is_err() {
            break;
        }
        let mut ops = Vec::new();
        for layer in (rank.rank.0..LAYERS).step_by(PREFILL_RANKS as usize) {
            let spec = ChunkSpec {
                request: key.room.0,
                layer,
                first_token: i as u32 * PAGE_TOKENS,
                tokens: PAGE_TOKENS,
                token_bytes: TOKEN_BYTES,
            };
            let mut buf = vec![0u8; CHUNK_BYTES as usize];
            fill_chunk(&mut buf, &spec);
            ops.push(WriteOp {
                key,
                region: RegionId(0),
                offset: u64::from(*page) * PAGE_BYTES + u64::from(layer) * CHUNK_BYTES,
                data: Bytes::from(buf),
            });
        }
        let r2 = rank.clone();
        let tx2 = to_decode.clone();
        let sink = Arc::new(move |_h: TransferHandle, status: &TransferStatus| {
            let ok = *status == TransferStatus::Completed;
            let effects = lock(&r2.rooms).end_write(key, ok).unwrap_or_default();
            if !ok {
                let _ = tx2.send(ToDecode::RankFailed(key, r2.rank));
            }
            r2.perform(effects, &tx2);
        });
        let submitted = WriteBatch::new(ops, BatchLimits::default())
            .map_err(|e| e.to_string())
            .and_then(|b| {
                transport
                    .submit(PEER, b, Some(sink.clone()))
                    .map_err(|e| e.to_string())
            });
        if submitted.is_err() {
            // Nothing was posted: account the write as ended (failed) so the room can drain.
            let effects = lock(&rank.rooms).end_write(key, false).unwrap_or_default();
            let _ = to_decode.send(ToDecode::RankFailed(key, rank.rank));
            rank.perform(effects, to_decode);
            break;
        }
    }
    let effects = lock(&rank.rooms).finish_input(key).unwrap_or_default();
    rank.perform(effects, to_decode);
}

struct DecodeRequest {
    room: ReceiverRoom,
    pages: Vec<u32>,
    done_ranks: std::collections::BTreeSet<PrefillRank>,
    timeout_at: Instant,
    abort_at: Option<Instant>,
    decode_until: Option<Instant>,
}

struct DecodeSide<'a> {
    region: &'a HostRegion,
    free: Vec<u32>,
    quarantine: Quarantine<u32>,
    report: AbortStressReport,
    ack_timeout: Duration,
}

impl DecodeSide<'_> {
    /// Verifies every chunk of a request's pages; counts each bad page once.
    fn verify(&mut self, key: RoomKey, pages: &[u32]) {
        for (i, page) in pages.iter().enumerate() {
            let Some(guard) = self.region.page(*page) else {
                continue;
            };
            let mut bad = false;
            for layer in 0..LAYERS {
                let spec = ChunkSpec {
                    request: key.room.0,
                    layer,
                    first_token: i as u32 * PAGE_TOKENS,
                    tokens: PAGE_TOKENS,
                    token_bytes: TOKEN_BYTES,
                };
                let start = (u64::from(layer) * CHUNK_BYTES) as usize;
                self.report.chunks_verified += 1;
                if let Err(c) = verify_chunk(&guard[start..start + CHUNK_BYTES as usize], &spec) {
                    if !bad {
                        tracing::debug!(%key, page, error = %c, "corrupt KV page");
                    }
                    bad = true;
                }
            }
            if bad {
                self.report.corrupt_pages += 1;
            }
        }
    }

    fn apply(
        &mut self,
        key: RoomKey,
        verdict: GateVerdict,
        pages: &[u32],
        cause: Option<FailureCause>,
    ) {
        match verdict {
            GateVerdict::Hold => {}
            GateVerdict::Free {
                from_quarantine, ..
            } => {
                if from_quarantine {
                    if let Some(p) = self.quarantine.release(key) {
                        self.free.extend(p);
                    }
                    self.report.recovered += 1;
                } else {
                    self.free.extend_from_slice(pages);
                }
            }
            GateVerdict::Quarantine => {
                self.report.quarantined += 1;
                self.quarantine
                    .admit(key, pages.to_vec(), cause, Instant::now());
            }
        }
    }
}

fn decode_loop(
    args: &AbortStressArgs,
    mode: GateMode,
    region: &HostRegion,
    ranks: &[Arc<PrefillRankState>],
    inbox: &Receiver<ToDecode>,
) -> Result<AbortStressReport, AbortStressError> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let mut side = DecodeSide {
        region,
        // LIFO: the most recently freed page is reused first (immediate reuse).
        free: (0..args.pages).rev().collect(),
        quarantine: Quarantine::new(),
        report: AbortStressReport::default(),
        ack_timeout: Duration::from_millis(args.ack_timeout_ms),
    };
    let writers: Vec<PrefillRank> = (0..PREFILL_RANKS).map(PrefillRank).collect();
    let mut live: HashMap<RoomKey, DecodeRequest> = HashMap::new();
    // Failed rooms whose pages wait on the gate, keyed for late acks.
    let mut next_request = 1u64;
    let mut last_progress = Instant::now();

    loop {
        let now = Instant::now();
        // Admit new requests while there is room.
        while next_request <= args.requests && live.len() < args.concurrency {
            let want = rng.random_range(1..=4usize);
            if side.free.len() < want {
                break;
            }
            let pages: Vec<u32> = (0..want).filter_map(|_| side.free.pop()).collect();
            let key = RoomKey::new(next_request, 1);
            next_request += 1;
            side.report.requests += 1;
            let timeout = if rng.random_bool(args.timeout_probability) {
                Duration::from_micros(rng.random_range(200..4_000))
            } else {
                Duration::from_secs(30)
            };
            let abort_at = rng
                .random_bool(args.abort_probability)
                .then(|| now + Duration::from_micros(rng.random_range(50..5_000)));
            let compute = Duration::from_micros(rng.random_range(0..1_500));
            for rank in ranks {
                {
                    let mut rooms = lock(&rank.rooms);
                    if rooms.open(key).is_ok() {
                        rank.source_holds.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = rooms.destination_ready(key);
                }
                lock(&rank.queue).push_back(Work {
                    key,
                    pages: pages.clone(),
                    compute,
                });
                rank.ready.notify_one();
            }
            live.insert(
                key,
                DecodeRequest {
                    room: ReceiverRoom::new(key, writers.iter().copied(), mode),
                    pages,
                    done_ranks: Default::default(),
                    timeout_at: now + timeout,
                    abort_at,
                    decode_until: None,
                },
            );
        }
        if next_request > args.requests && live.is_empty() {
            break;
        }

        // Messages from prefill.
        match inbox.recv_timeout(Duration::from_micros(200)) {
            Ok(msg) => {
                last_progress = Instant::now();
                handle_message(msg, &mut live, &mut side, ranks);
                while let Ok(msg) = inbox.try_recv() {
                    handle_message(msg, &mut live, &mut side, ranks);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return Err(AbortStressError::Stalled("prefill ranks exited".into()));
            }
        }

        // Timers: client aborts, timeouts, decode completion, ack deadlines.
        let now = Instant::now();
        let keys: Vec<RoomKey> = live.keys().copied().collect();
        for key in keys {
            let Some(req) = live.get_mut(&key) else {
                continue;
            };
            let state = req.room.state();
            let cause = match state {
                ReceiverState::WaitingForInput | ReceiverState::Transferring => {
                    if req.abort_at.is_some_and(|t| now >= t) {
                        Some(FailureCause::ClientAbort)
                    } else if now >= req.timeout_at {
                        Some(FailureCause::Timeout)
                    } else {
                        None
                    }
                }
                _ => None,
            };
            if let Some(cause) = cause {
                match cause {
                    FailureCause::ClientAbort => side.report.client_aborts += 1,
                    _ => side.report.timeouts += 1,
                }
                fail_room(key, cause, &mut live, &mut side, ranks);
                continue;
            }
            if state == ReceiverState::Committed && req.decode_until.is_some_and(|t| now >= t) {
                // Decode finished: read (verify) once more, then free normally.
                let pages = std::mem::take(&mut req.pages);
                side.verify(key, &pages);
                side.report.completed += 1;
                side.free.extend_from_slice(&pages);
                live.remove(&key);
                continue;
            }
            if matches!(state, ReceiverState::ReleasePending) {
                let verdict = req.room.on_tick(now);
                let pages = req.pages.clone();
                side.apply(key, verdict, &pages, req.room.cause());
                if verdict == GateVerdict::Quarantine {
                    // Keep tracking: a late ack can still recover the pages.
                }
            }
            if let Some(req) = live.get(&key)
                && matches!(req.room.state(), ReceiverState::ReleaseSafe(_))
            {
                live.remove(&key);
            }
        }
        if last_progress.elapsed() > Duration::from_secs(60) && !live.is_empty() {
            return Err(AbortStressError::Stalled(format!(
                "{} requests without progress for 60 s",
                live.len()
            )));
        }
    }
    side.report.pages_quarantined_at_end = side.quarantine.pages_held() as u64;
    Ok(side.report)
}

fn fail_room(
    key: RoomKey,
    cause: FailureCause,
    live: &mut HashMap<RoomKey, DecodeRequest>,
    side: &mut DecodeSide<'_>,
    ranks: &[Arc<PrefillRankState>],
) {
    let Some(req) = live.get_mut(&key) else {
        return;
    };
    let (notify, verdict) = req.room.fail(cause, Instant::now(), side.ack_timeout);
    // ABORT to every prefill rank that may write (the in-process signal stream).
    for rank in notify {
        if let Some(r) = ranks.iter().find(|r| r.rank == rank) {
            let effects = lock(&r.rooms).abort(key, DECODE_RANK);
            // Acks produced synchronously travel back through the same inbox as async ones.
            for e in effects {
                match e {
                    SenderEffect::SendAck(ack) => handle_ack(ack, live, side),
                    other => r.perform(vec![other], &mpsc::channel().0),
                }
            }
        }
    }
    if let Some(req) = live.get_mut(&key) {
        let pages = req.pages.clone();
        side.apply(key, verdict, &pages, Some(cause));
        if matches!(req.room.state(), ReceiverState::ReleaseSafe(_)) {
            live.remove(&key);
        }
    }
}

fn handle_ack(
    ack: AbortAck,
    live: &mut HashMap<RoomKey, DecodeRequest>,
    side: &mut DecodeSide<'_>,
) {
    let Some(req) = live.get_mut(&ack.key) else {
        side.report.acks_ignored += 1;
        return;
    };
    match req.room.on_ack(ack.key, ack.prefill_rank) {
        AckOutcome::Ignored(_) => side.report.acks_ignored += 1,
        AckOutcome::Counted { verdict, .. } => {
            side.report.acks += 1;
            let pages = req.pages.clone();
            let cause = req.room.cause();
            side.apply(ack.key, verdict, &pages, cause);
            if matches!(req.room.state(), ReceiverState::ReleaseSafe(_)) {
                live.remove(&ack.key);
            }
        }
    }
}

fn handle_message(
    msg: ToDecode,
    live: &mut HashMap<RoomKey, DecodeRequest>,
    side: &mut DecodeSide<'_>,
    ranks: &[Arc<PrefillRankState>],
) {
    match msg {
        ToDecode::Ack(ack) => handle_ack(ack, live, side),
        ToDecode::RankFailed(key, rank) => {
            tracing::debug!(%key, rank = rank.0, "prefill rank reported a failed write");
            if live.get(&key).is_some_and(|r| {
                matches!(
                    r.room.state(),
                    ReceiverState::WaitingForInput | ReceiverState::Transferring
                )
            }) {
                side.report.transfer_failures += 1;
                fail_room(key, FailureCause::TransferFailed, live, side, ranks);
            }
        }
        ToDecode::RankDone(key, rank) => {
            let Some(req) = live.get_mut(&key) else {
                return;
            };
            if !matches!(
                req.room.state(),
                ReceiverState::WaitingForInput | ReceiverState::Transferring
            ) {
                return;
            }
            req.done_ranks.insert(rank);
            let _ = req.room.on_chunk();
            if req.done_ranks.len() == PREFILL_RANKS as usize
                && req.room.on_complete().is_ok()
                && req.room.commit().is_ok()
            {
                // KV complete: the request reads its pages now and again after decoding.
                let pages = req.pages.clone();
                req.decode_until = Some(Instant::now() + Duration::from_micros(4_000));
                side.verify(key, &pages);
            }
        }
    }
}
