//! The audit trail's own file, `<db>.audit`: its set-up and the jobs its thread runs (the
//! thread itself is the engine's [`Trail`]).
//!
//! Audit rows are the store's most numerous writes. In the main database, where each also
//! landed on a random page of a by-key index (about 10 µs of work and a 4 KiB WAL page a row),
//! they rode in the reservations' group commits, so every reservation's `fdatasync` also
//! carried the audit pages of the batch and waited for them. Here the trail has its own WAL,
//! its own lock and its own thread, which commits with `synchronous = FULL`: its sync is not a
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
use super::engine::trail::{Job, Trail, Upkeep, Wrote};
use super::*;
use rusqlite::{params, Connection};

/// The audit file beside a database: `<db>.audit` (its WAL is `<db>.audit-wal`).
pub fn path_of(db: &std::path::Path) -> std::path::PathBuf {
    beside(db, ".audit")
}

/// The trail's thread (see [`Trail`]), given this file's jobs and its upkeep, the by-key
/// index's merge.
pub struct AuditFile {
    trail: Trail,
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
        let upkeep = Upkeep {
            every,
            waiting: audit_index::unindexed(&conn)?,
            run: audit_index::merge,
            what: "index the audit trail by key",
        };
        let trail = Trail::start("idemproxy-audit", conn, upkeep)?;
        Ok(AuditFile { trail })
    }

    /// Writes `rows` (in one transaction with whatever else is queued); returns once they are
    /// on disk.
    pub async fn append(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.trail.run(appending(rows)).await.map(|_| ())
    }

    /// Deletes up to `batch` rows that expired before `before`.
    pub async fn purge(&self, before: i64, batch: i64) -> StoreResult<u64> {
        let job = move |conn: &Connection| {
            let answer = audit_index::purge(conn, before, batch)?;
            Ok(Wrote {
                answer,
                appended: 0,
            })
        };
        self.trail.run(Box::new(job)).await
    }

    /// Writes what is queued, closes the file and ends the thread; a later append or purge is
    /// refused with [`StoreError::Closed`], as the writer's are.
    pub async fn close(&self) {
        self.trail.close().await
    }
}

/// Rows written between two yields of the CPU, so a serving thread woken during a long append
/// need not wait for the scheduler to preempt it (appends ran at 8 µs a row with a by-key index):
/// p99 of replays over 10k keys 1.39–1.67 → 1.10–1.25 ms; every 8 rows the trail fell behind
/// (2.5–5 ms). One part is one insert statement (the largest of [`AUDIT_CHUNKS`]).
const SLICE: usize = AUDIT_CHUNKS[0];

/// The job that appends `rows`, a part at a time.
fn appending(rows: Vec<AuditRow>) -> Job {
    Box::new(move |conn: &Connection| {
        for part in rows.chunks(SLICE) {
            append_audit(conn, part)?;
            // Let a serving thread that is waiting for this CPU run before the next part.
            std::thread::yield_now();
        }
        let appended = rows.len() as u64;
        Ok(Wrote {
            answer: appended,
            appended,
        })
    })
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

#[cfg(test)]
mod tests {
    use super::super::audit::tests::{open, row};
    use super::super::engine::trail::write;
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
        let append = |rows: Vec<AuditRow>| appending(rows);
        let good = append((0..5).map(row).collect());
        let bad = append((5..9).map(row).collect());
        let done = write(&conn, vec![good, bad]);
        assert!(done.iter().all(Result::is_err), "{done:?}");
        assert_eq!(stored(&db), 0);
        let fine = write(&conn, vec![append((0..5).map(row).collect())]);
        assert!(
            matches!(fine[..], [Ok(Wrote { answer: 5, .. })]),
            "{fine:?}"
        );
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
