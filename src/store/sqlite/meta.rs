//! Facts about the store itself: the scope secret's id, and the readiness probe row.

use super::*;
use sqlx::SqliteConnection;

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

pub async fn probe(conn: &mut SqliteConnection, now: i64) -> StoreResult<()> {
    sqlx::query("INSERT INTO idem_probe (id, at) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET at = excluded.at")
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
