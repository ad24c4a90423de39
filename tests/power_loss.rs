//! A power cut on SQLite. A `kill -9` keeps the page cache, so it never tests `fdatasync`;
//! here every write not yet synced is lost too. The proxy runs under an `LD_PRELOAD` shim
//! (`tests/power_loss/shim.c`, built with the machine's C compiler) that records, at each
//! `fsync`/`fdatasync`, the size the file had when the sync began. Under a load of first
//! writes the proxy is killed, every file it synced is cut back to its last synced size (the
//! WAL only grows in this test: no checkpoint runs, which the test checks), the shared-memory
//! index is dropped, and the proxy restarts on what a power cut would have left. Then no key
//! whose caller got an answer, or whose request reached the upstream, is forwarded again, and
//! every answer a caller saw replays.
//!
//! A writer that acknowledges before its sync (the `skip-sync` fault of the build with fault
//! points) must fail that check: the second test shows that it does.

mod common;
use common::retries::*;
use common::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use tokio::sync::Notify;

const CALLERS: usize = 8;
/// Answers before the cut: few enough that the WAL never reaches a checkpoint.
const ANSWERS: usize = 60;
/// The WAL length past which SQLite checkpoints (1,000 frames of 4 KiB pages): a WAL never
/// this long was never restarted, so it only grew, and cutting its length undoes exactly the
/// writes a power cut loses.
const CHECKPOINT_AT: u64 = 32 + 1_000 * (4_096 + 24);

/// The shim, built into `dir`; `None` (loudly, a failure under `CI=true`) without a compiler.
fn shim(dir: &Path) -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/power_loss/shim.c");
    let out = dir.join("shim.so");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-ldl")
        .status()
        .is_ok_and(|s| s.success());
    if built {
        return Some(out);
    }
    skip_loudly("POWER-LOSS TESTS SKIPPED: no C compiler (cc) to build tests/power_loss/shim.c");
    None
}

/// Cuts every file the log names back to its last synced size, and drops SQLite's
/// shared-memory index (memory, as far as a power cut is concerned). Returns the files cut.
fn cut_power(log: &Path, db: &Path) -> Vec<(PathBuf, u64, u64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut synced: BTreeMap<PathBuf, Vec<u64>> = BTreeMap::new();
    for line in text.lines() {
        if let Some((size, path)) = line.split_once(' ') {
            let size: u64 = size.parse().expect("a size");
            synced.entry(PathBuf::from(path)).or_default().push(size);
        }
    }
    let mut cut = Vec::new();
    for (path, sizes) in &synced {
        let Ok(meta) = std::fs::metadata(path) else {
            continue;
        };
        // Only appends since the first sync: a WAL restarted by a checkpoint would rewrite
        // synced bytes in place, which cutting the length cannot undo.
        assert!(
            sizes.windows(2).all(|w| w[0] <= w[1]) && meta.len() < CHECKPOINT_AT,
            "{} may have been checkpointed ({} bytes): lower ANSWERS",
            path.display(),
            meta.len()
        );
        let last = *sizes.last().unwrap_or(&0);
        if meta.len() > last {
            let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            f.set_len(last).unwrap();
            cut.push((path.clone(), meta.len(), last));
        }
    }
    let mut shm = db.as_os_str().to_owned();
    shm.push("-shm");
    let _ = std::fs::remove_file(PathBuf::from(shm));
    cut
}

/// What a power cut left: keys forwarded twice, answered keys a retry does not replay, and
/// the files cut.
type Cut = (Vec<String>, Vec<String>, Vec<(PathBuf, u64, u64)>);

/// When the power goes: after `ANSWERS` answers, or where the process killed itself at the
/// fault point `IDEMPROXY_FAULT` names.
enum When {
    AfterAnswers,
    AtFaultPoint,
}

/// A power cut of a proxy started from `bin` with `env`, at `when`.
async fn power_cut(bin: &Path, env: &[(&str, &str)], when: When) -> Option<Cut> {
    let dir = TestDir::new();
    let shim = shim(dir.path())?;
    let upstream = RecordingUpstream::start().await;
    let db = dir.path().join("cut.db");
    let toml = format!(
        "{}\n[store]\nurl = \"sqlite://{}\"\n",
        api_config(&upstream, "", "", CHARGES_ROUTE),
        db.display()
    );
    let cfg = dir.write_config(&toml);
    let log = dir.path().join("synced.log");
    let (shim, log_s) = (shim.display().to_string(), log.display().to_string());
    let mut with_shim = vec![
        ("LD_PRELOAD", shim.as_str()),
        ("POWERLOSS_LOG", log_s.as_str()),
    ];
    with_shim.extend_from_slice(env);
    let mut process = ProxyProcess::spawn_binary(bin, &cfg, &with_shim).await;
    let url = process.url("/api/v1/charges");
    let until = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Notify::new()),
        ANSWERS,
    );
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| tokio::spawn(caller(url.clone(), format!("cut-{n}"), until.clone())))
        .collect();
    match when {
        When::AtFaultPoint => drop(process.wait().await),
        When::AfterAnswers => {
            until.1.notified().await;
            process.kill().await;
        }
    }
    let mut sent: Sent = Vec::new();
    for c in callers {
        sent.extend(c.await.expect("caller"));
    }
    let cut = cut_power(&log, &db);
    eprintln!("power cut: {cut:?}");
    let restarted = ProxyProcess::spawn(&cfg).await;
    let mut twice = Vec::new();
    let mut lost = Vec::new();
    for (key, first, retry, posts) in retry_all(&restarted, &upstream, &sent).await {
        if posts > 1 {
            twice.push(key.to_owned());
        }
        let replays =
            retry.replayed() == Some(true) && first.as_ref().is_some_and(|f| f.body == retry.body);
        if first.is_some() && !replays {
            lost.push(key.to_owned());
        }
    }
    eprintln!(
        "{} keys, {} forwarded twice, {} answers lost",
        sent.len(),
        twice.len(),
        lost.len()
    );
    Some((twice, lost, cut))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_forwards_nothing_twice_and_loses_no_answer() {
    let bin = Path::new(env!("CARGO_BIN_EXE_idemproxy"));
    let Some((twice, lost, _)) = power_cut(bin, &[], When::AfterAnswers).await else {
        return;
    };
    assert!(twice.is_empty(), "forwarded twice: {twice:?}");
    assert!(lost.is_empty(), "answers a caller saw, lost: {lost:?}");
}

/// The same, the power cut at the worst moment: a batch committed, its sync not yet made (the
/// `before-sync` fault point), so the cut always takes something.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_before_a_sync_forwards_nothing_twice_and_loses_no_answer() {
    let Some(bin) = faults_binary() else {
        return;
    };
    let Some((twice, lost, cut)) = power_cut(
        &bin,
        &[("IDEMPROXY_FAULT", "before-sync:60")],
        When::AtFaultPoint,
    )
    .await
    else {
        return;
    };
    assert!(!cut.is_empty(), "the cut took nothing");
    assert!(twice.is_empty(), "forwarded twice: {twice:?}");
    assert!(lost.is_empty(), "answers a caller saw, lost: {lost:?}");
}

/// The check above catches a writer that acknowledges before its sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_catches_a_writer_that_acknowledges_before_its_sync() {
    let Some(bin) = faults_binary() else {
        return;
    };
    // Not a kill: the proxy runs on, and the test cuts the power after `ANSWERS` answers.
    let Some((twice, lost, _)) = power_cut(
        &bin,
        &[("IDEMPROXY_FAULT", "skip-sync")],
        When::AfterAnswers,
    )
    .await
    else {
        return;
    };
    assert!(
        !twice.is_empty() && !lost.is_empty(),
        "an unsynced writer went unnoticed: twice {twice:?}, lost {lost:?}"
    );
}
