//! What can go wrong with the store, typed. On the request path every kind is
//! `503 store_unavailable` and nothing is forwarded (fail closed); the kind tells the log and
//! the operator why.

/// A store failure.
#[derive(Debug, Clone)]
pub enum StoreError {
    /// The database did not answer, or answered with an error (connection lost, disk full,
    /// a statement failed).
    Unavailable(String),
    /// A stored value could not be read back (a row this release does not understand).
    Corrupt(String),
    /// A stored answer is encrypted and cannot be decrypted with the configured keys (the
    /// key is missing or wrong, or the value was moved from another record).
    Sealed(String),
    /// Another `idemproxy serve` holds this SQLite file.
    InUse(String),
    /// The schema could not be brought up to date.
    Migration(String),
    /// A file beside the database (the lock or the scope secret) could not be used.
    File(String),
    /// The store is shutting down and takes no more writes.
    Closed,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Unavailable(m) => write!(f, "store unavailable: {m}"),
            StoreError::Corrupt(m) => write!(f, "unreadable stored value: {m}"),
            StoreError::InUse(m) | StoreError::File(m) | StoreError::Sealed(m) => f.write_str(m),
            StoreError::Migration(m) => write!(f, "migration failed: {m}"),
            StoreError::Closed => f.write_str("the store is closed"),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        StoreError::Migration(e.to_string())
    }
}

pub type StoreResult<T> = Result<T, StoreError>;
