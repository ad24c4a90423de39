//! Pacing in the pipeline (see [`crate::pace`]). A protected request takes its turn in its
//! account's budget between step 2 and step 3: holding its key's slot (so its own retries
//! queue behind it, not beside it) and no entity lock, so writes to the entity by requests
//! whose turn came are not held up by one still waiting. A replay never takes a turn. Every
//! answer's rate-limit news goes back to the budget.
//!
//! A `429` the API gives anyway (another client on the same account spent the limit) is not a
//! write the API applied: HubSpot, Zendesk and Stripe each document that a request refused for
//! its rate limit is not processed. So the write waits for the account's next turn (the
//! `429`'s `Retry-After` pauses the account first) and is sent once more, under the same key —
//! not a retry of a write that may have happened, which the proxy never makes. It waits
//! holding its reservation and entity locks: the write is under way, and letting another
//! write to the entity go first would reorder the writes its callers sent in order. A second
//! `429` goes to the caller, as any answer does.

use super::Ctx;
use crate::error::ProxyResult;
use crate::state::AppState;
use crate::upstream::{Called, ProxyBody, Target};
use http::{Request, Response};

/// This request's turn, once (a request sent back to step 2 by another replica's
/// reservation keeps the turn it had).
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<()> {
    if ctx.upstream.pace.is_none() || ctx.paced {
        return Ok(());
    }
    let scope = &ctx.prepared.id.scope;
    ctx.state
        .pacer
        .turn(&ctx.upstream, scope, ctx.caller)
        .await?;
    ctx.paced = true;
    Ok(())
}

/// The answer's rate-limit news to the budget; `true` when the API refused it for its limit
/// (a `429`) and the upstream is paced, so it may be sent once more after its turn.
pub(super) fn heard(ctx: &Ctx, called: &Called) -> bool {
    let head = match called {
        Called::Answer(a) => a,
        Called::Oversize { head, .. } => head,
        _ => return false,
    };
    let find = |name: &str| {
        head.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| &v[..])
    };
    let scope = &ctx.prepared.id.scope;
    let limited = ctx
        .state
        .pacer
        .heard(&ctx.upstream, scope, head.status, &find);
    limited && ctx.upstream.pace.is_some()
}

/// After a `429`: the account's next turn; `Err` when it would come past `max_wait` (the
/// `429` then goes to the caller).
pub(super) async fn again(ctx: &Ctx) -> ProxyResult<()> {
    let scope = &ctx.prepared.id.scope;
    ctx.state.pacer.turn(&ctx.upstream, scope, ctx.caller).await
}

/// A request that is not protected (a read, an unmatched write streamed through): its turn,
/// then the call, then its answer's news to the budget. Streamed, its body cannot be sent
/// twice: a `429` goes to the caller (and pauses the account).
pub async fn passthrough(
    state: &AppState,
    target: &Target<'_>,
    mut req: Request<crate::connection::RequestBody>,
) -> ProxyResult<Response<ProxyBody>> {
    let upstream = target.upstream;
    let client = state.client_for(target)?;
    if upstream.pace.is_none() {
        return crate::upstream::passthrough(&client, target, req).await;
    }
    // The account is what the API sees: a credential the client names in `Connection` is
    // never forwarded, so it must not pick another budget.
    crate::upstream::strip_hop_by_hop(req.headers_mut());
    let host = super::readable::wildcard_host(upstream, target.host);
    let scope = state
        .scoper
        .scope_at(req.headers(), &upstream.credentials, host);
    let caller = crate::pace::caller(req.headers(), req.body().conn());
    state.pacer.turn(upstream, &scope, caller).await?;
    let resp = crate::upstream::passthrough(&client, target, req).await?;
    let headers = resp.headers();
    let find = |name: &str| headers.get(name).map(|v| v.as_bytes());
    state
        .pacer
        .heard(upstream, &scope, resp.status().as_u16(), &find);
    Ok(resp)
}
