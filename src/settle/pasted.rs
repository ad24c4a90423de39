//! The answer an operator pastes for a write that happened, checked and cleaned before it is
//! stored: retries get it as the upstream's own answer, so it must be one an upstream could
//! have sent and that the proxy would have stored.

use super::Refused;
use crate::config::Upstream;
use crate::store::{StoredResponse, SET_BY_OPERATOR};
use crate::upstream::client::strip_hop_by_hop;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

/// The answer an operator pastes: status, headers as written, body.
#[derive(Debug, Default, Clone)]
pub struct Completion {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

/// Headers a pasted answer never stores: framing is the proxy's when it replays, a cookie
/// would hand a session to every retry, and the proxy's own names are set by the proxy.
fn dropped(name: &HeaderName) -> bool {
    let n = name.as_str();
    matches!(
        n,
        "content-length"
            | "transfer-encoding"
            | "set-cookie"
            | "set-cookie2"
            | "idempotent-replayed"
    ) || n.starts_with("idemproxy-")
}

impl Completion {
    /// The answer as stored for a record of `upstream`: a status an answer can have and that
    /// does not mean "not processed" there, a body within its `max_answer`, header lines
    /// that parse, without hop-by-hop and [`dropped`] names, marked as set by an operator.
    pub fn stored(&self, upstream: Option<&Upstream>) -> Result<StoredResponse, Refused> {
        let invalid = |m: String| Err(Refused::Invalid(m));
        if !(200..=599).contains(&self.status) {
            return invalid(format!(
                "status {} is not an answer's status (200-599)",
                self.status
            ));
        }
        if let Some(u) = upstream {
            if u.release_statuses.contains(&self.status) {
                return invalid(format!(
                    "status {} is one of upstream {}'s release_statuses (not processed): release the key instead",
                    self.status, u.name
                ));
            }
            if self.body.len() > u.max_answer {
                return invalid(format!(
                    "the body ({} bytes) is over upstream {}'s max_answer ({} bytes)",
                    self.body.len(),
                    u.name,
                    u.max_answer
                ));
            }
        }
        let mut map = HeaderMap::with_capacity(self.headers.len());
        for (name, value) in &self.headers {
            let n = HeaderName::from_bytes(name.trim().as_bytes())
                .map_err(|_| Refused::Invalid(format!("{name:?} is not a header name")))?;
            let v = HeaderValue::from_str(value.trim()).map_err(|_| {
                Refused::Invalid(format!("the value of {name:?} is not a header value"))
            })?;
            map.append(n, v);
        }
        strip_hop_by_hop(&mut map);
        let mut headers: Vec<(String, Bytes)> = map
            .iter()
            .filter(|(n, _)| !dropped(n))
            .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
            .collect();
        headers.push((SET_BY_OPERATOR.into(), Bytes::from_static(b"1")));
        Ok(StoredResponse {
            status: self.status,
            headers,
            body: self.body.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pasted(status: u16, headers: &[(&str, &str)]) -> Completion {
        Completion {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: Bytes::from_static(b"{}"),
        }
    }

    #[test]
    fn only_end_to_end_headers_are_kept() {
        let c = pasted(
            201,
            &[
                ("Content-Type", "application/json"),
                ("Connection", "x-private"),
                ("X-Private", "1"),
                ("Keep-Alive", "timeout=5"),
                ("Transfer-Encoding", "chunked"),
                ("Content-Length", "999"),
                ("Set-Cookie", "session=abc"),
                ("Idemproxy-Cache", "hit"),
                ("Idempotent-Replayed", "false"),
                ("X-Request-Id", "req_1"),
            ],
        );
        let stored = c.stored(None).map_err(|e| e.to_string()).unwrap();
        let names: Vec<&str> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "x-request-id", SET_BY_OPERATOR]);
    }

    #[test]
    fn what_no_upstream_could_answer_is_refused() {
        for status in [0, 101, 199, 600, 999] {
            assert!(pasted(status, &[]).stored(None).is_err(), "{status}");
        }
        for (n, v) in [("Bad Name", "1"), ("X-A", "a\r\nSet-Cookie: x"), ("", "v")] {
            assert!(pasted(200, &[(n, v)]).stored(None).is_err(), "{n:?}: {v:?}");
        }
    }
}
