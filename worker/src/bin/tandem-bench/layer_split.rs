//! `tandem-bench layer-split`: LayerSplit's memory and traffic figures against the replicated layout
//! and a whole-buffer broadcast, all measured in the same run (DESIGN §7 "per-rank KV bytes =
//! 1/context of replicated; outputs bit-identical"; contract 6).
//!
//! For each CP size the same requests run three times through an in-process CP group: replicated
//! (baseline), LayerSplit broadcasting the pages in use, and LayerSplit broadcasting the whole layer
//! buffer (the naive variant). Printed: each rank's KV bytes as a ratio of a replicated rank's, the
//! bound ⌈L/C⌉/L, broadcast payload bytes vs the whole-buffer baseline, and `identical=` — whether
//! every rank's attention output for every request equals the replicated layout's bit for bit.
//! The split run is repeated over loopback TCP (`TcpRankLink`, the link between a group's pods):
//! its wall time beside the in-process one and `identical_over_tcp=`.
//!
//! Then the **model** section (`layer_split::cost_model`; no measurement, and labelled so): the
//! token-capacity gain `L / (⌈L/C⌉ + 1)` at CP 4 and 8 for each geometry of `--models` (tokens in
//! the KV memory of PR #29930's log), and the throughput gain at 40K–120K tokens with a 90 % prefix
//! hit for GLM-5 at CP 8 and 4, next to the published figures (seed 004: +10 % to +132 %; SGLang PR
//! #29930: ~7.1× tokens at CP 8), with the assumed inputs named.

use std::time::{Duration, Instant};

use tandem_worker::layer_split::cost_model::{self, CostParams, GainRow};
use tandem_worker::layer_split::group::run_group_over_tcp;
use tandem_worker::layer_split::tcp_link::TcpLinkConfig;
use tandem_worker::layer_split::{
    BroadcastScope, GroupSpec, KvLayout, LayerSplitError, OwnerMap, RankReport, RequestSpec,
    WaitPolicy, run_group,
};
use tandem_worker::model::{Attention, ModelCatalog, ModelIdentity};

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The CP group refused the arguments or failed.
    #[error(transparent)]
    Group(#[from] LayerSplitError),
    /// `--models` could not be read or is not a valid `models.json`.
    #[error("--models {}: {reason}", path.display())]
    Models {
        /// The file named.
        path: std::path::PathBuf,
        /// What failed.
        reason: String,
    },
}

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
    /// A `models.json` whose geometries get the model's capacity table. Unset: the shared
    /// catalogue beside this checkout ([`SHARED_MODELS`]) when it exists, else GLM-5 only.
    #[arg(long)]
    pub models: Option<std::path::PathBuf>,
}

/// The shared model catalogue of this checkout (`../shared/data/models.json` beside the
/// repository), read when `--models` is not given.
pub const SHARED_MODELS: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/models.json");

/// KV bytes per rank of the model section: 457,920 tokens × 61,464 B (PR #29930's log, "KV size:
/// 26.22 GB"); assumed for the other geometries.
pub const MODEL_KV_BYTES_PER_RANK: f64 = 457_920.0 * 61_464.0;

/// Context lengths of the model's gain curve (seed 004's 40K–120K).
pub const MODEL_CONTEXTS: [f64; 5] = [40e3, 60e3, 80e3, 100e3, 120e3];

/// One geometry's token capacity under the model.
#[derive(Debug, Clone)]
pub struct CapacityRow {
    /// Model name.
    pub model: String,
    /// Layers.
    pub layers: u32,
    /// KV bytes per token (all layers).
    pub bytes_per_token: u64,
    /// Tokens a replicated rank holds in [`MODEL_KV_BYTES_PER_RANK`].
    pub base_tokens: f64,
    /// (CP size, capacity ratio `L / (⌈L/C⌉ + 1)`).
    pub ratios: Vec<(u32, f64)>,
}

/// The model section: capacity per geometry and the GLM-5 gain curves.
#[derive(Debug, Clone)]
pub struct ModelSection {
    /// One row per geometry of `--models`, GLM-5 first.
    pub capacity: Vec<CapacityRow>,
    /// (CP size, the gain curve at [`MODEL_CONTEXTS`]) for GLM-5 at the reference's fit.
    pub curves: Vec<(u32, Vec<GainRow>)>,
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
    /// Wall time of the replicated, pages-in-use, whole-buffer and pages-in-use-over-TCP runs.
    pub wall: [Duration; 4],
    /// The split run over loopback TCP (`TcpRankLink`): every output equal to the replicated
    /// layout's, and its payload bytes equal to the in-process run's.
    pub tcp_identical: bool,
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
    /// The cost model's figures.
    pub model: ModelSection,
}

impl ModelSection {
    /// Computes the section; `catalog` adds its geometries to GLM-5's.
    pub fn compute(catalog: Option<&ModelCatalog>) -> Self {
        const CPS: [u32; 2] = [4, 8];
        let row = |model: &str, layers: u32, bytes_per_token: u64| CapacityRow {
            model: model.to_owned(),
            layers,
            bytes_per_token,
            base_tokens: MODEL_KV_BYTES_PER_RANK / bytes_per_token as f64,
            ratios: CPS
                .iter()
                .map(|&cp| (cp, cost_model::capacity_ratio(layers, cp, 1)))
                .collect(),
        };
        // GLM-5: 78 layers × (656 + 132) B (FP8 MLA record and indexer key).
        let mut capacity = vec![row("glm-5 (DSA, FP8)", 78, 78 * (656 + 132))];
        for m in catalog.map(|c| c.models.as_slice()).unwrap_or_default() {
            capacity.push(row(&m.name, m.layers, m.bytes_per_token()));
        }
        let curves = [8, 4]
            .into_iter()
            .map(|cp| {
                let p = CostParams {
                    cp,
                    ..CostParams::glm5_cp8()
                };
                (cp, cost_model::gain_curve(&p, &MODEL_CONTEXTS))
            })
            .collect();
        Self { capacity, curves }
    }

    /// Printable lines, each figure labelled as the model's.
    pub fn lines(&self) -> Vec<String> {
        let p = CostParams::glm5_cp8();
        let mut out = vec![
            "layer-split model (cost model, not a measurement; reference/layersplit-snapshot.md §3)"
                .to_owned(),
            format!(
                "  capacity: tokens per rank in {:.2} GiB of KV (PR #29930's log; assumed for the other models), one transient layer slot",
                MODEL_KV_BYTES_PER_RANK / f64::from(1u32 << 30)
            ),
        ];
        for r in &self.capacity {
            let ratios: Vec<String> = r
                .ratios
                .iter()
                .map(|(cp, x)| format!("cp{cp}={x:.2}x ({:.0} tokens)", r.base_tokens * x))
                .collect();
            out.push(format!(
                "    {}: {} layers, {} B/token, replicated {:.0} tokens, model_capacity {}",
                r.model,
                r.layers,
                r.bytes_per_token,
                r.base_tokens,
                ratios.join(" ")
            ));
        }
        out.push("    published: SGLang PR #29930 measured ~7.1x tokens per prefill instance at CP 8 (GLM-5.2, 78 layers)".to_owned());
        out.push(format!(
            "  throughput: GLM-5, h={} prefix hit, S={} sessions, lognormal gaps sigma={}, a={:.0} us/token, b={:.1e} s/pair, broadcast {:.0} GB/s, chunk {:.0} tokens",
            p.prefix_share,
            p.sessions,
            p.gap_sigma,
            p.per_token_s * 1e6,
            p.indexer_pair_s,
            p.broadcast_bytes_per_s / 1e9,
            p.chunk_tokens
        ));
        out.push("    assumed (unpublished; fitted to seed 004's endpoints): S, sigma, a, b, broadcast bandwidth, chunk; public: layers, row bytes, KV memory, h".to_owned());
        for (cp, rows) in &self.curves {
            out.push(format!("    cp={cp}"));
            for r in rows {
                out.push(format!(
                    "      T={:.0}K hit_replicated={:.2} hit_split={:.2} t_replicated={:.2}s t_split={:.2}s exposed_broadcast={:.1}ms model_gain={:+.0}%",
                    r.tokens / 1e3,
                    r.hit_base,
                    r.hit_split,
                    r.base.total_s(),
                    r.split.total_s(),
                    r.split.exposed_comm_s * 1e3,
                    r.gain * 100.0
                ));
            }
        }
        out.push("    published: seed 004 reports +10% to +132% system throughput at 90% cache hit, 40K to 120K tokens, growing with length".to_owned());
        out
    }
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
                "  wall_ms replicated={:.1} split={:.1} split_whole_buffer={:.1} split_over_tcp={:.1} (tcp/in-process={:.2})",
                r.wall[0].as_secs_f64() * 1e3,
                r.wall[1].as_secs_f64() * 1e3,
                r.wall[2].as_secs_f64() * 1e3,
                r.wall[3].as_secs_f64() * 1e3,
                r.wall[3].as_secs_f64() / r.wall[1].as_secs_f64().max(1e-9)
            ));
            out.push(format!("  identical={}", r.identical));
            out.push(format!("  identical_over_tcp={}", r.tcp_identical));
        }
        out.extend(self.model.lines());
        out
    }
}

/// Runs the benchmark.
///
/// # Errors
/// [`BenchError::Group`]: invalid arguments (CP size 0 or above the layer count, a request larger
/// than the pool) and any group error; [`BenchError::Models`]: an unreadable or invalid
/// `--models` file.
pub fn run(args: &LayerSplitArgs) -> Result<LayerSplitReport, BenchError> {
    let shared = std::path::PathBuf::from(SHARED_MODELS);
    let models = args
        .models
        .clone()
        .or_else(|| shared.is_file().then_some(shared));
    let catalog = match &models {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| e.to_string())
                .and_then(|text| ModelCatalog::from_json(&text).map_err(|e| e.to_string()))
                .map_err(|reason| BenchError::Models {
                    path: path.clone(),
                    reason,
                })?,
        ),
        None => None,
    };
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
            KvLayout::Split(map.clone()),
            BroadcastScope::UnsafeWholeBuffer,
        ))?;
        let t = Instant::now();
        let maps = vec![Some(map.clone()); cp as usize];
        let tcp = run_group_over_tcp(
            &spec(KvLayout::Split(map.clone()), BroadcastScope::PagesInUse),
            &requests,
            &maps,
            TcpLinkConfig::default(),
        )
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        let t_tcp = t.elapsed();
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
            wall: [t_rep, t_ls, t_whole, t_tcp],
            tcp_identical: outputs(&tcp) == outputs(&rep)
                && tcp.iter().map(|r| r.broadcast_payload_bytes).sum::<u64>()
                    == ls.iter().map(|r| r.broadcast_payload_bytes).sum::<u64>(),
        });
    }
    Ok(LayerSplitReport {
        layers: args.layers,
        pages_in_use,
        pool_pages: args.pool_pages,
        requests: args.requests,
        indexer_work: args.indexer_work,
        rows,
        model: ModelSection::compute(catalog.as_ref()),
    })
}
