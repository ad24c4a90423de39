//! Row decoding shared by both backends. PostgreSQL selects cast their columns to the types
//! SQLite returns (`::text` for JSONB, `::bigint` for INTEGER), so one decoder serves both.

use super::answer::read_answer;
use super::codec::decode_entities;
use super::seal::Cipher;
use super::*;
use sqlx::{ColumnIndex, Decode, Row, Type};

/// Typed column reads of any sqlx row whose database decodes text, integers and bytes.
pub trait Cols {
    fn text(&self, col: &str) -> StoreResult<String>;
    fn opt_text(&self, col: &str) -> StoreResult<Option<String>>;
    fn int(&self, col: &str) -> StoreResult<i64>;
    fn opt_int(&self, col: &str) -> StoreResult<Option<i64>>;
    fn opt_bytes(&self, col: &str) -> StoreResult<Option<Vec<u8>>>;
}

impl<R: Row> Cols for R
where
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    fn text(&self, col: &str) -> StoreResult<String> {
        Ok(self.try_get(col)?)
    }
    fn opt_text(&self, col: &str) -> StoreResult<Option<String>> {
        Ok(self.try_get(col)?)
    }
    fn int(&self, col: &str) -> StoreResult<i64> {
        Ok(self.try_get(col)?)
    }
    fn opt_int(&self, col: &str) -> StoreResult<Option<i64>> {
        Ok(self.try_get(col)?)
    }
    fn opt_bytes(&self, col: &str) -> StoreResult<Option<Vec<u8>>> {
        Ok(self.try_get(col)?)
    }
}

/// An `idem_keys` row; its answer opened with `cipher` when it was sealed (see
/// [`StoredAnswer`]).
pub fn key_record(row: &impl Cols, cipher: Option<&Cipher>) -> StoreResult<KeyRecord> {
    let state = row.text("state")?;
    let id = ScopedKey::new(row.text("upstream")?, row.text("scope")?, row.text("key")?);
    let epoch = row.int("epoch")?;
    let enc_key = row.opt_text("enc_key")?;
    let response = match row.opt_int("status")? {
        Some(status) => Some(read_answer(
            cipher,
            &id,
            epoch,
            status as u16,
            enc_key.as_deref(),
            row.opt_bytes("headers")?,
            row.opt_bytes("body")?,
        )),
        None => None,
    };
    Ok(KeyRecord {
        id,
        fingerprint: row.text("fingerprint")?,
        route: row.text("route")?,
        entities: decode_entities(&row.text("entities")?),
        state: KeyState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown key state {state:?}")))?,
        owner: row.opt_text("owner")?,
        lease_until: row.int("lease_until")?,
        epoch,
        attempts: row.int("attempts")?,
        response,
        enc_key,
        created_at: row.int("created_at")?,
        updated_at: row.int("updated_at")?,
        expires_at: row.opt_int("expires_at")?,
        call_ms: row.opt_int("call_ms")?,
    })
}

/// An `idem_entities` row.
pub fn entity_state(row: &impl Cols) -> StoreResult<EntityState> {
    let claim = match row.opt_text("claim_key")? {
        Some(key) => Some(Claim {
            owner: ScopedKey::new(
                row.opt_text("claim_upstream")?.unwrap_or_default(),
                row.opt_text("claim_scope")?.unwrap_or_default(),
                key,
            ),
            until: row.opt_int("claim_until")?.unwrap_or(0),
        }),
        None => None,
    };
    Ok(EntityState {
        entity: row.text("entity")?,
        version: row.opt_int("version")?,
        claim,
        updated_at: row.int("updated_at")?,
    })
}

/// An `idem_audit` row.
pub fn audit_row(row: &impl Cols) -> StoreResult<AuditRow> {
    Ok(AuditRow {
        at: row.int("at")?,
        upstream: row.text("upstream")?,
        route: row.text("route")?,
        entities: decode_entities(&row.text("entities")?),
        key: row.opt_text("key")?,
        fingerprint: row.opt_text("fingerprint")?,
        decision: row.text("decision")?,
        upstream_status: row.opt_int("upstream_status")?.map(|s| s as u16),
        total_ms: row.int("total_ms")?,
        lock_wait_ms: row.int("lock_wait_ms")?,
        upstream_ms: row.opt_int("upstream_ms")?,
        expires_at: row.int("expires_at")?,
        requests: row.int("requests")?,
        scope: row
            .opt_text("scope")?
            .as_deref()
            .map(crate::store::ScopeId::of),
        workflow: row.opt_text("workflow")?,
        note: row.opt_text("note")?,
    })
}

/// A row of [`crate::store::AuditLog::audit_counts`].
pub fn audit_count(row: &impl Cols) -> StoreResult<crate::store::AuditCount> {
    Ok(crate::store::AuditCount {
        route: row.text("route")?,
        decision: row.text("decision")?,
        minute: row.int("minute")?,
        requests: row.int("requests")?,
        class: row.int("class")?,
        timed: row.int("timed")?,
        upstream_ms: row.int("upstream_ms")?,
        upstream_max_ms: row.int("upstream_max_ms")?,
    })
}

/// The columns selected for [`key_record`] (PostgreSQL casts them to SQLite's types).
pub const KEY_COLUMNS_SQLITE: &str =
    "upstream, scope, key, fingerprint, route, entities, state, owner, lease_until, \
     epoch, attempts, status, headers, body, enc_key, created_at, updated_at, expires_at, call_ms";
pub const KEY_COLUMNS_PG: &str = "upstream, scope, key, fingerprint, route, entities::text AS entities, state, owner, \
     lease_until, epoch, attempts, status::bigint AS status, headers, body, enc_key, created_at, updated_at, expires_at, call_ms";
pub const AUDIT_COLUMNS_SQLITE: &str =
    "at, upstream, route, entities, key, fingerprint, decision, upstream_status, \
     total_ms, lock_wait_ms, upstream_ms, expires_at, requests, scope, workflow, note";
pub const AUDIT_COLUMNS_PG: &str =
    "at, upstream, route, entities::text AS entities, key, fingerprint, decision, \
     upstream_status::bigint AS upstream_status, total_ms, lock_wait_ms, upstream_ms, expires_at, requests, \
     scope, workflow, note";
pub const ENTITY_COLUMNS: &str =
    "entity, version, claim_upstream, claim_scope, claim_key, claim_until, updated_at";
