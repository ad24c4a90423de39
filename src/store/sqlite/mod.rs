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

mod batch;
mod writer;
mod writes;

use super::codec::encode_entities;
use super::*;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, SqliteConnection, SqlitePool};
use std::str::FromStr;
use writer::Writer;

use super::rows::{
    self, AUDIT_COLUMNS_SQLITE as AUDIT_COLUMNS, ENTITY_COLUMNS, KEY_COLUMNS_SQLITE as KEY_COLUMNS,
};

/// [`KeyRecord::effective_state`] in SQL (`?4` is now): what `keys list --state` filters on, so
/// an abandoned in-flight key lists as `unknown`.
const EFFECTIVE_STATE: &str =
    "(CASE WHEN state = 'in_flight' AND lease_until <= ?4 THEN 'unknown' \
     WHEN state = 'completed' AND expires_at < ?4 THEN 'released' ELSE state END)";

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
        owner_only(opts.get_filename())?;
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
        // The writer's multi-row statements come in many shapes (one per batch size): keep
        // them all prepared.
        let mut conn =
            SqliteConnection::connect_with(&opts.clone().statement_cache_capacity(1024)).await?;
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

/// Files that hold stored answers (customer data) are readable by their owner only: the
/// database is created `0600` before SQLite opens it (its WAL and shared-memory files take
/// the database's mode), and files left `0644` by an earlier release are tightened.
fn owner_only(db: &std::path::Path) -> StoreResult<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        if db.as_os_str().is_empty() || db.as_os_str() == ":memory:" {
            return Ok(());
        }
        if let Err(e) = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(db)
        {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(StoreError(format!("cannot create {}: {e}", db.display())));
            }
        }
        for suffix in ["", "-wal", "-shm", ".lock"] {
            let mut path = db.as_os_str().to_owned();
            path.push(suffix);
            let path = std::path::PathBuf::from(path);
            if let Ok(meta) = std::fs::metadata(&path) {
                if meta.permissions().mode() & 0o077 != 0 {
                    let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
                }
            }
        }
    }
    Ok(())
}

/// The scope secret of a SQLite store whose config names none: 32 random bytes kept in
/// `<db>.secret` (`0600`), generated on first start. A file of its own, so a copy of the
/// database alone does not carry it; losing it makes every stored key look new, so back it
/// up with the database.
pub fn default_scope_secret(url: &str) -> StoreResult<Vec<u8>> {
    let path = secret_path(url)?;
    match std::fs::read_to_string(&path) {
        Ok(text) if text.trim().len() >= 32 => return Ok(text.trim().as_bytes().to_vec()),
        Ok(_) => {
            return Err(StoreError(format!(
                "{} holds no usable secret (delete it only if the database is new)",
                path.display()
            )))
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(StoreError(format!("cannot read {}: {e}", path.display())))
        }
        Err(_) => {}
    }
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| StoreError("no system randomness for the scope secret".into()))?;
    let secret = hex::encode(bytes);
    let mut open = std::fs::OpenOptions::new();
    open.create_new(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let written = open.open(&path).and_then(|mut f| {
        use std::io::Write;
        f.write_all(secret.as_bytes())?;
        f.sync_all()
    });
    written.map_err(|e| StoreError(format!("cannot create {}: {e}", path.display())))?;
    Ok(secret.into_bytes())
}

fn secret_path(url: &str) -> StoreResult<std::path::PathBuf> {
    let opts = SqliteConnectOptions::from_str(url)?;
    let mut path = opts.get_filename().as_os_str().to_owned();
    path.push(".secret");
    Ok(path.into())
}

/// The generated scope secret, if the store has one already (never creates it): what
/// `explain` keys scopes with, to show what the proxy stores.
pub fn existing_scope_secret(url: &str) -> Option<Vec<u8>> {
    let text = std::fs::read_to_string(secret_path(url).ok()?).ok()?;
    let text = text.trim();
    (text.len() >= 32).then(|| text.as_bytes().to_vec())
}

fn lock_path(db: &std::path::Path) -> std::path::PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(".lock");
    path.into()
}

/// The admin address of the `serve` process holding this database, if one runs: it writes
/// the address into the lock file it holds. The CLI releases keys through it, so the running
/// proxy's replay cache forgets them at once.
pub fn running_admin(url: &str) -> Option<std::net::SocketAddr> {
    let opts = SqliteConnectOptions::from_str(url).ok()?;
    let path = lock_path(opts.get_filename());
    let file = std::fs::File::open(&path).ok()?;
    if file.try_lock_shared().is_ok() {
        return None; // nobody holds it: no proxy is running
    }
    std::fs::read_to_string(&path).ok()?.trim().parse().ok()
}

fn lock_file(db: &std::path::Path) -> StoreResult<std::fs::File> {
    let path = lock_path(db);
    let mut open = std::fs::OpenOptions::new();
    open.create(true).truncate(false).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let file = open
        .open(&path)
        .map_err(|e| StoreError(format!("cannot open {}: {e}", path.display())))?;
    file.try_lock().map_err(|_| {
        StoreError(format!(
            "{} is in use by another idemproxy serve process; SQLite serves one process (use PostgreSQL for several replicas)",
            db.display()
        ))
    })?;
    Ok(file)
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn advertise_admin(&self, addr: std::net::SocketAddr) {
        use std::io::{Seek, Write};
        if let Some(mut f) = self._lock.as_ref() {
            let written = f
                .set_len(0)
                .and_then(|_| f.rewind())
                .and_then(|_| f.write_all(addr.to_string().as_bytes()));
            if let Err(e) = written {
                tracing::warn!(error = %e, "cannot write the admin address into the lock file");
            }
        }
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
        row.as_ref().map(rows::key_record).transpose()
    }

    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        self.writer.reserve(r).await
    }

    async fn finish(&self, id: &ScopedKey, epoch: i64, outcome: Finish) -> StoreResult<bool> {
        self.writer.finish(id.clone(), epoch, outcome).await
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
        rows.iter().map(rows::key_record).collect()
    }

    async fn list_keys(&self, f: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE (?1 IS NULL OR {EFFECTIVE_STATE} = ?1) \
             AND (?2 IS NULL OR EXISTS (SELECT 1 FROM json_each(idem_keys.entities) WHERE {})) \
             ORDER BY updated_at DESC LIMIT ?3",
            names_entity("value", "?2")
        ))
        .bind(f.state.map(KeyState::as_str))
        .bind(f.entity.as_deref())
        .bind(if f.limit > 0 { f.limit } else { 100 })
        .bind(now_ms())
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(rows::key_record).collect()
    }

    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        let rows = sqlx::query(
            &format!("SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE entity IN (SELECT value FROM json_each(?))"),
        )
        .bind(encode_entities(entities))
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(rows::entity_state).collect()
    }

    async fn release_claim(&self, entity: &str) -> StoreResult<bool> {
        let entity = entity.to_owned();
        self.writer
            .write(move |c, now| {
                Box::pin(async move { writes::release_claims(c, &entity, now).await })
            })
            .await
    }

    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>> {
        let rows = sqlx::query(&format!(
            "SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE {} ORDER BY entity LIMIT 100",
            names_entity("entity", "?1")
        ))
        .bind(entity)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(rows::entity_state).collect()
    }

    async fn reset_version(&self, entity: &str) -> StoreResult<u64> {
        let entity = entity.to_owned();
        self.writer
            .write(move |c, now| {
                Box::pin(async move { writes::reset_version(c, &entity, now).await })
            })
            .await
    }

    async fn scope_secret(&self, id: &str) -> StoreResult<ScopeCheck> {
        let id = id.to_owned();
        self.writer
            .write(move |c, _now| Box::pin(async move { writes::scope_secret(c, &id).await }))
            .await
    }

    async fn append_audit(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.writer.audit(rows).await
    }

    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {AUDIT_COLUMNS} FROM idem_audit \
             WHERE EXISTS (SELECT 1 FROM json_each(idem_audit.entities) WHERE {}) ORDER BY id DESC LIMIT ?2",
            names_entity("value", "?1")
        ))
        .bind(entity)
        .bind(limit)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(rows::audit_row).collect()
    }

    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {AUDIT_COLUMNS} FROM idem_audit WHERE key = ? ORDER BY id DESC LIMIT ?"
        ))
        .bind(key)
        .bind(limit)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(rows::audit_row).collect()
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
