//! Step 2: the scoped key. A completed key replays (from the replay cache when it can, with no
//! lock); another fingerprint is `422 key_reused`; a key in flight is waited for (or refused);
//! an unknown outcome is `409 outcome_unknown` unless the upstream dedupes by our key (then it
//! is taken over and re-forwarded) or the route reconciles it (then it is taken over and the
//! real system asked first, see `reconcile`).

use super::refusals::{in_progress, outcome_unknown};
use super::Ctx;
use crate::config::InFlight;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::store::{now_ms, KeyRecord, KeyState, ScopedKey, StoredResponse};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What the look-up found.
pub(super) enum Found {
    /// A stored answer for this request.
    Replay(Arc<StoredResponse>),
    /// Nothing stands in the way: lock, check, reserve, forward.
    Proceed,
}

/// What a stored record means for this request.
enum Decision {
    /// `take_unknown`: take over an unknown outcome, to re-forward it (only when the upstream
    /// dedupes by our key) or, with `reconcile`, to ask the real system first (after this wait).
    Proceed {
        take_unknown: bool,
        reconcile: Option<Duration>,
    },
    Replay(Arc<StoredResponse>),
    /// Another request owns the key (at this epoch) until this time (ms); wait for it.
    WaitForeign {
        until: i64,
        epoch: i64,
    },
}

/// Step 2. The first time, it also takes the key's local slot (one request per scoped key in
/// this process; the rest queue behind it); after a reservation lost to another process, it
/// decides on that process's record.
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<Found> {
    let mut fresh = None;
    if ctx.slot.is_none() {
        // A completed key replays at once, with no lock — concurrent replays of one key never
        // queue behind each other — and, when cached, with no store read.
        if let Some(hit) = ctx.state.replay.hit(&ctx.prepared.id) {
            if hit.fingerprint == ctx.prepared.fingerprint {
                return Ok(Found::Replay(hit.response.clone()));
            }
            return Err(key_reused());
        }
        let looks_up =
            reservation_looks_up(ctx) && !ctx.state.replay.likely_replay(&ctx.prepared.id);
        let mut record = match looks_up {
            true => None,
            false => get(ctx, &ctx.prepared.id).await?,
        };
        if record.is_none() && ctx.legacy_scope.is_some() {
            record = adopt_legacy_scope(ctx).await?;
        }
        if let Some(rec) = record
            .as_ref()
            .filter(|r| r.effective_state(now_ms()) == KeyState::Completed)
        {
            if let Decision::Replay(stored) = decide(ctx, Some(rec))? {
                return Ok(Found::Replay(stored));
            }
        }
        let immediate = take_slot(ctx).await?;
        ctx.deadline = Some(Instant::now() + ctx.route.lock_timeout);
        // An absent key read just now needs no second look (the reservation settles any
        // race); anything else is read again after subscribing to its changes.
        if immediate && record.is_none() {
            fresh = Some(None);
        }
    }
    let deadline = ctx.deadline.unwrap_or_else(Instant::now);
    loop {
        if let Some(record) = ctx.taken.take() {
            match decide(ctx, Some(&record))? {
                Decision::Replay(stored) => return Ok(Found::Replay(stored)),
                Decision::WaitForeign { until, epoch } => {
                    wait_foreign(ctx, until, epoch, deadline).await?
                }
                // Our reading and the store disagree (another replica's clock, a race): try
                // again, but never past the deadline.
                Decision::Proceed { .. } if Instant::now() >= deadline => return Err(in_progress()),
                Decision::Proceed { .. } => {}
            }
        }
        let record = match fresh.take() {
            Some(record) => record,
            None => get(ctx, &ctx.prepared.id).await?,
        };
        match decide(ctx, record.as_ref())? {
            Decision::Replay(stored) => return Ok(Found::Replay(stored)),
            Decision::Proceed {
                take_unknown,
                reconcile,
            } => {
                ctx.take_unknown = take_unknown;
                ctx.reconcile_first = reconcile;
                return Ok(Found::Proceed);
            }
            Decision::WaitForeign { until, epoch } => {
                wait_foreign(ctx, until, epoch, deadline).await?
            }
        }
    }
}

/// When nothing stands between the look-up and the reservation (no entity to lock, no check
/// or pre-check to run), the reservation is the look-up: a store finds a record at
/// reservation as cheaply as by reading it (see [`crate::store::Keys::reserve`]), and a record
/// it finds comes back to this step (as `ctx.taken`) and is decided on as if read here. One
/// store trip fewer for every first write.
///
/// Not for a request that most likely replays (`ReplayCache::likely_replay`: the cache held
/// its key's answer until lately, or most look-ups that missed the cache lately were of
/// completed keys): a read takes it from the store's readers, while a reservation queues on
/// SQLite's one writer behind whatever it is committing (an audit batch of hundreds of rows:
/// 10–17 ms, which was the p99 of replays spread over more keys than the cache holds).
///
/// Not on `in_flight = "reject"` routes: there, concurrent retries of a completed key the cache
/// does not hold would find its slot taken before anything read the key, and be refused
/// instead of replayed.
fn reservation_looks_up(ctx: &Ctx) -> bool {
    ctx.prepared.entities.is_empty()
        && ctx.route.precheck.is_none()
        && ctx.route.in_flight != InFlight::Reject
        && ctx.legacy_scope.is_none()
}

/// Reads a record; a completed one goes to the replay cache.
async fn get(ctx: &Ctx, id: &ScopedKey) -> ProxyResult<Option<KeyRecord>> {
    let record = ctx.state.store.get(id).await.map_err(ProxyError::store)?;
    if let Some(rec) = &record {
        ctx.state.replay.saw(rec);
    }
    Ok(record)
}

/// The key's local slot: `true` when it was free at once.
async fn take_slot(ctx: &mut Ctx) -> ProxyResult<bool> {
    let id = &ctx.prepared.id;
    let name = id.joined("");
    let locks = &ctx.state.key_locks;
    let (slot, immediate) = match locks.lock(&name, None).await {
        Ok(slot) => (slot, true),
        Err(_) if ctx.route.in_flight == InFlight::Reject => return Err(in_progress()),
        Err(_) => {
            let _waiting = ctx.state.stats.wait();
            let slot = locks.lock(&name, Some(ctx.route.lock_timeout)).await;
            (slot.map_err(|_| in_progress())?, false)
        }
    };
    ctx.slot = Some(slot);
    Ok(immediate)
}

/// SPEC step 2's table.
fn decide(ctx: &Ctx, record: Option<&KeyRecord>) -> ProxyResult<Decision> {
    let Some(rec) = record else {
        return Ok(Decision::Proceed {
            take_unknown: false,
            reconcile: None,
        });
    };
    let state = rec.effective_state(now_ms());
    if state != KeyState::Released && rec.fingerprint != ctx.prepared.fingerprint {
        return Err(key_reused());
    }
    let native = ctx.resends_unknown();
    let reconcile = match state {
        KeyState::Unknown if !native => super::reconcile::on_retry(ctx, rec)?,
        _ => None,
    };
    Ok(match state {
        KeyState::Released => Decision::Proceed {
            take_unknown: false,
            reconcile: None,
        },
        // An answer that cannot be decrypted is a store failure (`503`), never "no answer":
        // the write happened, so it must not be forwarded again.
        KeyState::Completed => match rec.answer().map_err(|e| sealed(ctx, e))? {
            Some(resp) => Decision::Replay(Arc::new(resp.clone())),
            None => Decision::Proceed {
                take_unknown: false,
                reconcile: None,
            },
        },
        KeyState::InFlight if ctx.route.in_flight == InFlight::Reject => return Err(in_progress()),
        KeyState::InFlight => Decision::WaitForeign {
            until: rec.lease_until,
            epoch: rec.epoch,
        },
        KeyState::Unknown if native || reconcile.is_some() => Decision::Proceed {
            take_unknown: true,
            reconcile,
        },
        KeyState::Unknown => return Err(outcome_unknown(None)),
    })
}

/// Waits for another request's in-flight record: until it changes, its lease ends, or our
/// deadline passes. The store is first asked to tell us of the change (see
/// [`crate::store::Shared::watch_key`]); when it has changed already, there is nothing to wait
/// for: the caller reads it again.
async fn wait_foreign(
    ctx: &mut Ctx,
    until_ms: i64,
    epoch: i64,
    deadline: Instant,
) -> ProxyResult<()> {
    if Instant::now() >= deadline {
        return Err(in_progress());
    }
    // Subscribed before the watch, which reads the record again: a completion in another
    // replica either sees the watch (and notifies us, subscribed by then) or came first (and
    // the watch finds the key settled). Not before every read: most requests never wait. A
    // store no other process shares has no one else to hear from: the key's owner is in this
    // process, and the slot it holds is what this request waited on.
    let mut woken = None;
    if let Some(shared) = &ctx.state.shared {
        woken = Some(shared.subscribe_key(&ctx.prepared.id));
        let id = &ctx.prepared.id;
        if !shared
            .watch_key(id, epoch)
            .await
            .map_err(ProxyError::store)?
        {
            return Ok(());
        }
    }
    let _waiting = ctx.state.stats.wait();
    let lease_left = Duration::from_millis(until_ms.saturating_sub(now_ms()).max(0) as u64 + 1);
    let wake = (Instant::now() + lease_left).min(deadline);
    match woken {
        Some(mut rx) => {
            tokio::select! {
                _ = rx.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
        None => tokio::time::sleep_until(wake).await,
    }
    Ok(())
}

/// A key stored before scopes were keyed has an unkeyed scope. Called when the keyed scope found
/// nothing: the old scope's record, if there is one, is this request's (an upgrade must never
/// make a stored key look new to its own caller's retry).
async fn adopt_legacy_scope(ctx: &mut Ctx) -> ProxyResult<Option<KeyRecord>> {
    let Some((scope, uncovered)) = ctx.legacy_scope.clone() else {
        return Ok(None);
    };
    let old = ctx.prepared.id.with_scope(scope);
    let Some(record) = get(ctx, &old).await? else {
        return Ok(None);
    };
    if uncovered {
        // It may be this caller's (then forwarding would repeat the write) or another session's
        // (then replaying would hand over its answer): neither, until an operator says.
        return Err(ProxyError::new(
            ErrorKind::OutcomeUnknown,
            "this key was stored before the upgrade under a scope that did not include this \
             request's cookie or API key, so whether it is this caller's cannot be told; if it \
             is not, release it with `idemproxy keys release KEY`",
        ));
    }
    ctx.prepared.id = old;
    Ok(Some(record))
}

/// A stored answer this process cannot decrypt: counted, logged with why (which key, which
/// value), and refused as a store failure. The caller is told only that it cannot be read: key
/// ids and settings are the operator's business.
fn sealed(ctx: &Ctx, e: crate::store::StoreError) -> ProxyError {
    ctx.state.stats.on_decrypt_failure();
    tracing::error!(key = %ctx.prepared.id.key, upstream = %ctx.prepared.id.upstream, error = %e, "a stored answer cannot be decrypted: refused (503), not forwarded");
    ProxyError::store("a stored answer for this key cannot be decrypted")
}

fn key_reused() -> ProxyError {
    ProxyError::new(
        ErrorKind::KeyReused,
        "this idempotency key was used for a different request (method, path, query or body differ)",
    )
}
