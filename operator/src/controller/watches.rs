//! Watches that say when they fail: each watch the controllers run is wrapped so that an error is
//! logged as a warning with the delay before its retry, recorded in [`WatchHealth`] (which
//! `/readyz` and the `tandem_operator_watches_failing` gauge report), and retried along the
//! per-watch [`backoff::WATCH`] curve (250 ms doubling to at most 5 s, reset by the next event).
//!
//! The errors are consumed here: the controllers' trigger streams only see events, so one failing
//! watch (a kind whose CRD was deleted) does not pause the others of its controller, and a watch
//! whose CRD comes back relists within one capped delay (found on the live stack: with the
//! runtime's shared trigger backoff and errors logged at debug, re-created kinds went
//! unreconciled for minutes while `/readyz` said 200).
//!
//! [`WatchHealth`] also records which watches have completed their first list (the watcher's
//! `InitDone`): when the last of the watches built so far has listed, the operator logs
//! `all watches listed` once (info), with their number. Until then the controllers may still
//! miss objects of a kind; the chart's e2e suite waits on that line before it reads the log for
//! refused (403) calls.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::runtime::watcher;
use prometheus_client::metrics::gauge::Gauge;

use super::backoff::{self, Exponential};

/// One failing watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failing {
    /// When its current run of failures began.
    pub since: Instant,
    /// Consecutive failures.
    pub failures: u32,
    /// The last error.
    pub error: String,
    /// The delay before the next retry.
    pub retry_in: Duration,
}

/// The lists of the watches: which were built, which have listed, which are (re)listing now,
/// and whether the `all watches listed` line was logged.
#[derive(Debug, Default)]
struct Lists {
    built: BTreeSet<String>,
    listed: BTreeSet<String>,
    listing: BTreeSet<String>,
    announced: bool,
}

/// Which watches are failing now, by name (e.g. `DecodePool: prefillpools`), and which have
/// completed their first list. Shared between the controllers (writers) and the health endpoint
/// (reader).
#[derive(Debug, Clone, Default)]
pub struct WatchHealth {
    failing: Arc<Mutex<BTreeMap<String, Failing>>>,
    lists: Arc<Mutex<Lists>>,
    gauge: Option<Gauge>,
}

impl WatchHealth {
    /// A registry that also keeps `gauge` at the number of failing watches.
    pub fn with_gauge(gauge: Gauge) -> Self {
        Self {
            failing: Arc::default(),
            lists: Arc::default(),
            gauge: Some(gauge),
        }
    }

    fn count(&self, n: usize) {
        if let Some(g) = &self.gauge {
            g.set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Records a failure of `watch`.
    pub fn failed(&self, watch: &str, error: &str, failures: u32, retry_in: Duration) {
        if let Ok(mut m) = self.failing.lock() {
            let since = m.get(watch).map_or_else(Instant::now, |f| f.since);
            m.insert(
                watch.to_owned(),
                Failing {
                    since,
                    failures,
                    error: error.to_owned(),
                    retry_in,
                },
            );
            self.count(m.len());
        }
    }

    /// Records that `watch` delivered an event; returns its run of failures, if it had one.
    pub fn recovered(&self, watch: &str) -> Option<Failing> {
        let mut m = self.failing.lock().ok()?;
        let was = m.remove(watch);
        self.count(m.len());
        was
    }

    /// Records that `watch` was built: [`WatchHealth::all_listed`] waits for its first list too.
    pub fn built(&self, watch: &str) {
        if let Ok(mut l) = self.lists.lock() {
            l.built.insert(watch.to_owned());
            l.listing.insert(watch.to_owned());
        }
    }

    /// Records that `watch` started a (re)list (its `Init`): until its `InitDone` its store holds
    /// the previous state.
    pub fn listing(&self, watch: &str) {
        if let Ok(mut l) = self.lists.lock() {
            l.listing.insert(watch.to_owned());
        }
    }

    /// Whether every built watch is streaming: none failing, none (re)listing. While one is not,
    /// its store may be frozen or behind, and reconciles read from the API server instead
    /// (`Context::caches`).
    pub fn settled(&self) -> bool {
        let listing = self.lists.lock().map_or(true, |l| !l.listing.is_empty());
        let failing = self.failing.lock().map_or(true, |m| !m.is_empty());
        !listing && !failing
    }

    /// Records that `watch` completed a list (its `InitDone`); the first time every built watch
    /// has listed, logs `all watches listed` (info, with their number). Returns whether all have.
    pub fn listed(&self, watch: &str) -> bool {
        let Ok(mut l) = self.lists.lock() else {
            return false;
        };
        l.listing.remove(watch);
        if l.listed.insert(watch.to_owned()) {
            tracing::debug!(watch, "watch listed");
        }
        let all = l.built.is_subset(&l.listed);
        if all && !l.announced {
            l.announced = true;
            tracing::info!(watches = l.listed.len(), "all watches listed");
        }
        all
    }

    /// Whether every built watch has completed its first list (true when none was built).
    pub fn all_listed(&self) -> bool {
        self.lists
            .lock()
            .is_ok_and(|l| l.built.is_subset(&l.listed))
    }

    /// The failing watches, by name.
    pub fn failing(&self) -> Vec<(String, Failing)> {
        self.failing
            .lock()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// One line per failing watch, for `/readyz`; empty when all are healthy.
    pub fn report(&self) -> String {
        self.failing()
            .iter()
            .map(|(name, f)| {
                format!(
                    "watch {name} failing for {:.0}s ({} failures, retrying in {:.1}s): {}\n",
                    f.since.elapsed().as_secs_f64(),
                    f.failures,
                    f.retry_in.as_secs_f64(),
                    f.error
                )
            })
            .collect()
    }
}

/// Wraps a watch stream: errors are logged as warnings, recorded in `health` under `name` and
/// retried after the `policy` delay; events pass through (and clear the record).
pub fn resilient<T, S>(
    name: String,
    health: WatchHealth,
    policy: Exponential,
    stream: S,
) -> impl Stream<Item = Result<T, watcher::Error>> + Send + 'static
where
    T: Send + 'static,
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
{
    let state = (stream.boxed(), 0u32, name, health);
    futures::stream::unfold(
        state,
        move |(mut s, mut failures, name, health)| async move {
            loop {
                match s.next().await {
                    None => return None,
                    Some(Ok(item)) => {
                        if let Some(f) = health.recovered(&name) {
                            tracing::info!(
                                watch = %name,
                                failures = f.failures,
                                after_s = f.since.elapsed().as_secs_f64(),
                                "watch recovered"
                            );
                        }
                        return Some((Ok(item), (s, 0, name, health)));
                    }
                    Some(Err(e)) => {
                        failures = failures.saturating_add(1);
                        let retry_in = policy.delay(failures);
                        tracing::warn!(
                            watch = %name,
                            error = %e,
                            failures,
                            retry_in_s = retry_in.as_secs_f64(),
                            "watch failed; retrying"
                        );
                        health.failed(&name, &e.to_string(), failures, retry_in);
                        tokio::time::sleep(retry_in).await;
                    }
                }
            }
        },
    )
}

/// [`resilient`] with the [`backoff::WATCH`] curve, over a watcher's event stream: the watch is
/// recorded as built in `health` now, and as listed at its first `InitDone`.
pub fn watched<K, S>(
    name: String,
    health: &WatchHealth,
    stream: S,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    health.built(&name);
    let lists = (health.clone(), name.clone());
    let stream = stream.inspect(move |e| match e {
        Ok(watcher::Event::Init) => lists.0.listing(&lists.1),
        Ok(watcher::Event::InitDone) => {
            lists.0.listed(&lists.1);
        }
        _ => {}
    });
    resilient(name, health.clone(), backoff::WATCH, stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> watcher::Error {
        watcher::Error::NoResourceVersion
    }

    /// `all_listed` turns true only at the `InitDone` of the last built watch: the start and the
    /// objects of a list do not count.
    #[tokio::test]
    async fn all_listed_waits_for_the_init_done_of_every_built_watch() {
        use watcher::Event;
        let health = WatchHealth::default();
        assert!(health.all_listed(), "no watch built: nothing to wait for");
        let (tx_a, rx_a) =
            futures::channel::mpsc::unbounded::<Result<Event<u32>, watcher::Error>>();
        let (tx_b, rx_b) =
            futures::channel::mpsc::unbounded::<Result<Event<u32>, watcher::Error>>();
        let mut a = Box::pin(watched("t: a".into(), &health, rx_a));
        let mut b = Box::pin(watched("t: b".into(), &health, rx_b));
        assert!(!health.all_listed(), "two built, none listed");
        for e in [Event::Init, Event::InitApply(1), Event::InitDone] {
            tx_a.unbounded_send(Ok(e)).unwrap();
            assert!(a.next().await.is_some_and(|r| r.is_ok()));
        }
        assert!(!health.all_listed(), "b has not listed");
        tx_b.unbounded_send(Ok(Event::Init)).unwrap();
        tx_b.unbounded_send(Ok(Event::InitApply(2))).unwrap();
        for _ in 0..2 {
            assert!(b.next().await.is_some_and(|r| r.is_ok()));
        }
        assert!(
            !health.all_listed(),
            "b's list is not done before its InitDone"
        );
        tx_b.unbounded_send(Ok(Event::InitDone)).unwrap();
        assert!(b.next().await.is_some_and(|r| r.is_ok()));
        assert!(health.all_listed(), "both listed");
    }

    /// Three failures, then an event: the stream yields only the event, after the three capped
    /// delays; health says failing in between and healthy after.
    #[tokio::test]
    async fn errors_are_retried_with_backoff_and_reported_until_an_event() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<u32, watcher::Error>>();
        let health = WatchHealth::default();
        let policy = Exponential {
            base: Duration::from_millis(20),
            cap: Duration::from_millis(40),
        };
        let mut s = Box::pin(resilient("t: things".into(), health.clone(), policy, rx));
        for _ in 0..3 {
            tx.unbounded_send(Err(failure())).unwrap();
        }
        let started = Instant::now();
        let next = tokio::spawn(async move { s.next().await.map(|r| r.is_ok()) });
        // The stream takes the three errors (bounded wait on the observed record).
        let seen_three = tokio::time::timeout(Duration::from_secs(10), async {
            while health.failing().first().is_none_or(|(_, f)| f.failures < 3) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(seen_three.is_ok(), "three failures recorded");
        let (name, f) = health.failing().remove(0);
        assert_eq!(name, "t: things");
        assert_eq!(f.retry_in, Duration::from_millis(40), "capped");
        assert!(
            health.report().contains("3 failures"),
            "{}",
            health.report()
        );
        tx.unbounded_send(Ok(7)).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), next).await;
        assert_eq!(
            got.unwrap().unwrap(),
            Some(true),
            "only the event comes out"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(20 + 40 + 40),
            "each failure waited its delay"
        );
        assert!(health.failing().is_empty(), "recovered");
        assert_eq!(health.report(), "");
    }
}
