//! The serving counters of one worker: one set of monotonic `u64`s, exported both as the
//! `counters` object of `/report` (INTERFACES §4, exact names) and as Prometheus counters
//! `tandem_<name>_total` on `/metrics`; plus [`ReasonCounters`], counters labelled by a reason code
//! (`tandem_<name>_total{reason="…"}`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Monotonic counters; cheap to clone (every field shares its atomic).
        #[derive(Debug, Clone, Default)]
        pub struct Counters {
            $($(#[$doc])* pub $name: Counter,)*
        }

        impl Counters {
            /// `(name, value)` of every counter, in declaration order (the `/report` names).
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.get()),)*]
            }

            /// Registers every counter as `tandem_<name>` (the text encoder appends `_total`).
            pub fn register(&self, registry: &mut Registry) {
                $(registry.register(
                    concat!("tandem_", stringify!($name)),
                    stringify!($name),
                    self.$name.clone(),
                );)*
            }
        }
    };
}

counters! {
    /// Requests answered successfully (decode: completions; prefill: rooms whose writes all landed).
    requests_ok,
    /// Requests that failed after admission.
    requests_failed,
    /// Requests whose client went away after admission (by stage:
    /// `tandem_requests_cancelled_by_reason_total{reason}`); their KV pages went to the release
    /// gate like any other ending's.
    requests_cancelled,
    /// Prompt tokens looked up in the prefix index.
    prefix_lookup_tokens,
    /// Prompt tokens served from the device pool.
    prefix_hit_tokens_l1,
    /// Prompt tokens served from the host pool.
    prefix_hit_tokens_l2,
    /// Prompt tokens served from the CacheTier store.
    prefix_hit_tokens_l3,
    /// KV bytes whose writes completed (prefill).
    kv_bytes_sent,
    /// KV bytes received and verified (decode).
    kv_bytes_received,
    /// Rooms aborted (decode: failed rooms; prefill: aborts received).
    rooms_aborted,
    /// Abort acks (decode: received; prefill: sent).
    abort_acks,
    /// Pages put in quarantine (no ack, no proof) — an alarm when non-zero.
    pages_quarantined,
    /// KV chunks that failed verification on read — must stay 0.
    corrupt_pages_read,
    /// L3 objects loaded back into L2 at start.
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
}

type ReasonFamily = Family<Vec<(String, String)>, Counter>;

/// Counters labelled by a stable reason code; cheap to clone (clones share their values).
#[derive(Debug, Clone, Default)]
pub struct ReasonCounters {
    /// Spec-guard anomalies by reason (`low_accept_length`, `high_accept_rate`): Prometheus
    /// `tandem_spec_guard_anomalies_total{reason}`.
    pub spec_guard_anomalies: ReasonFamily,
    /// Cancelled requests by the stage their client left in (`prefill`, `decode`, `stream`):
    /// Prometheus `tandem_requests_cancelled_by_reason_total{reason}`.
    pub requests_cancelled: ReasonFamily,
}

fn reason(code: &str) -> Vec<(String, String)> {
    vec![("reason".to_owned(), code.to_owned())]
}

impl ReasonCounters {
    /// Counts one spec-guard anomaly of `code`.
    pub fn spec_guard_anomaly(&self, code: &str) {
        self.spec_guard_anomalies.get_or_create(&reason(code)).inc();
    }

    /// Spec-guard anomalies of `code` so far.
    pub fn spec_guard_anomalies_of(&self, code: &str) -> u64 {
        self.spec_guard_anomalies.get_or_create(&reason(code)).get()
    }

    /// Counts one cancelled request of stage `code`.
    pub fn request_cancelled(&self, code: &str) {
        self.requests_cancelled.get_or_create(&reason(code)).inc();
    }

    /// Cancelled requests of stage `code` so far.
    pub fn requests_cancelled_of(&self, code: &str) -> u64 {
        self.requests_cancelled.get_or_create(&reason(code)).get()
    }

    /// Registers every family as `tandem_<name>` (the text encoder appends `_total`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tandem_spec_guard_anomalies",
            "spec_guard anomalies by reason",
            self.spec_guard_anomalies.clone(),
        );
        registry.register(
            "tandem_requests_cancelled_by_reason",
            "requests whose client went away, by the stage it left in",
            self.requests_cancelled.clone(),
        );
    }
}

/// Sets a counter that mirrors a monotonic source (e.g. a node's own atomic) to `value`; a smaller
/// value is ignored, so the exported counter never goes back.
pub fn mirror(counter: &Counter, value: u64) {
    let now = counter.get();
    if value > now {
        counter.inc_by(value - now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_match_the_report_contract_and_metrics_encode() {
        let c = Counters::default();
        c.requests_ok.inc();
        mirror(&c.kv_bytes_sent, 10);
        mirror(&c.kv_bytes_sent, 4);
        let snap: std::collections::BTreeMap<_, _> = c.snapshot().into_iter().collect();
        for name in [
            "requests_ok",
            "requests_failed",
            "prefix_lookup_tokens",
            "prefix_hit_tokens_l1",
            "prefix_hit_tokens_l2",
            "prefix_hit_tokens_l3",
            "kv_bytes_sent",
            "kv_bytes_received",
            "rooms_aborted",
            "abort_acks",
            "pages_quarantined",
            "corrupt_pages_read",
            "l3_pages_loaded_back",
            "l3_pages_written",
            "requests_cancelled",
        ] {
            assert!(snap.contains_key(name), "{name}");
        }
        assert_eq!(snap["requests_ok"], 1);
        assert_eq!(snap["kv_bytes_sent"], 10);
        let mut reg = Registry::default();
        c.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(text.contains("tandem_requests_ok_total 1"), "{text}");

        let r = ReasonCounters::default();
        r.spec_guard_anomaly("low_accept_length");
        r.spec_guard_anomaly("low_accept_length");
        assert_eq!(r.spec_guard_anomalies_of("low_accept_length"), 2);
        let mut reg = Registry::default();
        r.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains(r#"tandem_spec_guard_anomalies_total{reason="low_accept_length"} 2"#),
            "{text}"
        );
        r.request_cancelled("prefill");
        assert_eq!(r.requests_cancelled_of("prefill"), 1);
        let mut reg = Registry::default();
        r.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains(r#"tandem_requests_cancelled_by_reason_total{reason="prefill"} 1"#),
            "{text}"
        );
    }
}
