//! The audit trail and retention, both off the request path.
//!
//! A request's [`Trace`] becomes one audit row and one metrics update when it ends. Rows go to
//! the [`Auditor`], a background task that writes them in batches (on SQLite they join the
//! writer's group commit), so auditing adds no store round trip to a request. The
//! [`retention`] task purges expired keys, claims and audit rows in small batches.

use crate::metrics::Stats;
use crate::store::{after_ms, now_ms, AuditRow, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Rows waiting to be written; beyond this, rows are dropped (and counted) rather than slowing
/// requests down.
const QUEUE: usize = 65_536;
/// Most rows written in one batch.
const BATCH: usize = 512;

/// The sending side of the audit trail.
#[derive(Clone)]
pub struct Auditor {
    tx: mpsc::Sender<AuditRow>,
    stats: Arc<Stats>,
}

impl Auditor {
    /// Starts the writer task; after `stop` is cancelled it writes what is queued and ends.
    pub fn start(
        store: Arc<dyn Store>,
        stats: Arc<Stats>,
        stop: CancellationToken,
    ) -> (Auditor, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let task = tokio::spawn(write_rows(store, stats.clone(), rx, stop));
        (Auditor { tx, stats }, task)
    }

    fn send(&self, row: AuditRow) {
        if self.tx.try_send(row).is_err() {
            self.stats.on_audit_dropped(1);
        }
    }
}

async fn write_rows(
    store: Arc<dyn Store>,
    stats: Arc<Stats>,
    mut rx: mpsc::Receiver<AuditRow>,
    stop: CancellationToken,
) {
    let mut buf = Vec::with_capacity(BATCH);
    loop {
        let stopping = tokio::select! {
            n = rx.recv_many(&mut buf, BATCH) => n == 0,
            _ = stop.cancelled() => true,
        };
        if stopping {
            while let Ok(row) = rx.try_recv() {
                buf.push(row);
            }
        }
        if buf.is_empty() && stopping {
            return;
        }
        let rows = std::mem::take(&mut buf);
        let n = rows.len() as u64;
        if let Err(e) = store.append_audit(rows).await {
            stats.on_store_error();
            stats.on_audit_dropped(n);
            tracing::warn!(error = %e, rows = n, "audit rows dropped: the store is unavailable");
        }
        if stopping {
            return;
        }
    }
}

/// What one protected request did, filled in as it goes through the pipeline.
pub struct Trace {
    started: Instant,
    pub upstream: String,
    pub route: String,
    pub retention: Duration,
    pub key: Option<String>,
    pub fingerprint: Option<String>,
    pub entities: Vec<String>,
    pub lock_wait: Duration,
    pub upstream_time: Option<Duration>,
    pub upstream_status: Option<u16>,
}

impl Trace {
    pub fn new(upstream: &str, route: &str, retention: Duration) -> Trace {
        Trace {
            started: Instant::now(),
            upstream: upstream.to_owned(),
            route: route.to_owned(),
            retention,
            key: None,
            fingerprint: None,
            entities: Vec::new(),
            lock_wait: Duration::ZERO,
            upstream_time: None,
            upstream_status: None,
        }
    }

    /// Ends the trace: one audit row, one metrics update.
    pub fn record(self, auditor: &Auditor, decision: &str) {
        auditor
            .stats
            .on_decision(&self.route, decision, self.lock_wait, self.upstream_time);
        let ms = |d: Duration| d.as_millis() as i64;
        auditor.send(AuditRow {
            at: now_ms(),
            upstream: self.upstream,
            route: self.route,
            entities: self.entities,
            key: self.key,
            fingerprint: self.fingerprint,
            decision: decision.to_owned(),
            upstream_status: self.upstream_status,
            total_ms: ms(self.started.elapsed()),
            lock_wait_ms: ms(self.lock_wait),
            upstream_ms: self.upstream_time.map(ms),
            expires_at: after_ms(self.retention),
        });
    }
}

/// A request's trace until its outcome is known; a request dropped before that (the client
/// hung up while it waited) still gets its audit row, as `client_closed`.
pub struct PendingTrace {
    trace: Option<Trace>,
    auditor: Auditor,
}

impl PendingTrace {
    pub fn new(trace: Trace, auditor: &Auditor) -> PendingTrace {
        PendingTrace {
            trace: Some(trace),
            auditor: auditor.clone(),
        }
    }
}

impl std::ops::Deref for PendingTrace {
    type Target = Option<Trace>;
    fn deref(&self) -> &Option<Trace> {
        &self.trace
    }
}

impl std::ops::DerefMut for PendingTrace {
    fn deref_mut(&mut self) -> &mut Option<Trace> {
        &mut self.trace
    }
}

impl Drop for PendingTrace {
    fn drop(&mut self) {
        if let Some(t) = self.trace.take() {
            t.record(&self.auditor, "client_closed");
        }
    }
}

/// Rows of each kind deleted per purge statement: small, so no purge holds the store long.
const PURGE_BATCH: i64 = 500;

/// Purges expired rows every `every` until cancelled; a full batch is followed at once by
/// another, with a yield in between so requests interleave.
pub async fn retention(
    store: Arc<dyn Store>,
    retention: Duration,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        loop {
            let released_before = now_ms().saturating_sub(retention.as_millis() as i64);
            match store.purge(PURGE_BATCH, released_before).await {
                Ok(n) if n > 0 => {
                    tracing::debug!(rows = n, "purged expired rows");
                    tokio::task::yield_now().await;
                }
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "retention purge failed; will retry");
                    break;
                }
            }
            if cancel.is_cancelled() {
                return;
            }
        }
    }
}
