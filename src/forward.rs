//! The upstream call of a protected request, and what its ending means (SPEC.md's outcome
//! table). Never retried here: a re-forward is only safe when nothing was sent, and even then
//! it is the client's retry that does it.

use crate::store::StoredResponse;
use crate::upstream::{strip_hop_by_hop, ProxyBody, UpstreamClient};
use bytes::Bytes;
use http::{header, Request};
use http_body_util::BodyExt;
use std::time::Duration;

/// How an upstream call ended.
#[derive(Debug)]
pub enum Outcome {
    /// A complete answer.
    Answer(StoredResponse),
    /// Never sent (connect, DNS, TLS): safe to forward again.
    NotSent(String),
    /// Sent, no complete answer (timeout, reset): the upstream may have applied it.
    Unknown(String),
}

/// Sends `req` and buffers the whole answer within `timeout`.
pub async fn call(client: &UpstreamClient, req: Request<ProxyBody>, timeout: Duration) -> Outcome {
    let fut = async {
        let resp = match client.send(req).await {
            Ok(r) => r,
            Err(e) if e.is_connect() => return Outcome::NotSent(describe(&e)),
            Err(e) => return Outcome::Unknown(describe(&e)),
        };
        let (parts, body) = resp.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return Outcome::Unknown(format!("the answer's body broke off: {}", describe(&e)))
            }
        };
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        // The length is the body's; hyper recomputes it on every (re)play.
        headers.remove(header::CONTENT_LENGTH);
        Outcome::Answer(StoredResponse {
            status: parts.status.as_u16(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
                .collect(),
            body,
        })
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
