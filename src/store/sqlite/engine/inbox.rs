//! Replies handed back to a runtime in batches: one wake-up for all the replies a sync
//! delivers to one runtime, instead of one for each.
//!
//! A reply sent from the writer's or the syncer's thread wakes its caller's task from outside
//! the runtime. Tokio then queues the task and wakes the runtime's I/O driver: on a
//! single-threaded runtime (the connection threads, `crate::threads`) that is a `write` to its
//! `eventfd` for every reply, even when the driver is already awake. A sync of ten
//! reservations made ten such writes, and each one could cut the serving thread's `epoll_wait`
//! short. A runtime's inbox is a task on that runtime: the store's threads queue replies in it
//! and wake it only when it was empty, and it sends them from inside the runtime, where waking
//! a task costs no system call.
//!
//! An inbox whose task is gone (its runtime shut down) sends what it is given at once, as the
//! store did without one, so no reply waits on a runtime that no longer runs.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::runtime::{Handle, Id};
use tokio::sync::Notify;

thread_local! {
    /// The inbox of the runtime this thread last asked for one on.
    static CURRENT: RefCell<Option<(Id, Arc<Inbox>)>> = const { RefCell::new(None) };
}

/// What a write's caller is told once its commit is durable (`None`) or cannot be (`Some(why)`).
pub type Reply = Box<dyn FnOnce(Option<&str>) + Send>;

/// A reply, and where it is sent from: its caller's runtime's inbox, or the store's thread
/// that delivers it.
pub struct Delivery {
    reply: Reply,
    inbox: Option<Arc<Inbox>>,
}

impl Delivery {
    /// `reply`, sent from the thread that delivers it.
    pub fn here(reply: Reply) -> Delivery {
        Delivery { reply, inbox: None }
    }

    /// This delivery, sent from `inbox`'s runtime when there is one.
    pub fn via(self, inbox: Option<Arc<Inbox>>) -> Delivery {
        Delivery { inbox, ..self }
    }

    /// Tells the caller: at once, or queued in its runtime's inbox.
    pub fn send(self, failure: Option<&str>) {
        match self.inbox {
            Some(inbox) => inbox.queue(self.reply, failure),
            None => (self.reply)(failure),
        }
    }
}

/// Replies queued for one runtime, and the wake-up of the task that sends them.
#[derive(Default)]
pub struct Inbox {
    replies: Mutex<Vec<(Reply, Option<Arc<str>>)>>,
    /// The task is gone: replies are sent where they are given. Set and read under the lock
    /// of `replies` wherever a reply could be left behind by a race; read without it to pick
    /// an inbox.
    closed: AtomicBool,
    ready: Notify,
    /// Times the task was woken (what tests count).
    #[cfg(test)]
    wakes: std::sync::atomic::AtomicUsize,
}

impl Inbox {
    /// The inbox of the runtime the caller runs on, started on first use; `None` off a
    /// runtime (the reply is then sent from the store's thread).
    pub fn current() -> Option<Arc<Inbox>> {
        let handle = Handle::try_current().ok()?;
        let id = handle.id();
        CURRENT.with(|cur| {
            let mut cur = cur.borrow_mut();
            if let Some((at, inbox)) = cur.as_ref() {
                if *at == id && !inbox.closed.load(Ordering::Acquire) {
                    return Some(inbox.clone());
                }
            }
            let inbox = Arc::new(Inbox::default());
            handle.spawn(Sender(inbox.clone()).run());
            *cur = Some((id, inbox.clone()));
            Some(inbox)
        })
    }

    fn queue(&self, reply: Reply, failure: Option<&str>) {
        let mut q = self.replies.lock().unwrap_or_else(|p| p.into_inner());
        if self.closed.load(Ordering::Acquire) {
            drop(q);
            return reply(failure);
        }
        let was_empty = q.is_empty();
        q.push((reply, failure.map(Arc::from)));
        drop(q);
        if was_empty {
            #[cfg(test)]
            self.wakes.fetch_add(1, Ordering::Relaxed);
            self.ready.notify_one();
        }
    }

    fn take(&self) -> Vec<(Reply, Option<Arc<str>>)> {
        std::mem::take(&mut *self.replies.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The task that sends an inbox's replies; dropped (its runtime shutting down), it closes
/// the inbox and sends what is left.
struct Sender(Arc<Inbox>);

impl Sender {
    async fn run(self) {
        loop {
            self.0.ready.notified().await;
            for (reply, failure) in self.0.take() {
                reply(failure.as_deref());
            }
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let left = {
            let mut q = self.0.replies.lock().unwrap_or_else(|p| p.into_inner());
            self.0.closed.store(true, Ordering::Release);
            std::mem::take(&mut *q)
        };
        for (reply, failure) in left {
            reply(failure.as_deref());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A reply that sends `n` on a oneshot, delivered through `inbox`.
    fn reply(inbox: &Arc<Inbox>, n: u32) -> (Delivery, oneshot::Receiver<(u32, Option<String>)>) {
        let (tx, rx) = oneshot::channel();
        let d = Delivery::here(Box::new(move |f: Option<&str>| {
            drop(tx.send((n, f.map(str::to_owned))))
        }));
        (d.via(Some(inbox.clone())), rx)
    }

    #[test]
    fn a_sync_s_replies_to_one_runtime_wake_it_once() {
        let rt = runtime();
        let inbox = rt.block_on(async { Inbox::current().unwrap() });
        let again = rt.block_on(async { Inbox::current().unwrap() });
        assert!(Arc::ptr_eq(&inbox, &again), "one inbox a runtime");
        let (replies, mut rxs): (Vec<_>, Vec<_>) = (0..3).map(|n| reply(&inbox, n)).unzip();
        // Delivered from another thread while the runtime is not running, as the syncer does.
        std::thread::spawn(move || {
            for (i, d) in replies.into_iter().enumerate() {
                d.send((i == 2).then_some("disk full"));
            }
        })
        .join()
        .unwrap();
        // Queued for the runtime, not sent from the delivering thread.
        for rx in &mut rxs {
            assert!(rx.try_recv().is_err());
        }
        let got = rt.block_on(async {
            let mut got = Vec::new();
            for rx in rxs {
                got.push(rx.await.unwrap());
            }
            got
        });
        assert_eq!(
            got,
            vec![(0, None), (1, None), (2, Some("disk full".to_owned()))]
        );
        assert_eq!(
            inbox.wakes.load(Ordering::Relaxed),
            1,
            "one wake for the three"
        );
    }

    #[test]
    fn an_inbox_whose_runtime_is_gone_delivers_at_once() {
        let rt = runtime();
        let inbox = rt.block_on(async { Inbox::current().unwrap() });
        let (queued, rx_queued) = reply(&inbox, 1);
        queued.send(None);
        drop(rt);
        // Queued before the runtime went: sent as its task was dropped.
        assert_eq!(rx_queued.blocking_recv().unwrap(), (1, None));
        let (late, rx_late) = reply(&inbox, 2);
        late.send(None);
        assert_eq!(rx_late.blocking_recv().unwrap(), (2, None));
        // A new runtime on this thread gets an inbox of its own.
        let rt = runtime();
        let next = rt.block_on(async { Inbox::current().unwrap() });
        assert!(!Arc::ptr_eq(&inbox, &next));
    }

    #[test]
    fn off_a_runtime_there_is_no_inbox() {
        assert!(Inbox::current().is_none());
    }
}
