//! Lost answers settle without a person only where the API allows it: through the shipped
//! `proxy.toml`, a Zendesk ticket update is reconciled by reading the ticket unless it adds a
//! comment (which a read cannot find, and a second send would add twice), and an upsert HubSpot
//! applies idempotently is sent again. Each test counts what the API received.

mod common;

use common::*;
use serde_json::json;

fn shipped(apis: &[(&str, String)]) -> String {
    let mut vars = vec![
        ("IDEMPROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
    ];
    vars.extend(apis.iter().cloned());
    shipped_text(&vars, &[])
}

/// A ticket update that adds a comment is not reconciled by reading the ticket (`unless`): its
/// lost answer stays unknown and it is never sent twice; one without a comment is found by
/// the read. An upsert HubSpot applies idempotently is sent again (`resend_unknown`).
#[tokio::test]
async fn lost_answers_settle_only_where_the_api_allows() {
    let posts = std::sync::atomic::AtomicUsize::new(0);
    let api = RecordingUpstream::builder()
        .raw_http1()
        .handler(move |rec, _| match rec.method.as_str() {
            "GET" => Reply::json(200, &json!({"ticket": {"id": 42, "status": "solved"}})),
            "POST" if posts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 => {
                Reply::json(200, &json!({"vid": 9801}))
            }
            _ => Reply::drop_connection(),
        })
        .start()
        .await;
    let apis = [
        ("ZENDESK_API_URL", api.url()),
        ("HUBSPOT_API_URL", api.url()),
    ];
    let config = shipped(&apis);
    let proxy = TestProxy::start(&config).await;
    let ticket = proxy.url("/zendesk/api/v2/tickets/42.json");
    let auth: (&str, &[u8]) = ("authorization", b"Basic YWdlbnQ6dDBrZW4=");
    let json_type: (&str, &[u8]) = ("content-type", b"application/json");
    let comment = r#"{"ticket":{"comment":{"body":"Printer fixed"}}}"#;
    let first = send(build_bytes("PUT", &ticket, &[auth, json_type], comment)).await;
    assert_eq!(first.status, 504, "{}", first.text());
    let retry = send(build_bytes("PUT", &ticket, &[auth, json_type], comment)).await;
    assert_eq!(
        retry.error_type(),
        Some("outcome_unknown"),
        "{}",
        retry.text()
    );
    assert_eq!((api.count_method("PUT"), api.count_method("GET")), (1, 0));
    // No comment: the read finds the status set, and that is the answer.
    let status = r#"{"ticket":{"status":"solved"}}"#;
    let found = send(build_bytes("PUT", &ticket, &[auth, json_type], status)).await;
    assert_eq!(found.status, 200, "{}", found.text());
    assert_eq!((api.count_method("PUT"), api.count_method("GET")), (2, 1));

    let upsert = proxy.url("/hubspot/contacts/v1/contact/createOrUpdate/email/ada@example.com");
    let bearer: (&str, &[u8]) = ("authorization", b"Bearer pat-1");
    let body = r#"{"properties":[{"property":"firstname","value":"Ada"}]}"#;
    let lost = send(build_bytes("POST", &upsert, &[bearer, json_type], body)).await;
    assert_eq!(lost.status, 504, "{}", lost.text());
    let again = send(build_bytes("POST", &upsert, &[bearer, json_type], body)).await;
    assert_eq!(again.status, 200, "sent again: {}", again.text());
    assert_eq!(api.count_method("POST"), 2);
}
