//! What the writer runs: a job, the context it runs in, and when its caller hears back. Shared
//! by the writer, the outcomes waiting for it (`deferred`) and the tables' writes (`keys`,
//! `audit`), so none of them depends on another for these.

use super::inbox::Delivery;
use crate::store::{StoreError, StoreResult};
use rusqlite::Connection;

/// What a job is given: the connection (inside the batch's transaction), the batch's clock
/// (ms), and the cipher that opens the records a reservation finds standing.
pub struct Tx<'a> {
    pub conn: &'a Connection,
    pub now: i64,
    pub cipher: Option<&'a crate::store::seal::Cipher>,
}

/// Holds `res` until the commit, then hands it to `to`; a failed commit turns it into that
/// error.
pub(super) fn deliver<T: Send + 'static>(
    to: impl FnOnce(StoreResult<T>) + Send + 'static,
    res: StoreResult<T>,
) -> Delivery {
    Delivery::here(Box::new(move |failure: Option<&str>| {
        to(match failure {
            Some(msg) => Err(StoreError::Unavailable(msg.to_owned())),
            None => res,
        })
    }))
}

/// One write, run in the batch's transaction; what it returns is delivered after the commit.
pub type Job = Box<dyn FnOnce(&Tx) -> Delivery + Send>;

/// When a write's caller hears back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// Once its commit is on disk: what the caller acts on (a reservation before a forward).
    Synced,
    /// Once it is committed (visible to every reader), its `fdatasync` following within
    /// [`super::durable::LAZY_SYNC`]: for writes nobody acts on being durable — an outcome
    /// whose caller was already answered (`store::When::Answered`), audit rows. Their callers
    /// let go of the key's slot and entity locks at once, and a lone first write pays one
    /// `fdatasync` (its reservation's), not two.
    Committed,
}
