use super::*;

#[test]
fn settable_says_what_set_does_without_a_copy() {
    let bodies = [
        serde_json::json!({"ticket": {"subject": "x"}}),
        serde_json::json!({"ticket": "text"}),
        serde_json::json!({"inputs": [{"properties": {}}]}),
        serde_json::json!({"inputs": []}),
        serde_json::json!([1, 2]),
        serde_json::json!("text"),
    ];
    let paths = [
        "ticket.external_id",
        "ticket.a.b",
        "inputs[0].properties.key",
        "inputs[1].properties.key",
        "missing.deeper.key",
        "missing[0]",
        "[1]",
    ];
    for body in &bodies {
        for p in paths {
            let Ok(path) = BodyPath::parse(p) else {
                continue;
            };
            let mut copy = body.clone();
            let set = path.set(&mut copy, Value::Null);
            assert_eq!(path.settable(body), set, "{p} on {body}");
        }
    }
}
use serde_json::json;

#[test]
fn stripe_forms_read_as_json() {
    let v = parse(
        BodyKind::Form,
        b"amount=100&customer=cus_1&metadata[order_id]=7&items[1][id]=b&items[0][id]=a&expand[]=x&expand[]=y",
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        v,
        json!({"amount": "100", "customer": "cus_1", "metadata": {"order_id": "7"},
               "items": [{"id": "a"}, {"id": "b"}], "expand": ["x", "y"]})
    );
    let p = BodyPath::parse("items[*].id").unwrap();
    assert_eq!(p.strings(&v), vec!["a", "b"]);
    assert_eq!(p.to_string(), "items[*].id");
}

#[test]
fn paths_and_removal() {
    let mut v = json!({"a": {"b": 1, "c": 2}, "l": [{"x": 1, "y": 2}]});
    BodyPath::parse("a.b").unwrap().remove(&mut v);
    BodyPath::parse("l[*].x").unwrap().remove(&mut v);
    assert_eq!(v, json!({"a": {"c": 2}, "l": [{"y": 2}]}));
    assert!(BodyPath::parse("a..b").is_err());
    assert!(BodyPath::parse("a[x]").is_err());
    assert_eq!(BodyPath::parse("l[0].y").unwrap().strings(&v), vec!["2"]);
}

#[test]
fn deep_form_names_are_refused_not_a_crash() {
    let deep = format!("a{}=1", "[x]".repeat(20_000));
    assert!(parse(BodyKind::Form, deep.as_bytes()).is_err());
    let ok = format!("a{}=1", "[x]".repeat(MAX_FORM_DEPTH - 1));
    assert!(parse(BodyKind::Form, ok.as_bytes()).is_ok());
}

#[test]
fn bad_json_is_an_error() {
    assert!(parse(BodyKind::Json, b"{nope").is_err());
    assert_eq!(parse(BodyKind::Raw, b"{nope").unwrap(), None);
}
