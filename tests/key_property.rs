//! A property over arbitrary bytes in paths, queries, forms, JSON and header values: two
//! requests get the same scoped key only when the upstream would receive the same method,
//! path, query, body and credentials.
//!
//! Requests are drawn as a model (the bytes each part means) and a spelling (how each byte is
//! written: as itself, `%XX` in either case, `+` for a space, JSON escapes, a number's
//! exponent form), so that pairs often mean the same thing in different bytes, or differ in
//! one byte (`%FF` against `%FE`). Each goes through what the server runs: hop-by-hop headers
//! stripped, the router, then step 1's evaluation. What the upstream would receive is judged
//! here on its own terms (decoded bytes, JSON values), never by the proxy's code.

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use idemproxy::config::Config;
use idemproxy::key::ScopeKeyer;
use idemproxy::pipeline::prepare::{plan_key, prepare, Input};
use idemproxy::server::router::{resolve, Action, Listener};
use proptest::prelude::*;

const CONFIG: &str = r#"
[server]
listen = "127.0.0.1:0"
[store]
url = "sqlite://unused.db"
[upstreams.api]
url = "http://127.0.0.1:9"
prefix = "/api"
credential_headers = ["Authorization"]
[[routes]]
name = "thing"
upstream = "api"
methods = ["POST", "PATCH"]
path = "/things/{id}"
entity = "thing:{path.id}"
key = { header = "", derive = ["{header.x-workflow-id}:{entity}:{fingerprint}", "{entity}:{fingerprint}"] }
[[routes]]
name = "form"
upstream = "api"
methods = ["POST"]
path = "/forms"
entity = "customer:{body.customer}"
key = { header = "", derive = "{route}:{fingerprint}" }
"#;

/// Bytes the model draws from: letters, a digit, a space, separators, `%`, and bytes that are
/// not UTF-8 alone (`é` in Latin-1, a UTF-8 lead byte, `%FF`-ish).
const BYTES: &[u8] = b"ab1 +&=;%\xe9\xc3\xa9\xff\xfe";

fn model_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(proptest::sample::select(BYTES), 0..max)
}

/// How a byte is written in a URL part: 0 = as itself when that is safe, 1 = `%XX`,
/// 2 = `%xx`, 3 = `+` for a space (else `%XX`).
fn spell(bytes: &[u8], how: &[u8], in_path: bool) -> String {
    let mut out = String::new();
    for (i, &b) in bytes.iter().enumerate() {
        let choice = how.get(i).copied().unwrap_or(0) % 4;
        let safe = b.is_ascii_alphanumeric() || (in_path && b == b';') || (in_path && b == b'=');
        match (choice, b) {
            (0, _) if safe => out.push(char::from(b)),
            (3, b' ') if !in_path => out.push('+'),
            (2, _) => out.push_str(&format!("%{b:02x}")),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[derive(Debug, Clone)]
struct Model {
    patch: bool,
    segment: Vec<u8>,
    query: Vec<(Vec<u8>, Vec<u8>)>,
    /// `None`: a JSON body; `Some`: form fields.
    form: Option<Vec<(Vec<u8>, Vec<u8>)>>,
    json: Vec<(u8, JsonValue)>,
    auth: u8,
    /// Authorization named in `Connection` (so never forwarded).
    auth_hop: bool,
    proxy_auth: Option<u8>,
    cookie: Option<u8>,
    workflow: Option<Vec<u8>>,
}

#[derive(Debug, Clone)]
enum JsonValue {
    Text(Vec<u8>),
    Number(u16),
}

#[derive(Debug, Clone)]
struct Spelling {
    how: Vec<u8>,
    number: u8,
    reverse_fields: bool,
    escape_text: bool,
}

fn pairs() -> impl Strategy<Value = Vec<(Vec<u8>, Vec<u8>)>> {
    proptest::collection::vec((model_bytes(3), model_bytes(4)), 0..3)
}

fn model() -> impl Strategy<Value = Model> {
    let json = proptest::collection::vec(
        (
            0u8..3,
            prop_oneof![
                model_bytes(4).prop_map(JsonValue::Text),
                (0u16..20).prop_map(JsonValue::Number)
            ],
        ),
        0..3,
    );
    (
        (any::<bool>(), model_bytes(4), pairs()),
        (proptest::option::of(pairs()), json),
        (0u8..2, any::<bool>(), proptest::option::of(0u8..2)),
        (
            proptest::option::of(0u8..2),
            proptest::option::of(model_bytes(3)),
        ),
    )
        .prop_map(
            |(
                (patch, segment, query),
                (form, json),
                (auth, auth_hop, proxy_auth),
                (cookie, workflow),
            )| Model {
                patch,
                segment,
                query,
                form,
                json,
                auth,
                auth_hop,
                proxy_auth,
                cookie,
                workflow,
            },
        )
}

fn spelling() -> impl Strategy<Value = Spelling> {
    (
        proptest::collection::vec(any::<u8>(), 64),
        any::<u8>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(how, number, reverse_fields, escape_text)| Spelling {
            how,
            number,
            reverse_fields,
            escape_text,
        })
}

/// A request as a client sends it: method, target, headers, body.
struct Sent {
    method: Method,
    target: String,
    headers: HeaderMap,
    body: Vec<u8>,
}

fn url_pairs(pairs: &[(Vec<u8>, Vec<u8>)], s: &Spelling, reverse: bool) -> String {
    let mut written: Vec<String> = pairs
        .iter()
        .enumerate()
        .map(|(i, (k, v))| {
            let how = &s.how[(i * 7) % 32..];
            format!("{}={}", spell(k, how, false), spell(v, &how[3..], false))
        })
        .collect();
    // Fields of different names may come in any order; one name's values keep theirs.
    if reverse && pairs.windows(2).all(|w| w[0].0 != w[1].0) {
        written.reverse();
    }
    written.join("&")
}

fn json_text(bytes: &[u8], escape: bool) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    Some(match escape {
        true => text
            .chars()
            .map(|c| format!("\\u{:04x}", c as u32))
            .collect(),
        false => serde_json::to_string(text)
            .ok()?
            .trim_matches('"')
            .to_owned(),
    })
}

fn write(m: &Model, s: &Spelling) -> Sent {
    let mut target = format!("/api/things/{}", spell(&m.segment, &s.how, true));
    if m.form.is_some() {
        target = "/api/forms".into();
    }
    if !m.query.is_empty() {
        target = format!("{target}?{}", url_pairs(&m.query, s, s.reverse_fields));
    }
    let mut headers = HeaderMap::new();
    let mut add = |name: &'static str, value: &[u8]| {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            headers.append(HeaderName::from_static(name), v);
        }
    };
    add("authorization", format!("Bearer t{}", m.auth).as_bytes());
    if m.auth_hop {
        add("connection", b"authorization");
    }
    if let Some(p) = m.proxy_auth {
        add("proxy-authorization", format!("Basic p{p}").as_bytes());
    }
    if let Some(c) = m.cookie {
        add("cookie", format!("__cf_bm=c{c}").as_bytes());
    }
    if let Some(w) = &m.workflow {
        add("x-workflow-id", w);
    }
    let body = match &m.form {
        Some(fields) => {
            add("content-type", b"application/x-www-form-urlencoded");
            let mut fields = fields.clone();
            fields.push((b"customer".to_vec(), m.segment.clone()));
            url_pairs(&fields, s, !s.reverse_fields).into_bytes()
        }
        None => {
            add("content-type", b"application/json");
            let mut members: Vec<String> = Vec::new();
            let mut seen = Vec::new();
            for (k, v) in &m.json {
                if seen.contains(k) {
                    continue;
                }
                seen.push(*k);
                let value = match v {
                    JsonValue::Text(t) => match json_text(t, s.escape_text) {
                        Some(t) => format!("\"{t}\""),
                        None => continue,
                    },
                    JsonValue::Number(n) => match s.number % 3 {
                        0 => n.to_string(),
                        1 => format!("{n}.0"),
                        _ => format!("{n}0e-1"),
                    },
                };
                members.push(format!("\"k{k}\":{value}"));
            }
            if s.reverse_fields {
                members.reverse();
            }
            format!("{{{}}}", members.join(",")).into_bytes()
        }
    };
    Sent {
        method: if m.patch && m.form.is_none() {
            Method::PATCH
        } else {
            Method::POST
        },
        target,
        headers,
        body,
    }
}

/// A URL-encoded string as the upstream decodes it: `+` a space, `%XX` a byte.
fn decoded(raw: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let one = |s: &str| -> Vec<u8> {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            match b[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                },
                c => out.push(c),
            }
            i += 1;
        }
        out
    };
    let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = raw
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (one(k), one(v)),
            None => (one(p), Vec::new()),
        })
        .collect();
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs
}

/// What the upstream receives, judged here: method, path as sent, the query's and a form's
/// fields as decoded bytes, a JSON body as its value, and the credentials forwarded.
fn received(sent: &Sent) -> impl PartialEq + std::fmt::Debug {
    let (path, query) = match sent.target.split_once('?') {
        Some((p, q)) => (p.to_owned(), decoded(q)),
        None => (sent.target.clone(), Vec::new()),
    };
    let hop = sent.headers.get("connection").is_some();
    let auth = (!hop)
        .then(|| sent.headers.get("authorization").cloned())
        .flatten();
    let ct = sent.headers.get("content-type").cloned();
    let body = match ct.as_ref().map(|v| v.as_bytes()) {
        Some(b"application/json") => {
            match serde_json::from_slice::<serde_json::Value>(&sent.body) {
                Ok(v) => format!("json:{v}").into_bytes(),
                Err(_) => sent.body.clone(),
            }
        }
        _ => {
            let text = String::from_utf8_lossy(&sent.body).into_owned();
            format!("form:{:?}", decoded(&text)).into_bytes()
        }
    };
    (sent.method.clone(), path, query, ct, body, auth)
}

/// The scoped key the proxy gives `sent`, or `None` when it is refused.
fn key(config: &Config, scoper: &ScopeKeyer, sent: &Sent) -> Option<(String, String, String)> {
    let uri: http::Uri = sent.target.parse().ok()?;
    let mut headers = sent.headers.clone();
    idemproxy::upstream::strip_hop_by_hop(&mut headers);
    let (upstream, rel, action) =
        resolve(config, &Listener::Main, &sent.method, uri.path()).ok()?;
    let Action::Protect(route, params) = action else {
        return None;
    };
    let plan = plan_key(&upstream, &route, &headers).ok()?;
    let body = bytes::Bytes::from(sent.body.clone());
    let input = Input {
        method: &sent.method,
        path: rel,
        query: uri.query(),
        headers: &headers,
        body: &body,
        path_params: &params,
        host: None,
    };
    let p = prepare(&upstream, &route, plan, &input, scoper).ok()?;
    Some((p.id.upstream.clone(), p.id.scope.clone(), p.id.key.clone()))
}

/// `m` with one byte of one part set to `byte` (`(part, position, byte)`), where it has one.
fn changed(m: &Model, (part, at, byte): (usize, usize, u8)) -> Model {
    let mut m = m.clone();
    let mut parts: Vec<&mut Vec<u8>> = vec![&mut m.segment];
    for (k, v) in m.query.iter_mut().chain(m.form.iter_mut().flatten()) {
        parts.push(k);
        parts.push(v);
    }
    for (_, v) in m.json.iter_mut() {
        if let JsonValue::Text(t) = v {
            parts.push(t);
        }
    }
    parts.extend(m.workflow.as_mut());
    let n = parts.len();
    if let Some(bytes) = parts.get_mut(part % n) {
        let at = at % bytes.len().max(1);
        if let Some(b) = bytes.get_mut(at) {
            *b = byte;
        }
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn one_key_only_for_what_the_upstream_receives_alike(
        a in model(),
        sa in spelling(),
        b in model(),
        sb in spelling(),
        how_alike in 0u8..3,
        change in (0usize..6, 0usize..8, proptest::sample::select(BYTES)),
    ) {
        let config = Config::from_toml(CONFIG, "property.toml").expect("the test config");
        let scoper = ScopeKeyer::new(b"0123456789abcdef0123456789abcdef");
        // A third of the pairs mean the same, a third differ in one byte, a third are drawn
        // apart.
        let b = match how_alike {
            0 => a.clone(),
            1 => changed(&a, change),
            _ => b,
        };
        let (x, y) = (write(&a, &sa), write(&b, &sb));
        if let (Some(kx), Some(ky)) = (key(&config, &scoper, &x), key(&config, &scoper, &y)) {
            if kx == ky {
                prop_assert_eq!(
                    received(&x),
                    received(&y),
                    "one key for {} and {}", x.target, y.target
                );
            }
        }
    }
}

/// The property is not empty: the same meaning in other bytes gets one key.
#[test]
fn the_same_request_in_other_spellings_is_one_key() {
    let config = Config::from_toml(CONFIG, "property.toml").expect("the test config");
    let scoper = ScopeKeyer::new(b"0123456789abcdef0123456789abcdef");
    let sent =
        |target: &str, ct: &'static [u8], body: &str, extra: &[(&'static str, &'static [u8])]| {
            let mut headers = HeaderMap::new();
            headers.insert("authorization", HeaderValue::from_static("Bearer t0"));
            headers.insert(
                "content-type",
                HeaderValue::from_bytes(ct).expect("a value"),
            );
            for (k, v) in extra {
                headers.append(*k, HeaderValue::from_bytes(v).expect("a value"));
            }
            Sent {
                method: Method::POST,
                target: target.into(),
                headers,
                body: body.as_bytes().to_vec(),
            }
        };
    let form: &[u8] = b"application/x-www-form-urlencoded";
    let json: &[u8] = b"application/json";
    let same = [
        (
            sent(
                "/api/forms?a=%41+b&c=1",
                form,
                "customer=c%C3%A9&x=a+b",
                &[],
            ),
            sent(
                "/api/forms?c=1&a=A%20b",
                form,
                "x=a%20b&customer=c%c3%a9",
                &[
                    ("cookie", b"__cf_bm=1"),
                    ("proxy-authorization", b"Basic x"),
                ],
            ),
        ),
        (
            sent(
                "/api/things/7",
                json,
                r#"{"a":"\u00e9","n":1}"#,
                &[("x-workflow-id", "résa".as_bytes())],
            ),
            sent(
                "/api/things/7",
                json,
                r#"{ "n":1, "a":"é" }"#,
                &[("x-workflow-id", "résa".as_bytes())],
            ),
        ),
    ];
    for (x, y) in &same {
        let (kx, ky) = (key(&config, &scoper, x), key(&config, &scoper, y));
        assert!(kx.is_some(), "{}", x.target);
        assert_eq!(kx, ky, "{} and {}", x.target, y.target);
    }
}
