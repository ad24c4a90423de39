//! The reads of the request path — a key's record, the entities' states — run on the caller's
//! own thread.
//!
//! Every request with an entity, a precheck or `in_flight = "reject"` reads its key before it
//! takes a lock, so does every replay the replay cache misses, and a route with version or
//! claim checks reads its entities' states before each write. Through the sqlx pool such a
//! read was handed to the connection's worker thread and its answer handed back: two wake-ups
//! between threads per read (on this project's VM, a wake-up across cores is a host round
//! trip), with eight worker threads woken in turn. Here the caller runs the indexed `SELECT`
//! itself on a pooled `rusqlite` connection: an index look-up of a local file, a few
//! microseconds when its pages are in the page cache (as the hot part of the store is). A read
//! of pages that are not (a cold start on a slow disk) holds the calling worker for that read,
//! as a page fault would; nothing in it waits on the writer, since WAL readers read a snapshot.

use super::*;
use crate::store::seal::Cipher;
use rusqlite::{params, Connection, OpenFlags};
use std::sync::Mutex;

/// Idle connections kept: at most one read runs per thread at a time, and tokio runs one
/// worker per core, so more would only idle.
const KEEP: usize = 8;

/// Read-only connections to the store's file, taken for one read at a time.
pub struct Reader {
    db: std::path::PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl Reader {
    pub fn new(db: &std::path::Path) -> Reader {
        Reader {
            db: db.to_owned(),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The record of `id`, if any, read on this thread.
    pub fn record(
        &self,
        cipher: Option<&Cipher>,
        id: &ScopedKey,
    ) -> StoreResult<Option<KeyRecord>> {
        self.read(|conn| read_record(conn, cipher, id))
    }

    /// The stored states of these entities (those with none are left out), read on this
    /// thread: what a route's version and claim checks read before every write.
    pub fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        self.read(|conn| {
            let mut stmt = conn.prepare_cached(&ENTITIES_SQL)?;
            let mut rows = stmt.query(params![encode_entities(entities)])?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                out.push(rows::entity_state(&Lite(row))?);
            }
            Ok(out)
        })
    }

    /// Runs `f` on an idle connection (or a new one), then keeps the connection for the next
    /// read.
    fn read<T>(&self, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
        let taken = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let conn = match taken {
            Some(conn) => conn,
            None => self.open()?,
        };
        let out = f(&conn);
        // A connection that failed a read is dropped, not pooled: the next read opens another.
        if out.is_ok() {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < KEEP {
                idle.push(conn);
            }
        }
        out
    }

    fn open(&self) -> StoreResult<Connection> {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.db, flags)?;
        // A WAL reader waits for nothing the writer does; only another process's recovery of
        // the WAL (a CLI command opening the store after a crash) makes it busy. It must not
        // hold a tokio worker for that: past this, the read fails here and the caller reads
        // through the pool instead (see [`is_missed`]).
        conn.busy_timeout(BUSY_FOR)?;
        Ok(conn)
    }
}

/// The longest an inline read waits for a lock before it is handed to the pool.
const BUSY_FOR: Duration = Duration::from_millis(20);

/// A key's record by its three columns.
pub static KEY_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("SELECT {KEY_COLUMNS} FROM idem_keys WHERE upstream = ?1 AND scope = ?2 AND key = ?3")
});

/// The states of the entities named in a JSON array.
pub static ENTITIES_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE entity IN (SELECT value FROM json_each(?1))"
    )
});

/// Whether an inline read failed for want of SQLite (busy past [`BUSY_FOR`], a connection
/// that cannot open): then it is read again through the pool, which waits off the worker
/// threads. A record that cannot be decoded or decrypted fails either way.
pub fn is_missed(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_))
}

/// One key's record on `conn` (the writer's, inside its transaction, or a reader's).
pub fn read_record(
    conn: &Connection,
    cipher: Option<&Cipher>,
    id: &ScopedKey,
) -> StoreResult<Option<KeyRecord>> {
    let mut stmt = conn.prepare_cached(&KEY_SQL)?;
    let mut rows = stmt.query(params![id.upstream, id.scope, id.key])?;
    match rows.next()? {
        Some(row) => Ok(Some(rows::key_record(&Lite(row), cipher)?)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> ScopedKey {
        ScopedKey::new("api", "s", key)
    }

    /// A first write's reservation of `key`, holding `entities`.
    fn reservation(key: &str, entities: &[&str]) -> Reservation {
        Reservation {
            id: id(key),
            fingerprint: "fp".into(),
            route: "r".into(),
            entities: entities.iter().map(|e| e.to_string()).collect(),
            owner: "me".into(),
            lease: Duration::from_secs(30),
            take_unknown: false,
            call_timeout: Duration::from_secs(30),
        }
    }

    /// Each read sees the latest commit, and no pooled connection keeps a snapshot open after
    /// its read: one that did would read stale records and keep checkpoints from ever
    /// emptying the WAL.
    #[tokio::test]
    async fn reads_see_each_commit_and_hold_no_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let url = format!("sqlite://{}", db.display());
        let store = SqliteStore::open(&url, Duration::from_secs(30), false, None)
            .await
            .unwrap();
        assert!(store.get(&id("a")).await.unwrap().is_none());
        assert!(matches!(
            store.reserve(reservation("a", &[])).await.unwrap(),
            Reserved::Owned(_)
        ));
        let read = store.get(&id("a")).await.unwrap().expect("seen at once");
        assert_eq!(read.state, KeyState::InFlight);
        // Every frame can be checkpointed and the WAL truncated: no reader pins a snapshot.
        let other = Connection::open(&db).unwrap();
        let (busy, _, _): (i64, i64, i64) = other
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .unwrap();
        assert_eq!(busy, 0, "a pooled reader kept its read transaction open");
        store.close().await;
    }

    /// A read this thread cannot make (SQLite busy past `BUSY_FOR`, here a file it cannot
    /// open) is made through the pool, never failed or answered empty.
    #[tokio::test]
    async fn a_read_the_thread_cannot_make_goes_through_the_pool() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let mut store = SqliteStore::open(&url, Duration::from_secs(30), false, None)
            .await
            .unwrap();
        store
            .reserve(reservation("b", &["customer:1"]))
            .await
            .unwrap();
        store.reader = Reader::new(&dir.path().join("missing").join("s.db"));
        let e = store.reader.record(None, &id("b")).unwrap_err();
        assert!(is_missed(&e), "{e}");
        let read = store
            .get(&id("b"))
            .await
            .unwrap()
            .expect("read through the pool");
        assert_eq!(read.state, KeyState::InFlight);
        let states = store.entity_states(&["customer:1".into()]).await.unwrap();
        assert!(states.is_empty(), "no version or claim stored yet");
        store.close().await;
    }
}
