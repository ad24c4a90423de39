//! Step 4 of the pipeline, inside the entity locks: the claim, the version, the precheck.
//! Each refuses with a 409 that says what it saw, and nothing is forwarded.

use super::prepare::Prepared;
use super::Ctx;
use crate::config::{Precheck, Route};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::store::{now_ms, EntityState, Store};
use crate::upstream::describe;
use crate::upstream::{full, UpstreamClient};
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Limited};
use serde_json::{json, Value};

/// Most bytes of a precheck answer read.
const PRECHECK_MAX_BODY: usize = 1 << 20;

/// Step 4, inside the locks.
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<()> {
    let store = ctx.state.store.as_ref();
    run(
        store,
        &ctx.route,
        &ctx.p,
        &ctx.client,
        &ctx.outgoing.headers,
    )
    .await
}

/// Runs the route's checks in SPEC order: claim, version, precheck.
pub async fn run(
    store: &dyn Store,
    route: &Route,
    p: &Prepared,
    client: &UpstreamClient,
    headers: &HeaderMap,
) -> ProxyResult<()> {
    if route.claim.is_some() || p.version.is_some() {
        let states = store
            .entity_states(&p.entities)
            .await
            .map_err(ProxyError::store)?;
        if route.claim.is_some() {
            check_claims(&states, p)?;
        }
        if let Some(v) = p.version {
            check_versions(&states, v)?;
        }
    }
    if let (Some(pc), Some(path)) = (&route.precheck, &p.precheck_path) {
        precheck(pc, path, client, headers).await?;
    }
    Ok(())
}

/// Claim-first: an entity claimed by another key (until its claim lapses) refuses the write.
pub(super) fn check_claims(states: &[EntityState], p: &Prepared) -> ProxyResult<()> {
    let now = now_ms();
    for s in states {
        if let Some(c) = &s.claim {
            if c.until > now && c.owner != p.id {
                let entity = crate::key::unqualified(&s.entity);
                return Err(ProxyError::new(
                    ErrorKind::EntityClaimed,
                    format!("{entity} is claimed by another execution"),
                )
                .details(json!({"entity": entity, "claimed_until_ms": c.until})));
            }
        }
    }
    Ok(())
}

/// Version fencing: the write's version must be greater than every entity's last accepted
/// version; the error carries the current version so the client can rehydrate.
pub(super) fn check_versions(states: &[EntityState], version: i64) -> ProxyResult<()> {
    for s in states {
        if let Some(current) = s.version.filter(|c| *c >= version) {
            let entity = crate::key::unqualified(&s.entity);
            return Err(ProxyError::new(
                ErrorKind::StaleVersion,
                format!(
                    "version {version} of {entity} is not newer than the accepted version {current}"
                ),
            )
            .details(json!({"entity": entity, "current_version": current, "version": version})));
        }
    }
    Ok(())
}

/// Re-reads the real system right before the write; the request's credentials go along.
async fn precheck(
    pc: &Precheck,
    path: &str,
    client: &UpstreamClient,
    headers: &HeaderMap,
) -> ProxyResult<()> {
    let up = &client.upstream;
    let uri = client.uri(path).map_err(|e| {
        ProxyError::new(
            ErrorKind::BadPath,
            format!("the precheck path {path:?} is not a URL: {e}"),
        )
    })?;
    let mut req = Request::new(full(bytes::Bytes::new()));
    *req.method_mut() = pc.method.clone();
    *req.uri_mut() = uri;
    for name in crate::key::credential_names(&up.scope_headers) {
        for v in headers.get_all(name) {
            req.headers_mut().append(name.clone(), v.clone());
        }
    }
    req.headers_mut().insert(
        http::header::ACCEPT,
        http::HeaderValue::from_static("application/json"),
    );
    let fetch = async {
        let resp = client.send(req).await.map_err(|e| {
            let kind = if e.is_connect() {
                ErrorKind::UpstreamUnreachable
            } else {
                ErrorKind::UpstreamTimeout
            };
            ProxyError::new(
                kind,
                format!("the precheck {path} failed: {}", describe(&e)),
            )
        })?;
        let status = resp.status().as_u16();
        let body = Limited::new(resp.into_body(), PRECHECK_MAX_BODY)
            .collect()
            .await
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::UpstreamTimeout,
                    format!("the precheck answer broke off: {e}"),
                )
            })?
            .to_bytes();
        Ok::<_, ProxyError>((status, body))
    };
    let (status, body) = tokio::time::timeout(up.timeout, fetch)
        .await
        .map_err(|_| {
            ProxyError::new(
                ErrorKind::UpstreamTimeout,
                format!("the precheck {path} got no answer in time"),
            )
        })??;
    let json: Option<Value> = serde_json::from_slice(&body).ok();
    let mut seen = serde_json::Map::new();
    let mut ok = pc.expect_status.contains(&status);
    for (field, expected) in &pc.expect {
        let value = json
            .as_ref()
            .and_then(|j| field.values(j).into_iter().next().cloned());
        ok &= value.as_ref().is_some_and(|v| same(v, expected));
        seen.insert(format!("body.{field}"), value.unwrap_or(Value::Null));
    }
    if ok {
        return Ok(());
    }
    Err(ProxyError::new(ErrorKind::PrecheckFailed, format!("the precheck {} {path} did not match", pc.method))
        .details(json!({"precheck": {"method": pc.method.as_str(), "path": path, "status": status, "seen": seen}})))
}

/// Equal as JSON, or equal as text (`"5"` from a form-minded API matches `5`).
fn same(seen: &Value, expected: &Value) -> bool {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    // Numbers by value (`5.50` is `5.5`, `1e2` is `100`), as numbers are kept as written.
    let number = |v: &Value| match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    let numeric = matches!(seen, Value::Number(_)) || matches!(expected, Value::Number(_));
    seen == expected
        || text(seen) == text(expected)
        || (numeric && number(seen).is_some_and(|a| number(expected) == Some(a)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Claim, ScopedKey};

    fn state(entity: &str, version: Option<i64>, claim: Option<(&str, i64)>) -> EntityState {
        EntityState {
            entity: entity.into(),
            version,
            claim: claim.map(|(k, until)| Claim {
                owner: ScopedKey {
                    upstream: "u".into(),
                    scope: "s".into(),
                    key: k.into(),
                },
                until,
            }),
            updated_at: 0,
        }
    }

    #[test]
    fn versions_must_grow() {
        let states = [state("a", Some(5), None), state("b", None, None)];
        assert!(check_versions(&states, 6).is_ok());
        let e = check_versions(&states, 5).unwrap_err();
        assert_eq!(e.kind, ErrorKind::StaleVersion);
        assert_eq!(e.details.unwrap()["current_version"], 5);
    }

    #[test]
    fn values_compare_as_json_or_text() {
        assert!(same(&json!("free"), &json!("free")));
        assert!(same(&json!(5), &json!("5")));
        let n = |t: &str| serde_json::from_str::<Value>(t).unwrap();
        assert!(same(&n("5.50"), &n("5.5")));
        assert!(same(&n("1e2"), &n("100")));
        assert!(!same(&n("5.51"), &n("5.5")));
        assert!(!same(&json!("taken"), &json!("free")));
        let _ = state("x", None, Some(("k", now_ms() + 1000)));
    }
}
