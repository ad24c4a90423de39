//! The protected-request pipeline: SPEC.md "Request handling", seven steps in seven named
//! places, run in order by [`run`]:
//!
//! 1. [`prepare`]: buffer the body; [`evaluate`] key, fingerprint, entities, version.
//! 2. [`lookup`]: the scoped key — replay, refuse, wait for it, or go on.
//! 3. [`lock`]: the entity locks, in this process and across replicas.
//! 4. [`checks`]: claim, version, precheck, inside the locks.
//! 5. [`reserve`]: durably reserve the key; nothing is forwarded before it commits.
//! 6. [`forward`]: the upstream call, detached from the client's connection.
//! 7. [`store`]: the answer stored, the entity effects applied, the locks released.
//!
//! Beside them: [`observe`] (observe mode: forward, and record what enforce mode would do),
//! [`side_read`] (the reads sent on a request's behalf: precheck and reconcile) and
//! [`reconcile`] (asking the real system about an unknown outcome: after step 6 lost its
//! answer, and between steps 5 and 6 when a retry met an unknown key).
//!
//! One request context, [`Ctx`], owns what a request holds as it goes (its key slot, entity
//! guards and leases, its timings), the way pingora's `CTX` does; one typed [`Outcome`] is what
//! its audit row, its metrics and its answer are written from, once, by [`Ctx::finish`].

mod body_read;
pub mod checks;
mod evaluate;
mod forward;
mod lock;
mod lookup;
pub mod observe;
mod outcome;
pub mod pace;
pub mod prepare;
mod readable;
mod reconcile;
mod refusals;
mod request_parts;
mod reserve;
mod side_read;
mod store;

pub use outcome::Outcome;

use crate::config::{Mode, Route, Upstream};
use crate::connection::RequestBody;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::locks::LockGuard;
use crate::state::AppState;
use crate::store::{KeyRecord, Ticket};
use crate::upstream::{ProxyBody, Target, UpstreamClient};
use http::{Request, Response};
use lock::StoreLeases;
use prepare::{KeyPlan, Prepared};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Runs a protected request through steps 1–7.
pub async fn run(
    state: &Arc<AppState>,
    route: &Arc<Route>,
    params: Vec<(String, String)>,
    target: &Target<'_>,
    mut req: Request<RequestBody>,
) -> ProxyResult<Response<ProxyBody>> {
    // What is never forwarded decides nothing: hop-by-hop headers (and those a client names
    // in `Connection`) go before the key, its scope and the entities are read, so two requests
    // the upstream receives alike are one key and one lock.
    crate::upstream::strip_hop_by_hop(req.headers_mut());
    let plan = match prepare::plan_key(target.upstream, route, req.headers()) {
        Ok(KeyPlan::Unprotected) => return pace::passthrough(state, target, req).await,
        plan => plan,
    };
    state.stats.on_protected();
    let mut ctx = Ctx::new(state, route, target)?;
    ctx.caller = crate::pace::caller(req.headers(), req.body().conn());
    let observe = route.mode == Mode::Observe;
    let prepared = match plan {
        Ok(plan) => prepare::step(&mut ctx, plan, params, target, req).await,
        // Observe mode's paths are boxed, as the reconcile is: each holds a whole forward and
        // its stored outcome (~5 KB), and every request's future (boxed, copied in) would
        // otherwise carry room for them.
        Err(e) if observe => return Box::pin(observe::passthrough(ctx, &e, target, req)).await,
        Err(e) => Err(e),
    };
    if observe {
        let refused = match prepared {
            Ok(()) => ctx.build_outgoing(target).err(),
            Err(e) => Some(e),
        };
        return Box::pin(observe::run(ctx, refused)).await;
    }
    if let Err(e) = prepared {
        return ctx.finish(Outcome::Refused(e));
    }
    loop {
        let before_forward = async {
            if let lookup::Found::Replay(stored) = lookup::step(&mut ctx).await? {
                return Ok(Some(stored));
            }
            ctx.build_outgoing(target)?;
            pace::step(&mut ctx).await?;
            lock::step(&mut ctx).await?;
            // A reconcile comes first: a write that did happen makes the checks moot.
            if ctx.reconcile_first.is_none() {
                checks::step(&mut ctx).await?;
            }
            Ok(None)
        };
        match before_forward.await {
            Ok(Some(stored)) => return ctx.finish(outcome::replayed(stored)),
            Err(e) => return ctx.finish(Outcome::Refused(e)),
            Ok(None) => {}
        }
        // Steps 5–7 run detached from this connection: once the reservation is sent, the
        // forward and the stored outcome follow even if the client hangs up meanwhile. The
        // answer may come back before the job ends (before its outcome commits: see `store`).
        let (reply, detached) = tokio::sync::oneshot::channel();
        // Boxed: the task's cell then holds a pointer, not the job's ~5 KB state machine,
        // which spawning and finishing the task would otherwise copy several times over.
        state
            .tracker
            .spawn(Box::pin(reserve_forward_store(ctx, reply)));
        match detached.await {
            Ok(Detached::Finished(answer)) => return answer,
            // Another replica reserved the key between our look-up and our reservation.
            Ok(Detached::Taken(back)) => ctx = *back,
            Err(_) => {
                tracing::error!("the forward job ended without an answer");
                return Err(ProxyError::new(
                    ErrorKind::Internal,
                    "the proxy failed while forwarding; the key's outcome is unknown until its lease runs out",
                ));
            }
        }
    }
}

/// How the detached steps 5–7 ended.
enum Detached {
    /// Answered (or refused); the job records it, perhaps after this answer (see `store`).
    Finished(ProxyResult<Response<ProxyBody>>),
    /// The key belongs to another process: back to step 2 with this context.
    Taken(Box<Ctx>),
}

/// Where the detached job sends how it ended (dropped: the client hung up).
type Reply = tokio::sync::oneshot::Sender<Detached>;

/// Steps 5–7. The answer is stored and the audit row written here, whether or not the client
/// still waits for it.
async fn reserve_forward_store(mut ctx: Ctx, reply: Reply) {
    match reserve::step(&mut ctx).await {
        Ok(true) => {}
        Ok(false) => {
            let _ = reply.send(Detached::Taken(Box::new(ctx)));
            return;
        }
        Err(e) => {
            let _ = reply.send(Detached::Finished(ctx.finish(Outcome::Refused(e))));
            return;
        }
    }
    if let Some(wait) = ctx.reconcile_first {
        // Boxed, as in `store`: a rare path that needs an upstream call's room.
        if let Some(outcome) = Box::pin(reserve::before_retry(&mut ctx, wait)).await {
            let _ = reply.send(Detached::Finished(ctx.finish(outcome)));
            return;
        }
    }
    let called = forward::step(&mut ctx).await;
    crate::fault::point(crate::fault::Point::Answered);
    store::step(ctx, called, reply).await;
}

/// What one protected request holds and knows as it goes through the steps. Dropped before
/// [`Ctx::finish`] (the client hung up while it waited), it still writes its audit row, as
/// `client_closed`; its guards and leases are released on drop.
pub struct Ctx {
    state: Arc<AppState>,
    route: Arc<Route>,
    upstream: Arc<Upstream>,
    client: Arc<UpstreamClient>,
    /// Step 1: key, fingerprint, entities, version (defaults until then).
    prepared: Prepared,
    /// Step 1 evaluated the request (the audit row then names its key and entities).
    evaluated: bool,
    /// Step 1: the request's head and body, until the upstream request is built from them
    /// (see [`Ctx::build_outgoing`]).
    unsent: Option<(http::request::Parts, bytes::Bytes)>,
    /// The upstream request, built once.
    outgoing: forward::Outgoing,
    /// Step 1: the unkeyed scope of this request (as records stored before scopes were keyed carry it), when keys stored before the
    /// upgrade may remain (see `lookup`), and whether the request carries credentials that
    /// scope left out (then an old record may be another caller's).
    legacy_scope: Option<(String, bool)>,
    /// Step 2: one local request per scoped key at a time; held until the answer is stored.
    slot: Option<LockGuard>,
    /// Step 2: when this request stops waiting for keys and locks.
    deadline: Option<Instant>,
    /// Step 5, when another process had reserved the key: its record, for step 2 to decide.
    taken: Option<Box<KeyRecord>>,
    /// Step 2: take over an unknown outcome (the upstream dedupes by our key, or a reconcile).
    take_unknown: bool,
    /// Step 2: the key's outcome is unknown and the route reconciles: ask the real system
    /// (after step 5, and after this wait) before the checks and the forward.
    reconcile_first: Option<Duration>,
    /// Step 3: local entity locks and cross-replica leases.
    entity_guards: Vec<LockGuard>,
    leases: Option<StoreLeases>,
    /// Step 5: the reservation, once the key is ours: what the outcome is stored under (its
    /// fencing epoch), and the action a stamped route's stamp is made from.
    ticket: Option<Ticket>,
    /// The connection the request came on: who it is, to pacing's fair queue.
    caller: u64,
    /// Took its turn in its account's rate-limit budget (see [`pace`]).
    paced: bool,
    started: Instant,
    lock_wait: Duration,
    upstream_time: Option<Duration>,
    upstream_status: Option<u16>,
    /// Observe mode: what enforce mode would have done (`None`: forwarded it too).
    observed: Option<&'static str>,
    finished: bool,
}

impl Ctx {
    fn new(state: &Arc<AppState>, route: &Arc<Route>, target: &Target<'_>) -> ProxyResult<Ctx> {
        Ok(Ctx {
            state: state.clone(),
            route: route.clone(),
            upstream: target.upstream.clone(),
            client: state.client_for(target)?,
            prepared: Prepared::default(),
            evaluated: false,
            unsent: None,
            outgoing: forward::Outgoing::default(),
            legacy_scope: None,
            slot: None,
            deadline: None,
            taken: None,
            take_unknown: false,
            reconcile_first: None,
            entity_guards: Vec::new(),
            leases: None,
            ticket: None,
            caller: 0,
            paced: false,
            started: Instant::now(),
            lock_wait: Duration::ZERO,
            upstream_time: None,
            upstream_status: None,
            observed: None,
            finished: false,
        })
    }

    /// Builds the upstream request from what step 1 kept, once: after the look-up, as a
    /// replay never sends it (building it — the headers filtered and copied, the upstream URL
    /// made and parsed — was a twentieth of a replay's cost).
    fn build_outgoing(&mut self, target: &Target<'_>) -> ProxyResult<()> {
        if let Some((parts, body)) = self.unsent.take() {
            self.outgoing =
                forward::Outgoing::new(&self.client, target, &self.prepared.key, parts, body)?;
        }
        Ok(())
    }

    /// Releases the entity locks and leases (after the answer is stored, or when the key
    /// turned out to be another process's).
    async fn release_entities(&mut self) {
        if let Some(leases) = self.leases.take() {
            leases.release().await;
        }
        self.entity_guards.clear();
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if !self.finished {
            let decision = if std::thread::panicking() {
                "internal_error"
            } else {
                "client_closed"
            };
            self.record(decision);
        }
    }
}
