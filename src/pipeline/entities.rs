//! Step 3: entity locks — in this process first, then across replicas through the store.

use super::{entity_busy, store_error};
use crate::config::Route;
use crate::error::ProxyResult;
use crate::locks::LockGuard;
use crate::prepare::Prepared;
use crate::proxy::AppState;
use crate::store::{EntityLease, Store};
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Step 3: local entity locks, then the store's cross-replica leases, all by `deadline`.
pub(super) async fn lock_entities(
    state: &AppState,
    route: &Route,
    p: &Prepared,
    deadline: Instant,
) -> ProxyResult<(Vec<LockGuard>, StoreLeases)> {
    let _waiting = state.stats.wait();
    let left = || deadline.saturating_duration_since(Instant::now());
    let guards = state
        .entity_locks
        .lock_all(&p.entities, left())
        .await
        .map_err(|_| entity_busy(route))?;
    if p.entities.is_empty() {
        return Ok((guards, StoreLeases::none(state)));
    }
    // Taken in a task of its own and handed over as a guard: if this request is cancelled
    // (the client hung up) while leases are being taken, the guard drops and releases them
    // instead of leaving the entities locked until the leases run out.
    let (tx, rx) = oneshot::channel();
    let (store, owner, entities) = (state.store.clone(), state.owner.clone(), p.entities.clone());
    let (lease, timeout) = (state.config.store.lease, left());
    tokio::spawn(async move {
        let taken = store.lock_entities(&entities, &owner, lease, timeout).await;
        let _ = tx.send(taken.map(|held| held.map(|held| StoreLeases { store, owner, held })));
    });
    let leases = rx
        .await
        .map_err(|_| entity_busy(route))?
        .map_err(|e| store_error(state, e))?
        .ok_or_else(|| entity_busy(route))?;
    Ok((guards, leases))
}

/// Entity leases held in the store; released on every path, by `release` or on drop.
pub(super) struct StoreLeases {
    store: Arc<dyn Store>,
    owner: String,
    pub(super) held: Vec<EntityLease>,
}

impl StoreLeases {
    pub(super) fn none(state: &AppState) -> StoreLeases {
        StoreLeases {
            store: state.store.clone(),
            owner: state.owner.clone(),
            held: Vec::new(),
        }
    }

    pub(super) async fn release(mut self) {
        let held = std::mem::take(&mut self.held);
        if !held.is_empty() {
            if let Err(e) = self.store.unlock_entities(&held, &self.owner).await {
                tracing::warn!(error = %e, "could not release entity leases; they expire after the lease");
            }
        }
    }
}

impl Drop for StoreLeases {
    fn drop(&mut self) {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return;
        }
        // An early return or a cancelled task: release in the background.
        let (store, owner) = (self.store.clone(), self.owner.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = store.unlock_entities(&held, &owner).await;
            });
        }
    }
}
