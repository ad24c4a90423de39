//! The group-commit writer: one connection, one task, one transaction per batch.
//!
//! Callers queue a [`Job`] (a closure that runs its SQL inside the batch's transaction) and
//! hear back only after the `COMMIT` — so a result is never acted on before it is durable —
//! while every job queued meanwhile shares that one commit and its fsync.

use crate::store::{
    AuditRow, FinishColumns, Reservation, Reserved, ScopedKey, SharedCipher, StoreError,
    StoreResult,
};
use sqlx::{Connection, SqliteConnection};
use std::future::Future;
use std::pin::Pin;
use tokio::sync::{mpsc, oneshot};

/// Most jobs committed together.
const MAX_BATCH: usize = 256;
// A batch's reservations (or outcomes) fit one multi-row statement.
const _: () = assert!(MAX_BATCH <= super::keys::CHUNK);

/// A future borrowing the writer's connection.
pub type ConnFuture<'c, T> = Pin<Box<dyn Future<Output = StoreResult<T>> + Send + 'c>>;

/// A result held until the commit says whether it stands (called with the commit error).
type Delivery = Box<dyn FnOnce(Option<&str>) + Send>;

type Reply<T> = oneshot::Sender<StoreResult<T>>;

/// Holds `res` until the commit; a failed commit turns it into that error.
fn deliver<T: Send + 'static>(reply: Reply<T>, res: StoreResult<T>) -> Delivery {
    Box::new(move |failure: Option<&str>| {
        let _ = reply.send(match failure {
            Some(msg) => Err(StoreError::Unavailable(msg.to_owned())),
            None => res,
        });
    })
}

/// One write: runs inside the batch's transaction, given the batch's clock (ms).
type Job = Box<
    dyn for<'c> FnOnce(
            &'c mut SqliteConnection,
            i64,
        ) -> Pin<Box<dyn Future<Output = Delivery> + Send + 'c>>
        + Send,
>;

enum Msg {
    Job(Job),
    /// The writes every request makes, aggregated per batch into one statement each.
    Reserve(Reservation, Reply<Reserved>),
    /// Already sealed by the caller (encryption runs on the request's task, not here).
    Finish(ScopedKey, i64, FinishColumns, Reply<bool>),
    Audit(Vec<AuditRow>, Reply<()>),
    /// Stop after this batch (sent by `close`, once requests are done).
    Close(oneshot::Sender<()>),
}

/// The handle to the writer task.
pub struct Writer {
    tx: mpsc::Sender<Msg>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Writer {
    /// Starts the task; `cipher` opens the records a reservation finds standing.
    pub fn start(conn: SqliteConnection, cipher: SharedCipher) -> Writer {
        let (tx, rx) = mpsc::channel(8192);
        let task = tokio::spawn(run(conn, rx, cipher));
        Writer {
            tx,
            task: std::sync::Mutex::new(Some(task)),
        }
    }

    /// Runs `f` in the next batch and returns its result once committed.
    pub async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut SqliteConnection, i64) -> ConnFuture<'c, T> + Send + 'static,
    {
        self.send(move |reply| {
            Msg::Job(Box::new(move |conn, now| {
                Box::pin(async move { deliver(reply, f(conn, now).await) })
            }))
        })
        .await
    }

    pub async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        self.send(|reply| Msg::Reserve(r, reply)).await
    }

    pub async fn finish(&self, id: ScopedKey, epoch: i64, f: FinishColumns) -> StoreResult<bool> {
        self.send(|reply| Msg::Finish(id, epoch, f, reply)).await
    }

    pub async fn audit(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.send(|reply| Msg::Audit(rows, reply)).await
    }

    async fn send<T>(&self, msg: impl FnOnce(Reply<T>) -> Msg) -> StoreResult<T> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(msg(reply)).await.map_err(|_| stopped())?;
        // A dropped reply means the batch could not even begin (logged by the writer).
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Flushes queued writes, then stops the task.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Close(tx)).await.is_ok() {
            let _ = rx.await;
        }
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = task {
            let _ = t.await;
        }
    }
}

fn stopped() -> StoreError {
    StoreError::Closed
}

/// One batch, sorted by kind.
#[derive(Default)]
struct Batch {
    reserves: Vec<(Reservation, Reply<Reserved>)>,
    finishes: Vec<(ScopedKey, i64, FinishColumns, Reply<bool>)>,
    audits: Vec<(Vec<AuditRow>, Reply<()>)>,
    jobs: Vec<Job>,
}

impl Batch {
    /// One statement: only reservations, all for new keys or all taking over unknown ones (see
    /// `keys::reserve_many`), or only outcomes without entity effects (`keys::finish_many`).
    fn is_one_statement(&self) -> bool {
        if !self.audits.is_empty() || !self.jobs.is_empty() {
            return false;
        }
        let first = self.reserves.first().map(|(r, _)| r.take_unknown);
        let reserves = self
            .reserves
            .iter()
            .all(|(r, _)| Some(r.take_unknown) == first);
        let finishes = self
            .finishes
            .iter()
            .all(|(_, _, f, _)| f.effects.is_empty());
        match (self.reserves.is_empty(), self.finishes.is_empty()) {
            (false, true) => reserves,
            (true, false) => finishes,
            _ => false,
        }
    }

    fn is_empty(&self) -> bool {
        self.reserves.is_empty()
            && self.finishes.is_empty()
            && self.audits.is_empty()
            && self.jobs.is_empty()
    }
}

async fn run(mut conn: SqliteConnection, mut rx: mpsc::Receiver<Msg>, cipher: SharedCipher) {
    let mut msgs = Vec::with_capacity(MAX_BATCH);
    // Whether the connection is known to be outside any transaction (see `run_batch`).
    let mut clean = true;
    while rx.recv_many(&mut msgs, MAX_BATCH).await > 0 {
        let mut batch = Batch::default();
        let mut closing = None;
        for msg in msgs.drain(..) {
            match msg {
                Msg::Job(j) => batch.jobs.push(j),
                Msg::Reserve(r, reply) => batch.reserves.push((r, reply)),
                Msg::Finish(id, epoch, f, reply) => batch.finishes.push((id, epoch, f, reply)),
                Msg::Audit(rows, reply) => batch.audits.push((rows, reply)),
                Msg::Close(tx) => closing = Some(tx),
            }
        }
        if !batch.is_empty() {
            clean = run_batch(&mut conn, batch, cipher.as_deref(), clean).await;
        }
        if let Some(tx) = closing {
            let _ = tx.send(());
            break;
        }
    }
    let _ = conn.close().await;
}

/// Delivers one result to every reply of a group (an error is copied to each).
fn deliver_all<T: Send + 'static>(
    replies: Vec<Reply<T>>,
    res: StoreResult<Vec<T>>,
    done: &mut Vec<Delivery>,
) {
    match res {
        Ok(values) => done.extend(
            replies
                .into_iter()
                .zip(values)
                .map(|(r, v)| deliver(r, Ok(v))),
        ),
        Err(e) => done.extend(replies.into_iter().map(|r| deliver(r, Err(e.clone())))),
    }
}

/// Runs a batch in one transaction: one statement per kind of request write, then the other
/// jobs. Callers hear back only after the commit. Returns whether the connection is known to
/// be outside any transaction afterwards (`clean`: whether it was before).
async fn run_batch(
    conn: &mut SqliteConnection,
    batch: Batch,
    cipher: Option<&crate::store::seal::Cipher>,
    clean: bool,
) -> bool {
    // A batch that is one statement (a lone reservation, the common case at a light load) is
    // its own transaction, committed durably as it runs: two trips to sqlx's worker thread
    // fewer than BEGIN and COMMIT around it. Only on a connection known to be outside any
    // transaction (after a failed commit, inside one the statement would not commit): until
    // an explicit transaction commits again, batches begin one, which fails closed.
    let single = clean && batch.is_one_statement();
    if !single {
        if let Err(e) = sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
            // Dropping the batch unrun drops its replies: every caller gets an error. A
            // transaction left open by a failed commit is let go for the next batch.
            tracing::error!(error = %e, "SQLite cannot begin a write");
            let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
            return false;
        }
    }
    let now = crate::store::now_ms();
    let started = std::time::Instant::now();
    let sizes = (
        batch.reserves.len(),
        batch.finishes.len(),
        batch.audits.len(),
        batch.jobs.len(),
    );
    let mut done: Vec<Delivery> = Vec::new();
    if !batch.reserves.is_empty() {
        let (rs, replies): (Vec<_>, Vec<_>) = batch.reserves.into_iter().unzip();
        let res = super::keys::reserve_many(conn, &rs, now, cipher).await;
        done.extend(replies.into_iter().zip(res).map(|(r, v)| deliver(r, v)));
    }
    if !batch.finishes.is_empty() {
        let (fs, replies): (Vec<_>, Vec<_>) = batch
            .finishes
            .into_iter()
            .map(|(id, e, f, r)| ((id, e, f), r))
            .unzip();
        let res = super::keys::finish_many(conn, fs, now).await;
        deliver_all(replies, res, &mut done);
    }
    if !batch.audits.is_empty() {
        let (rows, replies): (Vec<_>, Vec<_>) = batch.audits.into_iter().unzip();
        let rows: Vec<AuditRow> = rows.into_iter().flatten().collect();
        let res = super::audit::append_audit(conn, &rows).await;
        let n = replies.len();
        deliver_all(replies, res.map(|()| vec![(); n]), &mut done);
    }
    for job in batch.jobs {
        done.push(job(conn, now).await);
    }
    let ran = started.elapsed();
    let failure = match single {
        true => None,
        false => commit(conn).await,
    };
    tracing::trace!(?sizes, ?ran, total = ?started.elapsed(), "write batch committed");
    let clean = single || failure.is_none();
    for d in done {
        d(failure.as_deref());
    }
    clean
}

/// Commits the batch's transaction: `Some(why)` when it could not.
async fn commit(conn: &mut SqliteConnection) -> Option<String> {
    match sqlx::query("COMMIT").execute(&mut *conn).await {
        Ok(_) => None,
        Err(e) => {
            // Leave no transaction open behind a failed commit (ignore "no transaction").
            let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
            Some(format!("commit failed: {e}"))
        }
    }
}
