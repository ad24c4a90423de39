//! Settling a key by hand (SPEC "Settling an unknown outcome by hand"), through the admin API
//! and the CLI, on SQLite and PostgreSQL: the real proxy in front of a recording upstream that
//! takes a write and drops the connection before answering (the outcome unknown). A key marked
//! done is never forwarded and its retries get the operator's answer; a released one is
//! forwarded exactly once more; a key whose outcome is known, or which several records carry,
//! is refused with the records; every act leaves an audit row with its note.

mod common;
use common::*;

use common::pg::PgServer;
use serde_json::{json, Value};

/// Writes 1, 2, 4, 5 and 6 are taken and their connection dropped (unknown outcomes); the
/// others are answered.
async fn upstream() -> RecordingUpstream {
    RecordingUpstream::builder()
        .raw_http1()
        .handler(|rec, n| match n {
            1 | 2 | 4 | 5 | 6 => Reply::drop_connection(),
            _ => Reply::echo(rec, n),
        })
        .start()
        .await
}

fn config(upstream: &RecordingUpstream, store: &str) -> String {
    let route = format!("{CHARGES_ROUTE}entity = \"customer:{{body.customer}}\"\n");
    let limits = "release_statuses = [429, 503]\nmax_answer = \"1KiB\"\n";
    let server = "max_body = \"16KiB\"";
    format!("{}\n{store}", api_config(upstream, server, limits, &route))
}

async fn charge(proxy: &TestProxy, key: &str, auth: &str) -> Resp {
    let body = json!({"customer": "cus_9", "amount": 100});
    let headers = [("authorization", auth), ("x-workflow-id", "run-77")];
    post_json(&proxy.url("/api/v1/charges"), Some(key), &body, &headers).await
}

async fn admin_post(proxy: &TestProxy, path: &str, body: &Value) -> Resp {
    let headers = [("content-type", "application/json")];
    request("POST", &proxy.admin_url(path), &headers, body.to_string()).await
}

/// Runs the real binary's `keys …` on the proxy's own config: (success, stdout and stderr).
async fn keys(proxy: &TestProxy, args: &[&str]) -> (bool, String) {
    let cfg = proxy.dir.write_file("cli.toml", &proxy.config_text);
    let (ok, out, err) = cli(cfg, args).await;
    (ok, out + &err)
}

/// Polls the key's audit trail until a row with `decision` shows; returns it.
async fn audit_row(proxy: &TestProxy, key: &str, decision: &str) -> Value {
    eventually(|| async {
        let report = get(&proxy.admin_url(&format!("/admin/keys/{key}")))
            .await
            .json();
        let rows = report["attempts"].as_array().cloned().unwrap_or_default();
        match rows.into_iter().find(|r| r["decision"] == decision) {
            Some(row) => Ok(row),
            None => Err(format!("no {decision} row for {key}: {report}")),
        }
    })
    .await
}

async fn settles_by_hand(store: &str) {
    let upstream = upstream().await;
    let proxy = TestProxy::start(&config(&upstream, store)).await;

    // 1. The write happened: marked done on the admin API, never forwarded again.
    charge(&proxy, "done-1", "Bearer a")
        .await
        .assert_status(504);
    let retry = charge(&proxy, "done-1", "Bearer a").await;
    assert_eq!(retry.error_type(), Some("outcome_unknown"));
    refuses_what_no_upstream_could_answer(&proxy, "done-1").await;
    let pasted = json!({
        "status": 201,
        "headers": [
            ["Content-Type", "application/json"],
            ["Set-Cookie", "session=first-callers"],
            ["Transfer-Encoding", "chunked"],
            ["Connection", "x-private"],
            ["X-Private", "1"],
            ["Idempotent-Replayed", "false"],
        ],
        "body": "{\"id\":\"ch_real\",\"amount\":100}",
        "note": "found ch_real in the dashboard",
    });
    let done = admin_post(&proxy, "/admin/keys/done-1/complete", &pasted).await;
    done.assert_status(200);
    assert_eq!(
        done.json()["records"][0]["state"],
        "completed",
        "{}",
        done.text()
    );
    for _ in 0..2 {
        let retry = charge(&proxy, "done-1", "Bearer a").await;
        retry.assert_status(201);
        assert_eq!(retry.json()["id"], "ch_real");
        assert_eq!(retry.replayed(), Some(true));
        assert_eq!(retry.header("idemproxy-set-by"), Some("operator"));
        assert_eq!(retry.header("content-type"), Some("application/json"));
        for dropped in ["set-cookie", "x-private", "transfer-encoding"] {
            assert_eq!(retry.header(dropped), None, "{dropped} replayed");
        }
    }
    assert_eq!(upstream.count(), 1, "a key marked done is never forwarded");
    let row = audit_row(&proxy, "done-1", "completed_by_operator").await;
    assert_eq!(row["note"], "found ch_real in the dashboard", "{row}");
    assert_eq!(row["upstream_status"], 201);
    // Who sent the write: the workflow id header and the credential scope's short id.
    let sent = audit_row(&proxy, "done-1", "unknown").await;
    assert_eq!(sent["workflow"], "run-77", "{sent}");
    let scope = sent["scope"].as_str().unwrap_or_default();
    assert!(scope.len() == 16 && scope == row["scope"], "{sent} {row}");
    // Its outcome is known now: settling it again is refused, with the record.
    let again = admin_post(&proxy, "/admin/keys/done-1/complete", &pasted).await;
    assert_eq!(
        again.error_type(),
        Some("not_settleable"),
        "{}",
        again.text()
    );
    assert_eq!(again.json()["error"]["records"][0]["state"], "completed");

    // 2. The write did not happen: released with the CLI, forwarded exactly once more.
    charge(&proxy, "rel-1", "Bearer a").await.assert_status(504);
    let (ok, out) = keys(
        &proxy,
        &[
            "keys",
            "release",
            "rel-1",
            "--note",
            "no charge in the dashboard",
        ],
    )
    .await;
    assert!(ok, "{out}");
    charge(&proxy, "rel-1", "Bearer a").await.assert_status(200);
    charge(&proxy, "rel-1", "Bearer a").await.assert_status(200);
    assert_eq!(
        upstream.count(),
        3,
        "released: forwarded once, then replayed"
    );
    let row = audit_row(&proxy, "rel-1", "released_by_operator").await;
    assert_eq!(row["note"], "no charge in the dashboard", "{row}");

    // 3. Marked done with the CLI: the body from a file, a header, a required note.
    charge(&proxy, "cli-1", "Bearer a").await.assert_status(504);
    let body = proxy.dir.write_file("real.json", r#"{"id":"ch_cli"}"#);
    let body = body.to_string_lossy().into_owned();
    let args = [
        "keys",
        "complete",
        "cli-1",
        "--status",
        "200",
        "--body-file",
        &body,
    ];
    let (ok, out) = keys(&proxy, &args).await;
    assert!(
        !ok && out.contains("--note <NOTE>"),
        "a note is required: {out}"
    );
    let with_note = [
        &args[..],
        &["-H", "Content-Type: application/json", "--note", "seen"],
    ]
    .concat();
    let (ok, out) = keys(&proxy, &with_note).await;
    assert!(ok, "{out}");
    let retry = charge(&proxy, "cli-1", "Bearer a").await;
    retry.assert_status(200);
    assert_eq!(retry.json()["id"], "ch_cli");
    assert_eq!(upstream.count(), 4, "never forwarded after keys complete");
    let (ok, out) = keys(&proxy, &with_note).await;
    assert!(
        !ok && out.contains("unknown"),
        "a known outcome is not settled again: {out}"
    );

    // 4. One key, two callers (two credential scopes): complete must pick one.
    charge(&proxy, "amb-1", "Bearer a").await.assert_status(504);
    charge(&proxy, "amb-1", "Bearer b").await.assert_status(504);
    let pasted = json!({"status": 200, "body": "{\"id\":\"ch_a\"}", "note": "a's"});
    let both = admin_post(&proxy, "/admin/keys/amb-1/complete", &pasted).await;
    assert_eq!(both.error_type(), Some("not_settleable"), "{}", both.text());
    let records = both.json()["error"]["records"].as_array().cloned().unwrap();
    assert_eq!(records.len(), 2, "{}", both.text());
    let mut picked = pasted.clone();
    picked["upstream"] = json!("api");
    picked["scope"] = records[0]["scope"].clone();
    admin_post(&proxy, "/admin/keys/amb-1/complete", &picked)
        .await
        .assert_status(200);
    let (a, b) = (
        charge(&proxy, "amb-1", "Bearer a").await,
        charge(&proxy, "amb-1", "Bearer b").await,
    );
    let mut seen = [a.status, b.status];
    seen.sort();
    assert_eq!(
        seen,
        [200, 409],
        "one caller's record completed, the other's still unknown"
    );
    let completed = if a.status == 200 { &a } else { &b };
    assert_eq!(completed.json()["id"], "ch_a");
    assert_eq!(upstream.count(), 6, "nothing forwarded by settling");

    // A release that names no record is refused too: it would drop the other caller's.
    let wide = admin_post(&proxy, "/admin/keys/amb-1/release", &json!({"note": "x"})).await;
    assert_eq!(wide.error_type(), Some("not_settleable"), "{}", wide.text());
    let (ok, out) = keys(&proxy, &["keys", "release", "amb-1"]).await;
    assert!(!ok && out.contains("--scope"), "{out}");
    let scopes = json!({"upstream": "api", "scope": 7, "note": "x"});
    let typed = admin_post(&proxy, "/admin/keys/amb-1/release", &scopes).await;
    assert_eq!(typed.error_type(), Some("body_invalid"), "{}", typed.text());
    assert_eq!(
        charge(
            &proxy,
            "amb-1",
            if a.status == 200 {
                "Bearer a"
            } else {
                "Bearer b"
            }
        )
        .await
        .json()["id"],
        "ch_a",
        "the completed record stands"
    );
    assert_eq!(upstream.count(), 6);

    // 5. Released one record at a time: the other caller's record stays unknown, and a
    //    record whose answer is stored is never released by it.
    let (still, unknown_auth) = match a.status {
        200 => (&records[1], "Bearer b"),
        _ => (&records[0], "Bearer a"),
    };
    let one = json!({"upstream": "api", "scope": still["scope"], "note": "not there"});
    let done = admin_post(&proxy, "/admin/keys/amb-1/release", &one).await;
    done.assert_status(200);
    let row = audit_row(&proxy, "amb-1", "released_by_operator").await;
    assert_eq!(row["note"], "not there", "{row}");
    charge(&proxy, "amb-1", unknown_auth)
        .await
        .assert_status(200);
    assert_eq!(
        upstream.count(),
        7,
        "the released record's retry is forwarded once"
    );
    let other = json!({"upstream": "api", "scope": picked["scope"], "note": "x"});
    let refused = admin_post(&proxy, "/admin/keys/amb-1/release", &other).await;
    assert_eq!(
        refused.error_type(),
        Some("not_settleable"),
        "{}",
        refused.text()
    );
    let kept = charge(
        &proxy,
        "amb-1",
        if unknown_auth == "Bearer a" {
            "Bearer b"
        } else {
            "Bearer a"
        },
    )
    .await;
    assert_eq!(kept.json()["id"], "ch_a", "the operator's answer stands");
    assert_eq!(upstream.count(), 7);
}

/// Answers no upstream could have sent (or that mean "not processed"), and notes left out,
/// are refused with `400 body_invalid`: the key stays unknown and nothing is forwarded.
async fn refuses_what_no_upstream_could_answer(proxy: &TestProxy, key: &str) {
    let path = format!("/admin/keys/{key}/complete");
    let note = "checked";
    for pasted in [
        json!({"status": 101, "note": note}),
        json!({"status": 600, "note": note}),
        json!({"status": 70000, "note": note}),
        json!({"status": "201", "note": note}),
        json!({"status": 503, "note": note}),
        json!({"status": 201}),
        json!({"status": 201, "note": " \u{7} "}),
        json!({"status": 201, "note": note, "headers": {"X-A": "1\r\nSet-Cookie: s=1"}}),
        json!({"status": 201, "note": note, "headers": {"Bad Name": "1"}}),
        json!({"status": 201, "note": note, "body": "x".repeat(2048)}),
        json!({"status": 201, "note": note, "scope": ["a"]}),
    ] {
        let refused = admin_post(proxy, &path, &pasted).await;
        assert_eq!(
            refused.error_type(),
            Some("body_invalid"),
            "{pasted}: {}",
            refused.text()
        );
    }
    // A paste over `server.max_body` (16 KiB here) is refused before it is read whole.
    let huge = json!({"status": 201, "note": note, "body": "x".repeat(17 << 10)});
    let refused = admin_post(proxy, &path, &huge).await;
    assert_eq!(refused.status, 413, "{}", refused.text());
    assert_eq!(refused.error_type(), Some("body_too_large"));
    let shown = get(&proxy.admin_url(&format!("/admin/keys/{key}")))
        .await
        .json();
    assert_eq!(shown["records"][0]["state"], "unknown", "{shown}");
}

#[tokio::test]
async fn an_operator_settles_unknown_outcomes_on_sqlite() {
    settles_by_hand("").await;
}

#[tokio::test]
async fn an_operator_settles_unknown_outcomes_on_postgres() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    settles_by_hand(&pg.store_toml()).await;
}

/// Without an admin token (a loopback admin listener), no page in a browser on this machine
/// may settle a key: not by a cross-site POST (`Origin`, `Sec-Fetch-Site`) and not through a
/// name of its own rebound to 127.0.0.1 (`Host`). Nothing changes: the key stays unknown and
/// its retry is still refused, never forwarded.
#[tokio::test]
async fn without_a_token_no_other_site_settles_a_key() {
    let upstream = upstream().await;
    let proxy = TestProxy::start(&config(&upstream, "")).await;
    charge(&proxy, "site-1", "Bearer a")
        .await
        .assert_status(504);
    let url = proxy.admin_url("/admin/keys/site-1/release");
    let json = ("content-type", "text/plain");
    for (name, value) in [
        ("origin", "http://evil.example"),
        ("origin", "null"),
        ("origin", "http://localhost:3000"),
        ("origin", "http://127.0.0.1:1"),
        ("sec-fetch-site", "cross-site"),
        ("sec-fetch-site", "same-site"),
        ("host", "evil.example"),
    ] {
        let refused = request("POST", &url, &[json, (name, value)], "{}").await;
        assert_eq!(refused.status, 403, "{name}: {value}: {}", refused.text());
        let shown = get(&proxy.admin_url("/admin/keys/site-1")).await.json();
        assert_eq!(shown["records"][0]["state"], "unknown", "{shown}");
    }
    assert_eq!(
        charge(&proxy, "site-1", "Bearer a").await.error_type(),
        Some("outcome_unknown")
    );
    assert_eq!(upstream.count(), 1);
    // This machine's own tools, and a page of the admin listener's own origin (the console),
    // still may: the release goes through and the retry is forwarded, once.
    let origin = proxy.admin_url("");
    let origin = origin.trim_end_matches('/');
    let own = [json, ("origin", origin), ("sec-fetch-site", "same-origin")];
    request("POST", &url, &own, "{}").await.assert_status(200);
    charge(&proxy, "site-1", "Bearer a").await;
    assert_eq!(upstream.count(), 2, "forwarded once after the release");
}

/// `keys release` on a completed key would drop its stored answer and let the next identical
/// request write again: refused (admin API and CLI) unless forced with a note, and audited.
#[tokio::test]
async fn a_completed_key_is_released_only_when_forced_with_a_note() {
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&upstream, "")).await;
    let first = charge(&proxy, "paid-1", "Bearer a").await;
    first.assert_status(200);
    assert_eq!(upstream.count(), 1);

    let unforced = admin_post(&proxy, "/admin/keys/paid-1/release", &json!({"note": "x"})).await;
    unforced.assert_status(409);
    assert_eq!(unforced.error_type(), Some("not_settleable"));
    assert!(unforced.text().contains("force"), "{}", unforced.text());
    let (ok, out) = keys(&proxy, &["keys", "release", "paid-1"]).await;
    assert!(!ok && out.contains("--force"), "{out}");
    let (ok, out) = keys(&proxy, &["keys", "release", "paid-1", "--force"]).await;
    assert!(
        !ok && out.contains("note"),
        "a forced release needs a note: {out}"
    );
    let retry = charge(&proxy, "paid-1", "Bearer a").await;
    assert_eq!(retry.replayed(), Some(true), "nothing was dropped");
    assert_eq!(upstream.count(), 1);

    let note = "the stored answer was a test charge";
    let (ok, out) = keys(
        &proxy,
        &["keys", "release", "paid-1", "--force", "--note", note],
    )
    .await;
    assert!(ok, "{out}");
    let row = audit_row(&proxy, "paid-1", "answer_dropped_by_operator").await;
    assert_eq!(row["note"], note, "{row}");
    let again = charge(&proxy, "paid-1", "Bearer a").await;
    assert_eq!(again.replayed(), Some(false), "forwarded again, on purpose");
    assert_eq!(upstream.count(), 2);
}
