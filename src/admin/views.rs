//! What operators see of keys, entities and the audit trail, as JSON: the admin API's
//! reports, `idemproxy keys`, and the console's data.

use crate::error::ProxyError;
use crate::store::seal::ENCRYPTED;
use crate::store::{now_ms, AuditRow, KeyRecord, Store, StoreResult, StoredAnswer};
use crate::upstream::{full, ProxyBody};
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Value};

/// Most audit rows shown with a key or an entity.
const HISTORY: i64 = 100;

/// Every record of a key and its attempts (audit rows, newest first); `None` if unknown.
pub async fn key_report(store: &dyn Store, key: &str) -> StoreResult<Option<Value>> {
    let records = store.find_key(key).await?;
    // A key refused before it was stored has no record, only its attempts.
    let attempts = store.audit_for_key(key, HISTORY).await?;
    if records.is_empty() && attempts.is_empty() {
        return Ok(None);
    }
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
        "scope": a.scope,
        "workflow": a.workflow,
        "note": a.note,
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

pub fn json_response(status: StatusCode, body: Value) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

pub fn error(e: ProxyError) -> Response<ProxyBody> {
    use http_body_util::BodyExt;
    e.to_response()
        .map(|b| b.map_err(|never| match never {}).boxed())
}
