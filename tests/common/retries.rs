//! Callers that send first writes until the proxy dies, and the retry of every request after
//! a restart with what it must get: shared by the crash tests (`tests/crash.rs`, killed at a
//! random moment under load) and the fault-point tests (`tests/fault_points.rs`, killed at a
//! named moment).

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// Answers counted so far, who to tell, and at which count.
pub type Until = (Arc<AtomicUsize>, Arc<Notify>, usize);

pub fn body(key: &str) -> String {
    format!(r#"{{"customer":"cus_1","amount":100,"ref":"{key}"}}"#)
}

pub fn headers(key: &str) -> [(&str, &str); 2] {
    [
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ]
}

/// One caller's requests: (key, the answer if one came before the kill).
pub type Sent = Vec<(String, Option<Resp>)>;

/// Sends first writes until the proxy dies; counts answers in `answered`, and notifies
/// `enough` at the `notify_at`-th.
pub async fn caller(url: String, prefix: String, until: Until) -> Sent {
    let (answered, enough, notify_at) = until;
    let mut sent = Vec::new();
    for i in 0.. {
        let key = format!("{prefix}-{i}");
        match try_request("POST", &url, &headers(&key), body(&key)).await {
            Ok(resp) => {
                resp.assert_status(200);
                sent.push((key, Some(resp)));
                if answered.fetch_add(1, Ordering::SeqCst) + 1 == notify_at {
                    enough.notify_one();
                }
            }
            Err(_) => {
                sent.push((key, None));
                return sent;
            }
        }
    }
    sent
}

/// What the retries of every request sent came to.
#[derive(Default)]
pub struct Retried {
    pub replayed: usize,
    pub unknown: usize,
    /// Never reserved before the crash: forwarded by the retry, once.
    pub fresh: usize,
    /// Answered before the crash, and `unknown` on retry.
    pub answered_lost: usize,
}

/// One request retried: its key, the answer its caller got before the crash, the retry's
/// answer, and how many times the upstream received it in all.
pub type Retry<'a> = (&'a str, &'a Option<Resp>, Resp, usize);

/// Retries every request of `sent` through `proxy`, one after another, asserting nothing.
pub async fn retry_all<'a>(
    proxy: &ProxyProcess,
    upstream: &RecordingUpstream,
    sent: &'a Sent,
) -> Vec<Retry<'a>> {
    let url = proxy.url("/api/v1/charges");
    let mut out = Vec::with_capacity(sent.len());
    for (key, first) in sent {
        let retry = request("POST", &url, &headers(key), body(key)).await;
        let posts = upstream
            .requests()
            .iter()
            .filter(|r| r.body == body(key).as_bytes())
            .count();
        out.push((key.as_str(), first, retry, posts));
    }
    out
}

/// Retries every request of `sent` through `proxy`, one after another. A key reaches the
/// upstream at most once; an answered key replays its very answer or reads `409
/// outcome_unknown`; one never answered replays, reads unknown, or is forwarded for the first
/// time.
pub async fn retry_every(
    proxy: &ProxyProcess,
    upstream: &RecordingUpstream,
    sent: &Sent,
) -> Retried {
    let mut r = Retried::default();
    for (key, first, retry, posts) in retry_all(proxy, upstream, sent).await {
        assert!(posts <= 1, "{key} reached the upstream {posts} times");
        match (retry.status, first) {
            (200, Some(first)) => {
                assert_eq!(
                    retry.replayed(),
                    Some(true),
                    "{key}: answered, then forwarded"
                );
                assert_eq!(retry.body, first.body, "{key}: another answer replayed");
                r.replayed += 1;
            }
            (200, None) if retry.replayed() == Some(true) => r.replayed += 1,
            (200, None) => {
                assert_eq!(posts, 1, "{key}");
                r.fresh += 1;
            }
            // Reserved before the kill, sent or not: the proxy cannot tell, and never guesses.
            (409, first) => {
                assert_eq!(retry.error_type(), Some("outcome_unknown"), "{key}");
                r.unknown += 1;
                // Answered, and its completion lost with the process.
                r.answered_lost += usize::from(first.is_some());
            }
            (status, _) => panic!("{key}: retry answered {status}: {}", retry.text()),
        }
    }
    r
}
