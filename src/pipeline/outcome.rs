//! How a protected request ended, typed: the one value its audit row, its metrics, its answer
//! and what becomes of its key and entities (SPEC's outcome table: [`finish_of`]) are all
//! written from. Observe mode's mark — what enforce mode would have done — is made here too.

use super::Ctx;
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::store::{after_ms, now_ms, AuditRow, Effects, Finish, StoredResponse, OMITTED_BODY};
use crate::upstream::{full, Called, PrefixedBody, ProxyBody};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::Duration;

/// The key an answer is for, and whether it is a replay, on every answer (names made once,
/// not parsed per answer).
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// On an answer that is the reconcile read's (the write's own answer was lost).
pub const RECONCILED_HEADER: &str = "idemproxy-reconciled";

/// On a replay of an answer an operator set by hand (see `crate::settle`).
pub const SET_BY_HEADER: &str = "idemproxy-set-by";

/// On an observe-mode answer: what enforce mode would have done (see `super::observe`).
pub const OBSERVED_HEADER: &str = "idemproxy-observed";

/// How a protected request ended.
pub enum Outcome {
    /// A stored answer, replayed (audit decision `replayed`).
    Replayed(Arc<StoredResponse>),
    /// The upstream's answer, stored (`forwarded`) or, for a `release_statuses` status, not
    /// stored so a retry is forwarded again (`released`).
    Answered { answer: Answer, released: bool },
    /// Never sent: the key is released (`upstream_unreachable`).
    NotSent(ProxyError),
    /// Sent, no complete answer: the outcome is unknown (`unknown`).
    Unknown(ProxyError),
    /// Sent, no complete answer, but the reconcile read found the write: its answer, stored
    /// (the forward's decision is still `unknown`; the reconcile has its own audit row).
    Reconciled(Arc<StoredResponse>),
    /// Refused by the proxy before anything was sent (the error type).
    Refused(ProxyError),
}

/// The upstream's answer for the first caller.
pub enum Answer {
    Full(Arc<StoredResponse>),
    /// Over `max_answer`: the head, and the body streamed through, never stored.
    Streamed(Arc<StoredResponse>, PrefixedBody),
}

/// A stored answer as a replay — unless its body was too large to store: then the request
/// is refused, never forwarded again.
pub(super) fn replayed(stored: Arc<StoredResponse>) -> Outcome {
    if !stored.body_omitted() {
        return Outcome::Replayed(stored);
    }
    Outcome::Refused(
        ProxyError::new(
            ErrorKind::AnswerTooLarge,
            format!(
                "the first request with this key was answered {} by the upstream, with a body over \
                 max_answer that was not stored; it is not forwarded again and cannot be replayed",
                stored.status
            ),
        )
        .details(serde_json::json!({ "upstream_status": stored.status })),
    )
}

impl Outcome {
    /// The audit row's decision (SPEC: `forwarded`, `replayed`, `released`, `unknown`, or the
    /// error type).
    pub fn decision(&self) -> &'static str {
        match self {
            Outcome::Replayed(_) => "replayed",
            Outcome::Answered { released: true, .. } => "released",
            Outcome::Answered { .. } => "forwarded",
            Outcome::Unknown(_) | Outcome::Reconciled(_) => "unknown",
            Outcome::NotSent(e) | Outcome::Refused(e) => e.kind.as_str(),
        }
    }
}

impl Ctx {
    /// Ends the request: one audit row, one metrics update, one answer.
    pub fn finish(mut self, outcome: Outcome) -> ProxyResult<Response<ProxyBody>> {
        let decision = self.decision(&outcome);
        let answer = self.answer(outcome);
        // Last: the audit row takes the request's key, fingerprint and entities (no copies).
        self.conclude(&decision);
        answer
    }

    /// What the audit row and the metrics will say (`observed:…` in observe mode).
    pub(super) fn decision(&self, outcome: &Outcome) -> std::borrow::Cow<'static, str> {
        if matches!(outcome, Outcome::Replayed(_)) {
            self.state.stats.on_replay();
        }
        match self.observation() {
            Some(observed) => observed.into(),
            None => outcome.decision().into(),
        }
    }

    /// In observe mode, the audit decision `observed:<would>`, counted in
    /// `idemproxy_observed_total`; `None` in enforce mode.
    pub(super) fn observation(&self) -> Option<String> {
        let would = self.observed?;
        self.state.stats.on_observed(&self.route.name, would);
        Some(format!("observed:{would}"))
    }

    /// In observe mode, `Idemproxy-Observed: <would>` on the caller's answer.
    pub(super) fn show_observed(&self, headers: &mut HeaderMap) {
        if let Some(would) = self.observed {
            headers.insert(OBSERVED_HEADER, HeaderValue::from_static(would));
        }
    }

    /// The caller's answer (or error) for how the request ended.
    pub(super) fn answer(&self, outcome: Outcome) -> ProxyResult<Response<ProxyBody>> {
        // Observe mode hands the upstream's answer back unchanged (but for what it observed).
        let observe = self.route.mode == crate::config::Mode::Observe;
        let key = &self.prepared.key;
        let answer = match outcome {
            Outcome::Replayed(stored) => Ok(respond(&stored, key, true)),
            Outcome::Reconciled(stored) => Ok(respond(&stored, key, false)),
            Outcome::Answered { answer, .. } => Ok(match answer {
                Answer::Full(resp) if observe => unchanged(&resp),
                Answer::Full(resp) => respond(&resp, key, false),
                Answer::Streamed(head, body) => {
                    let mut resp = match observe {
                        true => unchanged(&head),
                        false => respond(&head, key, false),
                    };
                    *resp.body_mut() = body.map_err(Into::into).boxed();
                    resp
                }
            }),
            Outcome::NotSent(e) | Outcome::Unknown(e) | Outcome::Refused(e) => {
                Err(if self.evaluated && e.key.is_none() {
                    e.with_key(key)
                } else {
                    e
                })
            }
        };
        answer.map(|mut resp| {
            self.show_observed(resp.headers_mut());
            resp
        })
    }

    /// The request is over (its answer given): its audit row and metrics.
    pub(super) fn conclude(&mut self, decision: &str) {
        self.finished = true;
        self.record(decision);
    }

    /// The audit row and the per-decision metrics.
    pub(super) fn record(&mut self, decision: &str) {
        let state = &self.state;
        state.stats.on_decision(
            &self.route.name,
            decision,
            self.lock_wait,
            self.upstream_time,
        );
        // The context ends here (finish, or drop): its strings move into the row.
        let ids = match self.evaluated {
            true => (
                Some(std::mem::take(&mut self.prepared.key)),
                Some(std::mem::take(&mut self.prepared.fingerprint)),
                std::mem::take(&mut self.prepared.entities),
            ),
            false => (None, None, Vec::new()),
        };
        let (status, upstream) = (self.upstream_status, self.upstream_time);
        let row = self.audit_row(ids, decision, status, self.started.elapsed(), upstream);
        self.state.auditor.send(row);
    }

    /// An audit row of its own for a read the proxy sent on this request's behalf (a
    /// reconcile), beside the request's row, so `keys show` tells the whole story.
    pub(super) fn record_read(&self, decision: &str, status: Option<u16>, took: Duration) {
        let ids = (
            Some(self.prepared.key.clone()),
            Some(self.prepared.fingerprint.clone()),
            self.prepared.entities.clone(),
        );
        let mut row = self.audit_row(ids, decision, status, took, Some(took));
        row.lock_wait_ms = 0;
        self.state.auditor.send(row);
    }

    /// One audit row of this request: (key, fingerprint, entities), what happened, its times.
    fn audit_row(
        &self,
        (key, fingerprint, entities): (Option<String>, Option<String>, Vec<String>),
        decision: &str,
        upstream_status: Option<u16>,
        total: Duration,
        upstream: Option<Duration>,
    ) -> AuditRow {
        let ms = |d: Duration| d.as_millis() as i64;
        AuditRow {
            at: now_ms(),
            upstream: self.upstream.name.clone(),
            route: self.route.name.clone(),
            entities,
            key,
            fingerprint,
            decision: decision.to_owned(),
            upstream_status,
            total_ms: ms(total),
            lock_wait_ms: ms(self.lock_wait),
            upstream_ms: upstream.map(ms),
            expires_at: after_ms(self.route.retention),
            requests: 1,
            scope: self.evaluated.then(|| {
                crate::store::ScopeId::of(crate::key::entity_scope(&self.prepared.id.scope))
            }),
            workflow: self.prepared.workflow.clone(),
            note: None,
        }
    }
}

/// The upstream's answer as it came (observe mode).
fn unchanged(stored: &StoredResponse) -> Response<ProxyBody> {
    let mut resp = Response::new(full(stored.body.clone()));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    // Room for the stored headers and the two `respond` adds: the map never grows.
    *resp.headers_mut() = HeaderMap::with_capacity(stored.headers.len() + 2);
    let h: &mut HeaderMap = resp.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            h.append(n, v);
        }
    }
    resp
}

/// A stored (or just received) answer, with the idempotency headers.
pub(super) fn respond(stored: &StoredResponse, key: &str, replayed: bool) -> Response<ProxyBody> {
    let mut resp = unchanged(stored);
    let h: &mut HeaderMap = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(key) {
        h.insert(IDEMPOTENCY_KEY, v);
    }
    // An upstream that replayed on its own (Stripe, after a re-forward with the same key)
    // said so: that stays true.
    let upstream_replayed = h
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    let replayed = replayed || upstream_replayed;
    h.insert(
        IDEMPOTENT_REPLAYED,
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    if stored.reconciled() {
        h.insert(RECONCILED_HEADER, HeaderValue::from_static("true"));
    }
    if stored.set_by_operator() {
        h.insert(SET_BY_HEADER, HeaderValue::from_static("operator"));
    }
    resp
}

/// What the forward's ending means for the request (nothing stored yet).
pub(super) fn outcome_of(ctx: &mut Ctx, called: Called) -> Outcome {
    let released = |status: u16| ctx.upstream.release_statuses.contains(&status);
    match called {
        Called::Answer(resp) => {
            let released = released(resp.status);
            ctx.upstream_status = Some(resp.status);
            Outcome::Answered {
                answer: Answer::Full(Arc::new(resp)),
                released,
            }
        }
        Called::Oversize { head, body } => {
            let released = released(head.status);
            ctx.upstream_status = Some(head.status);
            Outcome::Answered {
                answer: Answer::Streamed(Arc::new(head), body),
                released,
            }
        }
        Called::NotSent(why) => Outcome::NotSent(ProxyError::new(
            ErrorKind::UpstreamUnreachable,
            format!("upstream {} unreachable: {why}", ctx.upstream.name),
        )),
        Called::Unknown(why) => Outcome::Unknown(ProxyError::new(
            ErrorKind::UpstreamTimeout,
            format!("upstream {}: {why}", ctx.upstream.name),
        )),
    }
}

/// What the key's record becomes (SPEC's outcome table): a stored answer and its entity
/// effects, a release (never sent, or a `release_statuses` status), or an unknown outcome.
pub(super) fn finish_of(ctx: &Ctx, outcome: &Outcome) -> Finish {
    let keep_cookie = ctx.upstream.store_set_cookie;
    let stored = match outcome {
        Outcome::Reconciled(stored) => stored.for_storage(keep_cookie),
        Outcome::Unknown(_) => return Finish::Unknown,
        // Nothing was sent (or a `release_statuses` answer): a retry may be forwarded.
        Outcome::Answered { released: true, .. }
        | Outcome::NotSent(_)
        | Outcome::Replayed(_)
        | Outcome::Refused(_) => return Finish::Released,
        Outcome::Answered {
            answer: Answer::Full(resp),
            ..
        } => resp.for_storage(keep_cookie),
        Outcome::Answered {
            answer: Answer::Streamed(head, _),
            ..
        } => {
            // The write happened and its status is known: the key is completed, but only its
            // head is stored, marked, so retries get `answer_too_large`, never a second forward.
            tracing::warn!(key = %ctx.prepared.id.key, status = head.status, max_answer = ctx.upstream.max_answer, "the answer is over max_answer: streamed to its caller, not stored");
            let mut stored: StoredResponse = (*head.for_storage(keep_cookie)).clone();
            stored
                .headers
                .push((OMITTED_BODY.into(), bytes::Bytes::from_static(b"1")));
            Arc::new(stored)
        }
    };
    completed(ctx, stored)
}

/// A stored answer, kept for the route's retention (or the key's window, when it was derived
/// from the intent alone), with its entity effects.
pub(super) fn completed(ctx: &Ctx, stored: Arc<StoredResponse>) -> Finish {
    let keep = ctx
        .prepared
        .window
        .map_or(ctx.route.retention, |w| w.min(ctx.route.retention));
    Finish::Completed {
        effects: effects(ctx, stored.status),
        response: stored,
        expires_at: after_ms(keep),
    }
}

/// What a successful answer does to the entities: record the version, take or release the
/// claim. Nothing for other statuses.
fn effects(ctx: &Ctx, status: u16) -> Effects {
    let route = &ctx.route;
    let fenced = ctx.prepared.version.is_some() || route.claim.is_some() || route.release_claim;
    // Nothing to record (no version, no claim): no copies of the entities, leases and owner.
    if !(200..300).contains(&status) || !fenced || ctx.prepared.entities.is_empty() {
        return Effects::default();
    }
    Effects {
        entities: ctx.prepared.entities.clone(),
        version: ctx.prepared.version,
        claim_until: route.claim.map(after_ms),
        release_claim: route.release_claim,
        leases: ctx
            .leases
            .as_ref()
            .map(|l| l.held.clone())
            .unwrap_or_default(),
        owner: ctx.state.owner.clone(),
    }
}
