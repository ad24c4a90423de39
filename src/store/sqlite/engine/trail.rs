//! A file written by a thread of its own, in turns: each turn runs every job queued in one
//! transaction and answers each, then, once enough rows were appended since the last time, runs
//! the file's upkeep. The audit trail's file is one (`store::sqlite::audit_file` gives it its
//! jobs and its upkeep, the by-key index's merge); the thread knows no table.
//!
//! Why a file and a thread of its own: rows of a trail are the store's most numerous writes,
//! and in the main database they rode in the reservations' group commits, so every
//! reservation's `fdatasync` also carried them (see `audit_file` for the figures).

use crate::store::{StoreError, StoreResult};
use rusqlite::Connection;
use std::sync::mpsc;
use tokio::sync::oneshot;

/// What a job did: its answer to its caller, and how many rows it appended (which count
/// towards the next upkeep).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wrote {
    pub answer: u64,
    pub appended: u64,
}

/// One job, run inside its turn's transaction.
pub type Job = Box<dyn FnOnce(&Connection) -> StoreResult<Wrote> + Send>;

/// What the file needs now and then, off its callers' turns: run once `every` rows were
/// appended since the last run (or since the thread started, `waiting` at its start).
pub struct Upkeep {
    pub every: u64,
    pub waiting: u64,
    pub run: fn(&Connection) -> StoreResult<u64>,
    /// Said in the warning when a run fails.
    pub what: &'static str,
}

/// What the thread is sent: a job, or the word to stop.
enum Msg {
    Job(Job, oneshot::Sender<StoreResult<u64>>),
    /// The jobs queued before it are written; then the thread closes the file and ends.
    Close(oneshot::Sender<()>),
}

/// The sending side of the thread; closed (or dropped), the thread writes what is queued and
/// ends.
pub struct Trail {
    jobs: mpsc::Sender<Msg>,
}

impl Trail {
    /// Starts the thread `name` over `conn`, its pragmas set by the caller.
    pub fn start(name: &str, conn: Connection, upkeep: Upkeep) -> StoreResult<Trail> {
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(conn, queue, upkeep))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the thread {name}: {e}")))?;
        Ok(Trail { jobs })
    }

    /// Runs `job` in the next turn; its answer once the turn is committed.
    pub async fn run(&self, job: Job) -> StoreResult<u64> {
        let (done, heard) = oneshot::channel();
        self.jobs
            .send(Msg::Job(job, done))
            .map_err(|_| StoreError::Closed)?;
        heard.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Writes what is queued, closes the file and ends the thread; a later job is refused with
    /// [`StoreError::Closed`], as the writer's are.
    pub async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.jobs.send(Msg::Close(done)).is_ok() {
            let _ = closed.await;
        }
    }
}

/// The thread: each turn takes every job queued up to a `Close`, runs them in one transaction
/// and answers each, then runs the upkeep if its rows are due. Jobs queued after a `Close` are
/// dropped unanswered: their callers hear [`StoreError::Closed`].
fn run(conn: Connection, queue: mpsc::Receiver<Msg>, upkeep: Upkeep) {
    let mut waiting = upkeep.waiting;
    while let Ok(first) = queue.recv() {
        let (mut jobs, mut tells, mut close) = (Vec::new(), Vec::new(), None);
        for msg in std::iter::once(first).chain(queue.try_iter().take(255)) {
            match msg {
                Msg::Job(job, tell) => {
                    jobs.push(job);
                    tells.push(tell);
                }
                Msg::Close(tell) => {
                    close = Some(tell);
                    break;
                }
            }
        }
        for (done, tell) in write(&conn, jobs).into_iter().zip(tells) {
            waiting += done.as_ref().map_or(0, |w| w.appended);
            drop(tell.send(done.map(|w| w.answer)));
        }
        if waiting >= upkeep.every {
            // A failed run leaves its work for the next; that waits for as many rows again, so
            // a lasting error costs a try (and a warning) an upkeep's worth of rows, not a turn.
            waiting = 0;
            if let Err(e) = (upkeep.run)(&conn) {
                tracing::warn!(error = %e, "cannot {}", upkeep.what);
            }
        }
        if let Some(tell) = close {
            drop(conn);
            let _ = tell.send(());
            return;
        }
    }
}

/// Runs `jobs` in one transaction: each one's result, or, if any job or the commit failed, that
/// error for all, with nothing stored (so rows counted as dropped were not written). No
/// savepoint per job: SQLite copies every page a savepoint (or a statement that may abort
/// halfway) changes into a journal in memory, and a trail's rows each change a page of their
/// own: 13% of this thread's time, measured with `perf` on the audit trail. A turn almost
/// always holds one job (the auditor awaits each append), so failing the turn whole costs
/// nothing in practice.
pub(in crate::store::sqlite) fn write(
    conn: &Connection,
    jobs: Vec<Job>,
) -> Vec<StoreResult<Wrote>> {
    let count = jobs.len();
    let failed = |e: StoreError| (0..count).map(|_| Err(e.clone())).collect();
    let tx = match conn.unchecked_transaction() {
        Ok(tx) => tx,
        Err(e) => return failed(e.into()),
    };
    let each: StoreResult<Vec<Wrote>> = jobs.into_iter().map(|job| job(&tx)).collect();
    match each.and_then(|each| tx.commit().map(|_| each).map_err(Into::into)) {
        Ok(each) => each.into_iter().map(Ok).collect(),
        // The transaction rolls back as it drops.
        Err(e) => failed(e),
    }
}
