//! Pipelined durability: the writer commits without waiting for the disk, and a thread of
//! its own makes each commit durable before anyone hears of it.
//!
//! With `synchronous = FULL` every commit waits for its own `fsync` of the WAL, and the one
//! writer sits idle meanwhile: a third of its time at 64 concurrent first writes. Here the
//! writer's connection commits with `synchronous = NORMAL` (frames written to the WAL, not
//! synced) and hands the batch's replies to the syncer, which calls `fdatasync` on the WAL and
//! only then delivers every reply queued before that call began. The writer meanwhile runs the
//! next batch, so one `fsync` covers as many batches as the disk's latency lets through.
//!
//! What a caller waits on is exactly as durable as under `FULL`: such a reply is delivered only
//! after an `fdatasync` of the WAL that began after its commit's frames were written, and WAL
//! recovery replays every commit whose frames reached the disk. `NORMAL` keeps the database
//! itself safe from corruption on power loss (SQLite syncs the WAL before each checkpoint and
//! the database after it). What changes is what *other readers* may see: a commit is visible
//! to readers up to one `fdatasync` before it is durable, so a power loss (not a process
//! crash: the OS still holds those writes) can lose a completion that a concurrent retry was
//! already replayed. That retry's key is then `unknown` after the restart, never forwarded
//! twice: the reservation was durable before the forward (`docs/operations.md`). Writes whose
//! callers do not wait on their durability (`writer::Heard::Committed`: outcomes already
//! answered, audit rows) are heard of at their commit and synced within [`LAZY_SYNC`].

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::inbox::Delivery;

/// Replies waiting for the next `fdatasync`, whether one is under way, and whether the store
/// is closing.
#[derive(Default)]
struct Queue {
    waiting: Vec<Delivery>,
    syncing: bool,
    /// Commits nobody waits on are not yet synced (see [`Syncer::sync_soon`]).
    dirty: bool,
    /// The syncer will look at `dirty` again without being woken: it is running, or waits
    /// with a deadline that is no later than `LAZY_SYNC` after any commit made dirty since.
    armed: bool,
    /// `fdatasync`s the syncer thread has made (what tests wait for).
    synced: u64,
    closing: bool,
}

/// How long a commit whose callers heard of it at once (see `writer::Heard::Committed`) may
/// stay unsynced when no other write's sync covers it.
pub const LAZY_SYNC: std::time::Duration = std::time::Duration::from_millis(10);

/// Once an `fdatasync` has failed, nothing written later is acknowledged: Linux may have
/// dropped the failed pages, and WAL recovery stops at the first frame missing, so a later
/// commit that syncs fine could still be lost behind it (PostgreSQL stops for the same reason).
/// The store answers `503 store_unavailable` until it is restarted.
const POISONED: &str = "an earlier fsync of the write-ahead log failed: restart the proxy";

/// The handle to the syncer thread.
pub struct Syncer {
    shared: Arc<(Mutex<Queue>, Condvar)>,
    /// The WAL, also synced by the writer itself when the syncer is idle (see `after_sync`).
    wal: Arc<File>,
    poisoned: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Syncer {
    /// Opens the WAL of `db` (which must exist: the store's migrations have written it), makes
    /// its directory entry durable — under `NORMAL` SQLite would do so only at its first
    /// checkpoint — and starts the thread.
    pub fn start(db: &Path) -> std::io::Result<Syncer> {
        let wal = wal_path(db);
        let file = File::open(&wal)?;
        file.sync_all()?;
        if let Some(dir) = wal.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        Syncer::on(file)
    }

    /// The syncer of an open WAL file.
    fn on(file: File) -> std::io::Result<Syncer> {
        let shared = Arc::new((Mutex::new(Queue::default()), Condvar::new()));
        let (wal, poisoned) = (Arc::new(file), Arc::new(AtomicBool::new(false)));
        let theirs = (shared.clone(), wal.clone(), poisoned.clone());
        let thread = std::thread::Builder::new()
            .name("idemproxy-fsync".into())
            .spawn(move || run(&theirs.1, &theirs.0, &theirs.2))?;
        Ok(Syncer {
            shared,
            wal,
            poisoned,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Whether an `fdatasync` is under way or replies wait for one: the writer then keeps its
    /// transaction open for whatever else is queued, since nothing it commits now would be
    /// heard of before the next `fdatasync` anyway — one commit per sync, as large as the
    /// load makes it (fewer WAL frames and locks per write).
    pub fn busy(&self) -> bool {
        let q = self.shared.0.lock().unwrap_or_else(|p| p.into_inner());
        q.syncing || !q.waiting.is_empty()
    }

    /// Delivers `done` after the next `fdatasync` of the WAL (their batch has committed). With
    /// `inline` (nothing else queued for the writer) and the syncer idle, the writer syncs and
    /// delivers itself: a lone write skips a hand-off between threads. The syncer is the only
    /// other caller of `fdatasync`, and with nothing queued there is no earlier reply to
    /// overtake.
    pub fn after_sync(&self, done: Vec<Delivery>, inline: bool) {
        if done.is_empty() {
            return;
        }
        if inline && !self.busy() {
            // Covers every commit so far, those nobody waits on included.
            self.shared
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .dirty = false;
            let failure = sync(&self.wal, &self.poisoned);
            for d in done {
                d.send(failure.as_deref());
            }
            return;
        }
        let (lock, ready) = &*self.shared;
        // Held only to move the replies in: never across I/O.
        let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
        q.waiting.extend(done);
        ready.notify_one();
    }

    /// Why no write may be acknowledged any more (an earlier `fdatasync` failed), if so: what
    /// the writer tells the callers of writes heard of at their commit, too.
    pub fn failed(&self) -> Option<&'static str> {
        self.poisoned.load(Ordering::Acquire).then_some(POISONED)
    }

    /// A commit nobody waits on: synced with the next write that is waited on, or within
    /// [`LAZY_SYNC`] by the syncer. The syncer is woken only from its untimed wait: a lone
    /// client's every outcome is such a commit, and each woke the syncer (a context switch a
    /// request) although the next reservation's sync covered it.
    pub fn sync_soon(&self) {
        let (lock, ready) = &*self.shared;
        let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
        if !q.dirty {
            q.dirty = true;
            if !q.armed {
                ready.notify_one();
            }
        }
    }

    /// Syncs what is queued, delivers it, and stops the thread.
    pub fn close(&self) {
        {
            let (lock, ready) = &*self.shared;
            lock.lock().unwrap_or_else(|p| p.into_inner()).closing = true;
            ready.notify_one();
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        self.close();
    }
}

fn wal_path(db: &Path) -> PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push("-wal");
    path.into()
}

/// One `fdatasync` of the WAL: `Some(why)` when what it covers is not durable.
fn sync(wal: &File, poisoned: &AtomicBool) -> Option<String> {
    if poisoned.load(Ordering::Acquire) {
        return Some(POISONED.to_owned());
    }
    crate::fault::point(crate::fault::Point::BeforeSync);
    let synced = match crate::fault::armed(crate::fault::Point::SkipSync) {
        true => Ok(()),
        false => wal.sync_data(),
    };
    crate::fault::point(crate::fault::Point::AfterSync);
    synced.err().map(|e| {
        tracing::error!(error = %e, "SQLite WAL fsync failed: no write is acknowledged until a restart");
        poisoned.store(true, Ordering::Release);
        format!("fsync of the write-ahead log failed: {e}")
    })
}

fn run(wal: &File, shared: &(Mutex<Queue>, Condvar), poisoned: &AtomicBool) {
    let (lock, ready) = shared;
    loop {
        let (batch, closing, lazy) = {
            let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
            let mut since = None;
            q.armed = true;
            while q.waiting.is_empty() && !q.closing {
                if !q.dirty {
                    since = None;
                    q.armed = false;
                    q = ready.wait(q).unwrap_or_else(|p| p.into_inner());
                    q.armed = true;
                    continue;
                }
                // Unsynced commits nobody waits on: synced once LAZY_SYNC has passed since
                // the first was seen (a deadline, not a synchronization: nobody is woken by
                // it). A commit made dirty later, while armed, is synced no later than that.
                let start = *since.get_or_insert_with(std::time::Instant::now);
                let left = LAZY_SYNC.saturating_sub(start.elapsed());
                if left.is_zero() {
                    break;
                }
                q = ready
                    .wait_timeout(q, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let lazy = std::mem::take(&mut q.dirty);
            q.syncing = !q.waiting.is_empty() || lazy;
            (std::mem::take(&mut q.waiting), q.closing, lazy)
        };
        if !batch.is_empty() || lazy {
            // Everything queued was committed before this call begins, so it covers them all.
            let failure = sync(wal, poisoned);
            for d in batch {
                d.send(failure.as_deref());
            }
            let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
            q.syncing = false;
            q.synced += 1;
        }
        if closing {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn reply(tx: &mpsc::Sender<Option<String>>) -> Delivery {
        let tx = tx.clone();
        Delivery::here(Box::new(move |failure| {
            let _ = tx.send(failure.map(str::to_owned));
        }))
    }

    #[test]
    fn replies_come_after_a_sync_on_either_thread() {
        let dir = tempfile::tempdir().unwrap();
        let syncer = Syncer::on(File::create(dir.path().join("wal")).unwrap()).unwrap();
        let (tx, rx) = mpsc::channel();
        syncer.after_sync(vec![reply(&tx), reply(&tx)], false);
        syncer.after_sync(vec![reply(&tx)], true);
        syncer.sync_soon();
        syncer.close();
        let heard: Vec<_> = rx.try_iter().collect();
        assert_eq!(heard, vec![None, None, None]);
    }

    /// Waits (up to a minute) until the syncer thread has made `n` syncs.
    fn until_synced(syncer: &Syncer, n: u64) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            if syncer.shared.0.lock().unwrap().synced >= n {
                return true;
            }
            // Polled: waiting on the syncer's condition variable could take its wake-up.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        false
    }

    /// A commit nobody waits on is synced by the syncer within its deadline, also when it
    /// comes while the syncer already waits with one (and is not woken for it), after the
    /// writer's own sync cleared the commit before it.
    #[test]
    fn commits_nobody_waits_on_are_synced_by_the_syncer() {
        let dir = tempfile::tempdir().unwrap();
        let syncer = Syncer::on(File::create(dir.path().join("wal")).unwrap()).unwrap();
        syncer.sync_soon();
        assert!(
            until_synced(&syncer, 1),
            "a lone lazy commit was never synced"
        );
        // Armed again, then the writer syncs inline (clearing it) and a new one comes.
        syncer.sync_soon();
        let (tx, rx) = mpsc::channel();
        syncer.after_sync(vec![reply(&tx)], true);
        assert_eq!(rx.recv().unwrap(), None);
        syncer.sync_soon();
        assert!(
            until_synced(&syncer, 2),
            "a lazy commit made while armed was never synced"
        );
        syncer.close();
    }

    #[test]
    fn after_a_failed_sync_nothing_is_acknowledged() {
        // fdatasync of a character device fails (EINVAL): a sync that fails.
        let syncer = Syncer::on(File::open("/dev/null").unwrap()).unwrap();
        let (tx, rx) = mpsc::channel();
        assert_eq!(syncer.failed(), None);
        syncer.after_sync(vec![reply(&tx)], true);
        let first = rx.recv().unwrap();
        assert!(
            first.as_deref().unwrap_or("").contains("fsync"),
            "{first:?}"
        );
        // What the writer tells writes heard of at their commit, from now on.
        assert_eq!(syncer.failed(), Some(POISONED));
        // Every later write fails too, on the writer and on the syncer alike.
        syncer.after_sync(vec![reply(&tx)], true);
        syncer.after_sync(vec![reply(&tx)], false);
        syncer.close();
        let later: Vec<_> = rx.try_iter().collect();
        assert_eq!(
            later,
            vec![Some(POISONED.to_owned()), Some(POISONED.to_owned())]
        );
    }
}
