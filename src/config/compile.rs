//! Raw TOML → validated [`Config`]. Collects every error with its `file:line:col`.

use super::compiler::Compiler;
use super::raw::*;
use super::routes::route;
use super::store::store;
use super::units::parse_size;
use super::*;
use std::collections::{BTreeMap, HashSet};
use toml::Spanned;

pub(super) fn compile(
    text: &str,
    origin: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let raw: RawConfig = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        let ctx = Compiler {
            text,
            origin,
            env,
            errors: vec![],
        };
        ConfigError {
            errors: vec![format!(
                "{}: {}{}",
                ctx.at(span),
                e.message(),
                super::units::did_you_mean(e.message())
            )],
        }
    })?;
    let mut cx = Compiler {
        text,
        origin,
        env,
        errors: Vec::new(),
    };
    let server = server(&mut cx, &raw.server);
    let store = store(&mut cx, &raw.store);
    let routes: Vec<Arc<Route>> = raw
        .routes
        .iter()
        .filter_map(|r| route(&mut cx, r, &raw.upstreams, store.retention))
        .map(Arc::new)
        .collect();
    let mut names = HashSet::new();
    for (raw_route, r) in raw.routes.iter().zip(&routes) {
        if !names.insert(r.name.clone()) {
            cx.err(
                raw_route.get_ref().name.span(),
                format!("duplicate route name {:?}", r.name),
            );
        }
    }
    let upstreams = upstreams(&mut cx, &raw.upstreams, &routes, &server, store.retention);
    let egress = super::egress::egress(&mut cx, raw.egress.as_ref());
    super::egress::check_claims(&mut cx, &raw.upstreams);
    if cx.errors.is_empty() {
        Ok(Config {
            origin: origin.to_owned(),
            source: None,
            server,
            store,
            egress,
            upstreams,
            routes,
        })
    } else {
        Err(ConfigError { errors: cx.errors })
    }
}

fn server(cx: &mut Compiler, raw: &RawServer) -> ServerConfig {
    let default_listen = SocketAddr::from(([127, 0, 0, 1], 8080));
    let listen = raw
        .listen
        .as_ref()
        .and_then(|l| cx.addr(l))
        .unwrap_or(default_listen);
    // Absent: the default admin port; `""` turns the admin listener off.
    let admin_listen = match &raw.admin_listen {
        None => Some(SocketAddr::from(([127, 0, 0, 1], 9090))),
        Some(a) if a.get_ref().is_empty() => None,
        Some(a) => cx.addr(a),
    };
    let admin_token = raw
        .admin_token
        .as_ref()
        .and_then(|t| cx.s(t))
        .filter(|t| !t.is_empty());
    let max_body = match &raw.max_body {
        None => 1 << 20,
        Some(v) => cx
            .s(v)
            .and_then(|s| parse_size(&s).map_err(|e| cx.err(v.span(), e)).ok())
            .unwrap_or(1 << 20),
    };
    let size = |cx: &mut Compiler, v: &Option<Str>, default: usize| match v {
        None => default,
        Some(v) => cx
            .s(v)
            .and_then(|s| parse_size(&s).map_err(|e| cx.err(v.span(), e)).ok())
            .unwrap_or(default),
    };
    let max_answer = size(cx, &raw.max_answer, DEFAULT_MAX_ANSWER);
    let count = |cx: &mut Compiler, v: &Option<Spanned<i64>>, default: usize| match v {
        None => default,
        Some(n) => usize::try_from(*n.get_ref()).unwrap_or_else(|_| {
            cx.err(n.span(), "must be 0 or more");
            default
        }),
    };
    let max_connections = count(cx, &raw.max_connections, 8192).max(1);
    let max_connections_per_ip = count(cx, &raw.max_connections_per_ip, 0);
    let workers = raw
        .workers
        .as_ref()
        .and_then(|n| match usize::try_from(*n.get_ref()) {
            Ok(w) if (1..=1024).contains(&w) => Some(w),
            _ => {
                cx.err(n.span(), "must be from 1 to 1024");
                None
            }
        });
    let body_timeout = cx.dur(&raw.body_timeout, Duration::from_secs(30));
    // Absent: `x-workflow-id` (the header the shipped derive templates read); `""`: none.
    let workflow_header = match &raw.workflow_header {
        None => Some(http::HeaderName::from_static("x-workflow-id")),
        Some(h) => cx.s(h).filter(|h| !h.is_empty()).and_then(|name| {
            http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| cx.err(h.span(), format!("{name:?} is not a header name")))
                .ok()
        }),
    };
    let tls = raw.tls.as_ref().and_then(|t| {
        let t = t.get_ref();
        Some(TlsFiles {
            cert: cx.s(&t.cert)?.into(),
            key: cx.s(&t.key)?.into(),
        })
    });
    ServerConfig {
        listen,
        admin_listen,
        admin_token,
        max_body,
        body_timeout,
        max_answer,
        max_connections,
        max_connections_per_ip,
        workflow_header,
        workers,
        tls,
    }
}

/// Default `max_answer`: larger than any JSON answer of the APIs in front of which this proxy
/// sits, small enough that a few hundred of them in flight fit in memory.
pub const DEFAULT_MAX_ANSWER: usize = 10 << 20;

fn upstreams(
    cx: &mut Compiler,
    raw: &BTreeMap<String, Spanned<RawUpstream>>,
    routes: &[Arc<Route>],
    server: &ServerConfig,
    store_retention: Duration,
) -> Vec<Arc<Upstream>> {
    let mut out = Vec::new();
    let mut prefixes: Vec<String> = Vec::new();
    for (name, sp) in raw {
        let u = sp.get_ref();
        let Some(url) = cx.s(&u.url) else { continue };
        let shown = redact_url(&url);
        let (url, url_host) = super::egress::host_url(&url);
        let uri: http::Uri = match url.parse() {
            Ok(uri) => uri,
            Err(e) => {
                cx.err(u.url.span(), format!("upstream url {shown:?}: {e}"));
                continue;
            }
        };
        let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned())
        else {
            cx.err(
                u.url.span(),
                format!("upstream url {shown:?} needs http:// or https:// and a host"),
            );
            continue;
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
        let (authority, url_credentials) = super::units::split_credentials(authority);
        let prefix = u.prefix.as_ref().and_then(|p| {
            let s = cx.s(p)?;
            let trimmed = s.trim_end_matches('/').to_owned();
            if !s.starts_with('/')
                || trimmed.is_empty()
                || crate::rules::pattern::check_path(&s).is_err()
            {
                cx.err(p.span(), format!("prefix {s:?} must look like /name"));
                return None;
            }
            if prefixes.contains(&trimmed) {
                cx.err(
                    p.span(),
                    format!("prefix {s:?} is used by another upstream"),
                );
            }
            prefixes.push(trimmed.clone());
            Some(trimmed)
        });
        // `""` (e.g. an unset `${VAR:-}`) means no dedicated listener.
        let listen = u
            .listen
            .as_ref()
            .filter(|l| cx.s(l).is_some_and(|s| !s.is_empty()))
            .and_then(|l| cx.addr(l));
        let claims = u.hosts.as_ref().is_some_and(|h| !h.is_empty());
        if prefix.is_none() && listen.is_none() && u.prefix.is_none() && !claims {
            cx.err(
                sp.span(),
                format!("upstream {name:?} needs a prefix, a listen address or hosts for the egress listener"),
            );
        }
        // Port 0 asks the OS for a free port: it never collides with another listener.
        if let (Some(l), true) = (
            listen,
            listen.is_some_and(|l| l.port() != 0)
                && (listen == Some(server.listen) || listen == server.admin_listen),
        ) {
            cx.err(
                sp.span(),
                format!("upstream {name:?}: listen {l} is already used by [server]"),
            );
        }
        let release_statuses = match &u.release_statuses {
            None => Vec::new(),
            Some(list) => list
                .get_ref()
                .iter()
                .filter_map(|s| match u16::try_from(*s.get_ref()) {
                    Ok(code) if (100..=599).contains(&code) => Some(code),
                    _ => {
                        cx.err(s.span(), format!("{} is not an HTTP status", s.get_ref()));
                        None
                    }
                })
                .collect(),
        };
        let unmatched = match u
            .unmatched
            .as_ref()
            .and_then(|v| cx.s(v).map(|s| (s, v.span())))
        {
            None => Unmatched::Protect,
            Some((s, span)) => match s.as_str() {
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
            },
        };
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
            if list.is_empty() && scope_headers.is_empty() {
                if let Some(first) = names.first() {
                    cx.err(first.span(), format!("upstream {name:?}: credential_headers is empty, so no caller's answer could be told from another's; name the headers its API authenticates with"));
                }
            }
            if list.contains(&http::header::PROXY_AUTHORIZATION) {
                if let Some(first) = names.first() {
                    cx.err(first.span(), format!("upstream {name:?}: Proxy-Authorization is never forwarded to an upstream, so it cannot be one of its credential_headers"));
                }
            }
        }
        let hosts = super::egress::hosts(cx, &u.hosts);
        if url_host && hosts.is_empty() {
            cx.err(u.url.span(), format!("upstream {name:?}: url has {{host}}, which only an intercepted request has: give the upstream hosts = [...]"));
        }
        out.push(Arc::new(Upstream {
            name: name.clone(),
            hosts,
            url_host,
            scheme,
            authority,
            base_path: uri.path().trim_end_matches('/').to_owned(),
            prefix,
            listen,
            timeout: cx.dur(&u.timeout, Duration::from_secs(30)),
            native_idempotency_header: u
                .native_idempotency_header
                .as_ref()
                .and_then(|h| cx.header(h)),
            release_statuses,
            unmatched,
            ca_file: u.ca_file.as_ref().and_then(|c| cx.s(c)).map(PathBuf::from),
            credentials: crate::key::credential_list(configured.as_deref(), &scope_headers),
            scope_headers,
            share_entities: u.share_entities.unwrap_or(false),
            error_format: match &u.error_format {
                None => Default::default(),
                Some(v) => cx
                    .s(v)
                    .and_then(|s| {
                        crate::error::ErrorFormat::parse(&s).or_else(|| {
                            cx.err(
                                v.span(),
                                format!("error_format = {s:?}: use idemproxy, stripe, hubspot or zendesk"),
                            );
                            None
                        })
                    })
                    .unwrap_or_default(),
            },
            sdk_keys: u
                .sdk_keys
                .iter()
                .flatten()
                .filter_map(|p| {
                    let s = cx.s(p)?;
                    crate::key::KeyPattern::parse(&s)
                        .map_err(|e| cx.err(p.span(), e))
                        .ok()
                })
                .collect(),
            store_set_cookie: u.store_set_cookie.unwrap_or(false),
            max_answer: match &u.max_answer {
                None => server.max_answer,
                Some(v) => cx
                    .s(v)
                    .and_then(|s| parse_size(&s).map_err(|e| cx.err(v.span(), e)).ok())
                    .unwrap_or(server.max_answer),
            },
            url_credentials,
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

#[cfg(test)]
#[path = "compile_tests.rs"]
mod tests;
