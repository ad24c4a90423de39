//! The multi-row statements the [`Batcher`]s send: every reservation of a batch in one upsert,
//! every outcome without entity effects in one update, each over `UNNEST`ed arrays.

use super::*;
use crate::store::seal::Cipher;
use crate::store::FinishColumns;
use std::collections::{HashMap, HashSet};

/// An outcome to store: the key, the epoch that must still own it, the columns.
pub(super) type Finishing = (ScopedKey, i64, FinishColumns);

/// The records of many keys in one statement: the look-up every request makes before it
/// reserves (one statement per request woke a backend per request: most of PostgreSQL's CPU
/// at 64 connections). `None` for a key with no record.
pub(super) async fn get_many(
    conn: &mut sqlx::PgConnection,
    clock: &Clock,
    cipher: Option<&Cipher>,
    ids: Vec<ScopedKey>,
) -> StoreResult<Vec<Option<KeyRecord>>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let col = |f: fn(&ScopedKey) -> &str| -> Vec<&str> { ids.iter().map(f).collect() };
    let rows = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM UNNEST($1::text[], $2::text[], $3::text[]) AS v(u, s, k) \
         JOIN idem_keys ON upstream = v.u AND scope = v.s AND key = v.k"
    ))
    .bind(col(|id| &id.upstream))
    .bind(col(|id| &id.scope))
    .bind(col(|id| &id.key))
    .fetch_all(&mut *conn)
    .await?;
    // One key may be asked for several times in a batch (concurrent retries, waiters woken
    // by one completion): each asker gets the record.
    let mut askers: HashMap<&ScopedKey, Vec<usize>> = HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        askers.entry(id).or_default().push(i);
    }
    let mut out: Vec<Option<KeyRecord>> = ids.iter().map(|_| None).collect();
    for record in clock.records(&rows, cipher)? {
        if let Some((last, rest)) = askers.get(&record.id).and_then(|a| a.split_last()) {
            for &i in rest {
                out[i] = Some(record.clone());
            }
            out[*last] = Some(record);
        }
    }
    Ok(out)
}

/// Reserves every key it can; the others come back as the record that stands.
///
/// New keys go in with `ON CONFLICT DO NOTHING`, which leaves a standing record alone (no row
/// lock, so no commit to flush when every key stood: a look-up's cost). Only the records that
/// look reservable (released, past retention) are then taken with the locking upsert, which
/// decides again; and so are the takeovers of unknown outcomes.
pub(super) async fn reserve_many(
    conn: &mut sqlx::PgConnection,
    clock: &Clock,
    cipher: Option<&Cipher>,
    rs: Vec<Reservation>,
) -> StoreResult<Vec<StoreResult<Reserved>>> {
    let mut out: Vec<Option<Reserved>> = rs.iter().map(|_| None).collect();
    // Each statement commits on its own: when a later one fails, the keys reserved before it
    // stay reserved, and their callers must hear so (answered with the error, they would
    // leave the keys in flight, then unknown, with nothing sent). The others get the error.
    let done = rounds(conn, clock, cipher, &rs, &mut out).await;
    let mut reserved = Vec::with_capacity(rs.len());
    for (r, got) in rs.iter().zip(out) {
        reserved.push(match (got, &done) {
            (Some(got), _) => Ok(got),
            (None, Err(e)) => Err(e.clone()),
            (None, Ok(())) => existing(conn, clock, cipher, &r.id)
                .await
                .map(|rec| Reserved::Existing(Box::new(rec))),
        });
    }
    Ok(reserved)
}

/// The statements of [`reserve_many`], filling `out` as each commits.
async fn rounds(
    conn: &mut sqlx::PgConnection,
    clock: &Clock,
    cipher: Option<&Cipher>,
    rs: &[Reservation],
    out: &mut [Option<Reserved>],
) -> StoreResult<()> {
    let mut pending: Vec<usize> = (0..rs.len()).collect();
    // A statement may touch a row once: a key twice in one batch (never from one replica's
    // key slots, but cheap to rule out) waits for the next round, and finds the first's
    // reservation there.
    while !pending.is_empty() {
        let mut seen = HashSet::new();
        let (round, later): (Vec<usize>, Vec<usize>) =
            pending.iter().partition(|&&i| seen.insert(&rs[i].id));
        let (takeovers, fresh): (Vec<usize>, Vec<usize>) =
            round.into_iter().partition(|&i| rs[i].take_unknown);
        let mut upserts = takeovers;
        for (i, epoch, action) in insert(conn, rs, fresh.clone(), None).await? {
            out[i] = Some(Reserved::Owned(Ticket::new(&rs[i], epoch, action)));
        }
        if rs.len() > 1 {
            crate::fault::point(crate::fault::Point::PgBatchMid);
        }
        let stood: Vec<usize> = fresh.into_iter().filter(|&i| out[i].is_none()).collect();
        let ids = stood.iter().map(|&i| rs[i].id.clone()).collect();
        let now = crate::store::now_ms();
        for (i, record) in stood
            .into_iter()
            .zip(get_many(conn, clock, cipher, ids).await?)
        {
            match record {
                Some(r) if r.effective_state(now) != KeyState::Released => {
                    out[i] = Some(Reserved::Existing(Box::new(r)));
                }
                // Reservable, or gone since (purged): the upsert decides.
                _ => upserts.push(i),
            }
        }
        for take_unknown in [false, true] {
            let group: Vec<usize> = upserts
                .iter()
                .copied()
                .filter(|&i| rs[i].take_unknown == take_unknown)
                .collect();
            if group.is_empty() {
                continue;
            }
            let conflict = format!(
                "DO UPDATE SET {} WHERE {}",
                rules::RESERVE_SET,
                rules::reservable(if take_unknown { "TRUE" } else { "FALSE" })
            );
            for (i, epoch, action) in insert(conn, rs, group, Some(&conflict)).await? {
                out[i] = Some(Reserved::Owned(Ticket::new(&rs[i], epoch, action)));
            }
        }
        pending = later;
    }
    Ok(())
}

/// One multi-row reservation of `group` (indexes into `rs`): `ON CONFLICT DO NOTHING`, or the
/// `conflict` action given. Returns the reserved ones with their epochs and actions.
async fn insert(
    conn: &mut sqlx::PgConnection,
    rs: &[Reservation],
    mut group: Vec<usize>,
    conflict: Option<&str>,
) -> StoreResult<Vec<(usize, i64, i64)>> {
    if group.is_empty() {
        return Ok(Vec::new());
    }
    // Rows are locked in key order, so two replicas' batches cannot deadlock.
    group.sort_by(|&a, &b| {
        let (a, b) = (&rs[a].id, &rs[b].id);
        (&a.upstream, &a.scope, &a.key).cmp(&(&b.upstream, &b.scope, &b.key))
    });
    let col =
        |f: fn(&Reservation) -> &str| -> Vec<&str> { group.iter().map(|&i| f(&rs[i])).collect() };
    let entities: Vec<String> = group
        .iter()
        .map(|&i| codec::encode_entities(&rs[i].entities).into_owned())
        .collect();
    let leases: Vec<i64> = group.iter().map(|&i| lease_ms(rs[i].lease)).collect();
    let calls: Vec<i64> = group
        .iter()
        .map(|&i| lease_ms(rs[i].call_timeout))
        .collect();
    let rows = sqlx::query(&format!(
        "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, owner, \
           lease_until, epoch, attempts, created_at, updated_at, call_ms) \
         SELECT v.u, v.s, v.k, v.f, v.r, v.e::jsonb, 'in_flight', v.o, t.now_ms + v.l, 1, 1, t.now_ms, t.now_ms, v.c \
         FROM (SELECT {NOW} AS now_ms) t, \
           UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int8[], $9::int8[]) \
           WITH ORDINALITY AS v(u, s, k, f, r, e, o, l, c, n) \
         ORDER BY v.n \
         ON CONFLICT (upstream, scope, key) {} \
         RETURNING upstream, scope, key, epoch, action",
        conflict.unwrap_or("DO NOTHING")
    ))
    .bind(col(|r| &r.id.upstream))
    .bind(col(|r| &r.id.scope))
    .bind(col(|r| &r.id.key))
    .bind(col(|r| &r.fingerprint))
    .bind(col(|r| &r.route))
    .bind(entities)
    .bind(col(|r| &r.owner))
    .bind(leases)
    .bind(calls)
    .fetch_all(&mut *conn)
    .await?;
    let index = by_id(group.iter().map(|&i| (i, &rs[i].id)));
    let mut owned = Vec::with_capacity(rows.len());
    for row in rows {
        let id: (&str, &str, &str) = (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
        if let Some(&i) = index.get(&id) {
            owned.push((i, row.try_get(3)?, row.try_get(4)?));
        }
    }
    Ok(owned)
}

async fn existing(
    conn: &mut sqlx::PgConnection,
    clock: &Clock,
    cipher: Option<&Cipher>,
    id: &ScopedKey,
) -> StoreResult<KeyRecord> {
    super::keys::record(&mut *conn, clock, cipher, id)
        .await?
        .ok_or_else(|| StoreError::Corrupt("the key vanished while it was being reserved".into()))
}

/// Stores a batch of outcomes without entity effects (those go one at a time, in a
/// transaction with their effects: see `Keys::finish`). `Commit::Lazy` commits without
/// waiting for the WAL flush (see `store::When::Answered`).
pub(super) async fn finish_many(
    conn: &mut sqlx::PgConnection,
    clock: &Clock,
    fs: Vec<Finishing>,
    commit: Commit,
) -> StoreResult<Vec<bool>> {
    store_outcomes(conn, clock, &fs, commit).await
}

/// How a statement's own (implicit) transaction commits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Commit {
    /// As the session says: on the main pool, after its WAL is flushed.
    Session,
    /// Without waiting for the flush: `set_config('synchronous_commit', 'off', true)` in the
    /// statement, which lasts until its transaction commits.
    Lazy,
}

/// Stores every outcome whose epoch still owns its key (`false` for the fenced ones), and
/// NOTIFYs, in the same statement, each stored key that a waiter watches (see
/// `Shared::watch_key`): the row lock orders a watch and an outcome, so either the outcome's
/// update sees the mark, or the watch finds the key no longer in flight.
pub(super) async fn store_outcomes<'e>(
    db: impl sqlx::PgExecutor<'e>,
    clock: &Clock,
    fs: &[Finishing],
    commit: Commit,
) -> StoreResult<Vec<bool>> {
    // The setting is read in the final `SELECT`, which runs once the update returned a row: a
    // batch whose every outcome was fenced off commits as the session says.
    let (lazy_cte, lazy_from) = match commit {
        Commit::Session => ("", ""),
        Commit::Lazy => (
            "c AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true) AS lazy), ",
            ", c",
        ),
    };
    let ids =
        |f: fn(&ScopedKey) -> &str| -> Vec<&str> { fs.iter().map(|(id, _, _)| f(id)).collect() };
    let epochs: Vec<i64> = fs.iter().map(|(_, e, _)| *e).collect();
    let states: Vec<&str> = fs.iter().map(|(_, _, c)| c.state.as_str()).collect();
    let statuses: Vec<Option<i32>> = fs.iter().map(|(_, _, c)| c.status.map(i32::from)).collect();
    let headers: Vec<Option<&[u8]>> = fs.iter().map(|(_, _, c)| c.headers.as_deref()).collect();
    let bodies: Vec<Option<&[u8]>> = fs.iter().map(|(_, _, c)| c.body.as_deref()).collect();
    let enc_keys: Vec<Option<&str>> = fs.iter().map(|(_, _, c)| c.enc_key.as_deref()).collect();
    let expiries: Vec<Option<i64>> = fs
        .iter()
        .map(|(_, _, c)| c.expires_at.map(|t| clock.to_db(t)))
        .collect();
    let rows = sqlx::query(&format!(
        "WITH {lazy_cte}u AS (UPDATE idem_keys k SET state = v.st, status = v.status, headers = v.h, body = v.b, \
           expires_at = v.x, enc_key = v.ek, owner = NULL, updated_at = {NOW} \
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::text[], $6::int4[], $7::bytea[], $8::bytea[], $9::int8[], $10::text[]) \
           AS v(u, s, k, epoch, st, status, h, b, x, ek) \
         WHERE k.upstream = v.u AND k.scope = v.s AND k.key = v.k AND k.state = 'in_flight' AND k.epoch = v.epoch \
         RETURNING k.upstream, k.scope, k.key, k.watched) \
         SELECT upstream, scope, key, CASE WHEN watched THEN \
           pg_notify('{CHANNEL}', 'k:' || upstream || chr(10) || scope || chr(10) || key)::text END \
         FROM u{lazy_from}"
    ))
    .bind(ids(|id| &id.upstream))
    .bind(ids(|id| &id.scope))
    .bind(ids(|id| &id.key))
    .bind(epochs)
    .bind(states)
    .bind(statuses)
    .bind(headers)
    .bind(bodies)
    .bind(expiries)
    .bind(enc_keys)
    .fetch_all(db)
    .await?;
    let mut owned = vec![false; fs.len()];
    let index = by_id(fs.iter().enumerate().map(|(i, (id, _, _))| (i, id)));
    for row in rows {
        let id: (&str, &str, &str) = (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
        if let Some(&i) = index.get(&id) {
            owned[i] = true;
        }
    }
    Ok(owned)
}

/// Where each key sits in its batch (keys are unique within a statement).
fn by_id<'a>(
    ids: impl Iterator<Item = (usize, &'a ScopedKey)>,
) -> HashMap<(&'a str, &'a str, &'a str), usize> {
    ids.map(|(i, id)| {
        (
            (id.upstream.as_str(), id.scope.as_str(), id.key.as_str()),
            i,
        )
    })
    .collect()
}
