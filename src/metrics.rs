//! Counters shared by the pipeline, tests and the admin listener.
//!
//! Plain atomics: the hot path pays one relaxed increment per event.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Process-wide request statistics.
#[derive(Debug, Default)]
pub struct Stats {
    protected: AtomicU64,
    waiting: AtomicU64,
    forwarded: AtomicU64,
    replayed: AtomicU64,
    in_flight: AtomicU64,
    store_errors: AtomicU64,
}

/// Decrements a gauge when dropped, so early returns and cancellations keep it right.
pub struct GaugeGuard<'a>(&'a AtomicU64);

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Stats {
    /// Protected requests received so far.
    pub fn protected(&self) -> u64 {
        self.protected.load(Relaxed)
    }
    /// Requests currently waiting on a key or an entity lock.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Relaxed)
    }
    pub fn forwarded(&self) -> u64 {
        self.forwarded.load(Relaxed)
    }
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Relaxed)
    }
    /// Protected requests at the upstream right now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }
    pub fn store_errors(&self) -> u64 {
        self.store_errors.load(Relaxed)
    }

    pub(crate) fn on_protected(&self) {
        self.protected.fetch_add(1, Relaxed);
    }
    pub(crate) fn on_forward(&self) -> GaugeGuard<'_> {
        self.forwarded.fetch_add(1, Relaxed);
        self.in_flight.fetch_add(1, Relaxed);
        GaugeGuard(&self.in_flight)
    }
    pub(crate) fn on_replay(&self) {
        self.replayed.fetch_add(1, Relaxed);
    }
    pub(crate) fn on_store_error(&self) {
        self.store_errors.fetch_add(1, Relaxed);
    }
    pub(crate) fn wait(&self) -> GaugeGuard<'_> {
        self.waiting.fetch_add(1, Relaxed);
        GaugeGuard(&self.waiting)
    }

    /// Prometheus text exposition of these counters.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |name: &str, kind: &str, help: &str, v: u64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        line(
            "idemproxy_protected_requests_total",
            "counter",
            "Protected requests received.",
            self.protected(),
        );
        line(
            "idemproxy_forwards_total",
            "counter",
            "Protected requests forwarded upstream.",
            self.forwarded(),
        );
        line(
            "idemproxy_replays_total",
            "counter",
            "Stored answers replayed.",
            self.replayed(),
        );
        line(
            "idemproxy_in_flight",
            "gauge",
            "Protected requests at the upstream now.",
            self.in_flight(),
        );
        line(
            "idemproxy_waiting",
            "gauge",
            "Requests waiting on a key or entity lock.",
            self.waiting(),
        );
        line(
            "idemproxy_store_errors_total",
            "counter",
            "Store operations that failed.",
            self.store_errors(),
        );
        out
    }
}
