//! The console (SPEC "The console"), in a real browser: Debian's chromium driven over
//! WebDriver, against the real binary on SQLite and on PostgreSQL in front of a recording
//! upstream. An operator signs in (a wrong token refused); finds what needs attention oldest
//! first (a write a killed proxy left in flight, lost answers, a failed reconcile read); reads
//! the night's three writes to one contact as three lines; releases one lost write (its retry
//! is sent exactly once) and marks another done (its retry gets the pasted object, never
//! sent); reads the overview (observe mode's "would have" too); a form without its CSRF token
//! changes nothing; hostile entity names, keys, workflow ids, notes and stored answers run
//! nothing. Screenshots go to `target/console-screens/`. Plain-HTTP rules (no token, sealed
//! answers) are in `console/open.rs`.

mod common;
use common::*;

#[path = "console/browser.rs"]
mod browser;
#[path = "console/open.rs"]
mod open;
#[path = "console/world.rs"]
mod world;

use browser::Browser;
use std::sync::Arc;
use world::*;

#[tokio::test]
async fn the_console_on_sqlite() {
    scenario(false).await;
}

#[tokio::test]
async fn the_console_on_postgres() {
    scenario(true).await;
}

async fn scenario(pg: bool) {
    let Some(mut world) = World::start(pg).await else {
        return;
    };
    world.night().await;
    let world = Arc::new(world);
    let prefix = if pg { "postgres" } else { "sqlite" };
    Browser::run(prefix, move |b| async move {
        sign_in(&world, &b).await;
        release(&world, &b).await;
        mark_done(&world, &b).await;
        timeline(&world, &b).await;
        hostile(&world, &b).await;
        overview(&world, &b).await;
        csrf(&world, &b).await;
        sign_out(&world, &b).await;
    })
    .await;
}

async fn sign_in(w: &World, b: &Browser) {
    b.goto(&w.proxy.admin_url("/")).await;
    assert_eq!(
        b.at().await,
        "/login",
        "the console asks for the token first"
    );
    b.screenshot("01-sign-in").await;
    b.type_into("#token", "not-the-token").await;
    b.navigate("form.signin button").await;
    assert_eq!(b.text("p.problem").await, "That is not the admin token.");
    assert!(
        b.client.get_all_cookies().await.unwrap().is_empty(),
        "no session"
    );
    b.screenshot("02-sign-in-refused").await;

    b.type_into("#token", TOKEN).await;
    b.navigate("form.signin button").await;
    b.find("article.card").await;
    assert_eq!(b.at().await, "/");
    assert_eq!(b.text("h1").await, "Needs attention");
    let cookie = b
        .client
        .get_named_cookie("idemproxy_console")
        .await
        .unwrap();
    assert_eq!(cookie.http_only(), Some(true), "{cookie}");
    let same_site = cookie.same_site().map(|s| s.to_string());
    assert_eq!(same_site.as_deref(), Some("Strict"), "{cookie}");
    assert!(cookie.value().starts_with("v1."), "{cookie}");
    b.assert_unharmed().await;
    // Oldest first: the order the answers were lost in.
    let mut keys = Vec::new();
    for card in b.find_all("article.card").await {
        keys.push(card.attr("data-key").await.unwrap().unwrap_or_default());
    }
    assert_eq!(
        keys,
        ["hang-lapsed", "lost-release", "lost-done", HOSTILE_LOST_KEY]
    );
    let lapsed = b.text("article.card[data-key='hang-lapsed'] header").await;
    assert!(
        lapsed.contains("in flight past its lease") || lapsed.contains("unknown"),
        "{lapsed}"
    );
    // The payment's reconcile read could not tell: it is listed with the key.
    let reads = b
        .text("article.card[data-key='lost-done'] table.reconciles")
        .await;
    assert!(
        reads.contains("reconcile failed") && reads.contains("503"),
        "{reads}"
    );
    b.screenshot("03-needs-attention").await;
}

/// Release from the page: the retry is sent, exactly once.
async fn release(w: &World, b: &Browser) {
    let card = "article.card[data-key='lost-release'] details.release";
    b.click(&format!("{card} summary")).await;
    let note = "Checked the ledger: no charge for lost-release";
    b.type_into(&format!("{card} textarea[name=note]"), note)
        .await;
    b.navigate(&format!("{card} button")).await;
    assert!(b.text("p.flash").await.starts_with("Released"));
    let act = b
        .text("table.timeline tbody tr:last-child td.decision")
        .await;
    assert!(
        act.contains("released by an operator") && act.contains(note),
        "{act}"
    );
    assert_eq!(b.at().await, "/console/key?k=lost-release&done=released");
    assert_eq!(w.state_of("lost-release").await, "released");
    b.screenshot("04-released").await;

    assert_eq!(w.sent("lost-release"), 1);
    let retry = w.charge("lost-release", "cus_1").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, Some(false)),
        "{}",
        retry.text()
    );
    assert_eq!(w.sent("lost-release"), 2, "sent again after the release");
    let again = w.charge("lost-release", "cus_1").await;
    assert_eq!(again.replayed(), Some(true));
    assert_eq!(w.sent("lost-release"), 2, "and only once");
}

const PASTED: &str = r#"{"id": "ch_real_77", "amount": 100}"#;

/// Mark done from the page: retries get the pasted object and are never sent.
async fn mark_done(w: &World, b: &Browser) {
    b.goto(&w.proxy.admin_url("/")).await;
    let card = "article.card[data-key='lost-done'] details.complete";
    b.click(&format!("{card} summary")).await;
    b.type_into(&format!("{card} input[name=status]"), "201")
        .await;
    b.type_into(&format!("{card} textarea[name=body]"), PASTED)
        .await;
    let note = "Found ch_real_77 in the Stripe dashboard";
    b.type_into(&format!("{card} textarea[name=note]"), note)
        .await;
    b.navigate(&format!("{card} button")).await;
    assert!(b.text("p.flash").await.starts_with("Marked done"));
    let act = b
        .text("table.timeline tbody tr:last-child td.decision")
        .await;
    assert!(
        act.contains("marked done by an operator") && act.contains(note),
        "{act}"
    );
    let answer = b.text("section.record h3").await;
    assert!(
        answer.contains("201") && answer.contains("set by an operator"),
        "{answer}"
    );
    assert_eq!(b.text("section.record pre.body").await, PASTED);
    b.screenshot("05-marked-done").await;

    for _ in 0..2 {
        let retry = w.pay("lost-done", "cus_2").await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (201, Some(true)),
            "{}",
            retry.text()
        );
        assert_eq!(retry.text(), PASTED);
        assert_eq!(retry.header("idemproxy-set-by"), Some("operator"));
    }
    assert_eq!(w.sent("lost-done"), 1, "never sent again");
}

/// The night's three writes to contact 901 read as three lines: who, what, why.
async fn timeline(_w: &World, b: &Browser) {
    b.type_into(
        "form[action='/console/entity'] input[name=e]",
        "contact:901",
    )
    .await;
    b.navigate("form[action='/console/entity'] button").await;
    b.find("table.timeline").await;
    assert_eq!(b.at().await, "/console/entity?e=contact%3A901");
    let rows = b.find_all("table.timeline tbody tr").await;
    let mut lines = Vec::new();
    for row in &rows {
        let cells = row.find_all(fantoccini::Locator::Css("td")).await.unwrap();
        let mut text = Vec::new();
        for i in [3, 4] {
            text.push(cells[i].text().await.unwrap());
        }
        let badge = row.find(fantoccini::Locator::Css(".badge")).await.unwrap();
        text.push(badge.text().await.unwrap());
        lines.push(text.join(" | "));
    }
    assert_eq!(
        lines,
        [
            "sync-901-a | run-nightly-0200 | forwarded",
            "sync-901-a | run-nightly-0200 | replayed",
            "sync-901-b | run-backfill-0315 | refused: stale version",
        ]
    );
    let why = b.find_all("table.timeline td.decision .why").await;
    assert!(
        why[2].text().await.unwrap().contains("not newer"),
        "the stale write's reason"
    );
    let now = b.find_all("table.now td").await;
    assert_eq!(now.len(), 3, "one scope's version and claim");
    assert_eq!(now[1].text().await.unwrap(), "2", "version 2 now");
    b.screenshot("06-timeline").await;
    // A real derived key and workflow id have no place to break: the table still fits.
    b.goto(&_w.proxy.admin_url("/console/entity?e=contact%3A902"))
        .await;
    b.find("table.timeline").await;
    b.screenshot("06b-long-values").await;
    b.navigate("table.timeline td a.key").await;
    b.screenshot("06c-long-key").await;
}

/// Hostile entity names, keys, workflow ids and stored answers are text, never markup.
async fn hostile(w: &World, b: &Browser) {
    let entity = format!("customer:{HOSTILE_ENTITY}");
    b.goto(
        &w.proxy
            .admin_url(&format!("/console/entity?e={}", encode(&entity))),
    )
    .await;
    b.find("table.timeline").await;
    b.assert_unharmed().await;
    assert_eq!(b.text("h1 code").await, entity);
    assert_eq!(b.find_all("table.timeline tbody tr").await.len(), 1);
    assert_eq!(b.text("table.timeline td a.key").await, HOSTILE_LOST_KEY);
    b.screenshot("07-hostile-entity").await;

    b.goto(
        &w.proxy
            .admin_url(&format!("/console/key?k={}", encode(HOSTILE_KEY))),
    )
    .await;
    b.find("section.record").await;
    b.assert_unharmed().await;
    assert_eq!(b.text("h1 code").await, HOSTILE_KEY);
    assert_eq!(b.text("pre.body").await, HOSTILE_BODY);
    let headers = b.text("table.headers").await;
    assert!(headers.contains(HOSTILE_HEADER), "{headers}");
    assert!(headers.contains("set-cookie"), "named as hidden: {headers}");
    assert_eq!(b.text("code.workflow").await, HOSTILE_WORKFLOW);
    let source = b.client.source().await.unwrap();
    assert!(
        !source.contains(SECRET_COOKIE),
        "a stored cookie is never shown"
    );
    b.screenshot("08-hostile-key").await;
    // The `javascript:` entity is a link to its timeline, not a script.
    b.navigate("section.record dd a.entity").await;
    b.find("table.timeline").await;
    assert_eq!(b.text("h1 code").await, format!("customer:{JS_ENTITY}"));
    b.assert_unharmed().await;

    // An `"><img>` entity, and its `javascript:` key: a link to the key's page.
    let entity = format!("customer:{HOSTILE_IMG_ENTITY}");
    let timeline = format!("/console/entity?e={}", encode(&entity));
    b.goto(&w.proxy.admin_url(&timeline)).await;
    assert_eq!(b.text("h1 code").await, entity);
    b.assert_unharmed().await;
    b.navigate("table.timeline td a.key").await;
    b.find("section.record").await;
    assert!(
        b.at().await.starts_with("/console/key?k=javascript%3A"),
        "{}",
        b.at().await
    );
    assert_eq!(b.text("h1 code").await, JS_KEY);
    b.assert_unharmed().await;
}

/// Per route, what was decided; the chart of it.
async fn overview(w: &World, b: &Browser) {
    // Every act and retry above is in the audit trail (written off the request path).
    w.wait_for_history("customer:cus_1", 4).await;
    w.wait_for_history("customer:cus_2", 5).await;
    b.navigate("header nav a[href='/console/overview']").await;
    b.find("table.overview").await;
    b.assert_unharmed().await;
    let cell = |route: &str, kind: &str| format!("tr[data-route='{route}'] td.{kind}");
    for (route, kind, n) in [
        ("contact-update", "forwarded", "2"),
        ("contact-update", "replayed", "1"),
        ("contact-update", "refused", "1"),
        ("charges", "unknown", "2"),
        ("charges", "operator", "1"),
        ("charges", "replayed", "1"),
        ("payments", "unknown", "1"),
        ("payments", "reconciled", "1"),
        ("payments", "operator", "1"),
        ("payments", "replayed", "2"),
        ("refunds", "forwarded", "1"),
        ("refunds", "observed", "1"),
    ] {
        assert_eq!(b.text(&cell(route, kind)).await, n, "{route} {kind}");
    }
    let refused = b.text("tr[data-detail='contact-update']").await;
    assert!(refused.contains("refused: stale_version 1"), "{refused}");
    let observed = b.text("tr[data-detail='refunds']").await;
    assert!(
        observed.contains("enforce would have: replay 1"),
        "{observed}"
    );
    assert!(
        !b.find_all("svg.chart rect").await.is_empty(),
        "the chart has bars"
    );
    b.screenshot("09-overview").await;
    running(b).await;
}

/// What runs: upstreams, routes and listeners from the configuration in force; no secret. And
/// each upstream's health: the three unknown outcomes of the night show against `api`.
async fn running(b: &Browser) {
    b.navigate("header nav a[href='/console/upstreams']").await;
    let unknown = b
        .text("table.health tr[data-upstream='api'] td:nth-child(6)")
        .await;
    assert_eq!(unknown, "3", "the night's unknown outcomes");
    b.assert_unharmed().await;
    b.screenshot("09c-upstreams").await;
    b.navigate("header nav a[href='/console/running']").await;
    let text = b.text("main").await;
    for want in [
        "api",
        "contact-update",
        "/contacts/{id}",
        "egress",
        "admin token set",
    ] {
        assert!(text.contains(want), "{want} on the running page: {text}");
    }
    assert!(
        !text.contains(world::TOKEN),
        "the admin token is never shown"
    );
    b.assert_unharmed().await;
    b.screenshot("09b-running").await;
}

/// A POST without the CSRF token changes nothing, in the browser and by hand.
async fn csrf(w: &World, b: &Browser) {
    b.goto(&w.proxy.admin_url("/")).await;
    let form = format!("article.card[data-key=\"{HOSTILE_LOST_KEY}\"] details.release");
    let form = form.as_str();
    b.click(&format!("{form} summary")).await;
    b.type_into(&format!("{form} textarea[name=note]"), "forged")
        .await;
    let csrf = b
        .find(&format!("{form} input[name=csrf]"))
        .await
        .attr("value")
        .await
        .unwrap();
    b.script(&format!(
        "document.querySelector('{form} input[name=csrf]').remove(); return null;"
    ))
    .await;
    b.navigate(&format!("{form} button")).await;
    assert_eq!(b.text("h1").await, "Refused: no valid CSRF token");
    b.screenshot("10-csrf-refused").await;
    assert_eq!(
        w.state_of(HOSTILE_LOST_KEY).await,
        "unknown",
        "nothing changed"
    );

    // By hand: the session without the token, a wrong token, the token without the session.
    let session = b
        .client
        .get_named_cookie("idemproxy_console")
        .await
        .unwrap();
    let cookie = format!("idemproxy_console={}", session.value());
    let form_type = ("content-type", "application/x-www-form-urlencoded");
    let fields = format!(
        "key={}&note=forged&status=201&body=x",
        encode(HOSTILE_LOST_KEY)
    );
    let sent = w.upstream.count();
    for act in ["/console/release", "/console/complete"] {
        let url = w.proxy.admin_url(act);
        for (headers, body, status) in [
            (vec![form_type, ("cookie", &cookie)], fields.clone(), 403),
            (
                vec![form_type, ("cookie", &cookie)],
                format!("{fields}&csrf=00ff"),
                403,
            ),
            (
                vec![form_type],
                format!("{fields}&csrf={}", csrf.clone().unwrap_or_default()),
                401,
            ),
        ] {
            let resp = request("POST", &url, &headers, body).await;
            assert_eq!(resp.status, status, "{act}: {}", resp.text());
        }
    }
    assert_eq!(
        w.state_of(HOSTILE_LOST_KEY).await,
        "unknown",
        "nothing changed"
    );
    assert_eq!(w.upstream.count(), sent, "nothing forwarded");

    // With its token, the same form works; the note is shown as written.
    b.goto(&w.proxy.admin_url("/")).await;
    b.click(&format!("{form} summary")).await;
    let note = "<script>window.__pwned=10</script> checked: never charged";
    b.type_into(&format!("{form} textarea[name=note]"), note)
        .await;
    b.navigate(&format!("{form} button")).await;
    b.find("p.flash").await;
    // The page it lands on lists the act, with the note as written.
    assert_eq!(b.text("td.decision .note q").await, note);
    b.assert_unharmed().await;
    assert_eq!(w.state_of(HOSTILE_LOST_KEY).await, "released");
}

async fn sign_out(w: &World, b: &Browser) {
    b.goto(&w.proxy.admin_url("/")).await;
    let left = b.find_all("article.card").await;
    assert_eq!(left.len(), 1, "only the lapsed write is left");
    let key = left[0].attr("data-key").await.unwrap();
    assert_eq!(key.as_deref(), Some("hang-lapsed"));
    b.navigate("form.signout button").await;
    b.find("form.signin").await;
    b.goto(&w.proxy.admin_url("/console/overview")).await;
    assert_eq!(b.at().await, "/login", "signed out");
}
