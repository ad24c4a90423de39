//! The replay cache's entries: completed answers by key, bounded by bytes (quick_cache's
//! S3-FIFO evicts), each trusted for [`FRESH_FOR_MS`], and the keys released lately, which no
//! read that began before the release may put back.

use crate::store::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How long an entry is trusted before the store is asked again.
pub const FRESH_FOR_MS: i64 = 5_000;
/// How the look-ups that missed the cache ended lately (see [`Misses::mostly_replays`]).
#[derive(Default)]
pub(super) struct Misses(std::sync::atomic::AtomicU32);

impl Misses {
    const MAX: u32 = 64;

    /// A look-up that missed the cache found a completed record (`true`), or a reservation
    /// made a new key ours (`false`). The score climbs by two for the first and falls by one
    /// for the second; a stream of new keys only reads it.
    pub(super) fn found(&self, completed: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let _ = self
            .0
            .fetch_update(Relaxed, Relaxed, |s| match (completed, s) {
                (false, 0) | (true, Self::MAX) => None,
                (true, s) => Some((s + 2).min(Self::MAX)),
                (false, s) => Some(s - 1),
            });
    }

    /// Whether over a third of the keys looked up past the cache lately were completed ones:
    /// retries of keys the cache does not hold (a store larger than the cache, replayed
    /// over), which are better read than looked up by a reservation.
    pub(super) fn mostly_replays(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) > Self::MAX / 2
    }
}

/// Bounds for the whole cache.
const MAX_ENTRIES: usize = 65_536;
const MAX_BYTES: u64 = 64 << 20;

/// A completed answer, as replays need it.
pub struct CachedAnswer {
    pub fingerprint: String,
    pub response: Arc<StoredResponse>,
    expires_at: i64,
    fresh_until: i64,
    bytes: u64,
}

#[cfg(test)]
impl CachedAnswer {
    fn clone_of(a: &CachedAnswer) -> CachedAnswer {
        CachedAnswer {
            fingerprint: a.fingerprint.clone(),
            response: a.response.clone(),
            expires_at: a.expires_at,
            fresh_until: a.fresh_until,
            bytes: a.bytes,
        }
    }
}

#[derive(Clone)]
pub(super) struct ByBytes;

impl quick_cache::Weighter<ScopedKey, Arc<CachedAnswer>> for ByBytes {
    fn weight(&self, _id: &ScopedKey, entry: &Arc<CachedAnswer>) -> u64 {
        entry.bytes
    }
}

/// The answers and the recent releases.
pub(super) struct Entries {
    pub(super) answers: quick_cache::sync::Cache<ScopedKey, Arc<CachedAnswer>, ByBytes>,
    /// Keys released lately, with when: a read that started before a release must not put
    /// the released answer back (tombstones live as long as an entry would). A std mutex: a
    /// map look-up or insert, never held across an await.
    pub(super) released: Mutex<HashMap<String, i64, ahash::RandomState>>,
}

impl Default for Entries {
    fn default() -> Entries {
        Entries::new()
    }
}

impl Entries {
    pub(super) fn new() -> Entries {
        Entries {
            answers: quick_cache::sync::Cache::with_weighter(MAX_ENTRIES, MAX_BYTES, ByBytes),
            released: Mutex::default(),
        }
    }

    /// The key's answer, while it is fresh. One past its freshness but not its retention
    /// stays, as a hint for [`Entries::stale`], until a read replaces it or it is evicted.
    pub(super) fn get(&self, id: &ScopedKey) -> Option<Arc<CachedAnswer>> {
        let hit = self.answers.get(id)?;
        let now = now_ms();
        if hit.fresh_until > now && hit.expires_at > now {
            return Some(hit);
        }
        if hit.expires_at <= now {
            self.answers.remove(id);
        }
        None
    }

    /// Whether the key was completed when last read, though that was over [`FRESH_FOR_MS`]
    /// ago: most likely it still is, and a request on it replays once it is read again.
    pub(super) fn stale(&self, id: &ScopedKey) -> bool {
        let now = now_ms();
        self.answers
            .peek(id)
            .is_some_and(|hit| hit.fresh_until <= now && hit.expires_at > now)
    }

    /// `false` when the answer stays out (released lately, or too large).
    pub(super) fn put(
        &self,
        id: &ScopedKey,
        fingerprint: &str,
        response: Arc<StoredResponse>,
        expires_at: i64,
    ) -> bool {
        // Held until the entry is in: a release cannot slip between the check and the insert.
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        if !released.is_empty() {
            let now = now_ms();
            released.retain(|_, at| *at + FRESH_FOR_MS > now);
            if released.contains_key(&id.key) {
                return false;
            }
        }
        // What the entry costs the allocator, not just its data: each header is a `String` and a
        // `Bytes` (about 100 bytes of bookkeeping with allocator rounding), and the key, the
        // fingerprint, the answer and the cache's own slot about 600 more.
        let headers: usize = response
            .headers
            .iter()
            .map(|(n, v)| n.len() + v.len() + 100)
            .sum();
        let strings = id.upstream.len() + id.scope.len() + id.key.len() + fingerprint.len();
        let bytes = (response.body.len() + headers + strings + 600) as u64;
        if bytes > MAX_BYTES / 64 {
            return false;
        }
        let entry = CachedAnswer {
            fingerprint: fingerprint.to_owned(),
            response,
            expires_at,
            fresh_until: now_ms() + FRESH_FOR_MS,
            bytes,
        };
        self.answers.insert(id.clone(), Arc::new(entry));
        drop(released);
        true
    }

    /// Drops every entry of `key` (any upstream or scope), or everything (`None`: releases may
    /// have been missed).
    pub(super) fn forget(&self, key: Option<&str>) {
        match key {
            Some(key) => {
                let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
                released.insert(key.to_owned(), now_ms());
                self.answers.retain(|id, _| id.key != key);
            }
            None => self.answers.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn id(k: &str) -> ScopedKey {
        ScopedKey::new("u", "s", k)
    }

    fn resp() -> Arc<StoredResponse> {
        Arc::new(StoredResponse {
            status: 200,
            headers: vec![],
            body: Bytes::from_static(b"{}"),
        })
    }

    #[test]
    fn hits_expire_and_releases_forget() {
        let c = Entries::new();
        c.put(&id("a"), "fp", resp(), now_ms() + 60_000);
        assert_eq!(
            c.get(&id("a")).map(|e| e.fingerprint.clone()).as_deref(),
            Some("fp")
        );
        c.put(&id("old"), "fp", resp(), now_ms() - 1);
        assert!(c.get(&id("old")).is_none(), "past retention");
        c.forget(Some("a"));
        assert!(c.get(&id("a")).is_none());
        // A read that began before the release cannot put the answer back.
        c.put(&id("a"), "fp", resp(), now_ms() + 60_000);
        assert!(c.get(&id("a")).is_none());
    }

    #[test]
    fn an_answer_past_its_freshness_is_a_hint_not_a_hit() {
        let c = Entries::new();
        c.put(&id("a"), "fp", resp(), now_ms() + 60_000);
        assert!(!c.stale(&id("a")), "fresh");
        // As it stands FRESH_FOR_MS later.
        let mut aged = CachedAnswer::clone_of(&c.answers.peek(&id("a")).unwrap());
        aged.fresh_until = now_ms() - 1;
        c.answers.insert(id("a"), Arc::new(aged));
        assert!(c.get(&id("a")).is_none(), "never replayed from");
        assert!(c.stale(&id("a")), "still a hint after a look-up");
        c.forget(Some("a"));
        assert!(!c.stale(&id("a")), "a release forgets the hint too");
        assert!(!c.stale(&id("never")));
    }

    #[test]
    fn misses_that_mostly_find_answers_mean_replays() {
        let m = Misses::default();
        // New keys only: never.
        (0..1000).for_each(|_| m.found(false));
        assert!(!m.mostly_replays());
        // Half the misses find a completed record: replays of keys the cache does not hold.
        (0..100).for_each(|i| m.found(i % 2 == 0));
        assert!(m.mostly_replays());
        // A quarter: first writes mostly, as before.
        (0..400).for_each(|i| m.found(i % 4 == 0));
        assert!(!m.mostly_replays());
    }
}
