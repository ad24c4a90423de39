//! SQLite backend: WAL, `synchronous = FULL`, one writer task with group commit.
//!
//! Every write goes through one connection owned by a writer task. The task drains whatever
//! writes are queued (up to [`MAX_BATCH`]) into one transaction and answers each caller only
//! after the `COMMIT` — so a reservation is durable before anything is forwarded, yet twenty
//! concurrent first writes share one fsync instead of paying twenty. Reads use a separate pool
//! (WAL lets them run beside the writer).
//!
//! SQLite serves one `serve` process: with `exclusive`, the store takes an OS lock on
//! `<db>.lock`, so a second `serve` on the same file refuses to start, and any record still
//! `in_flight` at start was left by a dead process: it becomes `unknown` at once.

mod writer;
mod writes;

use super::codec::{decode_entities, decode_headers, encode_entities};
use super::*;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Row, SqliteConnection, SqlitePool};
use std::str::FromStr;
use writer::Writer;

pub(super) const KEY_COLUMNS: &str = "upstream, scope, key, fingerprint, route, entities, state, owner, lease_until, \
                                      epoch, attempts, status, headers, body, created_at, updated_at, expires_at";

const AUDIT_COLUMNS: &str =
    "at, upstream, route, entities, key, fingerprint, decision, upstream_status, total_ms, \
                             lock_wait_ms, upstream_ms, expires_at";

pub struct SqliteStore {
    reads: SqlitePool,
    writer: Writer,
    /// Held for the life of a `serve` process: the exclusive lock on `<db>.lock`.
    _lock: Option<std::fs::File>,
}

impl SqliteStore {
    pub async fn open(url: &str, _lease: Duration, exclusive: bool) -> StoreResult<SqliteStore> {
        let opts = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5));
        let lock = if exclusive {
            Some(lock_file(opts.get_filename())?)
        } else {
            None
        };
        let reads = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts.clone())
            .await?;
        sqlx::migrate!("migrations/sqlite").run(&reads).await?;
        let mut conn = SqliteConnection::connect_with(&opts).await?;
        if exclusive {
            // Whoever owned these is gone (we hold the process lock): outcome unknown.
            sqlx::query("UPDATE idem_keys SET state = 'unknown', owner = NULL, updated_at = ? WHERE state = 'in_flight'")
                .bind(now_ms())
                .execute(&mut conn)
                .await?;
        }
        Ok(SqliteStore {
            reads,
            writer: Writer::start(conn),
            _lock: lock,
        })
    }
}

fn lock_file(db: &std::path::Path) -> StoreResult<std::fs::File> {
    let mut path = db.as_os_str().to_owned();
    path.push(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| StoreError(format!("cannot open {}: {e}", path.to_string_lossy())))?;
    file.try_lock().map_err(|_| {
        StoreError(format!(
            "{} is in use by another idemproxy serve process; SQLite serves one process (use PostgreSQL for several replicas)",
            db.display()
        ))
    })?;
    Ok(file)
}

pub(super) fn decode_key(row: &SqliteRow) -> StoreResult<KeyRecord> {
    let state: String = row.try_get("state")?;
    let status: Option<i64> = row.try_get("status")?;
    let response = match status {
        Some(status) => {
            let headers: Option<Vec<u8>> = row.try_get("headers")?;
            let body: Option<Vec<u8>> = row.try_get("body")?;
            Some(StoredResponse {
                status: status as u16,
                headers: decode_headers(headers.as_deref().unwrap_or_default()),
                body: Bytes::from(body.unwrap_or_default()),
            })
        }
        None => None,
    };
    let entities: String = row.try_get("entities")?;
    Ok(KeyRecord {
        id: ScopedKey {
            upstream: row.try_get("upstream")?,
            scope: row.try_get("scope")?,
            key: row.try_get("key")?,
        },
        fingerprint: row.try_get("fingerprint")?,
        route: row.try_get("route")?,
        entities: decode_entities(&entities),
        state: KeyState::parse(&state)
            .ok_or_else(|| StoreError(format!("unknown key state {state:?}")))?,
        owner: row.try_get("owner")?,
        lease_until: row.try_get("lease_until")?,
        epoch: row.try_get("epoch")?,
        attempts: row.try_get("attempts")?,
        response,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        expires_at: row.try_get("expires_at")?,
    })
}

fn decode_audit(row: &SqliteRow) -> StoreResult<AuditRow> {
    let entities: String = row.try_get("entities")?;
    let status: Option<i64> = row.try_get("upstream_status")?;
    Ok(AuditRow {
        at: row.try_get("at")?,
        upstream: row.try_get("upstream")?,
        route: row.try_get("route")?,
        entities: decode_entities(&entities),
        key: row.try_get("key")?,
        fingerprint: row.try_get("fingerprint")?,
        decision: row.try_get("decision")?,
        upstream_status: status.map(|s| s as u16),
        total_ms: row.try_get("total_ms")?,
        lock_wait_ms: row.try_get("lock_wait_ms")?,
        upstream_ms: row.try_get("upstream_ms")?,
        expires_at: row.try_get("expires_at")?,
    })
}

fn decode_entity(row: &SqliteRow) -> StoreResult<EntityState> {
    let claim_key: Option<String> = row.try_get("claim_key")?;
    let claim = match claim_key {
        Some(key) => Some(Claim {
            owner: ScopedKey {
                upstream: row
                    .try_get::<Option<String>, _>("claim_upstream")?
                    .unwrap_or_default(),
                scope: row
                    .try_get::<Option<String>, _>("claim_scope")?
                    .unwrap_or_default(),
                key,
            },
            until: row.try_get::<Option<i64>, _>("claim_until")?.unwrap_or(0),
        }),
        None => None,
    };
    Ok(EntityState {
        entity: row.try_get("entity")?,
        version: row.try_get("version")?,
        claim,
        updated_at: row.try_get("updated_at")?,
    })
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE upstream = ? AND scope = ? AND key = ?"
        ))
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(&self.reads)
        .await?;
        row.as_ref().map(decode_key).transpose()
    }

    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        self.writer
            .write(move |c, now| Box::pin(async move { writes::reserve(c, &r, now).await }))
            .await
    }

    async fn finish(&self, id: &ScopedKey, epoch: i64, outcome: Finish) -> StoreResult<bool> {
        let id = id.clone();
        self.writer
            .write(move |c, now| {
                Box::pin(async move { writes::finish(c, &id, epoch, outcome, now).await })
            })
            .await
    }

    async fn renew(&self, id: &ScopedKey, epoch: i64, lease: Duration) -> StoreResult<bool> {
        let id = id.clone();
        let ms = lease.as_millis() as i64;
        self.writer
            .write(move |c, now| {
                Box::pin(async move { writes::renew(c, &id, epoch, now.saturating_add(ms)).await })
            })
            .await
    }

    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        let key = key.to_owned();
        self.writer
            .write(move |c, now| Box::pin(async move { writes::release_key(c, &key, now).await }))
            .await
    }

    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE key = ? ORDER BY created_at"
        ))
        .bind(key)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode_key).collect()
    }

    async fn list_keys(&self, f: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE (?1 IS NULL OR state = ?1) \
             AND (?2 IS NULL OR EXISTS (SELECT 1 FROM json_each(idem_keys.entities) WHERE value = ?2)) \
             ORDER BY updated_at DESC LIMIT ?3"
        ))
        .bind(f.state.map(KeyState::as_str))
        .bind(f.entity.as_deref())
        .bind(if f.limit > 0 { f.limit } else { 100 })
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode_key).collect()
    }

    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        let rows = sqlx::query(
            "SELECT entity, version, claim_upstream, claim_scope, claim_key, claim_until, updated_at \
             FROM idem_entities WHERE entity IN (SELECT value FROM json_each(?))",
        )
        .bind(encode_entities(entities))
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode_entity).collect()
    }

    async fn release_claim(&self, entity: &str) -> StoreResult<bool> {
        let entity = entity.to_owned();
        self.writer
            .write(move |c, now| {
                Box::pin(async move { writes::release_claim(c, &entity, now).await })
            })
            .await
    }

    async fn append_audit(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.writer
            .write(move |c, _| Box::pin(async move { writes::append_audit(c, &rows).await }))
            .await
    }

    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {AUDIT_COLUMNS} FROM idem_audit \
             WHERE EXISTS (SELECT 1 FROM json_each(idem_audit.entities) WHERE value = ?) ORDER BY id DESC LIMIT ?"
        ))
        .bind(entity)
        .bind(limit)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode_audit).collect()
    }

    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {AUDIT_COLUMNS} FROM idem_audit WHERE key = ? ORDER BY id DESC LIMIT ?"
        ))
        .bind(key)
        .bind(limit)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode_audit).collect()
    }

    async fn purge(&self, batch: i64, released_before: i64) -> StoreResult<u64> {
        self.writer
            .write(move |c, now| {
                Box::pin(async move { writes::purge(c, now, batch, released_before).await })
            })
            .await
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.reads).await?;
        self.writer
            .write(|c, now| Box::pin(async move { writes::probe(c, now).await }))
            .await
    }

    async fn close(&self) {
        // Queued writes run first; then the writer stops.
        self.writer.close().await;
        self.reads.close().await;
    }
}
