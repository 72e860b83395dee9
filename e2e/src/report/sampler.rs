//! Periodic `GET http://<podIP>:8080/report` of every Tandem worker while a replay runs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

use super::workers::{Sample, WorkerReport};
use crate::replay::schedule::Clock;
use crate::replay::targets::ROLE_LABEL;

/// The health port of every worker role (`tandem_crds::ports`; worker/interfaces/README.md §2).
pub use tandem_crds::ports::HEALTH_PORT;

/// One worker to sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportTarget {
    /// Pod name (or the URL for fixed targets).
    pub pod: String,
    /// Pod uid (or the URL): keys incarnations.
    pub uid: String,
    /// `http://ip:port/report`.
    pub url: String,
}

/// Which workers to sample.
#[derive(Clone)]
pub enum ReportSource {
    /// A fixed list of `/report` URLs.
    Fixed(Vec<String>),
    /// Every pod with a `serving.tandem.dev/role` label in the namespace that has an IP.
    Kube {
        /// Client.
        client: kube::Client,
        /// Namespace of the stack.
        namespace: String,
    },
}

impl ReportSource {
    async fn targets(&self) -> Vec<ReportTarget> {
        match self {
            Self::Fixed(urls) => urls
                .iter()
                .map(|u| ReportTarget {
                    pod: u.clone(),
                    uid: u.clone(),
                    url: u.clone(),
                })
                .collect(),
            Self::Kube { client, namespace } => {
                let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
                match api.list(&ListParams::default().labels(ROLE_LABEL)).await {
                    Ok(list) => report_targets(&list.items),
                    Err(e) => {
                        tracing::warn!(error = %e, "listing worker pods for /report failed");
                        Vec::new()
                    }
                }
            }
        }
    }
}

/// `/report` targets of pods that have an IP and run (pure; a pod without uid or IP is skipped).
pub fn report_targets(pods: &[Pod]) -> Vec<ReportTarget> {
    pods.iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            Some(ReportTarget {
                pod: p.metadata.name.clone()?,
                uid: p.metadata.uid.clone()?,
                url: format!("http://{ip}:{HEALTH_PORT}/report"),
            })
        })
        .collect()
}

/// A running sampler; [`Sampler::stop`] ends it and returns what it gathered,
/// [`Sampler::finish`] after one more round.
pub struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    task: tokio::task::JoinHandle<()>,
    /// Rounds started and rounds completed so far.
    rounds: tokio::sync::watch::Receiver<(u64, u64)>,
    interval: Duration,
}

impl Sampler {
    /// Samples every target of `source` each `interval` (rounds start on the interval; a slow
    /// worker times out after the interval and is recorded as an error).
    pub fn start(source: ReportSource, interval: Duration, clock: Clock) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let out = samples.clone();
        let (rounds_tx, rounds) = tokio::sync::watch::channel((0u64, 0u64));
        let task = tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(interval.max(Duration::from_millis(200)))
                .build()
                .unwrap_or_default();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            for round in 0u64.. {
                tick.tick().await;
                rounds_tx.send_modify(|r| r.0 = round + 1);
                let targets = source.targets().await;
                let gets = targets.into_iter().map(|t| {
                    let http = http.clone();
                    async move { sample_one(&http, t, round, clock).await }
                });
                let batch = futures::future::join_all(gets).await;
                out.lock().unwrap_or_else(|e| e.into_inner()).extend(batch);
                rounds_tx.send_modify(|r| r.1 = round + 1);
            }
        });
        Self {
            samples,
            task,
            rounds,
            interval,
        }
    }

    /// Samples so far.
    pub fn snapshot(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until a round that started after this call has completed (so every worker's
    /// counters as they are now are in), then stops and returns every sample. The wait is bounded
    /// by three intervals plus a second (a round starts within one interval and each of its
    /// requests times out after one); past that it stops with what it has.
    pub async fn finish(self) -> Vec<Sample> {
        let started = self.rounds.borrow().0;
        let mut rounds = self.rounds.clone();
        let bound = self.interval * 3 + Duration::from_secs(1);
        let _ = tokio::time::timeout(bound, rounds.wait_for(|r| r.1 > started)).await;
        self.stop().await
    }

    /// Stops sampling and returns every sample.
    pub async fn stop(self) -> Vec<Sample> {
        self.task.abort();
        let _ = self.task.await;
        let mut s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *s)
    }
}

async fn sample_one(http: &reqwest::Client, t: ReportTarget, round: u64, clock: Clock) -> Sample {
    let got = async {
        let resp = http
            .get(&t.url)
            .send()
            .await
            .map_err(|e| format!("{e:#}"))?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| format!("{e:#}"))?;
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        serde_json::from_str::<WorkerReport>(&text).map_err(|e| format!("bad /report: {e}"))
    }
    .await;
    let (report, error) = match got {
        Ok(r) => (Some(r), None),
        Err(e) => (None, Some(e)),
    };
    Sample {
        round,
        t_ms: clock.ms(),
        pod: t.pod,
        uid: t.uid,
        report,
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `finish` returns only after a round that started after the call: its samples are later
    /// than the call (`stop` at that moment would return none of them).
    #[tokio::test]
    async fn finish_waits_for_a_round_that_started_after_the_call() {
        let clock = Clock::start();
        // Nothing listens on port 1: every GET fails at once, and each round records its error.
        let source = ReportSource::Fixed(vec!["http://127.0.0.1:1/report".into()]);
        let sampler = Sampler::start(source, Duration::from_millis(100), clock);
        let mut rounds = sampler.rounds.clone();
        let first = tokio::time::timeout(Duration::from_secs(5), rounds.wait_for(|r| r.1 >= 1));
        assert!(first.await.is_ok(), "a first round completes");
        let called = clock.ms();
        let samples = sampler.finish().await;
        assert!(
            samples
                .iter()
                .any(|s| s.t_ms >= called && s.error.is_some()),
            "no sample after the call: {:?}",
            samples
                .iter()
                .map(|s| (s.round, s.t_ms))
                .collect::<Vec<_>>()
        );
    }
}
