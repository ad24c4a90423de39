//! The replay cache: completed answers kept in memory, so a retry storm is served without a
//! store round trip. It sits beside the store in the application state, and the request path
//! consults it in so many words: [`ReplayCache::hit`] before a look-up, [`ReplayCache::saw`]
//! after one, [`ReplayCache::remember`] before an answer goes out ahead of its commit, and
//! [`ReplayCache::finished`] once the outcome's write is over. It hears of releases made
//! elsewhere through [`Store::observe_releases`] (NOTIFY on PostgreSQL), and an operator's
//! read or act through this process waits, in [`ReplayCache::settled`], for the answers
//! already given to commit.
//!
//! A completed record changes in just two ways: its retention ends (each entry keeps the
//! record's `expires_at`) or an operator releases it. A release made where this process cannot
//! hear it is seen within [`FRESH_FOR_MS`], after which an entry is read again. Memory is
//! bounded by bytes (quick_cache's S3-FIFO evicts).
//!
//! - [`entries`]: the answers by key, and the keys released lately.
//! - [`settling`]: the answers given before their commit, which an operator's read waits for.

mod entries;
mod settling;

pub use entries::{CachedAnswer, FRESH_FOR_MS};

use super::*;
use entries::{Entries, Misses};
use settling::Settling;
use std::sync::Arc;

/// Proof that an answer was remembered before its outcome's commit: only
/// [`ReplayCache::remember`] makes one, and only [`When::Answered`] takes one, so a caller
/// cannot be answered ahead of the commit of an answer a retry would not find.
#[derive(Debug, Clone, Copy)]
pub struct Remembered(u64);

/// The completed answers this process keeps (see the module's doc).
#[derive(Default)]
pub struct ReplayCache {
    entries: Arc<Entries>,
    /// Answers given before their commit, which an operator's read waits for.
    settling: Arc<Settling>,
    /// How the look-ups that missed the cache ended lately.
    misses: Misses,
}

impl ReplayCache {
    /// A cache that forgets what `store` hears released elsewhere.
    pub fn beside(store: &dyn Store) -> Arc<ReplayCache> {
        let cache = Arc::new(ReplayCache::default());
        let heard = cache.entries.clone();
        store.observe_releases(Arc::new(move |key| heard.forget(key)));
        cache
    }

    /// A completed answer kept for this key: a replay then needs no lock and no store trip.
    pub fn hit(&self, id: &ScopedKey) -> Option<Arc<CachedAnswer>> {
        self.entries.get(id)
    }

    /// Whether a request on this key, which the cache does not answer, most likely replays:
    /// the cache held its answer until it went stale (see [`FRESH_FOR_MS`]), or most
    /// look-ups that missed the cache lately found a completed record. Such a request reads
    /// the record rather than let a reservation look it up (see `pipeline::lookup`).
    pub fn likely_replay(&self, id: &ScopedKey) -> bool {
        self.misses.mostly_replays() || self.entries.stale(id)
    }

    /// A record a look-up (a read, or a reservation that found it standing) met: a completed
    /// one is kept, unless sealed (each look-up meets a sealed answer, and refuses it, anew).
    pub fn saw(&self, rec: &KeyRecord) {
        if rec.effective_state(now_ms()) != KeyState::Completed {
            return;
        }
        self.misses.found(true);
        if let (Some(StoredAnswer::Open(resp)), Some(exp)) = (&rec.response, rec.expires_at) {
            self.entries
                .put(&rec.id, &rec.fingerprint, Arc::new(resp.clone()), exp);
        }
    }

    /// A reservation made a new key ours: a look-up past the cache that was not a replay.
    pub fn reserved(&self) {
        self.misses.found(false);
    }

    /// Keeps the answer of a key this process reserved where a retry finds it at once, so its
    /// caller can be answered before the commit. `None` when it cannot (the answer does not
    /// fit): answer after the commit.
    pub fn remember(
        &self,
        ticket: &Ticket,
        response: &Arc<StoredResponse>,
        expires_at: i64,
    ) -> Option<Remembered> {
        let fp = ticket.fingerprint();
        if !self
            .entries
            .put(ticket.id(), fp, response.clone(), expires_at)
        {
            return None;
        }
        Some(Remembered(self.settling.begin()))
    }

    /// The cache once an outcome's write is over: a completed answer stored is kept (an
    /// answer remembered before is in already); an answer remembered and then not stored is
    /// dropped, since the store says in flight (unknown after a restart), and so must the
    /// cache.
    pub fn finished(
        &self,
        ticket: &Ticket,
        outcome: &Finish,
        remembered: Option<Remembered>,
        stored: &StoreResult<bool>,
    ) {
        let id = ticket.id();
        match (stored, outcome, remembered) {
            (
                Ok(true),
                Finish::Completed {
                    response,
                    expires_at,
                    ..
                },
                None,
            ) => {
                self.entries
                    .put(id, ticket.fingerprint(), response.clone(), *expires_at);
            }
            (Ok(true), ..) => {}
            (_, _, Some(_)) => {
                self.entries.answers.remove(id);
            }
            _ => {}
        }
        if let Some(Remembered(n)) = remembered {
            self.settling.end(n);
        }
    }

    /// Waits until every answer given before now has committed (or failed to): an
    /// operator's read or act comes after what callers were told. Bounded (see
    /// [`settling::Settling::settle`]).
    pub fn settled(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.settling.settle()
    }

    /// Drops the answers of `key` (`None`: every answer), released by an operator here.
    pub fn forget(&self, key: Option<&str>) {
        self.entries.forget(key)
    }
}
