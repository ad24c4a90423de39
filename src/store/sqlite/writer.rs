//! The group-commit writer: one connection, one thread, one transaction per batch.
//!
//! Callers queue a job (a closure that runs its SQL inside the batch's transaction) and hear
//! back only once the batch is committed and durable — so a result is never acted on before it
//! is on disk — while every job queued meanwhile shares that commit and its `fsync`.
//!
//! The writer is the one serial step of every first write, so it is a plain thread that runs
//! its statements itself (`rusqlite`, prepared statements cached): no statement waits for a
//! worker thread or for an async task to be polled again. Measured at 64 concurrent first
//! writes, the async writer (sqlx, which hands each statement to a worker thread) spent about
//! half of its serial time waiting for those hand-offs.
//!
//! Writes nobody waits on for durability (an answered request's outcome, audit rows), taken
//! while the syncer is busy (an `fdatasync` under way, or replies waiting for one), linger
//! briefly for one that is waited on (a reservation) and share its transaction: under load one
//! is always near. Each transaction rewrites the pages it touches in the WAL, so at 64
//! concurrent first writes this halved the transactions and cut the bytes written per request
//! by about a fifth. With the syncer idle (a lone client, mostly) an outcome commits at once,
//! while its caller reads the answer, rather than on the critical path of the next request's
//! reservation.

use super::durable::{Delivery, Syncer};
use crate::store::{
    AuditRow, FinishColumns, Reservation, Reserved, ScopedKey, SharedCipher, StoreError,
    StoreResult,
};
use rusqlite::Connection;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Most jobs committed together: bounds the time a batch holds its callers.
const MAX_BATCH: usize = 256;

/// How long writes heard of at their commit ([`Heard::Committed`]) wait for a write that is
/// waited on, to share its transaction. The answer went out already; what waits up to this
/// much longer is what waits for the commit: the key's slot (a retry is served from the replay
/// cache), the entity locks of an answer with no entity effects (a non-2xx on an entity route),
/// the operator's views that wait for answered outcomes to settle, the audit flusher.
const LINGER: Duration = Duration::from_millis(1);

/// When writes heard of at their commit linger, and for how long at most.
#[derive(Clone, Copy)]
enum Linger {
    /// While the syncer is busy: under load.
    WhileSyncing(Duration),
    /// Whatever the syncer does (tests, whose writer has none).
    #[cfg(test)]
    Always(Duration),
}

impl Linger {
    /// Whether to wait, and for how long at most; `syncing` says whether the syncer is busy
    /// (asked only when it matters).
    fn wait(self, syncing: impl FnOnce() -> bool) -> Option<Duration> {
        match self {
            Linger::WhileSyncing(d) => syncing().then_some(d),
            #[cfg(test)]
            Linger::Always(d) => Some(d),
        }
    }
}

/// What a job is given: the connection (inside the batch's transaction), the batch's clock
/// (ms), and the cipher that opens the records a reservation finds standing.
pub struct Ctx<'a> {
    pub conn: &'a Connection,
    pub now: i64,
    pub cipher: Option<&'a crate::store::seal::Cipher>,
}

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

/// One write, run in the batch's transaction; what it returns is delivered after the commit.
type Job = Box<dyn FnOnce(&Ctx) -> Delivery + Send>;

/// When a write's caller hears back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// Once its commit is on disk: what the caller acts on (a reservation before a forward).
    Synced,
    /// Once it is committed (visible to every reader), its `fdatasync` following within
    /// [`super::durable::LAZY_SYNC`]: for writes nobody acts on being durable — an outcome
    /// whose caller was already answered (`Keys::finish_answered`), audit rows. Their callers
    /// let go of the key's slot and entity locks at once, and a lone first write pays one
    /// `fdatasync` (its reservation's), not two.
    Committed,
}

enum Msg {
    Job(Job, Heard),
    /// Stop after this batch (sent by `close`, once requests are done).
    Close(oneshot::Sender<()>),
}

/// The handle to the writer thread.
pub struct Writer {
    tx: flume::Sender<Msg>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Writer {
    /// Starts the thread; `cipher` opens the records a reservation finds standing. With a
    /// `syncer`, `conn` commits without syncing and replies wait for the syncer's `fdatasync`
    /// (see [`super::durable`]); without one, `conn` must sync each commit itself.
    pub fn start(
        conn: Connection,
        cipher: SharedCipher,
        syncer: Option<Syncer>,
    ) -> StoreResult<Writer> {
        Writer::lingering(conn, cipher, syncer, Linger::WhileSyncing(LINGER))
    }

    /// [`start`](Self::start) with writes heard of at their commit lingering as `linger` says.
    fn lingering(
        conn: Connection,
        cipher: SharedCipher,
        syncer: Option<Syncer>,
        linger: Linger,
    ) -> StoreResult<Writer> {
        let (tx, rx) = flume::bounded(8192);
        let thread = std::thread::Builder::new()
            .name("idemproxy-writer".into())
            .spawn(move || run(conn, rx, cipher, syncer, linger))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the writer: {e}")))?;
        Ok(Writer {
            tx,
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// Runs `f` in the next batch and returns its result once committed.
    pub async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ctx) -> StoreResult<T> + Send + 'static,
    {
        self.write_heard(Heard::Synced, f).await
    }

    /// Runs `f` in the next batch and returns its result once `heard` says.
    pub async fn write_heard<T, F>(&self, heard: Heard, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ctx) -> StoreResult<T> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let job: Job = Box::new(move |ctx| deliver(reply, f(ctx)));
        self.tx
            .send_async(Msg::Job(job, heard))
            .await
            .map_err(|_| StoreError::Closed)?;
        // A dropped reply means its batch failed before the job ran (logged by the writer).
        rx.await
            .map_err(|_| StoreError::Unavailable("the write's batch failed before it ran".into()))?
    }

    pub async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        self.write(move |ctx| super::keys::reserve(ctx, &r)).await
    }

    pub async fn finish(
        &self,
        id: ScopedKey,
        epoch: i64,
        f: FinishColumns,
        heard: Heard,
    ) -> StoreResult<bool> {
        self.write_heard(heard, move |ctx| super::keys::finish(ctx, &id, epoch, &f))
            .await
    }

    pub async fn audit(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.write_heard(Heard::Committed, move |ctx| {
            super::audit::append_audit(ctx.conn, &rows)
        })
        .await
    }

    /// Flushes queued writes (committed and synced), then stops the thread.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send_async(Msg::Close(tx)).await.is_ok() {
            let _ = rx.await;
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }
}

fn run(
    conn: Connection,
    rx: flume::Receiver<Msg>,
    cipher: SharedCipher,
    syncer: Option<Syncer>,
    linger: Linger,
) {
    let mut jobs: Vec<(Job, Heard)> = Vec::with_capacity(MAX_BATCH);
    let mut closing = None;
    while let Ok(first) = rx.recv() {
        let linger = || linger.wait(|| syncer.as_ref().is_some_and(Syncer::busy));
        gather(first, &rx, &mut jobs, &mut closing, linger);
        if !jobs.is_empty() {
            let ctx = Ctx {
                conn: &conn,
                now: crate::store::now_ms(),
                cipher: cipher.as_deref(),
            };
            let batch = Batch {
                rx: &rx,
                closing: &mut closing,
                syncer: syncer.as_ref(),
            };
            run_batch(&ctx, std::mem::take(&mut jobs), batch);
        }
        if closing.is_some() {
            break;
        }
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

/// Takes `first` and whatever else is queued into `jobs`. Jobs that are all heard of at their
/// commit wait for one that is waited on, which ends the wait, as long as `linger` says when
/// first asked (`None`: not at all).
fn gather(
    first: Msg,
    rx: &flume::Receiver<Msg>,
    jobs: &mut Vec<(Job, Heard)>,
    closing: &mut Option<oneshot::Sender<()>>,
    linger: impl FnOnce() -> Option<Duration>,
) {
    let mut linger = Some(linger);
    let mut waited_on = false;
    let mut until = None;
    let mut next = Some(first);
    while let Some(msg) = next.take() {
        match msg {
            Msg::Job(job, heard) => {
                waited_on |= heard == Heard::Synced;
                jobs.push((job, heard));
            }
            Msg::Close(tx) => {
                *closing = Some(tx);
                return;
            }
        }
        if jobs.len() >= MAX_BATCH {
            return;
        }
        next = match rx.try_recv() {
            Ok(msg) => Some(msg),
            Err(_) if waited_on => None,
            Err(_) => {
                if let Some(wait) = linger.take() {
                    until = wait().map(|d| Instant::now() + d);
                }
                match until {
                    Some(until) => rx.recv_deadline(until).ok(),
                    None => None,
                }
            }
        };
    }
}

/// What a batch may draw on beyond its first jobs.
struct Batch<'a> {
    rx: &'a flume::Receiver<Msg>,
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
        match self.rx.try_recv().ok()? {
            Msg::Job(j, heard) => Some((j, heard)),
            Msg::Close(tx) => {
                *self.closing = Some(tx);
                None
            }
        }
    }
}

/// Runs a batch in one transaction; callers hear back only after the commit (and its sync).
fn run_batch(ctx: &Ctx, jobs: Vec<(Job, Heard)>, mut batch: Batch) {
    let conn = ctx.conn;
    if !conn.is_autocommit() {
        // A transaction left open by a failed commit is let go before the next one.
        let _ = conn.execute_batch("ROLLBACK");
    }
    if let Err(e) = run_cached(conn, "BEGIN IMMEDIATE") {
        // Dropping the batch unrun drops its replies: every caller gets an error.
        tracing::error!(error = %e, "SQLite cannot begin a write");
        return;
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
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (a full disk, an I/O error): what ran
            // is gone and nothing more may run outside it. The jobs left are dropped unrun.
            tracing::error!("SQLite rolled a write batch back");
            break;
        }
    }
    let size = done.len() + committed.len();
    let ran = started.elapsed();
    let failure = match conn.is_autocommit() {
        true => Some("the write batch was rolled back".to_owned()),
        false => commit(conn),
    };
    // After a failed fsync nothing is acknowledged, not even what is heard of at its commit.
    let failure = failure.or_else(|| batch.syncer.and_then(Syncer::failed).map(str::to_owned));
    tracing::trace!(size, ?ran, total = ?started.elapsed(), "write batch committed");
    match (batch.syncer, &failure) {
        // Committed: heard of once durable. Synced here when nothing else waits for the
        // writer, else on the syncer's thread while the next batch runs; what is heard of at
        // its commit is synced with them, or within `LAZY_SYNC` when nothing else is.
        (Some(s), None) => {
            let lazy = !committed.is_empty();
            for d in committed {
                d(None);
            }
            match done.is_empty() {
                true if lazy => s.sync_soon(),
                true => {}
                false => s.after_sync(done, batch.rx.is_empty()),
            }
        }
        _ => {
            for d in done.into_iter().chain(committed) {
                d(failure.as_deref());
            }
        }
    }
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

#[cfg(test)]
#[path = "writer_tests.rs"]
mod tests;
