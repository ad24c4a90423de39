//! The SQL of SQLite's other writes (the per-request ones are in [`super::batch`]). Each runs
//! inside the writer's batch transaction, given the batch's clock `now` (ms).

use crate::store::codec::encode_entities;
use crate::store::{
    names_entity, AuditRow, Effects, ScopeCheck, ScopedKey, StoreResult, LEGACY_SCOPE,
};
use sqlx::SqliteConnection;

/// Version and claim changes of a 2xx write. SQLite serves one process, whose in-process
/// entity locks make the writer the only holder: no lease to check.
pub(super) async fn apply_effects(
    conn: &mut SqliteConnection,
    id: &ScopedKey,
    fx: &Effects,
    now: i64,
) -> StoreResult<()> {
    for entity in &fx.entities {
        if let Some(v) = fx.version {
            sqlx::query(
                "INSERT INTO idem_entities (entity, version, updated_at) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (entity) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at \
                 WHERE idem_entities.version IS NULL OR idem_entities.version < excluded.version",
            )
            .bind(entity)
            .bind(v)
            .bind(now)
            .execute(&mut *conn)
            .await?;
        }
        if let Some(until) = fx.claim_until {
            sqlx::query(
                "INSERT INTO idem_entities (entity, claim_upstream, claim_scope, claim_key, claim_until, updated_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
                 ON CONFLICT (entity) DO UPDATE SET claim_upstream = excluded.claim_upstream, \
                   claim_scope = excluded.claim_scope, claim_key = excluded.claim_key, \
                   claim_until = excluded.claim_until, updated_at = excluded.updated_at \
                 WHERE idem_entities.claim_key IS NULL OR idem_entities.claim_until <= ?6 \
                    OR (idem_entities.claim_upstream = ?2 AND idem_entities.claim_scope = ?3 AND idem_entities.claim_key = ?4)",
            )
            .bind(entity)
            .bind(&id.upstream)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(until)
            .bind(now)
            .execute(&mut *conn)
            .await?;
        }
        if fx.release_claim {
            release_claim(conn, entity, now).await?;
        }
    }
    Ok(())
}

pub async fn release_claim(
    conn: &mut SqliteConnection,
    entity: &str,
    now: i64,
) -> StoreResult<bool> {
    let res = sqlx::query(
        "UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL, \
         updated_at = ?2 WHERE entity = ?1 AND claim_key IS NOT NULL",
    )
    .bind(entity)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected() == 1)
}

/// The operator's claim release: the entity and its scoped variants.
pub async fn release_claims(
    conn: &mut SqliteConnection,
    entity: &str,
    now: i64,
) -> StoreResult<bool> {
    let res = sqlx::query(&format!(
        "UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL, \
         updated_at = ?2 WHERE {} AND claim_key IS NOT NULL",
        names_entity("entity", "?1")
    ))
    .bind(entity)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected() > 0)
}

pub async fn reset_version(
    conn: &mut SqliteConnection,
    entity: &str,
    now: i64,
) -> StoreResult<u64> {
    let res = sqlx::query(&format!(
        "UPDATE idem_entities SET version = NULL, updated_at = ?2 WHERE {} AND version IS NOT NULL",
        names_entity("entity", "?1")
    ))
    .bind(entity)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected())
}

pub async fn scope_secret(conn: &mut SqliteConnection, id: &str) -> StoreResult<ScopeCheck> {
    sqlx::query("INSERT INTO idem_meta (name, value) VALUES ('scope_secret_id', ?1) ON CONFLICT (name) DO NOTHING")
        .bind(id)
        .execute(&mut *conn)
        .await?;
    let recorded: String =
        sqlx::query_scalar("SELECT value FROM idem_meta WHERE name = 'scope_secret_id'")
            .fetch_one(&mut *conn)
            .await?;
    let legacy_keys: bool = sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM idem_keys WHERE {LEGACY_SCOPE})"
    ))
    .fetch_one(&mut *conn)
    .await?;
    Ok(ScopeCheck {
        recorded,
        legacy_keys,
    })
}

pub async fn renew(
    conn: &mut SqliteConnection,
    id: &ScopedKey,
    epoch: i64,
    until: i64,
) -> StoreResult<bool> {
    let res = sqlx::query(
        "UPDATE idem_keys SET lease_until = ? WHERE upstream = ? AND scope = ? AND key = ? AND state = 'in_flight' AND epoch = ?",
    )
    .bind(until)
    .bind(&id.upstream)
    .bind(&id.scope)
    .bind(&id.key)
    .bind(epoch)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected() == 1)
}

pub async fn release_key(conn: &mut SqliteConnection, key: &str, now: i64) -> StoreResult<u64> {
    let res = sqlx::query(
        "UPDATE idem_keys SET state = 'released', owner = NULL, updated_at = ?1 \
         WHERE key = ?2 AND state != 'released' AND NOT (state = 'in_flight' AND lease_until > ?1)",
    )
    .bind(now)
    .bind(key)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected())
}

pub async fn probe(conn: &mut SqliteConnection, now: i64) -> StoreResult<()> {
    sqlx::query("INSERT INTO idem_probe (id, at) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET at = excluded.at")
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// One multi-row insert for the whole batch (one statement, not one per row).
pub async fn append_audit(conn: &mut SqliteConnection, rows: &[AuditRow]) -> StoreResult<()> {
    // Fixed-size chunks: a handful of statement shapes, each prepared once and cached,
    // instead of a new statement (and a new prepare) for every batch size.
    for chunk in rows.chunks(64) {
        let mut qb = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
            "INSERT INTO idem_audit (at, upstream, route, entities, key, fingerprint, decision, upstream_status, \
             total_ms, lock_wait_ms, upstream_ms, expires_at) ",
        );
        qb.push_values(chunk, |mut b, r| {
            b.push_bind(r.at)
                .push_bind(&r.upstream)
                .push_bind(&r.route)
                .push_bind(encode_entities(&r.entities))
                .push_bind(&r.key)
                .push_bind(&r.fingerprint)
                .push_bind(&r.decision)
                .push_bind(r.upstream_status.map(i64::from))
                .push_bind(r.total_ms)
                .push_bind(r.lock_wait_ms)
                .push_bind(r.upstream_ms)
                .push_bind(r.expires_at);
        });
        qb.build().execute(&mut *conn).await?;
    }
    Ok(())
}

/// One small batch of each kind of expired row.
pub async fn purge(
    conn: &mut SqliteConnection,
    now: i64,
    batch: i64,
    released_before: i64,
) -> StoreResult<u64> {
    let by_time = [
        ("DELETE FROM idem_keys WHERE (upstream, scope, key) IN (SELECT upstream, scope, key FROM idem_keys \
          WHERE state = 'completed' AND expires_at < ?1 LIMIT ?2)", now),
        ("DELETE FROM idem_keys WHERE (upstream, scope, key) IN (SELECT upstream, scope, key FROM idem_keys \
          WHERE state = 'released' AND updated_at < ?1 LIMIT ?2)", released_before),
        ("DELETE FROM idem_audit WHERE id IN (SELECT id FROM idem_audit WHERE expires_at < ?1 LIMIT ?2)", now),
        ("UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL \
          WHERE entity IN (SELECT entity FROM idem_entities WHERE claim_until < ?1 LIMIT ?2)", now),
    ];
    let mut n = 0;
    for (sql, before) in by_time {
        n += sqlx::query(sql)
            .bind(before)
            .bind(batch)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    n += sqlx::query(
        "DELETE FROM idem_entities WHERE entity IN (SELECT entity FROM idem_entities \
         WHERE version IS NULL AND claim_key IS NULL LIMIT ?1)",
    )
    .bind(batch)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n)
}
