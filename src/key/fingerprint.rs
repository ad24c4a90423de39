//! The fingerprint: what a request asks for, hashed, so a retry of the same intent is
//! recognized whatever order its fields come in.

use crate::rules::body::{form_name_steps, BodyKind, BodyPath, Step};
use crate::rules::urlencoded::{pairs, Pair};
use http::{HeaderMap, HeaderName};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// What a route leaves out of its fingerprint, and the headers it adds.
#[derive(Debug, Default)]
pub struct FingerprintRule {
    pub ignore: Vec<BodyPath>,
    pub headers: Vec<HeaderName>,
}

/// What a fingerprint is computed over.
pub struct Intent<'a> {
    pub method: &'a str,
    /// Upstream-relative path.
    /// Upstream-relative path, exactly as forwarded (`;params`, escapes and all).
    pub path: &'a str,
    /// The query's fields, decoded to bytes (never lossy text: `%FF` is not `%FE`).
    pub query: &'a [Pair],
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
    let mut q: Vec<&Pair> = query.iter().collect();
    // By name only, stable: repeated names keep their order (`a=1&a=2` is not `a=2&a=1`).
    q.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, v) in q {
        field(b"qk", k);
        field(b"qv", v);
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
            // A form parsed only when every field is text (`body::parse`); hashed as bytes.
            let mut pairs: Vec<Pair> = pairs(body)
                .filter(|(name, _)| {
                    let name = std::str::from_utf8(name).unwrap_or_default();
                    !rule.ignore.iter().any(|p| form_field_matches(p, name))
                })
                .collect();
            // Sorted by name, stably — except that fields appending to one `[]` list
            // (`items[][price]`, `items[][qty]`) keep their order among each other: there the
            // order says which values belong to which list element.
            pairs.sort_by(|a, b| list_group(&a.0).cmp(list_group(&b.0)));
            for (k, v) in pairs {
                field(b"fk", &k);
                field(b"fv", &v);
            }
        }
        _ => field(b"raw", body),
    }
    for name in &rule.headers {
        for v in headers.get_all(name) {
            field(name.as_str().as_bytes(), v.as_bytes());
        }
    }
    let mut out = String::new();
    super::push_hex(&mut out, &h.finalize());
    out
}

/// The part of a form name that orders it: up to its first `[]`, or the whole name.
fn list_group(name: &[u8]) -> &[u8] {
    match name.windows(2).position(|w| w == b"[]") {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::body;

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
}
