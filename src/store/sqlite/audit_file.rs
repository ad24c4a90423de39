//! The audit trail's own file, `<db>.audit`, and the thread that writes it.
//!
//! Audit rows are the store's most numerous writes. In the main database, where each also
//! landed on a random page of a by-key index (about 10 µs of work and a 4 KiB WAL page a row),
//! they rode in the reservations' group commits, so every reservation's `fdatasync` also
//! carried the audit pages of the batch and waited for them. Here the trail has its own WAL,
//! its own lock and this thread, which commits with `synchronous = FULL`: its sync is not a
//! reservation's; its rows are indexed by key in bulk ([`audit_index`]). Paired against the
//! trail in the main database (`bench/ab.sh`, SQLite first writes, Intel host): 8 connections
//! 1.161 ± 0.040 req/s and 0.836 ± 0.025 CPU a request; one connection 0.657 ± 0.020 CPU and
//! p99 0.899 ± 0.042; 64 connections 1.044 ± 0.027.
//!
//! Once the auditor heard its rows were written, they survive a power loss. Rows written by an
//! earlier release into the main database's `idem_audit` are moved here when the store opens
//! (see [`move_old_rows`]).

use super::audit::{append_audit, AUDIT_CHUNKS};
use super::audit_index;
use super::*;
use rusqlite::{params, Connection};
use std::sync::mpsc;
use tokio::sync::oneshot;

/// The audit file beside a database: `<db>.audit` (its WAL is `<db>.audit-wal`).
pub fn path_of(db: &std::path::Path) -> std::path::PathBuf {
    beside(db, ".audit")
}

enum Job {
    Append(Vec<AuditRow>, oneshot::Sender<StoreResult<()>>),
    Purge {
        before: i64,
        batch: i64,
        done: oneshot::Sender<StoreResult<u64>>,
    },
}

/// What the thread is sent: a job, or the word to stop.
enum Msg {
    Job(Job),
    /// The jobs queued before it are written; then the thread closes the file and ends.
    Close(oneshot::Sender<()>),
}

/// The sending side of the audit thread; closed (or dropped), the thread writes what is
/// queued and ends.
pub struct AuditFile {
    jobs: mpsc::Sender<Msg>,
}

impl AuditFile {
    /// Creates the file and its table if missing, moves rows an earlier release left in the
    /// main database, and starts the thread.
    pub fn open(db: &std::path::Path) -> StoreResult<AuditFile> {
        AuditFile::merging_every(db, audit_index::MERGE_ROWS)
    }

    /// [`AuditFile::open`], merging rows into the by-key index once `every` wait after its mark.
    fn merging_every(db: &std::path::Path, every: u64) -> StoreResult<AuditFile> {
        let path = path_of(db);
        owner_only(&path)?;
        let conn = open_gathering(&path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        conn.set_prepared_statement_cache_capacity(16);
        move_old_rows(&conn, db)?;
        let unindexed = audit_index::unindexed(&conn)?;
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new()
            .name("idemproxy-audit".into())
            .spawn(move || run(conn, queue, unindexed, every))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the audit thread: {e}")))?;
        Ok(AuditFile { jobs })
    }

    /// Writes `rows` (in one transaction with whatever else is queued); returns once they are
    /// on disk.
    pub async fn append(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        let (done, heard) = oneshot::channel();
        self.send(Msg::Job(Job::Append(rows, done)))?;
        heard.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Deletes up to `batch` rows that expired before `before`.
    pub async fn purge(&self, before: i64, batch: i64) -> StoreResult<u64> {
        let (done, heard) = oneshot::channel();
        self.send(Msg::Job(Job::Purge {
            before,
            batch,
            done,
        }))?;
        heard.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Writes what is queued, closes the file and ends the thread; a later append or purge is
    /// refused with [`StoreError::Closed`], as the writer's are.
    pub async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.send(Msg::Close(done)).is_ok() {
            let _ = closed.await;
        }
    }

    fn send(&self, msg: Msg) -> StoreResult<()> {
        self.jobs.send(msg).map_err(|_| StoreError::Closed)
    }
}

/// Creates this file's `idem_audit` and its indexes from the main database's (its migrations
/// define them, so they are written once), checks that both have the same columns, and moves
/// the main database's rows (written there before the trail had a file of its own) here, ids
/// kept. The copy and the delete are two files' commits, which SQLite does not make atomic
/// together: a crash between them leaves the rows in both, and the next open copies them again
/// with `OR IGNORE`, by id, then deletes them. The by-key index is made (see
/// [`audit_index::prepare`]) before rows move, and the moved rows under its mark are indexed in
/// the move's transaction.
fn move_old_rows(conn: &Connection, db: &std::path::Path) -> StoreResult<()> {
    let db = db
        .to_str()
        .ok_or_else(|| StoreError::File(format!("{} is not a UTF-8 path", db.display())))?;
    conn.execute("ATTACH DATABASE ?1 AS old", params![db])?;
    let moved = (|| -> StoreResult<()> {
        if columns(conn, "main")?.is_empty() {
            let mut stmt = conn.prepare(
                "SELECT sql FROM old.sqlite_master WHERE tbl_name = 'idem_audit' AND sql IS NOT NULL \
                 ORDER BY type = 'index'",
            )?;
            let schema: Vec<String> = stmt
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            conn.execute_batch(&format!("BEGIN; {}; COMMIT;", schema.join(";\n")))?;
        }
        if columns(conn, "main")? != columns(conn, "old")? {
            return Err(StoreError::Migration(
                "the audit file's idem_audit has other columns than the database's: a migration \
                 changed one and not the other"
                    .into(),
            ));
        }
        audit_index::prepare(conn)?;
        let any: bool =
            conn.query_row("SELECT EXISTS (SELECT 1 FROM old.idem_audit)", [], |r| {
                r.get(0)
            })?;
        if any {
            conn.execute_batch(&format!(
                "BEGIN IMMEDIATE; \
                 INSERT OR IGNORE INTO main.idem_audit SELECT * FROM old.idem_audit ORDER BY id; \
                 {}; \
                 DELETE FROM old.idem_audit; \
                 COMMIT;",
                audit_index::INDEX_MOVED
            ))
            .inspect_err(|_| {
                let _ = conn.execute_batch("ROLLBACK");
            })?;
        }
        Ok(())
    })();
    conn.execute("DETACH DATABASE old", [])?;
    moved
}

/// The names of `schema`'s `idem_audit` columns, in order (none if it has no such table).
fn columns(conn: &Connection, schema: &str) -> StoreResult<Vec<String>> {
    let mut stmt = conn.prepare(&format!(
        "SELECT name FROM pragma_table_info('idem_audit', '{schema}')"
    ))?;
    let names = stmt
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(names)
}

/// The thread: each turn takes every job queued up to a `Close`, runs them in one transaction
/// and answers each; then, once `every` rows wait after the by-key index's mark (`unindexed` at
/// the start), merges them into it. Jobs queued after a `Close` are dropped unanswered: their
/// callers hear [`StoreError::Closed`].
fn run(conn: Connection, queue: mpsc::Receiver<Msg>, mut unindexed: u64, every: u64) {
    while let Ok(first) = queue.recv() {
        let (mut jobs, mut close) = (Vec::new(), None);
        for msg in std::iter::once(first).chain(queue.try_iter().take(255)) {
            match msg {
                Msg::Job(job) => jobs.push(job),
                Msg::Close(tell) => {
                    close = Some(tell);
                    break;
                }
            }
        }
        let done = write(&conn, &jobs);
        for (job, done) in jobs.into_iter().zip(done) {
            match job {
                Job::Append(_, tell) => {
                    unindexed += *done.as_ref().unwrap_or(&0);
                    drop(tell.send(done.map(|_| ())))
                }
                Job::Purge { done: tell, .. } => drop(tell.send(done)),
            }
        }
        if unindexed >= every {
            // A failed merge leaves the rows after the mark, where look-ups still scan them; the
            // next try waits for as many rows again, so a lasting error costs a try (and a
            // warning) a merge's worth of rows, not one a turn.
            unindexed = 0;
            if let Err(e) = audit_index::merge(&conn) {
                tracing::warn!(error = %e, "cannot index the audit trail by key");
            }
        }
        if let Some(tell) = close {
            drop(conn);
            let _ = tell.send(());
            return;
        }
    }
}

/// Runs `jobs` in one transaction: each one's result, or, if any job or the commit failed, that
/// error for all, with nothing stored (so rows counted as dropped were not written). No
/// savepoint per job: SQLite copies every page a savepoint (or a statement that may abort
/// halfway) changes into a journal in memory, and the trail's rows each change a page of their
/// own: 13% of this thread's time, measured with `perf`. A turn almost always holds one job
/// (the auditor awaits each append), so failing the turn whole costs nothing in practice.
fn write(conn: &Connection, jobs: &[Job]) -> Vec<StoreResult<u64>> {
    let tx = match conn.unchecked_transaction() {
        Ok(tx) => tx,
        Err(e) => return failed(jobs, e.into()),
    };
    let each: StoreResult<Vec<u64>> = jobs.iter().map(|job| run_job(&tx, job)).collect();
    match each.and_then(|each| tx.commit().map(|_| each).map_err(Into::into)) {
        Ok(each) => each.into_iter().map(Ok).collect(),
        // The transaction rolls back as it drops.
        Err(e) => failed(jobs, e),
    }
}

/// Rows written between two yields of the CPU, so a serving thread woken during a long append
/// need not wait for the scheduler to preempt it (appends ran at 8 µs a row with a by-key index):
/// p99 of replays over 10k keys 1.39–1.67 → 1.10–1.25 ms; every 8 rows the trail fell behind
/// (2.5–5 ms). One part is one insert statement (the largest of [`AUDIT_CHUNKS`]).
const SLICE: usize = AUDIT_CHUNKS[0];

fn run_job(conn: &Connection, job: &Job) -> StoreResult<u64> {
    match job {
        Job::Append(rows, _) => {
            for part in rows.chunks(SLICE) {
                append_audit(conn, part)?;
                // Let a serving thread that is waiting for this CPU run before the next part.
                std::thread::yield_now();
            }
            Ok(rows.len() as u64)
        }
        Job::Purge { before, batch, .. } => audit_index::purge(conn, *before, *batch),
    }
}

/// One error for every job of a transaction that could not begin or commit.
fn failed(jobs: &[Job], e: StoreError) -> Vec<StoreResult<u64>> {
    jobs.iter().map(|_| Err(e.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::super::audit::tests::{open, row};
    use super::*;

    /// A database in `dir` whose store was opened once (migrations run, audit file made) and
    /// closed.
    async fn made(dir: &tempfile::TempDir) -> std::path::PathBuf {
        let db = dir.path().join("a.db");
        open(&db).await.close().await;
        db
    }

    /// The rows in the audit file beside `db`.
    fn stored(db: &std::path::Path) -> i64 {
        Connection::open(path_of(db))
            .unwrap()
            .query_row("SELECT count(*) FROM idem_audit", [], |r| r.get(0))
            .unwrap()
    }

    /// Rows an earlier release wrote into the main database come back from the audit file, each
    /// once and in order, even when a crash had copied some of them without deleting them.
    #[tokio::test]
    async fn rows_left_in_the_database_move_to_the_audit_file_once() {
        let dir = tempfile::tempdir().unwrap();
        let db = made(&dir).await;
        let rows: Vec<AuditRow> = (0..5).map(row).collect();
        append_audit(&Connection::open(&db).unwrap(), &rows).unwrap();
        // The first three were copied, and the process died before it deleted them.
        let audit = Connection::open(path_of(&db)).unwrap();
        audit
            .execute("ATTACH DATABASE ?1 AS old", params![db.to_str().unwrap()])
            .unwrap();
        let copy = "INSERT INTO main.idem_audit SELECT * FROM old.idem_audit WHERE id <= 3";
        assert_eq!(audit.execute(copy, []).unwrap(), 3);
        drop(audit);

        let store = open(&db).await;
        let mut read = store.audit_for_key("k", 100).await.unwrap();
        read.reverse();
        assert_eq!(read, rows);
        let in_main = || -> i64 {
            Connection::open(&db)
                .unwrap()
                .query_row("SELECT count(*) FROM idem_audit", [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!(in_main(), 0, "the main database keeps no audit row");
        store.append_audit(vec![row(9)]).await.unwrap();
        assert_eq!(store.audit_for_key("k", 1).await.unwrap(), vec![row(9)]);
        assert_eq!(in_main(), 0, "new rows go to the audit file");
        store.close().await;
    }

    /// A turn whose second job fails stores neither job's rows and fails both, so rows the
    /// auditor counts as dropped were not written (the inserts themselves keep no journal to
    /// undo a part: `OR FAIL`, and no savepoint).
    #[tokio::test]
    async fn a_failed_job_fails_its_whole_turn_and_stores_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let db = made(&dir).await;
        let conn = Connection::open(path_of(&db)).unwrap();
        conn.execute_batch(
            "CREATE TEMP TRIGGER refuse BEFORE INSERT ON idem_audit WHEN NEW.at = 7 \
             BEGIN SELECT RAISE(FAIL, 'refused'); END;",
        )
        .unwrap();
        let append = |rows: Vec<AuditRow>| Job::Append(rows, oneshot::channel().0);
        let good = append((0..5).map(row).collect());
        let bad = append((5..9).map(row).collect());
        let done = write(&conn, &[good, bad]);
        assert!(done.iter().all(Result::is_err), "{done:?}");
        assert_eq!(stored(&db), 0);
        let fine = write(&conn, &[append((0..5).map(row).collect())]);
        assert!(matches!(fine[..], [Ok(5)]), "{fine:?}");
    }

    /// A closed store's trail has written what it was given before, and refuses more as the
    /// writer does, rather than writing after the store said it was closed.
    #[tokio::test]
    async fn a_closed_trail_keeps_what_came_before_and_refuses_more() {
        let dir = tempfile::tempdir().unwrap();
        let db = made(&dir).await;
        let store = open(&db).await;
        store.append_audit((0..3).map(row).collect()).await.unwrap();
        store.close().await;
        let late = store.append_audit(vec![row(3)]).await;
        assert!(matches!(late, Err(StoreError::Closed)), "{late:?}");
        assert_eq!(stored(&db), 3);
    }

    /// The thread merges the rows after the mark into the by-key index once `every` of them
    /// wait, and not before; a look-up finds every row either way.
    #[tokio::test]
    async fn the_thread_indexes_rows_once_enough_wait() {
        let dir = tempfile::tempdir().unwrap();
        let db = made(&dir).await;
        let file = AuditFile::merging_every(&db, 4).unwrap();
        let indexed = || -> i64 {
            Connection::open(path_of(&db))
                .unwrap()
                .query_row("SELECT count(*) FROM idem_audit_by_key", [], |r| r.get(0))
                .unwrap()
        };
        file.append((0..3).map(row).collect()).await.unwrap();
        // A job queued later is answered after the turn before it, merge included.
        file.purge(0, 1).await.unwrap();
        assert_eq!(indexed(), 0, "3 rows wait, under the 4 that make a merge");
        file.append((3..5).map(row).collect()).await.unwrap();
        file.purge(0, 1).await.unwrap();
        assert_eq!(indexed(), 5);
        file.append(vec![row(5)]).await.unwrap();
        file.purge(0, 1).await.unwrap();
        assert_eq!(indexed(), 5, "the count starts again after a merge");
        file.close().await;
    }

    /// A migration that changes the database's `idem_audit` and not the audit file's stops the
    /// store from opening, rather than writing rows into the wrong columns.
    #[tokio::test]
    async fn an_audit_file_with_other_columns_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = made(&dir).await;
        Connection::open(&db)
            .unwrap()
            .execute("ALTER TABLE idem_audit ADD COLUMN extra TEXT", [])
            .unwrap();
        let url = format!("sqlite://{}", db.display());
        let refused = crate::store::open(&url, Duration::from_secs(30), true, None).await;
        assert!(
            matches!(refused, Err(StoreError::Migration(_))),
            "{:?}",
            refused.err()
        );
    }
}
