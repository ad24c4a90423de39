//! What an operator reads and settles, on SQLite: reads through the pool (never the request
//! path's reader thread), acts through the writer.

use super::entities::{release_claims, reset_version};
use super::keys::{outcome_row, release_key, SETTLE_SQL};
use super::*;

#[async_trait]
impl Operator for SqliteStore {
    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        let key = key.to_owned();
        let (n, seq) = self.writer.write(move |ctx| release_key(ctx, &key)).await?;
        if self.lock.is_none() {
            super::releases::wait_until_seen(&self.reads, &self.db, seq).await;
        }
        Ok(n)
    }
    async fn settle_record(
        &self,
        id: &ScopedKey,
        epoch: i64,
        outcome: Finish,
    ) -> StoreResult<bool> {
        let c = outcome.into_columns(self.cipher.as_deref(), id, epoch)?;
        let id = id.clone();
        self.writer
            .write(move |ctx| outcome_row(ctx, &id, epoch, &c, &SETTLE_SQL))
            .await
    }
    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE key = ? ORDER BY created_at"
        ))
        .bind(key)
        .fetch_all(&self.reads)
        .await?;
        rows.iter()
            .map(|r| rows::key_record(r, self.cipher.as_deref()))
            .collect()
    }
    async fn list_keys(&self, f: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE (?1 IS NULL OR {} = ?1) \
             AND (?2 IS NULL OR EXISTS (SELECT 1 FROM json_each(idem_keys.entities) WHERE {})) \
             ORDER BY updated_at {} LIMIT ?3",
            rules::effective_state("?4"),
            names_entity("value", "?2"),
            if f.oldest_first { "ASC" } else { "DESC" }
        ))
        .bind(f.state.map(KeyState::as_str))
        .bind(f.entity.as_deref())
        .bind(if f.limit > 0 { f.limit } else { 100 })
        .bind(now_ms())
        .fetch_all(&self.reads)
        .await?;
        rows.iter()
            .map(|r| rows::key_record(r, self.cipher.as_deref()))
            .collect()
    }
    async fn release_claim(&self, entity: &str) -> StoreResult<bool> {
        let entity = entity.to_owned();
        self.writer
            .write(move |ctx| release_claims(ctx.conn, &entity, ctx.now))
            .await
    }
    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>> {
        let rows = sqlx::query(&format!(
            "SELECT {ENTITY_COLUMNS} FROM idem_entities WHERE {} ORDER BY entity LIMIT 100",
            names_entity("entity", "?1")
        ))
        .bind(entity)
        .fetch_all(&self.reads)
        .await?;
        rows.iter().map(rows::entity_state).collect()
    }
    async fn reset_version(&self, entity: &str) -> StoreResult<u64> {
        let entity = entity.to_owned();
        self.writer
            .write(move |ctx| reset_version(ctx.conn, &entity, ctx.now))
            .await
    }
}
