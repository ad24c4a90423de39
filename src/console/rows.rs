//! Audit rows as the console's table, shared by an entity's timeline and a key's attempts.

use super::decision;
use super::page::{self, durations, entity_link, key_link, precise};
use crate::store::AuditRow;
use maud::{html, Markup};

/// What a decision table names in its fourth column: the key of each row (an entity's
/// timeline) or its entities (a key's attempts).
pub enum Subject {
    Key,
    Entities,
}

/// Audit rows as a table, in the order given: when, route, the subject, workflow, decision
/// and why (with the operator's note), upstream status, waits, credential scope.
pub fn table(rows: &[AuditRow], subject: Subject) -> Markup {
    let subject_name = match subject {
        Subject::Key => "key",
        Subject::Entities => "entities",
    };
    html! {
        table.timeline {
            thead { tr {
                th { "#" } th { "when" } th { "route" } th { (subject_name) } th { "workflow" }
                th { "decision, and why" } th { "upstream" } th { "waited" } th { "scope" }
            } }
            tbody {
                @for (i, row) in rows.iter().enumerate() {
                    tr class={ "row " (decision::kind(&row.decision).name()) } {
                        td.n { (i + 1) }
                        td.at { (precise(row.at)) }
                        td { code { (row.route) } }
                        @match subject {
                            Subject::Key => td { @match &row.key { Some(k) => (key_link(k)), None => span.none { "none" } } },
                            Subject::Entities => td { @for e in &row.entities { (entity_link(e)) " " } },
                        }
                        td { @match &row.workflow { Some(w) => code.workflow { (w) }, None => span.none { "none" } } }
                        td.decision {
                            (page::badge(&row.decision))
                            @if row.requests > 1 { " " span.times { "×" (row.requests) } }
                            div.why { (decision::why(row)) }
                            @if let Some(note) = &row.note { div.note { "note: " q { (note) } } }
                        }
                        td { @match row.upstream_status { Some(s) => code { (s) }, None => span.none { "none" } } }
                        td { (durations(row)) }
                        td { @match &row.scope { Some(s) => code { (s) }, None => span.none { "none" } } }
                    }
                }
            }
        }
    }
}
