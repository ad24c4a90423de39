//! `reconcile.answer`: the body a reconciled write is answered with, shaped from the read's.
//!
//! A create's client expects the create's answer (`{"ticket": {...}}`, or HubSpot's batch
//! `{"status": "COMPLETE", "results": [...]}`), but the consistent read that finds the object
//! may answer another shape (a list by `external_id`, one object by id). The template is JSON
//! in which a string `"{read}"` stands for the read's whole body and `"{read.X}"` for its field
//! `X` (a body path, `tickets[0]`), inserted as JSON values, never as text: nothing in a read
//! can change the template's structure.

use crate::rules::body::BodyPath;
use serde_json::Value;

/// The body path a template string names: `Some(Ok(None))` for `"{read}"`, `Some(Ok(path))`
/// for `"{read.X}"`, `None` for any other string (kept as written).
fn read_ref(s: &str) -> Option<Result<Option<BodyPath>, String>> {
    let inner = s.strip_prefix("{read")?.strip_suffix('}')?;
    Some(match inner {
        "" => Ok(None),
        _ => match inner.strip_prefix('.') {
            Some(p) => BodyPath::parse(p).map(Some),
            None => Err(format!("{s:?}: use \"{{read}}\" or \"{{read.field}}\"")),
        },
    })
}

/// Calls `f` with every read reference of the template, for load-time checks.
pub fn visit_reads(t: &Value, f: &mut dyn FnMut(Result<Option<BodyPath>, String>)) {
    match t {
        Value::String(s) => {
            if let Some(r) = read_ref(s) {
                f(r)
            }
        }
        Value::Array(a) => a.iter().for_each(|v| visit_reads(v, f)),
        Value::Object(m) => m.values().for_each(|v| visit_reads(v, f)),
        _ => {}
    }
}

/// The template filled from `read`; `None` when a field it names is absent or null (the
/// object was not found: an empty list has no `tickets[0]`).
pub fn fill(t: &Value, read: &Value) -> Option<Value> {
    Some(match t {
        Value::String(s) => match read_ref(s) {
            None => t.clone(),
            Some(Ok(None)) => read.clone(),
            Some(Ok(Some(path))) => path
                .values(read)
                .into_iter()
                .next()
                .filter(|v| !v.is_null())?
                .clone(),
            Some(Err(_)) => return None,
        },
        Value::Array(a) => Value::Array(a.iter().map(|v| fill(v, read)).collect::<Option<_>>()?),
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| Some((k.clone(), fill(v, read)?)))
                .collect::<Option<_>>()?,
        ),
        other => other.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_list_read_answers_as_the_create() {
        let t = json!({ "ticket": "{read.tickets[0]}" });
        let found = json!({ "tickets": [{ "id": 7, "subject": "{read}" }], "count": 1 });
        assert_eq!(
            fill(&t, &found),
            Some(json!({ "ticket": { "id": 7, "subject": "{read}" } })),
            "values from the read are inserted as they are, never read as templates"
        );
        assert_eq!(fill(&t, &json!({ "tickets": [], "count": 0 })), None);
        let batch = json!({ "status": "COMPLETE", "results": ["{read}"] });
        assert_eq!(
            fill(&batch, &json!({ "id": "1" })),
            Some(json!({ "status": "COMPLETE", "results": [{ "id": "1" }] }))
        );
        let mut bad = Vec::new();
        visit_reads(&json!(["{read.}", "{reads}", "{read.a[x]}"]), &mut |r| {
            bad.push(r.is_err())
        });
        assert_eq!(bad, vec![true, true, true]);
    }
}
