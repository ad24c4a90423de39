//! The audit trail and retention on PostgreSQL.

use super::*;
use crate::store::codec::encode_entities;
use crate::store::rows::{self, AUDIT_COLUMNS_PG};
use sqlx::PgPool;

/// One insert for the whole batch, over `UNNEST`ed arrays: one statement shape whatever the
/// batch size, so each connection prepares and plans it once.
pub async fn append_audit<'e>(db: impl sqlx::PgExecutor<'e>, rows: &[AuditRow]) -> StoreResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let text = |f: fn(&AuditRow) -> &str| -> Vec<&str> { rows.iter().map(f).collect() };
    let int = |f: fn(&AuditRow) -> i64| -> Vec<i64> { rows.iter().map(f).collect() };
    sqlx::query(
        "INSERT INTO idem_audit (at, upstream, route, entities, key, fingerprint, decision, upstream_status, \
         total_ms, lock_wait_ms, upstream_ms, expires_at, requests, scope, workflow, note) \
         SELECT at, upstream, route, entities::jsonb, key, fingerprint, decision, upstream_status, \
           total_ms, lock_wait_ms, upstream_ms, expires_at, requests, scope, workflow, note \
         FROM UNNEST($1::int8[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], \
           $8::int4[], $9::int8[], $10::int8[], $11::int8[], $12::int8[], $13::int8[], $14::text[], \
           $15::text[], $16::text[]) \
         AS v(at, upstream, route, entities, key, fingerprint, decision, upstream_status, \
           total_ms, lock_wait_ms, upstream_ms, expires_at, requests, scope, workflow, note)",
    )
    .bind(int(|r| r.at))
    .bind(text(|r| &r.upstream))
    .bind(text(|r| &r.route))
    .bind(rows.iter().map(|r| encode_entities(&r.entities).into_owned()).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.key.as_deref()).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.fingerprint.as_deref()).collect::<Vec<_>>())
    .bind(text(|r| &r.decision))
    .bind(rows.iter().map(|r| r.upstream_status.map(i32::from)).collect::<Vec<_>>())
    .bind(int(|r| r.total_ms))
    .bind(int(|r| r.lock_wait_ms))
    .bind(rows.iter().map(|r| r.upstream_ms).collect::<Vec<_>>())
    .bind(int(|r| r.expires_at))
    .bind(int(|r| r.requests))
    .bind(rows.iter().map(|r| r.scope.as_ref().map(|s| s.as_str())).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.workflow.as_deref()).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.note.as_deref()).collect::<Vec<_>>())
    .execute(db)
    .await?;
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
///
/// Each statement picks its rows `FOR UPDATE SKIP LOCKED` and then changes only those: a row
/// a request has locked (a key being reserved again, a lease being taken or released, a claim
/// being renewed) is left for the next purge, so the purge never waits for a request's lock
/// while holding others — which deadlocked with a batch of lease releases that held the one it
/// waited for and waited for one it held — and a row picked is re-checked against the latest
/// committed version and stays as picked until the purge commits: without the lock, a lease
/// taken again between the pick and the delete was deleted under its new holder.
pub async fn purge(pool: &PgPool, batch: i64, released_before: i64) -> StoreResult<u64> {
    let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW}"))
        .fetch_one(pool)
        .await?;
    let mut n = 0;
    let by_time = [
        ("DELETE FROM idem_keys WHERE ctid = ANY(ARRAY(SELECT ctid FROM idem_keys \
          WHERE state = 'completed' AND expires_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED))", now),
        ("DELETE FROM idem_keys WHERE ctid = ANY(ARRAY(SELECT ctid FROM idem_keys \
          WHERE state = 'released' AND updated_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED))", released_before),
        ("DELETE FROM idem_audit WHERE id = ANY(ARRAY(SELECT id FROM idem_audit WHERE expires_at < $1 LIMIT $2))", now),
        ("UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL \
          WHERE entity = ANY(ARRAY(SELECT entity FROM idem_entities WHERE claim_until < $1 LIMIT $2 \
          FOR UPDATE SKIP LOCKED))", now),
        // No index: one would keep every lease's take and release from being a HOT update
        // (migration `0011`). The walk stops at the batch size, and most leases are free.
        ("DELETE FROM idem_entity_leases WHERE entity = ANY(ARRAY(SELECT entity FROM idem_entity_leases \
          WHERE owner IS NULL AND lease_until < $1 LIMIT $2 FOR UPDATE SKIP LOCKED))", now),
        // Rate-limit sends of accounts gone quiet (a claim drops its own account's old ones):
        // a day is past any API's window.
        ("DELETE FROM idem_pace_sends WHERE ctid = ANY(ARRAY(SELECT ctid FROM idem_pace_sends \
          WHERE at < $1 LIMIT $2))", now - 86_400_000),
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
         WHERE version IS NULL AND claim_key IS NULL LIMIT $1 FOR UPDATE SKIP LOCKED))",
    )
    .bind(batch)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}

#[async_trait]
impl AuditLog for PgStore {
    async fn append_audit(&self, mut rows: Vec<AuditRow>) -> StoreResult<()> {
        // Purged against the database clock.
        for r in &mut rows {
            r.expires_at = self.clock.to_db(r.expires_at);
        }
        // On the lazily durable pool: nobody waits on an audit row being on disk, and its own
        // WAL flush queued the next reservation's behind it (as SQLite's writer syncs audit
        // rows lazily).
        let mut c = self.lazy.take().await?;
        append_audit(c.conn(), &rows).await?;
        c.done();
        Ok(())
    }
    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let names = format!(
            "EXISTS (SELECT 1 FROM jsonb_array_elements_text(entities) AS e(value) WHERE {})",
            names_entity("e.value", "$1")
        );
        audit_where(&self.pool, &names, entity, limit).await
    }
    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        audit_where(&self.pool, "key = $1", key, limit).await
    }
    async fn audit_counts(&self, since: i64) -> StoreResult<Vec<AuditCount>> {
        let rows = sqlx::query(
            "SELECT route, decision, (at / 60000) * 60000 AS minute, \
             COALESCE(upstream_status / 100, 0)::int8 AS class, SUM(requests)::int8 AS requests, \
             COUNT(upstream_ms)::int8 AS timed, COALESCE(SUM(upstream_ms), 0)::int8 AS upstream_ms, \
             COALESCE(MAX(upstream_ms), 0)::int8 AS upstream_max_ms \
             FROM idem_audit WHERE at >= $1 GROUP BY route, decision, minute, class ORDER BY minute",
        )
        .bind(since)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(rows::audit_count).collect()
    }
    async fn purge(&self, batch: i64, released_before: i64) -> StoreResult<u64> {
        purge(&self.pool, batch, self.clock.to_db(released_before)).await
    }
}
