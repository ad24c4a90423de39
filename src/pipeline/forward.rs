//! Step 6: the upstream call, run to completion even if the client hung up, renewing the key's
//! lease while it runs. Never retried here: a re-forward is only safe when nothing was sent,
//! and even then it is the client's retry that does it.

use super::Ctx;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::upstream::{call, full, request_headers, Called, ProxyBody, Target, UpstreamClient};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request};
use std::time::Duration;
use tokio::time::Instant;

/// The upstream request of a protected call, built once in step 1: hop-by-hop headers gone,
/// the native idempotency header set, the body shared (`Bytes`), never copied.
#[derive(Default)]
pub(super) struct Outgoing {
    method: http::Method,
    uri: http::Uri,
    pub(super) headers: HeaderMap,
    body: Bytes,
}

impl Outgoing {
    pub(super) fn new(
        client: &UpstreamClient,
        target: &Target<'_>,
        key: &str,
        parts: http::request::Parts,
        body: Bytes,
    ) -> ProxyResult<Outgoing> {
        let mut headers = request_headers(parts.headers);
        if let Some(native) = target.upstream.native_idempotency_header.as_ref() {
            // No key (observe mode forwarding a request enforce mode would refuse): none sent.
            if let Some(v) = HeaderValue::from_str(key).ok().filter(|_| !key.is_empty()) {
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

    /// Writes `stamp` into the JSON body at `field` (step 1 checked the body is JSON).
    fn stamp(&mut self, field: &crate::rules::body::BodyPath, stamp: String) -> ProxyResult<()> {
        let refuse = |why: &str| {
            ProxyError::new(
                ErrorKind::BodyInvalid,
                format!("the route stamps its key into body.{field}, but {why}"),
            )
        };
        let mut body: serde_json::Value =
            serde_json::from_slice(&self.body).map_err(|_| refuse("the body is not JSON"))?;
        if !field.set(&mut body, serde_json::Value::String(stamp)) {
            return Err(refuse("the body has no place for it"));
        }
        let bytes = serde_json::to_vec(&body).map_err(|_| refuse("it could not be written"))?;
        self.headers.remove(http::header::CONTENT_LENGTH);
        self.body = Bytes::from(bytes);
        Ok(())
    }

    /// Whether step 1 got as far as building the request (an absolute URI has a host).
    pub(super) fn built(&self) -> bool {
        self.uri.host().is_some()
    }

    fn request(&self) -> Request<ProxyBody> {
        let mut out = Request::new(full(self.body.clone()));
        *out.method_mut() = self.method.clone();
        *out.uri_mut() = self.uri.clone();
        *out.headers_mut() = self.headers.clone();
        out
    }
}

/// Step 6: the call, timed, counted in flight, the key's lease renewed every third of it; a
/// stamped route's body carries the stamp.
pub(super) async fn step(ctx: &mut Ctx) -> Called {
    if let Some(field) = ctx.route.stamp.as_ref().filter(|_| ctx.prepared.stamped) {
        let stamp = ctx.stamp();
        if let Err(e) = ctx.outgoing.stamp(field, stamp) {
            return Called::NotSent(e.message);
        }
    }
    let called = timed(ctx, true).await;
    // Refused for the API's rate limit, so not processed: once more after the account's next
    // turn (see `pace`).
    // The key's lease is renewed while it waits.
    if super::pace::heard(ctx, &called) && renewing(ctx, super::pace::again(ctx)).await.is_ok() {
        let second = timed(ctx, true).await;
        super::pace::heard(ctx, &second);
        return second;
    }
    called
}

impl Ctx {
    /// This action's stamp: `idem-` and 32 hex digits of a hash of the scoped key and the
    /// action, the same on every replica and every retry of the action, another for the next
    /// action of the key (after its window, or a release) — so a reconcile read by the stamp
    /// finds this action's object and never an earlier one's.
    pub(super) fn stamp(&self) -> String {
        use sha2::{Digest, Sha256};
        let id = &self.prepared.id;
        let mut h = Sha256::new();
        for part in [&id.upstream, &id.scope, &id.key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let action = self.ticket.as_ref().map_or(0, |t| t.action());
        h.update(action.to_be_bytes());
        let mut out = String::from("idem-");
        crate::key::push_hex(&mut out, &h.finalize()[..16]);
        out
    }
}

/// Step 6 without a reservation to renew (observe mode, when the key was not ours).
pub(super) async fn plain(ctx: &mut Ctx) -> Called {
    timed(ctx, false).await
}

async fn timed(ctx: &mut Ctx, renewing: bool) -> Called {
    let started = Instant::now();
    let outcome = {
        let _in_flight = ctx.state.stats.on_forward();
        match renewing {
            true => call_renewing(ctx).await,
            false => call::call(&ctx.client, ctx.outgoing.request(), ctx.upstream.timeout).await,
        }
    };
    ctx.upstream_time = Some(started.elapsed());
    outcome
}

async fn call_renewing(ctx: &Ctx) -> Called {
    let call = call::call(&ctx.client, ctx.outgoing.request(), ctx.upstream.timeout);
    renewing(ctx, call).await
}

/// Runs `work` (the call, a reconcile) while renewing the key's lease every third of it.
pub(super) async fn renewing<F: std::future::Future>(ctx: &Ctx, work: F) -> F::Output {
    let lease = ctx.state.config.store.lease;
    let every = (lease / 3).max(Duration::from_millis(100));
    tokio::pin!(work);
    let mut tick = tokio::time::interval_at(Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tick.tick() => renew(ctx, lease).await,
        }
    }
}

/// Extends the key's lease (the entity leases renew themselves, see `StoreLeases`); failures
/// are logged (the call goes on: it cannot be taken back).
async fn renew(ctx: &Ctx, lease: Duration) {
    let (state, id) = (&ctx.state, &ctx.prepared.id);
    let Some(ticket) = &ctx.ticket else {
        return;
    };
    match state.store.renew(ticket, lease).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::error!(key = %id.key, "lost the key's reservation while the upstream call runs")
        }
        Err(e) => {
            state.stats.on_store_error();
            tracing::warn!(key = %id.key, error = %e, "lease renewal failed");
        }
    }
}
