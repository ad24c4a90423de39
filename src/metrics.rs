//! Metrics in Prometheus (OpenMetrics) text, shared by the pipeline, tests and `/metrics`.
//!
//! Requests by route and decision, replays, forwards, upstream latency and entity-lock wait
//! histograms, the in-flight and waiting gauges, store errors. Updating one is an atomic add
//! (plus a read-locked map look-up for labelled families) on the hot path.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ObservedLabels {
    route: String,
    would: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    route: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

type Histograms = Family<RouteLabels, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    // 1 ms … ~32 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Process-wide request metrics.
pub struct Stats {
    registry: Registry,
    protected: Counter,
    forwarded: Counter,
    replayed: Counter,
    store_errors: Counter,
    /// Stored answers met on the request path that could not be decrypted (refused `503`).
    decrypt_failures: Counter,
    audit_dropped: Counter,
    in_flight: Gauge,
    waiting: Gauge,
    /// Connections waiting for their next request with only the socket held.
    parked: Gauge,
    requests: Family<RequestLabels, Counter>,
    /// Observe mode: what enforce mode would have done.
    observed: Family<ObservedLabels, Counter>,
    reloads: Family<ResultLabels, Counter>,
    /// Reconcile reads by route and result (found, not_found, failed).
    reconciles: Family<ReconcileLabels, Counter>,
    upstream_seconds: Histograms,
    lock_wait_seconds: Histograms,
    /// Pacing at the APIs' rate limits (see [`crate::pace`]).
    pub pace: crate::pace::Metrics,
}

/// Decrements a gauge when dropped, so early returns and cancellations keep it right.
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    /// Raises `gauge` until the guard is dropped.
    pub fn up(gauge: Gauge) -> GaugeGuard {
        gauge.inc();
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Default for Stats {
    /// One piece on purpose: every family and its help text in one list, in the order
    /// `/metrics` serves them, so what the proxy exposes reads as one table.
    fn default() -> Self {
        let s = Stats {
            registry: Registry::default(),
            protected: Counter::default(),
            forwarded: Counter::default(),
            replayed: Counter::default(),
            store_errors: Counter::default(),
            decrypt_failures: Counter::default(),
            audit_dropped: Counter::default(),
            in_flight: Gauge::default(),
            waiting: Gauge::default(),
            parked: Gauge::default(),
            requests: Family::default(),
            observed: Family::default(),
            reloads: Family::default(),
            reconciles: Family::default(),
            upstream_seconds: Family::new_with_constructor(seconds_histogram),
            lock_wait_seconds: Family::new_with_constructor(seconds_histogram),
            pace: Default::default(),
        };
        let mut r = s.registry;
        s.pace.register(&mut r);
        r.register(
            "idemproxy_requests",
            "Protected requests by route and decision",
            s.requests.clone(),
        );
        r.register(
            "idemproxy_observed",
            "Observe mode: requests enforce mode would have replayed, refused or held, by route and what it would have done",
            s.observed.clone(),
        );
        r.register(
            "idemproxy_reconciles",
            "Reconcile reads of unknown outcomes by route and result (found, not_found, failed)",
            s.reconciles.clone(),
        );
        r.register(
            "idemproxy_config_reloads",
            "Configuration reloads by result (ok or error)",
            s.reloads.clone(),
        );
        r.register(
            "idemproxy_connections_parked",
            "Keep-alive connections waiting for their next request with only the socket held",
            s.parked.clone(),
        );
        r.register(
            "idemproxy_protected_requests",
            "Protected requests received",
            s.protected.clone(),
        );
        r.register(
            "idemproxy_forwards",
            "Protected requests forwarded upstream",
            s.forwarded.clone(),
        );
        r.register(
            "idemproxy_replays",
            "Stored answers replayed",
            s.replayed.clone(),
        );
        r.register(
            "idemproxy_store_errors",
            "Store operations that failed",
            s.store_errors.clone(),
        );
        r.register(
            "idemproxy_decrypt_failures",
            "Stored answers that could not be decrypted (key missing or wrong, value moved): refused with 503",
            s.decrypt_failures.clone(),
        );
        r.register(
            "idemproxy_audit_dropped",
            "Audit rows dropped (store down or queue full)",
            s.audit_dropped.clone(),
        );
        r.register(
            "idemproxy_in_flight",
            "Protected requests at the upstream now",
            s.in_flight.clone(),
        );
        r.register(
            "idemproxy_waiting",
            "Requests waiting on a key or an entity lock now",
            s.waiting.clone(),
        );
        r.register(
            "idemproxy_upstream_latency_seconds",
            "Upstream answer time of protected requests",
            s.upstream_seconds.clone(),
        );
        r.register(
            "idemproxy_lock_wait_seconds",
            "Time spent waiting for entity locks",
            s.lock_wait_seconds.clone(),
        );
        Stats { registry: r, ..s }
    }
}

impl Stats {
    /// Protected requests received so far.
    pub fn protected(&self) -> u64 {
        self.protected.get()
    }
    /// Requests currently waiting on a key or an entity lock.
    pub fn waiting(&self) -> u64 {
        self.waiting.get().max(0) as u64
    }
    pub fn forwarded(&self) -> u64 {
        self.forwarded.get()
    }
    pub fn replayed(&self) -> u64 {
        self.replayed.get()
    }
    /// Protected requests at the upstream right now.
    /// The gauge of parked connections, for [`crate::connection::Http`].
    pub fn parked(&self) -> Gauge {
        self.parked.clone()
    }
    pub fn in_flight(&self) -> u64 {
        self.in_flight.get().max(0) as u64
    }
    pub fn store_errors(&self) -> u64 {
        self.store_errors.get()
    }

    pub(crate) fn on_protected(&self) {
        self.protected.inc();
    }
    pub(crate) fn on_forward(&self) -> GaugeGuard {
        self.forwarded.inc();
        self.in_flight.inc();
        GaugeGuard(self.in_flight.clone())
    }
    pub(crate) fn on_replay(&self) {
        self.replayed.inc();
    }
    pub(crate) fn on_store_error(&self) {
        self.store_errors.inc();
    }
    pub(crate) fn on_decrypt_failure(&self) {
        self.decrypt_failures.inc();
    }
    pub(crate) fn on_audit_dropped(&self, n: u64) {
        self.audit_dropped.inc_by(n);
    }
    pub(crate) fn wait(&self) -> GaugeGuard {
        self.waiting.inc();
        GaugeGuard(self.waiting.clone())
    }
    /// One finished protected request.
    pub(crate) fn on_decision(
        &self,
        route: &str,
        decision: &str,
        lock_wait: Duration,
        upstream: Option<Duration>,
    ) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                decision: decision.to_owned(),
            })
            .inc();
        let labels = RouteLabels {
            route: route.to_owned(),
        };
        self.lock_wait_seconds
            .get_or_create(&labels)
            .observe(lock_wait.as_secs_f64());
        if let Some(u) = upstream {
            self.upstream_seconds
                .get_or_create(&labels)
                .observe(u.as_secs_f64());
        }
    }

    /// An observed request that enforce mode would have acted on (`would`).
    pub(crate) fn on_observed(&self, route: &str, would: &str) {
        self.observed
            .get_or_create(&ObservedLabels {
                route: route.to_owned(),
                would: would.to_owned(),
            })
            .inc();
    }

    /// A reconcile read and what it decided.
    pub(crate) fn on_reconcile(&self, route: &str, result: &str) {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                route: route.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }

    /// A configuration reload, applied or refused.
    pub(crate) fn on_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.reloads
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let s = Stats::default();
        s.on_protected();
        let g = s.wait();
        s.on_decision(
            "charges",
            "replayed",
            Duration::from_millis(3),
            Some(Duration::from_millis(20)),
        );
        let text = s.render();
        assert!(
            text.contains("idemproxy_protected_requests_total 1"),
            "{text}"
        );
        assert!(text.contains("idemproxy_waiting 1"), "{text}");
        assert!(
            text.contains(r#"idemproxy_requests_total{route="charges",decision="replayed"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("idemproxy_upstream_latency_seconds_bucket"),
            "{text}"
        );
        drop(g);
        assert_eq!(s.waiting(), 0);
    }
}
