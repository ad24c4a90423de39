//! One budget: the requests one account may send an API (an upstream and a credential scope),
//! with a fair queue in front of it. A request goes when both hold: fewer than `limit` were
//! sent in the last `per` (a log of the sends: an API that counts in fixed or sliding windows
//! never sees more than its limit in one — a token bucket alone lets twice its size through
//! across a window's edge), and the bucket of `burst` tokens, refilled at `limit / per`, has
//! one (which is also where the API's "this many left" lands).
//!
//! A request takes a token and goes at once when the bucket has one and nobody waits; else
//! it queues behind its own caller's earlier requests, and callers are served in turn (round
//! robin), so one agent's burst of sixty does not make another agent's one request wait for
//! all sixty. A dispatcher task runs while anyone waits: it sleeps until the next token (or the
//! end of a pause the API asked for) and hands tokens out.

use crate::store::Shared;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

pub use crate::config::pace::Rate;

/// How long a send counts against the window: the window and a twenty-fifth more. A send
/// reaches the API a little after its turn (its locks, its reservation), later for some than
/// for others, and one that arrives past the API's window edge counts in the next window
/// there. So at most `limit` go in any 1.04 × `per`: 96% of the limit, by design.
pub fn counted(per: Duration) -> Duration {
    per + per / 25
}

/// Tokens gained per second.
fn per_second(r: &Rate) -> f64 {
    f64::from(r.limit) / r.per.as_secs_f64().max(1e-3)
}

/// What a caller gets when it asks for a turn.
pub enum Turn {
    /// Go now.
    Now,
    /// Wait for this; it fires when a token is handed to this request (dropped: given up).
    Queued(oneshot::Receiver<()>),
    /// The wait would pass the longest allowed: about this long.
    TooLong(Duration),
}

pub struct Lane {
    state: Mutex<State>,
    /// Where the account's sends are counted with every other replica's (PostgreSQL): each
    /// send also needs a credit claimed there.
    ledger: Option<Ledger>,
}

/// An account's budget in the store several replicas share.
pub struct Ledger {
    pub store: Arc<dyn Shared>,
    pub upstream: String,
    pub scope: String,
}

struct State {
    /// As configured, and as the API's own headers said lately (the tighter holds).
    configured: Rate,
    learned: Option<Rate>,
    tokens: f64,
    refilled: Instant,
    /// When the requests of the last window were sent, oldest first.
    sent: VecDeque<Instant>,
    /// The API asked for a pause (a `429` with `Retry-After`): no token is handed out before.
    paused_until: Option<Instant>,
    /// Waiters by caller, and the callers with waiters in the order they are served.
    waiting: HashMap<u64, VecDeque<oneshot::Sender<()>>, ahash::RandomState>,
    turns: VecDeque<u64>,
    queued: usize,
    /// A dispatcher task runs.
    dispatching: bool,
    /// Shared lanes: sends claimed in the store and not yet made, good until `credits_until`
    /// (a claim counts its sends at the database's time: one made much later would not be
    /// counted where it happened).
    credits: u32,
    credits_until: Instant,
    shared: bool,
}

impl State {
    fn rate(&self) -> Rate {
        match self.learned {
            Some(l) if per_second(&l) < per_second(&self.configured) => l,
            _ => self.configured,
        }
    }

    fn refill(&mut self, now: Instant) {
        // Before the end of a pause, nothing accrues.
        if now <= self.refilled {
            return;
        }
        let rate = self.rate();
        let gained = now.saturating_duration_since(self.refilled).as_secs_f64() * per_second(&rate);
        self.tokens = (self.tokens + gained).min(f64::from(rate.burst.max(1)));
        self.refilled = now;
    }

    /// Sends in the window ending now, once older ones are dropped (see [`counted`]).
    fn in_window(&mut self, now: Instant) -> usize {
        let per = self
            .configured
            .per
            .max(self.learned.map_or(Duration::ZERO, |l| l.per));
        let per = counted(per);
        while self
            .sent
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) >= per)
        {
            self.sent.pop_front();
        }
        let window = counted(self.rate().per);
        let old = self
            .sent
            .partition_point(|&t| now.saturating_duration_since(t) >= window);
        self.sent.len() - old
    }

    /// Whether this process's own count lets one more go now.
    fn locally(&mut self, now: Instant) -> bool {
        self.paused(now).is_none()
            && self.tokens >= 1.0
            && self.in_window(now) < self.rate().limit as usize
    }

    /// Whether one more may go now: by this process's count, and on a shared lane by a
    /// credit claimed in the store.
    fn may_go(&mut self, now: Instant) -> bool {
        self.locally(now) && (!self.shared || (self.credits > 0 && now < self.credits_until))
    }

    fn spend(&mut self, now: Instant) {
        self.tokens -= 1.0;
        self.sent.push_back(now);
        self.credits = self.credits.saturating_sub(1);
    }

    fn paused(&self, now: Instant) -> Option<Duration> {
        self.paused_until
            .filter(|&until| until > now)
            .map(|until| until - now)
    }

    /// About how long until `n` more may go: the pause first, then the later of the bucket's
    /// refill and the window's making room.
    fn time_for(&mut self, n: usize, now: Instant) -> Duration {
        let rate = self.rate();
        let short = (n as f64 - self.tokens).max(0.0);
        let refill = Duration::from_secs_f64(short / per_second(&rate));
        let in_window = self.in_window(now);
        let limit = rate.limit.max(1) as usize;
        let room = match (in_window + n).checked_sub(limit + 1) {
            None => Duration::ZERO,
            Some(j) => {
                // The j-th send from the window's start must age out; past the log, whole
                // windows more.
                let first = self.sent.len() - in_window;
                let (k, windows) = (j % limit, (j / limit) as u32);
                let at = self.sent.get(first + k).copied().unwrap_or(now);
                let window = counted(rate.per);
                (at + window).saturating_duration_since(now) + window * windows
            }
        };
        self.paused(now).unwrap_or_default() + refill.max(room)
    }

    /// The next waiter in turn, its caller moved to the back of the line.
    fn next_waiter(&mut self) -> Option<oneshot::Sender<()>> {
        while let Some(caller) = self.turns.pop_front() {
            let Some(queue) = self.waiting.get_mut(&caller) else {
                continue;
            };
            let Some(tx) = queue.pop_front() else {
                self.waiting.remove(&caller);
                continue;
            };
            self.queued -= 1;
            if queue.is_empty() {
                self.waiting.remove(&caller);
            } else {
                self.turns.push_back(caller);
            }
            return Some(tx);
        }
        None
    }
}

impl Lane {
    pub fn new(rate: Rate, ledger: Option<Ledger>) -> Arc<Lane> {
        let now = Instant::now();
        let shared = ledger.is_some();
        Arc::new(Lane {
            ledger,
            state: Mutex::new(State {
                configured: rate,
                learned: None,
                tokens: f64::from(rate.burst.max(1)),
                refilled: Instant::now(),
                sent: VecDeque::new(),
                paused_until: None,
                waiting: HashMap::default(),
                turns: VecDeque::new(),
                queued: 0,
                dispatching: false,
                credits: 0,
                credits_until: now,
                shared,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A turn for one request of `caller`, waiting at most `max_wait` for it.
    pub fn ask(self: &Arc<Self>, caller: u64, max_wait: Duration) -> Turn {
        let now = Instant::now();
        let mut s = self.state();
        s.refill(now);
        if s.queued == 0 && s.may_go(now) {
            s.spend(now);
            return Turn::Now;
        }
        // Served in turn, a request waits for at most everyone queued before it.
        let queued = s.queued;
        let wait = s.time_for(queued + 1, now);
        if wait > max_wait {
            return Turn::TooLong(wait);
        }
        let (tx, rx) = oneshot::channel();
        let st = &mut *s;
        let queue = st.waiting.entry(caller).or_default();
        if queue.is_empty() {
            st.turns.push_back(caller);
        }
        queue.push_back(tx);
        st.queued += 1;
        if !s.dispatching {
            s.dispatching = true;
            tokio::spawn(self.clone().dispatch());
        }
        Turn::Queued(rx)
    }

    /// Hands tokens to waiters as they come, until nobody waits; on a shared lane, claims
    /// credits in the store for the waiters when this process's count would let them go.
    async fn dispatch(self: Arc<Self>) {
        loop {
            let (claim, next) = {
                let now = Instant::now();
                let mut s = self.state();
                s.refill(now);
                while s.may_go(now) {
                    let Some(tx) = s.next_waiter() else { break };
                    // A waiter that gave up (its caller hung up, its wait ran out) takes none.
                    if tx.send(()).is_ok() {
                        s.spend(now);
                    }
                }
                if s.queued == 0 {
                    s.dispatching = false;
                    return;
                }
                let rate = s.rate();
                let want = (s.queued as u32)
                    .max(rate.limit / 20)
                    .clamp(1, rate.limit.max(1));
                let claim = (s.shared && s.locally(now)).then_some((want, rate));
                (claim, s.time_for(1, now).max(Duration::from_millis(1)))
            };
            let next = match (claim, &self.ledger) {
                (Some((want, rate)), Some(ledger)) => self.claim(ledger, want, rate).await,
                _ => next,
            };
            if !next.is_zero() {
                tokio::time::sleep(next).await;
            }
        }
    }

    /// Claims up to `want` sends in the shared store; how long to sleep before trying again
    /// (zero: credits came). When the store fails, this process's own count decides: the
    /// waiters go by it rather than wait for a store that may not come back.
    async fn claim(&self, ledger: &Ledger, want: u32, rate: Rate) -> Duration {
        let window = counted(rate.per);
        let claimed = ledger
            .store
            .claim_sends(crate::store::SendClaim {
                upstream: &ledger.upstream,
                scope: &ledger.scope,
                want,
                limit: rate.limit,
                window,
            })
            .await;
        let now = Instant::now();
        let good_for = (counted(rate.per) - rate.per).max(Duration::from_millis(10));
        let mut s = self.state();
        let (granted, wait) = match claimed {
            Ok(got) => got,
            Err(e) => {
                tracing::warn!(upstream = %ledger.upstream, error = %e, "cannot claim rate-limit credits in the store; pacing by this process's count alone");
                (want, Duration::ZERO)
            }
        };
        s.credits = granted;
        s.credits_until = now + good_for;
        match granted {
            0 => wait.max(Duration::from_millis(5)),
            _ => Duration::ZERO,
        }
    }
    /// The API said how many requests are left in its window: no more go before it refills.
    pub fn remaining(&self, left: u32) {
        let mut s = self.state();
        s.refill(Instant::now());
        s.tokens = s.tokens.min(f64::from(left));
    }

    /// The API said its limit: kept when tighter than the configured one.
    pub fn learn(&self, rate: Rate) {
        let mut s = self.state();
        s.refill(Instant::now());
        s.learned = Some(rate);
        s.tokens = s.tokens.min(f64::from(rate.burst.max(1)));
    }

    /// The API refused for its rate limit (a `429`): nothing goes for `pause`, and the bucket
    /// starts empty after it.
    pub fn pause(&self, pause: Duration) {
        let mut s = self.state();
        let until = Instant::now() + pause;
        s.paused_until = Some(s.paused_until.map_or(until, |p| p.max(until)));
        s.tokens = 0.0;
        s.refilled = until;
    }

    /// Requests waiting, and whether the lane is paused now.
    pub fn load(&self) -> (usize, bool) {
        let s = self.state();
        (s.queued, s.paused(Instant::now()).is_some())
    }

    /// The configured rate changed (a reload): the new one holds from now.
    pub fn reconfigure(&self, rate: Rate) {
        let mut s = self.state();
        if s.configured != rate {
            s.refill(Instant::now());
            s.configured = rate;
        }
    }
}
