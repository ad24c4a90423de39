//! The admin listener: health, readiness, metrics, and the operator API behind the token.
//! Never reachable from the main listener (it is a different socket).

use crate::error::{ErrorKind, ProxyError};
use crate::proxy::AppState;
use crate::store::{now_ms, KeyRecord};
use crate::upstream::{full, ProxyBody};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use percent_encoding::percent_decode_str;
use serde_json::{json, Value};
use std::sync::Arc;

/// Answers one admin request.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
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
            let mut resp = Response::new(full(state.stats.render()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            resp
        }
        (_, p) if p.starts_with("/admin/") => {
            if !authorized(&state, &req) {
                return error(ProxyError::new(
                    ErrorKind::Unauthorized,
                    "a valid bearer token is required",
                ));
            }
            admin_api(&state, &method, p).await
        }
        _ => error(ProxyError::new(
            ErrorKind::NotFound,
            format!("no admin endpoint {method} {path}"),
        )),
    }
}

fn authorized(state: &AppState, req: &Request<Incoming>) -> bool {
    let Some(token) = &state.config.server.admin_token else {
        return true;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant-time comparison: the token must not leak through timing.
    given.is_some_and(|g| {
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    })
}

async fn admin_api(state: &AppState, method: &Method, path: &str) -> Response<ProxyBody> {
    let segs: Vec<String> = path
        .trim_start_matches("/admin/")
        .split('/')
        .map(|s| percent_decode_str(s).decode_utf8_lossy().into_owned())
        .collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let result = match (method, segs.as_slice()) {
        (&Method::GET, ["keys", key]) => state.store.find_key(key).await.map(|records| {
            if records.is_empty() {
                error(ProxyError::new(ErrorKind::NotFound, format!("no key {key:?}")))
            } else {
                json_response(StatusCode::OK, json!({"key": key, "records": records.iter().map(record_json).collect::<Vec<_>>()}))
            }
        }),
        (&Method::POST, ["keys", key, "release"]) => state.store.release_key(key).await.map(|n| {
            tracing::info!(key, released = n, "key released by the admin API");
            json_response(StatusCode::OK, json!({"key": key, "released": n}))
        }),
        _ => Ok(error(ProxyError::new(ErrorKind::NotFound, format!("no admin endpoint {method} {path}")))),
    };
    result.unwrap_or_else(|e| error(ProxyError::store(e)))
}

/// A key record as operators see it (admin API and `idemproxy keys`). Never the credentials:
/// only their hash.
pub fn record_json(r: &KeyRecord) -> Value {
    let now = now_ms();
    json!({
        "upstream": r.id.upstream,
        "key": r.id.key,
        "scope": r.id.scope,
        "route": r.route,
        "state": r.effective_state(now).as_str(),
        "stored_state": r.state.as_str(),
        "fingerprint": r.fingerprint,
        "entities": r.entities,
        "attempts": r.attempts,
        "epoch": r.epoch,
        "owner": r.owner,
        "lease_until_ms": r.lease_until,
        "created_at_ms": r.created_at,
        "updated_at_ms": r.updated_at,
        "expires_at_ms": r.expires_at,
        "response": r.response.as_ref().map(|resp| json!({
            "status": resp.status,
            "body_bytes": resp.body.len(),
            "body_preview": String::from_utf8_lossy(&resp.body[..resp.body.len().min(512)]),
        })),
    })
}

fn json_response(status: StatusCode, body: Value) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn error(e: ProxyError) -> Response<ProxyBody> {
    use http_body_util::BodyExt;
    e.to_response()
        .map(|b| b.map_err(|never| match never {}).boxed())
}
