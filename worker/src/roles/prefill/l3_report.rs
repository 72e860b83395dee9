//! The prefill's view of its store replicas on `/report` (the `l3` section) and `/metrics`
//! (issue 18 item 4): per-replica write rates and ramp weights, and reattach times, from the
//! writer's [`ReplicaBook`].
//!
//! `/metrics` (gauges, refreshed per scrape):
//! - `tandem_l3_replica_writes_per_second{replica}` and
//!   `tandem_l3_replica_write_bytes_per_second{replica}`: stored writes over the rate window;
//! - `tandem_l3_replica_write_weight{replica}`: the placement weight (below 1 while a replica
//!   that attached empty ramps);
//! - `tandem_l3_reattach_seconds`: the last outage's length, first failed call (or a replica
//!   leaving the resolved set) to the next attachment; `tandem_l3_reattaches`: how many.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use crate::l3::replicas::ReplicaBook;

type Labels = Vec<(String, String)>;
type F64Gauge = Gauge<f64, AtomicU64>;

/// The gauges; cheap to clone (shared atomics). Created before the serve state so that
/// [`L3Metrics::register`] can run in its registry builder.
#[derive(Debug, Clone, Default)]
pub struct L3Metrics {
    writes_per_s: Family<Labels, F64Gauge>,
    bytes_per_s: Family<Labels, F64Gauge>,
    weight: Family<Labels, F64Gauge>,
    reattach_s: F64Gauge,
    reattaches: Gauge,
}

impl L3Metrics {
    /// Adds the gauges to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tandem_l3_replica_writes_per_second",
            "Writes each store replica stored for this worker, per second over the rate window",
            self.writes_per_s.clone(),
        );
        registry.register(
            "tandem_l3_replica_write_bytes_per_second",
            "Bytes each store replica stored for this worker, per second over the rate window",
            self.bytes_per_s.clone(),
        );
        registry.register(
            "tandem_l3_replica_write_weight",
            "Placement weight of each store replica (below 1 while one that attached empty ramps)",
            self.weight.clone(),
        );
        registry.register(
            "tandem_l3_reattach_seconds",
            "Length of the last L3 outage: first failed call to the next replica attachment",
            self.reattach_s.clone(),
        );
        registry.register(
            "tandem_l3_reattaches",
            "L3 outages ended by a replica (re)attaching",
            self.reattaches.clone(),
        );
    }

    /// Sets every gauge from `book` at `now` (replicas no longer in the book disappear).
    pub fn update(&self, book: &ReplicaBook, now: Instant) {
        self.writes_per_s.clear();
        self.bytes_per_s.clear();
        self.weight.clear();
        for r in book.report(now) {
            let l = vec![("replica".to_owned(), r.addr.to_string())];
            self.writes_per_s.get_or_create(&l).set(r.writes_per_s);
            self.bytes_per_s.get_or_create(&l).set(r.bytes_per_s);
            self.weight.get_or_create(&l).set(r.weight);
        }
        let (last, n) = book.reattach();
        if let Some(last) = last {
            self.reattach_s.set(last.outage_s);
        }
        self.reattaches.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// The `l3` section of `/report`: the knobs, one line per replica
/// ([`crate::l3::replicas::ReplicaReport`]), and `reattach` (`count`, `last`, `outage_for_s` of
/// an open outage).
pub fn section(book: &ReplicaBook, now: Instant) -> Value {
    let c = book.config();
    let (last, count) = book.reattach();
    json!({
        "write_ramp": {
            "enabled": c.ramp_enabled,
            "ramp_s": c.ramp.as_secs_f64(),
            "floor": c.ramp_floor,
        },
        "rate_window_s": c.rate_window.as_secs_f64(),
        "replicas": book.report(now),
        "reattach": {
            "count": count,
            "last": last,
            "outage_for_s": book.outage_for(now),
        },
    })
}
