//! `[egress]` and upstreams' `hosts`: the forward proxy for clients whose API host is fixed
//! (SPEC.md, "Clients whose API host is fixed"), compiled once like the rest.

use super::compiler::Compiler;
use super::raw::{RawEgress, Str};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// The egress listener's settings.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// `None`: no egress listener (the default).
    pub listen: Option<SocketAddr>,
    /// The CA that signs the leaves of intercepted hosts (`idemproxy ca init` writes both).
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    /// Hosts passed through untouched (`CONNECT` only, bytes copied both ways).
    pub tunnel: Vec<HostPattern>,
    /// When set, every request to the egress listener must carry it in `Proxy-Authorization`
    /// (Basic with any user and this password, or Bearer), or gets `407`.
    pub proxy_token: Option<String>,
    /// How long a client may take from connecting to a finished TLS handshake inside its
    /// `CONNECT`: a slow or silent preamble does not hold a slot.
    pub handshake_timeout: Duration,
}

impl Default for EgressConfig {
    fn default() -> Self {
        EgressConfig {
            listen: None,
            ca_cert: PathBuf::from("certs/idemproxy-ca.pem"),
            ca_key: PathBuf::from("certs/idemproxy-ca.key"),
            tunnel: Vec::new(),
            proxy_token: None,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// A host an upstream claims or a tunnel passes: an exact name (`api.hubapi.com`), every name
/// under a domain (`*.zendesk.com`: `acme.zendesk.com`, not `zendesk.com`), or an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    Exact(String),
    /// The suffix, with its leading dot: `.zendesk.com`.
    Under(String),
    Address(IpAddr),
}

impl HostPattern {
    pub fn parse(s: &str) -> Result<HostPattern, String> {
        let lower = s.trim().to_ascii_lowercase();
        if let Ok(ip) = lower.trim_start_matches('[').trim_end_matches(']').parse() {
            return Ok(HostPattern::Address(ip));
        }
        let (under, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        match (dns_name(name), under) {
            (false, _) => Err(format!(
                "{s:?} is not a host name: use a name (api.hubapi.com), *.domain (*.zendesk.com) or an address"
            )),
            (true, true) => Ok(HostPattern::Under(format!(".{name}"))),
            (true, false) => Ok(HostPattern::Exact(name.to_owned())),
        }
    }

    /// Whether `host` (lower case, no port) is one this pattern names. `*.domain` names one
    /// label under the domain (`acme.zendesk.com`, not `a.b.zendesk.com`), as a wildcard
    /// certificate does, and only a well-formed DNS name: a client cannot make the proxy mint
    /// a certificate for an arbitrary string.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(name) => name == host,
            HostPattern::Under(suffix) => host
                .strip_suffix(suffix.as_str())
                .is_some_and(|label| !label.contains('.') && dns_name(host)),
            HostPattern::Address(ip) => {
                host.trim_start_matches('[').trim_end_matches(']').parse() == Ok(*ip)
            }
        }
    }

    /// Whether it names more than one host (so keys are scoped by the host too).
    pub fn is_wildcard(&self) -> bool {
        matches!(self, HostPattern::Under(_))
    }
}

impl std::fmt::Display for HostPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostPattern::Exact(n) => f.write_str(n),
            HostPattern::Under(s) => write!(f, "*{s}"),
            HostPattern::Address(ip) => write!(f, "{ip}"),
        }
    }
}

/// What `check` and `serve` warn of: an upstream that claims several hosts (several accounts)
/// but sends every request to one fixed url — right for a test's fake, wrong in production,
/// where each account's requests and credentials would reach one account.
pub fn warnings(upstreams: &[std::sync::Arc<super::Upstream>]) -> Vec<String> {
    upstreams
        .iter()
        .filter(|u| !u.url_host && (u.hosts.len() > 1 || u.hosts.iter().any(HostPattern::is_wildcard)))
        .map(|u| {
            format!(
                "upstream {:?} claims several hosts ({}) but sends every intercepted request to {}; unless that is a test's fake, use url = \"https://{{host}}\"",
                u.name,
                u.hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(", "),
                u.authority
            )
        })
        .collect()
}

/// A DNS name: labels of letters, digits, `-` and `_`, 1–63 bytes each, 253 in all.
pub fn dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Compiles a list of host patterns, each error at its place.
pub(super) fn hosts(cx: &mut Compiler, list: &Option<Vec<Str>>) -> Vec<HostPattern> {
    let mut out = Vec::new();
    for h in list.iter().flatten() {
        let Some(text) = cx.s(h) else { continue };
        match HostPattern::parse(&text) {
            Ok(p) => out.push(p),
            Err(e) => cx.err(h.span(), e),
        }
    }
    out
}

/// The placeholder an upstream URL's `{host}` parses as: an intercepted request is sent to the
/// host it was for (`https://{host}`, one Zendesk account or another).
pub const HOST_PLACEHOLDER: &str = "intercepted-host.invalid";

/// `url` with `{host}` made parseable, and whether it had one.
pub(super) fn host_url(url: &str) -> (String, bool) {
    match url.contains("{host}") {
        true => (url.replace("{host}", HOST_PLACEHOLDER), true),
        false => (url.to_owned(), false),
    }
}

/// Two upstreams may not claim one host: which routes a request runs through would depend on
/// the file's order.
pub(super) fn check_claims(
    cx: &mut Compiler,
    raw: &std::collections::BTreeMap<String, toml::Spanned<super::raw::RawUpstream>>,
) {
    let mut seen: Vec<(HostPattern, &str)> = Vec::new();
    for (name, u) in raw {
        for h in u.get_ref().hosts.iter().flatten() {
            let Ok(p) = HostPattern::parse(h.get_ref()) else {
                continue;
            };
            match seen.iter().find(|(q, _)| *q == p) {
                Some((_, other)) => cx.err(
                    h.span(),
                    format!("host {p} is claimed by upstreams {other:?} and {name:?}: one upstream per host"),
                ),
                None => seen.push((p, name)),
            }
        }
    }
}

pub(super) fn egress(cx: &mut Compiler, raw: Option<&RawEgress>) -> EgressConfig {
    let mut out = EgressConfig::default();
    let Some(raw) = raw else { return out };
    out.listen = match &raw.listen {
        Some(l) if cx.s(l).is_some_and(|s| !s.is_empty()) => cx.addr(l),
        _ => None,
    };
    if let Some(p) = raw.ca_cert.as_ref().and_then(|p| cx.s(p)) {
        out.ca_cert = PathBuf::from(p);
    }
    if let Some(p) = raw.ca_key.as_ref().and_then(|p| cx.s(p)) {
        out.ca_key = PathBuf::from(p);
    }
    out.tunnel = hosts(cx, &raw.tunnel);
    out.proxy_token = raw
        .proxy_token
        .as_ref()
        .and_then(|t| cx.s(t))
        .filter(|t| !t.is_empty());
    out.handshake_timeout = cx.dur(&raw.handshake_timeout, out.handshake_timeout);
    out
}

#[cfg(test)]
mod tests {
    use super::HostPattern;

    #[test]
    fn host_patterns() {
        let exact = HostPattern::parse("API.hubapi.com").unwrap();
        assert!(exact.matches("api.hubapi.com") && !exact.matches("x.api.hubapi.com"));
        let under = HostPattern::parse("*.zendesk.com").unwrap();
        assert!(under.matches("acme.zendesk.com") && !under.matches("a.b.zendesk.com"));
        assert!(
            !under.matches("a b.zendesk.com")
                && !under.matches(&format!("{}.zendesk.com", "a".repeat(64)))
        );
        assert!(!under.matches("zendesk.com") && !under.matches("evilzendesk.com"));
        assert!(under.is_wildcard() && !exact.is_wildcard());
        let ip = HostPattern::parse("127.0.0.1").unwrap();
        assert!(ip.matches("127.0.0.1") && !ip.matches("127.0.0.2"));
        assert!(HostPattern::parse("*.").is_err());
        assert!(HostPattern::parse("a b").is_err());
        assert!(HostPattern::parse("https://x").is_err());
    }
}
