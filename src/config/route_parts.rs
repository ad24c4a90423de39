//! The parts of a `[[routes]]` entry, each compiled on its own, and what they must agree on
//! (see [`super::routes::route`]).

use super::compiler::Compiler;
use super::raw::*;
use super::side_reads::Check;
use super::*;
use crate::rules::template::Source;
use std::collections::BTreeMap;
use toml::Spanned;

/// The route's upstream, which must be configured (else the known ones are listed).
pub(super) fn upstream_name(
    cx: &mut Compiler,
    name: &str,
    r: &RawRoute,
    upstreams: &BTreeMap<String, Spanned<RawUpstream>>,
) -> Option<String> {
    let upstream = cx.s(&r.upstream)?;
    if !upstreams.contains_key(&upstream) {
        let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
        let hint = match super::units::closest(&upstream, &known) {
            Some(near) => format!(" (did you mean {near:?}?)"),
            None => String::new(),
        };
        let list = match known.is_empty() {
            true => "none: add an [upstreams.NAME] table".to_owned(),
            false => known.join(", "),
        };
        cx.err(
            r.upstream.span(),
            format!(
                "route {name:?}: unknown upstream {upstream:?}{hint}; the upstreams are {list}"
            ),
        );
    }
    Some(upstream)
}

/// The methods it protects: unsafe ones only (safe methods always pass through).
pub(super) fn methods(cx: &mut Compiler, name: &str, r: &RawRoute) -> Vec<Method> {
    let Some(list) = &r.methods else {
        return Config::DEFAULT_METHODS.to_vec();
    };
    list.iter()
        .filter_map(|m| {
            let s = cx.s(m)?.to_ascii_uppercase();
            match Method::from_bytes(s.as_bytes()) {
                Ok(m) if m.is_safe() => {
                    cx.err(r.name.span(), format!("route {name:?}: {m} is a safe method; safe methods always pass through"));
                    None
                }
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
        .collect()
}

/// `key`: the header, the derivations (checked: `{entity}` needs an entity), whether a key is
/// required, and the dedupe window of intent-only keys.
pub(super) fn key_rule(
    cx: &mut Compiler,
    name: &str,
    sp: &Spanned<RawRoute>,
    upstream: Option<&RawUpstream>,
    has_entity: bool,
    check: &mut Check,
) -> KeyRule {
    let mut rule = KeyRule {
        header: Some(HeaderName::from_static("idempotency-key")),
        derive: KeyRule::default_derive(),
        required: true,
        window: None,
    };
    let Some(k) = &sp.get_ref().key else {
        return rule;
    };
    let k = k.get_ref();
    if let Some(h) = &k.header {
        rule.header = match cx.s(h) {
            Some(s) if s.is_empty() => None,
            _ => cx.header(h),
        };
    }
    if let Some(d) = &k.derive {
        rule.derive = Vec::new();
        // `derive = ""` turns derivation off.
        for d in derive_list(cx, name, d)
            .iter()
            .filter(|d| !d.get_ref().is_empty())
        {
            if !has_entity && d.get_ref().contains("{entity}") {
                cx.err(
                    d.span(),
                    format!(
                        "route {name:?}: key.derive uses {{entity}} but the route has no entity"
                    ),
                );
            }
            rule.derive
                .extend(check(cx, "key.derive", d, has_entity, true));
        }
    }
    if let Some(span) = k.window.as_ref().map(|w| w.span()) {
        let w = cx.dur(&k.window, Duration::ZERO);
        if w.is_zero() {
            cx.err(
                span.clone(),
                format!("route {name:?}: key.window must be longer than zero"),
            );
        }
        if !rule.derive.iter().any(intent_only) {
            cx.err(span.clone(), format!("route {name:?}: key.window applies to keys derived from the intent alone, and no key.derive template is (each reads a header)"));
        }
        // The upstream would replay the earlier action's answer under the same key.
        let native = upstream
            .and_then(|u| u.native_idempotency_header.as_ref())
            .is_some_and(|h| !h.get_ref().is_empty());
        if native {
            cx.err(span, format!("route {name:?}: key.window on an upstream that dedupes by the key we send (native_idempotency_header): it would answer a new action with the earlier one's answer; the upstream's own key retention is the window"));
        }
        rule.window = Some(w);
    }
    rule.required = k.required.unwrap_or(true);
    if rule.header.is_none() && rule.derive.is_empty() && rule.required {
        cx.err(
            sp.span(),
            format!("route {name:?}: key has neither header nor derive but is required"),
        );
    }
    rule
}

/// The route's mode, else its upstream's, else the default.
pub(super) fn mode(cx: &mut Compiler, r: &RawRoute, upstream: Option<&RawUpstream>) -> Mode {
    [r.mode.as_ref(), upstream.and_then(|u| u.mode.as_ref())]
        .into_iter()
        .flatten()
        .next()
        .and_then(|v| cx.mode(v))
        .unwrap_or_default()
}

/// How long the route's keys are kept: its own `retention`, else the store's.
pub(super) fn retention(cx: &mut Compiler, r: &RawRoute, store: Duration) -> Duration {
    r.retention
        .as_ref()
        .map_or(store, |_| cx.dur(&r.retention, Duration::ZERO))
}

/// `in_flight`: what a duplicate of a request still running gets.
pub(super) fn in_flight(cx: &mut Compiler, v: &Option<Str>) -> InFlight {
    match v.as_ref().and_then(|v| cx.s(v).map(|s| (s, v.span()))) {
        None => InFlight::Wait,
        Some((s, _)) if s == "wait" => InFlight::Wait,
        Some((s, _)) if s == "reject" => InFlight::Reject,
        Some((s, span)) => {
            cx.err(span, format!("in_flight = {s:?}: use wait or reject"));
            InFlight::Wait
        }
    }
}

/// `fingerprint`: the body fields it leaves out, and the headers it takes in.
pub(super) fn fingerprint_rule(cx: &mut Compiler, fp: &Option<RawFingerprint>) -> FingerprintRule {
    let mut rule = FingerprintRule::default();
    let Some(fp) = fp else {
        return rule;
    };
    for ig in &fp.ignore {
        let Some(s) = cx.s(ig) else { continue };
        match s.strip_prefix("body.").map(BodyPath::parse) {
            Some(Ok(p)) => rule.ignore.push(p),
            Some(Err(e)) => cx.err(ig.span(), e),
            None => cx.err(
                ig.span(),
                format!("fingerprint.ignore {s:?}: only body.* fields can be ignored"),
            ),
        }
    }
    rule.headers = fp.headers.iter().filter_map(|h| cx.header(h)).collect();
    rule
}

/// `claim` (with its `claim_ttl`, a day by default) and `release_claim`: both need an entity.
pub(super) fn claims(
    cx: &mut Compiler,
    name: &str,
    sp: &Spanned<RawRoute>,
    has_entity: bool,
) -> (Option<Duration>, bool) {
    let r = sp.get_ref();
    let claim = r.claim.unwrap_or(false);
    let ttl = match &r.claim_ttl {
        Some(t) if !claim => {
            cx.err(
                t.span(),
                format!("route {name:?}: claim_ttl needs claim = true"),
            );
            None
        }
        Some(_) => Some(cx.dur(&r.claim_ttl, Duration::ZERO)),
        None => None,
    };
    let release_claim = r.release_claim.unwrap_or(false);
    if (claim || release_claim) && !has_entity {
        cx.err(
            sp.span(),
            format!("route {name:?}: claim and release_claim need an entity"),
        );
    }
    let day = Duration::from_secs(86_400);
    (claim.then(|| ttl.unwrap_or(day)), release_claim)
}

/// `stamp`: one body field, not through `[*]`.
pub(super) fn stamp_field(cx: &mut Compiler, name: &str, v: &Option<Str>) -> Option<BodyPath> {
    let v = v.as_ref()?;
    let text = cx.s(v)?;
    let parsed = match text.strip_prefix("body.").map(BodyPath::parse) {
        Some(Ok(p)) if !p.0.contains(&crate::rules::body::Step::All) => Ok(p),
        Some(Ok(_)) => Err(format!("stamp {text:?}: one field, not [*]")),
        Some(Err(e)) => Err(e),
        None => Err(format!(
            "stamp {text:?}: a body field, e.g. \"body.ticket.external_id\""
        )),
    };
    parsed
        .map_err(|e| cx.err(v.span(), format!("route {name:?}: {e}")))
        .ok()
}

/// What the parts must agree on: a read-only route keys and locks nothing; a lost answer is
/// settled by a reconcile read or by sending again, not both.
pub(super) fn consistent(cx: &mut Compiler, sp: &Spanned<RawRoute>, route: &Route) {
    let name = &route.name;
    let keyed = route.entity.is_some()
        || route.version.is_some()
        || route.claim.is_some()
        || route.release_claim
        || route.precheck.is_some()
        || route.reconcile.is_some()
        || route.stamp.is_some()
        || sp.get_ref().key.is_some();
    if route.read_only && keyed {
        cx.err(sp.span(), format!("route {name:?}: a read_only route is never keyed or locked: it takes no key, entity, version, claim, precheck, reconcile or stamp"));
    }
    let resend = sp
        .get_ref()
        .resend_unknown
        .as_ref()
        .filter(|b| *b.get_ref());
    if let (Some(b), true) = (resend, route.reconcile.is_some()) {
        cx.err(b.span(), format!("route {name:?}: resend_unknown and reconcile both settle a lost answer: keep one (reconcile reads before sending again; resend_unknown is for writes the API applies idempotently)"));
    }
}

impl Route {
    /// Whether some template or rule reads the body (which must then parse).
    pub(super) fn reads_body(&self) -> bool {
        let body = |s: &Source| matches!(s, Source::Body(_));
        let uses = |t: &Option<Template>| t.as_ref().is_some_and(|t| t.uses(body));
        uses(&self.entity)
            || uses(&self.version)
            || self.key.derive.iter().any(|t| t.uses(body))
            || self.precheck.as_ref().is_some_and(|p| p.path.uses(body))
            || self.reconcile.as_ref().is_some_and(|r| r.reads_body())
            || !self.fingerprint.ignore.is_empty()
            || self.stamp.is_some()
    }
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

/// A derive template that reads no header: the key is the intent alone (route, entity,
/// fingerprint, body fields), so the same call from anyone, at any time, makes it.
pub fn intent_only(t: &Template) -> bool {
    !t.uses(|s| matches!(s, Source::Header(_)))
}
