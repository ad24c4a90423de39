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

mod audit;
mod batched;
mod batchers;
mod engine;
mod entities;
mod keys;
mod leases;
mod locks;
mod meta;
mod operator;
mod pace;

use super::notify::{entity_topic, key_topic, Hub, RELEASED_PREFIX};
use super::*;
use engine::{batch, kept};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{PgPool, Row};
use std::str::FromStr;
use std::sync::Arc;
use tokio::time::Instant;

/// The database clock in milliseconds since the Unix epoch.
const NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

const CHANNEL: &str = "idemproxy";

/// The main pool (reservations, outcomes: synchronous commits) and the lazily durable one
/// (see `PgStore::lazy`).
async fn pools(url: &str) -> StoreResult<(PgPool, PgPool)> {
    // A dead or hung database must turn into 503 store_unavailable within seconds.
    // Every hot statement here finds its rows by key through an index; the batched ones
    // join a few `UNNEST`ed keys to `idem_keys`. On a table whose statistics lag its
    // growth (a new store, a burst) the planner scanned every key for those instead (a
    // hash join, or a loop over a sequential scan): 5–8 ms a batch at 20k keys, growing
    // with the table, in prepared plans kept until the next ANALYZE. So the store's
    // connections plan only index lookups (a query with no index still scans), and plan
    // each prepared statement once: re-planning the batched statements on every
    // execution (PostgreSQL's default for statements over arrays) was a sixth of its CPU.
    let opts = PgConnectOptions::from_str(url)?.options([
        ("statement_timeout", "5000"),
        ("plan_cache_mode", "force_generic_plan"),
        ("enable_seqscan", "off"),
        ("enable_hashjoin", "off"),
        ("enable_mergejoin", "off"),
    ]);
    let lazy_pool = PgPoolOptions::new()
        .max_connections(LAZY_CONNECTIONS)
        .min_connections(0)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| Box::pin(ping_if_idle(conn, meta)))
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(opts.clone().options([("synchronous_commit", "off")]));
    let pool = PgPoolOptions::new()
        .max_connections(32 - LAZY_CONNECTIONS)
        .min_connections(2)
        // sqlx's default pings every connection as it leaves the pool: a round trip (and a
        // backend woken) per statement. Only a connection idle for a while is pinged (a
        // dead one is closed and another taken): a database restart or a firewall's idle
        // timeout kills idle connections, and a statement that met one would fail —
        // for an outcome, after the upstream answered, leaving its key unknown. Under
        // load connections are never idle that long, so they are never pinged.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| Box::pin(ping_if_idle(conn, meta)))
        .acquire_timeout(Duration::from_secs(3))
        // Reservations and completions are durable before anyone acts on them, whatever
        // the server, role, database or URL defaults to: a `synchronous_commit = off`
        // there would make a reservation lazy, and a database crash after the forward
        // would lose it (the retry forwarded again). Set last, it wins over the URL's.
        .connect_with(opts.options([("synchronous_commit", "on")]))
        .await?;
    Ok((pool, lazy_pool))
}

/// A lease as milliseconds, the unit of the database clock.
fn lease_ms(d: Duration) -> i64 {
    d.as_millis() as i64
}

use super::rows::{self, KEY_COLUMNS_PG as COLUMNS};

pub struct PgStore {
    pool: PgPool,
    /// Connections kept between the unbatched hot statements (see [`kept`]).
    kept: kept::Kept,
    /// The same, on sessions with `synchronous_commit = off`: for the entity lease statements
    /// whose durability the next synchronous commit provides — a lease taken or re-checked
    /// before a reservation (whose commit flushes the log through them, before anything is
    /// forwarded), a release (lost in a database crash, the lease only expires). Each of
    /// these waited for its own WAL flush: three per request on an entity route. Audit rows
    /// run here too.
    lazy: kept::Kept,
    lazy_pool: PgPool,
    /// The hot statements, many requests per round trip (see [`batchers`]).
    batchers: batchers::Batchers,
    hub: Arc<Hub>,
    listener: tokio::task::JoinHandle<()>,
    clock: Clock,
    clock_task: tokio::task::JoinHandle<()>,
    /// Seals answers before they are stored, opens them when read (see [`super::seal`]).
    cipher: SharedCipher,
}

/// This replica's reading of the database clock: `offset` is database time minus local time
/// (ms), measured at start and every minute. Leases are computed in SQL on the database
/// clock; times the pipeline computes locally (retention, claim TTL) are moved onto it before
/// they are stored, and times read back are moved onto the local clock before the pipeline
/// compares them — so replicas with skewed clocks still agree.
#[derive(Clone, Default)]
struct Clock(Arc<std::sync::atomic::AtomicI64>);

impl Clock {
    /// Measured now, and every minute by the task returned.
    async fn start(pool: &PgPool) -> StoreResult<(Clock, tokio::task::JoinHandle<()>)> {
        let clock = Clock::default();
        clock.measure(pool).await?;
        let task = {
            let (clock, pool) = (clock.clone(), pool.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    let _ = clock.measure(&pool).await;
                }
            })
        };
        Ok((clock, task))
    }

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

    /// Rows as records on the local clock, their answers opened with `cipher`.
    fn records(
        &self,
        rows: &[sqlx::postgres::PgRow],
        cipher: Option<&super::seal::Cipher>,
    ) -> StoreResult<Vec<KeyRecord>> {
        rows.iter()
            .map(|row| rows::key_record(row, cipher).map(|r| self.record(r)))
            .collect()
    }
}

impl PgStore {
    pub async fn open(url: &str, cipher: SharedCipher) -> StoreResult<PgStore> {
        let (pool, lazy_pool) = pools(url).await?;
        sqlx::migrate!("migrations/postgres").run(&pool).await?;
        let hub = Arc::new(Hub::default());
        let mut listener = PgListener::connect_with(&pool).await?;
        listener.listen(CHANNEL).await?;
        let listener = tokio::spawn(listen(listener, hub.clone()));
        let (clock, clock_task) = Clock::start(&pool).await?;
        let batchers = batchers::Batchers::start(&pool, &lazy_pool, &clock, &cipher);
        Ok(PgStore {
            kept: kept::Kept::new(pool.clone(), KEPT_CONNECTIONS),
            lazy: kept::Kept::new(
                lazy_pool.clone(),
                LAZY_CONNECTIONS as usize - 1 - batch::IN_FLIGHT - 1,
            ),
            lazy_pool,
            pool,
            batchers,
            hub,
            listener,
            clock,
            clock_task,
            cipher,
        })
    }
}

/// Connections of the lazily durable pool (see `PgStore::lazy`), out of the replica's 32.
const LAZY_CONNECTIONS: u32 = 8;
/// Connections the unbatched hot statements keep at most (see [`kept`]), of the main pool's
/// 24: the batchers keep 6 more, and the rest serve transactions, listings and `LISTEN`.
const KEPT_CONNECTIONS: usize = 8;

/// The pools' test before use: only a connection idle for a while is pinged (see `open`).
async fn ping_if_idle(
    conn: &mut sqlx::PgConnection,
    meta: sqlx::pool::PoolConnectionMetadata,
) -> Result<bool, sqlx::Error> {
    if meta.idle_for > batch::IDLE {
        sqlx::Connection::ping(conn).await?;
    }
    Ok(true)
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

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }
    async fn scope_secret(&self, id: &str) -> StoreResult<ScopeCheck> {
        meta::scope_secret(&self.pool, id).await
    }
    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
    async fn close(&self) {
        self.listener.abort();
        self.clock_task.abort();
        // The batchers keep connections; the pool closes once they are back.
        self.batchers.close().await;
        self.kept.release_all();
        self.lazy.release_all();
        self.lazy_pool.close().await;
        self.pool.close().await;
    }
    fn observe_releases(&self, f: ReleaseObserver) {
        self.hub.set_observer(f);
    }
}
