//! Entity state on SQLite: versions and claims, written by the writer thread inside its
//! batch's transaction, read from the read pool.

use super::*;
use rusqlite::{params, Connection};

/// Version and claim changes of a 2xx write. SQLite serves one process, whose in-process
/// entity locks make the writer the only holder: no lease to check.
pub(super) fn apply_effects(
    conn: &Connection,
    id: &ScopedKey,
    fx: &Effects,
    now: i64,
) -> StoreResult<()> {
    for entity in &fx.entities {
        if let Some(v) = fx.version {
            conn.prepare_cached(
                "INSERT INTO idem_entities (entity, version, updated_at) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (entity) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at \
                 WHERE idem_entities.version IS NULL OR idem_entities.version < excluded.version",
            )?
            .execute(params![entity, v, now])?;
        }
        if let Some(until) = fx.claim_until {
            conn.prepare_cached(
                "INSERT INTO idem_entities (entity, claim_upstream, claim_scope, claim_key, claim_until, updated_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
                 ON CONFLICT (entity) DO UPDATE SET claim_upstream = excluded.claim_upstream, \
                   claim_scope = excluded.claim_scope, claim_key = excluded.claim_key, \
                   claim_until = excluded.claim_until, updated_at = excluded.updated_at \
                 WHERE idem_entities.claim_key IS NULL OR idem_entities.claim_until <= ?6 \
                    OR (idem_entities.claim_upstream = ?2 AND idem_entities.claim_scope = ?3 AND idem_entities.claim_key = ?4)",
            )?
            .execute(params![entity, id.upstream, id.scope, id.key, until, now])?;
        }
        if fx.release_claim {
            release_claim(conn, entity, now)?;
        }
    }
    Ok(())
}

pub fn release_claim(conn: &Connection, entity: &str, now: i64) -> StoreResult<bool> {
    let changed = conn
        .prepare_cached(
            "UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL, \
             updated_at = ?2 WHERE entity = ?1 AND claim_key IS NOT NULL",
        )?
        .execute(params![entity, now])?;
    Ok(changed == 1)
}

/// The operator's claim release: the entity and its scoped variants.
pub fn release_claims(conn: &Connection, entity: &str, now: i64) -> StoreResult<bool> {
    let changed = conn.execute(
        &format!(
            "UPDATE idem_entities SET claim_upstream = NULL, claim_scope = NULL, claim_key = NULL, claim_until = NULL, \
             updated_at = ?2 WHERE {} AND claim_key IS NOT NULL",
            names_entity("entity", "?1")
        ),
        params![entity, now],
    )?;
    Ok(changed > 0)
}

pub fn reset_version(conn: &Connection, entity: &str, now: i64) -> StoreResult<u64> {
    let changed = conn.execute(
        &format!(
            "UPDATE idem_entities SET version = NULL, updated_at = ?2 WHERE {} AND version IS NOT NULL",
            names_entity("entity", "?1")
        ),
        params![entity, now],
    )?;
    Ok(changed as u64)
}

#[async_trait]
impl EntityStates for SqliteStore {
    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        // Before every write of a route with version or claim checks: on this thread (see
        // [`super::reads`]), or through the pool when SQLite is busy.
        match super::reads::entity_states(&self.reader, entities) {
            Err(e) if super::engine::reader::is_missed(&e) => {}
            states => return states,
        }
        let rows = sqlx::query(&super::reads::ENTITIES_SQL)
            .bind(encode_entities(entities))
            .fetch_all(&self.reads)
            .await?;
        rows.iter().map(rows::entity_state).collect()
    }
}
