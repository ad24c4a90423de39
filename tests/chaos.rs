//! The chaos cases people hit in production, each driven through the real proxy against a real
//! recording upstream: duplicate storms, keyless retries, webhook re-deliveries, hot entities,
//! client timeouts, dropped connections and a proxy killed mid-flight. Every test asserts on
//! what the upstream received, not only on what the client was answered.

mod common;
use common::*;

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinHandle;

/// `[server]` plus `[upstreams.api]` at `/api` (with `extra` upstream keys) plus `routes`.
fn config(upstream_url: &str, extra_upstream: &str, routes: &str) -> String {
    format!(
        "{}\n[upstreams.api]\nurl = \"{upstream_url}\"\nprefix = \"/api\"\n{extra_upstream}\n\n{routes}\n",
        server_section()
    )
}

/// A `POST /v1/charges` route whose entity is the JSON body's customer, plus `extra` keys.
fn charges_route(extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"charges\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
         path = \"/v1/charges\"\nentity = \"customer:{{body.customer}}\"\n{extra}\n"
    )
}

/// A JSON POST to `url` with extra headers, spawned so that many can run at once.
fn spawn_post(url: String, body: Value, headers: Vec<(String, String)>) -> JoinHandle<Resp> {
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        post_json(&url, None, &body, &headers).await
    })
}

fn key_header(key: &str) -> Vec<(String, String)> {
    vec![("idempotency-key".into(), key.into())]
}

/// Awaits every task; panics if one panicked.
async fn join_all(tasks: Vec<JoinHandle<Resp>>) -> Vec<Resp> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
}

/// Asserts a proxy error: status, `Idemproxy-Error` and the JSON body's type.
#[track_caller]
fn assert_error(resp: &Resp, status: u16, kind: &str) {
    resp.assert_status(status);
    assert_eq!(resp.error_type(), Some(kind), "body {:?}", resp.text());
    assert_eq!(resp.json()["error"]["type"], kind);
}

/// Asserts that exactly one answer is fresh and the rest are replays, all identical.
#[track_caller]
fn assert_one_fresh_rest_replayed(answers: &[Resp]) {
    let first = &answers[0];
    for a in answers {
        a.assert_status(200);
        assert_eq!(a.status, first.status);
        assert_eq!(a.body, first.body, "every answer carries the same body");
    }
    let fresh = answers
        .iter()
        .filter(|a| a.replayed() == Some(false))
        .count();
    let replayed = answers
        .iter()
        .filter(|a| a.replayed() == Some(true))
        .count();
    assert_eq!(fresh, 1, "exactly one answer comes from the upstream");
    assert_eq!(
        replayed,
        answers.len() - 1,
        "every other answer is a replay"
    );
}

/// Twenty concurrent identical POSTs to `path` with one key, against a holding upstream.
async fn storm_with_one_key(routes: &str, path: &str) {
    let upstream = RecordingUpstream::holding().await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", routes)).await;
    let url = proxy.url(path);
    let body = json!({"customer": "cus_1", "amount": 100});

    let tasks: Vec<_> = (0..20)
        .map(|_| spawn_post(url.clone(), body.clone(), key_header("storm-1")))
        .collect();
    // One request is at the upstream and the other 19 are queued inside the proxy: the
    // duplicates really overlap with the original.
    upstream.wait_for_held(1).await;
    proxy.wait_for_waiting(19).await;
    assert_eq!(upstream.count(), 1);

    upstream.release_all();
    let answers = join_all(tasks).await;
    assert_eq!(
        upstream.count_method("POST"),
        1,
        "exactly one POST upstream"
    );
    assert_one_fresh_rest_replayed(&answers);
    assert!(answers
        .iter()
        .all(|a| a.idempotency_key() == Some("storm-1")));
    assert_eq!(answers[0].json()["n"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_duplicates_with_one_key_forward_once() {
    // With an entity (the entity lock also queues them) and without one (the key alone does).
    storm_with_one_key(&charges_route(""), "/api/v1/charges").await;
    let payouts = "[[routes]]\nname = \"payouts\"\nupstream = \"api\"\npath = \"/v1/payouts\"\n";
    storm_with_one_key(payouts, "/api/v1/payouts").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_retries_without_a_key_collapse_on_the_derived_key() {
    let upstream = RecordingUpstream::holding().await;
    let route = charges_route(
        "key = { header = \"\", derive = \"{header.x-workflow-id}:{entity}:{fingerprint}\" }",
    );
    let proxy = TestProxy::start(&config(&upstream.url(), "", &route)).await;
    let url = proxy.url("/api/v1/charges");
    let body = json!({"customer": "cus_1", "amount": 100});
    // A fresh random SDK key on every call must not defeat the derived key (header = "").
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let headers = vec![
                ("x-workflow-id".to_string(), "wf-42".to_string()),
                ("idempotency-key".to_string(), format!("sdk-random-{i}")),
            ];
            spawn_post(url.clone(), body.clone(), headers)
        })
        .collect();
    upstream.wait_for_held(1).await;
    proxy.wait_for_waiting(19).await;

    upstream.release_all();
    let answers = join_all(tasks).await;
    assert_eq!(upstream.count_method("POST"), 1);
    assert_one_fresh_rest_replayed(&answers);
    let key = answers[0].idempotency_key().expect("effective key");
    assert!(
        key.starts_with("wf-42:customer:cus_1:"),
        "derived key {key}"
    );

    // Another workflow with the same intent is a different operation: forwarded.
    let other = post_json(&url, None, &body, &[("x-workflow-id", "wf-43")]).await;
    other.assert_status(200);
    assert_eq!(other.replayed(), Some(false));
    assert_eq!(upstream.count_method("POST"), 2);
}

#[tokio::test]
async fn webhook_redelivered_three_times_is_forwarded_once() {
    let upstream = RecordingUpstream::start().await;
    let route = "[[routes]]\nname = \"webhook\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
                 path = \"/hooks/orders\"\n\
                 key = { header = \"\", derive = \"delivery:{header.x-delivery-id}:{body.id}\" }\n";
    let proxy = TestProxy::start(&config(&upstream.url(), "", route)).await;
    let url = proxy.url("/api/hooks/orders");
    let event = json!({"id": "evt_1", "type": "order.paid"});

    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(post_json(&url, None, &event, &[("x-delivery-id", "d-1")]).await);
    }
    assert_eq!(
        upstream.count_method("POST"),
        1,
        "one forward for three deliveries"
    );
    assert_eq!(answers[0].replayed(), Some(false));
    assert_eq!(answers[1].replayed(), Some(true));
    assert_eq!(answers[2].replayed(), Some(true));
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    assert_eq!(answers[2].idempotency_key(), Some("delivery:d-1:evt_1"));

    // A different event is a different delivery.
    let next = json!({"id": "evt_2", "type": "order.paid"});
    let fresh = post_json(&url, None, &next, &[("x-delivery-id", "d-2")]).await;
    assert_eq!(fresh.replayed(), Some(false));
    assert_eq!(upstream.count_method("POST"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_workers_on_one_entity_serialize_while_other_entities_run_in_parallel() {
    let upstream = RecordingUpstream::builder()
        .hold()
        .entity_json("/customer")
        .start()
        .await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", &charges_route(""))).await;
    let url = proxy.url("/api/v1/charges");

    let mut tasks = Vec::new();
    for i in 0..10 {
        let body = json!({"customer": "cus_hot", "amount": i});
        tasks.push(spawn_post(
            url.clone(),
            body,
            key_header(&format!("hot-{i}")),
        ));
    }
    for c in 0..5 {
        let body = json!({"customer": format!("cus_other_{c}"), "amount": 1});
        tasks.push(spawn_post(
            url.clone(),
            body,
            key_header(&format!("other-{c}")),
        ));
    }
    // One hot write and the five other entities are at the upstream together; the other nine
    // hot writes wait on the entity lock inside the proxy.
    upstream.wait_for_held(6).await;
    proxy.wait_for_waiting(9).await;
    assert_eq!(upstream.in_flight_for("cus_hot"), 1);
    assert!(
        upstream.max_concurrent_total() > 1,
        "entity locks must not serialize unrelated entities"
    );
    assert_eq!(upstream.max_concurrent_total(), 6);

    upstream.release_all();
    let answers = join_all(tasks).await;
    assert!(answers
        .iter()
        .all(|a| a.status == 200 && a.replayed() == Some(false)));
    assert_eq!(
        upstream.count_method("POST"),
        15,
        "every distinct key forwarded"
    );
    assert_eq!(
        upstream.max_concurrent("cus_hot"),
        1,
        "one write per entity at the upstream at any time"
    );
}

#[tokio::test]
async fn client_timeout_after_upstream_success_then_retry_is_replayed() {
    let upstream = RecordingUpstream::holding().await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", &charges_route(""))).await;
    let body = r#"{"customer":"cus_1","amount":100}"#;

    // The client sends its write, then gives up (closes the socket) while the upstream works.
    let mut stream = tokio::net::TcpStream::connect(proxy.main_addr)
        .await
        .expect("connect to the proxy");
    let head = format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: proxy\r\ncontent-type: application/json\r\n\
         idempotency-key: timeout-1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .await
        .expect("write request");
    upstream.wait_for_held(1).await;
    drop(stream);

    // The upstream succeeds after the client left; the proxy stores the answer regardless.
    upstream.release_all();
    upstream.wait_idle().await;

    let retry = request(
        "POST",
        &proxy.url("/api/v1/charges"),
        &[
            ("content-type", "application/json"),
            ("idempotency-key", "timeout-1"),
        ],
        body,
    )
    .await;
    retry.assert_status(200);
    assert_eq!(
        retry.replayed(),
        Some(true),
        "the retry gets the stored answer"
    );
    assert_eq!(retry.json()["n"], 1);
    assert_eq!(retry.upstream_seq(), Some(1));
    assert_eq!(upstream.count_method("POST"), 1, "never a second charge");
}

#[tokio::test]
async fn upstream_drops_connection_after_processing_then_outcome_unknown_until_released() {
    let upstream = RecordingUpstream::dropping().await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", &charges_route(""))).await;
    let url = proxy.url("/api/v1/charges");
    let body = json!({"customer": "cus_1", "amount": 100});

    let first = post_json(&url, Some("drop-1"), &body, &[]).await;
    assert_error(&first, 504, "upstream_timeout");
    assert_eq!(upstream.count(), 1);

    // The upstream may have charged: never forwarded again on our own.
    let retry = post_json(&url, Some("drop-1"), &body, &[]).await;
    assert_error(&retry, 409, "outcome_unknown");
    assert_eq!(retry.json()["error"]["key"], "drop-1");
    assert_eq!(
        upstream.count(),
        1,
        "an unknown outcome is not re-forwarded"
    );

    // The operator checked the upstream and releases the key on the admin API.
    let released = request(
        "POST",
        &proxy.admin_url("/admin/keys/drop-1/release"),
        &[],
        "",
    )
    .await;
    released.assert_status(200);
    assert_eq!(released.json()["released"], 1);
    let again = post_json(&url, Some("drop-1"), &body, &[]).await;
    assert_error(&again, 504, "upstream_timeout");
    assert_eq!(upstream.count(), 2, "forwarded again after the release");
    let blocked = post_json(&url, Some("drop-1"), &body, &[]).await;
    assert_error(&blocked, 409, "outcome_unknown");
    assert_eq!(upstream.count(), 2);

    // The same with the CLI, on the same database while the proxy keeps serving.
    let cfg = proxy.dir.write_file("cli.toml", &proxy.config_text);
    let (ok, out, err) = cli(cfg.clone(), &["keys", "show", "drop-1"]).await;
    assert!(ok, "keys show failed: {err}");
    let shown: Value = serde_json::from_str(&out).expect("keys show prints JSON");
    assert_eq!(shown["records"][0]["state"], "unknown", "{out}");
    assert_eq!(shown["records"][0]["attempts"], 2, "{out}");
    let (ok, out, err) = cli(cfg, &["keys", "release", "drop-1"]).await;
    assert!(ok, "keys release failed: {out} {err}");
    let third = post_json(&url, Some("drop-1"), &body, &[]).await;
    assert_error(&third, 504, "upstream_timeout");
    assert_eq!(upstream.count(), 3, "forwarded again after the CLI release");
}

/// An upstream that holds its first request (until the test ends) and answers later ones.
async fn first_request_held_upstream() -> RecordingUpstream {
    RecordingUpstream::with_handler(|rec, n| {
        if n == 1 {
            Reply::echo(rec, n).held()
        } else {
            Reply::echo(rec, n)
        }
    })
    .await
}

/// Starts `idemproxy serve`, sends a write (with `headers`) that reaches the upstream, SIGKILLs
/// the process mid-flight and starts it again on the same database.
async fn kill_mid_flight(
    dir: &TestDir,
    upstream: &RecordingUpstream,
    toml: &str,
    headers: &[(&str, &str)],
) -> ProxyProcess {
    let cfg = dir.write_config(toml);
    let mut process = ProxyProcess::spawn(&cfg).await;
    let url = process.url("/api/v1/charges");
    let mut headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    headers.push(("content-type".into(), "application/json".into()));
    let pending = tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        try_request("POST", &url, &headers, CHARGE).await
    });
    upstream.wait_for_held(1).await;
    process.kill().await;
    let lost = pending.await.expect("request task");
    assert!(lost.is_err(), "the killed proxy cannot answer: {lost:?}");
    ProxyProcess::spawn(&cfg).await
}

const CHARGE: &str = r#"{"customer":"cus_1","amount":100}"#;

#[tokio::test]
async fn proxy_killed_mid_flight_leaves_outcome_unknown_never_reforwarded() {
    let upstream = first_request_held_upstream().await;
    let dir = TestDir::new();
    let toml = config(&upstream.url(), "", &charges_route(""));
    let key = [("idempotency-key", "kill-1")];
    let restarted = kill_mid_flight(&dir, &upstream, &toml, &key).await;

    let url = restarted.url("/api/v1/charges");
    let headers = [key[0], ("content-type", "application/json")];
    let retry = request("POST", &url, &headers, CHARGE).await;
    assert_error(&retry, 409, "outcome_unknown");
    assert_eq!(upstream.count(), 1, "never forwarded again");

    let shown = get(&restarted.admin_url("/admin/keys/kill-1")).await;
    shown.assert_status(200);
    assert_eq!(shown.json()["records"][0]["state"], "unknown");
}

#[tokio::test]
async fn proxy_killed_mid_flight_reforwards_with_the_same_native_idempotency_key() {
    let upstream = first_request_held_upstream().await;
    let dir = TestDir::new();
    // A Temporal-style activity: the SDK puts a fresh random key on every attempt, so the
    // route derives its key from the workflow id; the upstream dedupes by the key we send.
    let toml = config(
        &upstream.url(),
        "native_idempotency_header = \"Idempotency-Key\"",
        &charges_route("key = { header = \"\", derive = \"wf:{header.x-workflow-id}\" }"),
    );
    let first_attempt = [("x-workflow-id", "wf-7"), ("idempotency-key", "sdk-1")];
    let restarted = kill_mid_flight(&dir, &upstream, &toml, &first_attempt).await;
    let url = restarted.url("/api/v1/charges");
    let retry_headers = [
        ("x-workflow-id", "wf-7"),
        ("idempotency-key", "sdk-2"),
        ("content-type", "application/json"),
    ];

    // Re-forwarding the unknown outcome is safe: the upstream dedupes by our key.
    let retry = request("POST", &url, &retry_headers, CHARGE).await;
    retry.assert_status(200);
    assert_eq!(retry.replayed(), Some(false));
    assert_eq!(retry.idempotency_key(), Some("wf:wf-7"));
    assert_eq!(upstream.count(), 2, "forwarded again");
    assert_eq!(
        upstream.request(1).header("idempotency-key"),
        Some("wf:wf-7")
    );
    assert_eq!(
        upstream.request(2).header("idempotency-key"),
        Some("wf:wf-7"),
        "the re-forward carries the same key for the upstream to dedupe"
    );

    let replay = request("POST", &url, &retry_headers, CHARGE).await;
    assert_eq!(replay.replayed(), Some(true));
    assert_eq!(replay.body, retry.body);
    assert_eq!(upstream.count(), 2);
}
