//! Step 1's evaluation of a buffered request: its key, fingerprint, entities, version and
//! side reads. Pure of the network and the store, so `idemproxy explain` runs the same code.

use super::body_read::BodyRead;
use super::readable::{readable, wildcard_host};
use super::request_parts::{self as parts, KeyPlan, KeySource, ReconcileRead};
use super::side_read;
use crate::config::{Route, Upstream};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::key;
use crate::rules::body::{self, BodyKind};
use crate::rules::template::RequestView;
use crate::store::ScopedKey;
use bytes::Bytes;
use http::{HeaderMap, Method};

/// A protected request, evaluated.
#[derive(Debug, Default)]
pub struct Prepared {
    pub key: String,
    pub key_source: KeySource,
    /// The route's `key.window`, when the key was derived from the intent alone: the
    /// completed key is a retry's answer for this long only.
    pub window: Option<std::time::Duration>,
    pub id: ScopedKey,
    pub fingerprint: String,
    /// Sorted, unique; each qualified with the credential scope (`name@scope`) unless the
    /// upstream shares entities across credentials.
    pub entities: Vec<String>,
    pub version: Option<i64>,
    /// The precheck's upstream path (and query), when the route has a precheck.
    pub precheck_path: Option<String>,
    /// The reconcile read, when the route has one.
    pub reconcile: Option<ReconcileRead>,
    /// The route's `stamp` goes into this request's body: the caller left the field empty. A
    /// value the caller put there is theirs, and is forwarded as sent (with no reconcile read
    /// by the stamp, which would not be in the object).
    pub stamped: bool,
    /// The workflow id header's value (`server.workflow_header`), for the audit trail.
    pub workflow: Option<String>,
}

/// Reads the client's key, if the route takes one: decided before the body is buffered so an
/// unprotected request can still stream.
pub fn plan_key(upstream: &Upstream, route: &Route, headers: &HeaderMap) -> ProxyResult<KeyPlan> {
    if let Some(name) = &route.key.header {
        let found = key::header_key(headers, name)
            .map_err(|e| ProxyError::new(ErrorKind::KeyInvalid, e))?;
        if let Some(k) = found {
            // An SDK's random per-call key says nothing about the intent: derive instead, so
            // a workflow-level retry (a new SDK call, a new random key) meets the first answer.
            let generated = upstream.sdk_keys.iter().any(|p| p.matches(&k));
            if !generated || route.key.derive.is_empty() {
                return Ok(KeyPlan::Header(k));
            }
            return Ok(KeyPlan::Derive(Some(k)));
        }
    }
    match (route.key.derive.is_empty(), route.key.required) {
        (false, _) => Ok(KeyPlan::Derive(None)),
        (true, false) => Ok(KeyPlan::Unprotected),
        (true, true) => Err(ProxyError::new(
            ErrorKind::KeyMissing,
            match &route.key.header {
                Some(h) => format!(
                    "route {} needs an idempotency key in the {h} header (it derives none)",
                    route.name
                ),
                None => format!("route {} takes no key header and derives none", route.name),
            },
        )),
    }
}

/// The request as the pipeline evaluates it.
pub struct Input<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub body: &'a Bytes,
    pub path_params: &'a [(String, String)],
    /// The host the egress listener intercepted the request for, if it did.
    pub host: Option<&'a str>,
}

/// Evaluates key, fingerprint, entities and version of a buffered request.
pub fn prepare(
    upstream: &Upstream,
    route: &Route,
    plan: KeyPlan,
    input: &Input<'_>,
    scoper: &key::ScopeKeyer,
) -> ProxyResult<Prepared> {
    // Decoded once: bytes for the fingerprint, text for the templates.
    let query_bytes: Vec<crate::rules::urlencoded::Pair> = input
        .query
        .map(|q| crate::rules::urlencoded::pairs(q.as_bytes()).collect())
        .unwrap_or_default();
    let query = readable(route, input.headers, &query_bytes)?;
    let (kind, parsed) = read_body(route, input)?;
    let read = BodyRead {
        kind,
        parsed: parsed.is_some(),
        headers: input.headers,
        body: input.body,
    };
    let stamped = parts::stamped(route, kind, parsed.as_ref())?;
    let kind = if parsed.is_some() {
        kind
    } else {
        BodyKind::Raw
    };
    let intent = key::Intent {
        method: input.method.as_str(),
        path: input.path,
        query: &query_bytes,
        body: input.body,
        kind,
        parsed: parsed.as_ref(),
        headers: input.headers,
    };
    let fingerprint = key::fingerprint(&intent, &route.fingerprint);
    let mut view = RequestView {
        method: input.method.as_str(),
        path_params: input.path_params,
        query: &query,
        headers: input.headers,
        body: parsed.as_ref(),
        route: &route.name,
        entity: None,
        fingerprint: Some(&fingerprint),
    };
    let entities = parts::entities(route, &view, &read)?;
    let joined = entities.join(",");
    view.entity = (!entities.is_empty()).then_some(joined.as_str());
    let (key, key_source, window) = parts::key(route, plan, &view, &read)?;
    let version = parts::version(route, &view, &read, &key)?;
    let precheck_path = match &route.precheck {
        None => None,
        Some(pc) => Some(side_read::eval_path(&pc.path, &view, "precheck", &key)?),
    };
    let reconcile = parts::reconcile(route, &view, parsed.as_ref(), stamped, &key)?;
    let (id, entities) = scoped(upstream, input, &key, entities, scoper);
    Ok(Prepared {
        key,
        key_source,
        window,
        id,
        fingerprint,
        entities,
        version,
        precheck_path,
        reconcile,
        stamped,
        workflow: None,
    })
}

/// The body read by its `Content-Type` (the one reading `explain` shares): its kind, and its
/// value when it parsed. A route that reads the body refuses one that does not parse, saying
/// what was read; for any other, an unparsed body is fingerprinted as raw bytes.
fn read_body(
    route: &Route,
    input: &Input<'_>,
) -> ProxyResult<(BodyKind, Option<serde_json::Value>)> {
    let kind = BodyKind::of(input.headers);
    let parsed = match body::parse(kind, input.body) {
        Ok(v) => v,
        Err(e) if route.needs_body => return Err(ProxyError::new(ErrorKind::BodyInvalid, e)),
        // Nothing reads the body: it is fingerprinted as raw bytes.
        Err(_) => None,
    };
    if route.needs_body && parsed.is_none() {
        let read = BodyRead {
            kind,
            parsed: false,
            headers: input.headers,
            body: input.body,
        };
        return Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            format!(
                "route {} reads the body, which must be JSON or a form: {}",
                route.name,
                read.said()
            ),
        ));
    }
    Ok((kind, parsed))
}

/// The key scoped to the caller's credentials (and host, for a wildcard upstream), and the
/// entities likewise: entity locks, versions and claims belong to the caller's credentials
/// unless the upstream shares them — another tenant's contact 42 is not ours.
fn scoped(
    upstream: &Upstream,
    input: &Input<'_>,
    key: &str,
    entities: Vec<String>,
    scoper: &key::ScopeKeyer,
) -> (ScopedKey, Vec<String>) {
    let id = ScopedKey::new(
        upstream.name.clone(),
        scoper.scope_at(
            input.headers,
            &upstream.credentials,
            wildcard_host(upstream, input.host),
        ),
        key.to_owned(),
    );
    if upstream.share_entities {
        return (id, entities);
    }
    let scope = key::entity_scope(&id.scope);
    let entities = entities
        .into_iter()
        .map(|e| format!("{e}@{scope}"))
        .collect();
    (id, entities)
}
