//! The audit trail's by-key index, kept up in bulk rather than row by row.
//!
//! An index on `idem_audit (key)` put each new row on a random page of a B-tree: with a million
//! keys replayed (a row per replay, nothing to fold) that cost the trail's thread 3 µs of its
//! 4.5 a replay and doubled the replays' p99. So the trail file has no such index. Its rows are
//! appended in id order only (the table and its expiry index grow at one end), and
//! `idem_audit_by_key (key, id)` is filled by [`merge`]: every [`MERGE_ROWS`] rows, the rows
//! after the mark are inserted sorted by key in one transaction, which walks the B-tree once in
//! order, and the mark (`idem_audit_indexed.upto`) moves to the last of them. A look-up by key
//! ([`by_key`]) reads the index up to the mark and scans the rows after it, at most a merge's
//! worth, so it sees every row at any time, a crash between two merges included.

use super::*;
use rusqlite::{params, Connection, Transaction, TransactionBehavior};

/// Rows appended between two merges: about the most a look-up by key scans beyond the index
/// (a turn may append more before the merge after it). At 40k rows a second (a million keys
/// replayed at 8 connections) a merge every 1.6 s; a scan of 65,536 rows took 11 ms.
pub const MERGE_ROWS: u64 = 65_536;

/// The rows of key `?1`, newest first, at most `?2`: the newest `?2` the index holds up to its
/// mark, and those after the mark, read by id (the table's own order) without an index. The
/// outer `key = ?1` keeps out an entry whose row is gone or holds another key (an older
/// release's purge does not delete entries).
pub fn by_key(columns: &str) -> String {
    format!(
        "SELECT {columns} FROM idem_audit WHERE key = ?1 AND id IN ( \
           SELECT id FROM (SELECT id FROM idem_audit_by_key WHERE key = ?1 AND id <= {UPTO} \
             ORDER BY id DESC LIMIT ?2) \
           UNION ALL \
           SELECT id FROM idem_audit WHERE id > {UPTO} AND key = ?1) \
         ORDER BY id DESC LIMIT ?2"
    )
}

/// The index's mark, 0 if it has none.
const UPTO: &str = "coalesce((SELECT upto FROM idem_audit_indexed), 0)";

/// Indexes rows just moved in from the main database (attached as `old`) that lie under the
/// mark, inside the move's transaction; rows above it wait for the next merge.
pub const INDEX_MOVED: &str = "INSERT OR IGNORE INTO main.idem_audit_by_key (key, id) \
     SELECT key, id FROM main.idem_audit WHERE key IS NOT NULL \
     AND id IN (SELECT id FROM old.idem_audit) \
     AND id <= (SELECT upto FROM main.idem_audit_indexed)";

/// Makes the index and its mark if this file has none: a new file, or one written before the
/// index existed, whose rows are indexed here and whose row-by-row `idem_audit_key` is dropped,
/// in one transaction that holds the file's write lock (two processes may open it at once).
/// A file that has its mark is only read: the write lock would also take the main database's,
/// attached while the store opens, on every open.
pub fn prepare(conn: &Connection) -> StoreResult<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS main.idem_audit_by_key ( \
           key TEXT NOT NULL, id INTEGER NOT NULL, PRIMARY KEY (key, id)) WITHOUT ROWID; \
         CREATE TABLE IF NOT EXISTS main.idem_audit_indexed ( \
           one INTEGER PRIMARY KEY CHECK (one = 1), upto INTEGER NOT NULL);",
    )?;
    let marked = |conn: &Connection| -> StoreResult<bool> {
        Ok(conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM main.idem_audit_indexed)",
            [],
            |r| r.get(0),
        )?)
    };
    if marked(conn)? {
        return Ok(());
    }
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
    if !marked(&tx)? {
        tx.execute_batch(
            "INSERT INTO main.idem_audit_by_key (key, id) \
               SELECT key, id FROM main.idem_audit WHERE key IS NOT NULL ORDER BY key, id; \
             INSERT INTO main.idem_audit_indexed (one, upto) \
               SELECT 1, coalesce(max(id), 0) FROM main.idem_audit; \
             DROP INDEX IF EXISTS main.idem_audit_key;",
        )?;
    }
    tx.commit()?;
    Ok(())
}

/// How many rows lie after the mark.
pub fn unindexed(conn: &Connection) -> StoreResult<u64> {
    Ok(conn.query_row(
        &format!("SELECT count(*) FROM idem_audit WHERE id > {UPTO}"),
        [],
        |r| r.get::<_, i64>(0),
    )? as u64)
}

/// Indexes every row after the mark, sorted by key, and moves the mark past them, in one
/// transaction that takes the write lock first. Returns how many rows it indexed.
pub fn merge(conn: &Connection) -> StoreResult<u64> {
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
    let (upto, last): (i64, i64) = tx.query_row(
        "SELECT upto, (SELECT coalesce(max(id), 0) FROM idem_audit) FROM idem_audit_indexed",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    if last <= upto {
        return Ok(0);
    }
    let n = tx
        .prepare_cached(
            "INSERT INTO idem_audit_by_key (key, id) SELECT key, id FROM idem_audit \
             WHERE id > ?1 AND id <= ?2 AND key IS NOT NULL ORDER BY key, id",
        )?
        .execute(params![upto, last])?;
    tx.prepare_cached("UPDATE idem_audit_indexed SET upto = ?1")?
        .execute(params![last])?;
    tx.commit()?;
    Ok(n as u64)
}

/// Deletes up to `batch` rows that expired before `before`, and their index entries; the caller
/// holds a transaction. The two statements pick the same rows: the same query, in a total order
/// (the expiry index's, then id), on the same snapshot, and the first leaves `idem_audit` as it
/// was.
pub fn purge(conn: &Connection, before: i64, batch: i64) -> StoreResult<u64> {
    const EXPIRED: &str =
        "SELECT key, id FROM idem_audit WHERE expires_at < ?1 ORDER BY expires_at, id LIMIT ?2";
    conn.prepare_cached(&format!(
        "DELETE FROM idem_audit_by_key WHERE (key, id) IN ({EXPIRED})"
    ))?
    .execute(params![before, batch])?;
    Ok(conn
        .prepare_cached(&format!(
            "DELETE FROM idem_audit WHERE id IN (SELECT id FROM ({EXPIRED}))"
        ))?
        .execute(params![before, batch])? as u64)
}

#[cfg(test)]
mod tests {
    use super::super::audit::tests::{open, row};
    use super::super::audit_file::path_of;
    use super::*;

    /// A store on a new database in a directory of its own (kept while the test runs).
    async fn fresh() -> (tempfile::TempDir, std::path::PathBuf, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("a.db");
        let store = open(&db).await;
        (dir, db, store)
    }

    /// How many entries the by-key index holds, and its mark.
    fn index_of(db: &std::path::Path) -> (i64, i64) {
        let conn = Connection::open(path_of(db)).unwrap();
        let n = conn
            .query_row("SELECT count(*) FROM idem_audit_by_key", [], |r| r.get(0))
            .unwrap();
        let upto = conn
            .query_row("SELECT upto FROM idem_audit_indexed", [], |r| r.get(0))
            .unwrap();
        (n, upto)
    }

    /// Rows of one key, some under the mark and some after it, come back together, newest
    /// first; another key's rows and rows with no key stay out of both the answer and the
    /// index.
    #[tokio::test]
    async fn a_key_s_rows_are_found_on_both_sides_of_the_mark() {
        let (_dir, db, store) = fresh().await;
        let other = |n| AuditRow {
            key: Some("other".into()),
            ..row(n)
        };
        let keyless = |n| AuditRow {
            key: None,
            ..row(n)
        };
        let rows: Vec<AuditRow> = (0..8).map(row).collect();
        store
            .append_audit(vec![
                rows[0].clone(),
                other(100),
                rows[1].clone(),
                keyless(101),
            ])
            .await
            .unwrap();
        store.append_audit(rows[2..5].to_vec()).await.unwrap();
        assert_eq!(merge(&Connection::open(path_of(&db)).unwrap()).unwrap(), 6);
        assert_eq!(index_of(&db), (6, 7));
        store.append_audit(rows[5..].to_vec()).await.unwrap();
        store.append_audit(vec![other(102)]).await.unwrap();
        assert_eq!(index_of(&db), (6, 7), "the last rows wait after the mark");
        let mut read = store.audit_for_key("k", 100).await.unwrap();
        read.reverse();
        assert_eq!(read, rows);
        assert_eq!(
            store.audit_for_key("k", 2).await.unwrap(),
            vec![row(7), row(6)]
        );
        assert_eq!(
            store.audit_for_key("other", 100).await.unwrap(),
            vec![other(102), other(100)]
        );
        store.close().await;
    }

    /// The purge takes an expired row's index entry with it, one batch at a time in expiry
    /// order (not id order), and leaves no entry without its row.
    #[tokio::test]
    async fn an_expired_row_leaves_the_index_with_it() {
        let (_dir, db, store) = fresh().await;
        let expiring = |n, at| AuditRow {
            expires_at: at,
            ..row(n)
        };
        let rows = vec![expiring(0, 5), expiring(1, 1), expiring(2, 3), row(3)];
        store.append_audit(rows).await.unwrap();
        merge(&Connection::open(path_of(&db)).unwrap()).unwrap();
        assert_eq!(index_of(&db).0, 4);
        assert_eq!(store.purge(1, 0).await.unwrap(), 1);
        let dangling: i64 = Connection::open(path_of(&db))
            .unwrap()
            .query_row(
                "SELECT count(*) FROM idem_audit_by_key k LEFT JOIN idem_audit a ON a.id = k.id \
                 WHERE a.id IS NULL",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!((index_of(&db).0, dangling), (3, 0));
        let left = vec![row(3), expiring(2, 3), expiring(0, 5)];
        assert_eq!(store.audit_for_key("k", 100).await.unwrap(), left);
        store.close().await;
    }

    /// Rows an earlier release left in the main database whose ids lie under the mark are
    /// indexed as they move in; else a look-up would never find them.
    #[tokio::test]
    async fn rows_moved_in_under_the_mark_are_indexed() {
        let (_dir, db, store) = fresh().await;
        let rows: Vec<AuditRow> = (0..5).map(row).collect();
        store.append_audit(rows.clone()).await.unwrap();
        store.close().await;
        drop(store);
        {
            // Rows 1-3 are in the main database instead, under the mark at 5.
            let trail = Connection::open(path_of(&db)).unwrap();
            merge(&trail).unwrap();
            trail
                .execute_batch(
                    "DELETE FROM idem_audit WHERE id <= 3; \
                     DELETE FROM idem_audit_by_key WHERE id <= 3;",
                )
                .unwrap();
            super::super::audit::append_audit(&Connection::open(&db).unwrap(), &rows[..3]).unwrap();
        }
        let store = open(&db).await;
        assert_eq!(index_of(&db), (5, 5));
        let mut read = store.audit_for_key("k", 100).await.unwrap();
        read.reverse();
        assert_eq!(read, rows);
        store.close().await;
    }

    /// A trail file written before the index existed (rows, the old `idem_audit_key`, no
    /// `idem_audit_by_key`) has its rows indexed and the old index dropped when it opens.
    #[tokio::test]
    async fn a_trail_from_before_the_index_is_indexed_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("a.db");
        open(&db).await.close().await;
        let rows: Vec<AuditRow> = (0..5).map(row).collect();
        {
            let conn = Connection::open(path_of(&db)).unwrap();
            conn.execute_batch(
                "DROP TABLE idem_audit_by_key; DROP TABLE idem_audit_indexed; \
                 CREATE INDEX idem_audit_key ON idem_audit (key);",
            )
            .unwrap();
            super::super::audit::append_audit(&conn, &rows).unwrap();
        }
        let store = open(&db).await;
        assert_eq!(index_of(&db), (5, 5));
        let old: i64 = Connection::open(path_of(&db))
            .unwrap()
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'idem_audit_key'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(old, 0, "the row-by-row index is gone");
        let mut read = store.audit_for_key("k", 100).await.unwrap();
        read.reverse();
        assert_eq!(read, rows);
        store.close().await;
    }
}
