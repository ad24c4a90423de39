//! SQLite backend: WAL, durable commits, one writer thread with group commit.
//!
//! Above the line, this folder is SQL and jobs: the tables' statements ([`keys`],
//! [`entities`], [`audit`] and the trail's by-key index [`audit_index`], [`operator`],
//! [`meta`]), the request path's reads ([`reads`]), the audit file's set-up and jobs
//! ([`audit_file`]), and how a release made by another process reaches this one
//! ([`releases`]). Below it, [`engine`] runs them knowing no table: the writer thread and its
//! group commit, the syncer, the WAL-gathering VFS, the inbox of replies, the audit file's
//! thread, and the pool of read-only connections the request path reads through.
//!
//! Every write goes through one connection owned by the writer thread. It drains whatever
//! writes are queued into one transaction and answers each caller only after the `COMMIT` is
//! on disk (the `fsync` runs on a thread of its own, beside the next batch) — so a reservation
//! is durable before anything is forwarded, yet many concurrent first writes share one fsync
//! instead of paying one each. Reads run beside the writer (WAL): the request path's on the
//! caller's own thread ([`reads`]), the operator's on a sqlx pool. The audit trail is the one
//! exception to the one writer: it lives in a file of its own, written by a thread of its own,
//! so its pages never ride in a reservation's `fsync`.
//!
//! SQLite serves one `serve` process: with `exclusive`, the store takes an OS lock on
//! `<db>.lock`, so a second `serve` on the same file refuses to start, and any record still
//! `in_flight` at start was left by a dead process: it becomes `unknown` at once.

mod audit;
mod audit_file;
mod audit_index;
mod engine;
mod entities;
mod keys;
mod meta;
mod operator;
mod reads;
mod releases;

use super::codec::encode_entities;
use super::*;
use engine::writer::Writer;
use engine::{durable, walbuf};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;
use std::str::FromStr;
use std::sync::Arc;

use super::rows::{
    self, AUDIT_COLUMNS_SQLITE as AUDIT_COLUMNS, ENTITY_COLUMNS, KEY_COLUMNS_SQLITE as KEY_COLUMNS,
};

pub struct SqliteStore {
    reads: SqlitePool,
    /// The audit trail's file and its thread (see [`audit_file`]), and reads of it.
    audit: audit_file::AuditFile,
    audit_reads: SqlitePool,
    /// The request path's reads (a key's record, entities' states), on the caller's thread
    /// (see [`reads`]).
    reader: engine::reader::Reader,
    writer: Arc<Writer>,
    /// Held for the life of a `serve` process: the exclusive lock on `<db>.lock`.
    lock: Option<std::fs::File>,
    /// The database file.
    db: std::path::PathBuf,
    /// Told of releases made by other processes (see [`releases`]).
    observer: releases::Observer,
    /// Stops the serving process's reader of release notes.
    stop: tokio_util::sync::CancellationToken,
    /// Seals answers before they go to the writer, opens them when read (see [`super::seal`]).
    cipher: SharedCipher,
}

impl SqliteStore {
    pub async fn open(
        url: &str,
        _lease: Duration,
        exclusive: bool,
        cipher: SharedCipher,
    ) -> StoreResult<SqliteStore> {
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
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts.clone())
            .await?;
        sqlx::migrate!("migrations/sqlite").run(&reads).await?;
        let audit = audit_file::AuditFile::open(opts.get_filename())?;
        let audit_reads = SqlitePoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(
                opts.clone()
                    .filename(audit_file::path_of(opts.get_filename())),
            )
            .await?;
        let conn = writer_connection(opts.get_filename(), cipher.is_some(), exclusive)?;
        let syncer = pipelined_sync(&conn, opts.get_filename())?;
        let writer = Arc::new(Writer::start(conn, cipher.clone(), syncer)?);
        let observer = releases::Observer::default();
        let stop = tokio_util::sync::CancellationToken::new();
        if exclusive {
            releases::watch(
                reads.clone(),
                writer.clone(),
                observer.clone(),
                stop.clone(),
            );
        }
        Ok(SqliteStore {
            reader: engine::reader::Reader::new(opts.get_filename()),
            reads,
            audit,
            audit_reads,
            writer,
            lock,
            db: opts.get_filename().to_owned(),
            observer,
            stop,
            cipher,
        })
    }
}

/// A connection that writes each commit's WAL frames in one call (see [`walbuf`]), or a plain
/// one if that VFS cannot register: for the connections that write (the writer's, the audit
/// file's).
fn open_gathering(db: &std::path::Path) -> StoreResult<rusqlite::Connection> {
    Ok(match walbuf::register() {
        Some(vfs) => {
            rusqlite::Connection::open_with_flags_and_vfs(db, rusqlite::OpenFlags::default(), vfs)?
        }
        None => rusqlite::Connection::open(db)?,
    })
}

/// The writer's own connection (`rusqlite`, on the same SQLite library as the read pool): WAL,
/// `synchronous = FULL` until [`pipelined_sync`] takes the sync over.
fn writer_connection(
    db: &std::path::Path,
    secure_delete: bool,
    exclusive: bool,
) -> StoreResult<rusqlite::Connection> {
    if db.as_os_str().is_empty() || db.as_os_str() == ":memory:" {
        return Err(StoreError::Unavailable(
            "the SQLite store needs a database file (an in-memory database is not durable)".into(),
        ));
    }
    let conn = open_gathering(db)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(64);
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    // Statement journals in memory: a multi-row statement inside a batch (the audit inserts)
    // keeps a copy of every page it changes, and past 64 KiB SQLite spilled it to a temp file
    // created, written and deleted each time (~1,400 times a second at 64 first writes).
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    if secure_delete {
        // Deleted rows (purged keys, answers replaced by a new attempt) are zeroed where that
        // costs no extra I/O, so clear answers written before encryption was turned on do not
        // linger in free pages once purged.
        conn.pragma_update(None, "secure_delete", "FAST")?;
    }
    if exclusive {
        // Whoever owned these is gone (we hold the process lock): outcome unknown.
        conn.execute(
            "UPDATE idem_keys SET state = 'unknown', owner = NULL, updated_at = ?1 WHERE state = 'in_flight'",
            [now_ms()],
        )?;
    }
    Ok(conn)
}

/// Moves the writer's `fsync` off its critical path (see [`durable`]): a first durable write
/// (under `FULL`, which creates the WAL and syncs its directory entry), then the syncer on that
/// WAL and `synchronous = NORMAL` on the writer's connection. Where the WAL cannot be opened,
/// the connection stays `FULL` and syncs every commit itself.
fn pipelined_sync(
    conn: &rusqlite::Connection,
    db: &std::path::Path,
) -> StoreResult<Option<durable::Syncer>> {
    meta::probe(conn, now_ms())?;
    // The WAL SQLite writes is beside the database as SQLite names it — a symlink resolved to
    // its target — not beside the configured path, where a stale `-wal` may lie: syncing that
    // would make nothing durable.
    let named = conn
        .path()
        .filter(|p| !p.is_empty())
        .map(std::path::Path::new);
    let db = named.unwrap_or(db);
    match durable::Syncer::start(db) {
        Ok(syncer) => {
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            Ok(Some(syncer))
        }
        Err(e) => {
            tracing::warn!(error = %e, db = %db.display(), "SQLite WAL not found: every commit syncs on the writer");
            Ok(None)
        }
    }
}

/// A row of the writer's connection, read through the decoders both backends share.
pub(super) struct Lite<'a, 'r>(pub &'a rusqlite::Row<'r>);

impl rows::Cols for Lite<'_, '_> {
    fn text(&self, col: &str) -> StoreResult<String> {
        Ok(self.0.get(col)?)
    }
    fn opt_text(&self, col: &str) -> StoreResult<Option<String>> {
        Ok(self.0.get(col)?)
    }
    fn int(&self, col: &str) -> StoreResult<i64> {
        Ok(self.0.get(col)?)
    }
    fn opt_int(&self, col: &str) -> StoreResult<Option<i64>> {
        Ok(self.0.get(col)?)
    }
    fn opt_bytes(&self, col: &str) -> StoreResult<Option<Vec<u8>>> {
        Ok(self.0.get(col)?)
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
                return Err(StoreError::File(format!(
                    "cannot create {}: {e}",
                    db.display()
                )));
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

fn lock_path(db: &std::path::Path) -> std::path::PathBuf {
    beside(db, ".lock")
}

/// The file named as `db` with `suffix` appended (`<db>.lock`, `<db>.audit`).
fn beside(db: &std::path::Path, suffix: &str) -> std::path::PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(suffix);
    path.into()
}

fn lock_file(db: &std::path::Path) -> StoreResult<std::fs::File> {
    let path = lock_path(db);
    let mut open = std::fs::OpenOptions::new();
    open.create(true).truncate(false).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let file = open
        .open(&path)
        .map_err(|e| StoreError::File(format!("cannot open {}: {e}", path.display())))?;
    // A CLI process checks for a running proxy with a brief shared lock: try again before
    // concluding that another `serve` holds the file.
    let mut locked = file.try_lock();
    for _ in 0..5 {
        if locked.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        locked = file.try_lock();
    }
    locked.map_err(|_| {
        StoreError::InUse(format!(
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
    async fn scope_secret(&self, id: &str) -> StoreResult<ScopeCheck> {
        let id = id.to_owned();
        self.writer
            .write(move |ctx| meta::scope_secret(ctx.conn, &id))
            .await
    }
    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.reads).await?;
        self.writer
            .write(|ctx| meta::probe(ctx.conn, ctx.now))
            .await
    }
    async fn close(&self) {
        self.stop.cancel();
        // Queued writes run first; then the writer stops.
        self.writer.close().await;
        self.reads.close().await;
        self.audit.close().await;
        self.audit_reads.close().await;
    }
    fn observe_releases(&self, f: ReleaseObserver) {
        *self.observer.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }
}
