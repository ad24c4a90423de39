//! `idemproxy explain`: the pipeline's step 1 and the router, as a dry run — no network, no
//! store. It runs the same code as the server ([`crate::server::router::resolve`], [`crate::pipeline::prepare`]).

use crate::config::{Config, Route, Upstream};
use crate::pipeline::prepare::{self, Input, KeyPlan, KeySource};
use crate::server::router::{resolve, Action, Listener};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use std::fmt::Write;

/// Explains what the proxy would do with a request; `Err` for unusable arguments.
pub fn explain(
    config: &Config,
    method: &str,
    url: &str,
    headers: &[String],
    body: Option<Bytes>,
) -> Result<String, String> {
    let (method, uri, hm) = arguments(method, url, headers)?;
    let body = body.unwrap_or_default();
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "request:     {method} {url}");
    // The body is read as the proxy reads it, by its Content-Type alone: a dry run that
    // guessed would call protected what the proxy refuses.
    if !hm.contains_key(http::header::CONTENT_TYPE) && !body.is_empty() {
        let _ = writeln!(
            w,
            "note:        no Content-Type: the proxy reads this body as neither JSON nor a form; add -H 'Content-Type: ...' as your client sends it"
        );
    }
    let (upstream, rel, action) = match resolve(config, &Listener::Main, &method, uri.path()) {
        Ok(r) => r,
        Err(e) => return Ok(refused(out, &e)),
    };
    let pq = match uri.query() {
        Some(q) => format!("{}{rel}?{q}", upstream.base_path),
        None => format!("{}{rel}", upstream.base_path),
    };
    let _ = writeln!(
        w,
        "upstream:    {} -> {}://{}{pq}",
        upstream.name, upstream.scheme, upstream.authority
    );
    let (route, params) = match action {
        Action::Passthrough => {
            let _ = writeln!(
                w,
                "outcome:     passthrough (streamed, unlocked, unrecorded)"
            );
            return Ok(out);
        }
        Action::Protect(route, params) => (route, params),
    };
    let _ = writeln!(w, "route:       {}", route.summary());
    let plan = match prepare::plan_key(&upstream, &route, &hm) {
        Ok(KeyPlan::Unprotected) => {
            let _ = writeln!(
                w,
                "outcome:     no key and none required: passthrough, unprotected"
            );
            return Ok(out);
        }
        Ok(plan) => plan,
        Err(e) => return Ok(refused(out, &e)),
    };
    if body.len() > config.server.max_body {
        let _ = writeln!(w, "outcome:     refused: 413 body_too_large");
        return Ok(out);
    }
    let input = Input {
        method: &method,
        path: rel,
        query: uri.query(),
        headers: &hm,
        body: &body,
        path_params: &params,
        host: None,
    };
    let scoping = Scoping::of(config);
    let p = match prepare::prepare(&upstream, &route, plan, &input, &scoping.keyer) {
        Ok(p) => p,
        Err(e) => return Ok(refused(out, &e)),
    };
    key_lines(w, &upstream, &hm, &p, &scoping);
    rule_lines(w, &route, &upstream, &p);
    Ok(out)
}

/// The method, the path and the headers, as the server would take them.
fn arguments(
    method: &str,
    url: &str,
    headers: &[String],
) -> Result<(Method, http::Uri, HeaderMap), String> {
    let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("{method:?} is not an HTTP method"))?;
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("{url:?} is not a path: {e}"))?;
    let mut hm = HeaderMap::new();
    for h in headers {
        let (n, v) = h
            .split_once(':')
            .ok_or_else(|| format!("header {h:?} must look like 'Name: value'"))?;
        let name = HeaderName::from_bytes(n.trim().as_bytes())
            .map_err(|_| format!("bad header name {n:?}"))?;
        let value =
            HeaderValue::from_str(v.trim()).map_err(|_| format!("bad header value in {h:?}"))?;
        hm.append(name, value);
    }
    // As the server does: what is never forwarded decides nothing.
    crate::upstream::strip_hop_by_hop(&mut hm);
    Ok((method, uri, hm))
}

/// What keys the scopes here. The running proxy keys them with the secret its store recorded;
/// explain reads no store, so it takes the first candidate (the one a new store records) and
/// says when the store may use another. With none yet (SQLite's file not made), a placeholder
/// shows the shape, not the value.
struct Scoping {
    keyer: crate::key::ScopeKeyer,
    by: Option<String>,
    others: usize,
}

impl Scoping {
    fn of(config: &Config) -> Scoping {
        let candidates = crate::scope_secret::candidates(&config.store, false).unwrap_or_default();
        let others = candidates.len().saturating_sub(1);
        match candidates.into_iter().next() {
            Some(c) => Scoping {
                keyer: c.keyer,
                by: Some(c.source.to_string()),
                others,
            },
            None => Scoping {
                keyer: crate::key::ScopeKeyer::new(b"explain-placeholder"),
                by: None,
                others,
            },
        }
    }
}

/// The key, its scope and the credentials that make it, the fingerprint, the entities.
fn key_lines(
    w: &mut String,
    upstream: &Upstream,
    hm: &HeaderMap,
    p: &prepare::Prepared,
    scoping: &Scoping,
) {
    let source = match (p.key_source, p.window) {
        (KeySource::Header, _) => "from the client's header".to_owned(),
        (KeySource::Derived, None) => "derived".to_owned(),
        (KeySource::Derived, Some(win)) => {
            let win = crate::config::units::show_duration(win);
            format!("derived from the intent alone: a retry for {win} after its answer")
        }
    };
    let _ = writeln!(w, "key:         {} ({source})", p.key);
    let creds: Vec<String> = upstream
        .credentials
        .iter()
        .filter(|n| hm.contains_key(*n))
        .map(|n| n.to_string())
        .collect();
    let note = match (&scoping.by, scoping.others) {
        (None, _) => " (keyed with a placeholder: the store has no secret yet)".to_owned(),
        (Some(_), 0) => String::new(),
        (Some(by), n) => format!(
            " (keyed by {by}; a store first written under one of the {n} other candidate secret(s) keys it with that one)"
        ),
    };
    let _ = writeln!(w, "scope:       {}{note}", p.id.scope);
    let creds = match creds.is_empty() {
        true => "none (every caller without credentials shares one scope)".to_owned(),
        false => creds.join(", "),
    };
    let _ = writeln!(w, "credentials: {creds}");
    let _ = writeln!(w, "fingerprint: {}", p.fingerprint);
    let entities = match p.entities.is_empty() {
        true => "(none: no entity lock)".to_owned(),
        false => p.entities.join(", "),
    };
    let _ = writeln!(w, "entities:    {entities}");
}

/// The rules the route adds (version, claim, precheck, reconcile, the native key) and the
/// outcome.
fn rule_lines(w: &mut String, route: &Route, upstream: &Upstream, p: &prepare::Prepared) {
    if let Some(v) = p.version {
        let _ = writeln!(
            w,
            "version:     {v} (forwarded only if newer than every entity's accepted version)"
        );
    }
    if let Some(ttl) = route.claim {
        let _ = writeln!(
            w,
            "claim:       the first key to succeed owns the entities (claim_ttl {ttl:?})"
        );
    }
    if route.release_claim {
        let _ = writeln!(w, "claim:       a 2xx answer releases the entities' claim");
    }
    if let (Some(pc), Some(path)) = (&route.precheck, &p.precheck_path) {
        let _ = writeln!(
            w,
            "precheck:    {} {path} must answer {:?}",
            pc.method, pc.expect_status
        );
    }
    if let (Some(rc), Some(read)) = (&route.reconcile, &p.reconcile) {
        let expect: Vec<String> = rc
            .expect
            .iter()
            .zip(&read.expect)
            .map(|((field, _), v)| format!("body.{field} = {v}"))
            .collect();
        let expecting = match expect.is_empty() {
            true => String::new(),
            false => format!(", expecting {}", expect.join(", ")),
        };
        let _ = writeln!(
            w,
            "reconcile:   if the answer is lost: after {:?}, {} {} (found {:?}, not_found {:?}{expecting})",
            rc.after, rc.method, read.path, rc.found, rc.not_found,
        );
        if let Some(answer) = &read.answer_path {
            let _ = writeln!(w, "             found: answered with GET {answer}");
        }
    }
    if let Some(native) = &upstream.native_idempotency_header {
        let _ = writeln!(w, "native:      sends {native}: {}", p.key);
    }
    let outcome = match route.mode {
        crate::config::Mode::Observe => "observed (mode = observe): forwarded as is, never held, refused or replayed; what enforce mode would do is recorded (Idemproxy-Observed, idemproxy_observed_total)".to_owned(),
        _ => format!(
            "protected: replay if stored with this fingerprint, else lock the entities, reserve the key, forward once (in_flight = {})",
            route.in_flight.as_str()
        ),
    };
    let _ = writeln!(w, "outcome:     {outcome}");
}

fn refused(mut out: String, e: &crate::error::ProxyError) -> String {
    let _ = writeln!(
        out,
        "outcome:     refused: {} {} ({})",
        e.kind.status().as_u16(),
        e.kind.as_str(),
        e.message
    );
    out
}
