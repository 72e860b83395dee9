//! `tandem-bench pool`: page allocation and free rate of [`KvPool`], against a bare free-list stack
//! (no refcounts, no lock) measured in the same run (DESIGN §7).
//!
//! Rows: allocate+free of 1 page, of 32 pages, and a writer pin+unpin cycle, each as operations per
//! second and as a ratio to the baseline's rate.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tandem_worker::memory::Allocator;
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{KvPool, PoolLayout, PoolRole, PoolSpec};
use tandem_worker::model::{Attention, ModelIdentity};

/// Arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolArgs {
    /// Pages in the pool.
    #[arg(long, default_value_t = 4096)]
    pub pages: u32,
    /// Operations per row.
    #[arg(long, default_value_t = 2_000_000)]
    pub ops: u64,
}

/// One row.
#[derive(Debug, Clone)]
pub struct PoolRow {
    /// What was measured.
    pub what: String,
    /// Page operations (one page allocated and freed = 1) per second.
    pub pages_per_sec: f64,
    /// Ratio of the baseline's rate to this rate (how many times slower).
    pub slowdown: f64,
}

/// The report.
#[derive(Debug, Clone)]
pub struct PoolReport {
    /// Rows; the first is the baseline.
    pub rows: Vec<PoolRow>,
}

impl PoolReport {
    /// Printable lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec!["pool benchmark: page alloc+free rate".to_owned()];
        for r in &self.rows {
            out.push(format!(
                "{:<34} {:>14.0} pages/s {:>7.2}x slower than bare free list",
                r.what, r.pages_per_sec, r.slowdown
            ));
        }
        out
    }
}

/// Errors.
#[derive(Debug, thiserror::Error)]
pub enum PoolBenchError {
    /// A step failed.
    #[error("{0}")]
    Failed(String),
}

fn fail(e: impl std::fmt::Display) -> PoolBenchError {
    PoolBenchError::Failed(e.to_string())
}

fn rate(pages: u64, d: Duration) -> f64 {
    pages as f64 / d.as_secs_f64().max(1e-12)
}

/// Runs the benchmark.
///
/// # Errors
/// [`PoolBenchError::Failed`] when the pool cannot be built or an operation fails.
pub fn run(args: &PoolArgs) -> Result<PoolReport, PoolBenchError> {
    if args.pages < 32 {
        return Err(fail("--pages must be at least 32"));
    }
    let spec = PoolSpec {
        role: PoolRole::Target,
        model: ModelIdentity {
            name: "bench".into(),
            layers: 1,
            attention: Attention::Gqa {
                kv_heads: 1,
                head_dim: 8,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        },
        page_tokens: 16,
        pages: args.pages,
        layout: PoolLayout::PageFirst,
    };
    let allocator = Allocator::new("bench", MmapBackend::new());
    let pool = KvPool::new(spec, &allocator).map_err(fail)?;

    // Baseline: a bare Vec<u32> stack, the least a page allocator can do.
    let mut free: Vec<u32> = (0..args.pages).collect();
    let start = Instant::now();
    for _ in 0..args.ops {
        let p = free.pop().ok_or_else(|| fail("baseline empty"))?;
        free.push(black_box(p));
    }
    let baseline = rate(args.ops, start.elapsed());

    let start = Instant::now();
    for _ in 0..args.ops {
        let pages = pool.allocate(1).map_err(fail)?;
        pool.free(black_box(&pages)).map_err(fail)?;
    }
    let single = rate(args.ops, start.elapsed());

    let batches = args.ops / 32;
    let start = Instant::now();
    for _ in 0..batches {
        let pages = pool.allocate(32).map_err(fail)?;
        pool.free(black_box(&pages)).map_err(fail)?;
    }
    let batched = rate(batches * 32, start.elapsed());

    let page = pool.allocate(1).map_err(fail)?[0];
    let start = Instant::now();
    for _ in 0..args.ops {
        pool.pin_writer(page).map_err(fail)?;
        pool.unpin_writer(black_box(page)).map_err(fail)?;
    }
    let pins = rate(args.ops, start.elapsed());
    pool.free(&[page]).map_err(fail)?;
    if pool.stats().free != args.pages {
        return Err(fail("pages leaked during the benchmark"));
    }
    pool.destroy().map_err(fail)?;

    let row = |what: &str, r: f64| PoolRow {
        what: what.to_owned(),
        pages_per_sec: r,
        slowdown: baseline / r.max(1e-12),
    };
    Ok(PoolReport {
        rows: vec![
            row("baseline: bare free-list stack", baseline),
            row("KvPool allocate(1)+free", single),
            row("KvPool allocate(32)+free", batched),
            row("KvPool pin_writer+unpin_writer", pins),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_completes() {
        let r = run(&PoolArgs {
            pages: 64,
            ops: 1000,
        })
        .unwrap();
        assert_eq!(r.rows.len(), 4);
        assert!(r.rows.iter().all(|row| row.pages_per_sec > 0.0));
    }
}
