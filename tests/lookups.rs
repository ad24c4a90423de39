//! Concurrent retries of a completed key that the replay cache does not hold (another replica,
//! a restart): every one finds the stored answer and replays it, whatever the look-up's path —
//! a batched read on PostgreSQL, or the reservation itself ("the reservation is the look-up").
//! Each case counts what the upstream received.

mod common;
use bytes::Bytes;
use common::pg::PgServer;
use common::*;
use idemproxy::store::{self, Finish, Reservation, Reserved, ScopedKey, StoredResponse};
use std::time::Duration;

fn id(key: &str) -> ScopedKey {
    ScopedKey::new("api", "s1", key)
}

/// Sends `n` copies of one request at once; returns the statuses (and error types) of those
/// not answered 200.
async fn concurrently(
    n: usize,
    method: &'static str,
    url: String,
    headers: &'static [(&'static str, &'static str)],
) -> Vec<(u16, Option<String>)> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let r = request(method, &url, headers, r#"{"a":1}"#).await;
                (r.status, r.error_type().map(str::to_owned), r.replayed())
            })
        })
        .collect();
    let mut refused = Vec::new();
    for t in tasks {
        let (status, error, replayed) = t.await.expect("request task");
        if status != 200 || replayed != Some(true) {
            refused.push((status, error));
        }
    }
    refused
}

/// PostgreSQL batches look-ups: many of one key in a batch must each get the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_lookups_of_one_key_on_postgres_all_find_it() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let writer = store::open(&pg.url, Duration::from_secs(60), false, None)
        .await
        .expect("open")
        .store;
    let reservation = Reservation {
        id: id("dup"),
        fingerprint: "fp".into(),
        route: "r".into(),
        entities: vec![],
        owner: "o".into(),
        lease: Duration::from_secs(60),
        take_unknown: false,
        call_timeout: std::time::Duration::from_secs(30),
    };
    let Reserved::Owned(ticket) = writer.reserve(reservation).await.expect("reserve") else {
        panic!("a new key is ours");
    };
    let answer = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{}"),
    };
    let completed = Finish::Completed {
        response: answer.into(),
        expires_at: store::after_ms(Duration::from_secs(3600)),
        effects: Default::default(),
    };
    assert!(writer
        .finish(&ticket, completed, idemproxy::store::When::Durable)
        .await
        .expect("finish"));
    // Another store (another replica: an empty replay cache), sixteen look-ups at once.
    let reader = store::open(&pg.url, Duration::from_secs(60), false, None)
        .await
        .expect("open")
        .store;
    let lookups: Vec<_> = (0..16)
        .map(|_| {
            let reader = reader.clone();
            tokio::spawn(async move { reader.get(&id("dup")).await.expect("get").is_some() })
        })
        .collect();
    let mut missed = 0;
    for l in lookups {
        missed += usize::from(!l.await.expect("lookup"));
    }
    assert_eq!(missed, 0, "{missed} of 16 look-ups found no record");
}

/// A versioned write, then retries on another replica at once: each replays (none is
/// refused as stale by the write's own version).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_on_another_replica_all_replay() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let toml = format!(
        "{}\n{}",
        api_config(&upstream, "", "", CONTACTS_ROUTE),
        pg.store_toml()
    );
    let cfg = dir.write_config(&toml);
    let a = ProxyProcess::spawn(&cfg).await;
    let b = ProxyProcess::spawn(&cfg).await;
    const HEADERS: &[(&str, &str)] = &[
        ("x-request-id", "req-1"),
        ("x-entity-version", "7"),
        ("content-type", "application/json"),
    ];
    let url = |p: &ProxyProcess| p.url("/api/contacts/42");
    request("PATCH", &url(&a), HEADERS, r#"{"a":1}"#)
        .await
        .assert_status(200);
    let refused = concurrently(8, "PATCH", url(&b), HEADERS).await;
    assert!(refused.is_empty(), "retries not replayed: {refused:?}");
    assert_eq!(upstream.count(), 1);
}

/// After a restart (an empty replay cache), concurrent retries on a route that rejects
/// requests whose key is in flight: the stored answer is found before the key's slot is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_after_a_restart_on_a_reject_route_all_replay() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let route = format!("{CHARGES_ROUTE}in_flight = \"reject\"\n");
    let cfg = dir.write_config(&api_config(&upstream, "", "", &route));
    let mut first = ProxyProcess::spawn(&cfg).await;
    const HEADERS: &[(&str, &str)] = &[
        ("idempotency-key", "k-1"),
        ("content-type", "application/json"),
    ];
    request("POST", &first.url("/api/v1/charges"), HEADERS, r#"{"a":1}"#)
        .await
        .assert_status(200);
    // The admin API reads after the completion commits.
    let shown = get(&first.admin_url("/admin/keys/k-1")).await;
    assert_eq!(shown.json()["records"][0]["state"], "completed");
    first.kill().await;
    let restarted = ProxyProcess::spawn(&cfg).await;
    let refused = concurrently(8, "POST", restarted.url("/api/v1/charges"), HEADERS).await;
    assert!(refused.is_empty(), "replays refused: {refused:?}");
    assert_eq!(upstream.count(), 1);
}

/// The same path with hostile callers: after a restart (an empty replay cache, so each
/// request's reservation is its look-up), another caller's credentials with the same key get a
/// write of their own, never the stored answer; the same caller with another body is refused
/// and nothing is sent; the first caller's retry replays its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_a_reservation_found_never_serves_another_caller_or_body() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let cfg = dir.write_config(&api_config(&upstream, "", "", CHARGES_ROUTE));
    let send = |url: String, who: &'static str, body: &'static str| async move {
        let headers = [
            ("idempotency-key", "shared-1"),
            ("authorization", who),
            ("content-type", "application/json"),
        ];
        request("POST", &url, &headers, body).await
    };
    let mut first = ProxyProcess::spawn(&cfg).await;
    let a = send(first.url("/api/v1/charges"), "Bearer A", r#"{"a":1}"#).await;
    a.assert_status(200);
    let shown = get(&first.admin_url("/admin/keys/shared-1")).await;
    assert_eq!(shown.json()["records"][0]["state"], "completed");
    first.kill().await;

    let restarted = ProxyProcess::spawn(&cfg).await;
    let url = restarted.url("/api/v1/charges");
    let other = send(url.clone(), "Bearer B", r#"{"a":1}"#).await;
    other.assert_status(200);
    assert_eq!(other.replayed(), Some(false), "B's write is its own");
    assert_ne!(other.body, a.body, "B never gets A's answer");
    assert_eq!(upstream.count(), 2);

    let reused = send(url.clone(), "Bearer A", r#"{"a":2}"#).await;
    assert_eq!(reused.status, 422);
    assert_eq!(reused.error_type(), Some("key_reused"));
    assert_eq!(upstream.count(), 2, "a reused key is never sent");

    let retry = send(url, "Bearer A", r#"{"a":1}"#).await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(retry.body, a.body);
    assert_eq!(upstream.count(), 2);
}
