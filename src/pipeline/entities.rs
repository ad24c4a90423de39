//! Step 3: entity locks — in this process first, then across replicas through the store.

use super::{entity_busy, store_error};
use crate::config::Route;
use crate::error::ProxyResult;
use crate::locks::LockGuard;
use crate::prepare::Prepared;
use crate::state::AppState;
use crate::store::{EntityLease, Store, StoreResult};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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
        let leases =
            taken.map(|held| held.map(|held| StoreLeases::held(store, owner, held, lease)));
        let _ = tx.send(leases);
    });
    let leases = rx
        .await
        .map_err(|_| entity_busy(route))?
        .map_err(|e| store_error(state, e))?
        .ok_or_else(|| entity_busy(route))?;
    Ok((guards, leases))
}

/// Entity leases held in the store: renewed every third of the lease for as long as they are
/// held — through the checks, the reservation and the upstream call, however long each takes
/// — and released on every path, by `release` or on drop.
pub(super) struct StoreLeases {
    store: Arc<dyn Store>,
    owner: String,
    pub(super) held: Vec<EntityLease>,
    /// Stops the renewal task.
    renewing: Option<CancellationToken>,
}

impl StoreLeases {
    pub(super) fn none(state: &AppState) -> StoreLeases {
        StoreLeases {
            store: state.store.clone(),
            owner: state.owner.clone(),
            held: Vec::new(),
            renewing: None,
        }
    }

    fn held(
        store: Arc<dyn Store>,
        owner: String,
        held: Vec<EntityLease>,
        lease: Duration,
    ) -> StoreLeases {
        let stop = CancellationToken::new();
        if !held.is_empty() {
            let (store, owner, held, stop) =
                (store.clone(), owner.clone(), held.clone(), stop.clone());
            let every = (lease / 3).max(Duration::from_millis(50));
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                    match store.renew_entities(&held, &owner, lease).await {
                        Ok(lost) if lost.is_empty() => {}
                        Ok(lost) => {
                            tracing::error!(?lost, "entity leases were taken over while held");
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "entity lease renewal failed; retrying")
                        }
                    }
                }
            });
        }
        StoreLeases {
            store,
            owner,
            held,
            renewing: Some(stop),
        }
    }

    /// Renews every lease now; `false` if any is no longer ours. Called right before the
    /// reservation, so a lease lost while waiting never lets a write through.
    pub(super) async fn still_held(&self, lease: Duration) -> StoreResult<bool> {
        if self.held.is_empty() {
            return Ok(true);
        }
        Ok(self
            .store
            .renew_entities(&self.held, &self.owner, lease)
            .await?
            .is_empty())
    }

    pub(super) async fn release(mut self) {
        if let Some(stop) = self.renewing.take() {
            stop.cancel();
        }
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
        if let Some(stop) = self.renewing.take() {
            stop.cancel();
        }
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
