//! mcp-zendesk through the shipped config, against a fake Zendesk.

use super::*;
use common::audits::Audits;

/// The fake Zendesk's tickets. Ticket 7 exists from the start.
#[derive(Default)]
struct Desk {
    tickets: Vec<Value>,
    /// Hold ticket creates and updates until the test releases them.
    hold: bool,
    /// The subjects whose one lost answer was lost already.
    lost: HashSet<String>,
    /// One per applied update, with its metadata (the proxy's stamp).
    audits: Audits,
}

/// `/api/v2/tickets/{id}.json` → `id`.
fn ticket_in(path: &str) -> Option<u64> {
    path.strip_prefix("/api/v2/tickets/")?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// A fake Zendesk for the calls mcp-zendesk makes, with the list by `external_id` the proxy's
/// reconcile reads. A ticket with the subject "Lost answer" is created and its answer lost;
/// one with "Vanished" is lost before it is created; one with "Rate limited" is refused 429
/// (each once). A comment "Lost comment" is added and its answer lost; "Vanished comment" is
/// lost before it is added (each once).
async fn fake_zendesk() -> (RecordingUpstream, Arc<Mutex<Desk>>) {
    let state = Arc::new(Mutex::new(Desk {
        tickets: vec![json!({
            "id": 7, "subject": "Refund request", "description": "Please refund order 1234",
            "status": "open", "priority": "normal", "external_id": null, "tags": [],
            "comments": [{"body": "Please refund order 1234", "public": true}],
        })],
        ..Desk::default()
    }));
    let s = state.clone();
    let api = RecordingUpstream::builder()
        .handler(move |rec, _| {
            let mut s = lock(&s);
            let body: Value = serde_json::from_slice(&rec.body).unwrap_or(Value::Null);
            let not_found = Reply::json(
                404,
                &json!({"error": "RecordNotFound", "description": "Not found"}),
            );
            let hold = |reply: Reply, hold: bool| if hold { reply.held() } else { reply };
            match (rec.method.as_str(), rec.path()) {
                ("POST", "/api/v2/tickets.json") => {
                    let t = &body["ticket"];
                    let subject = t["subject"].as_str().unwrap_or_default().to_owned();
                    if subject == "Vanished" && s.lost.insert(subject.clone()) {
                        return Reply::drop_connection();
                    }
                    if subject == "Rate limited" && s.lost.insert(subject.clone()) {
                        return Reply::json(429, &json!({
                            "error": "TooManyRequests", "description": "Rate limit exceeded",
                        }))
                        .header("retry-after", "1");
                    }
                    let ticket = json!({
                        "id": 100 + s.tickets.len() as u64, "subject": subject,
                        "description": t["comment"]["body"], "status": "new",
                        "priority": t["priority"], "external_id": t["external_id"],
                        "tags": t.get("tags").cloned().unwrap_or(json!([])),
                        "comments": [t["comment"]],
                    });
                    s.tickets.push(ticket.clone());
                    if subject == "Lost answer" && s.lost.insert(subject) {
                        return Reply::drop_connection();
                    }
                    hold(Reply::json(201, &json!({"ticket": ticket})), s.hold)
                }
                ("GET", "/api/v2/tickets.json") => {
                    let query = rec.query().unwrap_or_default().as_bytes();
                    let wanted = form_urlencoded::parse(query)
                        .find(|(k, _)| k == "external_id")
                        .map(|(_, v)| v.into_owned());
                    let tickets: Vec<Value> = s
                        .tickets
                        .iter()
                        .filter(|t| wanted.is_none() || t["external_id"] == wanted.as_deref().unwrap_or_default())
                        .cloned()
                        .collect();
                    Reply::json(200, &json!({
                        "tickets": tickets, "count": tickets.len(), "next_page": null, "previous_page": null,
                    }))
                }
                ("GET", p) if Audits::ticket_of(p).is_some() => {
                    s.audits.reply(Audits::ticket_of(p).unwrap_or_default(), rec.query())
                }
                ("GET", p) => match s.tickets.iter().find(|t| Some(t["id"].clone()) == ticket_in(p).map(Value::from)) {
                    Some(t) => Reply::json(200, &json!({"ticket": t})),
                    None => not_found,
                },
                ("PUT", p) => {
                    let held = s.hold;
                    let comment = body["ticket"]["comment"]["body"].as_str().unwrap_or_default().to_owned();
                    if comment == "Vanished comment" && s.lost.insert(comment.clone()) {
                        return Reply::drop_connection();
                    }
                    let lost = comment == "Lost comment" && s.lost.insert(comment);
                    let audits = s.audits.clone();
                    let Some(t) = s.tickets.iter_mut().find(|t| Some(t["id"].clone()) == ticket_in(p).map(Value::from)) else {
                        return not_found;
                    };
                    let update = &body["ticket"];
                    for field in ["status", "priority"] {
                        if let Some(v) = update.get(field) {
                            t[field] = v.clone();
                        }
                    }
                    if let (Some(comments), Some(c)) = (t["comments"].as_array_mut(), update.get("comment")) {
                        comments.push(c.clone());
                    }
                    audits.record(t["id"].as_u64().unwrap_or_default(), &body);
                    if lost {
                        return Reply::drop_connection();
                    }
                    hold(Reply::json(200, &json!({"ticket": t})), held)
                }
                _ => not_found,
            }
        })
        .start()
        .await;
    (api, state)
}

fn create_ticket(subject: &str) -> Value {
    json!({"tool": "create_ticket", "args": {
        "subject": subject, "description": format!("{subject}: details"), "priority": "high",
    }})
}

/// The ticket id in mcp-zendesk's "Ticket created successfully! Ticket ID: 101, ..." text.
fn created_ticket(r: &Value) -> u64 {
    text(r)
        .strip_prefix("Ticket created successfully! Ticket ID: ")
        .and_then(|t| t.split(',').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no ticket created: {r}"))
}

/// How many of ticket 7's comments say `body`.
fn comments_saying(desk: &Arc<Mutex<Desk>>, body: &str) -> usize {
    lock(desk).tickets[0]["comments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["body"] == body)
        .count()
}

fn tickets_titled(desk: &Arc<Mutex<Desk>>, subject: &str) -> Vec<Value> {
    lock(desk)
        .tickets
        .iter()
        .filter(|t| t["subject"] == subject)
        .cloned()
        .collect()
}

/// The ticket's status in a get_ticket result.
fn status(r: &Value) -> Value {
    json_text(r)["status"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zendesk_mcp_server_through_the_shipped_config() {
    if !python_wrappers() {
        return;
    }
    let (api, desk) = fake_zendesk().await;
    let gate = Gate::closed();
    let dir = TestDir::new();
    let proxy = shipped_proxy(&dir, &[("ZENDESK_API_URL", gate.url())]).await;
    let agent = Agent::new("zendesk", proxy.url("/zendesk"), &dir);
    const TICKETS: &str = "/api/v2/tickets.json";
    const TICKET_7: &str = "/api/v2/tickets/7.json";

    // Zendesk is down (nothing listens). mcp-zendesk hands every error back as ordinary text
    // (isError false): the text says nothing was applied and that a later retry is safe.
    let down = create_ticket("Outage");
    let out = agent.run(json!([down])).await;
    assert!(
        !failed(&out[0]),
        "mcp-zendesk reports errors as text: {out:?}"
    );
    assert!(
        text(&out[0]).starts_with("Error creating ticket: HTTP Status Error: 502"),
        "{out:?}"
    );
    assert!(
        text(&out[0]).contains("idemproxy upstream_unreachable: "),
        "{out:?}"
    );
    assert!(text(&out[0]).contains(SAFE_LATER), "{out:?}");
    assert_eq!(api.count(), 0);
    gate.open(api.addr());

    let update = json!({"tool": "update_ticket", "args": {
        "ticket_id": 7, "status": "pending", "comment": "Waiting on the customer",
    }});
    let comment = json!({"tool": "add_ticket_comment", "args": {"ticket_id": 7, "comment": "Refund approved"}});
    let get = json!({"tool": "get_ticket", "args": {"ticket_id": 7}});
    let lost_comment =
        json!({"tool": "add_ticket_comment", "args": {"ticket_id": 7, "comment": "Lost comment"}});
    let vanished_comment = json!({"tool": "add_ticket_comment", "args": {"ticket_id": 7, "comment": "Vanished comment"}});
    let out = agent
        .run(json!([
            // 0: Zendesk is up: the same call goes through, once.
            down,
            // 1-2: the same ticket twice.
            create_ticket("Printer on fire"),
            create_ticket("Printer on fire"),
            // 3-8: ticket 7 read, the same update twice, the same comment twice, read again.
            get,
            update,
            update,
            comment,
            comment,
            get,
            // 9-10: Zendesk creates the ticket, and the answer is lost.
            create_ticket("Lost answer"),
            create_ticket("Lost answer"),
            // 11-12: the request is lost before Zendesk created the ticket.
            create_ticket("Vanished"),
            create_ticket("Vanished"),
            // 13-14: Zendesk answers the first call 429 (another client spent the limit).
            create_ticket("Rate limited"),
            create_ticket("Rate limited"),
            // 15-16: Zendesk adds the comment, and the answer is lost.
            lost_comment.clone(),
            lost_comment,
            // 17-18: the comment is lost before Zendesk added it.
            vanished_comment.clone(),
            vanished_comment,
        ]))
        .await;

    created_ticket(&out[0]);
    assert_eq!(tickets_titled(&desk, "Outage").len(), 1, "{out:?}");
    assert_eq!(sent(&api, TICKETS, "Outage").len(), 1);

    // The same call twice: one effect, the second call shows the same ticket.
    let printer = created_ticket(&out[1]);
    assert_eq!(created_ticket(&out[2]), printer, "{out:?}");
    assert_eq!(
        tickets_titled(&desk, "Printer on fire").len(),
        1,
        "one ticket"
    );
    assert_eq!(sent(&api, TICKETS, "Printer on fire").len(), 1);
    for r in &out[4..=5] {
        assert_eq!(text(r), "Ticket 7 updated successfully!", "{out:?}");
    }
    assert_eq!(
        sent(&api, TICKET_7, "Waiting on the customer").len(),
        1,
        "one update"
    );
    for r in &out[6..=7] {
        assert_eq!(
            text(r),
            "Added public comment to ticket 7 successfully!",
            "{out:?}"
        );
    }
    assert_eq!(
        sent(&api, TICKET_7, "Refund approved").len(),
        1,
        "one comment"
    );
    // Reads go straight through: the second read shows the update.
    assert_eq!(
        (status(&out[3]), status(&out[8])),
        (json!("open"), json!("pending"))
    );

    // Answer lost after the create: the proxy stamped the ticket's external_id, lists tickets
    // by it, and answers the call with the ticket; the second call is replayed it.
    let lost = created_ticket(&out[9]);
    assert_eq!(created_ticket(&out[10]), lost, "{out:?}");
    let tickets = tickets_titled(&desk, "Lost answer");
    assert_eq!(tickets.len(), 1, "one ticket");
    let stamp = tickets[0]["external_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        stamp
            .strip_prefix("idem-")
            .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit())),
        "the proxy's stamp: {stamp:?}"
    );
    assert_eq!(sent(&api, TICKETS, "Lost answer").len(), 1);
    let reads: Vec<String> = api
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path() == TICKETS)
        .map(|r| r.query().unwrap_or_default().to_owned())
        .collect();
    assert!(reads.contains(&format!("external_id={stamp}")), "{reads:?}");

    // Lost before it landed: the list by the stamp finds nothing, the call is told that
    // sending it again is safe, and the second call creates the ticket. One ticket.
    assert!(
        text(&out[11]).starts_with("Error creating ticket: HTTP Status Error: 504"),
        "{out:?}"
    );
    assert!(
        text(&out[11]).contains("idemproxy upstream_timeout: "),
        "{out:?}"
    );
    assert!(text(&out[11]).contains(SAFE_TO_RESEND), "{out:?}");
    let vanished = created_ticket(&out[12]);
    assert_ne!(vanished, lost);
    assert_eq!(tickets_titled(&desk, "Vanished").len(), 1, "one ticket");
    let stamps: HashSet<String> = sent(&api, TICKETS, "Vanished")
        .iter()
        .map(|r| {
            r.json()["ticket"]["external_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(
        stamps.len(),
        2,
        "two attempts, each its own stamp: {stamps:?}"
    );

    // A 429 (another client spent the account's limit) was not processed: the account pauses
    // for its Retry-After, the create goes once more, and the agent never sees the 429. The
    // same call again is replayed.
    let limited = created_ticket(&out[13]);
    assert_eq!(created_ticket(&out[14]), limited, "{out:?}");
    assert_eq!(tickets_titled(&desk, "Rate limited").len(), 1, "one ticket");
    assert_eq!(sent(&api, TICKETS, "Rate limited").len(), 2);

    // A comment added and its answer lost: the proxy finds its stamp among ticket 7's audits
    // and answers both calls with the ticket. One comment.
    for r in &out[15..=16] {
        assert_eq!(
            text(r),
            "Added public comment to ticket 7 successfully!",
            "{out:?}"
        );
    }
    assert_eq!(comments_saying(&desk, "Lost comment"), 1, "one comment");
    assert_eq!(sent(&api, TICKET_7, "Lost comment").len(), 1);
    assert!(api
        .requests()
        .iter()
        .any(|r| r.method == "GET" && r.path() == "/api/v2/tickets/7/audits.json"));
    // Lost before it was added: not among the audits, the call is told to send it again, and
    // the second call adds it. One comment.
    assert!(
        text(&out[17]).starts_with("Error adding comment: HTTP Status Error: 504"),
        "{out:?}"
    );
    assert!(text(&out[17]).contains(SAFE_TO_RESEND), "{out:?}");
    assert_eq!(
        text(&out[18]),
        "Added public comment to ticket 7 successfully!",
        "{out:?}"
    );
    assert_eq!(comments_saying(&desk, "Vanished comment"), 1, "one comment");
    assert_eq!(sent(&api, TICKET_7, "Vanished comment").len(), 2);

    // Ten agents open the same ticket at the same moment: one ticket, all ten show it.
    lock(&desk).hold = true;
    let run = agent.spawn(ten_agents(create_ticket("Ten agents")));
    wait_queued(&api, &proxy, 10).await;
    api.release_one();
    let out = run.await.expect("the agents ran");
    let ids: HashSet<u64> = group(&out[0]).iter().map(created_ticket).collect();
    lock(&desk).hold = false;
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(tickets_titled(&desk, "Ten agents").len(), 1, "one ticket");
    assert_eq!(sent(&api, TICKETS, "Ten agents").len(), 1);

    // Ten different updates of ticket 7 at once: Zendesk sees one at a time, all ten.
    lock(&desk).hold = true;
    let before = api.count();
    let updates: Vec<Value> = (0..10)
        .map(|i| json!({"tool": "update_ticket", "args": {"ticket_id": 7, "comment": format!("note {i}")}}))
        .collect();
    let run = agent.spawn(json!([{"parallel": updates}]));
    wait_queued(&api, &proxy, 10).await;
    release_one_by_one(&api, before).await;
    let out = run.await.expect("the agent ran");
    lock(&desk).hold = false;
    for r in group(&out[0]) {
        assert_eq!(text(&r), "Ticket 7 updated successfully!", "{r}");
    }
    assert_eq!(api.max_concurrent(TICKET_7), 1);
    let notes: HashSet<Value> = lock(&desk).tickets[0]["comments"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["body"].clone())
        .filter(|b| b.as_str().is_some_and(|b| b.starts_with("note ")))
        .collect();
    assert_eq!(notes.len(), 10, "{notes:?}");
    assert_eq!(api.count(), before + 10);
}
