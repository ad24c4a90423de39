//! What the docs say of entities is what the shipped config does. The tables that map a
//! client's request to its entity — docs/agents.md (each tool's `key, entity`) and
//! docs/integrations.md (each n8n node's route and `entity:…`) — are read row by row, each
//! request is run through `idemproxy explain` on the shipped `proxy.toml`, and the entity the
//! row states must be the one the proxy locks.

mod common;

use common::shipped_text;
use idemproxy::config::Config;
use std::path::Path;

fn doc(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs")
        .join(name);
    std::fs::read_to_string(path).expect("a doc")
}

fn shipped() -> Config {
    let config = shipped_text(
        &[
            ("ZENDESK_API_URL", "https://acme.zendesk.com".into()),
            ("IDEMPROXY_LISTEN", "127.0.0.1:0".into()),
            ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".into()),
        ],
        &[],
    );
    Config::from_toml(&config, "proxy.toml").expect("the shipped config")
}

/// The cells of each table row, and the backticked spans of each cell.
fn rows(text: &str) -> Vec<Vec<Vec<String>>> {
    let spans = |cell: &str| -> Vec<String> {
        cell.split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(_, s)| s.to_owned())
            .collect()
    };
    text.lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("|---"))
        .map(|l| l.trim_matches('|').split(" | ").map(spans).collect())
        .collect()
}

/// The value a placeholder (`{id}` in a path, `<id>` in an entity) stands for here.
fn value(name: &str) -> &'static str {
    match name {
        "type" => "contacts",
        "name" => "firstname",
        "email" => "ada@example.com",
        "vid" => "901",
        _ => "42",
    }
}

/// `METHOD /path` → the method and the path with its `{x}` filled in, prefixed for the main
/// listener (each API's prefix in the shipped config).
fn request(span: &str) -> Option<(String, String)> {
    let (method, path) = span.split_once(' ')?;
    if !path.starts_with('/') || !method.chars().all(|c| c.is_ascii_uppercase()) {
        return None;
    }
    let mut filled = String::new();
    let mut rest = path;
    while let Some((before, after)) = rest.split_once('{') {
        let (name, tail) = after.split_once('}')?;
        filled.push_str(before);
        filled.push_str(value(name));
        rest = tail;
    }
    filled.push_str(rest);
    let prefix = match path {
        p if p.starts_with("/api/v2") => "/zendesk",
        p if p.starts_with("/v1/") => "/stripe",
        _ => "/hubspot",
    };
    Some((method.to_owned(), format!("{prefix}{filled}")))
}

/// The entities `explain` says the request locks, unscoped.
fn entities(config: &Config, method: &str, url: &str) -> Vec<String> {
    let body = r#"{"ticket":{"status":"open"},"customer":"cus_42","invoice":"in_42","payment_intent":"pi_42",
        "properties":{"email":"ada@example.com","firstname":"Ada"},"name":"firstname",
        "inputs":[{"id":"42","properties":{"email":"ada@example.com","firstname":"Ada"}}],
        "engagement":{"type":"NOTE"},"metadata":{"body":"hi"}}"#;
    let headers = [
        "Content-Type: application/json".to_owned(),
        "Authorization: Bearer t".to_owned(),
    ];
    let out = idemproxy::cli::explain::explain(config, method, url, &headers, Some(body.into()))
        .unwrap_or_else(|e| panic!("explain {method} {url}: {e}"));
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("entities:"))
        .unwrap_or_else(|| panic!("explain {method} {url} names no entity:\n{out}"));
    line.split(',')
        .map(|e| e.trim().split('@').next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn each_tool_s_entity_in_agents_md_is_the_one_the_proxy_locks() {
    let config = shipped();
    let mut checked = 0;
    for row in rows(&doc("agents.md")) {
        let (Some(requests), Some(claims)) = (row.get(1), row.get(2)) else {
            continue;
        };
        // `ticket:<id>`, `property:<type>:<name>`: placeholders a path fills in.
        let stated: Vec<String> = claims
            .iter()
            .filter(|c| c.contains(":<") && !c.contains(' ') && !c.starts_with('<'))
            .map(|c| {
                c.split(':')
                    .map(
                        |part| match part.strip_prefix('<').and_then(|p| p.strip_suffix('>')) {
                            Some(name) => value(name).to_owned(),
                            None => part.to_owned(),
                        },
                    )
                    .collect::<Vec<_>>()
                    .join(":")
            })
            .collect();
        for (method, url) in requests.iter().filter_map(|s| request(s)) {
            if stated.is_empty() || !url.contains("/42") && !url.contains("/contacts") {
                continue;
            }
            let locked = entities(&config, &method, &url);
            assert!(
                stated.iter().any(|e| locked.contains(e)),
                "agents.md says {method} {url} locks {stated:?}; the proxy locks {locked:?}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 5, "only {checked} rows checked");
}

#[test]
fn each_n8n_node_s_entity_in_integrations_md_is_the_one_the_proxy_locks() {
    let config = shipped();
    let mut checked = 0;
    for row in rows(&doc("integrations.md")) {
        let (Some(requests), Some(routes)) = (row.get(1), row.get(2)) else {
            continue;
        };
        // `contact:…`: the entity's kind.
        let kinds: Vec<&str> = routes.iter().filter_map(|r| r.strip_suffix(":…")).collect();
        if kinds.is_empty() {
            continue;
        }
        // A row may pair several requests with several routes (a create with no entity, an
        // update with one): each entity locked is of a kind the row states, and some request
        // of the row locks one.
        let stated = |e: &String| kinds.iter().any(|k| e.starts_with(&format!("{k}:")));
        let mut any = false;
        for (method, url) in requests.iter().filter_map(|s| request(s)) {
            let locked = entities(&config, &method, &url);
            let locked: Vec<String> = locked.into_iter().filter(|e| !e.starts_with('(')).collect();
            assert!(
                locked.iter().all(stated),
                "integrations.md says {method} {url} locks one of {kinds:?}; the proxy locks {locked:?}"
            );
            any |= !locked.is_empty();
            checked += 1;
        }
        assert!(
            any,
            "integrations.md says {kinds:?} for {requests:?}; the proxy locks none"
        );
    }
    assert!(checked >= 10, "only {checked} requests checked");
}
