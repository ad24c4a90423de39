//! Lost answers settle without a person only where the API allows it: through the shipped
//! `proxy.toml`, a Zendesk ticket update (a comment included) is reconciled by the stamp it
//! left in its audit, and an upsert HubSpot applies idempotently is sent again. Each test
//! counts what the API received.

mod common;

use common::audits::Audits;
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

/// A ticket update is stamped into its audit's metadata, and a lost answer — a comment's too,
/// which no read of the ticket could tell from an identical one — is reconciled by the stamp
/// among the ticket's audits: found, the caller gets the ticket and nothing is sent twice; not
/// found (lost before Zendesk applied it), the caller is told to send it again, and it is. An
/// upsert HubSpot applies idempotently is sent again (`resend_unknown`).
#[tokio::test]
async fn lost_answers_settle_only_where_the_api_allows() {
    let posts = std::sync::atomic::AtomicUsize::new(0);
    let audits = Audits::default();
    let kept = audits.clone();
    let dropped = std::sync::Mutex::new(std::collections::HashSet::new());
    let api = RecordingUpstream::builder()
        .raw_http1()
        .handler(move |rec, _| {
            let ticket = json!({"ticket": {"id": 42, "status": "solved"}});
            let body: serde_json::Value = serde_json::from_slice(&rec.body).unwrap_or_default();
            let comment = body["ticket"]["comment"]["body"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let first = dropped
                .lock()
                .map(|mut d| d.insert(comment.clone()))
                .unwrap_or(false);
            match rec.method.as_str() {
                "GET" => match Audits::ticket_of(rec.path()) {
                    Some(id) => kept.reply(id, rec.query()),
                    None => Reply::json(200, &ticket),
                },
                "PUT" if comment == "Never landed" && first => Reply::drop_connection(),
                "PUT" => {
                    kept.record(42, &body);
                    match comment == "Printer fixed" && first {
                        true => Reply::drop_connection(),
                        false => Reply::json(200, &ticket),
                    }
                }
                "POST" if posts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 => {
                    Reply::json(200, &json!({"vid": 9801}))
                }
                _ => Reply::drop_connection(),
            }
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
    let put = |body: &'static str| send(build_bytes("PUT", &ticket, &[auth, json_type], body));

    // Applied, answer lost: the audits hold the stamp; the caller gets the ticket, as does
    // its retry, and the comment was sent once.
    let comment = r#"{"ticket":{"comment":{"body":"Printer fixed"}}}"#;
    let first = put(comment).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.json()["ticket"]["id"], 42, "{}", first.text());
    let retry = put(comment).await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert_eq!((api.count_method("PUT"), api.count_method("GET")), (1, 2));
    let sent = api.request(1).json();
    let stamp = sent["ticket"]["metadata"]["custom"]["idemproxy_stamp"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(stamp.starts_with("idem-"), "stamped: {sent}");
    assert_eq!(sent["ticket"]["comment"]["body"], "Printer fixed");
    assert_eq!(audits.stamped(&stamp), 1);
    let read = api.request(2);
    assert_eq!(
        (read.path(), read.query()),
        ("/api/v2/tickets/42/audits.json", Some("sort_order=desc"))
    );
    assert_eq!(api.request(3).path(), "/api/v2/tickets/42.json");

    // Lost before Zendesk applied it: no audit has the stamp, the caller may send it again,
    // and the second send is the one comment.
    let never = r#"{"ticket":{"comment":{"body":"Never landed"}}}"#;
    let lost = put(never).await;
    assert_eq!(
        lost.error_type(),
        Some("upstream_timeout"),
        "{}",
        lost.text()
    );
    assert_eq!((api.count_method("PUT"), api.count_method("GET")), (2, 3));
    let again = put(never).await;
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(api.count_method("PUT"), 3);

    // No comment, answered: nothing to reconcile.
    let status = r#"{"ticket":{"status":"solved"}}"#;
    let solved = put(status).await;
    assert_eq!(solved.status, 200, "{}", solved.text());
    assert_eq!((api.count_method("PUT"), api.count_method("GET")), (4, 3));

    let upsert = proxy.url("/hubspot/contacts/v1/contact/createOrUpdate/email/ada@example.com");
    let bearer: (&str, &[u8]) = ("authorization", b"Bearer pat-1");
    let body = r#"{"properties":[{"property":"firstname","value":"Ada"}]}"#;
    let lost = send(build_bytes("POST", &upsert, &[bearer, json_type], body)).await;
    assert_eq!(lost.status, 504, "{}", lost.text());
    let again = send(build_bytes("POST", &upsert, &[bearer, json_type], body)).await;
    assert_eq!(again.status, 200, "sent again: {}", again.text());
    assert_eq!(api.count_method("POST"), 2);
}
