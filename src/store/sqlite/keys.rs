//! Keys on SQLite. Multi-row statements for the writes every request makes: all reservations of a batch in
//! one upsert, all outcomes in one update. sqlx hands each SQLite statement to a worker
//! thread (tens of µs a trip), so a statement per batch rather than per request is what lets
//! the writer keep up with many concurrent first writes.

use super::entities::apply_effects;
use super::*;
use crate::store::seal::Cipher;
use sqlx::{QueryBuilder, Row, Sqlite, SqliteConnection};

/// Rows per statement: SQLite binds at most 32766 variables.
pub(super) const CHUNK: usize = 2000;

fn same(row: &sqlx::sqlite::SqliteRow, id: &ScopedKey) -> bool {
    row.try_get::<&str, _>("upstream")
        .is_ok_and(|u| u == id.upstream)
        && row.try_get::<&str, _>("scope").is_ok_and(|s| s == id.scope)
        && row.try_get::<&str, _>("key").is_ok_and(|k| k == id.key)
}

/// Reserves every key it can; the others come back as the record that stands. One result per
/// reservation: a statement that fails after others reserved keys (outside a transaction, a
/// lone statement commits as it runs) fails only the reservations it had left.
pub async fn reserve_many(
    conn: &mut SqliteConnection,
    rs: &[Reservation],
    now: i64,
    cipher: Option<&Cipher>,
) -> Vec<StoreResult<Reserved>> {
    let mut out: Vec<Option<Reserved>> = rs.iter().map(|_| None).collect();
    let done = match upsert(conn, rs, now, &mut out).await {
        // The records that stand, read in one statement: after a restart (an empty replay
        // cache) a retry storm's reservations all find theirs (see `pipeline::lookup`).
        Ok(()) => {
            let stood: Vec<&ScopedKey> = rs
                .iter()
                .zip(&out)
                .filter(|(_, got)| got.is_none())
                .map(|(r, _)| &r.id)
                .collect();
            existing(conn, &stood, cipher).await.map(|found| {
                found
                    .into_iter()
                    .map(|r| (r.id.clone(), r))
                    .collect::<std::collections::HashMap<_, _>>()
            })
        }
        Err(e) => Err(e),
    };
    rs.iter()
        .zip(out)
        .map(|(r, got)| match (got, &done) {
            (Some(owned), _) => Ok(owned),
            (None, Err(e)) => Err(e.clone()),
            // (A key twice in the batch: the second finds the first's reservation.)
            (None, Ok(found)) => match found.get(&r.id) {
                Some(record) => Ok(Reserved::Existing(Box::new(record.clone()))),
                None => Err(StoreError::Corrupt(
                    "the key vanished while it was being reserved".into(),
                )),
            },
        })
        .collect()
}

/// The reservation upserts, filling `out` with the keys taken.
async fn upsert(
    conn: &mut SqliteConnection,
    rs: &[Reservation],
    now: i64,
    out: &mut [Option<Reserved>],
) -> StoreResult<()> {
    // Taking over unknown outcomes is a per-request choice: one statement per choice.
    for take_unknown in [false, true] {
        let group: Vec<usize> = (0..rs.len())
            .filter(|&i| rs[i].take_unknown == take_unknown)
            .collect();
        for chunk in group.chunks(CHUNK) {
            let mut qb = QueryBuilder::<Sqlite>::new(
                "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, owner, \
                 lease_until, epoch, attempts, created_at, updated_at) ",
            );
            qb.push_values(chunk, |mut b, &i| {
                let r = &rs[i];
                b.push_bind(&r.id.upstream)
                    .push_bind(&r.id.scope)
                    .push_bind(&r.id.key)
                    .push_bind(&r.fingerprint)
                    .push_bind(&r.route)
                    .push_bind(encode_entities(&r.entities))
                    .push("'in_flight'")
                    .push_bind(&r.owner)
                    .push_bind(now.saturating_add(r.lease.as_millis() as i64))
                    .push("1")
                    .push("1")
                    .push_bind(now)
                    .push_bind(now);
            });
            let take = if take_unknown { "TRUE" } else { "FALSE" };
            qb.push(format!(
                " ON CONFLICT (upstream, scope, key) DO UPDATE SET {} WHERE {}",
                rules::RESERVE_SET,
                rules::reservable(take)
            ));
            qb.push(" RETURNING upstream, scope, key, epoch");
            for row in qb.build().fetch_all(&mut *conn).await? {
                // The first still-open request of this key owns it (a key twice in one batch:
                // the second finds the first's reservation).
                if let Some(&i) = chunk
                    .iter()
                    .find(|&&i| out[i].is_none() && same(&row, &rs[i].id))
                {
                    out[i] = Some(Reserved::Owned {
                        epoch: row.try_get("epoch")?,
                    });
                }
            }
        }
    }
    Ok(())
}

/// The records of `ids`, in any order.
async fn existing(
    conn: &mut SqliteConnection,
    ids: &[&ScopedKey],
    cipher: Option<&Cipher>,
) -> StoreResult<Vec<crate::store::KeyRecord>> {
    let mut records = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(CHUNK) {
        let mut qb = QueryBuilder::<Sqlite>::new(format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE (upstream, scope, key) IN (VALUES "
        ));
        let mut list = qb.separated(", ");
        for id in chunk {
            list.push("(")
                .push_bind_unseparated(&id.upstream)
                .push_unseparated(", ")
                .push_bind_unseparated(&id.scope)
                .push_unseparated(", ")
                .push_bind_unseparated(&id.key)
                .push_unseparated(")");
        }
        qb.push(")");
        for row in qb.build().fetch_all(&mut *conn).await? {
            records.push(rows::key_record(&row, cipher)?);
        }
    }
    Ok(records)
}

/// Stores every outcome whose epoch still owns its key; `false` for the fenced ones. Effects
/// (versions, claims) follow for the stored 2xx answers.
pub async fn finish_many(
    conn: &mut SqliteConnection,
    fs: Vec<(ScopedKey, i64, FinishColumns)>,
    now: i64,
) -> StoreResult<Vec<bool>> {
    let mut owned = vec![false; fs.len()];
    let idx: Vec<usize> = (0..fs.len()).collect();
    for chunk in idx.chunks(CHUNK) {
        let mut qb = QueryBuilder::<Sqlite>::new(
            "UPDATE idem_keys SET state = v.column5, status = v.column6, headers = v.column7, body = v.column8, \
             expires_at = v.column9, enc_key = v.column10, owner = NULL, updated_at = ",
        );
        qb.push_bind(now).push(" FROM (");
        qb.push_values(chunk, |mut b, &i| {
            let (id, epoch, c) = &fs[i];
            b.push_bind(&id.upstream)
                .push_bind(&id.scope)
                .push_bind(&id.key)
                .push_bind(*epoch)
                .push_bind(c.state.as_str())
                .push_bind(c.status.map(i64::from))
                .push_bind(c.headers.as_deref())
                .push_bind(c.body.as_deref())
                .push_bind(c.expires_at)
                .push_bind(c.enc_key.as_deref());
        });
        qb.push(
            ") AS v WHERE idem_keys.upstream = v.column1 AND idem_keys.scope = v.column2 \
             AND idem_keys.key = v.column3 AND idem_keys.state = 'in_flight' AND idem_keys.epoch = v.column4 \
             RETURNING idem_keys.upstream AS upstream, idem_keys.scope AS scope, idem_keys.key AS key",
        );
        for row in qb.build().fetch_all(&mut *conn).await? {
            if let Some(&i) = chunk.iter().find(|&&i| !owned[i] && same(&row, &fs[i].0)) {
                owned[i] = true;
            }
        }
    }
    for (i, (id, _, c)) in fs.iter().enumerate() {
        if owned[i] && !c.effects.is_empty() {
            apply_effects(conn, id, &c.effects, now).await?;
        }
    }
    Ok(owned)
}

pub async fn renew(
    conn: &mut SqliteConnection,
    id: &ScopedKey,
    epoch: i64,
    until: i64,
) -> StoreResult<bool> {
    let res = sqlx::query(
        "UPDATE idem_keys SET lease_until = ? WHERE upstream = ? AND scope = ? AND key = ? AND state = 'in_flight' AND epoch = ?",
    )
    .bind(until)
    .bind(&id.upstream)
    .bind(&id.scope)
    .bind(&id.key)
    .bind(epoch)
    .execute(&mut *conn)
    .await?;
    Ok(res.rows_affected() == 1)
}

/// Releases `key` and notes the release in `idem_releases`, which the serving process reads
/// (see [`super::releases`]): `(records released, the note's sequence number)`.
pub async fn release_key(
    conn: &mut SqliteConnection,
    key: &str,
    now: i64,
) -> StoreResult<(u64, i64)> {
    let res = sqlx::query(&format!(
        "UPDATE idem_keys SET state = 'released', owner = NULL, updated_at = ?1 WHERE key = ?2 AND {}",
        rules::releasable("?1")
    ))
    .bind(now)
    .bind(key)
    .execute(&mut *conn)
    .await?;
    let seq: i64 =
        sqlx::query_scalar("INSERT INTO idem_releases (key, at) VALUES (?1, ?2) RETURNING seq")
            .bind(key)
            .bind(now)
            .fetch_one(&mut *conn)
            .await?;
    Ok((res.rows_affected(), seq))
}

#[async_trait]
impl Keys for SqliteStore {
    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM idem_keys WHERE upstream = ? AND scope = ? AND key = ?"
        ))
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(&self.reads)
        .await?;
        let cipher = self.cipher.as_deref();
        row.as_ref()
            .map(|r| rows::key_record(r, cipher))
            .transpose()
    }
    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        // The upsert's `WHERE` leaves a standing record untouched: no page is written, so its
        // commit writes nothing and syncs nothing.
        self.writer.reserve(r).await
    }
    async fn finish(&self, id: &ScopedKey, epoch: i64, outcome: Finish) -> StoreResult<bool> {
        // Sealed here, on the request's task, not on the one writer task (which opens only the
        // rare record a reservation finds standing, see `existing`).
        let columns = outcome.into_columns(self.cipher.as_deref(), id, epoch)?;
        self.writer.finish(id.clone(), epoch, columns).await
    }
    async fn renew(&self, id: &ScopedKey, epoch: i64, lease: Duration) -> StoreResult<bool> {
        let id = id.clone();
        let ms = lease.as_millis() as i64;
        self.writer
            .write(move |c, now| {
                Box::pin(async move { renew(c, &id, epoch, now.saturating_add(ms)).await })
            })
            .await
    }
    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        let key = key.to_owned();
        let (n, seq) = self
            .writer
            .write(move |c, now| Box::pin(async move { release_key(c, &key, now).await }))
            .await?;
        if self.lock.is_none() {
            super::releases::wait_until_seen(&self.reads, &self.db, seq).await;
        }
        Ok(n)
    }
    fn observe_releases(&self, f: ReleaseObserver) {
        *self.observer.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
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
             ORDER BY updated_at DESC LIMIT ?3",
            rules::effective_state("?4"),
            names_entity("value", "?2")
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
}
