//! Client side of the tests: requests to the proxy over plain HTTP/1.1 (hyper-util's legacy
//! client, a fresh one per call so no pooled connection outlives a test's runtime), h2c with
//! prior knowledge, and hand-written HTTP/1.1 over raw TCP for targets normal clients refuse to
//! send (absolute-form, `..` paths, CONNECT).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::raw_upstream::find;

/// A safety net, not an assertion: a request that gets no answer in this long fails the test
/// instead of hanging the suite.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A complete response.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub version: Version,
}

impl Resp {
    /// A header's value as a string.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body parsed as JSON; panics with status and body if it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}); status {}, body {:?}",
                self.status,
                self.text()
            )
        })
    }

    /// The body as (lossy) UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// `Idemproxy-Error` (the proxy's own error type), if any.
    pub fn error_type(&self) -> Option<&str> {
        self.header("idemproxy-error")
    }

    /// `Idempotent-Replayed` as a bool (`None` when absent).
    pub fn replayed(&self) -> Option<bool> {
        self.header("idempotent-replayed")
            .map(|v| v.eq_ignore_ascii_case("true"))
    }

    /// `Idempotency-Key` of the answer (the effective key on protected routes).
    pub fn idempotency_key(&self) -> Option<&str> {
        self.header("idempotency-key")
    }

    /// `x-upstream-seq` set by a [`RecordingUpstream`](super::RecordingUpstream): which
    /// upstream request produced this answer.
    pub fn upstream_seq(&self) -> Option<u64> {
        self.header("x-upstream-seq").and_then(|v| v.parse().ok())
    }

    /// Panics with the whole response unless the status is `status`.
    #[track_caller]
    pub fn assert_status(&self, status: u16) -> &Resp {
        assert_eq!(
            self.status,
            status,
            "unexpected status; headers {:?}, body {:?}",
            self.headers,
            self.text()
        );
        self
    }
}

/// Builds a request; `headers` are appended in order (repeats allowed).
pub fn build(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Request<Full<Bytes>> {
    let method =
        Method::from_bytes(method.as_bytes()).unwrap_or_else(|e| panic!("method {method:?}: {e}"));
    let mut req = Request::new(Full::new(body.into()));
    *req.method_mut() = method;
    *req.uri_mut() = url.parse().unwrap_or_else(|e| panic!("url {url:?}: {e}"));
    for (name, value) in headers {
        req.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes())
                .unwrap_or_else(|e| panic!("header name {name:?}: {e}")),
            HeaderValue::from_str(value).unwrap_or_else(|e| panic!("header value {value:?}: {e}")),
        );
    }
    req
}

async fn collect(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    req: Request<Full<Bytes>>,
) -> anyhow::Result<Resp> {
    let what = format!("{} {}", req.method(), req.uri());
    let exchange = async {
        let resp = client.request(req).await?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        anyhow::Ok(Resp {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
            version: parts.version,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{what}: no answer within {REQUEST_TIMEOUT:?}"))?
        .with_context(|| format!("{what} failed"))
}

/// Sends over HTTP/1.1; `Err` on a transport error (reset, incomplete message, refused).
pub async fn try_send(req: Request<Full<Bytes>>) -> anyhow::Result<Resp> {
    let client = Client::builder(TokioExecutor::new()).build_http();
    collect(&client, req).await
}

/// Sends over HTTP/1.1; panics on a transport error.
pub async fn send(req: Request<Full<Bytes>>) -> Resp {
    try_send(req).await.unwrap_or_else(|e| panic!("{e:#}"))
}

/// Sends over HTTP/2 without TLS (h2c, prior knowledge).
pub async fn send_h2(req: Request<Full<Bytes>>) -> Resp {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    collect(&client, req)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// `method url` with headers and body; `Err` on a transport error.
pub async fn try_request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Resp> {
    try_send(build(method, url, headers, body)).await
}

/// `method url` with headers and body; panics on a transport error.
pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Resp {
    send(build(method, url, headers, body)).await
}

/// `GET url`.
pub async fn get(url: &str) -> Resp {
    request("GET", url, &[], Bytes::new()).await
}

/// `POST url` with a JSON body, `Idempotency-Key: key` when given, and `extra_headers`.
pub async fn post_json(
    url: &str,
    key: Option<&str>,
    body: &serde_json::Value,
    extra_headers: &[(&str, &str)],
) -> Resp {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(key) = key {
        headers.push(("idempotency-key", key));
    }
    headers.extend_from_slice(extra_headers);
    let body = serde_json::to_vec(body).expect("serialize JSON body");
    request("POST", url, &headers, body).await
}

/// Writes `bytes` as they are to `addr` and returns the response text: head plus a body
/// delimited by `content-length`, chunked encoding, or EOF. An empty string means the peer
/// closed without answering. Panics if nothing complete arrives within 10 s.
pub async fn raw_request(addr: SocketAddr, bytes: &[u8]) -> String {
    let exchange = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        stream
            .write_all(bytes)
            .await
            .unwrap_or_else(|e| panic!("write raw request to {addr}: {e}"));
        let head_only = bytes.starts_with(b"HEAD ");
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            if response_complete(&buf, head_only) {
                break;
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break, // EOF or reset: return what arrived
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    };
    tokio::time::timeout(super::WAIT, exchange)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "raw request to {addr}: no complete answer in {:?}",
                super::WAIT
            )
        })
}

/// Whether `buf` holds one whole response (false means: keep reading until EOF).
fn response_complete(buf: &[u8], head_only: bool) -> bool {
    let Some(head_end) = find(buf, b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = raw_status(&head);
    if head_only || status == 204 || status == 304 || (100..200).contains(&status) {
        return true;
    }
    let body = &buf[head_end + 4..];
    for line in head.split("\r\n").skip(1) {
        if let Some((name, value)) = line.split_once(':') {
            match name.trim() {
                "content-length" => {
                    return value.trim().parse::<usize>().is_ok_and(|n| body.len() >= n)
                }
                "transfer-encoding" if value.contains("chunked") => {
                    return body.starts_with(b"0\r\n\r\n") || find(body, b"\r\n0\r\n\r\n").is_some()
                }
                _ => {}
            }
        }
    }
    false
}

/// The status code of a raw response text (`0` if it has no status line).
pub fn raw_status(response: &str) -> u16 {
    if !response.starts_with("HTTP/") {
        return 0;
    }
    response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A request with header values given as bytes (a client may send any).
pub fn build_bytes(
    method: &str,
    url: &str,
    headers: &[(&str, &[u8])],
    body: &str,
) -> Request<Full<Bytes>> {
    let mut req = build(method, url, &[], body.to_owned());
    for (name, value) in headers {
        req.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes()).expect("a header name"),
            HeaderValue::from_bytes(value).expect("a header value"),
        );
    }
    req
}
