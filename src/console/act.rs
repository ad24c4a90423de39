//! The console's two acts on a key whose outcome is unknown, each a form with a required
//! note, settled through [`crate::settle`] exactly as the admin API and the CLI settle (the
//! same entity locks, the same audit rows with the note):
//!
//! - Release (`POST /console/release`): the write did not happen; the next retry is sent.
//! - Mark done (`POST /console/complete`): the write happened; the operator pastes the real
//!   answer (status, headers, body) and retries get it, marked as set by an operator.
//!
//! After an act the browser is sent to the key's page (`303`), so a reload repeats nothing.

use super::form::Form;
use super::page::{self, key_href};
use crate::key::entity_scope;
use crate::settle::{self, Completion, Pick, Refused, Settler};
use crate::state::AppState;
use crate::store::{now_ms, AuditRow, KeyRecord};
use crate::upstream::ProxyBody;
use bytes::Bytes;
use http::{Response, StatusCode};
use maud::{html, Markup};
use std::time::Duration;

/// Longest wait for an act's audit row before its key's page is shown.
const AUDITED: Duration = Duration::from_secs(2);

/// `POST /console/release`.
pub async fn release(state: &AppState, form: &Form) -> Response<ProxyBody> {
    let key = form.get("key").unwrap_or_default();
    let done = async {
        let note = settle::note(form.get("note"), true)?;
        // The record the form was drawn for, and only while its outcome is still unknown
        // (checked under the entity locks): a page read a minute ago must not drop an answer
        // a retry or a reconcile read has stored since, nor another caller's record.
        let settled = Settler::of(state)
            .release(key, &pick(form), note, false)
            .await?;
        match settled.audit.is_empty() {
            true => Err(Refused::NotUnknown(settled.records)),
            false => Ok(settled.audit),
        }
    };
    finish(state, key, "released", done.await).await
}

/// `POST /console/complete`.
pub async fn complete(state: &AppState, form: &Form) -> Response<ProxyBody> {
    let key = form.get("key").unwrap_or_default();
    let done = async {
        let note = settle::note(form.get("note"), true)?;
        let completion = completion(form)?;
        let settled = Settler::of(state)
            .complete(key, &pick(form), &completion, note)
            .await?;
        Ok(settled.audit)
    };
    finish(state, key, "completed", done.await).await
}

/// The record the form names (its hidden `upstream` and `scope`).
fn pick(form: &Form) -> Pick {
    let field = |f: &str| form.get(f).filter(|v| !v.is_empty()).map(str::to_owned);
    Pick {
        upstream: field("upstream"),
        scope: field("scope"),
    }
}

/// The answer pasted into the form. Browsers send a textarea's line ends as CRLF: the body
/// is stored with LF, as the object was most likely copied from an API's JSON.
fn completion(form: &Form) -> Result<Completion, Refused> {
    let status = form
        .get("status")
        .and_then(|s| s.trim().parse::<u16>().ok())
        .ok_or_else(|| {
            Refused::Invalid("the status is the real answer's HTTP status (200-599)".into())
        })?;
    let mut headers = Vec::new();
    for line in form.get("headers").unwrap_or_default().lines() {
        if line.trim().is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':').ok_or_else(|| {
            Refused::Invalid(format!("header line {line:?} is not `Name: value`"))
        })?;
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    let body = form.get("body").unwrap_or_default().replace("\r\n", "\n");
    Ok(Completion {
        status,
        headers,
        body: Bytes::from(body),
    })
}

/// The audit rows queued, then the key's page; or the refusal as a page.
async fn finish(
    state: &AppState,
    key: &str,
    done: &str,
    result: Result<Vec<AuditRow>, Refused>,
) -> Response<ProxyBody> {
    match result {
        Ok(rows) => {
            let last = rows.last().map(|r| (r.at, r.decision.clone()));
            for row in rows {
                state.auditor.send(row);
            }
            if let Some(last) = last {
                audited(state, key, last).await;
            }
            page::redirect(&format!("{}&done={done}", key_href(key)), None)
        }
        Err(refused) => refusal(key, refused),
    }
}

/// Waits (at most [`AUDITED`]) until the act's audit row is written, so the page the operator
/// lands on lists it. The row goes through the auditor like every other, which keeps each
/// key's rows in order; the auditor writes a batch within milliseconds. After the wait the page
/// is shown anyway: the row follows.
async fn audited(state: &AppState, key: &str, (at, decision): (i64, String)) {
    let deadline = tokio::time::Instant::now() + AUDITED;
    while tokio::time::Instant::now() < deadline {
        match state.store.audit_for_key(key, 10).await {
            Ok(rows) if rows.iter().any(|r| r.at == at && r.decision == decision) => return,
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(_) => return,
        }
    }
}

/// Why an act was refused, as a page; nothing changed.
fn refusal(key: &str, r: Refused) -> Response<ProxyBody> {
    let status = match &r {
        Refused::NoKey => StatusCode::NOT_FOUND,
        Refused::NotUnknown(_) | Refused::Ambiguous(_) | Refused::Answered(_) | Refused::Busy => {
            StatusCode::CONFLICT
        }
        Refused::Invalid(_) => StatusCode::BAD_REQUEST,
        Refused::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    let message = match &r {
        Refused::Ambiguous(_) => format!("{r}: settle it from the record's own form."),
        Refused::Answered(_) => format!("{r}, with `idemproxy keys release --force --note`."),
        _ => format!("{r}."),
    };
    let records = r.records();
    let now = now_ms();
    let body = html! {
        h1 { "Nothing changed" }
        p.problem { (message) }
        @for r in records {
            p { code { (r.id.upstream) } " · scope " code { (entity_scope(&r.id.scope)) } ": "
                (r.effective_state(now).as_str()) }
        }
        p { a href=(key_href(key)) { "Back to the key" } " · " a href="/" { "Needs attention" } }
    };
    page::respond(status, page::bare("Nothing changed", body))
}

/// The two acts' forms for record `r`, folded until opened (`<details>`: no script).
pub fn forms(csrf: &str, r: &KeyRecord) -> Markup {
    // Both forms name the record (its key, upstream and scope: see `pick`) and carry the token.
    let which = html! {
        input type="hidden" name="csrf" value=(csrf);
        input type="hidden" name="key" value=(r.id.key);
        input type="hidden" name="upstream" value=(r.id.upstream);
        input type="hidden" name="scope" value=(entity_scope(&r.id.scope));
    };
    html! {
        div.acts {
            details.act.release {
                summary { "Release…" }
                form method="post" action="/console/release" {
                    (which)
                    p.hint { "The write did not happen: the next retry is sent upstream." }
                    label { "Note (what you checked, what you found)"
                        textarea name="note" required rows="2" {} }
                    button type="submit" { "Release" }
                }
            }
            details.act.complete {
                summary { "Mark done…" }
                form method="post" action="/console/complete" {
                    (which)
                    p.hint { "The write happened: paste the real object. Retries get it, \
                              marked as set by an operator; nothing is sent upstream." }
                    label { "Status" input type="number" name="status" min="200" max="599" value="200" required; }
                    label { "Headers (one `Name: value` a line)"
                        textarea name="headers" rows="2" { "Content-Type: application/json" } }
                    label { "Body" textarea name="body" rows="6" {} }
                    label { "Note (what you checked, what you found)"
                        textarea name="note" required rows="2" {} }
                    button type="submit" { "Mark done" }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pasted_answer() {
        let form = Form::of(&[
            ("status", " 201 "),
            (
                "headers",
                "Content-Type: application/json\r\n\r\nX-Id:  7 \r\n",
            ),
            ("body", "{\r\n  \"id\": 1\r\n}"),
            ("scope", "0123456789abcdef"),
            ("upstream", ""),
        ]);
        let c = completion(&form).map_err(|e| format!("{e:?}")).unwrap();
        assert_eq!(c.status, 201);
        assert_eq!(
            c.headers,
            [
                ("Content-Type".into(), "application/json".into()),
                ("X-Id".into(), "7".into())
            ]
        );
        assert_eq!(&c.body[..], b"{\n  \"id\": 1\n}");
        let p = pick(&form);
        assert_eq!(
            (p.upstream, p.scope.as_deref()),
            (None, Some("0123456789abcdef"))
        );
        assert!(completion(&Form::of(&[("status", "x")])).is_err());
        assert!(completion(&Form::of(&[("status", "200"), ("headers", "nocolon")])).is_err());
    }
}
