//! In-process locks: one holder, many waiters, no polling (after pingora-cache `lock.rs`).
//!
//! A [`LockTable`] maps a name (a scoped key, or an entity) to a one-permit semaphore. The
//! first request takes the permit; later ones wait on the semaphore with a deadline and are
//! woken when the holder's guard drops. Entries are removed when nobody holds or waits, so the
//! table only holds what is busy. Across replicas the store provides the lock; this layer keeps
//! local waiters from hammering it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

const SHARDS: usize = 16;

type Shard = Mutex<HashMap<String, Arc<Semaphore>, ahash::RandomState>>;

/// A sharded table of named one-permit locks.
/// Clones share the table (a reloaded configuration keeps every lock held).
#[derive(Default, Clone)]
pub struct LockTable {
    // std Mutex: held only to look up or remove an entry, never across an await.
    shards: Arc<[Shard; SHARDS]>,
    hasher: ahash::RandomState,
}

/// Why a lock was not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum LockError {
    /// Someone holds it and the caller asked not to wait.
    Busy,
    /// The deadline passed while waiting.
    TimedOut,
}

/// A held lock; dropping it wakes the next waiter.
pub struct LockGuard {
    shards: Arc<[Shard; SHARDS]>,
    shard: usize,
    name: String,
    sem: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
}

impl LockTable {
    pub fn new() -> Self {
        LockTable::default()
    }

    fn shard_of(&self, name: &str) -> usize {
        (self.hasher.hash_one(name) as usize) % SHARDS
    }

    fn entry(&self, name: &str) -> (usize, Arc<Semaphore>) {
        let shard = self.shard_of(name);
        let mut map = self.shards[shard].lock().unwrap_or_else(|p| p.into_inner());
        let sem = map
            .entry(name.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone();
        (shard, sem)
    }

    /// Takes the lock on `name`, waiting up to `timeout` (`None`: do not wait at all).
    pub async fn lock(
        &self,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<LockGuard, LockError> {
        let (shard, sem) = self.entry(name);
        // The acquire future holds its own clone of `sem`; it is gone once this statement ends,
        // so the guard's drop below sees an exact reference count.
        let acquired = match timeout {
            None => sem.clone().try_acquire_owned().map_err(|_| LockError::Busy),
            Some(t) => match tokio::time::timeout(t, sem.clone().acquire_owned()).await {
                Ok(Ok(p)) => Ok(p),
                // The semaphore is never closed; treat that like a timeout all the same.
                _ => Err(LockError::TimedOut),
            },
        };
        let (permit, err) = match acquired {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        let guard = LockGuard {
            shards: self.shards.clone(),
            shard,
            name: name.to_owned(),
            sem,
            permit,
        };
        match err {
            // Dropping the guard removes the table entry if nobody else uses it.
            Some(e) => Err(e),
            None => Ok(guard),
        }
    }

    /// Takes every lock of `names` in sorted order (no deadlock between requests that share
    /// entities), all within one `timeout`. Names must be sorted and unique.
    pub async fn lock_all(
        &self,
        names: &[String],
        timeout: Duration,
    ) -> Result<Vec<LockGuard>, LockError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut guards = Vec::with_capacity(names.len());
        for name in names {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            guards.push(self.lock(name, Some(left)).await?);
        }
        Ok(guards)
    }

    /// Names currently held or waited on (for tests and metrics).
    pub fn busy(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // Release first so a waiter can proceed, then drop our table entry if we were last.
        drop(self.permit.take());
        let mut map = self.shards[self.shard]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Two references: the table's and ours. Waiters hold clones, so they keep it alive.
        if Arc::strong_count(&self.sem) == 2 {
            map.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_and_waiters_are_woken() {
        let t = Arc::new(LockTable::new());
        let g = t.lock("a", None).await.unwrap();
        assert_eq!(t.lock("a", None).await.err(), Some(LockError::Busy));
        let t2 = t.clone();
        let waiter =
            tokio::spawn(async move { t2.lock("a", Some(Duration::from_secs(10))).await.is_ok() });
        tokio::task::yield_now().await;
        drop(g);
        assert!(waiter.await.unwrap());
        assert_eq!(t.busy(), 0);
    }

    #[tokio::test]
    async fn timeout_leaves_the_table_clean() {
        let t = LockTable::new();
        let _g = t.lock("a", None).await.unwrap();
        let r = t.lock("a", Some(Duration::from_millis(1))).await;
        assert_eq!(r.err(), Some(LockError::TimedOut));
        assert_eq!(t.busy(), 1);
        drop(_g);
        assert_eq!(t.busy(), 0);
        let names = vec!["x".to_string(), "y".to_string()];
        let gs = t.lock_all(&names, Duration::from_secs(1)).await.unwrap();
        assert_eq!(t.busy(), 2);
        drop(gs);
        assert_eq!(t.busy(), 0);
    }
}
