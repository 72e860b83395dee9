//! The decode worker's request engine: what the front door calls (DESIGN §3 decode side).
//!
//! This is the built-in simulated engine, used when the config names no `engine`. With one, the
//! front door hands each admitted request to the engine beside the worker through the engine API
//! instead ([`super::via_engine`]): the same peer choice, retries and spec-guard rules, with the
//! pages, the verification and the token generation in that engine.
//!
//! Per request ([`DecodeEngine::prefill`]): pick a peer round-robin, open a room for the prompt's
//! pages, receive and verify the KV within the KV deadline (past it the room aborts through the
//! release protocol — seed 004), and, when the peer fails mid-request, retry on another peer within
//! the retry budget. Pages return to the pool only through the release gate of [`DecodeNode`]; a
//! request's pages stay held (a [`KvLease`]) until its last token is generated or its decode is
//! aborted. Token generation is simulated at `TANDEM_SIM_TPOT_MS` per step
//! ([`DecodeEngine::decode_plan`]); with `speculative` set, each step is a verification step of
//! `draftTokens` draft tokens whose leading tokens are accepted with probability 0.8 each, so a
//! step emits `1..=draftTokens+1` tokens.
//!
//! The speculative-decoding anomaly guard (DESIGN contract 8, seed 004; [`crate::spec_guard`]):
//! with `speculative` and `specGuard` set, every verification step of an attempt is fed to a
//! [`SpecGuard`] before its tokens are emitted. An anomaly (mean accept length below
//! `minAcceptLength`, or accept rate above `maxAcceptRate`, after `afterTokens` tokens) means the
//! draft/target KV state is corrupt and the output garbage: the attempt's pages are released through
//! the release gate (contract 3, cause `SpecGuard`), `spec_guard_aborts` and
//! `tandem_spec_guard_anomalies_total{reason}` count it, and the request is retried (fresh KV from
//! another prefill peer when there is one, fresh decode) within `specGuard.retryBudget`
//! (`spec_guard_retries`). Beyond the budget the client gets 503 `spec_guard_anomaly`. A streamed
//! response cannot take back the tokens it already sent: it ends with an error event of the same
//! code and no `[DONE]`, and the client retries elsewhere. `TANDEM_SIM_SPEC_FAULT` (test-only, see
//! [`crate::roles::sim`]) makes the simulated draft anomalous.
//!
//! Every admitted request is an [`Admission`]: it ends exactly once as ok (`requests_ok`), failed
//! (`requests_failed`) or cancelled — its client went away, noticed (a stream nobody reads) or
//! not (the handler future dropped at any await point) — counted in `requests_cancelled` and by
//! the [`Stage`] it was in (`tandem_requests_cancelled_by_reason_total{reason}`). Its pages are
//! owned by the transfer's room guard, then by the [`KvLease`]: whichever way the request ends,
//! they go to the release gate (see [`super::node`]).
//!
//! `/report` adds `peers`, `refused_peers`, `kv_pages` `{free, held, quarantined, total,
//! stranded}` (pages of the receive region; `stranded`: held by no live request past the KV
//! deadline, see [`DecodeNode::stranded`]), `rooms` `{opened, released, quarantined, abandoned}`
//! ([`super::node::RoomTally`]), `requests_cancelled_by_reason` and `spec_guard`
//! `{enabled, anomalies_by_reason}` to
//! worker/interfaces/README.md §4.
//!
//! Readiness: ready only while at least one same-revision prefill peer is connected and no KV
//! page is stranded (a worker that can no longer admit a request its pool could hold is not
//! ready); `/report` says why not otherwise. Drain (SIGTERM): readiness 503 at once, new requests
//! 503, in-flight requests finish until the grace deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::node::{DecodeError, DecodeNode, KvLease, Stranded, TransferOutcome};
use super::peers::PeerSet;
use crate::config;
use crate::control::pb;
use crate::health::http::ServeState;
use crate::release::receiver::FailureCause;
use crate::roles::sim::{SimKnobs, SpecFaultMode};
use crate::spec_guard::{Anomaly, SpecGuard, Thresholds, Verdict};

/// Why a request was not served (mapped to HTTP by the front door).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not admitting (starting or draining): 503.
    #[error("not ready: {0}")]
    NotReady(String),
    /// No prefill peer of this revision is left to try: 503.
    #[error("{0}")]
    NoPeer(String),
    /// Too many requests in flight or no free KV pages now: 429 (retry later).
    #[error("at capacity: {0}")]
    AtCapacity(String),
    /// The prompt needs more KV pages than this decode's pool has in total: 400
    /// `context_length_exceeded` (retrying cannot help).
    #[error(
        "the prompt has {prompt_tokens} tokens; this decode's KV pool holds {limit} tokens in all \
         ({pages} pages), so it can never fit"
    )]
    ContextLength {
        /// Prompt tokens asked for.
        prompt_tokens: u64,
        /// Tokens the whole pool holds.
        limit: u64,
        /// Pages of the whole pool.
        pages: usize,
    },
    /// The KV did not arrive before the deadline; the room was aborted: 503.
    #[error("KV not received within {0:?}; room aborted")]
    Timeout(Duration),
    /// Every prefill peer tried failed mid-transfer (killed, heartbeat lost, restarted by a
    /// rollout) and the retry budget is spent: 503 — transient, the client retries elsewhere.
    /// The rooms went through the release gate; no page was reused early.
    #[error("{0}")]
    PrefillLost(String),
    /// The request's deadline (admission to last token, [`DecodeEngine::request_deadline`]) passed
    /// in `stage`: a prefill peer that accepted the room and went silent, or a decode that stalled.
    /// Its pages went to the release gate: 504 `request_deadline_exceeded`.
    #[error("request not finished within its deadline of {deadline:?} (in {})", stage.code())]
    DeadlineExceeded {
        /// The deadline, from admission.
        deadline: Duration,
        /// Where the request was when it passed.
        stage: Stage,
    },
    /// Anything else: 500.
    #[error("{0}")]
    Failed(String),
}

/// Where an admitted request is: the reason its cancellation is counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Its KV is being prefilled and transferred (room open, transfer wait, retries).
    Prefill,
    /// Its tokens are being generated for a non-streamed response.
    Decode,
    /// Its tokens are being streamed.
    Stream,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 3] = [Stage::Prefill, Stage::Decode, Stage::Stream];

    /// The stable reason code (`prefill`, `decode`, `stream`).
    pub fn code(self) -> &'static str {
        match self {
            Stage::Prefill => "prefill",
            Stage::Decode => "decode",
            Stage::Stream => "stream",
        }
    }
}

/// One admitted request: its in-flight slot and its ending, counted exactly once — ok, failed,
/// refused (no pages now, no peer) or cancelled. Dropped without an ending (the handler future was dropped: the client hung up)
/// it counts as cancelled in the stage it was in.
#[must_use = "dropping the admission counts the request as cancelled"]
pub struct Admission {
    state: Arc<ServeState>,
    stage: Stage,
    ended: bool,
    _permit: OwnedSemaphorePermit,
    deadline: tokio::time::Instant,
    budget: Duration,
    expired: Arc<DeadlineTally>,
}

/// Requests ended by their deadline, by the [`Stage`] they were in (monotonic; `/report`
/// `requests_deadline_exceeded` `{prefill, decode, stream}`).
#[derive(Debug, Default)]
pub struct DeadlineTally([AtomicU64; 3]);

impl DeadlineTally {
    /// Requests ended by their deadline in `stage`.
    pub fn of(&self, stage: Stage) -> u64 {
        self.0[stage as usize].load(Ordering::Relaxed)
    }
}

impl Admission {
    /// When the request must have ended: admission + [`DecodeEngine::request_deadline`].
    pub fn deadline(&self) -> tokio::time::Instant {
        self.deadline
    }

    /// The deadline passed: counted as failed and by stage; returns the error to answer with.
    pub fn deadline_exceeded(mut self) -> RequestError {
        self.ended = true;
        let stage = self.stage;
        tracing::warn!(stage = stage.code(), deadline = ?self.budget, "request deadline exceeded");
        self.state.counters.requests_failed.inc();
        self.expired.0[stage as usize].fetch_add(1, Ordering::Relaxed);
        RequestError::DeadlineExceeded {
            deadline: self.budget,
            stage,
        }
    }

    /// The request moved on to `stage`.
    pub fn enter(&mut self, stage: Stage) {
        self.stage = stage;
    }

    /// The stage now.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Answered successfully (`requests_ok`).
    pub fn succeeded(mut self) {
        self.ended = true;
        self.state.counters.requests_ok.inc();
    }

    /// Failed after admission (`requests_failed`).
    pub fn failed(mut self) {
        self.ended = true;
        self.state.counters.requests_failed.inc();
    }

    /// Refused after admission for a reason that is not the request's failure: no free KV pages
    /// now, or no prefill peer at all (`requests_refused`, like the refusals at admission).
    pub fn refused(mut self) {
        self.ended = true;
        self.state.counters.requests_refused.inc();
    }

    /// Ends the request with error `e`: [`Admission::refused`] for capacity and no peer,
    /// [`Admission::failed`] otherwise.
    pub fn ended_with(self, e: &RequestError) {
        match e {
            RequestError::AtCapacity(_) | RequestError::NoPeer(_) | RequestError::NotReady(_) => {
                self.refused();
            }
            _ => self.failed(),
        }
    }

    /// The client went away (`requests_cancelled`, by stage).
    pub fn cancelled(mut self) {
        self.ended = true;
        self.count_cancelled();
    }

    fn count_cancelled(&self) {
        tracing::info!(
            stage = self.stage.code(),
            "request cancelled: the client went away"
        );
        self.state.counters.requests_cancelled.inc();
        self.state.by_reason.request_cancelled(self.stage.code());
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.ended {
            self.count_cancelled();
        }
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("stage", &self.stage)
            .finish()
    }
}

/// A request's KV, received and verified.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefilled {
    /// Prompt tokens the prefill served from each tier.
    pub hits: pb::PrefixHits,
    /// KV bytes received.
    pub kv_bytes: u64,
    /// Chunks that failed verification (0 unless something is badly wrong).
    pub corrupt_chunks: u64,
    /// Address of the prefill peer that served it.
    pub peer: String,
    /// Peers tried before it.
    pub retries: u32,
}

/// One step of the simulated decode (one TPOT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStep {
    /// Tokens emitted.
    pub tokens: u32,
    /// Draft tokens proposed (0 without speculation).
    pub proposed: u32,
    /// Draft tokens accepted (`tokens - 1` with speculation, 0 without).
    pub accepted: u32,
}

/// The simulated decode of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// The steps; their tokens sum to the requested tokens.
    pub steps: Vec<DecodeStep>,
    /// Mean tokens per step with speculation, 0.0 without.
    pub accept_length: f64,
}

/// One attempt's decode: the plan's steps, each judged by the spec guard (when there is one)
/// before its tokens are emitted.
#[derive(Debug)]
pub struct Decoding {
    steps: std::vec::IntoIter<DecodeStep>,
    guard: Option<SpecGuard>,
    tokens: u64,
    emitted_steps: u64,
    proposed: u64,
    accepted: u64,
}

impl Decoding {
    /// The steps of `plan`, judged by `guard`.
    pub fn new(plan: DecodePlan, guard: Option<SpecGuard>) -> Self {
        Self {
            steps: plan.steps.into_iter(),
            guard,
            tokens: 0,
            emitted_steps: 0,
            proposed: 0,
            accepted: 0,
        }
    }

    /// The next step's tokens to emit: `Ok(None)` when the plan is done.
    ///
    /// # Errors
    /// The guard's [`Anomaly`]: the step's tokens must not be emitted and the attempt ends.
    pub fn next_step(&mut self) -> Result<Option<u32>, Anomaly> {
        let Some(step) = self.steps.next() else {
            return Ok(None);
        };
        if step.proposed > 0
            && let Some(g) = self.guard.as_mut()
        {
            match g.observe(step.proposed, step.accepted) {
                Ok(Verdict::Anomaly(a)) => return Err(a),
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "malformed simulated verification step"),
            }
        }
        self.tokens += u64::from(step.tokens);
        self.emitted_steps += 1;
        self.proposed += u64::from(step.proposed);
        self.accepted += u64::from(step.accepted);
        Ok(Some(step.tokens))
    }

    /// Mean tokens per speculative step emitted so far; 0.0 without speculation.
    pub fn accept_length(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.tokens as f64 / self.emitted_steps as f64
        }
    }

    /// Accepted / proposed draft tokens so far; 0.0 without speculation.
    pub fn accept_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
}

/// What the spec guard did for one request: the `tandem.spec_guard` field of the final response
/// or of the error.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GuardReport {
    /// Whether the guard judged this request (speculative decoding and `specGuard` configured).
    pub enabled: bool,
    /// Each aborted attempt's anomaly and the prefill peer whose KV it decoded.
    pub anomalies: Vec<(Anomaly, String)>,
    /// Attempts retried after an anomaly.
    pub retries: u32,
}

impl GuardReport {
    /// The JSON form: `{"enabled","aborts","retries","anomalies":[{"reason","accept_length",
    /// "accept_rate","tokens","prefill_worker"}]}`.
    pub fn json(&self) -> serde_json::Value {
        let anomalies: Vec<serde_json::Value> = self
            .anomalies
            .iter()
            .map(|(a, peer)| {
                serde_json::json!({
                    "reason": a.reason.code(), "accept_length": a.accept_length,
                    "accept_rate": a.accept_rate, "tokens": a.tokens, "prefill_worker": peer,
                })
            })
            .collect();
        serde_json::json!({
            "enabled": self.enabled, "aborts": self.anomalies.len(), "retries": self.retries,
            "anomalies": anomalies,
        })
    }
}

/// What the front door needs of the decode worker.
pub struct DecodeEngine {
    /// Serving state.
    pub state: Arc<ServeState>,
    /// Model name served (`GET /v1/models`).
    pub model: String,
    /// Pool revision.
    pub revision: String,
    /// Worker id.
    pub worker_id: String,
    /// Simulation knobs.
    pub knobs: SimKnobs,
    pub(super) node: Arc<DecodeNode>,
    pub(super) peers: Arc<PeerSet>,
    pub(super) inflight: Arc<Semaphore>,
    pub(super) max_inflight: usize,
    pub(super) draft_tokens: Option<u32>,
    pub(super) spec_guard: Option<config::SpecGuard>,
    pub(super) kv_deadline: Duration,
    /// Added to [`Self::kv_deadline`] per prompt token (default zero): a prefill that computes at
    /// its usual speed meets the deadline whatever the prompt's length, so only queueing in front
    /// of the prefill trips it — the seed 004 setting, where decode aborts requests whose prefill
    /// queued too long (`TANDEM_DECODE_KV_DEADLINE_US_PER_TOKEN`).
    pub(super) kv_deadline_per_token: Duration,
    pub(super) retry_budget: u32,
    pub(super) next_request: AtomicU64,
    /// Every request ends within this long of its admission (issue 18 item 2;
    /// `TANDEM_DECODE_REQUEST_DEADLINE_MS`, see [`super::DecodeOptions`]).
    pub request_deadline: Duration,
    /// Requests the deadline ended, by stage.
    pub deadline_tally: Arc<DeadlineTally>,
    /// The rooms of the engine beside the worker, when the config names one (DESIGN §3.1): the
    /// front door then hands every request to that engine ([`super::via_engine`]).
    pub(super) engine_rooms: Option<Arc<super::node::engine_rooms::EngineRooms>>,
    /// The engine beside the worker when it is one that serves its own API (SGLang, vLLM): the
    /// front door hands each admitted request to it ([`super::own_api`]), or answers 421
    /// `engine_serves_its_own_api` at once when this decode serves the tier calls from its pool.
    pub(super) own_api_engine: Option<super::own_api::OwnApiEngine>,
    /// Snapshot sync of finished turns (DESIGN contract 4, issue 15); `None` when off
    /// (`TANDEM_DECODE_SNAPSHOT_SYNC=off`).
    pub(super) snapshots: Option<Arc<super::snapshot_push::SnapshotPush>>,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Per-mille chance that the target accepts a draft token: 800 healthy (accept length
/// ≈ 3.4 and accept rate ≈ 0.59 with 4 draft tokens), 50 under an injected `low_accept` fault
/// (accept length ≈ 1.05), 1000 under `high_accept` (accept rate 1).
fn accept_per_mille(fault: Option<SpecFaultMode>) -> u64 {
    match fault {
        None => 800,
        Some(SpecFaultMode::LowAccept) => 50,
        Some(SpecFaultMode::HighAccept) => 1000,
    }
}

/// Steps of a simulated decode of `tokens` tokens: one token per step without speculation, else
/// verification steps of `draft_tokens` draft tokens whose leading tokens are each accepted with
/// a fixed chance (skewed by an injected `fault`), emitting the accepted tokens plus one;
/// deterministic in `seed`, the last step cut to the tokens left.
pub fn decode_plan(
    tokens: u32,
    draft_tokens: Option<u32>,
    seed: u64,
    fault: Option<SpecFaultMode>,
) -> DecodePlan {
    let Some(draft) = draft_tokens.map(|d| d.max(1)) else {
        let one = DecodeStep {
            tokens: 1,
            proposed: 0,
            accepted: 0,
        };
        return DecodePlan {
            steps: vec![one; tokens as usize],
            accept_length: 0.0,
        };
    };
    let chance = accept_per_mille(fault);
    let mut state = seed;
    let mut left = tokens;
    let mut steps = Vec::new();
    while left > 0 {
        let mut accepted = 0;
        while accepted < draft && splitmix(&mut state) % 1000 < chance {
            accepted += 1;
        }
        let emitted = (accepted + 1).min(left);
        steps.push(DecodeStep {
            tokens: emitted,
            proposed: draft,
            accepted: emitted - 1,
        });
        left -= emitted;
    }
    let accept_length = if steps.is_empty() {
        0.0
    } else {
        f64::from(tokens) / steps.len() as f64
    };
    DecodePlan {
        steps,
        accept_length,
    }
}

impl DecodeEngine {
    /// Tokens the whole KV pool holds: a longer prompt can never be served here.
    pub fn max_prompt_tokens(&self) -> u64 {
        match &self.engine_rooms {
            Some(rooms) => rooms.capacity_tokens(),
            None => self.node.capacity_tokens(),
        }
    }

    /// Refuses a prompt longer than the whole pool holds ([`RequestError::ContextLength`]).
    ///
    /// # Errors
    /// [`RequestError::ContextLength`].
    pub fn check_context(&self, prompt_tokens: u32) -> Result<(), RequestError> {
        let limit = self.max_prompt_tokens();
        if u64::from(prompt_tokens) > limit {
            return Err(RequestError::ContextLength {
                prompt_tokens: u64::from(prompt_tokens),
                limit,
                pages: self.node.total_pages(),
            });
        }
        Ok(())
    }

    /// Admits one request while admitting and under `max_inflight`, in [`Stage::Prefill`].
    ///
    /// # Errors
    /// [`RequestError::NotReady`] or [`RequestError::AtCapacity`].
    pub fn admit(&self) -> Result<Admission, RequestError> {
        if !self.state.admitting() {
            self.state.counters.requests_refused.inc();
            let why = match self.state.phase() {
                crate::health::http::Phase::Starting(r) => r,
                _ => "draining".to_owned(),
            };
            return Err(RequestError::NotReady(why));
        }
        let permit = self.inflight.clone().try_acquire_owned().map_err(|_| {
            self.state.counters.requests_refused.inc();
            RequestError::AtCapacity(format!("{} requests in flight", self.max_inflight))
        })?;
        Ok(Admission {
            state: self.state.clone(),
            stage: Stage::Prefill,
            ended: false,
            _permit: permit,
            deadline: tokio::time::Instant::now() + self.request_deadline,
            budget: self.request_deadline,
            expired: self.deadline_tally.clone(),
        })
    }

    /// A fresh request id (unique per worker).
    pub fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// The simulated decode of attempt `attempt` (0 = the first) of a request.
    pub fn decode_plan(&self, request_id: u64, attempt: u32, tokens: u32) -> DecodePlan {
        let fault = self
            .knobs
            .spec_fault
            .filter(|f| f.applies_to(attempt))
            .map(|f| f.mode);
        let seed = request_id ^ (u64::from(attempt) << 48);
        decode_plan(tokens, self.draft_tokens, seed, fault)
    }

    /// A turn finished: sync the session's KV (`session_kv_hashes`) to the prefill of its next
    /// turn, in the background (no-op without hashes or with sync off).
    pub fn sync_session(&self, session_kv_hashes: &[u64]) {
        if let Some(s) = &self.snapshots
            && !session_kv_hashes.is_empty()
        {
            s.spawn(session_kv_hashes.to_vec());
        }
    }

    /// Whether the spec guard judges requests (speculative decoding and `specGuard` configured).
    pub fn spec_guard_enabled(&self) -> bool {
        self.spec_guard.is_some()
    }

    /// Retries after a spec-guard abort (`specGuard.retryBudget`; 0 without a guard).
    pub fn spec_retry_budget(&self) -> u32 {
        self.spec_guard.as_ref().map_or(0, |g| g.retry_budget)
    }

    /// One attempt's decode of `tokens` tokens, judged by a fresh guard when enabled.
    pub fn decoding(&self, request_id: u64, attempt: u32, tokens: u32) -> Decoding {
        let guard = self
            .spec_guard
            .as_ref()
            .map(|g| SpecGuard::new(Thresholds::from(g)));
        Decoding::new(self.decode_plan(request_id, attempt, tokens), guard)
    }

    /// Aborts an attempt the spec guard judged anomalous: the pages go back through the release
    /// gate (cause `SpecGuard`), and the abort is counted by reason and logged.
    pub fn spec_abort(&self, request_id: u64, lease: KvLease, anomaly: &Anomaly, peer: &str) {
        tracing::warn!(
            request_id,
            room = %lease.key(),
            reason = anomaly.reason.code(),
            accept_length = anomaly.accept_length,
            accept_rate = anomaly.accept_rate,
            tokens = anomaly.tokens,
            prefill_worker = peer,
            "spec guard: decode aborted"
        );
        lease.abort(FailureCause::SpecGuard);
        self.state.counters.spec_guard_aborts.inc();
        self.state
            .by_reason
            .spec_guard_anomaly(anomaly.reason.code());
    }

    /// Receives the KV of a prompt from a same-revision prefill peer, preferring peers not in
    /// `avoid` (those whose KV an aborted attempt decoded), retrying on another peer when one
    /// fails (within the retry budget). The pages stay held by the returned [`KvLease`] until
    /// the decode ends.
    ///
    /// # Errors
    /// [`RequestError`]: no peer, capacity (no free pages), timeout (room aborted), or every
    /// peer tried failed.
    pub async fn prefill(
        &self,
        request_id: u64,
        input_tokens: u32,
        output_tokens: u32,
        kv_block_hashes: Vec<u64>,
        kv_deadline: Option<Duration>,
        avoid: &[String],
    ) -> Result<(Prefilled, KvLease), RequestError> {
        let spec = pb::RequestSpec {
            request_id,
            input_tokens: input_tokens.max(1),
            output_tokens,
            hash_ids: kv_block_hashes,
        };
        let hashes = &spec.hash_ids;
        let c = &self.state.counters;
        let ours = self.kv_deadline + self.kv_deadline_per_token.saturating_mul(spec.input_tokens);
        let kv_deadline = kv_deadline.map_or(ours, |d| d.min(ours));
        let mut tried: Vec<String> = Vec::new();
        let mut last_error = None;
        for attempt in 0..=self.retry_budget {
            let shunned: Vec<String> = tried.iter().chain(avoid).cloned().collect();
            let Some(link) = self
                .peers
                .pick(&shunned, hashes)
                .or_else(|| self.peers.pick(&tried, hashes))
            else {
                break;
            };
            if attempt > 0 {
                c.requests_retried.inc();
                tracing::info!(request_id, peer = %link.addr(), attempt, "retrying on another prefill peer");
            }
            tried.push(link.addr().to_owned());
            match self
                .node
                .transfer_held(&link, spec.clone(), kv_deadline)
                .await
            {
                Ok((
                    TransferOutcome::Completed {
                        corrupt_chunks,
                        hits,
                        kv_bytes,
                        ..
                    },
                    Some(lease),
                )) => {
                    c.kv_bytes_received.inc_by(kv_bytes);
                    c.corrupt_pages_read.inc_by(corrupt_chunks);
                    self.peers.routed(link.addr(), hashes);
                    let prefilled = Prefilled {
                        hits,
                        kv_bytes,
                        corrupt_chunks,
                        peer: link.addr().to_owned(),
                        retries: attempt,
                    };
                    return Ok((prefilled, lease));
                }
                Ok((TransferOutcome::Completed { key, .. }, None)) => {
                    // transfer_held always leases a completed room; never reached.
                    last_error = Some(format!("room {key} completed without a lease"));
                }
                Ok((TransferOutcome::Failed { key, cause }, _)) => {
                    c.rooms_aborted.inc();
                    tracing::warn!(request_id, %key, ?cause, peer = %link.addr(), "room failed");
                    if cause == FailureCause::Timeout {
                        return Err(RequestError::Timeout(kv_deadline));
                    }
                    self.peers.forget_if_dead(link.addr());
                    last_error = Some(format!("prefill peer {} failed: {cause:?}", link.addr()));
                }
                Err(DecodeError::NoPages { need, free }) => {
                    return Err(RequestError::AtCapacity(format!(
                        "need {need} KV pages, {free} free"
                    )));
                }
                Err(DecodeError::TooLarge { total, .. }) => {
                    return Err(RequestError::ContextLength {
                        prompt_tokens: u64::from(spec.input_tokens),
                        limit: self.max_prompt_tokens(),
                        pages: total,
                    });
                }
                Err(e) => {
                    self.peers.forget_if_dead(link.addr());
                    last_error = Some(e.to_string());
                }
            }
        }
        Err(match last_error {
            Some(e) => RequestError::PrefillLost(format!("{} peer(s) tried: {e}", tried.len())),
            None => RequestError::NoPeer(self.peers.not_ready_reason()),
        })
    }
}

/// Why stranded pages make the decode not ready (readiness and the `KvPagesStranded` health
/// degradation).
pub fn stranded_reason(s: Stranded, kv_deadline: Duration) -> String {
    format!(
        "{} KV pages in {} rooms held by no live request for over the KV deadline ({kv_deadline:?}): \
         the pool can no longer admit a request it could hold",
        s.pages, s.rooms
    )
}

/// The decode's readiness: at least one live same-revision prefill peer (`live`), and no stranded
/// KV page (held by no live request past the KV deadline). `no_peer` gives the reason when no peer
/// is live.
///
/// # Errors
/// The reason the decode is not ready.
pub fn readiness(
    live: usize,
    stranded: Stranded,
    kv_deadline: Duration,
    no_peer: impl FnOnce() -> String,
) -> Result<(), String> {
    if live == 0 {
        return Err(no_peer());
    }
    if stranded.pages > 0 {
        return Err(stranded_reason(stranded, kv_deadline));
    }
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_needs_a_peer_and_no_stranded_page() {
        let d = Duration::from_secs(30);
        let none = Stranded::default();
        assert_eq!(readiness(1, none, d, || "x".into()), Ok(()));
        assert_eq!(
            readiness(0, none, d, || "no prefill peer".into()),
            Err("no prefill peer".into())
        );
        let s = Stranded {
            rooms: 2,
            pages: 80,
        };
        let why = readiness(3, s, d, || unreachable!()).unwrap_err();
        assert!(
            why.contains("80 KV pages in 2 rooms held by no live request"),
            "{why}"
        );
    }

    #[test]
    fn plans_cover_the_tokens() {
        let p = decode_plan(7, None, 1, None);
        assert!(p.steps.iter().all(|s| s.tokens == 1 && s.proposed == 0));
        assert_eq!(p.steps.len(), 7);
        assert!(p.accept_length.abs() < f64::EPSILON);
        let s = decode_plan(200, Some(4), 9, None);
        assert_eq!(s.steps.iter().map(|s| s.tokens).sum::<u32>(), 200);
        assert!(
            s.steps
                .iter()
                .all(|s| (1..=5).contains(&s.tokens) && s.accepted == s.tokens - 1)
        );
        assert!(
            s.accept_length > 2.5 && s.accept_length < 4.5,
            "{}",
            s.accept_length
        );
        assert_eq!(decode_plan(200, Some(4), 9, None), s, "deterministic");
    }

    fn judge(plan: DecodePlan) -> Result<u64, Anomaly> {
        let mut d = Decoding::new(plan, Some(SpecGuard::new(Thresholds::SEED_004)));
        let mut tokens = 0;
        while let Some(n) = d.next_step()? {
            tokens += u64::from(n);
        }
        Ok(tokens)
    }

    #[test]
    fn healthy_plans_pass_the_seed_004_guard_and_faulty_ones_trip_it() {
        use crate::spec_guard::AnomalyReason;
        for seed in 0..50 {
            for draft in [1, 2, 4, 8] {
                let healthy = decode_plan(512, Some(draft), seed, None);
                assert_eq!(judge(healthy), Ok(512), "seed {seed} draft {draft}");
                let low = decode_plan(512, Some(draft), seed, Some(SpecFaultMode::LowAccept));
                let a = judge(low).unwrap_err();
                assert_eq!(a.reason, AnomalyReason::LowAcceptLength);
                assert!(a.tokens >= 128 && a.tokens < 140, "{a:?}");
                let high = decode_plan(512, Some(draft), seed, Some(SpecFaultMode::HighAccept));
                assert_eq!(
                    judge(high).unwrap_err().reason,
                    AnomalyReason::HighAcceptRate
                );
            }
        }
        // Without a guard the faulty plan streams every token.
        let low = decode_plan(512, Some(4), 3, Some(SpecFaultMode::LowAccept));
        let mut d = Decoding::new(low, None);
        let mut tokens = 0;
        while let Some(n) = d.next_step().unwrap() {
            tokens += n;
        }
        assert_eq!(tokens, 512);
        assert!(d.accept_length() < 1.4);
    }
}
