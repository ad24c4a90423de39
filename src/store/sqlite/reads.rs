//! The reads of the request path — a key's record, the entities' states — run on the caller's
//! own thread, through the engine's pool of read-only connections ([`Reader`]).
//!
//! Every request with an entity, a precheck or `in_flight = "reject"` reads its key before it
//! takes a lock, so does every replay the replay cache misses, and a route with version or
//! claim checks reads its entities' states before each write.

use super::engine::reader::Reader;
use super::*;
use crate::store::seal::Cipher;
use rusqlite::{params, Connection};

/// The record of `id`, if any, read on this thread.
pub fn record(
    reader: &Reader,
    cipher: Option<&Cipher>,
    id: &ScopedKey,
) -> StoreResult<Option<KeyRecord>> {
    reader.read(|conn| read_record(conn, cipher, id))
}

/// The stored states of these entities (those with none are left out), read on this thread:
/// what a route's version and claim checks read before every write.
pub fn entity_states(reader: &Reader, entities: &[String]) -> StoreResult<Vec<EntityState>> {
    reader.read(|conn| {
        let mut stmt = conn.prepare_cached(&ENTITIES_SQL)?;
        let mut rows = stmt.query(params![encode_entities(entities)])?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            out.push(rows::entity_state(&Lite(row))?);
        }
        Ok(out)
    })
}

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
    use super::super::engine::reader::is_missed;
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
        let e = record(&store.reader, None, &id("b")).unwrap_err();
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
