//! Which prefill peer computes a request's KV: prefix affinity balanced against load (issue 16
//! item 2). Pure: no I/O, no clock; [`super::peers::PeerSet::pick`] feeds it the live links.
//!
//! Round-robin sends a session's next turn where its prefix is not: on the Mooncake conversation
//! trace the L2 hit ratio was 0.211 against an unbounded cache's 0.374. Two prefix-aware
//! policies, both on the decode's own [`AffinityTable`]:
//!
//! - [`Routing::LeastWork`] (the default): the peer with the fewest blocks to compute before this
//!   request's KV is ready — its backlog from this decode plus the request's blocks it does not
//!   hold ([`least_work`]; the cost NVIDIA Dynamo's KV router scores workers by). On the
//!   conversation trace with the demo's capacities and no L3 (`tandem-bench routing`, one run)
//!   it raised the hit ratio 1.75 × round-robin's with one decode and 1.50 × with two, at 0.75 ×
//!   and 0.92 × round-robin's model p99 TTFT; `affinity` gave 1.47 × and 1.35 × at 0.99 × and
//!   0.98 ×.
//! - [`Routing::PrefixAffinity`]: the rule SGLang's cache-aware router uses (`sgl-router`
//!   `cache_aware`: an approximate radix tree per worker, fed by the router's own routing
//!   decisions), load counted in rooms:
//!
//! 1. **Load first.** Only peers with at most `min + max_skew` rooms in flight are eligible
//!    (`min`: the least-loaded live peer's count), so affinity never piles a hot prefix onto one
//!    queue.
//! 2. **Longest prefix.** Among the eligible, the peer whose [`AffinityTable`] holds the longest
//!    leading run of the request's `kv_block_hashes` wins when that run is at least half the
//!    request (a session's next turn): that is where its KV most likely still is (L2 pages are
//!    keyed by the same chained hashes, `tier::PageKey::from_trace_id`). Ties: fewest rooms in
//!    flight.
//! 3. **New prefixes** (no peer holds half of it — what peers share is then only a common head:
//!    on the Mooncake conversation trace every request starts with the same block): rendezvous
//!    hashing of the first block past the shared head over the eligible peers' addresses. Every
//!    decode worker places a session the same way, new sessions spread evenly, and a peer that
//!    comes or goes moves only its own share.
//! 4. **No prefix** (no `kv_block_hashes`): the least-loaded peers in turn.
//!
//! The table is the decode's own record of what it sent where (an LRU of block hashes per peer,
//! bounded like the prefill's L2), not the prefill's cache itself: a peer that evicted a prefix
//! only costs a miss there, never a wrong answer.

use std::cmp::Reverse;
use std::collections::HashMap;
use std::num::NonZeroUsize;

use lru::LruCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Rooms in flight a peer may have above the least-loaded one and still be chosen for affinity.
/// 0: affinity only chooses among the least-loaded peers — on the conversation trace
/// (`tandem-bench routing`) that kept p99 TTFT within 1 % of round-robin's while the L2 hit ratio
/// rose 1.47×; 1 gave 1.72× at up to +3 % p99, 4 gave 1.94× at up to +10 %.
pub const DEFAULT_MAX_SKEW: u32 = 0;

/// Block hashes remembered per peer when its L2 capacity is not known (pages of 512 tokens:
/// about the L2 of the demo's prefill).
pub const DEFAULT_BLOCKS_PER_PEER: usize = 16_384;

/// How the decode spreads rooms over prefill peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// The next live peer in turn (the baseline).
    RoundRobin,
    /// Prefix affinity within `max_skew` rooms of the least-loaded peer (the module doc's rule).
    PrefixAffinity {
        /// Rooms in flight above the least-loaded peer's that affinity may accept.
        max_skew: u32,
    },
    /// Least work: the peer with the fewest blocks to compute before this request's KV is ready
    /// — the blocks of this decode's rooms in flight there, plus the blocks of this request it
    /// does not hold ([`least_work`]). The default.
    #[default]
    LeastWork,
}

/// The decode's knob for [`Routing`] (read at start; a bad value refuses to start).
pub const ROUTING_ENV: &str = "TANDEM_DECODE_ROUTING";

impl Routing {
    /// Parses the value of [`ROUTING_ENV`]: `least-work` (the default), `round-robin`,
    /// `affinity` (skew [`DEFAULT_MAX_SKEW`]) or `affinity:SKEW` (rooms in flight above the
    /// least-loaded peer's that affinity may accept, a non-negative integer).
    ///
    /// # Errors
    /// The value and what is expected, in one line.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!(
                "{ROUTING_ENV}={s:?}: {why}; expected \"least-work\", \"round-robin\", \
                 \"affinity\" or \"affinity:SKEW\" (SKEW a non-negative integer)"
            )
        };
        match s.trim() {
            "round-robin" => Ok(Self::RoundRobin),
            "least-work" => Ok(Self::LeastWork),
            "affinity" => Ok(Self::PrefixAffinity {
                max_skew: DEFAULT_MAX_SKEW,
            }),
            other => match other.strip_prefix("affinity:") {
                Some(skew) => skew
                    .trim()
                    .parse::<u32>()
                    .map(|max_skew| Self::PrefixAffinity { max_skew })
                    .map_err(|e| bad(&format!("bad skew: {e}"))),
                None => Err(bad("unknown policy")),
            },
        }
    }

    /// The policy's name as [`Routing::parse`] reads it (`least-work`, `round-robin`, `affinity`).
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::PrefixAffinity { .. } => "affinity",
            Self::LeastWork => "least-work",
        }
    }

    /// The policy as `/report` shows it: `{"policy": NAME}`, plus `max_skew` for affinity.
    pub fn report(self) -> serde_json::Value {
        match self {
            Self::RoundRobin | Self::LeastWork => serde_json::json!({"policy": self.name()}),
            Self::PrefixAffinity { max_skew } => {
                serde_json::json!({"policy": self.name(), "max_skew": max_skew})
            }
        }
    }
}

impl std::fmt::Display for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RoundRobin => f.write_str("round-robin"),
            Self::LeastWork => f.write_str("least-work"),
            Self::PrefixAffinity { max_skew } => write!(f, "affinity:{max_skew}"),
        }
    }
}

/// One live peer as the chooser sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// The peer's control address (its identity in the table).
    pub addr: &'a str,
    /// Rooms this decode has open on it now.
    pub in_flight: u32,
    /// Blocks those rooms had to compute there when they were routed (their blocks the peer did
    /// not hold, by this decode's table).
    pub pending_blocks: u64,
}

/// The decode's record of which block hashes it sent to which peer: an LRU of at most
/// `blocks_per_peer` hashes per peer.
#[derive(Debug)]
pub struct AffinityTable {
    blocks_per_peer: NonZeroUsize,
    peers: HashMap<String, LruCache<u64, ()>>,
}

impl AffinityTable {
    /// An empty table remembering at most `blocks_per_peer` (≥ 1) hashes per peer.
    pub fn new(blocks_per_peer: usize) -> Self {
        AffinityTable {
            blocks_per_peer: NonZeroUsize::new(blocks_per_peer).unwrap_or(NonZeroUsize::MIN),
            peers: HashMap::new(),
        }
    }

    /// How many leading hashes of `hashes` the table says `addr` holds.
    pub fn leading_match(&self, addr: &str, hashes: &[u64]) -> usize {
        self.peers.get(addr).map_or(0, |lru| {
            hashes.iter().take_while(|h| lru.contains(h)).count()
        })
    }

    /// Records that `addr` computed (or hit) every block of `hashes`: they become its most recent.
    pub fn record(&mut self, addr: &str, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        let cap = self.blocks_per_peer;
        let lru = self
            .peers
            .entry(addr.to_owned())
            .or_insert_with(|| LruCache::new(cap));
        for h in hashes {
            lru.put(*h, ());
        }
    }

    /// Forgets `addr` (it left, or restarted with an empty cache).
    pub fn forget(&mut self, addr: &str) {
        self.peers.remove(addr);
    }
}

/// The index in `candidates` of the peer to use, or `None` when there is none.
///
/// `rr` is a counter the caller advances once per call (round-robin and tie-breaking without a
/// prefix). See the module doc for the rule.
pub fn choose(
    routing: Routing,
    candidates: &[Candidate<'_>],
    hashes: &[u64],
    table: &AffinityTable,
    rr: usize,
) -> Option<usize> {
    if candidates.is_empty() {
        return None;
    }
    let max_skew = match routing {
        Routing::RoundRobin => return Some(rr % candidates.len()),
        Routing::LeastWork => return Some(least_work(candidates, hashes, table, rr).0),
        Routing::PrefixAffinity { max_skew } => max_skew,
    };
    let least = candidates.iter().map(|c| c.in_flight).min()?;
    let eligible: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].in_flight <= least.saturating_add(max_skew))
        .collect();
    if hashes.is_empty() {
        // Nothing to be affine to: the least loaded, in turn.
        let lightest: Vec<usize> = eligible
            .into_iter()
            .filter(|&i| candidates[i].in_flight == least)
            .collect();
        return lightest.get(rr % lightest.len().max(1)).copied();
    }
    let matched: Vec<usize> = eligible
        .iter()
        .map(|&i| table.leading_match(candidates[i].addr, hashes))
        .collect();
    let best = matched.iter().copied().max().unwrap_or(0);
    let pool: Vec<usize> = if best > 0 && best * 2 >= hashes.len() {
        // A peer holds most of this request: it goes there (the lightest of those that do).
        let with_best: Vec<usize> = eligible
            .iter()
            .zip(&matched)
            .filter(|(_, m)| **m == best)
            .map(|(i, _)| *i)
            .collect();
        let lightest = with_best.iter().map(|&i| candidates[i].in_flight).min()?;
        with_best
            .into_iter()
            .filter(|&i| candidates[i].in_flight == lightest)
            .collect()
    } else {
        // A new prefix (what peers share is only its head, e.g. a common system prompt): place
        // it by the first block past the shared head, so that every decode worker sends this
        // session to the same peer, spread evenly over the eligible ones.
        eligible
    };
    let key = hashes[best.min(hashes.len() - 1)];
    pool.iter()
        .copied()
        .max_by_key(|&i| (rendezvous(key, candidates[i].addr), Reverse(i)))
}

/// [`Routing::LeastWork`]: the index of the peer with the least work before this request's KV
/// is ready, and the blocks of the request it will compute there.
///
/// Work on a peer, in blocks: its [`Candidate::pending_blocks`] plus the request's blocks past
/// the leading run the table says it holds — the cost the KV-aware router of NVIDIA Dynamo
/// scores peers by (blocks to prefill + blocks active), on Tandem's page keys. A held run counts
/// only when it is at least half the request (a session's next turn, as for
/// [`Routing::PrefixAffinity`]): a head every request shares (the conversation trace's first
/// block) would otherwise pull every new session onto the peers that served first, and away
/// from a peer that just joined. A session's next turn stays where its prefix is until another
/// peer's backlog is smaller than the prefix; a new prefix goes to the least-backlogged peer.
/// Ties: fewer rooms, the longer counted run, then rendezvous hashing of the first block past
/// the longest run any peer holds — decode workers whose tables agree on that run place a quiet
/// system's new sessions alike. Without hashes: fewest pending blocks, then fewest rooms, the
/// tied peers in turn (`rr`).
pub fn least_work(
    candidates: &[Candidate<'_>],
    hashes: &[u64],
    table: &AffinityTable,
    rr: usize,
) -> (usize, u64) {
    let blocks = hashes.len() as u64;
    let runs: Vec<usize> = candidates
        .iter()
        .map(|c| table.leading_match(c.addr, hashes))
        .collect();
    let longest = runs.iter().copied().max().unwrap_or(0);
    let held: Vec<usize> = runs
        .iter()
        .map(|&h| if h * 2 >= hashes.len() { h } else { 0 })
        .collect();
    let cost = |i: usize| {
        let c = &candidates[i];
        let own = blocks - held[i] as u64;
        (
            c.pending_blocks.saturating_add(own),
            c.in_flight,
            Reverse(held[i]),
        )
    };
    let Some(best) = (0..candidates.len()).map(cost).min() else {
        return (0, blocks);
    };
    let tied: Vec<usize> = (0..candidates.len()).filter(|&i| cost(i) == best).collect();
    let pick = match hashes.get(longest.min(hashes.len().saturating_sub(1))) {
        Some(&key) => tied
            .iter()
            .copied()
            .max_by_key(|&i| (rendezvous(key, candidates[i].addr), Reverse(i))),
        None => tied.get(rr % tied.len().max(1)).copied(),
    };
    pick.map_or((0, blocks), |i| (i, blocks - held[i] as u64))
}

/// Rendezvous (highest-random-weight) score of `addr` for the block hash `key`.
fn rendezvous(key: u64, addr: &str) -> u64 {
    xxh3_64_with_seed(addr.as_bytes(), key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers<'a>(loads: &[(&'a str, u32)]) -> Vec<Candidate<'a>> {
        loads
            .iter()
            .map(|&(addr, in_flight)| Candidate {
                addr,
                in_flight,
                pending_blocks: 0,
            })
            .collect()
    }

    const AFFINITY: Routing = Routing::PrefixAffinity { max_skew: 2 };
    const LEAST_WORK: Routing = Routing::LeastWork;

    fn loaded<'a>(loads: &[(&'a str, u32, u64)]) -> Vec<Candidate<'a>> {
        loads
            .iter()
            .map(|&(addr, in_flight, pending_blocks)| Candidate {
                addr,
                in_flight,
                pending_blocks,
            })
            .collect()
    }

    #[test]
    fn the_knob_parses_both_policies_and_refuses_the_rest() {
        assert_eq!(Routing::parse("round-robin"), Ok(Routing::RoundRobin));
        assert_eq!(Routing::default(), Routing::LeastWork);
        assert_eq!(Routing::parse("least-work"), Ok(Routing::LeastWork));
        assert_eq!(
            Routing::parse(" affinity "),
            Ok(Routing::PrefixAffinity {
                max_skew: DEFAULT_MAX_SKEW
            })
        );
        assert_eq!(
            Routing::parse("affinity:3"),
            Ok(Routing::PrefixAffinity { max_skew: 3 })
        );
        for r in [
            Routing::RoundRobin,
            Routing::LeastWork,
            Routing::PrefixAffinity { max_skew: 4 },
        ] {
            assert_eq!(Routing::parse(&r.to_string()), Ok(r), "round trip of {r}");
        }
        for bad in [
            "",
            "rr",
            "Affinity",
            "affinity:",
            "affinity:-1",
            "affinity:x",
            "round-robin:1",
            "least-work:1",
        ] {
            let e = Routing::parse(bad).unwrap_err();
            assert!(e.starts_with("TANDEM_DECODE_ROUTING="), "{e}");
            assert!(
                e.contains("least-work")
                    && e.contains("round-robin")
                    && e.contains("affinity:SKEW"),
                "{e}"
            );
        }
        assert_eq!(
            Routing::RoundRobin.report(),
            serde_json::json!({"policy": "round-robin"})
        );
        assert_eq!(
            Routing::LeastWork.report(),
            serde_json::json!({"policy": "least-work"})
        );
        assert_eq!(
            Routing::PrefixAffinity { max_skew: 1 }.report(),
            serde_json::json!({"policy": "affinity", "max_skew": 1})
        );
    }

    #[test]
    fn a_session_returns_to_the_peer_that_holds_its_prefix() {
        let c = peers(&[("a", 0), ("b", 0), ("c", 0)]);
        let mut t = AffinityTable::new(100);
        t.record("b", &[1, 2, 3]);
        for rr in 0..6 {
            assert_eq!(choose(AFFINITY, &c, &[1, 2, 3, 4], &t, rr), Some(1));
        }
        // Round-robin ignores it.
        let picks: Vec<_> = (0..3)
            .map(|rr| choose(Routing::RoundRobin, &c, &[1, 2, 3, 4], &t, rr))
            .collect();
        assert_eq!(picks, vec![Some(0), Some(1), Some(2)]);
    }

    #[test]
    fn the_longest_leading_run_wins_not_the_most_blocks() {
        let c = peers(&[("a", 0), ("b", 0)]);
        let mut t = AffinityTable::new(100);
        t.record("a", &[1, 2]);
        t.record("b", &[1, 3, 4, 5, 6]); // more blocks, but its run breaks at the second
        assert_eq!(choose(AFFINITY, &c, &[1, 2, 7], &t, 0), Some(0));
    }

    #[test]
    fn affinity_yields_to_load_beyond_the_skew() {
        let mut t = AffinityTable::new(100);
        t.record("a", &[1, 2, 3]);
        let within = peers(&[("a", 2), ("b", 0)]);
        assert_eq!(choose(AFFINITY, &within, &[1, 2, 3], &t, 0), Some(0));
        let beyond = peers(&[("a", 3), ("b", 0)]);
        assert_eq!(choose(AFFINITY, &beyond, &[1, 2, 3], &t, 0), Some(1));
    }

    #[test]
    fn without_a_known_prefix_the_least_loaded_peers_take_turns() {
        let t = AffinityTable::new(100);
        let c = peers(&[("a", 1), ("b", 0), ("c", 0)]);
        let picks: Vec<_> = (0..4).map(|rr| choose(AFFINITY, &c, &[], &t, rr)).collect();
        assert_eq!(picks, vec![Some(1), Some(2), Some(1), Some(2)]);
    }

    #[test]
    fn a_new_prefix_is_placed_by_rendezvous_hash_stable_under_peer_churn() {
        let t = AffinityTable::new(100);
        let three = peers(&[("a", 0), ("b", 0), ("c", 0)]);
        let first = |c: &[Candidate<'_>], h: u64| choose(AFFINITY, c, &[h, h + 1], &t, 0);
        let placed: Vec<_> = (0..64).map(|h| first(&three, h)).collect();
        // Every peer gets some prefixes.
        for i in 0..3 {
            assert!(
                placed.contains(&Some(i)),
                "peer {i} never chosen: {placed:?}"
            );
        }
        // Removing "c" moves only the prefixes that were on "c".
        let two = peers(&[("a", 0), ("b", 0)]);
        for h in 0..64 {
            let before = placed[h as usize].unwrap();
            let after = first(&two, h).unwrap();
            if before < 2 {
                assert_eq!(after, before, "prefix {h} moved off a peer that stayed");
            }
        }
    }

    #[test]
    fn a_head_every_peer_holds_does_not_pull_new_sessions_onto_one_peer() {
        // The conversation trace: every request starts with block 0.
        let c = peers(&[("a", 0), ("b", 0), ("c", 0)]);
        let mut t = AffinityTable::new(1000);
        t.record("a", &[0, 100, 101, 102]);
        t.record("b", &[0]);
        t.record("c", &[0]);
        let mut per_peer = [0; 3];
        for session in 0..90u64 {
            let i = choose(AFFINITY, &c, &[0, 1000 + session, 2000 + session], &t, 0).unwrap();
            per_peer[i] += 1;
        }
        assert!(per_peer.iter().all(|&n| n >= 15), "{per_peer:?}");
        // The next turn of the session that "a" holds still goes to "a".
        assert_eq!(
            choose(AFFINITY, &c, &[0, 100, 101, 102, 103], &t, 0),
            Some(0)
        );
    }

    #[test]
    fn the_table_is_bounded_per_peer_and_forgets_a_peer() {
        let mut t = AffinityTable::new(2);
        t.record("a", &[1, 2, 3]); // 1 is evicted
        assert_eq!(t.leading_match("a", &[2, 3]), 2);
        assert_eq!(t.leading_match("a", &[1, 2]), 0);
        t.forget("a");
        assert_eq!(t.leading_match("a", &[2, 3]), 0);
    }

    #[test]
    fn least_work_keeps_a_session_on_its_prefix_until_another_backlog_is_smaller() {
        let mut t = AffinityTable::new(100);
        t.record("b", &[1, 2, 3, 4, 5, 6]);
        let next_turn = [1, 2, 3, 4, 5, 6, 7, 8];
        // "b" holds 6 of 8 blocks: 2 to compute behind its backlog of 5 = 7, against 0 + 8 on "a".
        let c = loaded(&[("a", 0, 0), ("b", 2, 5)]);
        assert_eq!(choose(LEAST_WORK, &c, &next_turn, &t, 0), Some(1));
        assert_eq!(least_work(&c, &next_turn, &t, 0), (1, 2));
        // A backlog on "b" larger than the prefix saves: the idle peer computes it all.
        let c = loaded(&[("a", 0, 0), ("b", 1, 7)]);
        assert_eq!(least_work(&c, &next_turn, &t, 0), (0, 8));
        // Round-robin and affinity (skew 2, rooms) see none of it.
        assert_eq!(choose(AFFINITY, &c, &next_turn, &t, 0), Some(1));
    }

    #[test]
    fn least_work_sends_a_new_prefix_to_the_smallest_backlog_and_idle_ties_by_rendezvous() {
        let t = AffinityTable::new(100);
        let c = loaded(&[("a", 1, 9), ("b", 3, 4), ("c", 1, 6)]);
        // Blocks, not rooms: "b" has the most rooms and the least work.
        assert_eq!(choose(LEAST_WORK, &c, &[40, 41], &t, 0), Some(1));
        // Idle peers: the choice is the rendezvous one for the prefix, whatever the turn
        // counter, so two decode workers agree.
        let idle = loaded(&[("a", 0, 0), ("b", 0, 0), ("c", 0, 0)]);
        let mut seen = [0; 3];
        for h in 0..60u64 {
            let first = choose(LEAST_WORK, &idle, &[h, h + 1], &t, 0).unwrap();
            for rr in 1..4 {
                assert_eq!(choose(LEAST_WORK, &idle, &[h, h + 1], &t, rr), Some(first));
            }
            seen[first] += 1;
        }
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }

    #[test]
    fn least_work_without_hashes_takes_the_least_backlog_then_turns() {
        let t = AffinityTable::new(100);
        let c = loaded(&[("a", 1, 3), ("b", 0, 0), ("c", 0, 0)]);
        let picks: Vec<_> = (0..4)
            .map(|rr| choose(LEAST_WORK, &c, &[], &t, rr))
            .collect();
        assert_eq!(picks, vec![Some(1), Some(2), Some(1), Some(2)]);
        assert_eq!(least_work(&c, &[], &t, 0).1, 0);
    }

    #[test]
    fn least_work_does_not_pull_new_sessions_onto_the_peers_that_hold_a_shared_head() {
        // The conversation trace: every request starts with block 0. "d" joined and holds
        // nothing; a one-block head must not keep new sessions away from it.
        let c = peers(&[("a", 0), ("b", 0), ("c", 0), ("d", 0)]);
        let mut t = AffinityTable::new(1000);
        t.record("a", &[0, 100, 101, 102]);
        t.record("b", &[0]);
        t.record("c", &[0]);
        let mut per_peer = [0; 4];
        for session in 0..120u64 {
            let i = choose(LEAST_WORK, &c, &[0, 1000 + session, 2000 + session], &t, 0).unwrap();
            per_peer[i] += 1;
        }
        assert!(per_peer.iter().all(|&n| n >= 15), "{per_peer:?}");
        // The next turn of the session "a" holds still goes to "a".
        assert_eq!(
            least_work(&c, &[0, 100, 101, 102, 103], &t, 0),
            (0, 1),
            "a holds 4 of 5 blocks"
        );
    }

    #[test]
    fn no_candidates_no_choice() {
        let t = AffinityTable::new(1);
        assert_eq!(choose(AFFINITY, &[], &[1], &t, 0), None);
        assert_eq!(choose(Routing::RoundRobin, &[], &[1], &t, 0), None);
        assert_eq!(choose(LEAST_WORK, &[], &[1], &t, 0), None);
    }
}
