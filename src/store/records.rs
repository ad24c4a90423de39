//! Records of ordered persistence and of the audit trail, and what operators ask of them.

use super::{KeyState, ScopedKey, StoreError, StoreResult};

/// What the store knows of one entity.
#[derive(Debug, Clone, PartialEq)]
pub struct EntityState {
    pub entity: String,
    /// The last version accepted with a 2xx answer.
    pub version: Option<i64>,
    /// The key that owns the entity (claim-first), while the claim lasts.
    pub claim: Option<Claim>,
    pub updated_at: i64,
}

/// A claim: the first key to succeed owns the entity until `until` (ms).
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    pub owner: ScopedKey,
    pub until: i64,
}

/// What a successful (2xx) write does to its entities, applied in the same transaction as
/// the stored answer and only while the writer still owns its key (and, across replicas, its
/// entity leases) — so a replica that lost its lease cannot advance a version or claim.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Effects {
    pub entities: Vec<String>,
    /// Record this version on every entity.
    pub version: Option<i64>,
    /// Claim every entity for the writing key until this time (ms).
    pub claim_until: Option<i64>,
    /// Release every entity's claim.
    pub release_claim: bool,
    /// The writer's entity leases (empty on a one-process store) and their owner.
    pub leases: Vec<super::EntityLease>,
    pub owner: String,
}

impl Effects {
    pub fn is_empty(&self) -> bool {
        self.entities.is_empty()
            || (self.version.is_none() && self.claim_until.is_none() && !self.release_claim)
    }

    /// The fencing epoch of our lease on `entity`, if the store uses leases.
    pub fn lease_epoch(&self, entity: &str) -> Option<i64> {
        self.leases
            .iter()
            .find(|l| l.entity == entity)
            .map(|l| l.epoch)
    }
}

/// One protected request, as the audit trail keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRow {
    pub at: i64,
    pub upstream: String,
    pub route: String,
    pub entities: Vec<String>,
    pub key: Option<String>,
    pub fingerprint: Option<String>,
    /// `forwarded`, `replayed`, `released`, `unknown`, or the error type.
    pub decision: String,
    pub upstream_status: Option<u16>,
    pub total_ms: i64,
    pub lock_wait_ms: i64,
    pub upstream_ms: Option<i64>,
    pub expires_at: i64,
    /// How many requests this row stands for: one, or a run of one key's requests that ended
    /// alike within one audit batch (a retry storm's replays), folded by the auditor (at the
    /// first one's time, with the slowest one's durations).
    pub requests: i64,
    /// The credential scope as a short id (see [`crate::key::entity_scope`]).
    pub scope: Option<ScopeId>,
    /// The workflow id header's value, when the request carried one.
    pub workflow: Option<String>,
    /// An operator's note, on the rows of an operator's act.
    pub note: Option<String>,
}

/// A credential scope's short id (at most 16 characters: the start of its keyed hash), held
/// inline: every protected request's audit row carries one, and a replay's whole cost is a few
/// microseconds, so it must not cost an allocation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ScopeId {
    bytes: [u8; 16],
    len: u8,
}

impl ScopeId {
    /// The first 16 characters of `text` (a hex id: one byte each).
    pub fn of(text: &str) -> ScopeId {
        let mut end = text.len().min(16);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; 16];
        bytes[..end].copy_from_slice(&text.as_bytes()[..end]);
        ScopeId {
            bytes,
            len: end as u8,
        }
    }

    pub fn as_str(&self) -> &str {
        // Cut at a character boundary in `of`, so always valid UTF-8.
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or_default()
    }
}

impl std::fmt::Display for ScopeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for ScopeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl serde::Serialize for ScopeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// A held cross-process lease on one entity, with its fencing epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntityLease {
    pub entity: String,
    pub epoch: i64,
}

/// Filters for `keys list`.
#[derive(Debug, Default, Clone)]
pub struct KeyFilter {
    pub entity: Option<String>,
    pub state: Option<KeyState>,
    pub limit: i64,
    /// Oldest first (by last change) instead of newest first: what waits longest comes first.
    pub oldest_first: bool,
}

/// Requests of one route that ended with one decision and one class of upstream status within
/// one minute (the console's overview and upstream health): `minute` is the minute's start, in
/// ms since the epoch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AuditCount {
    pub route: String,
    pub decision: String,
    pub minute: i64,
    pub requests: i64,
    /// The upstream's status divided by 100 (2 for 2xx); 0 when nothing answered.
    pub class: i64,
    /// Of the rows with an upstream call: how many, their upstream milliseconds summed, and
    /// the longest.
    pub timed: i64,
    pub upstream_ms: i64,
    pub upstream_max_ms: i64,
}

/// Told how a write nobody waits on went (see [`super::When::Later`]), exactly once: one dropped
/// untold (a writer that stopped with the write still queued) tells that the store is closed,
/// so the caller's bookkeeping (the error counted, the key's slot let go) always runs.
pub struct AfterCommit(Option<Box<dyn FnOnce(StoreResult<bool>) + Send>>);

impl AfterCommit {
    pub fn new(then: impl FnOnce(StoreResult<bool>) + Send + 'static) -> Self {
        AfterCommit(Some(Box::new(then)))
    }

    /// Tells how the write went.
    pub fn tell(mut self, stored: StoreResult<bool>) {
        if let Some(then) = self.0.take() {
            then(stored)
        }
    }
}

impl Drop for AfterCommit {
    fn drop(&mut self) {
        if let Some(then) = self.0.take() {
            then(Err(StoreError::Closed))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn after_commit_is_told_once_even_when_dropped() {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let told = |heard: &Arc<Mutex<Vec<String>>>| {
            let heard = heard.clone();
            AfterCommit::new(move |r| heard.lock().unwrap().push(format!("{r:?}")))
        };
        told(&heard).tell(Ok(true));
        drop(told(&heard));
        assert_eq!(*heard.lock().unwrap(), ["Ok(true)", "Err(Closed)"]);
    }
}
