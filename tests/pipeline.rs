//! The protected-request pipeline, row by row (SPEC.md "Request handling" and "Outcomes"):
//! replay, key reuse, in-flight duplicates, entity locks, release statuses, unreachable and
//! timed-out upstreams, native idempotency headers, credential scopes, key and body rules,
//! multi-entity locks, the error format and the `unmatched` policies. Each test runs the real
//! proxy against a real recording upstream and checks what the upstream received.

mod common;
use common::*;

use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// `[server]` (plus `server_extra` keys), `[upstreams.api]` at `/api` (plus `upstream_extra`
/// keys), then `routes`.
fn config_with(server_extra: &str, url: &str, upstream_extra: &str, routes: &str) -> String {
    format!(
        "{}{server_extra}\n[upstreams.api]\nurl = \"{url}\"\nprefix = \"/api\"\n{upstream_extra}\n\n{routes}\n",
        server_section()
    )
}

/// The proxy in front of `url` (mounted at `/api`), with `upstream_extra` keys and `routes`.
async fn start_at(url: &str, upstream_extra: &str, routes: &str) -> TestProxy {
    TestProxy::start(&config_with("", url, upstream_extra, routes)).await
}

async fn start(upstream: &RecordingUpstream, upstream_extra: &str, routes: &str) -> TestProxy {
    start_at(&upstream.url(), upstream_extra, routes).await
}

/// A POST route at `path` with `extra` keys (entity, key rule, ...).
fn route(name: &str, path: &str, extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\nupstream = \"api\"\nmethods = [\"POST\"]\npath = \"{path}\"\n{extra}\n"
    )
}

/// The Stripe-like charges route: entity from the JSON body's customer.
fn charges(extra: &str) -> String {
    let extra = format!("entity = \"customer:{{body.customer}}\"\n{extra}");
    route("charges", "/v1/charges", &extra)
}

fn charge(customer: &str, amount: i64) -> Value {
    json!({"customer": customer, "amount": amount})
}

/// `POST url` with a JSON body and `Idempotency-Key: key`.
async fn post(url: &str, key: &str, body: &Value) -> Resp {
    post_json(url, Some(key), body, &[]).await
}

/// [`post`] in a task, for requests the upstream holds.
fn spawn_post(url: &str, key: &'static str, body: Value) -> JoinHandle<Resp> {
    let url = url.to_string();
    tokio::spawn(async move { post(&url, key, &body).await })
}

/// Asserts a proxy-made error: status, `Idemproxy-Error`, and the JSON body
/// `{"error": {"type": ..., "message": ...}}` (plus `key` when one was known, nothing else).
#[track_caller]
fn assert_error(resp: &Resp, status: u16, kind: &str) {
    resp.assert_status(status);
    assert_eq!(resp.error_type(), Some(kind), "body {:?}", resp.text());
    assert_eq!(resp.header("content-type"), Some("application/json"));
    let v = resp.json();
    assert_eq!(v["error"]["type"], kind, "{v}");
    let message = v["error"]["message"].as_str();
    assert!(message.is_some_and(|m| !m.is_empty()), "no message: {v}");
    let fields = v["error"].as_object().expect("error object");
    let known = ["type", "message", "key"];
    assert!(fields.keys().all(|k| known.contains(&k.as_str())), "{v}");
}

/// `GET /admin/keys/{key}` on the admin listener: the first record.
async fn admin_record(proxy: &TestProxy, key: &str) -> Value {
    let resp = get(&proxy.admin_url(&format!("/admin/keys/{key}"))).await;
    resp.assert_status(200);
    resp.json()["records"][0].clone()
}

#[tokio::test]
async fn replay_is_byte_identical_and_marked() {
    let upstream = RecordingUpstream::with_handler(|_, n| {
        Reply::json(201, &json!({"id": format!("ch_{n}"), "paid": true})).header("x-custom", "abc")
    })
    .await;
    let proxy = start(&upstream, "", &charges("")).await;
    let url = proxy.url("/api/v1/charges");

    let first = post(&url, "k-replay", &charge("cus_1", 100)).await;
    first.assert_status(201);
    assert_eq!(first.replayed(), Some(false));
    assert_eq!(first.idempotency_key(), Some("k-replay"));

    let second = post(&url, "k-replay", &charge("cus_1", 100)).await;
    assert_eq!(second.status, first.status);
    assert_eq!(second.body, first.body, "byte-identical body");
    for h in ["content-type", "x-custom", "x-upstream-seq"] {
        assert_eq!(second.header(h), first.header(h), "stored header {h}");
    }
    assert_eq!(second.upstream_seq(), Some(1));
    assert_eq!(second.replayed(), Some(true));
    assert_eq!(second.idempotency_key(), Some("k-replay"));
    assert_eq!(upstream.count_method("POST"), 1);
}

#[tokio::test]
async fn same_key_with_another_body_is_key_reused() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream, "", &charges("")).await;
    let url = proxy.url("/api/v1/charges");

    let first = post(&url, "k-reuse", &charge("cus_1", 100)).await;
    first.assert_status(200);
    let reused = post(&url, "k-reuse", &charge("cus_1", 999)).await;
    assert_error(&reused, 422, "key_reused");
    assert_eq!(reused.json()["error"]["key"], "k-reuse");
    assert_eq!(upstream.count_method("POST"), 1, "not forwarded");
}

#[tokio::test]
async fn in_flight_reject_answers_request_in_progress() {
    let upstream = RecordingUpstream::holding().await;
    let proxy = start(&upstream, "", &charges("in_flight = \"reject\"")).await;
    let url = proxy.url("/api/v1/charges");

    let first = spawn_post(&url, "k-busy", charge("cus_1", 100));
    upstream.wait_for_held(1).await;
    let dup = post(&url, "k-busy", &charge("cus_1", 100)).await;
    assert_error(&dup, 409, "request_in_progress");
    assert!(dup.header("retry-after").is_some(), "409 has Retry-After");
    assert_eq!(upstream.count(), 1);

    upstream.release_all();
    first.await.expect("first").assert_status(200);
    let later = post(&url, "k-busy", &charge("cus_1", 100)).await;
    assert_eq!(later.replayed(), Some(true));
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn entity_held_past_lock_timeout_is_entity_busy() {
    let upstream = RecordingUpstream::holding().await;
    let proxy = start(&upstream, "", &charges("lock_timeout = \"200ms\"")).await;
    let url = proxy.url("/api/v1/charges");

    let first = spawn_post(&url, "k-a", charge("cus_1", 1));
    upstream.wait_for_held(1).await;
    // Another key, the same customer: it waits on the entity lock, then gives up.
    let busy = post(&url, "k-b", &charge("cus_1", 2)).await;
    assert_error(&busy, 503, "entity_busy");
    assert!(busy.header("retry-after").is_some(), "503 has Retry-After");
    assert_eq!(upstream.count(), 1, "a busy entity is never forwarded");

    upstream.release_all();
    first.await.expect("first").assert_status(200);
    // entity_busy stored nothing: the same key goes through once the entity is free.
    let retry = post(&url, "k-b", &charge("cus_1", 2)).await;
    assert_eq!(retry.replayed(), Some(false));
    assert_eq!(upstream.count(), 2);
}

#[tokio::test]
async fn release_statuses_release_the_key_for_a_retry() {
    let upstream = RecordingUpstream::with_handler(|rec, n| match n {
        1 => Reply::json(503, &json!({"error": "overloaded"})).header("retry-after", "1"),
        _ => Reply::echo(rec, n),
    })
    .await;
    let proxy = start(&upstream, "release_statuses = [503]", &charges("")).await;
    let url = proxy.url("/api/v1/charges");

    let first = post(&url, "k-rel", &charge("cus_1", 1)).await;
    first.assert_status(503);
    assert_eq!(
        first.json(),
        json!({"error": "overloaded"}),
        "upstream's answer"
    );
    assert_eq!(first.error_type(), None, "not a proxy error");
    assert_eq!(first.replayed(), Some(false));
    assert_eq!(admin_record(&proxy, "k-rel").await["state"], "released");

    let retry = post(&url, "k-rel", &charge("cus_1", 1)).await;
    retry.assert_status(200);
    assert_eq!(retry.replayed(), Some(false));
    assert_eq!(upstream.count(), 2, "a released key is forwarded again");

    let third = post(&url, "k-rel", &charge("cus_1", 1)).await;
    assert_eq!(third.replayed(), Some(true));
    assert_eq!(third.body, retry.body);
    assert_eq!(upstream.count(), 2);
}

#[tokio::test]
async fn unreachable_upstream_is_502_and_releases_the_key() {
    let proxy = start_at(&format!("http://{}", unused_addr()), "", &charges("")).await;
    let url = proxy.url("/api/v1/charges");

    let first = post(&url, "k-down", &charge("cus_1", 1)).await;
    assert_error(&first, 502, "upstream_unreachable");
    let rec = admin_record(&proxy, "k-down").await;
    assert_eq!(rec["state"], "released", "{rec}");
    assert_eq!(rec["attempts"], 1);

    // Never sent, so the retry is forwarded (attempted) again rather than refused.
    let retry = post(&url, "k-down", &charge("cus_1", 1)).await;
    assert_error(&retry, 502, "upstream_unreachable");
    let rec = admin_record(&proxy, "k-down").await;
    assert_eq!(rec["state"], "released");
    assert_eq!(rec["attempts"], 2, "reserved and forwarded again");
}

/// A TLS upstream that accepts TCP and then never answers the handshake: the connection is
/// never made, so nothing was sent — a 502 and a released key, not an unknown outcome.
#[tokio::test]
async fn a_stalled_tls_handshake_counts_as_never_sent() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            sockets.push(s); // kept open, never written to
        }
    });
    let proxy = start_at(&format!("https://{addr}"), "timeout = \"2s\"", &charges("")).await;
    let resp = post(
        &proxy.url("/api/v1/charges"),
        "k-stall",
        &charge("cus_1", 1),
    )
    .await;
    assert_error(&resp, 502, "upstream_unreachable");
    let rec = admin_record(&proxy, "k-stall").await;
    assert_eq!(rec["state"], "released", "{rec}");
    held.abort();
}

#[tokio::test]
async fn upstream_timeout_is_504_then_outcome_unknown() {
    let upstream = RecordingUpstream::hanging().await;
    let proxy = start(&upstream, "timeout = \"300ms\"", &charges("")).await;
    let url = proxy.url("/api/v1/charges");

    let first = post(&url, "k-slow", &charge("cus_1", 1)).await;
    assert_error(&first, 504, "upstream_timeout");
    let retry = post(&url, "k-slow", &charge("cus_1", 1)).await;
    assert_error(&retry, 409, "outcome_unknown");
    assert_eq!(upstream.count(), 1, "never re-sent on its own");
    assert_eq!(admin_record(&proxy, "k-slow").await["state"], "unknown");
}

#[tokio::test]
async fn native_idempotency_header_carries_the_effective_key() {
    let upstream = RecordingUpstream::start().await;
    let refunds = route(
        "workflow",
        "/v1/refunds",
        "key = { header = \"\", derive = \"wf:{header.x-workflow-id}\" }",
    );
    let routes = format!("{}{refunds}", charges(""));
    let native = "native_idempotency_header = \"Idempotency-Key\"";
    let proxy = start(&upstream, native, &routes).await;
    let charges_url = proxy.url("/api/v1/charges");

    // A client key in structured-field form reaches the upstream as the bare key.
    let sf = post(&charges_url, "\"abc\"", &charge("cus_1", 1)).await;
    sf.assert_status(200);
    assert_eq!(upstream.request(1).header("idempotency-key"), Some("abc"));

    // A derived key (the fingerprint) is sent too.
    let derived = post_json(&charges_url, None, &charge("cus_2", 1), &[]).await;
    let key = derived.idempotency_key().expect("effective key");
    assert_eq!(key.len(), 64, "the default derived key is the fingerprint");
    assert_eq!(upstream.request(2).header("idempotency-key"), Some(key));

    // header = "": the client's random SDK key is replaced by the proxy's derived key.
    let refund = post_json(
        &proxy.url("/api/v1/refunds"),
        Some("sdk-random-1"),
        &json!({"charge": "ch_1"}),
        &[("x-workflow-id", "w1")],
    )
    .await;
    assert_eq!(refund.idempotency_key(), Some("wf:w1"));
    assert_eq!(upstream.request(3).header("idempotency-key"), Some("wf:w1"));
    assert_eq!(upstream.count(), 3);
}

#[tokio::test]
async fn keys_are_scoped_by_credentials() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream, "", &charges("")).await;
    let url = proxy.url("/api/v1/charges");
    let as_user = |who: &'static str| {
        let url = url.clone();
        async move {
            let auth = format!("Bearer {who}");
            let headers = [("authorization", auth.as_str())];
            post_json(&url, Some("k-scope"), &charge("cus_1", 1), &headers).await
        }
    };

    let alice = as_user("alice").await;
    let bob = as_user("bob").await;
    assert_eq!(
        bob.replayed(),
        Some(false),
        "never replayed across credentials"
    );
    assert_eq!(bob.upstream_seq(), Some(2));
    assert_eq!(upstream.count(), 2);
    assert_eq!(
        upstream.request(2).header("authorization"),
        Some("Bearer bob")
    );

    let alice_again = as_user("alice").await;
    assert_eq!(alice_again.replayed(), Some(true));
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(upstream.count(), 2);

    // Two records, credentials stored only as a hash.
    let records = get(&proxy.admin_url("/admin/keys/k-scope")).await;
    assert_eq!(records.json()["records"].as_array().map(Vec::len), Some(2));
    assert!(!records.text().contains("alice") && !records.text().contains("bob"));
}

#[tokio::test]
async fn key_validation_and_structured_field_form() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream, "", &charges("")).await;
    let url = proxy.url("/api/v1/charges");

    for bad in ["k".repeat(256), "a b".to_string()] {
        assert_error(
            &post(&url, &bad, &charge("cus_1", 1)).await,
            400,
            "key_invalid",
        );
    }
    assert_eq!(upstream.count(), 0, "an invalid key is never forwarded");
    let longest = "k".repeat(255);
    post(&url, &longest, &charge("cus_1", 1))
        .await
        .assert_status(200);
    assert_eq!(upstream.count(), 1);

    // `"abc"` (structured field) and `abc` (plain) are the same key.
    let quoted = post(&url, "\"abc\"", &charge("cus_2", 1)).await;
    assert_eq!(quoted.replayed(), Some(false));
    assert_eq!(quoted.idempotency_key(), Some("abc"));
    let plain = post(&url, "abc", &charge("cus_2", 1)).await;
    assert_eq!(plain.replayed(), Some(true));
    assert_eq!(plain.body, quoted.body);
    assert_eq!(upstream.count(), 2);
}

#[tokio::test]
async fn required_key_without_derive_is_key_missing_and_optional_passes_through() {
    let upstream = RecordingUpstream::start().await;
    let strict = route("strict", "/strict", "key = { derive = \"\" }");
    let optional = route(
        "optional",
        "/optional",
        "key = { derive = \"\", required = false }",
    );
    let proxy = start(&upstream, "", &format!("{strict}{optional}")).await;
    let (strict_url, optional_url) = (proxy.url("/api/strict"), proxy.url("/api/optional"));

    let missing = post_json(&strict_url, None, &json!({"a": 1}), &[]).await;
    assert_error(&missing, 400, "key_missing");
    assert_eq!(upstream.count(), 0);
    let keyed = post(&strict_url, "k-strict", &json!({"a": 1})).await;
    assert_eq!(keyed.replayed(), Some(false));
    assert_eq!(upstream.count(), 1);

    for n in 2..=3 {
        let resp = post_json(&optional_url, None, &json!({"a": 1}), &[]).await;
        resp.assert_status(200);
        assert_eq!(resp.replayed(), None, "unprotected: no idempotency headers");
        assert_eq!(resp.idempotency_key(), None);
        assert_eq!(resp.upstream_seq(), Some(n));
    }
    assert_eq!(upstream.count_path("/optional"), 2, "forwarded every time");
}

#[tokio::test]
async fn body_over_max_body_is_413_and_never_forwarded() {
    let upstream = RecordingUpstream::start().await;
    let toml = config_with("max_body = \"1KiB\"\n", &upstream.url(), "", &charges(""));
    let proxy = TestProxy::start(&toml).await;
    let url = proxy.url("/api/v1/charges");

    let big = json!({"customer": "cus_1", "note": "x".repeat(2000)});
    assert_error(&post(&url, "k-big", &big).await, 413, "body_too_large");
    // Chunked, with no length announced: the limit holds while reading.
    let chunk = "y".repeat(0x258);
    let raw = format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: proxy\r\nidempotency-key: k-big2\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    let answer = raw_request(proxy.main_addr, raw.as_bytes()).await;
    assert_eq!(raw_status(&answer), 413, "{answer}");
    assert!(answer
        .to_ascii_lowercase()
        .contains("idemproxy-error: body_too_large"));
    assert_eq!(upstream.count(), 0);

    let small = json!({"customer": "cus_1", "note": "x".repeat(900)});
    post(&url, "k-small", &small).await.assert_status(200);
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn body_rules_invalid_json_missing_entity_and_stripe_forms() {
    let upstream = RecordingUpstream::start().await;
    let routes = charges("fingerprint = { ignore = [\"body.metadata.order_id\"] }");
    let proxy = start(&upstream, "", &routes).await;
    let url = proxy.url("/api/v1/charges");

    let json_headers = [
        ("content-type", "application/json"),
        ("idempotency-key", "k-bad"),
    ];
    let malformed = request("POST", &url, &json_headers, "{\"customer\": ").await;
    assert_error(&malformed, 400, "body_invalid");
    let missing = post(&url, "k-missing", &json!({"amount": 1})).await;
    assert_error(&missing, 400, "entity_missing");
    assert_eq!(upstream.count(), 0);

    let form = |body: &'static str| {
        let url = url.clone();
        async move {
            let headers = [("content-type", "application/x-www-form-urlencoded")];
            request("POST", &url, &headers, body).await
        }
    };
    let first = form("customer=cus_1&amount=100&metadata[order_id]=7").await;
    first.assert_status(200);
    assert_eq!(first.replayed(), Some(false));
    let sent = upstream.request(1).body_text();
    assert_eq!(
        sent, "customer=cus_1&amount=100&metadata[order_id]=7",
        "forwarded as sent"
    );
    // Same intent, other pair order and another (ignored) order id: the fingerprint key matches.
    let same = form("amount=100&metadata[order_id]=8&customer=cus_1").await;
    assert_eq!(same.replayed(), Some(true));
    assert_eq!(same.idempotency_key(), first.idempotency_key());
    let other = form("customer=cus_1&amount=200&metadata[order_id]=7").await;
    assert_eq!(other.replayed(), Some(false));
    assert_eq!(upstream.count(), 2);

    let key = first.idempotency_key().expect("derived key");
    let rec = admin_record(&proxy, key).await;
    assert_eq!(unscoped(&rec["entities"]), ["customer:cus_1"]);
}

/// Stored entity names without their credential scope (`contact:1@0123456789abcdef`).
fn unscoped(entities: &serde_json::Value) -> Vec<String> {
    let names = entities.as_array().cloned().unwrap_or_default();
    names
        .iter()
        .map(|e| {
            let e = e.as_str().unwrap_or_default();
            let (name, scope) = e.rsplit_once('@').expect("a scoped entity name");
            assert_eq!(scope.len(), 16, "{e}");
            name.to_owned()
        })
        .collect()
}

/// The contacts of a batch body `{"inputs": [{"id": "1"}, ...]}`, as `contact:<id>`.
fn batch_contacts(rec: &Recorded) -> Vec<String> {
    let inputs = rec.json()["inputs"].as_array().cloned().unwrap_or_default();
    let id = |i: &Value| format!("contact:{}", i["id"].as_str().unwrap_or("?"));
    inputs.iter().map(id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multi_entity_batch_never_overlaps_a_write_to_one_of_its_entities() {
    let upstream = RecordingUpstream::builder()
        .hold()
        .entities(batch_contacts)
        .start()
        .await;
    let entity = "entity = \"contact:{body.inputs[*].id}\"";
    let proxy = start(&upstream, "", &route("batch", "/contacts/batch", entity)).await;
    let url = proxy.url("/api/contacts/batch");
    let ids = |ids: &[&str]| json!({"inputs": ids.iter().map(|id| json!({"id": id})).collect::<Vec<_>>()});

    let batch = spawn_post(&url, "k-batch", ids(&["2", "1"]));
    upstream.wait_for_held(1).await;
    let single = spawn_post(&url, "k-single", ids(&["2"]));
    let unrelated = spawn_post(&url, "k-other", ids(&["3"]));
    // contact 3 reaches the upstream beside the batch; the write to contact 2 waits.
    upstream.wait_for_held(2).await;
    proxy.wait_for_waiting(1).await;
    assert_eq!(upstream.count(), 2);
    assert_eq!(upstream.in_flight_for("contact:2"), 1);

    upstream.release_all();
    for task in [batch, single, unrelated] {
        task.await.expect("task").assert_status(200);
    }
    assert_eq!(upstream.count(), 3);
    assert_eq!(
        upstream.max_concurrent("contact:2"),
        1,
        "never two writes to contact 2"
    );
    assert_eq!(upstream.max_concurrent("contact:1"), 1);
    assert_eq!(upstream.max_concurrent_total(), 2);
    let rec = admin_record(&proxy, "k-batch").await;
    assert_eq!(unscoped(&rec["entities"]), ["contact:1", "contact:2"]);
}

#[tokio::test]
async fn proxy_errors_are_json_with_the_error_header() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream, "", &charges("")).await;
    let url = proxy.url("/api/v1/charges");
    post(&url, "k-err", &charge("cus_1", 1))
        .await
        .assert_status(200);

    let no_route = post(&proxy.url("/nowhere/x"), "k1", &json!({})).await;
    assert_error(&no_route, 404, "no_route");
    assert_error(
        &post(&url, "a b", &charge("cus_1", 1)).await,
        400,
        "key_invalid",
    );
    assert_error(
        &post(&url, "k2", &json!({"amount": 1})).await,
        400,
        "entity_missing",
    );
    assert_error(
        &post(&url, "k-err", &charge("cus_9", 1)).await,
        422,
        "key_reused",
    );
    let json_ct = [("content-type", "application/json")];
    assert_error(
        &request("POST", &url, &json_ct, "[").await,
        400,
        "body_invalid",
    );
    let raw = raw_request(
        proxy.main_addr,
        b"POST /api/../v1/charges HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&raw), 400, "{raw}");
    assert!(raw.contains("\"type\":\"bad_path\""), "{raw}");
    assert_eq!(upstream.count(), 1, "no error was forwarded");
}

/// A proxy with a charges route and the given `unmatched` policy (`None`: the default).
async fn unmatched_proxy(upstream: &RecordingUpstream, policy: Option<&str>) -> TestProxy {
    let extra = policy.map_or(String::new(), |p| format!("unmatched = \"{p}\""));
    start(upstream, &extra, &charges("")).await
}

#[tokio::test]
async fn unmatched_protect_dedupes_by_key_or_fingerprint() {
    let upstream = RecordingUpstream::start().await;
    let proxy = unmatched_proxy(&upstream, None).await;
    let url = proxy.url("/api/v1/other");

    let first = post(&url, "k-un", &json!({"x": 1})).await;
    assert_eq!(first.replayed(), Some(false));
    let second = post(&url, "k-un", &json!({"x": 1})).await;
    assert_eq!(second.replayed(), Some(true));
    assert_eq!(upstream.count_path("/v1/other"), 1);
    // No key: the fingerprint is the key.
    post_json(&url, None, &json!({"x": 2}), &[])
        .await
        .assert_status(200);
    let again = post_json(&url, None, &json!({"x": 2}), &[]).await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(upstream.count_path("/v1/other"), 2);
}

#[tokio::test]
async fn unmatched_reject_is_no_route() {
    let upstream = RecordingUpstream::start().await;
    let proxy = unmatched_proxy(&upstream, Some("reject")).await;
    let resp = post(&proxy.url("/api/v1/other"), "k", &json!({})).await;
    assert_error(&resp, 404, "no_route");
    assert_eq!(upstream.count(), 0);
    // Safe methods still pass through.
    get(&proxy.url("/api/v1/other")).await.assert_status(200);
    assert_eq!(upstream.count_method("GET"), 1);
}

#[tokio::test]
async fn unmatched_passthrough_forwards_every_time() {
    let upstream = RecordingUpstream::start().await;
    let proxy = unmatched_proxy(&upstream, Some("passthrough")).await;
    for n in 1..=2 {
        let resp = post(&proxy.url("/api/v1/other"), "k", &json!({})).await;
        resp.assert_status(200);
        assert_eq!(resp.replayed(), None);
        assert_eq!(resp.upstream_seq(), Some(n));
    }
    assert_eq!(upstream.count_method("POST"), 2);
}

#[tokio::test]
async fn spelling_variants_of_a_path_meet_the_same_route() {
    let upstream = RecordingUpstream::start().await;
    let routes = route(
        "contact",
        "/contacts/{id}",
        "entity = \"contact:{path.id}\"\nkey = { header = \"\", derive = \"{entity}:{fingerprint}\" }",
    );
    let proxy = start(&upstream, "", &routes).await;
    let first = post(&proxy.url("/api/contacts/123"), "ignored", &json!({"x": 1})).await;
    first.assert_status(200);
    // A doubled slash, a trailing slash and an escaped letter meet the same route and entity
    // (never slipping past the route as an unmatched request), but the key is the path as
    // the upstream receives it: an answer to one spelling is never replayed for another.
    let mut keys = vec![first.idempotency_key().map(str::to_owned)];
    for (n, variant) in [
        "/api/contacts//123",
        "/api/contacts/123/",
        "/api/%63ontacts/123",
    ]
    .iter()
    .enumerate()
    {
        let again = post(&proxy.url(variant), "ignored", &json!({"x": 1})).await;
        assert_eq!(again.replayed(), Some(false), "{variant}");
        let key = again.idempotency_key().map(str::to_owned);
        assert!(
            key.as_deref()
                .is_some_and(|k| k.starts_with("contact:123:")),
            "{variant}: {key:?}"
        );
        assert!(!keys.contains(&key), "{variant}: {key:?}");
        keys.push(key);
        let retry = post(&proxy.url(variant), "ignored", &json!({"x": 1})).await;
        assert_eq!(retry.replayed(), Some(true), "{variant}");
        assert_eq!(upstream.count(), n + 2);
        assert_eq!(upstream.request(n as u64 + 2).path(), &variant[4..]);
    }
    assert!(first
        .idempotency_key()
        .is_some_and(|k| k.starts_with("contact:123:")));
}

#[tokio::test]
async fn a_deeply_nested_form_is_refused_and_the_proxy_lives_on() {
    let upstream = RecordingUpstream::start().await;
    let routes = route("forms", "/forms", "entity = \"thing:{body.id}\"");
    let proxy = start(&upstream, "", &routes).await;
    let deep = format!("id=1&a{}=1", "[x]".repeat(20_000));
    let resp = request(
        "POST",
        &proxy.url("/api/forms"),
        &[
            ("content-type", "application/x-www-form-urlencoded"),
            ("idempotency-key", "deep"),
        ],
        deep,
    )
    .await;
    assert_error(&resp, 400, "body_invalid");
    // Also on the unmatched route, where nothing reads the body: fingerprinted as raw bytes.
    let deep = format!("a{}=1", "[x]".repeat(20_000));
    let form = [
        ("content-type", "application/x-www-form-urlencoded"),
        ("idempotency-key", "deep2"),
    ];
    request("POST", &proxy.url("/api/other"), &form, deep)
        .await
        .assert_status(200);
    assert_eq!(upstream.count(), 1);
    post(&proxy.url("/api/forms"), "after", &json!({"id": "2"}))
        .await
        .assert_status(200);
}

/// A body the route reads, sent without a Content-Type or as a form (curl's `-d`), is refused
/// with what was read and what to send; nothing is forwarded.
#[tokio::test]
async fn a_body_refusal_says_how_it_was_read_and_what_to_send() {
    let upstream = RecordingUpstream::start().await;
    let routes = route("forms", "/things", "entity = \"thing:{body.id}\"");
    let proxy = start(&upstream, "", &routes).await;
    let url = proxy.url("/api/things");
    let json_body = r#"{"id":"t1"}"#;
    let untyped = request("POST", &url, &[("idempotency-key", "b1")], json_body).await;
    assert_error(&untyped, 400, "body_invalid");
    assert!(
        untyped.text().contains("no Content-Type"),
        "{}",
        untyped.text()
    );
    assert!(
        untyped.text().contains("application/json"),
        "{}",
        untyped.text()
    );
    let form = [
        ("idempotency-key", "b2"),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let as_form = request("POST", &url, &form, json_body).await;
    assert_error(&as_form, 400, "entity_missing");
    assert!(
        as_form.text().contains("looks like JSON"),
        "{}",
        as_form.text()
    );
    assert_eq!(upstream.count(), 0);
}
