//! A roofline cost model of the model and GPU: prefill is compute-bound (dense FLOPs plus causal
//! attention over the cached prefix), a decode step is memory-bound (weights plus the KV read).

use std::time::Duration;

use crate::model::ModelIdentity;

/// A GPU's peak numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpu {
    /// Dense bf16 peak, TFLOP/s.
    pub tflops: f64,
    /// HBM bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// Fraction of peak compute reached by prefill kernels (0..1].
    pub mfu: f64,
}

impl Gpu {
    /// NVIDIA H200 SXM (989 dense bf16 TFLOP/s, 4.8 TB/s), 45% MFU.
    pub const H200: Gpu = Gpu {
        tflops: 989.0,
        hbm_gbps: 4800.0,
        mfu: 0.45,
    };
}

/// The cost model.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Parameters active per token (billions).
    pub active_params_b: f64,
    /// KV elements per token across all layers (from the model identity).
    pub kv_elems_per_token: f64,
    /// Bytes per weight and KV element.
    pub dtype_bytes: f64,
    /// The GPU.
    pub gpu: Gpu,
    /// Multiplier on every duration (benchmarks and tests shrink time; 1.0 = real time).
    pub time_scale: f64,
}

impl CostModel {
    /// A model from its identity and active parameter count.
    pub fn new(model: &ModelIdentity, active_params_b: f64, gpu: Gpu) -> CostModel {
        CostModel {
            active_params_b,
            kv_elems_per_token: (u64::from(model.layers)
                * model.attention.kv_elems_per_token_layer())
                as f64,
            dtype_bytes: f64::from(model.dtype_bytes),
            gpu,
            time_scale: 1.0,
        }
    }

    /// Time to prefill `new_tokens` after `cached_tokens` of reused prefix:
    /// `(2·P·n + 2·kv·n·(c + n/2)) / (peak·mfu)`.
    pub fn prefill(&self, new_tokens: u64, cached_tokens: u64) -> Duration {
        let n = new_tokens as f64;
        let c = cached_tokens as f64;
        let dense = 2.0 * self.active_params_b * 1e9 * n;
        let attention = 2.0 * self.kv_elems_per_token * n * (c + n / 2.0);
        self.secs((dense + attention) / (self.gpu.tflops * 1e12 * self.gpu.mfu))
    }

    /// Time of one decode step for `batch` sequences holding `context_tokens` tokens in total:
    /// weights read once plus every sequence's KV read.
    pub fn decode_step(&self, batch: u64, context_tokens: u64) -> Duration {
        if batch == 0 {
            return Duration::ZERO;
        }
        let weights = self.active_params_b * 1e9 * self.dtype_bytes;
        let kv = self.kv_elems_per_token * self.dtype_bytes * context_tokens as f64;
        self.secs((weights + kv) / (self.gpu.hbm_gbps * 1e9))
    }

    fn secs(&self, s: f64) -> Duration {
        Duration::from_secs_f64((s * self.time_scale).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Attention;

    fn llama8b() -> ModelIdentity {
        ModelIdentity {
            name: "llama-3-8b".into(),
            layers: 32,
            attention: Attention::Gqa {
                kv_heads: 8,
                head_dim: 128,
            },
            dtype_bytes: 2,
            row_extra_bytes: 0,
        }
    }

    #[test]
    fn prefill_grows_superlinearly_and_decode_is_memory_bound() {
        let m = CostModel::new(&llama8b(), 8.0, Gpu::H200);
        let p1 = m.prefill(8192, 0).as_secs_f64();
        let p2 = m.prefill(16384, 0).as_secs_f64();
        assert!(p2 > 2.0 * p1, "attention term makes prefill superlinear");
        // 8k tokens of an 8B model on an H200: on the order of 0.3 s.
        assert!((0.1..1.0).contains(&p1), "{p1}");
        // Decode step ≈ 16 GB of weights / 4.8 TB/s ≈ 3.3 ms.
        let d = m.decode_step(1, 0).as_secs_f64();
        assert!((0.003..0.004).contains(&d), "{d}");
        assert!(
            m.prefill(1024, 60_000) > m.prefill(1024, 0),
            "cached prefix still costs attention"
        );
        let mut fast = m.clone();
        fast.time_scale = 0.001;
        assert!(fast.prefill(8192, 0) < m.prefill(8192, 0));
    }
}
