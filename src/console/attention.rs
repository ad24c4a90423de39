//! Needs attention, the landing page: every key whose outcome is unknown, and every write in
//! flight past its lease (its caller gone), oldest first — what waits longest comes first.
//! Each with what an operator needs to check the real system: route, entities, when, the
//! upstream's status if one came, and the reconcile reads already made for it; then the two
//! acts (see [`super::act`]).

use super::act;
use super::page::{self, entity_link, key_link, when, Frame, Nav};
use crate::key::entity_scope;
use crate::state::AppState;
use crate::store::{now_ms, AuditRow, KeyFilter, KeyRecord, KeyState, StoreResult};
use maud::{html, Markup};
use std::collections::HashMap;

/// Most keys listed at once; the rest wait their turn below the fold of the next visit.
const LIMIT: i64 = 50;

/// Audit rows read per key, for its reconcile reads and upstream status.
const HISTORY: i64 = 100;

/// The page.
pub async fn page(state: &AppState, frame: &Frame<'_>) -> StoreResult<Markup> {
    let filter = KeyFilter {
        state: Some(KeyState::Unknown),
        oldest_first: true,
        limit: LIMIT + 1,
        ..Default::default()
    };
    let mut records = state.operator().await.list_keys(&filter).await?;
    let more = records.len() as i64 > LIMIT;
    records.truncate(LIMIT as usize);
    let mut audits: HashMap<String, Vec<AuditRow>> = HashMap::new();
    for r in &records {
        if !audits.contains_key(&r.id.key) {
            let rows = state.store.audit_for_key(&r.id.key, HISTORY).await?;
            audits.insert(r.id.key.clone(), rows);
        }
    }
    let now = now_ms();
    let body = html! {
        h1 { "Needs attention" }
        @if records.is_empty() {
            p.empty { "Nothing needs attention: no key's outcome is unknown, and no write is \
                       in flight past its lease." }
        } @else {
            p.lead { (records.len()) @if more { "+" } " "
                @if records.len() == 1 { "key" } @else { "keys" }
                " whose outcome is unknown, oldest first. Check each write at the upstream, then \
                  release it (it did not happen) or mark it done (it did) with a note." }
            @for r in &records {
                (card(frame.csrf, r, audits.get(&r.id.key).map_or(&[][..], Vec::as_slice), now))
            }
            @if more { p.more { "Only the oldest " (LIMIT) " are shown: settle these to see the rest." } }
        }
    };
    Ok(page::layout(frame, Nav::Attention, "Needs attention", body))
}

/// One record waiting for an operator.
fn card(csrf: &str, r: &KeyRecord, audit: &[AuditRow], now: i64) -> Markup {
    let lapsed = r.state == KeyState::InFlight;
    let reconciles: Vec<&AuditRow> = audit
        .iter()
        .rev()
        .filter(|a| a.decision.starts_with("reconcile"))
        .collect();
    // The newest answer the upstream gave this key, if any came at all.
    let status = audit
        .iter()
        .filter(|a| !a.decision.starts_with("reconcile"))
        .find_map(|a| a.upstream_status);
    html! {
        article.card data-key=(r.id.key) {
            header {
                (key_link(&r.id.key))
                @if lapsed { span.badge.unknown { "in flight past its lease" } }
                @else { span.badge.unknown { "outcome unknown" } }
                span.age { "since " (when(r.updated_at, Some(now))) }
            }
            dl {
                dt { "route" } dd { code { (r.route) } " on " code { (r.id.upstream) } }
                dt { "entities" } dd {
                    @for e in &r.entities { (entity_link(e)) " " }
                    @if r.entities.is_empty() { span.none { "none" } }
                }
                dt { "first sent" } dd { (when(r.created_at, Some(now))) }
                dt { "attempts" } dd { (r.attempts) }
                dt { "upstream status" } dd {
                    @match status { Some(s) => code { (s) }, None => span.none { "no answer came" } }
                }
                dt { "scope" } dd { code { (entity_scope(&r.id.scope)) } }
            }
            @if reconciles.is_empty() {
                p.none { "No reconcile read was made for it." }
            } @else {
                table.reconciles {
                    caption { "Reconcile reads" }
                    tr { th { "when" } th { "result" } th { "read status" } }
                    @for a in &reconciles {
                        tr {
                            td { (when(a.at, None)) }
                            td { (page::badge(&a.decision)) }
                            td { @match a.upstream_status { Some(s) => (s), None => "none" } }
                        }
                    }
                }
            }
            (act::forms(csrf, r))
        }
    }
}
