//! Pacing at the API's rate limit. Every API behind this proxy limits requests per account
//! (HubSpot per private app, Zendesk per account, Stripe per key), and a fleet of agents or
//! workers sharing one credential goes over it together. This process sees every request to
//! that account, so it keeps them under the limit instead of handing `429`s to models:
//!
//! - each upstream with `pace` has a budget per credential scope (the account the API counts
//!   against: the same scope keys are kept under), a token bucket ([`lane`]);
//! - a request waits for its turn before the entity locks (it holds its key's slot, nothing
//!   else), callers served in turn; past `max_wait` it is refused `429 rate_limited` with
//!   `Retry-After`, in the API's error shape, and nothing is sent;
//! - every answer's rate-limit headers tighten the budget at once ([`learn`]); a `429` that
//!   got through anyway (another client on the account) pauses the scope for its
//!   `Retry-After`.
//!
//! Reads and writes both count, as the APIs count both. Replays never reach the API and take
//! no turn.

mod lane;
mod learn;
mod metrics;

pub use crate::config::pace::{Budget, Rate};
pub use learn::{heard, retry_after, Header, Heard};
pub use metrics::Metrics;

use crate::config::Upstream;
use crate::error::{ErrorKind, ProxyError};
use lane::{Lane, Turn};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Who a request is, to an account's fair queue: its run (`X-Workflow-Id`: an n8n execution,
/// a Temporal workflow, an agent's session), else the connection it came on.
pub fn caller(headers: &http::HeaderMap, conn: u64) -> u64 {
    const RUN: u64 = 1 << 63;
    match headers.get("x-workflow-id") {
        Some(run) => {
            let seeds = ahash::RandomState::with_seeds(1, 2, 3, 4);
            std::hash::BuildHasher::hash_one(&seeds, run.as_bytes()) | RUN
        }
        None => conn & !RUN,
    }
}

/// Most budgets kept per upstream: past it, idle ones (nobody waiting) are dropped and start
/// again full, as a new account's would.
const MOST_LANES: usize = 65_536;

/// One upstream's budgets, by scope.
type Lanes = HashMap<String, Arc<Lane>, ahash::RandomState>;

/// Every budget of this process, by upstream and scope. Kept across reloads.
#[derive(Default)]
pub struct Pacer {
    lanes: Mutex<HashMap<String, Lanes>>,
    metrics: Metrics,
    /// The store replicas share (PostgreSQL): every account's sends are counted there too.
    shared: Option<Arc<dyn crate::store::Shared>>,
}

impl Pacer {
    pub fn new(metrics: Metrics, shared: Option<Arc<dyn crate::store::Shared>>) -> Pacer {
        Pacer {
            lanes: Mutex::default(),
            metrics,
            shared,
        }
    }

    fn lane(&self, upstream: &Upstream, budget: &Budget, scope: &str) -> Arc<Lane> {
        let mut all = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let lanes = match all.get_mut(&upstream.name) {
            Some(l) => l,
            None => all.entry(upstream.name.clone()).or_default(),
        };
        if let Some(lane) = lanes.get(scope) {
            lane.reconfigure(budget.rate);
            return lane.clone();
        }
        if lanes.len() >= MOST_LANES {
            lanes.retain(|_, l| l.load().0 > 0);
        }
        let ledger = self.shared.clone().map(|store| lane::Ledger {
            store,
            upstream: upstream.name.clone(),
            scope: scope.to_owned(),
        });
        let lane = Lane::new(budget.rate, ledger);
        lanes.insert(scope.to_owned(), lane.clone());
        lane
    }

    /// Waits for this request's turn in its account's budget: `Ok` when it may go (at once,
    /// or after waiting), `Err(rate_limited)` when its turn would come after `max_wait` (then
    /// nothing is sent). An upstream without `pace` goes at once.
    pub async fn turn(
        &self,
        upstream: &Upstream,
        scope: &str,
        caller: u64,
    ) -> Result<(), ProxyError> {
        let Some(budget) = &upstream.pace else {
            return Ok(());
        };
        let lane = self.lane(upstream, budget, scope);
        let rx = match lane.ask(caller, budget.max_wait) {
            Turn::Now => return Ok(()),
            Turn::Queued(rx) => rx,
            Turn::TooLong(wait) => return Err(self.refused(upstream, budget, wait)),
        };
        let started = Instant::now();
        let _queued = self.metrics.queued(&upstream.name);
        let waited = tokio::time::timeout(budget.max_wait, rx).await;
        self.metrics.waited(&upstream.name, started.elapsed());
        match waited {
            Ok(Ok(())) => Ok(()),
            // Its turn did not come in time (the API paused the account meanwhile): what is
            // left of the queue ahead, about.
            _ => Err(self.refused(upstream, budget, budget.max_wait)),
        }
    }

    fn refused(&self, upstream: &Upstream, budget: &Budget, wait: Duration) -> ProxyError {
        self.metrics.refused(&upstream.name);
        let secs = wait.as_secs().max(1);
        ProxyError::new(
            ErrorKind::RateLimited,
            format!(
                "the API's rate limit for this account ({} requests per {:?}) is taken by the requests ahead of this one; its turn would come in about {secs} s, past the longest wait ({:?}); nothing was sent",
                budget.rate.limit, budget.rate.per, budget.max_wait
            ),
        )
        .retry_after(Duration::from_secs(secs))
    }

    /// What an answer of the API said of its limit, applied to the account's budget. `true`
    /// when it was a `429` (the request was not processed).
    pub fn heard(
        &self,
        upstream: &Upstream,
        scope: &str,
        status: u16,
        headers: Header<'_>,
    ) -> bool {
        let limited = status == 429;
        if limited {
            self.metrics.limited(&upstream.name);
        }
        let Some(budget) = &upstream.pace else {
            return limited;
        };
        let said = heard(status, headers);
        if said == Heard::default() {
            return limited;
        }
        let lane = self.lane(upstream, budget, scope);
        if let Some(rate) = said.rate {
            lane.learn(rate);
        }
        if let Some(left) = said.remaining {
            lane.remaining(left);
        }
        if let Some(pause) = said.pause {
            lane.pause(pause);
            tracing::warn!(upstream = %upstream.name, ?pause, "the API asked for a pause in its rate limit: this account's requests wait");
        }
        limited
    }

    /// Per upstream: requests waiting for their turn, and scopes paused now.
    pub fn load(&self) -> Vec<(String, usize, usize)> {
        let all = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, usize, usize)> = all
            .iter()
            .map(|(name, lanes)| {
                let (queued, paused) = lanes
                    .values()
                    .map(|l| l.load())
                    .fold((0, 0), |(q, p), (lq, lp)| (q + lq, p + usize::from(lp)));
                (name.clone(), queued, paused)
            })
            .collect();
        out.sort();
        out
    }

    /// Brings the gauges up to date (before `/metrics` is rendered).
    pub fn refresh(&self) {
        for (name, _, paused) in self.load() {
            self.metrics.paused(&name, paused);
        }
    }
}
