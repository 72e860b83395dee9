//! `tandem-bench layer-split`: LayerSplit's memory and traffic figures against the replicated layout
//! and a whole-buffer broadcast, all measured in the same run (DESIGN §7 "per-rank KV bytes =
//! 1/context of replicated; outputs bit-identical"; contract 6).
//!
//! For each CP size the same requests run three times through an in-process CP group: replicated
//! (baseline), LayerSplit broadcasting the pages in use, and LayerSplit broadcasting the whole layer
//! buffer (the naive variant). Printed: each rank's KV bytes as a ratio of a replicated rank's, the
//! bound ⌈L/C⌉/L, broadcast payload bytes vs the whole-buffer baseline, and `identical=` — whether
//! every rank's attention output for every request equals the replicated layout's bit for bit.

use std::time::{Duration, Instant};

use tandem_worker::layer_split::{
    BroadcastScope, GroupSpec, KvLayout, LayerSplitError, OwnerMap, RankReport, RequestSpec,
    WaitPolicy, run_group,
};
use tandem_worker::model::{Attention, ModelIdentity};

/// Arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct LayerSplitArgs {
    /// Layers of the model (61 = DeepSeek-V3's, not divisible by 2 or 4).
    #[arg(long, default_value_t = 61)]
    pub layers: u32,
    /// CP sizes to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pub cp: Vec<u32>,
    /// Pages per rank pool.
    #[arg(long, default_value_t = 128)]
    pub pool_pages: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_tokens: u32,
    /// Requests (their page counts cycle through 1..=max_pages deterministically).
    #[arg(long, default_value_t = 16)]
    pub requests: u32,
    /// Largest page count of a request.
    #[arg(long, default_value_t = 24)]
    pub max_pages: u32,
    /// Indexer work rounds per layer.
    #[arg(long, default_value_t = 64)]
    pub indexer_work: u32,
}

/// Figures for one CP size.
#[derive(Debug, Clone)]
pub struct CpRow {
    /// CP size.
    pub cp: u32,
    /// Per rank: (stored layers, KV bytes / replicated rank's KV bytes).
    pub ranks: Vec<(u32, f64)>,
    /// ⌈L/C⌉ / L.
    pub bound: f64,
    /// Sum of the ranks' KV bytes / one replicated rank's.
    pub group_sum_ratio: f64,
    /// Payload bytes broadcast, pages in use.
    pub broadcast_bytes: u64,
    /// Payload bytes broadcast, whole layer buffer.
    pub whole_buffer_bytes: u64,
    /// Waits whose broadcast had landed before the wait (hidden behind the indexer), and all waits.
    pub waits_hidden: (u64, u64),
    /// Every output equal to the replicated layout's.
    pub identical: bool,
    /// Wall time of the replicated, pages-in-use and whole-buffer runs.
    pub wall: [Duration; 3],
}

/// The report.
#[derive(Debug, Clone)]
pub struct LayerSplitReport {
    /// Layers.
    pub layers: u32,
    /// Pages in use summed over requests, and the pool size.
    pub pages_in_use: u64,
    /// Pool pages.
    pub pool_pages: u32,
    /// Requests.
    pub requests: u32,
    /// Indexer work rounds per layer.
    pub indexer_work: u32,
    /// One row per CP size.
    pub rows: Vec<CpRow>,
}

impl LayerSplitReport {
    /// Printable lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "layer-split benchmark: {} layers, pool {} pages/rank, {} requests using {} pages in all",
            self.layers, self.pool_pages, self.requests, self.pages_in_use
        )];
        for r in &self.rows {
            out.push(format!("cp={}", r.cp));
            for (rank, (layers, ratio)) in r.ranks.iter().enumerate() {
                out.push(format!(
                    "  rank {rank}: {layers} layers, kv_bytes_ratio_vs_replicated={ratio:.4} (1/cp={:.4})",
                    1.0 / f64::from(r.cp)
                ));
            }
            let max = r.ranks.iter().map(|x| x.1).fold(0.0, f64::max);
            out.push(format!(
                "  max_rank_kv_ratio={max:.4} bound_ceil(L/C)/L={:.4} group_sum_ratio={:.4}",
                r.bound, r.group_sum_ratio
            ));
            out.push(format!(
                "  broadcast_bytes={} whole_buffer_baseline_bytes={} ratio={:.4} ({:.2}x fewer)",
                r.broadcast_bytes,
                r.whole_buffer_bytes,
                r.broadcast_bytes as f64 / r.whole_buffer_bytes.max(1) as f64,
                r.whole_buffer_bytes as f64 / r.broadcast_bytes.max(1) as f64
            ));
            out.push(format!(
                "  broadcast_hidden_behind_indexer={} of {} layer waits (indexer work {} rounds)",
                r.waits_hidden.0, r.waits_hidden.1, self.indexer_work
            ));
            out.push(format!(
                "  wall_ms replicated={:.1} split={:.1} split_whole_buffer={:.1}",
                r.wall[0].as_secs_f64() * 1e3,
                r.wall[1].as_secs_f64() * 1e3,
                r.wall[2].as_secs_f64() * 1e3
            ));
            out.push(format!("  identical={}", r.identical));
        }
        out
    }
}

/// Runs the benchmark.
///
/// # Errors
/// Invalid arguments (CP size 0 or above the layer count, a request larger than the pool) and any
/// group error.
pub fn run(args: &LayerSplitArgs) -> Result<LayerSplitReport, LayerSplitError> {
    let requests: Vec<RequestSpec> = (0..args.requests)
        .map(|i| RequestSpec {
            id: 0x5eed_0000 + u64::from(i),
            pages: 1 + (i * 37 + 11) % args.max_pages.max(1),
        })
        .collect();
    let pages_in_use = requests.iter().map(|r| u64::from(r.pages)).sum();
    let model = ModelIdentity {
        name: "layer-split-bench".into(),
        layers: args.layers,
        attention: Attention::Mla {
            kv_lora_rank: 512,
            rope_dim: 64,
        },
        dtype_bytes: 1,
        row_extra_bytes: 0,
    };
    let mut rows = Vec::new();
    for &cp in &args.cp {
        let map = OwnerMap::contiguous(args.layers, cp)?;
        let spec = |layout, scope| GroupSpec {
            model: model.clone(),
            cp_size: cp,
            page_tokens: args.page_tokens,
            pool_pages: args.pool_pages,
            layout,
            scope,
            wait: WaitPolicy::Wait,
            indexer_work: args.indexer_work,
            wait_timeout: Duration::from_secs(60),
        };
        let timed = |s: GroupSpec| -> Result<(Vec<RankReport>, Duration), LayerSplitError> {
            let t = Instant::now();
            let r = run_group(&s, &requests)?;
            Ok((r, t.elapsed()))
        };
        let (rep, t_rep) = timed(spec(KvLayout::Replicated, BroadcastScope::PagesInUse))?;
        let (ls, t_ls) = timed(spec(
            KvLayout::Split(map.clone()),
            BroadcastScope::PagesInUse,
        ))?;
        let (whole, t_whole) = timed(spec(
            KvLayout::Split(map),
            BroadcastScope::UnsafeWholeBuffer,
        ))?;
        let full = rep.first().map_or(1, |r| r.stored_kv_bytes).max(1) as f64;
        let outputs = |v: &[RankReport]| v.iter().map(|r| r.outputs.clone()).collect::<Vec<_>>();
        rows.push(CpRow {
            cp,
            ranks: ls
                .iter()
                .map(|r| (r.stored_layers, r.stored_kv_bytes as f64 / full))
                .collect(),
            bound: f64::from(args.layers.div_ceil(cp)) / f64::from(args.layers),
            group_sum_ratio: ls.iter().map(|r| r.stored_kv_bytes as f64).sum::<f64>() / full,
            broadcast_bytes: ls.iter().map(|r| r.broadcast_payload_bytes).sum(),
            whole_buffer_bytes: whole.iter().map(|r| r.broadcast_payload_bytes).sum(),
            waits_hidden: (
                ls.iter().map(|r| r.waits_hidden).sum(),
                ls.iter().map(|r| r.waits).sum(),
            ),
            identical: outputs(&ls) == outputs(&rep) && outputs(&whole) == outputs(&rep),
            wall: [t_rep, t_ls, t_whole],
        });
    }
    Ok(LayerSplitReport {
        layers: args.layers,
        pages_in_use,
        pool_pages: args.pool_pages,
        requests: args.requests,
        indexer_work: args.indexer_work,
        rows,
    })
}
