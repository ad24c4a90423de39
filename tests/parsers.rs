//! Property tests over every parser a request (or a config) reaches: whatever the input, no
//! panic, and either a value or the documented error. proptest shrinks any failure to a
//! minimal input; the case count is bounded so the suite stays quick.

use http::{HeaderMap, HeaderName, HeaderValue};
use idemproxy::key;
use idemproxy::rules::body::{self, BodyKind, BodyPath};
use idemproxy::rules::pattern::{canonical, check_path, PathPattern};
use idemproxy::rules::template::{RequestView, Template};
use proptest::prelude::*;

/// Strings rich in the characters these parsers care about.
fn tricky() -> impl Strategy<Value = String> {
    proptest::string::string_regex(
        r#"[/a-zA-Z0-9%.{}\[\]*:=&?@"\\ \-_\x00-\x1f\u{80}-\u{10ffff}]{0,64}"#,
    )
    .expect("a valid regex")
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn canonical_paths_are_stable_and_safe(path in tricky()) {
        let path = format!("/{path}");
        let c = canonical(&path);
        prop_assert_eq!(canonical(&c), c.clone(), "canonical is idempotent");
        // A path that passes the safety check never turns into one that walks up.
        if check_path(&path).is_ok() {
            prop_assert!(!c.split('/').any(|s| s == ".."), "{} -> {}", path, c);
        }
    }

    #[test]
    fn route_patterns_parse_or_explain_and_match_without_panicking(
        pattern in tricky(),
        path in tricky(),
    ) {
        match PathPattern::parse(&pattern) {
            Ok(p) => {
                let path = format!("/{path}");
                if let Some(params) = p.matches(&path) {
                    prop_assert!(p.matches_ignoring_case(&path));
                    prop_assert!(params.len() <= p.captures().count());
                }
            }
            Err(e) => prop_assert!(!e.is_empty()),
        }
    }

    #[test]
    fn templates_parse_or_explain_and_evaluate_to_a_value_or_the_missing_field(
        text in tricky(),
        json in any::<u8>(),
    ) {
        let Ok(t) = Template::parse(&text) else { return Ok(()) };
        let body = serde_json::json!({"a": {"b": json}, "items": [{"id": 1}, {"id": "x"}]});
        let headers = HeaderMap::new();
        let view = RequestView {
            method: "POST",
            path_params: &[],
            query: &[],
            headers: &headers,
            body: Some(&body),
            route: "r",
            entity: Some("e"),
            fingerprint: Some("f"),
        };
        match t.eval(&view) {
            Ok(values) => prop_assert!(values.len() <= idemproxy::rules::template::MAX_VALUES),
            Err(field) => prop_assert!(!field.is_empty() || text.is_empty()),
        }
        let _ = t.eval_url(&view);
        let _ = t.eval_one(&view);
    }

    #[test]
    fn body_paths_parse_or_explain(path in tricky()) {
        if let Ok(p) = BodyPath::parse(&path) {
            let mut v = serde_json::json!({"a": [1, {"b": 2}], "c": "d"});
            let _ = p.strings(&v);
            p.remove(&mut v);
        }
    }

    #[test]
    fn forms_and_json_bodies_parse_or_explain(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        for kind in [BodyKind::Json, BodyKind::Form, BodyKind::Raw] {
            match body::parse(kind, &bytes) {
                Ok(_) => {}
                Err(e) => prop_assert!(!e.is_empty()),
            }
        }
        let _ = body::form_name_steps(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn deep_forms_never_overflow_the_stack(depth in 1usize..5000) {
        let name = format!("a{}", "[x]".repeat(depth));
        let _ = body::parse(BodyKind::Form, format!("{name}=1").as_bytes());
        let json = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        let _ = body::parse(BodyKind::Json, json.as_bytes());
    }

    #[test]
    fn key_headers_are_a_valid_key_or_key_invalid(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
        let name = HeaderName::from_static("idempotency-key");
        let Ok(value) = HeaderValue::from_bytes(&raw) else { return Ok(()) };
        let mut headers = HeaderMap::new();
        headers.insert(name.clone(), value);
        match key::header_key(&headers, &name) {
            Ok(Some(k)) => {
                prop_assert!(key::validate(&k).is_ok());
                prop_assert!(k.len() <= key::MAX_KEY_LEN);
            }
            Ok(None) => prop_assert!(false, "a present header is read"),
            Err(e) => prop_assert!(e.starts_with("idempotency-key")),
        }
    }
}
