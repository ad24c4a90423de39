//! What the rest of the proxy asks of a store, in narrow traits by who asks:
//!
//! - [`Keys`]: the request path's four calls — read a record, reserve it (a [`Ticket`]),
//!   finish it, renew it;
//! - [`EntityStates`]: the request path's read of versions and claims;
//! - [`Operator`]: what an operator reads and settles;
//! - [`AuditLog`]: the trail and retention;
//! - [`Shared`]: what only a store several processes share adds — cross-process entity leases
//!   and being told of another process's change to a key. A store opened alone (SQLite) has
//!   none: [`Opened::shared`] is `None`, and no caller calls a no-op.
//!
//! [`Store`] is all but [`Shared`], plus what the process needs of the store as a whole.

use super::*;
use async_trait::async_trait;
use std::sync::Arc;

/// A reservation this process holds: made only by [`Keys::reserve`] and taken by
/// [`Keys::finish`] and [`Keys::renew`], so an outcome can be stored only under a
/// reservation, fenced by its epoch (an owner that lost its record can never overwrite the
/// new holder's outcome).
#[derive(Debug, Clone)]
pub struct Ticket {
    id: ScopedKey,
    epoch: i64,
    action: i64,
    fingerprint: String,
}

impl Ticket {
    /// The store makes these when it reserves; one made by hand (a tool, a test) is fenced by
    /// its epoch like any other owner's.
    pub fn new(r: &Reservation, epoch: i64, action: i64) -> Ticket {
        Ticket {
            id: r.id.clone(),
            epoch,
            action,
            fingerprint: r.fingerprint.clone(),
        }
    }
    pub fn id(&self) -> &ScopedKey {
        &self.id
    }
    /// The fencing epoch this reservation holds the record at.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }
    /// The action this reservation is part of (see [`Reserved::NEW_ACTION`]).
    pub fn action(&self) -> i64 {
        self.action
    }
    /// The fingerprint the key was reserved with (an outcome carries only the answer).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

/// Idempotency keys on the request path: reserve before forwarding, store the outcome, renew
/// the lease while the call runs.
#[async_trait]
pub trait Keys: Send + Sync + 'static {
    /// Reads one record.
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>>;
    /// Atomically makes the key ours (absent, released, expired — or unknown when
    /// `take_unknown`), committed durably before it returns; else returns what stands. Finding
    /// a record that stands costs no more than reading it — it changes nothing and commits
    /// nothing to disk — so a request with nothing to lock or check lets its reservation be its
    /// look-up (see `pipeline::lookup`).
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved>;
    /// Records the outcome if the ticket's epoch still holds the record; `false` when fenced
    /// off. `when` says when its caller hears of it: once durable, once visible (its caller
    /// was answered from the replay cache), or later, on a callback, without waiting at all.
    async fn finish(&self, ticket: &Ticket, outcome: Finish, when: When) -> StoreResult<bool>;
    /// Extends our lease while the upstream call runs; `false` when fenced off.
    async fn renew(&self, ticket: &Ticket, lease: Duration) -> StoreResult<bool>;
}

/// Per-entity state of ordered persistence, as the request path reads it.
#[async_trait]
pub trait EntityStates: Send + Sync + 'static {
    /// The stored state of these entities (those the store has never seen are left out).
    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>>;
}

/// What an operator reads and does (the admin API, the console, the `keys` command).
#[async_trait]
pub trait Operator: Send + Sync + 'static {
    /// Operator release: every record with this key (any upstream or scope) that is not live
    /// in flight becomes forwardable again. Returns how many.
    async fn release_key(&self, key: &str) -> StoreResult<u64>;
    /// An operator settles one record: `id`, seen at `epoch` with its outcome unknown (or in
    /// flight with its lease lapsed), takes `outcome` — completed with the operator's answer
    /// (its effects are not applied: the operator records no version and takes no claim), or
    /// released. `false` when it is no longer so (a retry took it over, or it was settled
    /// meanwhile): an answer stored since is never dropped or overwritten by it.
    async fn settle_record(&self, id: &ScopedKey, epoch: i64, outcome: Finish)
        -> StoreResult<bool>;
    /// Every record with this key, any upstream or scope.
    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>>;
    async fn list_keys(&self, filter: &KeyFilter) -> StoreResult<Vec<KeyRecord>>;
    /// Release of an entity's claim (and of the claims of its scoped variants, see
    /// [`names_entity`]); `false` when none had one.
    async fn release_claim(&self, entity: &str) -> StoreResult<bool>;
    /// The state of `entity` and of its scoped variants ([`names_entity`]).
    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>>;
    /// Forgets the last accepted version of `entity` (and of its scoped variants), so the
    /// next write with any version is accepted. Returns how many.
    async fn reset_version(&self, entity: &str) -> StoreResult<u64>;
}

/// The audit trail, and retention of everything that expires.
#[async_trait]
pub trait AuditLog: Send + Sync + 'static {
    /// Appends audit rows (called in batches, off the request path).
    async fn append_audit(&self, rows: Vec<AuditRow>) -> StoreResult<()>;
    /// The newest audit rows touching `entity`.
    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>>;
    /// The newest audit rows of `key` (any upstream or scope).
    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>>;
    /// How many requests each route's decisions stood for, per minute, since `since` (ms).
    async fn audit_counts(&self, since: i64) -> StoreResult<Vec<AuditCount>>;
    /// Deletes up to `batch` rows of each kind past retention: completed keys past their
    /// `expires_at`, released keys last touched before `released_before`, audit rows past
    /// their `expires_at`, lapsed claims. Returns how many rows went.
    async fn purge(&self, batch: i64, released_before: i64) -> StoreResult<u64>;
}

/// A whole store: every concern above, plus what the process needs of it as a whole.
#[async_trait]
pub trait Store: Keys + EntityStates + Operator + AuditLog {
    /// `sqlite` or `postgres`, for logs.
    fn backend(&self) -> &'static str;
    /// Records `id` (see [`crate::key::ScopeKeyer::id`]) as the id of the secret that keys
    /// this store's credential scopes, unless one is recorded already; says which is recorded
    /// and whether keys with first-release (unkeyed) scopes remain.
    async fn scope_secret(&self, id: &str) -> StoreResult<ScopeCheck>;
    /// Whether the store answers (readiness).
    async fn ping(&self) -> StoreResult<()>;
    /// Closes connections; pending writes are flushed first.
    async fn close(&self);
    /// Registers `f`, called with a key that another process released (`None`: any key may
    /// have changed, after a lost notification connection), so in-memory copies of completed
    /// answers can be dropped: another replica (PostgreSQL), or a `keys release` beside the
    /// server (SQLite).
    fn observe_releases(&self, f: ReleaseObserver);
}

/// What a store that several processes share adds (PostgreSQL).
#[async_trait]
pub trait Shared: Send + Sync + 'static {
    /// Takes cross-process leases on `entities` (sorted), waiting up to `timeout`; `None` when
    /// it ran out.
    async fn lock_entities(
        &self,
        entities: &[String],
        owner: &str,
        lease: Duration,
        timeout: Duration,
    ) -> StoreResult<Option<Vec<EntityLease>>>;
    /// Extends held entity leases; the ones lost (taken over after expiry) are returned.
    async fn renew_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>>;
    /// [`Shared::renew_entities`] right before the reservation: the last check that the
    /// leases are still ours. A store may make this renewal durable lazily, since the
    /// reservation that follows it is made durable before anything is forwarded.
    async fn recheck_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>>;
    /// Releases entity leases (fenced: only those still ours) and wakes their waiters.
    async fn unlock_entities(&self, leases: &[EntityLease], owner: &str) -> StoreResult<()>;
    /// Interest in changes of a key owned by another process, registered before the caller
    /// asks to watch it ([`Shared::watch_key`], which checks the record again) so no wake-up
    /// is lost.
    fn subscribe_key(&self, id: &ScopedKey) -> tokio::sync::watch::Receiver<u64>;
    /// Asks to be told when the record of `id`, seen in flight at `epoch` and owned by
    /// another request, changes: called after [`Shared::subscribe_key`] and before waiting on
    /// it. `false`: it is no longer in flight at that epoch, so read it again instead of
    /// waiting.
    async fn watch_key(&self, id: &ScopedKey, epoch: i64) -> StoreResult<bool>;
    /// Claims sends of one account's rate-limit budget, for every replica together: how many
    /// were granted, and when none was, about how long until one fits.
    async fn claim_sends(&self, claim: SendClaim<'_>) -> StoreResult<(u32, Duration)>;
}

/// Up to `want` sends of the account (`upstream`, credential `scope`) whose budget is `limit`
/// in any `window`.
#[derive(Debug, Clone, Copy)]
pub struct SendClaim<'a> {
    pub upstream: &'a str,
    pub scope: &'a str,
    pub want: u32,
    pub limit: u32,
    pub window: Duration,
}

/// An open store, and its shared part when it has one.
#[derive(Clone)]
pub struct Opened {
    pub store: Arc<dyn Store>,
    /// `None`: no other process can own keys or lease entities (SQLite), so the in-process
    /// locks already order everything.
    pub shared: Option<Arc<dyn Shared>>,
}
