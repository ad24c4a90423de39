//! When the writer watches its queue before it blocks on it (see [`Pace`]).

use std::time::Duration;

/// What a batch ran: how many jobs, and whether any was waited on (a reservation, mostly).
#[derive(Default, Clone, Copy)]
pub(super) struct Ran {
    pub(super) jobs: usize,
    pub(super) waited_on: bool,
}

/// Whether the writer watches its queue for a while before it blocks on it.
///
/// Under light load with a fast upstream (a lone client, a few) the writer finds its queue
/// empty after nearly every batch, and the next job comes soon after: the outcome of the write
/// it just reserved, or the client's next request. Blocking and being woken for it costs more
/// than the wait itself on a virtual machine (a futex wake-up, a context switch, the vCPU's
/// halt and its interrupt): watching the queue for up to [`SPIN`] first cut a lone client's
/// p50 from 0.29–0.37 ms to 0.23–0.24 ms (docs/design-notes.md, "The SQLite writer"). It is done
/// only when it pays:
/// - **light load**: batches of [`LIGHT`] jobs or fewer on average. Under load the batches grow
///   and the writer blocks at once, leaving the cores to the threads that serve requests
///   (spinning there cost throughput);
/// - **short waits**: most recent waits ended within [`SPIN`]. There are two kinds, judged
///   apart: after outcomes alone the writer waits for the clients' next request, after a
///   reservation for the upstream's answer (its outcome). Only the first is on a client's path;
///   the second is worth spinning through only to be awake for the first. So the writer spins
///   when the clients come back quickly, and after a reservation only if the upstream answers
///   quickly too. Clients that pause between writes or a slow upstream (a real API) make the
///   writer block at once, as when idle: with a 1 ms pause between a lone client's writes,
///   spinning after reservations as well cost 24% more CPU a request and gained nothing.
///
/// What it costs at most is [`SPIN`] of one core per wait that was predicted short and was not.
pub(super) struct Pace {
    /// Jobs per batch, a moving average over about the last eight batches.
    jobs: f32,
    /// The share of recent waits (about the last eight of each kind) that ended within
    /// [`SPIN`]: after a batch with a job waited on (`[1]`), and after one without (`[0]`).
    short: [f32; 2],
    /// The kind of the last batch: the wait under way is judged and learned as that kind.
    after: usize,
    /// How long a wait is watched for, and the longest that counts as short: [`SPIN`] (tests
    /// set their own).
    spin: Duration,
}

impl Default for Pace {
    fn default() -> Pace {
        Pace {
            jobs: 0.0,
            short: [0.0; 2],
            after: 0,
            spin: SPIN,
        }
    }
}

/// How long the writer watches its queue before it blocks, when [`Pace`] says it pays.
const SPIN: Duration = Duration::from_micros(200);
/// The most jobs per batch, on average, that counts as light load.
const LIGHT: f32 = 3.0;

/// Moves `avg` an eighth of the way to `sample`: a moving average over about eight samples.
fn average(avg: &mut f32, sample: f32) {
    *avg += (sample - *avg) / 8.0;
}

impl Pace {
    /// A pace that spins from its first wait, for `spin` at most: what the writer's tests use
    /// to watch a spin under way.
    #[cfg(test)]
    pub(super) fn spinning(spin: Duration) -> Pace {
        Pace {
            short: [1.0; 2],
            spin,
            ..Pace::default()
        }
    }

    pub(super) fn record(&mut self, ran: Ran) {
        average(&mut self.jobs, ran.jobs as f32);
        self.after = usize::from(ran.waited_on);
    }

    /// The writer waited `d` for its next message.
    pub(super) fn waited(&mut self, d: Duration) {
        let short = f32::from(u8::from(d < self.spin));
        average(&mut self.short[self.after], short);
    }

    pub(super) fn spin(&self) -> Option<Duration> {
        let clients_return = self.short[0] >= 0.5;
        let light = self.jobs <= LIGHT;
        (light && clients_return && self.short[self.after] >= 0.5).then_some(self.spin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(pace: &mut Pace, waited_on: bool, then_waited: Duration) -> Option<Duration> {
        pace.record(Ran { jobs: 1, waited_on });
        let spin = pace.spin();
        pace.waited(then_waited);
        spin
    }

    /// A lone client's `rounds` writes: each reservation's outcome comes `upstream` after its
    /// batch, and the client's next reservation `client` after the outcome's.
    fn lone_client(upstream: Duration, client: Duration, rounds: usize) -> Pace {
        let mut pace = Pace::default();
        for _ in 0..rounds {
            batch(&mut pace, true, upstream);
            batch(&mut pace, false, client);
        }
        pace
    }

    const FAST: Duration = Duration::from_micros(50);

    /// A lone client against a fast upstream: both waits short, so the writer spins after
    /// every batch once it has seen a few.
    #[test]
    fn a_lone_client_with_a_fast_upstream_is_waited_for() {
        let mut pace = lone_client(FAST, FAST, 8);
        assert_eq!(batch(&mut pace, true, FAST), Some(SPIN));
        assert_eq!(batch(&mut pace, false, FAST), Some(SPIN));
    }

    /// Clients that pause between writes: the writer blocks at once, also after a reservation
    /// whose outcome comes quickly (nobody waits on the writer meanwhile).
    #[test]
    fn clients_that_pause_are_not_waited_for() {
        let pause = Duration::from_millis(5);
        let mut pace = lone_client(FAST, pause, 16);
        assert_eq!(batch(&mut pace, true, FAST), None);
        assert_eq!(batch(&mut pace, false, pause), None);
    }

    /// A slow upstream and clients that come back at once: the writer waits for the clients,
    /// not for the upstream.
    #[test]
    fn a_slow_upstream_is_not_waited_for() {
        let slow = Duration::from_millis(80);
        let mut pace = lone_client(slow, FAST, 16);
        assert_eq!(batch(&mut pace, true, slow), None);
        assert_eq!(batch(&mut pace, false, FAST), Some(SPIN));
    }

    /// Under load (large batches) the writer never spins, however short its waits.
    #[test]
    fn under_load_the_writer_blocks_at_once() {
        let mut pace = Pace::default();
        for _ in 0..32 {
            pace.record(Ran {
                jobs: 9,
                waited_on: true,
            });
            pace.waited(Duration::from_micros(10));
        }
        assert_eq!(pace.spin(), None);
    }
}
