//! Audit rows held before they are written, each key's run of alike outcomes folded into one.
//!
//! A run of one key's requests that ended alike (same route, entities, fingerprint, decision
//! and upstream status, with no other outcome of that key between them) is one row that counts
//! them: `requests`, at the first one's time, with the slowest one's durations and the latest
//! expiry. A row is held for [`HOLD`] after it was first heard, so a key replayed again within
//! that time adds to it instead of writing a row of its own. A key's forward is not held: it
//! happens once a key, so nothing folds into it, and holding the forward row of every first
//! write (16k a second at 64 connections) cost first writes 3.5% more CPU.
//!
//! Why hold: each audit row lands on a random page of the trail's by-key index, about 10 µs of
//! the store's one writer on two cores. Replays of keys drawn from ten thousand stored, at
//! 60k req/s, were 60k rows a second: more than the writer could take beside the requests, so
//! rows were dropped (72k in 13 s) and the writer's audit batches, milliseconds of CPU each,
//! made the replays' p99 ten times their p90. Folded over [`HOLD`], those keys write at most
//! one row each a second. A row that waits longer is lost if the process is killed (not
//! stopped) in that time; a stopped process writes what it holds first.

use crate::store::AuditRow;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How long a row waits for more of its key's alike requests before it is written.
pub const HOLD: Duration = Duration::from_secs(1);

/// The decision of a key's forward, whose row is not held.
const FORWARDED: &str = "forwarded";

/// The most rows held: past this the oldest are written early, so memory stays bounded (about
/// 0.5 KiB a row) whatever the number of keys.
pub const CAP: usize = 16_384;

/// Rows in arrival order (of each one's first request) with the time each falls due, and each
/// key's latest among them. Rows are written in that order, so a row not held still waits for
/// the rows ahead of it.
#[derive(Default)]
pub struct Pending {
    rows: VecDeque<(Instant, AuditRow)>,
    /// The sequence number of `rows[0]`; a row's is its place since the first row ever held.
    base: u64,
    /// Each (upstream, route, key)'s latest row by sequence number, under a hash checked on use.
    latest: HashMap<u64, u64>,
    hasher: ahash::RandomState,
}

impl Pending {
    /// Adds `row`, heard at `now`: folded into its key's latest held row if they tell the same
    /// story, else held as a row of its own after every other.
    pub fn push(&mut self, row: AuditRow, now: Instant) {
        let h = self.hash(&row);
        if let Some(prev) = self.held(h).map(|i| &mut self.rows[i].1) {
            let same_key =
                (&prev.upstream, &prev.route, &prev.key) == (&row.upstream, &row.route, &row.key);
            if same_key && alike(prev, &row) {
                prev.requests += row.requests;
                prev.total_ms = prev.total_ms.max(row.total_ms);
                prev.lock_wait_ms = prev.lock_wait_ms.max(row.lock_wait_ms);
                prev.upstream_ms = prev.upstream_ms.max(row.upstream_ms);
                prev.expires_at = prev.expires_at.max(row.expires_at);
                return;
            }
        }
        let seq = self.base + self.rows.len() as u64;
        self.latest.insert(h, seq);
        let due = if row.decision == FORWARDED {
            now
        } else {
            now + hold_for(&row)
        };
        self.rows.push_back((due, row));
    }

    /// When the oldest held row falls due.
    pub fn next_due(&self) -> Option<Instant> {
        self.rows.front().map(|(due, _)| *due)
    }

    /// Up to `max` rows, oldest first, while they are due by `now` or beyond [`CAP`]; with
    /// `all`, every row.
    pub fn take(&mut self, now: Instant, all: bool, max: usize) -> Vec<AuditRow> {
        let mut out = Vec::new();
        while out.len() < max {
            let due = match self.rows.front() {
                Some((due, _)) => all || self.rows.len() > CAP || *due <= now,
                None => false,
            };
            if !due {
                break;
            }
            let Some((_, row)) = self.rows.pop_front() else {
                break;
            };
            let h = self.hash(&row);
            if self.latest.get(&h) == Some(&self.base) {
                self.latest.remove(&h);
            }
            self.base += 1;
            out.push(row);
        }
        out
    }

    /// The index in `rows` of the row `h` names, if it is still held.
    fn held(&self, h: u64) -> Option<usize> {
        let seq = *self.latest.get(&h)?;
        seq.checked_sub(self.base)
            .map(|i| i as usize)
            .filter(|&i| i < self.rows.len())
    }

    fn hash(&self, row: &AuditRow) -> u64 {
        self.hasher.hash_one((&row.upstream, &row.route, &row.key))
    }
}

/// [`HOLD`], or a quarter of the row's life if that is shorter (a retention of seconds): a row
/// must be readable for most of its life, not written as it expires.
fn hold_for(row: &AuditRow) -> Duration {
    let life = u64::try_from(row.expires_at.saturating_sub(row.at)).unwrap_or(0);
    HOLD.min(Duration::from_millis(life / 4))
}

/// Two rows of one key that tell the same story but for their times.
fn alike(a: &AuditRow, b: &AuditRow) -> bool {
    a.decision == b.decision
        && a.fingerprint == b.fingerprint
        && a.upstream_status == b.upstream_status
        && a.entities == b.entities
        && a.scope == b.scope
        && a.workflow == b.workflow
        && a.note == b.note
}

#[cfg(test)]
mod tests {
    use super::super::tests::{row, story, DAY};
    use super::*;

    /// Every row pushed at one instant, then every row taken.
    fn fold(rows: Vec<AuditRow>) -> Vec<AuditRow> {
        let (mut held, now) = (Pending::default(), Instant::now());
        rows.into_iter().for_each(|r| held.push(r, now));
        held.take(now, true, usize::MAX)
    }

    /// A storm of one key's replays, interleaved with other keys' rows, is one row that counts
    /// them, where the first one stood; the other keys' rows are untouched.
    #[test]
    fn one_keys_replays_fold_into_one_row_that_counts_them() {
        let rows = vec![
            row("a", "forwarded", 9),
            row("k", "replayed", 1),
            row("b", "forwarded", 2),
            row("k", "replayed", 7),
            row("k", "replayed", 3),
        ];
        let folded = fold(rows);
        let want = [
            ("a", "forwarded", 1),
            ("k", "replayed", 3),
            ("b", "forwarded", 1),
        ];
        let want: Vec<_> = want
            .iter()
            .map(|(k, d, n)| (k.to_string(), d.to_string(), *n))
            .collect();
        assert_eq!(story(&folded), want);
        let k = &folded[1];
        assert_eq!(
            (k.at, k.total_ms, k.expires_at),
            (1, 7, 7 + DAY),
            "first time, slowest, latest"
        );
    }

    /// Another outcome of the key between two replays ends the run (each key's rows keep
    /// their order), and rows that differ in anything but their times never merge.
    #[test]
    fn a_different_outcome_or_story_is_a_row_of_its_own() {
        let mut other_fp = row("k", "replayed", 1);
        other_fp.fingerprint = Some("other".into());
        let mut other_route = row("k", "replayed", 1);
        other_route.route = "refunds".into();
        let rows = vec![
            row("k", "replayed", 1),
            row("k", "key_reused", 1),
            row("k", "replayed", 1),
            other_fp,
            other_route,
            row("j", "replayed", 1),
        ];
        let folded = fold(rows.clone());
        assert_eq!(story(&folded), story(&rows), "nothing folds");
    }

    /// A row is held for [`HOLD`]: a replay within it adds to the row, one after it was
    /// written starts a row of its own; and no more than [`CAP`] rows are held.
    #[test]
    fn rows_are_held_for_a_while_and_never_beyond_the_cap() {
        let (mut held, t0) = (Pending::default(), Instant::now());
        held.push(row("k", "replayed", 1), t0);
        held.push(row("k", "replayed", 2), t0 + HOLD / 2);
        assert!(
            held.take(t0 + HOLD / 2, false, 100).is_empty(),
            "not due yet"
        );
        assert_eq!(held.next_due(), Some(t0 + HOLD));
        let written = held.take(t0 + HOLD, false, 100);
        assert_eq!(
            story(&written),
            story(&[AuditRow {
                requests: 2,
                ..row("k", "replayed", 2)
            }])
        );
        held.push(row("k", "replayed", 3), t0 + HOLD);
        assert_eq!(held.take(t0 + HOLD, true, 100)[0].requests, 1, "a new row");

        for n in 0..CAP + 10 {
            held.push(row(&format!("key-{n}"), "key_reused", 1), t0);
        }
        let early = held.take(t0, false, usize::MAX);
        assert_eq!(early.len(), 10, "the oldest beyond the cap");
        assert_eq!(early[0].key.as_deref(), Some("key-0"));
        assert!(held.take(t0, false, usize::MAX).is_empty());
        assert_eq!(held.take(t0, true, 5).len(), 5, "at most max a take");
    }

    /// A row whose life is shorter than four [`HOLD`]s is held a quarter of it.
    #[test]
    fn a_short_lived_row_is_held_a_quarter_of_its_life() {
        let (mut held, t0) = (Pending::default(), Instant::now());
        let short = AuditRow {
            expires_at: 1_001,
            ..row("k", "replayed", 1)
        };
        held.push(short, t0);
        assert_eq!(held.next_due(), Some(t0 + Duration::from_millis(250)));
    }

    /// A key's forward is due at once, unless rows held ahead of it are not: the order in
    /// which rows were heard is the order they are written.
    #[test]
    fn a_forward_is_not_held_but_keeps_its_place() {
        let (mut held, t0) = (Pending::default(), Instant::now());
        held.push(row("a", "forwarded", 1), t0);
        assert_eq!(
            story(&held.take(t0, false, 10)),
            story(&[row("a", "forwarded", 1)])
        );
        held.push(row("a", "replayed", 2), t0);
        held.push(row("b", "forwarded", 3), t0);
        assert!(held.take(t0, false, 10).is_empty(), "behind a held replay");
        let written = held.take(t0 + HOLD, false, 10);
        assert_eq!(
            story(&written),
            story(&[row("a", "replayed", 2), row("b", "forwarded", 3)])
        );
    }
}
