//! The audit trail and retention, both off the request path.
//!
//! A request's context becomes one audit row when it ends (see `pipeline::Outcome`). Rows go to
//! the [`Auditor`], a background task that writes them in batches (on SQLite they join the
//! writer's group commit), so auditing adds no store round trip to a request. The
//! [`retention`] task purges expired keys, claims and audit rows in small batches.

use crate::metrics::Stats;
use crate::store::{now_ms, AuditRow, Store};
use std::collections::HashMap;
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
        // one writer. The linger sleeps without watching the queue and then takes what came:
        // watching it woke this task (on the main runtime, usually from another thread) for
        // every row sent meanwhile, a cross-thread wake-up per request. A full batch does not
        // linger, so rows arriving faster than a batch per linger are written at once.
        if !stopping && buf.len() < BATCH {
            tokio::select! {
                _ = tokio::time::sleep(LINGER) => {}
                _ = stop.cancelled() => stopping = true,
            }
            while buf.len() < BATCH {
                match rx.try_recv() {
                    Ok(row) => buf.push(row),
                    Err(_) => break,
                }
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
        let rows = fold(std::mem::take(&mut buf));
        let n = rows.iter().map(|r| r.requests.max(0) as u64).sum();
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

/// Folds each run of one key's requests that ended alike (same route, entities, fingerprint,
/// decision and upstream status, with no other outcome of that key between them) into one
/// row that counts them: `requests`, at the first one's time, with the slowest one's
/// durations and the latest expiry. A retry storm — a client, a webhook sender or a hostile
/// caller replaying one key tens of thousands of times a second — otherwise wrote a row per
/// replay, and those rows were a fifth of a replay's cost and most of the store's writes. Each
/// key's rows keep their order; rows of different keys are never merged. A row carries no
/// credential scope, so two callers replaying the same key text with the same body may share
/// one — rows that were indistinguishable but for their times before folding too.
fn fold(rows: Vec<AuditRow>) -> Vec<AuditRow> {
    let mut out: Vec<AuditRow> = Vec::with_capacity(rows.len());
    // Each (upstream, route, key)'s latest row in `out`, by a hash checked on use.
    let mut latest: HashMap<u64, usize> = HashMap::with_capacity(rows.len());
    let hasher = ahash::RandomState::new();
    for row in rows {
        let h = hasher.hash_one((&row.upstream, &row.route, &row.key));
        if let Some(prev) = latest.get(&h).map(|&i| &mut out[i]) {
            let same_key =
                (&prev.upstream, &prev.route, &prev.key) == (&row.upstream, &row.route, &row.key);
            if same_key && alike(prev, &row) {
                prev.requests += row.requests;
                prev.total_ms = prev.total_ms.max(row.total_ms);
                prev.lock_wait_ms = prev.lock_wait_ms.max(row.lock_wait_ms);
                prev.upstream_ms = prev.upstream_ms.max(row.upstream_ms);
                prev.expires_at = prev.expires_at.max(row.expires_at);
                continue;
            }
        }
        latest.insert(h, out.len());
        out.push(row);
    }
    out
}

/// Two rows of one key that tell the same story but for their times.
fn alike(a: &AuditRow, b: &AuditRow) -> bool {
    a.decision == b.decision
        && a.fingerprint == b.fingerprint
        && a.upstream_status == b.upstream_status
        && a.entities == b.entities
        && a.scope == b.scope
        && a.workflow == b.workflow
        && a.note == b.note
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

#[cfg(test)]
mod tests {
    use super::fold;
    use crate::store::AuditRow;

    fn row(key: &str, decision: &str, total_ms: i64) -> AuditRow {
        AuditRow {
            at: total_ms,
            upstream: "api".into(),
            route: "charges".into(),
            entities: vec!["customer:1".into()],
            key: Some(key.into()),
            fingerprint: Some("fp".into()),
            decision: decision.into(),
            upstream_status: None,
            total_ms,
            lock_wait_ms: 0,
            upstream_ms: None,
            expires_at: total_ms,
            requests: 1,
            scope: None,
            workflow: None,
            note: None,
        }
    }

    fn story(rows: &[AuditRow]) -> Vec<(String, String, i64)> {
        let key = |r: &AuditRow| r.key.clone().unwrap_or_default();
        rows.iter()
            .map(|r| (key(r), r.decision.clone(), r.requests))
            .collect()
    }

    /// A storm of one key's replays, interleaved with other keys' rows, is one row that counts
    /// them, where the first one stood; the other keys' rows are untouched.
    #[test]
    fn one_keys_replays_fold_into_one_row_that_counts_them() {
        let rows = vec![
            row("a", "forwarded", 9),
            row("k", "replayed", 1),
            row("b", "forwarded", 2),
            row("k", "replayed", 7),
            row("k", "replayed", 3),
        ];
        let folded = fold(rows);
        let want = [
            ("a", "forwarded", 1),
            ("k", "replayed", 3),
            ("b", "forwarded", 1),
        ];
        let want: Vec<_> = want
            .iter()
            .map(|(k, d, n)| (k.to_string(), d.to_string(), *n))
            .collect();
        assert_eq!(story(&folded), want);
        let k = &folded[1];
        assert_eq!(
            (k.at, k.total_ms, k.expires_at),
            (1, 7, 7),
            "first time, slowest, latest"
        );
    }

    /// The auditor folds what one batch holds before it writes: 300 replays queued behind a
    /// key's forward are stored, in a real SQLite store, as two rows that count 301 requests.
    #[tokio::test]
    async fn the_auditor_stores_a_replay_storm_as_one_row() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("a.db").display());
        let timeout = std::time::Duration::from_secs(30);
        let store = crate::store::open(&url, timeout, true, None).await.unwrap();
        let stats = std::sync::Arc::new(crate::metrics::Stats::default());
        let stop = tokio_util::sync::CancellationToken::new();
        let (auditor, task) = super::Auditor::start(store.clone(), stats, stop.clone());
        // On this one-thread runtime the writer task runs only once this test awaits: every
        // row is queued before its first batch.
        auditor.send(row("k", "forwarded", 5));
        (0..300).for_each(|n| auditor.send(row("k", "replayed", n % 4)));
        stop.cancel();
        task.await.unwrap();
        let rows = store.audit_for_key("k", 100).await.unwrap();
        let want = [("replayed", 300), ("forwarded", 1)];
        let want: Vec<_> = want
            .iter()
            .map(|(d, n)| ("k".to_string(), d.to_string(), *n))
            .collect();
        assert_eq!(story(&rows), want, "newest first");
        assert_eq!(rows[0].total_ms, 3, "the slowest replay");
        store.close().await;
    }

    /// Another outcome of the key between two replays ends the run (each key's rows keep
    /// their order), and rows that differ in anything but their times never merge.
    #[test]
    fn a_different_outcome_or_story_is_a_row_of_its_own() {
        let mut other_fp = row("k", "replayed", 1);
        other_fp.fingerprint = Some("other".into());
        let mut other_route = row("k", "replayed", 1);
        other_route.route = "refunds".into();
        let rows = vec![
            row("k", "replayed", 1),
            row("k", "key_reused", 1),
            row("k", "replayed", 1),
            other_fp,
            other_route,
            row("j", "replayed", 1),
        ];
        let folded = fold(rows.clone());
        assert_eq!(story(&folded), story(&rows), "nothing folds");
    }
}
