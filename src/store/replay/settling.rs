//! Outcomes answered before their commit. A first write's answer goes to its caller as soon as
//! it is in the replay cache, while its completion commits (see `pipeline::store`): a retry in
//! this process replays from the cache, and anything that would read the record waits behind
//! the key's slot and the entity locks, held until the commit. An operator's read through this
//! process (`/admin/keys`, `/admin/entities`) holds no lock, so it waits here instead, for every
//! outcome answered before it began: what it shows never lags what a caller was told.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::watch;

/// The longest an operator's read waits for earlier commits (a store that cannot commit fails
/// its statements within seconds; the read then shows what is stored).
const MOST: Duration = Duration::from_secs(6);

/// The outcomes answered and not yet committed, numbered in the order they were answered.
pub struct Settling {
    open: Mutex<Open>,
    /// Every outcome numbered below this one has committed (or failed to).
    settled_below: watch::Sender<u64>,
}

#[derive(Default)]
struct Open {
    next: u64,
    numbers: BTreeSet<u64>,
}

impl Default for Settling {
    fn default() -> Settling {
        Settling {
            open: Mutex::default(),
            settled_below: watch::channel(0).0,
        }
    }
}

impl Settling {
    fn open(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An outcome is answered before its commit: its number, for [`Settling::end`].
    pub fn begin(&self) -> u64 {
        let mut open = self.open();
        let n = open.next;
        open.next += 1;
        open.numbers.insert(n);
        n
    }

    /// Its commit is over (stored, fenced off or failed).
    pub fn end(&self, n: u64) {
        let mut open = self.open();
        open.numbers.remove(&n);
        let below = open.numbers.first().copied().unwrap_or(open.next);
        self.settled_below.send_replace(below);
    }

    /// Waits until every outcome answered before now has committed (at most [`MOST`]).
    /// The outcomes waited for are those answered before this call, not before the first poll.
    pub fn settle(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let target = self.open().next;
        let mut rx = self.settled_below.subscribe();
        async move {
            let _ = tokio::time::timeout(MOST, rx.wait_for(|below| *below >= target)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_read_waits_for_the_outcomes_answered_before_it_only() {
        let s = std::sync::Arc::new(Settling::default());
        s.settle().await; // nothing open: no wait
        let (a, b) = (s.begin(), s.begin());
        let reader = tokio::spawn(s.settle());
        s.end(b);
        let later = s.begin(); // answered after the read began: not waited for
        tokio::task::yield_now().await;
        assert!(!reader.is_finished(), "a is still open");
        s.end(a);
        reader.await.unwrap();
        s.end(later);
    }
}
