//! @hubspot/mcp-server through the shipped config, against a fake HubSpot.

use super::*;

const NOW: &str = "2026-11-30T00:00:00.000Z";

/// The fake HubSpot's records. Contact 901 exists from the start.
#[derive(Default)]
struct Hub {
    contacts: Vec<Value>,
    engagements: Vec<Value>,
    /// Every engagement PATCH body, in the order applied.
    engagement_updates: Vec<Value>,
    token_reads: u64,
    /// Hold batch creates and engagement updates until the test releases them.
    hold: bool,
    /// The markers whose one lost answer was lost already.
    lost: HashSet<String>,
}

fn contact(id: &str, properties: &Value) -> Value {
    json!({"id": id, "properties": properties, "createdAt": NOW, "updatedAt": NOW, "archived": false})
}

/// A fake HubSpot for the calls @hubspot/mcp-server makes. A batch create whose first email is
/// `lost@...` is applied and its answer lost; one with `vanished@...` is lost before it is
/// applied; one with `busy@...` is refused 429; an engagement with the body "lost note" is
/// applied and its answer lost (each once).
async fn fake_hubspot() -> (RecordingUpstream, Arc<Mutex<Hub>>) {
    let state = Arc::new(Mutex::new(Hub {
        contacts: vec![contact(
            "901",
            &json!({"email": "ada@example.com", "firstname": "Ada"}),
        )],
        ..Hub::default()
    }));
    let s = state.clone();
    let api = RecordingUpstream::builder()
        .handler(move |rec, _| {
            let mut s = lock(&s);
            let body: Value = serde_json::from_slice(&rec.body).unwrap_or(Value::Null);
            let path = rec.path().to_owned();
            let not_found = Reply::json(
                404,
                &json!({"status": "error", "message": "Object not found", "category": "OBJECT_NOT_FOUND"}),
            );
            let hold = |reply: Reply, hold: bool| if hold { reply.held() } else { reply };
            match (rec.method.as_str(), path.as_str()) {
                ("POST", "/oauth/v2/private-apps/get/access-token-info") => {
                    s.token_reads += 1;
                    Reply::json(200, &json!({
                        "token": body["tokenKey"], "user": "agent@example.com", "hubId": 123,
                        "appId": 456, "userId": 77, "scopes": ["crm.objects.contacts.write"],
                        "tokenType": "ACCESS_TOKEN", "reads": s.token_reads,
                    }))
                }
                ("GET", "/account-info/v3/details") => Reply::json(
                    200,
                    &json!({"portalId": 123, "uiDomain": "app.hubspot.com", "timeZone": "US/Eastern"}),
                ),
                ("GET", p) if p.starts_with("/crm/v3/owners/") => Reply::json(
                    200,
                    &json!({"id": "77", "userId": 77, "email": "agent@example.com"}),
                ),
                ("POST", "/crm/v3/objects/contacts/batch/create") => {
                    let email = body["inputs"][0]["properties"]["email"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    if email.starts_with("vanished@") && s.lost.insert(email.clone()) {
                        return Reply::drop_connection();
                    }
                    if email.starts_with("busy@") && s.lost.insert(email.clone()) {
                        return Reply::json(429, &json!({
                            "status": "error", "message": "You have reached your secondly limit.",
                            "errorType": "RATE_LIMIT", "category": "RATE_LIMITS",
                        }));
                    }
                    let mut results = Vec::new();
                    for input in body["inputs"].as_array().into_iter().flatten() {
                        let c = contact(&(1000 + s.contacts.len()).to_string(), &input["properties"]);
                        s.contacts.push(c.clone());
                        results.push(c);
                    }
                    if email.starts_with("lost@") && s.lost.insert(email) {
                        return Reply::drop_connection();
                    }
                    let reply = Reply::json(201, &json!({
                        "status": "COMPLETE", "results": results, "startedAt": NOW, "completedAt": NOW,
                    }));
                    hold(reply, s.hold)
                }
                ("GET", p) if p.starts_with("/crm/v3/objects/contacts/") => {
                    let wanted = p
                        .trim_start_matches("/crm/v3/objects/contacts/")
                        .replace("%40", "@");
                    let by_email = rec.query().is_some_and(|q| q.contains("idProperty=email"));
                    let found = s.contacts.iter().find(|c| match by_email {
                        true => c["properties"]["email"] == wanted.as_str(),
                        false => c["id"] == wanted.as_str(),
                    });
                    found.map_or(not_found, |c| Reply::json(200, c))
                }
                ("POST", "/crm/v3/objects/contacts/batch/update") => {
                    let mut results = Vec::new();
                    for input in body["inputs"].as_array().into_iter().flatten() {
                        let Some(c) = s.contacts.iter_mut().find(|c| c["id"] == input["id"]) else {
                            continue;
                        };
                        for (k, v) in input["properties"].as_object().into_iter().flatten() {
                            c["properties"][k] = v.clone();
                        }
                        results.push(c.clone());
                    }
                    Reply::json(200, &json!({
                        "status": "COMPLETE", "results": results, "startedAt": NOW, "completedAt": NOW,
                    }))
                }
                ("POST", "/engagements/v1/engagements") => {
                    let mut engagement = body["engagement"].clone();
                    engagement["id"] = (5001 + s.engagements.len() as u64).into();
                    engagement["portalId"] = 123.into();
                    let object = json!({
                        "engagement": engagement, "associations": body["associations"],
                        "attachments": [], "metadata": body["metadata"],
                    });
                    s.engagements.push(object.clone());
                    if body["metadata"]["body"] == "lost note" && s.lost.insert("lost note".into()) {
                        return Reply::drop_connection();
                    }
                    Reply::json(200, &object)
                }
                ("PATCH", p) if p.starts_with("/engagements/v1/engagements/") => {
                    let id: u64 = p.rsplit('/').next().and_then(|i| i.parse().ok()).unwrap_or(0);
                    s.engagement_updates.push(body.clone());
                    let held = s.hold;
                    let Some(e) = s.engagements.iter_mut().find(|e| e["engagement"]["id"] == id) else {
                        return not_found;
                    };
                    for (k, v) in body["metadata"].as_object().into_iter().flatten() {
                        e["metadata"][k] = v.clone();
                    }
                    hold(Reply::json(200, e), held)
                }
                _ => not_found,
            }
        })
        .start()
        .await;
    (api, state)
}

fn contacts_with(hub: &Arc<Mutex<Hub>>, email: &str) -> usize {
    lock(hub)
        .contacts
        .iter()
        .filter(|c| c["properties"]["email"] == email)
        .count()
}

pub(super) fn batch_create(email: &str, firstname: &str) -> Value {
    json!({"tool": "hubspot-batch-create-objects", "args": {
        "objectType": "contacts",
        "inputs": [{"properties": {"email": email, "firstname": firstname}}],
    }})
}

fn note(body: &str) -> Value {
    json!({"tool": "hubspot-create-engagement", "args": {
        "type": "NOTE", "ownerId": 77, "associations": {"contactIds": [901]}, "metadata": {"body": body},
    }})
}

/// The id of the first contact in a hubspot-batch-create-objects result.
pub(super) fn created_contact(r: &Value) -> String {
    assert!(!failed(r), "{r}");
    let id = json_text(r)["results"][0]["id"].clone();
    id.as_str()
        .unwrap_or_else(|| panic!("no contact id: {r}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hubspot_mcp_server_through_the_shipped_config() {
    if !python_wrappers() || !node_hubspot() {
        return;
    }
    let (api, hub) = fake_hubspot().await;
    let gate = Gate::closed();
    let dir = TestDir::new();
    let proxy = shipped_proxy(&dir, &[("HUBSPOT_API_URL", gate.url())]).await;
    let agent = Agent::new("hubspot", proxy.url("/hubspot"), &dir);
    const BATCH_CREATE: &str = "/crm/v3/objects/contacts/batch/create";
    const ENGAGEMENTS: &str = "/engagements/v1/engagements";

    // HubSpot is down (nothing listens): a readable tool error that says nothing was applied.
    let down = batch_create("down@example.com", "Dee");
    let out = agent.run(json!([down])).await;
    assert!(failed(&out[0]), "{out:?}");
    assert!(
        text(&out[0]).contains("idemproxy upstream_unreachable: "),
        "{out:?}"
    );
    assert!(text(&out[0]).contains(SAFE_LATER), "{out:?}");
    assert_eq!(api.count(), 0);
    gate.open(api.addr());

    let out = agent
        .run(json!([
            // 0: HubSpot is up: the same call goes through, once.
            down,
            // 1-2: the same note twice (the tool stamps engagement.timestamp with Date.now()).
            note("Call notes: wants the annual plan"),
            note("Call notes: wants the annual plan"),
            // 3-4: the same batch update twice.
            {"tool": "hubspot-batch-update-objects", "args": {"objectType": "contacts",
                "inputs": [{"id": "901", "properties": {"lifecyclestage": "customer"}}]}},
            {"tool": "hubspot-batch-update-objects", "args": {"objectType": "contacts",
                "inputs": [{"id": "901", "properties": {"lifecyclestage": "customer"}}]}},
            // 5-6: HubSpot creates the contact, and the answer is lost.
            batch_create("lost@example.com", "Lou"),
            batch_create("lost@example.com", "Lou"),
            // 7-8: the request is lost before HubSpot applied it.
            batch_create("vanished@example.com", "Val"),
            batch_create("vanished@example.com", "Val"),
            // 9-10: a note is created and its answer lost (engagements have no reconcile read).
            note("lost note"),
            note("lost note"),
            // 11-12: a read sent as POST, twice.
            {"tool": "hubspot-get-user-details", "args": {}},
            {"tool": "hubspot-get-user-details", "args": {}},
            // 13-14: HubSpot answers the first call 429 (another client spent the limit).
            batch_create("busy@example.com", "Bea"),
            batch_create("busy@example.com", "Bea"),
        ]))
        .await;

    created_contact(&out[0]);
    assert_eq!(contacts_with(&hub, "down@example.com"), 1, "{out:?}");
    assert_eq!(sent(&api, BATCH_CREATE, "down@example.com").len(), 1);

    // The same call twice: one effect, and the second call gets the first answer.
    let note_id = |r: &Value| {
        assert!(!failed(r), "{r}");
        json_text(r)["engagement"]["engagement"]["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("{r}"))
    };
    let engagement = note_id(&out[1]);
    assert_eq!(note_id(&out[2]), engagement, "{out:?}");
    assert_eq!(text(&out[1]), text(&out[2]), "replayed");
    assert_eq!(
        sent(&api, ENGAGEMENTS, "wants the annual plan").len(),
        1,
        "one note"
    );
    assert!(!failed(&out[3]) && !failed(&out[4]), "{out:?}");
    assert_eq!(text(&out[3]), text(&out[4]), "replayed");
    assert_eq!(
        api.count_path("/crm/v3/objects/contacts/batch/update"),
        1,
        "one update"
    );

    // Answer lost after the create: the proxy reads the contact back by email and answers the
    // call with it; the agent's second call is replayed that answer. One contact.
    let lost = created_contact(&out[5]);
    assert_eq!(created_contact(&out[6]), lost, "{out:?}");
    assert_eq!(text(&out[5]), text(&out[6]), "replayed");
    assert_eq!(
        json_text(&out[5])["results"][0]["properties"]["email"],
        "lost@example.com"
    );
    assert_eq!(contacts_with(&hub, "lost@example.com"), 1, "one contact");
    assert_eq!(sent(&api, BATCH_CREATE, "lost@example.com").len(), 1);
    assert_eq!(
        api.requests()
            .iter()
            .filter(|r| r.method == "GET" && r.path().contains("lost"))
            .count(),
        1,
        "one reconcile read"
    );

    // Lost before it landed: the read finds nothing, so the call is told what happened and
    // that sending it again is safe; the second call creates the contact. One contact.
    assert!(failed(&out[7]), "{out:?}");
    assert!(
        text(&out[7]).contains("idemproxy upstream_timeout: "),
        "{out:?}"
    );
    assert!(text(&out[7]).contains(SAFE_TO_RESEND), "{out:?}");
    let vanished = created_contact(&out[8]);
    assert_ne!(vanished, lost);
    assert_eq!(
        contacts_with(&hub, "vanished@example.com"),
        1,
        "one contact"
    );
    assert_eq!(sent(&api, BATCH_CREATE, "vanished@example.com").len(), 2);

    // A lost note cannot be read back (the v1 API has no consistent read by a property of
    // ours): both calls say the outcome is unknown and that the same call again is safe; one
    // note, never two.
    assert!(failed(&out[9]) && failed(&out[10]), "{out:?}");
    assert!(
        text(&out[9]).contains("idemproxy upstream_timeout: "),
        "{out:?}"
    );
    assert!(
        text(&out[10]).contains("idemproxy outcome_unknown: "),
        "{out:?}"
    );
    assert!(text(&out[10]).contains(SAFE_TO_RESEND), "{out:?}");
    assert_eq!(sent(&api, ENGAGEMENTS, "lost note").len(), 1, "one note");

    // Reads are never replayed: both reached HubSpot and the second shows its new answer.
    assert!(!failed(&out[11]) && !failed(&out[12]), "{out:?}");
    assert!(
        text(&out[11]).contains("\"reads\": 1"),
        "{}",
        text(&out[11])
    );
    assert!(
        text(&out[12]).contains("\"reads\": 2"),
        "{}",
        text(&out[12])
    );
    assert_eq!(
        api.count_path("/oauth/v2/private-apps/get/access-token-info"),
        2
    );

    // A 429 (another client spent the app's limit) was not processed: the app's budget pauses,
    // the create goes once more, and the agent never sees the 429. The same call again is
    // replayed.
    let limited = created_contact(&out[13]);
    assert_eq!(created_contact(&out[14]), limited, "{out:?}");
    assert_eq!(contacts_with(&hub, "busy@example.com"), 1, "one contact");
    assert_eq!(sent(&api, BATCH_CREATE, "busy@example.com").len(), 2);

    // Ten agents create the same contact at the same moment: one reaches HubSpot (held there
    // until the other nine wait at the proxy), all ten get that contact.
    lock(&hub).hold = true;
    let run = agent.spawn(ten_agents(batch_create("ten@example.com", "Tess")));
    wait_queued(&api, &proxy, 10).await;
    api.release_one();
    let out = run.await.expect("the agents ran");
    let ids: HashSet<String> = group(&out[0]).iter().map(created_contact).collect();
    lock(&hub).hold = false;
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(contacts_with(&hub, "ten@example.com"), 1, "one contact");
    assert_eq!(sent(&api, BATCH_CREATE, "ten@example.com").len(), 1);

    // Ten different updates of one engagement at once: HubSpot sees one at a time, all ten.
    lock(&hub).hold = true;
    let before = api.count();
    let updates: Vec<Value> = (0..10)
        .map(|i| json!({"tool": "hubspot-update-engagement", "args": {
            "engagementId": engagement, "metadata": {"body": format!("update {i}")}, "associations": {},
        }}))
        .collect();
    let run = agent.spawn(json!([{"parallel": updates}]));
    wait_queued(&api, &proxy, 10).await;
    release_one_by_one(&api, before).await;
    let out = run.await.expect("the agent ran");
    lock(&hub).hold = false;
    for r in group(&out[0]) {
        assert!(!failed(&r), "{r}");
        assert!(
            text(&r).contains(&format!("Successfully updated engagement {engagement}")),
            "{r}"
        );
    }
    assert_eq!(
        api.max_concurrent(&format!("{ENGAGEMENTS}/{engagement}")),
        1
    );
    let applied: HashSet<String> = lock(&hub)
        .engagement_updates
        .iter()
        .map(|b| {
            b["metadata"]["body"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(applied.len(), 10, "{applied:?}");
    assert_eq!(api.count(), before + 10);
}
