//! The admin listener: health, readiness, metrics, and the operator API behind the token.
//! Never reachable from the main listener (it is a different socket).
//!
//! - [`views`]: keys, entities and audit rows as operators see them (JSON).
//! - [`settle`]: `POST /admin/keys/{key}/release` and `…/complete`.

pub mod settle;
pub mod views;

pub use views::{audit_json, entity_report, error, json_response, key_report, record_json};

use crate::connection::RequestBody;
use crate::error::{ErrorKind, ProxyError};
use crate::state::{AppState, Live};
use crate::upstream::{full, ProxyBody};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use percent_encoding::percent_decode_str;
use serde_json::{json, Value};

/// Answers one admin request (under the configuration in force when it arrived).
pub async fn handle(live: Live, req: Request<RequestBody>) -> Response<ProxyBody> {
    let state = live.load_full();
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/healthz") => json_response(StatusCode::OK, json!({"status": "ok"})),
        (&Method::GET, "/readyz") => match state.store.ping().await {
            Ok(()) => json_response(
                StatusCode::OK,
                json!({"status": "ready", "store": state.store.backend()}),
            ),
            Err(e) => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "unavailable", "store": state.store.backend(), "error": e.to_string()}),
            ),
        },
        (&Method::GET, "/metrics") => {
            state.pacer.refresh();
            let mut resp = Response::new(full(state.stats.render()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            resp
        }
        (_, p) if p.starts_with("/admin/") => {
            if !admin_open(&state) {
                return error(ProxyError::new(
                    ErrorKind::Forbidden,
                    "the admin API is off: the admin listener is not on loopback and no admin_token is set",
                ));
            }
            if !authorized(&state, &req) {
                return error(ProxyError::new(
                    ErrorKind::Unauthorized,
                    "a valid bearer token is required",
                ));
            }
            if state.config.server.admin_token.is_none() && !from_this_machine(&req) {
                return error(ProxyError::new(
                    ErrorKind::Forbidden,
                    "without an admin_token, /admin/* answers only requests for a loopback host that no other site's page sent",
                ));
            }
            if (&method, p) == (&Method::POST, "/admin/reload") {
                return reloaded(&live).await;
            }
            if method == Method::POST && (p.ends_with("/complete") || p.ends_with("/release")) {
                return settling(&state, req).await;
            }
            admin_api(&state, &method, p).await
        }
        // The console's pages, forms and assets (its own sign-in and CSRF checks).
        (_, p) if crate::console::serves(p) => {
            crate::console::handle(&state, req, admin_open(&state)).await
        }
        _ => error(ProxyError::new(
            ErrorKind::NotFound,
            format!("no admin endpoint {method} {path}"),
        )),
    }
}

/// `POST /admin/reload`: `200` with the settings kept, or `400` with every error
/// (`file:line:col: message`) and nothing changed.
async fn reloaded(live: &Live) -> Response<ProxyBody> {
    match crate::reload::reload(live).await {
        Ok(kept) => json_response(StatusCode::OK, json!({"reloaded": true, "kept": kept})),
        Err(errors) => json_response(
            StatusCode::BAD_REQUEST,
            json!({
                "error": {
                    "type": "config_invalid",
                    "message": "the configuration file is invalid; nothing changed",
                    "errors": errors,
                },
                "reloaded": false,
            }),
        ),
    }
}

/// Without a token, `/admin/*` (stored answers, key release, claim deletion) is served only
/// on a loopback admin listener: a listener others can reach needs a token.
pub fn admin_open(state: &AppState) -> bool {
    let server = &state.config.server;
    server.admin_token.is_some() || server.admin_listen.is_some_and(|a| a.ip().is_loopback())
}

fn authorized(state: &AppState, req: &Request<RequestBody>) -> bool {
    let Some(token) = &state.config.server.admin_token else {
        return true;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compared as digests, in constant time: neither the token nor its length leaks through
    // timing (a comparison that stops at a length mismatch tells the length).
    given.is_some_and(|g| {
        use sha2::{Digest, Sha256};
        let (a, b) = (
            Sha256::digest(g.as_bytes()),
            Sha256::digest(token.as_bytes()),
        );
        a.iter()
            .zip(b.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    })
}

/// Without a token, whoever reaches a loopback admin listener may use `/admin/*` — but a page
/// in a browser must not, not even one served from this machine: not through a name of its
/// own rebound to 127.0.0.1 (the `Host` is then not a loopback name), and not by a POST from
/// any other origin, another local port included (a browser names it in `Origin` and says
/// `Sec-Fetch-Site`). Only the admin listener's own origin (the console) passes. curl and
/// scripts send neither header.
fn from_this_machine(req: &Request<RequestBody>) -> bool {
    let headers = req.headers();
    let site_ok = headers.get("sec-fetch-site").is_none_or(|v| {
        let v = v.as_bytes();
        v.eq_ignore_ascii_case(b"same-origin") || v.eq_ignore_ascii_case(b"none")
    });
    // The origin, if any, must be this listener's own: `scheme://` + the `Host` asked for
    // (`null`, from a sandboxed frame, never is).
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin_ok = headers.get(header::ORIGIN).is_none_or(|v| {
        let origin = v.to_str().unwrap_or_default();
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        authority.is_some_and(|a| host.is_some_and(|h| a.eq_ignore_ascii_case(h)))
    });
    crate::console::loopback_host(req.uri(), headers) && site_ok && origin_ok
}

async fn admin_api(state: &AppState, method: &Method, path: &str) -> Response<ProxyBody> {
    let segs = segments(path);
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let result = match (method, segs.as_slice()) {
        (&Method::GET, ["keys", key]) => {
            key_report(state.operator().await, key)
                .await
                .map(|report| match report {
                    Some(r) => json_response(StatusCode::OK, r),
                    None => error(ProxyError::new(
                        ErrorKind::NotFound,
                        format!("no key {key:?}"),
                    )),
                })
        }
        (&Method::GET, ["entities", entity]) => entity_report(state.operator().await, entity)
            .await
            .map(|r| json_response(StatusCode::OK, r)),
        (&Method::DELETE, ["claims", entity]) => state
            .operator()
            .await
            .release_claim(entity)
            .await
            .map(|released| {
                tracing::info!(entity, released, "claim released by the admin API");
                json_response(
                    StatusCode::OK,
                    json!({"entity": entity, "released": released}),
                )
            }),
        (&Method::DELETE, ["entities", entity, "version"]) => {
            state.operator().await.reset_version(entity).await.map(|n| {
                tracing::info!(entity, reset = n, "entity version reset by the admin API");
                json_response(StatusCode::OK, json!({"entity": entity, "reset": n}))
            })
        }
        _ => Ok(error(ProxyError::new(
            ErrorKind::NotFound,
            format!("no admin endpoint {method} {path}"),
        ))),
    };
    result.unwrap_or_else(|e| error(ProxyError::store(e)))
}

/// `POST /admin/keys/{key}/release` and `…/complete`: an operator settles a key (see
/// [`crate::settle`]); the body is JSON (`{"note": …}`, and for complete the answer).
async fn settling(state: &AppState, req: Request<RequestBody>) -> Response<ProxyBody> {
    let path = req.uri().path().to_owned();
    let segs = segments(&path);
    let (key, act) = match segs.as_slice() {
        [keys, key, act] if keys == "keys" => (key.clone(), act.clone()),
        _ => {
            return error(ProxyError::new(
                ErrorKind::NotFound,
                format!("no admin endpoint POST {path}"),
            ))
        }
    };
    let body = match read_json(state, req).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    let settled = settle::act(state, &key, &act, &body).await;
    match settled {
        Ok(v) => json_response(StatusCode::OK, v),
        Err(e) => error(e),
    }
}

/// An `/admin/…` path's segments, percent-decoded (keys and entities may hold `/` or `:`).
fn segments(path: &str) -> Vec<String> {
    path.trim_start_matches("/admin/")
        .split('/')
        .map(|s| percent_decode_str(s).decode_utf8_lossy().into_owned())
        .collect()
}

/// A JSON request body (an empty one is `{}`), at most `max_body` bytes, arriving within
/// `body_timeout` (a trickled body must not hold the admin listener's connections).
async fn read_json(state: &AppState, req: Request<RequestBody>) -> Result<Value, ProxyError> {
    use http_body_util::BodyExt;
    let server = &state.config.server;
    let limited = http_body_util::Limited::new(req.into_body(), server.max_body);
    let collected = tokio::time::timeout(server.body_timeout, limited.collect())
        .await
        .map_err(|_| {
            ProxyError::new(
                ErrorKind::BodyTimeout,
                "the request body did not arrive within body_timeout",
            )
        })?;
    let bytes = collected
        .map_err(|e| ProxyError::new(ErrorKind::BodyTooLarge, format!("request body: {e}")))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| ProxyError::new(ErrorKind::BodyInvalid, format!("the body is not JSON: {e}")))
}
