//! The engine seat of a decode worker whose config names an engine (`config.engine`, DESIGN §3.1).
//!
//! At start the worker allocates the decode pools — target, plus draft with `speculative` and the
//! indexer when sized — in the configured allocator domain and registers them transactionally
//! under `registrationFailure` (the role-agnostic [`Seat`] of `roles::prefill::seat`; a failure
//! refuses the start), registers the target pool on its TCP receiver ([`EngineRooms::bind`]) and
//! serves the engine API (Session, Decode, Spec) on `engine.socketDir`. Requests then flow as
//! [`super::via_engine`] says.
//!
//! Readiness: `/readyz` is 503 `engine not attached` until an engine attached and again from the
//! moment that attach ends; while attached, the decode's own rule applies (a same-revision prefill
//! peer, no stranded page). When the attach ends, its rooms fail through the release gate and every
//! request waiting on the engine ends at once with the reason.
//!
//! `/metrics` adds to the seat's `tandem_engine_pool_*`, registration, `tandem_engine_attached` and
//! `tandem_engine_attaches`: `tandem_engine_decode_work_total` (requests handed to the engine),
//! `tandem_engine_rooms_reserved_total`, `tandem_engine_rooms_completed_total`,
//! `tandem_engine_rooms_failed_total`, `tandem_engine_releases_total{proof}` (SafeToReuse by proof:
//! `concluded`, `acks`, `transport`, `bypassed`), `tandem_engine_abort_acks_total`,
//! `tandem_engine_rooms_quarantined_total`, `tandem_engine_spec_trips_total`,
//! `tandem_engine_tokens_total`, `tandem_engine_chunks_verified_total`,
//! `tandem_engine_corrupt_chunks_total` and `tandem_engine_pages{state}` (`free`, `held`,
//! `release_pending`, `quarantined`). `/report`'s `engine` carries the same ([`DecodeSeat::report`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use super::node::DecodeNode;
use super::node::engine_rooms::EngineRooms;
use crate::config::{EngineSeat, WorkerConfig};
use crate::control::KvLayout;
use crate::health::counters::mirror;
use crate::health::http::ServeState;
use crate::roles::ServeError;
use crate::roles::prefill::seat::{self, EngineMetrics, NOT_ATTACHED, Seat, SeatRole, TierSeat};
use crate::roles::prefill::tiers::HostTiers;

type Labels = Vec<(String, String)>;

/// The decode seat's own metrics; cheap to clone (clones share their values).
#[derive(Debug, Clone, Default)]
pub struct DecodeEngineMetrics {
    /// Requests (attempts) handed to the engine.
    pub work: Counter,
    /// Rooms the engine reserved.
    pub rooms_reserved: Counter,
    /// Rooms whose KV completed.
    pub rooms_completed: Counter,
    /// Rooms failed (any cause).
    pub rooms_failed: Counter,
    /// SafeToReuse releases by proof.
    pub releases: Family<Labels, Counter>,
    /// Abort acks counted by the gate.
    pub acks: Counter,
    /// Rooms quarantined.
    pub quarantined: Counter,
    /// Spec-guard trips through ReportSteps.
    pub spec_trips: Counter,
    /// Tokens the engine emitted.
    pub tokens: Counter,
    /// Chunks the engine verified.
    pub chunks_verified: Counter,
    /// Chunks the engine found corrupt.
    pub corrupt_chunks: Counter,
    /// Pages of the engine's pools by state.
    pub pages: Family<Labels, Gauge>,
}

impl DecodeEngineMetrics {
    /// Registers every metric in `r`.
    pub fn register(&self, r: &mut Registry) {
        let counters: [(&str, &str, &Counter); 10] = [
            (
                "tandem_engine_decode_work",
                "Requests handed to the decode engine",
                &self.work,
            ),
            (
                "tandem_engine_rooms_reserved",
                "Rooms the decode engine reserved",
                &self.rooms_reserved,
            ),
            (
                "tandem_engine_rooms_completed",
                "Rooms whose KV completed in the engine's pages",
                &self.rooms_completed,
            ),
            (
                "tandem_engine_rooms_failed",
                "Rooms of the decode engine that failed (any cause)",
                &self.rooms_failed,
            ),
            (
                "tandem_engine_abort_acks",
                "Abort acks counted by the decode engine's release gate",
                &self.acks,
            ),
            (
                "tandem_engine_rooms_quarantined",
                "Rooms whose pages were quarantined (no proof by the ack deadline)",
                &self.quarantined,
            ),
            (
                "tandem_engine_spec_trips",
                "Spec-guard trips through ReportSteps",
                &self.spec_trips,
            ),
            (
                "tandem_engine_tokens",
                "Tokens the decode engine emitted",
                &self.tokens,
            ),
            (
                "tandem_engine_chunks_verified",
                "KV chunks the decode engine read and verified",
                &self.chunks_verified,
            ),
            (
                "tandem_engine_corrupt_chunks",
                "KV chunks the decode engine found corrupt",
                &self.corrupt_chunks,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "tandem_engine_releases",
            "Pages released to the decode engine (SafeToReuse), by the gate's proof",
            self.releases.clone(),
        );
        r.register(
            "tandem_engine_pages",
            "Pages of the decode engine's pools by state",
            self.pages.clone(),
        );
    }
}

/// A running decode seat.
pub struct DecodeSeat {
    /// The role-agnostic seat (pools, server).
    pub seat: Seat,
    /// The engine's rooms on the node.
    pub rooms: Arc<EngineRooms>,
}

impl DecodeSeat {
    /// Allocates and registers the pools, starts the engine-API server and binds the engine's rooms
    /// to `node`. `ready` computes the decode's readiness while an engine is attached; it is
    /// re-evaluated at every attach change (`/readyz` says `engine not attached` otherwise).
    /// `tier`: the tier calls' L2/L3 for an SGLang or vLLM engine ([`SeatRole::Decode`]).
    ///
    /// # Errors
    /// [`ServeError::Config`] when the pools cannot be made or registered (fail-closed), the
    /// target pool is not the transfer layout, or the server cannot bind its sockets.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        cfg: &WorkerConfig,
        engine: &EngineSeat,
        node: &Arc<DecodeNode>,
        state: &Arc<ServeState>,
        rank: u32,
        metrics: (&EngineMetrics, &DecodeEngineMetrics),
        layout: KvLayout,
        target_token_bytes: Option<u64>,
        ready: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
        tier: Option<Box<TierSeat>>,
    ) -> Result<Self, ServeError> {
        let rooms = EngineRooms::new(node, layout).map_err(ServeError::Config)?;
        let seat = Seat::start_role(
            cfg,
            engine,
            SeatRole::Decode(rooms.clone(), tier),
            state,
            rank,
            metrics.0,
            target_token_bytes,
        )?;
        rooms
            .bind(&seat.api)
            .map_err(|e| ServeError::Config(format!("engine pools: {e}")))?;
        let mut rx = seat.api.watch_attach();
        let (st, r) = (state.clone(), rooms.clone());
        tokio::spawn(async move {
            loop {
                let now = *rx.borrow_and_update();
                match now {
                    Some(id) => {
                        tracing::info!(attach_id = id, "decode engine attached");
                        st.set_ready(ready());
                    }
                    None => {
                        r.engine_lost("the decode engine detached or exited");
                        st.set_ready(Err(NOT_ATTACHED.into()));
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        let (api, r, m) = (seat.api.clone(), rooms.clone(), metrics.1.clone());
        state.on_refresh(move |_| {
            let s = &r.stats;
            mirror(&m.work, s.work_submitted.load(Ordering::Relaxed));
            mirror(&m.tokens, s.tokens_emitted.load(Ordering::Relaxed));
            mirror(
                &m.chunks_verified,
                s.chunks_verified.load(Ordering::Relaxed),
            );
            mirror(&m.corrupt_chunks, s.corrupt_chunks.load(Ordering::Relaxed));
            let Some(side) = api.decode_side() else {
                m.pages
                    .get_or_create(&vec![("state".into(), "free".into())])
                    .set(i64::from(api.pools().pages()));
                return;
            };
            let c = &side.counters;
            mirror(&m.rooms_reserved, c.reserved.load(Ordering::Relaxed));
            mirror(&m.rooms_completed, c.completed.load(Ordering::Relaxed));
            mirror(&m.rooms_failed, c.failed.load(Ordering::Relaxed));
            mirror(&m.acks, c.acks.load(Ordering::Relaxed));
            mirror(&m.quarantined, c.quarantined.load(Ordering::Relaxed));
            mirror(&m.spec_trips, c.spec_trips.load(Ordering::Relaxed));
            for (proof, v) in [
                ("concluded", &c.released_concluded),
                ("acks", &c.released_acks),
                ("transport", &c.released_transport),
                ("bypassed", &c.released_bypassed),
            ] {
                mirror(
                    &m.releases
                        .get_or_create(&vec![("proof".into(), proof.into())]),
                    v.load(Ordering::Relaxed),
                );
            }
            let p = side.pages();
            for (state, n) in [
                ("free", p.free),
                ("held", p.held),
                ("release_pending", p.release_pending),
                ("quarantined", p.quarantined),
            ] {
                m.pages
                    .get_or_create(&vec![("state".into(), state.into())])
                    .set(i64::from(n));
            }
        });
        tracing::info!(kind = ?engine.kind, "decode serves through the engine API");
        Ok(Self { seat, rooms })
    }

    /// Whether an engine is attached now.
    pub fn attached(&self) -> bool {
        self.seat.api.current_attach().is_some()
    }

    /// `/report`'s `engine`: the seat's common fields (`kind`, `attached`, `attach_id`, `attaches`,
    /// `pools`) plus `work`, `rooms_reserved`, `rooms_completed`, `rooms_failed`, `releases`
    /// `{concluded, acks, transport, bypassed}`, `acks`, `quarantined`, `spec_trips`, `tokens`,
    /// `chunks_verified`, `corrupt_chunks`, `cancelled_reports`, `prefill_refused` (hand-offs the
    /// prefill's engine refused), `sessions_synced`, `session_pages` and `session_pages_refused`
    /// (session KV the engine handed over with SyncSession for snapshot sync, and the pages refused
    /// while the sync budget was full), `requests_waiting`, `rooms_open`,
    /// `pages` `{free, held, release_pending, quarantined, total}`, `registration` (`commits`,
    /// `rollbacks`, `fallbacks`, `quarantined`), `engine_summary` (a simulated engine's own
    /// running summary beside the socket, else null) and `tiers` (the tier calls' figures, null
    /// without them).
    pub fn report(&self) -> Value {
        let s = &self.seat;
        report_of(
            s.kind,
            &s.api,
            &self.rooms,
            &s.registration,
            &s.socket_dir,
            s.tiers.as_deref(),
        )
    }

    /// Teardown (DESIGN contract 9), after the requests drained: the live attach ends (its rooms
    /// fail through the gate), the server stops, and the pools are deregistered and freed.
    pub async fn stop(self) -> Vec<String> {
        self.seat.stop().await
    }

    /// [`Seat::stop_engine`]: the attach ends, the requests waiting on its rooms end.
    pub async fn stop_engine(&mut self) {
        self.seat.stop_engine().await;
    }

    /// [`Seat::release`]: the pools deregistered and freed. Returns the errors, one line each.
    pub fn release(self) -> Vec<String> {
        self.seat.release()
    }
}

/// [`DecodeSeat::report`] of the seat's parts.
pub fn report_of(
    kind: crate::config::EngineKind,
    api: &Arc<crate::engine_api::service::EngineApi>,
    rooms: &EngineRooms,
    registration: &crate::registration::metrics::RegistrationMetrics,
    socket_dir: &std::path::Path,
    tiers: Option<&HostTiers>,
) -> Value {
    {
        let mut out = seat::report(Some((&kind, api)), tiers);
        let s = &rooms.stats;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let side = api.decode_side();
        let c = side.as_ref().map(|d| &d.counters);
        let cn = |f: fn(&crate::engine_api::decode::DecodeCounters) -> u64| c.map_or(0, f);
        let pages = side.as_ref().map(|d| d.pages()).unwrap_or_default();
        let total = api.pools().pages();
        let free = if side.is_some() { pages.free } else { total };
        let decode = json!({
            "work": ld(&s.work_submitted),
            "rooms_reserved": cn(|c| c.reserved.load(Ordering::Relaxed)),
            "rooms_completed": cn(|c| c.completed.load(Ordering::Relaxed)),
            "rooms_failed": cn(|c| c.failed.load(Ordering::Relaxed)),
            "releases": {
                "concluded": cn(|c| c.released_concluded.load(Ordering::Relaxed)),
                "acks": cn(|c| c.released_acks.load(Ordering::Relaxed)),
                "transport": cn(|c| c.released_transport.load(Ordering::Relaxed)),
                "bypassed": cn(|c| c.released_bypassed.load(Ordering::Relaxed)),
            },
            "acks": cn(|c| c.acks.load(Ordering::Relaxed)),
            "quarantined": cn(|c| c.quarantined.load(Ordering::Relaxed)),
            "spec_trips": cn(|c| c.spec_trips.load(Ordering::Relaxed)),
            "tokens": ld(&s.tokens_emitted),
            "chunks_verified": ld(&s.chunks_verified),
            "corrupt_chunks": ld(&s.corrupt_chunks),
            "cancelled_reports": ld(&s.cancelled_reports),
            "prefill_refused": ld(&s.prefill_refused),
            "sessions_synced": ld(&s.sessions_synced),
            "session_pages": ld(&s.session_pages),
            "session_pages_refused": ld(&s.session_pages_refused),
            "requests_waiting": rooms.pending(),
            "rooms_open": rooms.rooms(),
            "pages": {
                "free": free, "held": pages.held, "release_pending": pages.release_pending,
                "quarantined": pages.quarantined, "total": total,
            },
            "registration": seat::registration_report(registration),
            "engine_summary": seat::engine_summary(socket_dir),
        });
        if let (Some(o), Value::Object(d)) = (out.as_object_mut(), decode) {
            o.extend(d);
        }
        out
    }
}
