//! The durable store: a trait with few, raw methods, and its backends.
//!
//! Records are keyed by (upstream, scope, key) where scope is the SHA-256 of the credential
//! headers. A record moves `in_flight → completed | released | unknown`; every reservation
//! bumps its `epoch`, and `finish`/`renew` are fenced on it, so an owner that lost its record
//! (lease expired, taken over) can never overwrite the new holder's outcome.

mod answer;
pub mod cached;
pub mod codec;
mod error;
mod id;
mod key_record;
pub mod notify;
pub mod postgres;
mod records;
mod replay_cache;
mod rows;
pub mod rules;
pub mod seal;
mod settling;
pub mod sqlite;

pub use answer::{
    FinishColumns, SealedAnswer, StoredAnswer, StoredResponse, OMITTED_BODY, RECONCILED,
    SET_BY_OPERATOR,
};
pub use error::{StoreError, StoreResult};
pub use id::{KeyParts, ScopedKey};
pub use key_record::{Finish, KeyRecord, KeyState, Reservation, Reserved, When};
pub use records::{
    AfterCommit, AuditCount, AuditRow, Claim, Effects, EntityLease, EntityState, KeyFilter, ScopeId,
};

use async_trait::async_trait;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: the store's clock unit.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn after_ms(d: Duration) -> i64 {
    now_ms().saturating_add(d.as_millis() as i64)
}

/// See [`Store::observe_releases`].
pub type ReleaseObserver = std::sync::Arc<dyn Fn(Option<&str>) + Send + Sync>;

/// Idempotency keys: reserve before forwarding, store the outcome, replay, release.
#[async_trait]
pub trait Keys: Send + Sync + 'static {
    /// A completed answer kept in memory, when the store keeps a replay cache (see
    /// [`cached::CachedStore`]): a replay then needs no lock and no store round trip.
    fn cached(&self, _id: &ScopedKey) -> Option<std::sync::Arc<cached::CachedAnswer>> {
        None
    }
    /// Whether a request on this key, which the replay cache does not answer, most likely
    /// replays: the cache held its answer until it went stale (see [`cached::FRESH_FOR_MS`]),
    /// or most look-ups that missed the cache lately found a completed record. Such a request
    /// reads the record rather than let a reservation look it up (see `pipeline::lookup`).
    fn likely_replay(&self, _id: &ScopedKey) -> bool {
        false
    }
    /// Reads one record.
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>>;
    /// Atomically makes the key ours (absent, released, expired — or unknown when
    /// `take_unknown`), committed durably before it returns; else returns what stands. Finding
    /// a record that stands costs no more than reading it — it changes nothing and commits
    /// nothing to disk — so a request with nothing to lock or check lets its reservation be its
    /// look-up (see `pipeline::lookup`).
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved>;
    /// Records the outcome if we still own `epoch`; `false` when fenced off. `when` says when
    /// its caller hears of it: once durable, once visible (its caller was answered from the
    /// replay cache), or later, on a callback, without waiting at all.
    async fn finish(
        &self,
        id: &ScopedKey,
        epoch: i64,
        outcome: Finish,
        when: When,
    ) -> StoreResult<bool>;
    /// Before [`Keys::finish`] of a key this process reserved: keeps its answer where a retry
    /// finds it at once (the replay cache), so the caller can be answered before the commit.
    /// `false` when it cannot (no cache, or the answer does not fit): answer after the commit.
    fn remember(
        &self,
        _id: &ScopedKey,
        _response: &std::sync::Arc<StoredResponse>,
        _expires_at: i64,
    ) -> bool {
        false
    }
    /// Extends our lease while the upstream call runs; `false` when fenced off.
    async fn renew(&self, id: &ScopedKey, epoch: i64, lease: Duration) -> StoreResult<bool>;
    /// Interest in changes of a key owned by another process, registered before the caller
    /// asks to watch it ([`Keys::watch_key`], which checks the record again) so no wake-up is
    /// lost. `None`: no other process can own keys (SQLite).
    fn subscribe_key(&self, _id: &ScopedKey) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// Asks to be told when the record of `id`, seen in flight at `epoch` and owned by
    /// another request, changes: called after [`Keys::subscribe_key`] and before waiting on
    /// it. `false`: it is no longer in flight at that epoch, so read it again instead of
    /// waiting. A store that tells its subscribers of every change has nothing to record.
    async fn watch_key(&self, _id: &ScopedKey, _epoch: i64) -> StoreResult<bool> {
        Ok(true)
    }
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
    /// Registers `f`, called with a key that another process released (`None`: any key may
    /// have changed, after a lost notification connection), so in-memory copies of completed
    /// answers can be dropped. A one-process store has no one else to hear from.
    fn observe_releases(&self, _f: ReleaseObserver) {}
}

/// Cross-process entity leases with fencing epochs (a one-process store needs none).
#[async_trait]
pub trait EntityLocks: Send + Sync + 'static {
    /// Takes cross-process leases on `entities` (sorted), waiting up to `timeout`; `None` when
    /// it ran out. The default suits a one-process store, whose in-process entity locks
    /// already serialize everything: no lease needed.
    async fn lock_entities(
        &self,
        _entities: &[String],
        _owner: &str,
        _lease: Duration,
        _timeout: Duration,
    ) -> StoreResult<Option<Vec<EntityLease>>> {
        Ok(Some(Vec::new()))
    }
    /// Extends held entity leases; the ones lost (taken over after expiry) are returned.
    async fn renew_entities(
        &self,
        _leases: &[EntityLease],
        _owner: &str,
        _lease: Duration,
    ) -> StoreResult<Vec<String>> {
        Ok(Vec::new())
    }
    /// [`EntityLocks::renew_entities`] right before the reservation: the last check that the
    /// leases are still ours. A store may make this renewal durable lazily, since the
    /// reservation that follows it is made durable before anything is forwarded.
    async fn recheck_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        self.renew_entities(leases, owner, lease).await
    }
    /// Releases entity leases (fenced: only those still ours) and wakes their waiters.
    async fn unlock_entities(&self, _leases: &[EntityLease], _owner: &str) -> StoreResult<()> {
        Ok(())
    }
}

/// Per-entity state of ordered persistence: the last accepted version and the claim.
#[async_trait]
pub trait EntityStates: Send + Sync + 'static {
    /// The stored state of these entities (those the store has never seen are left out).
    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>>;
    /// Operator release of an entity's claim (and of the claims of its scoped variants, see
    /// [`names_entity`]); `false` when none had one.
    async fn release_claim(&self, entity: &str) -> StoreResult<bool>;
    /// Operator view: the state of `entity` and of its scoped variants ([`names_entity`]).
    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>>;
    /// Operator reset: forgets the last accepted version of `entity` (and of its scoped
    /// variants), so the next write with any version is accepted. Returns how many.
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
pub trait Store: Keys + EntityLocks + EntityStates + AuditLog {
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
}

/// What the store knows about the secret that keys its credential scopes.
#[derive(Debug, Clone)]
pub struct ScopeCheck {
    /// The id recorded in the store (the one just given, when none was).
    pub recorded: String,
    /// Keys stored before scopes were keyed, whose scope is a plain SHA-256: a request whose
    /// keyed scope finds nothing also looks for these, so an upgrade never makes a stored
    /// key look new to its own caller's retry.
    pub legacy_keys: bool,
}

/// SQL (SQLite and PostgreSQL alike) that is true when column `col` is the entity named by
/// parameter `param`, or that entity qualified with a credential scope (`name@scope`, see
/// [`crate::key::entity_scope`]): how an operator names "this entity, for every caller".
pub fn names_entity(col: &str, param: &str) -> String {
    // A variant is the name, `@` and exactly 16 hex characters: `user:alice@example.com` is not
    // a scope of `user:alice`.
    format!(
        "({col} = {param} OR (length({col}) = length(CAST({param} AS TEXT)) + 17 \
         AND substr({col}, 1, length(CAST({param} AS TEXT)) + 1) = CAST({param} AS TEXT) || '@'))"
    )
}

/// SQL condition over `idem_keys.scope`: an unkeyed scope (written before scopes were keyed).
pub const LEGACY_SCOPE: &str = "substr(scope, 1, 3) <> 'k1:'";

/// The store's encryption keys, shared by its backend (`None`: answers are stored in clear).
pub type SharedCipher = Option<std::sync::Arc<seal::Cipher>>;

/// Opens the store named by `url` and applies its migrations. With `cipher`, answers are
/// sealed when stored and opened when read (see [`seal`]).
pub async fn open(
    url: &str,
    lease: Duration,
    exclusive: bool,
    cipher: SharedCipher,
) -> StoreResult<std::sync::Arc<dyn Store>> {
    let store: std::sync::Arc<dyn Store> = if url.starts_with("sqlite:") {
        std::sync::Arc::new(sqlite::SqliteStore::open(url, lease, exclusive, cipher).await?)
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        std::sync::Arc::new(postgres::PgStore::open(url, cipher).await?)
    } else {
        return Err(StoreError::Unavailable(format!(
            "store {}: use sqlite://FILE or postgres://...",
            crate::redact::redact_url(url)
        )));
    };
    // A serving process replays hot keys from memory; a CLI process reads the store itself.
    Ok(if exclusive {
        cached::CachedStore::wrap(store)
    } else {
        store
    })
}
