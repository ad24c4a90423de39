//! Requests that are not protected — safe methods, read-only routes, `unmatched =
//! "passthrough"`, optional keys left out — stream through: unbuffered, unlocked, unrecorded.

use super::call::describe;
use super::client::{request_headers, strip_hop_by_hop, ProxyBody, UpstreamClient};
use crate::config::Upstream;
use crate::connection::RequestBody;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use http::{Request, Response};
use http_body_util::BodyExt;
use std::sync::Arc;

/// The upstream-side target of a request.
pub struct Target<'a> {
    pub upstream: &'a Arc<Upstream>,
    /// Upstream-relative path (no query).
    pub path: &'a str,
    pub query: Option<&'a str>,
    /// The host an egress request was intercepted for (`None` on the other listeners): an
    /// upstream whose URL is `https://{host}` is sent there, and a wildcard upstream's keys
    /// and entities are scoped by it.
    pub host: Option<&'a str>,
}

impl Target<'_> {
    pub fn path_and_query(&self) -> String {
        match self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.to_owned(),
        }
    }
}

/// Streams a request through `client` (the target's upstream's), unlocked and unrecorded.
pub async fn passthrough(
    client: &UpstreamClient,
    target: &Target<'_>,
    req: Request<RequestBody>,
) -> ProxyResult<Response<ProxyBody>> {
    let (parts, body) = req.into_parts();
    let uri = client.uri(&target.path_and_query()).map_err(|e| {
        ProxyError::new(
            ErrorKind::BadPath,
            format!("cannot build the upstream URL: {e}"),
        )
    })?;
    let mut out = Request::new(body.map_err(Into::into).boxed());
    *out.method_mut() = parts.method;
    *out.uri_mut() = uri;
    *out.headers_mut() = request_headers(parts.headers);
    let timeout = target.upstream.timeout;
    let resp = match tokio::time::timeout(timeout, client.send(out)).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) if e.is_connect() => {
            return Err(ProxyError::new(
                ErrorKind::UpstreamUnreachable,
                describe(&e),
            ))
        }
        Ok(Err(e)) => return Err(ProxyError::new(ErrorKind::UpstreamTimeout, describe(&e))),
        Err(_) => {
            return Err(ProxyError::new(
                ErrorKind::UpstreamTimeout,
                format!("no answer within {timeout:?}"),
            ))
        }
    };
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(
        parts,
        body.map_err(Into::into).boxed(),
    ))
}
