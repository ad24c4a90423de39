//! Raw TOML → validated [`Config`]. Collects every error with its `file:line:col`.

use super::compiler::Compiler;
use super::raw::*;
use super::routes::route;
use super::store::store;
use super::units::parse_size;
use super::upstreams::upstreams;
use super::*;
use std::collections::HashSet;
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
    let max_body = size(cx, &raw.max_body, 1 << 20);
    let max_answer = size(cx, &raw.max_answer, DEFAULT_MAX_ANSWER);
    let max_connections = count(cx, &raw.max_connections, 8192).max(1);
    let max_connections_per_ip = count(cx, &raw.max_connections_per_ip, 0);
    let workers = workers(cx, &raw.workers);
    let body_timeout = cx.dur(&raw.body_timeout, Duration::from_secs(30));
    let workflow_header = workflow_header(cx, &raw.workflow_header);
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

/// A size (`1MiB`, `64KiB`, bytes), or `default` when absent or wrong (the error noted).
fn size(cx: &mut Compiler, v: &Option<Str>, default: usize) -> usize {
    match v {
        None => default,
        Some(v) => cx
            .s(v)
            .and_then(|s| parse_size(&s).map_err(|e| cx.err(v.span(), e)).ok())
            .unwrap_or(default),
    }
}

/// A count of 0 or more, or `default` when absent or negative (the error noted).
fn count(cx: &mut Compiler, v: &Option<Spanned<i64>>, default: usize) -> usize {
    match v {
        None => default,
        Some(n) => usize::try_from(*n.get_ref()).unwrap_or_else(|_| {
            cx.err(n.span(), "must be 0 or more");
            default
        }),
    }
}

/// `workers`: from 1 to 1024, or absent (as many as the machine's cores).
fn workers(cx: &mut Compiler, v: &Option<Spanned<i64>>) -> Option<usize> {
    let n = v.as_ref()?;
    match usize::try_from(*n.get_ref()) {
        Ok(w) if (1..=1024).contains(&w) => Some(w),
        _ => {
            cx.err(n.span(), "must be from 1 to 1024");
            None
        }
    }
}

/// Absent: `x-workflow-id` (the header the shipped derive templates read); `""`: none.
fn workflow_header(cx: &mut Compiler, v: &Option<Str>) -> Option<http::HeaderName> {
    match v {
        None => Some(http::HeaderName::from_static("x-workflow-id")),
        Some(h) => cx.s(h).filter(|h| !h.is_empty()).and_then(|name| {
            http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| cx.err(h.span(), format!("{name:?} is not a header name")))
                .ok()
        }),
    }
}

/// Default `max_answer`: larger than any JSON answer of the APIs in front of which this proxy
/// sits, small enough that a few hundred of them in flight fit in memory.
pub const DEFAULT_MAX_ANSWER: usize = 10 << 20;

#[cfg(test)]
#[path = "compile_tests.rs"]
mod tests;
