//! Step 1's evaluation of a buffered request: its key, fingerprint, entities, version and
//! side reads. Pure of the network and the store, so `idemproxy explain` runs the same code.

use super::body_read::BodyRead;
use super::readable::{readable, wildcard_host};
use super::side_read;
use crate::config::{Expected, Reconcile, Route, Upstream};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::key;
use crate::rules::body::{self, BodyKind};
use crate::rules::template::RequestView;
use crate::store::ScopedKey;
use bytes::Bytes;
use http::{HeaderMap, Method};
use serde_json::Value;

/// Most entities one request may lock.
pub const MAX_ENTITIES: usize = 100;
/// Longest entity name kept as is; longer ones are hashed.
pub const MAX_ENTITY_LEN: usize = 200;

/// Where the key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeySource {
    #[default]
    Header,
    Derived,
}

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

/// A request's reconcile read: the path, and the value each of the route's `expect` fields
/// must hold (in the route's order).
#[derive(Debug, Default)]
pub struct ReconcileRead {
    pub path: String,
    pub expect: Vec<Value>,
    /// The read whose body answers a found write (`reconcile.answer_path`).
    pub answer_path: Option<String>,
}

/// What to do with a mutating request, decided before its body is read.
pub enum KeyPlan {
    /// A client key from the header (already validated).
    Header(String),
    /// No client key (or an SDK's random one, kept as a fallback should the derivation lack a
    /// field): derive one from the template once the body is known.
    Derive(Option<String>),
    /// No key and none required: forward unprotected, streamed.
    Unprotected,
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
    let kind = BodyKind::of(input.headers);
    let parsed = match body::parse(kind, input.body) {
        Ok(v) => v,
        Err(e) if route.needs_body => return Err(ProxyError::new(ErrorKind::BodyInvalid, e)),
        // Nothing reads the body: it is fingerprinted as raw bytes.
        Err(_) => None,
    };
    let read = BodyRead {
        kind,
        parsed: parsed.is_some(),
        headers: input.headers,
        body: input.body,
    };
    if route.needs_body && parsed.is_none() {
        return Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            format!(
                "route {} reads the body, which must be JSON or a form: {}",
                route.name,
                read.said()
            ),
        ));
    }
    // A stamped body must take the stamp, or the key is refused before anything is reserved.
    let mut stamped = false;
    if let Some(field) = &route.stamp {
        let theirs = parsed
            .as_ref()
            .is_some_and(|b| field.values(b).iter().any(|v| !v.is_null()));
        stamped = !theirs;
        let fits = kind == BodyKind::Json && parsed.as_ref().is_some_and(|b| field.settable(b));
        if !fits {
            return Err(ProxyError::new(
                ErrorKind::BodyInvalid,
                format!(
                    "route {} stamps its key into body.{field}: the body must be a JSON object with room for it",
                    route.name
                ),
            ));
        }
    }
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
    let entities = match &route.entity {
        None => Vec::new(),
        Some(t) => {
            let e = t.eval(&view).map_err(|field| {
                ProxyError::new(
                    ErrorKind::EntityMissing,
                    format!(
                        "the entity needs {{{field}}}, which the request lacks{}",
                        read.note(&field)
                    ),
                )
            })?;
            // Long names (an id field someone filled with a document) become their hash, so
            // every store can index them; the count is bounded, as every entity is a lock.
            let mut e: Vec<String> = e
                .into_iter()
                .map(|name| key::bounded(name, MAX_ENTITY_LEN))
                .collect();
            e.sort();
            e.dedup();
            if e.len() > MAX_ENTITIES {
                return Err(ProxyError::new(
                    ErrorKind::BodyInvalid,
                    format!("the request names {} entities; at most {MAX_ENTITIES} are locked for one write", e.len()),
                ));
            }
            e
        }
    };
    let joined = entities.join(",");
    view.entity = (!entities.is_empty()).then_some(joined.as_str());
    let (key, key_source, window) = match plan {
        KeyPlan::Header(k) => (k, KeySource::Header, None),
        KeyPlan::Derive(fallback) => match (derive(route, &view), fallback) {
            (Ok((raw, window)), _) => (key::normalize_derived(raw), KeySource::Derived, window),
            // The request still carries the SDK's own key: better than refusing it.
            (Err(_), Some(k)) => (k, KeySource::Header, None),
            (Err(field), None) => {
                return Err(ProxyError::new(
                    ErrorKind::KeyMissing,
                    format!(
                        "the key is derived from {{{field}}}, which the request lacks{}",
                        read.note(&field)
                    ),
                ))
            }
        },
        KeyPlan::Unprotected => {
            return Err(ProxyError::new(
                ErrorKind::KeyMissing,
                format!("route {} takes no key", route.name),
            ))
        }
    };
    let version = match &route.version {
        None => None,
        Some(t) => {
            let text = t.eval_one(&view).map_err(|field| {
                ProxyError::new(
                    ErrorKind::VersionMissing,
                    format!(
                        "the version needs {{{field}}}, which the request lacks{}",
                        read.note(&field)
                    ),
                )
                .with_key(&key)
            })?;
            Some(text.trim().parse::<i64>().map_err(|_| {
                ProxyError::new(
                    ErrorKind::VersionMissing,
                    format!("the version {text:?} is not an integer"),
                )
                .with_key(&key)
            })?)
        }
    };
    let precheck_path = match &route.precheck {
        None => None,
        Some(pc) => Some(side_read::eval_path(&pc.path, &view, "precheck", &key)?),
    };
    // A read names one object: a batch of several (`{body.inputs[*].id}` with two ids) is
    // not reconciled, as one object found says nothing of the others.
    // A field of `unless` in the body: not reconciled.
    let present = |p: &crate::rules::body::BodyPath| {
        parsed
            .as_ref()
            .is_some_and(|b| p.values(b).iter().any(|v| !v.is_null()))
    };
    let excluded = |rc: &Reconcile| rc.unless.iter().any(present);
    let reconcile = match &route.reconcile {
        Some(rc) if excluded(rc) => None,
        Some(rc) if stamped || !rc.uses_stamp() => match rc.path.eval(&view).map(|v| v.len()) {
            Ok(n) if n > 1 => None,
            _ => Some(reconcile_read(rc, &view, &key)?),
        },
        _ => None,
    };
    let id = ScopedKey::new(
        upstream.name.clone(),
        scoper.scope_at(
            input.headers,
            &upstream.credentials,
            wildcard_host(upstream, input.host),
        ),
        key.clone(),
    );
    // Entity locks, versions and claims belong to the caller's credentials unless the
    // upstream shares them: another tenant's contact 42 is not ours.
    let entities = if upstream.share_entities {
        entities
    } else {
        let scope = key::entity_scope(&id.scope);
        entities
            .into_iter()
            .map(|e| format!("{e}@{scope}"))
            .collect()
    };
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

/// The key from the first derive template whose every field the request has, and the window
/// it is kept for when that template is the intent alone. `Err`: the first template's missing
/// field (the one a caller is told to send).
fn derive(
    route: &Route,
    view: &RequestView<'_>,
) -> Result<(String, Option<std::time::Duration>), String> {
    let mut first_missing = None;
    for t in &route.key.derive {
        match t.eval_one(view) {
            Ok(raw) => {
                let window = route.key.window.filter(|_| crate::config::intent_only(t));
                return Ok((raw, window));
            }
            Err(field) => {
                first_missing.get_or_insert(field);
            }
        }
    }
    Err(first_missing.unwrap_or_else(|| format!("route {} has no way to make a key", route.name)))
}

/// The reconcile read of this request: its path, and its expectations evaluated over the
/// original request. A retry has the same fingerprint, and expectations never read what the
/// fingerprint ignores (checked at load), so it asks the same question.
fn reconcile_read(rc: &Reconcile, view: &RequestView<'_>, key: &str) -> ProxyResult<ReconcileRead> {
    let path = side_read::eval_path(&rc.path, view, "reconcile", key)?;
    let expect = rc
        .expect
        .iter()
        .map(|(field, e)| match e {
            Expected::Value(v) => Ok(v.clone()),
            // One body field: its JSON value as the request sent it (an object: every field
            // in it must hold), less what the fingerprint ignores.
            Expected::Field { path, strip } => {
                let value = view.body.and_then(|b| path.values(b).into_iter().next().cloned());
                let mut value = value.filter(|v| !v.is_null()).ok_or_else(|| {
                    ProxyError::new(
                        ErrorKind::EntityMissing,
                        format!("reconcile.expect {field} needs {{body.{path}}}, which the request lacks"),
                    )
                    .with_key(key)
                })?;
                strip.iter().for_each(|p| p.remove(&mut value));
                Ok(value)
            }
            Expected::Template(t) => t.eval_one(view).map(Value::String).map_err(|missing| {
                ProxyError::new(
                    ErrorKind::EntityMissing,
                    format!(
                        "reconcile.expect {field} needs {{{missing}}}, which the request lacks"
                    ),
                )
                .with_key(key)
            }),
        })
        .collect::<ProxyResult<_>>()?;
    let answer_path = match &rc.answer_path {
        Some(t) => Some(side_read::eval_path(t, view, "reconcile answer", key)?),
        None => None,
    };
    Ok(ReconcileRead {
        path,
        expect,
        answer_path,
    })
}
