//! Hostile callers, part one: what is stored never crosses callers (credential scopes, entity
//! scopes, cookies), what is too large is never stored, and what is sensitive is never left
//! open (the admin API, the store's files). Each test asserts on what the upstream received.

mod common;

use common::*;
use serde_json::{json, Value};

use common::api_config as config;

use common::{CHARGES_ROUTE as CHARGES, CONTACTS_ROUTE as CONTACTS};

async fn post(url: &str, key: &str, headers: &[(&str, &str)]) -> Resp {
    post_json(url, Some(key), &json!({"amount": 1}), headers).await
}

#[tokio::test]
async fn a_stored_answer_never_reaches_other_credentials_in_any_common_header() {
    let upstream = RecordingUpstream::with_handler(|_, n| {
        Reply::json(201, &json!({"id": n})).header("set-cookie", &format!("session=S{n}"))
    })
    .await;
    let proxy = TestProxy::start(&config(&upstream, "", "", CHARGES)).await;
    let url = proxy.url("/api/v1/charges");
    // Proxy-Authorization is not among them: it is never forwarded, so it tells no two
    // callers apart at the upstream (tests/forwarded.rs).
    for (i, header) in ["cookie", "x-api-key", "x-auth-token"].iter().enumerate() {
        let key = format!("k-{header}");
        let before = upstream.count();
        let a = post(&url, &key, &[(header, "caller-A")]).await;
        assert_eq!(a.replayed(), Some(false));
        let b = post(&url, &key, &[(header, "caller-B")]).await;
        assert_eq!(
            b.replayed(),
            Some(false),
            "{header}: B must not get A's answer"
        );
        assert_ne!(b.body, a.body, "{header}");
        assert_eq!(
            upstream.count(),
            before + 2,
            "{header}: B's request is its own"
        );
        let again = post(&url, &key, &[(header, "caller-A")]).await;
        assert_eq!(again.replayed(), Some(true), "{header}: A's retry replays");
        assert_eq!(again.body, a.body);
        assert_eq!(upstream.count(), before + 2, "round {i}");
    }
}

#[tokio::test]
async fn set_cookie_reaches_only_the_first_caller_unless_an_upstream_opts_in() {
    let upstream = RecordingUpstream::with_handler(|_, n| {
        Reply::json(201, &json!({"id": n})).header("set-cookie", &format!("session=S{n}"))
    })
    .await;
    let proxy = TestProxy::start(&config(&upstream, "", "", CHARGES)).await;
    let url = proxy.url("/api/v1/charges");
    let first = post(&url, "k-cookie", &[]).await;
    assert_eq!(first.header("set-cookie"), Some("session=S1"));
    let replay = post(&url, "k-cookie", &[]).await;
    assert_eq!(replay.replayed(), Some(true));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("set-cookie"), None, "cookies are not stored");
    let record = get(&proxy.admin_url("/admin/keys/k-cookie")).await.json();
    assert!(!record.to_string().contains("session=S1"), "{record}");

    let opted = TestProxy::start(&config(&upstream, "", "store_set_cookie = true", CHARGES)).await;
    let url = opted.url("/api/v1/charges");
    let first = post(&url, "k-cookie-2", &[]).await;
    let replay = post(&url, "k-cookie-2", &[]).await;
    assert_eq!(replay.replayed(), Some(true));
    assert_eq!(replay.header("set-cookie"), first.header("set-cookie"));
    assert_eq!(upstream.count(), 2);
}

async fn patch(url: &str, tenant: &str, request: &str, version: &str) -> Resp {
    let headers = [
        ("content-type", "application/json"),
        ("authorization", tenant),
        ("x-request-id", request),
        ("x-entity-version", version),
    ];
    request_with(url, &headers).await
}

async fn request_with(url: &str, headers: &[(&str, &str)]) -> Resp {
    common::request("PATCH", url, headers, r#"{"name":"x"}"#).await
}

#[tokio::test]
async fn entity_versions_and_locks_belong_to_each_credential_unless_shared() {
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&upstream, "", "", CONTACTS)).await;
    let url = proxy.url("/api/contacts/42");
    let max = i64::MAX.to_string();
    patch(&url, "Bearer A", "a1", &max).await.assert_status(200);
    // Tenant B's contact 42 is not tenant A's: A's huge version does not fence B.
    patch(&url, "Bearer B", "b1", "1").await.assert_status(200);
    patch(&url, "Bearer B", "b2", "2").await.assert_status(200);
    assert_eq!(upstream.count(), 3);
    let stale = patch(&url, "Bearer B", "b3", "2").await;
    stale.assert_status(409);
    let e = stale.json();
    assert_eq!(
        e["error"]["current_version"], 2,
        "B sees its own version only: {e}"
    );
    assert_eq!(e["error"]["entity"], "contact:42");
    assert_eq!(upstream.count(), 3);

    // The operator sees every scope of the entity and can reset its version.
    let admin = get(&proxy.admin_url("/admin/entities/contact:42"))
        .await
        .json();
    assert_eq!(admin["scopes"].as_array().map(Vec::len), Some(2), "{admin}");
    let reset = common::request(
        "DELETE",
        &proxy.admin_url("/admin/entities/contact:42/version"),
        &[],
        "",
    )
    .await;
    reset.assert_status(200);
    assert_eq!(reset.json()["reset"], 2);
    patch(&url, "Bearer A", "a2", "1").await.assert_status(200);
    assert_eq!(upstream.count(), 4);

    // One account, several tokens: the upstream shares entities across credentials.
    let shared = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&shared, "", "share_entities = true", CONTACTS)).await;
    let url = proxy.url("/api/contacts/42");
    patch(&url, "Bearer A", "a1", "5").await.assert_status(200);
    let e = patch(&url, "Bearer B", "b1", "3").await;
    e.assert_status(409);
    assert_eq!(e.error_type(), Some("stale_version"));
    assert_eq!(shared.count(), 1);
}

#[tokio::test]
async fn answers_over_max_answer_stream_to_their_caller_and_are_never_forwarded_again() {
    let big = "x".repeat(256 * 1024);
    let body = big.clone();
    let upstream = RecordingUpstream::with_handler(move |_, _| Reply::text(201, &body)).await;
    let proxy = TestProxy::start(&config(&upstream, "max_answer = \"16KiB\"\n", "", CHARGES)).await;
    let url = proxy.url("/api/v1/charges");
    let first = post(&url, "k-big", &[]).await;
    first.assert_status(201);
    assert_eq!(first.body.len(), big.len(), "the first caller gets it all");
    assert_eq!(first.replayed(), Some(false));
    let retry = post(&url, "k-big", &[]).await;
    retry.assert_status(409);
    assert_eq!(retry.error_type(), Some("answer_too_large"));
    assert_eq!(retry.json()["error"]["upstream_status"], 201);
    assert_eq!(upstream.count(), 1, "never forwarded twice");
    let record = get(&proxy.admin_url("/admin/keys/k-big")).await.json();
    assert_eq!(record["records"][0]["state"], "completed", "{record}");
    assert!(
        !record.to_string().contains("xxxxxxxx"),
        "the body is not stored"
    );
    // An oversize answer in release_statuses is not stored either: the retry is forwarded.
    let body = big.clone();
    let busy = RecordingUpstream::with_handler(move |_, _| Reply::text(503, &body)).await;
    let extra = "release_statuses = [503]";
    let proxy = TestProxy::start(&config(&busy, "max_answer = \"16KiB\"\n", extra, CHARGES)).await;
    let url = proxy.url("/api/v1/charges");
    post(&url, "k-busy", &[]).await.assert_status(503);
    post(&url, "k-busy", &[]).await.assert_status(503);
    assert_eq!(busy.count(), 2, "a released key is forwarded again");
    // Small answers are still stored and replayed.
    let small = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&small, "max_answer = \"16KiB\"\n", "", CHARGES)).await;
    let url = proxy.url("/api/v1/charges");
    let a = post(&url, "k-small", &[]).await;
    let b = post(&url, "k-small", &[]).await;
    assert_eq!((b.replayed(), &b.body), (Some(true), &a.body));
}

#[tokio::test]
async fn the_admin_api_needs_a_token_off_loopback() {
    let upstream = RecordingUpstream::start().await;
    let open = "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"0.0.0.0:0\"\n";
    let text = format!(
        "{open}\n[upstreams.api]\nurl = \"{}\"\nprefix = \"/api\"\n{CHARGES}",
        upstream.url()
    );
    let proxy = TestProxy::start(&text).await;
    let port = proxy.admin_addr.map(|a| a.port()).unwrap_or_default();
    let at = |path: &str| format!("http://127.0.0.1:{port}{path}");
    post(&proxy.url("/api/v1/charges"), "k-admin", &[]).await;
    let refused = get(&at("/admin/keys/k-admin")).await;
    refused.assert_status(403);
    assert_eq!(refused.error_type(), Some("forbidden"));
    assert!(!refused.text().contains("\"n\""), "no stored body leaks");
    let release = common::request("POST", &at("/admin/keys/k-admin/release"), &[], "").await;
    release.assert_status(403);
    get(&at("/healthz")).await.assert_status(200);
    get(&at("/metrics")).await.assert_status(200);
    // The key was never released: the retry replays.
    let retry = post(&proxy.url("/api/v1/charges"), "k-admin", &[]).await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(upstream.count(), 1);

    // With a token, the same listener serves the API to whoever holds it.
    let text = text.replace(
        "admin_listen = \"0.0.0.0:0\"\n",
        "admin_listen = \"0.0.0.0:0\"\nadmin_token = \"t0ken\"\n",
    );
    let proxy = TestProxy::start(&text).await;
    let port = proxy.admin_addr.map(|a| a.port()).unwrap_or_default();
    let url = format!("http://127.0.0.1:{port}/admin/keys/nope");
    get(&url).await.assert_status(401);
    let authorized = common::request("GET", &url, &[("authorization", "Bearer t0ken")], "").await;
    authorized.assert_status(404);
}

#[cfg(unix)]
#[tokio::test]
async fn store_files_are_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&upstream, "", "", CHARGES)).await;
    post(&proxy.url("/api/v1/charges"), "k-perm", &[]).await;
    let db = proxy.dir.db_path();
    for suffix in ["", "-wal", "-shm", ".lock", ".secret"] {
        let path = format!("{}{suffix}", db.display());
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{path} is {mode:o}");
    }
}

#[tokio::test]
async fn credential_scopes_are_keyed_and_an_upgrade_keeps_old_keys() {
    use idemproxy::store::{Finish, Reservation, Reserved, ScopedKey, StoredResponse};
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    // A key stored before scopes were keyed: its scope is the plain SHA-256 of Authorization.
    {
        let store = idemproxy::store::open(
            &dir.db_url(),
            std::time::Duration::from_secs(30),
            false,
            None,
        )
        .await
        .expect("open the store")
        .store;
        let mut headers = http::HeaderMap::new();
        headers.insert("authorization", "Bearer old".parse().expect("header"));
        let id = ScopedKey::new("api", idemproxy::key::legacy_scope(&headers, &[]), "k-old");
        let fingerprint = fingerprint_of(&dir, &upstream).await;
        let reserved = store
            .reserve(Reservation {
                id: id.clone(),
                fingerprint,
                route: "charges".into(),
                entities: vec![],
                owner: "first-release".into(),
                lease: std::time::Duration::from_secs(30),
                take_unknown: false,
                call_timeout: std::time::Duration::from_secs(30),
            })
            .await
            .expect("reserve");
        let Reserved::Owned(ticket) = reserved else {
            panic!("fresh key")
        };
        let response = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: r#"{"stored":"before the upgrade"}"#.into(),
        };
        let done = Finish::Completed {
            response: std::sync::Arc::new(response),
            expires_at: idemproxy::store::now_ms() + 3_600_000,
            effects: Default::default(),
        };
        assert!(store
            .finish(&ticket, done, idemproxy::store::When::Durable)
            .await
            .expect("finish"));
        store.close().await;
    }
    let proxy = TestProxy::start_in(dir, &config(&upstream, "", "", CHARGES)).await;
    let url = proxy.url("/api/v1/charges");
    let retry = post(&url, "k-old", &[("authorization", "Bearer old")]).await;
    assert_eq!(retry.replayed(), Some(true), "{}", retry.text());
    assert_eq!(retry.json(), json!({"stored": "before the upgrade"}));
    let other = post(&url, "k-old", &[("authorization", "Bearer other")]).await;
    assert_eq!(other.replayed(), Some(false));
    assert_eq!(
        upstream.count(),
        1,
        "only the other caller's request was forwarded"
    );
    // The old scope left cookies out: a caller with the same Authorization and a cookie may be
    // this caller or another session. Neither replayed nor forwarded: 409 until released.
    let session = [("authorization", "Bearer old"), ("cookie", "session=B")];
    let cookie = post(&url, "k-old", &session).await;
    cookie.assert_status(409);
    assert_eq!(cookie.error_type(), Some("outcome_unknown"));
    assert!(
        !cookie.text().contains("before the upgrade\"}"),
        "no stored body"
    );
    assert_eq!(upstream.count(), 1);

    // New records are keyed: not the plain hash of the credentials.
    post(&url, "k-new", &[("authorization", "Bearer new")]).await;
    let report: Value = get(&proxy.admin_url("/admin/keys/k-new")).await.json();
    let scope = report["records"][0]["scope"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let mut headers = http::HeaderMap::new();
    headers.insert("authorization", "Bearer new".parse().expect("header"));
    assert!(scope.starts_with("k1:"), "{report}");
    assert!(!scope.contains(&idemproxy::key::legacy_scope(&headers, &[])));

    // Another secret would make every stored key look new: the proxy refuses to start.
    let text = proxy.config_text.replace(
        "[store]\n",
        "[store]\nscope_secret = \"a-different-secret-0123456789\"\n",
    );
    let dir = proxy.shutdown().await;
    let config = idemproxy::config::Config::from_toml(&text, "test.toml").expect("config");
    let err = idemproxy::server::Server::start(config)
        .await
        .err()
        .expect("refused");
    assert!(
        format!("{err:#}").contains("another scope secret"),
        "{err:#}"
    );
    drop(dir);
}

/// The fingerprint the proxy computes for `post(.., &[])` on the charges route (by asking
/// `explain`, which runs the same code).
async fn fingerprint_of(dir: &TestDir, upstream: &RecordingUpstream) -> String {
    let path = dir.write_config_as("explain.toml", &config(upstream, "", "", CHARGES));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["explain", "--config"])
        .arg(&path)
        .args([
            "POST",
            "/api/v1/charges",
            "-H",
            "Content-Type: application/json",
        ])
        .args(["--body", r#"{"amount":1}"#])
        .output()
        .expect("run explain");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("fingerprint:"))
        .map(|f| f.trim().to_owned())
        .unwrap_or_else(|| panic!("no fingerprint in {text}"))
}

#[tokio::test]
async fn case_variants_of_routes_and_methods_are_refused_never_forwarded() {
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&upstream, "", "", CHARGES)).await;
    let upper = post(&proxy.url("/api/V1/Charges"), "k-case", &[]).await;
    upper.assert_status(400);
    assert_eq!(upper.error_type(), Some("bad_path"));
    let lower = common::request(
        "post",
        &proxy.url("/api/v1/charges"),
        &[("idempotency-key", "k-case")],
        "{}",
    )
    .await;
    lower.assert_status(400);
    assert_eq!(lower.error_type(), Some("bad_method"));
    assert_eq!(upstream.count(), 0, "nothing reached the upstream");
    post(&proxy.url("/api/v1/charges"), "k-case", &[])
        .await
        .assert_status(200);
    assert_eq!(upstream.count(), 1);
}
