//! The replay cache: completed answers kept in memory, so a retry storm is served without a
//! store round trip.
//!
//! Only completed records are cached, and a completed record changes in just two ways: its
//! retention ends (each entry keeps the record's `expires_at`) or an operator releases it. A
//! release through this process's admin API drops the entry at once; one made elsewhere (the
//! CLI, another replica) is seen within [`FRESH_FOR`], after which an entry is read again.
//! Memory is bounded by entry count and bytes; the oldest entries of a shard go first.

use crate::store::{now_ms, KeyRecord, KeyState, ScopedKey, StoredResponse};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

/// How long an entry is trusted before the store is asked again.
pub const FRESH_FOR_MS: i64 = 5_000;
const SHARDS: usize = 16;
/// Bounds for the whole cache.
const MAX_ENTRIES: usize = 65_536;
const MAX_BYTES: usize = 64 << 20;

/// A completed answer, as replays need it.
pub struct Cached {
    pub fingerprint: String,
    pub response: Arc<StoredResponse>,
    expires_at: i64,
    fresh_until: i64,
    bytes: usize,
}

#[derive(Default)]
struct Shard {
    map: HashMap<ScopedKey, Arc<Cached>>,
    order: VecDeque<ScopedKey>,
    bytes: usize,
}

#[derive(Default)]
pub struct ReplayCache {
    // std Mutex: a map look-up or insert, never held across an await.
    shards: [Mutex<Shard>; SHARDS],
    hasher: std::collections::hash_map::RandomState,
    /// Keys released lately, with when: a read that started before a release must not put
    /// the released answer back (tombstones live as long as an entry would).
    released: Mutex<HashMap<String, i64>>,
}

impl ReplayCache {
    fn shard(&self, id: &ScopedKey) -> std::sync::MutexGuard<'_, Shard> {
        let i = (self.hasher.hash_one(id) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh, unexpired entry.
    pub fn get(&self, id: &ScopedKey) -> Option<Arc<Cached>> {
        let now = now_ms();
        let mut shard = self.shard(id);
        let hit = shard.map.get(id)?.clone();
        if hit.fresh_until > now && hit.expires_at > now {
            return Some(hit);
        }
        shard.remove(id);
        None
    }

    /// Keeps a record if it is completed.
    pub fn put_record(&self, rec: &KeyRecord) {
        if rec.effective_state(now_ms()) != KeyState::Completed {
            return;
        }
        if let (Some(resp), Some(exp)) = (&rec.response, rec.expires_at) {
            self.put(&rec.id, &rec.fingerprint, Arc::new(resp.clone()), exp);
        }
    }

    /// Keeps a just-stored answer.
    pub fn put(
        &self,
        id: &ScopedKey,
        fingerprint: &str,
        response: Arc<StoredResponse>,
        expires_at: i64,
    ) {
        // Held until the entry is in: a release cannot slip between the check and the insert
        // (lock order: `released`, then a shard).
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        if !released.is_empty() {
            let now = now_ms();
            released.retain(|_, at| *at + FRESH_FOR_MS > now);
            if released.contains_key(&id.key) {
                return;
            }
        }
        let bytes = response.body.len()
            + response
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
            + id.key.len()
            + 256;
        if bytes > MAX_BYTES / SHARDS / 4 {
            return;
        }
        let entry = Arc::new(Cached {
            fingerprint: fingerprint.to_owned(),
            response,
            expires_at,
            fresh_until: now_ms() + FRESH_FOR_MS,
            bytes,
        });
        let mut shard = self.shard(id);
        shard.remove(id);
        shard.bytes += bytes;
        shard.order.push_back(id.clone());
        shard.map.insert(id.clone(), entry);
        if shard.order.len() > 2 * shard.map.len() + 16 {
            let Shard { map, order, .. } = &mut *shard;
            order.retain(|id| map.contains_key(id));
        }
        while shard.map.len() > MAX_ENTRIES / SHARDS || shard.bytes > MAX_BYTES / SHARDS {
            let Some(oldest) = shard.order.pop_front() else {
                break;
            };
            if let Some(gone) = shard.map.remove(&oldest) {
                shard.bytes -= gone.bytes;
            }
        }
        drop(shard);
        drop(released);
    }

    /// Drops everything (notifications of releases may have been missed).
    pub fn clear(&self) {
        for s in &self.shards {
            *s.lock().unwrap_or_else(|p| p.into_inner()) = Shard::default();
        }
    }

    /// Drops every entry of `key` (any upstream or scope): an operator released it.
    pub fn forget_key(&self, key: &str) {
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        released.insert(key.to_owned(), now_ms());
        for s in &self.shards {
            let mut shard = s.lock().unwrap_or_else(|p| p.into_inner());
            let ids: Vec<ScopedKey> = shard
                .map
                .keys()
                .filter(|id| id.key == key)
                .cloned()
                .collect();
            for id in ids {
                shard.remove(&id);
            }
        }
    }
}

impl Shard {
    fn remove(&mut self, id: &ScopedKey) {
        if let Some(gone) = self.map.remove(id) {
            self.bytes -= gone.bytes;
            // The id stays in `order` until it reaches the front; popping it then is a no-op.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn id(k: &str) -> ScopedKey {
        ScopedKey {
            upstream: "u".into(),
            scope: "s".into(),
            key: k.into(),
        }
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
        let c = ReplayCache::default();
        c.put(&id("a"), "fp", resp(), now_ms() + 60_000);
        assert_eq!(
            c.get(&id("a")).map(|e| e.fingerprint.clone()).as_deref(),
            Some("fp")
        );
        c.put(&id("old"), "fp", resp(), now_ms() - 1);
        assert!(c.get(&id("old")).is_none(), "past retention");
        c.forget_key("a");
        assert!(c.get(&id("a")).is_none());
        // A read that began before the release cannot put the answer back.
        c.put(&id("a"), "fp", resp(), now_ms() + 60_000);
        assert!(c.get(&id("a")).is_none());
    }
}
