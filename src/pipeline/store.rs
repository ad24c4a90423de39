//! Step 7: what the forward's ending means (SPEC's outcome table), stored — the answer, the
//! new version and claim of a 2xx — then the locks released.
//!
//! An answer goes to its caller before its completion commits when it is kept where a retry
//! finds it at once (the replay cache, see [`ReplayCache::remember`]): the
//! reservation, committed before the forward, is what stops a second forward, and the key's
//! slot and entity locks are held until the commit, so the next write to the entity, or a
//! retry the cache cannot serve, sees the stored outcome. What a crash between the answer and
//! the commit leaves: the key unknown (never forwarded again). Answers with entity effects (a
//! version, a claim) wait for their commit.

use super::outcome::{finish_of, outcome_of, Answer, Outcome};
use super::reconcile::{self, Verdict};
use super::{Ctx, Detached, Reply};
use crate::error::ProxyError;
use crate::store::replay::{Remembered, ReplayCache};
use crate::store::{AfterCommit, Finish, KeyState, ScopedKey, StoreResult, When};
use crate::upstream::Called;
use std::time::Duration;

/// Step 7, to the end of the request: answers the caller (at once, or once the outcome is
/// stored), stores the outcome, writes the audit row.
pub(super) async fn step(mut ctx: Ctx, called: Called, reply: Reply) {
    let (outcome, finish) = decide(&mut ctx, called).await;
    let Some(remembered) = answer_first(&ctx, &outcome, &finish) else {
        record(&mut ctx, finish, None).await;
        let _ = reply.send(Detached::Finished(ctx.finish(outcome)));
        return;
    };
    // The audit row goes with the answer (rows keep the order callers saw answers in; a
    // store that then fails to commit is logged and counted, as when it fails before).
    let decision = ctx.decision(&outcome);
    let answer = ctx.answer(outcome);
    ctx.conclude(&decision);
    let _ = reply.send(Detached::Finished(answer));
    match ctx.entity_guards.is_empty() && ctx.leases.is_none() {
        true => record_later(&mut ctx, finish, remembered).await,
        false => record(&mut ctx, finish, Some(remembered)).await,
    }
}

/// Step 7 in observe mode (which answers after it): the outcome, stored.
pub(super) async fn stored(ctx: &mut Ctx, called: Called) -> Outcome {
    let (outcome, finish) = decide(ctx, called).await;
    // Once: observe mode never holds an answer back for a failing store (it fails open).
    let stored = finish_within(ctx, finish, None, Duration::ZERO).await;
    heard(&ctx.state.stats, &ctx.prepared.id, stored);
    ctx.release_entities().await;
    ctx.slot = None;
    outcome
}

/// The outcome, and what the key's record becomes.
async fn decide(ctx: &mut Ctx, called: Called) -> (Outcome, Finish) {
    match outcome_of(ctx, called) {
        // The write may have happened: ask the real system, still holding the locks.
        // Boxed: the reconcile's read is a whole upstream call, and every first write would
        // otherwise carry room for it in its task (and copy that room when the task is spawned
        // and when it ends).
        Outcome::Unknown(e) if reconcile::applies(ctx) => Box::pin(after_unknown(ctx, e)).await,
        outcome => {
            let finish = finish_of(ctx, &outcome);
            (outcome, finish)
        }
    }
}

/// Right after a forward lost its answer: what the request gets and what the key becomes.
async fn after_unknown(ctx: &mut Ctx, lost: ProxyError) -> (Outcome, Finish) {
    let after = ctx
        .route
        .reconcile
        .as_ref()
        .map_or(Duration::ZERO, |rc| rc.after);
    match reconcile::ask(ctx, after).await {
        Verdict::Found(stored) => {
            let outcome = Outcome::Reconciled(stored);
            let finish = finish_of(ctx, &outcome);
            (outcome, finish)
        }
        Verdict::NotFound => {
            let e = lost.also(
                "the reconcile read says the write did not happen: a retry is forwarded again",
            );
            (Outcome::Unknown(e), Finish::Released)
        }
        Verdict::Failed(why) => {
            let e = lost.also(&format!(
                "the reconcile read could not tell ({why}): the outcome stays unknown"
            ));
            (Outcome::Unknown(e), Finish::Unknown)
        }
    }
}

/// Whether the caller may be answered before the outcome commits — a full answer, stored, with
/// no entity effects, that the replay cache keeps where a retry finds it (and
/// `store.answer_before_commit` is not off) — and the cache's word that it does.
fn answer_first(ctx: &Ctx, outcome: &Outcome, finish: &Finish) -> Option<Remembered> {
    let full = ctx.state.config.store.answer_before_commit
        && matches!(
            outcome,
            Outcome::Answered {
                answer: Answer::Full(_),
                released: false
            }
        );
    match finish {
        // An answer that records a version or a claim waits for its commit: a crash must not
        // leave a caller told "done" while the entity's fence or claim is unrecorded.
        Finish::Completed {
            response,
            expires_at,
            effects,
        } if full && effects.is_empty() => {
            let ticket = ctx.ticket.as_ref()?;
            ctx.state.replay.remember(ticket, response, *expires_at)
        }
        _ => None,
    }
}

/// Stores what became of the key (fenced by our epoch), then lets go of the entity locks and
/// the key's slot. `remembered`: its caller was answered already, from the replay cache.
pub(super) async fn record(ctx: &mut Ctx, finish: Finish, remembered: Option<Remembered>) {
    let budget = STORE_RETRY_FOR.min(ctx.state.config.store.lease);
    let stored = finish_within(ctx, finish, remembered, budget).await;
    heard(&ctx.state.stats, &ctx.prepared.id, stored);
    ctx.release_entities().await;
    ctx.slot = None;
}

/// How long a completion the store failed to commit is tried again. A database failing over
/// (a PostgreSQL standby promoted behind the same address: 0.1–0.3 s in `tests/failover.rs`)
/// takes it then, and the answer its caller is about to get is stored first, so a retry
/// replays it instead of reading `409 outcome_unknown`. Never the write: only its outcome.
const STORE_RETRY_FOR: Duration = Duration::from_secs(5);

/// [`crate::store::Keys::finish`], tried again while the store fails, for up to `budget`
/// ([`record`]: [`STORE_RETRY_FOR`] or the lease, if shorter, since past it the key may be
/// another's; observe mode: no second try). A try that failed may have committed all the same
/// (its acknowledgement lost with the connection): when the next finds the record no longer
/// ours, the record says whether it holds this outcome at our epoch.
async fn finish_within(
    ctx: &Ctx,
    finish: Finish,
    remembered: Option<Remembered>,
    budget: Duration,
) -> StoreResult<bool> {
    let Some(ticket) = &ctx.ticket else {
        return Ok(false);
    };
    let stored = finish_tried(ctx, ticket, &finish, remembered, budget).await;
    ctx.state
        .replay
        .finished(ticket, &finish, remembered, &stored);
    stored
}

/// [`finish_within`]'s tries.
async fn finish_tried(
    ctx: &Ctx,
    ticket: &crate::store::Ticket,
    finish: &Finish,
    remembered: Option<Remembered>,
    budget: Duration,
) -> StoreResult<bool> {
    let (store, id, epoch) = (&ctx.state.store, ticket.id(), ticket.epoch());
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(25);
    let mut failed = false;
    loop {
        let when = match remembered {
            Some(r) => When::Answered(r),
            None => When::Durable,
        };
        match store.finish(ticket, finish.clone(), when).await {
            Ok(false) if failed => {
                let want = match finish {
                    Finish::Completed { .. } => KeyState::Completed,
                    Finish::Released => KeyState::Released,
                    Finish::Unknown => KeyState::Unknown,
                };
                let record = store.get(id).await?;
                return Ok(record.is_some_and(|r| r.epoch == epoch && r.state == want));
            }
            Ok(owned) => return Ok(owned),
            Err(e) if started.elapsed() + pause > budget => return Err(e),
            Err(e) => {
                failed = true;
                tracing::warn!(key = %id.key, error = %e, "could not store the upstream's answer yet; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// [`record`] of an answer already given, when nothing but the key's slot is held: the store
/// takes the outcome without this task waiting for it, and the slot is let go once it is
/// stored, wherever the store hears of that (SQLite: the writer's thread, see
/// `store::sqlite::engine::deferred`).
async fn record_later(ctx: &mut Ctx, finish: Finish, remembered: Remembered) {
    let Some(ticket) = ctx.ticket.clone() else {
        return;
    };
    let (stats, replay, slot): (_, std::sync::Arc<ReplayCache>, _) = (
        ctx.state.stats.clone(),
        ctx.state.replay.clone(),
        ctx.slot.take(),
    );
    let (theirs, outcome) = (ticket.clone(), finish.clone());
    let then = AfterCommit::new(move |stored| {
        replay.finished(&theirs, &outcome, Some(remembered), &stored);
        heard(&stats, theirs.id(), stored);
        drop(slot);
    });
    let store = &ctx.state.store;
    let _handed = store.finish(&ticket, finish, When::Later(then)).await;
}

/// What a stored outcome's write came to, logged and counted.
fn heard(stats: &crate::metrics::Stats, id: &ScopedKey, stored: StoreResult<bool>) {
    match stored {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(key = %id.key, "our reservation was taken over; the answer was not stored")
        }
        Err(e) => {
            stats.on_store_error();
            tracing::error!(key = %id.key, error = %e, "could not store the upstream's answer; the key will read as unknown");
        }
    }
}
