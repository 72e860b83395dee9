//! Simulation knobs of the serving processes (worker/interfaces/README.md §2) and the KV layout
//! they imply.
//!
//! The simulated engine (DESIGN §3) writes, moves and verifies real bytes; these knobs scale how many
//! and how fast, so that a demo of many workers fits one machine (RSS < 300 MiB per worker):
//! - `TANDEM_SIM_KV_BYTES_PER_TOKEN`: KV bytes per token per rank (all layers) the engine writes and
//!   transfers; default: the real geometry, `model.bytes_per_token_layer × layers / tensor`.
//! - `TANDEM_SIM_TPOT_MS`: decode time per output token, default 2 ms.
//! - `TANDEM_SIM_PREFILL_POOL_PAGES`: pages of the built-in prefill's KV pool that its rooms hold
//!   while they compute (snapshot sync's occupancy, issue 15; read by
//!   `roles::prefill::snapshot_sync`); unset, rooms hold none.
//! - `TANDEM_SIM_PREFILL_US_PER_TOKEN`: prefill compute time per prompt token not served from a
//!   cache tier, default 20 µs.
//! - `TANDEM_SIM_SPEC_FAULT` (**test-only** fault injection, read only in builds with the
//!   `negative-controls` feature; others refuse to start with it set):
//!   `low_accept` or `high_accept`, optionally `:N`. With speculative decoding configured, the
//!   simulated draft of this decode worker is then anomalous — almost every draft token rejected
//!   (`low_accept`, the garbled-output signature of seed 004) or every one accepted (`high_accept`,
//!   the repetition signature) — for the first `N` attempts of every request (all attempts without
//!   `:N`). It exists to exercise the spec guard (DESIGN contract 8) end to end.

use std::time::Duration;

use crate::config::WorkerConfig;
use crate::control::KvLayout;
use crate::engine::content::TAG_BYTES;

/// Tokens per KV page when the config names no cache tier: the Mooncake trace's block size, so
/// that one `kv_block_hashes` entry is one page.
pub const DEFAULT_PAGE_TOKENS: u32 = 512;

/// Upper bound of a decode worker's KV receive region, in bytes. Pages are allocated lazily
/// (zeroed on first touch) and reused LIFO, so RSS follows the pages in use, not this bound; the
/// cap bounds the page table whatever the config's pool size. 1 GiB holds the sample stack's
/// `hostPool.size` whole: a smaller cap made the decode refuse (429) bursts of the Mooncake
/// trace that its configured pool holds.
pub const REGION_CAP_BYTES: u64 = 1 << 30;

/// Upper bound of a decode worker's page count (page metadata cap).
pub const REGION_CAP_PAGES: u64 = 4096;

/// The knobs, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimKnobs {
    /// KV bytes per token per rank over all layers; `None` = real geometry.
    pub kv_bytes_per_token: Option<u64>,
    /// Decode time per output token.
    pub tpot: Duration,
    /// Prefill compute time per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Test-only speculative fault (`TANDEM_SIM_SPEC_FAULT`); `None` in production.
    pub spec_fault: Option<SpecFault>,
}

/// How an injected speculative fault skews the simulated draft (test-only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecFaultMode {
    /// Almost every draft token rejected: accept length near 1 (seed 004: garbled output).
    LowAccept,
    /// Every draft token accepted: accept rate 1 (seed 004: repetition loops).
    HighAccept,
}

/// A test-only speculative fault: `mode` on the first `attempts` attempts of each request (every
/// attempt when `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecFault {
    /// How the draft is skewed.
    pub mode: SpecFaultMode,
    /// Attempts of a request that are faulty; `None` = all.
    pub attempts: Option<u32>,
}

impl SpecFault {
    /// Parses `low_accept|high_accept[:N]`; `None` when malformed.
    pub fn parse(value: &str) -> Option<Self> {
        let (mode, attempts) = match value.trim().split_once(':') {
            Some((m, n)) => (m, Some(n.trim().parse::<u32>().ok()?)),
            None => (value.trim(), None),
        };
        let mode = match mode {
            "low_accept" => SpecFaultMode::LowAccept,
            "high_accept" => SpecFaultMode::HighAccept,
            _ => return None,
        };
        Some(Self { mode, attempts })
    }

    /// Whether attempt `attempt` (0 = the first) of a request is faulty.
    pub fn applies_to(&self, attempt: u32) -> bool {
        self.attempts.is_none_or(|n| attempt < n)
    }
}

impl Default for SimKnobs {
    fn default() -> Self {
        Self {
            kv_bytes_per_token: None,
            tpot: Duration::from_millis(2),
            prefill_per_token: Duration::from_micros(20),
            spec_fault: None,
        }
    }
}

/// A knob that is set but not a number.
#[derive(Debug, thiserror::Error)]
#[error("environment variable {name}={value:?} is not {expected}")]
pub struct KnobError {
    /// Variable name.
    pub name: &'static str,
    /// Its value.
    pub value: String,
    /// What the variable takes.
    pub expected: &'static str,
}

impl SimKnobs {
    /// Reads the knobs from the process environment.
    ///
    /// # Errors
    /// [`KnobError`] naming the first malformed variable.
    pub fn from_env() -> Result<Self, KnobError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the knobs through `get` (pure; unset or empty = default).
    ///
    /// # Errors
    /// [`KnobError`] naming the first malformed variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, KnobError> {
        let num = |name: &'static str| -> Result<Option<u64>, KnobError> {
            match get(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(value) => value
                    .trim()
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| KnobError {
                        name,
                        value,
                        expected: "a non-negative integer",
                    }),
            }
        };
        let d = Self::default();
        let fault = "TANDEM_SIM_SPEC_FAULT";
        let spec_fault = match get(fault).filter(|v| !v.trim().is_empty()) {
            None => None,
            #[cfg(feature = "negative-controls")]
            Some(value) => Some(SpecFault::parse(&value).ok_or(KnobError {
                name: fault,
                value,
                expected: "low_accept or high_accept, optionally followed by :N",
            })?),
            #[cfg(not(feature = "negative-controls"))]
            Some(value) => {
                return Err(KnobError {
                    name: fault,
                    value,
                    expected: "unset (a test-only fault injection; this build has no \
                               negative-controls feature)",
                });
            }
        };
        Ok(Self {
            spec_fault,
            kv_bytes_per_token: num("TANDEM_SIM_KV_BYTES_PER_TOKEN")?.filter(|b| *b > 0),
            tpot: num("TANDEM_SIM_TPOT_MS")?.map_or(d.tpot, Duration::from_millis),
            prefill_per_token: num("TANDEM_SIM_PREFILL_US_PER_TOKEN")?
                .map_or(d.prefill_per_token, Duration::from_micros),
        })
    }

    /// The KV page layout of `cfg` under these knobs: `model.layers` layers, the tier's page size
    /// (else [`DEFAULT_PAGE_TOKENS`]) and per-layer token bytes of
    /// `ceil(kv_bytes_per_token / layers)`, rounded up to 8 and at least the engine's row tag.
    /// Prefill and decode derive it the same way, so their hello agrees.
    pub fn layout(&self, cfg: &WorkerConfig) -> KvLayout {
        let layers = cfg.model.layers.max(1);
        let per_token = self.kv_bytes_per_token.unwrap_or_else(|| {
            cfg.model.bytes_per_token_layer() * u64::from(layers)
                / u64::from(cfg.parallelism.tensor.max(1))
        });
        let per_layer = per_token.div_ceil(u64::from(layers)).next_multiple_of(8);
        let token_bytes = u32::try_from(per_layer.max(TAG_BYTES as u64)).unwrap_or(u32::MAX);
        KvLayout {
            layers,
            page_tokens: cfg
                .cache
                .as_ref()
                .map_or(DEFAULT_PAGE_TOKENS, |c| c.page_tokens.max(1)),
            token_bytes,
        }
    }
}

/// A model identity whose token row on one layer is exactly `layout.token_bytes` bytes, so that a
/// pool page (`memory::pool::KvPool`) of it is one page of `layout`: the simulated KV layout as a
/// model (the prefill KV pool of snapshot sync, the owned-layer store of LayerSplit).
pub fn layout_model(layout: KvLayout) -> crate::model::ModelIdentity {
    crate::model::ModelIdentity {
        name: "prefill-kv".into(),
        layers: layout.layers.max(1),
        attention: crate::model::Attention::Mla {
            kv_lora_rank: layout.token_bytes.max(1),
            rope_dim: 0,
        },
        dtype_bytes: 1,
        row_extra_bytes: 0,
    }
}

/// Pages of a decode worker's receive region: the target pool's pages, capped by
/// [`REGION_CAP_BYTES`] and [`REGION_CAP_PAGES`], at least 1.
pub fn region_pages(pool_bytes: u64, layout: KvLayout) -> u32 {
    let page = layout.page_bytes().max(1);
    let cap = (REGION_CAP_BYTES / page).clamp(1, REGION_CAP_PAGES);
    let pages = (pool_bytes / page).clamp(1, cap);
    u32::try_from(pages).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_parse_with_defaults_and_reject_garbage() {
        let k = SimKnobs::from_lookup(|_| None).unwrap();
        assert_eq!(k, SimKnobs::default());
        let k = SimKnobs::from_lookup(|n| match n {
            "TANDEM_SIM_KV_BYTES_PER_TOKEN" => Some("4096".into()),
            "TANDEM_SIM_TPOT_MS" => Some("0".into()),
            "TANDEM_SIM_PREFILL_US_PER_TOKEN" => Some(" 5 ".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(k.kv_bytes_per_token, Some(4096));
        assert_eq!(k.tpot, Duration::ZERO);
        assert_eq!(k.prefill_per_token, Duration::from_micros(5));
        let e = SimKnobs::from_lookup(|n| (n == "TANDEM_SIM_TPOT_MS").then(|| "fast".into()));
        assert!(e.is_err());
    }

    #[test]
    fn the_spec_fault_knob_parses_and_counts_attempts() {
        let knob = |v: &'static str| {
            SimKnobs::from_lookup(move |n| (n == "TANDEM_SIM_SPEC_FAULT").then(|| v.into()))
        };
        let all = knob("low_accept").unwrap().spec_fault.unwrap();
        assert_eq!(all.mode, SpecFaultMode::LowAccept);
        assert!(all.applies_to(0) && all.applies_to(7));
        let first = knob(" high_accept:1 ").unwrap().spec_fault.unwrap();
        assert_eq!(first.mode, SpecFaultMode::HighAccept);
        assert!(first.applies_to(0) && !first.applies_to(1));
        assert_eq!(knob("").unwrap().spec_fault, None);
        for bad in ["sometimes", "low_accept:", "low_accept:x", "high:1"] {
            let e = knob(bad).unwrap_err();
            assert_eq!(e.name, "TANDEM_SIM_SPEC_FAULT", "{bad}");
        }
    }

    #[test]
    fn region_is_capped() {
        let l = KvLayout {
            layers: 32,
            page_tokens: 512,
            token_bytes: 64,
        };
        // 1 MiB pages: the 1 GiB cap wins over a 64 GiB pool.
        assert_eq!(region_pages(64 << 30, l), 1024);
        assert_eq!(region_pages(4 << 20, l), 4);
        assert_eq!(region_pages(0, l), 1);
    }
}
