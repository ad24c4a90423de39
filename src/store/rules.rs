//! The store's rules, written once as SQL both backends run (the dialects agree on these), and
//! mirrored by [`super::KeyRecord::effective_state`] for records already read. Each takes the
//! SQL expression of "now" (ms), because the backends' clocks differ: a parameter on SQLite,
//! the database clock on PostgreSQL.

/// What a record counts as now: an in-flight record whose lease ran out was abandoned (its
/// outcome is unknown); a completed one past its retention is as good as released.
pub fn effective_state(now: &str) -> String {
    format!(
        "(CASE WHEN state = 'in_flight' AND lease_until <= {now} THEN 'unknown' \
         WHEN state = 'completed' AND expires_at < {now} THEN 'released' ELSE state END)"
    )
}

/// The reservation upsert: every column a new reservation sets over the record that stands.
pub const RESERVE_SET: &str = "fingerprint = excluded.fingerprint, route = excluded.route, \
     entities = excluded.entities, state = 'in_flight', owner = excluded.owner, \
     lease_until = excluded.lease_until, epoch = idem_keys.epoch + 1, \
     action = CASE WHEN idem_keys.state IN ('in_flight', 'unknown') THEN idem_keys.action \
       ELSE idem_keys.epoch + 1 END, \
     attempts = idem_keys.attempts + 1, updated_at = excluded.updated_at, call_ms = excluded.call_ms, \
     status = NULL, headers = NULL, body = NULL, enc_key = NULL, expires_at = NULL";

/// When a reservation may take a record that stands: released, or completed past its
/// retention — and, with `take_unknown` (an SQL boolean expression: the upstream dedupes by
/// our key, or the route reconciles before it sends anything), unknown or abandoned in flight.
pub fn reservable(take_unknown: &str) -> String {
    format!(
        "idem_keys.state = 'released' \
         OR (idem_keys.state = 'completed' AND idem_keys.expires_at < excluded.updated_at) \
         OR ({take_unknown} AND (idem_keys.state = 'unknown' \
             OR (idem_keys.state = 'in_flight' AND idem_keys.lease_until <= excluded.updated_at)))"
    )
}

/// What an operator's release may touch: anything but a record already released or one whose
/// upstream call runs right now (in flight with a live lease).
pub fn releasable(now: &str) -> String {
    format!("state <> 'released' AND NOT (state = 'in_flight' AND lease_until > {now})")
}

/// What an operator may settle by hand (complete with the real answer): an outcome nobody
/// knows — unknown, or in flight with its lease lapsed (its caller gone).
pub fn settleable(now: &str) -> String {
    format!("(state = 'unknown' OR (state = 'in_flight' AND lease_until <= {now}))")
}
