//! Serving one accepted connection, HTTP/1.1 or HTTP/2, so that an idle connection holds
//! almost nothing. hyper keeps an HTTP/1 connection's read and write buffers (8 KiB each)
//! and its dispatcher for as long as the connection lives; nginx frees a keep-alive
//! connection's buffers while it idles, and so does this module: HTTP/1 requests run on a
//! hyper connection that gives the socket back once no request has begun for a second
//! ([`turn`]); the bare socket is then parked until its next bytes, and handed to a fresh hyper
//! connection with those bytes put back in front.
//!
//! The client sees one keep-alive connection. One is closed (with `Connection: close` on the
//! last answer) when the client asked to, when a request's body was not read to its end (its
//! rest would be taken for the next request's head), or when the listener is closing.

mod body;
mod h2;
mod rewind;
pub mod splice;
mod turn;

pub use body::{number, RequestBody};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONNECTION};
use http::{HeaderMap, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::metrics::gauge::Gauge;
use rewind::Rewind;
use std::convert::Infallible;
use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_util::sync::CancellationToken;
use turn::{Turn, Turned};

/// What an HTTP/2 client sends first (RFC 9113, 3.4): how prior knowledge is told from HTTP/1.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How a listener serves its connections' HTTP.
pub struct Http {
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    /// How long a connection may wait for its first request, and idle between requests.
    idle: Duration,
    /// Connections waiting for a request with only the socket held.
    parked: Gauge,
}

impl Http {
    /// `head` bounds a request head once its first byte is in, and a connection's wait for a
    /// request (its first, or its next); `parked` counts the connections waiting.
    pub fn new(head: Duration, parked: Gauge) -> Http {
        let mut h1 = http1::Builder::new();
        h1.timer(TokioTimer::new())
            .header_read_timeout(head)
            // Reads stop once a request is in: the next read is then for the next head.
            .half_close(true);
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        // HTTP/2 clients are pinged when idle; one that does not answer is dropped.
        h2.timer(TokioTimer::new())
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        Http {
            h1,
            h2,
            idle: head,
            parked,
        }
    }
}

/// Serves `io` to its end: until the client closes, idles past its time, sends what is not
/// HTTP, or `closing` is cancelled (an exchange under way is finished first).
pub async fn serve<I, H, F, B>(
    mut io: I,
    http: &Http,
    handler: H,
    closing: &CancellationToken,
    peer: &(dyn Display + Sync),
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<RequestBody>) -> F + Clone + Send + Sync + Unpin + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Some(mut next) = first_bytes_in(&mut io, http, closing, peer).await else {
        return;
    };
    let conn = number();
    if next.starts_with(PREFACE) {
        return h2::serve(Rewind::new(next, io), http, handler, closing, peer, conn).await;
    }
    loop {
        let Some((back, rest)) =
            exchange(Rewind::new(next, io), http, &handler, closing, peer, conn).await
        else {
            return;
        };
        io = back;
        next = match rest.is_empty() {
            false => rest,
            true => match wait(&mut io, http, closing, peer, Wait::Next).await {
                Some(bytes) => bytes,
                None => return,
            },
        };
    }
}

/// The connection's first bytes: enough to tell HTTP/2's preface from HTTP/1, under one
/// deadline however thinly they come.
async fn first_bytes_in<I>(
    io: &mut I,
    http: &Http,
    closing: &CancellationToken,
    peer: &(dyn Display + Sync),
) -> Option<Bytes>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let first = tokio::time::Instant::now() + http.idle;
    let mut next = wait(io, http, closing, peer, Wait::First(first)).await?;
    while next.len() < PREFACE.len() && PREFACE.starts_with(&next) {
        let more = wait(io, http, closing, peer, Wait::First(first)).await?;
        let mut joined = BytesMut::from(&next[..]);
        joined.extend_from_slice(&more);
        next = joined.freeze();
    }
    Some(next)
}

/// What a connection waits for.
enum Wait {
    /// Its first request, by this deadline.
    First(tokio::time::Instant),
    /// Its next request (it is parked), for as long as a connection may idle.
    Next,
}

/// Parks `io` until bytes arrive and returns them; `None` when the connection is over (closed
/// by the client, idle too long, or the listener closing), after closing it.
async fn wait<I>(
    io: &mut I,
    http: &Http,
    closing: &CancellationToken,
    peer: &(dyn Display + Sync),
    what: Wait,
) -> Option<Bytes>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let (deadline, _parked) = match what {
        Wait::First(deadline) => (deadline, None),
        Wait::Next => (
            tokio::time::Instant::now() + http.idle,
            Some(crate::metrics::GaugeGuard::up(http.parked.clone())),
        ),
    };
    let read = tokio::select! {
        _ = closing.cancelled() => None,
        read = tokio::time::timeout_at(deadline, first_bytes(io)) => Some(read),
    };
    match read {
        Some(Ok(Ok(bytes))) if !bytes.is_empty() => return Some(bytes),
        Some(Ok(Ok(_))) => return None,
        Some(Ok(Err(e))) => {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
            return None;
        }
        Some(Err(_)) => tracing::debug!(%peer, "closing a connection that sent no request in time"),
        None => {}
    }
    close(io).await;
    None
}

/// Reads what has arrived, into a buffer on the stack of the poll (never in the connection's
/// task, which stays small while it waits).
async fn first_bytes<I: AsyncRead + Unpin>(io: &mut I) -> std::io::Result<Bytes> {
    std::future::poll_fn(|cx| {
        let mut stack = [0u8; 4096];
        let mut buf = ReadBuf::new(&mut stack);
        ready!(Pin::new(&mut *io).poll_read(cx, &mut buf))?;
        Poll::Ready(Ok(Bytes::copy_from_slice(buf.filled())))
    })
    .await
}

async fn close<I: AsyncWrite + Unpin>(io: &mut I) {
    let _ = tokio::time::timeout(Duration::from_secs(5), io.shutdown()).await;
}

type Answer<B> = Pin<Box<dyn Future<Output = Result<Response<B>, Infallible>> + Send>>;

/// HTTP/1 requests and their answers on one hyper connection, until the connection idles
/// (see [`turn`]), closes or may not carry another request. Returns the socket and any bytes
/// read past the last request when the connection may carry another.
async fn exchange<I, H, F, B>(
    io: Rewind<I>,
    http: &Http,
    handler: &H,
    closing: &CancellationToken,
    peer: &(dyn Display + Sync),
    conn: u64,
) -> Option<(I, Bytes)>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<RequestBody>) -> F + Clone + Send + Sync + Unpin + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let turn = Arc::new(Turn::default());
    let svc = {
        let (turn, handler, closing) = (turn.clone(), handler.clone(), closing.clone());
        hyper::service::service_fn(move |req: Request<Incoming>| -> Answer<B> {
            turn.begin();
            let keep = keeps_alive(req.version(), req.headers());
            // This request's own flag: an earlier request's body, still alive in an upstream
            // call, must not vouch for this one.
            let read = Arc::new(AtomicBool::new(false));
            let answer = handler(req.map(|b| RequestBody::tracked(b, read.clone(), conn)));
            let (turn, closing) = (turn.clone(), closing.clone());
            Box::pin(async move {
                let mut resp = answer.await;
                let again = keep
                    && read.load(Ordering::Acquire)
                    && !closing.is_cancelled()
                    && resp.status() != StatusCode::SWITCHING_PROTOCOLS
                    && !has_token(resp.headers(), "close");
                if !again {
                    resp.headers_mut()
                        .insert(CONNECTION, HeaderValue::from_static("close"));
                }
                turn.again.store(again, Ordering::Release);
                Ok(resp)
            })
        })
    };
    let io = TokioIo::new(Turned::new(io, turn.clone()));
    // Boxed, so its buffers and dispatcher are freed with it and the waiting task stays small.
    let mut conn = Box::new(http.h1.serve_connection(io, svc));
    // Closing: an idle hyper connection closes at once, a busy one after its answer.
    let cancelled = closing.cancelled();
    tokio::pin!(cancelled);
    let (mut shut, mut turned) = (false, false);
    let served = std::future::poll_fn(|cx| loop {
        if !shut && cancelled.as_mut().poll(cx).is_ready() {
            shut = true;
            Pin::new(&mut *conn).graceful_shutdown();
        }
        let polled = conn.poll_without_shutdown(cx);
        if polled.is_pending() && turn.tell() {
            Pin::new(&mut *conn).graceful_shutdown();
            turned = !shut;
            continue;
        }
        return polled;
    });
    if let Err(e) = served.await {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
        return None;
    }
    let parts = conn.into_parts();
    let (mut io, unread) = parts.io.into_inner().into_inner().into_inner();
    // Kept only when it ended by our turn, idle: any close hyper chose itself (a request with
    // both Content-Length and Transfer-Encoding, an HTTP/1.0 body ended by closing) stands.
    if !(turned && !shut && turn.again.load(Ordering::Acquire)) {
        close(&mut io).await;
        return None;
    }
    Some((io, leftover(parts.read_buf, unread)))
}

/// The bytes read past the last request: what hyper had buffered, then what the turn caught
/// of the next request's head.
fn leftover(buffered: Bytes, unread: Bytes) -> Bytes {
    match (buffered.is_empty(), unread.is_empty()) {
        (true, _) => unread,
        (false, true) => buffered,
        (false, false) => {
            let mut joined = BytesMut::from(&buffered[..]);
            joined.extend_from_slice(&unread);
            joined.freeze()
        }
    }
}

/// Whether the client lets the connection carry another request: HTTP/1.1 unless it says
/// `close`, HTTP/1.0 only when it says `keep-alive`.
fn keeps_alive(version: Version, headers: &HeaderMap) -> bool {
    match version {
        Version::HTTP_11 => !has_token(headers, "close"),
        Version::HTTP_10 => has_token(headers, "keep-alive"),
        _ => false,
    }
}

fn has_token(headers: &HeaderMap, token: &str) -> bool {
    connection_tokens(headers).any(|t| t.eq_ignore_ascii_case(token))
}

/// The tokens of every `Connection` header (`close`, `keep-alive`, header names), trimmed.
pub fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
}

/// How long a client may take to send a request head (and how long a connection may idle
/// before its first request).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves a connection to its end — unless no request has begun within
/// [`HEADER_READ_TIMEOUT`]: hyper's header timeout starts only once a request's bytes arrive
/// (and after HTTP/1-or-2 detection), so a silent client would otherwise hold its slot.
pub async fn drive<F, E>(conn: F, spoke: &AtomicBool, peer: impl std::fmt::Display)
where
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tokio::pin!(conn);
    let ended = tokio::select! {
        r = &mut conn => Some(r),
        _ = tokio::time::sleep(HEADER_READ_TIMEOUT) => None,
    };
    let result = match ended {
        Some(r) => r,
        None if !spoke.load(Ordering::Relaxed) => {
            tracing::debug!(%peer, "closing a connection that sent no request in time");
            return;
        }
        None => conn.await,
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(connection: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in connection {
            h.append(CONNECTION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn who_keeps_the_connection() {
        assert!(keeps_alive(Version::HTTP_11, &headers(&[])));
        assert!(!keeps_alive(
            Version::HTTP_11,
            &headers(&["Keep-Alive, Close"])
        ));
        assert!(!keeps_alive(Version::HTTP_11, &headers(&["te", "close"])));
        assert!(!keeps_alive(Version::HTTP_10, &headers(&[])));
        assert!(keeps_alive(Version::HTTP_10, &headers(&["keep-alive"])));
        assert!(!keeps_alive(Version::HTTP_09, &headers(&[])));
    }
}
