//! Pacing at the API's rate limit (`upstreams.X.pace`): callers sharing one credential take
//! turns instead of meeting `429`s. Each test starts the real proxy in front of a fake API that
//! enforces a HubSpot-like limit (a fixed window, `429` past it) and counts what it accepted
//! and refused: no `429` reaches a caller while the budget holds, every write lands once, a
//! wait past `max_wait` is refused with nothing sent, the API's own headers tighten the budget
//! at once, a `429` that got through pauses the account and the write goes once more, and one
//! caller's burst does not make another's request wait for all of it.

mod common;

use common::*;
use serde_json::json;
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which rate-limit headers the fake sends on every answer.
#[derive(Clone, Copy, PartialEq)]
enum Headers {
    /// None (a `429` still carries `Retry-After`).
    Quiet,
    /// `X-HubSpot-RateLimit-Max`, `-Remaining`, `-Interval-Milliseconds`.
    HubSpot,
    /// Zendesk's `X-Rate-Limit` (a minute's) and `X-Rate-Limit-Remaining`.
    Zendesk,
}

/// A fake API allowing `limit` requests per `window` (fixed windows from its first request),
/// answering `429` with `Retry-After` past it, and the rate-limit headers of `style` on every
/// answer. Counts accepted and refused requests.
struct Limited {
    api: RecordingUpstream,
    refused: Arc<AtomicUsize>,
    accepted: Arc<Mutex<Vec<String>>>,
}

fn window_headers(
    reply: Reply,
    limit: usize,
    left: usize,
    window: Duration,
    style: Headers,
) -> Reply {
    match style {
        Headers::Quiet => reply,
        Headers::HubSpot => reply
            .header("x-hubspot-ratelimit-max", &limit.to_string())
            .header("x-hubspot-ratelimit-remaining", &left.to_string())
            .header(
                "x-hubspot-ratelimit-interval-milliseconds",
                &window.as_millis().to_string(),
            ),
        Headers::Zendesk => {
            let per_minute = limit as u128 * 60_000 / window.as_millis();
            reply
                .header("x-rate-limit", &per_minute.to_string())
                .header("x-rate-limit-remaining", &left.to_string())
        }
    }
}

async fn limited(limit: usize, window: Duration, style: Headers) -> Limited {
    let refused = Arc::new(AtomicUsize::new(0));
    let accepted: Arc<Mutex<Vec<String>>> = Arc::default();
    let (r, a) = (refused.clone(), accepted.clone());
    let counts: Arc<Mutex<(Option<Instant>, u64, usize)>> = Arc::default();
    let api = RecordingUpstream::builder()
        .handler(move |rec, _| {
            let mut c = counts.lock().unwrap();
            let start = *c.0.get_or_insert_with(Instant::now);
            let index = (start.elapsed().as_millis() / window.as_millis()) as u64;
            if index != c.1 {
                *c = (Some(start), index, 0);
            }
            if c.2 >= limit {
                r.fetch_add(1, Ordering::SeqCst);
                let reply =
                    Reply::json(429, &json!({"status": "error", "category": "RATE_LIMITS"}))
                        .header("retry-after", "1");
                return window_headers(reply, limit, 0, window, style);
            }
            c.2 += 1;
            a.lock().unwrap().push(rec.body_text());
            let reply = Reply::json(200, &json!({"ok": true, "n": c.2}));
            window_headers(reply, limit, limit - c.2, window, style)
        })
        .start()
        .await;
    Limited {
        api,
        refused,
        accepted,
    }
}

/// A config with `pace` on the upstream `api`, whose writes to `/v1/things` are keyed by their
/// body; `store` lines go in a `[store]` table.
fn config(api: &RecordingUpstream, pace: &str, store: &str) -> String {
    format!(
        "{}[store]\n{store}\n[upstreams.api]\nurl = \"{}\"\nprefix = \"/api\"\ncredential_headers = [\"Authorization\"]\n\
         release_statuses = [429]\npace = {pace}\n\n\
         [[routes]]\nname = \"things\"\nupstream = \"api\"\nmethods = [\"POST\"]\npath = \"/v1/things\"\n\
         key = {{ header = \"\", derive = \"{{fingerprint}}\" }}\n",
        server_section(),
        api.url()
    )
}

/// The proxy on a SQLite store of its own.
async fn proxy(api: &RecordingUpstream, pace: &str) -> TestProxy {
    TestProxy::start(&config(api, pace, "")).await
}

async fn write(proxy: &TestProxy, body: &str, run: Option<&str>) -> Resp {
    let url = proxy.url("/api/v1/things");
    let mut headers: Vec<(&str, &[u8])> = vec![
        ("authorization", b"Bearer app-1"),
        ("content-type", b"application/json"),
    ];
    if let Some(run) = run {
        headers.push(("x-workflow-id", run.as_bytes()));
    }
    send(build_bytes("POST", &url, &headers, body)).await
}

/// Every caller was answered `200`, the API refused none, and it accepted each write once.
async fn each_write_once(fake: &Limited, callers: Vec<tokio::task::JoinHandle<Resp>>) {
    let n = callers.len();
    for c in callers {
        let r = c.await.expect("the caller ran");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let refused = fake.refused.load(Ordering::SeqCst);
    assert_eq!(refused, 0, "the API refused none");
    let accepted = fake.accepted.lock().unwrap().clone();
    let distinct: HashSet<&String> = accepted.iter().collect();
    assert_eq!((accepted.len(), distinct.len()), (n, n));
}

/// A read with the same credential as the writes (the same account).
async fn read(proxy: &TestProxy) -> Resp {
    let url = proxy.url("/api/v1/things/1");
    send(build_bytes(
        "GET",
        &url,
        &[("authorization", b"Bearer app-1")],
        "",
    ))
    .await
}

/// Thirty callers, two writes and a read each, against an API that takes twenty in two
/// seconds: no `429` reaches a caller, the API refuses nothing, and every write lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_callers_share_the_budget_and_every_write_lands_once() {
    let fake = limited(20, Duration::from_secs(2), Headers::HubSpot).await;
    let proxy = proxy(&fake.api, r#"{ rate = 20, per = "2s", max_wait = "60s" }"#).await;
    let proxy = Arc::new(proxy);
    let mut callers = Vec::new();
    for c in 0..30 {
        let proxy = proxy.clone();
        callers.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for w in 0..2 {
                let r = write(&proxy, &format!(r#"{{"caller":{c},"write":{w}}}"#), None).await;
                statuses.push(r.status);
            }
            statuses.push(read(&proxy).await.status);
            statuses
        }));
    }
    for c in callers {
        let statuses = c.await.expect("the caller ran");
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    }
    assert_eq!(
        fake.refused.load(Ordering::SeqCst),
        0,
        "the API refused none"
    );
    let accepted = fake.accepted.lock().unwrap().clone();
    let writes: Vec<&String> = accepted.iter().filter(|b| !b.is_empty()).collect();
    let distinct: HashSet<&String> = writes.iter().copied().collect();
    assert_eq!((writes.len(), distinct.len()), (60, 60), "each write once");
}

/// The same against a Zendesk-like API (a minute's `X-Rate-Limit`, `Retry-After` on its
/// `429`), paced at its rate: thirty callers, nothing refused, every write once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zendesk_like_api_refuses_none_of_thirty_callers() {
    let fake = limited(20, Duration::from_secs(2), Headers::Zendesk).await;
    let proxy = Arc::new(proxy(&fake.api, r#"{ rate = 20, per = "2s", max_wait = "60s" }"#).await);
    let writes: Vec<_> = (0..30)
        .map(|c| {
            let proxy = proxy.clone();
            tokio::spawn(async move { write(&proxy, &format!(r#"{{"caller":{c}}}"#), None).await })
        })
        .collect();
    each_write_once(&fake, writes).await;
}

/// A request whose turn would come after `max_wait` is refused at once: `429 rate_limited`
/// with `Retry-After`, in plain words, and nothing is sent.
#[tokio::test]
async fn a_turn_past_max_wait_is_refused_and_nothing_is_sent() {
    let fake = limited(100, Duration::from_secs(60), Headers::Quiet).await;
    let proxy = proxy(
        &fake.api,
        r#"{ rate = 1, per = "60s", burst = 1, max_wait = "2s" }"#,
    )
    .await;
    assert_eq!(write(&proxy, r#"{"n":1}"#, None).await.status, 200);
    let refused = write(&proxy, r#"{"n":2}"#, None).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.error_type(), Some("rate_limited"));
    let after: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((50..=66).contains(&after), "about a minute: {after}");
    assert!(
        refused.text().contains("nothing was sent"),
        "{}",
        refused.text()
    );
    // Reads count too, and are refused the same way.
    assert_eq!(read(&proxy).await.status, 429);
    // Another account (another credential) has its own budget.
    assert_eq!(get(&proxy.url("/api/v1/things/1")).await.status, 200);
    assert_eq!(
        fake.api.count(),
        2,
        "only the first, and the other account's read"
    );
    // A credential the client names in `Connection` never reaches the API: that read is the
    // credential-less account's, whose budget is spent.
    let hidden: [(&str, &[u8]); 2] = [
        ("authorization", b"Bearer app-2"),
        ("connection", b"authorization"),
    ];
    let url = proxy.url("/api/v1/things/1");
    let sneaked = send(build_bytes("GET", &url, &hidden, "")).await;
    assert_eq!(sneaked.status, 429, "{}", sneaked.text());
    assert_eq!(fake.api.count(), 2, "nothing more reached the API");
}

/// The API's own headers tighten the budget at once: configured for a hundred a second, the
/// API says two a minute, and the third request is refused rather than sent.
#[tokio::test]
async fn the_api_s_headers_tighten_the_budget_at_once() {
    let fake = limited(2, Duration::from_secs(60), Headers::HubSpot).await;
    let proxy = proxy(&fake.api, r#"{ rate = 100, per = "1s", max_wait = "2s" }"#).await;
    assert_eq!(write(&proxy, r#"{"n":1}"#, None).await.status, 200);
    assert_eq!(write(&proxy, r#"{"n":2}"#, None).await.status, 200);
    let third = write(&proxy, r#"{"n":3}"#, None).await;
    assert_eq!(third.error_type(), Some("rate_limited"), "{}", third.text());
    assert_eq!(fake.api.count(), 2);
    assert_eq!(fake.refused.load(Ordering::SeqCst), 0);
}

/// A `429` that got through anyway (another client spent the limit) was not processed: the
/// account pauses for its `Retry-After`, the write is sent once more under the same key, its
/// caller gets the answer, and a retry replays it.
#[tokio::test]
async fn a_429_pauses_the_account_and_the_write_goes_once_more() {
    let first = Arc::new(AtomicUsize::new(0));
    let api = RecordingUpstream::builder()
        .handler(move |_, _| match first.fetch_add(1, Ordering::SeqCst) {
            0 => Reply::json(429, &json!({"status": "error"})).header("retry-after", "1"),
            _ => Reply::json(200, &json!({"id": "thing-1"})),
        })
        .start()
        .await;
    let proxy = proxy(&api, r#"{ rate = 100, per = "1s", max_wait = "10s" }"#).await;
    let done = write(&proxy, r#"{"n":1}"#, None).await;
    assert_eq!(done.status, 200, "{}", done.text());
    assert_eq!(done.json()["id"], "thing-1");
    assert_eq!(api.count(), 2, "sent once more after the pause");
    assert_eq!(api.request(1).body_text(), api.request(2).body_text());
    let again = write(&proxy, r#"{"n":1}"#, None).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(api.count(), 2);
    let metrics = get(&proxy.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains(r#"idemproxy_upstream_rate_limited_total{upstream="api"} 1"#),
        "{metrics}"
    );
}

/// Callers take turns: with one run's twelve writes queued, another run's one write is sent
/// among the next few, not after all twelve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_run_s_burst_does_not_starve_another() {
    let fake = limited(1000, Duration::from_secs(60), Headers::Quiet).await;
    let proxy = Arc::new(
        proxy(
            &fake.api,
            r#"{ rate = 4, per = "1s", burst = 1, max_wait = "60s" }"#,
        )
        .await,
    );
    let mut burst = Vec::new();
    for n in 0..12 {
        let proxy = proxy.clone();
        burst.push(tokio::spawn(async move {
            write(&proxy, &format!(r#"{{"run":"a","n":{n}}}"#), Some("run-a")).await
        }));
    }
    let metrics = proxy.admin_url("/metrics");
    eventually(|| async {
        let text = get(&metrics).await.text();
        let queued = text
            .lines()
            .find_map(|l| l.strip_prefix(r#"idemproxy_pace_queued{upstream="api"} "#))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        match queued >= 10 {
            true => Ok(()),
            false => Err(format!("{queued} of run a's writes queued")),
        }
    })
    .await;
    let other = write(&proxy, r#"{"run":"b"}"#, Some("run-b")).await;
    assert_eq!(other.status, 200);
    let sent = fake.accepted.lock().unwrap().clone();
    let at = sent.iter().position(|b| b.contains(r#""run":"b""#));
    let behind = sent.iter().filter(|b| b.contains(r#""run":"a""#)).count();
    assert!(
        behind < 6,
        "run b waited behind {behind} of run a's writes: {sent:?}"
    );
    for w in burst {
        assert_eq!(w.await.expect("ran").status, 200);
    }
    assert!(at.is_some());
    assert_eq!(fake.api.count(), 13);
}

/// Two replicas on PostgreSQL share each account's budget: fifteen callers on each, and
/// together they stay under the API's limit (it refuses none), every write landing once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_postgres_share_the_budget() {
    let Some(pg) = common::pg::PgServer::start().await else {
        return;
    };
    let fake = limited(20, Duration::from_secs(2), Headers::HubSpot).await;
    let store = format!(
        "url = {}\nscope_secret = \"pace-replicas-share-this-secret\"\n",
        common::proxy::toml_string(&pg.url)
    );
    let pace = r#"{ rate = 20, per = "2s", max_wait = "60s" }"#;
    let text = config(&fake.api, pace, &store);
    let replicas = [
        Arc::new(TestProxy::start(&text).await),
        Arc::new(TestProxy::start(&text).await),
    ];
    let mut callers = Vec::new();
    for c in 0..30 {
        let proxy = replicas[c % 2].clone();
        callers.push(tokio::spawn(async move {
            write(
                &proxy,
                &format!(r#"{{"replica":{},"caller":{c}}}"#, c % 2),
                None,
            )
            .await
        }));
    }
    each_write_once(&fake, callers).await;
}
