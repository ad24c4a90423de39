//! Step 4 of the pipeline, inside the entity locks: the claim, the version, the precheck.
//! Each refuses with a 409 that says what it saw, and nothing is forwarded.

use super::prepare::Prepared;
use super::{side_read, Ctx};
use crate::config::{Precheck, Route};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::store::{now_ms, EntityState, Store};
use crate::upstream::UpstreamClient;
use http::HeaderMap;
use serde_json::json;

/// Step 4, inside the locks.
pub(super) async fn step(ctx: &mut Ctx) -> ProxyResult<()> {
    let store = ctx.state.store.as_ref();
    run(
        store,
        &ctx.route,
        &ctx.prepared,
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
    let answer = side_read::read(client, &pc.method, path, headers, "precheck").await?;
    let (held, seen) = side_read::holds(&answer.body, pc.expect.iter().map(|(f, v)| (f, v)));
    if held && pc.expect_status.contains(&answer.status) {
        return Ok(());
    }
    let status = answer.status;
    Err(ProxyError::new(ErrorKind::PrecheckFailed, format!("the precheck {} {path} did not match", pc.method))
        .details(json!({"precheck": {"method": pc.method.as_str(), "path": path, "status": status, "seen": seen}})))
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
                owner: ScopedKey::new("u", "s", k),
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
    fn another_keys_live_claim_refuses() {
        let p = Prepared::default();
        assert!(check_claims(&[state("x", None, Some(("k", now_ms() + 60_000)))], &p).is_err());
        assert!(check_claims(&[state("x", None, Some(("k", now_ms() - 1)))], &p).is_ok());
    }
}
