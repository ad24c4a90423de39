//! The parts of a request step 1 evaluates (its `prepare`), one function
//! each: whether the route's stamp goes into the body, the entities, the key, the version and
//! the reconcile read. Each refusal names the field the request lacks and how its body was read.

use super::body_read::BodyRead;
use super::side_read;
use crate::config::{Expected, Reconcile, Route};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::key;
use crate::rules::body::BodyKind;
use crate::rules::template::RequestView;
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

/// Whether the route's stamp goes into this body (`false`: the caller put its own value in the
/// field). A stamped body must take the stamp, or the key is refused before anything is
/// reserved.
pub(super) fn stamped(route: &Route, kind: BodyKind, parsed: Option<&Value>) -> ProxyResult<bool> {
    let Some(field) = &route.stamp else {
        return Ok(false);
    };
    let theirs = parsed.is_some_and(|b| field.values(b).iter().any(|v| !v.is_null()));
    let fits = kind == BodyKind::Json && parsed.is_some_and(|b| field.settable(b));
    if !fits {
        return Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            format!(
                "route {} stamps its key into body.{field}: the body must be a JSON object with room for it",
                route.name
            ),
        ));
    }
    Ok(!theirs)
}

/// The entities the request locks, sorted and without repeats. Long names (an id field someone
/// filled with a document) become their hash, so every store can index them; the count is
/// bounded, as every entity is a lock.
pub(super) fn entities(
    route: &Route,
    view: &RequestView<'_>,
    read: &BodyRead<'_>,
) -> ProxyResult<Vec<String>> {
    let Some(t) = &route.entity else {
        return Ok(Vec::new());
    };
    let names = t.eval(view).map_err(|field| {
        ProxyError::new(
            ErrorKind::EntityMissing,
            format!(
                "the entity needs {{{field}}}, which the request lacks{}",
                read.note(&field)
            ),
        )
    })?;
    let mut names: Vec<String> = names
        .into_iter()
        .map(|name| key::bounded(name, MAX_ENTITY_LEN))
        .collect();
    names.sort();
    names.dedup();
    if names.len() > MAX_ENTITIES {
        return Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            format!(
                "the request names {} entities; at most {MAX_ENTITIES} are locked for one write",
                names.len()
            ),
        ));
    }
    Ok(names)
}

/// The key, where it came from, and the window an intent-only key is kept for.
pub(super) fn key(
    route: &Route,
    plan: KeyPlan,
    view: &RequestView<'_>,
    read: &BodyRead<'_>,
) -> ProxyResult<(String, KeySource, Option<std::time::Duration>)> {
    match plan {
        KeyPlan::Header(k) => Ok((k, KeySource::Header, None)),
        KeyPlan::Derive(fallback) => match (derive(route, view), fallback) {
            (Ok((raw, window)), _) => Ok((key::normalize_derived(raw), KeySource::Derived, window)),
            // The request still carries the SDK's own key: better than refusing it.
            (Err(_), Some(k)) => Ok((k, KeySource::Header, None)),
            (Err(field), None) => Err(ProxyError::new(
                ErrorKind::KeyMissing,
                format!(
                    "the key is derived from {{{field}}}, which the request lacks{}",
                    read.note(&field)
                ),
            )),
        },
        KeyPlan::Unprotected => Err(ProxyError::new(
            ErrorKind::KeyMissing,
            format!("route {} takes no key", route.name),
        )),
    }
}

/// The version the request writes, an integer.
pub(super) fn version(
    route: &Route,
    view: &RequestView<'_>,
    read: &BodyRead<'_>,
    key: &str,
) -> ProxyResult<Option<i64>> {
    let Some(t) = &route.version else {
        return Ok(None);
    };
    let text = t.eval_one(view).map_err(|field| {
        ProxyError::new(
            ErrorKind::VersionMissing,
            format!(
                "the version needs {{{field}}}, which the request lacks{}",
                read.note(&field)
            ),
        )
        .with_key(key)
    })?;
    let version = text.trim().parse::<i64>().map_err(|_| {
        ProxyError::new(
            ErrorKind::VersionMissing,
            format!("the version {text:?} is not an integer"),
        )
        .with_key(key)
    })?;
    Ok(Some(version))
}

/// The reconcile read this request would get. Not for a request with a field of `unless`, nor
/// for one whose read names several objects (`{body.inputs[*].id}` with two ids: one object
/// found says nothing of the others), nor for one a stamp cannot find (its caller set the
/// stamp's field).
pub(super) fn reconcile(
    route: &Route,
    view: &RequestView<'_>,
    parsed: Option<&Value>,
    stamped: bool,
    key: &str,
) -> ProxyResult<Option<ReconcileRead>> {
    let Some(rc) = &route.reconcile else {
        return Ok(None);
    };
    let present = |p: &crate::rules::body::BodyPath| {
        parsed.is_some_and(|b| p.values(b).iter().any(|v| !v.is_null()))
    };
    if rc.unless.iter().any(present) || (!stamped && rc.uses_stamp()) {
        return Ok(None);
    }
    match rc.path.eval(view).map(|v| v.len()) {
        Ok(n) if n > 1 => Ok(None),
        _ => reconcile_read(rc, view, key).map(Some),
    }
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
