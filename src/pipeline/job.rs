//! Steps 6–7: the forward, detached from the client's connection so its answer is stored even
//! when the client hung up; then the outcome table, the effects, the audit row.

use super::entities::StoreLeases;
use super::{respond, store_error};
use crate::audit::Trace;
use crate::config::Route;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::locks::LockGuard;
use crate::state::AppState;
use crate::store::{after_ms, Effects, Finish, KeyRecord, Reservation, Reserved, OMITTED_BODY};
use crate::upstream::{call, Outcome, PrefixedBody};
use crate::upstream::{ProxyBody, UpstreamClient};
use http::{Request, Response};
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A forward that runs to completion even if the client hangs up.
pub(super) struct Job {
    pub(super) state: Arc<AppState>,
    pub(super) client: Arc<UpstreamClient>,
    pub(super) route: Arc<Route>,
    pub(super) id: crate::store::ScopedKey,
    pub(super) fingerprint: String,
    pub(super) epoch: i64,
    /// Recorded once the outcome is stored.
    pub(super) trace: Option<Trace>,
    /// The request's entities and version, for the effects of a 2xx answer.
    pub(super) entities: Vec<String>,
    pub(super) version: Option<i64>,
    /// Cross-replica entity leases, released right after the outcome is stored.
    pub(super) leases: StoreLeases,
    /// Held until the outcome is stored: the key slot (handed back if the key was taken)
    /// and the entity locks.
    pub(super) slot: Option<LockGuard>,
    pub(super) entity_guards: Vec<LockGuard>,
}

/// The first caller's answer.
enum Answer {
    Full(Arc<crate::store::StoredResponse>),
    /// Over `max_answer`: the head, and the body streamed through.
    Streamed(Arc<crate::store::StoredResponse>, PrefixedBody),
}

/// How a job ended.
pub(super) enum JobEnd {
    /// Forwarded (or failed to reserve): the answer for the client.
    Done(ProxyResult<Response<ProxyBody>>),
    /// Another process holds the key: the pipeline decides again, keeping its slot and trace.
    Taken {
        record: Box<KeyRecord>,
        slot: Option<LockGuard>,
        trace: Option<Trace>,
    },
}

impl Job {
    /// Step 5 (reserve durably; nothing is forwarded before this commit), then 6–7.
    pub(super) async fn run(mut self, reservation: Reservation, req: Request<ProxyBody>) -> JobEnd {
        // The entity leases must still be ours, and for a full lease from now, before anything
        // is reserved or sent: checks or waits may have taken long.
        match self.leases.still_held(self.state.config.store.lease).await {
            Ok(true) => {}
            outcome => {
                let err = match outcome {
                    Err(e) => store_error(&self.state, e),
                    _ => super::entity_busy(&self.route),
                };
                self.leases.release().await;
                if let Some(t) = self.trace.take() {
                    t.record(&self.state.auditor, err.kind.as_str());
                }
                return JobEnd::Done(Err(err));
            }
        }
        match self.state.store.reserve(reservation).await {
            Ok(Reserved::Owned { epoch }) => self.epoch = epoch,
            Ok(Reserved::Existing(record)) => {
                self.leases.release().await;
                return JobEnd::Taken {
                    record,
                    slot: self.slot,
                    trace: self.trace,
                };
            }
            Err(e) => {
                self.leases.release().await;
                let err = store_error(&self.state, e);
                if let Some(t) = self.trace.take() {
                    t.record(&self.state.auditor, err.kind.as_str());
                }
                return JobEnd::Done(Err(err));
            }
        }
        JobEnd::Done(self.forward(req).await)
    }

    /// Steps 6–7: forward, store the outcome, release the locks, record the audit row.
    async fn forward(mut self, req: Request<ProxyBody>) -> ProxyResult<Response<ProxyBody>> {
        let up = self.client.upstream.clone();
        let started = Instant::now();
        let outcome = {
            let _in_flight = self.state.stats.on_forward();
            self.call_renewing(req).await
        };
        let status = match &outcome {
            Outcome::Answer(resp) => Some(resp.status),
            Outcome::Oversize { head, .. } => Some(head.status),
            _ => None,
        };
        let decision = match &outcome {
            Outcome::Answer(resp) if up.release_statuses.contains(&resp.status) => "released",
            Outcome::Answer(_) | Outcome::Oversize { .. } => "forwarded",
            Outcome::NotSent(_) => ErrorKind::UpstreamUnreachable.as_str(),
            Outcome::Unknown(_) => "unknown",
        };
        let retention = self
            .route
            .retention
            .unwrap_or(self.state.config.store.retention);
        let mut cache = None;
        let (finish, answer) = match outcome {
            Outcome::Answer(resp) if up.release_statuses.contains(&resp.status) => {
                (Finish::Released, Ok(Answer::Full(Arc::new(resp))))
            }
            Outcome::Answer(resp) => {
                let resp = Arc::new(resp);
                let stored = resp.for_storage(up.store_set_cookie);
                let expires_at = after_ms(retention);
                cache = Some((stored.clone(), expires_at));
                (
                    Finish::Completed {
                        response: stored,
                        expires_at,
                        effects: self.effects(resp.status),
                    },
                    Ok(Answer::Full(resp)),
                )
            }
            Outcome::Oversize { head, prefix, rest } => {
                // The write happened and its status is known: the key is completed, but only
                // its head is stored, marked, so retries get `answer_too_large`, never a
                // second forward.
                let head = Arc::new(head);
                let mut stored = (*head.for_storage(up.store_set_cookie)).clone();
                stored
                    .headers
                    .push((OMITTED_BODY.into(), bytes::Bytes::from_static(b"1")));
                tracing::warn!(key = %self.id.key, status = head.status, max_answer = up.max_answer, "the answer is over max_answer: streamed to its caller, not stored");
                (
                    Finish::Completed {
                        response: Arc::new(stored),
                        expires_at: after_ms(retention),
                        effects: self.effects(head.status),
                    },
                    Ok(Answer::Streamed(head, PrefixedBody::new(prefix, rest))),
                )
            }
            Outcome::NotSent(why) => (
                Finish::Released,
                Err(ProxyError::new(
                    ErrorKind::UpstreamUnreachable,
                    format!("upstream {} unreachable: {why}", up.name),
                )),
            ),
            Outcome::Unknown(why) => (
                Finish::Unknown,
                Err(ProxyError::new(
                    ErrorKind::UpstreamTimeout,
                    format!("upstream {}: {why}", up.name),
                )),
            ),
        };
        match self.state.store.finish(&self.id, self.epoch, finish).await {
            Ok(true) => {
                // Stored: the next retry replays from memory.
                if let Some((stored, expires_at)) = cache {
                    self.state
                        .cache
                        .put(&self.id, &self.fingerprint, stored, expires_at);
                }
            }
            Ok(false) => {
                tracing::warn!(key = %self.id.key, "our reservation was taken over; the answer was not stored")
            }
            Err(e) => {
                self.state.stats.on_store_error();
                tracing::error!(key = %self.id.key, error = %e, "could not store the upstream's answer; the key will read as unknown");
            }
        }
        self.leases.release().await;
        drop((self.slot, self.entity_guards));
        if let Some(mut t) = self.trace.take() {
            t.upstream_time = Some(started.elapsed());
            t.upstream_status = status;
            t.record(&self.state.auditor, decision);
        }
        answer.map(|answer| match answer {
            Answer::Full(resp) => respond(&resp, &self.id.key, false),
            Answer::Streamed(head, body) => {
                let mut resp = respond(&head, &self.id.key, false);
                *resp.body_mut() = body.map_err(Into::into).boxed();
                resp
            }
        })
    }

    /// The upstream call, renewing our lease every third of it while it runs.
    async fn call_renewing(&self, req: Request<ProxyBody>) -> Outcome {
        let lease = self.state.config.store.lease;
        let every = (lease / 3).max(Duration::from_millis(100));
        let call = call::call(&self.client, req, self.client.upstream.timeout);
        tokio::pin!(call);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                outcome = &mut call => return outcome,
                _ = tick.tick() => {
                    self.renew(lease).await;
                }
            }
        }
    }
}

impl Job {
    /// What a successful answer does to the entities: record the version, take or release
    /// the claim. Nothing for other statuses.
    fn effects(&self, status: u16) -> Effects {
        let route = &self.route;
        if !(200..300).contains(&status) {
            return Effects::default();
        }
        Effects {
            entities: self.entities.clone(),
            version: self.version,
            claim_until: route
                .claim
                .then(|| after_ms(route.claim_ttl.unwrap_or(Duration::from_secs(86_400)))),
            release_claim: route.release_claim,
            leases: self.leases.held.clone(),
            owner: self.state.owner.clone(),
        }
    }

    /// Extends the key's lease (the entity leases renew themselves, see `StoreLeases`);
    /// failures are logged (the call goes on: it cannot be taken back).
    async fn renew(&self, lease: Duration) {
        let store = &self.state.store;
        match store.renew(&self.id, self.epoch, lease).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::error!(key = %self.id.key, "lost the key's reservation while the upstream call runs")
            }
            Err(e) => {
                self.state.stats.on_store_error();
                tracing::warn!(key = %self.id.key, error = %e, "lease renewal failed");
            }
        }
    }
}
