//! n8n 2.8.4 and its built-in HubSpot, Zendesk and Stripe nodes — which call the APIs' own
//! hosts and cannot be given a base URL — through the egress listener (`HTTPS_PROXY`,
//! `NODE_EXTRA_CA_CERTS`) and the shipped `proxy.toml`, against recording fakes of the three
//! APIs: a workflow run twice (a re-delivered webhook) writes once to each, and a Stripe create
//! whose answer was dropped after Stripe applied it is retried by the node (Retry On Fail) and
//! applied once. n8n is installed by `.ci/run` from the npm registry (tests/n8n/package-lock.json).

mod common;

use common::audits::Audits;
use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

fn n8n_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/n8n/node_modules/.bin/n8n")
}

fn have_n8n() -> bool {
    installed(
        "n8n 2.8.4 in tests/n8n",
        Command::new(n8n_bin()).arg("--version"),
    )
}

/// n8n's home, its credentials for the three APIs, and how to run its commands.
struct N8n {
    home: tempfile::TempDir,
    env: Vec<(String, String)>,
}

impl N8n {
    fn new(egress: std::net::SocketAddr, ca: &Path) -> N8n {
        let home = tempfile::tempdir().expect("a home for n8n");
        let env = vec![
            ("N8N_USER_FOLDER".into(), home.path().display().to_string()),
            ("N8N_ENCRYPTION_KEY".into(), "idemproxy-test-key".into()),
            ("N8N_DIAGNOSTICS_ENABLED".into(), "false".into()),
            ("N8N_VERSION_NOTIFICATIONS_ENABLED".into(), "false".into()),
            ("HTTPS_PROXY".into(), format!("http://{egress}")),
            ("NODE_EXTRA_CA_CERTS".into(), ca.display().to_string()),
            ("NO_PROXY".into(), String::new()),
            // Its task broker listens on a fixed port (5679) unless told: two n8n at once
            // (tests in parallel) would collide.
            (
                "N8N_RUNNERS_BROKER_PORT".into(),
                unused_addr().port().to_string(),
            ),
        ];
        let n = N8n { home, env };
        let creds = json!([
            {"id": "hs1", "name": "hubspot", "type": "hubspotAppToken", "data": {"appToken": "pat-na1-test"}},
            {"id": "zd1", "name": "zendesk", "type": "zendeskApi", "data": {"subdomain": "acme", "email": "agent@example.com", "apiToken": "t0ken"}},
            {"id": "st1", "name": "stripe", "type": "stripeApi", "data": {"secretKey": "sk_test_n8n"}}
        ]);
        n.import("credentials", &creds);
        n
    }

    fn run(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(n8n_bin())
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .expect("run n8n");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    fn import(&self, what: &str, value: &Value) {
        let file = self.home.path().join(format!("{what}.json"));
        std::fs::write(&file, value.to_string()).expect("write the import");
        let input = format!("--input={}", file.display());
        let (ok, text) = self.run(&[&format!("import:{what}"), &input]);
        assert!(ok, "n8n import:{what}: {text}");
    }

    /// Runs workflow `id` to its end; whether it succeeded, and what n8n printed.
    fn execute(&self, id: &str) -> (bool, String) {
        let (ok, text) = self.run(&["execute", &format!("--id={id}"), "--rawOutput"]);
        (ok && text.contains("\"status\": \"success\""), text)
    }
}

fn node(name: &str, kind: &str, version: f64, params: Value, creds: Value, x: i64) -> Value {
    json!({"id": name, "name": name, "type": format!("n8n-nodes-base.{kind}"), "typeVersion": version,
           "position": [x, 0], "parameters": params, "credentials": creds,
           "retryOnFail": true, "maxTries": 2, "waitBetweenTries": 0})
}

/// Start → HubSpot (contact upsert) → Zendesk (ticket update) → Stripe (customer create).
fn workflow(id: &str) -> Value {
    let nodes = vec![
        json!({"id": "Start", "name": "Start", "type": "n8n-nodes-base.manualTrigger", "typeVersion": 1, "position": [0, 0], "parameters": {}}),
        node(
            "HubSpot",
            "hubspot",
            2.2,
            json!({"authentication": "appToken", "resource": "contact", "operation": "upsert", "email": "ada@example.com", "additionalFields": {"firstName": "Ada"}}),
            json!({"hubspotAppToken": {"id": "hs1", "name": "hubspot"}}),
            200,
        ),
        node(
            "Zendesk",
            "zendesk",
            1.0,
            json!({"resource": "ticket", "operation": "update", "id": "42", "updateFields": {"status": "solved"}}),
            json!({"zendeskApi": {"id": "zd1", "name": "zendesk"}}),
            400,
        ),
        node(
            "Stripe",
            "stripe",
            1.0,
            json!({"resource": "customer", "operation": "create", "name": "Ada Lovelace", "additionalFields": {"email": "ada@example.com"}}),
            json!({"stripeApi": {"id": "st1", "name": "stripe"}}),
            600,
        ),
    ];
    let link = |to: &str| json!({"main": [[{"node": to, "type": "main", "index": 0}]]});
    json!([{"id": id, "name": id, "active": false, "settings": {}, "nodes": nodes,
            "connections": {"Start": link("HubSpot"), "HubSpot": link("Zendesk"), "Zendesk": link("Stripe")}}])
}

/// Fake HubSpot: the v1 upsert answers a vid, the profile read answers the contact. With
/// `drop_first`, the first upsert is applied and its answer dropped.
async fn hubspot(drop_first: bool) -> RecordingUpstream {
    RecordingUpstream::builder()
        .raw_http1()
        .handler(move |rec, n| match rec.method.as_str() {
            "GET" => Reply::json(200, &json!({"vid": 9801, "properties": {"email": {"value": "ada@example.com"}, "firstname": {"value": "Ada"}}})),
            _ if drop_first && n == 1 => Reply::drop_connection(),
            _ => Reply::json(200, &json!({"vid": 9801, "isNew": n == 1})),
        })
        .start()
        .await
}

/// Fake Zendesk: a ticket update answers the ticket and leaves an audit with its metadata; a
/// read of the ticket answers it as the update left it, a read of its audits lists them. With
/// `drop_first`, the first update is applied and its answer dropped.
async fn zendesk(drop_first: bool) -> RecordingUpstream {
    let audits = Audits::default();
    RecordingUpstream::builder()
        .raw_http1()
        .handler(move |rec, n| {
            let ticket = json!({"id": 42, "status": "solved", "subject": "Printer"});
            match rec.method.as_str() {
                "GET" => match Audits::ticket_of(rec.path()) {
                    Some(id) => audits.reply(id, rec.query()),
                    None => Reply::json(200, &json!({ "ticket": ticket })),
                },
                _ => {
                    audits.record(42, &rec.json());
                    match drop_first && n == 1 {
                        true => Reply::drop_connection(),
                        false => Reply::json(200, &json!({"ticket": ticket, "audit": {"id": n}})),
                    }
                }
            }
        })
        .start()
        .await
}

/// Fake Stripe: creates a customer per new `Idempotency-Key` and answers a key it has seen with
/// its first answer, as Stripe does; with `drop_first`, the first create is applied and its
/// answer dropped (the connection closed).
async fn stripe(drop_first: bool) -> (RecordingUpstream, Arc<Mutex<HashMap<String, Value>>>) {
    let seen: Arc<Mutex<HashMap<String, Value>>> = Arc::default();
    let applied = seen.clone();
    let api = RecordingUpstream::builder()
        .raw_http1()
        .handler(move |rec, _| {
            let key = rec.header("idempotency-key").unwrap_or_default().to_owned();
            let mut seen = applied.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(first) = seen.get(&key) {
                return Reply::json(200, first);
            }
            let customer = json!({"id": format!("cus_{}", seen.len() + 1), "object": "customer", "name": "Ada Lovelace"});
            seen.insert(key, customer.clone());
            match drop_first && seen.len() == 1 {
                true => Reply::drop_connection(),
                false => Reply::json(200, &customer),
            }
        })
        .start()
        .await;
    (api, seen)
}

/// The three fake APIs, the shipped proxy in front of them with its egress listener on.
struct Fleet {
    hs: RecordingUpstream,
    zd: RecordingUpstream,
    st: RecordingUpstream,
    customers: Arc<Mutex<HashMap<String, Value>>>,
    proxy: TestProxy,
    ca: PathBuf,
}

/// With `drop_first`, each API applies its first write and drops the answer.
async fn fleet(drop_first: bool) -> Fleet {
    let (hs, zd) = (hubspot(drop_first).await, zendesk(drop_first).await);
    let (st, customers) = stripe(drop_first).await;
    let apis = [
        ("HUBSPOT_API_URL", hs.url()),
        ("ZENDESK_API_URL", zd.url()),
        ("STRIPE_API_URL", st.url()),
    ];
    let (proxy, ca) = shipped_egress(&apis, &[]).await;
    Fleet {
        hs,
        zd,
        st,
        customers,
        proxy,
        ca,
    }
}

impl Fleet {
    /// Runs workflow `id` `times` times in one n8n home: each run's success and output.
    async fn runs(&self, id: &'static str, times: usize) -> Vec<(bool, String)> {
        let addr = self.proxy.egress_addr.expect("egress listener");
        let ca = self.ca.clone();
        tokio::task::spawn_blocking(move || {
            let n8n = N8n::new(addr, &ca);
            n8n.import("workflow", &workflow(id));
            (0..times).map(|_| n8n.execute(id)).collect()
        })
        .await
        .expect("n8n's thread")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n8n_built_in_nodes_write_once_through_the_egress_listener() {
    if !have_n8n() {
        return;
    }
    let f = fleet(false).await;
    let runs = f.runs("wf-once", 2).await;
    let (hs, zd, st, customers) = (&f.hs, &f.zd, &f.st, &f.customers);
    // The second run is the same event delivered again.
    let outcome = ((runs[0].0, &runs[0].1), (runs[1].0, &runs[1].1));
    let ((first, a), (second, b)) = outcome;
    assert!(first, "the first run: {a}");
    assert!(second, "the second run: {b}");
    assert_eq!(hs.count_method("POST"), 1, "one HubSpot upsert");
    assert_eq!(
        hs.request(1).path(),
        "/contacts/v1/contact/createOrUpdate/email/ada@example.com"
    );
    assert_eq!(zd.count_method("PUT"), 1, "one Zendesk ticket update");
    assert_eq!(st.count_method("POST"), 1, "one Stripe create");
    assert_eq!(customers.lock().map(|c| c.len()).unwrap_or(0), 1);
    // n8n sends no key: Stripe got the proxy's, so it dedupes a re-forward itself.
    let key = st.request(1).header("idempotency-key").map(str::to_owned);
    assert!(
        key.as_deref()
            .is_some_and(|k| k.starts_with("stripe-customer-create:")),
        "{key:?}"
    );
}

/// Every API applies the write and its answer is dropped. Zendesk's is reconciled by the
/// stamp among the ticket's audits, then answered with the ticket (no second update); HubSpot's upsert, applied idempotently, is sent again when
/// the node retries (`resend_unknown`: one contact); Stripe's create is sent again with the
/// same key, which Stripe answers with the first customer. The run finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_dropped_after_each_write_settle_and_the_run_finishes() {
    if !have_n8n() {
        return;
    }
    let f = fleet(true).await;
    let runs = f.runs("wf-retry", 1).await;
    let (hs, zd, st, customers) = (&f.hs, &f.zd, &f.st, &f.customers);
    let (ok, text) = (runs[0].0, &runs[0].1);
    assert!(ok, "the run finishes: {text}");
    assert_eq!(
        zd.count_method("PUT"),
        1,
        "the ticket update was reconciled, not sent again"
    );
    assert_eq!(
        zd.count_method("GET"),
        2,
        "one reconcile read of the audits, one of the ticket for the answer"
    );
    assert_eq!(
        hs.count_method("POST"),
        2,
        "the upsert was sent again on the node's retry"
    );
    let upserts: Vec<String> = hs
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .map(|r| r.path().to_owned())
        .collect();
    assert_eq!(upserts[0], upserts[1], "the same upsert: one contact");
    // The node's retry reached Stripe again, with the same key: Stripe answered it with the
    // first (applied) customer, and no second one exists.
    assert_eq!(st.count_method("POST"), 2);
    let keys: Vec<Option<String>> = st
        .requests()
        .iter()
        .map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    assert_eq!(keys[0], keys[1], "{keys:?}");
    assert_eq!(customers.lock().map(|c| c.len()).unwrap_or(0), 1);
}
