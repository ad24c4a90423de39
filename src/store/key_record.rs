//! A key's record and state, what a reservation gives, and how a write finishes: the values
//! the [`super::Keys`] interface passes.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    InFlight,
    Completed,
    Released,
    Unknown,
}

impl KeyState {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::InFlight => "in_flight",
            KeyState::Completed => "completed",
            KeyState::Released => "released",
            KeyState::Unknown => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<KeyState> {
        Some(match s {
            "in_flight" => KeyState::InFlight,
            "completed" => KeyState::Completed,
            "released" => KeyState::Released,
            "unknown" => KeyState::Unknown,
            _ => return None,
        })
    }
}

/// A stored key.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    pub id: ScopedKey,
    pub fingerprint: String,
    pub route: String,
    pub entities: Vec<String>,
    pub state: KeyState,
    pub owner: Option<String>,
    pub lease_until: i64,
    pub epoch: i64,
    /// How many times the key was reserved (forwarded or about to be).
    pub attempts: i64,
    /// The stored answer (completed keys), opened or sealed: see [`KeyRecord::answer`].
    pub response: Option<StoredAnswer>,
    /// The id of the encryption key that sealed the answer (`None`: stored in clear).
    pub enc_key: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    pub expires_at: Option<i64>,
    /// The upstream timeout the reservation's call was sent under, in ms (`None`: a record
    /// written before it was kept).
    pub call_ms: Option<i64>,
}

impl KeyRecord {
    /// The stored answer, opened — or [`StoreError::Sealed`] when it is encrypted and cannot
    /// be opened here: what the request path uses, so an answer it cannot read is a store
    /// failure (`503`), never mistaken for no answer (which would forward again).
    pub fn answer(&self) -> StoreResult<Option<&StoredResponse>> {
        match &self.response {
            None => Ok(None),
            Some(StoredAnswer::Open(r)) => Ok(Some(r)),
            Some(StoredAnswer::Sealed(s)) => Err(answer::sealed_error(&self.id, s)),
        }
    }

    /// What the pipeline should treat this record as, now: an in-flight record whose lease ran
    /// out was abandoned by a dead owner, so its outcome is unknown. The same rule as
    /// [`rules::effective_state`], for a record already read.
    pub fn effective_state(&self, now: i64) -> KeyState {
        match self.state {
            KeyState::InFlight if self.lease_until <= now => KeyState::Unknown,
            // A completed key past its retention is as good as gone (purge lags behind).
            KeyState::Completed if self.expires_at.is_some_and(|e| e < now) => KeyState::Released,
            s => s,
        }
    }
}

/// A request to own a key and forward it.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub id: ScopedKey,
    pub fingerprint: String,
    pub route: String,
    pub entities: Vec<String>,
    pub owner: String,
    /// How long the reservation holds without renewal (the store's clock adds it).
    pub lease: Duration,
    /// Take over `unknown` (and abandoned in-flight) records: only when the upstream dedupes
    /// by the key we send (`native_idempotency_header`).
    pub take_unknown: bool,
    /// How long the call may run (the upstream's `timeout`): stored with the reservation, so a
    /// retry that finds it abandoned waits by the deadline it was sent under.
    pub call_timeout: Duration,
}

#[derive(Debug)]
pub enum Reserved {
    /// Ours: the ticket [`Keys::finish`] and [`Keys::renew`] take.
    Owned(super::Ticket),
    /// Someone else's record stands; the pipeline decides (replay, wait, 409, 422).
    Existing(Box<KeyRecord>),
}

impl Reserved {
    /// The action of a key's first reservation. An action is the epoch of the reservation
    /// that began it: a takeover of an unknown outcome continues it, a reservation of a
    /// released or expired key begins the next. A stamped route marks the object it creates
    /// with its action, so a reconcile read cannot mistake an earlier action's object for it.
    pub const NEW_ACTION: i64 = 1;
}

/// How a forward ended.
#[derive(Debug, Clone)]
pub enum Finish {
    Completed {
        /// Shared with the replay cache and the client's answer: stored without a copy.
        response: std::sync::Arc<StoredResponse>,
        expires_at: i64,
        /// Version and claim changes, for 2xx answers.
        effects: Effects,
    },
    Released,
    Unknown,
}

/// When the caller of [`Keys::finish`] hears that an outcome is stored.
pub enum When {
    /// Once it is durable: its caller is answered after.
    Durable,
    /// Once it is committed, visible to every reader: its caller was answered already, from the
    /// replay cache (see [`super::replay::ReplayCache::remember`]), so nobody acts on it being durable and a store
    /// may sync it shortly after (SQLite: see `sqlite::engine::job::Heard`; PostgreSQL: an
    /// asynchronous commit). A crash before that sync leaves the key unknown, as a crash
    /// before the commit would: never forwarded twice. An outcome with entity effects (a
    /// version, a claim) is always made durable first.
    Answered(super::replay::Remembered),
    /// As [`When::Answered`], with nobody waiting: `finish` returns once the store has taken
    /// the write (`Ok(true)`), and the callback hears how it went. A store that rides the
    /// write on its next transaction (SQLite) calls it on its writer thread, so it must be
    /// quick and must not block; others call it before `finish` returns.
    Later(AfterCommit),
}
