//! Keys on SQLite: the writes every request makes (reserve, finish), run by the writer thread
//! one prepared statement per request inside the batch's transaction, and the reads: a key's
//! record on the caller's thread ([`super::reads`]), the operator's listings from the read
//! pool.

use super::engine::job::{Heard, Tx};
use super::entities::apply_effects;
use super::*;
use rusqlite::{params, OptionalExtension};

/// Makes the key ours, or returns the record that stands (read in the same transaction).
///
/// A new key (every first write) is one plain insert: `RETURNING` costs SQLite a temporary
/// table per statement, about a third of a reservation's work on the writer. A key that stands
/// is read, as a retry the replay cache missed needs it read anyway; only one that looks
/// reservable (released, past retention) takes the upsert, which decides again — as on
/// PostgreSQL. Takeovers of unknown outcomes go to the upsert at once.
pub fn reserve(ctx: &Tx, r: &Reservation) -> StoreResult<Reserved> {
    let stmt = |sql: &str| -> rusqlite::Result<rusqlite::CachedStatement<'_>> {
        ctx.conn.prepare_cached(sql)
    };
    let entities = encode_entities(&r.entities);
    let lease_until = ctx.now.saturating_add(r.lease.as_millis() as i64);
    let args = params![
        r.id.upstream,
        r.id.scope,
        r.id.key,
        r.fingerprint,
        r.route,
        entities,
        r.owner,
        lease_until,
        ctx.now,
        r.call_timeout.as_millis() as i64,
    ];
    if !r.take_unknown {
        if stmt(&RESERVE_NEW)?.execute(args)? == 1 {
            let ticket = Ticket::new(r, NEW_EPOCH, Reserved::NEW_ACTION);
            return Ok(Reserved::Owned(ticket));
        }
        match record(ctx, &r.id)? {
            Some(found) if found.effective_state(ctx.now) != KeyState::Released => {
                return Ok(Reserved::Existing(Box::new(found)));
            }
            // Reservable, or purged since: the upsert decides.
            _ => {}
        }
    }
    // Taking over unknown outcomes is a per-request choice: one statement text per choice,
    // each prepared once.
    let sql = match r.take_unknown {
        true => &*RESERVE_TAKING_UNKNOWN,
        false => &*RESERVE,
    };
    let owned: Option<(i64, i64)> = stmt(sql)?
        .query_row(args, |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?;
    if let Some((epoch, action)) = owned {
        return Ok(Reserved::Owned(Ticket::new(r, epoch, action)));
    }
    // The upsert's `WHERE` left the record untouched (no page written): read what stands.
    match record(ctx, &r.id)? {
        Some(found) => Ok(Reserved::Existing(Box::new(found))),
        None => Err(StoreError::Corrupt(
            "the key vanished while it was being reserved".into(),
        )),
    }
}

/// The epoch of a key's first reservation.
const NEW_EPOCH: i64 = 1;

/// The insert of a new key as in flight, with `conflict` after it.
fn insert_sql(conflict: &str) -> String {
    format!(
        "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, owner, \
         lease_until, epoch, attempts, created_at, updated_at, call_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'in_flight', ?7, ?8, {NEW_EPOCH}, 1, ?9, ?9, ?10) {conflict}"
    )
}

fn reserve_sql(take_unknown: &str) -> String {
    insert_sql(&format!(
        "ON CONFLICT (upstream, scope, key) DO UPDATE SET {} WHERE {} RETURNING epoch, action",
        rules::RESERVE_SET,
        rules::reservable(take_unknown)
    ))
}

static RESERVE_NEW: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| insert_sql("ON CONFLICT (upstream, scope, key) DO NOTHING"));

static RESERVE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| reserve_sql("FALSE"));
static RESERVE_TAKING_UNKNOWN: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| reserve_sql("TRUE"));

/// One record, read on the writer's connection (inside its transaction).
fn record(ctx: &Tx, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
    // Every replay the cache misses comes this way (the reservation is its look-up).
    super::reads::read_record(ctx.conn, ctx.cipher, id)
}

/// Stores the outcome if `epoch` still owns the key (`false`: fenced off). Effects (versions,
/// claims) follow for a stored 2xx answer, applied whole with the outcome or not at all: the
/// batch's other jobs share its transaction, so an outcome with effects runs in a savepoint of
/// its own, rolled back when a statement fails — a key is never completed without its
/// version or claim while its caller is told it will read as unknown.
pub fn finish(ctx: &Tx, id: &ScopedKey, epoch: i64, c: &FinishColumns) -> StoreResult<bool> {
    if c.effects.is_empty() {
        return finish_row(ctx, id, epoch, c);
    }
    ctx.conn.prepare_cached("SAVEPOINT finish")?.execute([])?;
    let done = finish_row(ctx, id, epoch, c).and_then(|owned| {
        if owned {
            apply_effects(ctx.conn, id, &c.effects, ctx.now)?;
        }
        Ok(owned)
    });
    if done.is_err() {
        // Nothing of this job stands; the batch's other jobs go on.
        ctx.conn.prepare_cached("ROLLBACK TO finish")?.execute([])?;
    }
    ctx.conn.prepare_cached("RELEASE finish")?.execute([])?;
    done
}

/// The outcome's own row, fenced by `epoch`.
fn finish_row(ctx: &Tx, id: &ScopedKey, epoch: i64, c: &FinishColumns) -> StoreResult<bool> {
    outcome_row(ctx, id, epoch, c, &FINISH_SQL)
}

/// Sets a record's outcome columns where `sql`'s condition holds at `epoch`.
pub(super) fn outcome_row(
    ctx: &Tx,
    id: &ScopedKey,
    epoch: i64,
    c: &FinishColumns,
    sql: &str,
) -> StoreResult<bool> {
    let changed = ctx.conn.prepare_cached(sql)?.execute(params![
        c.state.as_str(),
        c.status.map(i64::from),
        c.headers.as_deref(),
        c.body.as_deref(),
        c.expires_at,
        c.enc_key.as_deref(),
        ctx.now,
        id.upstream,
        id.scope,
        id.key,
        epoch,
    ])?;
    Ok(changed == 1)
}

/// The outcome's columns, then where they go: the record at its epoch, and the condition.
const OUTCOME_SET: &str = "UPDATE idem_keys SET state = ?1, status = ?2, headers = ?3, body = ?4, \
     expires_at = ?5, enc_key = ?6, owner = NULL, updated_at = ?7 \
     WHERE upstream = ?8 AND scope = ?9 AND key = ?10 AND epoch = ?11 AND ";

/// A forward's outcome, stored by the reservation that owns the record.
static FINISH_SQL: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{OUTCOME_SET}state = 'in_flight'"));

/// An operator's settlement: only while the outcome is unknown (see [`rules::settleable`]).
pub(super) static SETTLE_SQL: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{OUTCOME_SET}{}", rules::settleable("?7")));

pub fn renew(ctx: &Tx, id: &ScopedKey, epoch: i64, until: i64) -> StoreResult<bool> {
    let changed = ctx.conn.prepare_cached(
        "UPDATE idem_keys SET lease_until = ?1 WHERE upstream = ?2 AND scope = ?3 AND key = ?4 AND state = 'in_flight' AND epoch = ?5",
    )?
    .execute(params![until, id.upstream, id.scope, id.key, epoch])?;
    Ok(changed == 1)
}

/// Releases `key` and notes the release in `idem_releases`, which the serving process reads
/// (see [`super::releases`]): `(records released, the note's sequence number)`.
pub fn release_key(ctx: &Tx, key: &str) -> StoreResult<(u64, i64)> {
    let released = ctx.conn.execute(
        &format!(
            "UPDATE idem_keys SET state = 'released', owner = NULL, updated_at = ?1 WHERE key = ?2 AND {}",
            rules::releasable("?1")
        ),
        params![ctx.now, key],
    )?;
    let seq: i64 = ctx.conn.query_row(
        "INSERT INTO idem_releases (key, at) VALUES (?1, ?2) RETURNING seq",
        params![key, ctx.now],
        |row| row.get(0),
    )?;
    Ok((released as u64, seq))
}

impl SqliteStore {
    /// [`Keys::finish`]. Sealed here, on the request's task, not on the one writer thread
    /// (which opens only the rare record a reservation finds standing, see `record`). An
    /// outcome with effects (a version, a claim) always waits for its sync, whatever `when`
    /// says: those are never answered first. One nobody waits on rides on the writer's next
    /// transaction (see `engine::deferred`).
    async fn store_outcome(
        &self,
        id: &ScopedKey,
        epoch: i64,
        outcome: Finish,
        when: When,
    ) -> StoreResult<bool> {
        let sealed = outcome.into_columns(self.cipher.as_deref(), id, epoch);
        let (columns, heard) = match (sealed, when) {
            (Err(e), When::Later(then)) => {
                then.tell(Err(e));
                return Ok(true);
            }
            (Err(e), _) => return Err(e),
            (Ok(c), When::Later(then)) if c.effects.is_empty() => {
                let id = id.clone();
                self.writer
                    .finish_later(move |ctx: &Tx| finish(ctx, &id, epoch, &c), then);
                return Ok(true);
            }
            (Ok(c), When::Later(then)) => {
                let id = id.clone();
                let done = self
                    .writer
                    .write_heard(Heard::Synced, move |ctx| finish(ctx, &id, epoch, &c))
                    .await;
                then.tell(done);
                return Ok(true);
            }
            (Ok(c), When::Answered(_)) if c.effects.is_empty() => (c, Heard::Committed),
            (Ok(c), _) => (c, Heard::Synced),
        };
        let id = id.clone();
        self.writer
            .write_heard(heard, move |ctx| finish(ctx, &id, epoch, &columns))
            .await
    }
}

#[async_trait]
impl Keys for SqliteStore {
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        // Every request with an entity, a precheck or `in_flight = "reject"` looks its key up
        // here, on its own thread (see [`super::reads`]); through the pool when SQLite is
        // busy for longer than a worker may wait.
        let cipher = self.cipher.as_deref();
        match super::reads::record(&self.reader, cipher, id) {
            Err(e) if super::engine::reader::is_missed(&e) => {}
            found => return found,
        }
        let row = sqlx::query(&super::reads::KEY_SQL)
            .bind(&id.upstream)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(&self.reads)
            .await?;
        row.as_ref()
            .map(|r| rows::key_record(r, cipher))
            .transpose()
    }
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        // A new key is one insert; a standing one is read and changes nothing, so its commit
        // writes nothing and syncs nothing (see `reserve` above).
        self.writer.write(move |ctx| reserve(ctx, &r)).await
    }
    async fn finish(&self, ticket: &Ticket, outcome: Finish, when: When) -> StoreResult<bool> {
        let (id, epoch) = (ticket.id(), ticket.epoch());
        self.store_outcome(id, epoch, outcome, when).await
    }
    async fn renew(&self, ticket: &Ticket, lease: Duration) -> StoreResult<bool> {
        let (id, epoch) = (ticket.id().clone(), ticket.epoch());
        let ms = lease.as_millis() as i64;
        self.writer
            .write(move |ctx| renew(ctx, &id, epoch, ctx.now.saturating_add(ms)))
            .await
    }
}
