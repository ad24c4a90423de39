//! A form the console posted to itself: `application/x-www-form-urlencoded`, read whole up to
//! the listener's body limit (a pasted answer can be as large as a stored one) and within its
//! `body_timeout` (the sign-in form is read before anyone is known: a client that trickles
//! its bytes must not hold a connection forever).

use crate::connection::RequestBody;
use http::{header, Request, StatusCode};
use std::time::Duration;

/// The fields of a posted form, in order.
pub struct Form(Vec<(String, String)>);

/// Why a form could not be read: its status and a message for the page.
pub struct Unreadable(pub StatusCode, pub String);

impl Form {
    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Reads the body of `req`, at most `max` bytes, all of them within `within`.
    pub async fn read(
        req: Request<RequestBody>,
        max: usize,
        within: Duration,
    ) -> Result<Form, Unreadable> {
        use http_body_util::BodyExt;
        let urlencoded = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
        if !urlencoded {
            return Err(Unreadable(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "the console takes its own forms only (application/x-www-form-urlencoded)".into(),
            ));
        }
        let collect = http_body_util::Limited::new(req.into_body(), max).collect();
        let bytes = tokio::time::timeout(within, collect)
            .await
            .map_err(|_| {
                Unreadable(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("the form did not arrive within body_timeout ({within:?})"),
                )
            })?
            .map_err(|e| Unreadable(StatusCode::PAYLOAD_TOO_LARGE, format!("the form: {e}")))?
            .to_bytes();
        Ok(Form(form_urlencoded::parse(&bytes).into_owned().collect()))
    }

    #[cfg(test)]
    pub fn of(pairs: &[(&str, &str)]) -> Form {
        Form(
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        )
    }
}

/// The query string of `uri` as pairs (a GET page's parameters).
pub fn query(uri: &http::Uri) -> Form {
    let q = uri.query().unwrap_or_default();
    Form(form_urlencoded::parse(q.as_bytes()).into_owned().collect())
}
