//! An entity's timeline: every decision that touched it, oldest first, each a line that says
//! who sent it (the workflow run, the credential scope), what became of it and why, and how
//! long it waited; above them, the entity's version and claim as they stand now.

use super::page::{self, key_link, when, Frame, Nav};
use super::rows;
use crate::state::AppState;
use crate::store::{now_ms, EntityState, StoreResult};
use maud::{html, Markup};

/// Most decisions shown (the newest ones, oldest first).
const LIMIT: i64 = 500;

/// The page of `entity` (`None`: the search box alone).
pub async fn page(
    state: &AppState,
    frame: &Frame<'_>,
    entity: Option<&str>,
) -> StoreResult<Markup> {
    let Some(entity) = entity.map(str::trim).filter(|e| !e.is_empty()) else {
        let body = html! {
            h1 { "Entity timeline" }
            form.big method="get" action="/console/entity" {
                input type="search" name="e" placeholder="contact:901" aria-label="Entity" autofocus;
                button type="submit" { "Show its timeline" }
            }
        };
        return Ok(page::layout(
            frame,
            Nav::Entity(""),
            "Entity timeline",
            body,
        ));
    };
    let states = state.operator().await.find_entities(entity).await?;
    let mut rows = state.store.audit_for_entity(entity, LIMIT).await?;
    rows.reverse();
    let full = rows.len() as i64 == LIMIT;
    let now = now_ms();
    let body = html! {
        h1 { "Timeline of " code.subject { (entity) } }
        (now_state(&states, now))
        @if rows.is_empty() {
            p.empty { "No decision touched this entity (or its audit rows are past retention)." }
        } @else {
            @if full { p.more { "The newest " (LIMIT) " decisions, oldest first." } }
            (rows::table(&rows, rows::Subject::Key))
        }
    };
    Ok(page::layout(frame, Nav::Entity(entity), entity, body))
}

/// The entity's version and claim now, for each credential scope that wrote it.
fn now_state(states: &[EntityState], now: i64) -> Markup {
    html! {
        @if states.is_empty() {
            p.none { "No version or claim recorded for it." }
        } @else {
            table.now {
                caption { "Now" }
                tr { th { "scope" } th { "version" } th { "claim" } }
                @for s in states {
                    tr {
                        td { code { (scope_of(&s.entity)) } }
                        td { @match s.version { Some(v) => code { (v) }, None => span.none { "none" } } }
                        td {
                            @match s.claim.as_ref().filter(|c| c.until > now) {
                                Some(c) => { "held by " (key_link(&c.owner.key)) " until " (when(c.until, None)) }
                                None => span.none { "none" },
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The credential scope an entity name is qualified with (`contact:42@0123…` → `0123…`).
fn scope_of(entity: &str) -> &str {
    let name = crate::key::unqualified(entity);
    entity
        .get(name.len()..)
        .map_or("", |s| s.trim_start_matches('@'))
}

#[cfg(test)]
mod tests {
    #[test]
    fn scopes() {
        assert_eq!(
            super::scope_of("contact:1@0123456789abcdef"),
            "0123456789abcdef"
        );
        assert_eq!(super::scope_of("contact:1"), "");
    }
}
