//! Settling a key by hand: an operator who checked the real system says what became of a write
//! whose outcome the proxy could not know (SPEC "Settling an unknown outcome by hand").
//! Release: it did not happen, the next retry is forwarded. Complete: it happened, and retries
//! get the answer the operator pastes, marked as set by an operator, never a second forward.
//! The admin API, the console and the CLI all settle through here, so each act takes the same
//! locks, refuses for the same reasons in the same words, and leaves the same audit row
//! (`released_by_operator`, `completed_by_operator`) with the operator's note.
//!
//! - [`pasted`]: the operator's answer, checked and cleaned before it is stored.
//! - [`held`]: the entity locks an act holds, let go on every path.

mod held;
mod pasted;

pub use pasted::Completion;

use crate::config::Config;
use crate::key::entity_scope;
use crate::locks::LockTable;
use crate::store::replay::ReplayCache;
use crate::store::{
    after_ms, now_ms, AuditRow, Effects, Finish, KeyRecord, KeyState, ScopedKey, Shared, Store,
    StoreError,
};
use held::Held;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Longest note kept with an operator's act.
pub const NOTE_MAX: usize = 2000;

const NOTE_REQUIRED: &str = "a note is required: say what you checked and what you found";

/// How long settling waits for the key's entities, held by requests in flight.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// Where an operator acts from, and what it may lock.
pub struct Settler<'a> {
    pub store: Arc<dyn Store>,
    /// The store's leases across replicas, when it has them.
    pub shared: Option<Arc<dyn Shared>>,
    /// The server's replay cache (`None`: a CLI process, which keeps none): an act comes
    /// after the answers already given, and a released answer leaves it.
    pub replay: Option<Arc<ReplayCache>>,
    /// This process's entity locks (`None`: a CLI process, which shares none with the server
    /// beside it; the store's leases still order it against every replica).
    pub locks: Option<&'a LockTable>,
    /// Who holds the entity leases while an act runs.
    pub owner: String,
    /// The lease, each record's retention and its upstream's limits.
    pub config: &'a Config,
}

/// Which record of a key an act is for, when several carry it (other upstreams or
/// credential scopes). Either may be left out when the rest pick one.
#[derive(Debug, Default, Clone)]
pub struct Pick {
    pub upstream: Option<String>,
    /// The record's credential scope, whole or as the short id the console shows.
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
    /// The key is completed: releasing it would drop the answer its retries get, and the next
    /// identical request would be forwarded — a second write. Only on purpose: `force` (`409`).
    Answered(Vec<KeyRecord>),
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

impl Refused {
    /// The records that explain the refusal, if any.
    pub fn records(&self) -> &[KeyRecord] {
        match self {
            Refused::NotUnknown(rs) | Refused::Ambiguous(rs) | Refused::Answered(rs) => rs,
            _ => &[],
        }
    }
}

/// The refusal in the words every front end shows (each adds how to pick a record its way).
impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::NoKey => f.write_str("no record carries this key"),
            Refused::NotUnknown(_) => f.write_str(
                "only a key whose outcome is unknown (or whose call's lease lapsed) can be settled; \
                 this one's is known, or its call may still be running",
            ),
            Refused::Answered(_) => f.write_str(
                "the key is completed: its retries get the stored answer. Releasing it drops that \
                 answer, and the next identical request is forwarded again — a second write at \
                 the upstream. To do that on purpose (a wrong answer was stored), force it with a \
                 note",
            ),
            Refused::Ambiguous(_) => f.write_str(
                "several records carry this key (other upstreams or credential scopes): \
                 pick one by its upstream and scope",
            ),
            Refused::Invalid(m) => f.write_str(m),
            Refused::Busy => {
                f.write_str("the key's entities stayed locked by requests in flight; try again")
            }
            Refused::Store(e) => write!(f, "the store failed: {e}"),
        }
    }
}

/// What an act did: the records as they now stand, and the audit rows that say so (written by
/// the caller: the server's auditor, or the CLI's store directly). One row per record settled.
pub struct Settled {
    pub records: Vec<KeyRecord>,
    pub audit: Vec<AuditRow>,
}

/// A note as kept: trimmed, control characters but line ends and tabs dropped, at most
/// [`NOTE_MAX`] characters; `required` refuses an empty one.
pub fn note(text: Option<&str>, required: bool) -> Result<Option<String>, Refused> {
    let kept = |c: &char| !c.is_control() || *c == '\n' || *c == '\t';
    let text: Option<String> = text.map(|t| t.chars().filter(kept).take(NOTE_MAX).collect());
    match text.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
        None if required => Err(Refused::Invalid(NOTE_REQUIRED.into())),
        None => Ok(None),
        Some(t) => Ok(Some(t.to_owned())),
    }
}

/// Whether an operator may settle this record now: its outcome unknown, or its call's lease
/// lapsed (its caller gone).
pub fn settleable(r: &KeyRecord) -> bool {
    r.effective_state(now_ms()) == KeyState::Unknown
}

impl<'a> Settler<'a> {
    /// The server's settler: its store, its entity locks, its lease owner.
    pub fn of(state: &'a crate::state::AppState) -> Self {
        Settler {
            store: state.store.clone(),
            shared: state.shared.clone(),
            replay: Some(state.replay.clone()),
            locks: Some(&state.entity_locks),
            owner: state.owner.clone(),
            config: &state.config,
        }
    }

    /// The write did not happen: the picked record of `key` becomes forwardable, if its
    /// outcome is still unknown once its entities are locked (an answer a retry or a
    /// reconcile read stored meanwhile stands). With `force` (and a note), when one record
    /// alone carries the key, a completed one's stored answer is dropped too and the next
    /// identical request is forwarded: a second write, on purpose (audited as
    /// `answer_dropped_by_operator`). A released record stays as it is (no row).
    pub async fn release(
        &self,
        key: &str,
        pick: &Pick,
        note: Option<String>,
        force: bool,
    ) -> Result<Settled, Refused> {
        let records = self.records(key).await?;
        let record = choose(&records, pick)?;
        let state = record.effective_state(now_ms());
        let whole = records.len() == 1 && pick.upstream.is_none() && pick.scope.is_none();
        let done = match state {
            KeyState::Unknown => {
                let held = self.lock(&record.entities).await?;
                let done = self
                    .store
                    .settle_record(&record.id, record.epoch, Finish::Released);
                let done = done.await;
                held.unlock().await;
                done?
            }
            KeyState::Completed if !force => return Err(Refused::Answered(vec![record.clone()])),
            KeyState::Completed if note.is_none() => {
                return Err(Refused::Invalid(
                    "a forced release drops a stored answer: a note is required, saying why".into(),
                ))
            }
            KeyState::Completed if !whole => {
                return Err(Refused::Invalid(
                    "a forced release acts on a key that one record carries, named by the key \
                     alone; this one has several (other upstreams or callers' scopes), and \
                     their answers are theirs"
                        .into(),
                ))
            }
            KeyState::Completed if whole => {
                let held = self.lock(&record.entities).await?;
                let released = self.store.release_key(key).await;
                if let Some(replay) = &self.replay {
                    replay.forget(Some(key));
                }
                held.unlock().await;
                released? > 0
            }
            KeyState::Released => false,
            _ => return Err(Refused::NotUnknown(vec![record.clone()])),
        };
        let now = self.records(key).await?;
        if !done && state != KeyState::Released {
            // A retry took it over, or another operator settled it, meanwhile.
            return Err(Refused::NotUnknown(now));
        }
        let decision = match state {
            KeyState::Completed => "answer_dropped_by_operator",
            _ => "released_by_operator",
        };
        let audit = match done {
            true => vec![self.row(record, decision, None, note)],
            false => Vec::new(),
        };
        tracing::info!(key, upstream = %record.id.upstream, released = done, "key released by an operator");
        Ok(Settled {
            records: now,
            audit,
        })
    }

    /// The write happened: the picked record of `key` is completed with the operator's
    /// answer (a note is required: it is all that says why retries get this object).
    pub async fn complete(
        &self,
        key: &str,
        pick: &Pick,
        c: &Completion,
        note: Option<String>,
    ) -> Result<Settled, Refused> {
        let note = note.ok_or_else(|| Refused::Invalid(NOTE_REQUIRED.into()))?;
        let records = self.records(key).await?;
        let record = choose(&records, pick)?;
        if !settleable(record) {
            return Err(Refused::NotUnknown(vec![record.clone()]));
        }
        let response = Arc::new(c.stored(self.config.upstream(&record.id.upstream).map(|u| &**u))?);
        let finish = Finish::Completed {
            response: response.clone(),
            expires_at: after_ms(self.retention(&record.route)),
            // The operator records no version and takes no claim.
            effects: Effects::default(),
        };
        let held = self.lock(&record.entities).await?;
        let done = self
            .store
            .settle_record(&record.id, record.epoch, finish)
            .await;
        held.unlock().await;
        let now = self.records(key).await?;
        if !done? {
            // A retry took it over, or another operator settled it, meanwhile.
            return Err(Refused::NotUnknown(now));
        }
        let status = Some(response.status);
        tracing::info!(key, upstream = %record.id.upstream, status = response.status, "key completed by an operator");
        let audit = vec![self.row(record, "completed_by_operator", status, Some(note))];
        Ok(Settled {
            records: now,
            audit,
        })
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
        let mut held = Held::new(self.shared.clone(), self.owner.clone(), guards);
        if let Some(shared) = self.shared.as_ref().filter(|_| !entities.is_empty()) {
            let lease = self.config.store.lease;
            let taken = shared.lock_entities(entities, &self.owner, lease, LOCK_WAIT);
            held.leases = taken.await?.ok_or(Refused::Busy)?;
        }
        Ok(held)
    }

    /// Every record of `key`, once the answers already given have committed.
    async fn records(&self, key: &str) -> Result<Vec<KeyRecord>, StoreError> {
        if let Some(replay) = &self.replay {
            replay.settled().await;
        }
        self.store.find_key(key).await
    }

    /// A route's retention by name, else the store's (a route renamed since the key was
    /// stored).
    fn retention(&self, route: &str) -> Duration {
        let routes = &self.config.routes;
        let named = routes.iter().find(|r| r.name == route);
        named.map_or(self.config.store.retention, |r| r.retention)
    }

    /// The audit row of an operator's act on record `r`.
    fn row(
        &self,
        r: &KeyRecord,
        decision: &str,
        status: Option<u16>,
        note: Option<String>,
    ) -> AuditRow {
        AuditRow {
            at: now_ms(),
            upstream: r.id.upstream.clone(),
            route: r.route.clone(),
            entities: r.entities.clone(),
            key: Some(r.id.key.clone()),
            fingerprint: Some(r.fingerprint.clone()),
            decision: decision.to_owned(),
            upstream_status: status,
            total_ms: 0,
            lock_wait_ms: 0,
            upstream_ms: None,
            expires_at: after_ms(self.retention(&r.route)),
            requests: 1,
            scope: Some(crate::store::ScopeId::of(entity_scope(&r.id.scope))),
            workflow: None,
            note,
        }
    }
}

/// The one record of a key that `pick` names.
fn choose<'r>(records: &'r [KeyRecord], pick: &Pick) -> Result<&'r KeyRecord, Refused> {
    let (upstream, scope) = (pick.upstream.as_deref(), pick.scope.as_deref());
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

/// Whether `given` names the record's credential scope: whole, or as the short id the
/// console and the audit trail show.
fn picks_scope(given: &str, id: &ScopedKey) -> bool {
    given == id.scope || given == entity_scope(&id.scope)
}
