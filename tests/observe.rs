//! Observe mode and reload without a restart (SPEC "Adoption and operations"): observed
//! requests are all forwarded — concurrent duplicates, retries of completed keys, concurrent
//! writes to one entity, stale versions — and counted by what enforce mode would have done;
//! the records they keep let a route switched to enforce (by a reload) replay from true
//! history. Reloads take effect for requests that start afterwards, drop nothing, and an
//! invalid file changes nothing.

mod common;
use common::pg::PgServer;
use common::*;

use serde_json::json;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// `route` (one `[[routes]]` entry) in observe mode.
fn observing(route: &str) -> String {
    format!("{route}mode = \"observe\"\n")
}

/// The charges route of `text` with one more `line`.
fn charges_with(text: &str, line: &str) -> String {
    let path = "path = \"/v1/charges\"";
    text.replace(path, &format!("{path}\n{line}"))
}

fn config(upstream: &RecordingUpstream, store: &str, routes: &str) -> String {
    format!("{}\n{store}", api_config(upstream, "", "", routes))
}

/// `idemproxy_observed_total{route, would}` as scraped.
async fn observed(admin: &str, route: &str, would: &str) -> u64 {
    let series = format!("idemproxy_observed_total{{route=\"{route}\",would=\"{would}\"}}");
    metric(admin, &series).await
}

async fn reloads(admin: &str, result: &str) -> u64 {
    metric(
        admin,
        &format!("idemproxy_config_reloads_total{{result=\"{result}\"}}"),
    )
    .await
}

fn spawn_post(url: &str, key: &str, body: serde_json::Value) -> tokio::task::JoinHandle<Resp> {
    let (url, key) = (url.to_owned(), key.to_owned());
    tokio::spawn(async move { post_json(&url, Some(&key), &body, &[]).await })
}

fn charge() -> serde_json::Value {
    json!({"amount": 100, "currency": "usd", "customer": "cus_1"})
}

async fn patch(url: &str, request_id: &str, version: &str) -> Resp {
    request(
        "PATCH",
        url,
        &[
            ("content-type", "application/json"),
            ("x-request-id", request_id),
            ("x-entity-version", version),
        ],
        r#"{"email":"a@example.com"}"#,
    )
    .await
}

/// The scenario on any store: concurrent duplicates all reach the upstream at once, a retry
/// of the completed key is forwarded again, concurrent writes to one entity overlap at the
/// upstream and a stale version is forwarded — each counted by what enforce mode would have
/// done. Then a reload switches the routes to enforce, and a retry replays the answer observe
/// mode stored.
async fn observe_scenario(store: &str) {
    let upstream = RecordingUpstream::holding().await;
    let routes = format!(
        "{}\n{}",
        observing(CHARGES_ROUTE),
        observing(CONTACTS_ROUTE)
    );
    let proxy = TestProxy::start_file(&config(&upstream, store, &routes)).await;
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    let url = proxy.url("/api/v1/charges");

    // Three concurrent duplicates: enforce mode would hold two behind the first.
    let dups: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post_json(&url, Some("k-dup"), &charge(), &[]).await })
        })
        .collect();
    upstream.wait_for_held(3).await;
    assert_eq!(upstream.count(), 3, "every duplicate reaches the upstream");
    upstream.release(3);
    let mut flagged = 0;
    for d in dups {
        let r = d.await.unwrap();
        r.assert_status(200);
        assert_eq!(r.replayed(), None, "the answer goes back unchanged");
        if r.header("idemproxy-observed") == Some("in_flight") {
            flagged += 1;
        }
    }
    assert_eq!(
        flagged, 2,
        "the two duplicates sent while the first was in flight"
    );
    assert_eq!(observed(&admin, "charges", "in_flight").await, 2);

    // A retry of the completed key: forwarded again, flagged as a replay enforce mode would make.
    let retry = spawn_post(&url, "k-dup", charge());
    upstream.wait_for_held(1).await;
    upstream.release(1);
    let retry = retry.await.unwrap();
    retry.assert_status(200);
    assert_eq!(retry.header("idemproxy-observed"), Some("replay"));
    assert_eq!(upstream.count(), 4);
    assert_eq!(observed(&admin, "charges", "replay").await, 1);
    // The same key with another body: key reuse.
    let other = spawn_post(&url, "k-dup", json!({"amount": 999}));
    upstream.wait_for_held(1).await;
    upstream.release(1);
    let other = other.await.unwrap();
    assert_eq!(other.header("idemproxy-observed"), Some("key_reused"));
    assert_eq!(upstream.count(), 5);

    // Two writes to one contact at once: enforce mode's entity lock would have queued one.
    let c1 = proxy.url("/api/contacts/c1");
    let writes: Vec<_> = ["r-1", "r-2"]
        .into_iter()
        .zip(["1", "2"])
        .map(|(id, v)| {
            let c1 = c1.clone();
            tokio::spawn(async move { patch(&c1, id, v).await })
        })
        .collect();
    upstream.wait_for_held(2).await;
    assert_eq!(upstream.max_concurrent("/contacts/c1"), 2);
    upstream.release(2);
    let flags: Vec<Option<String>> = {
        let mut v = Vec::new();
        for w in writes {
            let r = w.await.unwrap();
            r.assert_status(200);
            v.push(r.header("idemproxy-observed").map(str::to_owned));
        }
        v
    };
    assert_eq!(
        flags
            .iter()
            .flatten()
            .filter(|f| *f == "entity_overlap")
            .count(),
        1,
        "{flags:?}"
    );
    assert_eq!(
        observed(&admin, "contact-update", "entity_overlap").await,
        1
    );
    // Version 2 is stored (it completed); version 1 now is stale, and still forwarded.
    let stale = tokio::spawn({
        let c1 = c1.clone();
        async move { patch(&c1, "r-3", "1").await }
    });
    upstream.wait_for_held(1).await;
    upstream.release(1);
    let stale = stale.await.unwrap();
    stale.assert_status(200);
    assert_eq!(stale.header("idemproxy-observed"), Some("stale_version"));
    assert_eq!(upstream.count(), 8);

    // Enforce from the history observe mode kept: the retry replays, nothing is forwarded.
    let enforce = config(&upstream, store, &routes.replace("mode = \"observe\"", ""));
    proxy.reload(&enforce).await.assert_status(200);
    let replay = post_json(&url, Some("k-dup"), &charge(), &[]).await;
    replay.assert_status(200);
    assert_eq!(replay.replayed(), Some(true));
    assert_eq!(
        patch(&c1, "r-4", "1").await.error_type(),
        Some("stale_version")
    );
    assert_eq!(upstream.count(), 8, "enforce mode forwards neither");
}

#[tokio::test]
async fn observe_mode_forwards_everything_and_counts_what_enforce_would_do_on_sqlite() {
    observe_scenario("").await;
}

#[tokio::test]
async fn observe_mode_forwards_everything_and_counts_what_enforce_would_do_on_postgres() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let store = pg.store_toml();
    observe_scenario(&store).await;
}

/// A store that is down does not stop observed traffic: forwarded, and the failure counted.
#[tokio::test]
async fn observe_mode_fails_open_when_the_store_is_down() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let upstream = RecordingUpstream::start().await;
    let store = pg.store_toml();
    let proxy = TestProxy::start(&config(&upstream, &store, &observing(CHARGES_ROUTE))).await;
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    pg.stop();
    let r = post_json(
        &proxy.url("/api/v1/charges"),
        Some("k-down"),
        &charge(),
        &[],
    )
    .await;
    r.assert_status(200);
    assert_eq!(upstream.count(), 1, "forwarded although the store is down");
    assert!(metric(&admin, "idemproxy_store_errors_total").await >= 1);
    pg.restart();
}

/// A client sending continuously through a reload: every request is answered, requests that
/// started before the reload was asked for ran under the old rules, and requests that started
/// after it returned run under the new ones.
#[tokio::test]
async fn a_reload_under_load_loses_nothing_and_applies_to_new_requests_only() {
    let upstream = RecordingUpstream::start().await;
    let enforce = config(&upstream, "", CHARGES_ROUTE);
    let proxy = TestProxy::start_file(&enforce).await;
    let url = proxy.url("/api/v1/charges");
    // 0: before the reload is asked for; 1: while it runs; 2: after it returned.
    let phase = Arc::new(AtomicU8::new(0));
    let client = {
        let (url, phase) = (url.clone(), phase.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut after = 0;
            for i in 0.. {
                let started = phase.load(Ordering::SeqCst);
                let r = post_json(&url, Some(&format!("k-{i}")), &charge(), &[]).await;
                // Enforce mode marks its answers with the key; observe mode hands them back as is.
                seen.push((started, r.status, r.idempotency_key().is_some()));
                if started == 2 {
                    after += 1;
                    if after == 50 {
                        break;
                    }
                }
            }
            seen
        })
    };
    wait_until(
        || upstream.count() >= 50,
        WAIT,
        "50 requests before the reload",
    )
    .await;
    phase.store(1, Ordering::SeqCst);
    let observe = charges_with(&enforce, "mode = \"observe\"");
    let r = proxy.reload(&observe).await;
    r.assert_status(200);
    phase.store(2, Ordering::SeqCst);
    let seen = client.await.unwrap();
    assert!(
        seen.iter().all(|(_, status, _)| *status == 200),
        "no request lost"
    );
    assert_eq!(upstream.count(), seen.len(), "each forwarded once");
    assert!(
        seen.iter().filter(|s| s.0 == 0).all(|s| s.2),
        "old rules before the reload"
    );
    assert!(
        seen.iter().filter(|s| s.0 == 2).all(|s| !s.2),
        "new rules after it"
    );
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    assert_eq!(reloads(&admin, "ok").await, 1);
}

/// An invalid file changes nothing and says exactly what is wrong; settings that cannot
/// change while running are reported and kept.
#[tokio::test]
async fn an_invalid_reload_changes_nothing_and_names_the_line() {
    let upstream = RecordingUpstream::start().await;
    let good = config(&upstream, "", CHARGES_ROUTE);
    let proxy = TestProxy::start_file(&good).await;
    let url = proxy.url("/api/v1/charges");
    let bad = charges_with(&good, "mode = \"sometimes\"");
    let r = proxy.reload(&bad).await;
    r.assert_status(400);
    let errors = r.json()["error"]["errors"].clone();
    let line = bad
        .lines()
        .position(|l| l.contains("sometimes"))
        .map(|i| i + 1)
        .unwrap();
    let first = errors[0].as_str().unwrap_or_default().to_owned();
    assert!(
        first.contains(&format!("proxy.toml:{line}:")) && first.contains("use enforce or observe"),
        "{errors}"
    );
    // Still the old rules: enforce mode replays.
    post_json(&url, Some("k-1"), &charge(), &[])
        .await
        .assert_status(200);
    let again = post_json(&url, Some("k-1"), &charge(), &[]).await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(upstream.count(), 1);
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    assert_eq!(reloads(&admin, "error").await, 1);

    // A listener address cannot move while running: reported, kept, the rest applied.
    let moved = good.replacen(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"{}\"", unused_addr()),
        1,
    );
    let r = proxy.reload(&moved).await;
    r.assert_status(200);
    let kept = r.json()["kept"].to_string();
    assert!(kept.contains("server.listen"), "{kept}");
    post_json(&url, Some("k-2"), &charge(), &[])
        .await
        .assert_status(200);
}

/// A slow write in flight across a reload finishes under the rules it started with, and its
/// stored answer replays afterwards.
#[tokio::test]
async fn a_write_in_flight_across_a_reload_is_stored_and_replayed() {
    let upstream = RecordingUpstream::holding().await;
    let good = config(&upstream, "", CHARGES_ROUTE);
    let proxy = TestProxy::start_file(&good).await;
    let url = proxy.url("/api/v1/charges");
    let slow = spawn_post(&url, "k-slow", charge());
    upstream.wait_for_held(1).await;
    let retention = charges_with(&good, "retention = \"1h\"");
    proxy.reload(&retention).await.assert_status(200);
    upstream.release_all();
    let first = slow.await.unwrap();
    first.assert_status(200);
    assert_eq!(first.replayed(), Some(false));
    let retry = post_json(&url, Some("k-slow"), &charge(), &[]).await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.count(), 1);
}

/// `SIGHUP` to the real binary reloads its file: the route it switched to observe mode hands
/// the upstream's answer back unchanged and flags the duplicate it forwards.
#[tokio::test]
async fn sighup_reloads_the_running_binary() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let enforce = config(&upstream, "", CHARGES_ROUTE);
    let path = dir.write_config(&enforce);
    let proxy = common::process::ProxyProcess::spawn(&path).await;
    let url = proxy.url("/api/v1/charges");
    post_json(&url, Some("k-1"), &charge(), &[])
        .await
        .assert_status(200);
    assert_eq!(
        post_json(&url, Some("k-1"), &charge(), &[])
            .await
            .replayed(),
        Some(true)
    );
    dir.write_config(&charges_with(&enforce, "mode = \"observe\""));
    let status = std::process::Command::new("kill")
        .args(["-HUP", &proxy.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let admin = proxy.admin_url("");
    eventually(|| async {
        match reloads(&admin, "ok").await {
            1 => Ok(()),
            _ => Err(format!("no reload: {}", proxy.stderr())),
        }
    })
    .await;
    let dup = post_json(&url, Some("k-1"), &charge(), &[]).await;
    dup.assert_status(200);
    assert_eq!(dup.header("idemproxy-observed"), Some("replay"));
    assert_eq!(upstream.count(), 2, "observe mode forwarded the duplicate");
}

/// A write to an entity another key has claimed: forwarded, flagged `entity_claimed`.
#[tokio::test]
async fn observe_mode_flags_a_write_to_a_claimed_entity() {
    let upstream = RecordingUpstream::start().await;
    let route = r#"
[[routes]]
name = "book"
upstream = "api"
methods = ["POST"]
path = "/bookings"
entity = "slot:{body.slot}"
claim = true
mode = "observe"
"#;
    let proxy = TestProxy::start(&config(&upstream, "", route)).await;
    let url = proxy.url("/api/bookings");
    let first = post_json(&url, Some("exec-a"), &json!({"slot": "s1"}), &[]).await;
    first.assert_status(200);
    assert_eq!(first.header("idemproxy-observed"), None);
    let other = post_json(&url, Some("exec-b"), &json!({"slot": "s1"}), &[]).await;
    other.assert_status(200);
    assert_eq!(other.header("idemproxy-observed"), Some("entity_claimed"));
    assert_eq!(upstream.count(), 2, "both forwarded");
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    assert_eq!(observed(&admin, "book", "entity_claimed").await, 1);
}

/// What enforce mode refuses for want of a key is forwarded in observe mode and flagged; a
/// body over `max_body` is refused in both modes (there is nothing whole to forward).
#[tokio::test]
async fn observe_mode_forwards_an_unkeyed_request_but_not_an_oversized_body() {
    let upstream = RecordingUpstream::start().await;
    // No derivation: a request without the header cannot be keyed.
    let route = charges_with(
        CHARGES_ROUTE,
        "key = { header = \"Idempotency-Key\", derive = \"\" }",
    );
    let text = api_config(&upstream, "max_body = \"1KiB\"\n", "", &observing(&route));
    let proxy = TestProxy::start(&text).await;
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    let url = proxy.url("/api/v1/charges");
    let unkeyed = post_json(&url, None, &charge(), &[]).await;
    unkeyed.assert_status(200);
    assert_eq!(unkeyed.header("idemproxy-observed"), Some("key_missing"));
    assert_eq!(upstream.count(), 1, "forwarded without a key");
    assert_eq!(observed(&admin, "charges", "key_missing").await, 1);
    let huge = json!({ "memo": "x".repeat(4096) });
    let refused = post_json(&url, Some("k-huge"), &huge, &[]).await;
    refused.assert_status(413);
    assert_eq!(upstream.count(), 1, "an oversized body is never forwarded");
}

/// `POST /admin/reload` is behind the admin token: without it, the file is not read again.
#[tokio::test]
async fn a_reload_needs_the_admin_token() {
    let upstream = RecordingUpstream::start().await;
    let good = api_config(&upstream, "admin_token = \"s3cret\"\n", "", CHARGES_ROUTE);
    let proxy = TestProxy::start_file(&good).await;
    proxy
        .dir
        .write_config(&charges_with(&good, "mode = \"observe\""));
    let reload = proxy.admin_url("/admin/reload");
    let refused = request("POST", &reload, &[], "").await;
    refused.assert_status(401);
    let url = proxy.url("/api/v1/charges");
    post_json(&url, Some("k-1"), &charge(), &[])
        .await
        .assert_status(200);
    let again = post_json(&url, Some("k-1"), &charge(), &[]).await;
    assert_eq!(again.replayed(), Some(true), "still enforce mode");
    assert_eq!(upstream.count(), 1);
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    assert_eq!(
        reloads(&admin, "ok").await + reloads(&admin, "error").await,
        0
    );
    let allowed = request("POST", &reload, &[("authorization", "Bearer s3cret")], "").await;
    allowed.assert_status(200);
    let observed_dup = post_json(&url, Some("k-1"), &charge(), &[]).await;
    assert_eq!(observed_dup.header("idemproxy-observed"), Some("replay"));
    assert_eq!(upstream.count(), 2);
}
