//! Connections lent to one statement (or transaction) at a time and kept between them, out of
//! the pool: sqlx tests every connection handed back to its pool with a round trip (a `Sync`,
//! answered by `ReadyForQuery`), which woke a backend and cost a round trip per statement —
//! three per request on an entity route (its lease taken, re-checked, released). The
//! batchers keep theirs the same way (see [`super::batch`]).
//!
//! Only a statement that succeeded gives its connection back here ([`Lent::done`]); one that
//! failed, or whose future was dropped mid-way, drops it, and the pool tests it (closing it if
//! it is dead, finishing a rollback sqlx queued). A connection kept idle for longer than
//! [`IDLE`] goes back to the pool too, whose test before use (see `PgStore::open`) checks it:
//! a database restart or a firewall's idle timeout kills idle connections.

use super::batch::{Conn, IDLE};
use crate::store::{StoreError, StoreResult};
use sqlx::PgPool;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, SemaphorePermit};

/// How long a statement waits for a connection, as for the pool's own (`PgStore::open`).
const WAIT: Duration = Duration::from_secs(3);

pub struct Kept {
    pool: PgPool,
    /// Most recently used last.
    idle: Mutex<Vec<(Conn, Instant)>>,
    /// Connections lent or kept at once. Fewer than the pool holds, so a connection kept
    /// idle here is never what a caller of the pool itself waits for: callers wait here,
    /// where a connection given back finds them.
    room: Semaphore,
}

/// A connection lent by [`Kept::take`]; dropped without [`Lent::done`], it goes to the pool.
pub struct Lent<'a> {
    conn: Conn,
    home: &'a Kept,
    _room: SemaphorePermit<'a>,
}

impl Kept {
    /// Keeps up to `most` connections of `pool` (fewer than its size).
    pub fn new(pool: PgPool, most: usize) -> Kept {
        Kept {
            pool,
            idle: Mutex::new(Vec::new()),
            room: Semaphore::new(most),
        }
    }

    /// The most recently used kept connection, or one from the pool.
    pub async fn take(&self) -> StoreResult<Lent<'_>> {
        let room = match tokio::time::timeout(WAIT, self.room.acquire()).await {
            Ok(Ok(permit)) => permit,
            Ok(Err(_)) => return Err(StoreError::Closed),
            Err(_) => {
                return Err(StoreError::Unavailable(
                    "timed out waiting for a database connection".into(),
                ))
            }
        };
        let (recent, stale) = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            match idle.pop() {
                Some((conn, at)) if at.elapsed() <= IDLE => (Some(conn), Vec::new()),
                // It and every older one have been idle too long: back to the pool.
                Some(last) => {
                    let mut stale = std::mem::take(&mut *idle);
                    stale.push(last);
                    (None, stale)
                }
                None => (None, Vec::new()),
            }
        };
        drop(stale);
        let conn = match recent {
            Some(conn) => conn,
            None => self.pool.acquire().await?,
        };
        Ok(Lent {
            conn,
            home: self,
            _room: room,
        })
    }

    /// Gives every kept connection back to the pool (which cannot close while they are kept),
    /// and lends no more.
    pub fn release_all(&self) {
        self.room.close();
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        drop(idle);
    }
}

impl Lent<'_> {
    pub fn conn(&mut self) -> &mut sqlx::PgConnection {
        &mut self.conn
    }

    /// The statement succeeded: keep the connection for the next one — unless the store is
    /// closing ([`Kept::release_all`]): kept then, it would never reach the pool, whose close
    /// waits for every connection.
    pub fn done(self) {
        let Lent { conn, home, _room } = self;
        // Decided under the lock `release_all` takes after closing: a connection is either
        // kept before it empties the list, or goes back to the pool.
        let mut idle = home.idle.lock().unwrap_or_else(|p| p.into_inner());
        if !home.room.is_closed() {
            // Kept before the permit goes, so whoever it lets in finds the connection.
            idle.push((conn, Instant::now()));
        }
        drop(idle);
        drop(_room);
    }
}
