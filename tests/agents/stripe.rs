//! stripe-agent-toolkit through the shipped config, against a fake Stripe.

use super::*;

/// The fake Stripe's objects; like Stripe it dedupes by `Idempotency-Key` (the same key
/// replays the first answer with `Idempotent-Replayed: true`).
#[derive(Default)]
struct FakeStripe {
    by_key: HashMap<String, Value>,
    customers: Vec<Value>,
    invoice_items: Vec<Value>,
    portal_sessions: usize,
    /// 503s answered to "Outage Co" so far.
    outages: usize,
    /// "Lost Co"'s answer was lost already.
    lost: bool,
    /// Hold customer and invoice item creates until the test releases them.
    hold: bool,
}

fn form(rec: &Recorded) -> HashMap<String, String> {
    form_urlencoded::parse(&rec.body).into_owned().collect()
}

/// A fake Stripe for the calls stripe-agent-toolkit makes here. A customer named "Lost Co" is
/// created and its answer lost (once); one named "Outage Co" is answered 503 three times
/// (stripe-python's first try and its two retries), then created.
async fn fake_stripe() -> (RecordingUpstream, Arc<Mutex<FakeStripe>>) {
    let state = Arc::new(Mutex::new(FakeStripe::default()));
    let s = state.clone();
    let api = RecordingUpstream::builder()
        .entity(|rec| match form(rec).get("invoice") {
            Some(invoice) => format!("invoice:{invoice}"),
            None => rec.path().to_owned(),
        })
        .handler(move |rec, _| {
            let mut s = lock(&s);
            let key = rec.header("idempotency-key").unwrap_or_default().to_owned();
            if let Some(v) = s.by_key.get(&key).filter(|_| !key.is_empty()) {
                return Reply::json(200, v).header("idempotent-replayed", "true");
            }
            let form = form(rec);
            let field = |name: &str| form.get(name).cloned().map_or(Value::Null, Value::from);
            let hold = |reply: Reply, hold: bool| if hold { reply.held() } else { reply };
            let object = match (rec.method.as_str(), rec.path()) {
                ("POST", "/v1/customers") => {
                    if field("name") == "Outage Co" && s.outages < 3 {
                        s.outages += 1;
                        return Reply::json(503, &json!({"error": {
                            "type": "api_error", "message": "Stripe is briefly unavailable (fake outage)",
                        }}));
                    }
                    let v = json!({
                        "id": format!("cus_{}", s.customers.len() + 1), "object": "customer",
                        "name": field("name"), "email": field("email"),
                    });
                    s.customers.push(v.clone());
                    v
                }
                ("POST", "/v1/invoiceitems") => {
                    let v = json!({
                        "id": format!("ii_{}", s.invoice_items.len() + 1), "object": "invoiceitem",
                        "invoice": field("invoice"), "customer": field("customer"),
                        "price": {"id": field("price"), "object": "price"},
                    });
                    s.invoice_items.push(v.clone());
                    v
                }
                ("POST", "/v1/billing_portal/sessions") => {
                    s.portal_sessions += 1;
                    let n = s.portal_sessions;
                    json!({
                        "id": format!("bps_{n}"), "object": "billing_portal.session",
                        "customer": field("customer"), "return_url": field("return_url"),
                        "url": format!("https://billing.stripe.com/p/session/test_{n}"),
                    })
                }
                _ => {
                    return Reply::json(404, &json!({"error": {
                        "type": "invalid_request_error", "message": "Unrecognized request URL",
                    }}))
                }
            };
            s.by_key.insert(key, object.clone());
            if object["name"] == "Lost Co" && !s.lost {
                s.lost = true;
                return Reply::drop_connection();
            }
            hold(Reply::json(200, &object), s.hold)
        })
        .start()
        .await;
    (api, state)
}

fn create_customer(name: &str) -> Value {
    let email = format!("{}@example.com", name.to_lowercase().replace(' ', "."));
    json!({"tool": "create_customer", "args": {"name": name, "email": email}})
}

/// The id in a StripeAPI.run result.
fn stripe_id(r: &Value) -> String {
    assert!(!failed(r), "{r}");
    r["value"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id: {r}"))
        .to_owned()
}

fn customers_named(stripe: &Arc<Mutex<FakeStripe>>, name: &str) -> usize {
    lock(stripe)
        .customers
        .iter()
        .filter(|c| c["name"] == name)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_agent_toolkit_through_the_shipped_config() {
    if !python_wrappers() {
        return;
    }
    let (api, stripe) = fake_stripe().await;
    let gate = Gate::closed();
    let dir = TestDir::new();
    let proxy = shipped_proxy(&dir, &[("STRIPE_API_URL", gate.url())]).await;
    let agent = Agent::new("stripe", proxy.url("/stripe"), &dir);
    const CUSTOMERS: &str = "/v1/customers";

    // Stripe is down (nothing listens): stripe-python retries twice by itself (the proxy says
    // it may: Stripe-Should-Retry), then raises APIError with the proxy's words.
    let down = create_customer("Down Co");
    let out = agent.run(json!([down])).await;
    let e = &out[0]["error"];
    assert_eq!(e["class"], "APIError", "{out:?}");
    assert_eq!(e["http_status"], 502, "{out:?}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("idemproxy upstream_unreachable: "),
        "{out:?}"
    );
    assert!(message.contains(SAFE_LATER), "{out:?}");
    assert_eq!(api.count(), 0);
    gate.open(api.addr());

    let portal = json!({"tool": "create_billing_portal_session", "args": {
        "customer": "cus_1", "return_url": "https://example.com/account",
    }});
    let out = agent
        .run(json!([
            // 0: Stripe is up: the same call goes through, once.
            down,
            // 1-2: the same customer twice (stripe-python sends a fresh Idempotency-Key each time).
            create_customer("Acme"),
            create_customer("Acme"),
            // 3-4: Stripe creates the customer, and the answer is lost.
            create_customer("Lost Co"),
            create_customer("Lost Co"),
            // 5-6: Stripe answers 503 to the first call and both its retries.
            create_customer("Outage Co"),
            create_customer("Outage Co"),
            // 7-8: a billing portal session (a fresh URL, not a change) twice.
            portal,
            portal,
        ]))
        .await;

    stripe_id(&out[0]);
    assert_eq!(customers_named(&stripe, "Down Co"), 1, "{out:?}");
    assert_eq!(sent(&api, CUSTOMERS, "Down+Co").len(), 1);

    // The same call twice: one customer, the same id.
    let acme = stripe_id(&out[1]);
    assert_eq!(stripe_id(&out[2]), acme, "{out:?}");
    assert_eq!(customers_named(&stripe, "Acme"), 1, "one customer");
    assert_eq!(sent(&api, CUSTOMERS, "Acme").len(), 1);

    // Answer lost: the proxy answers 504 (retry safe), stripe-python retries with its key,
    // the proxy takes the unknown outcome over and re-sends it with its own key, Stripe
    // replays the customer. The call returns it, the second call too; one customer.
    let lost = stripe_id(&out[3]);
    assert_eq!(stripe_id(&out[4]), lost, "{out:?}");
    assert_eq!(customers_named(&stripe, "Lost Co"), 1, "one customer");
    let keys: Vec<String> = sent(&api, CUSTOMERS, "Lost+Co")
        .iter()
        .map(|r| r.header("idempotency-key").unwrap_or_default().to_owned())
        .collect();
    assert_eq!(keys.len(), 2, "sent, lost, sent again: {keys:?}");
    assert_eq!(keys[0], keys[1], "with the same key");
    assert!(
        keys[0].starts_with("stripe-customer-create:"),
        "the proxy's key: {keys:?}"
    );

    // A 503 is released, not stored: each of stripe-python's retries reached Stripe, and once
    // Stripe is back the same call creates the customer, once.
    let e = &out[5]["error"];
    assert_eq!(
        (&e["class"], &e["http_status"]),
        (&json!("APIError"), &json!(503)),
        "{out:?}"
    );
    assert!(
        e["message"]
            .as_str()
            .unwrap_or_default()
            .contains("fake outage"),
        "{out:?}"
    );
    stripe_id(&out[6]);
    assert_eq!(customers_named(&stripe, "Outage Co"), 1, "one customer");
    assert_eq!(sent(&api, CUSTOMERS, "Outage+Co").len(), 4);

    // Billing portal sessions are not replayed: two sessions, two URLs.
    assert_ne!(out[7]["value"]["url"], out[8]["value"]["url"], "{out:?}");
    assert_eq!(lock(&stripe).portal_sessions, 2);

    // Ten agents create the same customer at the same moment: one customer, all ten get it.
    lock(&stripe).hold = true;
    let run = agent.spawn(ten_agents(create_customer("Ten Agents Co")));
    wait_queued(&api, &proxy, 10).await;
    api.release_one();
    let out = run.await.expect("the agents ran");
    let ids: HashSet<String> = group(&out[0]).iter().map(stripe_id).collect();
    lock(&stripe).hold = false;
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(customers_named(&stripe, "Ten Agents Co"), 1, "one customer");
    assert_eq!(sent(&api, CUSTOMERS, "Ten+Agents+Co").len(), 1);

    // Ten different items on one invoice at once: Stripe sees one at a time, all ten.
    lock(&stripe).hold = true;
    let before = api.count();
    let items: Vec<Value> = (0..10)
        .map(|i| {
            json!({"tool": "create_invoice_item", "args": {
                "customer": "cus_1", "price": format!("price_{i}"), "invoice": "in_1",
            }})
        })
        .collect();
    let run = agent.spawn(json!([{"parallel": items}]));
    wait_queued(&api, &proxy, 10).await;
    release_one_by_one(&api, before).await;
    let out = run.await.expect("the agent ran");
    lock(&stripe).hold = false;
    let created: HashSet<String> = group(&out[0]).iter().map(stripe_id).collect();
    assert_eq!(created.len(), 10, "{out:?}");
    assert_eq!(api.max_concurrent("invoice:in_1"), 1);
    let prices: HashSet<Value> = lock(&stripe)
        .invoice_items
        .iter()
        .map(|i| i["price"]["id"].clone())
        .collect();
    assert_eq!(prices.len(), 10, "{prices:?}");
    assert_eq!(api.count(), before + 10);
}
