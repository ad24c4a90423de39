//! The proxy killed (`SIGKILL`) under load, on SQLite and PostgreSQL. A first write's answer
//! goes to its caller before its completion commits (`pipeline::store`); the reservation,
//! committed before the forward, is what stops a second forward. So for every key, across the
//! kill, the restart and a retry of every request:
//! - the upstream received it at most once;
//! - a key whose caller was answered before the kill is never forwarded again: its retry
//!   replays the very answer, or (its completion lost with the process) gets
//!   `409 outcome_unknown`;
//! - with `store.answer_before_commit = false`, an answered key always replays.
//!
//! And the database crashed right after answered first writes (PostgreSQL): outcomes may be
//! lost with it, reservations never.

mod common;
use common::pg::PgServer;
use common::*;

use common::retries::*;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use tokio::sync::Notify;

/// Callers sending first writes one after another, each with a fresh key.
const CALLERS: usize = 16;
/// Answers received before the kill.
const ANSWERS_BEFORE_KILL: usize = 200;

async fn killed_under_load(store: &str, answer_before_commit: bool) {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    // A short lease: on PostgreSQL a retry waits out the dead process's lease.
    let toml = format!(
        "{}\n{store}lease = \"1s\"\nanswer_before_commit = {answer_before_commit}\n",
        api_config(&upstream, "", "timeout = \"2s\"", CHARGES_ROUTE)
    );
    let cfg = dir.write_config(&toml);
    let mut process = ProxyProcess::spawn(&cfg).await;
    let url = process.url("/api/v1/charges");
    let answered = Arc::new(AtomicUsize::new(0));
    let enough = Arc::new(Notify::new());
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| {
            let until = (answered.clone(), enough.clone(), ANSWERS_BEFORE_KILL);
            tokio::spawn(caller(url.clone(), format!("crash-{n}"), until))
        })
        .collect();
    enough.notified().await;
    process.kill().await;
    let mut sent: Sent = Vec::new();
    for c in callers {
        sent.extend(c.await.expect("caller"));
    }
    let forwarded_before = upstream.count();
    assert!(forwarded_before >= ANSWERS_BEFORE_KILL);

    let restarted = ProxyProcess::spawn(&cfg).await;
    let r = retry_every(&restarted, &upstream, &sent).await;
    let Retried {
        replayed,
        unknown,
        fresh,
        answered_lost,
    } = r;
    eprintln!(
        "{} keys: {forwarded_before} forwarded before the kill; on retry {replayed} replayed, \
         {unknown} unknown ({answered_lost} of them answered before the kill), {fresh} \
         forwarded for the first time",
        sent.len()
    );
    assert_eq!(upstream.count(), forwarded_before + fresh);
    if !answer_before_commit {
        assert_eq!(
            answered_lost, 0,
            "an answer given after its commit was lost"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_on_sqlite_no_key_is_forwarded_twice() {
    killed_under_load("[store]\n", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_on_sqlite_answers_after_commit_all_replay() {
    killed_under_load("[store]\n", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_on_postgres_no_key_is_forwarded_twice() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    killed_under_load(&pg.store_toml(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_on_postgres_answers_after_commit_all_replay() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    killed_under_load(&pg.store_toml(), false).await;
}

/// On PostgreSQL an answered caller's outcome commits without waiting for its own WAL flush
/// (`Keys::finish` with `When::Answered`); the reservation before the forward still waits for its flush.
/// So the database crashing right after a burst of answered first writes may lose outcomes,
/// never reservations: with the proxy's memory gone too, each retry replays its answer or
/// gets `409 outcome_unknown`, and nothing reaches the upstream twice. The WAL writer is
/// paused through the burst, so only synchronous commits put WAL on disk: a reservation
/// committed as lazily as an outcome is lost in the crash, and its retry forwarded (checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_crash_after_answers_loses_no_reservation() {
    database_crash_after_answers(false).await;
}

/// The same on a server whose own configuration commits lazily (`synchronous_commit = off`,
/// as a server, role, database or URL may say): the proxy's reserving sessions set it back
/// on, so no reservation is lost (fails when they inherit the server's: checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_crash_on_a_lazily_committing_server_loses_no_reservation() {
    database_crash_after_answers(true).await;
}

async fn database_crash_after_answers(lazy_server: bool) {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    if !pg.owned() {
        return; // a shared server (IDEMPROXY_TEST_PG_URL) is not ours to crash
    }
    if lazy_server {
        pg.configure("synchronous_commit", "off").await;
    }
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let toml = format!(
        "{}\n{}lease = \"1s\"\n",
        api_config(&upstream, "", "timeout = \"2s\"", CHARGES_ROUTE),
        pg.store_toml()
    );
    let cfg = dir.write_config(&toml);
    let mut process = ProxyProcess::spawn(&cfg).await;
    let url = process.url("/api/v1/charges");
    let wal_writer = pg.pause_wal_writer().await;
    // Concurrent callers, so outcomes commit while other reservations wait for their flush.
    let callers: Vec<_> = (0..8)
        .map(|n| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut answered: Sent = Vec::new();
                for i in 0..6 {
                    let key = format!("db-crash-{n}-{i}");
                    let resp = request("POST", &url, &headers(&key), body(&key)).await;
                    resp.assert_status(200);
                    answered.push((key, Some(resp)));
                }
                answered
            })
        })
        .collect();
    let mut answered: Sent = Vec::new();
    for c in callers {
        answered.extend(c.await.expect("caller"));
    }
    assert_eq!(upstream.count(), answered.len());
    pg.crash_via(wal_writer).await;
    process.kill().await;

    let restarted = ProxyProcess::spawn(&cfg).await;
    let r = retry_every(&restarted, &upstream, &answered).await;
    eprintln!(
        "after the database crash: {} replayed, {} outcomes lost",
        r.replayed, r.unknown
    );
    assert_eq!(
        upstream.count(),
        answered.len(),
        "a key was forwarded twice"
    );
}
