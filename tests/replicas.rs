//! Several real `idemproxy serve` processes on one real PostgreSQL behave as one proxy, and
//! survive faults: a replica SIGKILLed mid-request, PostgreSQL stopped and started.

mod common;

use common::pg::PgServer;
use common::*;
use serde_json::json;
use std::time::Duration;

/// Two routes: one with an entity, one keyed only by a derived key (no entity lock at all,
/// so the reservation alone must keep replicas from forwarding twice).
fn config(upstream: &RecordingUpstream, pg_url: &str, lease: &str) -> String {
    format!(
        r#"{server}
[store]
url = "{pg_url}"
lease = "{lease}"
scope_secret = "replicas-share-this-secret"

[upstreams.api]
url = "{up}"
prefix = "/api"

[[routes]]
name = "charge"
upstream = "api"
methods = ["POST"]
path = "/charges"
entity = "customer:{{body.customer}}"

[[routes]]
name = "multi"
upstream = "api"
methods = ["POST"]
path = "/multi"
entity = "customer:{{body.customers[*]}}"

[[routes]]
name = "webhook"
upstream = "api"
methods = ["POST"]
path = "/hooks"
key = {{ header = "", derive = "{{header.x-delivery-id}}" }}
"#,
        server = server_section(),
        up = upstream.url(),
    )
}

/// Everything a replica test runs on; dropped together at the end of the test.
struct Cluster {
    pg: PgServer,
    upstream: RecordingUpstream,
    _dir: TestDir,
    ps: Vec<ProxyProcess>,
}

/// A real PostgreSQL, a recording upstream (its entity: the body's `customer`) and `n`
/// replicas with this `lease`; `None` (the test skips, loudly) without PostgreSQL.
async fn cluster(n: usize, lease: &str, upstream: UpstreamBuilder) -> Option<Cluster> {
    let pg = PgServer::start().await?;
    let upstream = upstream.entity_json("/customer").start().await;
    let dir = TestDir::new();
    let ps = replicas(n, &dir, &config(&upstream, &pg.url, lease)).await;
    Some(Cluster {
        pg,
        upstream,
        _dir: dir,
        ps,
    })
}

async fn replicas(n: usize, dir: &TestDir, toml: &str) -> Vec<ProxyProcess> {
    let path = dir.write_config(toml);
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(ProxyProcess::spawn(&path).await);
    }
    out
}

/// A gauge or counter from a replica's `/metrics`.
/// POSTs a webhook delivery (its key derived from `x-delivery-id`) for `customer`, in a task.
fn send_hook(
    url: String,
    delivery: &'static str,
    customer: &'static str,
) -> tokio::task::JoinHandle<Resp> {
    tokio::spawn(async move {
        let h = [("x-delivery-id", delivery)];
        post_json(&url, None, &json!({"customer": customer}), &h).await
    })
}

async fn metric(p: &ProxyProcess, name: &str) -> u64 {
    let text = get(&p.admin_url("/metrics")).await.text();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

/// Waits until `n` requests wait inside the replicas (on a key or an entity).
async fn wait_for_waiting(ps: &[ProxyProcess], n: u64) {
    eventually(|| async {
        let mut sum = 0;
        for p in ps {
            sum += metric(p, "idemproxy_waiting").await;
        }
        match sum >= n {
            true => Ok(()),
            false => Err(format!("{sum} of {n} requests waiting in the replicas")),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_identical_requests_over_three_replicas_forward_once() {
    let Some(Cluster {
        pg: _pg,
        upstream,
        _dir,
        ps,
    }) = cluster(3, "30s", RecordingUpstream::builder().hold()).await
    else {
        return;
    };
    for (path, headers) in [
        ("/api/charges", vec![("idempotency-key", "pay-1")]),
        ("/api/hooks", vec![("x-delivery-id", "delivery-1")]),
    ] {
        let before = upstream.count();
        let mut tasks = Vec::new();
        for i in 0..20 {
            let url = ps[i % ps.len()].url(path);
            let headers: Vec<(String, String)> = headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            tasks.push(tokio::spawn(async move {
                let h: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                post_json(&url, None, &json!({"customer": "cus_1", "amount": 100}), &h).await
            }));
        }
        upstream.wait_for_held(1).await;
        wait_for_waiting(&ps, 19).await;
        upstream.release_one();
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.unwrap());
        }
        assert_eq!(
            upstream.count(),
            before + 1,
            "{path}: one forward across replicas"
        );
        let first = &answers[0];
        for a in &answers {
            a.assert_status(200);
            assert_eq!(
                a.body, first.body,
                "{path}: every answer is the one stored answer"
            );
        }
        assert_eq!(
            answers
                .iter()
                .filter(|a| a.replayed() == Some(true))
                .count(),
            19,
            "{path}"
        );
    }
}

/// A retry that waits on another replica for a key in flight asks to be told of its outcome
/// (`Shared::watch_key`), and the outcome's NOTIFY wakes it: not the end of the 30 s lease, nor
/// the 30 s lock timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_waiting_on_another_replica_wakes_at_the_outcome() {
    let Some(c) = cluster(2, "30s", RecordingUpstream::builder().hold()).await else {
        return;
    };
    let (upstream, ps) = (&c.upstream, &c.ps);
    let send = |url: String| send_hook(url, "delivery-w", "cus_w");
    let first = send(ps[0].url("/api/hooks"));
    upstream.wait_for_held(1).await;
    let retry = send(ps[1].url("/api/hooks"));
    wait_for_waiting(&ps[1..], 1).await;
    upstream.release_one();
    first.await.unwrap().assert_status(200);
    // A liveness bound a third of the lease: only the notification wakes the retry this soon.
    let retry = tokio::time::timeout(Duration::from_secs(10), retry)
        .await
        .expect("the waiting retry was not woken by the outcome")
        .unwrap();
    retry.assert_status(200);
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(upstream.count(), 1, "forwarded once across the replicas");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_to_one_entity_never_overlap_across_replicas() {
    let Some(Cluster {
        pg: _pg,
        upstream,
        _dir,
        ps,
    }) = cluster(2, "30s", RecordingUpstream::builder().hold()).await
    else {
        return;
    };
    let mut tasks = Vec::new();
    for i in 0..10 {
        let url = ps[i % 2].url("/api/charges");
        tasks.push(tokio::spawn(async move {
            let key = format!("write-{i}");
            post_json(
                &url,
                Some(&key),
                &json!({"customer": "cus_shared", "n": i}),
                &[],
            )
            .await
        }));
    }
    upstream.wait_for_held(1).await;
    wait_for_waiting(&ps, 9).await;
    upstream.release_all();
    for t in tasks {
        t.await.unwrap().assert_status(200);
    }
    assert_eq!(upstream.count(), 10, "every different key is forwarded");
    assert_eq!(
        upstream.max_concurrent("cus_shared"),
        1,
        "never two writes to one entity at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_mid_request_is_never_forwarded_again_and_frees_the_entity() {
    let Some(Cluster {
        pg: _pg,
        upstream,
        _dir,
        mut ps,
    }) = cluster(2, "1s", RecordingUpstream::builder().hold()).await
    else {
        return;
    };
    let url_a = ps[0].url("/api/charges");
    let doomed = tokio::spawn(async move {
        try_request(
            "POST",
            &url_a,
            &[
                ("content-type", "application/json"),
                ("idempotency-key", "kill-1"),
            ],
            r#"{"customer":"cus_k"}"#,
        )
        .await
    });
    upstream.wait_for_held(1).await;
    ps[0].kill().await;
    assert!(
        doomed.await.unwrap().is_err(),
        "the killed replica never answered"
    );
    upstream.release_all();

    // The retry on the surviving replica: the key's lease runs out, its outcome is unknown.
    let b = &ps[1];
    let retry = post_json(
        &b.url("/api/charges"),
        Some("kill-1"),
        &json!({"customer": "cus_k"}),
        &[],
    )
    .await;
    retry.assert_status(409);
    assert_eq!(retry.error_type(), Some("outcome_unknown"));
    assert_eq!(upstream.count(), 1, "never forwarded a second time");

    // The entity is free again once the dead replica's lease ran out.
    let other = post_json(
        &b.url("/api/charges"),
        Some("kill-2"),
        &json!({"customer": "cus_k"}),
        &[],
    )
    .await;
    other.assert_status(200);
    assert_eq!(upstream.count(), 2);
    assert_eq!(upstream.max_concurrent("cus_k"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_stopped_fails_closed_then_recovers_without_a_restart() {
    let Some(Cluster {
        pg,
        upstream,
        _dir,
        ps,
    }) = cluster(1, "30s", RecordingUpstream::builder()).await
    else {
        return;
    };
    if !pg.owned() {
        eprintln!("skipping the stop/start test: IDEMPROXY_TEST_PG_URL is not ours to stop");
        return;
    }
    let p = &ps[0];
    post_json(
        &p.url("/api/charges"),
        Some("up-1"),
        &json!({"customer": "c"}),
        &[],
    )
    .await
    .assert_status(200);
    assert_eq!(upstream.count(), 1);
    // The entity's lease is released after the answer: stopping the database before that
    // would leave it held until it runs out (30 s), and the write after the restart waits.
    pg.until("SELECT count(*) = 0 FROM idem_entity_leases WHERE owner IS NOT NULL")
        .await;

    pg.stop();
    for i in 0..3 {
        let key = format!("down-{i}");
        let r = post_json(
            &p.url("/api/charges"),
            Some(&key),
            &json!({"customer": "c"}),
            &[],
        )
        .await;
        r.assert_status(503);
        assert_eq!(r.error_type(), Some("store_unavailable"));
    }
    assert_eq!(
        upstream.count(),
        1,
        "nothing forwarded while the store is down"
    );
    get(&p.url("/api/anything")).await.assert_status(200);
    assert_eq!(upstream.count_method("GET"), 1, "reads keep passing");
    get(&p.admin_url("/readyz")).await.assert_status(503);

    pg.restart();
    eventually_within(Duration::from_secs(30), || async {
        match get(&p.admin_url("/readyz")).await.status {
            200 => Ok(()),
            _ => Err("the proxy did not recover after PostgreSQL came back".to_owned()),
        }
    })
    .await;
    let r = post_json(
        &p.url("/api/charges"),
        Some("back-1"),
        &json!({"customer": "c"}),
        &[],
    )
    .await;
    r.assert_status(200);
    assert_eq!(upstream.count_method("POST"), 2);
    let again = post_json(
        &p.url("/api/charges"),
        Some("back-1"),
        &json!({"customer": "c"}),
        &[],
    )
    .await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(upstream.count_method("POST"), 2);
}

/// The store keeps a connection per batch in flight between batches (no round trip to hand it
/// back to the pool per statement). When the server kills those connections, a write that
/// meets one fails closed — `503`, nothing forwarded — and the dead connection is not used
/// again: within a few writes every one succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_the_database_killed_are_replaced_not_reused() {
    let Some(Cluster {
        pg,
        upstream,
        _dir,
        ps,
    }) = cluster(1, "30s", RecordingUpstream::builder()).await
    else {
        return;
    };
    let p = &ps[0];
    let hook = |id: String| {
        let url = p.url("/api/hooks");
        async move {
            let h = [("x-delivery-id", id.as_str())];
            post_json(&url, None, &json!({"customer": "c"}), &h).await
        }
    };
    hook("before".into()).await.assert_status(200);
    assert_eq!(upstream.count(), 1);

    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&pg.url)
        .await
        .expect("connect to the test database");
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut admin)
    .await
    .expect("terminate the proxy's connections");
    assert!(!killed.is_empty(), "the proxy had no connection to kill");

    let mut statuses = Vec::new();
    for i in 0..8 {
        let r = hook(format!("after-{i}")).await;
        if r.status != 200 {
            r.assert_status(503);
            assert_eq!(r.error_type(), Some("store_unavailable"));
        }
        statuses.push(r.status);
    }
    let failed = statuses.iter().filter(|&&s| s != 200).count();
    // At most one failure per connection a batcher kept (two for reservations in flight).
    assert!(
        failed <= 2,
        "dead connections were used again: {statuses:?}"
    );
    assert!(
        statuses[4..].iter().all(|&s| s == 200),
        "the store did not recover: {statuses:?}"
    );
    assert_eq!(
        upstream.count(),
        1 + statuses.iter().filter(|&&s| s == 200).count(),
        "a write whose reservation failed was forwarded"
    );
    let again = hook("after-7".into()).await;
    again.assert_status(200);
    assert_eq!(again.replayed(), Some(true));
}

/// Many writes at once, each to its own entity, on one replica: every one takes its lease (on
/// the connections kept for lease statements), none waits for a connection kept idle, and
/// each is forwarded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_entities_at_once_each_get_their_lease() {
    let Some(Cluster {
        pg: _pg,
        upstream,
        _dir,
        ps,
    }) = cluster(1, "30s", RecordingUpstream::builder()).await
    else {
        return;
    };
    let url = ps[0].url("/api/charges");
    let mut tasks = Vec::new();
    for round in 0..3 {
        for i in 0..32 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let key = format!("many-{round}-{i}");
                post_json(
                    &url,
                    Some(&key),
                    &json!({"customer": format!("cus_{i}")}),
                    &[],
                )
                .await
            }));
        }
    }
    for t in tasks {
        t.await.expect("request task").assert_status(200);
    }
    assert_eq!(upstream.count(), 96);
    for i in 0..32 {
        assert_eq!(upstream.max_concurrent(&format!("cus_{i}")), 1);
    }
}

/// A contended store: the lease table is locked by another session while ten writes to one
/// entity arrive on two replicas; every write waits in the store, then they go one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_contended_store_never_lets_writes_to_one_entity_overlap() {
    use sqlx::Connection;
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let upstream = RecordingUpstream::builder()
        .entity_json("/customer")
        .start()
        .await;
    let dir = TestDir::new();
    let ps = replicas(2, &dir, &config(&upstream, &pg.url, "30s")).await;
    let mut blocker = sqlx::PgConnection::connect(&pg.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("LOCK TABLE idem_entity_leases IN ACCESS EXCLUSIVE MODE")
        .execute(&mut blocker)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..10 {
        let url = ps[i % 2].url("/api/charges");
        tasks.push(tokio::spawn(async move {
            post_json(
                &url,
                Some(&format!("slow-{i}")),
                &json!({"customer": "cus_slow"}),
                &[],
            )
            .await
        }));
    }
    // Each replica lets one request per entity at the store; the rest queue in the process.
    wait_for_waiting(&ps, 10).await;
    assert_eq!(
        upstream.count(),
        0,
        "nothing passes while the store is stuck"
    );
    sqlx::query("COMMIT").execute(&mut blocker).await.unwrap();
    for t in tasks {
        t.await.unwrap().assert_status(200);
    }
    assert_eq!(upstream.count(), 10);
    assert_eq!(
        upstream.max_concurrent("cus_slow"),
        1,
        "a slow store never lets two writes overlap"
    );
}

/// Replays come from each replica's memory, yet a release on one replica reaches the others'
/// caches at once (NOTIFY), so the next retry anywhere is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_on_one_replica_reaches_every_replay_cache() {
    let Some(Cluster {
        pg: _pg,
        upstream,
        _dir,
        ps,
    }) = cluster(2, "30s", RecordingUpstream::builder()).await
    else {
        return;
    };
    let body = json!({"customer": "cus_r"});
    post_json(&ps[0].url("/api/charges"), Some("rel-1"), &body, &[])
        .await
        .assert_status(200);
    for p in &ps {
        // Twice each: the second is served from the replica's cache.
        for _ in 0..2 {
            let r = post_json(&p.url("/api/charges"), Some("rel-1"), &body, &[]).await;
            assert_eq!(r.replayed(), Some(true));
        }
    }
    assert_eq!(upstream.count(), 1);
    let released = request(
        "POST",
        &ps[0].admin_url("/admin/keys/rel-1/release"),
        &[("content-type", "application/json")],
        r#"{"force": true, "note": "drop the stored answer"}"#,
    )
    .await;
    released.assert_status(200);
    assert_eq!(released.json()["released"], 1);
    // The other replica learns of it by NOTIFY; wait for that, then its retry is forwarded.
    // The bound stays under the cache's own refresh (idemproxy::store::replay::FRESH_FOR_MS), so only
    // the notification can make this pass.
    let bound = Duration::from_millis(idemproxy::store::replay::FRESH_FOR_MS as u64 - 1_000);
    eventually_within(bound, || async {
        let r = post_json(&ps[1].url("/api/charges"), Some("rel-1"), &body, &[]).await;
        match r.replayed() {
            Some(false) => Ok(()),
            _ => Err("replica 1 kept replaying a released key".to_owned()),
        }
    })
    .await;
    assert_eq!(
        upstream.count(),
        2,
        "forwarded again once, on the other replica"
    );
}

/// A call that outlives its lease keeps the entity: the holder renews the lease while the
/// upstream works, so another replica's write to the entity waits instead of overlapping.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_are_renewed_while_a_long_call_runs() {
    let Some(Cluster {
        pg: _pg,
        upstream,
        _dir,
        ps,
    }) = cluster(2, "600ms", RecordingUpstream::builder().hold()).await
    else {
        return;
    };
    let (a, b) = (ps[0].url("/api/charges"), ps[1].url("/api/charges"));
    let first = tokio::spawn(async move {
        post_json(&a, Some("long-1"), &json!({"customer": "cus_long"}), &[]).await
    });
    upstream.wait_for_held(1).await;
    let second = tokio::spawn(async move {
        post_json(&b, Some("long-2"), &json!({"customer": "cus_long"}), &[]).await
    });
    wait_for_waiting(&ps, 1).await;
    // Let wall-clock time run well past the lease: only renewal keeps replica 1 waiting.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(
        upstream.count(),
        1,
        "the second write did not take an entity whose holder is alive"
    );
    upstream.release_all();
    first.await.unwrap().assert_status(200);
    second.await.unwrap().assert_status(200);
    assert_eq!(upstream.count(), 2);
    assert_eq!(upstream.max_concurrent("cus_long"), 1);
}

/// A call that outlives its key's lease keeps the key: the replica that holds it renews the
/// lease while the upstream works (`Keys::renew`), so a retry on another replica, well past
/// the lease, waits for the outcome instead of finding it abandoned (a key with no entity
/// lock: the lease alone stands between the replicas).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_lease_is_renewed_while_its_call_runs() {
    let Some(c) = cluster(2, "600ms", RecordingUpstream::builder().hold()).await else {
        return;
    };
    let (upstream, ps, pg) = (&c.upstream, &c.ps, &c.pg);
    let send = |url: String| send_hook(url, "delivery-renewed", "cus_r");
    let first = send(ps[0].url("/api/hooks"));
    upstream.wait_for_held(1).await;
    // Until the lease has been renewed at least 1.2 s after the key was reserved: twice its
    // first deadline. Only renewal keeps the key in flight that long; without it this never
    // holds, and fails.
    pg.until(
        "SELECT EXISTS (SELECT 1 FROM idem_keys WHERE state = 'in_flight' \
         AND lease_until - created_at > 1800)",
    )
    .await;
    let retry = send(ps[1].url("/api/hooks"));
    // Without renewal the retry finds the lease run out and answers `409 outcome_unknown`
    // at once: it never waits, and this times out.
    wait_for_waiting(&ps[1..], 1).await;
    assert_eq!(upstream.count(), 1);
    upstream.release_one();
    first.await.unwrap().assert_status(200);
    let retry = retry.await.unwrap();
    retry.assert_status(200);
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(upstream.count(), 1, "forwarded once across the replicas");
}

/// A write to several entities holds the first while it waits for the next: those leases are
/// renewed during the wait, so no other replica takes them meanwhile (and the write is never
/// sent on a lease it lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_held_while_waiting_for_more_entities_are_renewed() {
    let customers = |r: &Recorded| -> Vec<String> {
        let v = r.json();
        match v.get("customers").and_then(|c| c.as_array()) {
            Some(list) => list
                .iter()
                .filter_map(|c| c.as_str().map(str::to_owned))
                .collect(),
            None => v
                .get("customer")
                .and_then(|c| c.as_str())
                .map(str::to_owned)
                .into_iter()
                .collect(),
        }
    };
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let upstream = RecordingUpstream::builder()
        .hold()
        .entities(customers)
        .start()
        .await;
    let dir = TestDir::new();
    let ps = replicas(2, &dir, &config(&upstream, &pg.url, "600ms")).await;
    let post = |p: &ProxyProcess, path: &str, key: &str, body: serde_json::Value| {
        let (url, key) = (p.url(path), key.to_owned());
        tokio::spawn(async move { post_json(&url, Some(&key), &body, &[]).await })
    };
    let a1 = post(&ps[0], "/api/charges", "a1", json!({"customer": "2"}));
    upstream.wait_for_held(1).await;
    let b = post(&ps[1], "/api/multi", "b", json!({"customers": ["1", "2"]}));
    wait_for_waiting(&ps, 1).await;
    // Well past the lease: only renewal keeps customer 1 with the waiting multi-write.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let a2 = post(&ps[0], "/api/charges", "a2", json!({"customer": "1"}));
    wait_for_waiting(&ps, 2).await;
    assert_eq!(
        upstream.count(),
        1,
        "customer 1 stayed with the multi-write while it waited"
    );
    upstream.release_all();
    for t in [a1, b, a2] {
        t.await.unwrap().assert_status(200);
    }
    assert_eq!(upstream.count(), 3);
    assert_eq!(upstream.max_concurrent("1"), 1);
    assert_eq!(upstream.max_concurrent("2"), 1);
}
