//! The egress listener: an HTTP forward proxy for clients whose API host is fixed (n8n's
//! built-in nodes, Activepieces' pieces, hand-written tools) and that follow `HTTPS_PROXY`.
//!
//! It intercepts only the hosts an upstream claims (`hosts = [...]`): a `CONNECT` to one is
//! answered `200`, then TLS is ended here with a leaf for that host signed by the proxy's CA
//! ([`ca`]), and each request inside runs through [`crate::server::router`] exactly as on that
//! upstream's dedicated listener. Hosts in `egress.tunnel` are spliced untouched
//! ([`tunnel`]); any other host is refused (`403 egress_host_not_allowed`) and nothing is
//! connected: not an open proxy.

mod tunnel;

use crate::config::{HostPattern, Upstream};
use crate::connection::{self, Http, RequestBody};
use crate::error::{ErrorKind, ProxyError};
use crate::server::router::{self, Listener};
use crate::state::Live;
use crate::upstream::ProxyBody;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// What the egress listener keeps while it runs: the CA's leaves.
pub struct Egress {
    pub ca: crate::ca::Authority,
}

/// Where a handler leaves the tasks that carry a connection on after an upgrade (a `CONNECT`;
/// several on one HTTP/2 connection): the connection's serving task awaits them, so the
/// connection keeps its slot until its tunnels end and is shed with them (each task is aborted
/// when dropped). A std `Mutex`: held to push or take, never across an await.
#[derive(Clone)]
pub struct Afterwards {
    tasks: Arc<Mutex<Vec<AbortOnDropHandle<()>>>>,
    /// The listener's: intercepted connections are served as its own are, and close with it.
    http: Arc<Http>,
    closing: CancellationToken,
}

impl Afterwards {
    pub fn new(http: Arc<Http>, closing: CancellationToken) -> Afterwards {
        Afterwards {
            tasks: Arc::default(),
            http,
            closing,
        }
    }

    fn add(&self, task: tokio::task::JoinHandle<()>) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        tasks.push(AbortOnDropHandle::new(task));
    }

    /// The tasks left by handlers (awaited by the connection's serving task).
    pub fn take(&self) -> Vec<AbortOnDropHandle<()>> {
        std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Answers one request on the egress listener; never fails, never panics on input.
pub async fn handle(
    live: Live,
    egress: Arc<Egress>,
    req: Request<RequestBody>,
) -> Response<ProxyBody> {
    match route(live, egress, req).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::info!(error = %e, "egress request refused");
            let auth = e.kind == ErrorKind::ProxyAuthRequired;
            let mut resp = e
                .to_response()
                .map(|b| b.map_err(|never| match never {}).boxed());
            if auth {
                resp.headers_mut().insert(
                    http::header::PROXY_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"idemproxy egress\""),
                );
            }
            resp
        }
    }
}

async fn route(
    live: Live,
    egress: Arc<Egress>,
    mut req: Request<RequestBody>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let state = live.load_full();
    let config = &state.config.egress;
    if let Some(token) = &config.proxy_token {
        if !authorized(req.headers().get(http::header::PROXY_AUTHORIZATION), token) {
            return Err(ProxyError::new(
                ErrorKind::ProxyAuthRequired,
                "the egress listener needs Proxy-Authorization (egress.proxy_token): Basic with any user and the token as password, or Bearer",
            ));
        }
    }
    let authority = req.uri().authority().cloned().ok_or_else(|| {
        ProxyError::new(
            ErrorKind::BadPath,
            "this is the egress listener, a forward proxy: send CONNECT host:443, or an absolute URL (set HTTPS_PROXY / HTTP_PROXY to it)",
        )
    })?;
    // An IPv6 literal without its brackets (`[::1]` is `::1`, to connect to and to name in a
    // certificate); a name without its trailing dot.
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase();
    let claimed = claimant(&state.config.upstreams, &host);
    if req.method() == Method::CONNECT {
        if let Some(upstream) = claimed {
            return intercept(live, egress, upstream, host, req);
        }
        let port = authority.port_u16().unwrap_or(443);
        if let Some(entry) = config.tunnel.iter().find(|t| t.matches(&host)) {
            let stream = tunnel::connect(&host, port, entry).await?;
            let upgrade = hyper::upgrade::on(&mut req);
            after(&req, tunnel::splice(upgrade, stream));
            return Ok(empty(StatusCode::OK));
        }
        return Err(not_allowed(&host));
    }
    // An absolute-form request (`POST http://host/...`): handled the same way, without TLS.
    let Some(upstream) = claimed else {
        return Err(not_allowed(&host));
    };
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    *req.uri_mut() = pq.parse().map_err(|_| {
        ProxyError::new(
            ErrorKind::BadPath,
            format!("{pq:?} is not a request target"),
        )
    })?;
    let host: Arc<str> = host.into();
    Ok(router::handle(state, Listener::Egress(upstream, host), req).await)
}

/// The upstream whose `hosts` claim `host`: one that names it exactly before one that claims
/// it by `*.domain` (`acme.zendesk.com` may have an upstream of its own beside `*.zendesk.com`).
fn claimant(upstreams: &[Arc<Upstream>], host: &str) -> Option<Arc<Upstream>> {
    let claims = |wildcard: bool| {
        upstreams.iter().find(|u| {
            u.hosts
                .iter()
                .any(|h: &HostPattern| h.is_wildcard() == wildcard && h.matches(host))
        })
    };
    claims(false).or_else(|| claims(true)).cloned()
}

fn not_allowed(host: &str) -> ProxyError {
    ProxyError::new(
        ErrorKind::EgressHostNotAllowed,
        format!(
            "{host} is not a host this proxy serves: add it to an upstream's hosts = [...] to protect its writes, or to egress.tunnel to pass it through untouched"
        ),
    )
}

/// `200` to the `CONNECT`, then TLS as `host` and every request inside through the router.
fn intercept(
    live: Live,
    egress: Arc<Egress>,
    upstream: Arc<Upstream>,
    host: String,
    mut req: Request<RequestBody>,
) -> Result<Response<ProxyBody>, ProxyError> {
    // Minted (or taken from the cache) before the 200: a failure is an answer, not a reset.
    let tls = egress.ca.server_config(&host).map_err(|e| {
        ProxyError::new(
            ErrorKind::Internal,
            format!("cannot make a certificate for {host}: {e:#}"),
        )
    })?;
    let handshake = live.load().config.egress.handshake_timeout;
    let upgrade = hyper::upgrade::on(&mut req);
    let host: Arc<str> = host.into();
    let (http, closing) = match req.extensions().get::<Afterwards>() {
        Some(a) => (a.http.clone(), a.closing.child_token()),
        None => (
            Arc::new(Http::new(
                crate::connection::HEADER_READ_TIMEOUT,
                live.load().stats.parked(),
            )),
            CancellationToken::new(),
        ),
    };
    after(&req, async move {
        let io = match upgrade.await {
            Ok(io) => TokioIo::new(io),
            Err(e) => return tracing::debug!(error = %e, "CONNECT upgrade failed"),
        };
        let accept = tokio_rustls::TlsAcceptor::from(tls).accept(io);
        let stream = match tokio::time::timeout(handshake, accept).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return tracing::debug!(%host, error = %e, "TLS handshake failed (does the client trust the CA? `idemproxy ca show`)")
            }
            Err(_) => return tracing::debug!(%host, "TLS handshake timed out"),
        };
        let peer = format!("intercepted {host}");
        let handle = move |req| {
            let (state, listener) = (
                live.load_full(),
                Listener::Egress(upstream.clone(), host.clone()),
            );
            router::handle(state, listener, req)
        };
        connection::serve(stream, &http, handle, &closing, &peer).await;
    });
    Ok(empty(StatusCode::OK))
}

/// Hands `work` to the connection (see [`Afterwards`]); without one (a test harness), spawns it.
fn after<B>(req: &Request<B>, work: impl std::future::Future<Output = ()> + Send + 'static) {
    let task = tokio::spawn(work);
    if let Some(slot) = req.extensions().get::<Afterwards>() {
        slot.add(task);
    }
}

fn empty(status: StatusCode) -> Response<ProxyBody> {
    let mut resp = Response::new(crate::upstream::full(bytes::Bytes::new()));
    *resp.status_mut() = status;
    resp
}

/// Whether `Proxy-Authorization` carries `token`: `Basic` with any user and the token as the
/// password (what `http://user:token@host:port` in `HTTPS_PROXY` sends), or `Bearer token`.
/// Compared in constant time.
fn authorized(header: Option<&HeaderValue>, token: &str) -> bool {
    use base64::Engine;
    let Some(value) = header.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let (scheme, rest) = value.trim().split_once(' ').unwrap_or((value, ""));
    let given = match scheme.to_ascii_lowercase().as_str() {
        "bearer" => rest.trim().as_bytes().to_vec(),
        "basic" => {
            let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(rest.trim()) else {
                return false;
            };
            match decoded.iter().position(|&b| b == b':') {
                Some(i) => decoded[i + 1..].to_vec(),
                None => return false,
            }
        }
        _ => return false,
    };
    let (a, b) = (
        ring::digest::digest(&ring::digest::SHA256, &given),
        ring::digest::digest(&ring::digest::SHA256, token.as_bytes()),
    );
    a.as_ref()
        .iter()
        .zip(b.as_ref())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::authorized;
    use http::HeaderValue;

    #[test]
    fn proxy_credentials() {
        let ok = |v: &str| authorized(Some(&HeaderValue::from_str(v).unwrap()), "s3cret");
        assert!(ok("Basic dXNlcjpzM2NyZXQ=")); // user:s3cret
        assert!(ok("Basic OnMzY3JldA==")); // :s3cret
        assert!(ok("Bearer s3cret"));
        assert!(!ok("Basic dXNlcjp3cm9uZw==")); // user:wrong
        assert!(!ok("Bearer s3cre"));
        assert!(!ok("Digest x"));
        assert!(!authorized(None, "s3cret"));
    }
}
