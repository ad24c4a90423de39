//! Compiling one `[[routes]]` entry: its parts in order ([`parts`]: methods, key rule,
//! fingerprint rule, claims, stamp), every template checked against what the route can provide
//! ([`Checker`]), and what the parts must agree on.

use super::compiler::Compiler;
use super::raw::*;
use super::route_parts as parts;
use super::side_reads::{precheck, reconcile};
use super::*;
use crate::rules::template::Source;
use std::collections::BTreeMap;
use toml::Spanned;

pub(super) fn route(
    cx: &mut Compiler,
    sp: &Spanned<RawRoute>,
    upstreams: &BTreeMap<String, Spanned<RawUpstream>>,
    store_retention: Duration,
) -> Option<Route> {
    let r = sp.get_ref();
    let errors_before = cx.errors.len();
    let name = cx.s(&r.name)?;
    let upstream = parts::upstream_name(cx, &name, r, upstreams)?;
    let methods = parts::methods(cx, &name, r);
    let path_text = cx.s(&r.path)?;
    let path = PathPattern::parse(&path_text)
        .map_err(|e| cx.err(r.path.span(), e))
        .ok()?;
    let checker = Checker {
        name: &name,
        path_text: &path_text,
        captures: path.captures().map(str::to_owned).collect(),
        stamped: r.stamp.is_some(),
    };
    let mut check = |cx: &mut Compiler, field: &str, v: &Str, entity: bool, fp: bool| {
        checker.check(cx, field, v, entity, fp)
    };
    let entity = r
        .entity
        .as_ref()
        .and_then(|e| check(cx, "entity", e, false, false));
    let version = r
        .version
        .as_ref()
        .and_then(|v| check(cx, "version", v, true, false));
    let raw_upstream = upstreams.get(&upstream).map(|u| u.get_ref());
    let key = parts::key_rule(cx, &name, sp, raw_upstream, entity.is_some(), &mut check);
    let mode = parts::mode(cx, r, raw_upstream);
    let fingerprint = parts::fingerprint_rule(cx, &r.fingerprint);
    let (claim, release_claim) = parts::claims(cx, &name, sp, entity.is_some());
    if version.is_some() && entity.is_none() {
        cx.err(
            sp.span(),
            format!("route {name:?}: version needs an entity"),
        );
    }
    let precheck = r
        .precheck
        .as_ref()
        .and_then(|p| precheck(cx, &name, p, &mut check));
    let ignored = &fingerprint.ignore;
    let reconcile = r
        .reconcile
        .as_ref()
        .and_then(|p| reconcile(cx, &name, p, &mut check, ignored));
    let retention = parts::retention(cx, r, store_retention);
    let mut route = Route {
        stamp: parts::stamp_field(cx, &name, &r.stamp),
        in_flight: parts::in_flight(cx, &r.in_flight),
        lock_timeout: cx.dur(&r.lock_timeout, Duration::from_secs(30)),
        read_only: r.read_only.unwrap_or(false),
        resend_unknown: r.resend_unknown.as_ref().is_some_and(|b| *b.get_ref()),
        needs_body: false,
        name,
        upstream,
        methods,
        path_text,
        path,
        entity,
        key,
        mode,
        fingerprint,
        version,
        claim,
        release_claim,
        precheck,
        reconcile,
        retention,
    };
    route.needs_body = route.reads_body();
    parts::consistent(cx, sp, &route);
    (cx.errors.len() == errors_before).then_some(route)
}

/// Checks each template against what its route can provide.
struct Checker<'a> {
    name: &'a str,
    path_text: &'a str,
    /// The path's captures (`{path.X}` must be one).
    captures: Vec<String>,
    /// The route has `stamp` (only a reconcile may read `{stamp}`, and only then).
    stamped: bool,
}

impl Checker<'_> {
    fn check(
        &self,
        cx: &mut Compiler,
        field: &str,
        v: &Str,
        allow_entity: bool,
        allow_fp: bool,
    ) -> Option<Template> {
        let t = cx.template(v)?;
        for src in t.sources() {
            let problem = match src {
                Source::Path(n) if !self.captures.contains(n) => Some(format!(
                    "{{path.{n}}}: the route path {:?} does not capture {n:?}",
                    self.path_text
                )),
                Source::Entity if !allow_entity => Some(format!("{field} cannot use {{entity}}")),
                Source::Fingerprint if !allow_fp => {
                    Some(format!("{field} cannot use {{fingerprint}}"))
                }
                Source::Stamp if !field.starts_with("reconcile.") || !self.stamped => {
                    Some(format!(
                        "{field} cannot use {{stamp}}: only a reconcile can, on a route with stamp"
                    ))
                }
                _ => None,
            };
            if let Some(p) = problem {
                cx.err(v.span(), format!("route {:?}: {p}", self.name));
            }
        }
        Some(t)
    }
}

impl Route {
    /// Every template the route evaluates over a request: entity, version, key derivations,
    /// the precheck's path, the reconcile's path and expectations.
    pub fn templates(&self) -> impl Iterator<Item = &Template> {
        let reconcile = self.reconcile.iter().flat_map(|r| {
            let expect = r.expect.iter().filter_map(|(_, e)| match e {
                super::Expected::Template(t) => Some(t),
                _ => None,
            });
            std::iter::once(&r.path).chain(expect)
        });
        self.entity
            .iter()
            .chain(&self.version)
            .chain(&self.key.derive)
            .chain(self.precheck.iter().map(|p| &p.path))
            .chain(reconcile)
    }
}
