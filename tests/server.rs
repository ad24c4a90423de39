//! Forwarding and errors at the edges of the proxy: prefix routing, dedicated listeners, TLS in
//! both directions, HTTP/2, header hygiene, streamed safe methods, hostile input, and the admin
//! listener. Every test runs the real proxy against a real recording upstream and asserts on
//! what the upstream received as well as on the answer.

mod common;
use common::*;

use common::proxy::toml_string;
use http::Version;
use serde_json::json;

/// `[server]` plus `body` (upstream tables, routes).
fn config(body: &str) -> String {
    format!("{}\n{body}", server_section())
}

/// One upstream table on the main listener.
fn upstream_table(name: &str, url: &str, prefix: &str) -> String {
    format!(
        "[upstreams.{name}]\nurl = {}\nprefix = {}\n",
        toml_string(url),
        toml_string(prefix)
    )
}

/// The proxy in front of `upstream`, mounted at `/api`.
async fn start_api(upstream: &RecordingUpstream, server_extra: &str) -> TestProxy {
    let table = upstream_table("api", &upstream.url(), "/api");
    TestProxy::start(&config(&format!("{server_extra}{table}"))).await
}

/// `POST url` with a JSON body and an idempotency key.
async fn post(url: &str, key: &str, body: &serde_json::Value) -> Resp {
    post_json(url, Some(key), body, &[]).await
}

/// A hand-written `POST /api/v1/charges` with extra header lines and a body.
fn raw_post(headers: &str, body: &[u8]) -> Vec<u8> {
    let mut raw = format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    raw
}

/// An admin-listener request, with `Authorization: Bearer <token>` when given.
async fn admin(proxy: &TestProxy, method: &str, path: &str, token: Option<&str>) -> Resp {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    request(method, &proxy.admin_url(path), &headers, "").await
}

/// Panics unless `resp` is the proxy's own JSON error of this status and type.
#[track_caller]
fn assert_proxy_error(resp: &Resp, status: u16, kind: &str) {
    let text = resp.assert_status(status).text();
    assert_eq!(resp.error_type(), Some(kind), "{text}");
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.json()["error"]["type"], kind, "body {text}");
}

/// Panics unless a raw HTTP/1.1 answer is the proxy's JSON error of this status and type.
#[track_caller]
fn assert_raw_error(answer: &str, status: u16, kind: &str) {
    assert_eq!(raw_status(answer), status, "raw answer: {answer}");
    let header = format!("idemproxy-error: {kind}\r\n");
    assert!(answer.to_ascii_lowercase().contains(&header), "{answer}");
    let body = &answer[answer.find("\r\n\r\n").expect("a head") + 4..];
    let value: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {answer}"));
    assert_eq!(value["error"]["type"], kind, "raw answer: {answer}");
}

/// Writes `bytes` to `addr` (a refused rest is fine) and reads until the peer closes. For
/// input the server may reject before reading all of it.
async fn raw_tolerant(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let _ = stream.write_all(bytes).await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        let mut chunk = [0u8; 8192];
        while let Ok(n @ 1..) = stream.read(&mut chunk).await {
            buf.extend_from_slice(&chunk[..n]);
        }
    });
    read.await.expect("the proxy closes the connection");
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test]
async fn prefix_routing_maps_paths_onto_the_upstream() {
    let upstream = RecordingUpstream::start().await;
    let base = format!("{}/base/", upstream.url());
    let proxy = start_api(&upstream, &upstream_table("based", &base, "/b/")).await;

    let cases = [
        ("/api/v1/things?x=1", "/v1/things?x=1"),
        ("/b/v1/things", "/base/v1/things"),
        ("/b/v1/things?y=2&z=3", "/base/v1/things?y=2&z=3"),
        ("/api", "/"),
        ("/api/", "/"),
    ];
    for (seq, (sent, expected)) in (1..).zip(cases) {
        let resp = get(&proxy.url(sent)).await;
        assert_eq!(resp.assert_status(200).upstream_seq(), Some(seq), "{sent}");
        assert_eq!(upstream.request(seq).path_and_query, expected, "{sent}");
    }

    // A protected write maps the same way.
    let resp = post(&proxy.url("/b/v1/charges?expand=x"), "k1", &json!({})).await;
    assert_eq!(resp.assert_status(200).replayed(), Some(false));
    let path = upstream.request(6).path_and_query;
    assert_eq!(path, "/base/v1/charges?expand=x");

    // Prefixes match whole segments only.
    for path in ["/apix/v1/things", "/apix", "/bx/v1"] {
        assert_proxy_error(&get(&proxy.url(path)).await, 404, "no_route");
    }
    assert_eq!(upstream.count(), 6, "nothing forwarded for /apix");
}

#[tokio::test]
async fn unknown_prefix_is_no_route_and_never_forwarded() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start_api(&upstream, "").await;
    let cases = [
        ("GET", "/nope/x"),
        ("POST", "/nope/x"),
        ("DELETE", "/"),
        ("PUT", "/v1"),
    ];
    for (method, path) in cases {
        let resp = request(method, &proxy.url(path), &[("idempotency-key", "k1")], "{}").await;
        assert_proxy_error(&resp, 404, "no_route");
    }
    assert_eq!(upstream.count(), 0);
    assert_eq!(upstream.connections(), 0, "the proxy never even connected");
}

#[tokio::test]
async fn dedicated_listener_forwards_every_path_as_is() {
    let dedicated = RecordingUpstream::start().await;
    let other = RecordingUpstream::start().await;
    let table = format!(
        "[upstreams.ded]\nurl = \"{}\"\nlisten = \"127.0.0.1:0\"\n",
        dedicated.url()
    );
    let proxy = start_api(&other, &table).await;

    get(&proxy.upstream_url("ded", "/v1/things?y=2"))
        .await
        .assert_status(200);
    assert_eq!(dedicated.request(1).path_and_query, "/v1/things?y=2");
    // Another upstream's prefix means nothing here: the path goes through unchanged.
    get(&proxy.upstream_url("ded", "/api/v1/x"))
        .await
        .assert_status(200);
    assert_eq!(dedicated.request(2).path_and_query, "/api/v1/x");

    // Writes on the dedicated listener are protected (unmatched = protect by default).
    let url = proxy.upstream_url("ded", "/v1/charges");
    let first = post(&url, "k-ded", &json!({"a": 1})).await;
    let second = post(&url, "k-ded", &json!({"a": 1})).await;
    assert_eq!(first.replayed(), Some(false));
    assert_eq!(second.replayed(), Some(true));
    assert_eq!(second.body, first.body);
    assert_eq!(dedicated.count_method("POST"), 1);

    // The dedicated upstream has no prefix on the main listener.
    assert_proxy_error(&get(&proxy.url("/v1/things")).await, 404, "no_route");
    assert_eq!((dedicated.count(), other.count()), (3, 0));
}

#[tokio::test]
async fn https_upstream_needs_its_ca_file() {
    let upstream = RecordingUpstream::builder().tls().start().await;
    let ca = toml_string(&upstream.ca_pem_path().display().to_string());
    let proxy = TestProxy::start(&config(&format!(
        "{}ca_file = {ca}\n\n{}",
        upstream_table("tls", &upstream.localhost_url(), "/tls"),
        upstream_table("untrusted", &upstream.url(), "/untrusted"),
    )))
    .await;

    let body = json!({"customer": "cus_1"});
    let first = post(&proxy.url("/tls/v1/charges"), "k-tls", &body).await;
    assert_eq!(first.assert_status(200).replayed(), Some(false));
    assert_eq!(upstream.count(), 1);
    let recorded = upstream.request(1);
    assert_eq!(recorded.path(), "/v1/charges");
    assert_eq!(recorded.json(), body);
    let authority = format!("localhost:{}", upstream.addr().port());
    assert_eq!(recorded.authority, Some(authority));
    let again = post(&proxy.url("/tls/v1/charges"), "k-tls", &body).await;
    assert_eq!((again.replayed(), &again.body), (Some(true), &first.body));
    get(&proxy.url("/tls/v1/charges/ch_1"))
        .await
        .assert_status(200);
    assert_eq!(upstream.count(), 2);

    // Without ca_file the handshake fails: never sent, so 502 and the key is released.
    for _ in 0..2 {
        let resp = post(&proxy.url("/untrusted/v1/charges"), "k-u", &body).await;
        assert_proxy_error(&resp, 502, "upstream_unreachable");
    }
    let resp = get(&proxy.url("/untrusted/v1/x")).await;
    assert_proxy_error(&resp, 502, "upstream_unreachable");
    assert_eq!(upstream.count(), 2, "nothing crossed the handshake");
}

#[tokio::test]
async fn h2c_clients_get_proxied_answers_and_replays() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start_api(&upstream, "").await;
    let upstream_authority = Some(upstream.addr().to_string());

    let resp = send_h2(build("GET", &proxy.url("/api/v1/things?q=1"), &[], "")).await;
    assert_eq!((resp.status, resp.version), (200, Version::HTTP_2));
    assert_eq!(resp.json()["query"], "q=1");
    assert_eq!(upstream.request(1).path_and_query, "/v1/things?q=1");
    assert_eq!(upstream.request(1).authority, upstream_authority);

    let headers = [
        ("content-type", "application/json"),
        ("idempotency-key", "k-h2"),
    ];
    let url = proxy.url("/api/v1/charges");
    let first = send_h2(build("POST", &url, &headers, r#"{"amount":100}"#)).await;
    assert_eq!((first.status, first.version), (200, Version::HTTP_2));
    assert_eq!(first.replayed(), Some(false));
    assert_eq!(first.idempotency_key(), Some("k-h2"));
    let second = send_h2(build("POST", &url, &headers, r#"{"amount":100}"#)).await;
    assert_eq!(second.replayed(), Some(true));
    assert_eq!((second.status, &second.body), (first.status, &first.body));
    assert_eq!(upstream.count_method("POST"), 1);
    assert_eq!(upstream.request(2).body_text(), r#"{"amount":100}"#);
    assert_eq!(upstream.request(2).authority, upstream_authority);
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let upstream = RecordingUpstream::with_handler(|rec, n| {
        Reply::echo(rec, n)
            .header("connection", "x-up-hop")
            .header("x-up-hop", "secret")
            .header("keep-alive", "timeout=5")
            .header("x-up-e2e", "1")
    })
    .await;
    let proxy = start_api(&upstream, "").await;
    let proxy_authority = proxy.main_addr.to_string();
    let headers = [
        ("host", proxy_authority.as_str()),
        ("connection", "x-hop"),
        ("x-hop", "1"),
        ("keep-alive", "timeout=5"),
        ("proxy-authorization", "Basic cHJveHk6c2VjcmV0"),
        ("te", "trailers"),
        ("x-e2e", "yes"),
        ("idempotency-key", "k-hop"),
    ];
    let streamed = request("GET", &proxy.url("/api/v1/x"), &headers, "").await;
    let url = proxy.url("/api/v1/charges");
    let first = request("POST", &url, &headers, "{}").await;
    let replay = request("POST", &url, &headers, "{}").await;
    assert_eq!(replay.replayed(), Some(true));

    for resp in [&streamed, &first, &replay] {
        let seen = format!("{:?}", resp.assert_status(200).headers);
        assert_eq!(resp.header("x-up-e2e"), Some("1"), "{seen}");
        assert!(resp.header("x-up-hop").is_none(), "{seen}");
        assert!(resp.header("keep-alive").is_none(), "{seen}");
        assert!(
            !resp
                .header("connection")
                .unwrap_or_default()
                .contains("x-up"),
            "{seen}"
        );
    }
    assert_eq!(upstream.count(), 2, "the replay was not forwarded");
    for rec in upstream.requests() {
        let seen = format!("{:?}", rec.headers);
        assert_eq!(rec.header("x-e2e"), Some("yes"), "{seen}");
        for hop in ["x-hop", "keep-alive", "proxy-authorization", "te"] {
            assert!(
                rec.header(hop).is_none(),
                "{hop} reached the upstream: {seen}"
            );
        }
        assert!(!rec
            .header("connection")
            .unwrap_or_default()
            .contains("x-hop"));
        assert_eq!(rec.authority, Some(upstream.addr().to_string()));
    }
}

#[tokio::test]
async fn safe_methods_stream_through_unrecorded() {
    const BIG: usize = 5 << 20;
    let pattern = |i: usize| (i % 251) as u8;
    let upstream = RecordingUpstream::with_handler(move |rec, n| {
        if rec.path() == "/big" {
            Reply::new(200).body((0..BIG).map(pattern).collect::<Vec<u8>>())
        } else {
            Reply::echo(rec, n)
        }
    })
    .await;
    let proxy = start_api(&upstream, "max_body = \"1MiB\"\n").await;

    let url = proxy.url("/api/v1/things/1");
    let headers = [("idempotency-key", "k-get")];
    let first = request("GET", &url, &headers, "").await;
    let second = request("GET", &url, &headers, "").await;
    assert_eq!(first.upstream_seq(), Some(1));
    assert_eq!(second.upstream_seq(), Some(2));
    assert_eq!(second.json()["n"], 2, "a GET is never replayed");
    assert_eq!((first.replayed(), second.replayed()), (None, None));
    request("HEAD", &url, &[], "").await.assert_status(200);
    request("OPTIONS", &url, &[], "").await.assert_status(200);
    assert_eq!(upstream.count(), 4);

    // Five times max_body: answers are streamed, never buffered against the request limit.
    let big = get(&proxy.url("/api/big")).await;
    assert_eq!(big.assert_status(200).body.len(), BIG);
    assert!(big.body.iter().enumerate().all(|(i, b)| *b == pattern(i)));
    assert_eq!(upstream.count(), 5);
    assert_eq!(proxy.stats().protected(), 0, "never in the pipeline");
}

#[tokio::test]
async fn unsafe_targets_are_refused_and_never_forwarded() {
    let upstream = RecordingUpstream::start().await;
    let table = upstream_table("api", &upstream.url(), "/api");
    let proxy = TestProxy::start(&config(&format!("{table}listen = \"127.0.0.1:0\"\n"))).await;
    let dedicated = proxy.upstream_addr("api");
    let targets = "/api/a/../b /api/.. /api/a/%2e%2e/b /api/%2E%2e/x /api/a/.%2E /api/./x \
                   /api/a%2fb /api/a%2Fb/c /api/a%5cb /api/a%00b";
    for target in targets.split(' ') {
        for method in ["GET", "POST"] {
            // On the main listener, and without the prefix on the dedicated one.
            for (addr, target) in [(proxy.main_addr, target), (dedicated, &target[4..])] {
                let raw = format!(
                    "{method} {target} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n\
                     Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
                );
                assert_raw_error(&raw_request(addr, raw.as_bytes()).await, 400, "bad_path");
            }
        }
    }

    // Absolute-form targets, whatever their authority.
    let (main, up) = (proxy.main_addr.to_string(), upstream.addr().to_string());
    for authority in ["evil.example", &main, &up] {
        let raw = format!(
            "POST http://{authority}/api/x HTTP/1.1\r\nHost: {authority}\r\n\
             Idempotency-Key: k\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        assert_raw_error(
            &raw_request(proxy.main_addr, raw.as_bytes()).await,
            400,
            "bad_path",
        );
    }

    // CONNECT, even to the upstream's own address: refused, no tunnel.
    for authority in ["evil.example:443", &up] {
        let raw = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        assert_raw_error(
            &raw_request(proxy.main_addr, raw.as_bytes()).await,
            400,
            "bad_path",
        );
    }

    assert_eq!(upstream.count(), 0);
    assert_eq!(upstream.connections(), 0, "never even connected");
}

#[tokio::test]
async fn malformed_input_gets_errors_not_panics() {
    let upstream = RecordingUpstream::start().await;
    let route = "[[routes]]\nname = \"charges\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
                 path = \"/v1/charges\"\nentity = \"customer:{body.customer}\"\n";
    let proxy = start_api(&upstream, &format!("max_body = \"64KiB\"\n{route}")).await;
    let addr = proxy.main_addr;
    const JSON: &str = "Content-Type: application/json\r\nIdempotency-Key: k1\r\n";
    let (nested, long_key) = (
        "[".repeat(50_000),
        format!("Idempotency-Key: {}\r\n", "k".repeat(10_000)),
    );
    const CT: &str = "Content-Type: application/json\r\n";
    const KEY: &str = "Idempotency-Key";
    let cases: [(&str, &[u8], &str); 11] = [
        (JSON, br#"{"customer":"#, "body_invalid"),
        (JSON, b"\xff\xfe{}", "body_invalid"),
        (JSON, nested.as_bytes(), "body_invalid"),
        (JSON, br#"{"amount":1}"#, "entity_missing"),
        // A leading zero is not JSON (huge numbers like 7e999 are: they are kept as text).
        (CT, br#"{"customer":07}"#, "body_invalid"),
        (&long_key, b"{}", "key_invalid"),
        (&format!("{KEY}: ab\tcd\r\n"), b"{}", "key_invalid"),
        (&format!("{KEY}: a b\r\n"), b"{}", "key_invalid"),
        (&format!("{KEY}: \"unterminated\r\n"), b"{}", "key_invalid"),
        (&format!("{KEY}: café\r\n"), b"{}", "key_invalid"),
        // Over max_body, declared up front.
        (JSON, &[b' '; (64 << 10) + 1], "body_too_large"),
    ];
    for (headers, body, kind) in cases {
        let status = if kind == "body_too_large" { 413 } else { 400 };
        assert_raw_error(
            &raw_request(addr, &raw_post(headers, body)).await,
            status,
            kind,
        );
    }
    // Over max_body, found out while reading a chunked body.
    let mut chunked = format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{JSON}\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        70_000,
        " ".repeat(70_000)
    );
    assert_raw_error(
        &raw_request(addr, chunked.as_bytes()).await,
        413,
        "body_too_large",
    );

    // Garbage hyper refuses before the proxy sees it: a 4xx or a closed connection, never a 5xx.
    chunked = format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: x\r\n{JSON}Transfer-Encoding: chunked\r\n\r\n\
         zz\r\n{{}}\r\n0\r\n\r\n"
    );
    let garbage = [
        b"GARBAGE\r\n\r\n".to_vec(),
        raw_post("Idempotency-Key: ab\x01cd\r\n", b"{}"),
        raw_post(&format!("X-{}: 1\r\n", "h".repeat(1 << 20)), b"{}"),
        b"POST /api/v1/charges HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}".to_vec(),
        chunked.into_bytes(),
    ];
    for raw in &garbage {
        let answer = raw_tolerant(addr, raw).await;
        let status = raw_status(&answer);
        assert!(
            answer.is_empty() || (400..500).contains(&status),
            "answer {answer:?}"
        );
    }

    assert_eq!(upstream.count(), 0, "no malformed request was forwarded");
    let ok = post(
        &proxy.url("/api/v1/charges"),
        "k-ok",
        &json!({"customer": "c"}),
    )
    .await;
    ok.assert_status(200);
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn inbound_tls_serves_https_clients() {
    let upstream = RecordingUpstream::start().await;
    let ca = TestCa::generate();
    let (cert, key) = (ca.leaf_pem_path(), ca.leaf_key_path());
    let tls = format!(
        "tls = {{ cert = {}, key = {} }}\n",
        toml_string(&cert.display().to_string()),
        toml_string(&key.display().to_string())
    );
    let proxy = start_api(&upstream, &tls).await;
    let client = ca.https_client();
    let port = proxy.main_addr.port();
    for host in ["localhost", "127.0.0.1"] {
        let req = build("GET", &format!("https://{host}:{port}/api/v1/x"), &[], "");
        let resp = client
            .request(req)
            .await
            .expect("HTTPS GET through the proxy");
        assert_eq!(resp.status(), 200);
    }
    let url = format!("https://localhost:{port}/api/v1/charges");
    let charge = || build("POST", &url, &[("idempotency-key", "k-tls-in")], "{}");
    let first = client.request(charge()).await.expect("HTTPS POST");
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let second = client.request(charge()).await.expect("HTTPS POST again");
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(upstream.count(), 3);
    assert_eq!(upstream.request(1).path(), "/v1/x");

    // Plain HTTP and clients that do not trust the CA get no answer.
    assert!(try_request("GET", &proxy.url("/api/v1/x"), &[], "")
        .await
        .is_err());
    let stranger = TestCa::generate().https_client();
    let req = build(
        "GET",
        &format!("https://localhost:{port}/api/v1/x"),
        &[],
        "",
    );
    assert!(stranger.request(req).await.is_err());
    assert_eq!(upstream.count(), 3);
}

#[tokio::test]
async fn admin_listener_health_metrics_and_keys() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start_api(&upstream, "admin_token = \"t0ken\"\n").await;
    let p = &proxy;
    let health = admin(p, "GET", "/healthz", None).await;
    assert_eq!(health.assert_status(200).json()["status"], "ok");
    admin(p, "GET", "/readyz", None).await.assert_status(200);
    let unauthorized = |resp: Resp| assert_proxy_error(&resp, 401, "unauthorized");
    unauthorized(admin(p, "GET", "/admin/keys/x", None).await);
    unauthorized(admin(p, "GET", "/admin/keys/x", Some("wrong")).await);
    let unknown = admin(p, "GET", "/admin/keys/x", Some("t0ken")).await;
    assert_proxy_error(&unknown, 404, "not_found");

    let url = proxy.url("/api/v1/charges");
    let creds = [("authorization", "Bearer sk_SECRET")];
    let body = json!({"a": 1});
    let charge = || post_json(&url, Some("k-adm"), &body, &creds);
    assert_eq!(charge().await.replayed(), Some(false));
    let shown = admin(p, "GET", "/admin/keys/k-adm", Some("t0ken")).await;
    let content_type = shown.assert_status(200).header("content-type");
    assert_eq!(content_type, Some("application/json"));
    let record = &shown.json()["records"][0];
    assert_eq!(record["state"], "completed");
    assert_eq!(record["upstream"], "api");
    assert_eq!(record["attempts"], 1);
    assert!(!shown.text().contains("sk_SECRET"), "{}", shown.text());
    let metrics = admin(p, "GET", "/metrics", None)
        .await
        .assert_status(200)
        .text();
    assert!(metrics.contains("idemproxy_forwards_total 1"), "{metrics}");

    // Release: unauthorized changes nothing; a completed key is released only on purpose
    // (`force`, with a note), and is then forwardable again.
    unauthorized(admin(p, "POST", "/admin/keys/k-adm/release", None).await);
    assert_eq!(charge().await.replayed(), Some(true));
    let unforced = admin(p, "POST", "/admin/keys/k-adm/release", Some("t0ken")).await;
    assert_proxy_error(&unforced, 409, "not_settleable");
    assert!(unforced.text().contains("force"), "{}", unforced.text());
    assert_eq!(charge().await.replayed(), Some(true), "nothing was dropped");
    let forced = serde_json::json!({"force": true, "note": "a wrong answer was stored"});
    let released = request(
        "POST",
        &p.admin_url("/admin/keys/k-adm/release"),
        &[
            ("authorization", "Bearer t0ken"),
            ("content-type", "application/json"),
        ],
        forced.to_string(),
    )
    .await;
    assert_eq!(released.assert_status(200).json()["released"], 1);
    let again = charge().await;
    assert_eq!(again.replayed(), Some(false));
    assert_eq!(again.json()["n"], 2);
    assert_eq!(upstream.count(), 2);

    // None of it is served on the main listener.
    let token = [("authorization", "Bearer t0ken")];
    for path in ["/healthz", "/readyz", "/metrics", "/admin/keys/k-adm"] {
        let resp = request("GET", &proxy.url(path), &token, "").await;
        assert_proxy_error(&resp, 404, "no_route");
    }
    let resp = request("POST", &proxy.url("/admin/keys/k-adm/release"), &token, "").await;
    assert_proxy_error(&resp, 404, "no_route");
    assert_eq!(upstream.count(), 2);
    assert_eq!(charge().await.replayed(), Some(true), "not released");
}

#[tokio::test]
async fn store_url_env_overrides_the_config() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let config_path = dir.write_config(&config(&upstream_table("api", &upstream.url(), "/api")));
    let other = dir.path().join("override.db");
    let env_url = format!("sqlite://{}", other.display());
    let env = [("IDEMPROXY_STORE_URL", env_url.as_str())];
    let body = json!({"a": 1});

    let mut proxy = ProxyProcess::spawn_with_env(&config_path, &env).await;
    let first = post(&proxy.url("/api/v1/charges"), "k-env", &body).await;
    assert_eq!(first.replayed(), Some(false));
    proxy.terminate();
    assert!(proxy.wait().await.success(), "{}", proxy.stderr());
    assert!(other.exists(), "IDEMPROXY_STORE_URL's database was created");
    assert!(!dir.db_path().exists(), "store.url was not used");

    // The override database holds the key; the config's database does not.
    let mut proxy = ProxyProcess::spawn_with_env(&config_path, &env).await;
    let replay = post(&proxy.url("/api/v1/charges"), "k-env", &body).await;
    assert_eq!(replay.replayed(), Some(true));
    proxy.terminate();
    assert!(proxy.wait().await.success());
    let proxy = ProxyProcess::spawn(&config_path).await;
    let fresh = post(&proxy.url("/api/v1/charges"), "k-env", &body).await;
    assert_eq!(fresh.replayed(), Some(false));
    assert!(dir.db_path().exists());
    assert_eq!(upstream.count(), 2);
}

#[tokio::test]
async fn connections_on_every_serving_thread_forward_once_and_replay() {
    // Three serving threads on SQLite: the runtime's one worker and two connection threads,
    // dealt new connections in turn — each request below comes on a connection of its own,
    // so a key's first write and its retries are served on different threads.
    let upstream = RecordingUpstream::start().await;
    let proxy = start_api(&upstream, "workers = 3\n").await;
    let url = proxy.url("/api/v1/charges");
    let body = json!({"amount": 100});
    let first = post(&url, "k-threads", &body).await;
    assert_eq!((first.status, first.replayed()), (200, Some(false)));
    for _ in 0..5 {
        let again = post(&url, "k-threads", &body).await;
        assert_eq!(again.replayed(), Some(true));
        assert_eq!((again.status, &again.body), (first.status, &first.body));
    }
    assert_eq!(
        upstream.count_method("POST"),
        1,
        "one forward for six requests"
    );
    for i in 0..6 {
        let resp = post(&url, &format!("k-threads-{i}"), &body).await;
        assert_eq!((resp.status, resp.replayed()), (200, Some(false)));
    }
    assert_eq!(
        upstream.count_method("POST"),
        7,
        "each new key forwarded once"
    );
    proxy.shutdown().await;
}
