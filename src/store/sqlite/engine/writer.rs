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
//!
//! Outcomes whose callers were answered before their commit need not even be queued: handed
//! over with [`Writer::finish_later`], they wait in [`super::deferred`] for the next batch, and
//! only a parked writer is woken for them. The thread itself, what goes into a batch and how a
//! batch runs, is `writer_thread.rs`; when it watches its queue before blocking on it (a lone
//! client's next write comes sooner than a wake-up), [`super::pace`].

use super::deferred::{Deferred, Later};
use super::durable::Syncer;
pub(super) use super::job::{deliver, Heard, Job, Tx};
use crate::store::{SharedCipher, StoreError, StoreResult};
use rusqlite::Connection;
use std::sync::Arc;
use std::time::Duration;
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

enum Msg {
    Job(Job, Heard),
    /// Outcomes wait in [`Deferred`] (sent to a parked writer only).
    Nudge,
    /// Stop after this batch (sent by `close`, once requests are done).
    Close(oneshot::Sender<()>),
}

/// The handle to the writer thread.
pub struct Writer {
    tx: flume::Sender<Msg>,
    deferred: Arc<Deferred>,
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
        let pace = super::pace::Pace::default();
        Writer::lingering(conn, cipher, syncer, Linger::WhileSyncing(LINGER), pace)
    }

    /// [`start`](Self::start) with writes heard of at their commit lingering as `linger` says,
    /// and the queue watched before blocking as `pace` learns to.
    fn lingering(
        conn: Connection,
        cipher: SharedCipher,
        syncer: Option<Syncer>,
        linger: Linger,
        pace: super::pace::Pace,
    ) -> StoreResult<Writer> {
        let (tx, rx) = flume::bounded(8192);
        let deferred = Arc::new(Deferred::default());
        let queues = thread::Queues {
            rx,
            deferred: deferred.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("idemproxy-writer".into())
            .spawn(move || thread::run(conn, queues, cipher, syncer, linger, pace))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the writer: {e}")))?;
        Ok(Writer {
            tx,
            deferred,
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// Runs `f` in the next batch and returns its result once committed.
    pub async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tx) -> StoreResult<T> + Send + 'static,
    {
        self.write_heard(Heard::Synced, f).await
    }

    /// Runs `f` in the next batch and returns its result once `heard` says.
    pub async fn write_heard<T, F>(&self, heard: Heard, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tx) -> StoreResult<T> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let inbox = super::inbox::Inbox::current();
        let job: Job =
            Box::new(move |ctx| deliver(move |res| drop(reply.send(res)), f(ctx)).via(inbox));
        self.tx
            .send_async(Msg::Job(job, heard))
            .await
            .map_err(|_| StoreError::Closed)?;
        // A dropped reply means its batch failed before the job ran (logged by the writer).
        rx.await
            .map_err(|_| StoreError::Unavailable("the write's batch failed before it ran".into()))?
    }

    /// Runs `f` in a coming batch without waiting for it (see [`super::deferred`]): `then`
    /// hears how it went, on the writer's thread, once committed.
    pub fn finish_later<F>(&self, f: F, then: crate::store::AfterCommit)
    where
        F: FnOnce(&Tx) -> StoreResult<bool> + Send + 'static,
    {
        let run = Box::new(f);
        match self.deferred.push(Later { run, then }) {
            // Full means the writer has work queued already: it will take this with it.
            Ok(true) => drop(self.tx.try_send(Msg::Nudge)),
            Ok(false) => {}
            Err(later) => later.then.tell(Err(StoreError::Closed)),
        }
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

#[path = "writer_thread.rs"]
mod thread;

#[cfg(test)]
#[path = "writer_tests.rs"]
mod tests;
