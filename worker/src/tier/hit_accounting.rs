//! Token-weighted hit accounting per tier.
//!
//! A request of `input_tokens` tokens is cut into pages of `page_tokens`; the last page may be
//! partial and then counts its real length. The hit tokens of a request are the tokens of the leading
//! pages its [`PrefixMatch`] found present, attributed to the tier that served each page; pending
//! writes never appear in a match (see `prefix_index`), so they are never counted. The token hit
//! ratio is `Σ hit tokens / Σ input tokens` — the definition of the Mooncake trace README
//! (`shared/data/mooncake/README.md`, 0.374 with an unbounded cache).

use super::prefix_index::{PrefixMatch, Tier};

/// Tokens of page `page` (0-based) of a request of `input_tokens` tokens cut into pages of
/// `page_tokens` tokens: `page_tokens`, except a partial last page, and 0 past the end.
pub fn page_token_len(input_tokens: u64, page_tokens: u64, page: usize) -> u64 {
    let start = page as u64 * page_tokens;
    input_tokens.saturating_sub(start).min(page_tokens)
}

/// Tokens of the pages among the first `leading` of `keys` that `marked` selects (e.g. the pages a
/// snapshot added: `snapshot_hit_tokens` of one lookup), for a request of `input_tokens` tokens in
/// pages of `page_tokens`.
pub fn marked_tokens<K>(
    keys: &[K],
    leading: usize,
    input_tokens: u64,
    page_tokens: u64,
    marked: impl Fn(&K) -> bool,
) -> u64 {
    keys.iter()
        .take(leading)
        .enumerate()
        .filter(|(_, k)| marked(k))
        .map(|(p, _)| page_token_len(input_tokens, page_tokens, p))
        .sum()
}

/// Running totals of lookups and hits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HitAccounting {
    /// Requests recorded.
    pub requests: u64,
    /// Input tokens of all recorded requests.
    pub lookup_tokens: u64,
    /// Hit tokens per tier, indexed by [`Tier::index`].
    pub hit_tokens: [u64; 3],
}

impl HitAccounting {
    /// Records one request of `input_tokens` tokens, cut into pages of `page_tokens`, whose lookup
    /// returned `matched`. Matched pages beyond the request's page count are ignored.
    pub fn record(&mut self, input_tokens: u64, page_tokens: u64, matched: &PrefixMatch) {
        self.requests += 1;
        self.lookup_tokens += input_tokens;
        for (page, tier) in matched.tiers.iter().enumerate() {
            self.hit_tokens[tier.index()] += page_token_len(input_tokens, page_tokens, page);
        }
    }

    /// Hit tokens over all tiers.
    pub fn total_hit_tokens(&self) -> u64 {
        self.hit_tokens.iter().sum()
    }

    /// `Σ hit tokens / Σ input tokens`, 0 when nothing was looked up.
    pub fn token_hit_ratio(&self) -> f64 {
        ratio(self.total_hit_tokens(), self.lookup_tokens)
    }

    /// The share of input tokens served by `tier`.
    pub fn tier_hit_ratio(&self, tier: Tier) -> f64 {
        ratio(self.hit_tokens[tier.index()], self.lookup_tokens)
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_last_page_counts_its_real_length() {
        assert_eq!(page_token_len(1100, 512, 0), 512);
        assert_eq!(page_token_len(1100, 512, 2), 76);
        assert_eq!(page_token_len(1100, 512, 3), 0);
        let mut acc = HitAccounting::default();
        let m = PrefixMatch {
            tiers: vec![Tier::L1Device, Tier::L3Store, Tier::L3Store],
        };
        acc.record(1100, 512, &m);
        assert_eq!(acc.hit_tokens, [512, 0, 588]);
        assert_eq!(acc.token_hit_ratio(), 1.0);
        assert!((acc.tier_hit_ratio(Tier::L3Store) - 588.0 / 1100.0).abs() < 1e-12);
    }
}
