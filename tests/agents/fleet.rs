//! A fleet at HubSpot's rate limit, through the shipped config: ten @hubspot/mcp-server agents,
//! ten @hubspot/api-client callers and ten raw HTTP callers create contacts at once against a
//! fake HubSpot that takes ten requests a second (a fixed window, `429` past it, its
//! `X-HubSpot-RateLimit-*` headers on every answer). The proxy paces them: no `429` reaches a
//! caller, the fake refuses none, and every contact is created once.

use super::hubspot::{batch_create, created_contact};
use super::*;

/// The fake: contacts created one by one or in a batch, read by email; ten requests a second.
async fn limited_hubspot() -> (RecordingUpstream, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
    let refused = Arc::new(AtomicUsize::new(0));
    let emails: Arc<Mutex<Vec<String>>> = Arc::default();
    let (r, e) = (refused.clone(), emails.clone());
    let window: Arc<Mutex<(Option<std::time::Instant>, u128, usize)>> = Arc::default();
    let api = RecordingUpstream::builder()
        .handler(move |rec, _| {
            let mut w = lock(&window);
            let start = *w.0.get_or_insert_with(std::time::Instant::now);
            let second = start.elapsed().as_millis() / 1000;
            if second != w.1 {
                *w = (Some(start), second, 0);
            }
            let limits = |reply: Reply, left: usize| {
                reply
                    .header("x-hubspot-ratelimit-max", "10")
                    .header("x-hubspot-ratelimit-remaining", &left.to_string())
                    .header("x-hubspot-ratelimit-interval-milliseconds", "1000")
            };
            if w.2 >= 10 {
                r.fetch_add(1, Ordering::SeqCst);
                let body = json!({"status": "error", "message": "You have reached your secondly limit.", "category": "RATE_LIMITS"});
                return limits(Reply::json(429, &body), 0);
            }
            w.2 += 1;
            let left = 10 - w.2;
            let body: Value = serde_json::from_slice(&rec.body).unwrap_or(Value::Null);
            let contact = |props: &Value| {
                let email = props["email"].as_str().unwrap_or_default().to_owned();
                let mut all = lock(&e);
                all.push(email);
                json!({"id": (2000 + all.len()).to_string(), "properties": props, "createdAt": "2026-12-07T00:00:00.000Z", "updatedAt": "2026-12-07T00:00:00.000Z", "archived": false})
            };
            let reply = match (rec.method.as_str(), rec.path()) {
                ("POST", "/crm/v3/objects/contacts") => Reply::json(201, &contact(&body["properties"])),
                ("POST", "/crm/v3/objects/contacts/batch/create") => {
                    let results: Vec<Value> = body["inputs"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|i| contact(&i["properties"]))
                        .collect();
                    Reply::json(201, &json!({"status": "COMPLETE", "results": results}))
                }
                _ => Reply::json(404, &json!({"status": "error", "category": "OBJECT_NOT_FOUND"})),
            };
            limits(reply, left)
        })
        .start()
        .await;
    (api, refused, emails)
}

fn sdk_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/node/hubspot.js")
}

fn api_client_installed() -> bool {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/node");
    installed(
        "@hubspot/api-client 14.0.1 in tests/sdk/node",
        Command::new("node").current_dir(dir).args([
            "-e",
            "const v = JSON.parse(require('fs').readFileSync('node_modules/@hubspot/api-client/package.json')).version; if (v !== '14.0.1') process.exit(1)",
        ]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_at_hubspot_s_rate_limit_takes_turns() {
    if !python_wrappers() || !node_hubspot() || !api_client_installed() {
        return;
    }
    let (api, refused, emails) = limited_hubspot().await;
    let config = shipped_text(
        &[
            ("HUBSPOT_API_URL", api.url()),
            ("IDEMPROXY_LISTEN", "127.0.0.1:0".into()),
            ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".into()),
        ],
        &[(
            r#"pace = { rate = 100, per = "10s", max_wait = "30s" }"#,
            r#"pace = { rate = 10, per = "1s", max_wait = "60s" }"#,
        )],
    );
    let proxy = TestProxy::start(&config).await;
    let base = proxy.url("/hubspot");
    let dir = TestDir::new();
    let agent = Agent::new("hubspot", base.clone(), &dir);

    let mcp: Vec<Value> = (0..10)
        .map(|i| batch_create(&format!("agent-{i}@example.com"), "Agent"))
        .collect();
    let agents = agent.spawn(json!([{"agents": mcp}]));
    let script = sdk_script();
    let node_base = base.clone();
    let sdk = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(&script)
            .arg(&node_base)
            .arg("fleet")
            .env("FLEET_FROM", "0")
            .output()
            .expect("run hubspot.js")
    });
    let url = proxy.url("/hubspot/crm/v3/objects/contacts");
    let raw: Vec<_> = (0..10)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = format!(r#"{{"properties":{{"email":"raw-{i}@example.com"}}}}"#);
                let headers: [(&str, &[u8]); 2] = [
                    ("authorization", b"Bearer pat-idemproxy"),
                    ("content-type", b"application/json"),
                ];
                send(build_bytes("POST", &url, &headers, &body)).await
            })
        })
        .collect();

    for r in raw {
        let r = r.await.expect("the raw caller ran");
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let out = agents.await.expect("the agents ran");
    for r in group(&out[0]) {
        created_contact(&r);
    }
    let sdk = sdk.await.expect("the sdk ran");
    let stdout = String::from_utf8_lossy(&sdk.stdout);
    assert!(
        sdk.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&sdk.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    let results: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    for r in results["results"].as_array().expect("results") {
        assert!(r["id"].is_string(), "{results}");
    }

    assert_eq!(refused.load(Ordering::SeqCst), 0, "HubSpot refused none");
    let created = lock(&emails).clone();
    let distinct: HashSet<&String> = created.iter().collect();
    assert_eq!((created.len(), distinct.len()), (30, 30), "{created:?}");
}
