//! Pacing's metrics, by upstream (a scope is an account's hash: too many to label by).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
}

fn wait_histogram() -> Histogram {
    // 1 ms … ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The families, registered once with the process's other metrics.
#[derive(Clone)]
pub struct Metrics {
    waits: Family<UpstreamLabels, Histogram, fn() -> Histogram>,
    queued: Family<UpstreamLabels, Gauge>,
    paused: Family<UpstreamLabels, Gauge>,
    refused: Family<UpstreamLabels, Counter>,
    limited: Family<UpstreamLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            waits: Family::new_with_constructor(wait_histogram),
            queued: Family::default(),
            paused: Family::default(),
            refused: Family::default(),
            limited: Family::default(),
        }
    }
}

/// Lowers the queue gauge when a waiter leaves, however it leaves.
pub struct Queued(Gauge);

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "idemproxy_pace_wait_seconds",
            "Time requests waited for their turn in an account's rate-limit budget, by upstream",
            self.waits.clone(),
        );
        r.register(
            "idemproxy_pace_queued",
            "Requests waiting for their turn in a rate-limit budget now, by upstream",
            self.queued.clone(),
        );
        r.register(
            "idemproxy_pace_paused_scopes",
            "Accounts (credential scopes) the API paused with a 429 and Retry-After, now, by upstream",
            self.paused.clone(),
        );
        r.register(
            "idemproxy_pace_refused",
            "Requests refused 429 rate_limited because their turn would come after max_wait, by upstream",
            self.refused.clone(),
        );
        r.register(
            "idemproxy_upstream_rate_limited",
            "429 answers the API gave (another client on the account, or a limit tighter than the budget), by upstream",
            self.limited.clone(),
        );
    }

    fn labels(upstream: &str) -> UpstreamLabels {
        UpstreamLabels {
            upstream: upstream.to_owned(),
        }
    }

    pub(super) fn queued(&self, upstream: &str) -> Queued {
        let g = self.queued.get_or_create(&Self::labels(upstream)).clone();
        g.inc();
        Queued(g)
    }

    pub(super) fn waited(&self, upstream: &str, waited: Duration) {
        self.waits
            .get_or_create(&Self::labels(upstream))
            .observe(waited.as_secs_f64());
    }

    pub(super) fn refused(&self, upstream: &str) {
        self.refused.get_or_create(&Self::labels(upstream)).inc();
    }

    pub(super) fn limited(&self, upstream: &str) {
        self.limited.get_or_create(&Self::labels(upstream)).inc();
    }

    pub(super) fn paused(&self, upstream: &str, scopes: usize) {
        self.paused
            .get_or_create(&Self::labels(upstream))
            .set(scopes as i64);
    }
}
