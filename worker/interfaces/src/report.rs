//! The `/report` document every worker role serves on its health port (worker/interfaces/README.md
//! §4): readiness, the role's identity, its degradations and its monotonic counters.
//!
//! The counter names are defined once, by [`with_report_counters!`](crate::with_report_counters):
//! this module builds [`ReportCounters`] (what readers parse) from it and the worker builds its
//! Prometheus counters (`tandem_<name>_total` on `/metrics`) from the same list, so a name cannot
//! differ between what a worker serves and what e2e reads.

use serde::{Deserialize, Serialize};

/// Calls the macro `$callback` with every `/report` counter, in declaration order, as
/// `$(#[doc] name),*` — the one list of the counter names (worker/interfaces/README.md §4).
///
/// Each counter is a monotonic `u64` that starts at 0 when the worker process starts.
#[macro_export]
macro_rules! with_report_counters {
    ($callback:ident) => {
        $callback! {
            /// Requests answered successfully (decode: completions; prefill: rooms whose writes
            /// all landed).
            requests_ok,
            /// Requests that failed after admission.
            requests_failed,
            /// Requests whose client went away after admission (by stage:
            /// `tandem_requests_cancelled_by_reason_total{reason}`); their KV pages went to the
            /// release gate like any other ending's.
            requests_cancelled,
            /// Prompt tokens looked up in the prefix index.
            prefix_lookup_tokens,
            /// Prompt tokens served from the device pool (L1).
            prefix_hit_tokens_l1,
            /// Prompt tokens served from the host pool (L2).
            prefix_hit_tokens_l2,
            /// Prompt tokens served from the CacheTier store (L3).
            prefix_hit_tokens_l3,
            /// KV bytes whose writes completed (prefill).
            kv_bytes_sent,
            /// KV bytes received and verified (decode).
            kv_bytes_received,
            /// Rooms aborted (decode: failed rooms; prefill: aborts received; DESIGN contract 3).
            rooms_aborted,
            /// Abort acks (decode: received; prefill: sent).
            abort_acks,
            /// Pages put in quarantine (no ack, no proof) — an alarm when non-zero.
            pages_quarantined,
            /// KV chunks that failed verification on read — must stay 0.
            corrupt_pages_read,
            /// L3 objects loaded back into L2 at start (DESIGN contract 7).
            l3_pages_loaded_back,
            /// Pages written to the L3 store.
            l3_pages_written,
            /// Requests retried on another prefill peer after a peer failure.
            requests_retried,
            /// Prefill peers refused for another revision (one per refused handshake).
            peer_revision_refusals,
            /// Requests refused at admission (not ready, draining, no peer, capacity).
            requests_refused,
            /// Decode attempts aborted by the speculative-decoding guard (DESIGN contract 8).
            spec_guard_aborts,
            /// Attempts retried on another prefill peer after a spec-guard abort.
            spec_guard_retries,
            /// Snapshot syncs a decode started at the end of a turn (DESIGN contract 4, issue
            /// 15): one per finished turn with page keys, whatever the outcome.
            snapshot_sync_attempts,
            /// Snapshot syncs whose KV the prefill took: transferred, sealed, and finalized into its
            /// KV pool and prefix index or queued for finalize (decode).
            snapshot_sync_ok,
            /// Snapshot syncs refused with `snapshot-buf-full` (decode).
            snapshot_sync_failed_buf_full,
            /// Snapshot syncs refused with `alloc-failed`: the receive space was asked of the busy
            /// prefill KV pool (the NEGATIVE CONTROL of seed 002's old design only; decode).
            snapshot_sync_failed_alloc,
            /// Snapshot syncs whose writes did not all complete (aborted; decode).
            snapshot_sync_failed_transfer,
            /// Snapshot syncs that failed otherwise: no prefill peer, the peer's buffer disabled, a
            /// control call refused or lost (decode).
            snapshot_sync_failed_other,
            /// Snapshots granted slots in this prefill's snapshot buffer (prefill).
            snapshot_reserved,
            /// Snapshots finalized into this prefill's KV pool and prefix index (prefill).
            snapshot_finalized,
            /// `alloc-failed-on-finalize` answers: the KV pool was full at finalize and the snapshot
            /// waited in its slots (each a retry, not a loss; prefill).
            snapshot_alloc_failed_on_finalize,
            /// Stale snapshots evicted (least recently used first) to make room (prefill).
            snapshot_evicted,
            /// Snapshots aborted by their decode (prefill).
            snapshot_aborted,
            /// Prompt tokens of later turns served from pages a snapshot put in the prefix index
            /// (prefill; included in `prefix_hit_tokens_l2`).
            snapshot_hit_tokens,
            /// Rooms whose prompt hit at least one page a snapshot put in the prefix index
            /// (prefill).
            snapshot_hit_requests,
        }
    };
}

macro_rules! report_counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// The `counters` object of `/report`: every counter of
        /// [`with_report_counters!`](crate::with_report_counters). A counter missing from a
        /// document parses as 0 (an older worker, or a role that does not count it).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct ReportCounters {
            $($(#[$doc])* pub $name: u64,)*
        }

        /// The counter names, in declaration order: the keys of the `counters` object.
        pub const COUNTER_NAMES: &[&str] = &[$(stringify!($name)),*];

        impl ReportCounters {
            /// Field-wise sum (saturating).
            pub fn add(&mut self, o: &ReportCounters) {
                $(self.$name = self.$name.saturating_add(o.$name);)*
            }

            /// Some counter is lower than in `earlier`: the process started over.
            pub fn went_back_from(&self, earlier: &ReportCounters) -> bool {
                false $(|| self.$name < earlier.$name)*
            }

            /// The counter called `name`, `None` for a name that is not a counter.
            pub fn get(&self, name: &str) -> Option<u64> {
                match name {
                    $(stringify!($name) => Some(self.$name),)*
                    _ => None,
                }
            }

            /// Sets the counter called `name`; `false` (and no change) for a name that is not a
            /// counter.
            pub fn set(&mut self, name: &str, value: u64) -> bool {
                match name {
                    $(stringify!($name) => { self.$name = value; true })*
                    _ => false,
                }
            }
        }
    };
}

with_report_counters!(report_counters);

/// Why a component runs degraded (seed 000: a fallback to L2 must be visible in the report, not
/// only in a log line; DESIGN contract 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DegradedReason {
    /// Component, e.g. `l3/draft`.
    pub component: String,
    /// Machine-readable reason code, e.g. `RegistrationFallbackToL2`.
    pub code: String,
    /// Human-readable detail (the error chain).
    pub message: String,
}

/// [`DegradedReason::component`] of a cache replica's store volume (issue 18 item 5).
pub const DEGRADED_COMPONENT_L3_VOLUME: &str = "l3/volume";
/// [`DegradedReason::code`] of a cache replica whose store volume is full: the latest put that
/// wrote to disk was refused (`ENOSPC`, `EDQUOT` or `EFBIG`) and none was stored since; reads keep
/// serving. The operator reports it as the CacheTier's `Degraded=True, StoreVolumeFull`.
pub const DEGRADED_VOLUME_FULL: &str = "VolumeFull";

/// Where a serving process is in its life, as `/report` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportPhase {
    /// Not admitting yet (`reason` says what it waits for).
    Starting,
    /// Admitting requests.
    Ready,
    /// SIGTERM received: admission stopped for good, in-flight work finishing.
    Draining,
}

/// A worker's `/report` body (worker/interfaces/README.md §4). Readers ignore fields they do not
/// know: a role adds its own (decode: `routing`, `peers`, `refused_peers`, `kv_pages`, `spec_guard`), and
/// every field has a default so an older or partial document still parses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerReport {
    /// Admitting work (`phase == ready`).
    pub ready: bool,
    /// `prefill`, `decode`, `cache` or `store-client`.
    pub role: String,
    /// Pool (or tier) name.
    pub pool: String,
    /// Revision the worker runs (empty for tiers and sidecars).
    pub revision: String,
    /// Components running degraded, in the order they degraded.
    pub degraded: Vec<DegradedReason>,
    /// Cumulative counters.
    pub counters: ReportCounters,
    /// Life phase; absent in documents of workers that predate it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<ReportPhase>,
    /// Why not ready (`null` when ready).
    pub reason: Option<String>,
    /// Cache replicas: loadback finished (DESIGN contract 7; warming is not unready).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm: Option<bool>,
    /// Cache replicas: objects held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objects: Option<u64>,
    /// Cache replicas: bytes held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Prefill and decode workers: the engine seat as the worker reports it (`{"kind": "builtin"}`,
    /// or the engine API's attach, pools, rooms, registration, a prefill's `tiers` and the
    /// simulated engine's `engine_summary`; README §4), kept as sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<serde_json::Value>,
    /// Decode workers: the routing policy over prefill peers in use (`{"policy": "least-work"}`,
    /// `{"policy": "round-robin"}` or `{"policy": "affinity", "max_skew": N}`;
    /// `TANDEM_DECODE_ROUTING`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_keys_and_missing_counters_are_zero() {
        let r: WorkerReport = serde_json::from_str(
            r#"{"ready":true,"role":"cache","pool":"t","revision":"r","degraded":[],
                "counters":{"l3_pages_written":5},"warm":true,"objects":3,"bytes":9,
                "peers":["ignored"]}"#,
        )
        .unwrap();
        assert_eq!(r.counters.l3_pages_written, 5);
        assert_eq!(r.counters.corrupt_pages_read, 0);
        assert_eq!(r.warm, Some(true));
        assert_eq!(r.phase, None);
        let v = serde_json::to_value(ReportCounters::default()).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut names = COUNTER_NAMES.to_vec();
        names.sort_unstable();
        assert_eq!(keys, names);
        assert_eq!(COUNTER_NAMES.len(), 33);
        assert_eq!(COUNTER_NAMES[0], "requests_ok");
    }

    #[test]
    fn get_set_add_and_going_back() {
        let mut a = ReportCounters::default();
        assert!(a.set("kv_bytes_sent", 10));
        assert!(!a.set("no_such_counter", 1));
        assert_eq!(a.get("kv_bytes_sent"), Some(10));
        assert_eq!(a.get("no_such_counter"), None);
        let mut b = a;
        b.add(&a);
        assert_eq!(b.kv_bytes_sent, 20);
        assert!(a.went_back_from(&b));
        assert!(!b.went_back_from(&a));
        b.kv_bytes_sent = u64::MAX;
        b.add(&a);
        assert_eq!(b.kv_bytes_sent, u64::MAX, "saturating");
    }

    #[test]
    fn phase_and_cache_fields_serialise_only_when_set() {
        let doc = serde_json::to_value(WorkerReport {
            phase: Some(ReportPhase::Draining),
            ..WorkerReport::default()
        })
        .unwrap();
        assert_eq!(doc["phase"], "draining");
        assert!(doc["reason"].is_null() && doc.get("reason").is_some());
        assert!(doc.get("warm").is_none() && doc.get("objects").is_none());
    }
}
