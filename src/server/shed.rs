//! Shedding under connection pressure: when every connection slot of a listener is taken and
//! another client connects, the connection that made the least progress — the one whose last
//! received byte is oldest: an idle keep-alive, a stalled upload — is closed to admit it. So
//! ten thousand stalled uploads cannot keep a healthy client out, even from one address (a
//! sidecar, a NAT, a load balancer), which a per-address cap cannot tell apart.
//!
//! Closing a connection never loses a write's outcome: a request already forwarded finishes
//! and is stored detached from its connection, and its client's retry replays it.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

/// The live connections of one listener.
pub struct Live {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    epoch: Instant,
}

/// One connection's progress, and the token that closes it.
pub struct Conn {
    /// When a byte last arrived, in ms since [`Live`]'s epoch.
    last_read: AtomicU64,
    epoch: Instant,
    shed: CancellationToken,
}

impl Conn {
    /// Cancelled when the connection is shed.
    pub fn shed(&self) -> &CancellationToken {
        &self.shed
    }

    fn touch(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.last_read.store(now, Ordering::Relaxed);
    }
}

impl Default for Live {
    fn default() -> Self {
        Live {
            conns: Mutex::default(),
            next: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl Live {
    /// Registers a new connection; it counts as having made progress now.
    pub fn register(self: &Arc<Self>) -> Tracked {
        let conn = Arc::new(Conn {
            last_read: AtomicU64::new(0),
            epoch: self.epoch,
            shed: CancellationToken::new(),
        });
        conn.touch();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, conn.clone());
        Tracked {
            live: self.clone(),
            id,
            conn,
        }
    }

    /// Closes the connection that made the least progress; `false` when there is none. A
    /// scan of every connection: it runs only when every slot is taken.
    pub fn shed_one(&self) -> bool {
        let mut conns = self.lock();
        let oldest = conns
            .iter()
            .min_by_key(|(_, c)| c.last_read.load(Ordering::Relaxed))
            .map(|(id, _)| *id);
        match oldest.and_then(|id| conns.remove(&id)) {
            Some(conn) => {
                conn.shed.cancel();
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A registered connection, unregistered on drop.
pub struct Tracked {
    live: Arc<Live>,
    id: u64,
    conn: Arc<Conn>,
}

impl Tracked {
    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.lock().remove(&self.id);
    }
}

/// An I/O stream that notes each byte received as its connection's progress.
pub struct Progress<IO> {
    inner: IO,
    conn: Arc<Conn>,
}

impl<IO> Progress<IO> {
    pub fn new(inner: IO, conn: Arc<Conn>) -> Self {
        Progress { inner, conn }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Progress<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.touch();
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Progress<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_idle_longest_is_shed_first() {
        let live = Arc::new(Live::default());
        let (a, b) = (live.register(), live.register());
        a.conn().last_read.store(5, Ordering::Relaxed);
        b.conn().last_read.store(1, Ordering::Relaxed);
        assert!(live.shed_one());
        assert!(b.conn().shed().is_cancelled() && !a.conn().shed().is_cancelled());
        assert!(live.shed_one(), "a shed connection is not picked twice");
        assert!(a.conn().shed().is_cancelled());
        assert!(!live.shed_one());
        drop((a, b));
        assert!(live.lock().is_empty());
    }
}
