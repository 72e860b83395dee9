//! `tandem-worker prefill --config`: the prefill serving process (INTERFACES §2).
//!
//! Serves the gRPC `Transfer` service on `$POD_IP:ports.control` with this pool's revision (a decode
//! of another revision is refused in the hello), runs the simulated engine per room with the
//! prefix cache when the config names a tier, and the health port. Drain (SIGTERM): readiness 503 at
//! once, new rooms refused with `UNAVAILABLE` (decode retries elsewhere), running rooms finish or
//! are aborted through the release protocol until the grace deadline, then the transport drains
//! and closes (DESIGN contract 9).
//!
//! The data port (`ports.data`) is where a decode worker's KV receiver listens; the prefill side
//! only dials it, so a prefill binds no data port.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::counters::mirror;
use super::health::{ServeState, router, spawn_http};
use super::prefix_cache::{L3_PORT, L3Target, PrefixCache};
use super::resolve::Resolver;
use super::sim::SimKnobs;
use super::{ServeError, ordinal_from_env, pod_ip};
use crate::cache::manifest::ShardCoords;
use crate::config::WorkerConfig;
use crate::control::prefill::{PrefillConfig, PrefillNode, PrefillService};
use crate::transfer::Transport;
use crate::transfer::tcp::{TcpConfig, TcpTransport};

/// Process-level options (the config decides the rest).
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// Address to bind (default `$POD_IP`, else 0.0.0.0).
    pub bind_ip: IpAddr,
    /// Worker id (default `$POD_NAME`).
    pub worker_id: String,
    /// Grace for in-flight rooms at drain.
    pub drain_grace: Duration,
}

impl PrefillOptions {
    /// Options from the pod environment.
    pub fn from_env() -> Self {
        Self {
            bind_ip: pod_ip(),
            worker_id: std::env::var("POD_NAME").unwrap_or_else(|_| "prefill-0".into()),
            drain_grace: Duration::from_secs(25),
        }
    }
}

/// A running prefill server.
pub struct PrefillServer {
    /// Serving state (phase, counters).
    pub state: Arc<ServeState>,
    /// gRPC control address.
    pub control_addr: SocketAddr,
    /// Health address.
    pub health_addr: SocketAddr,
    node: Arc<PrefillNode>,
    service: PrefillService,
    transport: Arc<TcpTransport>,
    grpc: tokio::task::JoinHandle<()>,
    http: tokio::task::JoinHandle<()>,
    grace: Duration,
}

impl PrefillServer {
    /// Starts serving; ready as soon as the control port listens.
    ///
    /// # Errors
    /// [`ServeError`] when a port cannot be bound.
    pub async fn start(
        cfg: &WorkerConfig,
        knobs: SimKnobs,
        opts: PrefillOptions,
    ) -> Result<Self, ServeError> {
        let state = ServeState::new("prefill", &cfg.pool, &cfg.revision, "starting");
        let layout = knobs.layout(cfg);
        let transport = Arc::new(TcpTransport::new(TcpConfig::default()));
        let rank = ordinal_from_env();
        let node = PrefillNode::new(
            PrefillConfig {
                worker_id: opts.worker_id.clone(),
                rank,
                layout,
                compute_per_page: knobs.prefill_per_token * layout.page_tokens,
            },
            transport.clone(),
        );
        let mut service = PrefillService::new(node.clone());
        service.revision = cfg.revision.clone();
        let page_bytes = layout.page_bytes().max(1);
        let l2_pages =
            usize::try_from(cfg.memory.target_pool_bytes / page_bytes).unwrap_or(usize::MAX);
        let l3 = cfg.cache.as_ref().map(|c| {
            let (tp, cp) = cfg.parallelism.ranks_of(rank).unwrap_or((0, 0));
            let (start, end) = cfg
                .layer_split
                .as_ref()
                .map(|ls| {
                    let owned: Vec<u32> = ls.owned_by(cp).collect();
                    (
                        owned.first().copied().unwrap_or(0),
                        owned.last().map_or(cfg.model.layers, |l| l + 1),
                    )
                })
                .unwrap_or((0, cfg.model.layers));
            L3Target {
                service: c.service.clone(),
                port: L3_PORT,
                shard: ShardCoords {
                    tp_rank: tp,
                    cp_rank: cp,
                    layer_start: start,
                    layer_end: end,
                },
                write_policy: c.write_policy,
            }
        });
        let st = state.clone();
        let sink: Arc<dyn Fn(Option<String>) + Send + Sync> = Arc::new(move |r| match r {
            Some(r) => st.health.degrade("l3", "L3Unreachable", r),
            None => st.health.recover("l3"),
        });
        service.planner = Some(Arc::new(PrefixCache::new(
            l2_pages,
            l3,
            Resolver::from_env(),
            knobs.prefill_per_token,
            state.counters.clone(),
            sink,
        )));
        let n = node.clone();
        state.on_refresh(move |s| {
            let st = n.stats();
            let c = &s.counters;
            mirror(&c.kv_bytes_sent, st.kv_bytes_sent.load(Ordering::Relaxed));
            mirror(&c.rooms_aborted, st.aborts_received.load(Ordering::Relaxed));
            mirror(&c.abort_acks, st.acks_sent.load(Ordering::Relaxed));
            mirror(&c.requests_ok, st.rooms_completed.load(Ordering::Relaxed));
        });

        let listener =
            tokio::net::TcpListener::bind(SocketAddr::new(opts.bind_ip, cfg.ports.control))
                .await
                .map_err(|e| ServeError::Bind("control", e))?;
        let control_addr = listener
            .local_addr()
            .map_err(|e| ServeError::Bind("control", e))?;
        let (health_addr, http) = spawn_http(
            SocketAddr::new(opts.bind_ip, cfg.ports.health),
            router(state.clone()),
        )
        .await
        .map_err(|e| ServeError::Bind("health", e))?;
        let svc = service.clone();
        let grpc = tokio::spawn(async move {
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(svc.into_server())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
            {
                tracing::error!(error = %e, "gRPC server stopped");
            }
        });
        state.set_ready(Ok(()));
        tracing::info!(%control_addr, %health_addr, revision = %cfg.revision, ?layout, "prefill serving");
        Ok(Self {
            state,
            control_addr,
            health_addr,
            node,
            service,
            transport,
            grpc,
            http,
            grace: opts.drain_grace,
        })
    }

    /// Drains and stops: readiness 503, no new rooms, running rooms finish (until the grace
    /// deadline), the transport drains and closes, the servers stop. Returns whether every room
    /// finished in time.
    pub async fn shutdown(self) -> bool {
        self.state.begin_drain();
        self.service.admitting.store(false, Ordering::SeqCst);
        tracing::info!(rooms = self.node.rooms_held(), "draining prefill");
        let deadline = Instant::now() + self.grace;
        while self.node.rooms_held() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rooms_left = self.node.rooms_held();
        let t = self.transport.clone();
        let report = tokio::task::spawn_blocking(move || {
            t.drain(deadline.max(Instant::now() + Duration::from_secs(1)))
        })
        .await
        .ok();
        let quiescent = report.as_ref().is_none_or(|r| r.quiescent());
        if !quiescent {
            tracing::error!("writes still in flight at the drain deadline");
        }
        self.transport.shutdown();
        self.grpc.abort();
        self.http.abort();
        tracing::info!(rooms_left, "prefill stopped");
        rooms_left == 0 && quiescent
    }
}
