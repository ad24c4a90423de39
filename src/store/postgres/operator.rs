//! What an operator reads and settles, on PostgreSQL: releases and settlements NOTIFY every
//! replica (their waiters and replay caches), reads go through the pool.

use super::entities::{find_entities, release_claim, reset_version};
use super::*;

#[async_trait]
impl Operator for PgStore {
    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        let rows = sqlx::query(&format!(
            "WITH u AS (UPDATE idem_keys SET state = 'released', owner = NULL, updated_at = {NOW} \
             WHERE key = $1 AND {} \
             RETURNING upstream, scope, key) \
             SELECT pg_notify('{CHANNEL}', 'k:' || upstream || chr(10) || scope || chr(10) || key)::text, \
                    pg_notify('{CHANNEL}', '{RELEASED_PREFIX}' || key)::text FROM u",
            rules::releasable(NOW)
        ))
        .bind(key)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.len() as u64)
    }
    async fn settle_record(
        &self,
        id: &ScopedKey,
        epoch: i64,
        outcome: Finish,
    ) -> StoreResult<bool> {
        let c = outcome.into_columns(self.cipher.as_deref(), id, epoch)?;
        // Whoever watches the key (a retry waiting on it, on any replica) reads it again.
        let rows = sqlx::query(&format!(
            "WITH u AS (UPDATE idem_keys SET state = $1, status = $2, headers = $3, body = $4, \
               expires_at = $5, enc_key = $6, owner = NULL, updated_at = {NOW} \
             WHERE upstream = $7 AND scope = $8 AND key = $9 AND epoch = $10 AND {} \
             RETURNING upstream, scope, key) \
             SELECT pg_notify('{CHANNEL}', 'k:' || upstream || chr(10) || scope || chr(10) || key)::text FROM u",
            rules::settleable(NOW)
        ))
        .bind(c.state.as_str())
        .bind(c.status.map(i32::from))
        .bind(c.headers.as_deref())
        .bind(c.body.as_deref())
        .bind(c.expires_at.map(|t| self.clock.to_db(t)))
        .bind(c.enc_key.as_deref())
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .bind(epoch)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.len() == 1)
    }
    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE key = $1 ORDER BY created_at"
        ))
        .bind(key)
        .fetch_all(&self.pool)
        .await?;
        self.clock.records(&rows, self.cipher.as_deref())
    }
    async fn list_keys(&self, f: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE ($1::text IS NULL OR \
               {} = $1) \
             AND ($2::text IS NULL OR EXISTS (SELECT 1 FROM jsonb_array_elements_text(entities) AS e(value) WHERE {})) \
             ORDER BY updated_at {} LIMIT $3",
            rules::effective_state(NOW),
            names_entity("e.value", "$2"),
            if f.oldest_first { "ASC" } else { "DESC" }
        ))
        .bind(f.state.map(KeyState::as_str))
        .bind(f.entity.as_deref())
        .bind(if f.limit > 0 { f.limit } else { 100 })
        .fetch_all(&self.pool)
        .await?;
        self.clock.records(&rows, self.cipher.as_deref())
    }
    async fn release_claim(&self, entity: &str) -> StoreResult<bool> {
        release_claim(&self.pool, entity).await
    }
    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>> {
        let states = find_entities(&self.pool, entity).await?;
        Ok(self.local_states(states))
    }
    async fn reset_version(&self, entity: &str) -> StoreResult<u64> {
        reset_version(&self.pool, entity).await
    }
}
