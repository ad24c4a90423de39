//! The console's page frame and the pieces every page shares: the layout (navigation, the
//! entity and key search, sign-out), links built from values that came from requests, badges,
//! and the headers every answer carries.
//!
//! Every value is put into the HTML by maud, which escapes it; links to entities and keys are
//! built here with the value percent-encoded into a fixed `/console/...` path, so a value such
//! as `javascript:…` is never a URL of its own.

use super::clock;
use super::decision::{self, Kind};
use crate::store::AuditRow;
use crate::upstream::{full, ProxyBody};
use http::{header, HeaderValue, Response, StatusCode};
use maud::{html, Markup, DOCTYPE};

/// No script at all, no resource from another origin, no framing, forms only to the console:
/// a value that escaped its escaping still could not run.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
                       form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Which navigation entry is the current page (the entity or key searched for stays in its
/// search box).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Nav<'a> {
    Attention,
    Overview,
    Upstreams,
    Running,
    Entity(&'a str),
    Key(&'a str),
}

/// What the frame needs to know about the viewer.
pub struct Frame<'a> {
    pub csrf: &'a str,
    pub signed_in: bool,
    pub store: &'static str,
}

/// A whole page: the frame around `body`.
pub fn layout(frame: &Frame, nav: Nav, title: &str, body: Markup) -> Markup {
    let current = |n: Nav| if n == nav { "current" } else { "" };
    let (entity, key) = match nav {
        Nav::Entity(e) => (e, ""),
        Nav::Key(k) => ("", k),
        _ => ("", ""),
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                header.top {
                    a.brand href="/" { "idemproxy" }
                    nav {
                        a class=(current(Nav::Attention)) href="/" { "Needs attention" }
                        a class=(current(Nav::Overview)) href="/console/overview" { "Overview" }
                        a class=(current(Nav::Upstreams)) href="/console/upstreams" { "Upstreams" }
                        a class=(current(Nav::Running)) href="/console/running" { "Running" }
                    }
                    form.search method="get" action="/console/entity" {
                        input type="search" name="e" placeholder="entity, e.g. contact:901"
                            aria-label="Entity" value=(entity);
                        button type="submit" { "Timeline" }
                    }
                    form.search method="get" action="/console/key" {
                        input type="search" name="k" placeholder="idempotency key"
                            aria-label="Key" value=(key);
                        button type="submit" { "Key" }
                    }
                    @if frame.signed_in {
                        form.signout method="post" action="/logout" {
                            input type="hidden" name="csrf" value=(frame.csrf);
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main { (body) }
                footer { "store: " (frame.store) " · times in UTC" }
            }
        }
    }
}

/// Every page's head: its title, and the console's own stylesheet and icon (nothing from
/// another origin).
fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · idemproxy" }
            link rel="stylesheet" href="/assets/console.css";
            link rel="icon" type="image/svg+xml" href="/assets/icon.svg";
        }
    }
}

/// A bare page outside the frame (sign-in, refusals before access is known).
pub fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body.bare { main { (body) } }
        }
    }
}

/// An HTML answer with the console's headers: the CSP, no caching (pages show stored
/// answers, which are customer data), no sniffing, no framing, no referrer.
pub fn respond(status: StatusCode, markup: Markup) -> Response<ProxyBody> {
    let mut resp = Response::new(full(markup.into_string()));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    secure_headers(headers);
    resp
}

/// The headers every console answer carries.
pub fn secure_headers(headers: &mut http::HeaderMap) {
    let fixed = [
        ("content-security-policy", CSP),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        ("referrer-policy", "no-referrer"),
        ("cross-origin-opener-policy", "same-origin"),
        ("cross-origin-resource-policy", "same-origin"),
        ("cache-control", "no-store"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
}

/// `303 See Other` to `location` (a path the console built), with `cookie` set if given.
pub fn redirect(location: &str, cookie: Option<String>) -> Response<ProxyBody> {
    let mut resp = Response::new(full(""));
    *resp.status_mut() = StatusCode::SEE_OTHER;
    let headers = resp.headers_mut();
    secure_headers(headers);
    if let Ok(v) = HeaderValue::from_str(location) {
        headers.insert(header::LOCATION, v);
    }
    if let Some(v) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        headers.insert(header::SET_COOKIE, v);
    }
    resp
}

/// A refusal or failure as a page of its own: what went wrong, and the way back.
pub fn problem(status: StatusCode, title: &str, message: &str) -> Response<ProxyBody> {
    respond(
        status,
        bare(
            title,
            html! {
                h1 { (title) }
                p.problem { (message) }
                p { a href="/" { "Back to the console" } }
            },
        ),
    )
}

/// `s` percent-encoded for a query string.
pub fn encode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// The console's page of a key.
pub fn key_href(key: &str) -> String {
    format!("/console/key?k={}", encode(key))
}

/// The console's timeline of an entity (by its name as callers wrote it, every scope).
pub fn entity_href(entity: &str) -> String {
    format!(
        "/console/entity?e={}",
        encode(crate::key::unqualified(entity))
    )
}

/// A key as a link to its page.
pub fn key_link(key: &str) -> Markup {
    html! { a.key href=(key_href(key)) { code { (key) } } }
}

/// An entity as a link to its timeline: the name as its caller wrote it (the credential
/// scope it was qualified with is shown in its own column).
pub fn entity_link(entity: &str) -> Markup {
    html! { a.entity href=(entity_href(entity)) { (crate::key::unqualified(entity)) } }
}

/// A decision's badge.
pub fn badge(decision_text: &str) -> Markup {
    let kind = decision::kind(decision_text);
    html! { span class={ "badge " (kind.name()) } { (decision::label(decision_text)) } }
}

/// A badge of a given kind with its own text.
pub fn kind_badge(kind: Kind, text: &str) -> Markup {
    html! { span class={ "badge " (kind.name()) } { (text) } }
}

/// A time in UTC to the millisecond: the order of a timeline's lines within one second.
pub fn precise(ms: i64) -> Markup {
    html! { time datetime=(clock::iso(ms)) { (clock::datetime(ms)) } }
}

/// A time in UTC, with its age when `now` is given.
pub fn when(ms: i64, now: Option<i64>) -> Markup {
    html! {
        time datetime=(clock::iso(ms)) title=(clock::datetime(ms)) {
            (clock::short(ms))
            @if let Some(now) = now { " " span.age { "(" (clock::age(ms, now)) " ago)" } }
        }
    }
}

/// An audit row's durations: `lock 3 ms · upstream 120 ms`.
pub fn durations(row: &AuditRow) -> Markup {
    html! {
        span.ms { "lock " (row.lock_wait_ms) " ms" }
        @if let Some(up) = row.upstream_ms { " · " span.ms { "upstream " (up) " ms" } }
    }
}
