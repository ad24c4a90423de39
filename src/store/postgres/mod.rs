//! PostgreSQL backend: several `idemproxy serve` replicas on one database behave as one proxy.
//!
//! - **One forward per key**: the reservation is one `INSERT … ON CONFLICT DO UPDATE … WHERE`
//!   statement; exactly one replica's statement returns the new epoch.
//! - **One request per entity**: lease rows in `idem_entity_leases`, not advisory locks. An
//!   advisory lock lives as long as its session, so it would pin one pooled connection per
//!   request in flight and, after a network partition, linger until TCP notices; a lease row
//!   costs no connection while held, expires by itself `lease` after its holder stopped
//!   renewing it (a SIGKILLed replica), and its epoch fences the holder's later writes.
//! - **No polling**: releases and completions `pg_notify('idemproxy', topic)` in the same
//!   statement; one LISTEN connection per replica feeds the [`Hub`], whose subscribers are
//!   registered before they read, so no wake-up is lost. A waiter also wakes when the lease it
//!   waits on would expire, which covers a holder that died without notifying.
//! - **Clock**: every lease is computed and compared on the database's clock, so replicas with
//!   skewed clocks still agree on who holds what.

mod ordered;

use super::notify::{entity_topic, key_topic, Hub, RELEASED_PREFIX};
use super::*;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{PgPool, Row};
use std::str::FromStr;
use std::sync::Arc;
use tokio::time::Instant;

/// The database clock in milliseconds since the Unix epoch.
const NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

const CHANNEL: &str = "idemproxy";

use super::rows::{self, KEY_COLUMNS_PG as COLUMNS};

pub struct PgStore {
    pool: PgPool,
    hub: Arc<Hub>,
    listener: tokio::task::JoinHandle<()>,
    clock: Clock,
    clock_task: tokio::task::JoinHandle<()>,
}

/// This replica's reading of the database clock: `offset` is database time minus local time
/// (ms), measured at start and every minute. Leases are computed in SQL on the database
/// clock; times the pipeline computes locally (retention, claim TTL) are moved onto it before
/// they are stored, and times read back are moved onto the local clock before the pipeline
/// compares them — so replicas with skewed clocks still agree.
#[derive(Clone, Default)]
struct Clock(Arc<std::sync::atomic::AtomicI64>);

impl Clock {
    async fn measure(&self, pool: &PgPool) -> StoreResult<()> {
        // Time the query alone, not the wait for a pooled connection.
        let mut conn = pool.acquire().await?;
        let before = now_ms();
        let db: i64 = sqlx::query_scalar(&format!("SELECT {NOW}"))
            .fetch_one(&mut *conn)
            .await?;
        let local = before + (now_ms() - before) / 2;
        self.0
            .store(db - local, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn offset(&self) -> i64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn to_db(&self, local: i64) -> i64 {
        local.saturating_add(self.offset())
    }

    fn to_local(&self, db: i64) -> i64 {
        db.saturating_sub(self.offset())
    }

    fn record(&self, mut r: KeyRecord) -> KeyRecord {
        r.lease_until = self.to_local(r.lease_until);
        r.expires_at = r.expires_at.map(|t| self.to_local(t));
        r.created_at = self.to_local(r.created_at);
        r.updated_at = self.to_local(r.updated_at);
        r
    }

    fn records(&self, rows: &[sqlx::postgres::PgRow]) -> StoreResult<Vec<KeyRecord>> {
        rows.iter()
            .map(|row| rows::key_record(row).map(|r| self.record(r)))
            .collect()
    }
}

impl PgStore {
    pub async fn open(url: &str) -> StoreResult<PgStore> {
        // A dead or hung database must turn into 503 store_unavailable within seconds.
        let opts = PgConnectOptions::from_str(url)?.options([("statement_timeout", "5000")]);
        let pool = PgPoolOptions::new()
            .max_connections(32)
            .min_connections(2)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(opts)
            .await?;
        sqlx::migrate!("migrations/postgres").run(&pool).await?;
        let hub = Arc::new(Hub::default());
        let mut listener = PgListener::connect_with(&pool).await?;
        listener.listen(CHANNEL).await?;
        let listener = tokio::spawn(listen(listener, hub.clone()));
        let clock = Clock::default();
        clock.measure(&pool).await?;
        let clock_task = {
            let (clock, pool) = (clock.clone(), pool.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    let _ = clock.measure(&pool).await;
                }
            })
        };
        Ok(PgStore {
            pool,
            hub,
            listener,
            clock,
            clock_task,
        })
    }
}

/// Feeds the hub from LISTEN. After a lost connection every waiter is woken to re-check,
/// since notifications sent meanwhile are gone.
async fn listen(mut listener: PgListener, hub: Arc<Hub>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match listener.try_recv().await {
            Ok(Some(n)) => {
                backoff = Duration::from_millis(100);
                match n.payload().strip_prefix(RELEASED_PREFIX) {
                    Some(key) => hub.released(Some(key)),
                    None => hub.publish(n.payload()),
                }
            }
            Ok(None) => {
                tracing::warn!("LISTEN connection lost; reconnecting");
                hub.publish_all();
            }
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN failed; retrying");
                hub.publish_all();
                // Reconnect backoff while the database is down (not a synchronization wait).
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

fn lease_ms(d: Duration) -> i64 {
    d.as_millis() as i64
}

/// Result of one attempt at an entity lease.
enum Attempt {
    Acquired(i64),
    /// Held by someone else for about this long.
    HeldFor(Duration),
}

impl PgStore {
    async fn try_lease(&self, entity: &str, owner: &str, lease: Duration) -> StoreResult<Attempt> {
        let row = sqlx::query(&format!(
            "INSERT INTO idem_entity_leases (entity, owner, epoch, lease_until) VALUES ($1, $2, 1, {NOW} + $3) \
             ON CONFLICT (entity) DO UPDATE SET owner = excluded.owner, epoch = idem_entity_leases.epoch + 1, \
               lease_until = excluded.lease_until \
             WHERE idem_entity_leases.owner IS NULL OR idem_entity_leases.lease_until <= excluded.lease_until - $3 \
             RETURNING epoch"
        ))
        .bind(entity)
        .bind(owner)
        .bind(lease_ms(lease))
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            return Ok(Attempt::Acquired(row.try_get(0)?));
        }
        let left: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT lease_until - {NOW} FROM idem_entity_leases WHERE entity = $1"
        ))
        .bind(entity)
        .fetch_optional(&self.pool)
        .await?;
        Ok(Attempt::HeldFor(Duration::from_millis(
            left.unwrap_or(0).max(0) as u64,
        )))
    }
}

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn get(&self, id: &ScopedKey) -> StoreResult<Option<KeyRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE upstream = $1 AND scope = $2 AND key = $3"
        ))
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(self.clock.records(row.as_slice())?.pop())
    }

    async fn reserve(&self, r: Reservation) -> StoreResult<Reserved> {
        let row = sqlx::query(&format!(
            "INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, owner, lease_until, epoch, attempts, created_at, updated_at) \
             SELECT $1, $2, $3, $4, $5, $6::jsonb, 'in_flight', $7, now_ms + $8, 1, 1, now_ms, now_ms FROM (SELECT {NOW} AS now_ms) t \
             ON CONFLICT (upstream, scope, key) DO UPDATE SET \
               fingerprint = excluded.fingerprint, route = excluded.route, entities = excluded.entities, \
               state = 'in_flight', owner = excluded.owner, lease_until = excluded.lease_until, \
               epoch = idem_keys.epoch + 1, attempts = idem_keys.attempts + 1, updated_at = excluded.updated_at, \
               status = NULL, headers = NULL, body = NULL, expires_at = NULL \
             WHERE idem_keys.state = 'released' \
                OR (idem_keys.state = 'completed' AND idem_keys.expires_at < excluded.updated_at) \
                OR ($9 AND (idem_keys.state = 'unknown' OR (idem_keys.state = 'in_flight' AND idem_keys.lease_until <= excluded.updated_at))) \
             RETURNING epoch"
        ))
        .bind(&r.id.upstream)
        .bind(&r.id.scope)
        .bind(&r.id.key)
        .bind(&r.fingerprint)
        .bind(&r.route)
        .bind(codec::encode_entities(&r.entities))
        .bind(&r.owner)
        .bind(lease_ms(r.lease))
        .bind(r.take_unknown)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            return Ok(Reserved::Owned {
                epoch: row.try_get(0)?,
            });
        }
        match self.get(&r.id).await? {
            Some(rec) => Ok(Reserved::Existing(Box::new(rec))),
            None => Err(StoreError(
                "the key vanished while it was being reserved".into(),
            )),
        }
    }

    async fn finish(&self, id: &ScopedKey, epoch: i64, outcome: Finish) -> StoreResult<bool> {
        let c = outcome.into_columns();
        // One transaction: the answer and its effects stand or fall together; the
        // notification goes out at commit.
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(&format!(
            "WITH u AS (UPDATE idem_keys SET state = $1, status = $2, headers = $3, body = $4, expires_at = $5, \
               owner = NULL, updated_at = {NOW} \
             WHERE upstream = $6 AND scope = $7 AND key = $8 AND state = 'in_flight' AND epoch = $9 \
             RETURNING upstream, scope, key) \
             SELECT pg_notify('{CHANNEL}', 'k:' || upstream || chr(10) || scope || chr(10) || key)::text FROM u"
        ))
        .bind(c.state.as_str())
        .bind(c.status.map(i32::from))
        .bind(c.headers)
        .bind(c.body.as_deref())
        .bind(c.expires_at.map(|t| self.clock.to_db(t)))
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .bind(epoch)
        .fetch_all(&mut *tx)
        .await?;
        let owned = rows.len() == 1;
        if owned && !c.effects.is_empty() {
            let mut effects = c.effects;
            effects.claim_until = effects.claim_until.map(|t| self.clock.to_db(t));
            ordered::apply_effects(&mut tx, id, &effects).await?;
        }
        tx.commit().await?;
        Ok(owned)
    }

    async fn renew(&self, id: &ScopedKey, epoch: i64, lease: Duration) -> StoreResult<bool> {
        let res = sqlx::query(&format!(
            "UPDATE idem_keys SET lease_until = {NOW} + $1 \
             WHERE upstream = $2 AND scope = $3 AND key = $4 AND state = 'in_flight' AND epoch = $5"
        ))
        .bind(lease_ms(lease))
        .bind(&id.upstream)
        .bind(&id.scope)
        .bind(&id.key)
        .bind(epoch)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    fn observe_releases(&self, f: ReleaseObserver) {
        self.hub.set_observer(f);
    }

    fn subscribe_key(&self, id: &ScopedKey) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.hub.subscribe(&key_topic(id)))
    }

    async fn lock_entities(
        &self,
        entities: &[String],
        owner: &str,
        lease: Duration,
        timeout: Duration,
    ) -> StoreResult<Option<Vec<EntityLease>>> {
        let deadline = Instant::now() + timeout;
        let every = (lease / 3).max(Duration::from_millis(50));
        // When the leases already taken are next due for renewal: kept across wake-ups, so a
        // busy entity that keeps changing hands cannot postpone it.
        let mut renew_at = Instant::now() + every;
        let mut held = Vec::with_capacity(entities.len());
        for entity in entities {
            loop {
                let mut woken = self.hub.subscribe(&entity_topic(entity));
                let attempt = match self.try_lease(entity, owner, lease).await {
                    Ok(a) => a,
                    Err(e) => {
                        let _ = self.unlock_entities(&held, owner).await;
                        return Err(e);
                    }
                };
                match attempt {
                    Attempt::Acquired(epoch) => {
                        if held.is_empty() {
                            renew_at = Instant::now() + every;
                        }
                        held.push(EntityLease {
                            entity: entity.clone(),
                            epoch,
                        });
                        break;
                    }
                    Attempt::HeldFor(left) => {
                        if Instant::now() >= deadline {
                            let _ = self.unlock_entities(&held, owner).await;
                            return Ok(None);
                        }
                        // Woken by the holder's release, or when its lease would run out — and
                        // never later than a third of our own lease, so the leases already
                        // taken are renewed while we wait for the next one.
                        let wake = (Instant::now() + left + Duration::from_millis(1)).min(deadline);
                        tokio::select! {
                            _ = woken.changed() => {}
                            _ = tokio::time::sleep_until(if held.is_empty() { wake } else { wake.min(renew_at) }) => {}
                        }
                        if !held.is_empty() && Instant::now() >= renew_at {
                            renew_at = Instant::now() + every;
                            match self.renew_entities(&held, owner, lease).await {
                                Ok(lost) if lost.is_empty() => {}
                                Ok(_) => {
                                    let _ = self.unlock_entities(&held, owner).await;
                                    return Ok(None);
                                }
                                Err(e) => {
                                    let _ = self.unlock_entities(&held, owner).await;
                                    return Err(e);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Some(held))
    }

    async fn renew_entities(
        &self,
        leases: &[EntityLease],
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Vec<String>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (names, epochs): (Vec<String>, Vec<i64>) =
            leases.iter().map(|l| (l.entity.clone(), l.epoch)).unzip();
        let kept: Vec<String> = sqlx::query_scalar(&format!(
            "UPDATE idem_entity_leases SET lease_until = {NOW} + $3 \
             WHERE owner = $1 AND (entity, epoch) IN (SELECT * FROM unnest($2::text[], $4::bigint[])) \
             RETURNING entity"
        ))
        .bind(owner)
        .bind(&names)
        .bind(lease_ms(lease))
        .bind(&epochs)
        .fetch_all(&self.pool)
        .await?;
        Ok(names.into_iter().filter(|n| !kept.contains(n)).collect())
    }

    async fn unlock_entities(&self, leases: &[EntityLease], owner: &str) -> StoreResult<()> {
        if leases.is_empty() {
            return Ok(());
        }
        let (names, epochs): (Vec<String>, Vec<i64>) =
            leases.iter().map(|l| (l.entity.clone(), l.epoch)).unzip();
        sqlx::query(&format!(
            "WITH u AS (UPDATE idem_entity_leases SET owner = NULL, lease_until = 0 \
             WHERE owner = $1 AND (entity, epoch) IN (SELECT * FROM unnest($2::text[], $3::bigint[])) \
             RETURNING entity) \
             SELECT pg_notify('{CHANNEL}', 'e:' || entity)::text FROM u"
        ))
        .bind(owner)
        .bind(&names)
        .bind(&epochs)
        .fetch_all(&self.pool)
        .await?;
        Ok(())
    }

    async fn release_key(&self, key: &str) -> StoreResult<u64> {
        let rows = sqlx::query(&format!(
            "WITH u AS (UPDATE idem_keys SET state = 'released', owner = NULL, updated_at = {NOW} \
             WHERE key = $1 AND state <> 'released' AND NOT (state = 'in_flight' AND lease_until > {NOW}) \
             RETURNING upstream, scope, key) \
             SELECT pg_notify('{CHANNEL}', 'k:' || upstream || chr(10) || scope || chr(10) || key)::text, \
                    pg_notify('{CHANNEL}', '{RELEASED_PREFIX}' || key)::text FROM u"
        ))
        .bind(key)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.len() as u64)
    }

    async fn find_key(&self, key: &str) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE key = $1 ORDER BY created_at"
        ))
        .bind(key)
        .fetch_all(&self.pool)
        .await?;
        self.clock.records(&rows)
    }

    async fn list_keys(&self, f: &KeyFilter) -> StoreResult<Vec<KeyRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM idem_keys WHERE ($1::text IS NULL OR \
               (CASE WHEN state = 'in_flight' AND lease_until <= {NOW} THEN 'unknown' \
                     WHEN state = 'completed' AND expires_at < {NOW} THEN 'released' ELSE state END) = $1) \
             AND ($2::text IS NULL OR EXISTS (SELECT 1 FROM jsonb_array_elements_text(entities) AS e(value) WHERE {})) \
             ORDER BY updated_at DESC LIMIT $3",
            names_entity("e.value", "$2")
        ))
        .bind(f.state.map(KeyState::as_str))
        .bind(f.entity.as_deref())
        .bind(if f.limit > 0 { f.limit } else { 100 })
        .fetch_all(&self.pool)
        .await?;
        self.clock.records(&rows)
    }

    async fn entity_states(&self, entities: &[String]) -> StoreResult<Vec<EntityState>> {
        let mut states = ordered::entity_states(&self.pool, entities).await?;
        for s in &mut states {
            s.updated_at = self.clock.to_local(s.updated_at);
            if let Some(c) = &mut s.claim {
                c.until = self.clock.to_local(c.until);
            }
        }
        Ok(states)
    }

    async fn release_claim(&self, entity: &str) -> StoreResult<bool> {
        ordered::release_claim(&self.pool, entity).await
    }

    async fn find_entities(&self, entity: &str) -> StoreResult<Vec<EntityState>> {
        let mut states = ordered::find_entities(&self.pool, entity).await?;
        for s in &mut states {
            s.updated_at = self.clock.to_local(s.updated_at);
            if let Some(c) = &mut s.claim {
                c.until = self.clock.to_local(c.until);
            }
        }
        Ok(states)
    }

    async fn reset_version(&self, entity: &str) -> StoreResult<u64> {
        ordered::reset_version(&self.pool, entity).await
    }

    async fn scope_secret(&self, id: &str) -> StoreResult<ScopeCheck> {
        ordered::scope_secret(&self.pool, id).await
    }

    async fn append_audit(&self, mut rows: Vec<AuditRow>) -> StoreResult<()> {
        // Purged against the database clock.
        for r in &mut rows {
            r.expires_at = self.clock.to_db(r.expires_at);
        }
        ordered::append_audit(&self.pool, &rows).await
    }

    async fn audit_for_entity(&self, entity: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        let names = format!(
            "EXISTS (SELECT 1 FROM jsonb_array_elements_text(entities) AS e(value) WHERE {})",
            names_entity("e.value", "$1")
        );
        ordered::audit_where(&self.pool, &names, entity, limit).await
    }

    async fn audit_for_key(&self, key: &str, limit: i64) -> StoreResult<Vec<AuditRow>> {
        ordered::audit_where(&self.pool, "key = $1", key, limit).await
    }

    async fn purge(&self, batch: i64, released_before: i64) -> StoreResult<u64> {
        ordered::purge(&self.pool, batch, self.clock.to_db(released_before)).await
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn close(&self) {
        self.listener.abort();
        self.clock_task.abort();
        self.pool.close().await;
    }
}
