//! Facts about the store itself: the scope secret's id.

use super::*;
use sqlx::PgPool;

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
