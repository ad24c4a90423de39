//! Reconciling an unknown outcome with the real system (SPEC "Reconciling unknown outcomes").
//!
//! A write that was sent but got no answer may or may not have happened. A route with
//! `reconcile` asks: still holding the entity locks (so nothing else writes the entity
//! meanwhile), it waits `after`, sends the reconcile read with the caller's credentials, and
//! returns a [`Verdict`] — found (the read's answer, marked reconciled), not found, or cannot
//! tell — for its callers to act on: step 7 right after the forward lost its answer
//! (`store::after_unknown`), and a retry that met an unknown key before its forward
//! (`reserve::before_retry`), at most once per `after` for one key. A leaf of the pipeline: it
//! decides, it stores nothing.

use super::forward::renewing;
use super::{side_read, Ctx};
use crate::config::{Mode, Reconcile};
use crate::error::ProxyError;
use crate::rules::template::STAMP_MARK;
use crate::store::{now_ms, KeyRecord, KeyState, StoredResponse, RECONCILED};
use http::Method;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What the reconcile read said, for its caller to act on.
pub(super) enum Verdict {
    /// The write happened: the read's answer, marked reconciled.
    Found(Arc<StoredResponse>),
    /// It did not.
    NotFound,
    /// Cannot tell (another status, no answer): why.
    Failed(String),
}

impl Verdict {
    fn result(&self) -> &'static str {
        match self {
            Verdict::Found(_) => "found",
            Verdict::NotFound => "not_found",
            Verdict::Failed(_) => "failed",
        }
    }
}

/// Whether an unknown outcome of this request is reconciled (enforce mode only: observe mode
/// never delays a request).
pub(super) fn applies(ctx: &Ctx) -> bool {
    ctx.route.mode == Mode::Enforce
        && ctx.route.reconcile.is_some()
        && ctx.prepared.reconcile.is_some()
}

/// Whether a retry that meets this record reconciles it first — an unknown outcome (or an
/// abandoned in-flight record) on a route with `reconcile`, when the upstream cannot dedupe a
/// re-forward itself — and how long to wait before the read. `Err` when the key changed less
/// than `after` ago (its last reconcile could not tell): at most one read per `after`.
pub(super) fn on_retry(ctx: &Ctx, rec: &KeyRecord) -> Result<Option<Duration>, ProxyError> {
    let (Some(rc), true) = (&ctx.route.reconcile, applies(ctx)) else {
        return Ok(None);
    };
    if ctx.resends_unknown() {
        return Ok(None);
    }
    match due(rec, rc.after, ctx.upstream.timeout, now_ms()) {
        Due::Wait(wait) => Ok(Some(wait)),
        Due::TooSoon(left) => Err(unknown(
            "the last reconcile read of this key could not tell either; it is asked again at most once per `after`",
        )
        .retry_after(left)),
    }
}

/// When a retry's reconcile read may go.
#[derive(Debug, PartialEq)]
enum Due {
    /// After this wait (zero: now).
    Wait(Duration),
    /// Not yet: the key changed (a reconcile failed) less than `after` ago.
    TooSoon(Duration),
}

/// An unknown record waits `after` from its last change (the forward's end, or the last
/// reconcile that could not tell). An abandoned in-flight record is waited out by the retry
/// itself, until `after` past the later of its lease's end and the latest its owner's call
/// could still be running (reserved at `updated_at`, cut off at the timeout it was sent under,
/// stored with it; `timeout`, this replica's, only for records written before that was kept):
/// an owner cut off from the store, not dead, may still be sending the write, and a reload or
/// another replica's configuration may have made this replica's timeout shorter.
fn due(rec: &KeyRecord, after: Duration, timeout: Duration, now: i64) -> Due {
    let after = after.as_millis() as i64;
    let left = |from: i64| {
        Duration::from_millis(from.saturating_add(after).saturating_sub(now).max(0) as u64)
    };
    match rec.state {
        KeyState::Unknown if !left(rec.updated_at).is_zero() => Due::TooSoon(left(rec.updated_at)),
        KeyState::InFlight => {
            let ran_under = rec.call_ms.unwrap_or(timeout.as_millis() as i64);
            let call_end = rec.updated_at.saturating_add(ran_under);
            Due::Wait(left(rec.lease_until.max(call_end)))
        }
        _ => Due::Wait(Duration::ZERO),
    }
}

/// Waits, sends the read, judges the answer (and reads the answer, with `answer_path`);
/// audited and counted.
pub(super) async fn ask(ctx: &Ctx, wait: Duration) -> Verdict {
    let (Some(rc), Some(read)) = (&ctx.route.reconcile, &ctx.prepared.reconcile) else {
        return Verdict::Failed("the route has no reconcile".into());
    };
    let started = Instant::now();
    // `{stamp}` is known once the key is ours: this action's stamp.
    let stamp = ctx.prepared.stamped.then(|| ctx.stamp());
    let stamped = |text: &str| match &stamp {
        Some(s) if text.contains(STAMP_MARK) => text.replace(STAMP_MARK, s),
        _ => text.to_owned(),
    };
    let path = stamped(&read.path);
    let expect: Vec<Value> = read
        .expect
        .iter()
        .map(|v| match v {
            Value::String(s) => Value::String(stamped(s)),
            other => other.clone(),
        })
        .collect();
    let send = |method: Method, path: String| async move {
        let headers = &ctx.outgoing.headers;
        side_read::read(&ctx.client, &method, &path, headers, "reconcile").await
    };
    let work = async {
        tokio::time::sleep(wait).await;
        let first = match send(rc.method.clone(), path.clone()).await {
            Ok(first) => first,
            Err(e) => return (None, Verdict::Failed(e.message)),
        };
        let status = Some(first.status);
        let found = match judge(rc, &expect, first) {
            Judged::Found(found) => found,
            Judged::NotFound => return (status, Verdict::NotFound),
            Judged::Failed(why) => return (status, Verdict::Failed(why)),
        };
        let Some(answer_path) = &read.answer_path else {
            let verdict = answer(rc, found).map_or(Verdict::NotFound, Verdict::Found);
            return (status, verdict);
        };
        // The write happened; what cannot be read now leaves the key unknown, to ask again.
        // A GET whatever the first read was: a HEAD answers with no body.
        let verdict = match send(Method::GET, stamped(answer_path)).await {
            Ok(a) if (200..300).contains(&a.status) => match answer(rc, a) {
                Some(a) => Verdict::Found(a),
                None => Verdict::Failed(format!("the write was found; its answer read {answer_path} lacks a field `answer` names")),
            },
            Ok(a) => Verdict::Failed(format!("the write was found; its answer read {answer_path} was answered {}", a.status)),
            Err(e) => Verdict::Failed(format!("the write was found; {}", e.message)),
        };
        (status, verdict)
    };
    let (status, verdict) = renewing(ctx, work).await;
    let took = started.elapsed().saturating_sub(wait);
    ctx.state
        .stats
        .on_reconcile(&ctx.route.name, verdict.result());
    let decision = match verdict {
        Verdict::Found(_) => "reconciled_found",
        Verdict::NotFound => "reconciled_not_found",
        Verdict::Failed(_) => "reconcile_failed",
    };
    ctx.record_read(decision, status, took);
    tracing::info!(key = %ctx.prepared.id.key, route = %ctx.route.name, path = %path, ?status, result = verdict.result(), "reconciled an unknown outcome");
    verdict
}

/// What the reconcile read says on its own.
enum Judged {
    Found(StoredResponse),
    NotFound,
    Failed(String),
}

/// SPEC's table: a `found` status whose expectations do not all hold counts as `not_found`.
fn judge(rc: &Reconcile, expect: &[Value], answer: StoredResponse) -> Judged {
    if rc.found.contains(&answer.status) {
        let fields = rc.expect.iter().map(|(f, _)| f);
        return match side_read::holds(&answer.body, fields.zip(expect)).0 {
            true => Judged::Found(answer),
            false => Judged::NotFound,
        };
    }
    if rc.not_found.contains(&answer.status) {
        return Judged::NotFound;
    }
    Judged::Failed(format!("it was answered {}", answer.status))
}

/// A found write's answer: shaped by `answer` (`None` when the read lacks a field the shape
/// names), with `answer_status`, marked reconciled.
fn answer(rc: &Reconcile, mut answer: StoredResponse) -> Option<Arc<StoredResponse>> {
    if let Some(shape) = &rc.answer {
        let body = serde_json::from_slice(&answer.body).ok();
        let body = body.and_then(|b| crate::rules::shape::fill(shape, &b))?;
        answer.body = bytes::Bytes::from(body.to_string());
        answer
            .headers
            .retain(|(n, _)| !n.eq_ignore_ascii_case("content-length"));
    }
    answer.status = rc.answer_status.unwrap_or(answer.status);
    answer
        .headers
        .push((RECONCILED.into(), bytes::Bytes::from_static(b"1")));
    Some(Arc::new(answer))
}

pub(super) fn unknown(why: &str) -> ProxyError {
    super::refusals::outcome_unknown(Some(why))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: KeyState, updated_at: i64, lease_until: i64) -> KeyRecord {
        KeyRecord {
            id: Default::default(),
            fingerprint: String::new(),
            route: String::new(),
            entities: Vec::new(),
            state,
            owner: None,
            lease_until,
            epoch: 1,
            attempts: 1,
            response: None,
            enc_key: None,
            created_at: 0,
            updated_at,
            expires_at: None,
            call_ms: None,
        }
    }

    #[test]
    fn a_retry_reads_at_most_once_per_after() {
        let after = Duration::from_secs(2);
        // Unknown for 5 s: read now.
        let old = record(KeyState::Unknown, 1_000, 0);
        let t = Duration::from_secs(1);
        assert_eq!(due(&old, after, t, 6_000), Due::Wait(Duration::ZERO));
        // A reconcile failed 500 ms ago: refused, retry in 1.5 s.
        let fresh = record(KeyState::Unknown, 5_500, 0);
        assert_eq!(
            due(&fresh, after, t, 6_000),
            Due::TooSoon(Duration::from_millis(1_500))
        );
        // An owner died; its lease ran out 500 ms ago: wait the rest of `after`, then read.
        let abandoned = record(KeyState::InFlight, 0, 5_500);
        assert_eq!(
            due(&abandoned, after, t, 6_000),
            Due::Wait(Duration::from_millis(1_500))
        );
        // Its call may run until reserved + timeout (10 s): wait for that, and `after`.
        let slow = Duration::from_secs(10);
        assert_eq!(
            due(&abandoned, after, slow, 6_000),
            Due::Wait(Duration::from_millis(6_000))
        );
        // The call was sent under a 20 s timeout, this replica's is 1 s: wait by the 20 s.
        let mut longer = record(KeyState::InFlight, 0, 5_500);
        longer.call_ms = Some(20_000);
        assert_eq!(
            due(&longer, after, t, 6_000),
            Due::Wait(Duration::from_millis(16_000))
        );
        // `after = 0`: every retry reads.
        assert_eq!(
            due(&fresh, Duration::ZERO, t, 6_000),
            Due::Wait(Duration::ZERO)
        );
    }
}
