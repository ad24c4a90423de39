//! Step 3: the entity locks, every entity of the request in sorted order, by the request's
//! deadline — in this process first, then across replicas through the store's leases.

use super::Ctx;
use crate::config::Route;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::store::{EntityLease, Shared, StoreResult};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Step 3: local entity locks, then the store's cross-replica leases.
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<()> {
    let waited = Instant::now();
    let locked = lock(ctx).await;
    ctx.lock_wait += waited.elapsed();
    let (guards, leases) = locked?;
    ctx.entity_guards = guards;
    ctx.leases = leases;
    Ok(())
}

type Locked = (Vec<crate::locks::LockGuard>, Option<StoreLeases>);

async fn lock(ctx: &Ctx) -> ProxyResult<Locked> {
    let state = &ctx.state;
    let deadline = ctx.deadline.unwrap_or_else(Instant::now);
    let _waiting = state.stats.wait();
    let left = || deadline.saturating_duration_since(Instant::now());
    let guards = state
        .entity_locks
        .lock_all(&ctx.prepared.entities, left())
        .await
        .map_err(|_| entity_busy(&ctx.route))?;
    // A store no other process shares needs no leases: this process's locks order it all.
    let Some(store) = state
        .shared
        .clone()
        .filter(|_| !ctx.prepared.entities.is_empty())
    else {
        return Ok((guards, None));
    };
    // Taken in a task of its own and handed over as a guard: if this request is cancelled
    // (the client hung up) while leases are being taken, the guard drops and releases them
    // instead of leaving the entities locked until the leases run out.
    let (tx, rx) = oneshot::channel();
    let owner = state.owner.clone();
    let entities = ctx.prepared.entities.clone();
    let (lease, timeout) = (state.config.store.lease, left());
    tokio::spawn(async move {
        let asked = Instant::now();
        let taken = store.lock_entities(&entities, &owner, lease, timeout).await;
        let leases =
            taken.map(|held| held.map(|held| StoreLeases::held(store, owner, held, lease, asked)));
        let _ = tx.send(leases);
    });
    let leases = rx
        .await
        .map_err(|_| entity_busy(&ctx.route))?
        .map_err(ProxyError::store)?
        .ok_or_else(|| entity_busy(&ctx.route))?;
    Ok((guards, Some(leases)))
}

pub(super) fn entity_busy(route: &Route) -> ProxyError {
    ProxyError::new(
        ErrorKind::EntityBusy,
        format!(
            "the entity stayed locked by other writes for lock_timeout ({:?})",
            route.lock_timeout
        ),
    )
    .retry_after(Duration::from_secs(1))
}

/// Entity leases held in the store: renewed every third of the lease for as long as they are
/// held — through the checks, the reservation and the upstream call, however long each takes
/// — and released on every path, by `release` or on drop.
pub(super) struct StoreLeases {
    store: Arc<dyn Shared>,
    owner: String,
    pub(super) held: Vec<EntityLease>,
    /// Stops the renewal task.
    renewing: Option<CancellationToken>,
    /// Until when the leases cannot have been lost (see [`StoreLeases::still_held`]).
    sure_until: Instant,
}

impl StoreLeases {
    /// `asked`: when the leases were asked for (before the first was taken).
    fn held(
        store: Arc<dyn Shared>,
        owner: String,
        held: Vec<EntityLease>,
        lease: Duration,
        asked: Instant,
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
            sure_until: asked + lease / 3,
        }
    }

    /// Renews every lease now; `false` if any is no longer ours. Called right before the
    /// reservation, so a lease lost while waiting never lets a write through.
    ///
    /// Within a third of `lease` of asking for them, no round trip: a lease is freed only by
    /// its expiry (`lease` after it was taken, on the database's clock, which is after we
    /// asked) or by its owner, and the renewal task renews it a third of `lease` after it
    /// was taken; on an entity route this is one of five store round trips per request.
    pub(super) async fn still_held(&self, lease: Duration) -> StoreResult<bool> {
        if self.held.is_empty() || Instant::now() < self.sure_until {
            return Ok(true);
        }
        Ok(self
            .store
            .recheck_entities(&self.held, &self.owner, lease)
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
