//! The replay cache, as a layer over a store: completed answers kept in memory, so a retry
//! storm is served without a store round trip. It owns its invalidation, so nothing above the
//! store knows it is there: it fills itself from [`Keys::get`] and [`Keys::finish`], forgets on
//! [`Keys::release_key`], and hears of releases made elsewhere through the inner store's
//! [`Keys::observe_releases`] (NOTIFY on PostgreSQL).
//!
//! A completed record changes in just two ways: its retention ends (each entry keeps the
//! record's `expires_at`) or an operator releases it. A release made where this process cannot
//! hear it is seen within [`FRESH_FOR_MS`], after which an entry is read again. Memory is
//! bounded by bytes (quick_cache's S3-FIFO evicts).

use super::settling::Settling;
use super::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How long an entry is trusted before the store is asked again.
pub const FRESH_FOR_MS: i64 = 5_000;
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

#[derive(Clone)]
struct ByBytes;

impl quick_cache::Weighter<ScopedKey, Arc<CachedAnswer>> for ByBytes {
    fn weight(&self, _id: &ScopedKey, entry: &Arc<CachedAnswer>) -> u64 {
        entry.bytes
    }
}

/// The answers and the recent releases.
struct Entries {
    answers: quick_cache::sync::Cache<ScopedKey, Arc<CachedAnswer>, ByBytes>,
    /// Keys released lately, with when: a read that started before a release must not put
    /// the released answer back (tombstones live as long as an entry would). A std mutex: a
    /// map look-up or insert, never held across an await.
    released: Mutex<HashMap<String, i64, ahash::RandomState>>,
}

impl Entries {
    fn get(&self, id: &ScopedKey) -> Option<Arc<CachedAnswer>> {
        let hit = self.answers.get(id)?;
        let now = now_ms();
        if hit.fresh_until > now && hit.expires_at > now {
            return Some(hit);
        }
        self.answers.remove(id);
        None
    }

    /// `false` when the answer stays out (released lately, or too large).
    fn put(
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
    fn forget(&self, key: Option<&str>) {
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

/// A store with the replay cache in front of it.
pub struct CachedStore {
    inner: Arc<dyn Store>,
    entries: Arc<Entries>,
    /// The fingerprint of each key this process reserved, until its outcome is stored (the
    /// outcome carries only the answer), and the number of its answer when it was answered
    /// before its commit (see [`Keys::remember`]).
    reserved: Mutex<HashMap<ScopedKey, (String, Option<u64>), ahash::RandomState>>,
    /// Answers given before their commit, which an operator's read waits for.
    settling: Settling,
}

impl CachedStore {
    pub fn wrap(inner: Arc<dyn Store>) -> Arc<dyn Store> {
        let entries = Arc::new(Entries {
            answers: quick_cache::sync::Cache::with_weighter(MAX_ENTRIES, MAX_BYTES, ByBytes),
            released: Mutex::default(),
        });
        let heard = entries.clone();
        inner.observe_releases(Arc::new(move |key| heard.forget(key)));
        Arc::new(CachedStore {
            inner,
            entries,
            reserved: Mutex::default(),
            settling: Settling::default(),
        })
    }
}

#[async_trait]
impl Keys for CachedStore {
    fn cached(&self, id: &ScopedKey) -> Option<Arc<CachedAnswer>> {
        self.entries.get(id)
    }
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        let record = self.inner.get(id).await?;
        if let Some(rec) = &record {
            self.keep(rec);
        }
        Ok(record)
    }
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        let (id, fingerprint) = (r.id.clone(), r.fingerprint.clone());
        let reserved = self.inner.reserve(r).await?;
        match &reserved {
            Reserved::Owned { .. } => {
                let mut map = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
                map.insert(id, (fingerprint, None));
            }
            // The reservation was the look-up (see `Keys::reserve`): what it found fills the
            // cache as a read would.
            Reserved::Existing(rec) => self.keep(rec),
        }
        Ok(reserved)
    }
    async fn finish(&self, id: &ScopedKey, epoch: i64, outcome: Finish) -> StoreResult<bool> {
        let completed = match &outcome {
            Finish::Completed {
                response,
                expires_at,
                ..
            } => Some((response.clone(), *expires_at)),
            _ => None,
        };
        let (fingerprint, answered) = self.reserved_fingerprint(id).unzip();
        let answered = answered.flatten();
        let stored = match answered {
            Some(_) => self.inner.finish_answered(id, epoch, outcome).await,
            None => self.inner.finish(id, epoch, outcome).await,
        };
        match (&stored, completed, fingerprint) {
            // (An answer remembered before the commit is in already.)
            (Ok(true), Some((response, expires_at)), Some(fp)) if answered.is_none() => {
                self.entries.put(id, &fp, response, expires_at);
            }
            (Ok(true), ..) => {}
            // Answered from the cache before a commit that did not store it: the store says
            // in flight (unknown after a restart), and so must the cache.
            _ if answered.is_some() => {
                self.entries.answers.remove(id);
            }
            _ => {}
        }
        if let Some(n) = answered {
            self.settling.end(n);
        }
        stored
    }
    fn remember(&self, id: &ScopedKey, response: &Arc<StoredResponse>, expires_at: i64) -> bool {
        let mut map = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let Some((fingerprint, answered)) = map.get_mut(id) else {
            return false;
        };
        if answered.is_some()
            || !self
                .entries
                .put(id, fingerprint, response.clone(), expires_at)
        {
            return false;
        }
        *answered = Some(self.settling.begin());
        true
    }
    async fn renew(&self, id: &ScopedKey, epoch: i64, lease: Duration) -> StoreResult<bool> {
        self.inner.renew(id, epoch, lease).await
    }
    fn subscribe_key(&self, id: &ScopedKey) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.subscribe_key(id)
    }
    async fn watch_key(&self, id: &ScopedKey, epoch: i64) -> StoreResult<bool> {
        self.inner.watch_key(id, epoch).await
    }
    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        // An operator's act, like an operator's read, comes after the answers already given
        // (a key answered and not yet committed is still in flight: not releasable).
        self.settling.settle().await;
        let n = self.inner.release_key(key).await?;
        self.entries.forget(Some(key));
        Ok(n)
    }
    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>> {
        self.settling.settle().await;
        self.inner.find_key(key).await
    }
    async fn list_keys(&self, filter: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        self.settling.settle().await;
        self.inner.list_keys(filter).await
    }
    fn observe_releases(&self, f: ReleaseObserver) {
        self.inner.observe_releases(f)
    }
}

impl CachedStore {
    /// Caches a completed record read from the store. A sealed answer is never cached: each
    /// look-up meets it (and refuses it) anew.
    fn keep(&self, rec: &KeyRecord) {
        if rec.effective_state(now_ms()) != KeyState::Completed {
            return;
        }
        if let (Some(StoredAnswer::Open(resp)), Some(exp)) = (&rec.response, rec.expires_at) {
            self.entries
                .put(&rec.id, &rec.fingerprint, Arc::new(resp.clone()), exp);
        }
    }

    /// The fingerprint the key was reserved with, known to the reservation's owner: the
    /// finish carries only the answer.
    fn reserved_fingerprint(&self, id: &ScopedKey) -> Option<(String, Option<u64>)> {
        self.reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
    }
}

#[async_trait]
impl EntityLocks for CachedStore {
    async fn lock_entities(
        &self,
        entities: &[String],
        owner: &str,
        lease: Duration,
        timeout: Duration,
    ) -> StoreResult<Option<Vec<EntityLease>>> {
        self.inner
            .lock_entities(entities, owner, lease, timeout)
            .await
    }
    async fn renew_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        self.inner.renew_entities(leases, owner, lease).await
    }
    async fn recheck_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        self.inner.recheck_entities(leases, owner, lease).await
    }
    async fn unlock_entities(&self, leases: &[EntityLease], owner: &str) -> StoreResult<()> {
        self.inner.unlock_entities(leases, owner).await
    }
}

#[async_trait]
impl EntityStates for CachedStore {
    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        self.inner.entity_states(entities).await
    }
    async fn release_claim(&self, entity: &str) -> StoreResult<bool> {
        // After the claims of answers already given are stored, or they would undo it.
        self.settling.settle().await;
        self.inner.release_claim(entity).await
    }
    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>> {
        self.settling.settle().await;
        self.inner.find_entities(entity).await
    }
    async fn reset_version(&self, entity: &str) -> StoreResult<u64> {
        self.settling.settle().await;
        self.inner.reset_version(entity).await
    }
}

#[async_trait]
impl AuditLog for CachedStore {
    async fn append_audit(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.inner.append_audit(rows).await
    }
    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        self.inner.audit_for_entity(entity, limit).await
    }
    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        self.inner.audit_for_key(key, limit).await
    }
    async fn purge(&self, batch: i64, released_before: i64) -> StoreResult<u64> {
        self.inner.purge(batch, released_before).await
    }
}

#[async_trait]
impl Store for CachedStore {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    async fn scope_secret(&self, id: &str) -> StoreResult<ScopeCheck> {
        self.inner.scope_secret(id).await
    }
    async fn ping(&self) -> StoreResult<()> {
        self.inner.ping().await
    }
    async fn close(&self) {
        self.inner.close().await
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

    fn entries() -> Entries {
        Entries {
            answers: quick_cache::sync::Cache::with_weighter(MAX_ENTRIES, MAX_BYTES, ByBytes),
            released: Mutex::default(),
        }
    }

    #[test]
    fn hits_expire_and_releases_forget() {
        let c = entries();
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
}
