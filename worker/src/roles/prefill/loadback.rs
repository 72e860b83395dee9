//! The read streams of a prefill's restart loadback (DESIGN §5: "restart, load back from L3, admit
//! when CacheWarm"; issue 16 item 3).
//!
//! A restarted prefill admits no room until its loadback ends (or its deadline passes), so the
//! loadback is on the restart's critical path — and a rolling restart's, since the operator holds
//! the next group until this one is Ready. Reading one object per round trip over the one shared
//! connection per replica left the store's connection thread, the network and this side's copy
//! taking turns: about 40 pages/s on a loaded 2-core machine, so a full L2 ran into the 30 s
//! deadline (the demo's CI slice, stop 27). [`read_in_order`] keeps `streams` reads in flight,
//! each stream on its own connection per replica (the store serves each connection on its own
//! thread), and still hands the pages to the caller **in the order asked** — the most recently
//! used page is published last, so L2's LRU order after the loadback is the order before the
//! restart.
//!
//! Memory: a stream takes page `i` only while `i < delivered + 2 × streams`, so at most that many
//! objects wait between their read and their turn, however long one read stalls (a replica that
//! times out, the second replica tried).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::prefix_cache::PrefixCache;
use crate::l3::client::L3Client;
use crate::tier::PageKey;

/// Read streams of a loadback when `TANDEM_L3_LOADBACK_STREAMS` is unset.
pub const DEFAULT_STREAMS: usize = 4;
/// Most read streams one loadback opens (per replica, one connection each).
pub const MAX_STREAMS: usize = 32;

/// The read streams from `TANDEM_L3_LOADBACK_STREAMS` ([`parse_streams`]).
///
/// # Errors
/// As [`parse_streams`].
pub fn streams_from_env() -> Result<usize, String> {
    parse_streams(std::env::var("TANDEM_L3_LOADBACK_STREAMS").ok().as_deref())
}

/// The read streams a `TANDEM_L3_LOADBACK_STREAMS` value asks for: 1 to [`MAX_STREAMS`] (1 reads
/// one object at a time, as before this module); unset, [`DEFAULT_STREAMS`].
///
/// # Errors
/// A value other than a whole number in range, named (the worker refuses to start rather than
/// run with a setting it did not understand).
pub fn parse_streams(value: Option<&str>) -> Result<usize, String> {
    let Some(v) = value else {
        return Ok(DEFAULT_STREAMS);
    };
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_STREAMS).contains(&n) => Ok(n),
        _ => Err(format!(
            "TANDEM_L3_LOADBACK_STREAMS={v:?}: expected a whole number from 1 to {MAX_STREAMS}"
        )),
    }
}

/// One read stream's connections, one per replica it has read from (opened on first use,
/// dropped with the stream).
#[derive(Default)]
pub struct StreamConns(pub(super) HashMap<SocketAddr, L3Client>);

/// A page's read: its bytes, `Ok(None)` on a miss, or why no replica answered.
pub type PageRead = Result<Option<Vec<u8>>, String>;

/// How [`read_in_order`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    /// Reads handed to the sink (a prefix of the pages asked).
    pub pages: usize,
    /// Whether the deadline cut the loadback short.
    pub stopped_at_deadline: bool,
    /// Streams that ran (fewer than asked when there were fewer pages, or a thread could not
    /// start; 0 means the reads ran on the calling thread).
    pub streams: usize,
}

/// Reads the target-pool L3 objects of `pages` through `cache` with up to `streams` reads in
/// flight, and calls `sink(page, read)` for each, in the order of `pages`, on the calling
/// thread. No read starts at or after `deadline`, and no read is handed over after it: the sink
/// sees a prefix of `pages` ([`Delivered::pages`] long). The call returns once the reads in
/// flight at the deadline end (each bounded by the L3 client's connect and I/O timeouts).
/// Blocking: run it off the async workers.
pub fn read_in_order(
    cache: &PrefixCache,
    pages: &[PageKey],
    streams: usize,
    deadline: Instant,
    sink: impl FnMut(PageKey, PageRead),
) -> Delivered {
    read_with(
        pages,
        streams,
        deadline,
        |conns, page| cache.l3_get_on(conns, page),
        sink,
    )
}

/// Which page a stream may read next: `next` while it is below `delivered + window`.
struct Window {
    next: usize,
    delivered: usize,
    closed: bool,
}

fn guard(m: &Mutex<Window>) -> MutexGuard<'_, Window> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`read_in_order`] over any `read` (a test injects stalls).
fn read_with(
    pages: &[PageKey],
    streams: usize,
    deadline: Instant,
    read: impl Fn(&mut StreamConns, PageKey) -> PageRead + Sync,
    mut sink: impl FnMut(PageKey, PageRead),
) -> Delivered {
    let want = streams.clamp(1, MAX_STREAMS).min(pages.len());
    let window = 2 * want.max(1);
    let gate = Mutex::new(Window {
        next: 0,
        delivered: 0,
        closed: false,
    });
    let moved = Condvar::new();
    // The next page a stream may read; None: none left, the deadline passed, or the caller
    // stopped.
    let take = || -> Option<usize> {
        let mut w = guard(&gate);
        loop {
            let now = Instant::now();
            if w.closed || w.next >= pages.len() || now >= deadline {
                return None;
            }
            if w.next < w.delivered + window {
                w.next += 1;
                return Some(w.next - 1);
            }
            w = moved
                .wait_timeout(w, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    };
    let mut delivered = 0;
    let started = std::thread::scope(|s| {
        let (tx, rx) = mpsc::sync_channel::<(usize, PageRead)>(window);
        let mut started = 0;
        for n in 0..want {
            let (tx, take, read) = (tx.clone(), &take, &read);
            let stream = move || {
                let mut conns = StreamConns::default();
                while let Some(i) = take() {
                    // A closed receiver: the caller stopped at its deadline.
                    if tx.send((i, read(&mut conns, pages[i]))).is_err() {
                        return;
                    }
                }
            };
            match std::thread::Builder::new()
                .name(format!("l3-loadback-{n}"))
                .spawn_scoped(s, stream)
            {
                Ok(_) => started += 1,
                Err(e) => {
                    tracing::warn!(error = %e, streams = started, "cannot start another L3 loadback stream");
                    break;
                }
            }
        }
        drop(tx);
        if started == 0 {
            return 0;
        }
        let mut pending = BTreeMap::new();
        'receive: loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Ends when the deadline passes or every stream has returned (each holds a sender).
            let Ok((i, r)) = rx.recv_timeout(left) else {
                break;
            };
            pending.insert(i, r);
            while let Some(r) = pending.remove(&delivered) {
                if Instant::now() >= deadline {
                    break 'receive;
                }
                sink(pages[delivered], r);
                delivered += 1;
            }
            guard(&gate).delivered = delivered;
            moved.notify_all();
        }
        // Streams waiting for the window return; one blocked on its send returns when `rx`
        // drops with this closure, and the scope joins them all.
        guard(&gate).closed = true;
        moved.notify_all();
        started
    });
    if started == 0 && !pages.is_empty() {
        // No thread could start: read here, one object at a time.
        let mut conns = StreamConns::default();
        for &page in pages {
            if Instant::now() >= deadline {
                break;
            }
            let r = read(&mut conns, page);
            if Instant::now() >= deadline {
                break;
            }
            sink(page, r);
            delivered += 1;
        }
    }
    Delivered {
        pages: delivered,
        stopped_at_deadline: delivered < pages.len(),
        streams: started,
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::config::WritePolicy;
    use crate::health::counters::Counters;
    use crate::l3::manifest::{ObjectKey, ShardCoords, StoreIdentity};
    use crate::l3::server::L3Server;
    use crate::l3::store::{L3Config, L3Store};
    use crate::memory::pool::{PoolLayout, PoolRole};
    use crate::model::{Attention, ModelIdentity};
    use crate::roles::prefill::prefix_cache::L3Target;
    use crate::roles::resolve::Resolver;

    const PAGE: usize = 2 * 4 * 32;

    fn identity() -> StoreIdentity {
        StoreIdentity {
            model: ModelIdentity {
                name: "t".into(),
                layers: 2,
                attention: Attention::Gqa {
                    kv_heads: 1,
                    head_dim: 8,
                },
                dtype_bytes: 2,
                row_extra_bytes: 0,
            },
            layout: PoolLayout::PageFirst,
            page_tokens: 4,
            tp_size: 1,
            cp_size: 1,
        }
    }

    fn cache(port: u16) -> PrefixCache {
        PrefixCache::new(
            64,
            Some(L3Target {
                service: "127.0.0.1".into(),
                port,
                shard: ShardCoords::whole(&identity()),
                write_policy: WritePolicy::WriteThrough,
            }),
            Resolver::System,
            Duration::ZERO,
            Counters::default(),
            Arc::new(|_| {}),
        )
    }

    /// A store on loopback holding pages 1..=n, page i filled with byte i.
    fn store(dir: &std::path::Path, n: u64) -> L3Server {
        let id = identity();
        let (store, warm) =
            L3Store::open(L3Config::new(dir.into(), id.clone(), 0, 1 << 20)).unwrap();
        warm.join();
        for i in 1..=n {
            let key = ObjectKey {
                page: PageKey::from_trace_id(i),
                pool: PoolRole::Target,
                shard: ShardCoords::whole(&id),
            };
            store.put(key, &[i as u8; PAGE]).unwrap();
        }
        L3Server::start(store, SocketAddr::from(([127, 0, 0, 1], 0))).unwrap()
    }

    /// Reads finish out of order across the streams, yet the sink sees every page in the order
    /// asked (L2's LRU order after a restart is the order before it), misses included.
    #[test]
    fn pages_reach_the_sink_in_the_order_asked() {
        let dir = tempfile::tempdir().unwrap();
        let server = store(dir.path(), 40);
        let cache = cache(server.local_addr().port());
        // Newest first as the store lists them, reversed; 41..=44 are absent (misses).
        let asked: Vec<PageKey> = (1..=44).rev().map(PageKey::from_trace_id).collect();
        let mut seen = Vec::new();
        let done = read_in_order(
            &cache,
            &asked,
            4,
            Instant::now() + Duration::from_secs(30),
            |p, r| {
                seen.push((p, r.unwrap().map(|b| (b.len(), b[0]))));
            },
        );
        assert_eq!(
            done,
            Delivered {
                pages: 44,
                stopped_at_deadline: false,
                streams: 4
            }
        );
        let expected: Vec<_> = asked
            .iter()
            .map(|p| {
                let id = p.as_u64();
                (*p, (1..=40).contains(&id).then_some((PAGE, id as u8)))
            })
            .collect();
        assert_eq!(seen.len(), expected.len());
        for (i, (got, want)) in seen.iter().zip(&expected).enumerate() {
            assert_eq!(got, want, "position {i}");
        }
    }

    /// One read stalls (the first page's replica times out): the other streams read ahead only
    /// within the window (2 × streams pages past the last page handed over), then wait; once
    /// the stalled read returns, every page reaches the sink in the order asked. Without the
    /// window the other streams would read all 8 other pages during the stall: the stalled read
    /// waits (at most 1 s) for that to happen, and the test fails if it did.
    #[test]
    fn a_stalled_read_holds_the_others_within_the_window_and_the_order_holds() {
        use std::sync::Condvar;
        let asked: Vec<PageKey> = (1..=9).map(PageKey::from_trace_id).collect();
        let (streams, window) = (3, 6);
        let others = (Mutex::new(0usize), Condvar::new());
        let mut seen_by_stall = None;
        let seen_cell = Mutex::new(&mut seen_by_stall);
        let read = |_: &mut StreamConns, page: PageKey| -> PageRead {
            if page == asked[0] {
                let (n, cv) = (&others.0, &others.1);
                let g = n.lock().unwrap();
                let (g, _) = cv
                    .wait_timeout_while(g, Duration::from_secs(1), |n| *n < asked.len() - 1)
                    .unwrap();
                **seen_cell.lock().unwrap() = Some(*g);
            } else {
                *others.0.lock().unwrap() += 1;
                others.1.notify_all();
            }
            Ok(Some(page.as_u64().to_le_bytes().to_vec()))
        };
        let mut order = Vec::new();
        let done = read_with(
            &asked,
            streams,
            Instant::now() + Duration::from_secs(30),
            read,
            |p, r| {
                assert_eq!(r.unwrap().unwrap(), p.as_u64().to_le_bytes());
                order.push(p);
            },
        );
        assert_eq!(order, asked);
        assert!(!done.stopped_at_deadline && done.pages == 9, "{done:?}");
        assert_eq!(
            seen_by_stall,
            Some(window - 1),
            "pages read while the first one stalled (the window allows {})",
            window - 1
        );
    }

    /// A passed deadline starts no read and hands nothing over; an unreachable store answers
    /// every page with an error, in order, without hanging.
    #[test]
    fn a_passed_deadline_or_a_dead_store_ends_the_loadback_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut server = store(dir.path(), 8);
        let port = server.local_addr().port();
        let cache = cache(port);
        let asked: Vec<PageKey> = (1..=8).map(PageKey::from_trace_id).collect();
        let done = read_in_order(&cache, &asked, 4, Instant::now(), |_, _| {
            panic!("nothing is handed over past the deadline")
        });
        assert!(done.stopped_at_deadline && done.pages == 0, "{done:?}");

        server.stop();
        drop(server);
        let mut errors = 0;
        let done = read_in_order(
            &cache,
            &asked,
            4,
            Instant::now() + Duration::from_secs(30),
            |_, r| {
                errors += usize::from(r.is_err());
            },
        );
        assert_eq!((done.pages, errors), (8, 8), "{done:?}");
    }

    #[test]
    fn the_stream_count_is_bounded_and_a_bad_value_is_named() {
        assert_eq!(parse_streams(None), Ok(DEFAULT_STREAMS));
        assert_eq!(parse_streams(Some("1")), Ok(1));
        assert_eq!(parse_streams(Some(" 32 ")), Ok(32));
        for bad in ["0", "33", "four", ""] {
            let e = parse_streams(Some(bad)).unwrap_err();
            assert!(e.starts_with("TANDEM_L3_LOADBACK_STREAMS="), "{e}");
        }
    }
}
