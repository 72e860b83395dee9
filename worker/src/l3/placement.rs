//! Which L3 store replica owns a page: rendezvous (highest-random-weight) hashing over the
//! replicas' addresses.
//!
//! Every client computes the same owner from the same replica set, whatever order the resolver
//! returned it in. When the set changes, only the pages of the replica that left (or the share the
//! new replica wins) move; the rest keep their owner and stay hits. Placement by
//! `hash % replicas` over the sorted addresses (what the clients did before) remaps most pages on
//! any change: growing 2 → 3 replicas moved about two thirds of them, each a miss until rewritten
//! ([`Placement::Modulo`] is kept as that negative control). Thaler & Ravishankar, "Using
//! name-based mappings to increase hit rates", IEEE/ACM ToN 1998.

use std::net::SocketAddr;

use crate::tier::page_key::PageKey;

/// A placement rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Rendezvous hashing: the replica with the highest `hash(page, replica)` owns the page.
    #[default]
    Rendezvous,
    /// `hash(page) % n` over the sorted addresses — remaps most pages when `n` changes. Only for
    /// the tests that show why it is not used.
    Modulo,
}

/// The owner of `page` among `replicas` (any order, duplicates ignored); `None` when empty.
pub fn owner(page: PageKey, replicas: &[SocketAddr], rule: Placement) -> Option<SocketAddr> {
    let page_hash = xxhash_rust::xxh3::xxh3_64(page.to_string().as_bytes());
    match rule {
        Placement::Rendezvous => replicas
            .iter()
            .copied()
            .max_by_key(|addr| (weight(page_hash, addr), *addr)),
        Placement::Modulo => {
            let mut sorted = replicas.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            (!sorted.is_empty()).then(|| sorted[(page_hash % sorted.len() as u64) as usize])
        }
    }
}

/// The owner of `page` among weighted `replicas` (weighted rendezvous hashing, the logarithmic
/// method: score `-w / ln(u)` with `u` the pair's hash mapped into (0, 1); Schindelhauer &
/// Schomaker, "Weighted distributed hash tables", SPAA 2005). A replica's expected share of pages
/// is its weight over the sum. Equal weights give exactly [`owner`]'s choice (the score is then
/// monotonic in the hash); lowering one replica's weight moves pages only from it to the replica
/// that ranks next for each page, never between the others. A weight ≤ 0 (or NaN) never owns;
/// `None` when no replica has a positive weight.
///
/// The write ramp of a replica that rejoined empty uses it (kvcache-ai/Mooncake#3688: an empty
/// instance drew every new write and timed out under the flood).
pub fn weighted_owner(page: PageKey, replicas: &[(SocketAddr, f64)]) -> Option<SocketAddr> {
    let page_hash = xxhash_rust::xxh3::xxh3_64(page.to_string().as_bytes());
    replicas
        .iter()
        .filter(|(_, w)| *w > 0.0)
        .map(|(addr, w)| {
            // (0, 1]: 53 high bits of the hash, +1 so ln never sees 0.
            let u = ((weight(page_hash, addr) >> 11) + 1) as f64 / (1u64 << 53) as f64;
            // -ln(u) ∈ [0, ~36.7]; u = 1 gives an infinite score (owns whatever the weight).
            let score = if u >= 1.0 { f64::INFINITY } else { -w / u.ln() };
            (score, *addr)
        })
        .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(_, addr)| addr)
}

/// The two replicas that rank highest for `page` under [`Placement::Rendezvous`] (any order of
/// `replicas`, duplicates ignored): `(first, second)`. Whatever the weights passed to
/// [`weighted_owner`] (one replica lowered), the weighted owner is one of these two, so a reader
/// that misses on the weighted owner finds a page written under another weight on the other one.
pub fn top_two(page: PageKey, replicas: &[SocketAddr]) -> (Option<SocketAddr>, Option<SocketAddr>) {
    let page_hash = xxhash_rust::xxh3::xxh3_64(page.to_string().as_bytes());
    let mut ranked: Vec<(u64, SocketAddr)> = replicas
        .iter()
        .map(|a| (weight(page_hash, a), *a))
        .collect();
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked.dedup_by(|a, b| a.1 == b.1);
    (ranked.first().map(|r| r.1), ranked.get(1).map(|r| r.1))
}

/// The rendezvous weight of one (page, replica) pair.
fn weight(page_hash: u64, replica: &SocketAddr) -> u64 {
    let replica = replica.to_string();
    xxhash_rust::xxh3::xxh3_64_with_seed(replica.as_bytes(), page_hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replicas(n: u8) -> Vec<SocketAddr> {
        (0..n)
            .map(|i| SocketAddr::from(([127, 100, 0, 10 + i], 7070)))
            .collect()
    }

    fn pages() -> impl Iterator<Item = PageKey> {
        (0..6000u64).map(PageKey::from_trace_id)
    }

    /// Share of pages whose owner differs between the two replica sets.
    fn moved(before: &[SocketAddr], after: &[SocketAddr], rule: Placement) -> f64 {
        let n = pages().count() as f64;
        let moved = pages()
            .filter(|p| owner(*p, before, rule) != owner(*p, after, rule))
            .count();
        moved as f64 / n
    }

    #[test]
    fn the_owner_does_not_depend_on_the_resolver_order() {
        let a = replicas(3);
        let mut b = a.clone();
        b.reverse();
        for p in pages().take(500) {
            assert_eq!(
                owner(p, &a, Placement::Rendezvous),
                owner(p, &b, Placement::Rendezvous)
            );
        }
        assert_eq!(
            owner(PageKey::from_trace_id(1), &[], Placement::Rendezvous),
            None
        );
    }

    #[test]
    fn pages_spread_evenly() {
        let set = replicas(4);
        for r in &set {
            let share = pages()
                .filter(|p| owner(*p, &set, Placement::Rendezvous) == Some(*r))
                .count() as f64
                / pages().count() as f64;
            assert!((share - 0.25).abs() < 0.03, "{r}: {share}");
        }
    }

    #[test]
    fn growing_moves_only_the_new_replicas_share() {
        let (two, three) = (replicas(2), replicas(3));
        let new = three[2];
        for p in pages() {
            let (b, a) = (
                owner(p, &two, Placement::Rendezvous),
                owner(p, &three, Placement::Rendezvous),
            );
            assert!(a == b || a == Some(new), "{p} moved between old replicas");
        }
        let share = moved(&two, &three, Placement::Rendezvous);
        assert!((share - 1.0 / 3.0).abs() < 0.03, "{share}");
    }

    #[test]
    fn losing_a_replica_moves_only_its_pages() {
        let (three, two) = (replicas(3), replicas(2));
        let gone = three[2];
        for p in pages() {
            let b = owner(p, &three, Placement::Rendezvous);
            if b != Some(gone) {
                assert_eq!(owner(p, &two, Placement::Rendezvous), b, "{p}");
            }
        }
    }

    #[test]
    fn equal_weights_choose_the_rendezvous_owner() {
        let set = replicas(3);
        let weighted: Vec<_> = set.iter().map(|a| (*a, 1.0)).collect();
        for p in pages().take(2000) {
            assert_eq!(
                weighted_owner(p, &weighted),
                owner(p, &set, Placement::Rendezvous),
                "{p}"
            );
        }
        assert_eq!(weighted_owner(PageKey::from_trace_id(1), &[]), None);
    }

    #[test]
    fn a_lowered_weight_sheds_its_pages_to_the_second_ranked_replica_only() {
        let set = replicas(3);
        let low = set[0];
        for w in [0.05, 0.25, 0.5] {
            let weighted: Vec<_> = set
                .iter()
                .map(|a| (*a, if *a == low { w } else { 1.0 }))
                .collect();
            let mut owned = 0;
            for p in pages() {
                let got = weighted_owner(p, &weighted).unwrap();
                let (first, second) = top_two(p, &set);
                assert!(Some(got) == first || Some(got) == second, "{p}");
                if first != Some(low) {
                    assert_eq!(Some(got), first, "{p} moved between full-weight replicas");
                }
                owned += usize::from(got == low);
            }
            // Expected share w / (w + 2).
            let share = owned as f64 / pages().count() as f64;
            let expected = w / (w + 2.0);
            assert!(
                (share - expected).abs() < 0.03,
                "w={w}: {share} vs {expected}"
            );
        }
        let zero: Vec<_> = set
            .iter()
            .map(|a| (*a, if *a == low { 0.0 } else { 1.0 }))
            .collect();
        assert!(pages().all(|p| weighted_owner(p, &zero) != Some(low)));
    }

    #[test]
    fn negative_control_modulo_placement_remaps_most_pages() {
        let share = moved(&replicas(2), &replicas(3), Placement::Modulo);
        assert!(share > 0.5, "modulo moved only {share}");
        assert!(moved(&replicas(2), &replicas(3), Placement::Rendezvous) < 0.4);
    }
}
