//! Step 7: what the forward's ending means (SPEC's outcome table), stored — the answer, the
//! new version and claim of a 2xx — then the locks released.

use super::outcome::{Answer, Outcome};
use super::Ctx;
use crate::error::{ErrorKind, ProxyError};
use crate::store::{after_ms, Effects, Finish, StoredResponse, OMITTED_BODY};
use crate::upstream::Outcome as Called;
use std::sync::Arc;

/// Step 7.
pub(super) async fn step(ctx: &mut Ctx, called: Called) -> Outcome {
    let (finish, outcome) = settle(ctx, called);
    let (state, id) = (&ctx.state, &ctx.p.id);
    match state.store.finish(id, ctx.epoch, finish).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(key = %id.key, "our reservation was taken over; the answer was not stored")
        }
        Err(e) => {
            state.stats.on_store_error();
            tracing::error!(key = %id.key, error = %e, "could not store the upstream's answer; the key will read as unknown");
        }
    }
    ctx.release_entities().await;
    ctx.slot = None;
    outcome
}

/// What the forward's ending means: what to store, and the request's outcome.
pub(super) fn settle(ctx: &mut Ctx, called: Called) -> (Finish, Outcome) {
    let up = ctx.upstream.clone();
    match called {
        Called::Answer(resp) if up.release_statuses.contains(&resp.status) => {
            ctx.upstream_status = Some(resp.status);
            let answer = Answer::Full(Arc::new(resp));
            let outcome = Outcome::Answered {
                answer,
                released: true,
            };
            (Finish::Released, outcome)
        }
        Called::Answer(resp) => {
            ctx.upstream_status = Some(resp.status);
            let resp = Arc::new(resp);
            let stored = resp.for_storage(up.store_set_cookie);
            let expires_at = after_ms(ctx.route.retention);
            let finish = Finish::Completed {
                response: stored.clone(),
                expires_at,
                effects: effects(ctx, resp.status),
            };
            let outcome = Outcome::Answered {
                answer: Answer::Full(resp),
                released: false,
            };
            (finish, outcome)
        }
        Called::Oversize { head, body } if up.release_statuses.contains(&head.status) => {
            ctx.upstream_status = Some(head.status);
            let answer = Answer::Streamed(Arc::new(head), body);
            (
                Finish::Released,
                Outcome::Answered {
                    answer,
                    released: true,
                },
            )
        }
        Called::Oversize { head, body } => {
            // The write happened and its status is known: the key is completed, but only its
            // head is stored, marked, so retries get `answer_too_large`, never a second forward.
            ctx.upstream_status = Some(head.status);
            let head = Arc::new(head);
            let mut stored: StoredResponse = (*head.for_storage(up.store_set_cookie)).clone();
            stored
                .headers
                .push((OMITTED_BODY.into(), bytes::Bytes::from_static(b"1")));
            tracing::warn!(key = %ctx.p.id.key, status = head.status, max_answer = up.max_answer, "the answer is over max_answer: streamed to its caller, not stored");
            let finish = Finish::Completed {
                response: Arc::new(stored),
                expires_at: after_ms(ctx.route.retention),
                effects: effects(ctx, head.status),
            };
            let answer = Answer::Streamed(head, body);
            (
                finish,
                Outcome::Answered {
                    answer,
                    released: false,
                },
            )
        }
        Called::NotSent(why) => {
            let e = ProxyError::new(
                ErrorKind::UpstreamUnreachable,
                format!("upstream {} unreachable: {why}", up.name),
            );
            (Finish::Released, Outcome::NotSent(e))
        }
        Called::Unknown(why) => {
            let e = ProxyError::new(
                ErrorKind::UpstreamTimeout,
                format!("upstream {}: {why}", up.name),
            );
            (Finish::Unknown, Outcome::Unknown(e))
        }
    }
}

/// What a successful answer does to the entities: record the version, take or release the
/// claim. Nothing for other statuses.
fn effects(ctx: &Ctx, status: u16) -> Effects {
    if !(200..300).contains(&status) {
        return Effects::default();
    }
    let route = &ctx.route;
    Effects {
        entities: ctx.p.entities.clone(),
        version: ctx.p.version,
        claim_until: route.claim.map(after_ms),
        release_claim: route.release_claim,
        leases: ctx
            .leases
            .as_ref()
            .map(|l| l.held.clone())
            .unwrap_or_default(),
        owner: ctx.state.owner.clone(),
    }
}
