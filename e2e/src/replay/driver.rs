//! The replay loop: each request is sent at its scaled time, streamed, timed, and retried on
//! another target within a budget.
//!
//! Timing (all in ms on the replay's [`Clock`]): `sent_ms` is the first attempt's send time;
//! TTFT is from `sent_ms` to the first `data:` event of the attempt that completed (a user
//! sees retries as latency); TPOT is `(last event − first event) / (tokens − 1)` of that attempt.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, watch};

use super::front_door::{
    CompletionChunk, CompletionRequest, SseDecoder, TandemBlock, error_message,
};
use super::schedule::{Clock, Outcome, backoff, classify, retryable_status, scaled_offset};
use super::targets::TargetSet;
use super::workload::TraceRequest;

/// Knobs of a replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Model name sent in every request.
    pub model: String,
    /// Multiplies trace timestamps (0.1 = ten times faster than recorded).
    pub time_scale: f64,
    /// At most this many requests in flight (None: unlimited; a due request waits for a slot).
    pub concurrency_limit: Option<usize>,
    /// Retries after the first attempt (on 503, 429, connection errors, cut streams, timeouts).
    pub retry_budget: u32,
    /// First back-off; doubles per retry.
    pub backoff_base: Duration,
    /// Back-off cap.
    pub backoff_max: Duration,
    /// One attempt's deadline (connect to `[DONE]`).
    pub attempt_timeout: Duration,
    /// Induces seed 004's race on a known fraction of requests (None: off).
    pub abort_probe: Option<AbortProbe>,
    /// Snapshot sync (`--snapshot-sync on|off`, issue 15): a request whose session has a next turn
    /// in the workload names its session KV (`session_kv_hashes`,
    /// [`super::workload::session_kv_hashes`]), so the decode pushes it to the next turn's prefill.
    pub snapshot_sync: bool,
}

/// Seed 004's race, induced on purpose: the first attempt of every `every`-th request carries a
/// KV deadline of `kv_deadline_ms` — shorter than its prefill takes — so the decode aborts the room
/// while the prefill may still be computing and writing its pages, and the release gate must keep
/// the pages until the prefill's ack. The 503 `kv_deadline_exceeded` is retried like any 503, without
/// the deadline, so no request is lost to the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbortProbe {
    /// Every N-th request (N ≥ 1; request indexes N−1, 2N−1, …).
    pub every: usize,
    /// The probe attempt's KV deadline, in ms (≥ 1).
    pub kv_deadline_ms: u64,
}

impl AbortProbe {
    /// Whether request `index` (0-based) is probed.
    pub fn probes(&self, index: usize) -> bool {
        self.every > 0 && index % self.every == self.every - 1
    }
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            model: "llama-3-70b".to_owned(),
            time_scale: 1.0,
            concurrency_limit: None,
            retry_budget: 3,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            attempt_timeout: Duration::from_secs(120),
            abort_probe: None,
            snapshot_sync: false,
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestResult {
    /// Position in the workload.
    pub index: usize,
    /// Prompt tokens asked for.
    pub input_tokens: u32,
    /// Completion tokens asked for.
    pub max_tokens: u32,
    /// When it was due (ms on the replay clock).
    pub scheduled_ms: f64,
    /// When the first attempt was sent (ms; never before `scheduled_ms`).
    pub sent_ms: f64,
    /// When it completed or was given up (ms).
    pub finished_ms: f64,
    /// ok / retried / failed.
    pub outcome: Outcome,
    /// Attempts made (1 + retries).
    pub attempts: u32,
    /// Why each failed attempt failed, in order.
    pub errors: Vec<String>,
    /// The front door that completed it.
    pub target: Option<String>,
    /// Time to first token (ms), completed requests only.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first (ms), when ≥ 2 tokens came.
    pub tpot_ms: Option<f64>,
    /// Completion tokens received (`usage.completion_tokens`, else the events counted).
    pub completion_tokens: u64,
    /// The final event's `tandem` block.
    pub tandem: Option<TandemBlock>,
}

/// Counts the replay publishes while it runs (for the demo's mid-replay actions and the bar).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayProgress {
    /// Requests whose first attempt was sent.
    pub dispatched: usize,
    /// Requests finished (any outcome).
    pub finished: usize,
    /// Requests in the workload.
    pub total: usize,
}

/// Why one attempt did not complete.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error("no front door available")]
    NoTarget,
    #[error("{target}: HTTP {status}: {message}")]
    Status {
        target: String,
        status: u16,
        message: String,
    },
    #[error("{target}: {message}")]
    Transport { target: String, message: String },
    #[error("{target}: error event after {events} events: {message}")]
    StreamError {
        target: String,
        events: u64,
        message: String,
    },
    #[error("{target}: stream ended before [DONE] after {events} events")]
    Cut { target: String, events: u64 },
    #[error("{target}: no [DONE] within {timeout:?}")]
    Timeout { target: String, timeout: Duration },
}

impl AttemptError {
    fn retryable(&self) -> bool {
        match self {
            Self::Status { status, .. } => retryable_status(*status),
            _ => true,
        }
    }
}

struct Completed {
    target: String,
    first_event_ms: f64,
    last_event_ms: f64,
    events: u64,
    last: CompletionChunk,
}

/// Replays `workload` against `targets` and returns one result per request, in workload order.
///
/// Requests are dispatched in order, each no earlier than its scaled timestamp; `progress` gets
/// every change; `bar` (if any) advances per finished request. Errors of single requests are
/// results, never a failure of the replay.
pub async fn replay(
    workload: &[TraceRequest],
    targets: &TargetSet,
    config: &ReplayConfig,
    clock: Clock,
    progress: Option<watch::Sender<ReplayProgress>>,
    bar: Option<ProgressBar>,
) -> Vec<RequestResult> {
    let http = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(30))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .unwrap_or_default();
    let first_ts = workload.first().map_or(0, |r| r.timestamp);
    let slots = config
        .concurrency_limit
        .map(|n| Arc::new(Semaphore::new(n.max(1))));
    let state = Arc::new(std::sync::Mutex::new(ReplayProgress {
        total: workload.len(),
        ..Default::default()
    }));
    let publish = {
        let progress = progress.clone();
        move |p: ReplayProgress| {
            if let Some(tx) = &progress {
                tx.send_replace(p);
            }
        }
    };
    publish(*state.lock().unwrap_or_else(|e| e.into_inner()));
    let sessions = if config.snapshot_sync {
        super::workload::session_kv_hashes(workload)
    } else {
        Vec::new()
    };
    let mut tasks = Vec::with_capacity(workload.len());
    for (index, req) in workload.iter().enumerate() {
        let session = sessions.get(index).cloned().unwrap_or_default();
        let due = scaled_offset(req.timestamp, first_ts, config.time_scale);
        tokio::time::sleep_until((clock.origin() + due).into()).await;
        let permit = match &slots {
            Some(s) => Some(s.clone().acquire_owned().await.ok()),
            None => None,
        };
        let scheduled_ms = due.as_secs_f64() * 1000.0;
        {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            s.dispatched += 1;
            publish(*s);
        }
        let (http, targets, config, req) =
            (http.clone(), targets.clone(), config.clone(), req.clone());
        let (state, publish, bar) = (state.clone(), publish.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let turn = Turn {
                index,
                req: &req,
                session_kv_hashes: session,
            };
            let r = one_request(&http, &targets, &config, clock, turn, scheduled_ms).await;
            drop(permit);
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            s.finished += 1;
            publish(*s);
            if let Some(b) = &bar {
                b.inc(1);
            }
            r
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for (index, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(r) => out.push(r),
            // A panicking request task is a bug; keep the slot as a failure rather than lose it.
            Err(e) => out.push(RequestResult {
                index,
                input_tokens: workload[index].input_length,
                max_tokens: workload[index].output_length,
                scheduled_ms: 0.0,
                sent_ms: 0.0,
                finished_ms: clock.ms(),
                outcome: Outcome::Failed,
                attempts: 0,
                errors: vec![format!("request task failed: {e}")],
                target: None,
                ttft_ms: None,
                tpot_ms: None,
                completion_tokens: 0,
                tandem: None,
            }),
        }
    }
    if let Some(b) = &bar {
        b.finish();
    }
    out
}

/// One request of the workload, with its session KV when snapshot sync names it.
struct Turn<'a> {
    index: usize,
    req: &'a TraceRequest,
    session_kv_hashes: Vec<u64>,
}

async fn one_request(
    http: &reqwest::Client,
    targets: &TargetSet,
    config: &ReplayConfig,
    clock: Clock,
    turn: Turn<'_>,
    scheduled_ms: f64,
) -> RequestResult {
    let (index, req) = (turn.index, turn.req);
    let plain = CompletionRequest {
        session_kv_hashes: turn.session_kv_hashes,
        ..CompletionRequest::from_trace(&config.model, req)
    };
    let probe = config
        .abort_probe
        .filter(|p| p.probes(index))
        .map(|p| CompletionRequest {
            kv_deadline_ms: Some(p.kv_deadline_ms.max(1)),
            ..plain.clone()
        });
    let sent_ms = clock.ms();
    let mut errors = Vec::new();
    let mut attempts = 0;
    let mut done = None;
    while attempts <= config.retry_budget {
        if attempts > 0 {
            tokio::time::sleep(backoff(attempts, config.backoff_base, config.backoff_max)).await;
        }
        attempts += 1;
        // The probe's deadline rides on the first attempt only.
        let body = match (&probe, attempts) {
            (Some(p), 1) => p,
            _ => &plain,
        };
        match attempt(
            http,
            targets,
            config,
            clock,
            index + attempts as usize - 1,
            body,
        )
        .await
        {
            Ok(c) => {
                done = Some(c);
                break;
            }
            Err(e) => {
                let retry = e.retryable();
                errors.push(e.to_string());
                if !retry {
                    break;
                }
            }
        }
    }
    let finished_ms = clock.ms();
    let mut r = RequestResult {
        index,
        input_tokens: req.input_length,
        max_tokens: req.output_length,
        scheduled_ms,
        sent_ms,
        finished_ms,
        outcome: classify(attempts, done.is_some()),
        attempts,
        errors,
        target: None,
        ttft_ms: None,
        tpot_ms: None,
        completion_tokens: 0,
        tandem: None,
    };
    if let Some(c) = done {
        let tokens = c
            .last
            .usage
            .map(|u| u.completion_tokens)
            .filter(|&t| t > 0)
            .unwrap_or(c.events);
        r.target = Some(c.target);
        r.ttft_ms = Some(c.first_event_ms - sent_ms);
        r.tpot_ms =
            (tokens >= 2).then(|| (c.last_event_ms - c.first_event_ms) / (tokens - 1) as f64);
        r.completion_tokens = tokens;
        r.tandem = c.last.tandem;
    }
    r
}

async fn attempt(
    http: &reqwest::Client,
    targets: &TargetSet,
    config: &ReplayConfig,
    clock: Clock,
    pick: usize,
    body: &CompletionRequest,
) -> Result<Completed, AttemptError> {
    let target = targets.pick(pick).ok_or(AttemptError::NoTarget)?;
    let timeout = config.attempt_timeout;
    match tokio::time::timeout(timeout, stream_completion(http, &target, clock, body)).await {
        Ok(r) => r,
        Err(_) => Err(AttemptError::Timeout { target, timeout }),
    }
}

async fn stream_completion(
    http: &reqwest::Client,
    target: &str,
    clock: Clock,
    body: &CompletionRequest,
) -> Result<Completed, AttemptError> {
    let transport = |e: reqwest::Error| AttemptError::Transport {
        target: target.to_owned(),
        message: format!("{e:#}"),
    };
    let resp = http
        .post(format!("{target}/v1/completions"))
        .json(body)
        .send()
        .await
        .map_err(transport)?;
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp.text().await.unwrap_or_default();
        return Err(AttemptError::Status {
            target: target.to_owned(),
            status,
            message: error_message(&text).unwrap_or(text),
        });
    }
    let mut stream = resp.bytes_stream();
    let mut decoder = SseDecoder::default();
    let (mut first, mut last_t, mut events) = (None, 0.0, 0u64);
    let mut last = CompletionChunk::default();
    while let Some(chunk) = stream.next().await {
        let bytes = chunk.map_err(|e| AttemptError::Transport {
            target: target.to_owned(),
            message: format!("stream broken after {events} events: {e:#}"),
        })?;
        for data in decoder.feed(&bytes) {
            let now = clock.ms();
            if data.trim() == "[DONE]" {
                return match first {
                    Some(first_event_ms) => Ok(Completed {
                        target: target.to_owned(),
                        first_event_ms,
                        last_event_ms: last_t,
                        events,
                        last,
                    }),
                    None => Err(AttemptError::Cut {
                        target: target.to_owned(),
                        events,
                    }),
                };
            }
            // A front door that gives up mid-stream (e.g. the spec guard's retry budget ran out)
            // sends an error object instead of [DONE]: retryable elsewhere, like a 503.
            if let Some(message) = error_message(&data) {
                return Err(AttemptError::StreamError {
                    target: target.to_owned(),
                    events,
                    message,
                });
            }
            let Ok(parsed) = serde_json::from_str::<CompletionChunk>(&data) else {
                tracing::debug!(%target, %data, "unparsable event ignored");
                continue;
            };
            first.get_or_insert(now);
            last_t = now;
            events += 1;
            last = parsed;
        }
    }
    Err(AttemptError::Cut {
        target: target.to_owned(),
        events,
    })
}

#[cfg(test)]
mod abort_probe_tests {
    use super::AbortProbe;

    #[test]
    fn the_probe_picks_every_nth_request() {
        let p = AbortProbe {
            every: 10,
            kv_deadline_ms: 30,
        };
        let picked: Vec<usize> = (0..35).filter(|i| p.probes(*i)).collect();
        assert_eq!(picked, [9, 19, 29]);
        let all = AbortProbe { every: 1, ..p };
        assert!((0..5).all(|i| all.probes(i)));
        let off = AbortProbe { every: 0, ..p };
        assert!(!(0..5).any(|i| off.probes(i)));
    }
}
