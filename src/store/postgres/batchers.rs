//! The hot statements batched many requests per round trip (see [`super::engine::batch`]), each named
//! for what it does.

use super::engine::batch;
use super::{batched, leases, Clock};
use crate::store::{KeyRecord, Reservation, Reserved, ScopedKey, SharedCipher, StoreResult};
use sqlx::PgPool;

pub(super) struct Batchers {
    /// Key records read by key (a lookup the replay cache missed).
    pub record_reads: batch::Batcher<ScopedKey, Option<KeyRecord>>,
    /// Reservations; each answers on its own (see `batched::reserve_many`).
    pub reservations: batch::Batcher<Reservation, StoreResult<Reserved>>,
    /// Outcomes their callers wait on: durable before they hear.
    pub outcomes: batch::Batcher<batched::Finishing, bool>,
    /// Outcomes whose callers were already answered (see `store::When::Answered`).
    pub answered_outcomes: batch::Batcher<batched::Finishing, bool>,
    /// Entity leases taken, many per statement, on the lazily durable pool (see [`leases`]).
    pub lease_takes: batch::Batcher<leases::Taking, leases::Attempt>,
    /// Entity leases released, likewise.
    pub lease_releases: batch::Batcher<leases::Releasing, ()>,
}

impl Batchers {
    pub fn start(pool: &PgPool, lazy_pool: &PgPool, clock: &Clock, cipher: &SharedCipher) -> Self {
        let record_reads = {
            let (clock, cipher) = (clock.clone(), cipher.clone());
            batch::Batcher::start(batch::IN_FLIGHT, pool.clone(), move |mut conn, ids| {
                let (clock, cipher) = (clock.clone(), cipher.clone());
                async move {
                    let out = batched::get_many(&mut conn, &clock, cipher.as_deref(), ids).await;
                    (Some(conn), out)
                }
            })
        };
        let reservations = {
            let (clock, cipher) = (clock.clone(), cipher.clone());
            batch::Batcher::start(batch::IN_FLIGHT, pool.clone(), move |mut conn, rs| {
                let (clock, cipher) = (clock.clone(), cipher.clone());
                async move {
                    let out = batched::reserve_many(&mut conn, &clock, cipher.as_deref(), rs).await;
                    // A statement that failed part-way leaves some requests reserved and the
                    // rest with its error: the connection is not kept either way.
                    let clean = matches!(&out, Ok(each) if each.iter().all(Result::is_ok));
                    (clean.then_some(conn), out)
                }
            })
        };
        // One batch of outcomes at a time: most callers were answered before their outcome
        // commits (`store.answer_before_commit`), so larger, fewer statements cost them
        // nothing (A/B at 64 connections: ~4% more first writes/s than two in flight).
        let outcomes = outcome_batcher(pool, clock, batched::Commit::Session);
        // The same for outcomes whose callers were answered, but a batch of one commits
        // without waiting for its WAL flush. Alone, that flush was what the next reservation's
        // queued behind: a lone client's first write waited for two flushes, not one. A larger
        // batch (concurrent first writes) waits for its flush, which it shares with the
        // reservations' flushes, while the next batch gathers; committed lazily, batches
        // shrank, and first writes/s at 64 connections fell by 5%.
        let answered_outcomes = outcome_batcher(pool, clock, batched::Commit::Lazy);
        // Takes as many in flight as reservations, releases one batch at a time: connections
        // of the lazy pool that its kept connections leave for them.
        let lease_takes = batch::Batcher::start(
            batch::IN_FLIGHT,
            lazy_pool.clone(),
            |mut conn, ts| async move {
                let (clean, out) = leases::take_many(&mut conn, ts).await;
                (clean.then_some(conn), out)
            },
        );
        let lease_releases =
            batch::Batcher::start(1, lazy_pool.clone(), |mut conn, rs| async move {
                let out = leases::release_many(&mut conn, rs).await;
                (out.is_ok().then_some(conn), out)
            });
        Batchers {
            record_reads,
            reservations,
            outcomes,
            answered_outcomes,
            lease_takes,
            lease_releases,
        }
    }

    /// Stops every batcher once its batch in flight is done (their connections go back).
    pub async fn close(&self) {
        self.record_reads.close().await;
        self.reservations.close().await;
        self.outcomes.close().await;
        self.answered_outcomes.close().await;
        self.lease_takes.close().await;
        self.lease_releases.close().await;
    }
}

/// A batcher of outcomes without entity effects, one batch at a time on `pool`: a batch of
/// one commits as `alone` says, larger ones as the session does.
fn outcome_batcher(
    pool: &PgPool,
    clock: &Clock,
    alone: batched::Commit,
) -> batch::Batcher<batched::Finishing, bool> {
    let clock = clock.clone();
    batch::Batcher::start(1, pool.clone(), move |mut conn, fs| {
        let clock = clock.clone();
        async move {
            let commit = match fs.len() {
                1 => alone,
                _ => batched::Commit::Session,
            };
            let several = fs.len() > 1;
            let out = batched::finish_many(&mut conn, &clock, fs, commit).await;
            if several {
                crate::fault::point(crate::fault::Point::PgOutcomeBatch);
            }
            (Some(conn), out)
        }
    })
}
