//! What the docs say of errors is what the proxy does: every "status and error type" they
//! state (`409 outcome_unknown`) is checked against the proxy's own table
//! (`ErrorKind::status`), and every error type a client can meet is in request-handling.md's
//! list. Reads docs/*.md and README.md as text.

use idemproxy::error::ErrorKind;
use std::collections::BTreeMap;
use std::path::Path;

/// Every Markdown file a user reads: README.md and docs/*.md, with their text.
fn docs() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut listed: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    listed.sort();
    files.extend(listed);
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("a doc");
            (p.display().to_string(), text)
        })
        .collect()
}

/// Each "NNN word" in `text` where the word is spelled like an error type (lower case with an
/// underscore, or one of the proxy's types), backticks allowed around it.
fn stated_pairs(text: &str, types: &BTreeMap<&str, u16>) -> Vec<(u16, String)> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut pairs = Vec::new();
    for w in words.windows(2) {
        let status = w[0].trim_start_matches(['`', '(', '*']);
        let name: String = w[1]
            .trim_matches(|c: char| !c.is_ascii_lowercase() && c != '_')
            .to_owned();
        let Ok(status) = status.parse::<u16>() else {
            continue;
        };
        let spelled_like_one =
            name.contains('_') && name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
        if (400..600).contains(&status) && (spelled_like_one || types.contains_key(name.as_str())) {
            pairs.push((status, name));
        }
    }
    pairs
}

#[test]
fn every_status_and_error_type_the_docs_state_is_the_proxys() {
    let types: BTreeMap<&str, u16> = ErrorKind::ALL
        .iter()
        .map(|k| (k.as_str(), k.status().as_u16()))
        .collect();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (file, text) in docs() {
        for (status, name) in stated_pairs(&text, &types) {
            checked += 1;
            match types.get(name.as_str()) {
                Some(&real) if real == status => {}
                Some(&real) => wrong.push(format!(
                    "{file}: `{status} {name}`: the proxy answers {real}"
                )),
                None => wrong.push(format!("{file}: `{status} {name}`: no such error type")),
            }
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    assert!(
        checked > 50,
        "only {checked} statements found: is the scan broken?"
    );
}

#[test]
fn every_error_type_is_in_the_request_handling_list() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("docs/request-handling.md")).expect("the doc");
    let missing: Vec<&str> = ErrorKind::ALL
        .iter()
        .map(|k| k.as_str())
        .filter(|name| !text.contains(&format!("`{name}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in docs/request-handling.md: {missing:?}"
    );
}

#[test]
fn the_scan_finds_what_a_doc_states() {
    let types: BTreeMap<&str, u16> = [("outcome_unknown", 409)].into_iter().collect();
    let pairs = stated_pairs(
        "gets `409 outcome_unknown`, or (503 store_unavailable), not 2026 events",
        &types,
    );
    assert_eq!(
        pairs,
        [
            (409, "outcome_unknown".to_owned()),
            (503, "store_unavailable".to_owned())
        ]
    );
}
