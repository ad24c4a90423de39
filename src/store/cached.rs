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

pub use super::replay_cache::{CachedAnswer, FRESH_FOR_MS};
use super::replay_cache::{Entries, Misses};
use super::settling::Settling;
use super::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A store with the replay cache in front of it.
pub struct CachedStore {
    inner: Arc<dyn Store>,
    entries: Arc<Entries>,
    /// The fingerprint of each key this process reserved, until its outcome is stored (the
    /// outcome carries only the answer), and the number of its answer when it was answered
    /// before its commit (see [`Keys::remember`]).
    reserved: Mutex<HashMap<ScopedKey, (String, Option<u64>), ahash::RandomState>>,
    /// Answers given before their commit, which an operator's read waits for.
    settling: Arc<Settling>,
    /// How the look-ups that missed the cache ended lately.
    misses: Misses,
}

/// What [`CachedStore`] does once an outcome's write is over (see [`CachedStore::settle`]).
struct Plan {
    completed: Option<(Arc<StoredResponse>, i64)>,
    fingerprint: Option<String>,
    answered: Option<u64>,
}

impl CachedStore {
    /// What the cache needs to know of an outcome before it is written.
    fn plan(&self, id: &ScopedKey, outcome: &Finish) -> Plan {
        let completed = match outcome {
            Finish::Completed {
                response,
                expires_at,
                ..
            } => Some((response.clone(), *expires_at)),
            _ => None,
        };
        let (fingerprint, answered) = self.reserved_fingerprint(id).unzip();
        Plan {
            completed,
            fingerprint,
            answered: answered.flatten(),
        }
    }

    /// The cache once the outcome's write is over.
    fn settle(&self, id: &ScopedKey, plan: Plan, stored: &StoreResult<bool>) {
        settle(&self.entries, &self.settling, id, plan, stored)
    }

    pub fn wrap(inner: Arc<dyn Store>) -> Arc<dyn Store> {
        let entries = Arc::new(Entries::new());
        let heard = entries.clone();
        inner.observe_releases(Arc::new(move |key| heard.forget(key)));
        Arc::new(CachedStore {
            inner,
            entries,
            reserved: Mutex::default(),
            settling: Arc::default(),
            misses: Misses::default(),
        })
    }
}

/// [`CachedStore::settle`], on whichever thread heard of the write.
fn settle(
    entries: &Entries,
    settling: &Settling,
    id: &ScopedKey,
    plan: Plan,
    stored: &StoreResult<bool>,
) {
    match (stored, plan.completed, plan.fingerprint) {
        // (An answer remembered before the commit is in already.)
        (Ok(true), Some((response, expires_at)), Some(fp)) if plan.answered.is_none() => {
            entries.put(id, &fp, response, expires_at);
        }
        (Ok(true), ..) => {}
        // Answered from the cache before a commit that did not store it: the store says in
        // flight (unknown after a restart), and so must the cache.
        _ if plan.answered.is_some() => {
            entries.answers.remove(id);
        }
        _ => {}
    }
    if let Some(n) = plan.answered {
        settling.end(n);
    }
}

#[async_trait]
impl Keys for CachedStore {
    fn cached(&self, id: &ScopedKey) -> Option<Arc<CachedAnswer>> {
        self.entries.get(id)
    }
    fn likely_replay(&self, id: &ScopedKey) -> bool {
        self.misses.mostly_replays() || self.entries.stale(id)
    }
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        let record = self.inner.get(id).await?;
        // A completed record counts here; a new key counts once, at its reservation.
        if record.as_ref().is_some_and(|r| self.keep(r)) {
            self.misses.found(true);
        }
        Ok(record)
    }
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        let (id, fingerprint) = (r.id.clone(), r.fingerprint.clone());
        let reserved = self.inner.reserve(r).await?;
        match &reserved {
            Reserved::Owned { .. } => {
                self.misses.found(false);
                let mut map = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
                map.insert(id, (fingerprint, None));
            }
            // The reservation was the look-up (see `Keys::reserve`): what it found fills the
            // cache as a read would.
            Reserved::Existing(rec) => {
                if self.keep(rec) {
                    self.misses.found(true);
                }
            }
        }
        Ok(reserved)
    }
    async fn finish(
        &self,
        id: &ScopedKey,
        epoch: i64,
        outcome: Finish,
        when: When,
    ) -> StoreResult<bool> {
        let plan = self.plan(id, &outcome);
        if let When::Later(then) = when {
            let (entries, settling) = (self.entries.clone(), self.settling.clone());
            let theirs = id.clone();
            let then = AfterCommit::new(move |stored| {
                settle(&entries, &settling, &theirs, plan, &stored);
                then.tell(stored)
            });
            return self
                .inner
                .finish(id, epoch, outcome, When::Later(then))
                .await;
        }
        let stored = self.inner.finish(id, epoch, outcome, when).await;
        self.settle(id, plan, &stored);
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
    async fn settle_record(
        &self,
        id: &ScopedKey,
        epoch: i64,
        outcome: Finish,
    ) -> StoreResult<bool> {
        // Only an unknown record: never one the cache holds (a retry reads the new one).
        self.inner.settle_record(id, epoch, outcome).await
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
    /// Caches a completed record read from the store, and says whether it was completed. A
    /// sealed answer is never cached: each look-up meets it (and refuses it) anew.
    fn keep(&self, rec: &KeyRecord) -> bool {
        if rec.effective_state(now_ms()) != KeyState::Completed {
            return false;
        }
        if let (Some(StoredAnswer::Open(resp)), Some(exp)) = (&rec.response, rec.expires_at) {
            self.entries
                .put(&rec.id, &rec.fingerprint, Arc::new(resp.clone()), exp);
        }
        true
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
    async fn audit_counts(&self, since: i64) -> StoreResult<Vec<AuditCount>> {
        self.inner.audit_counts(since).await
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
