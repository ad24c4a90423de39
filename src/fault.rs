//! Named fault points: places where the process can be killed (`SIGKILL`, as `kill -9` would)
//! at the exact moment a durability promise is tested — after a reservation is durable and
//! before the forward, after the upstream answered and before the outcome is durable, in the
//! middle of a write batch, before and after the WAL's `fdatasync`.
//!
//! Compiled in only with the `faults` cargo feature, which no release build enables: without
//! it [`point`] is an empty inline function and the binary holds no trace of the mechanism
//! (`.ci/run` checks). With it, `IDEMPROXY_FAULT=<name>` arms the point named `<name>`, and
//! `IDEMPROXY_FAULT=<name>:<n>` its `n`-th hit (from 1); every other point does nothing.
//! `tests/fault_points.rs` kills the real binary at each point and checks what the upstream
//! received and what every retry gets after a restart.

/// Where the process may be killed. The names are what `IDEMPROXY_FAULT` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// A reservation is durable; nothing is sent yet.
    Reserved,
    /// The upstream answered; nothing of the outcome is stored yet.
    Answered,
    /// A SQLite write batch ran one job of several; nothing is committed.
    BatchMid,
    /// A PostgreSQL reservation batch committed its new keys; its takeovers are not yet run.
    PgBatchMid,
    /// A PostgreSQL batch of outcomes committed (one statement, so all of it); none of their
    /// callers has heard.
    PgOutcomeBatch,
    /// SQLite committed a batch; its WAL is not yet synced.
    BeforeSync,
    /// SQLite's WAL is synced; nobody has heard of it yet.
    AfterSync,
    /// Not a kill: the syncer reports the WAL synced without syncing it — the regression the
    /// power-loss test must catch (`tests/power_loss.rs`).
    SkipSync,
}

impl Point {
    pub fn name(self) -> &'static str {
        match self {
            Point::Reserved => "reserved",
            Point::Answered => "answered",
            Point::BatchMid => "batch-mid",
            Point::PgBatchMid => "pg-batch-mid",
            Point::PgOutcomeBatch => "pg-outcome-batch",
            Point::BeforeSync => "before-sync",
            Point::AfterSync => "after-sync",
            Point::SkipSync => "skip-sync",
        }
    }
}

/// Kills the process here when this point is armed (a no-op without the `faults` feature).
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn point(_: Point) {}

/// Whether this point is armed (every hit, once serving): for faults that change what the
/// process does instead of killing it. Always `false` without the `faults` feature.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn armed(_: Point) -> bool {
    false
}

/// Points fire only once the listeners are up: the writes of a start (migrations, the probe,
/// crash recovery) pass the same places, and a test means the requests' moments.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn serving() {}

#[cfg(feature = "faults")]
static SERVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Points fire only once the listeners are up (see the version without the feature).
#[cfg(feature = "faults")]
pub fn serving() {
    SERVING.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `IDEMPROXY_FAULT`, read once: the armed point's name and the hit it fires at.
#[cfg(feature = "faults")]
fn spec() -> Option<&'static (String, u64)> {
    static SPEC: std::sync::OnceLock<Option<(String, u64)>> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| {
        let spec = std::env::var("IDEMPROXY_FAULT").ok()?;
        let (name, nth) = match spec.split_once(':') {
            Some((name, n)) => (name.to_owned(), n.parse().unwrap_or(1)),
            None => (spec, 1),
        };
        Some((name, nth))
    })
    .as_ref()
}

/// Whether this point is armed (every hit, once serving).
#[cfg(feature = "faults")]
pub fn armed(p: Point) -> bool {
    SERVING.load(std::sync::atomic::Ordering::SeqCst) && spec().is_some_and(|(n, _)| n == p.name())
}

/// Kills the process here when this point is armed.
#[cfg(feature = "faults")]
pub fn point(p: Point) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static HITS: AtomicU64 = AtomicU64::new(0);
    let Some((_, nth)) = spec() else { return };
    if !armed(p) || HITS.fetch_add(1, Ordering::SeqCst) + 1 != *nth {
        return;
    }
    eprintln!("idemproxy: fault point {} reached: SIGKILL", p.name());
    // SAFETY: `kill` and `getpid` take plain integers and touch no memory of ours.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}
