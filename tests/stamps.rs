//! Keys for callers without a run id, and creates reconciled by a stamp: a derive list falls
//! back from the run id to the intent, a key from the intent alone is a retry only within the
//! route's window, and a stamped create whose answer was lost is found by its stamp — this
//! action's, never an earlier one's. Every case counts the writes a Zendesk-like tickets API
//! received, on SQLite and PostgreSQL.

mod common;
use common::backend::Backend;
use common::*;

use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// A Zendesk-like tickets API: `POST /api/v2/tickets.json` creates a ticket (ids from 1),
/// `GET /api/v2/tickets.json?external_id=X` lists those with that `external_id`.
#[derive(Clone, Default)]
struct Tickets {
    tickets: Arc<Mutex<Vec<Value>>>,
    /// Lose the answer of the next creates (`true`), after applying them.
    lose: Arc<Mutex<VecDeque<bool>>>,
    /// Statuses the next list reads answer instead of the truth.
    reads: Arc<Mutex<VecDeque<u16>>>,
}

impl Tickets {
    async fn start(self) -> RecordingUpstream {
        RecordingUpstream::builder()
            .raw_http1()
            .handler(move |rec, _| self.answer(rec))
            .start()
            .await
    }

    fn answer(&self, rec: &Recorded) -> Reply {
        if rec.method == "GET" {
            if let Some(status) = self.reads.lock().unwrap().pop_front() {
                return Reply::json(status, &json!({"error": "down"}));
            }
            let wanted = rec
                .query()
                .and_then(|q| q.strip_prefix("external_id="))
                .unwrap_or_default()
                .to_owned();
            let found: Vec<Value> = self
                .tickets
                .lock()
                .unwrap()
                .iter()
                .filter(|t| t["external_id"] == wanted.as_str())
                .cloned()
                .collect();
            return Reply::json(200, &json!({"tickets": found, "count": found.len()}));
        }
        let mut ticket = rec.json()["ticket"].clone();
        let mut all = self.tickets.lock().unwrap();
        ticket["id"] = json!(all.len() + 1);
        all.push(ticket.clone());
        drop(all);
        match self.lose.lock().unwrap().pop_front() {
            Some(true) => Reply::drop_connection(),
            _ => Reply::json(201, &json!({ "ticket": ticket })),
        }
    }

    fn count(&self) -> usize {
        self.tickets.lock().unwrap().len()
    }

    fn external_ids(&self) -> Vec<String> {
        let all = self.tickets.lock().unwrap();
        all.iter()
            .map(|t| t["external_id"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

const ROUTES: &str = r#"
[[routes]]
name = "ticket-create"
upstream = "api"
methods = ["POST"]
path = "/api/v2/tickets.json"
key = { header = "", derive = ["{header.x-workflow-id}:{route}:{fingerprint}", "{route}:{fingerprint}"], window = "1h" }
stamp = "body.ticket.external_id"
reconcile = { path = "/api/v2/tickets.json?external_id={stamp}", answer = { ticket = "{read.tickets[0]}" }, answer_status = 201, after = "0s" }

[[routes]]
name = "ticket-create-short"
upstream = "api"
methods = ["POST"]
path = "/short/api/v2/tickets.json"
key = { header = "", derive = ["{header.x-workflow-id}:{route}:{fingerprint}", "{route}:{fingerprint}"], window = "1ms" }
stamp = "body.ticket.external_id"
reconcile = { path = "/api/v2/tickets.json?external_id={stamp}", answer = { ticket = "{read.tickets[0]}" }, answer_status = 201, after = "0s" }
"#;

async fn create(url: &str, subject: &str, extra: &[(&str, &str)]) -> Resp {
    let body = json!({"ticket": {"subject": subject, "comment": {"body": "help"}}});
    let mut headers = vec![("authorization", "Basic dDp0")];
    headers.extend_from_slice(extra);
    post_json(url, None, &body, &headers).await
}

fn is_stamp(s: &str) -> bool {
    s.strip_prefix("idem-")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

async fn scenario(pg: bool) {
    let Some(backend) = Backend::start(pg).await else {
        return;
    };
    let api = Tickets::default();
    let upstream = api.clone().start().await;
    let url_line = match &backend {
        Backend::Sqlite => String::new(),
        Backend::Pg(pg) => format!(
            "url = \"{}\"\nscope_secret = \"test-scope-secret-0123456789abcdef\"\n",
            pg.url
        ),
    };
    let config = format!(
        "{}\n[store]\n{url_line}",
        api_config(&upstream, "", "", ROUTES)
    );
    let proxy = TestProxy::start(&config).await;
    let url = proxy.url("/api/api/v2/tickets.json");

    // No run id: the key is the intent. The same call twice is one ticket, stamped.
    let first = create(&url, "printer on fire", &[]).await;
    first.assert_status(201);
    let again = create(&url, "printer on fire", &[]).await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(again.body, first.body);
    assert_eq!(api.count(), 1, "one ticket");
    let stamp = api.external_ids()[0].clone();
    assert!(is_stamp(&stamp), "stamped: {stamp:?}");
    let intent_key = first.idempotency_key().unwrap().to_owned();
    assert!(intent_key.starts_with("ticket-create:"), "{intent_key}");

    // A run id comes first when the caller sends one: another key, another ticket.
    let run = create(&url, "printer on fire", &[("x-workflow-id", "run-7")]).await;
    run.assert_status(201);
    assert!(run.idempotency_key().unwrap().starts_with("run-7:"));
    assert_eq!(api.count(), 2);
    assert_ne!(api.external_ids()[1], stamp, "another key, another stamp");

    // The caller's own external_id is kept, as sent.
    let body = json!({"ticket": {"subject": "mine", "external_id": "crm-42"}});
    post_json(&url, None, &body, &[]).await.assert_status(201);
    assert_eq!(api.external_ids()[2], "crm-42");

    // A lost answer: the read right after cannot tell (503), so the caller is told the write
    // may have happened; its retry reads by the stamp, finds the ticket and gets it as the
    // create would have answered it. One ticket.
    *api.lose.lock().unwrap() = [true].into();
    *api.reads.lock().unwrap() = [503].into();
    let lost = create(&url, "lost answer", &[]).await;
    lost.assert_status(504);
    assert_eq!(lost.error_type(), Some("upstream_timeout"));
    let retry = create(&url, "lost answer", &[]).await;
    retry.assert_status(201);
    assert_eq!(retry.header("idemproxy-reconciled"), Some("true"));
    assert_eq!(retry.json()["ticket"]["id"], 4, "{}", retry.text());
    assert_eq!(api.count(), 4, "never sent twice");
    let read = upstream.requests().into_iter().rfind(|r| r.method == "GET");
    let stamped = api.external_ids()[3].clone();
    assert_eq!(
        read.and_then(|r| r.query().map(str::to_owned)),
        Some(format!("external_id={stamped}"))
    );

    // A lost answer the read does not find: the retry creates it.
    *api.reads.lock().unwrap() = [503].into();
    *api.lose.lock().unwrap() = [true].into();
    let lost = create(&url, "lost twice", &[]).await;
    lost.assert_status(504);
    // The ticket did land; the test removes it, as if the write had not happened.
    api.tickets.lock().unwrap().pop();
    let retry = create(&url, "lost twice", &[]).await;
    retry.assert_status(201);
    assert_eq!(retry.header("idemproxy-reconciled"), None, "forwarded");
    assert_eq!(api.count(), 5);

    // Past the window an identical call is a new action: sent again, with another stamp, so
    // a reconcile of the new action cannot find the first one's ticket.
    let short = proxy.url("/api/short/api/v2/tickets.json");
    create(&short, "daily check", &[]).await.assert_status(201);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    *api.lose.lock().unwrap() = [true].into();
    *api.reads.lock().unwrap() = [503].into();
    create(&short, "daily check", &[]).await.assert_status(504);
    let ids = api.external_ids();
    let (a, b) = (&ids[ids.len() - 2], &ids[ids.len() - 1]);
    assert!(is_stamp(a) && is_stamp(b) && a != b, "{a} {b}");
    // The new action's retry finds its own ticket (7), not the first action's (6).
    let retry = create(&short, "daily check", &[]).await;
    retry.assert_status(201);
    assert_eq!(retry.json()["ticket"]["id"], 7, "{}", retry.text());
    assert_eq!(api.count(), 7);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamped_creates_on_sqlite() {
    scenario(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamped_creates_on_postgres() {
    scenario(true).await;
}
