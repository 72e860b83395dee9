//! Latency percentiles by the nearest-rank method: the p-th percentile of n sorted values is the
//! value at 1-based rank ⌈p/100 × n⌉ (so it is always an observed value, never interpolated).

use serde::{Deserialize, Serialize};

/// Summary of one latency series (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Number of values.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

/// The nearest-rank `q`-quantile (`q` in `[0, 1]`, clamped) of ascending `sorted`; `None` when empty.
pub fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, n) - 1])
}

/// Percentiles of `values` (NaN and infinite values are dropped); `None` when nothing is left.
pub fn summarize(values: impl IntoIterator<Item = f64>) -> Option<Percentiles> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let q = |p| nearest_rank(&v, p).unwrap_or(f64::NAN);
    Some(Percentiles {
        count: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: q(0.50),
        p90: q(0.90),
        p99: q(0.99),
        max: v[v.len() - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_to_hundred() {
        let p = summarize((1..=100).rev().map(f64::from)).unwrap();
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(p.count, 100);
        assert!((p.mean - 50.5).abs() < 1e-12);
    }

    #[test]
    fn small_and_degenerate_inputs() {
        // n = 10: p50 at rank 5, p90 at rank 9, p99 at rank ⌈9.9⌉ = 10.
        let p = summarize([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0]).unwrap();
        assert_eq!((p.p50, p.p90, p.p99), (5.0, 9.0, 10.0));
        let one = summarize([42.0]).unwrap();
        assert_eq!((one.p50, one.p99, one.max), (42.0, 42.0, 42.0));
        assert!(summarize([]).is_none());
        assert!(summarize([f64::NAN]).is_none());
        assert_eq!(nearest_rank(&[1.0, 2.0], 0.0), Some(1.0));
        assert_eq!(nearest_rank(&[1.0, 2.0], 1.0), Some(2.0));
    }
}
