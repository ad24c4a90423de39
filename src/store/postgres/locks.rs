//! Entity leases on PostgreSQL: one row per entity with its owner, a fencing epoch and a lease
//! on the database clock; a waiter marks the lease it waits for, and wakes on the NOTIFY its
//! release then sends.

use super::keys::{in_flight_at, IN_FLIGHT_AT};
use super::leases::{Attempt, Releasing, Taking};
use super::*;

impl PgStore {
    /// Extends `leases` on a connection from `conns`; returns the ones no longer ours.
    async fn renew(
        &self,
        conns: &kept::Kept,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (names, epochs): (Vec<String>, Vec<i64>) =
            leases.iter().map(|l| (l.entity.clone(), l.epoch)).unzip();
        let mut c = conns.take().await?;
        // Rows locked in the entity's order (see [`super::leases`]).
        let kept: Vec<String> = sqlx::query_scalar(&format!(
            "WITH o AS (SELECT entity FROM idem_entity_leases \
               WHERE owner = $1 AND (entity, epoch) IN (SELECT * FROM unnest($2::text[], $4::bigint[])) \
               ORDER BY entity FOR UPDATE) \
             UPDATE idem_entity_leases l SET lease_until = {NOW} + $3 FROM o \
             WHERE l.entity = o.entity RETURNING l.entity"
        ))
        .bind(owner)
        .bind(&names)
        .bind(lease_ms(lease))
        .bind(&epochs)
        .fetch_all(c.conn())
        .await?;
        c.done();
        Ok(names.into_iter().filter(|n| !kept.contains(n)).collect())
    }
}

#[async_trait]
impl Shared for PgStore {
    async fn lock_entities(
        &self,
        entities: &[String],
        owner: &str,
        lease: Duration,
        timeout: Duration,
    ) -> StoreResult<Option<Vec<EntityLease>>> {
        let deadline = Instant::now() + timeout;
        let every = (lease / 3).max(Duration::from_millis(50));
        // When the leases already taken are next due for renewal: kept across wake-ups, so a
        // busy entity that keeps changing hands cannot postpone it.
        let mut renew_at = Instant::now() + every;
        let mut held = Vec::with_capacity(entities.len());
        for entity in entities {
            loop {
                let mut woken = self.hub.subscribe(&entity_topic(entity));
                let taking = Taking::new(entity, owner, lease_ms(lease));
                let attempt = match self.batchers.lease_takes.call(taking).await {
                    Ok(a) => a,
                    Err(e) => {
                        let _ = self.unlock_entities(&held, owner).await;
                        return Err(e);
                    }
                };
                match attempt {
                    Attempt::Acquired(epoch) => {
                        if held.is_empty() {
                            renew_at = Instant::now() + every;
                        }
                        held.push(EntityLease {
                            entity: entity.clone(),
                            epoch,
                        });
                        break;
                    }
                    Attempt::HeldFor(left) => {
                        if Instant::now() >= deadline {
                            let _ = self.unlock_entities(&held, owner).await;
                            return Ok(None);
                        }
                        // Woken by the holder's release, or when its lease would run out — and
                        // never later than a third of our own lease, so the leases already
                        // taken are renewed while we wait for the next one.
                        let wake = (Instant::now() + left + Duration::from_millis(1)).min(deadline);
                        tokio::select! {
                            _ = woken.changed() => {}
                            _ = tokio::time::sleep_until(if held.is_empty() { wake } else { wake.min(renew_at) }) => {}
                        }
                        if !held.is_empty() && Instant::now() >= renew_at {
                            renew_at = Instant::now() + every;
                            match self.renew_entities(&held, owner, lease).await {
                                Ok(lost) if lost.is_empty() => {}
                                Ok(_) => {
                                    let _ = self.unlock_entities(&held, owner).await;
                                    return Ok(None);
                                }
                                Err(e) => {
                                    let _ = self.unlock_entities(&held, owner).await;
                                    return Err(e);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Some(held))
    }
    async fn renew_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        // Durable at its commit: renewals while the upstream call runs keep the lease from
        // lapsing under it, even across a database crash.
        self.renew(&self.kept, leases, owner, lease).await
    }
    async fn recheck_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        // Right before the reservation, whose synchronous commit makes this one durable too.
        self.renew(&self.lazy, leases, owner, lease).await
    }
    async fn unlock_entities(&self, leases: &[EntityLease], owner: &str) -> StoreResult<()> {
        if leases.is_empty() {
            return Ok(());
        }
        // Many requests' releases per round trip (see `release_many`).
        self.batchers
            .lease_releases
            .call(Releasing::new(owner, leases))
            .await
    }
    fn subscribe_key(&self, id: &ScopedKey) -> tokio::sync::watch::Receiver<u64> {
        self.hub.subscribe(&key_topic(id))
    }
    /// Marks the record watched, so that storing its outcome NOTIFYs (see migration `0010`:
    /// a NOTIFY for every outcome reached every replica, for waiters that are rare). The
    /// update waits for an outcome being stored and then finds it settled (`false`: read the
    /// record again); an outcome stored after it sees the mark.
    async fn watch_key(&self, id: &ScopedKey, epoch: i64) -> StoreResult<bool> {
        let sql = format!("UPDATE idem_keys SET watched = true WHERE {IN_FLIGHT_AT}");
        let res = in_flight_at(&sql, id, epoch).execute(&self.pool).await?;
        Ok(res.rows_affected() == 1)
    }
    async fn claim_sends(&self, claim: SendClaim<'_>) -> StoreResult<(u32, Duration)> {
        self.claim(claim).await
    }
}
