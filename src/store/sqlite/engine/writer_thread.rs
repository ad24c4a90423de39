//! The writer's thread: what goes into a batch (its queue, the outcomes that wait in
//! [`super::super::deferred`], the linger), and the batch run in one transaction.

use super::{Heard, Job, Linger, Msg, Tx, MAX_BATCH};
use crate::store::sqlite::engine::deferred::Deferred;
use crate::store::sqlite::engine::durable::Syncer;
use crate::store::sqlite::engine::inbox::Delivery;
use crate::store::sqlite::engine::pace::{Pace, Ran};
use crate::store::SharedCipher;
use rusqlite::Connection;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Where the writer's jobs come from: its queue, and the outcomes that wait without waking it.
pub(super) struct Queues {
    pub(super) rx: flume::Receiver<Msg>,
    pub(super) deferred: Arc<Deferred>,
}

impl Queues {
    /// The next message, blocking only when no outcome waits (`Some(None)`: go on without
    /// one); `None` once every sender is gone. The queue is watched for a while before the
    /// thread blocks when `pace` says so, and `pace` learns how long the wait was.
    fn next(&self, pace: &mut Pace) -> Option<Option<Msg>> {
        if !self.deferred.park() {
            return Some(None);
        }
        let started = Instant::now();
        if let Some(spin) = pace.spin() {
            loop {
                match self.rx.try_recv() {
                    Ok(msg) => {
                        self.deferred.unpark();
                        pace.waited(started.elapsed());
                        return Some(Some(msg));
                    }
                    Err(flume::TryRecvError::Disconnected) => return None,
                    Err(flume::TryRecvError::Empty) if started.elapsed() < spin => {
                        std::hint::spin_loop()
                    }
                    Err(flume::TryRecvError::Empty) => break,
                }
            }
        }
        let msg = self.rx.recv().ok()?;
        self.deferred.unpark();
        pace.waited(started.elapsed());
        Some(Some(msg))
    }
}

pub(super) fn run(
    conn: Connection,
    queues: Queues,
    cipher: SharedCipher,
    syncer: Option<Syncer>,
    linger: Linger,
    mut pace: Pace,
) {
    let mut jobs: Vec<(Job, Heard)> = Vec::with_capacity(MAX_BATCH);
    let mut closing = None;
    let ctx = |conn| Tx {
        conn,
        now: crate::store::now_ms(),
        cipher: cipher.as_deref(),
    };
    while let Some(first) = queues.next(&mut pace) {
        let linger = || linger.wait(|| syncer.as_ref().is_some_and(Syncer::busy));
        gather(first, &queues, &mut jobs, &mut closing, linger);
        if !jobs.is_empty() {
            let batch = Batch {
                queues: &queues,
                closing: &mut closing,
                syncer: syncer.as_ref(),
            };
            pace.record(run_batch(&ctx(&conn), std::mem::take(&mut jobs), batch));
        }
        if closing.is_some() {
            break;
        }
    }
    // Outcomes handed over before the last requests ended are committed, not dropped.
    let rest = queues.deferred.close();
    if !rest.is_empty() {
        let batch = Batch {
            queues: &queues,
            closing: &mut closing,
            syncer: syncer.as_ref(),
        };
        run_batch(&ctx(&conn), rest, batch);
    }
    drop(conn);
    if let Some(s) = syncer {
        // The last batches' replies are delivered (after their sync) before `close` returns.
        s.close();
    }
    if let Some(tx) = closing {
        let _ = tx.send(());
    }
}

/// Takes `first`, whatever else is queued and the outcomes that wait into `jobs`. Jobs that
/// are all heard of at their commit wait for one that is waited on, which ends the wait, as
/// long as `linger` says when first asked (`None`: not at all).
fn gather(
    first: Option<Msg>,
    queues: &Queues,
    jobs: &mut Vec<(Job, Heard)>,
    closing: &mut Option<oneshot::Sender<()>>,
    linger: impl FnOnce() -> Option<Duration>,
) {
    let mut linger = Some(linger);
    let mut waited_on = false;
    let mut until = None;
    let mut next = first;
    loop {
        match next.take() {
            Some(Msg::Job(job, heard)) => {
                waited_on |= heard == Heard::Synced;
                jobs.push((job, heard));
            }
            Some(Msg::Nudge) | None => {}
            Some(Msg::Close(tx)) => {
                *closing = Some(tx);
                break;
            }
        }
        if jobs.len() >= MAX_BATCH {
            break;
        }
        next = match queues.rx.try_recv() {
            Ok(msg) => Some(msg),
            Err(_) if waited_on => break,
            Err(_) if jobs.is_empty() && queues.deferred.is_empty() => break,
            Err(_) => {
                if let Some(wait) = linger.take() {
                    until = wait().map(|d| Instant::now() + d);
                }
                match until.and_then(|until| queues.rx.recv_deadline(until).ok()) {
                    Some(msg) => Some(msg),
                    None => break,
                }
            }
        };
    }
    queues
        .deferred
        .take(MAX_BATCH.saturating_sub(jobs.len()), jobs);
}

/// What a batch may draw on beyond its first jobs.
struct Batch<'a> {
    queues: &'a Queues,
    closing: &'a mut Option<oneshot::Sender<()>>,
    syncer: Option<&'a Syncer>,
}

impl Batch<'_> {
    /// The next job queued, while the syncer is busy (see [`Syncer::busy`]) and the batch has
    /// room: it joins this transaction instead of the next.
    fn more(&mut self, ran: usize) -> Option<(Job, Heard)> {
        if ran >= MAX_BATCH || self.closing.is_some() || !self.syncer.is_some_and(|s| s.busy()) {
            return None;
        }
        match self.queues.rx.try_recv() {
            Ok(Msg::Job(j, heard)) => Some((j, heard)),
            Ok(Msg::Close(tx)) => {
                *self.closing = Some(tx);
                None
            }
            Ok(Msg::Nudge) | Err(_) => self.queues.deferred.take_one(),
        }
    }
}

/// Runs a batch in one transaction; callers hear back only after the commit (and its sync).
/// Returns what it ran, for [`Pace`].
fn run_batch(ctx: &Tx, jobs: Vec<(Job, Heard)>, mut batch: Batch) -> Ran {
    let conn = ctx.conn;
    if !conn.is_autocommit() {
        // A transaction left open by a failed commit is let go before the next one.
        let _ = conn.execute_batch("ROLLBACK");
    }
    if let Err(e) = run_cached(conn, "BEGIN IMMEDIATE") {
        // Dropping the batch unrun drops its replies: every caller gets an error.
        tracing::error!(error = %e, "SQLite cannot begin a write");
        return Ran::default();
    }
    let started = std::time::Instant::now();
    let mut done: Vec<Delivery> = Vec::with_capacity(jobs.len());
    let mut committed: Vec<Delivery> = Vec::new();
    let mut jobs = jobs.into_iter();
    while let Some((job, heard)) = jobs
        .next()
        .or_else(|| batch.more(done.len() + committed.len()))
    {
        match heard {
            Heard::Synced => done.push(job(ctx)),
            Heard::Committed => committed.push(job(ctx)),
        }
        if done.len() + committed.len() == 1 && jobs.len() > 0 {
            crate::fault::point(crate::fault::Point::BatchMid);
        }
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (a full disk, an I/O error): what ran
            // is gone and nothing more may run outside it. The jobs left are dropped unrun.
            tracing::error!("SQLite rolled a write batch back");
            break;
        }
    }
    let size = done.len() + committed.len();
    let ran = Ran {
        jobs: size,
        waited_on: !done.is_empty(),
    };
    let took = started.elapsed();
    let failure = match conn.is_autocommit() {
        true => Some("the write batch was rolled back".to_owned()),
        false => commit(conn),
    };
    // After a failed fsync nothing is acknowledged, not even what is heard of at its commit.
    let failure = failure.or_else(|| batch.syncer.and_then(Syncer::failed).map(str::to_owned));
    tracing::trace!(size, ran = ?took, total = ?started.elapsed(), "write batch committed");
    match (batch.syncer, &failure) {
        // Committed: heard of once durable. Synced here when nothing else waits for the
        // writer, else on the syncer's thread while the next batch runs; what is heard of at
        // its commit is synced with them, or within `LAZY_SYNC` when nothing else is.
        (Some(s), None) => {
            let lazy = !committed.is_empty();
            for d in committed {
                d.send(None);
            }
            match done.is_empty() {
                true if lazy => s.sync_soon(),
                true => {}
                false => s.after_sync(done, batch.queues.rx.is_empty()),
            }
        }
        _ => {
            for d in done.into_iter().chain(committed) {
                d.send(failure.as_deref());
            }
        }
    }
    ran
}

/// Commits the batch's transaction: `Some(why)` when it could not.
fn commit(conn: &Connection) -> Option<String> {
    match run_cached(conn, "COMMIT") {
        Ok(()) => None,
        Err(e) => {
            // Leave no transaction open behind a failed commit (ignore "no transaction").
            let _ = conn.execute_batch("ROLLBACK");
            Some(format!("commit failed: {e}"))
        }
    }
}

/// A statement without parameters or rows, prepared once: `BEGIN` and `COMMIT` run thousands of
/// times a second, and `execute_batch` would parse them each time.
fn run_cached(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(drop)
}
