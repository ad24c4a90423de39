//! Accepting connections under hostile load: a connection limit per listener (at which the
//! connection that made the least progress is shed to admit a new one, see [`crate::server::shed`])
//! and, optionally, per peer address, and a loop that backs off (instead of spinning) when
//! the process runs out of file descriptors, with its log line rate-limited.

use crate::server::shed::{Conn, Live, Tracked};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Open connections per peer address.
type PeerCounts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// How many connections a listener serves at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// In all; a connection over it sheds the one that made the least progress.
    pub total: usize,
    /// From one peer address (0: no limit, the default). Connections over it are closed at
    /// once: for deployments where clients really have addresses of their own.
    pub per_ip: usize,
}

/// Longest pause after an accept error that says the process is out of resources.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
const MIN_BACKOFF: Duration = Duration::from_millis(5);

/// A listener's accept loop state.
pub struct Acceptor {
    listener: TcpListener,
    limits: Limits,
    slots: Arc<Semaphore>,
    peers: PeerCounts,
    live: Arc<Live>,
    backoff: Duration,
    errors: RateLimitedLog,
    refused: RateLimitedLog,
    shed: RateLimitedLog,
}

/// Held for as long as a connection lives: its slot, its count against its peer, and its
/// progress (which decides whether it is shed).
pub struct ConnPermit {
    _slot: OwnedSemaphorePermit,
    peer: Option<(IpAddr, PeerCounts)>,
    tracked: Tracked,
}

impl ConnPermit {
    /// The connection's progress, and the token that sheds it.
    pub fn conn(&self) -> Arc<Conn> {
        self.tracked.conn().clone()
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        if let Some((ip, peers)) = self.peer.take() {
            // Short critical section, never held across an await.
            let mut peers = peers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = peers.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    peers.remove(&ip);
                }
            }
        }
    }
}

impl Acceptor {
    pub fn new(listener: TcpListener, limits: Limits) -> Acceptor {
        Acceptor {
            listener,
            limits,
            slots: Arc::new(Semaphore::new(limits.total.max(1))),
            peers: Arc::default(),
            live: Arc::default(),
            backoff: MIN_BACKOFF,
            errors: RateLimitedLog::default(),
            refused: RateLimitedLog::default(),
            shed: RateLimitedLog::default(),
        }
    }

    /// The next connection within the limits. Never returns an error: accept failures are
    /// logged (at most once a second) and, when they mean the process is out of file
    /// descriptors or memory, waited out with a growing pause instead of retried at once.
    pub async fn next(&mut self) -> (TcpStream, SocketAddr, ConnPermit) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => {
                    self.backoff = MIN_BACKOFF;
                    accepted
                }
                Err(e) => {
                    let exhausted = is_resource_exhaustion(&e);
                    self.errors.log(|suppressed| {
                        tracing::warn!(error = %e, suppressed, "accept failed");
                    });
                    if exhausted {
                        tokio::time::sleep(self.backoff).await;
                        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    }
                    continue;
                }
            };
            match self.count_peer(peer.ip()) {
                Some(peer_count) => {
                    let slot = self.slot().await;
                    let tracked = self.live.register();
                    return (
                        stream,
                        peer,
                        ConnPermit {
                            _slot: slot,
                            peer: peer_count,
                            tracked,
                        },
                    );
                }
                None => {
                    let per_ip = self.limits.per_ip;
                    self.refused.log(|suppressed| {
                        tracing::warn!(%peer, per_ip, suppressed, "connection refused: the peer holds max_connections_per_ip connections");
                    });
                    drop(stream);
                }
            }
        }
    }

    /// A connection slot: a free one, or, when every slot is taken, the one the connection
    /// that made the least progress holds, once it has closed.
    async fn slot(&mut self) -> OwnedSemaphorePermit {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return p;
        }
        if self.live.shed_one() {
            let total = self.limits.total;
            self.shed.log(|suppressed| {
                tracing::warn!(total, suppressed, "every connection slot is taken: closed the connection that made the least progress");
            });
        }
        match self.slots.clone().acquire_owned().await {
            Ok(p) => p,
            // The semaphore is never closed; wait forever rather than spin if it were.
            Err(_) => std::future::pending().await,
        }
    }

    /// Counts a new connection against its peer; `None` when the peer is at its limit.
    fn count_peer(&self, ip: IpAddr) -> Option<Option<(IpAddr, PeerCounts)>> {
        if self.limits.per_ip == 0 {
            return Some(None);
        }
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let n = peers.entry(ip).or_insert(0);
        if *n >= self.limits.per_ip {
            return None;
        }
        *n += 1;
        Some(Some((ip, self.peers.clone())))
    }
}

/// EMFILE, ENFILE, ENOBUFS, ENOMEM: accepting again at once would fail again at once.
fn is_resource_exhaustion(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Logs at most once per second; the lines in between are counted and reported with the next.
#[derive(Default)]
pub struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    pub fn log(&mut self, emit: impl FnOnce(u64)) {
        let now = Instant::now();
        match self.last {
            Some(t) if now.duration_since(t) < Duration::from_secs(1) => self.suppressed += 1,
            _ => {
                emit(self.suppressed);
                self.last = Some(now);
                self.suppressed = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_are_rate_limited() {
        let mut log = RateLimitedLog::default();
        let mut lines = 0;
        for _ in 0..10_000 {
            log.log(|_| lines += 1);
        }
        assert_eq!(lines, 1);
        assert_eq!(log.suppressed, 9_999);
    }

    #[test]
    fn out_of_descriptors_is_exhaustion() {
        assert!(is_resource_exhaustion(&std::io::Error::from_raw_os_error(
            libc::EMFILE
        )));
        assert!(!is_resource_exhaustion(&std::io::Error::from_raw_os_error(
            libc::ECONNABORTED
        )));
    }
}
