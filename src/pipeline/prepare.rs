//! Step 1: buffer the body once (within `max_body` and `body_timeout`), then evaluate key,
//! fingerprint, entities and version ([`super::evaluate`]).

pub use super::evaluate::{plan_key, prepare, Input, Prepared};
use super::forward::Outgoing;
pub use super::request_parts::{KeyPlan, KeySource, ReconcileRead};
use super::Ctx;
use crate::connection::RequestBody;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::key;
use crate::upstream::Target;
use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use std::task::Poll;

/// Step 1: the body, buffered once; then the evaluation. The request is kept for the upstream
/// request, built once something is to be sent.
pub(super) async fn step(
    ctx: &mut Ctx,
    plan: KeyPlan,
    params: Vec<(String, String)>,
    target: &Target<'_>,
    req: Request<RequestBody>,
) -> ProxyResult<()> {
    let (parts, body) = req.into_parts();
    let server = &ctx.state.config.server;
    let read = read_body(body, &parts.headers, server.max_body);
    let body = timed(read, server.body_timeout).await.map_err(|_| {
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
        path: target.path,
        query: target.query,
        headers: &parts.headers,
        body: &body,
        path_params: &params,
        host: target.host,
    };
    // Read first: a request refused here is an audit row too, and says who sent it.
    let workflow = workflow(server.workflow_header.as_ref(), &parts.headers);
    let prepared = prepare(&ctx.upstream, &ctx.route, plan, &input, &ctx.state.scoper);
    if let Err(e) = prepared {
        ctx.prepared.workflow = workflow;
        // Observe mode forwards what enforce mode would refuse: keep the request to send (if
        // it cannot even be built, the refusal stands).
        if ctx.route.mode == crate::config::Mode::Observe {
            if let Ok(out) = Outgoing::new(&ctx.client, target, "", parts, body) {
                ctx.outgoing = out;
            }
        }
        return Err(e);
    }
    ctx.prepared = prepared?;
    ctx.prepared.workflow = workflow;
    ctx.evaluated = true;
    // Unkeyed scopes (records stored before scopes were keyed) hashed `Authorization` and `scope_headers` only: a request that
    // also carries another credential header (a cookie, an API key) shares that old scope with
    // callers it may not be.
    if ctx.state.legacy_scopes {
        let extra = &ctx.upstream.scope_headers;
        let uncovered = ctx
            .upstream
            .credentials
            .iter()
            .filter(|n| *n != http::header::AUTHORIZATION && !extra.contains(n))
            .any(|n| parts.headers.contains_key(n));
        ctx.legacy_scope = Some((key::legacy_scope(&parts.headers, extra), uncovered));
    }
    // The upstream request is built after the look-up (`Ctx::build_outgoing`): a replay,
    // most of a busy proxy's protected requests, never needs it.
    ctx.unsent = Some((parts, body));
    Ok(())
}

/// `read`, timed out after `limit` — but a body that came with its head (most do) is read at
/// the first poll, and then no timer is set: only a body still arriving is timed.
async fn timed<F: std::future::Future>(
    read: F,
    limit: std::time::Duration,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut read = std::pin::pin!(read);
    let first = std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(out) => Ok(out),
        Poll::Pending => tokio::time::timeout(limit, read).await,
    }
}

/// The workflow id a request carries, cut to [`WORKFLOW_MAX`] characters.
fn workflow(header: Option<&http::HeaderName>, headers: &HeaderMap) -> Option<String> {
    // For the audit trail only (a key reads it through its template): shown even when not
    // text.
    let value = String::from_utf8_lossy(headers.get(header?)?.as_bytes());
    Some(value.chars().take(WORKFLOW_MAX).collect())
}

/// Most characters of a workflow id kept in an audit row.
const WORKFLOW_MAX: usize = 128;

/// Buffers a request body up to `max` bytes.
async fn read_body(body: RequestBody, headers: &HeaderMap, max: usize) -> ProxyResult<Bytes> {
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
