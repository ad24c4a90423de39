//! How a request's body was read, in the words a refusal needs: a JSON body sent as a form
//! (curl's `-d` without a `Content-Type`) or with no `Content-Type` at all otherwise reads as
//! "the request lacks the field", which names neither the cause nor the fix.

use crate::rules::body::BodyKind;
use http::HeaderMap;

/// What step 1 made of the body.
pub(super) struct BodyRead<'a> {
    pub kind: BodyKind,
    /// Whether it parsed as its kind says (JSON, a form).
    pub parsed: bool,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

impl BodyRead<'_> {
    /// For a refusal over a missing `field`: empty unless the field is the body's, else how
    /// the body was read and, where it plainly is another kind, what to send.
    pub fn note(&self, field: &str) -> String {
        if !field.starts_with("body.") {
            return String::new();
        }
        format!(" ({})", self.said())
    }

    /// How the body was read, and what would have read it.
    pub fn said(&self) -> String {
        let ct = self
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let start = self.body.iter().find(|b| !b.is_ascii_whitespace());
        let looks_json = matches!(start, Some(b'{') | Some(b'['));
        match (self.kind, self.parsed, ct) {
            (_, _, None) if self.body.is_empty() => "the request has no body".into(),
            (_, _, None) => format!(
                "the body has no Content-Type, so it was read as neither JSON nor a form: send Content-Type: {}",
                if looks_json { "application/json" } else { "application/json or application/x-www-form-urlencoded" }
            ),
            (BodyKind::Form, true, Some(ct)) if looks_json => format!(
                "the body was read as a form (Content-Type: {ct}) but looks like JSON: send Content-Type: application/json"
            ),
            (BodyKind::Form, true, Some(ct)) => format!("the body was read as a form (Content-Type: {ct})"),
            (BodyKind::Json, true, Some(ct)) => format!("the body was read as JSON (Content-Type: {ct})"),
            (BodyKind::Raw, _, Some(ct)) => format!(
                "the body's Content-Type is {ct}: neither JSON (application/json, +json) nor a form (application/x-www-form-urlencoded)"
            ),
            (_, false, Some(ct)) => format!("the body does not parse as its Content-Type ({ct}) says"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(ct: Option<&str>, kind: BodyKind, parsed: bool, body: &[u8]) -> String {
        let mut headers = HeaderMap::new();
        if let Some(ct) = ct {
            headers.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
        }
        BodyRead {
            kind,
            parsed,
            headers: &headers,
            body,
        }
        .said()
    }

    #[test]
    fn says_how_the_body_was_read_and_what_to_send() {
        let form = Some("application/x-www-form-urlencoded");
        let s = said(form, BodyKind::Form, true, br#"{"properties":{}}"#);
        assert!(
            s.contains("looks like JSON") && s.contains("application/json"),
            "{s}"
        );
        let s = said(None, BodyKind::Raw, false, br#"{"a":1}"#);
        assert!(
            s.contains("no Content-Type") && s.contains("application/json"),
            "{s}"
        );
        let s = said(Some("text/plain"), BodyKind::Raw, false, b"x");
        assert!(s.contains("text/plain"), "{s}");
        assert_eq!(
            said(None, BodyKind::Raw, false, b""),
            "the request has no body"
        );
    }
}
