//! The one error type of the request path, and the one match that turns it into a response.
//!
//! Every error knows its origin (the client's input, the upstream, the store, or our own state)
//! so that logs and metrics can tell "the client sent garbage" from "PostgreSQL is down". The
//! mapping to status code and SPEC.md error type lives in [`ProxyError::kind`] and nowhere else.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use std::time::Duration;

/// Where an error came from: used for logs and metrics, never shown to clients as a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The request itself is at fault (bad path, missing key, body too large...).
    Downstream,
    /// The upstream failed us (unreachable, timed out).
    Upstream,
    /// The store failed us: fail closed, never forward.
    Store,
    /// The state of other requests (locks held, keys in flight, claims).
    Conflict,
    /// The proxy itself.
    Internal,
}

/// The error types of SPEC.md. The string form is what clients see in `Idemproxy-Error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    BadPath,
    NoRoute,
    BodyInvalid,
    BodyTooLarge,
    KeyMissing,
    KeyInvalid,
    EntityMissing,
    VersionMissing,
    KeyReused,
    RequestInProgress,
    OutcomeUnknown,
    StaleVersion,
    EntityClaimed,
    PrecheckFailed,
    EntityBusy,
    StoreUnavailable,
    UpstreamUnreachable,
    UpstreamTimeout,
    /// A method spelled like a standard one in another case (`post`): never forwarded.
    BadMethod,
    /// Egress listener: a host no upstream claims and no tunnel names (`403`); nothing is
    /// connected.
    EgressHostNotAllowed,
    /// Egress listener: a missing or wrong `Proxy-Authorization` when `proxy_token` is set.
    ProxyAuthRequired,
    /// A header a route reads (for its key, entity or version) is not UTF-8 text, or is sent
    /// more than once: reading it would be a guess, never a fallback (`400`).
    HeaderInvalid,
    /// The request body did not arrive within `body_timeout` (`408`).
    BodyTimeout,
    /// The key's first answer was over `max_answer`: it reached its first caller but was not
    /// stored, so it cannot be replayed; the request is never forwarded again (`409`).
    AnswerTooLarge,
    /// The proxy itself failed (a bug): a JSON `500`, never a bare one.
    Internal,
    /// Admin API only: `/admin/*` on a non-loopback listener without an `admin_token`.
    Forbidden,
    /// Admin API only: a missing or wrong bearer token.
    Unauthorized,
    /// Admin API only: the key or entity does not exist.
    NotFound,
    /// Admin API only: an operator's settlement of a key whose outcome is known, whose call
    /// may still run, or which several records carry (`409`, with the records).
    NotSettleable,
    /// The API's rate limit for this account (`upstreams.X.pace`) would not give this request
    /// its turn within `max_wait`: refused with `Retry-After`, nothing sent (`429`).
    RateLimited,
}

impl ErrorKind {
    /// Every error type, for tables and for the tests that hold the docs to them.
    pub const ALL: [ErrorKind; 30] = {
        use ErrorKind::*;
        [
            BadPath,
            NoRoute,
            BodyInvalid,
            BodyTooLarge,
            KeyMissing,
            KeyInvalid,
            EntityMissing,
            VersionMissing,
            KeyReused,
            RequestInProgress,
            OutcomeUnknown,
            StaleVersion,
            EntityClaimed,
            PrecheckFailed,
            EntityBusy,
            StoreUnavailable,
            UpstreamUnreachable,
            UpstreamTimeout,
            BadMethod,
            EgressHostNotAllowed,
            ProxyAuthRequired,
            HeaderInvalid,
            BodyTimeout,
            AnswerTooLarge,
            Internal,
            Forbidden,
            Unauthorized,
            NotFound,
            NotSettleable,
            RateLimited,
        ]
    };

    /// The `type` field of the JSON error and the `Idemproxy-Error` header value.
    pub fn as_str(self) -> &'static str {
        use ErrorKind::*;
        match self {
            BadPath => "bad_path",
            NoRoute => "no_route",
            BodyInvalid => "body_invalid",
            BodyTooLarge => "body_too_large",
            KeyMissing => "key_missing",
            KeyInvalid => "key_invalid",
            EntityMissing => "entity_missing",
            VersionMissing => "version_missing",
            KeyReused => "key_reused",
            RequestInProgress => "request_in_progress",
            OutcomeUnknown => "outcome_unknown",
            StaleVersion => "stale_version",
            EntityClaimed => "entity_claimed",
            PrecheckFailed => "precheck_failed",
            EntityBusy => "entity_busy",
            StoreUnavailable => "store_unavailable",
            UpstreamUnreachable => "upstream_unreachable",
            UpstreamTimeout => "upstream_timeout",
            BadMethod => "bad_method",
            HeaderInvalid => "header_invalid",
            EgressHostNotAllowed => "egress_host_not_allowed",
            ProxyAuthRequired => "proxy_auth_required",
            BodyTimeout => "body_timeout",
            AnswerTooLarge => "answer_too_large",
            Forbidden => "forbidden",
            Internal => "internal_error",
            Unauthorized => "unauthorized",
            NotFound => "not_found",
            NotSettleable => "not_settleable",
            RateLimited => "rate_limited",
        }
    }

    /// The HTTP status SPEC.md assigns to this error type.
    pub fn status(self) -> StatusCode {
        use ErrorKind::*;
        match self {
            BadPath | BadMethod | HeaderInvalid | BodyInvalid | KeyMissing | KeyInvalid
            | EntityMissing | VersionMissing => StatusCode::BAD_REQUEST,
            NoRoute | NotFound => StatusCode::NOT_FOUND,
            BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            RequestInProgress | OutcomeUnknown | StaleVersion | EntityClaimed | PrecheckFailed
            | AnswerTooLarge | NotSettleable => StatusCode::CONFLICT,
            BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Forbidden | EgressHostNotAllowed => StatusCode::FORBIDDEN,
            ProxyAuthRequired => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
            EntityBusy | StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Unauthorized => StatusCode::UNAUTHORIZED,
            RateLimited => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Where errors of this type come from.
    pub fn origin(self) -> Origin {
        use ErrorKind::*;
        match self {
            StoreUnavailable => Origin::Store,
            UpstreamUnreachable | UpstreamTimeout => Origin::Upstream,
            Internal => Origin::Internal,
            KeyReused | RequestInProgress | OutcomeUnknown | StaleVersion | EntityClaimed
            | PrecheckFailed | EntityBusy | AnswerTooLarge | RateLimited => Origin::Conflict,
            _ => Origin::Downstream,
        }
    }
}

/// Which API's error body the proxy imitates for an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorFormat {
    /// SPEC.md's `{"error": {"type", "message", "key"}}`.
    #[default]
    Idemproxy,
    /// `{"error": {"type", "code", "message"}}`, statuses the Stripe SDKs map to typed errors,
    /// and `Stripe-Should-Retry`.
    Stripe,
    /// `{"status": "error", "message", "category", "subCategory", "correlationId"}`.
    Hubspot,
    /// `{"error": "<type>", "description": "<message>", "details": {...}}`.
    Zendesk,
}

impl ErrorFormat {
    /// As the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorFormat::Idemproxy => "idemproxy",
            ErrorFormat::Stripe => "stripe",
            ErrorFormat::Hubspot => "hubspot",
            ErrorFormat::Zendesk => "zendesk",
        }
    }

    pub fn parse(s: &str) -> Option<ErrorFormat> {
        Some(match s {
            "idemproxy" => ErrorFormat::Idemproxy,
            "stripe" => ErrorFormat::Stripe,
            "hubspot" => ErrorFormat::Hubspot,
            "zendesk" => ErrorFormat::Zendesk,
            _ => return None,
        })
    }
}

/// An error answered by the proxy itself (never by the upstream).
#[derive(Debug, Clone)]
pub struct ProxyError {
    pub kind: ErrorKind,
    pub message: String,
    /// The effective idempotency key, when one was known: echoed in the body and headers.
    pub key: Option<String>,
    /// Sent as `Retry-After` (seconds, rounded up) for busy / in-progress answers.
    pub retry_after: Option<Duration>,
    /// Extra JSON fields for the error object (e.g. the current version on `stale_version`).
    pub details: Option<serde_json::Value>,
    /// The body shape of the upstream's API, once the upstream is known.
    pub format: ErrorFormat,
}

/// Result type of the request path.
pub type ProxyResult<T> = Result<T, ProxyError>;

impl ProxyError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ProxyError {
            kind,
            message: message.into(),
            key: None,
            retry_after: None,
            details: None,
            format: Default::default(),
        }
    }

    /// The same error, its message extended with what the proxy did next.
    pub fn also(mut self, more: &str) -> Self {
        self.message = format!("{}; {more}", self.message);
        self
    }

    pub fn with_key(mut self, key: &str) -> Self {
        self.key = Some(key.to_owned());
        self
    }

    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// Answers in the shape of this upstream's API (see [`crate::error_format`]).
    pub fn formatted(mut self, format: ErrorFormat) -> Self {
        self.format = format;
        self
    }

    pub fn details(mut self, details: serde_json::Value) -> Self {
        self.details = Some(details);
        self
    }

    /// A store failure: the request fails closed and nothing is forwarded.
    pub fn store(err: impl std::fmt::Display) -> Self {
        ProxyError::new(
            ErrorKind::StoreUnavailable,
            format!("the idempotency store is unavailable: {err}"),
        )
        .retry_after(Duration::from_secs(1))
    }

    /// The JSON body and headers of SPEC.md.
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        let mut obj = serde_json::Map::new();
        obj.insert("type".into(), self.kind.as_str().into());
        obj.insert("message".into(), self.message.clone().into());
        if let Some(key) = &self.key {
            obj.insert("key".into(), key.clone().into());
        }
        if let Some(serde_json::Value::Object(extra)) = &self.details {
            for (k, v) in extra {
                obj.insert(k.clone(), v.clone());
            }
        }
        let body = serde_json::json!({ "error": obj });
        let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
        *resp.status_mut() = self.kind.status();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(
            "idemproxy-error",
            HeaderValue::from_static(self.kind.as_str()),
        );
        if let Some(after) = self.retry_after {
            let secs = after.as_millis().div_ceil(1000).max(1);
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
        }
        // Every answer on a protected route says its key and whether it is a replay: an
        // error made by the proxy never is.
        if let Some(key) = self.key.as_deref() {
            if let Ok(v) = HeaderValue::from_str(key) {
                h.insert("idempotency-key", v);
                h.insert("idempotent-replayed", HeaderValue::from_static("false"));
            }
        }
        resp
    }
}

impl std::fmt::Display for ProxyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for ProxyError {}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn every_kind_maps_to_the_spec_status() {
        use ErrorKind::*;
        let cases = [
            (BadPath, 400),
            (NoRoute, 404),
            (BodyInvalid, 400),
            (BodyTooLarge, 413),
            (NotSettleable, 409),
            (KeyMissing, 400),
            (KeyInvalid, 400),
            (EntityMissing, 400),
            (VersionMissing, 400),
            (KeyReused, 422),
            (RequestInProgress, 409),
            (OutcomeUnknown, 409),
            (StaleVersion, 409),
            (EntityClaimed, 409),
            (PrecheckFailed, 409),
            (EntityBusy, 503),
            (StoreUnavailable, 503),
            (UpstreamUnreachable, 502),
            (UpstreamTimeout, 504),
            (HeaderInvalid, 400),
            (EgressHostNotAllowed, 403),
            (ProxyAuthRequired, 407),
        ];
        for (kind, status) in cases {
            assert_eq!(kind.status().as_u16(), status, "{}", kind.as_str());
        }
    }

    #[tokio::test]
    async fn error_response_is_json_with_header() {
        let err = ProxyError::new(ErrorKind::EntityBusy, "busy")
            .with_key("k1")
            .retry_after(Duration::from_millis(1500));
        let resp = err.to_response();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["idemproxy-error"], "entity_busy");
        assert_eq!(resp.headers()["retry-after"], "2");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "entity_busy");
        assert_eq!(v["error"]["key"], "k1");
    }
}
