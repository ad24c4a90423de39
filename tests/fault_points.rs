//! The real binary killed (`SIGKILL`) at the exact moment each durability promise is tested —
//! the named fault points of `src/fault.rs`, compiled in only with the `faults` feature — then
//! restarted, and every request retried, on SQLite and PostgreSQL. For every point and every
//! key: the upstream received it at most once; an answer its caller saw replays (the default,
//! answers after the completion is durable); and what the point leaves behind is what its retry
//! gets:
//!
//! - `reserved` (reservation durable, nothing sent): `409 outcome_unknown` (the proxy cannot
//!   tell it was not sent, and never guesses), and the upstream never saw that key;
//! - `answered` (the upstream answered, nothing stored): `409 outcome_unknown`, never sent again;
//! - `batch-mid` (SQLite: one job of a batch ran, nothing committed) and `pg-batch-mid`
//!   (PostgreSQL: a batch's new keys committed, its takeovers not run): what was not committed
//!   is forwarded once on retry, what was is unknown;
//! - `pg-outcome-batch` (PostgreSQL: a batch of outcomes committed, one statement, nobody told):
//!   those keys replay although their callers never got the answers;
//! - `before-sync` and `after-sync` (SQLite: committed, the WAL not yet / just synced, nobody
//!   told): the reservations stand (a process crash keeps the page cache), so unknown — or
//!   replayed, when the key's outcome made the same sync; a power loss is another test.
//!
//! The binary with fault points is `target/idemproxy-faults`, built by `.ci/run` with
//! `cargo build --features faults` (or `IDEMPROXY_FAULTS_BIN`); without it these tests skip
//! loudly, and fail under `CI=true`.

mod common;
use common::pg::PgServer;
use common::retries::*;
use common::*;

use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use tokio::sync::Notify;

/// Concurrent callers: enough that the store batches their writes.
const CALLERS: usize = 8;

/// What the keys sent came to, after the kill at `spec` (`point:n`: its `n`-th hit, so that
/// callers were answered before it), a restart and a retry of each.
async fn killed_at(spec: &str, store: &str) -> (Retried, usize, Sent) {
    let point = spec.split(':').next().unwrap_or(spec);
    let Some(bin) = faults_binary() else {
        return (Retried::default(), 0, Vec::new());
    };
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let toml = format!(
        "{}\n{store}lease = \"1s\"\n",
        api_config(&upstream, "", "timeout = \"2s\"", CHARGES_ROUTE)
    );
    let cfg = dir.write_config(&toml);
    let mut process = ProxyProcess::spawn_binary(&bin, &cfg, &[("IDEMPROXY_FAULT", spec)]).await;
    let url = process.url("/api/v1/charges");
    // Nobody is told: the callers send until the process dies at the point.
    let until = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()), 0);
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| tokio::spawn(caller(url.clone(), format!("{point}-{n}"), until.clone())))
        .collect();
    let status = process.wait().await;
    assert_eq!(
        status.signal(),
        Some(9),
        "{point}: the process was to die by SIGKILL at the point: {status}\n{}",
        process.stderr()
    );
    assert!(process
        .stderr()
        .contains(&format!("fault point {point} reached")));
    let mut sent: Sent = Vec::new();
    let point = spec;
    for c in callers {
        sent.extend(c.await.expect("caller"));
    }
    let forwarded = upstream.count();
    let restarted = ProxyProcess::spawn(&cfg).await;
    let r = retry_every(&restarted, &upstream, &sent).await;
    let answered = sent.iter().filter(|(_, a)| a.is_some()).count();
    eprintln!(
        "{point}: {} keys sent, {answered} answered, {forwarded} forwarded before the kill; on \
         retry {} replayed, {} unknown, {} forwarded for the first time",
        sent.len(),
        r.replayed,
        r.unknown,
        r.fresh
    );
    assert_eq!(
        r.answered_lost, 0,
        "{point}: an answer a caller saw was lost"
    );
    assert_eq!(upstream.count(), forwarded + r.fresh, "{point}");
    (r, forwarded, sent)
}

async fn points(store: &str, names: &[&str]) {
    for spec in names {
        let (r, forwarded, sent) = killed_at(spec, store).await;
        if sent.is_empty() {
            return; // skipped: no binary with fault points
        }
        let point = spec.split(':').next().unwrap_or(spec);
        let answered = sent.iter().filter(|(_, a)| a.is_some()).count();
        match point {
            // Reserved and killed before sending: the key is unknown, and nothing was sent.
            "reserved" => {
                assert!(r.unknown >= 1, "{point}: no reservation stood");
                assert!(forwarded <= answered + CALLERS, "{point}");
                assert!(answered >= 1 && r.replayed >= answered, "{point}");
            }
            // Sent, answered, nothing stored: unknown, and never sent again.
            "answered" => {
                assert!(forwarded > answered && r.unknown >= 1, "{point}");
                assert!(answered >= 1 && r.replayed >= answered, "{point}");
            }
            // Nothing of the batch committed. Its jobs (two or more) are reservations — their
            // keys are forwarded on retry, once — or, when the callers' first reservations
            // were each committed alone (a loaded machine), outcomes: those keys are unknown.
            "batch-mid" => assert!(
                r.fresh >= 2 || r.unknown >= 2,
                "{point}: a batch's keys were committed"
            ),
            // A batch of outcomes committed whole, nobody told: more keys replay than were
            // answered, and none is sent again.
            "pg-outcome-batch" => assert!(r.replayed >= answered + 2, "{point}"),
            // Committed, synced or not: a process crash keeps them. Every key that reached
            // the upstream was reserved first, so each is found on retry — unknown, or replayed
            // when its outcome made the same sync (which sync the point kills at is timing).
            _ => assert!(
                r.unknown + r.replayed >= forwarded,
                "{point}: a committed reservation was lost"
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_killed_at_each_fault_point() {
    points(
        "[store]\n",
        &[
            "reserved:12",
            "answered:12",
            "batch-mid",
            "before-sync:12",
            "after-sync:12",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_at_each_fault_point() {
    let Some(pg) = PgServer::start().await else {
        return;
    };
    points(
        &pg.store_toml(),
        &[
            "reserved:12",
            "answered:12",
            "pg-batch-mid",
            "pg-outcome-batch",
        ],
    )
    .await;
}
