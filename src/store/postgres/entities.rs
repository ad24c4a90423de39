//! Entity state on PostgreSQL: versions and claims, each change fenced on the writer's entity
//! lease.

use super::*;
use crate::store::rows::{self, ENTITY_COLUMNS};
use sqlx::{PgPool, Postgres, Transaction};

/// Applies a 2xx write's effects, each fenced on our entity lease: a replica whose lease was
/// taken over cannot advance a version or claim over the new holder.
pub async fn apply_effects(
    tx: &mut Transaction<'_, Postgres>,
    id: &ScopedKey,
    fx: &Effects,
) -> StoreResult<()> {
    for entity in &fx.entities {
        let Some(lease_epoch) = fx.lease_epoch(entity) else {
            tracing::warn!(
                entity,
                "no lease held on the entity: its version and claim are left alone"
            );
            continue;
        };
        let fence = "EXISTS (SELECT 1 FROM idem_entity_leases l WHERE l.entity = $1 AND l.owner = $2 AND l.epoch = $3)";
        if let Some(v) = fx.version {
            sqlx::query(&format!(
                "INSERT INTO idem_entities (entity, version, updated_at) SELECT $1, $4, {NOW} WHERE {fence} \
                 ON CONFLICT (entity) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at \
                 WHERE idem_entities.version IS NULL OR idem_entities.version < excluded.version"
            ))
            .bind(entity)
            .bind(&fx.owner)
            .bind(lease_epoch)
            .bind(v)
            .execute(&mut **tx)
            .await?;
        }
        if let Some(until) = fx.claim_until {
            sqlx::query(&format!(
                "INSERT INTO idem_entities (entity, claim_upstream, claim_scope, claim_key, claim_until, updated_at) \
                 SELECT $1, $4, $5, $6, $7, {NOW} WHERE {fence} \
                 ON CONFLICT (entity) DO UPDATE SET claim_upstream = excluded.claim_upstream, \
                   claim_scope = excluded.claim_scope, claim_key = excluded.claim_key, \
                   claim_until = excluded.claim_until, updated_at = excluded.updated_at \
                 WHERE idem_entities.claim_key IS NULL OR idem_entities.claim_until <= excluded.updated_at \
                    OR (idem_entities.claim_upstream = $4 AND idem_entities.claim_scope = $5 AND idem_entities.claim_key = $6)"
            ))
            .bind(entity)
            .bind(&fx.owner)
            .bind(lease_epoch)
            .bind(&id.upstream)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(until)
            .execute(&mut **tx)
            .await?;
        }
        if fx.release_claim {
            sqlx::query(&format!(
                "UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, \
                 claim_until = NULL, updated_at = {NOW} WHERE entity = $1 AND {fence}"
            ))
            .bind(entity)
            .bind(&fx.owner)
            .bind(lease_epoch)
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}

pub async fn entity_states<'e>(
    db: impl sqlx::PgExecutor<'e>,
    entities: &[String],
) -> StoreResult<Vec<EntityState>> {
    let rows = sqlx::query(&format!(
        "SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE entity = ANY($1)"
    ))
    .bind(entities)
    .fetch_all(db)
    .await?;
    rows.iter().map(rows::entity_state).collect()
}

/// The operator's claim release: the entity and its scoped variants.
pub async fn release_claim(pool: &PgPool, entity: &str) -> StoreResult<bool> {
    let res = sqlx::query(&format!(
        "UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL, \
         updated_at = {NOW} WHERE {} AND claim_key IS NOT NULL",
        names_entity("entity", "$1")
    ))
    .bind(entity)
    .execute(pool)
    .await?;
    Ok(res.rows_affected() > 0)
}

pub async fn find_entities(pool: &PgPool, entity: &str) -> StoreResult<Vec<EntityState>> {
    let rows = sqlx::query(&format!(
        "SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE {} ORDER BY entity LIMIT 100",
        names_entity("entity", "$1")
    ))
    .bind(entity)
    .fetch_all(pool)
    .await?;
    rows.iter().map(rows::entity_state).collect()
}

pub async fn reset_version(pool: &PgPool, entity: &str) -> StoreResult<u64> {
    let res = sqlx::query(&format!(
        "UPDATE idem_entities SET version = NULL, updated_at = {NOW} WHERE {} AND version IS NOT NULL",
        names_entity("entity", "$1")
    ))
    .bind(entity)
    .execute(pool)
    .await?;
    Ok(res.rows_affected())
}

impl PgStore {
    /// Entity times as read, moved from the database clock onto this replica's.
    pub(super) fn local_states(&self, mut states: Vec<EntityState>) -> Vec<EntityState> {
        for s in &mut states {
            s.updated_at = self.clock.to_local(s.updated_at);
            if let Some(c) = &mut s.claim {
                c.until = self.clock.to_local(c.until);
            }
        }
        states
    }
}

#[async_trait]
impl EntityStates for PgStore {
    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        let mut c = self.kept.take().await?;
        let states = entity_states(c.conn(), entities).await?;
        c.done();
        Ok(self.local_states(states))
    }
}
