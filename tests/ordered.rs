//! The third layer, per-entity order (SPEC.md "Request handling" step 4): version fencing,
//! claims (claim-first) and prechecks, and a booking scenario — twenty
//! executions racing for one slot, in-process on SQLite and over two replicas on PostgreSQL.
//! Every test runs the real proxy against a real recording upstream and checks what the
//! upstream received.

mod common;
use common::pg::PgServer;
use common::*;

use percent_encoding::percent_decode_str;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// `[server]`, then `store` (a `[store]` table or nothing), `[upstreams.api]` at `/api`, `routes`.
fn config(url: &str, store: &str, routes: &str) -> String {
    format!(
        "{}\n{store}\n[upstreams.api]\nurl = \"{url}\"\nprefix = \"/api\"\n\n{routes}\n",
        server_section()
    )
}

/// The booking route `POST /bookings` on `slot:{body.slot_id}` with `extra` keys.
fn book_route(extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"book-slot\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
         path = \"/bookings\"\nentity = \"slot:{{body.slot_id}}\"\n{extra}\n"
    )
}

/// `DELETE /bookings/{slot_id}`: a 2xx releases the slot's claim.
fn cancel_route() -> &'static str {
    "[[routes]]\nname = \"cancel-booking\"\nupstream = \"api\"\nmethods = [\"DELETE\"]\n\
     path = \"/bookings/{slot_id}\"\nentity = \"slot:{path.slot_id}\"\nrelease_claim = true\n"
}

const PRECHECK: &str = "precheck = { method = \"GET\", path = \"/slots/{body.slot_id}\", \
                        expect_status = [200], expect = { \"body.status\" = \"free\" } }";

/// The booking routes: claim (for `ttl`) and precheck, plus the cancel route.
fn booking_routes(ttl: &str) -> String {
    let book = book_route(&format!("claim = true\nclaim_ttl = \"{ttl}\"\n{PRECHECK}"));
    format!("{book}\n{}", cancel_route())
}

/// The calendar's slots as the real system sees them; the test scripts them.
#[derive(Clone, Default)]
struct Slots(Arc<Mutex<HashMap<String, &'static str>>>);

impl Slots {
    fn set(&self, slot: &str, status: &'static str) {
        self.0.lock().unwrap().insert(slot.to_string(), status);
    }
}

/// A calendar API: `GET /slots/{id}` answers the slot's status (404 when unknown),
/// `POST /bookings` takes the slot with a 201 (a 500 when the body says `"fail": true`; held
/// at the upstream when `hold`), `DELETE /bookings/{id}` frees it.
async fn calendar(slots: &Slots, hold: bool) -> RecordingUpstream {
    let slots = slots.clone();
    RecordingUpstream::builder()
        .entity_json("/slot_id")
        .handler(move |rec, n| {
            let mut map = slots.0.lock().unwrap();
            let path = rec.path();
            match (rec.method.as_str(), path) {
                ("GET", _) if path.starts_with("/slots/") => {
                    let id = percent_decode_str(&path["/slots/".len()..]).decode_utf8_lossy();
                    let id = id.as_ref();
                    match map.get(id) {
                        // A calendar in maintenance: a 503 whose (cached) body says free.
                        Some(&"unavailable") => Reply::json(503, &json!({"status": "free"})),
                        Some(status) => Reply::json(200, &json!({"id": id, "status": status})),
                        None => Reply::json(404, &json!({"error": "no such slot"})),
                    }
                }
                ("POST", "/bookings") => {
                    let body = rec.json();
                    if body["fail"] == json!(true) {
                        return Reply::json(500, &json!({"error": "calendar down"}));
                    }
                    let slot = body["slot_id"].as_str().unwrap_or_default().to_string();
                    map.insert(slot.clone(), "taken");
                    let reply = Reply::json(201, &json!({"booking": n, "slot_id": slot}));
                    if hold {
                        reply.held()
                    } else {
                        reply
                    }
                }
                ("DELETE", _) if path.starts_with("/bookings/") => {
                    map.insert(path["/bookings/".len()..].to_string(), "free");
                    Reply::json(200, &json!({"cancelled": n}))
                }
                _ => Reply::echo(rec, n),
            }
        })
        .start()
        .await
}

/// `POST base/api/bookings` for `slot` with `Idempotency-Key: key` and `headers`.
async fn book(base: &str, key: &str, slot: &str, headers: &[(&str, &str)]) -> Resp {
    let url = format!("{base}/api/bookings");
    post_json(&url, Some(key), &json!({"slot_id": slot}), headers).await
}

/// `DELETE base/api/bookings/{slot}` with `Idempotency-Key: key`.
async fn cancel(base: &str, key: &str, slot: &str) -> Resp {
    let url = format!("{base}/api/bookings/{slot}");
    request("DELETE", &url, &[("idempotency-key", key)], "").await
}

/// Asserts a proxy-made error (status, `Idemproxy-Error`, JSON type) and returns `error`.
#[track_caller]
fn assert_error(resp: &Resp, status: u16, kind: &str) -> Value {
    resp.assert_status(status);
    assert_eq!(resp.error_type(), Some(kind), "body {:?}", resp.text());
    let v = resp.json();
    assert_eq!(v["error"]["type"], kind, "{v}");
    v["error"].clone()
}

/// `GET admin/admin/entities/{entity}`.
async fn entity_report(admin: &str, entity: &str) -> Value {
    let resp = get(&format!("{admin}/admin/entities/{entity}")).await;
    resp.assert_status(200);
    resp.json()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn base(addr: std::net::SocketAddr) -> String {
    format!("http://{addr}")
}

#[tokio::test]
async fn version_fencing_rejects_stale_writes_per_entity() {
    let upstream = RecordingUpstream::with_handler(|rec, n| match n {
        // The first v3 write fails at the upstream: it must not count as accepted.
        3 => Reply::json(500, &json!({"error": "boom"})),
        _ => Reply::echo(rec, n),
    })
    .await;
    let routes =
        "[[routes]]\nname = \"contact-update\"\nupstream = \"api\"\nmethods = [\"PATCH\"]\n\
                  path = \"/contacts/{id}\"\nentity = \"contact:{path.id}\"\n\
                  version = \"{header.x-entity-version}\"\n";
    let proxy = TestProxy::start(&config(&upstream.url(), "", routes)).await;
    let patch = |contact: &str, key: &str, version: Option<&str>| {
        let url = proxy.url(&format!("/api/contacts/{contact}"));
        let (key, version) = (key.to_string(), version.map(str::to_string));
        async move {
            let mut headers = vec![
                ("content-type", "application/json"),
                ("idempotency-key", key.as_str()),
            ];
            if let Some(v) = &version {
                headers.push(("x-entity-version", v.as_str()));
            }
            let body = json!({"properties": {"email": format!("{key}@example.com")}});
            request("PATCH", &url, &headers, body.to_string()).await
        }
    };

    patch("1", "v1", Some("1")).await.assert_status(200);
    patch("1", "v2", Some("2")).await.assert_status(200);
    assert_eq!(upstream.count(), 2);
    assert_eq!(upstream.request(2).header("x-entity-version"), Some("2"));
    assert_eq!(upstream.request(2).path(), "/contacts/1");

    let late = patch("1", "v1-late", Some("1")).await;
    let e = assert_error(&late, 409, "stale_version");
    assert_eq!(e["current_version"], 2, "{e}");
    assert_eq!(e["entity"], "contact:1", "{e}");
    let equal = patch("1", "v2-again", Some("2")).await;
    assert_error(&equal, 409, "stale_version");
    assert_error(&patch("1", "none", None).await, 400, "version_missing");
    assert_error(
        &patch("1", "text", Some("two")).await,
        400,
        "version_missing",
    );
    assert_eq!(upstream.count(), 2, "nothing refused reaches the upstream");

    // A non-2xx answer is stored for its key but does not advance the version.
    let failed = patch("1", "v3-a", Some("3")).await;
    failed.assert_status(500);
    assert_eq!(failed.error_type(), None, "the upstream's own answer");
    assert_eq!(upstream.count(), 3);
    let replayed = patch("1", "v3-a", Some("3")).await;
    assert_eq!((replayed.status, replayed.replayed()), (500, Some(true)));
    patch("1", "v3-b", Some("3")).await.assert_status(200);
    assert_eq!(upstream.count(), 4, "v3 with a new key is forwarded again");
    assert_eq!(upstream.request(4).header("idempotency-key"), Some("v3-b"));
    assert_error(&patch("1", "v3-c", Some("3")).await, 409, "stale_version");

    // Versions are per entity: contact 2 starts from nothing.
    patch("2", "c2-v1", Some("1")).await.assert_status(200);
    assert_eq!(upstream.count(), 5);
    assert_eq!(upstream.request(5).path(), "/contacts/2");
    let admin = base(proxy.admin_addr.unwrap());
    assert_eq!(entity_report(&admin, "contact:1").await["version"], 3);
    assert_eq!(entity_report(&admin, "contact:2").await["version"], 1);
}

#[tokio::test]
async fn a_claim_belongs_to_the_first_key_until_released() {
    let slots = Slots::default();
    let upstream = calendar(&slots, false).await;
    let routes = format!(
        "{}\n{}",
        book_route("claim = true\nclaim_ttl = \"1h\""),
        cancel_route()
    );
    let proxy = TestProxy::start(&config(&upstream.url(), "", &routes)).await;
    let main = base(proxy.main_addr);
    let admin = base(proxy.admin_addr.unwrap());
    let posts = || upstream.count_method("POST");

    let first = book(&main, "exec-a", "s1", &[]).await;
    first.assert_status(201);
    assert_eq!(posts(), 1);
    let e = assert_error(
        &book(&main, "exec-b", "s1", &[]).await,
        409,
        "entity_claimed",
    );
    assert_eq!(e["entity"], "slot:s1", "{e}");
    assert_eq!(posts(), 1, "another key never reaches the upstream");
    let retry = book(&main, "exec-a", "s1", &[]).await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!((retry.status, &retry.body), (201, &first.body));
    assert_eq!(posts(), 1);
    let claim = &entity_report(&admin, "slot:s1").await["claim"];
    assert_eq!(claim["key"], "exec-a", "{claim}");

    // The cancel route's 2xx releases the claim.
    cancel(&main, "cancel-1", "s1").await.assert_status(200);
    assert_eq!(upstream.count_method("DELETE"), 1);
    assert_eq!(entity_report(&admin, "slot:s1").await["claim"], Value::Null);
    book(&main, "exec-b", "s1", &[]).await.assert_status(201);
    assert_eq!(posts(), 2);
    assert_error(
        &book(&main, "exec-c", "s1", &[]).await,
        409,
        "entity_claimed",
    );

    // So does the operator.
    let url = format!("{admin}/admin/claims/slot:s1");
    let released = request("DELETE", &url, &[], "").await;
    assert_eq!(released.assert_status(200).json()["released"], true);
    book(&main, "exec-c", "s1", &[]).await.assert_status(201);
    assert_eq!(posts(), 3);
    assert_eq!(
        upstream.request(upstream.count() as u64).json()["slot_id"],
        "s1"
    );

    // A failed booking claims nothing.
    let url = proxy.url("/api/bookings");
    let fail = json!({"slot_id": "s2", "fail": true});
    let failed = post_json(&url, Some("exec-d"), &fail, &[]).await;
    failed.assert_status(500);
    assert_eq!(posts(), 4);
    book(&main, "exec-e", "s2", &[]).await.assert_status(201);
    assert_eq!(posts(), 5, "the slot was still free after the 500");
    assert_error(
        &book(&main, "exec-f", "s2", &[]).await,
        409,
        "entity_claimed",
    );
    assert_eq!(posts(), 5);
}

#[tokio::test]
async fn a_claim_lapses_after_its_ttl() {
    let slots = Slots::default();
    let upstream = calendar(&slots, false).await;
    let routes = book_route("claim = true\nclaim_ttl = \"300ms\"");
    let proxy = TestProxy::start(&config(&upstream.url(), "", &routes)).await;
    let main = base(proxy.main_addr);
    let admin = base(proxy.admin_addr.unwrap());

    book(&main, "ttl-a", "s1", &[]).await.assert_status(201);
    assert_error(
        &book(&main, "ttl-b", "s1", &[]).await,
        409,
        "entity_claimed",
    );
    assert_eq!(upstream.count_method("POST"), 1);
    let until = entity_report(&admin, "slot:s1").await["claim"]["until_ms"]
        .as_i64()
        .expect("a claim with until_ms");
    wait_until(|| now_ms() > until, WAIT, "the claim lapsed").await;
    let lapsed = entity_report(&admin, "slot:s1").await;
    assert_eq!(
        lapsed["claim"],
        Value::Null,
        "a lapsed claim is not shown: {lapsed}"
    );
    book(&main, "ttl-b", "s1", &[]).await.assert_status(201);
    assert_eq!(upstream.count_method("POST"), 2);
    let claim = &entity_report(&admin, "slot:s1").await["claim"];
    assert_eq!(
        claim["key"], "ttl-b",
        "the new booking owns the slot: {claim}"
    );
}

#[tokio::test]
async fn prechecks_reread_the_slot_right_before_the_write() {
    let slots = Slots::default();
    let upstream = calendar(&slots, false).await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", &book_route(PRECHECK))).await;
    let main = base(proxy.main_addr);
    let auth = [("authorization", "Bearer tok-1")];
    slots.set("p1", "free");
    slots.set("p2", "taken");

    book(&main, "pc-1", "p1", &auth).await.assert_status(201);
    let seen: Vec<(String, String)> = upstream
        .requests()
        .iter()
        .map(|r| (r.method.to_string(), r.path().to_string()))
        .collect();
    let expected = [("GET", "/slots/p1"), ("POST", "/bookings")];
    assert_eq!(seen, expected.map(|(m, p)| (m.to_string(), p.to_string())));
    assert_eq!(
        upstream.request(1).header("authorization"),
        Some("Bearer tok-1")
    );
    assert_eq!(upstream.request(2).json(), json!({"slot_id": "p1"}));

    let taken = book(&main, "pc-2", "p2", &auth).await;
    let e = assert_error(&taken, 409, "precheck_failed");
    assert_eq!(e["precheck"]["seen"]["body.status"], "taken", "{e}");
    assert_eq!(e["precheck"]["status"], 200, "{e}");
    assert_eq!(e["precheck"]["path"], "/slots/p2", "{e}");
    assert_eq!(upstream.count_method("POST"), 1, "not forwarded");
    assert_eq!(upstream.count_path("/slots/p2"), 1);

    let missing = book(&main, "pc-3", "p3", &auth).await;
    let e = assert_error(&missing, 409, "precheck_failed");
    assert_eq!(e["precheck"]["status"], 404, "{e}");
    assert_eq!(e["precheck"]["seen"]["body.status"], Value::Null, "{e}");
    slots.set("p4", "unavailable");
    let unavailable = book(&main, "pc-4", "p4", &auth).await;
    let e = assert_error(&unavailable, 409, "precheck_failed");
    assert_eq!(
        e["precheck"]["status"], 503,
        "the status is checked too: {e}"
    );
    assert_eq!(e["precheck"]["seen"]["body.status"], "free", "{e}");
    assert_eq!(upstream.count_method("POST"), 1, "not forwarded");

    // A refused key was not stored: once the slot is free, the same key books.
    slots.set("p2", "free");
    let again = book(&main, "pc-2", "p2", &auth).await;
    assert_eq!((again.status, again.replayed()), (201, Some(false)));
    assert_eq!(upstream.count_method("POST"), 2);
    assert_eq!(upstream.count_method("GET"), 5);
}

#[tokio::test]
async fn precheck_paths_carry_a_body_value_as_one_segment() {
    let slots = Slots::default();
    let upstream = calendar(&slots, false).await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", &book_route(PRECHECK))).await;
    let main = base(proxy.main_addr);
    // Legitimate ids that are not URL-safe: re-read exactly that slot, never another.
    for (i, (slot, seen)) in [("room 7", "/slots/room%207"), ("7?v=2", "/slots/7%3Fv%3D2")]
        .into_iter()
        .enumerate()
    {
        slots.set(slot, "free");
        slots.set("7", "taken");
        let booked = book(&main, &format!("enc-{i}"), slot, &[]).await;
        assert_eq!(booked.status, 201, "{slot:?}: {}", booked.text());
        let get = &upstream.requests()[upstream.count() - 2];
        assert_eq!(get.path_and_query, seen, "{slot:?}");
        assert_eq!(
            upstream.request(upstream.count() as u64).json()["slot_id"],
            slot
        );
    }
    assert_eq!(upstream.count_method("POST"), 2);
}

/// Reads a gauge's value from `/metrics` text.
fn gauge(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

/// Waits until `n` requests wait on a key or entity lock, summed over the admin listeners.
async fn wait_for_waiting(admins: &[String], n: u64) {
    eventually(|| async {
        let mut sum = 0;
        for a in admins {
            sum += gauge(
                &get(&format!("{a}/metrics")).await.text(),
                "idemproxy_waiting",
            );
        }
        match sum >= n {
            true => Ok(()),
            false => Err(format!("{sum} of {n} requests waiting")),
        }
    })
    .await
}

/// The booking scenario: twenty executions (different keys) book one slot at once, spread over
/// `mains`; exactly one booking reaches the calendar, the rest get `entity_claimed`; the
/// winner's retry replays; a cancel frees the slot and the next booking succeeds.
async fn booking_scenario(
    upstream: &RecordingUpstream,
    slots: &Slots,
    mains: &[String],
    admins: &[String],
) {
    let slot = "slot-42";
    slots.set(slot, "free");
    let mut tasks = Vec::new();
    for i in 0..20 {
        let main = mains[i % mains.len()].clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("exec-{i}");
            let resp = book(&main, &key, slot, &[]).await;
            (key, resp)
        }));
    }
    upstream.wait_for_held(1).await;
    wait_for_waiting(admins, 19).await;
    upstream.release_all();
    let mut winners = Vec::new();
    for t in tasks {
        let (key, resp) = t.await.unwrap();
        if resp.status == 201 {
            winners.push((key, resp));
        } else {
            assert_error(&resp, 409, "entity_claimed");
        }
    }
    assert_eq!(winners.len(), 1, "exactly one execution booked");
    assert_eq!(
        upstream.count_method("POST"),
        1,
        "one booking reached the calendar"
    );
    assert_eq!(
        upstream.count_method("GET"),
        1,
        "the claim is checked before the precheck"
    );
    let (winner, won) = &winners[0];

    let retry = book(mains.last().unwrap(), winner, slot, &[]).await;
    assert_eq!((retry.replayed(), &retry.body), (Some(true), &won.body));
    assert_eq!(upstream.count_method("POST"), 1);

    cancel(mains.last().unwrap(), "cancel-42", slot)
        .await
        .assert_status(200);
    assert_eq!(upstream.count_method("DELETE"), 1);
    let next = book(&mains[0], "exec-next", slot, &[]).await;
    assert_eq!((next.status, next.replayed()), (201, Some(false)));
    assert_eq!(upstream.count_method("POST"), 2);
    assert_eq!(upstream.max_concurrent(slot), 1);
    let loser = if winner == "exec-0" {
        "exec-1"
    } else {
        "exec-0"
    };
    assert_error(
        &book(&mains[0], loser, slot, &[]).await,
        409,
        "entity_claimed",
    );
    assert_eq!(upstream.count_method("POST"), 2);

    // The audit trail, from any replica: 3 forwards (booking, cancel, booking), 1 replay,
    // 20 refusals.
    let counts = eventually(|| async {
        let report = entity_report(&admins[0], &format!("slot:{slot}")).await;
        let mut counts = HashMap::new();
        for row in report["history"].as_array().unwrap() {
            let decision = row["decision"].as_str().unwrap().to_string();
            // A row stands for `requests` requests (one key's alike outcomes are folded).
            let requests = row["requests"].as_u64().unwrap_or(0) as usize;
            *counts.entry(decision).or_insert(0usize) += requests;
        }
        match counts.values().sum::<usize>() >= 24 {
            true => Ok(counts),
            false => Err(format!("audit rows of {slot}: {counts:?}")),
        }
    })
    .await;
    let expected = [("forwarded", 3), ("replayed", 1), ("entity_claimed", 20)];
    let expected = expected.map(|(d, n)| (d.to_string(), n));
    assert_eq!(counts, HashMap::from(expected));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_executions_race_for_one_slot_on_sqlite() {
    let slots = Slots::default();
    let upstream = calendar(&slots, true).await;
    let proxy = TestProxy::start(&config(&upstream.url(), "", &booking_routes("24h"))).await;
    let mains = [base(proxy.main_addr)];
    let admins = [base(proxy.admin_addr.unwrap())];
    booking_scenario(&upstream, &slots, &mains, &admins).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_executions_race_for_one_slot_over_two_postgres_replicas() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    let slots = Slots::default();
    let upstream = calendar(&slots, true).await;
    let store = format!(
        "[store]\nurl = \"{}\"\nscope_secret = \"replicas-share-this-secret\"\n",
        pg.url
    );
    let dir = TestDir::new();
    let path = dir.write_config(&config(&upstream.url(), &store, &booking_routes("24h")));
    let a = ProxyProcess::spawn(&path).await;
    let b = ProxyProcess::spawn(&path).await;
    let mains = [base(a.main_addr), base(b.main_addr)];
    let admins = [base(a.admin_addr.unwrap()), base(b.admin_addr.unwrap())];
    booking_scenario(&upstream, &slots, &mains, &admins).await;
}
