//! What the docs say of keys and entities outside the request tables (`docs_entities.rs`) is
//! what the proxy does. Each worked request of the docs is a [`Claim`]: its doc, the request as
//! the doc sends it, the config it goes through (the shipped `proxy.toml`, or a doc's own
//! example), and the key and entity the doc states; each is run through `idemproxy explain`.
//! A sweep then finds every concrete key and entity the docs name — a backticked `contact:901`,
//! an `idempotency-key:` header or a `"key"`/`"entity"` field in an example — and each must be
//! a claim's, so a new statement cannot go unchecked.

mod common;

use common::shipped_text;
use idemproxy::config::Config;
use std::collections::BTreeSet;
use std::path::Path;

fn doc(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The docs a user reads (the lab notes of benchmark.md and the module names of
/// design-notes.md and testing.md name no request's key or entity).
fn docs() -> Vec<String> {
    let mut names = vec!["README.md".to_owned()];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(dir).expect("docs/") {
        let name = entry
            .expect("a doc")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".md")
            && !matches!(
                name.as_str(),
                "benchmark.md" | "design-notes.md" | "testing.md"
            )
        {
            names.push(format!("docs/{name}"));
        }
    }
    names.sort();
    names
}

/// The `n`th (from 1) `toml` block of a doc.
fn toml_block(name: &str, n: usize) -> String {
    let text = doc(name);
    let mut blocks = text.split("```toml\n").skip(1);
    let block = blocks
        .nth(n - 1)
        .unwrap_or_else(|| panic!("{name} has no toml block {n}"));
    block.split("```").next().unwrap_or_default().to_owned()
}

/// What a claim's request goes through.
#[derive(Clone, Copy)]
enum Through {
    Shipped,
    /// examples.md's first block (the upstream and the shipped route).
    Example1,
    /// examples.md's second block (the route with `version`), under the first one's upstream.
    Example2,
    /// examples.md's third block (the calendar).
    Example3,
}

fn config(through: Through) -> Config {
    let text = match through {
        Through::Shipped => shipped_text(
            &[
                ("ZENDESK_API_URL", "https://acme.zendesk.com".into()),
                ("IDEMPROXY_LISTEN", "127.0.0.1:0".into()),
                ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".into()),
            ],
            &[],
        ),
        Through::Example1 => toml_block("docs/examples.md", 1),
        Through::Example2 => {
            let first = toml_block("docs/examples.md", 1);
            let upstream = first.split("[[routes]]").next().unwrap_or_default();
            format!("{upstream}\n{}", toml_block("docs/examples.md", 2))
        }
        Through::Example3 => toml_block("docs/examples.md", 3),
    };
    Config::from_toml(&text, "doc").unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// A request a doc sends, and the key and entity it says the proxy gives it. A key ending in
/// `…` is a prefix (the doc shortens the fingerprint).
struct Claim {
    doc: &'static str,
    through: Through,
    method: &'static str,
    path: &'static str,
    headers: Vec<&'static str>,
    body: String,
    key: &'static str,
    entity: &'static str,
}

const JSON: &str = "Content-Type: application/json";
const FORM: &str = "Content-Type: application/x-www-form-urlencoded";

fn claims() -> Vec<Claim> {
    let contact_901 = |doc, through, headers, body: &str, key| Claim {
        doc,
        through,
        method: "PATCH",
        path: "/hubspot/crm/v3/objects/contacts/901",
        headers,
        body: body.to_owned(),
        key,
        entity: "contact:901",
    };
    let booking = |headers, body: &str, key, entity| Claim {
        doc: "docs/examples.md",
        through: Through::Example3,
        method: "POST",
        path: "/calendar/bookings",
        headers,
        body: body.to_owned(),
        key,
        entity,
    };
    let ticket_42 = |doc, path| Claim {
        doc,
        through: Through::Shipped,
        method: "PUT",
        path,
        headers: vec![JSON, "X-Workflow-Id: run-1"],
        body: r#"{"ticket":{"status":"open"}}"#.into(),
        key: "",
        entity: "ticket:42",
    };
    let charge = |doc, header, key| Claim {
        doc,
        through: Through::Shipped,
        method: "POST",
        path: "/stripe/v1/charges",
        headers: vec![FORM, header],
        body: "amount=2000&currency=usd&customer=cus_123".into(),
        key,
        entity: "customer:cus_123",
    };
    let attempt_5521 = |through, synced: &str| {
        let body = format!(
            r#"{{"properties": {{"lifecyclestage": "customer", "last_synced_at": "{synced}"}}}}"#
        );
        let key = "5521:contact:901:hubspot-contact-update:4568…";
        contact_901(
            "docs/examples.md",
            through,
            vec![JSON, "X-Workflow-Id: 5521"],
            &body,
            key,
        )
    };
    vec![
        // The lost answer: both attempts derive one key (`last_synced_at` is not fingerprinted).
        attempt_5521(Through::Example1, "2025-06-01T10:00:00Z"),
        attempt_5521(Through::Example1, "2025-06-01T10:00:11Z"),
        // The same request through the shipped route the example says it is (README names
        // its entity).
        attempt_5521(Through::Shipped, "2025-06-01T10:00:00Z"),
        // The stale delayed write: revisions 7 and 6.
        contact_901(
            "docs/examples.md",
            Through::Example2,
            vec![JSON, "X-Workflow-Id: sync-901-7", "X-Entity-Version: 7"],
            r#"{"properties": {"phone": "+1 555 0107"}}"#,
            "sync-901-7:contact:901:hubspot-contact-update:793e…",
        ),
        contact_901(
            "docs/examples.md",
            Through::Example2,
            vec![JSON, "X-Workflow-Id: sync-901-6", "X-Entity-Version: 6"],
            r#"{"properties": {"phone": "+1 555 0106"}}"#,
            "sync-901-6:contact:901:hubspot-contact-update:9b69…",
        ),
        // The double-booked slot.
        booking(
            vec![JSON, "Idempotency-Key: agent-12-book-s-42"],
            r#"{"slot_id": "s-42", "attendee": "agent-12@example.com"}"#,
            "agent-12-book-s-42",
            "slot:s-42",
        ),
        booking(
            vec![JSON, "Idempotency-Key: agent-4-book-s-42"],
            r#"{"slot_id": "s-42", "attendee": "agent-4@example.com"}"#,
            "agent-4-book-s-42",
            "slot:s-42",
        ),
        booking(
            vec![JSON, "Idempotency-Key: agent-7-book-s-43"],
            r#"{"slot_id": "s-43", "attendee": "agent-7@example.com"}"#,
            "agent-7-book-s-43",
            "slot:s-43",
        ),
        Claim {
            doc: "docs/examples.md",
            through: Through::Example3,
            method: "DELETE",
            path: "/calendar/bookings/s-42",
            headers: vec!["Idempotency-Key: agent-4-cancel-s-42"],
            body: String::new(),
            key: "agent-4-cancel-s-42",
            entity: "slot:s-42",
        },
        // `keys show order-1234-charge` (operations.md), and the README's Stripe customer.
        charge(
            "docs/operations.md",
            "Idempotency-Key: order-1234-charge",
            "order-1234-charge",
        ),
        // keys.md: `Idempotency-Key: abc` and `Idempotency-Key: "abc"` are the same key `abc`.
        charge("docs/keys.md", "Idempotency-Key: abc", "abc"),
        charge("docs/keys.md", "Idempotency-Key: \"abc\"", "abc"),
        // node-zendesk's `.json` path and the bare one lock one ticket.
        ticket_42("docs/integrations.md", "/zendesk/api/v2/tickets/42.json"),
        ticket_42("docs/integrations.md", "/zendesk/api/v2/tickets/42"),
    ]
}

/// The key and the bare entities `explain` gives a claim's request.
fn explained(claim: &Claim, config: &Config) -> (String, Vec<String>) {
    let mut headers: Vec<String> = claim.headers.iter().map(|h| h.to_string()).collect();
    headers.push("Authorization: Bearer doc-token".into());
    let (key, entities) = explain(config, claim.method, claim.path, &headers, &claim.body);
    let entities = entities
        .split(',')
        .map(|e| e.trim().split('@').next().unwrap_or_default().to_owned())
        .collect();
    (key, entities)
}

/// The key (without how it was found) and the entities line `explain` prints for a request.
fn explain(
    config: &Config,
    method: &str,
    path: &str,
    headers: &[String],
    body: &str,
) -> (String, String) {
    let body = (!body.is_empty()).then(|| body.as_bytes().to_vec().into());
    let out = idemproxy::cli::explain::explain(config, method, path, headers, body)
        .unwrap_or_else(|e| panic!("explain {method} {path}: {e}"));
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("explain {method} {path} has no {name}\n{out}"))
    };
    let key = field("key:");
    let key = key.split(" (").next().unwrap_or_default().to_owned();
    (key, field("entities:"))
}

/// Whether `key` is the one stated (`""`: the doc states none).
fn key_holds(stated: &str, key: &str) -> bool {
    match stated.strip_suffix('…') {
        Some(prefix) => key.starts_with(prefix),
        None => stated.is_empty() || key == stated,
    }
}

/// Whether a doc says `phrase`, however its lines are wrapped.
fn says(doc_text: &str, phrase: &str) -> bool {
    let flat = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    flat(doc_text).contains(&flat(phrase))
}

#[test]
fn each_worked_request_gets_the_key_and_entity_its_doc_states() {
    for claim in claims() {
        let text = doc(claim.doc);
        // A claim is about what its doc says: the key, else the entity.
        let said = if claim.key.is_empty() {
            claim.entity
        } else {
            claim.key
        };
        assert!(says(&text, said), "{} does not say {said}", claim.doc);
        let (key, entities) = explained(&claim, &config(claim.through));
        assert!(
            key_holds(claim.key, &key),
            "{} says {} {} gets the key {}; the proxy derives {key}",
            claim.doc,
            claim.method,
            claim.path,
            claim.key
        );
        assert!(
            entities.iter().any(|e| e == claim.entity),
            "{} says {} {} locks {}; the proxy locks {entities:?}",
            claim.doc,
            claim.method,
            claim.path,
            claim.entity
        );
    }
}

/// The entity kinds a doc could name: those of the shipped routes and of the examples'.
fn kinds() -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    for text in [doc("proxy.toml"), doc("docs/examples.md")] {
        for line in text.lines() {
            if let Some(rest) = line.trim().strip_prefix("entity = \"") {
                if let Some((kind, _)) = rest.split_once(':') {
                    kinds.insert(kind.to_owned());
                }
            }
        }
    }
    kinds
}

/// The route names of the shipped config and of the examples': a key derived with `{route}`
/// holds one between colons.
fn routes() -> BTreeSet<String> {
    let mut routes = BTreeSet::new();
    for text in [doc("proxy.toml"), doc("docs/examples.md")] {
        for line in text.lines() {
            if let Some(rest) = line.trim().strip_prefix("name = \"") {
                routes.insert(rest.trim_end_matches('"').to_owned());
            }
        }
    }
    routes
}

/// A concrete value: not a template, a placeholder or a kind alone.
fn concrete(value: &str) -> bool {
    !value.chars().all(|c| c == '.' || c == '…')
        && !value.contains(['{', '<', '$', ' '])
        && !value.ends_with(":…")
}

/// Every concrete key and entity a doc names, as (doc, "key" | "entity", value), in prose,
/// tables and examples alike; error messages are prose.
fn named() -> Vec<(String, &'static str, String)> {
    let (kinds, routes) = (kinds(), routes());
    let is_key =
        |v: &str| concrete(v) && v.contains(':') && v.split(':').any(|part| routes.contains(part));
    let is_entity = |v: &str| {
        v.split_once(':')
            .is_some_and(|(k, rest)| kinds.contains(k) && !rest.starts_with('/') && concrete(v))
    };
    let quoted = |line: &str, field: &str| -> Vec<String> {
        line.split(&format!("\"{field}\": "))
            .skip(1)
            .filter_map(|rest| {
                let rest = rest.trim_start_matches('[');
                let v = rest.strip_prefix('"')?.split('"').next()?;
                Some(v.to_owned())
            })
            .collect()
    };
    let mut out = Vec::new();
    for name in docs() {
        for line in doc(&name).lines() {
            let mut found = |what: &'static str, v: &str| {
                // A stored entity is shown scoped: `customer:cus_123@5f0c…`.
                let v = v.split('@').next().unwrap_or_default();
                if concrete(v) {
                    out.push((name.clone(), what, v.to_owned()));
                }
            };
            for span in line.split('`').skip(1).step_by(2) {
                if is_key(span) {
                    found("key", span);
                } else if is_entity(span) {
                    found("entity", span);
                }
            }
            // An answer's `idempotency-key:` line, or a request's `-H 'Idempotency-Key: …'`.
            let lower = line.to_ascii_lowercase();
            for (at, _) in lower.match_indices("idempotency-key: ") {
                let value = &line[at + "idempotency-key: ".len()..];
                found(
                    "key",
                    value
                        .split(['\'', '"', '`'])
                        .next()
                        .unwrap_or_default()
                        .trim(),
                );
            }
            for v in quoted(line, "key") {
                found("key", &v);
            }
            for v in quoted(line, "entity")
                .into_iter()
                .chain(quoted(line, "entities"))
            {
                if is_entity(&v) {
                    found("entity", &v);
                }
            }
        }
    }
    out
}

#[test]
fn every_key_and_entity_the_docs_name_is_a_checked_claim() {
    let claims = claims();
    let named = named();
    assert!(named.len() >= 15, "the sweep found only {named:?}");
    let mut unchecked = Vec::new();
    for (name, what, value) in &named {
        let checked = claims.iter().any(|c| match *what {
            // As the doc writes it, shortened fingerprint and all: a claim's key is the doc's.
            "key" => c.doc == name && c.key == value,
            _ => c.entity == value,
        });
        if !checked && !special(name, value) {
            unchecked.push(format!("{name}: {what} {value}"));
        }
    }
    assert!(
        unchecked.is_empty(),
        "named by a doc, checked by no claim: {unchecked:#?}"
    );
}

/// The entity templates of the shipped routes and of the examples'.
fn templates() -> BTreeSet<String> {
    let mut templates = BTreeSet::new();
    for text in [doc("proxy.toml"), doc("docs/examples.md")] {
        for line in text.lines() {
            if let Some(rest) = line.trim().strip_prefix("entity = \"") {
                templates.insert(rest.split('"').next().unwrap_or_default().to_owned());
            }
        }
    }
    templates
}

/// Whether `template` compiles as a route's entity: in a route whose path captures every
/// `{path.X}` it reads.
fn compiles_as_entity(template: &str) -> Result<(), String> {
    let captures: Vec<&str> = template
        .split("{path.")
        .skip(1)
        .filter_map(|rest| rest.split('}').next())
        .collect();
    let path: String = captures.iter().map(|c| format!("/{{{c}}}")).collect();
    let toml = format!(
        "[upstreams.api]\nurl = \"https://api.example.com\"\nprefix = \"/api\"\n\n\
         [[routes]]\nname = \"r\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
         path = \"/x{path}\"\nentity = {template:?}\nkey = {{ header = \"Idempotency-Key\" }}\n"
    );
    Config::from_toml(&toml, "doc")
        .map(drop)
        .map_err(|e| e.to_string())
}

/// An entity template a doc shows (`contact:{body.inputs[*].id}`, `entity =
/// "email:{body.properties.email}"`, in prose or a table) is one a shipped or example route
/// has, or at least one a route could have: it compiles.
#[test]
fn every_entity_template_the_docs_show_is_a_routes() {
    let templates = templates();
    let mut shown = 0;
    for name in docs() {
        for line in doc(&name).lines() {
            for span in line.split('`').skip(1).step_by(2) {
                let template = match span.strip_prefix("entity = \"") {
                    Some(t) => t.trim_end_matches('"'),
                    None => match span.split_once(":{") {
                        Some((kind, _))
                            if !kind.is_empty()
                                && kind.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                                && span.ends_with('}') =>
                        {
                            span
                        }
                        _ => continue,
                    },
                };
                shown += 1;
                if templates.contains(template) {
                    continue;
                }
                if let Err(e) = compiles_as_entity(template) {
                    panic!("{name} shows the entity {template}, which no route could have: {e}");
                }
            }
        }
    }
    assert!(shown >= 4, "only {shown} templates found");
}

/// The statements checked by a test of their own below.
fn special(doc: &str, value: &str) -> bool {
    matches!(
        (doc, value),
        ("docs/keys.md", "contact:9801" | "contact:42") | ("docs/security.md", "contact:42")
    )
}

/// keys.md: "`9801`, `9801.0` and `9.801e3` are `contact:9801`".
#[test]
fn a_json_number_is_one_entity_however_written() {
    assert!(says(
        &doc("docs/keys.md"),
        "`9801`, `9801.0` and `9.801e3` are `contact:9801`"
    ));
    let config = config(Through::Shipped);
    let headers = [JSON.to_owned(), "X-Workflow-Id: run-1".to_owned()];
    for id in ["9801", "9801.0", "9.801e3"] {
        let body = format!(r#"{{"inputs":[{{"id":{id},"properties":{{"firstname":"A"}}}}]}}"#);
        let path = "/hubspot/crm/v3/objects/contacts/batch/update";
        let (_, entities) = explain(&config, "POST", path, &headers, &body);
        assert_eq!(
            entities.split('@').next(),
            Some("contact:9801"),
            "id {id}: {entities}"
        );
    }
}

/// keys.md and security.md: entities are stored as `contact:42@<scope>`, and another tenant's
/// `contact:42` is another entity; keys.md: `/contacts/5555;v=1` and `/contacts/5555` are one
/// entity and two keys.
#[test]
fn entities_are_scoped_by_credentials_and_keys_take_the_path_as_sent() {
    let keys = doc("docs/keys.md");
    assert!(says(
        &keys,
        "(stored as `contact:42@<scope>`; error bodies show `contact:42`)"
    ));
    assert!(says(
        &keys,
        "`/contacts/5555;v=1` and `/contacts/5555` are one entity (one lock) and two keys"
    ));
    assert!(says(
        &doc("docs/security.md"),
        "tenant A's `contact:42` is not tenant B's"
    ));
    let config = config(Through::Shipped);
    let explain = |token: &str, path: &str| {
        let headers = [
            JSON.to_owned(),
            "X-Workflow-Id: run-1".to_owned(),
            format!("Authorization: Bearer {token}"),
        ];
        explain(
            &config,
            "PATCH",
            path,
            &headers,
            r#"{"properties":{"firstname":"A"}}"#,
        )
    };
    let (_, a) = explain("tenant-a", "/hubspot/crm/v3/objects/contacts/42");
    let (_, b) = explain("tenant-b", "/hubspot/crm/v3/objects/contacts/42");
    let scope = a
        .strip_prefix("contact:42@")
        .expect("stored as contact:42@<scope>");
    assert!(
        scope.len() == 16 && scope.bytes().all(|c| c.is_ascii_hexdigit()),
        "{a}"
    );
    assert_ne!(a, b, "tenant A's contact:42 is not tenant B's");
    let (key, one) = explain("tenant-a", "/hubspot/crm/v3/objects/contacts/5555;v=1");
    let (other_key, same) = explain("tenant-a", "/hubspot/crm/v3/objects/contacts/5555");
    assert_eq!(one, same, "one entity");
    assert_ne!(key, other_key, "two keys");
}
