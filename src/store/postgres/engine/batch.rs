//! Many requests per round trip. Each first write reserves its key and stores its outcome;
//! done one statement per request, a replica spent its CPU (and PostgreSQL's, a backend
//! process woken per statement) on round trips: 1,900 first writes/s at 64 connections. A
//! [`Batcher`] queues the requests of one kind and sends whatever is queued as one
//! statement over `UNNEST`ed arrays (one statement shape, prepared once, whatever the batch
//! size), a few batches in flight at once, so the batch grows with the load and an idle
//! proxy still sends a lone request at once.
//!
//! Each batch in flight keeps its connection from one batch to the next instead of returning
//! it to the pool: sqlx tests every connection given back to its pool with a round trip (a
//! `Sync`, answered by `ReadyForQuery`), so returning it cost a backend wake-up and a round
//! trip per statement. A kept connection that failed a batch goes back to the pool (whose
//! test closes it if it is dead) and the next batch takes another; one left idle longer than
//! [`IDLE`] goes back too, so the pool's test before use (see `PgStore::open`) checks it
//! before it carries a write — a database restart or a firewall's idle timeout kills idle
//! connections.

use crate::store::{StoreError, StoreResult};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// Most requests per statement.
const MAX_BATCH: usize = 512;
/// Batches of one kind in flight at once (each on its own pooled connection). Fewer batches
/// in flight make each one larger: at 64 concurrent first writes, 4 left ~4 requests per
/// transaction and 10–10.5k first writes/s; 2 gave ~6 per transaction and 12.3–13k/s; 1,
/// 11.2–13.3k/s (same VM, same hour). A lone request is still sent at once.
pub const IN_FLIGHT: usize = 2;
/// A kept connection idle for longer goes back to the pool before the next batch (the pool
/// pings connections idle this long before handing them out).
pub const IDLE: Duration = Duration::from_secs(1);

/// A connection a batch runs on.
pub type Conn = PoolConnection<Postgres>;

type Item<I, O> = (I, oneshot::Sender<StoreResult<O>>);

/// A connection kept between batches, and when its last batch ended.
struct Kept {
    conn: Conn,
    at: Instant,
}

/// A queue of one kind of request, run `run(conn, batch)` at a time. Unbounded, because what
/// fills it is: each queued item is a request in flight holding a connection slot
/// (`server.max_connections`), and it waits for its answer.
pub struct Batcher<I, O> {
    tx: mpsc::UnboundedSender<Item<I, O>>,
    stop: CancellationToken,
    drain: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// `run` answers a batch in order, one result per request (an error is every request's),
    /// and hands back the connection it was given — `None` when a statement failed on it, even
    /// if only some requests heard of it (the connection may be broken: the pool tests it).
    /// `in_flight`: batches of this kind at the database at once (see [`IN_FLIGHT`]), each on
    /// a connection taken from `pool`.
    pub fn start<F, Fut>(in_flight: usize, pool: PgPool, run: F) -> Batcher<I, O>
    where
        F: Fn(Conn, Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = (Option<Conn>, StoreResult<Vec<O>>)> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let drain = tokio::spawn(drain(
            rx,
            in_flight.max(1),
            pool,
            Arc::new(run),
            stop.clone(),
        ));
        Batcher {
            tx,
            stop,
            drain: std::sync::Mutex::new(Some(drain)),
        }
    }

    pub async fn call(&self, item: I) -> StoreResult<O> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send((item, reply))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Stops taking batches, waits for those in flight, and gives the kept connections back
    /// to the pool (which cannot close while they are kept). Requests still queued hear
    /// `Closed`.
    pub async fn close(&self) {
        self.stop.cancel();
        let drain = self.drain.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(d) = drain {
            let _ = d.await;
        }
    }
}

async fn drain<I, O, F, Fut>(
    mut rx: mpsc::UnboundedReceiver<Item<I, O>>,
    in_flight: usize,
    pool: PgPool,
    run: Arc<F>,
    stop: CancellationToken,
) where
    I: Send + 'static,
    O: Send + 'static,
    F: Fn(Conn, Vec<I>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = (Option<Conn>, StoreResult<Vec<O>>)> + Send + 'static,
{
    // The batch slots: a slot is free when its token is here, with the connection it kept.
    let (free, mut slots) = mpsc::channel::<Option<Kept>>(in_flight);
    for _ in 0..in_flight {
        let _ = free.try_send(None);
    }
    let mut queued = Vec::with_capacity(MAX_BATCH);
    loop {
        // Wait for a free slot first: what queues meanwhile joins the next batch.
        let kept = tokio::select! {
            slot = slots.recv() => slot.flatten(),
            _ = stop.cancelled() => break,
        };
        let n = tokio::select! {
            n = rx.recv_many(&mut queued, MAX_BATCH) => n,
            _ = stop.cancelled() => 0,
        };
        if n == 0 {
            break;
        }
        let (items, replies): (Vec<I>, Vec<_>) = queued.drain(..).unzip();
        let (run, pool, free) = (run.clone(), pool.clone(), free.clone());
        tokio::spawn(async move {
            let conn = match connection(kept, &pool).await {
                Ok(conn) => conn,
                Err(e) => {
                    answer(replies, Err(e));
                    let _ = free.send(None).await;
                    return;
                }
            };
            let (conn, out) = run(conn, items).await;
            // A connection that failed a batch may be broken, or mid-way through a reply:
            // the pool tests it (and closes it if so); the next batch takes another.
            let kept = conn.filter(|_| out.is_ok()).map(|conn| Kept {
                conn,
                at: Instant::now(),
            });
            answer(replies, out);
            let _ = free.send(kept).await;
        });
    }
    // Every slot back (batches in flight end first), each kept connection dropped: returned.
    drop(free);
    while slots.recv().await.is_some() {}
}

/// The connection for the next batch: the slot's own, unless it has been idle too long.
async fn connection(kept: Option<Kept>, pool: &PgPool) -> StoreResult<Conn> {
    match kept {
        Some(k) if k.at.elapsed() <= IDLE => Ok(k.conn),
        stale => {
            // Back to the pool first (which tests it before anyone uses it again), so this
            // batch never holds two.
            drop(stale);
            Ok(pool.acquire().await?)
        }
    }
}

/// Each request's result, in order; an error (or a wrong count) is every request's.
fn answer<O>(replies: Vec<oneshot::Sender<StoreResult<O>>>, out: StoreResult<Vec<O>>) {
    let n = replies.len();
    match out {
        Ok(out) if out.len() == n => {
            for (reply, o) in replies.into_iter().zip(out) {
                let _ = reply.send(Ok(o));
            }
        }
        Ok(_) => {
            let e = StoreError::Corrupt("a batch answered the wrong number of rows".into());
            replies.into_iter().for_each(|r| {
                let _ = r.send(Err(e.clone()));
            });
        }
        Err(e) => replies.into_iter().for_each(|r| {
            let _ = r.send(Err(e.clone()));
        }),
    }
}
