//! The reads the pipeline sends to the real system on its own — the precheck before a write,
//! the reconcile after a lost answer: a path template evaluated over the original request, the
//! caller's credentials sent along, the whole answer read within the upstream's timeout, and
//! its JSON body held against expected values.

use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::rules::body::BodyPath;
use crate::rules::template::{RequestView, Template};
use crate::store::StoredResponse;
use crate::upstream::{call, full, Called, UpstreamClient};
use http::{HeaderMap, HeaderValue, Method, Request};
use serde_json::Value;

/// The read's path (and query) for this request: a field the request lacks refuses it before
/// anything is sent, and a body value of `..` cannot walk the read to another resource.
pub(super) fn eval_path(
    t: &Template,
    view: &RequestView<'_>,
    what: &str,
    key: &str,
) -> ProxyResult<String> {
    let path = t.eval_url(view).map_err(|field| {
        ProxyError::new(
            ErrorKind::EntityMissing,
            format!("the {what} path needs {{{field}}}, which the request lacks"),
        )
        .with_key(key)
    })?;
    let only_path = path.split('?').next().unwrap_or_default();
    crate::rules::pattern::check_path(only_path).map_err(|why| {
        ProxyError::new(
            ErrorKind::BadPath,
            format!("the {what} path {path:?}: {why}"),
        )
        .with_key(key)
    })?;
    Ok(path)
}

/// Sends the read with the caller's credential headers (and no others) and returns the whole
/// answer; an answer that does not come, or comes over `max_answer`, is an error.
pub(super) async fn read(
    client: &UpstreamClient,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    what: &str,
) -> ProxyResult<StoredResponse> {
    let up = &client.upstream;
    let uri = client.uri(path).map_err(|e| {
        ProxyError::new(
            ErrorKind::BadPath,
            format!("the {what} path {path:?} is not a URL: {e}"),
        )
    })?;
    let mut req = Request::new(full(bytes::Bytes::new()));
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri;
    for name in &up.credentials {
        for v in headers.get_all(name) {
            req.headers_mut().append(name.clone(), v.clone());
        }
    }
    req.headers_mut().insert(
        http::header::ACCEPT,
        HeaderValue::from_static("application/json"),
    );
    match call::call(client, req, up.timeout).await {
        Called::Answer(answer) => Ok(answer),
        Called::Oversize { head, .. } => Err(ProxyError::new(
            ErrorKind::AnswerTooLarge,
            format!(
                "the {what} {path} was answered {} with a body over max_answer",
                head.status
            ),
        )),
        Called::NotSent(why) => Err(ProxyError::new(
            ErrorKind::UpstreamUnreachable,
            format!("the {what} {path} failed: {why}"),
        )),
        Called::Unknown(why) => Err(ProxyError::new(
            ErrorKind::UpstreamTimeout,
            format!("the {what} {path} got no answer: {why}"),
        )),
    }
}

/// Whether the answer's JSON body holds every expected value, and what it held at each field.
/// A field through `[*]` holds when any of its values does (`audits[*].metadata.custom.x`:
/// one of the ticket's audits carries the stamp).
pub(super) fn holds<'a>(
    body: &[u8],
    expect: impl Iterator<Item = (&'a BodyPath, &'a Value)>,
) -> (bool, serde_json::Map<String, Value>) {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    let mut seen = serde_json::Map::new();
    let mut ok = true;
    for (field, expected) in expect {
        let values = json.as_ref().map(|j| field.values(j)).unwrap_or_default();
        let matching = values.iter().find(|v| same(v, expected));
        ok &= matching.is_some();
        let value = matching.or(values.first()).map(|v| (*v).clone());
        seen.insert(format!("body.{field}"), value.unwrap_or(Value::Null));
    }
    (ok, seen)
}

/// Equal as JSON, or equal as text (`"5"` from a form-minded API matches `5`). An expected
/// object holds when every field it names holds (the answer may carry more).
fn same(seen: &Value, expected: &Value) -> bool {
    if let Value::Object(want) = expected {
        return seen.as_object().is_some_and(|got| {
            want.iter()
                .all(|(k, v)| got.get(k).is_some_and(|g| same(g, v)))
        });
    }
    if let (Value::Array(want), Value::Array(got)) = (expected, seen) {
        return want.len() == got.len() && want.iter().zip(got).all(|(v, g)| same(g, v));
    }
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    // Numbers by value (`5.50` is `5.5`, `1e2` is `100`), as numbers are kept as written.
    let number = |v: &Value| match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    let numeric = matches!(seen, Value::Number(_)) || matches!(expected, Value::Number(_));
    seen == expected
        || text(seen) == text(expected)
        || (numeric && number(seen).is_some_and(|a| number(expected) == Some(a)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_compare_as_json_or_text() {
        assert!(same(&json!("free"), &json!("free")));
        assert!(same(&json!(5), &json!("5")));
        let n = |t: &str| serde_json::from_str::<Value>(t).unwrap();
        assert!(same(&n("5.50"), &n("5.5")));
        assert!(same(&n("1e2"), &n("100")));
        assert!(!same(&n("5.51"), &n("5.5")));
        assert!(!same(&json!("taken"), &json!("free")));
        // An object: every field it names, as JSON or text; more in the answer is fine.
        let got = json!({"firstname": "Ada", "age": "36", "extra": 1});
        assert!(same(&got, &json!({"firstname": "Ada", "age": 36})));
        assert!(!same(&got, &json!({"firstname": "Ada", "lastname": "L"})));
        assert!(!same(&json!("Ada"), &json!({"firstname": "Ada"})));
    }

    #[test]
    fn expectations_hold_only_when_every_field_matches() {
        let path = BodyPath::parse("properties.firstname").unwrap();
        let want = json!("Ada");
        let body = br#"{"properties":{"firstname":"Ada"}}"#;
        assert!(holds(body, [(&path, &want)].into_iter()).0);
        let (ok, seen) = holds(br#"{"properties":{}}"#, [(&path, &want)].into_iter());
        assert!(!ok);
        assert_eq!(seen["body.properties.firstname"], Value::Null);
        assert!(!holds(b"not json", [(&path, &want)].into_iter()).0);
    }

    #[test]
    fn a_field_through_a_list_holds_when_any_element_does() {
        let path = BodyPath::parse("audits[*].metadata.custom.stamp").unwrap();
        let want = json!("idem-2");
        let body = br#"{"audits":[{"metadata":{"custom":{}}},{"metadata":{"custom":{"stamp":"idem-1"}}},{"metadata":{"custom":{"stamp":"idem-2"}}}]}"#;
        let (ok, seen) = holds(body, [(&path, &want)].into_iter());
        assert!(ok);
        assert_eq!(seen["body.audits[*].metadata.custom.stamp"], want);
        let none = br#"{"audits":[{"metadata":{"custom":{"stamp":"idem-1"}}}]}"#;
        assert!(!holds(none, [(&path, &want)].into_iter()).0);
        assert!(!holds(br#"{"audits":[]}"#, [(&path, &want)].into_iter()).0);
    }
}
