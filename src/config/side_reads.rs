//! The reads a route sends to the real system on its own: the precheck, right before a write,
//! and the reconcile, when a write's answer was lost. Both are GET/HEAD reads with a path
//! template over the original request and expectations on the answer's JSON body.

use super::compiler::Compiler;
use super::raw::*;
use super::*;
use crate::rules::template::Source;
use toml::Spanned;

pub(super) type Check<'a> =
    dyn FnMut(&mut Compiler, &str, &Str, bool, bool) -> Option<Template> + 'a;

pub(super) fn precheck(
    cx: &mut Compiler,
    name: &str,
    sp: &Spanned<RawPrecheck>,
    check: &mut Check,
) -> Option<Precheck> {
    let p = sp.get_ref();
    let method = read_method(cx, name, "precheck", &p.method)?;
    let path = check(cx, "precheck.path", &p.path, true, false)?;
    let expect_status = statuses(cx, &p.expect_status).unwrap_or_else(|| vec![200]);
    let expect_status = match expect_status.is_empty() {
        true => vec![200],
        false => expect_status,
    };
    no_body_to_check(
        cx,
        name,
        "precheck",
        &method,
        !p.expect.is_empty(),
        sp.span(),
    );
    let mut expect = Vec::new();
    for (field, value) in &p.expect {
        let json = serde_json::to_value(value.get_ref()).ok();
        if let (Some(path), Some(v)) = (body_field(cx, "precheck", field, value), json) {
            expect.push((path, v));
        }
    }
    Some(Precheck {
        method,
        path,
        expect_status,
        expect,
    })
}

/// `ignored`: the route's `fingerprint.ignore`, which an expectation must not depend on.
pub(super) fn reconcile(
    cx: &mut Compiler,
    name: &str,
    sp: &Spanned<RawReconcile>,
    check: &mut Check,
    ignored: &[BodyPath],
) -> Option<Reconcile> {
    let r = sp.get_ref();
    let method = read_method(cx, name, "reconcile", &r.method)?;
    let path = check(cx, "reconcile.path", &r.path, true, false)?;
    no_body_to_check(
        cx,
        name,
        "reconcile",
        &method,
        !r.expect.is_empty(),
        sp.span(),
    );
    let (found, not_found) = found_statuses(cx, name, sp);
    let answer_status = r.answer_status.as_ref().and_then(|s| {
        let ok = u16::try_from(*s.get_ref())
            .ok()
            .filter(|c| (200..300).contains(c));
        if ok.is_none() {
            let msg = format!(
                "reconcile.answer_status {} is not a 2xx status",
                s.get_ref()
            );
            cx.err(s.span(), msg);
        }
        ok
    });
    Some(Reconcile {
        method,
        path,
        found,
        not_found,
        answer_status,
        after: reconcile_after(cx, name, &r.after),
        expect: expectations(cx, name, r, check, ignored),
        answer: r.answer.as_ref().and_then(|a| answer(cx, name, a)),
        answer_path: r
            .answer_path
            .as_ref()
            .and_then(|p| check(cx, "reconcile.answer_path", p, true, false)),
        unless: unless_fields(cx, name, r),
    })
}

/// `found` (default `[200]`, never empty) and `not_found` (default `[404]`; empty is
/// meaningful: no answer releases the key, it is found or stays unknown), with no status in
/// both.
fn found_statuses(
    cx: &mut Compiler,
    name: &str,
    sp: &Spanned<RawReconcile>,
) -> (Vec<u16>, Vec<u16>) {
    let r = sp.get_ref();
    let found = statuses(cx, &r.found).unwrap_or_else(|| vec![200]);
    if found.is_empty() {
        cx.err(sp.span(), format!("route {name:?}: reconcile.found is empty: no answer could ever say the write happened"));
    }
    let not_found = statuses(cx, &r.not_found).unwrap_or_else(|| vec![404]);
    if let Some(both) = found.iter().find(|s| not_found.contains(s)) {
        cx.err(
            sp.span(),
            format!("route {name:?}: reconcile status {both} is in both found and not_found"),
        );
    }
    (found, not_found)
}

/// `expect`: each body field of the read's answer and the value it must hold — as written, or
/// a template over the original request (`"{body.properties.firstname}"`).
fn expectations(
    cx: &mut Compiler,
    name: &str,
    r: &RawReconcile,
    check: &mut Check,
    ignored: &[BodyPath],
) -> Vec<(BodyPath, Expected)> {
    let mut expect = Vec::new();
    for (field, value) in &r.expect {
        let Some(path) = body_field(cx, "reconcile", field, value) else {
            continue;
        };
        let expected = match value.get_ref() {
            toml::Value::String(s) => {
                let text = Spanned::new(value.span(), s.clone());
                check(cx, "reconcile.expect", &text, true, false)
                    .and_then(|t| expected(cx, name, t, ignored, value.span()))
            }
            other => serde_json::to_value(other).ok().map(Expected::Value),
        };
        if let Some(e) = expected {
            expect.push((path, e));
        }
    }
    expect
}

/// `unless`: body fields whose presence leaves a request unreconciled.
fn unless_fields(cx: &mut Compiler, name: &str, r: &RawReconcile) -> Vec<BodyPath> {
    let field = |cx: &mut Compiler, u: &Str| {
        let text = cx.s(u)?;
        match text.strip_prefix("body.").map(BodyPath::parse) {
            Some(Ok(p)) => Some(p),
            _ => {
                let msg = format!("route {name:?}: reconcile.unless {text:?}: a body field, e.g. \"body.ticket.comment\"");
                cx.err(u.span(), msg);
                None
            }
        }
    };
    r.unless
        .iter()
        .flatten()
        .filter_map(|u| field(cx, u))
        .collect()
}

/// A template expectation, checked against `fingerprint.ignore`: retries of one write share a
/// fingerprint, not the fields it ignores, so an expectation that reads such a field would ask
/// each retry another question (and a create might be sent twice). One that *contains* ignored
/// fields (`{body.properties}` with `body.properties.last_synced_at` ignored) leaves them out.
fn expected(
    cx: &mut Compiler,
    name: &str,
    t: Template,
    ignored: &[BodyPath],
    span: std::ops::Range<usize>,
) -> Option<Expected> {
    let covered = |p: &BodyPath| ignored.iter().any(|ig| p.0.starts_with(&ig.0));
    if let Some(p) = t.sources().find_map(|s| match s {
        Source::Body(p) if covered(p) => Some(p.clone()),
        _ => None,
    }) {
        cx.err(
            span,
            format!("route {name:?}: reconcile.expect reads {{body.{p}}}, which fingerprint.ignore leaves out: retries of one write could expect different values"),
        );
        return None;
    }
    let Some(path) = t.only_body_field().cloned() else {
        return Some(Expected::Template(t));
    };
    let strip = ignored
        .iter()
        .filter(|ig| ig.0.len() > path.0.len() && ig.0.starts_with(&path.0))
        .map(|ig| BodyPath(ig.0[path.0.len()..].to_vec()))
        .collect();
    Some(Expected::Field { path, strip })
}

/// Most `reconcile.after`: the proxy holds the write's entity locks (and a retry waits) that
/// long, so a typo like `"2h"` for `"2s"` is refused rather than stalling the entity.
const MAX_AFTER: Duration = Duration::from_secs(600);

fn reconcile_after(cx: &mut Compiler, name: &str, after: &Option<Str>) -> Duration {
    let d = cx.dur(after, Duration::from_secs(1));
    if d > MAX_AFTER {
        let span = after.as_ref().map(|a| a.span()).unwrap_or(0..0);
        cx.err(
            span,
            format!("route {name:?}: reconcile.after is at most {MAX_AFTER:?}: the entity stays locked that long"),
        );
    }
    d
}

impl Reconcile {
    /// Whether its path or expectations read the request body (which must then parse).
    pub fn reads_body(&self) -> bool {
        let body = |s: &Source| matches!(s, Source::Body(_));
        !self.unless.is_empty()
            || self.path.uses(body)
            || self.answer_path.as_ref().is_some_and(|t| t.uses(body))
            || self.expect.iter().any(|(_, e)| match e {
                Expected::Template(t) => t.uses(body),
                Expected::Field { .. } => true,
                Expected::Value(_) => false,
            })
    }

    /// Whether a read or an expectation names `{stamp}`: a request that carries its caller's
    /// own value in the stamp's field cannot be found by the stamp, and is not reconciled.
    pub fn uses_stamp(&self) -> bool {
        let stamp = |s: &Source| *s == Source::Stamp;
        self.path.uses(stamp)
            || self.answer_path.as_ref().is_some_and(|t| t.uses(stamp))
            || self.expect.iter().any(|(_, e)| match e {
                Expected::Template(t) => t.uses(stamp),
                _ => false,
            })
    }
}

/// GET unless said otherwise, or HEAD: these reads must change nothing and answer with the
/// resource (OPTIONS and TRACE say nothing of it).
fn read_method(cx: &mut Compiler, name: &str, what: &str, m: &Option<Str>) -> Option<Method> {
    let Some(m) = m else {
        return Some(Method::GET);
    };
    let s = cx.s(m)?.to_ascii_uppercase();
    match Method::from_bytes(s.as_bytes()) {
        Ok(m) if m == Method::GET || m == Method::HEAD => Some(m),
        _ => {
            cx.err(
                m.span(),
                format!("route {name:?}: {what} method must be GET or HEAD, not {s:?}"),
            );
            None
        }
    }
}

/// A HEAD answer has no body: expectations on it could never hold (on a reconcile, every
/// write would count as not found and be sent again).
fn no_body_to_check(
    cx: &mut Compiler,
    name: &str,
    what: &str,
    method: &Method,
    expects: bool,
    span: std::ops::Range<usize>,
) {
    if expects && method == Method::HEAD {
        cx.err(
            span,
            format!("route {name:?}: {what}.expect needs a body: use GET, not HEAD"),
        );
    }
}

/// A list of HTTP statuses; `None` when absent.
fn statuses(cx: &mut Compiler, v: &Option<Vec<Spanned<i64>>>) -> Option<Vec<u16>> {
    let given: Vec<u16> = v
        .iter()
        .flatten()
        .filter_map(|s| match u16::try_from(*s.get_ref()) {
            Ok(c) if (100..=599).contains(&c) => Some(c),
            _ => {
                cx.err(s.span(), format!("{} is not an HTTP status", s.get_ref()));
                None
            }
        })
        .collect();
    v.as_ref().map(|_| given)
}

/// An `expect` key: a `body.*` field.
fn body_field(
    cx: &mut Compiler,
    what: &str,
    field: &str,
    value: &Spanned<toml::Value>,
) -> Option<BodyPath> {
    match field.strip_prefix("body.").map(BodyPath::parse) {
        Some(Ok(path)) => Some(path),
        Some(Err(e)) => {
            cx.err(value.span(), e);
            None
        }
        None => {
            cx.err(
                value.span(),
                format!("{what}.expect {field:?}: keys must be body.* fields"),
            );
            None
        }
    }
}

/// `reconcile.answer`: TOML as JSON, its `"{read}"` / `"{read.X}"` strings checked.
fn answer(cx: &mut Compiler, name: &str, a: &Spanned<toml::Value>) -> Option<serde_json::Value> {
    let json = serde_json::to_value(a.get_ref()).ok()?;
    let mut bad = Vec::new();
    crate::rules::shape::visit_reads(&json, &mut |p| {
        if let Err(e) = p {
            bad.push(e);
        }
    });
    for e in &bad {
        cx.err(a.span(), format!("route {name:?}: reconcile.answer: {e}"));
    }
    bad.is_empty().then_some(json)
}
