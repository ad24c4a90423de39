//! The entity locks an operator's act holds: this process's guards and the store's leases.
//! Let go by [`Held::unlock`] once the act is stored, or on drop when the act was cancelled
//! (an admin client that hung up): the leases are then released by a task of their own
//! instead of keeping the entities from every replica until they lapse.

use crate::locks::LockGuard;
use crate::store::{EntityLease, Shared};
use std::sync::Arc;

pub(super) struct Held {
    /// `None`: a store with no leases (then `leases` stays empty).
    store: Option<Arc<dyn Shared>>,
    owner: String,
    _guards: Vec<LockGuard>,
    pub(super) leases: Vec<EntityLease>,
}

impl Held {
    pub(super) fn new(
        store: Option<Arc<dyn Shared>>,
        owner: String,
        guards: Vec<LockGuard>,
    ) -> Held {
        Held {
            store,
            owner,
            _guards: guards,
            leases: Vec::new(),
        }
    }

    /// Lets go of the leases now (this process's guards go with `self`).
    pub(super) async fn unlock(mut self) {
        let leases = std::mem::take(&mut self.leases);
        if let Some(store) = &self.store {
            unlock(store.as_ref(), &leases, &self.owner).await;
        }
    }
}

async fn unlock(store: &dyn Shared, leases: &[EntityLease], owner: &str) {
    if leases.is_empty() {
        return;
    }
    if let Err(e) = store.unlock_entities(leases, owner).await {
        tracing::warn!(error = %e, "could not release the entity leases taken to settle a key; they lapse with their lease");
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let leases = std::mem::take(&mut self.leases);
        if leases.is_empty() {
            return;
        }
        let Some(store) = self.store.clone() else {
            return;
        };
        let owner = std::mem::take(&mut self.owner);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn(async move { unlock(store.as_ref(), &leases, &owner).await })),
            Err(_) => tracing::warn!("entity leases left to lapse: no runtime to release them"),
        }
    }
}
