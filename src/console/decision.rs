//! What an audit row's decision means, in the console's words: its kind (the colour of its
//! badge and its column in the overview) and a line that says why the request went the way it
//! did, so a timeline reads as a story rather than as error codes.

use crate::store::AuditRow;

/// The kinds of decision the overview counts apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Forwarded,
    Replayed,
    Refused,
    Unknown,
    Reconciled,
    Released,
    Operator,
    Observed,
}

impl Kind {
    /// Every kind, in the overview's column order.
    pub const ALL: [Kind; 8] = [
        Kind::Forwarded,
        Kind::Replayed,
        Kind::Refused,
        Kind::Unknown,
        Kind::Reconciled,
        Kind::Released,
        Kind::Operator,
        Kind::Observed,
    ];

    /// The CSS class (and column heading) of the kind.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Forwarded => "forwarded",
            Kind::Replayed => "replayed",
            Kind::Refused => "refused",
            Kind::Unknown => "unknown",
            Kind::Reconciled => "reconciled",
            Kind::Released => "released",
            Kind::Operator => "operator",
            Kind::Observed => "observed",
        }
    }
}

/// The kind of a decision as the audit trail spells it.
pub fn kind(decision: &str) -> Kind {
    match decision {
        "forwarded" => Kind::Forwarded,
        "replayed" => Kind::Replayed,
        "unknown" => Kind::Unknown,
        "released" => Kind::Released,
        "released_by_operator" | "completed_by_operator" | "answer_dropped_by_operator" => {
            Kind::Operator
        }
        d if d.starts_with("reconcile") => Kind::Reconciled,
        d if d.starts_with("observed:") => Kind::Observed,
        _ => Kind::Refused,
    }
}

/// The decision's short label: `refused: stale version`, `observed: would replay`.
pub fn label(decision: &str) -> String {
    match kind(decision) {
        Kind::Refused => format!("refused: {}", decision.replace('_', " ")),
        Kind::Observed => format!(
            "observed; enforce: {}",
            decision.trim_start_matches("observed:").replace('_', " ")
        ),
        Kind::Operator if decision == "completed_by_operator" => {
            "marked done by an operator".into()
        }
        Kind::Operator => "released by an operator".into(),
        _ => decision.replace('_', " "),
    }
}

/// Why the request went as it did, in a sentence.
pub fn why(row: &AuditRow) -> String {
    let status = row
        .upstream_status
        .map_or_else(String::new, |s| format!(" {s}"));
    match row.decision.as_str() {
        "forwarded" => format!("a new key: sent upstream, which answered{status}; the answer is stored for its retries"),
        "replayed" => "a retry of a key already answered: the stored answer was sent back, nothing was sent upstream".into(),
        "released" => format!("sent upstream, which answered{status}, a status the route does not keep: the next retry is sent again"),
        "unknown" => "sent upstream, and no complete answer came back: whether the write happened is unknown".into(),
        "reconciled_found" => format!("a reconcile read{status} found the lost write: its retries get the object"),
        "reconciled_not_found" => format!("a reconcile read{status} did not find the lost write: the retry is sent"),
        "reconcile_failed" => format!("a reconcile read{status} could not tell whether the lost write happened"),
        "released_by_operator" => "an operator found the write did not happen: the next retry is sent".into(),
        "answer_dropped_by_operator" => "an operator dropped the stored answer on purpose: the next identical request is sent again".into(),
        "completed_by_operator" => format!("an operator found the write happened and stored its answer{status}: retries get it, nothing is sent"),
        "stale_version" => "its version was not newer than the one already accepted: never sent".into(),
        "entity_claimed" => "another execution holds the entity's claim: never sent".into(),
        "key_reused" => "its key was used before with a different request: never sent".into(),
        "outcome_unknown" => "a retry of a write whose outcome is unknown: never sent, waiting for an operator or a reconcile".into(),
        "request_in_progress" => "a retry of a write still at the upstream".into(),
        "precheck_failed" => "the pre-check read refused it: never sent".into(),
        "entity_busy" => "the entity stayed locked by other writes past lock_timeout: never sent".into(),
        "store_unavailable" => "the store could not be reached: never sent".into(),
        "upstream_unreachable" => "the upstream could not be reached: never sent".into(),
        d if d.starts_with("observed:") => format!(
            "observe mode sent it on; enforce mode would have answered {}",
            d.trim_start_matches("observed:").replace('_', " ")
        ),
        d => format!("refused ({}) before it was sent", d.replace('_', " ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        assert_eq!(kind("reconciled_found"), Kind::Reconciled);
        assert_eq!(kind("reconcile_failed"), Kind::Reconciled);
        assert_eq!(kind("observed:replay"), Kind::Observed);
        assert_eq!(kind("stale_version"), Kind::Refused);
        assert_eq!(kind("completed_by_operator"), Kind::Operator);
        assert_eq!(label("stale_version"), "refused: stale version");
        assert_eq!(
            label("observed:key_reused"),
            "observed; enforce: key reused"
        );
    }
}
