//! The entity lease statements of many requests per round trip (see [`super::engine::batch`]): every
//! protected request on an entity route takes its entity's lease and releases it, and one
//! statement each was a round trip and a transaction per request for PostgreSQL to wake for.
//! Both run on lazily durable sessions (see `PgStore::lazy`): a lease taken is made durable by
//! the reservation's synchronous commit before anything is forwarded under it, and a release
//! lost in a database crash only leaves the lease to expire.
//!
//! A statement that locks several lease rows locks them in the entity's order — a take batch
//! by its sorted input, the others by `ORDER BY entity FOR UPDATE` — so that statements of
//! different replicas, each waiting for rows the other has locked, cannot deadlock.

use super::*;
use std::collections::{BTreeMap, HashMap};

/// Result of one attempt at an entity lease.
pub enum Attempt {
    Acquired(i64),
    /// Held by someone else for about this long (zero: ask again at once).
    HeldFor(Duration),
}

/// One request's attempt at one entity's lease.
pub struct Taking {
    entity: String,
    owner: String,
    lease_ms: i64,
}

impl Taking {
    pub fn new(entity: &str, owner: &str, lease_ms: i64) -> Taking {
        Taking {
            entity: entity.to_owned(),
            owner: owner.to_owned(),
            lease_ms,
        }
    }
}

/// Takes the leases of a batch that are free (never taken, released, or run out); of the rest,
/// marks each watched — so that its release NOTIFYs (migration `0011`) — and reads how long it
/// is held. Taking a lease clears its mark (see the migration). Two attempts at one entity in
/// a batch (never from one replica's requests, which queue in the process first): the second
/// hears `HeldFor(0)` and asks again.
///
/// The first statement commits the leases it takes, so once it has answered, every request
/// hears of its own: if the second fails, those still held hear `HeldFor(0)` (they ask again,
/// and hear the error then), and `false` says the connection is not to be kept.
pub async fn take_many(
    conn: &mut sqlx::PgConnection,
    batch: Vec<Taking>,
) -> (bool, StoreResult<Vec<Attempt>>) {
    // Each entity once, in order (the order rows are locked in), with its first attempt.
    let mut first: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, t) in batch.iter().enumerate() {
        first.entry(t.entity.as_str()).or_insert(i);
    }
    match take_then_mark(conn, &batch, &first).await {
        Ok((taken, left)) => {
            let clean = left.is_ok();
            let left = left.unwrap_or_else(|e| {
                tracing::warn!(error = %e, "could not mark the entity leases waited for");
                HashMap::new()
            });
            (clean, Ok(answers(&batch, &first, &taken, &left)))
        }
        Err(e) => (false, Err(e)),
    }
}

type Found = HashMap<String, i64>;

/// The take (its leases, by entity), then the mark (how long each still held has left).
async fn take_then_mark(
    conn: &mut sqlx::PgConnection,
    batch: &[Taking],
    first: &BTreeMap<&str, usize>,
) -> StoreResult<(Found, StoreResult<Found>)> {
    let entities: Vec<&str> = first.keys().copied().collect();
    let owners: Vec<&str> = first.values().map(|&i| batch[i].owner.as_str()).collect();
    let leases: Vec<i64> = first.values().map(|&i| batch[i].lease_ms).collect();
    let taken: Vec<(String, i64)> = sqlx::query_as(&format!(
        "INSERT INTO idem_entity_leases (entity, owner, epoch, lease_until) \
         SELECT t.e, t.o, 1, {NOW} + t.l FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(e, o, l) \
         ON CONFLICT (entity) DO UPDATE SET owner = excluded.owner, epoch = idem_entity_leases.epoch + 1, \
           lease_until = excluded.lease_until, watched = false \
         WHERE idem_entity_leases.owner IS NULL OR idem_entity_leases.lease_until <= {NOW} \
         RETURNING entity, epoch"
    ))
    .bind(&entities)
    .bind(&owners)
    .bind(&leases)
    .fetch_all(&mut *conn)
    .await?;
    let taken: Found = taken.into_iter().collect();
    let held: Vec<&str> = entities
        .iter()
        .copied()
        .filter(|e| !taken.contains_key(*e))
        .collect();
    if held.is_empty() {
        return Ok((taken, Ok(HashMap::new())));
    }
    let left = sqlx::query_as::<_, (String, i64)>(&format!(
        "WITH o AS (SELECT entity FROM idem_entity_leases WHERE entity = ANY($1) \
               ORDER BY entity FOR UPDATE) \
             UPDATE idem_entity_leases l SET watched = true FROM o \
             WHERE l.entity = o.entity AND l.owner IS NOT NULL AND l.lease_until > {NOW} \
             RETURNING l.entity, l.lease_until - {NOW}"
    ))
    .bind(&held)
    .fetch_all(&mut *conn)
    .await
    .map(|rows| rows.into_iter().collect())
    .map_err(StoreError::from);
    Ok((taken, left))
}

/// Each attempt's answer, in the batch's order: only an entity's first attempt can have it.
fn answers(
    batch: &[Taking],
    first: &BTreeMap<&str, usize>,
    taken: &Found,
    left: &Found,
) -> Vec<Attempt> {
    batch
        .iter()
        .enumerate()
        .map(|(i, t)| (t, first.get(t.entity.as_str()) == Some(&i)))
        .map(|(t, first)| match (first, taken.get(&t.entity)) {
            (true, Some(&epoch)) => Attempt::Acquired(epoch),
            // Held (how long for), released since the take (no row: ask again), or a second
            // attempt at an entity in this batch.
            _ => {
                let ms = left.get(&t.entity).copied().filter(|_| first).unwrap_or(0);
                Attempt::HeldFor(Duration::from_millis(ms.max(0) as u64))
            }
        })
        .collect()
}

/// One request's leases to release.
pub struct Releasing {
    owner: String,
    leases: Vec<EntityLease>,
}

impl Releasing {
    pub fn new(owner: &str, leases: &[EntityLease]) -> Releasing {
        Releasing {
            owner: owner.to_owned(),
            leases: leases.to_vec(),
        }
    }
}

/// Releases the leases of a batch of requests in one statement; NOTIFYed only where a waiter
/// marked the lease while it was held (see [`take_many`]).
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
