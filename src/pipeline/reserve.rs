//! Step 5: durably reserve the key — state in flight, owner, lease, a new fencing epoch —
//! committed before anything is forwarded. A store that cannot commit is
//! `503 store_unavailable`, never a forward (fail closed).

use super::lock::entity_busy;
use super::Ctx;
use crate::error::{ProxyError, ProxyResult};
use crate::store::{Reservation, Reserved};

/// `Ok(true)`: the key is ours. `Ok(false)`: another process reserved it first; its record is
/// in `ctx.taken` for step 2 to decide on.
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<bool> {
    let lease = ctx.state.config.store.lease;
    // The entity leases must still be ours, and for a full lease from now, before anything
    // is reserved or sent: checks or waits may have taken long.
    if let Some(leases) = &ctx.leases {
        let held = leases.still_held(lease).await;
        if !matches!(held, Ok(true)) {
            ctx.release_entities().await;
            return Err(match held {
                Err(e) => ProxyError::store(e),
                _ => entity_busy(&ctx.route),
            });
        }
    }
    let reservation = Reservation {
        id: ctx.p.id.clone(),
        fingerprint: ctx.p.fingerprint.clone(),
        route: ctx.route.name.clone(),
        entities: ctx.p.entities.clone(),
        owner: ctx.state.owner.clone(),
        lease,
        take_unknown: ctx.take_unknown,
    };
    match ctx.state.store.reserve(reservation).await {
        Ok(Reserved::Owned { epoch }) => {
            ctx.epoch = epoch;
            Ok(true)
        }
        Ok(Reserved::Existing(record)) => {
            ctx.release_entities().await;
            ctx.taken = Some(record);
            Ok(false)
        }
        Err(e) => {
            ctx.release_entities().await;
            Err(ProxyError::store(e))
        }
    }
}
