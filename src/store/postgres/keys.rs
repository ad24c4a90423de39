//! Keys on PostgreSQL: reserve, finish and renew, fenced on the record's epoch; a change of a
//! key that a waiter watches is NOTIFYed, so waiters in other replicas wake without polling.

use super::*;

/// A key's record, on the local clock.
pub(super) async fn record<'e>(
    db: impl sqlx::PgExecutor<'e>,
    clock: &Clock,
    cipher: Option<&crate::store::seal::Cipher>,
    id: &ScopedKey,
) -> StoreResult<Option<KeyRecord>> {
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM idem_keys WHERE upstream = $1 AND scope = $2 AND key = $3"
    ))
    .bind(&id.upstream)
    .bind(&id.scope)
    .bind(&id.key)
    .fetch_optional(db)
    .await?;
    Ok(clock.records(row.as_slice(), cipher)?.pop())
}

/// The record of `$1`–`$3` while epoch `$4` holds it in flight: what the holder's renewals and
/// a waiter's watch may change.
pub(super) const IN_FLIGHT_AT: &str =
    "upstream = $1 AND scope = $2 AND key = $3 AND state = 'in_flight' AND epoch = $4";

/// `sql` (which names the record by [`IN_FLIGHT_AT`]) with the key and epoch bound.
pub(super) fn in_flight_at<'q>(
    sql: &'q str,
    id: &'q ScopedKey,
    epoch: i64,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .bind(epoch)
}

impl PgStore {
    /// Stores an outcome: with no entity effects, batched with others (see `batch`); with
    /// effects, in a transaction of its own.
    async fn finish_columns(
        &self,
        id: &ScopedKey,
        epoch: i64,
        c: crate::store::FinishColumns,
    ) -> StoreResult<bool> {
        if c.effects.is_empty() {
            return self.batchers.outcomes.call((id.clone(), epoch, c)).await;
        }
        // One transaction: the answer and its effects stand or fall together; the
        // notification goes out at commit.
        let mut lent = self.kept.take().await?;
        let mut tx = sqlx::Connection::begin(lent.conn()).await?;
        let mut finishing = [(id.clone(), epoch, c)];
        let owned =
            batched::store_outcomes(&mut *tx, &self.clock, &finishing, batched::Commit::Session)
                .await?;
        let owned = owned.first().copied().unwrap_or(false);
        if owned {
            let mut effects = std::mem::take(&mut finishing[0].2.effects);
            effects.claim_until = effects.claim_until.map(|t| self.clock.to_db(t));
            entities::apply_effects(&mut tx, id, &effects).await?;
        }
        tx.commit().await?;
        lent.done();
        Ok(owned)
    }
}

#[async_trait]
impl Keys for PgStore {
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        self.batchers.record_reads.call(id.clone()).await
    }
    /// New keys go in with `ON CONFLICT DO NOTHING`: a record that stands is read, not locked
    /// (see `batched::reserve_many`).
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        self.batchers.reservations.call(r).await?
    }
    /// An outcome whose caller was answered already and that has no entity effects commits
    /// asynchronously (`synchronous_commit = off`; the batcher does so for a batch of one):
    /// visible to every replica at once, on disk with the next synchronous commit of any
    /// session (every reservation is one) or the WAL writer's next flush, within three
    /// `wal_writer_delay`s. A database crash before then loses it: the key is left in flight
    /// and, once its lease lapses, unknown — never forwarded again, as when this process dies
    /// between the answer and the commit.
    async fn finish(&self, ticket: &Ticket, outcome: Finish, when: When) -> StoreResult<bool> {
        let (id, epoch) = (ticket.id(), ticket.epoch());
        let answered = |c: crate::store::FinishColumns| async move {
            match c.effects.is_empty() {
                true => {
                    let batch = (id.clone(), epoch, c);
                    self.batchers.answered_outcomes.call(batch).await
                }
                false => self.finish_columns(id, epoch, c).await,
            }
        };
        let sealed = outcome.into_columns(self.cipher.as_deref(), id, epoch);
        match when {
            When::Durable => self.finish_columns(id, epoch, sealed?).await,
            When::Answered(_) => answered(sealed?).await,
            When::Later(then) => {
                match sealed {
                    Ok(c) => then.tell(answered(c).await),
                    Err(e) => then.tell(Err(e)),
                }
                Ok(true)
            }
        }
    }
    async fn renew(&self, ticket: &Ticket, lease: Duration) -> StoreResult<bool> {
        let (id, epoch) = (ticket.id(), ticket.epoch());
        let sql = format!("UPDATE idem_keys SET lease_until = {NOW} + $5 WHERE {IN_FLIGHT_AT}");
        let res = in_flight_at(&sql, id, epoch)
            .bind(lease_ms(lease))
            .execute(&self.pool)
            .await?;
        Ok(res.rows_affected() == 1)
    }
}
