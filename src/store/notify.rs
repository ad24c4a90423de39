//! Wake-ups without polling: a hub of topics (a key, an entity) that waiters subscribe to
//! *before* they check the state they wait on, so no notification is lost in between.
//!
//! Each topic is a `watch` channel carrying a counter; a publish bumps it and every receiver
//! subscribed earlier sees the change. The PostgreSQL store feeds the hub from LISTEN/NOTIFY,
//! so a waiter in one replica learns of a completion in another.

use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::watch;

/// Topics are pruned once this many exist and nobody listens to some of them.
const PRUNE_AT: usize = 1024;

#[derive(Default)]
pub struct Hub {
    // std Mutex: held for a map look-up only, never across an await.
    topics: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Told of releases made elsewhere (see `Store::observe_releases`).
    observer: Mutex<Option<super::ReleaseObserver>>,
}

impl Hub {
    /// Interest in `topic` from now on.
    pub fn subscribe(&self, topic: &str) -> watch::Receiver<u64> {
        let mut map = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= PRUNE_AT {
            map.retain(|_, tx| tx.receiver_count() > 0);
        }
        map.entry(topic.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// Wakes every subscriber of `topic`.
    pub fn publish(&self, topic: &str) {
        let mut map = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = map.get(topic) {
            tx.send_modify(|n| *n = n.wrapping_add(1));
            if tx.receiver_count() == 0 {
                map.remove(topic);
            }
        }
    }

    /// Wakes everyone (after a lost connection, when notifications may have been missed).
    pub fn publish_all(&self) {
        {
            let map = self.topics.lock().unwrap_or_else(|p| p.into_inner());
            for tx in map.values() {
                tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
        self.released(None);
    }

    pub fn set_observer(&self, f: super::ReleaseObserver) {
        *self.observer.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// A key was released elsewhere (`None`: any key may have been).
    pub fn released(&self, key: Option<&str>) {
        let f = self
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(f) = f {
            f(key);
        }
    }
}

/// The payload announcing a key's release to other replicas' replay caches.
pub const RELEASED_PREFIX: &str = "r:";

/// The topic of a key.
pub fn key_topic(id: &super::ScopedKey) -> String {
    id.joined("k:")
}

/// The topic of an entity.
pub fn entity_topic(entity: &str) -> String {
    format!("e:{entity}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_publish_after_subscribe_is_never_lost() {
        let hub = Hub::default();
        let mut rx = hub.subscribe("a");
        hub.publish("a");
        // Already published: changed() returns at once.
        rx.changed().await.unwrap();
        let rx2 = hub.subscribe("a");
        hub.publish("b");
        assert!(!rx2.has_changed().unwrap());
        hub.publish_all();
        assert!(rx2.has_changed().unwrap());
    }

    /// What PostgreSQL sends for a key (`'k:' || upstream || chr(10) || scope || chr(10) ||
    /// key`, see the outcome statement) is the topic its waiters subscribe to.
    #[test]
    fn a_key_topic_is_what_the_notification_carries() {
        let id = crate::store::ScopedKey::new("api", "k1:00ff", "order-1");
        assert_eq!(key_topic(&id), "k:api\nk1:00ff\norder-1");
        assert_eq!(id.joined(""), "api\nk1:00ff\norder-1");
    }
}
