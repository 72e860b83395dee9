//! The `cache` role: one CacheTier store replica (DESIGN §2 `CacheTier`, contract 7). It opens the L3
//! store on its data directory (a PVC in the cluster), serves the framed TCP protocol of
//! [`crate::l3::wire`] at once, and loads back what is on disk in the background, logging
//! progress and reporting `Warming` → `CacheWarm` in its health. SIGTERM or SIGINT stops serving,
//! stops loadback, joins every thread and exits 0 (DESIGN contract 9); every put is already durable,
//! so there is nothing to flush.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::l3::server::L3Server;
use crate::l3::store::{L3Config, L3Store};

use crate::config::{CacheTierConfig, LoadConfig, resolve_path};
use crate::health::counters::mirror;
use crate::health::http::{ServeState, router, spawn_http};

use tandem_interfaces::report::{DEGRADED_COMPONENT_L3_VOLUME, DEGRADED_VOLUME_FULL};

use super::RoleError;

/// `tandem-worker cache` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The tier config (`/etc/tandem/tier.json` in a pod; read through `$TANDEM_ROOT`, as are
    /// its paths). Identity, budgets, data dir and ports come from it, and the health port
    /// (`/healthz`, `/readyz`, `/metrics`, `/report` with `warm`) is served; the bind address is
    /// `$POD_IP`. A port of 0 picks a free one; the L3 address is printed on stdout as
    /// `listening on ADDR`.
    #[arg(long, env = "TANDEM_CACHE_CONFIG")]
    pub config: PathBuf,
    /// Seconds between loadback progress lines.
    #[arg(long, default_value_t = 5)]
    pub progress_interval_s: u64,
    /// Test-only: skip fsync on put (atomic but not durable against power loss). Only in builds
    /// with the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    #[arg(long, hide = true)]
    pub unsafe_no_fsync: bool,
}

fn failed(what: &str) -> impl FnOnce(String) -> RoleError + '_ {
    move |e| RoleError::Failed(format!("{what}: {e}"))
}

/// Runs the replica until SIGTERM/SIGINT.
///
/// # Errors
/// [`RoleError::Failed`] when the identity file is unreadable or invalid, the data directory cannot
/// be opened, the address cannot be bound, or signal handlers cannot be installed. Bad objects on
/// disk are never errors (they are counted misses).
pub fn run(args: Args) -> Result<(), RoleError> {
    let cfg = CacheTierConfig::load(&resolve_path(&args.config))
        .map_err(|e| e.to_string())
        .map_err(failed("tier config"))?;
    let (memory, disk) = cfg.effective_budgets();
    let ip = crate::roles::pod_ip();
    let identity = cfg.identity();
    let data_dir = resolve_path(&cfg.data_dir);
    let listen = SocketAddr::new(ip, cfg.ports.l3);
    let health = (SocketAddr::new(ip, cfg.ports.health), cfg.tier.clone());
    identity
        .model
        .validate()
        .map_err(|e| e.to_string())
        .map_err(failed("store identity"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .map_err(failed("tokio runtime"))?;
    // Handlers first, so a SIGTERM right after start is not lost.
    let signals = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    });
    let (mut term, mut int) = signals
        .map_err(|e| e.to_string())
        .map_err(failed("signal handlers"))?;

    #[cfg(feature = "negative-controls")]
    let fsync = !args.unsafe_no_fsync;
    #[cfg(not(feature = "negative-controls"))]
    let fsync = true;
    let config = L3Config {
        progress_interval: Duration::from_secs(args.progress_interval_s.max(1)),
        fsync,
        ..L3Config::new(data_dir, identity, memory, disk)
    };
    let (store, loadback) = L3Store::open(config)
        .map_err(|e| e.to_string())
        .map_err(failed("opening the L3 store"))?;
    let server = L3Server::start(std::sync::Arc::clone(&store), listen)
        .map_err(|e| e.to_string())
        .map_err(failed("binding the L3 service"))?;
    tracing::info!(addr = %server.local_addr(), "cache replica serving; loadback running");
    println!("listening on {}", server.local_addr());

    let (addr, tier) = health;
    let http = runtime.block_on(serve_health(addr, &tier, &store))?;
    runtime.block_on(async {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping cache replica"),
            _ = int.recv() => tracing::info!("SIGINT: stopping cache replica"),
        }
    });
    let (state, task) = http;
    let report = teardown(&state, server, &store, loadback).run();
    task.abort();
    tracing::info!(health = ?store.health(), "cache replica stopped");
    super::print_teardown(&report);
    Ok(())
}

/// The replica's stop as the ordered teardown of DESIGN contract 9 (the plan the prefill and
/// decode run): readiness 503 so the Service stops listing it (StopAdmission); loadback stops
/// after the object it is verifying and its thread is joined (JoinThreads); the L3 service stops
/// accepting and cuts its connections — a put cut mid-way leaves only `tmp/`, which the next
/// start empties (DestroyTransports); the store's manifests directory is synced so every
/// acknowledged put survives the stop (FreeMemory). Nothing on disk is removed: the next start
/// loads it back. Printed as the `teardown {…}` line ([`super::print_teardown`]).
fn teardown(
    state: &std::sync::Arc<ServeState>,
    mut server: L3Server,
    store: &std::sync::Arc<L3Store>,
    loadback: crate::l3::store::Loadback,
) -> std::sync::Arc<crate::teardown::Teardown> {
    use crate::teardown::{Teardown, TeardownPhase as Phase};
    let plan = Teardown::new();
    let st = state.clone();
    plan.register(Phase::StopAdmission, "readiness 503", move || {
        st.begin_drain();
        Ok(())
    });
    let s = std::sync::Arc::clone(store);
    plan.register(
        Phase::JoinThreads,
        "loadback stops after its current object",
        move || {
            s.stop_loadback();
            loadback.join_checked()
        },
    );
    plan.register(
        Phase::DestroyTransports,
        "the L3 service stops; connections close",
        move || server.stop_checked(),
    );
    let s = std::sync::Arc::clone(store);
    plan.register(
        Phase::FreeMemory,
        "acknowledged puts are durable (data directory synced)",
        move || s.sync().map_err(|e| e.to_string()),
    );
    plan
}

/// The replica's health port: ready at once (warming is not unready; worker/interfaces/README.md
/// §2), `/report` with `warm`, `objects` and `bytes`, and the store counters mirrored into the §4
/// names.
async fn serve_health(
    addr: SocketAddr,
    tier: &str,
    store: &std::sync::Arc<L3Store>,
) -> Result<(std::sync::Arc<ServeState>, tokio::task::JoinHandle<()>), RoleError> {
    let state = ServeState::new("cache", tier, "", "opening the store");
    let s = std::sync::Arc::clone(store);
    state.set_extra(move || {
        let h = s.health();
        let mut m = serde_json::Map::new();
        m.insert("warm".into(), serde_json::json!(s.is_warm()));
        m.insert("objects".into(), serde_json::json!(h.objects));
        m.insert("bytes".into(), serde_json::json!(h.disk_bytes));
        m.insert("loadback".into(), serde_json::json!(h.loadback));
        // Issue 18 item 5: puts refused on a full volume (reads keep serving).
        m.insert(
            "puts_refused_disk_full".into(),
            serde_json::json!(h.counters.puts_refused_disk_full),
        );
        m
    });
    let s = std::sync::Arc::clone(store);
    state.on_refresh(move |st| {
        let h = s.health();
        mirror(&st.counters.l3_pages_loaded_back, h.loadback.published);
        mirror(&st.counters.l3_pages_written, h.counters.puts);
        mirror(&st.counters.corrupt_pages_read, h.counters.corrupt_on_read);
        // Issue 18 item 5: a full volume is a degradation while it lasts (a stored put clears
        // it), so the operator can say so in the CacheTier's status.
        match &h.volume_full {
            Some(why) => st.health.degrade(
                DEGRADED_COMPONENT_L3_VOLUME,
                DEGRADED_VOLUME_FULL,
                format!(
                    "{} put(s) refused, volume full ({why}); reads keep serving",
                    h.counters.puts_refused_disk_full
                ),
            ),
            None => st.health.recover(DEGRADED_COMPONENT_L3_VOLUME),
        }
    });
    state.set_ready(Ok(()));
    let (local, task) = spawn_http(addr, router(state.clone()))
        .await
        .map_err(|e| e.to_string())
        .map_err(failed("binding the health port"))?;
    tracing::info!(%local, "cache replica health serving");
    Ok((state, task))
}
