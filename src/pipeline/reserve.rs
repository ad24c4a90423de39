//! Step 5: durably reserve the key — state in flight, owner, lease, a new fencing epoch —
//! committed before anything is forwarded. A store that cannot commit is
//! `503 store_unavailable`, never a forward (fail closed).

use super::lock::entity_busy;
use super::outcome::Outcome;
use super::reconcile::{self, Verdict};
use super::{checks, store, Ctx};
use crate::error::{ProxyError, ProxyResult};
use crate::store::{Finish, Reservation, Reserved};
use std::time::Duration;

impl Ctx {
    /// The reservation of this request's key, for a full lease from now.
    /// Whether a retry of an unknown outcome is sent again: the upstream dedupes by the key we
    /// send, or the route's write is applied idempotently (`resend_unknown`). Then no
    /// reconcile runs, and enforce mode takes the unknown key over.
    pub(super) fn resends_unknown(&self) -> bool {
        self.upstream.native_idempotency_header.is_some() || self.route.resend_unknown
    }

    pub(super) fn reservation(&self, take_unknown: bool) -> Reservation {
        Reservation {
            id: self.prepared.id.clone(),
            fingerprint: self.prepared.fingerprint.clone(),
            route: self.route.name.clone(),
            entities: self.prepared.entities.clone(),
            owner: self.state.owner.clone(),
            lease: self.state.config.store.lease,
            take_unknown,
            call_timeout: self.upstream.timeout,
        }
    }
}

/// The entity leases must still be ours, and for a full lease from now, before anything is
/// reserved or sent: checks or waits may have taken long. Released when they are not.
async fn entities_held(ctx: &mut Ctx) -> ProxyResult<()> {
    let lease = ctx.state.config.store.lease;
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
    Ok(())
}

/// After a reservation, and before a forward that time separates from it (a reconcile read):
/// the entity leases and the key (its lease renewed, fenced by our epoch) are still ours.
/// Everything is let go when they are not, and nothing is sent.
pub(super) async fn still_ours(ctx: &mut Ctx) -> ProxyResult<()> {
    entities_held(ctx).await?;
    let lease = ctx.state.config.store.lease;
    let renewed = match &ctx.ticket {
        Some(ticket) => ctx.state.store.renew(ticket, lease).await,
        None => Ok(false),
    };
    if matches!(renewed, Ok(true)) {
        return Ok(());
    }
    ctx.release_entities().await;
    ctx.slot = None;
    Err(match renewed {
        Err(e) => ProxyError::store(e),
        _ => super::refusals::in_progress(),
    })
}

/// `Ok(true)`: the key is ours. `Ok(false)`: another process reserved it first; its record is
/// in `ctx.taken` for step 2 to decide on.
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<bool> {
    entities_held(ctx).await?;
    let reservation = ctx.reservation(ctx.take_unknown);
    match ctx.state.store.reserve(reservation).await {
        Ok(Reserved::Owned(ticket)) => {
            crate::fault::point(crate::fault::Point::Reserved);
            ctx.state.replay.reserved();
            ctx.ticket = Some(ticket);
            Ok(true)
        }
        Ok(Reserved::Existing(record)) => {
            // The reservation was the look-up (see `Keys::reserve`): what it found is kept
            // as a read's would be.
            ctx.state.replay.saw(&record);
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

/// A retry that met an unknown key and took it over (step 5, with `take_unknown`): `None`
/// when the write did not happen and this request goes on to be forwarded (after the checks
/// it skipped, which a found write would have made moot), else how the request ends.
pub(super) async fn before_retry(ctx: &mut Ctx, wait: Duration) -> Option<Outcome> {
    let (outcome, finish) = match reconcile::ask(ctx, wait).await {
        Verdict::Found(stored) => {
            // A retry gets what is stored (the read's `Set-Cookie` is not the write's).
            let stored = stored.for_storage(ctx.upstream.store_set_cookie);
            let finish = super::outcome::completed(ctx, stored.clone());
            (Outcome::Replayed(stored), finish)
        }
        Verdict::NotFound => match checks::step(ctx).await {
            // The read and the checks took time: the key and the entities must still be ours
            // before the write goes, or another replica may be sending it too.
            Ok(()) => match still_ours(ctx).await {
                Ok(()) => return None,
                Err(e) => return Some(Outcome::Refused(e)),
            },
            Err(e) => (Outcome::Refused(e), Finish::Released),
        },
        Verdict::Failed(why) => {
            let e = reconcile::unknown(&format!(
                "the reconcile read could not tell whether the earlier attempt happened ({why})"
            ));
            (Outcome::Refused(e), Finish::Unknown)
        }
    };
    store::record(ctx, finish, None).await;
    Some(outcome)
}
