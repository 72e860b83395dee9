//! `tandem-worker decode --config`: the decode serving process (INTERFACES §2, §3).
//!
//! Owns the KV receive region (data port), the same-revision prefill [`PeerSet`], and the front
//! door. Per request ([`DecodeEngine::prefill`]): pick a peer round-robin, open a room for the
//! prompt's pages, receive and verify the KV within the KV deadline (past it the room aborts
//! through the release protocol — seed 004), and, when the peer fails mid-request, retry on another
//! peer within the retry budget. Pages return to the pool only through the release gate of
//! [`DecodeNode`]. Token generation is simulated at `TANDEM_SIM_TPOT_MS` per step
//! ([`DecodeEngine::decode_plan`]); with `speculative` set, each step emits a simulated accept
//! length of `1..=draftTokens+1` tokens.
//!
//! Readiness: ready only while at least one same-revision prefill peer is connected; `/report`
//! says why not otherwise. Drain (SIGTERM): readiness 503 at once, new requests 503, in-flight
//! requests finish until the grace deadline.
//!
//! The speculative-decoding anomaly guard (DESIGN contract 8) is not applied: no guard module
//! exists in this crate yet; `specGuard` is read and reported only.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::counters::mirror;
use super::front_door;
use super::health::{ServeState, router, spawn_http};
use super::peers::{PeerSet, PeerTarget};
use super::resolve::Resolver;
use super::sim::{SimKnobs, region_pages};
use super::{ServeError, pod_ip};
use crate::config::WorkerConfig;
use crate::control::decode::{DecodeConfig, DecodeError, DecodeNode, TransferOutcome};
use crate::control::pb;
use crate::room::receiver::{FailureCause, GateMode};

/// Process-level options (the config decides the rest).
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    /// Address to bind (default `$POD_IP`, else 0.0.0.0).
    pub bind_ip: IpAddr,
    /// Worker id (default `$POD_NAME`).
    pub worker_id: String,
    /// Deadline for a request's KV; past it the room aborts through the release protocol.
    pub kv_deadline: Duration,
    /// Retries on another prefill peer after a peer failure.
    pub retry_budget: u32,
    /// Requests admitted at once; beyond, 429.
    pub max_inflight: usize,
    /// Peer set refresh interval.
    pub refresh_every: Duration,
    /// Heartbeat interval on each prefill link (3 missed = peer dead).
    pub heartbeat: Duration,
    /// Grace for in-flight requests at drain.
    pub drain_grace: Duration,
    /// Control port of the prefill peers (default: this config's `ports.control`, the pools'
    /// common port).
    pub peer_port: Option<u16>,
}

impl DecodeOptions {
    /// Options from the pod environment: `$POD_IP`, `$POD_NAME`, and the optional overrides
    /// `TANDEM_DECODE_RETRY_BUDGET` (default 2) and `TANDEM_DECODE_KV_DEADLINE_MS` (default
    /// 30000); the rest as documented on the fields.
    pub fn from_env() -> Self {
        let num = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Self {
            bind_ip: pod_ip(),
            worker_id: std::env::var("POD_NAME").unwrap_or_else(|_| "decode-0".into()),
            kv_deadline: Duration::from_millis(
                num("TANDEM_DECODE_KV_DEADLINE_MS").unwrap_or(30_000),
            ),
            retry_budget: num("TANDEM_DECODE_RETRY_BUDGET")
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(2),
            max_inflight: 256,
            refresh_every: Duration::from_secs(2),
            heartbeat: Duration::from_millis(500),
            drain_grace: Duration::from_secs(25),
            peer_port: None,
        }
    }
}

/// Why a request was not served (mapped to HTTP by the front door).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not admitting (starting or draining): 503.
    #[error("not ready: {0}")]
    NotReady(String),
    /// No prefill peer of this revision is left to try: 503.
    #[error("{0}")]
    NoPeer(String),
    /// Too many requests in flight or no free KV pages: 429.
    #[error("at capacity: {0}")]
    AtCapacity(String),
    /// The KV did not arrive before the deadline; the room was aborted: 503.
    #[error("KV not received within {0:?}; room aborted")]
    Timeout(Duration),
    /// Anything else: 500.
    #[error("{0}")]
    Failed(String),
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

/// The simulated decode of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// Tokens emitted per step (each step takes one TPOT); sums to the requested tokens.
    pub steps: Vec<u32>,
    /// Mean accepted tokens per step with speculation, 0.0 without.
    pub accept_length: f64,
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
    node: Arc<DecodeNode>,
    peers: Arc<PeerSet>,
    inflight: Arc<Semaphore>,
    max_inflight: usize,
    draft_tokens: Option<u32>,
    kv_deadline: Duration,
    retry_budget: u32,
    next_request: AtomicU64,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Steps of a simulated decode of `tokens` tokens: one token per step without speculation, else
/// an accept length drawn uniformly from `1..=draft_tokens+1` per step (deterministic in `seed`),
/// the last step cut to the tokens left.
pub fn decode_plan(tokens: u32, draft_tokens: Option<u32>, seed: u64) -> DecodePlan {
    let Some(draft) = draft_tokens else {
        return DecodePlan {
            steps: vec![1; tokens as usize],
            accept_length: 0.0,
        };
    };
    let mut state = seed;
    let mut left = tokens;
    let mut steps = Vec::new();
    while left > 0 {
        let a = 1 + (splitmix(&mut state) % (u64::from(draft) + 1)) as u32;
        let a = a.min(left);
        steps.push(a);
        left -= a;
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
    /// Admits one request: a permit while admitting and under `max_inflight`.
    ///
    /// # Errors
    /// [`RequestError::NotReady`] or [`RequestError::AtCapacity`].
    pub fn admit(&self) -> Result<OwnedSemaphorePermit, RequestError> {
        if !self.state.admitting() {
            self.state.counters.requests_refused.inc();
            let why = match self.state.phase() {
                super::health::Phase::Starting(r) => r,
                _ => "draining".to_owned(),
            };
            return Err(RequestError::NotReady(why));
        }
        self.inflight.clone().try_acquire_owned().map_err(|_| {
            self.state.counters.requests_refused.inc();
            RequestError::AtCapacity(format!("{} requests in flight", self.max_inflight))
        })
    }

    /// A fresh request id (unique per worker).
    pub fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// The simulated decode of a request.
    pub fn decode_plan(&self, request_id: u64, tokens: u32) -> DecodePlan {
        decode_plan(tokens, self.draft_tokens, request_id)
    }

    /// Receives the KV of a prompt from a same-revision prefill peer, retrying on another peer
    /// when one fails (within the retry budget).
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
    ) -> Result<Prefilled, RequestError> {
        let spec = pb::RequestSpec {
            request_id,
            input_tokens: input_tokens.max(1),
            output_tokens,
            hash_ids: kv_block_hashes,
        };
        let c = &self.state.counters;
        let mut tried: Vec<String> = Vec::new();
        let mut last_error = None;
        for attempt in 0..=self.retry_budget {
            let Some(link) = self.peers.pick(&tried) else {
                break;
            };
            if attempt > 0 {
                c.requests_retried.inc();
                tracing::info!(request_id, peer = %link.addr(), attempt, "retrying on another prefill peer");
            }
            tried.push(link.addr().to_owned());
            match self
                .node
                .transfer(&link, spec.clone(), self.kv_deadline)
                .await
            {
                Ok(TransferOutcome::Completed {
                    corrupt_chunks,
                    hits,
                    kv_bytes,
                    ..
                }) => {
                    c.kv_bytes_received.inc_by(kv_bytes);
                    c.corrupt_pages_read.inc_by(corrupt_chunks);
                    return Ok(Prefilled {
                        hits,
                        kv_bytes,
                        corrupt_chunks,
                        peer: link.addr().to_owned(),
                        retries: attempt,
                    });
                }
                Ok(TransferOutcome::Failed { key, cause }) => {
                    c.rooms_aborted.inc();
                    tracing::warn!(request_id, %key, ?cause, peer = %link.addr(), "room failed");
                    if cause == FailureCause::Timeout {
                        return Err(RequestError::Timeout(self.kv_deadline));
                    }
                    self.peers.forget_if_dead(link.addr());
                    last_error = Some(format!("prefill peer {} failed: {cause:?}", link.addr()));
                }
                Err(DecodeError::NoPages { need, free }) => {
                    return Err(RequestError::AtCapacity(format!(
                        "need {need} KV pages, {free} free"
                    )));
                }
                Err(e) => {
                    self.peers.forget_if_dead(link.addr());
                    last_error = Some(e.to_string());
                }
            }
        }
        Err(match last_error {
            Some(e) => RequestError::Failed(format!("{} peer(s) tried: {e}", tried.len())),
            None => RequestError::NoPeer(self.peers.not_ready_reason()),
        })
    }
}

/// A running decode server.
pub struct DecodeServer {
    /// Serving state.
    pub state: Arc<ServeState>,
    /// The engine behind the front door.
    pub engine: Arc<DecodeEngine>,
    /// Front door address.
    pub front_addr: SocketAddr,
    /// Health address.
    pub health_addr: SocketAddr,
    /// KV data address.
    pub data_addr: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    grace: Duration,
}

impl DecodeServer {
    /// Starts the receiver, the peer refresh, the front door and the health port.
    ///
    /// # Errors
    /// [`ServeError`] on a missing `peers.prefillService` or `ports.frontDoor`, or a bind failure.
    pub async fn start(
        cfg: &WorkerConfig,
        knobs: SimKnobs,
        opts: DecodeOptions,
    ) -> Result<Self, ServeError> {
        let service = cfg
            .peers
            .prefill_service
            .clone()
            .ok_or_else(|| ServeError::Config("decode needs peers.prefillService".into()))?;
        let front_port = cfg
            .ports
            .front_door
            .ok_or_else(|| ServeError::Config("decode needs ports.frontDoor".into()))?;
        let state = ServeState::new(
            "decode",
            &cfg.pool,
            &cfg.revision,
            "connecting to prefill peers",
        );
        let layout = knobs.layout(cfg);
        if opts.bind_ip.is_unspecified() {
            tracing::warn!(
                "POD_IP is not set: the KV receiver advertises an unspecified address, which only \
                 a prefill on this host can reach"
            );
        }
        let node = DecodeNode::start(DecodeConfig {
            worker_id: opts.worker_id.clone(),
            rank: super::ordinal_from_env(),
            pages: region_pages(cfg.memory.target_pool_bytes, layout),
            layout,
            data_bind: SocketAddr::new(opts.bind_ip, cfg.ports.data).to_string(),
            ack_timeout: Duration::from_secs(30),
            heartbeat: opts.heartbeat,
            fence_is_proof: true,
            gate: GateMode::Safe,
        })?;
        let peers = PeerSet::new(
            node.clone(),
            PeerTarget {
                service: service.clone(),
                port: opts.peer_port.unwrap_or(cfg.ports.control),
                revision: cfg.revision.clone(),
                connect_timeout: Duration::from_secs(2),
            },
            Resolver::from_env(),
            state.counters.clone(),
        );
        let engine = Arc::new(DecodeEngine {
            state: state.clone(),
            model: cfg.model.name.clone(),
            revision: cfg.revision.clone(),
            worker_id: opts.worker_id.clone(),
            knobs,
            node: node.clone(),
            peers: peers.clone(),
            inflight: Arc::new(Semaphore::new(opts.max_inflight.max(1))),
            max_inflight: opts.max_inflight.max(1),
            draft_tokens: cfg.speculative.as_ref().map(|s| s.draft_tokens.max(1)),
            kv_deadline: opts.kv_deadline,
            retry_budget: opts.retry_budget,
            next_request: AtomicU64::new(1),
        });
        let n = node.clone();
        state.on_refresh(move |s| {
            let c = &s.counters;
            mirror(&c.abort_acks, n.acks_received());
            mirror(&c.pages_quarantined, n.pages().quarantined as u64);
        });
        let p = peers.clone();
        state.set_extra(move || {
            let mut m = serde_json::Map::new();
            m.insert("peers".into(), serde_json::json!(p.addrs()));
            m.insert("refused_peers".into(), serde_json::json!(p.refused()));
            m
        });
        let (health_addr, http) = spawn_http(
            SocketAddr::new(opts.bind_ip, cfg.ports.health),
            router(state.clone()),
        )
        .await
        .map_err(|e| ServeError::Bind("health", e))?;
        let (front_addr, front) = spawn_http(
            SocketAddr::new(opts.bind_ip, front_port),
            front_door::router(engine.clone()),
        )
        .await
        .map_err(|e| ServeError::Bind("front door", e))?;
        let st = state.clone();
        let p = peers.clone();
        let refresh = peers.spawn_refresh(opts.refresh_every, move |live| {
            st.set_ready(if live > 0 {
                Ok(())
            } else {
                Err(p.not_ready_reason())
            });
        });
        tracing::info!(%front_addr, %health_addr, data = %node.data_addr(), %service, revision = %cfg.revision, ?layout, "decode serving");
        Ok(Self {
            state,
            engine,
            front_addr,
            health_addr,
            data_addr: node.data_addr(),
            tasks: vec![http, front, refresh],
            grace: opts.drain_grace,
        })
    }

    /// Drains and stops: readiness 503 and new requests refused at once, in-flight requests
    /// finish until the grace deadline. Returns whether every request finished in time.
    pub async fn shutdown(self) -> bool {
        self.state.begin_drain();
        let e = &self.engine;
        tracing::info!(
            in_flight = e.max_inflight - e.inflight.available_permits(),
            "draining decode"
        );
        let deadline = Instant::now() + self.grace;
        while e.inflight.available_permits() < e.max_inflight && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let finished = e.inflight.available_permits() == e.max_inflight;
        for t in &self.tasks {
            t.abort();
        }
        tracing::info!(finished, "decode stopped");
        finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_tokens() {
        let p = decode_plan(7, None, 1);
        assert_eq!(p.steps, vec![1; 7]);
        assert!(p.accept_length.abs() < f64::EPSILON);
        let s = decode_plan(200, Some(4), 9);
        assert_eq!(s.steps.iter().sum::<u32>(), 200);
        assert!(s.steps.iter().all(|a| (1..=5).contains(a)));
        assert!(
            s.accept_length > 1.5 && s.accept_length < 4.5,
            "{}",
            s.accept_length
        );
        assert_eq!(decode_plan(200, Some(4), 9), s, "deterministic");
    }
}
