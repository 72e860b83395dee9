//! `tandem-bench restart-loadback`: a restarted prefill's loadback of its L3 pages into L2 over the
//! store's wire protocol (the worker's own `HostTiers::load_back`, the engine path), with several
//! read streams against one at a time, in the same run (issue 16 item 3; `roles::prefill::loadback`).
//!
//! Method:
//! 1. fill a store of `--pages` objects of one page each (`--layers` × `--page-tokens` × 1 KiB per
//!    token and layer; the default is the sample's 640 KiB page) for the prefill's shard, and serve
//!    it on loopback with the store's own `L3Server` and no memory tier, so that every read goes
//!    to disk and its checksum is verified, as for a cold store;
//! 2. before each measurement, evict the objects from the page cache (`POSIX_FADV_DONTNEED`, as in
//!    `tandem-bench loadback`);
//! 3. time `HostTiers::load_back` of every page into a fresh L2 with 1 stream (the baseline: one
//!    read at a time, as before the streams) and with `--streams`; the two alternate `--reps`
//!    times and the best of each is compared. Each run must load every page back.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_worker::config::WritePolicy;
use tandem_worker::control::KvLayout;
use tandem_worker::health::counters::Counters;
use tandem_worker::l3::manifest::{ObjectKey, ShardCoords, StoreIdentity};
use tandem_worker::l3::server::L3Server;
use tandem_worker::l3::store::{L3Config, L3Store};
use tandem_worker::memory::Allocator;
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{KvPool, PoolLayout, PoolRole, PoolSpec};
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::roles::prefill::prefix_cache::{L3Target, PrefixCache};
use tandem_worker::roles::prefill::tiers::HostTiers;
use tandem_worker::roles::resolve::Resolver;
use tandem_worker::tier::PageKey;

/// Parameters.
#[derive(Clone, Debug, clap::Args)]
pub struct RestartLoadbackArgs {
    /// Pages in the store, all loaded back.
    #[arg(long, default_value_t = 512)]
    pub pages: usize,
    /// Layers per page.
    #[arg(long, default_value_t = 40)]
    pub layers: u32,
    /// Tokens per page (1 KiB per token and layer).
    #[arg(long, default_value_t = 16)]
    pub page_tokens: u32,
    /// Read streams of the measured loadback, 1 to 32 (the worker's default is 4).
    #[arg(long, default_value_t = tandem_worker::roles::prefill::loadback::DEFAULT_STREAMS)]
    pub streams: usize,
    /// Repetitions of each measurement (the best is kept).
    #[arg(long, default_value_t = 2)]
    pub reps: u32,
    /// Data directory; created and removed at the end. Defaults to
    /// `/tmp/tandem-restart-loadback-<pid>` (on the disk, not on tmpfs).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The figures.
#[derive(Debug, Clone)]
pub struct RestartLoadbackReport {
    /// Pages loaded back per run.
    pub pages: usize,
    /// Bytes per page.
    pub page_bytes: u64,
    /// Streams of the measured side.
    pub streams: usize,
    /// Best time of the one-stream baseline, seconds.
    pub baseline_s: f64,
    /// Best time with `streams`, seconds.
    pub streams_s: f64,
}

impl RestartLoadbackReport {
    /// Pages per second of a run of `secs`.
    fn rate(&self, secs: f64) -> f64 {
        self.pages as f64 / secs.max(1e-9)
    }

    /// Speed-up of the streams over the baseline (time ratio).
    pub fn ratio(&self) -> f64 {
        self.baseline_s / self.streams_s.max(1e-9)
    }

    /// Report lines.
    pub fn lines(&self) -> Vec<String> {
        let mib = |secs: f64| self.rate(secs) * self.page_bytes as f64 / f64::from(1u32 << 20);
        vec![
            format!(
                "restart-loadback: {} pages of {} KiB from a cold store over loopback into a fresh L2",
                self.pages,
                self.page_bytes >> 10
            ),
            format!(
                "  1 stream (baseline):  {:7.3} s  {:8.1} pages/s  {:7.1} MiB/s",
                self.baseline_s,
                self.rate(self.baseline_s),
                mib(self.baseline_s)
            ),
            format!(
                "  {} streams:            {:7.3} s  {:8.1} pages/s  {:7.1} MiB/s",
                self.streams,
                self.streams_s,
                self.rate(self.streams_s),
                mib(self.streams_s)
            ),
            format!(
                "  ratio: {:.2}x the baseline's rate (restart-to-admitting time {:.2}x shorter)",
                self.ratio(),
                self.ratio()
            ),
        ]
    }
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum RestartLoadbackError {
    /// Setting up the store, server, pool or tiers failed.
    #[error("{0}")]
    Setup(String),
    /// A run did not load every page back.
    #[error("a loadback with {streams} stream(s) loaded {loaded} of {pages} pages")]
    Incomplete {
        /// Streams of that run.
        streams: usize,
        /// Pages loaded.
        loaded: u64,
        /// Pages expected.
        pages: usize,
    },
}

fn setup<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> RestartLoadbackError + '_ {
    move |e| RestartLoadbackError::Setup(format!("{what}: {e}"))
}

/// Runs the benchmark.
///
/// # Errors
/// [`RestartLoadbackError`].
pub fn run(args: &RestartLoadbackArgs) -> Result<RestartLoadbackReport, RestartLoadbackError> {
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("tandem-restart-loadback-{}", std::process::id()))
    });
    let result = run_in(args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in(
    args: &RestartLoadbackArgs,
    dir: &Path,
) -> Result<RestartLoadbackReport, RestartLoadbackError> {
    // 1 KiB per token and layer: K and V of 2 heads × 128 dims in 2-byte elements.
    let model = ModelIdentity {
        name: "restart-loadback-bench".into(),
        layers: args.layers.max(1),
        attention: Attention::Gqa {
            kv_heads: 2,
            head_dim: 128,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    };
    let layout = KvLayout {
        layers: model.layers,
        page_tokens: args.page_tokens.max(1),
        token_bytes: 1024,
    };
    let id = StoreIdentity {
        model: model.clone(),
        layout: PoolLayout::PageFirst,
        page_tokens: layout.page_tokens,
        tp_size: 1,
        cp_size: 1,
    };
    let shard = ShardCoords::whole(&id);
    let page_bytes = layout.page_bytes();
    let pages = args.pages.max(1);
    let config = L3Config::new(dir.to_owned(), id.clone(), 0, pages as u64 * page_bytes * 2);
    let (store, warm) = L3Store::open(config).map_err(setup("opening the store"))?;
    warm.join();
    let mut bytes = vec![0u8; page_bytes as usize];
    for i in 0..pages {
        bytes.iter_mut().for_each(|b| *b = i as u8);
        let key = ObjectKey {
            page: PageKey::from_trace_id(i as u64 + 1),
            pool: PoolRole::Target,
            shard,
        };
        store.put(key, &bytes).map_err(setup("filling the store"))?;
    }
    let mut server = L3Server::start(store, SocketAddr::from(([127, 0, 0, 1], 0)))
        .map_err(setup("starting the L3 server"))?;
    let port = server.local_addr().port();
    let target = L3Target {
        service: "127.0.0.1".into(),
        port,
        shard,
        write_policy: WritePolicy::WriteThrough,
    };
    let pool_spec = PoolSpec {
        role: PoolRole::Target,
        model,
        page_tokens: layout.page_tokens,
        pages: 1,
        layout: PoolLayout::PageFirst,
    };
    let pool = Arc::new(
        KvPool::new(pool_spec, &Allocator::new("bench", MmapBackend::new()))
            .map_err(setup("allocating the target pool"))?,
    );
    let once = |streams: usize| -> Result<f64, RestartLoadbackError> {
        crate::loadback::evict_page_cache(dir).map_err(setup("evicting the page cache"))?;
        let cache = Arc::new(PrefixCache::new(
            pages,
            Some(target.clone()),
            Resolver::System,
            Duration::ZERO,
            Counters::default(),
            Arc::new(|_| {}),
        ));
        let tiers = HostTiers::new(pool.clone(), layout, pages, cache, Counters::default())
            .map_err(setup("building the tiers"))?;
        let start = Instant::now();
        let loaded = tiers.load_back(pages, streams, start + Duration::from_secs(3600));
        let secs = start.elapsed().as_secs_f64();
        tiers.close();
        if loaded != pages as u64 {
            return Err(RestartLoadbackError::Incomplete {
                streams,
                loaded,
                pages,
            });
        }
        Ok(secs)
    };
    let (mut baseline_s, mut streams_s) = (f64::INFINITY, f64::INFINITY);
    let streams = args
        .streams
        .clamp(1, tandem_worker::roles::prefill::loadback::MAX_STREAMS);
    for _ in 0..args.reps.max(1) {
        baseline_s = baseline_s.min(once(1)?);
        streams_s = streams_s.min(once(streams)?);
    }
    server.stop();
    Ok(RestartLoadbackReport {
        pages,
        page_bytes,
        streams,
        baseline_s,
        streams_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_run_loads_every_page_with_either_setting() {
        let dir = tempfile::tempdir().unwrap();
        let r = run(&RestartLoadbackArgs {
            pages: 24,
            layers: 2,
            page_tokens: 4,
            streams: 3,
            reps: 1,
            dir: Some(dir.path().join("store")),
        })
        .unwrap();
        assert_eq!((r.pages, r.page_bytes, r.streams), (24, 8 << 10, 3));
        assert!(r.baseline_s > 0.0 && r.streams_s > 0.0, "{r:?}");
        assert_eq!(r.lines().len(), 4);
    }
}
