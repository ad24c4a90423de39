//! Compiling `[upstreams.NAME]`: where each sends (its URL, with `{host}` for an intercepted
//! host and credentials kept apart), where it is reached (a prefix, a listener, hosts), and
//! the rest of its settings, each part on its own.

use super::compiler::Compiler;
use super::raw::*;
use super::units::parse_size;
use super::*;
use std::collections::BTreeMap;
use toml::Spanned;

pub(super) fn upstreams(
    cx: &mut Compiler,
    raw: &BTreeMap<String, Spanned<RawUpstream>>,
    routes: &[Arc<Route>],
    server: &ServerConfig,
    store_retention: Duration,
) -> Vec<Arc<Upstream>> {
    let mut prefixes: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for (name, sp) in raw {
        let u = sp.get_ref();
        let Some(to) = target(cx, u) else { continue };
        let prefix = prefix(cx, u, &mut prefixes);
        let listen = listen(cx, name, sp, server, prefix.is_some());
        let (credentials, scope_headers) = credentials(cx, name, u);
        let hosts = super::egress::hosts(cx, &u.hosts);
        if to.url_host && hosts.is_empty() {
            cx.err(u.url.span(), format!("upstream {name:?}: url has {{host}}, which only an intercepted request has: give the upstream hosts = [...]"));
        }
        out.push(Arc::new(Upstream {
            name: name.clone(),
            hosts,
            url_host: to.url_host,
            scheme: to.scheme,
            authority: to.authority,
            base_path: to.base_path,
            prefix,
            listen,
            timeout: cx.dur(&u.timeout, Duration::from_secs(30)),
            native_idempotency_header: u
                .native_idempotency_header
                .as_ref()
                .and_then(|h| cx.header(h)),
            release_statuses: release_statuses(cx, u),
            unmatched: unmatched(cx, u),
            ca_file: u.ca_file.as_ref().and_then(|c| cx.s(c)).map(PathBuf::from),
            credentials,
            scope_headers,
            share_entities: u.share_entities.unwrap_or(false),
            error_format: error_format(cx, u),
            sdk_keys: sdk_keys(cx, u),
            store_set_cookie: u.store_set_cookie.unwrap_or(false),
            max_answer: max_answer(cx, u, server.max_answer),
            url_credentials: to.credentials,
            pace: super::pace::budget(cx, name, &u.pace),
            routes: routes
                .iter()
                .filter(|r| &r.upstream == name)
                .cloned()
                .collect(),
            unmatched_route: Arc::new(Route::unmatched(
                name,
                store_retention,
                u.mode.as_ref().and_then(|v| cx.mode(v)).unwrap_or_default(),
            )),
        }));
    }
    out
}

/// Where an upstream sends: its URL taken apart.
struct Target {
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    base_path: String,
    /// `https://{host}`: the host a request was intercepted for.
    url_host: bool,
    /// `Authorization: Basic ...` from `user:pw@` in the URL, kept apart from the authority.
    credentials: Option<http::HeaderValue>,
}

/// The URL: http or https, a host, no query; shown redacted in errors.
fn target(cx: &mut Compiler, u: &RawUpstream) -> Option<Target> {
    let url = cx.s(&u.url)?;
    let shown = redact_url(&url);
    let (url, url_host) = super::egress::host_url(&url);
    let uri: http::Uri = match url.parse() {
        Ok(uri) => uri,
        Err(e) => {
            cx.err(u.url.span(), format!("upstream url {shown:?}: {e}"));
            return None;
        }
    };
    let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned()) else {
        cx.err(
            u.url.span(),
            format!("upstream url {shown:?} needs http:// or https:// and a host"),
        );
        return None;
    };
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        cx.err(
            u.url.span(),
            format!("upstream url {shown:?}: scheme must be http or https"),
        );
    }
    if uri.query().is_some() {
        cx.err(u.url.span(), "upstream url must not have a query");
    }
    let (authority, credentials) = super::units::split_credentials(authority);
    Some(Target {
        scheme,
        authority,
        base_path: uri.path().trim_end_matches('/').to_owned(),
        url_host,
        credentials,
    })
}

/// `prefix`: `/name`, used by no other upstream.
fn prefix(cx: &mut Compiler, u: &RawUpstream, taken: &mut Vec<String>) -> Option<String> {
    let p = u.prefix.as_ref()?;
    let s = cx.s(p)?;
    let trimmed = s.trim_end_matches('/').to_owned();
    if !s.starts_with('/') || trimmed.is_empty() || crate::rules::pattern::check_path(&s).is_err() {
        cx.err(p.span(), format!("prefix {s:?} must look like /name"));
        return None;
    }
    if taken.contains(&trimmed) {
        cx.err(
            p.span(),
            format!("prefix {s:?} is used by another upstream"),
        );
    }
    taken.push(trimmed.clone());
    Some(trimmed)
}

/// `listen`, a dedicated listener (`""`, e.g. an unset `${VAR:-}`, is none); an upstream is
/// reached by a prefix, a listener or hosts, at least one.
fn listen(
    cx: &mut Compiler,
    name: &str,
    sp: &Spanned<RawUpstream>,
    server: &ServerConfig,
    has_prefix: bool,
) -> Option<SocketAddr> {
    let u = sp.get_ref();
    let listen = u
        .listen
        .as_ref()
        .filter(|l| cx.s(l).is_some_and(|s| !s.is_empty()))
        .and_then(|l| cx.addr(l));
    let claims = u.hosts.as_ref().is_some_and(|h| !h.is_empty());
    if !has_prefix && listen.is_none() && u.prefix.is_none() && !claims {
        cx.err(sp.span(), format!("upstream {name:?} needs a prefix, a listen address or hosts for the egress listener"));
    }
    // Port 0 asks the OS for a free port: it never collides with another listener.
    if let Some(l) = listen.filter(|l| l.port() != 0) {
        if l == server.listen || Some(l) == server.admin_listen {
            cx.err(
                sp.span(),
                format!("upstream {name:?}: listen {l} is already used by [server]"),
            );
        }
    }
    listen
}

fn release_statuses(cx: &mut Compiler, u: &RawUpstream) -> Vec<u16> {
    let Some(list) = &u.release_statuses else {
        return Vec::new();
    };
    list.get_ref()
        .iter()
        .filter_map(|s| match u16::try_from(*s.get_ref()) {
            Ok(code) if (100..=599).contains(&code) => Some(code),
            _ => {
                cx.err(s.span(), format!("{} is not an HTTP status", s.get_ref()));
                None
            }
        })
        .collect()
}

fn unmatched(cx: &mut Compiler, u: &RawUpstream) -> Unmatched {
    let Some((s, span)) = u
        .unmatched
        .as_ref()
        .and_then(|v| cx.s(v).map(|s| (s, v.span())))
    else {
        return Unmatched::Protect;
    };
    match s.as_str() {
        "protect" => Unmatched::Protect,
        "passthrough" => Unmatched::Passthrough,
        "reject" => Unmatched::Reject,
        _ => {
            cx.err(
                span,
                format!("unmatched = {s:?}: use protect, passthrough or reject"),
            );
            Unmatched::Protect
        }
    }
}

/// The headers that scope keys and entities: `credential_headers` (checked: not empty, never
/// `Proxy-Authorization`) or the common ones, and `scope_headers`.
fn credentials(
    cx: &mut Compiler,
    name: &str,
    u: &RawUpstream,
) -> (Vec<HeaderName>, Vec<HeaderName>) {
    let scope_headers: Vec<HeaderName> = u
        .scope_headers
        .iter()
        .flatten()
        .filter_map(|h| cx.header(h))
        .collect();
    let configured: Option<Vec<HeaderName>> = u
        .credential_headers
        .as_ref()
        .map(|names| names.iter().filter_map(|h| cx.header(h)).collect());
    if let (Some(names), Some(list)) = (&u.credential_headers, &configured) {
        if let Some(first) = names.first() {
            if list.is_empty() && scope_headers.is_empty() {
                cx.err(first.span(), format!("upstream {name:?}: credential_headers is empty, so no caller's answer could be told from another's; name the headers its API authenticates with"));
            }
            if list.contains(&http::header::PROXY_AUTHORIZATION) {
                cx.err(first.span(), format!("upstream {name:?}: Proxy-Authorization is never forwarded to an upstream, so it cannot be one of its credential_headers"));
            }
        }
    }
    let credentials = crate::key::credential_list(configured.as_deref(), &scope_headers);
    (credentials, scope_headers)
}

fn error_format(cx: &mut Compiler, u: &RawUpstream) -> crate::error::ErrorFormat {
    let Some(v) = &u.error_format else {
        return Default::default();
    };
    cx.s(v)
        .and_then(|s| {
            crate::error::ErrorFormat::parse(&s).or_else(|| {
                let msg =
                    format!("error_format = {s:?}: use idemproxy, stripe, hubspot or zendesk");
                cx.err(v.span(), msg);
                None
            })
        })
        .unwrap_or_default()
}

fn sdk_keys(cx: &mut Compiler, u: &RawUpstream) -> Vec<crate::key::KeyPattern> {
    let parse = |cx: &mut Compiler, p: &Str| {
        let s = cx.s(p)?;
        crate::key::KeyPattern::parse(&s)
            .map_err(|e| cx.err(p.span(), e))
            .ok()
    };
    u.sdk_keys
        .iter()
        .flatten()
        .filter_map(|p| parse(cx, p))
        .collect()
}

fn max_answer(cx: &mut Compiler, u: &RawUpstream, default: usize) -> usize {
    let Some(v) = &u.max_answer else {
        return default;
    };
    cx.s(v)
        .and_then(|s| parse_size(&s).map_err(|e| cx.err(v.span(), e)).ok())
        .unwrap_or(default)
}
