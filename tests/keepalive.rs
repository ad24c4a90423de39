//! Keep-alive as a client sees it, now that an idle HTTP/1 connection is parked between
//! requests (see `src/connection`): one connection carries requests sent apart and pipelined;
//! HTTP/1.0 keeps it only when asked; and a connection whose request body was left unread is
//! closed — the rest of that body is never taken for a request. Each test speaks raw HTTP/1 on
//! one socket and counts what the recording upstream received.

mod common;
use common::*;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The proxy in front of `upstream` at `/api`, with request bodies limited to 64 bytes.
async fn start(upstream: &RecordingUpstream) -> TestProxy {
    TestProxy::start(&format!(
        "{}max_body = \"64B\"\n[upstreams.api]\nurl = \"{}\"\nprefix = \"/api\"\n",
        server_section(),
        upstream.url()
    ))
    .await
}

fn post(key: &str, body: &str) -> String {
    format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One answer read off `stream` (its head, lower-cased, and its body), framed by its
/// `Content-Length`; bytes past it are kept in `rest` for the next.
async fn answer(stream: &mut TcpStream, rest: &mut Vec<u8>) -> (String, Vec<u8>) {
    let read = async {
        loop {
            if let Some(end) = rest.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&rest[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map(|v| v.trim().parse().expect("a length"))
                    .unwrap_or_else(|| panic!("no content-length: {head}"));
                if rest.len() >= end + 4 + length {
                    let body = rest[end + 4..end + 4 + length].to_vec();
                    rest.drain(..end + 4 + length);
                    return (head, body);
                }
            }
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before a whole answer: {rest:?}");
            rest.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(WAIT, read).await.expect("an answer")
}

/// Reads until the proxy closes the connection; what came before the end.
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let read = async {
        let mut chunk = [0u8; 4096];
        while let Ok(n @ 1..) = stream.read(&mut chunk).await {
            got.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("the proxy closes the connection");
    got
}

/// A connection to the proxy that has sent a GET and read its answer.
async fn after_a_get(proxy: &TestProxy) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    let mut rest = Vec::new();
    s.write_all(b"GET /api/x HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    answer(&mut s, &mut rest).await;
    (s, rest)
}

fn connection(head: &str) -> Option<&str> {
    head.lines().find_map(|l| l.strip_prefix("connection: "))
}

#[tokio::test]
async fn one_connection_carries_requests_sent_apart_and_pipelined() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    let mut rest = Vec::new();

    s.write_all(post("a", "{}").as_bytes()).await.unwrap();
    let (head, _) = answer(&mut s, &mut rest).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(connection(&head), None, "{head}");

    s.write_all(b"GET /api/v1/things HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = answer(&mut s, &mut rest).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");

    // Three in one write: a new key, a retry of the first, a read.
    let three = format!(
        "{}{}GET /api/v1/things/1 HTTP/1.1\r\nHost: x\r\n\r\n",
        post("b", "{\"n\":1}"),
        post("a", "{}")
    );
    s.write_all(three.as_bytes()).await.unwrap();
    let mut replays = Vec::new();
    for _ in 0..3 {
        let (head, _) = answer(&mut s, &mut rest).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert_eq!(connection(&head), None, "{head}");
        replays.push(head.contains("idempotent-replayed: true"));
    }
    assert_eq!(replays, [false, true, false]);
    assert!(rest.is_empty());

    // What the upstream received: each write once, each read once, in order.
    let seen: Vec<(String, String)> = upstream
        .requests()
        .into_iter()
        .map(|r| (r.method.to_string(), r.path_and_query))
        .collect();
    let want = [
        ("POST", "/v1/charges"),
        ("GET", "/v1/things"),
        ("POST", "/v1/charges"),
        ("GET", "/v1/things/1"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(seen, want);
}

#[tokio::test]
async fn http_1_0_keeps_the_connection_only_when_asked() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    let mut rest = Vec::new();
    for _ in 0..2 {
        s.write_all(b"GET /api/x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await
            .unwrap();
        let (head, _) = answer(&mut s, &mut rest).await;
        assert!(head.starts_with("http/1.0 200"), "{head}");
        assert_eq!(connection(&head), Some("keep-alive"), "{head}");
    }
    s.write_all(b"GET /api/x HTTP/1.0\r\n\r\n").await.unwrap();
    let (head, _) = answer(&mut s, &mut rest).await;
    assert_eq!(connection(&head), Some("close"), "{head}");
    assert!(until_closed(&mut s).await.is_empty());
    assert_eq!(upstream.count(), 3);
}

#[tokio::test]
async fn connection_close_is_the_last_request() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    let mut rest = Vec::new();
    // A request after the one that says close is never read.
    let two = format!(
        "GET /api/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n{}",
        post("after-close", "{}")
    );
    s.write_all(two.as_bytes()).await.unwrap();
    let (head, _) = answer(&mut s, &mut rest).await;
    assert_eq!(connection(&head), Some("close"), "{head}");
    assert!(rest.is_empty() && until_closed(&mut s).await.is_empty());
    assert_eq!(upstream.count(), 1);
    assert_eq!(upstream.count_method("POST"), 0);
}

/// The body of a refused request arrives after the refusal and spells a request of its own:
/// were the connection kept, that request would reach the upstream.
#[tokio::test]
async fn a_body_left_unread_closes_the_connection_and_is_never_a_request() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let smuggled = post("smuggled", &format!("{{\"pad\":\"{}\"}}", "x".repeat(40)));
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    let head = format!(
        "POST /api/v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        smuggled.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut rest = Vec::new();
    let (head, body) = answer(&mut s, &mut rest).await;
    assert!(head.starts_with("http/1.1 413"), "{head}");
    assert!(String::from_utf8_lossy(&body).contains("body_too_large"));
    assert_eq!(connection(&head), Some("close"), "{head}");
    // The body, late; the connection may already be gone.
    let _ = s.write_all(smuggled.as_bytes()).await;
    let after = until_closed(&mut s).await;
    assert!(after.is_empty(), "{}", String::from_utf8_lossy(&after));
    assert_eq!(upstream.count(), 0);
}

#[tokio::test]
async fn an_idle_connection_is_closed_when_the_proxy_stops() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let (mut s, _) = after_a_get(&proxy).await;
    tokio::time::timeout(WAIT, proxy.shutdown())
        .await
        .expect("the proxy stops with an idle connection open");
    assert!(until_closed(&mut s).await.is_empty());
    assert_eq!(upstream.count(), 1);
}

/// A connection that idles is parked (its hyper state freed, seen on the gauge), and the next
/// request on it — a write, then its retry — is served on the same socket.
#[tokio::test]
async fn a_parked_connection_carries_the_next_request() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let (mut s, mut rest) = after_a_get(&proxy).await;
    // Read on connections of their own, closed after each answer (never parked themselves).
    let admin = proxy.admin_addr.expect("an admin listener");
    eventually(|| async {
        match parked(admin).await {
            0 => Err("the connection was never parked".to_owned()),
            _ => Ok(()),
        }
    })
    .await;
    assert_eq!(parked(admin).await, 1);
    for replayed in [false, true] {
        s.write_all(post("after-park", "{}").as_bytes())
            .await
            .unwrap();
        let (head, _) = answer(&mut s, &mut rest).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(
            head.contains(&format!("idempotent-replayed: {replayed}")),
            "{head}"
        );
    }
    assert_eq!(upstream.count_method("POST"), 1);
    assert_eq!(upstream.count(), 2);
}

/// `idemproxy_connections_parked` on `admin`'s `/metrics`.
async fn parked(admin: std::net::SocketAddr) -> u64 {
    let page = raw_request(
        admin,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    page.lines()
        .find_map(|l| l.strip_prefix("idemproxy_connections_parked "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the gauge on /metrics")
}

/// A request with both `Content-Length` and `Transfer-Encoding` (the classic smuggling pair):
/// hyper reads it chunked and closes the connection after it; so does the proxy, and what
/// follows the chunked body — a request to a front proxy that counts by `Content-Length` —
/// never reaches the upstream.
#[tokio::test]
async fn a_request_framed_two_ways_is_the_connections_last() {
    let upstream = RecordingUpstream::start().await;
    let proxy = start(&upstream).await;
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    s.write_all(
        b"POST /api/v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: two-ways\r\n\
          Content-Type: application/json\r\nContent-Length: 40\r\n\
          Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n\
          GET /api/v1/smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await
    .unwrap();
    let mut rest = Vec::new();
    let (head, _) = answer(&mut s, &mut rest).await;
    assert_eq!(connection(&head), Some("close"), "{head}");
    let after = until_closed(&mut s).await;
    assert!(
        rest.is_empty() && after.is_empty(),
        "{}",
        String::from_utf8_lossy(&after)
    );
    assert_eq!(upstream.count_path("/v1/smuggled"), 0);
}

/// HTTP/1.0 asking for keep-alive, and an answer of no known length (the upstream's is
/// chunked): an HTTP/1.0 body can only end by the connection closing, so it closes — the
/// client is never left waiting for the end of the body.
#[tokio::test]
async fn an_http_1_0_answer_of_no_length_ends_with_the_connection() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut chunk = [0u8; 1024];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut chunk).await {
                        Ok(n @ 1..) => seen.extend_from_slice(&chunk[..n]),
                        _ => return,
                    }
                }
                let _ = c
                    .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
                    .await;
            });
        }
    });
    let proxy = TestProxy::start(&format!(
        "{}[upstreams.api]\nurl = \"http://{at}\"\nprefix = \"/api\"\n",
        server_section()
    ))
    .await;
    let mut s = TcpStream::connect(proxy.main_addr).await.unwrap();
    s.write_all(b"GET /api/x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        .await
        .unwrap();
    let got = String::from_utf8_lossy(&until_closed(&mut s).await).into_owned();
    assert!(got.starts_with("HTTP/1.0 200"), "{got}");
    assert!(got.ends_with("hello"), "{got}");
}
