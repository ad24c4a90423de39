//! Many requests per round trip. Each first write reserves its key and stores its outcome;
//! done one statement per request, a replica spent its CPU (and PostgreSQL's, a backend
//! process woken per statement) on round trips: 1,900 first writes/s at 64 connections. A
//! [`Batcher`] queues the requests of one kind and sends whatever is queued as one
//! statement over `UNNEST`ed arrays (one statement shape, prepared once, whatever the batch
//! size), a few batches in flight at once, so the batch grows with the load and an idle
//! proxy still sends a lone request at once.

use crate::store::{StoreError, StoreResult};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Most requests per statement.
const MAX_BATCH: usize = 512;
/// Batches of one kind in flight at once (each on its own pooled connection). Fewer batches
/// in flight make each one larger: at 64 concurrent first writes, 4 left ~4 requests per
/// transaction and 10–10.5k first writes/s; 2 gave ~6 per transaction and 12.3–13k/s; 1,
/// 11.2–13.3k/s (same VM, same hour). A lone request is still sent at once.
pub const IN_FLIGHT: usize = 2;

type Item<I, O> = (I, oneshot::Sender<StoreResult<O>>);

/// A queue of one kind of request, run `run(batch)` at a time. Unbounded, because what
/// fills it is: each queued item is a request in flight holding a connection slot
/// (`server.max_connections`), and it waits for its answer.
pub struct Batcher<I, O> {
    tx: mpsc::UnboundedSender<Item<I, O>>,
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// `run` answers a batch in order, one result per request; an error is every request's.
    /// `in_flight`: batches of this kind at the database at once (see [`IN_FLIGHT`]).
    pub fn start<F, Fut>(in_flight: usize, run: F) -> Batcher<I, O>
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = StoreResult<Vec<O>>> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(drain(rx, in_flight.max(1), Arc::new(run)));
        Batcher { tx }
    }

    pub async fn call(&self, item: I) -> StoreResult<O> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send((item, reply))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }
}

async fn drain<I, O, F, Fut>(
    mut rx: mpsc::UnboundedReceiver<Item<I, O>>,
    in_flight: usize,
    run: Arc<F>,
) where
    I: Send + 'static,
    O: Send + 'static,
    F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StoreResult<Vec<O>>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(in_flight));
    let mut queued = Vec::with_capacity(MAX_BATCH);
    loop {
        // Wait for a free slot first: what queues meanwhile joins the next batch.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        if rx.recv_many(&mut queued, MAX_BATCH).await == 0 {
            return;
        }
        let (items, replies): (Vec<I>, Vec<_>) = queued.drain(..).unzip();
        let run = run.clone();
        tokio::spawn(async move {
            let n = replies.len();
            match run(items).await {
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
            drop(slot);
        });
    }
}
