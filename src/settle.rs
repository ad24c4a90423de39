//! Settling a key by hand: an operator who checked the real system says what became of a write
//! whose outcome the proxy could not know (SPEC "Settling an unknown outcome by hand").
//! Release: it did not happen, the next retry is forwarded. Complete: it happened, and retries
//! get the answer the operator pastes, marked as set by an operator, never a second forward.
//! The admin API, the console and the CLI all settle through here, so each act takes the same
//! locks and leaves the same audit row (`released_by_operator`, `completed_by_operator`) with
//! the operator's note.

use crate::key::entity_scope;
use crate::locks::{LockGuard, LockTable};
use crate::store::{
    after_ms, now_ms, AuditRow, Effects, EntityLease, Finish, KeyRecord, KeyState, ScopedKey,
    Store, StoreError, StoredResponse, SET_BY_OPERATOR,
};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Longest note kept with an operator's act.
pub const NOTE_MAX: usize = 2000;

/// How long settling waits for the key's entities, held by requests in flight.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// Where an operator acts from, and what it may lock.
pub struct Settler<'a> {
    pub store: &'a dyn Store,
    /// This process's entity locks (`None`: a CLI process, which shares none with the server
    /// beside it; the store's leases still order it against every replica).
    pub locks: Option<&'a LockTable>,
    pub owner: &'a str,
    pub lease: Duration,
}

/// The answer an operator pastes for a write that happened.
#[derive(Debug, Default, Clone)]
pub struct Completion {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    /// Which record, when several carry the key (other upstreams or credential scopes).
    pub upstream: Option<String>,
    pub scope: Option<String>,
}

/// Why an operator's act was refused; nothing changed.
#[derive(Debug)]
pub enum Refused {
    /// No record carries the key (`404`).
    NoKey,
    /// The record's outcome is known, or its call may still be running (`409`): the records
    /// as they stand.
    NotUnknown(Vec<KeyRecord>),
    /// Several records carry the key: `upstream` and `scope` must pick one (`409`).
    Ambiguous(Vec<KeyRecord>),
    /// The pasted answer or the note is not usable (`400`).
    Invalid(String),
    /// The key's entities stayed locked by requests in flight (`409`).
    Busy,
    Store(StoreError),
}

impl From<StoreError> for Refused {
    fn from(e: StoreError) -> Self {
        Refused::Store(e)
    }
}

/// What an act did: the records as they now stand, and the audit rows that say so (written by
/// the caller: the server's auditor, or the CLI's store directly).
pub struct Settled {
    pub records: Vec<KeyRecord>,
    pub audit: Vec<AuditRow>,
}

/// A note as kept: trimmed, at most [`NOTE_MAX`] characters; `required` refuses an empty one.
pub fn note(text: Option<&str>, required: bool) -> Result<Option<String>, Refused> {
    let text = text.map(str::trim).filter(|t| !t.is_empty());
    match text {
        None if required => Err(Refused::Invalid(
            "a note is required: say what you checked and what you found".into(),
        )),
        None => Ok(None),
        Some(t) => Ok(Some(t.chars().take(NOTE_MAX).collect())),
    }
}

/// Whether an operator may settle this record now: its outcome unknown, or its call's lease
/// lapsed (its caller gone).
pub fn settleable(r: &KeyRecord) -> bool {
    r.effective_state(now_ms()) == KeyState::Unknown
}

impl Settler<'_> {
    /// The write did not happen: every record of `key` that is not live in flight becomes
    /// forwardable (as `keys release` always did, a completed one too: its stored answer is
    /// dropped and the next retry is forwarded).
    pub async fn release(
        &self,
        key: &str,
        note: Option<String>,
        retention: impl Fn(&str) -> Duration,
    ) -> Result<(u64, Settled), Refused> {
        let before = self.store.find_key(key).await?;
        if before.is_empty() {
            return Err(Refused::NoKey);
        }
        let entities = all_entities(&before);
        let held = self.lock(&entities).await?;
        let released = self.store.release_key(key).await;
        self.unlock(held).await;
        let released = released?;
        let records = self.store.find_key(key).await?;
        let audit = records
            .iter()
            .filter(|r| released > 0 && r.state == KeyState::Released)
            .filter(|r| before.iter().any(|b| same(b, r) && b.state != r.state))
            .map(|r| row(r, "released_by_operator", None, note.clone(), &retention))
            .collect();
        Ok((released, Settled { records, audit }))
    }

    /// The write did not happen, for one record: the record of `key` (picked by `upstream`
    /// and `scope` when several carry it) becomes forwardable — if its outcome is still
    /// unknown once its entities are locked. An answer a retry or a reconcile read stored
    /// meanwhile stands, and so do other callers' records of the same key.
    pub async fn release_one(
        &self,
        key: &str,
        upstream: Option<&str>,
        scope: Option<&str>,
        note: Option<String>,
        retention: impl Fn(&str) -> Duration,
    ) -> Result<Settled, Refused> {
        let records = self.store.find_key(key).await?;
        let record = pick(&records, upstream, scope)?;
        if !settleable(record) {
            return Err(Refused::NotUnknown(vec![record.clone()]));
        }
        let held = self.lock(&record.entities).await?;
        let (id, epoch) = (&record.id, record.epoch);
        let done = self.store.settle_record(id, epoch, Finish::Released).await;
        self.unlock(held).await;
        if !done? {
            return Err(Refused::NotUnknown(self.store.find_key(key).await?));
        }
        let audit = vec![row(record, "released_by_operator", None, note, &retention)];
        let records = self.store.find_key(key).await?;
        Ok(Settled { records, audit })
    }

    /// The write happened: the record of `key` (picked by `upstream` and `scope` when several
    /// carry it) is completed with the operator's answer.
    pub async fn complete(
        &self,
        key: &str,
        c: Completion,
        note: Option<String>,
        retention: impl Fn(&str) -> Duration,
    ) -> Result<Settled, Refused> {
        let response = Arc::new(answer(&c)?);
        let records = self.store.find_key(key).await?;
        let record = pick(&records, c.upstream.as_deref(), c.scope.as_deref())?;
        if !settleable(record) {
            return Err(Refused::NotUnknown(vec![record.clone()]));
        }
        let held = self.lock(&record.entities).await?;
        let keep = retention(&record.route);
        let done = self
            .store
            .settle_record(&record.id, record.epoch, completed(response.clone(), keep))
            .await;
        self.unlock(held).await;
        if !done? {
            // A retry took it over, or another operator settled it, meanwhile.
            let now: Vec<KeyRecord> = self.store.find_key(key).await?;
            return Err(Refused::NotUnknown(now));
        }
        let records: Vec<KeyRecord> = self.store.find_key(key).await?;
        let status = Some(response.status);
        let audit = vec![row(
            record,
            "completed_by_operator",
            status,
            note,
            &retention,
        )];
        Ok(Settled { records, audit })
    }

    /// The entity locks a request on these entities would take: this process's, then the
    /// store's leases across replicas.
    async fn lock(&self, entities: &[String]) -> Result<Held, Refused> {
        let guards = match self.locks {
            Some(t) if !entities.is_empty() => t
                .lock_all(entities, LOCK_WAIT)
                .await
                .map_err(|_| Refused::Busy)?,
            _ => Vec::new(),
        };
        let leases = match entities.is_empty() {
            true => Vec::new(),
            false => self
                .store
                .lock_entities(entities, self.owner, self.lease, LOCK_WAIT)
                .await?
                .ok_or(Refused::Busy)?,
        };
        Ok(Held {
            _guards: guards,
            leases,
        })
    }

    async fn unlock(&self, held: Held) {
        if !held.leases.is_empty() {
            if let Err(e) = self.store.unlock_entities(&held.leases, self.owner).await {
                tracing::warn!(error = %e, "could not release the entity leases taken to settle a key; they lapse with their lease");
            }
        }
    }
}

struct Held {
    _guards: Vec<LockGuard>,
    leases: Vec<EntityLease>,
}

/// The operator's answer as stored: marked as set by an operator, without the headers a
/// stored answer never carries (framing is the proxy's when it replays).
fn answer(c: &Completion) -> Result<StoredResponse, Refused> {
    if !(200..=599).contains(&c.status) {
        return Err(Refused::Invalid(format!(
            "status {} is not an answer's status (200-599)",
            c.status
        )));
    }
    let mut headers = Vec::with_capacity(c.headers.len() + 1);
    for (name, value) in &c.headers {
        let n = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| Refused::Invalid(format!("{name:?} is not a header name")))?;
        let v = http::HeaderValue::from_str(value.trim()).map_err(|_| {
            Refused::Invalid(format!("the value of {name:?} is not a header value"))
        })?;
        if FRAMING.contains(&n.as_str()) {
            continue;
        }
        headers.push((n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())));
    }
    headers.push((SET_BY_OPERATOR.into(), Bytes::from_static(b"1")));
    Ok(StoredResponse {
        status: c.status,
        headers,
        body: c.body.clone(),
    })
}

/// The one record of a key that `upstream` and `scope` name (each may be left out when the
/// rest pick one).
fn pick<'r>(
    records: &'r [KeyRecord],
    upstream: Option<&str>,
    scope: Option<&str>,
) -> Result<&'r KeyRecord, Refused> {
    let picked: Vec<&KeyRecord> = records
        .iter()
        .filter(|r| upstream.is_none_or(|u| u == r.id.upstream))
        .filter(|r| scope.is_none_or(|s| picks_scope(s, &r.id)))
        .collect();
    match picked.as_slice() {
        [] if records.is_empty() => Err(Refused::NoKey),
        [one] => Ok(one),
        _ => Err(Refused::Ambiguous(records.to_vec())),
    }
}

/// The operator's answer as an outcome, kept for `keep`: no entity effects (the operator
/// records no version and takes no claim).
fn completed(response: Arc<StoredResponse>, keep: Duration) -> Finish {
    Finish::Completed {
        response,
        expires_at: after_ms(keep),
        effects: Effects::default(),
    }
}

/// Headers that describe one connection's framing, not the answer.
const FRAMING: [&str; 4] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
];

/// Whether `given` names the record's credential scope: whole, or as the short id the
/// console and the audit trail show.
fn picks_scope(given: &str, id: &ScopedKey) -> bool {
    given == id.scope || given == entity_scope(&id.scope)
}

fn same(a: &KeyRecord, b: &KeyRecord) -> bool {
    a.id == b.id
}

fn all_entities(records: &[KeyRecord]) -> Vec<String> {
    let mut all: Vec<String> = records.iter().flat_map(|r| r.entities.clone()).collect();
    all.sort();
    all.dedup();
    all
}

/// The audit row of an operator's act on record `r`.
fn row(
    r: &KeyRecord,
    decision: &str,
    upstream_status: Option<u16>,
    note: Option<String>,
    retention: &impl Fn(&str) -> Duration,
) -> AuditRow {
    AuditRow {
        at: now_ms(),
        upstream: r.id.upstream.clone(),
        route: r.route.clone(),
        entities: r.entities.clone(),
        key: Some(r.id.key.clone()),
        fingerprint: Some(r.fingerprint.clone()),
        decision: decision.to_owned(),
        upstream_status,
        total_ms: 0,
        lock_wait_ms: 0,
        upstream_ms: None,
        expires_at: after_ms(retention(&r.route)),
        requests: 1,
        scope: Some(crate::store::ScopeId::of(entity_scope(&r.id.scope))),
        workflow: None,
        note,
    }
}

/// A route's retention by name, else the store's (a route renamed since the key was stored).
pub fn retention_of(config: &crate::config::Config) -> impl Fn(&str) -> Duration + '_ {
    move |route| {
        config
            .routes
            .iter()
            .find(|r| r.name == route)
            .map_or(config.store.retention, |r| r.retention)
    }
}
