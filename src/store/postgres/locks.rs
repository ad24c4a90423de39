//! Entity leases on PostgreSQL: one row per entity with its owner, a fencing epoch and a lease
//! on the database clock; a waiter marks the lease it waits for, and wakes on the NOTIFY its
//! release then sends.

use super::*;

/// Result of one attempt at an entity lease.
enum Attempt {
    Acquired(i64),
    /// Held by someone else for about this long.
    HeldFor(Duration),
}

impl PgStore {
    /// On a lazily durable connection (see `PgStore::lazy`): a lease taken is made durable by
    /// the reservation's commit before anything is forwarded under it.
    async fn try_lease(&self, entity: &str, owner: &str, lease: Duration) -> StoreResult<Attempt> {
        let mut c = self.lazy.take().await?;
        let row = sqlx::query(&format!(
            "INSERT INTO idem_entity_leases (entity, owner, epoch, lease_until) VALUES ($1, $2, 1, {NOW} + $3) \
             ON CONFLICT (entity) DO UPDATE SET owner = excluded.owner, epoch = idem_entity_leases.epoch + 1, \
               lease_until = excluded.lease_until, watched = false \
             WHERE idem_entity_leases.owner IS NULL OR idem_entity_leases.lease_until <= excluded.lease_until - $3 \
             RETURNING epoch"
        ))
        .bind(entity)
        .bind(owner)
        .bind(lease_ms(lease))
        .fetch_optional(c.conn())
        .await?;
        if let Some(row) = row {
            c.done();
            return Ok(Attempt::Acquired(row.try_get(0)?));
        }
        // Held: marked watched, so that its release NOTIFYs (see migration `0011`). No row:
        // released since, and the caller asks again.
        let left: Option<i64> = sqlx::query_scalar(&format!(
            "UPDATE idem_entity_leases SET watched = true \
             WHERE entity = $1 AND owner IS NOT NULL AND lease_until > {NOW} \
             RETURNING lease_until - {NOW}"
        ))
        .bind(entity)
        .fetch_optional(c.conn())
        .await?;
        c.done();
        Ok(Attempt::HeldFor(Duration::from_millis(
            left.unwrap_or(0).max(0) as u64,
        )))
    }

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
        let kept: Vec<String> = sqlx::query_scalar(&format!(
            "UPDATE idem_entity_leases SET lease_until = {NOW} + $3 \
             WHERE owner = $1 AND (entity, epoch) IN (SELECT * FROM unnest($2::text[], $4::bigint[])) \
             RETURNING entity"
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
impl EntityLocks for PgStore {
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
                let attempt = match self.try_lease(entity, owner, lease).await {
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
        let releasing = Releasing {
            owner: owner.to_owned(),
            leases: leases.to_vec(),
        };
        self.releases.call(releasing).await
    }
}

/// One request's leases to release.
pub struct Releasing {
    owner: String,
    leases: Vec<EntityLease>,
}

/// Releases the leases of a batch of requests in one statement, on a lazily durable session
/// (see `PgStore::lazy`): a release lost in a database crash only leaves the lease to expire.
/// NOTIFYed only where a waiter marked the lease while it was held (see `try_lease`). The rows
/// are locked in the entity's order, as every statement that locks several lease rows does, so
/// that two such statements of different replicas cannot deadlock.
pub async fn release_many(
    conn: &mut sqlx::PgConnection,
    batch: Vec<Releasing>,
) -> StoreResult<Vec<()>> {
    let mut rows: Vec<(&str, &str, i64)> = batch
        .iter()
        .flat_map(|r| {
            r.leases
                .iter()
                .map(|l| (l.entity.as_str(), r.owner.as_str(), l.epoch))
        })
        .collect();
    rows.sort_unstable();
    let (mut entities, mut owners, mut epochs) = (Vec::new(), Vec::new(), Vec::new());
    for (entity, owner, epoch) in rows {
        entities.push(entity);
        owners.push(owner);
        epochs.push(epoch);
    }
    sqlx::query(&format!(
        "WITH o AS (SELECT l.entity FROM idem_entity_leases l \
           JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS t(e, o, p) \
             ON l.entity = t.e AND l.owner = t.o AND l.epoch = t.p \
           ORDER BY l.entity FOR UPDATE OF l), \
         u AS (UPDATE idem_entity_leases l SET owner = NULL, lease_until = 0 FROM o \
           WHERE l.entity = o.entity RETURNING l.entity, l.watched) \
         SELECT pg_notify('{CHANNEL}', 'e:' || entity)::text FROM u WHERE watched"
    ))
    .bind(&entities)
    .bind(&owners)
    .bind(&epochs)
    .fetch_all(conn)
    .await?;
    Ok(vec![(); batch.len()])
}
