//! A Zendesk ticket's audits, as the fake Zendesks keep them: each applied update leaves one,
//! carrying the update's `ticket.metadata.custom` — where the shipped route puts its stamp,
//! and what its reconcile reads back (`/api/v2/tickets/{id}/audits.json?sort_order=desc`).

use super::Reply;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

#[derive(Default, Clone)]
pub struct Audits(Arc<Mutex<Vec<Value>>>);

impl Audits {
    /// Records the audit an applied update of `ticket` (its JSON body) makes.
    pub fn record(&self, ticket: u64, update: &Value) {
        let mut audits = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let custom = update["ticket"]["metadata"]["custom"].clone();
        let comment = &update["ticket"]["comment"];
        let events = match comment.is_object() {
            true => json!([{"type": "Comment", "body": comment["body"]}]),
            false => json!([]),
        };
        let id = 9000 + audits.len() as u64;
        audits.push(json!({
            "id": id, "ticket_id": ticket, "events": events,
            "metadata": {"custom": if custom.is_object() { custom } else { json!({}) }, "system": {}},
        }));
    }

    /// The ticket id of an audits path (`/api/v2/tickets/42/audits.json` or without `.json`).
    pub fn ticket_of(path: &str) -> Option<u64> {
        let rest = path.strip_prefix("/api/v2/tickets/")?;
        let id = rest
            .strip_suffix("/audits.json")
            .or_else(|| rest.strip_suffix("/audits"))?;
        id.parse().ok()
    }

    /// The answer to a list of `ticket`'s audits: oldest first, newest first with
    /// `sort_order=desc`.
    pub fn reply(&self, ticket: u64, query: Option<&str>) -> Reply {
        let audits = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<Value> = audits
            .iter()
            .filter(|a| a["ticket_id"] == ticket)
            .cloned()
            .collect();
        if query.is_some_and(|q| q.split('&').any(|p| p == "sort_order=desc")) {
            list.reverse();
        }
        Reply::json(
            200,
            &json!({"audits": list, "count": list.len(), "next_page": null, "previous_page": null}),
        )
    }

    /// How many recorded audits carry `stamp` in their metadata.
    pub fn stamped(&self, stamp: &str) -> usize {
        let audits = self.0.lock().unwrap_or_else(|e| e.into_inner());
        audits
            .iter()
            .filter(|a| a["metadata"]["custom"]["idemproxy_stamp"] == stamp)
            .count()
    }
}
