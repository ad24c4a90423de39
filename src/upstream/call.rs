//! The upstream call of a protected request, and what its ending means (SPEC.md's outcome
//! table). Never retried here: a re-forward is only safe when nothing was sent, and even then
//! it is the client's retry that does it.

use super::client::{strip_hop_by_hop, BoxError, ProxyBody, UpstreamClient};
use crate::store::StoredResponse;
use bytes::{Bytes, BytesMut};
use http::{header, Request};
use http_body_util::BodyExt;
use std::future::Future;
use std::time::Duration;

/// How an upstream call ended.
#[derive(Debug)]
pub enum Called {
    /// A complete answer.
    Answer(StoredResponse),
    /// An answer over the upstream's `max_answer`: its head and the part read so far, and the
    /// rest still streaming. Memory stays bounded; the body is never stored.
    Oversize {
        head: StoredResponse,
        /// The part read so far, then the rest, until the call's deadline.
        body: PrefixedBody,
    },
    /// Never sent (connect, DNS, TLS): safe to forward again.
    NotSent(String),
    /// Sent, no complete answer (timeout, reset): the upstream may have applied it.
    Unknown(String),
}

/// Sends `req` and buffers the whole answer within `timeout`.
pub async fn call(client: &UpstreamClient, req: Request<ProxyBody>, timeout: Duration) -> Called {
    let deadline = tokio::time::Instant::now() + timeout;
    let fut = async {
        let resp = match client.send(req).await {
            Ok(r) => r,
            Err(e) if e.is_connect() => return Called::NotSent(describe(&e)),
            Err(e) => return Called::Unknown(describe(&e)),
        };
        let (parts, mut body) = resp.into_parts();
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        // The header values and the body are copied into one buffer, which every value and the
        // body are slices of: one allocation for the whole answer instead of one per value,
        // shared by the replay cache, the store and the response alike. Copied, not sliced out
        // of hyper's read buffer, which a cached answer would otherwise keep alive whole.
        let values: usize = headers.iter().map(|(_, v)| v.len()).sum();
        let max = client.upstream.max_answer;
        // Room for a declared length that will be read, never for one over `max_answer`.
        let expected = declared.filter(|&n| n <= max as u64).unwrap_or(0) as usize;
        let mut buf = BytesMut::with_capacity(values + expected);
        // Each header's name and where its value ends in `buf`. The length is the body's;
        // hyper recomputes it on every (re)play.
        let mut spans = Vec::with_capacity(headers.len());
        for (n, v) in headers.iter().filter(|(n, _)| *n != header::CONTENT_LENGTH) {
            buf.extend_from_slice(v.as_bytes());
            spans.push((n.as_str().to_owned(), buf.len()));
        }
        let (status, body_at) = (parts.status.as_u16(), buf.len());
        loop {
            if buf.len() - body_at > max || declared.is_some_and(|n| n > max as u64) {
                // The head gets buffers of its own: slices of `buf` would keep the body read
                // so far (up to `max_answer`) alive as long as the head is kept.
                let prefix = buf.split_off(body_at).freeze();
                let mut head = assemble(status, spans, &Bytes::copy_from_slice(&buf), body_at);
                // Streamed on to the first caller, never buffered whole: keep the length.
                if let Some(n) = declared {
                    head.headers
                        .push(("content-length".into(), Bytes::from(n.to_string())));
                }
                return Called::Oversize {
                    head,
                    body: PrefixedBody::new(prefix, body, deadline),
                };
            }
            match body.frame().await {
                None => break,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    return Called::Unknown(format!(
                        "the answer's body broke off: {}",
                        describe(&e)
                    ))
                }
            }
        }
        Called::Answer(assemble(status, spans, &buf.freeze(), body_at))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(outcome) => outcome,
        Err(_) => Called::Unknown(format!("no complete answer within {timeout:?}")),
    }
}

/// The answer whose header values (each ending at its span's offset) and body (from
/// `body_at`) are slices of `all`.
fn assemble(
    status: u16,
    spans: Vec<(String, usize)>,
    all: &Bytes,
    body_at: usize,
) -> StoredResponse {
    let mut start = 0;
    let headers = spans
        .into_iter()
        .map(|(name, end)| {
            let value = all.slice(start..end);
            start = end;
            (name, value)
        })
        .collect();
    StoredResponse {
        status,
        headers,
        body: all.slice(body_at..),
    }
}

/// An error and its causes on one line.
pub fn describe(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

/// A body that yields what was already read, then the rest of the upstream's stream: how an
/// answer over `max_answer` reaches its first caller without being held in memory.
/// The rest is bounded by the call's deadline (the upstream's `timeout`), like a buffered
/// answer: a stalling upstream cannot hold both connections open forever.
pub struct PrefixedBody {
    prefix: Option<Bytes>,
    rest: hyper::body::Incoming,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl std::fmt::Debug for PrefixedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixedBody").finish_non_exhaustive()
    }
}

impl PrefixedBody {
    pub fn new(
        prefix: Bytes,
        rest: hyper::body::Incoming,
        deadline: tokio::time::Instant,
    ) -> PrefixedBody {
        PrefixedBody {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }
}

impl hyper::body::Body for PrefixedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        use std::task::Poll;
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(prefix))));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            let late: BoxError = "the upstream's answer did not finish within its timeout".into();
            return Poll::Ready(Some(Err(late)));
        }
        std::pin::Pin::new(&mut self.rest)
            .poll_frame(cx)
            .map_err(Into::into)
    }
}
