//! Connection threads: serving threads beside the async runtime's workers, each a
//! single-threaded runtime of its own that keeps a connection, its requests' tasks and their
//! upstream connections on one thread.
//!
//! The runtime has one worker (a lone client's request then never crosses workers: with two,
//! the store's reply woke a worker on the other core and a lone first write on SQLite took
//! 60–90 µs longer), and that one worker is the limit under load. Connections are therefore
//! dealt in turn to the worker and to these threads: each accepted socket is moved to its
//! thread's I/O driver, and each thread forwards through a pool of upstream connections of its
//! own ([`crate::upstream::client::UpstreamClient`] picks it by [`index`]), so no request's
//! work hops between threads but for the store's. Measured on 2 cores at 64 concurrent first
//! writes: 15% more a second than one worker alone on SQLite (a lone client's p50 unchanged),
//! 10% more on PostgreSQL than two workers (a lone client's 8% faster) (docs/design-notes.md, "Serving threads and the request path").

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// Which serving thread this is: 0 off the connection threads (the runtime's workers), `i`
/// on the `i`-th connection thread.
pub fn index() -> usize {
    INDEX.with(Cell::get)
}

/// The connection threads `config` asks for on this machine.
pub fn for_config(config: &crate::config::Config) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    config.server.connection_threads_for(cores)
}

/// The connection threads of one server. Dropped without [`ConnThreads::stop`], its threads
/// end on their own (each one's stop signal is dropped with it), unwaited.
pub struct ConnThreads {
    handles: Vec<Handle>,
    /// Each thread's stop signal and the thread, until [`ConnThreads::stop`].
    running: Mutex<Vec<(oneshot::Sender<()>, std::thread::JoinHandle<()>)>>,
    next: AtomicUsize,
}

impl ConnThreads {
    /// Starts `n` threads (none: every connection stays on the runtime's worker).
    pub fn start(n: usize) -> std::io::Result<ConnThreads> {
        let (mut handles, mut running) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 1..=n {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            handles.push(rt.handle().clone());
            let join = std::thread::Builder::new()
                .name(format!("idemproxy-conn{i}"))
                .spawn(move || {
                    INDEX.with(|c| c.set(i));
                    rt.spawn(standing_timer());
                    // Runs until stopped (or its sender is dropped); what is left on it then
                    // is dropped with the runtime, on this thread.
                    let _ = rt.block_on(stopped);
                })?;
            running.push((stop, join));
        }
        Ok(ConnThreads {
            handles,
            running: Mutex::new(running),
            next: AtomicUsize::new(0),
        })
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Where the next connection goes, in turn: `None` for the runtime's worker, or one of
    /// the threads.
    pub fn next(&self) -> Option<&Handle> {
        if self.handles.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % (self.handles.len() + 1);
        turn.checked_sub(1).map(|i| &self.handles[i])
    }

    /// Stops the threads and waits for them (blocking: call it off the runtime's worker).
    /// Their connections must be over: what remains on them (idle upstream connections) is
    /// dropped.
    pub fn stop(&self) {
        let running = std::mem::take(&mut *self.running.lock().unwrap_or_else(|p| p.into_inner()));
        let joins: Vec<_> = running
            .into_iter()
            .map(|(stop, join)| {
                let _ = stop.send(());
                join
            })
            .collect();
        for join in joins {
            let _ = join.join();
        }
    }
}

/// How often a connection thread's standing timer ticks: under a third of a lease of 3 s or
/// more (the default is 30 s), so a lease renewal timer is not the soonest.
const STANDING_TICK: Duration = Duration::from_secs(1);

/// A timer that is always pending on a connection thread. Tokio's time driver wakes itself
/// (a `write` to the runtime's `eventfd`) when a timer is registered sooner than any it had
/// when it last parked, and a thread with no forward in flight had none: each forward's lease
/// renewal timer (`pipeline::forward::renewing`) then cost that write, 0.4 of them a first
/// write on the connection thread at 64 connections. With this one pending, it costs none.
async fn standing_timer() {
    let mut tick = tokio::time::interval(STANDING_TICK);
    loop {
        tick.tick().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_dealt_in_turn_and_threads_know_their_index() {
        let threads = ConnThreads::start(2).unwrap();
        let turns: Vec<Option<usize>> = (0..6)
            .map(|_| {
                threads
                    .next()
                    .map(|h| h.block_on(async { tokio::spawn(async { index() }).await.unwrap() }))
            })
            .collect();
        assert_eq!(turns, vec![None, Some(1), Some(2), None, Some(1), Some(2)]);
        assert_eq!(index(), 0);
        threads.stop();
    }
}
