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
    fn negative_control_modulo_placement_remaps_most_pages() {
        let share = moved(&replicas(2), &replicas(3), Placement::Modulo);
        assert!(share > 0.5, "modulo moved only {share}");
        assert!(moved(&replicas(2), &replicas(3), Placement::Rendezvous) < 0.4);
    }
}
