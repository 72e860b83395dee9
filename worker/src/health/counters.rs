//! The serving counters of one worker: one set of monotonic `u64`s, exported both as the
//! `counters` object of `/report` (worker/interfaces/README.md §4; the names and their docs are
//! `tandem_interfaces::with_report_counters!`, the one list) and as Prometheus counters
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

            /// The values now, as the `counters` object of `/report`.
            pub fn report(&self) -> tandem_interfaces::report::ReportCounters {
                tandem_interfaces::report::ReportCounters {
                    $($name: self.$name.get(),)*
                }
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

tandem_interfaces::with_report_counters!(counters);

impl Counters {
    /// One prefill's open-time prefix lookup of a request of `input_tokens` prompt tokens:
    /// `hit_l2`/`hit_l3` tokens hit, of which `snapshot_tokens` in pages a snapshot added (L2;
    /// `snapshot_hit_requests` counts the lookup when non-zero). The one rule for the built-in
    /// prefix cache and an engine's host tiers.
    pub fn record_prefix_lookup(
        &self,
        input_tokens: u64,
        hit_l2: u64,
        hit_l3: u64,
        snapshot_tokens: u64,
    ) {
        if snapshot_tokens > 0 {
            self.snapshot_hit_tokens.inc_by(snapshot_tokens);
            self.snapshot_hit_requests.inc();
        }
        self.prefix_lookup_tokens.inc_by(input_tokens);
        self.prefix_hit_tokens_l2.inc_by(hit_l2);
        self.prefix_hit_tokens_l3.inc_by(hit_l3);
    }
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
