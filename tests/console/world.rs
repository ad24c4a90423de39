//! What the console tests look at: the real binary on SQLite or PostgreSQL, with an admin
//! token, in front of a recording upstream; and the night's traffic they then read in the
//! console — three writes to one contact, writes whose answer was lost, and writes whose
//! entity, key, workflow and stored answer are hostile markup.

use super::common::backend::Backend;
use super::common::*;
use serde_json::json;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

pub const TOKEN: &str = "console-test-token-5b1f";

/// Markup that would set `window.__pwned` if a page ever let it run (the entity values are
/// customer ids: the entities are `customer:` and them).
pub const HOSTILE_ENTITY: &str = "<script>window.__pwned=1</script>";
pub const HOSTILE_KEY: &str = "k\"><img/src=x/onerror=window.__pwned=2>";
pub const HOSTILE_LOST_KEY: &str = "lost-<script>window.__pwned=3</script>";
pub const JS_ENTITY: &str = "javascript:window.__pwned=4//";
pub const HOSTILE_WORKFLOW: &str = "\"><img src=x onerror=window.__pwned=5>";
pub const HOSTILE_BODY: &str = "<script>window.__pwned=6</script><img src=x onerror=\"window.__pwned=7\"><a href=\"javascript:window.__pwned=8\">x</a>";
pub const HOSTILE_HEADER: &str = "\"><img src=x onerror=window.__pwned=9>";
pub const SECRET_COOKIE: &str = "SECRET-COOKIE-0451";
pub const HOSTILE_IMG_ENTITY: &str = "\"><img src=x onerror=window.__pwned=11>";
pub const JS_KEY: &str = "javascript:window.__pwned=12//";

/// The proxy process, its upstream and its store.
pub struct World {
    pub proxy: ProxyProcess,
    pub upstream: RecordingUpstream,
    config: std::path::PathBuf,
    _backend: Backend,
    _dir: TestDir,
}

/// Charges; payments, whose lost answers are looked up again by a reconcile read (which this
/// upstream cannot answer: the key stays unknown, the read in its audit trail); refunds, in
/// observe mode.
const ROUTES: &str = r#"
[[routes]]
name = "charges"
upstream = "api"
methods = ["POST"]
path = "/v1/charges"
entity = "customer:{body.customer}"

[[routes]]
name = "payments"
upstream = "api"
methods = ["POST"]
path = "/v1/payments"
entity = "customer:{body.customer}"
reconcile = { method = "GET", path = "/v1/payments/{body.customer}", found = [200], not_found = [404], after = "0s" }

[[routes]]
name = "refunds"
upstream = "api"
methods = ["POST"]
path = "/v1/refunds"
entity = "customer:{body.customer}"
mode = "observe"
"#;

impl World {
    /// `None`: PostgreSQL is wanted and not installed (the harness said so loudly).
    pub async fn start(pg: bool) -> Option<World> {
        let backend = Backend::start(pg).await?;
        let upstream = upstream().await;
        // A short lease: a write left in flight by a killed proxy lapses within a second.
        let store = match &backend {
            Backend::Sqlite => "[store]\n".to_owned(),
            Backend::Pg(pg) => pg.store_toml(),
        } + "lease = \"1s\"\n";
        let server = format!("admin_token = \"{TOKEN}\"\n");
        let routes = format!("{CONTACTS_ROUTE}\n{ROUTES}");
        // Stored cookies too, so the console has one to hide.
        let api = "store_set_cookie = true\n";
        let toml = format!("{}\n{store}", api_config(&upstream, &server, api, &routes));
        let dir = TestDir::new();
        let config = dir.write_config(&toml);
        let proxy = ProxyProcess::spawn(&config).await;
        Some(World {
            proxy,
            upstream,
            config,
            _backend: backend,
            _dir: dir,
        })
    }

    /// A charge with `key` for `customer`.
    pub async fn charge(&self, key: &str, customer: &str) -> Resp {
        let body = json!({"customer": customer, "amount": 100});
        post_json(&self.proxy.url("/api/v1/charges"), Some(key), &body, &[]).await
    }

    /// A payment (the reconciled route) with `key` for `customer`.
    pub async fn pay(&self, key: &str, customer: &str) -> Resp {
        let body = json!({"customer": customer, "amount": 100});
        post_json(&self.proxy.url("/api/v1/payments"), Some(key), &body, &[]).await
    }

    /// How many writes with `key` the upstream received.
    pub fn sent(&self, key: &str) -> usize {
        let requests = self.upstream.requests();
        let writes = requests.iter().filter(|r| r.method == http::Method::POST);
        writes
            .filter(|r| r.header("idempotency-key") == Some(key))
            .count()
    }

    /// A charge the upstream takes and never answers, and the proxy killed while it waits: the
    /// write is left in flight, and its lease lapses (its outcome unknown).
    async fn lose_the_proxy_mid_call(&mut self) {
        let url = self.proxy.url("/api/v1/charges");
        let body = json!({"customer": "cus_3", "amount": 100}).to_string();
        let before = self.upstream.count();
        let call = tokio::spawn(async move {
            let headers = [
                ("content-type", "application/json"),
                ("idempotency-key", "hang-lapsed"),
            ];
            try_request("POST", &url, &headers, body).await
        });
        self.upstream.wait_for_requests(before + 1).await;
        self.proxy.kill().await;
        assert!(
            call.await.unwrap().is_err(),
            "the caller never got an answer"
        );
        self.proxy = ProxyProcess::spawn(&self.config).await;
        let world = &*self;
        eventually(move || async move {
            match world.state_of("hang-lapsed").await.as_str() {
                "unknown" => Ok(()),
                state => Err(format!("the lease of hang-lapsed never lapsed: {state}")),
            }
        })
        .await;
    }

    /// `GET /admin/{path}` with the token: the JSON.
    pub async fn admin(&self, path: &str) -> serde_json::Value {
        let auth = format!("Bearer {TOKEN}");
        let resp = request(
            "GET",
            &self.proxy.admin_url(path),
            &[("authorization", &auth)],
            "",
        )
        .await;
        resp.assert_status(200);
        resp.json()
    }

    /// The effective state of `key`'s first record, by the admin API.
    pub async fn state_of(&self, key: &str) -> String {
        let path = format!("/admin/keys/{}", encode(key));
        self.admin(&path).await["records"][0]["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The night: a write left in flight by a killed proxy, three writes to contact 901 (the
    /// second a retry, replayed; the third a stale version, refused), three writes whose answer
    /// was lost (one hostile), two hostile charges whose answers are stored, and a refund sent
    /// twice in observe mode. Returns once every audit row is written.
    pub async fn night(&mut self) {
        self.lose_the_proxy_mid_call().await;
        let contact = self.proxy.url("/api/contacts/901");
        let write = |key: &'static str, version: &'static str, run: &'static str| {
            let headers = [
                ("content-type", "application/json"),
                ("x-request-id", key),
                ("x-entity-version", version),
                ("x-workflow-id", run),
            ];
            let url = contact.clone();
            async move {
                let body = r#"{"properties": {"lifecyclestage": "customer"}}"#;
                request("PATCH", &url, &headers, body).await
            }
        };
        let first = write("sync-901-a", "2", "run-nightly-0200").await;
        assert_eq!((first.status, first.replayed()), (200, Some(false)));
        let retry = write("sync-901-a", "2", "run-nightly-0200").await;
        assert_eq!(retry.replayed(), Some(true));
        let stale = write("sync-901-b", "1", "run-backfill-0315").await;
        assert_eq!(stale.error_type(), Some("stale_version"));
        // Contact 902: a key and a workflow id as long as real derived ones, with no place to
        // break a line (the timeline must still fit the window).
        let long_key = format!(
            "contact:902:contact-update:{}",
            "0123456789abcdef".repeat(12)
        );
        let long_run = format!("run-{}", "9f8e7d6c5b4a".repeat(10));
        let headers = [
            ("content-type", "application/json"),
            ("x-request-id", long_key.as_str()),
            ("x-entity-version", "1"),
            ("x-workflow-id", long_run.as_str()),
        ];
        let url = self.proxy.url("/api/contacts/902");
        request("PATCH", &url, &headers, r#"{"properties": {"a": 1}}"#)
            .await
            .assert_status(200);
        assert_eq!(
            self.upstream.count_path("/contacts/901"),
            1,
            "one write reached the API"
        );

        let lost = [
            self.charge("lost-release", "cus_1").await,
            self.pay("lost-done", "cus_2").await,
            self.charge(HOSTILE_LOST_KEY, HOSTILE_ENTITY).await,
        ];
        for resp in lost {
            assert_eq!(
                resp.error_type(),
                Some("upstream_timeout"),
                "{}",
                resp.text()
            );
        }
        let body = json!({"customer": JS_ENTITY, "amount": 100});
        let headers = [("x-workflow-id", HOSTILE_WORKFLOW)];
        let stored = post_json(
            &self.proxy.url("/api/v1/charges"),
            Some(HOSTILE_KEY),
            &body,
            &headers,
        )
        .await;
        stored.assert_status(200);
        self.charge(JS_KEY, HOSTILE_IMG_ENTITY)
            .await
            .assert_status(200);
        // Observe mode sends a duplicate on, and records that enforce mode would replay it.
        let refund = json!({"customer": "cus_r", "amount": 100});
        let url = self.proxy.url("/api/v1/refunds");
        post_json(&url, Some("refund-1"), &refund, &[])
            .await
            .assert_status(200);
        let again = post_json(&url, Some("refund-1"), &refund, &[]).await;
        assert_eq!(again.header("idemproxy-observed"), Some("replay"));
        let hostile = format!("customer:{HOSTILE_ENTITY}");
        let js = format!("customer:{JS_ENTITY}");
        let img = format!("customer:{HOSTILE_IMG_ENTITY}");
        for (entity, rows) in [
            ("contact:901", 3),
            ("contact:902", 1),
            (&hostile, 1),
            (&js, 1),
            (&img, 1),
            ("customer:cus_2", 2),
            ("customer:cus_r", 2),
        ] {
            self.wait_for_history(entity, rows).await;
        }
    }

    /// Waits until the audit rows of `entity` stand for `requests` requests (they are written
    /// off the request path, alike replays folded into one row).
    pub async fn wait_for_history(&self, entity: &str, requests: i64) {
        let path = format!("/admin/entities/{}", encode(entity));
        let path = &path;
        eventually(move || async move {
            let report = self.admin(path).await;
            let rows = report["history"].as_array().cloned().unwrap_or_default();
            let seen: i64 = rows.iter().filter_map(|r| r["requests"].as_i64()).sum();
            if seen >= requests {
                Ok(())
            } else {
                Err(format!("{requests} requests of {entity}: {report}"))
            }
        })
        .await
    }
}

/// The upstream: a write whose key starts with `lost-` is taken and its connection dropped
/// the first time (its outcome unknown), answered after; one whose key starts with `hang-` is
/// never answered; the hostile charge is answered with hostile headers and body, and a cookie;
/// a read (the reconcile's) with `503`; everything else with the default echo.
async fn upstream() -> RecordingUpstream {
    let seen: Arc<Mutex<HashSet<String>>> = Arc::default();
    RecordingUpstream::builder()
        .raw_http1()
        .handler(move |rec, n| {
            if rec.method == http::Method::GET {
                return Reply::text(503, "the read replica is down");
            }
            let key = rec.header("idempotency-key").unwrap_or_default().to_owned();
            if key.starts_with("hang-") {
                return Reply::hang();
            }
            if key.starts_with("lost-") && seen.lock().unwrap().insert(key) {
                return Reply::drop_connection();
            }
            if rec.header("idempotency-key") == Some(HOSTILE_KEY) {
                return Reply::new(200)
                    .header("content-type", "text/html")
                    .header("x-evil", HOSTILE_HEADER)
                    .header("set-cookie", &format!("session={SECRET_COOKIE}; HttpOnly"))
                    .body(HOSTILE_BODY);
            }
            Reply::echo(rec, n)
        })
        .start()
        .await
}

/// `s` percent-encoded for a path segment or a query value.
pub fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}
