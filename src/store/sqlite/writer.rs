//! The group-commit writer: one connection, one task, one transaction per batch.
//!
//! Callers queue a [`Job`] (a closure that runs its SQL inside the batch's transaction) and
//! hear back only after the `COMMIT` — so a result is never acted on before it is durable —
//! while every job queued meanwhile shares that one commit and its fsync.

use crate::store::{StoreError, StoreResult};
use sqlx::{Connection, SqliteConnection};
use std::future::Future;
use std::pin::Pin;
use tokio::sync::{mpsc, oneshot};

/// Most jobs committed together.
const MAX_BATCH: usize = 256;

/// A future borrowing the writer's connection.
pub type ConnFuture<'c, T> = Pin<Box<dyn Future<Output = StoreResult<T>> + Send + 'c>>;

/// A result held until the commit says whether it stands (called with the commit error).
type Delivery = Box<dyn FnOnce(Option<&str>) + Send>;

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
    /// Stop after this batch (sent by `close`, once requests are done).
    Close(oneshot::Sender<()>),
}

/// The handle to the writer task.
pub struct Writer {
    tx: mpsc::Sender<Msg>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Writer {
    pub fn start(conn: SqliteConnection) -> Writer {
        let (tx, rx) = mpsc::channel(8192);
        let task = tokio::spawn(run(conn, rx));
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
        let (reply, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn, now| {
            Box::pin(async move {
                let res = f(conn, now).await;
                Box::new(move |failure: Option<&str>| {
                    let _ = reply.send(match failure {
                        Some(msg) => Err(StoreError(msg.to_owned())),
                        None => res,
                    });
                }) as Delivery
            })
        });
        self.tx.send(Msg::Job(job)).await.map_err(|_| stopped())?;
        // A dropped reply means the batch could not even begin (logged by the writer).
        rx.await
            .map_err(|_| StoreError("the SQLite store cannot write (see the log)".into()))?
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
    StoreError("the SQLite writer has stopped".into())
}

async fn run(mut conn: SqliteConnection, mut rx: mpsc::Receiver<Msg>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let mut jobs = Vec::with_capacity(batch.len());
        let mut closing = None;
        for msg in batch.drain(..) {
            match msg {
                Msg::Job(j) => jobs.push(j),
                Msg::Close(tx) => closing = Some(tx),
            }
        }
        if !jobs.is_empty() {
            run_batch(&mut conn, jobs).await;
        }
        if let Some(tx) = closing {
            let _ = tx.send(());
            break;
        }
    }
    let _ = conn.close().await;
}

/// Runs jobs in one transaction; their callers hear back only after the commit.
async fn run_batch(conn: &mut SqliteConnection, jobs: Vec<Job>) {
    if let Err(e) = sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
        // Dropping the jobs unrun drops their replies: every caller gets an error.
        tracing::error!(error = %e, jobs = jobs.len(), "SQLite cannot begin a write");
        return;
    }
    let now = crate::store::now_ms();
    let mut done = Vec::with_capacity(jobs.len());
    for job in jobs {
        done.push(job(conn, now).await);
    }
    let failure = match sqlx::query("COMMIT").execute(&mut *conn).await {
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
