//! The pool of read-only connections the request path reads through on its own thread (the
//! reads themselves, a key's record and the entities' states, are `store::sqlite::reads`).
//!
//! Through the sqlx pool such a read was handed to the connection's worker thread and its
//! answer handed back: two wake-ups between threads per read (on this project's VM, a wake-up
//! across cores is a host round trip), with eight worker threads woken in turn. Here the caller
//! runs the indexed `SELECT` itself on a pooled `rusqlite` connection: an index look-up of a
//! local file, a few microseconds when its pages are in the page cache (as the hot part of the
//! store is). A read of pages that are not (a cold start on a slow disk) holds the calling
//! worker for that read, as a page fault would; nothing in it waits on the writer, since WAL
//! readers read a snapshot.

use crate::store::{StoreError, StoreResult};
use rusqlite::{Connection, OpenFlags};
use std::sync::Mutex;
use std::time::Duration;

/// Idle connections kept: at most one read runs per thread at a time, and tokio runs one
/// worker per core, so more would only idle.
const KEEP: usize = 8;

/// Read-only connections to the store's file, taken for one read at a time.
pub struct Reader {
    db: std::path::PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl Reader {
    pub fn new(db: &std::path::Path) -> Reader {
        Reader {
            db: db.to_owned(),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` on an idle connection (or a new one), then keeps the connection for the next
    /// read.
    pub fn read<T>(&self, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
        let taken = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let conn = match taken {
            Some(conn) => conn,
            None => self.open()?,
        };
        let out = f(&conn);
        // A connection that failed a read is dropped, not pooled: the next read opens another.
        if out.is_ok() {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < KEEP {
                idle.push(conn);
            }
        }
        out
    }

    fn open(&self) -> StoreResult<Connection> {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.db, flags)?;
        // A WAL reader waits for nothing the writer does; only another process's recovery of
        // the WAL (a CLI command opening the store after a crash) makes it busy. It must not
        // hold a tokio worker for that: past this, the read fails here and the caller reads
        // through the pool instead (see [`is_missed`]).
        conn.busy_timeout(BUSY_FOR)?;
        Ok(conn)
    }
}

/// The longest an inline read waits for a lock before it is handed to the pool.
const BUSY_FOR: Duration = Duration::from_millis(20);

/// Whether an inline read failed for want of SQLite (busy past [`BUSY_FOR`], a connection
/// that cannot open): then it is read again through the pool, which waits off the worker
/// threads. A record that cannot be decoded or decrypted fails either way.
pub fn is_missed(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_))
}
