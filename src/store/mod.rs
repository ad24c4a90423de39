//! The durable store: narrow traits by who asks ([`api`]), and its backends.
//!
//! Records are keyed by (upstream, scope, key) where scope is the SHA-256 of the credential
//! headers. A record moves `in_flight → completed | released | unknown`; every reservation
//! bumps its `epoch`, and `finish`/`renew` are fenced on it, so an owner that lost its record
//! (lease expired, taken over) can never overwrite the new holder's outcome.

mod answer;
mod api;
pub mod codec;
mod error;
mod id;
mod key_record;
pub mod notify;
pub mod postgres;
mod records;
pub mod replay;
mod rows;
pub mod rules;
pub mod seal;
pub mod sqlite;

pub use answer::{
    FinishColumns, SealedAnswer, StoredAnswer, StoredResponse, OMITTED_BODY, RECONCILED,
    SET_BY_OPERATOR,
};
pub use api::{AuditLog, EntityStates, Keys, Opened, Operator, SendClaim, Shared, Store, Ticket};
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
) -> StoreResult<Opened> {
    use std::sync::Arc;
    if url.starts_with("sqlite:") {
        let store = Arc::new(sqlite::SqliteStore::open(url, lease, exclusive, cipher).await?);
        return Ok(Opened {
            store,
            shared: None,
        });
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let store = Arc::new(postgres::PgStore::open(url, cipher).await?);
        return Ok(Opened {
            store: store.clone(),
            shared: Some(store),
        });
    }
    Err(StoreError::Unavailable(format!(
        "store {}: use sqlite://FILE or postgres://...",
        crate::redact::redact_url(url)
    )))
}
