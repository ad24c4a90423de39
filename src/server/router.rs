//! The router in front of the pipeline: which upstream, which route, protected or streamed.
//!
//! Safe methods and unprotected requests stream through without buffering; everything that
//! matches a route (or the upstream's `unmatched = "protect"`) goes to [`crate::pipeline`].

use crate::config::{Config, Route, Unmatched, Upstream};
use crate::connection::RequestBody;
use crate::error::{ErrorKind, Origin, ProxyError, ProxyResult};
use crate::state::AppState;
use crate::upstream::{ProxyBody, Target};
use http::{Method, Request, Response, Version};
use http_body_util::BodyExt;
use std::sync::Arc;

/// Which listener a request arrived on.
#[derive(Clone)]
pub enum Listener {
    /// `/<prefix>/...` routing.
    Main,
    /// A dedicated upstream listener: every path goes to this upstream as is.
    Upstream(Arc<Upstream>),
    /// A request the egress listener intercepted for this host, which this upstream claims:
    /// handled as on the upstream's dedicated listener.
    Egress(Arc<Upstream>, Arc<str>),
}

/// Answers one request; never fails, never panics on input.
pub async fn handle(
    state: Arc<AppState>,
    listener: Listener,
    req: Request<RequestBody>,
) -> Response<ProxyBody> {
    // For the log line of an error: a standard method and the URI's shared buffers are copied
    // without an allocation (the path as a `String` was one on every request).
    let (method, uri) = (req.method().clone(), req.uri().clone());
    match dispatch(&state, &listener, req).await {
        Ok(resp) => resp,
        Err(e) => {
            // Every error answer passes here: counted and logged by origin in this one place.
            match e.kind.origin() {
                Origin::Store => {
                    state.stats.on_store_error();
                    tracing::error!(%method, path = uri.path(), error = %e, "store unavailable; failing closed");
                }
                Origin::Internal => {
                    tracing::error!(%method, path = uri.path(), error = %e, "request failed")
                }
                _ => tracing::info!(%method, path = uri.path(), error = %e, "request refused"),
            }
            e.to_response_as(e.format)
                .map(|b| b.map_err(|never| match never {}).boxed())
        }
    }
}

async fn dispatch(
    state: &Arc<AppState>,
    listener: &Listener,
    req: Request<RequestBody>,
) -> ProxyResult<Response<ProxyBody>> {
    if req.method() == Method::CONNECT {
        return Err(ProxyError::new(
            ErrorKind::BadPath,
            "CONNECT is not supported",
        ));
    }
    // HTTP/2 always carries scheme and authority; in HTTP/1 they mean an absolute-form target.
    if req.version() < Version::HTTP_2 && req.uri().authority().is_some() {
        return Err(ProxyError::new(
            ErrorKind::BadPath,
            "absolute-form request targets are not accepted",
        ));
    }
    let uri = req.uri().clone();
    let (upstream, rel, action) = resolve(&state.config, listener, req.method(), uri.path())?;
    let target = Target {
        upstream: &upstream,
        path: rel,
        query: uri.query(),
        host: match listener {
            Listener::Egress(_, host) => Some(host),
            _ => None,
        },
    };
    let result = match action {
        Action::Passthrough => crate::pipeline::pace::passthrough(state, &target, req).await,
        Action::Protect(route, params) => {
            crate::pipeline::run(state, &route, params, &target, req).await
        }
    };
    result.map_err(|e| e.formatted(upstream.error_format))
}

/// What the router decided for a request.
pub enum Action {
    /// Stream it through, unlocked and unrecorded.
    Passthrough,
    /// Run the pipeline under this route, with these path captures. Routes match the
    /// canonical path ([`crate::rules::pattern::canonical`]), so an escaped or `;param` spelling cannot
    /// slip past a route; what is fingerprinted is the path as forwarded.
    Protect(Arc<Route>, Vec<(String, String)>),
}

/// Routing, pure: upstream, upstream-relative path and action for a method and path. Shared
/// by the server and `idemproxy explain`.
pub fn resolve<'p>(
    config: &Config,
    listener: &Listener,
    method: &Method,
    path: &'p str,
) -> ProxyResult<(Arc<Upstream>, &'p str, Action)> {
    crate::rules::pattern::check_path(path)
        .map_err(|why| ProxyError::new(ErrorKind::BadPath, why))?;
    check_method(method)?;
    let (upstream, rel) = match listener {
        // By name in the configuration in force (a reload may have changed its rules); an
        // upstream a reload removed keeps the rules its listener started with.
        Listener::Upstream(u) | Listener::Egress(u, _) => {
            (config.upstream(&u.name).unwrap_or(u).clone(), path)
        }
        Listener::Main => find_upstream(config, path).ok_or_else(|| {
            ProxyError::new(
                ErrorKind::NoRoute,
                format!("no upstream is mounted at {path}"),
            )
        })?,
    };
    if method.is_safe() {
        return Ok((upstream, rel, Action::Passthrough));
    }
    let canonical = crate::rules::pattern::canonical(rel);
    // A capture names an entity or a key: bytes that are not text would be read as U+FFFD,
    // and two different paths would name one entity.
    crate::rules::pattern::check_text(&canonical)
        .map_err(|why| ProxyError::new(ErrorKind::BadPath, why))?;
    let matched = upstream.routes.iter().find_map(|r| {
        r.methods
            .contains(method)
            .then(|| r.path.matches(&canonical))
            .flatten()
            .map(|p| (r, p))
    });
    if matched.is_none() {
        let near = upstream
            .routes
            .iter()
            .find(|r| r.methods.contains(method) && r.path.matches_ignoring_case(&canonical));
        if let Some(r) = near {
            return Err(ProxyError::new(
                ErrorKind::BadPath,
                format!(
                    "{rel} matches route {} ({}) only when case is ignored; paths are case-sensitive",
                    r.name, r.path_text
                ),
            ));
        }
    }
    let action = match matched {
        // A read sent as POST: streamed through like a GET, never keyed or locked.
        Some((route, _)) if route.read_only => Action::Passthrough,
        Some((route, params)) => Action::Protect(route.clone(), params),
        None => match upstream.unmatched {
            Unmatched::Protect => Action::Protect(upstream.unmatched_route.clone(), Vec::new()),
            Unmatched::Passthrough => Action::Passthrough,
            Unmatched::Reject => {
                return Err(ProxyError::new(
                    ErrorKind::NoRoute,
                    format!(
                        "no route of upstream {} matches {method} {rel}",
                        upstream.name
                    ),
                ))
            }
        },
    };
    Ok((upstream, rel, action))
}

/// A method spelled like a standard one in another case (`post`, `Delete`) is refused: it
/// would miss every route, yet an upstream that ignores case would run it.
fn check_method(method: &Method) -> ProxyResult<()> {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    let m = method.as_str();
    match STANDARD.iter().find(|s| s.eq_ignore_ascii_case(m)) {
        Some(s) if *s != m => Err(ProxyError::new(
            ErrorKind::BadMethod,
            format!("method {m:?} must be spelled {s}"),
        )),
        _ => Ok(()),
    }
}

/// `/stripe/v1/charges` → (stripe, `/v1/charges`): whole segments only.
fn find_upstream<'p>(config: &Config, path: &'p str) -> Option<(Arc<Upstream>, &'p str)> {
    config.upstreams.iter().find_map(|u| {
        let prefix = u.prefix.as_deref()?;
        let rest = path.strip_prefix(prefix)?;
        match rest {
            "" => Some((u.clone(), "/")),
            r if r.starts_with('/') => Some((u.clone(), r)),
            _ => None,
        }
    })
}
