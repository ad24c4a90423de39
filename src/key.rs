//! Idempotency keys: read from the client, derived from the intent, fingerprinted and scoped.

use crate::body::{form_name_steps, BodyKind, BodyPath, Step};
use crate::config::FingerprintRule;
use http::{HeaderMap, HeaderName};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Longest key accepted (client keys) before `key_invalid`.
pub const MAX_KEY_LEN: usize = 255;

/// Reads a client key from `name`, in the plain form (`abc`) or the IETF structured-field
/// string form (`"abc"`, with `\"` and `\\` escapes). `Ok(None)` when the header is absent.
pub fn header_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, String> {
    let Some(raw) = headers.get(name) else {
        return Ok(None);
    };
    let s = raw
        .to_str()
        .map_err(|_| format!("{name} must be visible ASCII"))?
        .trim();
    let key = match s.strip_prefix('"') {
        Some(inner) => unquote_sf_string(inner)
            .ok_or_else(|| format!("{name} is a malformed structured-field string"))?,
        None => s.to_owned(),
    };
    validate(&key).map_err(|e| format!("{name}: {e}"))?;
    Ok(Some(key))
}

fn unquote_sf_string(inner: &str) -> Option<String> {
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                c @ ('"' | '\\') => out.push(c),
                _ => return None,
            },
            // The closing quote must end the value (parameters are not meaningful here).
            '"' => return chars.as_str().is_empty().then_some(out),
            c => out.push(c),
        }
    }
    None
}

/// A key must be 1–255 visible ASCII characters.
pub fn validate(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("the key is empty".into());
    }
    if key.len() > MAX_KEY_LEN {
        return Err(format!(
            "the key is {} characters, over {MAX_KEY_LEN}",
            key.len()
        ));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the key must be visible ASCII (no spaces or control characters)".into());
    }
    Ok(())
}

/// A derived key that cannot be a header value or is too long is replaced by its hash, so
/// derivation never fails on odd field values.
pub fn normalize_derived(key: String) -> String {
    if validate(&key).is_ok() {
        key
    } else {
        hashed(&key)
    }
}

/// `s`, or its hash when it is longer than `max` bytes.
pub fn bounded(s: String, max: usize) -> String {
    if s.len() <= max {
        s
    } else {
        hashed(&s)
    }
}

fn hashed(s: &str) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(s.as_bytes())))
}

/// A pattern of client keys that an SDK generates on every call: `{uuid}` (8-4-4-4-12 hex, as
/// stripe-python makes them) or a glob where `*` matches anything (`stripe-node-retry-*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPattern {
    Uuid,
    Glob(Vec<String>),
}

impl KeyPattern {
    pub fn parse(s: &str) -> Result<KeyPattern, String> {
        if s == "{uuid}" {
            return Ok(KeyPattern::Uuid);
        }
        if s.is_empty() || s.contains(['{', '}']) {
            return Err(format!(
                "sdk key pattern {s:?}: use {{uuid}} or a glob with * (e.g. \"stripe-node-retry-*\")"
            ));
        }
        Ok(KeyPattern::Glob(s.split('*').map(str::to_owned).collect()))
    }

    pub fn matches(&self, key: &str) -> bool {
        match self {
            KeyPattern::Uuid => is_uuid(key),
            KeyPattern::Glob(parts) => {
                let (first, rest) = parts
                    .split_first()
                    .map_or(("", &[][..]), |(f, r)| (f.as_str(), r));
                let Some(mut left) = key.strip_prefix(first) else {
                    return false;
                };
                let Some((last, middle)) = rest.split_last() else {
                    return left.is_empty();
                };
                for part in middle {
                    match left.find(part.as_str()) {
                        Some(i) => left = &left[i + part.len()..],
                        None => return false,
                    }
                }
                left.ends_with(last.as_str())
            }
        }
    }
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, hex digits of either case.
fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// What a fingerprint is computed over.
pub struct Intent<'a> {
    pub method: &'a str,
    /// Upstream-relative path.
    pub path: &'a str,
    pub query: &'a [(String, String)],
    pub body: &'a [u8],
    pub kind: BodyKind,
    /// The parsed body (JSON or form), if it parsed.
    pub parsed: Option<&'a Value>,
    pub headers: &'a HeaderMap,
}

/// SHA-256 (hex) over the request's intent: method, upstream path, sorted query, canonical
/// body less ignored fields, and the configured headers.
pub fn fingerprint(intent: &Intent<'_>, rule: &FingerprintRule) -> String {
    let Intent {
        method,
        path,
        query,
        body,
        kind,
        parsed,
        headers,
    } = *intent;
    let mut h = Sha256::new();
    let mut field = |label: &[u8], data: &[u8]| {
        // Length-prefixed fields: no two different requests hash the same bytes.
        h.update(label);
        h.update((data.len() as u64).to_be_bytes());
        h.update(data);
    };
    field(b"method", method.as_bytes());
    field(b"path", path.as_bytes());
    let mut q: Vec<&(String, String)> = query.iter().collect();
    // By name only, stable: repeated names keep their order (`a=1&a=2` is not `a=2&a=1`).
    q.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, v) in q {
        field(b"qk", k.as_bytes());
        field(b"qv", v.as_bytes());
    }
    match (kind, parsed) {
        (BodyKind::Json, Some(v)) => {
            let canonical = if rule.ignore.is_empty() {
                serde_json::to_vec(v)
            } else {
                let mut v = v.clone();
                rule.ignore.iter().for_each(|p| p.remove(&mut v));
                serde_json::to_vec(&v)
            };
            field(b"json", &canonical.unwrap_or_default());
        }
        (BodyKind::Form, Some(_)) => {
            let mut pairs: Vec<(String, String)> = form_urlencoded::parse(body)
                .filter(|(name, _)| !rule.ignore.iter().any(|p| form_field_matches(p, name)))
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            // Sorted by name, stably — except that fields appending to one `[]` list
            // (`items[][price]`, `items[][qty]`) keep their order among each other: there the
            // order says which values belong to which list element.
            pairs.sort_by(|a, b| list_group(&a.0).cmp(list_group(&b.0)));
            for (k, v) in pairs {
                field(b"fk", k.as_bytes());
                field(b"fv", v.as_bytes());
            }
        }
        _ => field(b"raw", body),
    }
    for name in &rule.headers {
        for v in headers.get_all(name) {
            field(name.as_str().as_bytes(), v.as_bytes());
        }
    }
    hex::encode(h.finalize())
}

/// The part of a form name that orders it: up to its first `[]`, or the whole name.
fn list_group(name: &str) -> &str {
    match name.find("[]") {
        Some(i) => &name[..i + 2],
        None => name,
    }
}

/// Whether form field `name` (`metadata[order_id]`, `items[0][id]`) is what `path` names.
fn form_field_matches(path: &BodyPath, name: &str) -> bool {
    let steps = form_name_steps(name);
    steps.len() == path.0.len()
        && steps.iter().zip(&path.0).all(|(s, p)| match p {
            Step::Key(k) => k == s,
            Step::Index(i) => s.parse::<usize>().ok() == Some(*i),
            Step::All => s.is_empty() || s.parse::<usize>().is_ok(),
        })
}

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

/// The headers that carry a request's credentials: [`CREDENTIAL_HEADERS`], then `extra`
/// (the upstream's `scope_headers`), each name once. Also what a precheck or reconcile read
/// sends on the caller's behalf.
pub fn credential_names(extra: &[HeaderName]) -> impl Iterator<Item = HeaderName> + '_ {
    CREDENTIAL_HEADERS
        .iter()
        .map(|n| HeaderName::from_static(n))
        .chain(
            extra
                .iter()
                .filter(|h| !CREDENTIAL_HEADERS.contains(&h.as_str()))
                .cloned(),
        )
}

/// Hashes credential headers into a scope, keyed with a secret that is not kept in the
/// store, so a copy of the database alone cannot be used to test guesses at credentials.
pub struct ScopeKeyer {
    key: ring::hmac::Key,
}

/// Scopes written by this release start with this, so old (unkeyed) ones can be told apart.
pub const SCOPE_PREFIX: &str = "k1:";

impl ScopeKeyer {
    pub fn new(secret: &[u8]) -> ScopeKeyer {
        ScopeKeyer {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
        }
    }

    /// `k1:` + hex HMAC-SHA256 over every credential header of the request (name, length,
    /// value), in a fixed order.
    pub fn scope(&self, headers: &HeaderMap, scope_headers: &[HeaderName]) -> String {
        let mut ctx = ring::hmac::Context::with_key(&self.key);
        for name in credential_names(scope_headers) {
            for v in headers.get_all(&name) {
                ctx.update(name.as_str().as_bytes());
                ctx.update(b":");
                ctx.update(&(v.len() as u64).to_be_bytes());
                ctx.update(v.as_bytes());
            }
        }
        format!("{SCOPE_PREFIX}{}", hex::encode(ctx.sign().as_ref()))
    }

    /// A short, stable name for this secret (not the secret), so the store can tell that it
    /// was started with another one.
    pub fn id(&self) -> String {
        let tag = ring::hmac::sign(&self.key, b"idemproxy scope secret id");
        hex::encode(&tag.as_ref()[..8])
    }
}

/// The first release's scope: plain SHA-256 of `Authorization` and the upstream's scope
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
    use crate::body;

    fn hm(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn header_keys_plain_and_structured() {
        let n = HeaderName::from_static("idempotency-key");
        assert_eq!(
            header_key(&hm(&[("idempotency-key", "abc")]), &n)
                .unwrap()
                .as_deref(),
            Some("abc")
        );
        assert_eq!(
            header_key(&hm(&[("idempotency-key", "\"a\\\"b\"")]), &n)
                .unwrap()
                .as_deref(),
            Some("a\"b")
        );
        assert_eq!(header_key(&hm(&[]), &n).unwrap(), None);
        assert!(header_key(&hm(&[("idempotency-key", "\"abc")]), &n).is_err());
        assert!(header_key(&hm(&[("idempotency-key", "a b")]), &n).is_err());
        let long = "x".repeat(256);
        assert!(header_key(&hm(&[("idempotency-key", &long)]), &n).is_err());
        assert!(normalize_derived("a b".into()).starts_with("sha256:"));
        assert_eq!(normalize_derived("wf:1".into()), "wf:1");
    }

    fn fp(body: &[u8], kind: BodyKind, ignore: &[&str]) -> String {
        let rule = FingerprintRule {
            ignore: ignore.iter().map(|p| BodyPath::parse(p).unwrap()).collect(),
            headers: vec![],
        };
        let parsed = body::parse(kind, body).unwrap();
        let headers = HeaderMap::new();
        let intent = Intent {
            method: "POST",
            path: "/x",
            query: &[],
            body,
            kind,
            parsed: parsed.as_ref(),
            headers: &headers,
        };
        fingerprint(&intent, &rule)
    }

    #[test]
    fn json_fingerprint_ignores_key_order_and_ignored_fields() {
        let a = fp(br#"{"a":1,"b":{"c":2,"t":"x"}}"#, BodyKind::Json, &["b.t"]);
        let b = fp(
            br#"{ "b": {"t":"y", "c":2}, "a":1 }"#,
            BodyKind::Json,
            &["b.t"],
        );
        assert_eq!(a, b);
        assert_ne!(a, fp(br#"{"a":2,"b":{"c":2}}"#, BodyKind::Json, &["b.t"]));
    }

    #[test]
    fn form_fingerprint_sorts_pairs_and_ignores_bracket_fields() {
        let a = fp(
            b"amount=1&metadata[rid]=1&customer=c",
            BodyKind::Form,
            &["metadata.rid"],
        );
        let b = fp(
            b"customer=c&amount=1&metadata[rid]=2",
            BodyKind::Form,
            &["metadata.rid"],
        );
        assert_eq!(a, b);
        assert_ne!(
            a,
            fp(b"customer=c&amount=2", BodyKind::Form, &["metadata.rid"])
        );
        assert_ne!(
            fp(b"{}", BodyKind::Raw, &[]),
            fp(b"{ }", BodyKind::Raw, &[])
        );
    }

    #[test]
    fn different_requests_never_share_a_fingerprint() {
        // Repeated names keep their order; only names are sorted.
        let a = fp(
            b"items[][price]=x&items[][qty]=1&items[][price]=y&items[][qty]=2",
            BodyKind::Form,
            &[],
        );
        let b = fp(
            b"items[][price]=x&items[][qty]=2&items[][price]=y&items[][qty]=1",
            BodyKind::Form,
            &[],
        );
        assert_ne!(a, b);
        let f = |body: &[u8]| fp(body, BodyKind::Form, &[]);
        let c = f(b"items[][price]=x&items[][price]=y&items[][qty]=1&items[][qty]=2");
        assert_ne!(a, c, "the interleaving of one list's fields matters");
        let d = f(b"currency=usd&items[][price]=x&items[][qty]=1&items[][price]=y&items[][qty]=2");
        let e = f(b"items[][price]=x&items[][qty]=1&items[][price]=y&items[][qty]=2&currency=usd");
        assert_eq!(d, e, "other fields still sort");
        // Numbers are compared by their text, not through f64.
        let big1 = fp(br#"{"amount":100000000000000000001}"#, BodyKind::Json, &[]);
        let big2 = fp(br#"{"amount":100000000000000000002}"#, BodyKind::Json, &[]);
        assert_ne!(big1, big2);
        assert_ne!(
            fp(br#"{"x":0.1000000000000000001}"#, BodyKind::Json, &[]),
            fp(br#"{"x":0.1}"#, BodyKind::Json, &[])
        );
    }

    #[test]
    fn sdk_key_patterns() {
        let node = KeyPattern::parse("stripe-node-retry-*").unwrap();
        assert!(node.matches("stripe-node-retry-0b6d2f1e-8f44-4a3b-9a51-2f7c3d9e1a00"));
        assert!(!node.matches("signup-42"));
        let uuid = KeyPattern::parse("{uuid}").unwrap();
        assert!(uuid.matches("0b6d2f1e-8f44-4a3b-9a51-2f7c3d9e1a00"));
        assert!(!uuid.matches("order-0b6d2f1e-8f44-4a3b-9a51-2f7c3d9e1a00"));
        let mid = KeyPattern::parse("a*b*c").unwrap();
        assert!(mid.matches("abc") && mid.matches("a-b-c") && !mid.matches("acb"));
        assert!(KeyPattern::parse("{x}").is_err());
    }

    #[test]
    fn scope_depends_on_credentials() {
        let k = ScopeKeyer::new(b"0123456789abcdef");
        let sh = [HeaderName::from_static("stripe-account")];
        let scope = |pairs: &[(&str, &str)]| k.scope(&hm(pairs), &sh);
        let a = scope(&[("authorization", "Bearer a")]);
        assert_ne!(a, scope(&[("authorization", "Bearer b")]));
        assert_ne!(
            a,
            scope(&[("authorization", "Bearer a"), ("stripe-account", "acct_1")])
        );
        assert_eq!(a, scope(&[("authorization", "Bearer a"), ("x-other", "1")]));
        // Every common credential header scopes, not only Authorization.
        for name in CREDENTIAL_HEADERS {
            assert_ne!(
                scope(&[(name, "A")]),
                scope(&[(name, "B")]),
                "{name} must scope keys"
            );
        }
        // Keyed: another secret, another scope; the plain SHA-256 of old is not it.
        let other = ScopeKeyer::new(b"fedcba9876543210");
        assert_ne!(a, other.scope(&hm(&[("authorization", "Bearer a")]), &sh));
        assert_ne!(k.id(), other.id());
        let legacy = legacy_scope(&hm(&[("authorization", "Bearer a")]), &sh);
        assert!(!a.contains(&legacy));
        assert!(a.starts_with(SCOPE_PREFIX));
    }
}
