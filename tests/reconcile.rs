//! Reconciling unknown outcomes with the real system (SPEC "Reconciling unknown outcomes"):
//! a write whose answer was lost is looked up with the route's reconcile read — found, the key
//! completes with that answer and retries replay it; not found, the key is released and a
//! retry is forwarded; undecidable, the key stays unknown (409) and nothing is forwarded. The
//! same after a `kill -9` mid-call. Every case counts the writes the upstream received.

mod common;
use common::backend::Backend;
use common::pg::PgServer;
use common::*;

use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

/// What the fake CRM does with the next write.
#[derive(Clone, Copy, Debug)]
enum Write {
    /// Applies it and answers.
    Land,
    /// Applies it, then closes the connection: the answer is lost.
    LandLost,
    /// Closes the connection without applying it.
    Lost,
    /// Applies it and holds the answer until the test releases it.
    LandHeld,
}

/// A HubSpot-like contacts API: `POST /crm/v3/objects/contacts` creates a contact (its email is
/// its id), `GET /crm/v3/objects/contacts/{id}` reads one (`?idProperty=email` or not), `PATCH`
/// sets its properties. Writes and reads can be scripted to lose answers or fail.
#[derive(Clone, Default)]
struct Crm {
    contacts: Arc<Mutex<BTreeMap<String, Value>>>,
    writes: Arc<Mutex<VecDeque<Write>>>,
    /// Statuses the next reads answer instead of the truth.
    reads: Arc<Mutex<VecDeque<u16>>>,
}

impl Crm {
    async fn start(self) -> RecordingUpstream {
        RecordingUpstream::builder()
            .raw_http1()
            .handler(move |rec, _| self.answer(rec))
            .start()
            .await
    }

    fn script(&self, writes: &[Write]) {
        self.writes.lock().unwrap().extend(writes);
    }

    fn fail_reads(&self, statuses: &[u16]) {
        self.reads.lock().unwrap().extend(statuses);
    }

    fn contact(&self, id: &str) -> Option<Value> {
        self.contacts.lock().unwrap().get(id).cloned()
    }

    fn answer(&self, rec: &Recorded) -> Reply {
        let id = rec
            .path()
            .strip_prefix("/crm/v3/objects/contacts/")
            .map(|id| id.replace("%40", "@"));
        if rec.method == "GET" {
            if let Some(status) = self.reads.lock().unwrap().pop_front() {
                return Reply::json(status, &json!({"status": "error"}));
            }
            return match id.and_then(|id| self.contact(&id)) {
                // A session cookie on the read: not the write's, never replayed.
                Some(c) => Reply::json(200, &c).header("set-cookie", "crm_session=s3cret"),
                None => Reply::json(
                    404,
                    &json!({"status": "error", "category": "OBJECT_NOT_FOUND"}),
                ),
            };
        }
        let write = self
            .writes
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Write::Land);
        let props = rec.json()["properties"].clone();
        let id = id.unwrap_or_else(|| props["email"].as_str().unwrap_or("?").to_owned());
        if !matches!(write, Write::Lost) {
            let mut contacts = self.contacts.lock().unwrap();
            let contact = contacts
                .entry(id.clone())
                .or_insert_with(|| json!({"id": id, "properties": {}}));
            for (k, v) in props.as_object().into_iter().flatten() {
                contact["properties"][k] = v.clone();
            }
        }
        let created = if rec.method == "POST" { 201 } else { 200 };
        let answer = Reply::json(created, &self.contact(&id).unwrap_or(Value::Null));
        match write {
            Write::Land => answer,
            Write::LandHeld => answer.held(),
            Write::LandLost | Write::Lost => Reply::drop_connection(),
        }
    }
}

const ROUTES: &str = r#"
[[routes]]
name = "contact-create"
upstream = "api"
methods = ["POST"]
path = "/crm/v3/objects/contacts"
entity = "email:{body.properties.email}"
key = { header = "", derive = "{entity}:{fingerprint}" }
reconcile = { method = "GET", path = "/crm/v3/objects/contacts/{body.properties.email}?idProperty=email", found = [200], not_found = [404], after = "0s" }

[[routes]]
name = "contact-update"
upstream = "api"
methods = ["PATCH"]
path = "/crm/v3/objects/contacts/{id}"
entity = "contact:{path.id}"
key = { header = "", derive = "{header.x-workflow-id}:{entity}:{fingerprint}" }
reconcile = { path = "/crm/v3/objects/contacts/{path.id}", expect = { "body.properties.firstname" = "{body.properties.firstname}" }, after = "0s" }
"#;

fn config(upstream: &RecordingUpstream, store: &str) -> String {
    format!("{}\n{store}", api_config(upstream, "", "", ROUTES))
}

async fn create(proxy_url: &str, email: &str) -> Resp {
    create_named(proxy_url, email, "Ada").await
}

async fn create_named(proxy_url: &str, email: &str, firstname: &str) -> Resp {
    let body = json!({"properties": {"email": email, "firstname": firstname}});
    post_json(proxy_url, None, &body, &[("authorization", "Bearer t")]).await
}

/// POSTs the upstream received for this email.
fn posts(upstream: &RecordingUpstream, email: &str) -> usize {
    upstream
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.json()["properties"]["email"] == email)
        .count()
}

fn reads(upstream: &RecordingUpstream) -> usize {
    upstream.count_method("GET")
}

async fn reconciles(admin: &str, result: &str) -> u64 {
    let series =
        format!("idemproxy_reconciles_total{{route=\"contact-create\",result=\"{result}\"}}");
    metric(admin, &series).await
}

/// Found, not found, undecidable-then-found, on any store.
async fn create_scenario(store: &str) {
    let crm = Crm::default();
    let upstream = crm.clone().start().await;
    let proxy = TestProxy::start(&config(&upstream, store)).await;
    let admin = format!("http://{}", proxy.admin_addr.unwrap());
    let url = proxy.url("/api/crm/v3/objects/contacts");

    // Found: the contact was created, its answer lost. The read finds it and the caller gets
    // the contact; the retry replays it. One contact, one POST.
    crm.script(&[Write::LandLost]);
    let first = create(&url, "ada@example.com").await;
    first.assert_status(200);
    assert_eq!(first.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(first.json()["id"], "ada@example.com");
    let retry = create(&url, "ada@example.com").await;
    retry.assert_status(200);
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(
        retry.header("set-cookie"),
        None,
        "a read's cookie is not stored"
    );
    assert_eq!(retry.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(
        retry.body, first.body,
        "the retry gets the reconciled answer"
    );
    assert_eq!(posts(&upstream, "ada@example.com"), 1, "one side effect");
    let read = upstream
        .requests()
        .into_iter()
        .find(|r| r.method == "GET")
        .unwrap();
    assert_eq!(read.path(), "/crm/v3/objects/contacts/ada%40example.com");
    assert_eq!(read.query(), Some("idProperty=email"));
    assert_eq!(
        read.header("authorization"),
        Some("Bearer t"),
        "the caller's credentials"
    );
    assert_eq!(reconciles(&admin, "found").await, 1);

    // Not found: the write never landed. The key is released; the retry is forwarded and
    // creates the contact once.
    crm.script(&[Write::Lost]);
    let first = create(&url, "bob@example.com").await;
    first.assert_status(504);
    assert_eq!(first.error_type(), Some("upstream_timeout"));
    assert!(first.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("did not happen"));
    let retry = create(&url, "bob@example.com").await;
    retry.assert_status(201);
    assert_eq!(retry.replayed(), Some(false));
    assert_eq!(posts(&upstream, "bob@example.com"), 2, "forwarded again");
    assert!(
        crm.contact("bob@example.com").is_some(),
        "one contact in all"
    );
    let again = create(&url, "bob@example.com").await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(posts(&upstream, "bob@example.com"), 2);
    assert_eq!(reconciles(&admin, "not_found").await, 1);

    // Undecidable: the read fails, so the key stays unknown and a retry gets 409 — after
    // asking again (after = 0s), never forwarding. Once the read works, a retry gets the
    // contact: the SDK's own retry after a timeout gets the object.
    crm.script(&[Write::LandLost]);
    crm.fail_reads(&[500, 503]);
    let reads_before = reads(&upstream);
    let first = create(&url, "cy@example.com").await;
    first.assert_status(504);
    let retry = create(&url, "cy@example.com").await;
    retry.assert_status(409);
    assert_eq!(retry.error_type(), Some("outcome_unknown"));
    assert_eq!(posts(&upstream, "cy@example.com"), 1, "nothing forwarded");
    assert_eq!(reads(&upstream), reads_before + 2, "one read per attempt");
    assert_eq!(reconciles(&admin, "failed").await, 2);
    let healed = create(&url, "cy@example.com").await;
    healed.assert_status(200);
    assert_eq!(healed.replayed(), Some(true));
    assert_eq!(healed.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(
        healed.header("set-cookie"),
        None,
        "a read's cookie is not replayed"
    );
    assert_eq!(healed.json()["properties"]["email"], "cy@example.com");
    assert_eq!(posts(&upstream, "cy@example.com"), 1, "one side effect");
    assert_eq!(reconciles(&admin, "found").await, 2);

    // The history says what happened, in the order rows were written: each reconcile, then
    // the request it ran for (the lost forward, the refused retry, the replay).
    let key = healed.idempotency_key().unwrap().to_owned();
    let url = proxy.admin_url(&format!("/admin/keys/{}", urlencode(&key)));
    let want = [
        "reconcile_failed",
        "unknown",
        "reconcile_failed",
        "outcome_unknown",
        "reconciled_found",
        "replayed",
    ];
    let mut decisions = Vec::new();
    for _ in 0..500 {
        let shown = get(&url).await.json();
        assert_eq!(shown["records"][0]["state"], "completed", "{shown}");
        decisions = shown["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .rev()
            .map(|a| a["decision"].as_str().unwrap().to_owned())
            .collect();
        if decisions.len() >= want.len() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(decisions, want, "the audit trail of {key}");
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_creates_are_reconciled_on_sqlite() {
    create_scenario("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_creates_are_reconciled_on_postgres() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    create_scenario(&pg.store_toml()).await;
}

async fn update(url: &str, firstname: &str) -> Resp {
    let body = json!({"properties": {"firstname": firstname}});
    let headers = [("x-workflow-id", "wf-1"), ("authorization", "Bearer t")];
    request(
        "PATCH",
        url,
        &[&headers[..], &[("content-type", "application/json")]].concat(),
        body.to_string(),
    )
    .await
}

/// An update is found only when the fields it set hold: an unchanged contact counts as not
/// found, so the retry sends the update again (harmless: it sets the same fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_is_found_only_when_its_fields_hold() {
    let crm = Crm::default();
    let upstream = crm.clone().start().await;
    let proxy = TestProxy::start(&config(&upstream, "")).await;
    crm.contacts.lock().unwrap().insert(
        "42".into(),
        json!({"id": "42", "properties": {"firstname": "Old"}}),
    );
    let url = proxy.url("/api/crm/v3/objects/contacts/42");

    crm.script(&[Write::Lost]);
    let lost = update(&url, "Grace").await;
    lost.assert_status(504);
    let retry = update(&url, "Grace").await;
    retry.assert_status(200);
    assert_eq!(retry.replayed(), Some(false), "forwarded again");
    assert_eq!(
        crm.contact("42").unwrap()["properties"]["firstname"],
        "Grace"
    );
    assert_eq!(upstream.count_method("PATCH"), 2);

    crm.script(&[Write::LandLost]);
    let landed = update(&url, "Hopper").await;
    landed.assert_status(200);
    assert_eq!(landed.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(landed.json()["properties"]["firstname"], "Hopper");
    let replay = update(&url, "Hopper").await;
    assert_eq!(replay.replayed(), Some(true));
    assert_eq!(
        upstream.count_method("PATCH"),
        3,
        "the landed update is not sent again"
    );
}

/// The proxy is killed while the upstream applies a create; the restarted proxy reconciles
/// the abandoned record when the caller retries, and replays the contact.
async fn killed_mid_call(store: &str) {
    let crm = Crm::default();
    let upstream = crm.clone().start().await;
    crm.script(&[Write::LandHeld]);
    let dir = TestDir::new();
    // A short lease: on PostgreSQL the retry waits out the dead owner's lease.
    let store = match store {
        "" => "[store]\n",
        s => s,
    };
    // A short upstream timeout too: on PostgreSQL the retry also waits out the longest the
    // dead owner's call could have run (it cannot tell a dead owner from a cut-off one).
    let toml = format!(
        "{}\n{store}lease = \"1s\"\n",
        api_config(&upstream, "", "timeout = \"2s\"", ROUTES)
    );
    let cfg = dir.write_config(&toml);
    let mut process = ProxyProcess::spawn(&cfg).await;
    let url = process.url("/api/crm/v3/objects/contacts");
    let pending = tokio::spawn({
        let url = url.clone();
        async move {
            let body = json!({"properties": {"email": "dee@example.com", "firstname": "Ada"}});
            let headers = [
                ("content-type", "application/json"),
                ("authorization", "Bearer t"),
            ];
            try_request("POST", &url, &headers, body.to_string()).await
        }
    });
    upstream.wait_for_held(1).await;
    process.kill().await;
    assert!(
        pending.await.unwrap().is_err(),
        "the killed proxy cannot answer"
    );
    upstream.release_all();

    let restarted = ProxyProcess::spawn(&cfg).await;
    let retry = create(
        &restarted.url("/api/crm/v3/objects/contacts"),
        "dee@example.com",
    )
    .await;
    retry.assert_status(200);
    assert_eq!(retry.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(retry.json()["id"], "dee@example.com");
    assert_eq!(
        posts(&upstream, "dee@example.com"),
        1,
        "never forwarded again"
    );
    let again = create(
        &restarted.url("/api/crm/v3/objects/contacts"),
        "dee@example.com",
    )
    .await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(again.body, retry.body);
    assert_eq!(posts(&upstream, "dee@example.com"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_mid_call_is_reconciled_on_retry_on_sqlite() {
    killed_mid_call("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_mid_call_is_reconciled_on_retry_on_postgres() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    killed_mid_call(&pg.store_toml()).await;
}

/// With encryption at rest, a reconciled answer is stored sealed like any other: its data never
/// reaches the store's bytes, and it replays from the store after a restart.
async fn reconciled_answers_are_sealed(pg: bool) {
    const MARK: &str = "Reconciled-marker-41c7";
    let Some(backend) = Backend::start(pg).await else {
        return;
    };
    let crm = Crm::default();
    let upstream = crm.clone().start().await;
    let url_line = match &backend {
        Backend::Sqlite => String::new(),
        Backend::Pg(pg) => format!("url = \"{}\"\n", pg.url),
    };
    use base64::Engine as _;
    let key = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
    let store = format!("[store]\n{url_line}encryption_key = \"{key}\"\n");
    let proxy = TestProxy::start(&config(&upstream, &store)).await;
    let url = proxy.url("/api/crm/v3/objects/contacts");
    crm.script(&[Write::LandLost]);
    let first = create_named(&url, "sealed@example.com", MARK).await;
    first.assert_status(200);
    assert_eq!(first.header("idemproxy-reconciled"), Some("true"));
    assert!(first.text().contains(MARK));
    let places = backend.places_holding(&proxy.dir, MARK).await;
    assert!(
        places.is_empty(),
        "the reconciled answer in clear in {places:?}"
    );
    let proxy = proxy.restart().await;
    let url = proxy.url("/api/crm/v3/objects/contacts");
    let retry = create_named(&url, "sealed@example.com", MARK).await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(retry.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(posts(&upstream, "sealed@example.com"), 1);
    let dir = proxy.shutdown().await;
    let places = backend.places_holding(&dir, MARK).await;
    assert!(
        places.is_empty(),
        "the reconciled answer in clear in {places:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciled_answers_are_sealed_on_sqlite() {
    reconciled_answers_are_sealed(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciled_answers_are_sealed_on_postgres() {
    reconciled_answers_are_sealed(true).await;
}

/// Hostile values: a body value that would walk the read to another resource is refused
/// before anything is sent, and a read answered with more than `max_answer` cannot decide (the
/// key stays unknown, nothing is sent again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_reads_decide_nothing() {
    let crm = Crm::default();
    let upstream = crm.clone().start().await;
    let toml = format!(
        "{}\n",
        api_config(&upstream, "", "max_answer = \"1KiB\"", ROUTES)
    );
    let proxy = TestProxy::start(&toml).await;
    let url = proxy.url("/api/crm/v3/objects/contacts");

    let walked = create(&url, "..").await;
    walked.assert_status(400);
    assert_eq!(walked.error_type(), Some("bad_path"));
    assert_eq!(upstream.count(), 0, "nothing sent, not even the write");

    // The contact lands, its answer is lost, and the read's answer is over max_answer.
    crm.script(&[Write::LandLost]);
    let huge = "x".repeat(4096);
    let first = create_named(&url, "big@example.com", &huge).await;
    first.assert_status(504);
    let retry = create_named(&url, "big@example.com", &huge).await;
    retry.assert_status(409);
    assert_eq!(retry.error_type(), Some("outcome_unknown"));
    assert_eq!(posts(&upstream, "big@example.com"), 1, "never sent again");
    assert_eq!(reads(&upstream), 2, "one read per attempt");
}
