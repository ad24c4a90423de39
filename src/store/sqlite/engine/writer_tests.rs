//! Tests of [`super`]: which writes share a transaction, seen from a second connection.

use super::*;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// A writer on a fresh database with one table, and the database's path; with `syncing`, a
/// syncer on its WAL, idle (nothing is waiting for it).
fn writer_with(linger: Linger, syncing: bool) -> (tempfile::TempDir, std::path::PathBuf, Writer) {
    writer_pacing(linger, syncing, super::super::pace::Pace::default())
}

/// [`writer_with`], its queue watched before blocking as `pace` says.
fn writer_pacing(
    linger: Linger,
    syncing: bool,
    pace: super::super::pace::Pace,
) -> (tempfile::TempDir, std::path::PathBuf, Writer) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.db");
    let conn = Connection::open(&path).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        .unwrap();
    let syncer = syncing.then(|| super::super::durable::Syncer::start(&path).unwrap());
    let w = Writer::lingering(conn, None, syncer, linger, pace).unwrap();
    (dir, path, w)
}

/// A writer whose writes heard of at their commit always linger up to `linger`.
fn writer(linger: Duration) -> (tempfile::TempDir, std::path::PathBuf, Writer) {
    writer_with(Linger::Always(linger), false)
}

/// Whether row `id` is visible to a connection of its own (that is, committed).
fn committed(path: &std::path::Path, id: i64) -> bool {
    let c = Connection::open(path).unwrap();
    c.query_row("SELECT count(*) FROM t WHERE id = ?1", [id], |r| {
        r.get::<_, i64>(0)
    })
    .unwrap()
        == 1
}

fn insert(id: i64) -> impl FnOnce(&Tx) -> StoreResult<()> + Send + 'static {
    move |ctx| {
        ctx.conn.execute("INSERT INTO t (id) VALUES (?1)", [id])?;
        Ok(())
    }
}

/// Polls `f` once, which queues its job (the queue has room), and returns it to await later:
/// the order the jobs reach the writer is the order of these calls. Only for writes that
/// linger for an hour: their reply cannot have come by the end of that poll.
fn queued<F: Future>(f: F) -> Pin<Box<F>> {
    let mut f = Box::pin(f);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(f.as_mut().poll(&mut cx), Poll::Pending));
    f
}

/// Waits until the writer has taken every queued job (it is then gathering or running them).
async fn taken(w: &Writer) {
    while !w.tx.is_empty() {
        tokio::task::yield_now().await;
    }
}

/// A guard against a hang, not a synchronization: every reply here comes at once or not at all.
async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("the writer never answered")
}

#[tokio::test]
async fn an_outcome_shares_the_transaction_of_the_next_reservation() {
    // An hour's linger: only the waited-on write can end it.
    let (_dir, path, w) = writer(Duration::from_secs(3600));
    let outcome = queued(w.write_heard(Heard::Committed, insert(1)));
    // The outcome is with the writer before the reservation is queued: without the linger
    // it would commit alone.
    within(taken(&w)).await;
    let path2 = path.clone();
    let reservation = w.write(move |ctx| {
        insert(2)(ctx)?;
        // Row 1 was written in this same transaction: nobody else sees it yet.
        Ok(committed(&path2, 1))
    });
    let (outcome, reservation) = within(async { tokio::join!(outcome, reservation) }).await;
    outcome.unwrap();
    assert!(!reservation.unwrap());
    assert!(committed(&path, 1) && committed(&path, 2));
}

#[tokio::test]
async fn a_lone_outcome_commits_after_the_linger() {
    let (_dir, path, w) = writer(Duration::from_millis(1));
    within(w.write_heard(Heard::Committed, insert(1)))
        .await
        .unwrap();
    assert!(committed(&path, 1));
}

#[tokio::test]
async fn closing_commits_a_lingering_outcome() {
    let (_dir, path, w) = writer(Duration::from_secs(3600));
    let outcome = queued(w.write_heard(Heard::Committed, insert(1)));
    within(taken(&w)).await;
    within(w.close()).await;
    within(outcome).await.unwrap();
    assert!(committed(&path, 1));
}

#[tokio::test]
async fn outcomes_do_not_linger_while_the_disk_is_idle() {
    // No `fdatasync` under way: an hour's linger never applies.
    let linger = Linger::WhileSyncing(Duration::from_secs(3600));
    let (_dir, path, w) = writer_with(linger, true);
    within(w.write_heard(Heard::Committed, insert(1)))
        .await
        .unwrap();
    assert!(committed(&path, 1));
    within(w.close()).await;
}

#[tokio::test]
async fn waited_on_writes_do_not_linger() {
    // The reservation alone commits at once: an hour's linger never applies to it.
    let (_dir, path, w) = writer(Duration::from_secs(3600));
    within(w.write(insert(1))).await.unwrap();
    assert!(committed(&path, 1));
}

#[test]
fn outcomes_linger_only_while_the_syncer_is_busy() {
    let d = Duration::from_millis(1);
    assert_eq!(Linger::WhileSyncing(d).wait(|| true), Some(d));
    assert_eq!(Linger::WhileSyncing(d).wait(|| false), None);
    assert_eq!(Linger::Always(d).wait(|| unreachable!()), Some(d));
}

/// An outcome handed over with [`Writer::finish_later`] running `f`, and where its caller
/// hears how it went.
fn later<F>(w: &Writer, f: F) -> oneshot::Receiver<StoreResult<bool>>
where
    F: FnOnce(&Tx) -> StoreResult<bool> + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    w.finish_later(
        f,
        crate::store::AfterCommit::new(move |res| drop(tx.send(res))),
    );
    rx
}

/// Waits until the writer is blocked on its queue with nothing to do.
async fn parked(w: &Writer) {
    while !w.deferred.is_parked() {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn an_outcome_handed_over_wakes_a_parked_writer() {
    // Nothing else comes: without the wake-up it would wait forever.
    let linger = Linger::WhileSyncing(Duration::from_secs(3600));
    let (_dir, path, w) = writer_with(linger, true);
    within(parked(&w)).await;
    let heard = later(&w, |ctx| Ok(insert(1)(ctx).is_ok()));
    assert!(within(heard).await.unwrap().unwrap());
    assert!(committed(&path, 1));
    within(w.close()).await;
}

#[tokio::test]
async fn an_outcome_handed_over_rides_on_the_next_reservation() {
    // An hour's linger: only the waited-on write can end it.
    let (_dir, path, w) = writer(Duration::from_secs(3600));
    within(parked(&w)).await;
    let path2 = path.clone();
    let heard = later(&w, move |ctx| {
        // The reservation's row: written in this transaction, not yet committed.
        let mine: i64 = ctx
            .conn
            .query_row("SELECT count(*) FROM t WHERE id = 2", [], |r| r.get(0))?;
        insert(1)(ctx)?;
        Ok(mine == 1 && !committed(&path2, 2))
    });
    // Woken once, the writer now waits for a reservation.
    within(async {
        while w.deferred.is_parked() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    within(w.write(insert(2))).await.unwrap();
    assert!(
        within(heard).await.unwrap().unwrap(),
        "not in one transaction"
    );
    assert!(committed(&path, 1));
}

#[tokio::test]
async fn closing_commits_outcomes_handed_over_and_refuses_later_ones() {
    let (_dir, path, w) = writer(Duration::from_secs(3600));
    within(parked(&w)).await;
    let heard = later(&w, |ctx| Ok(insert(1)(ctx).is_ok()));
    within(w.close()).await;
    assert!(within(heard).await.unwrap().unwrap());
    assert!(committed(&path, 1));
    let refused = later(&w, |ctx| Ok(insert(2)(ctx).is_ok()));
    assert!(matches!(
        within(refused).await.unwrap(),
        Err(StoreError::Closed)
    ));
    assert!(!committed(&path, 2));
}

/// A writer that spins (for up to an hour here, so it is surely still spinning) hears of every
/// job as a blocked one would: an outcome handed over, a write, the close, none lost.
#[tokio::test]
async fn a_spinning_writer_misses_nothing() {
    let pace = super::super::pace::Pace::spinning(Duration::from_secs(3600));
    let linger = Linger::WhileSyncing(Duration::from_secs(3600));
    let (_dir, path, w) = writer_pacing(linger, true, pace);
    // Parked: it owes nothing and watches its queue (an hour's spin, so not blocked on it).
    within(parked(&w)).await;
    let heard = later(&w, |ctx| Ok(insert(1)(ctx).is_ok()));
    assert!(within(heard).await.unwrap().unwrap());
    assert!(committed(&path, 1));
    // Spinning again after that batch: a write that is waited on.
    within(parked(&w)).await;
    within(w.write(insert(2))).await.unwrap();
    assert!(committed(&path, 2));
    // And the close, which a writer that never looked at its queue again would not hear.
    within(parked(&w)).await;
    within(w.close()).await;
}
