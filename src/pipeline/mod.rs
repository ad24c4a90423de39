//! The protected-request pipeline: SPEC.md "Request handling" steps 1–7, in order, in one
//! place. Each step is a named function returning a decision or an error; [`run`] strings them
//! together with `?` and [`crate::router::handle`] turns errors into JSON answers. Step 3 lives in
//! [`entities`], steps 6–7 (the detached forward) in [`job`].

mod entities;
mod job;

use entities::lock_entities;
use job::{Job, JobEnd};

use crate::audit::{PendingTrace, Trace};
use crate::checks;
use crate::config::{InFlight, Route, Upstream};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::prepare::{self, Input, KeyPlan, Prepared};
use crate::state::AppState;
use crate::store::{now_ms, KeyRecord, KeyState, Reservation, StoredResponse};
use crate::upstream::Target;
use crate::upstream::{full, request_headers, ProxyBody};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// What a look-up of the key says to do.
enum Decision {
    /// Nothing stands in the way: lock, reserve, forward. `take_unknown` re-forwards an unknown
    /// outcome (only when the upstream dedupes by our key).
    Proceed { take_unknown: bool },
    /// A stored answer for this request.
    Replay(StoredResponse),
    /// Another process owns the key until this time (ms); wait for it.
    WaitForeign(i64),
}

/// Runs a protected request through steps 1–7.
pub async fn run(
    state: &Arc<AppState>,
    route: &Arc<Route>,
    params: Vec<(String, String)>,
    canonical: &str,
    target: &Target<'_>,
    req: Request<Incoming>,
) -> ProxyResult<Response<ProxyBody>> {
    let upstream = target.upstream;
    let plan = match prepare::plan_key(upstream, route, req.headers()) {
        Ok(KeyPlan::Unprotected) => return crate::upstream::passthrough(state, target, req).await,
        other => other,
    };
    state.stats.on_protected();
    let retention = route.retention.unwrap_or(state.config.store.retention);
    // The trace becomes the request's audit row: here, or in the forward job if it gets there.
    let trace = Trace::new(&upstream.name, &route.name, retention);
    let mut trace = PendingTrace::new(trace, &state.auditor);
    let result = match plan {
        Ok(plan) => {
            let matched = (params, canonical);
            traced(state, route, matched, target, req, plan, &mut trace).await
        }
        Err(e) => Err(e),
    };
    if let Some(t) = trace.take() {
        let decision = match &result {
            Ok(_) => "replayed",
            Err(e) => e.kind.as_str(),
        };
        t.record(&state.auditor, decision);
    }
    result
}

/// Step 1, then the rest: buffer the body once; evaluate key, fingerprint, entities, version.
async fn traced(
    state: &Arc<AppState>,
    route: &Arc<Route>,
    (params, canonical): (Vec<(String, String)>, &str),
    target: &Target<'_>,
    req: Request<Incoming>,
    plan: KeyPlan,
    trace: &mut Option<Trace>,
) -> ProxyResult<Response<ProxyBody>> {
    let upstream = target.upstream;
    // Step 1: buffer the body once; evaluate key, fingerprint, entities, version.
    let (parts, body) = req.into_parts();
    let server = &state.config.server;
    let body = tokio::time::timeout(
        server.body_timeout,
        read_body(body, &parts.headers, server.max_body),
    )
    .await
    .map_err(|_| {
        ProxyError::new(
            ErrorKind::BodyTimeout,
            format!(
                "the request body did not arrive within body_timeout ({:?})",
                server.body_timeout
            ),
        )
    })??;
    let input = Input {
        method: &parts.method,
        path: canonical,
        query: target.query,
        headers: &parts.headers,
        body: &body,
        path_params: &params,
    };
    let mut p = prepare::prepare(upstream, route, plan, &input, &state.scoper)?;
    if state.legacy_scopes {
        adopt_legacy_scope(state, upstream, &parts.headers, &mut p).await?;
    }
    if let Some(t) = trace.as_mut() {
        t.key = Some(p.key.clone());
        t.fingerprint = Some(p.fingerprint.clone());
        t.entities = p.entities.clone();
    }
    let key = p.key.clone();
    let result = protected(state, route, target, &p, parts, body, trace).await;
    result.map_err(|e| if e.key.is_none() { e.with_key(&key) } else { e })
}

async fn protected(
    state: &Arc<AppState>,
    route: &Arc<Route>,
    target: &Target<'_>,
    p: &Prepared,
    parts: http::request::Parts,
    body: Bytes,
    trace: &mut Option<Trace>,
) -> ProxyResult<Response<ProxyBody>> {
    let upstream = target.upstream;
    let client = state.client(upstream)?.clone();
    let outgoing = Outgoing::new(&client, target, p, parts, body)?;
    // Step 2, fast path: a completed key replays at once, with no lock — concurrent replays
    // of one key never queue behind each other — and, when cached, with no store read.
    if let Some(hit) = state.cache.get(&p.id) {
        if hit.fingerprint == p.fingerprint {
            return replay(state, &hit.response, &p.key);
        }
        return Err(key_reused());
    }
    let mut record = state
        .store
        .get(&p.id)
        .await
        .map_err(|e| store_error(state, e))?;
    if let Some(rec) = &record {
        if rec.effective_state(now_ms()) == KeyState::Completed {
            state.cache.put_record(rec);
            if let Decision::Replay(stored) = decide(Some(rec), p, upstream, route)? {
                return replay(state, &stored, &p.key);
            }
        }
    }
    // Otherwise one local request per scoped key at a time; the rest queue here.
    let slot_name = format!("{}\n{}\n{}", p.id.upstream, p.id.scope, p.id.key);
    let mut immediate = true;
    let slot = match state.key_locks.lock(&slot_name, None).await {
        Ok(slot) => slot,
        Err(_) if route.in_flight == InFlight::Reject => return Err(in_progress()),
        Err(_) => {
            // Someone else is on it: what we read is stale by the time we get the slot.
            immediate = false;
            let _waiting = state.stats.wait();
            state
                .key_locks
                .lock(&slot_name, Some(route.lock_timeout))
                .await
                .map_err(|_| in_progress())?
        }
    };
    let mut slot = Some(slot);
    // An absent key read just now needs no second look (the reservation settles any race);
    // anything else is read again after subscribing to its changes.
    let mut fresh = immediate && record.is_none();
    let deadline = Instant::now() + route.lock_timeout;
    loop {
        // Subscribed before reading, so a completion in another replica cannot slip between.
        let woken = state.store.subscribe_key(&p.id);
        if !std::mem::take(&mut fresh) {
            record = state
                .store
                .get(&p.id)
                .await
                .map_err(|e| store_error(state, e))?;
        }
        let take_unknown = match decide(record.as_ref(), p, upstream, route)? {
            Decision::Replay(stored) => return replay(state, &stored, &p.key),
            Decision::Proceed { take_unknown } => take_unknown,
            Decision::WaitForeign(until) => {
                wait_foreign(state, woken, until, deadline).await?;
                continue;
            }
        };

        // Step 3: the entity locks, sorted, within lock_timeout: in this process first, then
        // across replicas through the store.
        let waited = Instant::now();
        let locked = lock_entities(state, route, p, deadline).await;
        if let Some(t) = trace.as_mut() {
            t.lock_wait += waited.elapsed();
        }
        let (entity_guards, leases) = locked?;

        // Step 4: claim, version and precheck, inside the locks (ordered persistence).
        checks::run(state.store.as_ref(), route, p, &client, &outgoing.headers)
            .await
            .inspect_err(|e| {
                if e.kind == ErrorKind::StoreUnavailable {
                    state.stats.on_store_error();
                }
            })?;

        // Steps 5–7 run detached from this connection: once the reservation is sent, the
        // forward and the stored outcome follow even if the client hangs up meanwhile, so a
        // reservation is never left behind without its forward.
        let reservation = Reservation {
            id: p.id.clone(),
            fingerprint: p.fingerprint.clone(),
            route: route.name.clone(),
            entities: p.entities.clone(),
            owner: state.owner.clone(),
            lease: state.config.store.lease,
            take_unknown,
        };
        let job = Job {
            state: state.clone(),
            client: client.clone(),
            route: route.clone(),
            id: p.id.clone(),
            fingerprint: p.fingerprint.clone(),
            epoch: 0,
            trace: trace.take(),
            entities: p.entities.clone(),
            version: p.version,
            leases,
            slot: slot.take(),
            entity_guards,
        };
        let ended = state
            .tracker
            .spawn(job.run(reservation, outgoing.request()))
            .await
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::UpstreamTimeout,
                    format!("the upstream call failed: {e}"),
                )
            })?;
        match ended {
            JobEnd::Done(result) => return result,
            // Another replica reserved the key between our look-up and our reservation.
            JobEnd::Taken {
                record,
                slot: s,
                trace: t,
            } => {
                (slot, *trace) = (s, t);
                match decide(Some(&record), p, upstream, route)? {
                    Decision::Replay(stored) => return replay(state, &stored, &p.key),
                    Decision::WaitForeign(until) => {
                        wait_foreign(state, woken, until, deadline).await?
                    }
                    // Our reading and the store disagree (another replica's clock, a race):
                    // try again, but never past the deadline.
                    Decision::Proceed { .. } if Instant::now() >= deadline => {
                        return Err(in_progress())
                    }
                    Decision::Proceed { .. } => {}
                }
            }
        }
    }
}

/// A key stored by the first release has an unkeyed scope. When the keyed scope finds no
/// record, the old scope's record, if there is one, is this request's: an upgrade must never
/// make a stored key look new to its own caller's retry.
async fn adopt_legacy_scope(
    state: &AppState,
    upstream: &Upstream,
    headers: &HeaderMap,
    p: &mut Prepared,
) -> ProxyResult<()> {
    if state.cache.get(&p.id).is_some() {
        return Ok(());
    }
    let found = state.store.get(&p.id).await;
    if found.map_err(|e| store_error(state, e))?.is_some() {
        return Ok(());
    }
    let old = crate::store::ScopedKey {
        scope: crate::key::legacy_scope(headers, &upstream.scope_headers),
        ..p.id.clone()
    };
    let found = state.store.get(&old).await;
    if found.map_err(|e| store_error(state, e))?.is_some() {
        p.id = old;
    }
    Ok(())
}

/// The upstream request of a protected call, built once: hop-by-hop headers gone, the native
/// idempotency header set, the body shared (`Bytes`), never copied.
struct Outgoing {
    method: http::Method,
    uri: http::Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Outgoing {
    fn new(
        client: &crate::upstream::UpstreamClient,
        target: &Target<'_>,
        p: &Prepared,
        parts: http::request::Parts,
        body: Bytes,
    ) -> ProxyResult<Outgoing> {
        let mut headers = request_headers(parts.headers);
        if let Some(native) = &target.upstream.native_idempotency_header {
            if let Ok(v) = HeaderValue::from_str(&p.key) {
                headers.insert(native.clone(), v);
            }
        }
        let uri = client.uri(&target.path_and_query()).map_err(|e| {
            ProxyError::new(
                ErrorKind::BadPath,
                format!("cannot build the upstream URL: {e}"),
            )
        })?;
        Ok(Outgoing {
            method: parts.method,
            uri,
            headers,
            body,
        })
    }

    fn request(&self) -> Request<ProxyBody> {
        let mut out = Request::new(full(self.body.clone()));
        *out.method_mut() = self.method.clone();
        *out.uri_mut() = self.uri.clone();
        *out.headers_mut() = self.headers.clone();
        out
    }
}

/// Step 2's table: what a stored record means for this request.
fn decide(
    record: Option<&KeyRecord>,
    p: &Prepared,
    upstream: &Upstream,
    route: &Route,
) -> ProxyResult<Decision> {
    let Some(rec) = record else {
        return Ok(Decision::Proceed {
            take_unknown: false,
        });
    };
    let state = rec.effective_state(now_ms());
    if state != KeyState::Released && rec.fingerprint != p.fingerprint {
        return Err(key_reused());
    }
    Ok(match state {
        KeyState::Released => Decision::Proceed {
            take_unknown: false,
        },
        KeyState::Completed => match &rec.response {
            Some(resp) => Decision::Replay(resp.clone()),
            None => Decision::Proceed {
                take_unknown: false,
            },
        },
        KeyState::InFlight if route.in_flight == InFlight::Reject => return Err(in_progress()),
        KeyState::InFlight => Decision::WaitForeign(rec.lease_until),
        KeyState::Unknown if upstream.native_idempotency_header.is_some() => {
            Decision::Proceed { take_unknown: true }
        }
        KeyState::Unknown => return Err(ProxyError::new(
            ErrorKind::OutcomeUnknown,
            "an earlier attempt with this key reached the upstream but its outcome is unknown; \
                 check the upstream, then resolve it with `idemproxy keys release KEY`",
        )),
    })
}

/// Waits for another process's in-flight record: until it changes (`woken`), its lease ends,
/// or our deadline passes.
async fn wait_foreign(
    state: &AppState,
    woken: Option<watch::Receiver<u64>>,
    until_ms: i64,
    deadline: Instant,
) -> ProxyResult<()> {
    if Instant::now() >= deadline {
        return Err(in_progress());
    }
    let _waiting = state.stats.wait();
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

fn replay(
    state: &AppState,
    stored: &StoredResponse,
    key: &str,
) -> ProxyResult<Response<ProxyBody>> {
    if stored.body_omitted() {
        return Err(ProxyError::new(
            ErrorKind::AnswerTooLarge,
            format!(
                "the first request with this key was answered {} by the upstream, with a body over \
                 max_answer that was not stored; it is not forwarded again and cannot be replayed",
                stored.status
            ),
        )
        .details(serde_json::json!({ "upstream_status": stored.status })));
    }
    state.stats.on_replay();
    Ok(respond(stored, key, true))
}

/// A stored (or just received) answer, with the idempotency headers.
fn respond(stored: &StoredResponse, key: &str, replayed: bool) -> Response<ProxyBody> {
    let mut resp = Response::new(full(stored.body.clone()));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let h: &mut HeaderMap = resp.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            h.append(n, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(key) {
        h.insert("idempotency-key", v);
    }
    // An upstream that replayed on its own (Stripe, after a re-forward with the same key)
    // said so: that stays true.
    let upstream_replayed = h
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    h.insert(
        "idempotent-replayed",
        HeaderValue::from_static(if replayed || upstream_replayed {
            "true"
        } else {
            "false"
        }),
    );
    resp
}

/// Buffers a request body up to `max` bytes.
async fn read_body(body: Incoming, headers: &HeaderMap, max: usize) -> ProxyResult<Bytes> {
    let too_large = || {
        ProxyError::new(
            ErrorKind::BodyTooLarge,
            format!("the request body is over the {max}-byte limit"),
        )
    };
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            format!("the request body could not be read: {e}"),
        )),
    }
}

fn key_reused() -> ProxyError {
    ProxyError::new(
        ErrorKind::KeyReused,
        "this idempotency key was used for a different request (method, path, query or body differ)",
    )
}

fn in_progress() -> ProxyError {
    ProxyError::new(
        ErrorKind::RequestInProgress,
        "a request with this idempotency key is in progress",
    )
    .retry_after(Duration::from_secs(1))
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

pub(super) fn store_error(state: &AppState, e: crate::store::StoreError) -> ProxyError {
    state.stats.on_store_error();
    tracing::error!(error = %e, "store unavailable; failing closed");
    ProxyError::store(e)
}
