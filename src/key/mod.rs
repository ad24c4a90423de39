//! Idempotency keys: read from the client or derived from the intent ([`header_key`],
//! [`normalize_derived`]), recognized when an SDK made them up ([`KeyPattern`]), fingerprinted
//! ([`fingerprint`]) and scoped by the caller's credentials ([`scope`]); the secret the store's
//! scopes were keyed with is [`crate::scope_secret`]'s.

mod fingerprint;
pub mod scope;

pub use fingerprint::{fingerprint, FingerprintRule, Intent};
pub use scope::{
    credential_list, entity_scope, is_credential, legacy_scope, unqualified, ScopeKeyer,
    CREDENTIAL_HEADERS, SCOPE_PREFIX,
};

use http::{HeaderMap, HeaderName};
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

/// `s`, or its hash when it is longer than `max` bytes or holds a NUL: an entity named from
/// request data must fit every store's index and column (PostgreSQL's text and JSONB refuse
/// NUL, and one refused row would fail every reservation batched with it). Other control
/// characters are kept, and escaped wherever the name is shown.
pub fn bounded(s: String, max: usize) -> String {
    if s.len() <= max && !s.contains('\0') {
        s
    } else {
        hashed(&s)
    }
}

fn hashed(s: &str) -> String {
    let mut out = String::from("sha256:");
    push_hex(&mut out, &Sha256::digest(s.as_bytes()));
    out
}

/// Appends the lower-case hex of `bytes`. Every request hexes two digests (its scope and its
/// fingerprint); `hex::encode` collects its string a `char` at a time, about 2,200
/// instructions for 32 bytes against about 200 here.
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
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

/// Test helper shared by the submodules' tests.
#[cfg(test)]
pub(crate) fn test_headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    h
}

#[cfg(test)]
mod tests {
    #[test]
    fn push_hex_is_hex_encode() {
        let all: Vec<u8> = (0..=255).collect();
        let mut out = String::from("x:");
        super::push_hex(&mut out, &all);
        assert_eq!(out, format!("x:{}", hex::encode(&all)));
    }

    use super::test_headers as hm;
    use super::*;

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
}
