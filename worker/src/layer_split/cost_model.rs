//! The LayerSplit throughput **model** (not a measurement): why seed 004's gain grows from +10 % at
//! 40K tokens to +132 % at 120K, as a function of inputs most of which are assumed
//! (`reference/layersplit-snapshot.md` §3, a port of its appendix).
//!
//! Three parts, all pure arithmetic:
//! 1. **Capacity**: a CP rank under LayerSplit stores `⌈L/C⌉` layers plus `s` transient layer slots
//!    instead of `L`, so the same KV memory holds `ρ = L / (⌈L/C⌉ + s)` times the tokens
//!    ([`capacity_ratio`]; SGLang PR #29930 measured 457,920 → ~3.25 M tokens, ~7.1×, at CP 8 on
//!    78 layers, which is `78 / 11`).
//! 2. **Residency**: `S` sessions each hold a `T`-token prefix in an LRU cache of `N` tokens, with
//!    lognormal inter-turn gaps of mean 1 and shape `σ`; the hit probability of a session's next turn
//!    is the Che approximation `P(g < t_C)` where `S·T·P(age < t_C) = N` ([`lru_hit`]).
//! 3. **Work per request** ([`request_seconds`]): a hit covers `h·T·p` tokens; the `n` new ones cost
//!    `a·n + b·n·(T − n/2)` (linear MoE/projection cost and the DSA indexer's `O(n·T)`); under
//!    LayerSplit every layer of every chunk also broadcasts the context's indexer rows (exposed) and
//!    its KV rows (exposed only where longer than that layer's compute).
//!
//! Gain = `(t_base + t_fixed) / (t_split + t_fixed) − 1` ([`gain_curve`]). Every output of this
//! module is a model figure and says so where printed (`tandem-bench layer-split`); CI never reports
//! GPU latency.

/// Inputs of the model; [`CostParams::glm5_cp8`] is the reference's fit (§3.3).
///
/// Which are measured and which assumed (reference §3.2): `layers`, `kv_row_bytes`,
/// `index_row_bytes`, `base_tokens` and `transient_slots` are public (GLM-5 config, SGLang PR
/// #29930's log); `sessions`, `gap_sigma`, `per_token_s`, `indexer_pair_s`, `broadcast_bytes_per_s`
/// and `chunk_tokens` are **assumed** (z.ai published none of them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostParams {
    /// Layers `L`.
    pub layers: u32,
    /// CP size `C` (ranks per prefill group).
    pub cp: u32,
    /// Transient layer slots `s` a rank keeps for broadcast layers it does not own.
    pub transient_slots: u32,
    /// Main KV bytes per token per layer `B_kv` (656 for GLM-5's FP8 MLA record).
    pub kv_row_bytes: f64,
    /// Indexer key bytes per token per layer `B_idx` (132: 128 FP8 + one fp32 scale).
    pub index_row_bytes: f64,
    /// Tokens the replicated layout holds per rank, `N_base` (457,920 in PR #29930's log).
    pub base_tokens: f64,
    /// Nominal prefix-hit share `h` of a request's context (0.9: seed 004's setting).
    pub prefix_share: f64,
    /// Active sessions `S` per prefill instance (assumed; fitted).
    pub sessions: f64,
    /// Shape `σ` of the lognormal inter-turn gap, mean 1 (assumed; fitted).
    pub gap_sigma: f64,
    /// Linear cost `a` per new token, seconds per 8-GPU instance (assumed: 85 µs).
    pub per_token_s: f64,
    /// DSA indexer cost `b` per (query, key) pair over all layers, seconds (assumed: 5.3e-10).
    pub indexer_pair_s: f64,
    /// CP broadcast bandwidth, bytes per second (assumed: 150 GB/s).
    pub broadcast_bytes_per_s: f64,
    /// Prefill chunk size `n_c`, tokens (assumed: 16,384).
    pub chunk_tokens: f64,
    /// Non-prefill seconds per request `t_fixed` added to both sides (0: prefill-only throughput).
    pub fixed_s: f64,
}

impl CostParams {
    /// The reference's best fit to seed 004's two published endpoints: GLM-5 (78 layers), CP 8,
    /// one transient slot, `S = 24`, `σ = 2.5`, `a = 85 µs`, `h = 0.9`.
    pub fn glm5_cp8() -> Self {
        Self {
            layers: 78,
            cp: 8,
            transient_slots: 1,
            kv_row_bytes: 656.0,
            index_row_bytes: 132.0,
            base_tokens: 457_920.0,
            prefix_share: 0.9,
            sessions: 24.0,
            gap_sigma: 2.5,
            per_token_s: 85e-6,
            indexer_pair_s: 5.3e-10,
            broadcast_bytes_per_s: 150e9,
            chunk_tokens: 16_384.0,
            fixed_s: 0.0,
        }
    }

    /// Tokens one rank holds under LayerSplit: `N_base × ρ`.
    pub fn split_tokens(&self) -> f64 {
        self.base_tokens * capacity_ratio(self.layers, self.cp, self.transient_slots)
    }
}

/// Token-capacity gain of LayerSplit on one rank: `L / (⌈L/C⌉ + s)` (1 when `C` is 0 or 1 and
/// `s` is 0; `C` above `L` counts as `L`). Examples: 78 layers at CP 8 with one slot = 7.09; at
/// CP 4 = 3.71.
pub fn capacity_ratio(layers: u32, cp: u32, transient_slots: u32) -> f64 {
    let cp = cp.clamp(1, layers.max(1));
    let stored = layers.div_ceil(cp) + transient_slots;
    f64::from(layers) / f64::from(stored.max(1))
}

/// Standard normal CDF through `erfc` (W. J. Cody's rational Chebyshev form as in Numerical
/// Recipes §6.2, relative error below 1.2e-7, ample for a model).
fn normal_cdf(x: f64) -> f64 {
    let z = -x / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z.abs());
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc_abs = t * poly.exp();
    let erfc = if z >= 0.0 { erfc_abs } else { 2.0 - erfc_abs };
    0.5 * erfc
}

/// CDF of the lognormal inter-turn gap with mean 1 and shape `sigma` (`μ = −σ²/2`).
fn gap_cdf(x: f64, sigma: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    let mu = -sigma * sigma / 2.0;
    normal_cdf((x.ln() - mu) / sigma)
}

/// `P(age < t) = ∫₀ᵗ (1 − F(x)) dx / E[g]` (E[g] = 1), midpoint rule on a grid dense near 0.
fn age_below(t: f64, sigma: f64) -> f64 {
    const STEPS: u32 = 2000;
    let at = |i: u32| t * (f64::from(i) / f64::from(STEPS)).powi(2);
    (0..STEPS)
        .map(|i| {
            let (a, b) = (at(i), at(i + 1));
            (b - a) * (1.0 - gap_cdf((a + b) / 2.0, sigma))
        })
        .sum()
}

/// Hit probability of a session's next turn in an LRU cache of `capacity` tokens holding
/// `sessions` prefixes of `tokens` each (Che approximation with renewal arrivals; reference §3.2
/// eq. 1): 1 when everything fits, else `F(t_C)` with `sessions × tokens × P(age < t_C) =
/// capacity`. Inputs must be positive; `sigma` is the lognormal gap's shape.
pub fn lru_hit(sessions: f64, tokens: f64, capacity: f64, sigma: f64) -> f64 {
    let working_set = sessions * tokens;
    if working_set <= capacity {
        return 1.0;
    }
    let (mut lo, mut hi) = (1e-9_f64, 1.0_f64);
    // P(age < t) → 1 as t grows, and working_set > capacity, so this ends; bounded anyway.
    for _ in 0..64 {
        if working_set * age_below(hi, sigma) >= capacity {
            break;
        }
        hi *= 2.0;
    }
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if working_set * age_below(mid, sigma) < capacity {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    gap_cdf((lo + hi) / 2.0, sigma)
}

/// Seconds of one request, split into compute and LayerSplit's exposed broadcast.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestCost {
    /// Prefill compute of the new tokens, seconds.
    pub compute_s: f64,
    /// Broadcast time not hidden behind layer compute (0 for the replicated layout), seconds.
    pub exposed_comm_s: f64,
}

impl RequestCost {
    /// Compute plus exposed broadcast.
    pub fn total_s(&self) -> f64 {
        self.compute_s + self.exposed_comm_s
    }
}

/// Cost of a request of `tokens` context tokens whose cached prefix is found with probability
/// `hit` (reference §3.2 eqs. 2–3): `split` adds the per-layer, per-chunk broadcast of the
/// context's indexer rows (always exposed) and KV rows (exposed beyond the layer's compute).
pub fn request_seconds(p: &CostParams, tokens: f64, hit: f64, split: bool) -> RequestCost {
    let cached = tokens * p.prefix_share * hit;
    let new = tokens - cached;
    let compute_s = new * p.per_token_s + p.indexer_pair_s * new * (tokens - new / 2.0);
    let mut exposed_comm_s = 0.0;
    if split && p.chunk_tokens > 0.0 {
        let layers = f64::from(p.layers);
        let (mut context, mut left) = (cached, new);
        while left > 0.0 {
            let step = p.chunk_tokens.min(left);
            let c = context + step;
            let layer_compute =
                (step * p.per_token_s + p.indexer_pair_s * step * (context + step / 2.0)) / layers;
            let index = c * p.index_row_bytes / p.broadcast_bytes_per_s;
            let kv = c * p.kv_row_bytes / p.broadcast_bytes_per_s;
            exposed_comm_s += layers * (index + (kv - layer_compute).max(0.0));
            context = c;
            left -= step;
        }
    }
    RequestCost {
        compute_s,
        exposed_comm_s,
    }
}

/// One context length of the gain curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GainRow {
    /// Context tokens `T` of each request.
    pub tokens: f64,
    /// Next-turn hit probability with the replicated layout's capacity.
    pub hit_base: f64,
    /// Next-turn hit probability with LayerSplit's capacity.
    pub hit_split: f64,
    /// Replicated layout's cost.
    pub base: RequestCost,
    /// LayerSplit's cost.
    pub split: RequestCost,
    /// Throughput gain `(t_base + t_fixed) / (t_split + t_fixed) − 1` (0.17 = +17 %).
    pub gain: f64,
}

/// The model's gain at each context length in `contexts` (tokens).
pub fn gain_curve(p: &CostParams, contexts: &[f64]) -> Vec<GainRow> {
    contexts
        .iter()
        .map(|&tokens| {
            let hit_base = lru_hit(p.sessions, tokens, p.base_tokens, p.gap_sigma);
            let hit_split = lru_hit(p.sessions, tokens, p.split_tokens(), p.gap_sigma);
            let base = request_seconds(p, tokens, hit_base, false);
            let split = request_seconds(p, tokens, hit_split, true);
            GainRow {
                tokens,
                hit_base,
                hit_split,
                base,
                split,
                gain: (base.total_s() + p.fixed_s) / (split.total_s() + p.fixed_s) - 1.0,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTEXTS: [f64; 5] = [40e3, 60e3, 80e3, 100e3, 120e3];

    /// PR #29930's capacity: 78 layers at CP 8 with one slot is 78/11 ≈ 7.09 (measured ~7.1×):
    /// 457,920 → 3,247,069 tokens, within 0.01 % of the 3,247,296 its log shows (reference §5.1
    /// A1); CP 4 is 78/21 ≈ 3.71.
    #[test]
    fn capacity_ratio_matches_the_measured_cp8_figure() {
        let p = CostParams::glm5_cp8();
        assert!((capacity_ratio(78, 8, 1) - 78.0 / 11.0).abs() < 1e-12);
        assert_eq!(p.split_tokens().round(), 3_247_069.0);
        assert!((p.split_tokens() / 3_247_296.0 - 1.0).abs() < 1e-4);
        assert!((capacity_ratio(78, 4, 1) - 3.714).abs() < 1e-3);
        assert_eq!(capacity_ratio(61, 1, 0), 1.0, "no CP, no gain");
        assert_eq!(capacity_ratio(4, 8, 0), 4.0, "CP above L stores one layer");
    }

    #[test]
    fn normal_cdf_is_accurate() {
        for (x, want) in [(0.0, 0.5), (1.0, 0.841_344_746), (-2.0, 0.022_750_132)] {
            assert!((normal_cdf(x) - want).abs() < 1e-6, "Φ({x})");
        }
    }

    /// The reference's table (§3.3) at the fit S = 24, σ = 2.5: +17 % at 40K, +76 % at 80K,
    /// +128 % at 120K, hit 0.98 → 0.85 replicated and 1.00 split, exposed broadcast under 1 %.
    #[test]
    fn the_fit_reproduces_the_reference_table() {
        let rows = gain_curve(&CostParams::glm5_cp8(), &CONTEXTS);
        let gains: Vec<f64> = rows.iter().map(|r| r.gain).collect();
        for (got, want) in gains.iter().zip([0.17, 0.47, 0.76, 1.03, 1.28]) {
            assert!((got - want).abs() < 0.02, "gains {gains:?}");
        }
        assert!((rows[0].hit_base - 0.98).abs() < 0.01, "{:?}", rows[0]);
        assert!((rows[4].hit_base - 0.85).abs() < 0.01, "{:?}", rows[4]);
        for r in &rows {
            assert!(r.hit_split > 0.995, "{r:?}");
            assert!(r.split.exposed_comm_s < 0.01 * r.split.total_s(), "{r:?}");
        }
    }

    /// The shape the bench guards (reference §5.1 A5): gain is monotone non-decreasing in T for
    /// h ≥ 0.8, and about 0 while the working set S·T fits the replicated cache.
    #[test]
    fn gain_grows_with_context_and_is_flat_while_the_working_set_fits() {
        for share in [0.8, 0.9, 0.95] {
            let p = CostParams {
                prefix_share: share,
                ..CostParams::glm5_cp8()
            };
            let gains: Vec<f64> = gain_curve(&p, &CONTEXTS).iter().map(|r| r.gain).collect();
            assert!(
                gains.windows(2).all(|w| w[1] >= w[0]),
                "h={share}: {gains:?}"
            );
        }
        // S·T = 8 × 40K = 320K ≤ 457,920: both layouts hit every turn; only the broadcast differs.
        let p = CostParams {
            sessions: 8.0,
            ..CostParams::glm5_cp8()
        };
        let row = gain_curve(&p, &[40e3])[0];
        assert_eq!((row.hit_base, row.hit_split), (1.0, 1.0));
        assert!(row.gain <= 0.0 && row.gain > -0.01, "{row:?}");
    }

    /// Sensitivities the reference reports: a low prefix share leaves little to gain
    /// (h = 0.5: +2 % → +13 %), and a non-prefill share dilutes it (t_fixed = 1 s: +5 % → +81 %).
    #[test]
    fn sensitivities_match_the_reference() {
        let at = |p: CostParams| -> (f64, f64) {
            let rows = gain_curve(&p, &[40e3, 120e3]);
            (rows[0].gain, rows[1].gain)
        };
        let (lo, hi) = at(CostParams {
            prefix_share: 0.5,
            ..CostParams::glm5_cp8()
        });
        assert!(
            (lo - 0.02).abs() < 0.02 && (hi - 0.13).abs() < 0.03,
            "{lo} {hi}"
        );
        let (lo, hi) = at(CostParams {
            fixed_s: 1.0,
            ..CostParams::glm5_cp8()
        });
        assert!(
            (lo - 0.05).abs() < 0.02 && (hi - 0.81).abs() < 0.03,
            "{lo} {hi}"
        );
    }
}
