//! Below the line: how the PostgreSQL store's statements travel, knowing no table. A
//! [`batch::Batcher`] queues the requests of one kind and sends whatever is queued as one
//! statement (the statement itself is given by `store::postgres::batched`, `leases`, …), a few
//! batches in flight, each on a connection it keeps between batches; [`kept::Kept`] lends
//! connections to single statements the same way. Both exist because sqlx tests every
//! connection given back to its pool with a round trip, which cost a backend wake-up per
//! statement; both give a connection back to the pool after a failure or when it was idle past
//! [`batch::IDLE`], so the pool's test catches a dead one before it carries a write.

pub(super) mod batch;
pub(super) mod kept;
