//! Self-test of the shared harness in `tests/common`: the recording upstream (plain, held,
//! dropping, hanging, TLS), the client helpers and the parsers. None of it needs the proxy.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::process::parse_listeners;
use common::proxy::with_store_url;
use common::{
    build, client, raw_request, raw_status, request, send_h2, try_request, wait_until,
    RecordingUpstream, Reply, WAIT,
};
use http::Version;
use tokio::sync::mpsc;

#[tokio::test]
async fn records_requests_and_answers_with_sequence_numbers() {
    let upstream = RecordingUpstream::start().await;

    let first = request(
        "POST",
        &format!("{}/v1/charges?expand=x", upstream.url()),
        &[("content-type", "application/json"), ("x-test", "a")],
        r#"{"amount":100}"#,
    )
    .await;
    first.assert_status(200);
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.upstream_seq(), Some(1));
    assert_eq!(
        first.json(),
        serde_json::json!({"n": 1, "method": "POST", "path": "/v1/charges", "query": "expand=x"})
    );

    let second = client::get(&format!("{}/v1/charges/ch_1", upstream.url())).await;
    assert_eq!(second.upstream_seq(), Some(2));
    assert_eq!(second.json()["n"], 2);

    assert_eq!(upstream.count(), 2);
    assert_eq!(upstream.count_method("POST"), 1);
    assert_eq!(upstream.count_method("GET"), 1);
    assert_eq!(upstream.count_path("/v1/charges"), 1);
    let recorded = upstream.requests();
    assert_eq!(recorded[0].seq, 1);
    assert_eq!(recorded[0].method, http::Method::POST);
    assert_eq!(recorded[0].path_and_query, "/v1/charges?expand=x");
    assert_eq!(recorded[0].path(), "/v1/charges");
    assert_eq!(recorded[0].query(), Some("expand=x"));
    assert_eq!(recorded[0].header("x-test"), Some("a"));
    assert_eq!(recorded[0].json(), serde_json::json!({"amount": 100}));
    assert_eq!(recorded[0].version, Version::HTTP_11);
    assert_eq!(
        recorded[0].authority.as_deref(),
        Some(upstream.addr().to_string().as_str())
    );
    assert_eq!(recorded[1].body, Bytes::new());
    assert_eq!(upstream.request(2).path(), "/v1/charges/ch_1");
    // one at a time: never more than one in flight
    assert_eq!(upstream.max_concurrent("/v1/charges"), 1);
    assert_eq!(upstream.max_concurrent_total(), 1);
    assert_eq!(upstream.max_concurrent("/never"), 0);
    assert_eq!(upstream.in_flight(), 0);
}

#[tokio::test]
async fn tracks_concurrency_per_entity_while_held() {
    let upstream = RecordingUpstream::builder()
        .hold()
        .entity_json("/customer")
        .start()
        .await;
    let url = format!("{}/v1/charges", upstream.url());
    let mut tasks = Vec::new();
    for customer in ["cus_a", "cus_a", "cus_b"] {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            common::post_json(
                &url,
                None,
                &serde_json::json!({ "customer": customer }),
                &[],
            )
            .await
        }));
    }
    upstream.wait_for_held(3).await;
    assert_eq!(upstream.count(), 3);
    assert_eq!(upstream.in_flight(), 3);
    assert_eq!(upstream.in_flight_for("cus_a"), 2);
    assert_eq!(upstream.max_concurrent("cus_a"), 2);
    assert_eq!(upstream.max_concurrent("cus_b"), 1);
    assert_eq!(upstream.max_concurrent_total(), 3);

    upstream.release_all();
    let mut seqs = Vec::new();
    for task in tasks {
        let resp = task.await.expect("request task");
        resp.assert_status(200);
        seqs.push(resp.upstream_seq().expect("x-upstream-seq"));
    }
    seqs.sort();
    assert_eq!(seqs, vec![1, 2, 3]);
    upstream.wait_idle().await;
    assert_eq!(upstream.in_flight_for("cus_a"), 0);
    assert_eq!(upstream.max_concurrent("cus_a"), 2, "the maximum is kept");
}

#[tokio::test]
async fn multi_entity_requests_count_for_each_entity() {
    let upstream = RecordingUpstream::builder()
        .hold()
        .entities(|rec| {
            rec.json()["ids"]
                .as_array()
                .expect("ids array")
                .iter()
                .map(|id| format!("contact:{}", id.as_str().expect("string id")))
                .collect()
        })
        .start()
        .await;
    let url = format!("{}/batch", upstream.url());
    let batch = {
        let url = url.clone();
        tokio::spawn(async move {
            common::post_json(
                &url,
                None,
                &serde_json::json!({"ids": ["1", "2", "2"]}),
                &[],
            )
            .await
        })
    };
    let single = tokio::spawn(async move {
        common::post_json(&url, None, &serde_json::json!({"ids": ["2"]}), &[]).await
    });
    upstream.wait_for_held(2).await;
    assert_eq!(upstream.max_concurrent("contact:1"), 1);
    assert_eq!(
        upstream.max_concurrent("contact:2"),
        2,
        "duplicate ids in one request count once"
    );
    upstream.release_all();
    batch.await.expect("batch task").assert_status(200);
    single.await.expect("single task").assert_status(200);
}

#[tokio::test]
async fn hold_and_release_one_at_a_time() {
    let upstream = RecordingUpstream::holding().await;
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    for i in 0..2 {
        let url = format!("{}/slot/{i}", upstream.url());
        let done_tx = done_tx.clone();
        tokio::spawn(async move {
            let resp = request("POST", &url, &[], "x").await;
            done_tx.send(resp).expect("test still listening");
        });
    }
    upstream.wait_for_requests(2).await;
    upstream.wait_for_held(2).await;
    assert!(
        done_rx.try_recv().is_err(),
        "a held request must not be answered"
    );

    upstream.release_one();
    let first = done_rx.recv().await.expect("first answer");
    first.assert_status(200);
    wait_until(|| upstream.held() == 1, WAIT, "one request still held").await;
    assert!(done_rx.try_recv().is_err(), "only one was released");

    upstream.release_all();
    let second = done_rx.recv().await.expect("second answer");
    second.assert_status(200);
    let mut seqs = [first.upstream_seq(), second.upstream_seq()];
    seqs.sort();
    assert_eq!(seqs, [Some(1), Some(2)]);

    // after release_all the gate stays open
    let third = request("POST", &format!("{}/slot/9", upstream.url()), &[], "x").await;
    assert_eq!(third.upstream_seq(), Some(3));
    assert_eq!(upstream.held(), 0);
}

#[tokio::test]
async fn held_reply_from_a_handler_holds_only_that_request() {
    let upstream = RecordingUpstream::with_handler(|rec, n| {
        if n == 1 {
            Reply::echo(rec, n).held()
        } else {
            Reply::echo(rec, n)
        }
    })
    .await;
    let url = format!("{}/x", upstream.url());
    let held = {
        let url = url.clone();
        tokio::spawn(async move { request("POST", &url, &[], "").await })
    };
    upstream.wait_for_held(1).await;
    let free = request("POST", &url, &[], "").await;
    assert_eq!(free.upstream_seq(), Some(2));
    upstream.release_one();
    assert_eq!(held.await.expect("held task").upstream_seq(), Some(1));
}

#[tokio::test]
async fn scripted_handler_first_503_then_200() {
    let upstream = RecordingUpstream::with_handler(|rec, n| {
        if n == 1 {
            Reply::json(503, &serde_json::json!({"error": "busy"})).header("retry-after", "1")
        } else {
            Reply::echo(rec, n)
        }
    })
    .await;
    let url = format!("{}/v1/charges", upstream.url());
    let first = request("POST", &url, &[], "{}").await;
    first.assert_status(503);
    assert_eq!(first.header("retry-after"), Some("1"));
    assert_eq!(first.json(), serde_json::json!({"error": "busy"}));
    assert_eq!(first.upstream_seq(), Some(1));
    let second = request("POST", &url, &[], "{}").await;
    second.assert_status(200);
    assert_eq!(second.json()["n"], 2);
}

#[tokio::test]
async fn fixed_status_upstream() {
    let upstream = RecordingUpstream::fixed(429, r#"{"error":"slow down"}"#).await;
    let resp = request("POST", &format!("{}/a", upstream.url()), &[], "").await;
    resp.assert_status(429);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.text(), r#"{"error":"slow down"}"#);

    let text = RecordingUpstream::fixed(503, "unavailable").await;
    let resp = request("POST", &format!("{}/a", text.url()), &[], "").await;
    resp.assert_status(503);
    assert_eq!(resp.header("content-type"), Some("text/plain"));
    assert_eq!(text.count(), 1);
}

#[tokio::test]
async fn dropping_upstream_records_then_closes_without_answer() {
    let upstream = RecordingUpstream::dropping().await;
    let body = r#"{"customer":"cus_1","amount":100}"#;
    let result = try_request(
        "POST",
        &format!("{}/v1/charges", upstream.url()),
        &[("content-type", "application/json")],
        body,
    )
    .await;
    let err = result.expect_err("the upstream closes without answering");
    assert!(
        format!("{err:#}").contains("failed"),
        "a transport error, not a timeout: {err:#}"
    );
    assert_eq!(upstream.count(), 1, "the request was processed once");
    let recorded = upstream.request(1);
    assert_eq!(recorded.method, http::Method::POST);
    assert_eq!(recorded.path(), "/v1/charges");
    assert_eq!(recorded.body_text(), body);
    assert_eq!(recorded.header("content-type"), Some("application/json"));
    upstream.wait_idle().await;
}

#[tokio::test]
async fn raw_upstream_answers_and_reads_chunked_bodies() {
    let upstream = RecordingUpstream::builder().raw_http1().start().await;
    let resp = request("POST", &format!("{}/raw?x=1", upstream.url()), &[], "hello").await;
    resp.assert_status(200);
    assert_eq!(resp.json()["path"], "/raw");
    assert_eq!(resp.upstream_seq(), Some(1));

    let text = raw_request(
        upstream.addr(),
        b"POST /chunked HTTP/1.1\r\nHost: up\r\nTransfer-Encoding: chunked\r\n\
          Connection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&text), 200, "raw answer: {text}");
    assert!(text.contains("x-upstream-seq: 2"), "raw answer: {text}");
    let recorded = upstream.request(2);
    assert_eq!(recorded.body_text(), "hello world");
    assert_eq!(recorded.authority.as_deref(), Some("up"));
}

#[tokio::test]
async fn hyper_upstream_can_drop_a_scripted_request() {
    let upstream = RecordingUpstream::with_handler(|rec, n| {
        if n == 1 {
            Reply::drop_connection()
        } else {
            Reply::echo(rec, n)
        }
    })
    .await;
    let url = format!("{}/once", upstream.url());
    assert!(try_request("POST", &url, &[], "a").await.is_err());
    let retry = request("POST", &url, &[], "a").await;
    assert_eq!(retry.upstream_seq(), Some(2));
    assert_eq!(upstream.count(), 2);
}

#[tokio::test]
async fn hanging_upstream_records_and_never_answers() {
    let upstream = RecordingUpstream::hanging().await;
    let url = format!("{}/slow", upstream.url());
    let pending = tokio::spawn(async move { try_request("POST", &url, &[], "z").await });
    upstream.wait_for_requests(1).await;
    assert_eq!(upstream.in_flight(), 1);
    assert!(!pending.is_finished(), "a hanging upstream never answers");
    // stopping the upstream closes the connection: the client sees an error, not an answer
    upstream.stop();
    let result = pending.await.expect("request task");
    assert!(
        result.is_err(),
        "expected a transport error, got {result:?}"
    );
    upstream.wait_idle().await;
}

#[tokio::test]
async fn tls_upstream_is_reachable_with_the_generated_ca() {
    let upstream = RecordingUpstream::builder().tls().start().await;
    assert!(upstream.url().starts_with("https://127.0.0.1:"));
    let pem = std::fs::read_to_string(upstream.ca_pem_path()).expect("read CA PEM");
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");

    let client = upstream.ca().https_client();
    for (i, base) in [upstream.url(), upstream.localhost_url()]
        .iter()
        .enumerate()
    {
        let req = build("POST", &format!("{base}/v1/charges"), &[], "{}");
        let resp = client
            .request(req)
            .await
            .unwrap_or_else(|e| panic!("HTTPS request to {base} failed: {e:?}"));
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()["x-upstream-seq"].to_str().unwrap(),
            (i + 1).to_string()
        );
    }
    // ALPN offered h2 first and the server accepted it
    assert_eq!(upstream.request(1).version, Version::HTTP_2);
    assert_eq!(upstream.count(), 2);

    // a client that trusts another CA is refused
    let other = common::TestCa::generate();
    let req = build("GET", &format!("{}/x", upstream.url()), &[], "");
    assert!(other.https_client().request(req).await.is_err());
    assert_eq!(
        upstream.count(),
        2,
        "no request got through the failed handshake"
    );
}

#[tokio::test]
async fn tls_upstream_over_http1_only() {
    let upstream = RecordingUpstream::builder().tls().start().await;
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(upstream.ca().client_config())
        .https_or_http()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, http_body_util::Full<Bytes>>(connector);
    let resp = client
        .request(build("GET", &format!("{}/h1", upstream.url()), &[], ""))
        .await
        .expect("HTTPS/1.1 request");
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream.request(1).version, Version::HTTP_11);
}

#[tokio::test]
async fn h2c_prior_knowledge_client() {
    let upstream = RecordingUpstream::start().await;
    let resp = send_h2(build("POST", &format!("{}/h2", upstream.url()), &[], "b")).await;
    resp.assert_status(200);
    assert_eq!(resp.version, Version::HTTP_2);
    assert_eq!(upstream.request(1).version, Version::HTTP_2);
    assert_eq!(upstream.request(1).body_text(), "b");
}

#[tokio::test]
async fn raw_request_sends_targets_as_written() {
    let upstream = RecordingUpstream::start().await;
    let text = raw_request(
        upstream.addr(),
        b"GET http://example.com/abs?q=1 HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&text), 200, "raw answer: {text}");
    assert!(text.contains("\"n\":1"), "raw answer: {text}");
    let recorded = upstream.request(1);
    assert_eq!(recorded.path_and_query, "/abs?q=1");
    assert_eq!(recorded.authority.as_deref(), Some("example.com"));

    // keep-alive answer with content-length is returned without waiting for EOF
    let text = raw_request(upstream.addr(), b"GET /ka HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(raw_status(&text), 200, "raw answer: {text}");
    assert!(text.ends_with("}"), "whole body read: {text}");

    // a peer that closes without answering gives an empty string
    let dropping = RecordingUpstream::dropping().await;
    let text = raw_request(
        dropping.addr(),
        b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi",
    )
    .await;
    assert_eq!(text, "");
    assert_eq!(raw_status(&text), 0);
    assert_eq!(dropping.request(1).body_text(), "hi");
}

#[tokio::test]
async fn unreachable_address_refuses_connections() {
    let addr = common::unused_addr();
    let result = try_request("POST", &format!("http://{addr}/x"), &[], "").await;
    assert!(result.is_err());
}

#[tokio::test]
#[should_panic(expected = "timed out after")]
async fn wait_until_panics_with_its_message() {
    wait_until(|| false, Duration::from_millis(20), "never").await;
}

#[tokio::test]
#[should_panic(expected = "waiting for 1 upstream requests")]
async fn wait_for_requests_panics_on_timeout() {
    let upstream = RecordingUpstream::start().await;
    upstream
        .wait_for_requests_within(1, Duration::from_millis(20))
        .await;
}

#[test]
fn store_url_is_added_to_configs() {
    let url = "sqlite:///tmp/x/idemproxy.db";
    let appended = with_store_url("[server]\nlisten = \"127.0.0.1:0\"\n", url);
    assert!(
        appended.ends_with("[store]\nurl = \"sqlite:///tmp/x/idemproxy.db\"\n"),
        "{appended}"
    );

    let inserted = with_store_url(
        "[store]\nretention = \"1h\"\n\n[upstreams.a]\nurl = \"http://a\"\n",
        url,
    );
    assert_eq!(
        inserted,
        "[store]\nurl = \"sqlite:///tmp/x/idemproxy.db\"\nretention = \"1h\"\n\n\
         [upstreams.a]\nurl = \"http://a\"\n"
    );

    let kept = "[store]\nurl = \"sqlite://other.db\"\n";
    assert_eq!(with_store_url(kept, url), kept);
}

#[test]
fn listener_addresses_are_parsed_from_logs() {
    let log = "\
2024-01-01T00:00:00Z  INFO idemproxy::store: migrations applied
2024-01-01T00:00:00Z  INFO idemproxy::server: listening on main listener addr=127.0.0.1:41234
\u{1b}[2m2024\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m idemproxy::server: listening on admin listener \u{1b}[3maddr\u{1b}[0m\u{1b}[2m=\u{1b}[0m127.0.0.1:41235
2024-01-01T00:00:00Z  INFO idemproxy::server: listening on upstream listener addr=127.0.0.1:41236 upstream=stripe
";
    let found = parse_listeners(log);
    assert_eq!(found.main, Some("127.0.0.1:41234".parse().unwrap()));
    assert_eq!(found.admin, Some("127.0.0.1:41235".parse().unwrap()));
    assert_eq!(found.other.len(), 1);
    assert_eq!(found.other[0].1, "127.0.0.1:41236".parse().unwrap());

    let json = r#"{"level":"INFO","fields":{"message":"listening on main listener","addr":"127.0.0.1:5000"}}"#;
    assert_eq!(
        parse_listeners(json).main,
        Some("127.0.0.1:5000".parse().unwrap())
    );
    assert_eq!(parse_listeners("starting up").main, None);
}
