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

use super::codec::{decode_entities, decode_headers, encode_entities, encode_headers};
use super::*;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Row, SqliteConnection, SqlitePool};
use std::str::FromStr;
use tokio::sync::{mpsc, oneshot};

/// Most writes committed together in one transaction.
const MAX_BATCH: usize = 128;

const COLUMNS: &str =
    "upstream, scope, key, fingerprint, route, entities, state, owner, lease_until, \
                       epoch, attempts, status, headers, body, created_at, updated_at, expires_at";

pub struct SqliteStore {
    reads: SqlitePool,
    writes: mpsc::Sender<Op>,
    writer: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Held for the life of a `serve` process: the exclusive lock on `<db>.lock`.
    _lock: Option<std::fs::File>,
}

type Reply<T> = oneshot::Sender<StoreResult<T>>;

/// A result waiting for the batch's commit: called with the commit error, if any.
type Delivery = Box<dyn FnOnce(Option<&str>) + Send>;

enum Op {
    Reserve(Reservation, Reply<Reserved>),
    Finish(ScopedKey, i64, Finish, Reply<bool>),
    Renew(ScopedKey, i64, Duration, Reply<bool>),
    Release(String, Reply<u64>),
    /// A write that proves the file can still be written (readiness).
    Probe(Reply<()>),
    /// Stop after this batch (sent by `close`, after the last request finished).
    Close(Reply<()>),
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
        let (tx, rx) = mpsc::channel(4096);
        let writer = tokio::spawn(writer(conn, rx));
        Ok(SqliteStore {
            reads,
            writes: tx,
            writer: std::sync::Mutex::new(Some(writer)),
            _lock: lock,
        })
    }

    async fn write<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> StoreResult<T> {
        let (tx, rx) = oneshot::channel();
        self.writes
            .send(make(tx))
            .await
            .map_err(|_| StoreError("the SQLite writer has stopped".into()))?;
        rx.await
            .map_err(|_| StoreError("the SQLite writer dropped a write".into()))?
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

async fn writer(mut conn: SqliteConnection, mut rx: mpsc::Receiver<Op>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let closing = batch.iter().any(|op| matches!(op, Op::Close(_)));
        run_batch(&mut conn, std::mem::take(&mut batch)).await;
        if closing {
            break;
        }
    }
    let _ = conn.close().await;
}

/// Runs queued writes in one transaction; callers hear back only after the commit.
async fn run_batch(conn: &mut SqliteConnection, batch: Vec<Op>) {
    if let Err(e) = sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
        let msg = format!("cannot begin a write: {e}");
        for op in batch {
            op.fail(&msg);
        }
        return;
    }
    let now = now_ms();
    let mut done: Vec<Delivery> = Vec::with_capacity(batch.len());
    for op in batch {
        match op {
            Op::Reserve(r, tx) => {
                let res = reserve(conn, &r, now).await;
                done.push(deliver(tx, res));
            }
            Op::Finish(id, epoch, outcome, tx) => {
                let res = finish(conn, &id, epoch, outcome, now).await;
                done.push(deliver(tx, res));
            }
            Op::Renew(id, epoch, lease, tx) => {
                let until = now.saturating_add(lease.as_millis() as i64);
                let res = sqlx::query("UPDATE idem_keys SET lease_until = ? WHERE upstream = ? AND scope = ? AND key = ? AND state = 'in_flight' AND epoch = ?")
                    .bind(until).bind(&id.upstream).bind(&id.scope).bind(&id.key).bind(epoch)
                    .execute(&mut *conn).await.map(|r| r.rows_affected() == 1).map_err(StoreError::from);
                done.push(deliver(tx, res));
            }
            Op::Release(key, tx) => {
                let res = sqlx::query("UPDATE idem_keys SET state = 'released', owner = NULL, updated_at = ?1 WHERE key = ?2 AND state != 'released' AND NOT (state = 'in_flight' AND lease_until >= ?1)")
                    .bind(now).bind(&key)
                    .execute(&mut *conn).await.map(|r| r.rows_affected()).map_err(StoreError::from);
                done.push(deliver(tx, res));
            }
            Op::Probe(tx) => {
                let res = sqlx::query("INSERT INTO idem_probe (id, at) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET at = excluded.at")
                    .bind(now)
                    .execute(&mut *conn)
                    .await
                    .map(|_| ())
                    .map_err(StoreError::from);
                done.push(deliver(tx, res));
            }
            Op::Close(tx) => done.push(deliver(tx, Ok(()))),
        }
    }
    let commit = sqlx::query("COMMIT").execute(&mut *conn).await;
    let failure = match &commit {
        Ok(_) => None,
        Err(e) => {
            // Leave no transaction open behind a failed commit (ignore "no transaction").
            let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
            Some(format!("commit failed: {e}"))
        }
    };
    for d in done {
        d(failure.as_deref());
    }
}

/// Holds a result until the commit says whether it stands.
fn deliver<T: Send + 'static>(tx: Reply<T>, res: StoreResult<T>) -> Delivery {
    Box::new(move |failure| {
        let _ = tx.send(match failure {
            Some(msg) => Err(StoreError(msg.to_owned())),
            None => res,
        });
    })
}

impl Op {
    fn fail(self, msg: &str) {
        let err = || StoreError(msg.to_owned());
        match self {
            Op::Reserve(_, tx) => drop(tx.send(Err(err()))),
            Op::Finish(_, _, _, tx) => drop(tx.send(Err(err()))),
            Op::Renew(_, _, _, tx) => drop(tx.send(Err(err()))),
            Op::Release(_, tx) => drop(tx.send(Err(err()))),
            Op::Probe(tx) | Op::Close(tx) => drop(tx.send(Err(err()))),
        }
    }
}

async fn reserve(conn: &mut SqliteConnection, r: &Reservation, now: i64) -> StoreResult<Reserved> {
    let row = sqlx::query(
        "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, owner, lease_until, epoch, attempts, created_at, updated_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'in_flight', ?7, ?8, 1, 1, ?9, ?9) \
         ON CONFLICT (upstream, scope, key) DO UPDATE SET \
           fingerprint = excluded.fingerprint, route = excluded.route, entities = excluded.entities, \
           state = 'in_flight', owner = excluded.owner, lease_until = excluded.lease_until, \
           epoch = idem_keys.epoch + 1, attempts = idem_keys.attempts + 1, updated_at = excluded.updated_at, \
           status = NULL, headers = NULL, body = NULL, expires_at = NULL \
         WHERE idem_keys.state = 'released' \
            OR (idem_keys.state = 'completed' AND idem_keys.expires_at < ?9) \
            OR (?10 AND (idem_keys.state = 'unknown' OR (idem_keys.state = 'in_flight' AND idem_keys.lease_until <= ?9))) \
         RETURNING epoch",
    )
    .bind(&r.id.upstream)
    .bind(&r.id.scope)
    .bind(&r.id.key)
    .bind(&r.fingerprint)
    .bind(&r.route)
    .bind(encode_entities(&r.entities))
    .bind(&r.owner)
    .bind(now.saturating_add(r.lease.as_millis() as i64))
    .bind(now)
    .bind(r.take_unknown)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(row) = row {
        return Ok(Reserved::Owned {
            epoch: row.try_get(0)?,
        });
    }
    let existing = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM idem_keys WHERE upstream = ? AND scope = ? AND key = ?"
    ))
    .bind(&r.id.upstream)
    .bind(&r.id.scope)
    .bind(&r.id.key)
    .fetch_one(&mut *conn)
    .await?;
    Ok(Reserved::Existing(Box::new(decode(&existing)?)))
}

async fn finish(
    conn: &mut SqliteConnection,
    id: &ScopedKey,
    epoch: i64,
    outcome: Finish,
    now: i64,
) -> StoreResult<bool> {
    let (state, status, headers, body, expires) = match outcome {
        Finish::Completed {
            response,
            expires_at,
        } => (
            "completed",
            Some(response.status as i64),
            Some(encode_headers(&response.headers)),
            Some(response.body),
            Some(expires_at),
        ),
        Finish::Released => ("released", None, None, None, None),
        Finish::Unknown => ("unknown", None, None, None, None),
    };
    let res = sqlx::query(
        "UPDATE idem_keys SET state = ?, status = ?, headers = ?, body = ?, expires_at = ?, owner = NULL, updated_at = ? \
         WHERE upstream = ? AND scope = ? AND key = ? AND state = 'in_flight' AND epoch = ?",
    )
    .bind(state)
    .bind(status)
    .bind(headers)
    .bind(body.as_deref())
    .bind(expires)
    .bind(now)
    .bind(&id.upstream)
    .bind(&id.scope)
    .bind(&id.key)
    .bind(epoch)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected() == 1)
}

fn decode(row: &SqliteRow) -> StoreResult<KeyRecord> {
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

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE upstream = ? AND scope = ? AND key = ?"
        ))
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(&self.reads)
        .await?;
        row.as_ref().map(decode).transpose()
    }

    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        self.write(|tx| Op::Reserve(r, tx)).await
    }

    async fn finish(&self, id: &ScopedKey, epoch: i64, outcome: Finish) -> StoreResult<bool> {
        self.write(|tx| Op::Finish(id.clone(), epoch, outcome, tx))
            .await
    }

    async fn renew(&self, id: &ScopedKey, epoch: i64, lease: Duration) -> StoreResult<bool> {
        self.write(|tx| Op::Renew(id.clone(), epoch, lease, tx))
            .await
    }

    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        self.write(|tx| Op::Release(key.to_owned(), tx)).await
    }

    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE key = ? ORDER BY created_at"
        ))
        .bind(key)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn list_keys(&self, f: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE (?1 IS NULL OR state = ?1) \
             AND (?2 IS NULL OR EXISTS (SELECT 1 FROM json_each(idem_keys.entities) WHERE value = ?2)) \
             ORDER BY updated_at DESC LIMIT ?3"
        ))
        .bind(f.state.map(KeyState::as_str))
        .bind(f.entity.as_deref())
        .bind(if f.limit > 0 { f.limit } else { 100 })
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.reads).await?;
        self.write(Op::Probe).await
    }

    async fn close(&self) {
        // Queued writes run first: the writer handles the batch holding `Close`, then stops.
        let _ = self.write(Op::Close).await;
        let handle = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.await;
        }
        self.reads.close().await;
    }
}
