//! PostgreSQL: entity state (versions, claims), the audit trail, retention.

use super::NOW;
use crate::store::codec::encode_entities;
use crate::store::rows::{self, AUDIT_COLUMNS_PG, ENTITY_COLUMNS};
use crate::store::{
    names_entity, AuditRow, Effects, EntityState, ScopeCheck, ScopedKey, StoreResult, LEGACY_SCOPE,
};
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

pub async fn entity_states(pool: &PgPool, entities: &[String]) -> StoreResult<Vec<EntityState>> {
    let rows = sqlx::query(&format!(
        "SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE entity = ANY($1)"
    ))
    .bind(entities)
    .fetch_all(pool)
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

pub async fn scope_secret(pool: &PgPool, id: &str) -> StoreResult<ScopeCheck> {
    sqlx::query("INSERT INTO idem_meta (name, value) VALUES ('scope_secret_id', $1) ON CONFLICT (name) DO NOTHING")
        .bind(id)
        .execute(pool)
        .await?;
    let recorded: String =
        sqlx::query_scalar("SELECT value FROM idem_meta WHERE name = 'scope_secret_id'")
            .fetch_one(pool)
            .await?;
    let legacy_keys: bool = sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM idem_keys WHERE {LEGACY_SCOPE})"
    ))
    .fetch_one(pool)
    .await?;
    Ok(ScopeCheck {
        recorded,
        legacy_keys,
    })
}

/// One multi-row insert for the whole batch.
pub async fn append_audit(pool: &PgPool, rows: &[AuditRow]) -> StoreResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut qb = sqlx::QueryBuilder::<Postgres>::new(
        "INSERT INTO idem_audit (at, upstream, route, entities, key, fingerprint, decision, upstream_status, \
         total_ms, lock_wait_ms, upstream_ms, expires_at) ",
    );
    qb.push_values(rows, |mut b, r| {
        b.push_bind(r.at)
            .push_bind(&r.upstream)
            .push_bind(&r.route)
            .push_bind(encode_entities(&r.entities))
            .push_unseparated("::jsonb")
            .push_bind(&r.key)
            .push_bind(&r.fingerprint)
            .push_bind(&r.decision)
            .push_bind(r.upstream_status.map(i32::from))
            .push_bind(r.total_ms)
            .push_bind(r.lock_wait_ms)
            .push_bind(r.upstream_ms)
            .push_bind(r.expires_at);
    });
    qb.build().execute(pool).await?;
    Ok(())
}

pub async fn audit_where(
    pool: &PgPool,
    condition: &str,
    arg: &str,
    limit: i64,
) -> StoreResult<Vec<AuditRow>> {
    let rows = sqlx::query(&format!(
        "SELECT {AUDIT_COLUMNS_PG} FROM idem_audit WHERE {condition} ORDER BY id DESC LIMIT $2"
    ))
    .bind(arg)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter().map(rows::audit_row).collect()
}

/// One small batch of each kind of expired row; each statement is short, so purging never
/// holds locks that requests wait on for long.
pub async fn purge(pool: &PgPool, batch: i64, released_before: i64) -> StoreResult<u64> {
    let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW}"))
        .fetch_one(pool)
        .await?;
    let mut n = 0;
    let by_time = [
        ("DELETE FROM idem_keys WHERE ctid = ANY(ARRAY(SELECT ctid FROM idem_keys \
          WHERE state = 'completed' AND expires_at < $1 LIMIT $2))", now),
        ("DELETE FROM idem_keys WHERE ctid = ANY(ARRAY(SELECT ctid FROM idem_keys \
          WHERE state = 'released' AND updated_at < $1 LIMIT $2))", released_before),
        ("DELETE FROM idem_audit WHERE id = ANY(ARRAY(SELECT id FROM idem_audit WHERE expires_at < $1 LIMIT $2))", now),
        ("UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL \
          WHERE entity = ANY(ARRAY(SELECT entity FROM idem_entities WHERE claim_until < $1 LIMIT $2))", now),
        ("DELETE FROM idem_entity_leases WHERE entity = ANY(ARRAY(SELECT entity FROM idem_entity_leases \
          WHERE owner IS NULL AND lease_until < $1 LIMIT $2))", now),
    ];
    for (sql, before) in by_time {
        n += sqlx::query(sql)
            .bind(before)
            .bind(batch)
            .execute(pool)
            .await?
            .rows_affected();
    }
    n += sqlx::query(
        "DELETE FROM idem_entities WHERE entity = ANY(ARRAY(SELECT entity FROM idem_entities \
         WHERE version IS NULL AND claim_key IS NULL LIMIT $1))",
    )
    .bind(batch)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}
