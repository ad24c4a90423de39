//! The admin listener: health, readiness, metrics, and the operator API behind the token.
//! Never reachable from the main listener (it is a different socket).

use crate::error::{ErrorKind, ProxyError};
use crate::state::{AppState, Live};
use crate::store::seal::ENCRYPTED;
use crate::store::{now_ms, AuditRow, KeyRecord, Store, StoreResult, StoredAnswer};
use crate::upstream::{full, ProxyBody};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use percent_encoding::percent_decode_str;
use serde_json::{json, Value};

/// Answers one admin request (under the configuration in force when it arrived).
pub async fn handle(live: Live, req: Request<Incoming>) -> Response<ProxyBody> {
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
            if (&method, p) == (&Method::POST, "/admin/reload") {
                return reloaded(&live).await;
            }
            admin_api(&state, &method, p).await
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
        (&Method::GET, ["keys", key]) => {
            key_report(state.store.as_ref(), key)
                .await
                .map(|report| match report {
                    Some(r) => json_response(StatusCode::OK, r),
                    None => error(ProxyError::new(
                        ErrorKind::NotFound,
                        format!("no key {key:?}"),
                    )),
                })
        }
        (&Method::GET, ["entities", entity]) => entity_report(state.store.as_ref(), entity)
            .await
            .map(|r| json_response(StatusCode::OK, r)),
        (&Method::DELETE, ["claims", entity]) => {
            state.store.release_claim(entity).await.map(|released| {
                tracing::info!(entity, released, "claim released by the admin API");
                json_response(
                    StatusCode::OK,
                    json!({"entity": entity, "released": released}),
                )
            })
        }
        (&Method::DELETE, ["entities", entity, "version"]) => {
            state.store.reset_version(entity).await.map(|n| {
                tracing::info!(entity, reset = n, "entity version reset by the admin API");
                json_response(StatusCode::OK, json!({"entity": entity, "reset": n}))
            })
        }
        (&Method::POST, ["keys", key, "release"]) => state.store.release_key(key).await.map(|n| {
            tracing::info!(key, released = n, "key released by the admin API");
            json_response(StatusCode::OK, json!({"key": key, "released": n}))
        }),
        _ => Ok(error(ProxyError::new(
            ErrorKind::NotFound,
            format!("no admin endpoint {method} {path}"),
        ))),
    };
    result.unwrap_or_else(|e| error(ProxyError::store(e)))
}

/// Most audit rows shown with a key or an entity.
const HISTORY: i64 = 100;

/// Every record of a key and its attempts (audit rows, newest first); `None` if unknown.
pub async fn key_report(store: &dyn Store, key: &str) -> StoreResult<Option<Value>> {
    let records = store.find_key(key).await?;
    if records.is_empty() {
        return Ok(None);
    }
    let attempts = store.audit_for_key(key, HISTORY).await?;
    Ok(Some(json!({
        "key": key,
        "records": records.iter().map(record_json).collect::<Vec<_>>(),
        "attempts": attempts.iter().map(audit_json).collect::<Vec<_>>(),
    })))
}

/// An entity's version, claim and audit history (newest first). `entity` may be a bare name
/// (`contact:42`): every credential scope's state of it is listed under `scopes`, and the
/// top-level `version` and `claim` sum them up (the highest version, a live claim).
pub async fn entity_report(store: &dyn Store, entity: &str) -> StoreResult<Value> {
    let states = store.find_entities(entity).await?;
    let history = store.audit_for_entity(entity, HISTORY).await?;
    let now = now_ms();
    let live_claim = |s: &crate::store::EntityState| {
        s.claim
            .as_ref()
            .filter(|c| c.until > now)
            .map(|c| json!({"key": c.owner.key, "upstream": c.owner.upstream, "until_ms": c.until}))
    };
    Ok(json!({
        "entity": entity,
        "version": states.iter().filter_map(|s| s.version).max(),
        "claim": states.iter().find_map(live_claim),
        "scopes": states.iter().map(|s| json!({
            "entity": s.entity,
            "version": s.version,
            "claim": live_claim(s),
        })).collect::<Vec<_>>(),
        "history": history.iter().map(audit_json).collect::<Vec<_>>(),
    }))
}

/// An audit row as operators see it.
pub fn audit_json(a: &AuditRow) -> Value {
    json!({
        "at_ms": a.at,
        "upstream": a.upstream,
        "route": a.route,
        "entities": a.entities,
        "key": a.key,
        "fingerprint": a.fingerprint,
        "decision": a.decision,
        "upstream_status": a.upstream_status,
        "total_ms": a.total_ms,
        "lock_wait_ms": a.lock_wait_ms,
        "upstream_ms": a.upstream_ms,
        "requests": a.requests,
    })
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
        "encrypted_with": r.enc_key,
        "response": r.response.as_ref().map(answer_json),
    })
}

/// A stored answer as operators see it: opened (its headers and body as text), or, when this
/// process cannot decrypt it, its status and `<encrypted>` in place of the rest.
fn answer_json(a: &StoredAnswer) -> Value {
    match a {
        StoredAnswer::Open(resp) => json!({
            "status": resp.status,
            "headers": resp.headers.iter()
                .map(|(n, v)| json!([n, String::from_utf8_lossy(v)]))
                .collect::<Vec<_>>(),
            "body_bytes": resp.body.len(),
            "body_preview": String::from_utf8_lossy(&resp.body[..resp.body.len().min(512)]),
            "body": String::from_utf8_lossy(&resp.body),
        }),
        StoredAnswer::Sealed(s) => json!({
            "status": s.status,
            "headers": ENCRYPTED,
            "body": ENCRYPTED,
            "sealed": s.reason,
        }),
    }
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
