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
pub enum Outcome {
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
pub async fn call(client: &UpstreamClient, req: Request<ProxyBody>, timeout: Duration) -> Outcome {
    let deadline = tokio::time::Instant::now() + timeout;
    let fut = async {
        let resp = match client.send(req).await {
            Ok(r) => r,
            Err(e) if e.is_connect() => return Outcome::NotSent(describe(&e)),
            Err(e) => return Outcome::Unknown(describe(&e)),
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
        let mut names = Vec::with_capacity(headers.len());
        let mut ends = Vec::with_capacity(headers.len());
        let values: usize = headers.iter().map(|(_, v)| v.len()).sum();
        let max = client.upstream.max_answer;
        // Room for a declared length that will be read, never for one over `max_answer`.
        let expected = declared.filter(|&n| n <= max as u64).unwrap_or(0) as usize;
        let mut buf = BytesMut::with_capacity(values + expected);
        // The length is the body's; hyper recomputes it on every (re)play.
        for (n, v) in headers.iter().filter(|(n, _)| *n != header::CONTENT_LENGTH) {
            names.push(n.as_str().to_owned());
            buf.extend_from_slice(v.as_bytes());
            ends.push(buf.len());
        }
        let body_at = buf.len();
        let head = |all: &Bytes| StoredResponse {
            status: parts.status.as_u16(),
            headers: names
                .iter()
                .zip(&ends)
                .scan(0, |start, (n, &end)| {
                    let value = all.slice(*start..end);
                    *start = end;
                    Some((n.clone(), value))
                })
                .collect(),
            body: all.slice(body_at..),
        };
        loop {
            if buf.len() - body_at > max || declared.is_some_and(|n| n > max as u64) {
                let all = buf.freeze();
                let mut head = head(&all);
                // Streamed on to the first caller, never buffered whole: keep the length.
                if let Some(n) = declared {
                    head.headers
                        .push(("content-length".into(), Bytes::from(n.to_string())));
                }
                let prefix = std::mem::take(&mut head.body);
                return Outcome::Oversize {
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
                    return Outcome::Unknown(format!(
                        "the answer's body broke off: {}",
                        describe(&e)
                    ))
                }
            }
        }
        Outcome::Answer(head(&buf.freeze()))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(outcome) => outcome,
        Err(_) => Outcome::Unknown(format!("no complete answer within {timeout:?}")),
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
