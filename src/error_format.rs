//! The proxy's errors in the shape of the API behind it (`upstreams.X.error_format`), so each
//! official SDK raises its own typed error carrying the proxy's reason — and, for Stripe, knows
//! whether a retry can help (`Stripe-Should-Retry`). The proxy's own type is always kept: in the
//! body (`code`, `subCategory` or `error`) and in the `Idemproxy-Error` header.

use crate::error::{ErrorFormat, ErrorKind, Origin, ProxyError};
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde_json::{json, Value};

impl ProxyError {
    /// The error as the API behind `format` would shape it; the proxy's headers
    /// (`Idemproxy-Error`, `Idempotency-Key`, `Retry-After`) stay.
    pub fn to_response_as(&self, format: ErrorFormat) -> Response<Full<Bytes>> {
        let mut resp = self.to_response();
        let (status, body, retry) = match format {
            ErrorFormat::Idemproxy => return resp,
            ErrorFormat::Stripe => stripe(self),
            ErrorFormat::Hubspot => (self.kind.status(), hubspot(self), None),
            ErrorFormat::Zendesk => (self.kind.status(), zendesk(self), None),
        };
        *resp.status_mut() = status;
        *resp.body_mut() = Full::new(Bytes::from(body.to_string()));
        if let Some(retry) = retry {
            resp.headers_mut().insert(
                "stripe-should-retry",
                HeaderValue::from_static(if retry { "true" } else { "false" }),
            );
        }
        resp
    }
}

/// The message with the proxy's type in front, so even an SDK that keeps only the message
/// (stripe-python's `IdempotencyError` drops `code`) shows why; then, in plain words, what
/// happened and what to do. MCP servers and agent toolkits hand this text to a model as the
/// tool's error: it must say whether sending the call again is safe.
fn said(e: &ProxyError) -> String {
    format!(
        "idemproxy {}: {} ({})",
        e.kind.as_str(),
        advice(e.kind),
        e.message
    )
}

/// What a caller (often a model, through a tool wrapper) should do on each error, in two
/// short sentences: what happened, and whether and how to retry.
pub fn advice(kind: ErrorKind) -> &'static str {
    use ErrorKind::*;
    match kind {
        OutcomeUnknown => "The write may or may not have happened. Sending the same request again, unchanged, is safe: it is never applied twice, and returns the result once it is known; while it stays unknown, a person must check the record and settle it.",
        UpstreamTimeout => "The API did not answer in time; a write may have happened. Sending the same request again, unchanged, is safe: it is never applied twice and returns the result once known.",
        UpstreamUnreachable => "The API could not be reached; nothing was applied. Sending the same request again later is safe.",
        RequestInProgress => "The same request is still running. Wait a few seconds and send it again, unchanged, to get its result.",
        EntityBusy => "Another write to the same record is still running; nothing was applied. Send the request again in a few seconds.",
        StoreUnavailable => "The proxy cannot record writes right now; nothing was applied. Send the request again in a few seconds.",
        KeyReused => "This idempotency key was already used for a different request; nothing was applied. Use a new key for a new action.",
        AnswerTooLarge => "The write was applied once, but its answer was too large to keep. Do not send it again; read the record instead.",
        StaleVersion => "The record changed since this write was prepared; nothing was applied. Read the record again before deciding what to write.",
        EntityClaimed => "Another run owns this record; nothing was applied. Do not retry; tell a person if this is unexpected.",
        PrecheckFailed => "The record is not in the state this write expects; nothing was applied. Read it again before deciding what to do.",
        KeyMissing | EntityMissing | VersionMissing => "The proxy cannot tell this request from others; nothing was applied. Include the missing field, or ask the operator to configure the route.",
        BodyInvalid | BadPath | BadMethod | HeaderInvalid | KeyInvalid => "The request was malformed; nothing was applied. Fix it before sending it again.",
        BodyTooLarge => "The request body is larger than this proxy accepts (server.max_body); nothing was applied. Send a smaller body, or ask the operator to raise the limit.",
        BodyTimeout => "The request body did not arrive in time; nothing was applied. Sending it again is safe.",
        NoRoute | NotFound => "Nothing was found at this address; nothing was applied.",
        Forbidden | Unauthorized | ProxyAuthRequired => "The request was refused; nothing was applied.",
        EgressHostNotAllowed => "The proxy does not forward to this host; nothing was sent. Ask the operator to add it to an upstream's hosts or to egress.tunnel.",
        NotSettleable => "Nothing was changed: the key is not waiting to be settled, or several records carry it. Read its records and pick one.",
        Internal => "The proxy failed; a write may have happened. Sending the same request again, unchanged, is safe.",
        RateLimited => "The API's rate limit for this account is taken by the requests ahead of this one; nothing was sent. Wait the seconds in Retry-After, then send the same request again.",
    }
}

/// The proxy's fields beside the message: the key and any details.
fn extras(e: &ProxyError) -> serde_json::Map<String, Value> {
    let mut obj = serde_json::Map::new();
    if let Some(key) = &e.key {
        obj.insert("idempotency_key".into(), key.clone().into());
    }
    if let Some(Value::Object(d)) = &e.details {
        obj.extend(d.clone());
    }
    obj
}

/// Stripe: the SDKs pick the exception by status and `type` (`400` + `idempotency_error` is
/// `IdempotencyError`, `400`/`404` otherwise `InvalidRequestError`, the rest `APIError`), and
/// retry `409` and `5xx` unless `Stripe-Should-Retry: false`.
fn stripe(e: &ProxyError) -> (StatusCode, Value, Option<bool>) {
    use ErrorKind::*;
    let (status, kind, retry) = match e.kind {
        KeyReused | OutcomeUnknown | AnswerTooLarge => (400, "idempotency_error", false),
        // Retrying after the first request finished gets its answer.
        RequestInProgress => (409, "idempotency_error", true),
        StaleVersion | EntityClaimed | PrecheckFailed => (400, "invalid_request_error", false),
        NoRoute | NotFound => (404, "invalid_request_error", false),
        EntityBusy | StoreUnavailable | UpstreamUnreachable => {
            (e.kind.status().as_u16(), "api_error", true)
        }
        // As Stripe answers its own rate limit: `429`, which the SDKs retry after a pause.
        RateLimited => (429, "invalid_request_error", true),
        // Stripe dedupes by the key the proxy sends: a retry is safe and gets the outcome.
        UpstreamTimeout => (504, "api_error", true),
        _ if e.kind.origin() == Origin::Downstream => (400, "invalid_request_error", false),
        _ => (e.kind.status().as_u16(), "api_error", false),
    };
    let mut obj = extras(e);
    obj.insert("type".into(), kind.into());
    obj.insert("code".into(), e.kind.as_str().into());
    obj.insert("message".into(), said(e).into());
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
    (status, json!({ "error": obj }), Some(retry))
}

/// HubSpot: the client's `ApiException` carries the status and this body.
fn hubspot(e: &ProxyError) -> Value {
    let category = match e.kind.status().as_u16() {
        404 => "OBJECT_NOT_FOUND",
        409 | 422 => "CONFLICT",
        429 => "RATE_LIMITS",
        s if s >= 500 => "INTERNAL_ERROR",
        _ => "VALIDATION_ERROR",
    };
    let mut id = [0u8; 16];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id);
    let h = hex::encode(id);
    json!({
        "status": "error",
        "message": said(e),
        "category": category,
        "subCategory": format!("idemproxy.{}", e.kind.as_str()),
        "correlationId": format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..]),
        "context": extras(e),
    })
}

/// Zendesk: `{"error": ..., "description": ...}`, as its record errors.
fn zendesk(e: &ProxyError) -> Value {
    json!({
        "error": e.kind.as_str(),
        "description": said(e),
        "details": extras(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn body(resp: Response<Full<Bytes>>) -> Value {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn stripe_errors_are_typed_and_say_whether_to_retry() {
        let e = ProxyError::new(ErrorKind::KeyReused, "reused").with_key("k");
        let resp = e.to_response_as(ErrorFormat::Stripe);
        assert_eq!(resp.status(), 400);
        assert_eq!(resp.headers()["stripe-should-retry"], "false");
        assert_eq!(resp.headers()["idemproxy-error"], "key_reused");
        let v = body(resp).await;
        assert_eq!(v["error"]["type"], "idempotency_error");
        assert_eq!(v["error"]["code"], "key_reused");
        let busy =
            ProxyError::new(ErrorKind::EntityBusy, "busy").to_response_as(ErrorFormat::Stripe);
        assert_eq!(busy.status(), 503);
        assert_eq!(busy.headers()["stripe-should-retry"], "true");
    }

    #[tokio::test]
    async fn hubspot_and_zendesk_keep_the_proxy_type() {
        let e = ProxyError::new(ErrorKind::OutcomeUnknown, "unknown");
        let h = e.to_response_as(ErrorFormat::Hubspot);
        assert_eq!(h.status(), 409);
        let v = body(h).await;
        assert_eq!(v["category"], "CONFLICT");
        assert_eq!(v["subCategory"], "idemproxy.outcome_unknown");
        assert_eq!(v["correlationId"].as_str().map(str::len), Some(36));
        let z = body(e.to_response_as(ErrorFormat::Zendesk)).await;
        assert_eq!(z["error"], "outcome_unknown");
    }
}
