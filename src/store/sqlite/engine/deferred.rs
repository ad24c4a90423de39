//! Outcomes nobody waits on, handed to the writer without waking it.
//!
//! A first write's outcome, once its caller has its answer from the replay cache
//! ([`crate::store::When::Later`]), has nobody waiting on it: what waits is the
//! key's slot, let go once it commits. Sent through the writer's queue, each one woke the
//! writer when it was idle and a task of the worker's when it committed. Measured at 64
//! concurrent first writes, outcomes that took no trip through the writer at all (a bound, not
//! a design: nothing stored) cut the proxy's CPU per first write by a fifth, and the same
//! outcomes committed this way cut it by about 8%. Here they wait in a list the writer takes
//! into its next transaction — under load there is always one soon, for the next reservation —
//! and their callers hear back on the writer's thread, after the commit. Only a writer parked
//! with nothing to do is woken, once, as a lone client's outcome must not wait for a
//! reservation that may never come.

use super::job::{deliver, Heard, Job, Tx};
use crate::store::{AfterCommit, StoreResult};
use std::collections::VecDeque;
use std::sync::Mutex;

/// An outcome's write: whether it was stored (`false`: fenced off).
pub type Write = Box<dyn FnOnce(&Tx) -> StoreResult<bool> + Send>;

/// One outcome's write and who hears how it went.
pub struct Later {
    pub run: Write,
    pub then: AfterCommit,
}

impl Later {
    /// The write as a job of the batch's: `then` hears of it after the commit, as every write
    /// heard of at its commit does.
    fn job(self) -> Job {
        Box::new(move |ctx| deliver(move |r| self.then.tell(r), (self.run)(ctx)))
    }
}

#[derive(Default)]
struct List {
    waiting: VecDeque<Later>,
    /// The writer is blocked on its queue with nothing to do: the next push wakes it.
    parked: bool,
    /// The writer has stopped: nothing more is taken.
    closed: bool,
}

/// The outcomes waiting for the writer's next transaction.
#[derive(Default)]
pub struct Deferred {
    list: Mutex<List>,
}

impl Deferred {
    fn list(&self) -> std::sync::MutexGuard<'_, List> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `later`: `Ok(true)` when the writer is parked and must be woken (once, by the
    /// first push since it parked), `Err` with it back when the writer has stopped.
    pub fn push(&self, later: Later) -> Result<bool, Later> {
        let mut list = self.list();
        if list.closed {
            return Err(later);
        }
        list.waiting.push_back(later);
        Ok(std::mem::take(&mut list.parked))
    }

    /// The writer is about to block on its queue: `false` (and it must not block) when
    /// outcomes wait. Under the same lock as [`Deferred::push`], so a push either lands before
    /// this (and is seen here) or after it (and wakes the writer).
    pub fn park(&self) -> bool {
        let mut list = self.list();
        list.parked = list.waiting.is_empty();
        list.parked
    }

    /// The writer woke: pushes need not wake it.
    pub fn unpark(&self) {
        self.list().parked = false;
    }

    /// Whether the writer is parked (for tests).
    #[cfg(test)]
    pub fn is_parked(&self) -> bool {
        self.list().parked
    }

    pub fn is_empty(&self) -> bool {
        self.list().waiting.is_empty()
    }

    /// Moves up to `room` waiting outcomes into `jobs`, in the order they came.
    pub fn take(&self, room: usize, jobs: &mut Vec<(Job, Heard)>) {
        let mut list = self.list();
        let n = room.min(list.waiting.len());
        jobs.extend(list.waiting.drain(..n).map(|l| (l.job(), Heard::Committed)));
    }

    /// The first waiting outcome, as a job.
    pub fn take_one(&self) -> Option<(Job, Heard)> {
        let later = self.list().waiting.pop_front()?;
        Some((later.job(), Heard::Committed))
    }

    /// The writer stops: what still waits, as jobs for its last batch; later pushes fail.
    pub fn close(&self) -> Vec<(Job, Heard)> {
        let mut list = self.list();
        list.closed = true;
        let rest = std::mem::take(&mut list.waiting);
        rest.into_iter()
            .map(|l| (l.job(), Heard::Committed))
            .collect()
    }
}
