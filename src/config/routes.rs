//! Compiling one `[[routes]]` entry: methods, path pattern, templates checked against what the
//! route can provide, key rule, fingerprint rule, ordered-persistence fields, precheck.

use super::compiler::Compiler;
use super::raw::*;
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
    let upstream = cx.s(&r.upstream)?;
    if !upstreams.contains_key(&upstream) {
        let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
        let hint = match super::units::closest(&upstream, &known) {
            Some(near) => format!(" (did you mean {near:?}?)"),
            None => String::new(),
        };
        cx.err(
            r.upstream.span(),
            format!(
                "route {name:?}: unknown upstream {upstream:?}{hint}; the upstreams are {}",
                match known.is_empty() {
                    true => "none: add an [upstreams.NAME] table".to_owned(),
                    false => known.join(", "),
                }
            ),
        );
    }
    let methods = match &r.methods {
        None => Config::DEFAULT_METHODS.to_vec(),
        Some(list) => list
            .iter()
            .filter_map(|m| {
                let s = cx.s(m)?.to_ascii_uppercase();
                match Method::from_bytes(s.as_bytes()) {
                    Ok(m) if m.is_safe() => None.or_else(|| {
                        cx.err(r.name.span(), format!("route {name:?}: {m} is a safe method; safe methods always pass through"));
                        None
                    }),
                    Ok(m) if m == Method::CONNECT => {
                        cx.err(r.name.span(), format!("route {name:?}: CONNECT is not proxied"));
                        None
                    }
                    Ok(m) => Some(m),
                    Err(_) => {
                        cx.err(m.span(), format!("{s:?} is not an HTTP method"));
                        None
                    }
                }
            })
            .collect(),
    };
    let path_text = cx.s(&r.path)?;
    let path = PathPattern::parse(&path_text)
        .map_err(|e| cx.err(r.path.span(), e))
        .ok()?;
    let captures: Vec<String> = path.captures().map(str::to_owned).collect();

    // Every template is checked against what this route can provide.
    let mut check =
        |cx: &mut Compiler, field: &str, v: &Str, allow_entity: bool, allow_fp: bool| {
            let t = cx.template(v)?;
            for src in t.sources() {
                let problem = match src {
                    Source::Path(n) if !captures.contains(n) => Some(format!(
                        "{{path.{n}}}: the route path {path_text:?} does not capture {n:?}"
                    )),
                    Source::Entity if !allow_entity => {
                        Some(format!("{field} cannot use {{entity}}"))
                    }
                    Source::Fingerprint if !allow_fp => {
                        Some(format!("{field} cannot use {{fingerprint}}"))
                    }
                    Source::Stamp if !field.starts_with("reconcile.") || r.stamp.is_none() => {
                        Some(format!(
                        "{field} cannot use {{stamp}}: only a reconcile can, on a route with stamp"
                    ))
                    }
                    _ => None,
                };
                if let Some(p) = problem {
                    cx.err(v.span(), format!("route {name:?}: {p}"));
                }
            }
            Some(t)
        };
    let entity = r
        .entity
        .as_ref()
        .and_then(|e| check(cx, "entity", e, false, false));
    let version = r
        .version
        .as_ref()
        .and_then(|v| check(cx, "version", v, true, false));
    let (mut key_header, mut derive, mut required) = (
        Some(HeaderName::from_static("idempotency-key")),
        Vec::new(),
        true,
    );
    let mut derive_given = false;
    let mut window = None;
    if let Some(k) = &r.key {
        let k = k.get_ref();
        if let Some(h) = &k.header {
            key_header = match cx.s(h) {
                Some(s) if s.is_empty() => None,
                _ => cx.header(h),
            };
        }
        if let Some(d) = &k.derive {
            derive_given = true;
            for d in derive_list(cx, &name, d) {
                let d = &d;
                // `derive = ""` turns derivation off.
                if d.get_ref().is_empty() {
                    continue;
                }
                if entity.is_none() && d.get_ref().contains("{entity}") {
                    cx.err(
                        d.span(),
                        format!("route {name:?}: key.derive uses {{entity}} but the route has no entity"),
                    );
                }
                derive.extend(check(cx, "key.derive", d, entity.is_some(), true));
            }
        }
        if k.window.is_some() {
            let w = cx.dur(&k.window, Duration::ZERO);
            if w.is_zero() {
                cx.err(
                    k.window.as_ref().map(|w| w.span()).unwrap_or(0..0),
                    format!("route {name:?}: key.window must be longer than zero"),
                );
            }
            if !derive.iter().any(intent_only) {
                cx.err(
                    k.window.as_ref().map(|w| w.span()).unwrap_or(0..0),
                    format!("route {name:?}: key.window applies to keys derived from the intent alone, and no key.derive template is (each reads a header)"),
                );
            }
            // The upstream would replay the earlier action's answer under the same key.
            let native = upstreams
                .get(&upstream)
                .and_then(|u| u.get_ref().native_idempotency_header.as_ref())
                .is_some_and(|h| !h.get_ref().is_empty());
            if native {
                cx.err(
                    k.window.as_ref().map(|w| w.span()).unwrap_or(0..0),
                    format!("route {name:?}: key.window on an upstream that dedupes by the key we send (native_idempotency_header): it would answer a new action with the earlier one's answer; the upstream's own key retention is the window"),
                );
            }
            window = Some(w);
        }
        required = k.required.unwrap_or(true);
    }
    if !derive_given {
        derive = KeyRule::default_derive();
    }
    if key_header.is_none() && derive.is_empty() && required {
        cx.err(
            sp.span(),
            format!("route {name:?}: key has neither header nor derive but is required"),
        );
    }
    let in_flight = match r
        .in_flight
        .as_ref()
        .and_then(|v| cx.s(v).map(|s| (s, v.span())))
    {
        None => InFlight::Wait,
        Some((s, _)) if s == "wait" => InFlight::Wait,
        Some((s, _)) if s == "reject" => InFlight::Reject,
        Some((s, span)) => {
            cx.err(span, format!("in_flight = {s:?}: use wait or reject"));
            InFlight::Wait
        }
    };
    // The route's mode wins over its upstream's.
    let mode = [
        r.mode.as_ref(),
        upstreams
            .get(&upstream)
            .and_then(|u| u.get_ref().mode.as_ref()),
    ]
    .into_iter()
    .flatten()
    .next()
    .and_then(|v| cx.mode(v))
    .unwrap_or_default();
    let mut fingerprint = FingerprintRule::default();
    if let Some(fp) = &r.fingerprint {
        for ig in &fp.ignore {
            let Some(s) = cx.s(ig) else { continue };
            match s.strip_prefix("body.").map(BodyPath::parse) {
                Some(Ok(p)) => fingerprint.ignore.push(p),
                Some(Err(e)) => cx.err(ig.span(), e),
                None => cx.err(
                    ig.span(),
                    format!("fingerprint.ignore {s:?}: only body.* fields can be ignored"),
                ),
            }
        }
        fingerprint.headers = fp.headers.iter().filter_map(|h| cx.header(h)).collect();
    }
    let claim = r.claim.unwrap_or(false);
    let claim_ttl = match &r.claim_ttl {
        Some(_) => Some(cx.dur(&r.claim_ttl, Duration::ZERO)),
        None if claim => Some(Duration::from_secs(86_400)),
        None => None,
    };
    if r.claim_ttl.is_some() && !claim {
        cx.err(
            r.claim_ttl.as_ref().map(|c| c.span()).unwrap_or(0..0),
            format!("route {name:?}: claim_ttl needs claim = true"),
        );
    }
    let release_claim = r.release_claim.unwrap_or(false);
    if (claim || release_claim) && entity.is_none() {
        cx.err(
            sp.span(),
            format!("route {name:?}: claim and release_claim need an entity"),
        );
    }
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
    let reconcile = r
        .reconcile
        .as_ref()
        .and_then(|p| reconcile(cx, &name, p, &mut check, &fingerprint.ignore));
    let retention = r
        .retention
        .as_ref()
        .map_or(store_retention, |_| cx.dur(&r.retention, Duration::ZERO));
    let stamp = r.stamp.as_ref().and_then(|s| {
        let text = cx.s(s)?;
        let parsed = match text.strip_prefix("body.").map(BodyPath::parse) {
            Some(Ok(p)) if !p.0.contains(&crate::rules::body::Step::All) => Ok(p),
            Some(Ok(_)) => Err(format!("stamp {text:?}: one field, not [*]")),
            Some(Err(e)) => Err(e),
            None => Err(format!(
                "stamp {text:?}: a body field, e.g. \"body.ticket.external_id\""
            )),
        };
        parsed
            .map_err(|e| cx.err(s.span(), format!("route {name:?}: {e}")))
            .ok()
    });
    let uses_body = |t: &Option<Template>| {
        t.as_ref()
            .is_some_and(|t| t.uses(|s| matches!(s, Source::Body(_))))
    };
    let needs_body = uses_body(&entity)
        || uses_body(&version)
        || derive
            .iter()
            .any(|t| t.uses(|s| matches!(s, Source::Body(_))))
        || precheck
            .as_ref()
            .is_some_and(|p| p.path.uses(|s| matches!(s, Source::Body(_))))
        || reconcile.as_ref().is_some_and(|r| r.reads_body())
        || !fingerprint.ignore.is_empty()
        || stamp.is_some();
    let read_only = r.read_only.unwrap_or(false);
    if read_only
        && (entity.is_some()
            || version.is_some()
            || claim
            || release_claim
            || precheck.is_some()
            || reconcile.is_some()
            || stamp.is_some()
            || r.key.is_some())
    {
        cx.err(
            sp.span(),
            format!("route {name:?}: a read_only route is never keyed or locked: it takes no key, entity, version, claim, precheck, reconcile or stamp"),
        );
    }
    let resend_unknown = r.resend_unknown.as_ref().is_some_and(|b| *b.get_ref());
    if let Some(b) = r.resend_unknown.as_ref().filter(|b| *b.get_ref()) {
        if reconcile.is_some() {
            cx.err(
                b.span(),
                format!("route {name:?}: resend_unknown and reconcile both settle a lost answer: keep one (reconcile reads before sending again; resend_unknown is for writes the API applies idempotently)"),
            );
        }
    }
    if cx.errors.len() > errors_before {
        return None;
    }
    Some(Route {
        name,
        upstream,
        methods,
        path_text,
        path,
        entity,
        key: KeyRule {
            header: key_header,
            derive,
            required,
            window,
        },
        in_flight,
        mode,
        lock_timeout: cx.dur(&r.lock_timeout, Duration::from_secs(30)),
        fingerprint,
        version,
        claim: claim.then(|| claim_ttl.unwrap_or(Duration::from_secs(86_400))),
        release_claim,
        precheck,
        reconcile,
        retention,
        needs_body,
        read_only,
        stamp,
        resend_unknown,
    })
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

/// A derive template that reads no header: the key is the intent alone (route, entity,
/// fingerprint, body fields), so the same call from anyone, at any time, makes it.
pub fn intent_only(t: &Template) -> bool {
    !t.uses(|s| matches!(s, Source::Header(_)))
}

/// `derive = "…"` or `derive = ["…", "…"]`, each given the setting's span.
fn derive_list(cx: &mut Compiler, name: &str, d: &Spanned<toml::Value>) -> Vec<Str> {
    let span = d.span();
    let one = |v: &toml::Value| v.as_str().map(|s| Spanned::new(span.clone(), s.to_owned()));
    let list: Option<Vec<Str>> = match d.get_ref() {
        toml::Value::Array(items) => items.iter().map(one).collect(),
        v => one(v).map(|s| vec![s]),
    };
    list.unwrap_or_else(|| {
        cx.err(
            span.clone(),
            format!("route {name:?}: key.derive must be a template or a list of templates"),
        );
        Vec::new()
    })
}
