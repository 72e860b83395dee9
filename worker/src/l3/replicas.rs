//! A writer's book of the store replicas it resolves (issue 18 item 4): the write ramp of a
//! replica that (re)joins empty, per-replica write rates, reconnect backoff, and reattachment
//! after an outage. Pure: every method takes the instant it acts at, so tests drive time.
//!
//! - **Write ramp** (kvcache-ai/Mooncake#3688: a restarted instance came back with empty DRAM and
//!   the master sent it nearly every new write; transfers timed out and TTFT rose for every
//!   instance). Hash placement alone would hand a replica that attaches empty (no object, nothing
//!   on disk to load back) the refill of every page it owns at once: its pages are the only
//!   misses, so they are the only pages written. Instead it keeps a fraction
//!   `floor + (1 − floor) · (t / ramp)^(n−1)` of a full replica's share of writes, `n` the
//!   replicas placed over ([`kept_fraction`]), turned into a placement weight for
//!   [`super::placement::weighted_owner`] ([`weight_for`]). The exponent is the bound's: with the
//!   refill spread evenly over the ramp, the replica keeps `1/n` of its refill on average and the
//!   other `n − 1` share the rest, so its write rate over the ramp matches the others' mean (a
//!   linear ramp keeps about half with 3 replicas: twice the others' rate).
//! - **Rates**: writes the replica stored (not the puts it answered "already present") and their
//!   bytes, over the last [`BookConfig::rate_window`].
//! - **Backoff**: a replica that refused a connection is left out of placement for a bounded,
//!   doubling delay ([`BookConfig::backoff_min`] … [`BookConfig::backoff_max`]), so a dead
//!   address still listed costs one connect per delay, not one per page.
//! - **Reattach** (kvcache-ai/Mooncake#2185, #3740: clients kept a store's old address, or took
//!   ~2 min to follow it): an outage starts at the first failed call or when a listed replica
//!   leaves the resolved set; it ends at the next (re)attachment of a replica, and its length is
//!   recorded. Addresses are re-resolved on every call by the caller, so a replica on a new address
//!   is attached at the first call placed on it.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Knobs of the book.
#[derive(Debug, Clone, PartialEq)]
pub struct BookConfig {
    /// Length of the write ramp of a replica that attached empty (default 60 s).
    pub ramp: Duration,
    /// Fraction of a full replica's share kept at the start of the ramp (default 0.02).
    pub ramp_floor: f64,
    /// Whether the ramp applies. Only the `negative-controls` build turns it off.
    pub ramp_enabled: bool,
    /// Window of the reported write rates (default 60 s).
    pub rate_window: Duration,
    /// First reconnect delay after a refused connection (default 100 ms).
    pub backoff_min: Duration,
    /// Longest reconnect delay (default 1 s).
    pub backoff_max: Duration,
}

impl Default for BookConfig {
    fn default() -> Self {
        Self {
            ramp: Duration::from_secs(60),
            ramp_floor: 0.02,
            ramp_enabled: true,
            rate_window: Duration::from_secs(60),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
        }
    }
}

/// One recorded reattachment.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Reattach {
    /// The replica attached.
    pub addr: SocketAddr,
    /// Seconds from the start of the outage (first failed call, or a replica leaving the
    /// resolved set) to this attachment.
    pub outage_s: f64,
    /// Seconds from this address first appearing in the resolved set to this attachment.
    pub since_listed_s: f64,
}

/// One replica's line of the report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplicaReport {
    /// Address.
    pub addr: SocketAddr,
    /// Placement weight now (1 outside a ramp).
    pub weight: f64,
    /// In its write ramp.
    pub ramping: bool,
    /// Left out of placement by reconnect backoff.
    pub backing_off: bool,
    /// Seconds since it last attached (`None`: never attached).
    pub attached_for_s: Option<f64>,
    /// Stored writes per second over the rate window.
    pub writes_per_s: f64,
    /// Stored bytes per second over the rate window.
    pub bytes_per_s: f64,
    /// Stored writes since this writer first saw it.
    pub writes: u64,
    /// Puts it answered "already present" since this writer first saw it.
    pub already_present: u64,
}

#[derive(Debug)]
struct Replica {
    listed: bool,
    listed_at: Instant,
    attached_at: Option<Instant>,
    ramp_from: Option<Instant>,
    failures: u32,
    down_until: Option<Instant>,
    window: VecDeque<(Instant, u64)>,
    writes: u64,
    already_present: u64,
}

/// The fraction of a full replica's share of writes a ramping replica keeps, `progress` (0 … 1) of
/// the way through its ramp, among `n` replicas: `floor + (1 − floor) · progress^(n−1)` (exponent
/// at least 1), 1 from the end of the ramp on. See the module docs for the exponent.
pub fn kept_fraction(progress: f64, floor: f64, n: usize) -> f64 {
    let floor = floor.clamp(0.0, 1.0);
    let p = if progress.is_nan() {
        0.0
    } else {
        progress.clamp(0.0, 1.0)
    };
    let k = n.saturating_sub(1).max(1) as f64;
    floor + (1.0 - floor) * p.powf(k)
}

/// The placement weight that gives one replica `kept` (0 … 1) of a full replica's share when the
/// other `n − 1` weigh 1: its share `w / (w + n − 1)` equals `kept / n`, so
/// `w = kept · (n − 1) / (n − kept)`. A sole replica weighs 1 (there is nowhere else to write).
pub fn weight_for(kept: f64, n: usize) -> f64 {
    if n <= 1 {
        return 1.0;
    }
    let (k, n) = (kept.clamp(0.0, 1.0), n as f64);
    k * (n - 1.0) / (n - k)
}

/// The book (see the module docs).
#[derive(Debug)]
pub struct ReplicaBook {
    config: BookConfig,
    replicas: HashMap<SocketAddr, Replica>,
    outage_since: Option<Instant>,
    last_reattach: Option<Reattach>,
    reattaches: u64,
}

impl ReplicaBook {
    /// An empty book.
    pub fn new(config: BookConfig) -> Self {
        Self {
            config,
            replicas: HashMap::new(),
            outage_since: None,
            last_reattach: None,
            reattaches: 0,
        }
    }

    /// The knobs.
    pub fn config(&self) -> &BookConfig {
        &self.config
    }

    /// Records the resolved set: new addresses are listed now; a listed address that is missing
    /// starts an outage. Entries unlisted and idle for a whole rate window are forgotten.
    pub fn observe_set(&mut self, addrs: &[SocketAddr], now: Instant) {
        for a in addrs {
            let r = self.replicas.entry(*a).or_insert_with(|| Replica {
                listed: false,
                listed_at: now,
                attached_at: None,
                ramp_from: None,
                failures: 0,
                down_until: None,
                window: VecDeque::new(),
                writes: 0,
                already_present: 0,
            });
            if !r.listed {
                r.listed = true;
                r.listed_at = now;
            }
        }
        let window = self.config.rate_window;
        let mut left = false;
        for (a, r) in &mut self.replicas {
            if r.listed && !addrs.contains(a) {
                r.listed = false;
                r.attached_at = None;
                left = true;
            }
        }
        if left {
            self.outage_since.get_or_insert(now);
        }
        self.replicas.retain(|_, r| {
            r.listed
                || r.window
                    .back()
                    .is_some_and(|(t, _)| now.saturating_duration_since(*t) < window)
        });
    }

    /// `addrs` that are not in reconnect backoff, with their placement weights.
    pub fn placeable(&self, addrs: &[SocketAddr], now: Instant) -> Vec<(SocketAddr, f64)> {
        let up: Vec<SocketAddr> = addrs
            .iter()
            .copied()
            .filter(|a| !self.backing_off(a, now))
            .collect();
        up.iter()
            .map(|a| (*a, self.weight(a, now, up.len())))
            .collect()
    }

    fn backing_off(&self, addr: &SocketAddr, now: Instant) -> bool {
        self.replicas
            .get(addr)
            .and_then(|r| r.down_until)
            .is_some_and(|t| now < t)
    }

    /// The placement weight of `addr` now among `n` placeable replicas: 1, or while it ramps
    /// [`weight_for`] of its [`kept_fraction`].
    pub fn weight(&self, addr: &SocketAddr, now: Instant, n: usize) -> f64 {
        let Some(from) = self.replicas.get(addr).and_then(|r| r.ramp_from) else {
            return 1.0;
        };
        let ramp = self.config.ramp.as_secs_f64();
        let progress = if ramp <= 0.0 {
            1.0
        } else {
            now.saturating_duration_since(from).as_secs_f64() / ramp
        };
        weight_for(kept_fraction(progress, self.config.ramp_floor, n), n)
    }

    /// A connection to `addr` was refused or timed out: it backs off (doubling, bounded), and an
    /// outage starts if none is open.
    pub fn connect_failed(&mut self, addr: SocketAddr, now: Instant) {
        self.outage_since.get_or_insert(now);
        let (min, max) = (self.config.backoff_min, self.config.backoff_max);
        if let Some(r) = self.replicas.get_mut(&addr) {
            r.failures = r.failures.saturating_add(1);
            let delay = min
                .saturating_mul(1u32 << (r.failures - 1).min(16))
                .min(max);
            r.down_until = Some(now + delay);
            r.attached_at = None;
        }
    }

    /// A call on an open connection to `addr` failed (the connection is dropped): an outage starts
    /// if none is open.
    pub fn call_failed(&mut self, addr: SocketAddr, now: Instant) {
        self.outage_since.get_or_insert(now);
        if let Some(r) = self.replicas.get_mut(&addr) {
            r.attached_at = None;
        }
    }

    /// A new connection to `addr` answered its health call; `empty` when the replica holds no
    /// object and has nothing on disk to load back. Ends the open outage (returning the
    /// reattachment), clears the backoff, and starts the write ramp when `empty`.
    pub fn attached(&mut self, addr: SocketAddr, empty: bool, now: Instant) -> Option<Reattach> {
        let ramp = self.config.ramp_enabled && empty;
        let r = self.replicas.get_mut(&addr)?;
        r.failures = 0;
        r.down_until = None;
        r.attached_at = Some(now);
        if ramp {
            r.ramp_from = Some(now);
        }
        let since_listed = now.saturating_duration_since(r.listed_at);
        let outage = self.outage_since.take()?;
        let event = Reattach {
            addr,
            outage_s: now.saturating_duration_since(outage).as_secs_f64(),
            since_listed_s: since_listed.as_secs_f64(),
        };
        self.reattaches += 1;
        self.last_reattach = Some(event.clone());
        Some(event)
    }

    /// A put to `addr` of `bytes` succeeded: `stored` when the replica wrote it, false when it
    /// answered "already present".
    pub fn put_done(&mut self, addr: SocketAddr, bytes: u64, stored: bool, now: Instant) {
        let window = self.config.rate_window;
        let Some(r) = self.replicas.get_mut(&addr) else {
            return;
        };
        if !stored {
            r.already_present += 1;
            return;
        }
        r.writes += 1;
        r.window.push_back((now, bytes));
        while r
            .window
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= window)
        {
            r.window.pop_front();
        }
    }

    /// Every listed replica (and unlisted ones still in the rate window), sorted by address.
    pub fn report(&self, now: Instant) -> Vec<ReplicaReport> {
        let window = self.config.rate_window;
        let secs = window.as_secs_f64().max(f64::MIN_POSITIVE);
        let listed = self.replicas.values().filter(|r| r.listed).count();
        let mut out: Vec<ReplicaReport> = self
            .replicas
            .iter()
            .map(|(addr, r)| {
                let (n, bytes) = r
                    .window
                    .iter()
                    .filter(|(t, _)| now.saturating_duration_since(*t) < window)
                    .fold((0u64, 0u64), |(n, b), (_, len)| (n + 1, b + len));
                let weight = self.weight(addr, now, listed);
                ReplicaReport {
                    addr: *addr,
                    weight,
                    ramping: weight < 1.0,
                    backing_off: self.backing_off(addr, now),
                    attached_for_s: r
                        .attached_at
                        .map(|t| now.saturating_duration_since(t).as_secs_f64()),
                    writes_per_s: n as f64 / secs,
                    bytes_per_s: bytes as f64 / secs,
                    writes: r.writes,
                    already_present: r.already_present,
                }
            })
            .collect();
        out.sort_by_key(|r| r.addr);
        out
    }

    /// The last reattachment and how many there were.
    pub fn reattach(&self) -> (Option<&Reattach>, u64) {
        (self.last_reattach.as_ref(), self.reattaches)
    }

    /// Seconds the open outage has lasted, if one is open.
    pub fn outage_for(&self, now: Instant) -> Option<f64> {
        self.outage_since
            .map(|t| now.saturating_duration_since(t).as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(i: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, i], 7420))
    }

    fn book() -> ReplicaBook {
        ReplicaBook::new(BookConfig {
            ramp: Duration::from_secs(10),
            rate_window: Duration::from_secs(10),
            ..BookConfig::default()
        })
    }

    #[test]
    fn an_empty_attachment_ramps_and_a_full_one_does_not() {
        let (mut b, t) = (book(), Instant::now());
        b.observe_set(&[a(1), a(2)], t);
        assert_eq!(
            b.attached(a(1), false, t),
            None,
            "no outage open: no reattach"
        );
        b.attached(a(2), true, t);
        assert_eq!(b.weight(&a(1), t, 3), 1.0);
        // Three replicas: kept 0.02 + 0.98 · p², weight kept · 2 / (3 − kept).
        let w0 = b.weight(&a(2), t, 3);
        assert!((w0 - 0.02 * 2.0 / 2.98).abs() < 1e-9, "{w0}");
        let mid = b.weight(&a(2), t + Duration::from_secs(5), 3);
        let kept = 0.02 + 0.98 * 0.25;
        assert!((mid - kept * 2.0 / (3.0 - kept)).abs() < 1e-9, "{mid}");
        assert_eq!(b.weight(&a(2), t + Duration::from_secs(11), 3), 1.0);
        assert_eq!(
            b.weight(&a(2), t, 1),
            1.0,
            "a sole replica takes every write"
        );
        let mut off = ReplicaBook::new(BookConfig {
            ramp_enabled: false,
            ..BookConfig::default()
        });
        off.observe_set(&[a(2)], t);
        off.attached(a(2), true, t);
        assert_eq!(off.weight(&a(2), t, 3), 1.0, "ramp off");
    }

    #[test]
    fn the_kept_fraction_averages_one_nth_over_the_ramp() {
        for n in 2..=6 {
            let steps = 10_000;
            let mean = (0..steps)
                .map(|i| kept_fraction((i as f64 + 0.5) / steps as f64, 0.0, n))
                .sum::<f64>()
                / steps as f64;
            assert!((mean - 1.0 / n as f64).abs() < 1e-3, "n={n}: {mean}");
            // The weight gives exactly that fraction of a full replica's share w / (w + n − 1).
            let k = 0.3;
            let w = weight_for(k, n);
            let share = w / (w + n as f64 - 1.0);
            assert!((share - k / n as f64).abs() < 1e-12, "n={n}");
        }
        assert_eq!(kept_fraction(2.0, 0.02, 3), 1.0);
        assert_eq!(kept_fraction(f64::NAN, 0.02, 3), 0.02);
        assert_eq!(weight_for(1.0, 4), 1.0);
    }

    #[test]
    fn refused_connections_back_off_doubling_to_the_cap() {
        let (mut b, t) = (book(), Instant::now());
        b.observe_set(&[a(1), a(2)], t);
        b.connect_failed(a(1), t);
        assert_eq!(b.placeable(&[a(1), a(2)], t), vec![(a(2), 1.0)]);
        let t1 = t + Duration::from_millis(100);
        assert_eq!(b.placeable(&[a(1), a(2)], t1).len(), 2, "100 ms later");
        for _ in 0..10 {
            b.connect_failed(a(1), t1);
        }
        assert!(
            b.placeable(&[a(1)], t1 + Duration::from_millis(999))
                .is_empty()
        );
        assert_eq!(
            b.placeable(&[a(1)], t1 + Duration::from_secs(1)).len(),
            1,
            "cap"
        );
        assert!(b.report(t1)[0].backing_off);
    }

    #[test]
    fn an_outage_ends_at_the_next_attachment_and_is_timed() {
        let (mut b, t) = (book(), Instant::now());
        b.observe_set(&[a(1), a(2)], t);
        b.attached(a(1), false, t);
        b.attached(a(2), false, t);
        // a(2) fails, then leaves; a(3) appears and attaches.
        b.call_failed(a(2), t + Duration::from_secs(1));
        b.observe_set(&[a(1)], t + Duration::from_secs(2));
        b.observe_set(&[a(1), a(3)], t + Duration::from_secs(3));
        let r = b
            .attached(a(3), false, t + Duration::from_millis(3500))
            .unwrap();
        assert_eq!(r.addr, a(3));
        assert!((r.outage_s - 2.5).abs() < 1e-9, "{r:?}");
        assert!((r.since_listed_s - 0.5).abs() < 1e-9, "{r:?}");
        assert_eq!(b.reattach().1, 1);
        assert_eq!(b.outage_for(t + Duration::from_secs(4)), None);
    }

    #[test]
    fn rates_count_stored_writes_in_the_window_only() {
        let (mut b, t) = (book(), Instant::now());
        b.observe_set(&[a(1)], t);
        for i in 0..20 {
            b.put_done(a(1), 1000, true, t + Duration::from_millis(500 * i));
        }
        b.put_done(a(1), 1000, false, t);
        let now = t + Duration::from_millis(9_999);
        let r = &b.report(now)[0];
        assert_eq!((r.writes, r.already_present), (20, 1));
        assert!((r.writes_per_s - 2.0).abs() < 1e-9, "{r:?}");
        assert!((r.bytes_per_s - 2000.0).abs() < 1e-9, "{r:?}");
        // 5 s later the first ten are out of the window.
        let r = &b.report(now + Duration::from_secs(5))[0];
        assert!((r.writes_per_s - 1.0).abs() < 1e-9, "{r:?}");
        // Unlisted and idle for a window: forgotten.
        b.observe_set(&[], t + Duration::from_secs(30));
        assert!(b.report(t + Duration::from_secs(30)).is_empty());
    }
}
