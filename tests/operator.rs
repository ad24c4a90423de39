//! The operator's view (SPEC.md "Admin listener"): the audit trail behind
//! `/admin/entities/{entity}`, `/admin/keys/{key}` and `idemproxy keys show`, the admin token,
//! the Prometheus metrics, and retention. Every test runs the real proxy against a real
//! recording upstream and checks what the upstream received.

mod common;
use common::*;

use serde_json::{json, Value};
use std::process::Output;

/// `[server]` (plus `server_extra`), `store` (a `[store]` table or nothing), `[upstreams.api]`
/// at `/api`, then `routes`.
fn config(server_extra: &str, url: &str, store: &str, routes: &str) -> String {
    format!(
        "{}{server_extra}\n{store}\n[upstreams.api]\nurl = \"{url}\"\nprefix = \"/api\"\n\n{routes}\n",
        server_section()
    )
}

/// A POST route `name` at `path` on `item:{body.id}` with `extra` keys.
fn route(name: &str, path: &str, extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
         path = \"{path}\"\nentity = \"item:{{body.id}}\"\n{extra}\n"
    )
}

/// `GET path` on the admin listener; the JSON answer, after asserting 200.
async fn admin_json(proxy: &TestProxy, path: &str) -> Value {
    let resp = get(&proxy.admin_url(path)).await;
    resp.assert_status(200);
    resp.json()
}

/// Polls `/admin/entities/{entity}` until its history has `n` rows (the audit trail is written
/// in batches, off the request path); returns the report.
async fn history_of(proxy: &TestProxy, entity: &str, n: usize) -> Value {
    eventually(|| async {
        let report = admin_json(proxy, &format!("/admin/entities/{entity}")).await;
        match report["history"].as_array().map_or(0, Vec::len) {
            rows if rows == n => Ok(report),
            _ => Err(format!("not {n} audit rows of {entity}: {report}")),
        }
    })
    .await
}

/// The `decision` of each audit row, in the order given (newest first).
fn decisions(rows: &Value) -> Vec<&str> {
    let rows = rows.as_array().expect("an array of audit rows");
    rows.iter()
        .map(|r| r["decision"].as_str().unwrap())
        .collect()
}

/// Runs the real binary with `args` (off the runtime's threads).
async fn idemproxy(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(&args)
            .env_remove("IDEMPROXY_STORE_URL")
            .env_remove("IDEMPROXY_CONFIG")
            .env("NO_COLOR", "1")
            .output()
            .expect("run idemproxy")
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn the_audit_trail_shows_every_decision_on_an_entity() {
    let upstream = RecordingUpstream::start().await;
    let extra = "claim = true\nversion = \"{header.x-entity-version}\"";
    let toml = config("", &upstream.url(), "", &route("book", "/book", extra));
    let proxy = TestProxy::start(&toml).await;
    let url = proxy.url("/api/book");
    let v = [("x-entity-version", "7")];

    let first = post_json(&url, Some("aud-1"), &json!({"id": "a"}), &v).await;
    assert_eq!((first.status, first.replayed()), (200, Some(false)));
    let again = post_json(&url, Some("aud-1"), &json!({"id": "a"}), &v).await;
    assert_eq!(again.replayed(), Some(true));
    let other = post_json(&url, Some("aud-1"), &json!({"id": "a", "n": 2}), &v).await;
    other.assert_status(422);
    assert_eq!(other.error_type(), Some("key_reused"));
    assert_eq!(upstream.count(), 1, "one forward");

    let report = history_of(&proxy, "item:a", 3).await;
    assert_eq!(report["entity"], "item:a");
    assert_eq!(report["version"], 7, "{report}");
    assert_eq!(report["claim"]["key"], "aud-1", "{report}");
    assert_eq!(report["claim"]["upstream"], "api", "{report}");
    assert!(report["claim"]["until_ms"].as_i64().is_some(), "{report}");
    let history = &report["history"];
    assert_eq!(
        decisions(history),
        ["key_reused", "replayed", "forwarded"],
        "newest first: {history}"
    );
    let forwarded = &history[2];
    assert_eq!(forwarded["upstream_status"], 200, "{forwarded}");
    assert!(forwarded["upstream_ms"].is_number(), "{forwarded}");
    assert_eq!(forwarded["route"], "book");
    assert_eq!(forwarded["key"], "aud-1");
    // Entities are scoped by the caller's credentials: `name@scope`.
    let scoped = forwarded["entities"][0].as_str().unwrap_or_default();
    assert!(scoped.starts_with("item:a@"), "{forwarded}");
    assert_eq!(report["scopes"][0]["entity"], scoped, "{report}");
    assert_eq!(
        history[1]["upstream_status"],
        Value::Null,
        "a replay has none"
    );
    assert_ne!(history[0]["fingerprint"], history[2]["fingerprint"]);
    assert_eq!(history[1]["fingerprint"], history[2]["fingerprint"]);

    let key = admin_json(&proxy, "/admin/keys/aud-1").await;
    let record = &key["records"][0];
    assert_eq!(record["state"], "completed", "{key}");
    assert_eq!(record["attempts"], 1, "{key}");
    assert_eq!(record["entities"], forwarded["entities"]);
    assert_eq!(
        decisions(&key["attempts"]),
        ["key_reused", "replayed", "forwarded"]
    );

    // The same trail on the command line.
    let cfg = proxy.dir.write_config(&toml).display().to_string();
    let args = ["keys", "show", "aud-1", "--config", &cfg];
    let out = idemproxy(args.iter().map(|s| s.to_string()).collect()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "keys show failed: {stderr}");
    let shown: Value = serde_json::from_slice(&out.stdout).expect("keys show prints JSON");
    assert_eq!(shown["records"][0]["state"], "completed", "{shown}");
    assert_eq!(
        decisions(&shown["attempts"]),
        ["key_reused", "replayed", "forwarded"]
    );
    assert_eq!(shown["attempts"][2]["upstream_status"], 200, "{shown}");
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn the_admin_token_guards_the_operator_api_only() {
    let upstream = RecordingUpstream::start().await;
    let toml = config(
        "admin_token = \"t\"",
        &upstream.url(),
        "",
        &route("r", "/r", ""),
    );
    let proxy = TestProxy::start(&toml).await;
    let at = |path: &str, auth: Option<&'static str>| {
        let url = proxy.admin_url(path);
        async move {
            let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", *a)).collect();
            request("GET", &url, &headers, "").await
        }
    };
    for auth in [None, Some("Bearer wrong"), Some("t"), Some("Basic t")] {
        let resp = at("/admin/entities/x", auth).await;
        resp.assert_status(401);
        assert_eq!(resp.error_type(), Some("unauthorized"), "{auth:?}");
    }
    let delete = request("DELETE", &proxy.admin_url("/admin/claims/x"), &[], "").await;
    delete.assert_status(401);
    let report = at("/admin/entities/x", Some("Bearer t")).await;
    report.assert_status(200);
    assert_eq!(report.json()["entity"], "x");
    assert_eq!(report.json()["history"], json!([]));
    at("/healthz", None).await.assert_status(200);
    at("/metrics", None).await.assert_status(200);
    assert_eq!(upstream.count(), 0);
}

/// A line of `/metrics` text that starts with `prefix`, as `(line, value)`.
fn sample<'a>(text: &'a str, prefix: &str) -> (&'a str, f64) {
    let line = text
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no sample {prefix} in:\n{text}"));
    let value = line.rsplit(' ').next().and_then(|v| v.parse().ok());
    (
        line,
        value.unwrap_or_else(|| panic!("no value in {line:?}")),
    )
}

#[tokio::test]
async fn metrics_count_decisions_latency_and_in_flight() {
    let upstream = RecordingUpstream::with_handler(|rec, n| {
        let reply = Reply::echo(rec, n);
        if rec.path() == "/slow" {
            reply.held()
        } else {
            reply
        }
    })
    .await;
    let routes = format!(
        "{}\n{}",
        route("charges", "/charges", ""),
        route("slow", "/slow", "")
    );
    let proxy = TestProxy::start(&config("", &upstream.url(), "", &routes)).await;
    let url = proxy.url("/api/charges");
    for _ in 0..2 {
        post_json(&url, Some("m-1"), &json!({"id": "c1"}), &[])
            .await
            .assert_status(200);
    }
    post_json(&url, Some("m-2"), &json!({"id": "c1"}), &[])
        .await
        .assert_status(200);
    let metrics = || async {
        get(&proxy.admin_url("/metrics"))
            .await
            .assert_status(200)
            .text()
    };
    let text = metrics().await;
    let forwarded = r#"idemproxy_requests_total{route="charges",decision="forwarded"}"#;
    let replayed = r#"idemproxy_requests_total{route="charges",decision="replayed"}"#;
    assert_eq!(sample(&text, forwarded).1, 2.0);
    assert_eq!(sample(&text, replayed).1, 1.0);
    assert_eq!(
        sample(
            &text,
            r#"idemproxy_upstream_latency_seconds_count{route="charges"}"#
        )
        .1,
        2.0
    );
    assert_eq!(
        sample(
            &text,
            r#"idemproxy_lock_wait_seconds_count{route="charges"}"#
        )
        .1,
        3.0
    );
    sample(&text, r#"idemproxy_upstream_latency_seconds_bucket{"#);
    sample(&text, r#"idemproxy_lock_wait_seconds_bucket{"#);
    assert_eq!(sample(&text, "idemproxy_in_flight ").1, 0.0);
    assert_eq!(sample(&text, "idemproxy_store_errors_total ").1, 0.0);

    // A request held at the upstream is in flight.
    let slow = proxy.url("/api/slow");
    let held =
        tokio::spawn(async move { post_json(&slow, Some("m-3"), &json!({"id": "s"}), &[]).await });
    upstream.wait_for_held(1).await;
    assert_eq!(sample(&metrics().await, "idemproxy_in_flight ").1, 1.0);
    upstream.release_all();
    held.await.unwrap().assert_status(200);
    assert_eq!(sample(&metrics().await, "idemproxy_in_flight ").1, 0.0);
    assert_eq!(upstream.count(), 3);

    // None of the admin listener is on the main listener.
    for (method, path) in [
        ("GET", "/metrics"),
        ("GET", "/healthz"),
        ("GET", "/admin/entities/item:c1"),
        ("GET", "/admin/keys/m-1"),
        ("DELETE", "/admin/claims/item:c1"),
        ("POST", "/admin/keys/m-1/release"),
    ] {
        let resp = request(method, &proxy.url(path), &[], "").await;
        resp.assert_status(404);
        assert_eq!(resp.error_type(), Some("no_route"), "{method} {path}");
    }
    assert_eq!(upstream.count(), 3, "nothing forwarded");
    let replay = post_json(&url, Some("m-1"), &json!({"id": "c1"}), &[]).await;
    assert_eq!(replay.replayed(), Some(true), "the key was not released");
}

#[tokio::test]
async fn retention_expires_keys_and_audit_rows_unless_the_route_keeps_them() {
    let upstream = RecordingUpstream::start().await;
    let routes = format!(
        "{}\n{}",
        route("short", "/short", ""),
        route("long", "/long", "retention = \"1h\"")
    );
    let routes = format!(
        "{routes}\n{}",
        route("fenced", "/fenced", "version = \"{header.x-v}\"")
    );
    let toml = config(
        "",
        &upstream.url(),
        "[store]\nretention = \"1s\"\n",
        &routes,
    );
    let proxy = TestProxy::start(&toml).await;
    let (short, long) = (proxy.url("/api/short"), proxy.url("/api/long"));
    let (x, y) = (json!({"id": "x"}), json!({"id": "y"}));

    let first = post_json(&short, Some("s-1"), &x, &[]).await;
    assert_eq!(first.replayed(), Some(false));
    assert_eq!(
        post_json(&short, Some("s-1"), &x, &[]).await.replayed(),
        Some(true)
    );
    assert_eq!(
        post_json(&long, Some("l-1"), &y, &[]).await.replayed(),
        Some(false)
    );
    assert_eq!(
        post_json(&long, Some("l-1"), &y, &[]).await.replayed(),
        Some(true)
    );
    let v5 = [("x-v", "5")];
    let fenced = proxy.url("/api/fenced");
    post_json(&fenced, Some("f-1"), &json!({"id": "z"}), &v5)
        .await
        .assert_status(200);
    assert_eq!(upstream.count(), 3);
    history_of(&proxy, "item:x", 2).await;

    // The purge removes both keys of the store-wide retention, then their audit rows. The
    // keys expire a few milliseconds apart, so a purge may take one before the other.
    for key in ["s-1", "f-1"] {
        eventually(|| async {
            match get(&proxy.admin_url(&format!("/admin/keys/{key}")))
                .await
                .status
            {
                404 => Ok(()),
                _ => Err(format!("key {key} outlived its retention")),
            }
        })
        .await;
    }
    history_of(&proxy, "item:x", 0).await;
    history_of(&proxy, "item:z", 0).await;

    // Versions outlive retention: fencing still holds once the keys are gone.
    let stale = post_json(&fenced, Some("f-2"), &json!({"id": "z"}), &v5).await;
    stale.assert_status(409);
    assert_eq!(stale.error_type(), Some("stale_version"));
    assert_eq!(
        admin_json(&proxy, "/admin/entities/item:z").await["version"],
        5
    );

    // The route-level retention keeps the other key and its trail.
    admin_json(&proxy, "/admin/keys/l-1").await;
    let kept = admin_json(&proxy, "/admin/entities/item:y").await;
    assert_eq!(decisions(&kept["history"]), ["replayed", "forwarded"]);
    assert_eq!(
        post_json(&long, Some("l-1"), &y, &[]).await.replayed(),
        Some(true)
    );
    assert_eq!(upstream.count(), 3);

    // The expired key is forwarded again.
    let again = post_json(&short, Some("s-1"), &x, &[]).await;
    assert_eq!(again.replayed(), Some(false));
    assert_ne!(again.body, first.body, "a fresh answer");
    assert_eq!(upstream.count(), 4);
    assert_eq!(upstream.request(4).path(), "/short");
    assert_eq!(upstream.request(4).header("idempotency-key"), Some("s-1"));
}

/// A retry storm: 200 concurrent replays of one key. The upstream sees one POST; the audit
/// trail counts every request (`requests` summed over the key's rows, read from the store's
/// file): folding one key's alike replays into shared rows loses none of them. (That they do
/// fold is shown deterministically by the auditor's own test, `audit::tests`.)
#[tokio::test]
async fn a_replay_storm_is_counted_whole_in_the_audit_trail() {
    let upstream = RecordingUpstream::start().await;
    let toml = config("", &upstream.url(), "", &route("book", "/book", ""));
    let proxy = TestProxy::start(&toml).await;
    let url = proxy.url("/api/book");
    let body = json!({"id": "storm"});
    post_json(&url, Some("storm-1"), &body, &[])
        .await
        .assert_status(200);
    let storm = (0..200).map(|_| {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { post_json(&url, Some("storm-1"), &body, &[]).await })
    });
    for replay in storm {
        assert_eq!(replay.await.unwrap().replayed(), Some(true));
    }
    assert_eq!(upstream.count(), 1, "one forward");

    let db = rusqlite::Connection::open(proxy.dir.audit_db_path()).unwrap();
    let replayed = || -> (i64, i64) {
        db.query_row(
            "SELECT count(*), coalesce(sum(requests), 0) FROM idem_audit \
             WHERE key = 'storm-1' AND decision = 'replayed'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    };
    wait_until(|| replayed().1 >= 200, WAIT, "200 replays are audited").await;
    let (rows, requests) = replayed();
    assert_eq!(requests, 200, "every replay counted once ({rows} rows)");
    let forwarded: i64 = db
        .query_row(
            "SELECT sum(requests) FROM idem_audit WHERE key = 'storm-1' AND decision = 'forwarded'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(forwarded, 1);
}

/// A request refused before its key is looked up (here its entity cannot be named) is still an
/// audit row that says which workflow sent it, and nothing is forwarded.
#[tokio::test]
async fn a_request_refused_early_is_audited_with_its_workflow() {
    let upstream = RecordingUpstream::start().await;
    let toml = config("", &upstream.url(), "", &route("book", "/book", ""));
    let proxy = TestProxy::start(&toml).await;
    let headers = [("x-workflow-id", "run-78")];
    let refused = post_json(&proxy.url("/api/book"), Some("ev-1"), &json!({}), &headers).await;
    let decision = refused.error_type().unwrap_or_default().to_owned();
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert_eq!(upstream.count(), 0);
    let db = rusqlite::Connection::open(proxy.dir.audit_db_path()).unwrap();
    let workflow = || -> Option<String> {
        db.query_row(
            "SELECT workflow FROM idem_audit WHERE decision = ?1",
            [&decision],
            |r| r.get(0),
        )
        .ok()
    };
    wait_until(|| workflow().is_some(), WAIT, "the refusal is audited").await;
    assert_eq!(workflow().as_deref(), Some("run-78"));
}
