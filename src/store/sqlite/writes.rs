//! The SQL of SQLite writes. Each runs inside the writer's batch transaction, given the
//! batch's clock `now` (ms).

use super::KEY_COLUMNS;
use crate::store::codec::encode_entities;
use crate::store::rows;
use crate::store::{AuditRow, Effects, Finish, Reservation, Reserved, ScopedKey, StoreResult};
use sqlx::{Row, SqliteConnection};

pub async fn reserve(
    conn: &mut SqliteConnection,
    r: &Reservation,
    now: i64,
) -> StoreResult<Reserved> {
    let row = sqlx::query(
        "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, owner, lease_until, epoch, attempts, created_at, updated_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'in_flight', ?7, ?8, 1, 1, ?9, ?9) \
         ON CONFLICT (upstream, scope, key) DO UPDATE SET \
           fingerprint = excluded.fingerprint, route = excluded.route, entities = excluded.entities, \
           state = 'in_flight', owner = excluded.owner, lease_until = excluded.lease_until, \
           epoch = idem_keys.epoch + 1, attempts = idem_keys.attempts + 1, updated_at = excluded.updated_at, \
           status = NULL, headers = NULL, body = NULL, expires_at = NULL \
         WHERE idem_keys.state = 'released' \
            OR (idem_keys.state = 'completed' AND idem_keys.expires_at < ?9) \
            OR (?10 AND (idem_keys.state = 'unknown' OR (idem_keys.state = 'in_flight' AND idem_keys.lease_until <= ?9))) \
         RETURNING epoch",
    )
    .bind(&r.id.upstream)
    .bind(&r.id.scope)
    .bind(&r.id.key)
    .bind(&r.fingerprint)
    .bind(&r.route)
    .bind(encode_entities(&r.entities))
    .bind(&r.owner)
    .bind(now.saturating_add(r.lease.as_millis() as i64))
    .bind(now)
    .bind(r.take_unknown)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(row) = row {
        return Ok(Reserved::Owned {
            epoch: row.try_get(0)?,
        });
    }
    let existing = sqlx::query(&format!(
        "SELECT {KEY_COLUMNS} FROM idem_keys WHERE upstream = ? AND scope = ? AND key = ?"
    ))
    .bind(&r.id.upstream)
    .bind(&r.id.scope)
    .bind(&r.id.key)
    .fetch_one(&mut *conn)
    .await?;
    Ok(Reserved::Existing(Box::new(rows::key_record(&existing)?)))
}

/// Stores the outcome if `epoch` still owns the key, then applies the effects.
pub async fn finish(
    conn: &mut SqliteConnection,
    id: &ScopedKey,
    epoch: i64,
    outcome: Finish,
    now: i64,
) -> StoreResult<bool> {
    let c = outcome.into_columns();
    let res = sqlx::query(
        "UPDATE idem_keys SET state = ?, status = ?, headers = ?, body = ?, expires_at = ?, owner = NULL, updated_at = ? \
         WHERE upstream = ? AND scope = ? AND key = ? AND state = 'in_flight' AND epoch = ?",
    )
    .bind(c.state.as_str())
    .bind(c.status.map(i64::from))
    .bind(c.headers)
    .bind(c.body.as_deref())
    .bind(c.expires_at)
    .bind(now)
    .bind(&id.upstream)
    .bind(&id.scope)
    .bind(&id.key)
    .bind(epoch)
    .execute(&mut *conn)
    .await?;
    let owned = res.rows_affected() == 1;
    if owned && !c.effects.is_empty() {
        apply_effects(conn, id, &c.effects, now).await?;
    }
    Ok(owned)
}

/// Version and claim changes of a 2xx write. SQLite serves one process, whose in-process
/// entity locks make the writer the only holder: no lease to check.
async fn apply_effects(
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
         updated_at = ? WHERE entity = ? AND claim_key IS NOT NULL",
    )
    .bind(now)
    .bind(entity)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected() == 1)
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

pub async fn append_audit(conn: &mut SqliteConnection, rows: &[AuditRow]) -> StoreResult<()> {
    for r in rows {
        sqlx::query(
            "INSERT INTO idem_audit (at, upstream, route, entities, key, fingerprint, decision, upstream_status, \
             total_ms, lock_wait_ms, upstream_ms, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(r.at)
        .bind(&r.upstream)
        .bind(&r.route)
        .bind(encode_entities(&r.entities))
        .bind(&r.key)
        .bind(&r.fingerprint)
        .bind(&r.decision)
        .bind(r.upstream_status.map(i64::from))
        .bind(r.total_ms)
        .bind(r.lock_wait_ms)
        .bind(r.upstream_ms)
        .bind(r.expires_at)
        .execute(&mut *conn)
        .await?;
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
