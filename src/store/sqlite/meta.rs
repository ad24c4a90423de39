//! Facts about the store itself: the scope secret's id, and the readiness probe row.

use super::*;
use rusqlite::{params, Connection};

pub fn scope_secret(conn: &Connection, id: &str) -> StoreResult<ScopeCheck> {
    conn.execute(
        "INSERT INTO idem_meta (name, value) VALUES ('scope_secret_id', ?1) ON CONFLICT (name) DO NOTHING",
        params![id],
    )?;
    let recorded: String = conn.query_row(
        "SELECT value FROM idem_meta WHERE name = 'scope_secret_id'",
        [],
        |row| row.get(0),
    )?;
    let legacy_keys: bool = conn.query_row(
        &format!("SELECT EXISTS (SELECT 1 FROM idem_keys WHERE {LEGACY_SCOPE})"),
        [],
        |row| row.get(0),
    )?;
    Ok(ScopeCheck {
        recorded,
        legacy_keys,
    })
}

pub fn probe(conn: &Connection, now: i64) -> StoreResult<()> {
    conn.prepare_cached(
        "INSERT INTO idem_probe (id, at) VALUES (1, ?1) ON CONFLICT (id) DO UPDATE SET at = excluded.at",
    )?
    .execute(params![now])?;
    Ok(())
}
