//! The audit trail and retention, both off the request path.
//!
//! A request's context becomes one audit row when it ends (see `pipeline::Outcome`). Rows go to
//! the [`Auditor`], a background task that writes them in batches (on SQLite they join the
//! writer's group commit), so auditing adds no store round trip to a request. The
//! [`retention`] task purges expired keys, claims and audit rows in small batches.

use crate::metrics::Stats;
use crate::store::{now_ms, AuditRow, Store};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Rows waiting to be written; beyond this, rows are dropped (and counted) rather than slowing
/// requests down.
const QUEUE: usize = 65_536;
/// Most rows written in one batch.
const BATCH: usize = 512;
/// How long the first row of a batch waits for others.
const LINGER: Duration = Duration::from_millis(10);

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

    /// Queues a row; a full queue drops it (counted), never slows the request down.
    pub fn send(&self, row: AuditRow) {
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
        let mut stopping = tokio::select! {
            n = rx.recv_many(&mut buf, BATCH) => n == 0,
            _ = stop.cancelled() => true,
        };
        // Linger for more rows: at a light load each request would otherwise be a write batch
        // of its own, and the next request's reservation would queue behind it on SQLite's
        // one writer.
        let linger = tokio::time::sleep(LINGER);
        tokio::pin!(linger);
        while !stopping && buf.len() < BATCH {
            let room = BATCH - buf.len();
            tokio::select! {
                n = rx.recv_many(&mut buf, room) => stopping = n == 0,
                _ = stop.cancelled() => stopping = true,
                _ = &mut linger => break,
            }
        }
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

/// Rows of each kind deleted per purge statement: small, so no purge holds the store long.
/// Expired keys lie all over the key space: each one deleted dirties a page of its own (and one
/// in each index), and on SQLite the requests that share the purge's commit wait for those
/// pages' fsync.
const PURGE_BATCH: i64 = 100;

/// The least pause between two purge batches.
const PURGE_PAUSE: Duration = Duration::from_millis(5);

/// Purges expired rows every `every` until cancelled. A batch that found rows is followed by
/// another after a pause as long as the batch took (at least [`PURGE_PAUSE`]): a backlog (a
/// day's keys expiring at once) is worked off at no more than half the store's time, so the
/// requests beside it keep their latency. Even so it deletes thousands of rows a second.
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
            let started = tokio::time::Instant::now();
            let released_before = now_ms().saturating_sub(retention.as_millis() as i64);
            match store.purge(PURGE_BATCH, released_before).await {
                Ok(n) if n > 0 => {
                    tracing::debug!(rows = n, "purged expired rows");
                    let pause = started.elapsed().max(PURGE_PAUSE);
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
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
