//! A key's page: each record that carries it (one per upstream and credential scope), the
//! stored answer as a retry would get it, and every attempt, oldest first. The acts, when its
//! outcome is unknown.
//!
//! The stored answer shows its headers and body, but never a credential or a cookie:
//! `Set-Cookie`, `Set-Cookie2` and every header the proxy knows to carry credentials
//! ([`CREDENTIAL_HEADERS`]: `Authorization`, `Cookie`, `X-Api-Key`, `X-Auth-Token`, …) are
//! named as hidden, their values left out. An answer this process cannot decrypt shows
//! `<encrypted>`. The proxy's own markers (header names starting with `:`) are badges.

use super::act;
use super::page::{self, entity_link, when, Frame, Nav};
use super::rows;
use crate::key::entity_scope;
use crate::key::scope::CREDENTIAL_HEADERS;
use crate::settle::settleable;
use crate::state::AppState;
use crate::store::seal::ENCRYPTED;
use crate::store::{
    now_ms, KeyRecord, StoreResult, StoredAnswer, StoredResponse, OMITTED_BODY, RECONCILED,
    SET_BY_OPERATOR,
};
use maud::{html, Markup};

/// Headers whose values the console never shows, beside [`CREDENTIAL_HEADERS`]: the cookies
/// an answer sets (both spellings; kept when an upstream sets `keep_cookies`).
const COOKIES: [&str; 2] = ["set-cookie", "set-cookie2"];

/// Most attempts shown (the newest, oldest first).
const LIMIT: i64 = 200;

/// Most bytes of a stored body shown; the rest is counted.
const BODY_SHOWN: usize = 64 * 1024;

/// The page of `key` (`None`: the search box alone); `done` names the act just made.
pub async fn page(
    state: &AppState,
    frame: &Frame<'_>,
    key: Option<&str>,
    done: Option<&str>,
) -> StoreResult<(bool, Markup)> {
    let Some(key) = key.filter(|k| !k.is_empty()) else {
        let body = html! {
            h1 { "A key" }
            form.big method="get" action="/console/key" {
                input type="search" name="k" placeholder="idempotency key" aria-label="Key" autofocus;
                button type="submit" { "Show it" }
            }
        };
        return Ok((true, page::layout(frame, Nav::Key(""), "A key", body)));
    };
    let records = state.operator().await.find_key(key).await?;
    let mut attempts = state.store.audit_for_key(key, LIMIT).await?;
    attempts.reverse();
    let now = now_ms();
    let flash = match done {
        Some("released") => Some("Released: the next retry of this key is sent upstream."),
        Some("completed") => Some(
            "Marked done: retries of this key get the answer you pasted; nothing is sent upstream.",
        ),
        _ => None,
    };
    let body = html! {
        @if let Some(flash) = flash { p.flash { (flash) } }
        h1 { "Key " code.subject { (key) } }
        @if records.is_empty() {
            p.empty { "No record carries this key (never seen, or past its retention)." }
        }
        @for r in &records { (record(frame.csrf, r, now)) }
        h2 { "Attempts" }
        @if attempts.is_empty() {
            p.none { "No audit row of this key." }
        } @else {
            (rows::table(&attempts, rows::Subject::Entities))
        }
    };
    Ok((
        !records.is_empty(),
        page::layout(frame, Nav::Key(key), key, body),
    ))
}

/// One record of the key.
fn record(csrf: &str, r: &KeyRecord, now: i64) -> Markup {
    let state = r.effective_state(now);
    html! {
        section.record data-upstream=(r.id.upstream) {
            h2 { "On " code { (r.id.upstream) } " · scope " code { (entity_scope(&r.id.scope)) } }
            dl {
                dt { "state" } dd {
                    span class={ "badge state " (state.as_str()) } { (state.as_str().replace('_', " ")) }
                    @if state != r.state { " (stored as " (r.state.as_str().replace('_', " ")) ")" }
                }
                dt { "route" } dd { code { (r.route) } }
                dt { "entities" } dd {
                    @for e in &r.entities { (entity_link(e)) " " }
                    @if r.entities.is_empty() { span.none { "none" } }
                }
                dt { "attempts" } dd { (r.attempts) " (epoch " (r.epoch) ")" }
                dt { "fingerprint" } dd { code.hash { (r.fingerprint) } }
                dt { "created" } dd { (when(r.created_at, Some(now))) }
                dt { "updated" } dd { (when(r.updated_at, Some(now))) }
                @if let Some(owner) = &r.owner { dt { "owner" } dd { code { (owner) } } }
                @if let Some(e) = r.expires_at { dt { "kept until" } dd { (when(e, None)) } }
                dt { "encrypted with" } dd {
                    @match &r.enc_key { Some(k) => code { (k) }, None => span.none { "stored in clear" } }
                }
            }
            @match &r.response {
                None => p.none { "No stored answer." },
                Some(StoredAnswer::Open(resp)) => (answer(resp)),
                Some(StoredAnswer::Sealed(s)) => {
                    h3 { "Stored answer " code { (s.status) } }
                    p.sealed { "Headers: " code { (ENCRYPTED) } }
                    p.sealed { "Body: " code { (ENCRYPTED) } }
                    p.none { "This process cannot open it: " (s.reason) }
                }
            }
            @if settleable(r) { (act::forms(csrf, r)) }
        }
    }
}

/// An opened stored answer.
fn answer(resp: &StoredResponse) -> Markup {
    let marker = |name: &str| resp.headers.iter().any(|(n, _)| n == name);
    let shown: Vec<(&str, String)> = resp
        .headers
        .iter()
        .filter(|(n, _)| !n.starts_with(':') && !hidden(n))
        .map(|(n, v)| (n.as_str(), String::from_utf8_lossy(v).into_owned()))
        .collect();
    let mut withheld: Vec<&str> = resp
        .headers
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| hidden(n))
        .collect();
    withheld.dedup();
    let body = &resp.body[..resp.body.len().min(BODY_SHOWN)];
    html! {
        h3 {
            "Stored answer " code { (resp.status) }
            @if marker(SET_BY_OPERATOR) { " " span.badge.operator { "set by an operator" } }
            @if marker(RECONCILED) { " " span.badge.reconciled { "found by a reconcile read" } }
            @if marker(OMITTED_BODY) { " " span.badge.refused { "body not stored" } }
        }
        table.headers {
            @for (n, v) in &shown { tr { th { (n) } td { code { (v) } } } }
            @if !withheld.is_empty() {
                tr.withheld { th { "hidden" } td { (withheld.join(", ")) " (never shown)" } }
            }
        }
        pre.body { (String::from_utf8_lossy(body)) }
        @if resp.body.len() > BODY_SHOWN {
            p.more { "The first " (BODY_SHOWN) " of " (resp.body.len()) " bytes." }
        }
    }
}

fn hidden(name: &str) -> bool {
    COOKIES
        .iter()
        .chain(CREDENTIAL_HEADERS.iter())
        .any(|h| name.eq_ignore_ascii_case(h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn a_stored_answer_never_shows_a_credential_or_a_cookie() {
        let secret = "s3cr3t-value";
        let names = [
            "Set-Cookie",
            "set-cookie2",
            "Authorization",
            "X-Auth-Token",
            "x-access-token",
            "X-Amz-Security-Token",
            "Api-Key",
            "private-token",
        ];
        let mut headers: Vec<(String, Bytes)> = names
            .iter()
            .map(|n| (n.to_string(), Bytes::from(secret)))
            .collect();
        headers.push(("content-type".into(), Bytes::from("application/json")));
        let resp = StoredResponse {
            status: 201,
            headers,
            body: Bytes::from("{}"),
        };
        let html = answer(&resp).into_string();
        assert!(!html.contains(secret), "{html}");
        assert!(html.contains("application/json"), "{html}");
        for n in names {
            assert!(html.contains(n), "{n} is named as hidden: {html}");
        }
    }
}
