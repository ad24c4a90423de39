//! The official SDKs, unmodified and pinned, through a real `idemproxy serve` on the shipped
//! `proxy.toml`, against fake APIs on loopback that count side effects: stripe (Python) 16.1.0
//! (`pip install stripe==16.1.0`) and @hubspot/api-client 14.0.1 (`npm ci` in
//! `tests/sdk/node`). `.ci/run` installs both; without them these tests skip with a loud
//! banner, and fail under `CI=true`.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk")
}

fn python_stripe() -> bool {
    installed(
        "stripe==16.1.0 for python3",
        std::process::Command::new("python3").args([
            "-c",
            "import stripe; assert stripe.VERSION == '16.1.0', stripe.VERSION",
        ]),
    )
}

fn node_hubspot() -> bool {
    installed(
        "@hubspot/api-client 14.0.1 in tests/sdk/node",
        std::process::Command::new("node")
            .current_dir(sdk_dir().join("node"))
            .args([
                "-e",
                "const v = JSON.parse(require('fs').readFileSync('node_modules/@hubspot/api-client/package.json')).version; if (v !== '14.0.1') process.exit(1)",
            ]),
    )
}

/// `idemproxy serve` on the shipped proxy.toml, its APIs pointed at the fakes.
async fn shipped_proxy(dir: &TestDir, apis: &[(&str, &RecordingUpstream)]) -> ProxyProcess {
    let urls: Vec<(&str, String)> = apis.iter().map(|(var, api)| (*var, api.url())).collect();
    common::shipped_proxy(dir, &urls).await
}

/// Runs an SDK script to its end; its stdout is one JSON object.
async fn run(program: &str, script: &Path, args: &[&str]) -> Value {
    let mut command = std::process::Command::new(program);
    command
        .arg(script)
        .args(args)
        .current_dir(script.parent().unwrap_or(Path::new(".")));
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the script's thread")
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{program} {args:?} failed\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// A fake Stripe: creates objects, updates customers, and dedupes by `Idempotency-Key` as
/// Stripe does (the same key replays the first answer with `Idempotent-Replayed: true`).
/// `metadata[scenario]=dropped` is applied, then its connection dropped, once.
#[derive(Default)]
struct FakeStripe {
    by_key: HashMap<String, Value>,
    created: Vec<String>,
    dropped: bool,
}

async fn fake_stripe() -> (RecordingUpstream, Arc<Mutex<FakeStripe>>) {
    let state = Arc::new(Mutex::new(FakeStripe::default()));
    let s = state.clone();
    let upstream = RecordingUpstream::builder()
        .handler(move |rec, _| {
            let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
            let key = rec.header("idempotency-key").unwrap_or_default().to_owned();
            if let Some(v) = s.by_key.get(&key) {
                return Reply::json(200, v).header("idempotent-replayed", "true");
            }
            let form: HashMap<String, String> =
                form_urlencoded::parse(&rec.body).into_owned().collect();
            let metadata: serde_json::Map<String, Value> = form
                .iter()
                .filter_map(|(k, v)| {
                    let name = k.strip_prefix("metadata[")?.strip_suffix(']')?;
                    Some((name.to_owned(), Value::from(v.clone())))
                })
                .collect();
            let n = s.created.len() + 1;
            let (object, reply) = match rec.path() {
                "/v1/customers" => ("customer", json!({"id": format!("cus_new{n}"), "email": form.get("email")})),
                "/v1/payment_intents" => ("payment_intent", json!({
                    "id": format!("pi_{n}"), "amount": form.get("amount").and_then(|a| a.parse::<i64>().ok()),
                    "currency": form.get("currency"), "customer": form.get("customer"),
                })),
                p if p.starts_with("/v1/customers/") => {
                    let id = p.trim_start_matches("/v1/customers/");
                    let mut v = json!({"id": id, "object": "customer", "metadata": metadata});
                    v["object"] = "customer".into();
                    return Reply::json(200, &v).held();
                }
                _ => return Reply::json(404, &json!({"error": {"type": "invalid_request_error", "message": "no such path"}})),
            };
            let mut v = reply;
            v["object"] = object.into();
            v["metadata"] = Value::Object(metadata);
            let id = v["id"].as_str().unwrap_or_default().to_owned();
            s.created.push(id);
            s.by_key.insert(key, v.clone());
            if form.get("metadata[scenario]").map(String::as_str) == Some("dropped") && !s.dropped {
                s.dropped = true;
                return Reply::drop_connection();
            }
            Reply::json(200, &v)
        })
        .start()
        .await;
    (upstream, state)
}

fn created(state: &Arc<Mutex<FakeStripe>>) -> usize {
    state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .created
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_python_through_the_shipped_config() {
    if !python_stripe() {
        return;
    }
    let (api, state) = fake_stripe().await;
    let dir = TestDir::new();
    let proxy = shipped_proxy(&dir, &[("STRIPE_API_URL", &api)]).await;
    let base = proxy.url("/stripe");
    let script = sdk_dir().join("stripe_python.py");
    let py = |scenario: &'static str| {
        let (base, script) = (base.clone(), script.clone());
        async move { run("python3", &script, &[&base, scenario]).await }
    };

    // Plain create: one object, the SDK gets it.
    let out = py("create").await;
    assert_eq!(out["object"], "customer", "{out}");
    assert_eq!(created(&state), 1);

    // The answer is lost; the SDK's own retry gets the object, applied once. The proxy
    // re-forwards with the same key (Stripe dedupes by it) and keeps Stripe's replay header.
    let before = api.count();
    let out = py("dropped").await;
    assert!(
        out["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cus_new")),
        "{out}"
    );
    assert_eq!(created(&state), 2, "one side effect for the dropped create");
    assert_eq!(
        out["replayed"], "true",
        "Stripe's own replay is not overwritten: {out}"
    );
    assert_eq!(
        api.count(),
        before + 2,
        "sent, dropped, re-sent with the same key"
    );
    let sent: Vec<_> = api.requests()[before..]
        .iter()
        .map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    assert_eq!(sent[0], sent[1], "the re-forward carries the same key");

    // Two SDK calls with the same intent (fresh random SDK keys, fresh metadata[request_id]):
    // one payment intent at Stripe.
    let before = created(&state);
    let out = py("same_intent").await;
    assert_eq!(out["ids"][0], out["ids"][1], "{out}");
    assert_eq!(created(&state), before + 1);

    // Calls that differ in intent create one object each.
    let before = created(&state);
    let out = py("different_intent").await;
    let ids: std::collections::HashSet<_> = out["ids"].as_array().into_iter().flatten().collect();
    assert_eq!(ids.len(), 4, "{out}");
    assert_eq!(created(&state), before + 4);

    // A key the caller chose keeps Stripe's semantics: same key replays, another key is another
    // object, the same key with other parameters is an IdempotencyError (never forwarded).
    let before = (created(&state), api.count());
    let out = py("deliberate_key").await;
    assert_eq!(out["ids"][0], out["ids"][1], "{out}");
    assert_ne!(out["ids"][0], out["ids"][2], "{out}");
    assert_eq!(out["reused"]["class"], "IdempotencyError", "{out}");
    assert_eq!(out["reused"]["code"], "key_reused", "{out}");
    let message = out["reused"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("idemproxy key_reused: "), "{out}");
    assert_eq!(out["reused"]["status"], 400, "{out}");
    assert_eq!(out["reused"]["should_retry"], "false", "{out}");
    assert_eq!((created(&state), api.count()), (before.0 + 2, before.1 + 2));

    // Concurrent updates of one customer reach Stripe one at a time.
    let before = api.count();
    let runner = tokio::spawn(py("concurrent_updates"));
    for k in 1..=4 {
        api.wait_for_requests(before + k).await;
        api.release_one();
    }
    let out = runner.await.expect("the script ran");
    assert_eq!(out["ids"].as_array().map(Vec::len), Some(4), "{out}");
    assert_eq!(api.max_concurrent("/v1/customers/cus_1"), 1);

    // A proxy error surfaces as the SDK's typed error, with the proxy's reason, not retried.
    let before = api.count();
    let out = py("errors").await;
    let e = &out["entity_missing"];
    assert_eq!(e["class"], "InvalidRequestError", "{out}");
    assert_eq!(e["code"], "entity_missing", "{out}");
    assert_eq!(e["should_retry"], "false", "{out}");
    assert_eq!(api.count(), before, "nothing forwarded");
}

fn node_stripe() -> bool {
    installed(
        "stripe-node 23.1.0 in tests/sdk/node",
        std::process::Command::new("node")
            .current_dir(sdk_dir().join("node"))
            .args([
                "-e",
                "const v = JSON.parse(require('fs').readFileSync('node_modules/stripe/package.json')).version; if (v !== '23.1.0') process.exit(1)",
            ]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_node_through_the_shipped_config() {
    if !node_stripe() {
        return;
    }
    let (api, state) = fake_stripe().await;
    let dir = TestDir::new();
    let config = dir.path().join("shipped.toml");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml"),
        &config,
    )
    .expect("copy the shipped proxy.toml");
    let (url, store) = (api.url(), dir.db_url());
    let proxy = ProxyProcess::spawn_with_env(
        &config,
        &[
            ("STRIPE_API_URL", url.as_str()),
            ("IDEMPROXY_STORE_URL", store.as_str()),
            ("IDEMPROXY_LISTEN", "127.0.0.1:0"),
            ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0"),
            ("IDEMPROXY_STRIPE_LISTEN", "127.0.0.1:0"),
        ],
    )
    .await;
    let stripe = proxy
        .listeners()
        .other
        .first()
        .map(|(_, a)| *a)
        .expect("the Stripe listener");
    let (host, port) = (stripe.ip().to_string(), stripe.port().to_string());
    let script = sdk_dir().join("node/stripe_node.js");

    let out = run("node", &script, &[&host, &port, "same_intent"]).await;
    assert_eq!(
        out["ids"][0], out["ids"][1],
        "same intent, one object: {out}"
    );
    assert_ne!(out["ids"][0], out["ids"][2], "{out}");
    assert_eq!(created(&state), 2);
    let keys: Vec<_> = api
        .requests()
        .iter()
        .map(|r| r.header("idempotency-key").unwrap_or_default().to_owned())
        .collect();
    assert!(
        keys.iter().all(|k| !k.starts_with("stripe-node-retry-")),
        "the proxy's derived key goes to Stripe: {keys:?}"
    );

    let out = run("node", &script, &[&host, &port, "deliberate_key"]).await;
    assert_eq!(out["reused"]["type"], "StripeIdempotencyError", "{out}");
    assert_eq!(out["reused"]["code"], "key_reused", "{out}");
    assert_eq!(created(&state), 3, "the reused key was never forwarded");
}

/// A fake HubSpot: contacts created, updated (held when `X-Test-Hold` is sent), read by id or
/// by email, searched and batch-read from the current state. A create of `lost@example.com`,
/// and an update sent with `X-Test-Lose`, are applied and then their answer is lost.
async fn fake_hubspot() -> RecordingUpstream {
    let contacts: Arc<Mutex<HashMap<String, Value>>> = Arc::default();
    RecordingUpstream::builder()
        .handler(move |rec, _| {
            let mut c = contacts.lock().unwrap_or_else(|e| e.into_inner());
            let now = "2026-11-30T00:00:00.000Z";
            let object = |id: &str, props: &Value| {
                json!({"id": id, "properties": props, "createdAt": now, "updatedAt": now, "archived": false})
            };
            let body: Value = serde_json::from_slice(&rec.body).unwrap_or(Value::Null);
            let path = rec.path().to_owned();
            let lost = |reply: Reply, lose: bool| if lose { Reply::drop_connection() } else { reply };
            match (rec.method.as_str(), path.as_str()) {
                ("POST", "/crm/v3/objects/contacts") => {
                    let id = (c.len() + 100).to_string();
                    c.insert(id.clone(), body["properties"].clone());
                    let lose = body["properties"]["email"] == "lost@example.com";
                    lost(Reply::json(201, &object(&id, &body["properties"])), lose)
                }
                ("GET", p) if p.starts_with("/crm/v3/objects/contacts/") => {
                    let wanted = p.trim_start_matches("/crm/v3/objects/contacts/").replace("%40", "@");
                    let by_email = rec.query() == Some("idProperty=email");
                    let found = c.iter().find(|(id, props)| match by_email {
                        true => props["email"] == wanted.as_str(),
                        false => **id == wanted,
                    });
                    match found {
                        Some((id, props)) => Reply::json(200, &object(id, props)),
                        None => Reply::json(404, &json!({"status": "error", "message": "Object not found", "category": "OBJECT_NOT_FOUND"})),
                    }
                }
                ("POST", "/crm/v3/objects/contacts/search") => {
                    let results: Vec<Value> = c.iter().map(|(id, p)| object(id, p)).collect();
                    Reply::json(200, &json!({"total": results.len(), "results": results}))
                }
                ("POST", "/crm/v3/objects/contacts/batch/read") => {
                    let results: Vec<Value> = body["inputs"].as_array().into_iter().flatten()
                        .filter_map(|i| i["id"].as_str())
                        .map(|id| object(id, c.get(id).unwrap_or(&json!({}))))
                        .collect();
                    Reply::json(200, &json!({"status": "COMPLETE", "results": results, "startedAt": now, "completedAt": now}))
                }
                ("PATCH", p) if p.starts_with("/crm/v3/objects/contacts/") => {
                    let id = p.trim_start_matches("/crm/v3/objects/contacts/").to_owned();
                    let props = c.entry(id.clone()).or_insert_with(|| json!({}));
                    for (k, v) in body["properties"].as_object().into_iter().flatten() {
                        props[k] = v.clone();
                    }
                    let reply = Reply::json(200, &object(&id, props));
                    let reply = if rec.header("x-test-hold").is_some() { reply.held() } else { reply };
                    lost(reply, rec.header("x-test-lose").is_some())
                }
                _ => Reply::json(404, &json!({"status": "error", "message": "no such path", "category": "OBJECT_NOT_FOUND"})),
            }
        })
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hubspot_node_client_through_the_shipped_config() {
    if !node_hubspot() {
        return;
    }
    let api = fake_hubspot().await;
    let dir = TestDir::new();
    let proxy = shipped_proxy(&dir, &[("HUBSPOT_API_URL", &api)]).await;
    let base = proxy.url("/hubspot");
    let script = sdk_dir().join("node/hubspot.js");
    let js = |scenario: &'static str| {
        let (base, script) = (base.clone(), script.clone());
        async move { run("node", &script, &[&base, scenario]).await }
    };

    let out = js("create").await;
    assert!(out["id"].as_str().is_some(), "{out}");
    assert_eq!(api.count_method("POST"), 1);

    // Reads sent as POST are fresh every time: never keyed, never replayed.
    let out = js("search_is_fresh").await;
    assert_eq!(
        out["after"]["total"],
        out["before"]["total"].as_u64().unwrap_or(0) + 1,
        "{out}"
    );
    assert_eq!(out["after"]["replayed"], Value::Null, "{out}");
    assert_eq!(api.count_path("/crm/v3/objects/contacts/search"), 2);
    let out = js("batch_read_is_fresh").await;
    assert_eq!(out["before"]["firstname"], "Ada", "{out}");
    assert_eq!(out["after"]["firstname"], "Grace", "{out}");
    assert_eq!(api.count_path("/crm/v3/objects/contacts/batch/read"), 2);

    // Concurrent updates of one contact reach HubSpot one at a time.
    let before = api.count();
    let runner = tokio::spawn(js("concurrent_updates"));
    for k in 1..=4 {
        api.wait_for_requests(before + k).await;
        api.release_one();
    }
    let out = runner.await.expect("the script ran");
    assert_eq!(out["names"], json!(["n0", "n1", "n2", "n3"]));
    assert_eq!(api.max_concurrent("/crm/v3/objects/contacts/7"), 1);

    // HubSpot's answers are lost after it applied a create and an update: the shipped routes
    // read the contact back (by email, by id with the properties the update set) and the
    // client gets the contact, not an error; each write reached HubSpot once.
    let (posts, patches) = (api.count_method("POST"), api.count_method("PATCH"));
    let out = js("lost_answers").await;
    assert_eq!(out["created"]["email"], "lost@example.com", "{out}");
    assert_eq!(out["created"]["reconciled"], "true", "{out}");
    assert_eq!(out["updated"]["firstname"], "Lou", "{out}");
    assert_eq!(out["updated"]["reconciled"], "true", "{out}");
    assert_eq!(out["retried"]["replayed"], "true", "{out}");
    assert_eq!(api.count_method("POST"), posts + 1, "one create: {out}");
    assert_eq!(api.count_method("PATCH"), patches + 1, "one update: {out}");

    // A proxy error is the client's ApiException, in HubSpot's shape, with the proxy's type.
    let before = api.count();
    let out = js("errors").await;
    let e = &out["entity_missing"];
    assert_eq!(e["code"], 400, "{out}");
    assert_eq!(e["idemproxy"], "entity_missing", "{out}");
    let body: Value = match &e["body"] {
        Value::String(s) => serde_json::from_str(s).unwrap_or(Value::Null),
        v => v.clone(),
    };
    assert_eq!(body["category"], "VALIDATION_ERROR", "{out}");
    assert_eq!(body["subCategory"], "idemproxy.entity_missing", "{out}");
    assert_eq!(api.count(), before, "nothing forwarded");
}
