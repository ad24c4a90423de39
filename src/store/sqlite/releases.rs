//! How an operator's release made by another process (`idemproxy keys release`) reaches the
//! serving process's replay cache, through the database alone: the release is noted in
//! `idem_releases`; the serving process reads new notes every [`POLL`], tells its observer
//! (the cache forgets the key) and records the last note it has seen in `idem_meta`; the
//! releasing process waits for that record before it reports the release done.

use super::*;
use tokio_util::sync::CancellationToken;

/// How often the serving process looks for new release notes.
const POLL: Duration = Duration::from_millis(50);
/// How long a releasing process waits for the serving process to have seen its release.
const ACK_WAIT: Duration = Duration::from_secs(2);
/// Notes older than this are purged.
pub(super) const KEEP_MS: i64 = 3_600_000;

/// Where the observer of releases is kept until the cache layer registers it.
pub(super) type Observer = Arc<Mutex<Option<ReleaseObserver>>>;

use std::sync::{Arc, Mutex};

/// The serving process's reader of release notes, until `stop`.
pub(super) fn watch(
    reads: SqlitePool,
    writer: Arc<Writer>,
    observer: Observer,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        let start: Result<Option<i64>, _> =
            sqlx::query_scalar("SELECT MAX(seq) FROM idem_releases")
                .fetch_one(&reads)
                .await;
        let mut seen = start.ok().flatten().unwrap_or(0);
        let mut tick = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let notes: Result<Vec<(i64, String)>, _> =
                sqlx::query_as("SELECT seq, key FROM idem_releases WHERE seq > ? ORDER BY seq")
                    .bind(seen)
                    .fetch_all(&reads)
                    .await;
            let Ok(notes) = notes else { continue };
            let Some(last) = notes.last().map(|(seq, _)| *seq) else {
                continue;
            };
            if let Some(f) = observer.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                for (_, key) in &notes {
                    f(Some(key));
                }
            }
            seen = last;
            let ack = writer
                .write(move |ctx| {
                    ctx.conn
                        .execute(
                            "INSERT INTO idem_meta (name, value) VALUES ('releases_seen', ?1) \
                             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                            [last.to_string()],
                        )
                        .map(|_| ())
                        .map_err(StoreError::from)
                })
                .await;
            if let Err(e) = ack {
                tracing::warn!(error = %e, "cannot record the releases seen");
            }
        }
    });
}

/// In a process that does not serve: waits until the serving process (if one holds the
/// database) has seen release note `seq`, so its replay cache has forgotten the key when the
/// release is reported. Without a serving process there is nothing to wait for.
pub(super) async fn wait_until_seen(reads: &SqlitePool, db: &std::path::Path, seq: i64) {
    if !served(db) {
        return;
    }
    let deadline = tokio::time::Instant::now() + ACK_WAIT;
    while tokio::time::Instant::now() < deadline {
        let seen: Result<Option<String>, _> =
            sqlx::query_scalar("SELECT value FROM idem_meta WHERE name = 'releases_seen'")
                .fetch_optional(reads)
                .await;
        if seen
            .ok()
            .flatten()
            .and_then(|s| s.parse::<i64>().ok())
            .is_some_and(|s| s >= seq)
        {
            return;
        }
        // Polling another process's progress through the database (not a synchronization of
        // our own tasks).
        tokio::time::sleep(POLL / 2).await;
    }
    tracing::warn!("the running proxy did not confirm the release; its replay cache forgets the key within 5 s");
}

/// Whether a `serve` process holds the database's lock file.
fn served(db: &std::path::Path) -> bool {
    match std::fs::File::open(lock_path(db)) {
        Ok(file) => matches!(
            file.try_lock_shared(),
            Err(std::fs::TryLockError::WouldBlock)
        ),
        Err(_) => false,
    }
}
