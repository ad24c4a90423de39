//! What a [`RecordingUpstream`](super::RecordingUpstream) records ([`Recorded`]) and what a
//! test scripts it to answer ([`Reply`], [`Action`]).

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Version};

/// One request as the upstream received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// Arrival order at this upstream, starting at 1 (the `n` of the default answer).
    pub seq: u64,
    pub method: Method,
    /// Origin-form target as received, e.g. `/v1/charges?expand=x`.
    pub path_and_query: String,
    /// `Host` header, or the `:authority` of an HTTP/2 request.
    pub authority: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub version: Version,
}

impl Recorded {
    /// The path without the query.
    pub fn path(&self) -> &str {
        self.path_and_query
            .split_once('?')
            .map_or(self.path_and_query.as_str(), |(path, _)| path)
    }

    /// The query string, if any.
    pub fn query(&self) -> Option<&str> {
        self.path_and_query.split_once('?').map(|(_, query)| query)
    }

    /// A header's value as a string (the first, if repeated).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body parsed as JSON; panics with the body if it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "upstream request #{} body is not JSON ({e}): {:?}",
                self.seq,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The body as (lossy) UTF-8.
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// What the upstream does once a request is recorded (and released, if held).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send the reply's status, headers and body.
    Respond,
    /// Never answer; the connection stays open until the client gives up or the upstream stops.
    Hang,
    /// Close the connection without any answer: the request was processed, the outcome is lost.
    Drop,
}

/// A scripted answer. Every answer also carries `x-upstream-seq: <seq>` unless the reply sets it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    /// Hold the request (counted as in flight) until the test calls `release_*`.
    pub hold: bool,
    pub action: Action,
}

impl Reply {
    /// An empty answer with this status.
    pub fn new(status: u16) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: Bytes::new(),
            hold: false,
            action: Action::Respond,
        }
    }

    /// A JSON answer (`content-type: application/json`).
    pub fn json(status: u16, value: &serde_json::Value) -> Reply {
        Reply::new(status)
            .header("content-type", "application/json")
            .body(serde_json::to_vec(value).expect("serialize JSON reply"))
    }

    /// A plain-text answer (`content-type: text/plain`).
    pub fn text(status: u16, body: &str) -> Reply {
        Reply::new(status)
            .header("content-type", "text/plain")
            .body(body.to_string())
    }

    /// The default answer: `200`, JSON `{"n": seq, "method": ..., "path": ...}` (plus `"query"`
    /// when there is one), so a replay can be told apart from a fresh answer by `n`.
    pub fn echo(rec: &Recorded, seq: u64) -> Reply {
        let mut value = serde_json::json!({
            "n": seq,
            "method": rec.method.as_str(),
            "path": rec.path(),
        });
        if let Some(query) = rec.query() {
            value["query"] = serde_json::Value::String(query.to_string());
        }
        Reply::json(200, &value)
    }

    /// Never answers (to trigger the proxy's upstream timeout).
    pub fn hang() -> Reply {
        Reply {
            action: Action::Hang,
            ..Reply::new(0)
        }
    }

    /// Closes the connection without an answer, after the request was recorded.
    pub fn drop_connection() -> Reply {
        Reply {
            action: Action::Drop,
            ..Reply::new(0)
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Replaces the body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Reply {
        self.body = body.into();
        self
    }

    /// Holds this request until the test releases it, then acts as before.
    pub fn held(mut self) -> Reply {
        self.hold = true;
        self
    }

    /// The headers to send: the scripted ones plus `x-upstream-seq`.
    pub(crate) fn header_map(&self, seq: u64) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in &self.headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .unwrap_or_else(|e| panic!("scripted header name {name:?}: {e}"));
            let value = HeaderValue::from_str(value)
                .unwrap_or_else(|e| panic!("scripted header value {value:?}: {e}"));
            map.append(name, value);
        }
        if !map.contains_key("x-upstream-seq") {
            map.insert("x-upstream-seq", HeaderValue::from(seq));
        }
        map
    }
}

/// Decides the answer to each request: `(request, seq) -> Reply`.
pub type Handler = Arc<dyn Fn(&Recorded, u64) -> Reply + Send + Sync>;
/// Names the entities a request touches, for concurrency tracking.
pub type EntityFn = Arc<dyn Fn(&Recorded) -> Vec<String> + Send + Sync>;
