//! The audit trail and retention on SQLite.

use super::*;
use rusqlite::{params, Connection};

/// The batch's audit rows, inside the audit thread's transaction, in multi-row inserts of 32, 16, …,
/// 1 rows (as few statements as the row count has binary digits), each prepared once. A
/// statement has a fixed cost beyond its rows: setting up the VM, and on `idem_audit`
/// (AUTOINCREMENT) reading and writing its `sqlite_sequence` row. `OR FAIL`: a multi-row
/// statement that may abort halfway makes SQLite journal every page it changes, so that it can
/// undo its own rows; the caller rolls back the whole transaction on any error instead.
pub fn append_audit(conn: &Connection, rows: &[AuditRow]) -> StoreResult<()> {
    let mut rest = rows;
    while let Some((&n, sql)) = AUDIT_CHUNKS
        .iter()
        .zip(AUDIT_INSERTS.iter())
        .find(|(&n, _)| n <= rest.len())
    {
        let (chunk, after) = rest.split_at(n);
        let mut stmt = conn.prepare_cached(sql)?;
        let entities: Vec<std::borrow::Cow<str>> =
            chunk.iter().map(|r| encode_entities(&r.entities)).collect();
        let scopes: Vec<Option<&str>> = chunk
            .iter()
            .map(|r| r.scope.as_ref().map(|s| s.as_str()))
            .collect();
        let statuses: Vec<Option<i64>> = chunk
            .iter()
            .map(|r| r.upstream_status.map(i64::from))
            .collect();
        let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(n * AUDIT_FIELDS);
        let each = chunk.iter().zip(&entities).zip(&statuses).zip(&scopes);
        for (((r, entities), status), scope) in each {
            values.extend([
                &r.at as &dyn rusqlite::ToSql,
                &r.upstream,
                &r.route,
                entities,
                &r.key,
                &r.fingerprint,
                &r.decision,
                status,
                &r.total_ms,
                &r.lock_wait_ms,
                &r.upstream_ms,
                &r.expires_at,
                &r.requests,
                scope,
                &r.workflow,
                &r.note,
            ]);
        }
        stmt.execute(values.as_slice())?;
        rest = after;
    }
    Ok(())
}

/// Rows per multi-row insert, largest first; the last is 1, so every row finds a statement.
pub(super) const AUDIT_CHUNKS: [usize; 6] = [32, 16, 8, 4, 2, 1];
const AUDIT_FIELDS: usize = 16;

/// One insert text per entry of [`AUDIT_CHUNKS`].
static AUDIT_INSERTS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
    AUDIT_CHUNKS
        .iter()
        .map(|&n| {
            let rows: Vec<String> = (0..n)
                .map(|i| {
                    let cols: Vec<String> = (1..=AUDIT_FIELDS)
                        .map(|c| format!("?{}", i * AUDIT_FIELDS + c))
                        .collect();
                    format!("({})", cols.join(", "))
                })
                .collect();
            format!(
                "INSERT OR FAIL INTO idem_audit (at, upstream, route, entities, key, fingerprint, decision, \
                 upstream_status, total_ms, lock_wait_ms, upstream_ms, expires_at, requests, scope, workflow, \
                 note) VALUES {}",
                rows.join(", ")
            )
        })
        .collect()
});

/// One small batch of each kind of expired row in the main database (the audit file's are
/// purged by its own thread: see [`super::audit_file`]).
pub fn purge(conn: &Connection, now: i64, batch: i64, released_before: i64) -> StoreResult<u64> {
    let by_time = [
        // INDEXED BY: without statistics SQLite prefers the state index and walks every
        // completed key (1.6 s at a million) on the writer; the partial index holds only rows
        // the purge can delete (0.1 ms when none are due).
        ("DELETE FROM idem_keys WHERE (upstream, scope, key) IN (SELECT upstream, scope, key FROM idem_keys \
          INDEXED BY idem_keys_completed_expiry WHERE state = 'completed' AND expires_at < ?1 LIMIT ?2)", now),
        ("DELETE FROM idem_keys WHERE (upstream, scope, key) IN (SELECT upstream, scope, key FROM idem_keys \
          INDEXED BY idem_keys_released_updated WHERE state = 'released' AND updated_at < ?1 LIMIT ?2)", released_before),
        ("UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL \
          WHERE entity IN (SELECT entity FROM idem_entities INDEXED BY idem_entities_claimed \
          WHERE claim_until IS NOT NULL AND claim_until < ?1 LIMIT ?2)", now),
        ("DELETE FROM idem_releases WHERE seq IN (SELECT seq FROM idem_releases WHERE at < ?1 LIMIT ?2)",
          now - super::releases::KEEP_MS),
    ];
    let mut n = 0;
    for (sql, before) in by_time {
        n += conn.prepare_cached(sql)?.execute(params![before, batch])? as u64;
    }
    n += conn
        .prepare_cached(
            "DELETE FROM idem_entities WHERE entity IN (SELECT entity FROM idem_entities \
             INDEXED BY idem_entities_empty WHERE version IS NULL AND claim_key IS NULL LIMIT ?1)",
        )?
        .execute(params![batch])? as u64;
    Ok(n)
}

#[async_trait]
impl AuditLog for SqliteStore {
    async fn append_audit(&self, rows: Vec<AuditRow>) -> StoreResult<()> {
        self.audit.append(rows).await
    }
    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {AUDIT_COLUMNS} FROM idem_audit \
             WHERE EXISTS (SELECT 1 FROM json_each(idem_audit.entities) WHERE {}) ORDER BY id DESC LIMIT ?2",
            names_entity("value", "?1")
        ))
        .bind(entity)
        .bind(limit)
        .fetch_all(&self.audit_reads)
        .await?;
        rows.iter().map(rows::audit_row).collect()
    }
    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let rows = sqlx::query(&super::audit_index::by_key(AUDIT_COLUMNS))
            .bind(key)
            .bind(limit)
            .fetch_all(&self.audit_reads)
            .await?;
        rows.iter().map(rows::audit_row).collect()
    }
    async fn audit_counts(&self, since: i64) -> StoreResult<Vec<AuditCount>> {
        let rows = sqlx::query(
            "SELECT route, decision, (at / 60000) * 60000 AS minute, \
             COALESCE(upstream_status / 100, 0) AS class, SUM(requests) AS requests, \
             COUNT(upstream_ms) AS timed, COALESCE(SUM(upstream_ms), 0) AS upstream_ms, \
             COALESCE(MAX(upstream_ms), 0) AS upstream_max_ms \
             FROM idem_audit WHERE at >= ?1 GROUP BY route, decision, minute, class ORDER BY minute",
        )
        .bind(since)
        .fetch_all(&self.audit_reads)
        .await?;
        rows.iter().map(rows::audit_count).collect()
    }
    async fn purge(&self, batch: i64, released_before: i64) -> StoreResult<u64> {
        let main = self
            .writer
            .write(move |ctx| purge(ctx.conn, ctx.now, batch, released_before))
            .await?;
        Ok(main + self.audit.purge(now_ms(), batch).await?)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use crate::store::{AuditRow, Store};
    use std::sync::Arc;

    /// The store on the database `db`, created if missing (migrations run, audit file made).
    pub async fn open(db: &std::path::Path) -> Arc<dyn Store> {
        let url = format!("sqlite://{}", db.display());
        crate::store::open(&url, std::time::Duration::from_secs(30), true, None)
            .await
            .unwrap()
            .store
    }

    /// A row whose fields all differ with `n`, of key `k`.
    pub fn row(n: i64) -> AuditRow {
        AuditRow {
            at: n,
            upstream: "api".into(),
            route: "charges".into(),
            entities: vec![format!("customer:{n}")],
            key: Some("k".into()),
            fingerprint: Some(format!("fp{n}")),
            decision: "forwarded".into(),
            upstream_status: (n % 2 == 0).then_some(200),
            total_ms: n,
            lock_wait_ms: 0,
            upstream_ms: None,
            expires_at: i64::MAX,
            requests: n % 3 + 1,
            scope: Some(crate::store::ScopeId::of(&format!("{n:016x}"))),
            workflow: (n % 2 == 0).then(|| format!("run-{n}")),
            note: (n % 5 == 0).then(|| format!("checked <b>{n}</b>")),
        }
    }

    /// 37 rows go as inserts of 32, 4 and 1: every row stored, field for field, in the order
    /// given (ids ascending, so the newest-first read returns them reversed).
    #[tokio::test]
    async fn a_batch_is_stored_whole_and_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir.path().join("a.db")).await;
        let rows: Vec<AuditRow> = (0..37).map(row).collect();
        store.append_audit(rows.clone()).await.unwrap();
        let mut read = store.audit_for_key("k", 100).await.unwrap();
        read.reverse();
        assert_eq!(read, rows);
        store.close().await;
    }
}
