//! What real clients meet, without the SDKs themselves (tests/sdk.rs drives those): reads sent
//! as POST, SDK-generated keys, errors in the upstream API's shape, the upstream's own replay
//! header.

mod common;

use common::*;
use serde_json::json;

fn config(upstream: &RecordingUpstream, extra: &str, routes: &str) -> String {
    api_config(upstream, "", extra, routes)
}

const ROUTES: &str = r#"
[[routes]]
name = "search"
upstream = "api"
methods = ["POST"]
path = "/objects/{type}/search"
read_only = true

[[routes]]
name = "create"
upstream = "api"
methods = ["POST"]
path = "/objects/{type}"
key = { header = "Idempotency-Key", derive = "{route}:{fingerprint}" }
"#;

#[tokio::test]
async fn reads_sent_as_post_are_never_keyed_or_replayed() {
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&upstream, "", ROUTES)).await;
    let url = proxy.url("/api/objects/contacts/search");
    let a = post_json(&url, None, &json!({"q": "x"}), &[]).await;
    let b = post_json(&url, Some("same"), &json!({"q": "x"}), &[]).await;
    let c = post_json(&url, Some("same"), &json!({"q": "x"}), &[]).await;
    for r in [&a, &b, &c] {
        r.assert_status(200);
        assert_eq!(r.replayed(), None, "not a protected route");
    }
    assert_eq!(upstream.count(), 3, "every read reaches the upstream");
    assert_ne!(b.body, c.body);
    // The key is not even read: nothing is stored under it.
    get(&proxy.admin_url("/admin/keys/same"))
        .await
        .assert_status(404);

    let bad = TestProxy::try_start(&config(
        &upstream,
        "",
        "[[routes]]\nname = \"r\"\nupstream = \"api\"\npath = \"/x\"\nread_only = true\nentity = \"e:{route}\"\n",
    ))
    .await;
    let err = bad.err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err.contains("read_only route is never keyed"), "{err}");
}

#[tokio::test]
async fn sdk_generated_keys_give_way_to_the_intent() {
    let upstream = RecordingUpstream::start().await;
    let extra = "sdk_keys = [\"stripe-node-retry-*\", \"{uuid}\"]";
    let proxy = TestProxy::start(&config(&upstream, extra, ROUTES)).await;
    let url = proxy.url("/api/objects/contacts");
    let body = json!({"email": "a@example.com"});
    let first = post_json(&url, Some("stripe-node-retry-1111"), &body, &[]).await;
    let uuid = "0b6d2f1e-8f44-4a3b-9a51-2f7c3d9e1a00";
    let second = post_json(&url, Some(uuid), &body, &[]).await;
    assert_eq!(
        second.replayed(),
        Some(true),
        "same intent, another SDK key"
    );
    assert_eq!(second.idempotency_key(), first.idempotency_key());
    let other = post_json(&url, Some(uuid), &json!({"email": "b@example.com"}), &[]).await;
    assert_eq!(other.replayed(), Some(false), "another intent");
    // A key the caller chose is the key.
    let chosen = post_json(&url, Some("signup-42"), &body, &[]).await;
    assert_eq!(chosen.replayed(), Some(false));
    assert_eq!(chosen.idempotency_key(), Some("signup-42"));
    let reused = post_json(&url, Some("signup-42"), &json!({"email": "c@x"}), &[]).await;
    reused.assert_status(422);
    assert_eq!(upstream.count(), 3);

    // A derivation that lacks a field falls back to the SDK's own key rather than refusing.
    let routes =
        "[[routes]]\nname = \"wf\"\nupstream = \"api\"\nmethods = [\"POST\"]\npath = \"/wf\"\n\
                  key = { header = \"Idempotency-Key\", derive = \"{header.x-workflow-id}\" }\n";
    let proxy = TestProxy::start(&config(&upstream, extra, routes)).await;
    let r = post_json(&proxy.url("/api/wf"), Some(uuid), &body, &[]).await;
    r.assert_status(200);
    assert_eq!(r.idempotency_key(), Some(uuid));
    let again = post_json(&proxy.url("/api/wf"), Some(uuid), &body, &[]).await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(upstream.count(), 4, "the SDK's key dedupes its own retry");
}

#[tokio::test]
async fn proxy_errors_take_the_shape_of_the_upstream_api() {
    let upstream = RecordingUpstream::start().await;
    for (format, status, check) in [
        ("stripe", 400, "/error/type"),
        ("hubspot", 422, "/category"),
        ("zendesk", 422, "/error"),
        ("idemproxy", 422, "/error/type"),
    ] {
        let extra = format!("error_format = \"{format}\"");
        let proxy = TestProxy::start(&config(&upstream, &extra, ROUTES)).await;
        let url = proxy.url("/api/objects/contacts");
        post_json(&url, Some("k1"), &json!({"a": 1}), &[]).await;
        let e = post_json(&url, Some("k1"), &json!({"a": 2}), &[]).await;
        assert_eq!(e.status, status, "{format}: {}", e.text());
        assert_eq!(
            e.error_type(),
            Some("key_reused"),
            "{format}: the header stays"
        );
        assert!(e.json().pointer(check).is_some(), "{format}: {}", e.text());
        assert!(e.text().contains("key_reused"), "{format}: {}", e.text());
    }
    assert_eq!(
        upstream.count(),
        4,
        "one forward per format; the reused key never"
    );
}

#[tokio::test]
async fn an_upstream_replay_stays_a_replay() {
    let upstream = RecordingUpstream::builder()
        .reply(Reply::json(200, &json!({"id": 1})).header("idempotent-replayed", "true"))
        .start()
        .await;
    let proxy = TestProxy::start(&config(&upstream, "", ROUTES)).await;
    let r = post_json(
        &proxy.url("/api/objects/contacts"),
        Some("k"),
        &json!({}),
        &[],
    )
    .await;
    assert_eq!(r.replayed(), Some(true), "the upstream said it replayed");
    assert_eq!(upstream.count(), 1);
}
