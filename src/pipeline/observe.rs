//! Observe mode (SPEC "Observe mode"): every protected request is forwarded as it would be
//! without the proxy — no waiting, no refusal, no replay, no fencing, no precheck — and what
//! enforce mode *would* have done is recorded instead: `idemproxy_observed_total{route,
//! would}`, the audit decision `observed:<would>`, and `Idemproxy-Observed: <would>` on the
//! answer.
//!
//! Records are kept as enforce mode would keep them, so switching the route to enforce
//! starts from true history: a request enforce mode would have forwarded reserves its key and
//! stores its answer and entity effects; a request enforce mode would have replayed or refused
//! leaves the records alone. A store that fails does not stop the request (observe mode fails
//! open): it is forwarded, and the failure counted in `idemproxy_store_errors_total`. A stored
//! answer this process cannot decrypt counts as such a failure (and in
//! `idemproxy_decrypt_failures_total`): enforce mode answers it `503`, observe mode forwards.

use super::outcome::outcome_of;
use super::{checks, forward, lock, store, Ctx, Outcome};
use crate::error::ProxyError;
use crate::store::{now_ms, KeyRecord, KeyState, Reserved};
use crate::upstream::ProxyBody;
use http::Response;

/// A request enforce mode would refuse before reading its body (a malformed key header):
/// streamed through as is, the refusal recorded as what enforce mode would have done.
pub(super) async fn passthrough(
    mut ctx: Ctx,
    refused: &ProxyError,
    target: &crate::upstream::Target<'_>,
    req: http::Request<crate::connection::RequestBody>,
) -> crate::error::ProxyResult<Response<ProxyBody>> {
    let mut resp = crate::upstream::passthrough(&ctx.client, target, req).await?;
    ctx.observed = Some(refused.kind.as_str());
    ctx.upstream_status = Some(resp.status().as_u16());
    ctx.show_observed(resp.headers_mut());
    let observed = ctx.observation().unwrap_or_default();
    ctx.conclude(&observed);
    Ok(resp)
}

/// What enforce mode would have done with a stored record of this key.
fn would_for_record(rec: &KeyRecord, fingerprint: &str, resends: bool) -> Option<&'static str> {
    let state = rec.effective_state(now_ms());
    if state == KeyState::Released {
        return None;
    }
    if rec.fingerprint != fingerprint {
        return Some("key_reused");
    }
    match state {
        KeyState::Completed if rec.response.is_some() => Some("replay"),
        KeyState::Completed | KeyState::Released => None,
        KeyState::InFlight => Some("in_flight"),
        KeyState::Unknown if resends => None,
        KeyState::Unknown => Some("outcome_unknown"),
    }
}

/// The request, observed. `refused` is what step 1 refused (then nothing was evaluated and
/// nothing is recorded but the observation).
pub(super) async fn run(
    mut ctx: Ctx,
    refused: Option<ProxyError>,
) -> crate::error::ProxyResult<Response<ProxyBody>> {
    if let Some(e) = refused {
        // Transport limits hold in both modes: a body that never arrived cannot be sent.
        if !ctx.outgoing.built() {
            return ctx.finish(Outcome::Refused(e));
        }
        ctx.observed = Some(e.kind.as_str());
        let called = forward::plain(&mut ctx).await;
        let outcome = outcome_of(&mut ctx, called);
        return ctx.finish(outcome);
    }
    let (would, reserve) = look(&mut ctx).await;
    // The entity locks, taken only if free this instant: a write enforce mode would have
    // queued is an overlap, forwarded at once. Held, they fence the entity effects stored
    // below as in enforce mode (and detect overlaps across replicas on PostgreSQL).
    let mut overlap = false;
    if reserve && !ctx.prepared.entities.is_empty() {
        ctx.deadline = Some(tokio::time::Instant::now());
        if let Err(e) = lock::step(&mut ctx).await {
            match e.kind.origin() {
                crate::error::Origin::Store => {
                    ctx.state.stats.on_store_error();
                }
                _ => overlap = true,
            }
        }
    }
    ctx.observed = would.or(overlap.then_some("entity_overlap"));
    let owned = reserve && reserve_key(&mut ctx).await;
    if !owned {
        ctx.release_entities().await;
    }
    let called = match owned {
        true => forward::step(&mut ctx).await,
        false => forward::plain(&mut ctx).await,
    };
    let outcome = match owned {
        true => store::stored(&mut ctx, called).await,
        false => outcome_of(&mut ctx, called),
    };
    ctx.finish(outcome)
}

/// The key and the entities as enforce mode would have judged them: what it would have done,
/// and whether it would have reserved the key (then so does observe mode).
async fn look(ctx: &mut Ctx) -> (Option<&'static str>, bool) {
    let store = ctx.state.store.clone();
    let record = match ctx.state.replay.hit(&ctx.prepared.id) {
        Some(hit) if hit.fingerprint == ctx.prepared.fingerprint => return (Some("replay"), false),
        Some(_) => return (Some("key_reused"), false),
        None => store.get(&ctx.prepared.id).await,
    };
    if let Ok(Some(rec)) = &record {
        ctx.state.replay.saw(rec);
    }
    let record = match record {
        Ok(r) => r,
        Err(e) => return store_failed(ctx, e),
    };
    // An answer this process cannot decrypt is a store failure here too: enforce mode would
    // answer `503`; observe mode fails open and forwards (and leaves the record alone).
    if let Some(Err(e)) = record
        .as_ref()
        .filter(|r| r.effective_state(now_ms()) == KeyState::Completed)
        .map(|r| r.answer())
    {
        ctx.state.stats.on_decrypt_failure();
        return store_failed(ctx, e);
    }
    if let Some(w) = record
        .as_ref()
        .and_then(|r| would_for_record(r, &ctx.prepared.fingerprint, ctx.resends_unknown()))
    {
        return (Some(w), false);
    }
    if ctx.route.claim.is_some() || ctx.prepared.version.is_some() {
        let states = match store.entity_states(&ctx.prepared.entities).await {
            Ok(s) => s,
            Err(e) => return store_failed(ctx, e),
        };
        // Enforce mode refuses these before reserving: no record, no effects.
        if ctx.route.claim.is_some() && checks::check_claims(&states, &ctx.prepared).is_err() {
            return (Some("entity_claimed"), false);
        }
        if let Some(v) = ctx.prepared.version {
            if checks::check_versions(&states, v).is_err() {
                return (Some("stale_version"), false);
            }
        }
    }
    (None, true)
}

fn store_failed(ctx: &Ctx, e: crate::store::StoreError) -> (Option<&'static str>, bool) {
    ctx.state.stats.on_store_error();
    tracing::warn!(key = %ctx.prepared.id.key, error = %e, "observe mode: the store failed; forwarding anyway (observe mode fails open)");
    (None, false)
}

/// Reserves the key as enforce mode would; `false` when it was not ours (a concurrent
/// duplicate got there first: then that is what enforce mode would have seen) or the store
/// failed.
async fn reserve_key(ctx: &mut Ctx) -> bool {
    // As enforce mode after step 2: an unknown outcome is taken over when the upstream
    // dedupes by our key (`would_for_record` let it through only then).
    let reservation = ctx.reservation(ctx.resends_unknown());
    match ctx.state.store.reserve(reservation).await {
        Ok(Reserved::Owned(ticket)) => {
            ctx.state.replay.reserved();
            ctx.ticket = Some(ticket);
            true
        }
        Ok(Reserved::Existing(rec)) => {
            ctx.state.replay.saw(&rec);
            let w = would_for_record(&rec, &ctx.prepared.fingerprint, ctx.resends_unknown());
            ctx.observed = ctx.observed.or(w).or(Some("in_flight"));
            false
        }
        Err(e) => {
            store_failed(ctx, e);
            false
        }
    }
}
