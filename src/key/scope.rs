//! Credential scopes: which headers carry credentials, the keyed hash that scopes stored keys
//! and entities, and the unkeyed scope of records stored before scopes were keyed (read only,
//! for upgrades).

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

/// Headers that carry credentials in common APIs. Every one of them scopes keys (and, by
/// default, entities), whatever the upstream's `scope_headers` add: a stored answer must never
/// reach a caller with other credentials, wherever those credentials travel.
pub const CREDENTIAL_HEADERS: [&str; 14] = [
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
    "apikey",
    "x-apikey",
    "x-auth-token",
    "x-access-token",
    "x-api-token",
    "x-amz-security-token",
    "x-goog-api-key",
    "private-token",
    "ocp-apim-subscription-key",
];

/// Whether `name` (lowercase) is one of [`CREDENTIAL_HEADERS`] or `extra`.
pub fn is_credential(name: &str, extra: &[HeaderName]) -> bool {
    CREDENTIAL_HEADERS.contains(&name) || extra.iter().any(|h| h.as_str() == name)
}

/// The headers that carry an upstream's credentials, in the order the scope hashes them:
/// `configured` (the upstream's `credential_headers`: what its API authenticates with), else
/// every one of [`CREDENTIAL_HEADERS`]; then `scope_headers`; each name once. Names of the
/// common list keep its order, so a scope hashed before an upstream narrowed its list is the
/// same for a request that carries only the headers kept. Hop-by-hop headers are never on it:
/// they are not forwarded, so they cannot tell two callers apart at the upstream.
pub fn credential_list(
    configured: Option<&[HeaderName]>,
    scope_headers: &[HeaderName],
) -> Vec<HeaderName> {
    let wanted = |n: &HeaderName| configured.is_none_or(|c| c.contains(n));
    let mut out: Vec<HeaderName> = CREDENTIAL_NAMES
        .iter()
        .filter(|n| wanted(n) && **n != http::header::PROXY_AUTHORIZATION)
        .cloned()
        .collect();
    for n in configured.into_iter().flatten().chain(scope_headers) {
        if !out.contains(n) && *n != http::header::PROXY_AUTHORIZATION {
            out.push(n.clone());
        }
    }
    out
}

/// [`CREDENTIAL_HEADERS`] as header names, built once.
static CREDENTIAL_NAMES: std::sync::LazyLock<Vec<HeaderName>> = std::sync::LazyLock::new(|| {
    CREDENTIAL_HEADERS
        .iter()
        .map(|n| HeaderName::from_static(n))
        .collect()
});

/// Hashes credential headers into a scope, keyed with a secret that is not kept in the
/// store, so a copy of the database alone cannot be used to test guesses at credentials.
pub struct ScopeKeyer {
    key: ring::hmac::Key,
    /// The scope of a request that carries no credentials, hashed once: an internal API
    /// called without them is scoped on every request alike.
    uncredentialed: String,
}

/// Scopes written by this release start with this, so old (unkeyed) ones can be told apart.
pub const SCOPE_PREFIX: &str = "k1:";

impl ScopeKeyer {
    pub fn new(secret: &[u8]) -> ScopeKeyer {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let uncredentialed = scope_of(ring::hmac::Context::with_key(&key));
        ScopeKeyer {
            key,
            uncredentialed,
        }
    }

    /// `k1:` + hex HMAC-SHA256 over every credential header of the request (name, length,
    /// value), in the order of `credentials` (an upstream's [`credential_list`]).
    pub fn scope(&self, headers: &HeaderMap, credentials: &[HeaderName]) -> String {
        self.scope_at(headers, credentials, None)
    }

    /// [`ScopeKeyer::scope`], and for a request the egress listener intercepted for `host` of
    /// an upstream that claims several hosts (`*.zendesk.com`), the host after the
    /// credentials: one account's keys and entities never meet another's.
    pub fn scope_at(
        &self,
        headers: &HeaderMap,
        credentials: &[HeaderName],
        host: Option<&str>,
    ) -> String {
        // The names the request carries, compared with the list (cheap: a request has a few),
        // so only those are looked up; the hash takes them in the list's order, as before.
        let carried = |name: &&HeaderName| headers.keys().any(|k| k == *name);
        let mut names = credentials.iter().filter(carried).peekable();
        if names.peek().is_none() && host.is_none() {
            return self.uncredentialed.clone();
        }
        let mut ctx = ring::hmac::Context::with_key(&self.key);
        if let Some(host) = host {
            // A name no header has (a leading colon), so it is never a header's bytes.
            ctx.update(b":host:");
            ctx.update(&(host.len() as u64).to_be_bytes());
            ctx.update(host.as_bytes());
        }
        for name in names {
            for v in headers.get_all(name) {
                ctx.update(name.as_str().as_bytes());
                ctx.update(b":");
                ctx.update(&(v.len() as u64).to_be_bytes());
                ctx.update(v.as_bytes());
            }
        }
        scope_of(ctx)
    }

    /// A short, stable name for this secret (not the secret), so the store can tell that it
    /// was started with another one.
    pub fn id(&self) -> String {
        let tag = ring::hmac::sign(&self.key, b"idemproxy scope secret id");
        hex::encode(&tag.as_ref()[..8])
    }
}

/// `k1:` + the hex of what `ctx` hashed.
fn scope_of(ctx: ring::hmac::Context) -> String {
    let mut scope = String::with_capacity(SCOPE_PREFIX.len() + 64);
    scope.push_str(SCOPE_PREFIX);
    super::push_hex(&mut scope, ctx.sign().as_ref());
    scope
}

/// The unkeyed scope, as records stored before scopes were keyed carry it: plain SHA-256 of `Authorization` and the upstream's scope
/// headers. Only read, to find keys stored before the upgrade (see the pipeline's look-up).
pub fn legacy_scope(headers: &HeaderMap, scope_headers: &[HeaderName]) -> String {
    let mut h = Sha256::new();
    let names = std::iter::once(&http::header::AUTHORIZATION).chain(scope_headers);
    for name in names {
        for v in headers.get_all(name) {
            h.update(name.as_str().as_bytes());
            h.update(b":");
            h.update((v.len() as u64).to_be_bytes());
            h.update(v.as_bytes());
        }
    }
    hex::encode(h.finalize())
}

/// The scope an entity name is qualified with, short enough to read: entity locks, versions
/// and claims of one credential never touch another's (unless the upstream shares them).
pub fn entity_scope(scope: &str) -> &str {
    let hexed = scope.strip_prefix(SCOPE_PREFIX).unwrap_or(scope);
    &hexed[..hexed.len().min(16)]
}

/// An entity name as its caller wrote it: `contact:42@0123456789abcdef` → `contact:42`. What
/// error bodies show (the scope is the proxy's business).
pub fn unqualified(entity: &str) -> &str {
    match entity.rsplit_once('@') {
        Some((name, scope))
            if scope.len() == 16 && scope.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            name
        }
        _ => entity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::test_headers as hm;

    #[test]
    fn scope_depends_on_credentials() {
        let k = ScopeKeyer::new(b"0123456789abcdef");
        let sh = credential_list(None, &[HeaderName::from_static("stripe-account")]);
        let scope = |pairs: &[(&str, &str)]| k.scope(&hm(pairs), &sh);
        let a = scope(&[("authorization", "Bearer a")]);
        assert_ne!(a, scope(&[("authorization", "Bearer b")]));
        assert_ne!(
            a,
            scope(&[("authorization", "Bearer a"), ("stripe-account", "acct_1")])
        );
        assert_eq!(a, scope(&[("authorization", "Bearer a"), ("x-other", "1")]));
        // Every common credential header scopes, not only Authorization.
        for name in CREDENTIAL_HEADERS
            .iter()
            .filter(|n| **n != "proxy-authorization")
        {
            assert_ne!(
                scope(&[(name, "A")]),
                scope(&[(name, "B")]),
                "{name} must scope keys"
            );
        }
        // Keyed: another secret, another scope; the plain SHA-256 of old is not it.
        let other = ScopeKeyer::new(b"fedcba9876543210");
        assert_ne!(a, other.scope(&hm(&[("authorization", "Bearer a")]), &sh));
        // Proxy-Authorization is never forwarded: it scopes nothing.
        assert_eq!(
            a,
            scope(&[("authorization", "Bearer a"), ("proxy-authorization", "x")])
        );
        assert_ne!(k.id(), other.id());
        let legacy = legacy_scope(&hm(&[("authorization", "Bearer a")]), &sh[sh.len() - 1..]);
        assert!(!a.contains(&legacy));
        assert!(a.starts_with(SCOPE_PREFIX));
        // No credentials: the keyed hash of nothing, as it always was (made once).
        let none = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"0123456789abcdef");
        let none = format!("k1:{}", hex::encode(ring::hmac::sign(&none, b"")));
        assert_eq!(scope(&[("x-other", "1")]), none);
        assert_eq!(scope(&[]), none);
        assert_ne!(scope(&[("authorization", "")]), none);
    }

    /// An upstream that says what it authenticates with is scoped by those headers only (a
    /// cookie jar's `Cookie` then changes nothing), in the common list's order, so the scope of
    /// a request carrying only them is what it was with the whole list.
    #[test]
    fn an_upstreams_own_credentials_scope_its_keys() {
        let k = ScopeKeyer::new(b"0123456789abcdef");
        let names = |l: &[&'static str]| -> Vec<HeaderName> {
            l.iter().map(|n| HeaderName::from_static(n)).collect()
        };
        let all = credential_list(None, &names(&["stripe-account"]));
        let own = credential_list(Some(&names(&["stripe-account", "authorization"])), &[]);
        assert_eq!(own, names(&["authorization", "stripe-account"]));
        let req = hm(&[("authorization", "Bearer a"), ("stripe-account", "acct_1")]);
        assert_eq!(k.scope(&req, &all), k.scope(&req, &own));
        let with_cookie = hm(&[
            ("authorization", "Bearer a"),
            ("stripe-account", "acct_1"),
            ("cookie", "__cf_bm=1"),
        ]);
        assert_eq!(k.scope(&with_cookie, &own), k.scope(&req, &own));
        assert_ne!(k.scope(&with_cookie, &all), k.scope(&req, &all));
    }

    /// The bytes hashed are fixed (stored keys are found by their scope after an upgrade):
    /// each credential header present, in the list's order and then `scope_headers`', as
    /// name, `:`, the value's length (8 bytes, big-endian) and the value.
    #[test]
    fn the_scope_hashes_a_fixed_layout() {
        let secret = b"0123456789abcdef";
        let sh = credential_list(None, &[HeaderName::from_static("stripe-account")]);
        let headers = hm(&[
            ("stripe-account", "acct_1"),
            ("x-other", "1"),
            ("x-api-key", "K"),
            ("authorization", "Bearer a"),
        ]);
        let mut input = Vec::new();
        for (name, value) in [
            ("authorization", "Bearer a"),
            ("x-api-key", "K"),
            ("stripe-account", "acct_1"),
        ] {
            input.extend_from_slice(name.as_bytes());
            input.push(b':');
            input.extend_from_slice(&(value.len() as u64).to_be_bytes());
            input.extend_from_slice(value.as_bytes());
        }
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let expected = format!(
            "{SCOPE_PREFIX}{}",
            hex::encode(ring::hmac::sign(&key, &input))
        );
        assert_eq!(ScopeKeyer::new(secret).scope(&headers, &sh), expected);
    }
}
