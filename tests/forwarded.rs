//! The key, its scope and the entities are computed from the request exactly as it is
//! forwarded: what the upstream never receives decides nothing, and two requests the upstream
//! tells apart never share a key. Each test runs the shipped `proxy.toml` against a recording
//! upstream and asserts on what the upstream received (how many writes, which headers, how many
//! at once per entity).

mod common;

use common::*;
use serde_json::json;
use std::path::Path;

/// The shipped `proxy.toml` on `127.0.0.1:0`, each API named in `apis` at the URL given.
fn shipped(apis: &[(&str, String)], extra: &[(&str, &str)]) -> String {
    let mut vars = vec![
        ("IDEMPROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
    ];
    vars.extend(apis.iter().cloned());
    shipped_text(&vars, extra)
}

const CONTACT: &str = "/hubspot/crm/v3/objects/contacts/9801";
const UPDATE: &str = r#"{"properties":{"firstname":"Ada"}}"#;

fn hubspot_update(
    url: &str,
    extra: &[(&str, &[u8])],
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let mut headers: Vec<(&str, &[u8])> = vec![
        ("content-type", b"application/json"),
        ("authorization", b"Bearer pat-1"),
    ];
    headers.extend_from_slice(extra);
    build_bytes("PATCH", url, &headers, UPDATE)
}

/// Every request counts as one entity: the tests below send writes to one object only, so
/// the upstream's count of them at once is the entity's.
async fn held_upstream() -> RecordingUpstream {
    RecordingUpstream::builder()
        .entity(|_| "the-object".into())
        .hold()
        .start()
        .await
}

#[tokio::test]
async fn headers_that_are_never_forwarded_split_neither_the_key_nor_the_lock() {
    let api = held_upstream().await;
    let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
    let url = proxy.url(CONTACT);
    let first = tokio::spawn(send(hubspot_update(&url, &[])));
    api.wait_for_held(1).await;
    // The same update, with a proxy credential and a header named in Connection: neither
    // reaches the upstream, so the request is the first one's retry.
    let second = tokio::spawn(send(hubspot_update(
        &url,
        &[
            ("proxy-authorization", b"Basic dXNlcjpwdw=="),
            ("connection", b"x-api-key"),
            ("x-api-key", b"another-caller"),
        ],
    )));
    proxy.wait_for_waiting(1).await;
    api.release_all();
    let (first, second) = (first.await.expect("first"), second.await.expect("second"));
    first.assert_status(200);
    assert_eq!(second.replayed(), Some(true), "{}", second.text());
    assert_eq!(second.body, first.body);
    assert_eq!(api.count(), 1);
    assert_eq!(api.max_concurrent("the-object"), 1);
    let sent = api.request(1);
    assert!(sent.header("proxy-authorization").is_none());
    assert!(sent.header("x-api-key").is_none());
}

#[tokio::test]
async fn a_header_named_in_connection_scopes_nothing_it_is_not_sent() {
    let api = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&shipped(&[("STRIPE_API_URL", api.url())], &[])).await;
    let url = proxy.url("/stripe/v1/customers/cus_1");
    let post = |extra: &'static [(&'static str, &'static str)]| {
        let mut headers = vec![
            ("content-type", "application/x-www-form-urlencoded"),
            ("authorization", "Bearer sk_test_1"),
            ("idempotency-key", "rename-cus_1"),
        ];
        headers.extend_from_slice(extra);
        send(build("POST", &url, &headers, "name=Ada"))
    };
    // Stripe-Account named in Connection is dropped as hop-by-hop: the upstream acts for the
    // platform account, and the key is scoped as the platform's.
    let dropped = post(&[
        ("stripe-account", "acct_9"),
        ("connection", "Stripe-Account"),
    ])
    .await;
    dropped.assert_status(200);
    assert!(api.request(1).header("stripe-account").is_none());
    let plain = post(&[]).await;
    assert_eq!(
        plain.replayed(),
        Some(true),
        "the upstream saw this very request"
    );
    assert_eq!(api.count(), 1);
    // Sent for real, the account is another scope: forwarded, with the header.
    let connected = post(&[("stripe-account", "acct_9")]).await;
    assert_eq!(connected.replayed(), Some(false));
    assert_eq!(api.count(), 2);
    assert_eq!(api.request(2).header("stripe-account"), Some("acct_9"));
}

/// The fake API sets a Cloudflare-style cookie on every answer, as HubSpot's and Zendesk's do.
async fn cookie_setting_api() -> RecordingUpstream {
    RecordingUpstream::with_handler(|rec, n| {
        let body = match rec.path().contains("/tickets/") {
            true => json!({"ticket": {"id": 42, "status": "solved"}, "audit": {"id": n, "ticket_id": 42, "events": []}}),
            false => json!({"id": "9801", "n": n, "properties": {"firstname": "Ada"}}),
        };
        Reply::json(200, &body).header("set-cookie", &format!("__cf_bm=cookie{n}; Path=/; HttpOnly"))
    })
    .await
}

#[tokio::test]
async fn a_cookie_jar_does_not_turn_a_retry_into_a_new_write() {
    let api = cookie_setting_api().await;
    let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
    let url = proxy.url(CONTACT);
    let first = send(hubspot_update(&url, &[])).await;
    let cookie = first.header("set-cookie").unwrap_or_else(|| {
        panic!(
            "no cookie: {} {:?} {}",
            first.status,
            first.headers,
            first.text()
        )
    });
    let jar = cookie.split(';').next().unwrap_or_default().to_owned();
    let retry = send(hubspot_update(&url, &[("cookie", jar.as_bytes())])).await;
    assert_eq!(retry.replayed(), Some(true), "{}", retry.text());
    assert_eq!(api.count(), 1);
    // Another token is another caller, cookie or not.
    let other = send(build_bytes(
        "PATCH",
        &url,
        &[
            ("content-type", b"application/json"),
            ("authorization", b"Bearer pat-2"),
        ],
        UPDATE,
    ))
    .await;
    assert_eq!(other.replayed(), Some(false));
    assert_eq!(api.count(), 2);
}

const REQUESTS_SESSION: &str = r#"
import json, sys, requests
url = sys.argv[1]
s = requests.Session()
s.headers["Authorization"] = "Bearer pat-1"
answers = []
for _ in range(3):
    r = s.patch(url, json={"properties": {"firstname": "Ada"}})
    answers.append([r.status_code, r.headers.get("Idempotent-Replayed")])
print(json.dumps({"answers": answers, "cookies": len(s.cookies)}))
"#;

#[tokio::test]
async fn requests_session_keeps_its_cookies_and_writes_once() {
    if !installed(
        "python3 with requests",
        std::process::Command::new("python3").args(["-c", "import requests"]),
    ) {
        return;
    }
    let api = cookie_setting_api().await;
    let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
    let url = proxy.url(CONTACT);
    let out = tokio::task::spawn_blocking(move || {
        run_json(Path::new("python3"), &["-c", REQUESTS_SESSION, &url], &[])
    })
    .await
    .expect("the script's thread");
    assert_eq!(
        out["cookies"], 1,
        "the session kept the API's cookie: {out}"
    );
    assert_eq!(
        out["answers"],
        json!([[200, "false"], [200, "true"], [200, "true"]])
    );
    assert_eq!(api.count(), 1);
}

const ZENPY: &str = r#"
import json
from zenpy import Zenpy
from zenpy.lib.api_objects import Ticket
z = Zenpy(subdomain="acme", email="agent@example.com", token="t0ken")
for _ in range(3):
    z.tickets.update(Ticket(id=42, status="solved"))
print(json.dumps({"cookies": len(z.tickets.session.cookies)}))
"#;

#[tokio::test]
async fn zenpy_keeps_its_cookies_and_updates_a_ticket_once() {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agents/.venv/bin/python");
    if !installed(
        "zenpy in tests/agents/.venv",
        std::process::Command::new(&venv).args(["-c", "import zenpy"]),
    ) {
        return;
    }
    let api = cookie_setting_api().await;
    let config = shipped(
        &[("ZENDESK_API_URL", api.url())],
        &[("# listen = \"127.0.0.1:8083\"", "listen = \"127.0.0.1:0\"")],
    );
    let proxy = TestProxy::start(&config).await;
    let netloc = proxy.upstream_addr("zendesk").to_string();
    let out = tokio::task::spawn_blocking(move || {
        let env = [
            ("ZENPY_FORCE_NETLOC", netloc),
            ("ZENPY_FORCE_SCHEME", "http".to_owned()),
        ];
        run_json(&venv, &["-c", ZENPY], &env)
    })
    .await
    .expect("the script's thread");
    assert_eq!(
        out["cookies"], 1,
        "zenpy's session kept the API's cookie: {out}"
    );
    assert_eq!(
        api.count_method("PUT"),
        1,
        "three identical updates, one write"
    );
}

fn form(url: &str, body: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let headers: [(&str, &[u8]); 2] = [
        ("content-type", b"application/x-www-form-urlencoded"),
        ("authorization", b"Bearer sk_test_1"),
    ];
    build_bytes("POST", url, &headers, body)
}

#[tokio::test]
async fn bytes_that_are_not_text_are_never_one_value() {
    let api = RecordingUpstream::start().await;
    let config = shipped(
        &[
            ("STRIPE_API_URL", api.url()),
            ("HUBSPOT_API_URL", api.url()),
        ],
        &[],
    );
    let proxy = TestProxy::start(&config).await;
    // A route that reads the field refuses both: `%FF` and `%FE` would both read as U+FFFD.
    for customer in ["cus_%FF", "cus_%FE"] {
        let body = format!("customer={customer}&amount=7");
        let resp = send(form(&proxy.url("/stripe/v1/charges"), &body)).await;
        resp.assert_status(400);
        assert!(
            resp.text().contains("cus_%FF") || resp.text().contains("cus_%FE"),
            "{}",
            resp.text()
        );
    }
    assert_eq!(api.count(), 0);
    // A route that reads no field fingerprints the bytes: two products, two writes.
    for name in ["p_%FF", "p_%FE"] {
        let resp = send(form(
            &proxy.url("/stripe/v1/products"),
            &format!("name={name}"),
        ))
        .await;
        assert_eq!(resp.replayed(), Some(false), "{}", resp.text());
    }
    // So does a query.
    for q in ["%FF", "%FE"] {
        let url = proxy.url(&format!("/stripe/v1/products?expand={q}"));
        let resp = send(form(&url, "name=same")).await;
        assert_eq!(resp.replayed(), Some(false), "{q}: {}", resp.text());
    }
    assert_eq!(api.count(), 4);
    // A path whose escapes are not text names no object: refused, no reconcile read made.
    let resp = send(hubspot_update(
        &proxy.url("/hubspot/crm/v3/objects/contacts/%FF"),
        &[],
    ))
    .await;
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert_eq!(api.count(), 4);
}

#[tokio::test]
async fn a_header_that_is_not_text_is_refused_never_read_as_absent() {
    let api = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
    let url = proxy.url(CONTACT);
    // Two runs, their ids in Latin-1: neither is keyed by the intent alone (the second would
    // get the first's answer); both are refused, nothing forwarded.
    for run in [&b"r\xe9sa-7"[..], b"r\xe9sa-8"] {
        let resp = send(hubspot_update(&url, &[("x-workflow-id", run)])).await;
        assert_eq!(resp.status, 400, "{}", resp.text());
        assert!(resp.text().contains("x-workflow-id"), "{}", resp.text());
    }
    assert_eq!(api.count(), 0);
    // In UTF-8 they are two runs, and a retry of one replays it.
    let seven = "résa-7".as_bytes();
    let a = send(hubspot_update(&url, &[("x-workflow-id", seven)])).await;
    let b = send(hubspot_update(
        &url,
        &[("x-workflow-id", "résa-8".as_bytes())],
    ))
    .await;
    let again = send(hubspot_update(&url, &[("x-workflow-id", seven)])).await;
    assert_eq!((a.replayed(), b.replayed()), (Some(false), Some(false)));
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(again.body, a.body);
    assert_eq!(api.count(), 2);
    // Sent twice, the upstream may read either: refused.
    let twice = send(hubspot_update(
        &url,
        &[("x-workflow-id", seven), ("x-workflow-id", b"other")],
    ))
    .await;
    assert_eq!(twice.status, 400, "{}", twice.text());
    // So is a body with two Content-Types.
    let two_types = send(hubspot_update(&url, &[("content-type", b"text/plain")])).await;
    assert_eq!(two_types.status, 400, "{}", two_types.text());
    assert_eq!(api.count(), 2);
}

#[tokio::test]
async fn a_path_parameter_is_part_of_the_path_the_key_names() {
    let api = held_upstream().await;
    let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
    let run: &[u8] = b"run-5555";
    let with_param = proxy.url("/hubspot/crm/v3/objects/contacts/5555;v=1");
    let first = tokio::spawn(send(hubspot_update(&with_param, &[("x-workflow-id", run)])));
    api.wait_for_held(1).await;
    // The same run and body to the bare path: another request at the upstream, so another
    // key — but the same contact, so it waits for the first.
    let bare = proxy.url("/hubspot/crm/v3/objects/contacts/5555");
    let second = tokio::spawn(send(hubspot_update(&bare, &[("x-workflow-id", run)])));
    proxy.wait_for_waiting(1).await;
    api.release_all();
    let (first, second) = (first.await.expect("first"), second.await.expect("second"));
    assert_eq!(
        (first.replayed(), second.replayed()),
        (Some(false), Some(false))
    );
    assert_ne!(first.idempotency_key(), second.idempotency_key());
    assert_eq!(api.count(), 2);
    assert_eq!(api.max_concurrent("the-object"), 1);
    let paths: Vec<String> = api.requests().iter().map(|r| r.path().to_owned()).collect();
    assert!(
        paths.contains(&"/crm/v3/objects/contacts/5555;v=1".to_owned()),
        "{paths:?}"
    );
}

/// `(first, second)` sent while the first is held at the upstream: the second must wait.
async fn one_at_a_time(
    api: &RecordingUpstream,
    proxy: &TestProxy,
    first: http::Request<http_body_util::Full<bytes::Bytes>>,
    second: http::Request<http_body_util::Full<bytes::Bytes>>,
) -> (Resp, Resp) {
    let first = tokio::spawn(send(first));
    api.wait_for_held(1).await;
    let second = tokio::spawn(send(second));
    proxy.wait_for_waiting(1).await;
    api.release_all();
    let answers = (first.await.expect("first"), second.await.expect("second"));
    assert_eq!(
        api.count(),
        2,
        "{} / {}",
        answers.0.text(),
        answers.1.text()
    );
    assert_eq!(api.max_concurrent("the-object"), 1);
    answers
}

#[tokio::test]
async fn a_number_is_one_entity_however_it_is_written() {
    for id in ["9801.0", "9.801e3", "98010E-1"] {
        let api = held_upstream().await;
        let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
        let batch = format!(r#"{{"inputs":[{{"id":{id},"properties":{{"lastname":"L"}}}}]}}"#);
        let headers: [(&str, &[u8]); 2] = [
            ("content-type", b"application/json"),
            ("authorization", b"Bearer pat-1"),
        ];
        let url = proxy.url("/hubspot/crm/v3/objects/contacts/batch/update");
        let (a, b) = one_at_a_time(
            &api,
            &proxy,
            build_bytes("POST", &url, &headers, &batch),
            hubspot_update(&proxy.url(CONTACT), &[]),
        )
        .await;
        a.assert_status(200);
        b.assert_status(200);
    }
}

#[tokio::test]
async fn a_zendesk_ticket_patch_waits_for_its_put() {
    let api = held_upstream().await;
    let proxy = TestProxy::start(&shipped(&[("ZENDESK_API_URL", api.url())], &[])).await;
    let url = proxy.url("/zendesk/api/v2/tickets/42.json");
    let update = |method: &str| {
        let headers: [(&str, &[u8]); 2] = [
            ("content-type", b"application/json"),
            ("authorization", b"Basic YWdlbnQ6dDBrZW4="),
        ];
        build_bytes(method, &url, &headers, r#"{"ticket":{"status":"solved"}}"#)
    };
    let (put, patch) = one_at_a_time(&api, &proxy, update("PUT"), update("PATCH")).await;
    assert_eq!(
        (put.replayed(), patch.replayed()),
        (Some(false), Some(false))
    );
}

/// A number whose exponent is at the end of i64 names an entity like any other number: the
/// proxy answers, it does not crash.
#[tokio::test]
async fn a_number_with_a_huge_exponent_is_one_more_entity() {
    let api = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&shipped(&[("HUBSPOT_API_URL", api.url())], &[])).await;
    let url = proxy.url("/hubspot/crm/v3/objects/contacts/batch/update");
    for id in ["1e9223372036854775807", "-1e-9223372036854775808"] {
        let batch = format!(r#"{{"inputs":[{{"id":{id},"properties":{{"a":"b"}}}}]}}"#);
        let headers: [(&str, &[u8]); 2] = [
            ("content-type", b"application/json"),
            ("authorization", b"Bearer pat-1"),
        ];
        let resp = send(build_bytes("POST", &url, &headers, &batch)).await;
        assert_eq!(resp.status, 200, "{id}: {}", resp.text());
    }
    assert_eq!(api.count(), 2);
}
